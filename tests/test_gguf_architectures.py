"""GGUFs of llama.cpp's qwen3moe, qwen2moe and gemma3 served through real pipelines equal mlx-lm on the same weights.

Each tiny checkpoint (``tests/architectures.py``'s configs, as llama.cpp would write them: every qwen3moe
layer routed through experts, qwen2moe's shared expert with its sigmoid gate beside them, Gemma 3's one
global layer in six) is written as a GGUF the way
``convert_hf_to_gguf.py`` writes it (``tests/llama_cpp_gguf.py``: llama.cpp's names, stacked expert
tensors, Gemma's norms stored as ``1 + weight``) in F16 or Q8_0, beside an MLX checkpoint of the values
the GGUF holds. stagemesh serves the GGUF at PP=1 and PP=2 (real engine, scheduler and relay loops) and
must give mlx-lm's greedy tokens on that checkpoint; the planner's facts must equal the bytes each
stage loads; metadata and tensors mlx-lm cannot express are refused before any stage loads.
"""

from __future__ import annotations

import importlib

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from stage_worker.checkpoint.gguf.format import needed_gguf_tensors, read_gguf_header
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, QuantParams
from stage_worker.checkpoint.stage_weights import load_stage_weights
from stage_worker.model.model_facts import model_facts
from stage_worker.model.stage_model import StackStageModel, StageModel, StageRole
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import TINY_CONFIGS
from tests.engine_helpers import InProcessPipeline, read_until_finished
from tests.llama_cpp_gguf import convert_checkpoint, reference_dir

CONFIGS = {
    "qwen3moe": {**TINY_CONFIGS["qwen3_moe"], "mlp_only_layers": []},
    "qwen2moe": TINY_CONFIGS["qwen2_moe"],
    "gemma3": {**TINY_CONFIGS["gemma3_text"], "sliding_window_pattern": 6},
}
MLX_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gemma3": "gemma3_text"}
# Longer than Gemma's window (8), so the sliding layers' caches rotate.
PROMPTS = ((504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21),
           (17, 42, 99, 1000, 5, 6, 7, 8, 9, 10, 11))
MAX_TOKENS = (10, 8)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-architectures")


def _source(arch: str, root) -> str:
    from stagemesh.bench.random_checkpoint import write_random_checkpoint

    out = root / f"{arch}-mlx"
    if not (out / "model.safetensors").is_file():
        write_random_checkpoint(CONFIGS[arch], out, dtype="float32", seed=sum(map(ord, arch)))
    return str(out)


def _gguf(arch: str, qtype: Q, root, quantized_reference: bool = False) -> tuple[str, str]:
    """(the GGUF, its reference MLX checkpoint), written once per module."""
    path = root / f"{arch}-{qtype.name}.gguf"
    if not path.is_file():
        convert_checkpoint(_source(arch, root), arch, qtype, path)
    return str(path), str(reference_dir(path, quantized_reference))


def _mlx_lm_greedy(path: str) -> list[list[int]]:
    from pathlib import Path

    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))  # the model alone: the prompts are token ids already
    outputs = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda logits: mx.argmax(logits, -1))
        outputs.append([int(token) for token, _ in steps])
    return outputs


def _stages(spec, depth: int, dequantize: bool = False) -> list[StageModel]:
    stages = []
    for i, r in enumerate(even_split(spec.num_layers, depth)):
        stage = StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
        if dequantize:
            stage.dequantize()  # --dequantize on
        stages.append(stage)
    return stages


def _served(spec, depth: int, dequantize: bool = False) -> list[list[int]]:
    """A prompt alone, then the prompts batched (the second arriving once the first has its first token)."""
    stages = _stages(spec, depth, dequantize)
    assert all(isinstance(s, StackStageModel) for s in stages)
    with InProcessPipeline(stages) as pipeline:
        alone = pipeline.generate(PROMPTS[1], MAX_TOKENS[1])
        first = pipeline.submit(PROMPTS[0], MAX_TOKENS[0])
        early = first.events.get(timeout=120)
        outputs, _ = read_until_finished([first, pipeline.submit(PROMPTS[1], MAX_TOKENS[1])])
        outputs[0] = list(early.token_ids) + outputs[0]
        assert outputs[1] == alone, f"PP={depth}: batched differs from alone"
        return outputs


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_metadata_reads_as_the_mlx_checkpoints_config(root, arch):
    path, reference = _gguf(arch, Q.F16, root)
    spec, expected = read_model_spec(path), read_model_spec(reference)
    assert spec.model_type == expected.model_type == MLX_TYPES[arch]
    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    assert module.ModelArgs.from_dict(dict(spec.args)) == module.ModelArgs.from_dict(dict(expected.args))
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.tie_word_embeddings) == (
        expected.num_layers, expected.hidden_size, expected.vocab_size, expected.tie_word_embeddings)
    assert spec.tie_word_embeddings == (arch == "gemma3")  # Gemma 3 ships no lm_head


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_f16_gguf_served_at_pp1_and_pp2_equals_mlx_lm(root, arch):
    path, reference = _gguf(arch, Q.F16, root)
    spec = read_model_spec(path)
    assert spec.quantization is None
    expected = _mlx_lm_greedy(reference)
    for depth in (1, 2):
        assert _served(spec, depth) == expected, f"PP={depth}"


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_q8_0_gguf_served_quantized_equals_mlx_lm_on_mlx_quantized_weights(root, arch):
    path, reference = _gguf(arch, Q.Q8_0, root, quantized_reference=True)
    spec = read_model_spec(path)
    assert spec.quantization["bits"] == 8 and spec.quantization["group_size"] == 32
    if arch in ("qwen3moe", "qwen2moe"):  # expert stacks quantized, the router kept in F32 as llama.cpp keeps it
        assert spec.quantization_for("model.layers.1.mlp.switch_mlp.down_proj") == QuantParams(32, 8)
        assert spec.quantization_for("model.layers.1.mlp.gate") is None
    if arch == "qwen2moe":  # the shared expert quantized, its gate kept in F32
        assert spec.quantization_for("model.layers.1.mlp.shared_expert.up_proj") == QuantParams(32, 8)
        assert spec.quantization_for("model.layers.1.mlp.shared_expert_gate") is None
    expected = _mlx_lm_greedy(reference)
    assert _stages(spec, 1)[0].quantized
    for depth in (1, 2):
        assert _served(spec, depth) == expected, f"PP={depth}"


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_q8_0_gguf_dequantized_equals_mlx_lm_on_gguf_dequantized_weights(root, arch):
    """``--dequantize on``: the weights as ``gguf.quants.dequantize`` reads them, in float32."""
    path, reference = _gguf(arch, Q.Q8_0, root)
    assert _served(read_model_spec(path), 2, dequantize=True) == _mlx_lm_greedy(reference)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_stage_weights_are_the_gguf_values_under_mlx_names(root, arch):
    path, reference = _gguf(arch, Q.F16, root)
    spec = read_model_spec(path)
    expected: dict[str, mx.array] = mx.load(f"{reference}/model.safetensors")  # type: ignore[assignment]
    weights = load_stage_weights(spec, range(0, spec.num_layers), with_embedding=True, with_head=True)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        assert mx.array_equal(weights[name].astype(mx.float32), value).item(), name


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_middle_stage_reads_only_its_layers(root, arch):
    path, _ = _gguf(arch, Q.Q8_0, root)
    spec = read_model_spec(path)
    header = read_gguf_header(path)
    names = needed_gguf_tensors(header, range(1, 3), False, False, spec.tie_word_embeddings)
    assert names and all(n.startswith(("blk.1.", "blk.2.")) for n in names)
    assert len(names) == sum(n.startswith(("blk.1.", "blk.2.")) for n in header.tensors)
    weights = load_stage_weights(spec, range(1, 3), with_embedding=False, with_head=False)
    assert {int(k.split(".")[2]) for k in weights} == {1, 2}


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_planner_facts_equal_the_bytes_each_stage_loads(root, arch, qtype):
    spec = read_model_spec(_gguf(arch, qtype, root)[0])
    facts = model_facts(spec)
    n = spec.num_layers
    for start, end, first, last in [(0, 2, True, False), (2, n - 1, False, False), (n - 1, n, False, True)]:
        stage = StageModel.load(spec, StageRole(LayerRange(start, end), first, last), mx.float32)
        assert facts.slice_weight_bytes(start, end, first=first, last=last, element_bytes=4) == stage.weight_bytes


def test_convert_writes_a_directory_mlx_lm_generates_the_same_tokens_from(root, tmp_path):
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir

    for arch in sorted(CONFIGS):
        path, reference = _gguf(arch, Q.Q8_0, root, quantized_reference=True)
        out = convert_gguf_to_mlx_dir(path, str(tmp_path / arch))
        assert _mlx_lm_greedy(out) == _mlx_lm_greedy(reference), arch


def test_the_gguf_tokenizer_is_the_one_it_carries(root):
    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    default = load_tokenizer(read_model_spec(default_model_path()))
    for arch in sorted(CONFIGS):
        tok = load_tokenizer(read_model_spec(_gguf(arch, Q.F16, root)[0]))
        text = "Hello world, 12345 tokens!"
        assert tok.encode(text) == default.encode(text)
        assert tok.chat_template == default.chat_template


def test_a_gemma3_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """Gemma 3's GGUFs carry a sentencepiece vocabulary (tokens, scores, token types), written as llama.cpp's
    ``_create_vocab_sentencepiece`` writes them; the tokenizer built from it splits text as sentencepiece does."""
    import io

    import sentencepiece as spm

    from stage_worker.checkpoint.tokenizer import load_tokenizer

    text = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello stagemesh!",
            "Pipelines split layers across machines.", "Numbers like 12345 and 678 appear too."] * 50
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=proto, vocab_size=400, model_type="bpe", byte_fallback=True,
        add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
        split_digits=True, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, minloglevel=2)  # Gemma's own settings, at a tiny size
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             4 if pieces[i].endswith("_turn>") else 1 for i in range(len(pieces))]

    def vocabulary(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(pieces)
        writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
        writer.add_add_bos_token(True)

    tok = load_tokenizer(read_model_spec(_tiny_gguf(tmp_path / "g.gguf", "gemma3", vocabulary=vocabulary)))
    for sample in ["Hello world, the quick fox!", "Numbers 12345 split", "  two spaces <start_of_turn>user\n"]:
        assert tok.encode(sample) == [2] + sp.encode(sample), sample
        assert tok.decode(tok.encode(sample), skip_special_tokens=True) == sample


# ---------------------------------------------------------------- what llama.cpp fixes in code


@pytest.mark.parametrize("layers", [6, 62])
def test_gemma3_attention_scale_window_pattern_and_rope_as_llama_cpp_fixes_them(tmp_path, layers):
    path = _tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=layers, key_length=8,
                      rope_scaling=gguf.RopeScalingType.LINEAR)
    args = read_model_spec(path).args
    # The 27B (62 layers) scales attention by hidden/heads (32/2), every other Gemma 3 by its head_dim (8).
    assert args["query_pre_attn_scalar"] == (16 if layers == 62 else 8)
    assert (args["sliding_window"], args["sliding_window_pattern"], args["rope_local_base_freq"]) == (4, 6, 10000.0)
    assert args["rope_scaling"] == {"type": "linear", "factor": 4.0}
    from mlx_lm.models import gemma3_text

    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(dict(args)))
    # The scaling applies to the global layers only, as llama.cpp's rope_freq_scale_train_swa = 1 leaves local ones.
    assert model.model.layers[5].self_attn.rope.scale == 0.25 and model.model.layers[0].self_attn.rope.scale == 1.0


def test_a_qwen3moe_layer_without_a_router_is_a_dense_layer(tmp_path):
    router = np.zeros((2, 32), np.float32)
    path = _tiny_gguf(tmp_path / "q.gguf", "qwen3moe", layers=3,
                      tensors={"blk.0.ffn_gate_inp.weight": router, "blk.2.ffn_gate_inp.weight": router})
    args = read_model_spec(path).args
    assert args["mlp_only_layers"] == [1] and args["num_experts"] == 2 and args["norm_topk_prob"] is True
    assert (args["moe_intermediate_size"], args["intermediate_size"]) == (32, 64)


# ---------------------------------------------------------------- refused at spec time


def _tiny_gguf(path, arch: str, *, extra: dict | None = None, tensors: dict | None = None,
               rope_scaling: gguf.RopeScalingType | None = None, layers: int = 1, key_length: int = 16,
               vocabulary=None) -> str:
    """A GGUF of ``arch`` whose header is complete, with tiny tensors: what a spec is read from."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(key_length)
    writer.add_value_length(key_length)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(4)
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_count(2)
        writer.add_expert_used_count(1)
        writer.add_expert_feed_forward_length(32)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(48)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(rope_scaling)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32)
    if vocabulary is not None:
        vocabulary(writer)
    for key, value in (extra or {}).items():
        writer.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.FLOAT32)
    defaults = {"token_embd.weight": np.zeros((8, 32), np.float32), "output_norm.weight": np.ones(32, np.float32)}
    for name, array in {**defaults, **(tensors or {})}.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_tensor_the_architecture_has_no_counterpart_of_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "g.gguf", "gemma3", tensors={"blk.0.ffn_gate_inp.weight": np.zeros((2, 32),
                                                                                                    np.float32)})
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_gate_inp\.weight has no counterpart in mlx-lm's "
                                               r"gemma3_text model"):
        read_model_spec(path)


def test_gemma3_final_logit_softcapping_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "g.gguf", "gemma3", extra={"final_logit_softcapping": 30.0})
    with pytest.raises(ModelFormatError, match="soft-caps its final logits at 30"):
        read_model_spec(path)


@pytest.mark.parametrize("arch, model_type", [("qwen3moe", "qwen3_moe"), ("qwen2moe", "qwen2_moe")])
def test_moe_rope_scaling_is_refused(tmp_path, arch, model_type):
    path = _tiny_gguf(tmp_path / "q.gguf", arch, rope_scaling=gguf.RopeScalingType.YARN)
    with pytest.raises(ModelFormatError, match=f"mlx-lm's {model_type} model does not apply"):
        read_model_spec(path)


def test_qwen2moe_reads_its_shared_expert_and_keeps_the_routed_weights_unnormalized(tmp_path):
    args = read_model_spec(_tiny_gguf(tmp_path / "q.gguf", "qwen2moe", layers=2)).args
    assert (args["num_experts"], args["num_experts_per_tok"]) == (2, 1)
    assert (args["moe_intermediate_size"], args["shared_expert_intermediate_size"], args["intermediate_size"]) == (
        32, 48, 64)
    assert "norm_topk_prob" not in args  # llama.cpp's qwen2moe graph weighs experts by their softmax as it is


def test_an_architecture_without_a_table_names_the_served_ones(tmp_path):
    path = _tiny_gguf(tmp_path / "p.gguf", "phi3")
    with pytest.raises(ModelFormatError, match=r"'phi3' is not supported; stagemesh serves llama, qwen2, qwen3, "
                                               r"qwen3moe, qwen2moe, gemma3 GGUFs"):
        read_model_spec(path)


def test_serve_refuses_an_unsupported_gguf_architecture_with_exit_2(tmp_path, capsys):
    # The CLI's entry point in this process; unmarked, so tests/fast_tier.py fails the test if serve starts a
    # process or Ray before refusing.
    from stagemesh.cli import main

    path = _tiny_gguf(tmp_path / "p.gguf", "phi3")
    code = main(["serve", path, "-pp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "GGUF architecture 'phi3' is not supported" in err
    assert "llama, qwen2, qwen3, qwen3moe, qwen2moe, gemma3" in err
