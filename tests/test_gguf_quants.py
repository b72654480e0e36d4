"""GGUF block types: each against gguf's own dequantizer, a Q4_K_M-like model at PP=2 against mlx-lm on the
weights as gguf reads them, the planner's bytes against a loaded stage, and corrupt or unsupported files.

The files are written with the ``gguf`` package from random but valid blocks (``tests/gguf_blocks``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from stage_worker.checkpoint.gguf.format import convert_gguf_tensor, gguf_to_mlx_name, read_gguf_header
from stage_worker.checkpoint.gguf.quants import AFFINE_BITS, EXACT_TYPES, GROUP_SIZE
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, QuantParams
from stage_worker.model.model_facts import model_facts
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange, even_split
from tests.engine_helpers import InProcessPipeline, read_until_finished
from tests.gguf_blocks import random_blocks

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 288, 128, 4
HEAD_DIM = HIDDEN // HEADS


def _write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, Q]], n_layers: int = LAYERS) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dequantized(arrays: dict[str, mx.array], name: str, bits: int) -> np.ndarray:
    """What MLX computes from our affine layout, in float32."""
    base = name[: -len(".weight")]
    scales, biases = (arrays[f"{base}.{s}"].astype(mx.float32) for s in ("scales", "biases"))
    return np.array(mx.dequantize(arrays[name], scales, biases, group_size=GROUP_SIZE, bits=bits))


def _within_requantization_bound(ours: np.ndarray, reference: np.ndarray) -> bool:
    """Requantized to 8 bits over each group of 32: within (max - min) / 510 of the group, plus float32 rounding."""
    groups, errors = reference.reshape(-1, 32), np.abs(ours - reference).reshape(-1, 32)
    bound = np.ptp(groups, axis=1) / 510 + 4 * np.finfo(np.float32).eps * np.abs(groups).max(axis=1)
    return bool((errors.max(axis=1) <= bound).all())


# ---------------------------------------------------------------- each block type


@pytest.mark.parametrize("qtype", list(AFFINE_BITS), ids=lambda q: q.name)
def test_block_type_against_gguf_dequantize(tmp_path, qtype):
    raw = random_blocks(qtype, 16, 512, np.random.default_rng(int(qtype)))
    path = tmp_path / f"{qtype.name}.gguf"
    _write_gguf(path, [("blk.0.ffn_down.weight", raw, qtype)], n_layers=1)
    arrays = convert_gguf_tensor(str(path), "blk.0.ffn_down.weight")
    ours = _dequantized(arrays, "blk.0.ffn_down.weight", AFFINE_BITS[qtype])
    reference = gguf.quants.dequantize(raw, qtype)
    assert reference.shape == ours.shape == (16, 512) and np.isfinite(reference).all()
    if qtype in EXACT_TYPES:
        assert np.array_equal(ours, reference)
        return
    assert _within_requantization_bound(ours, reference)
    assert not np.array_equal(ours, reference)  # not exact: the test above would have been the one to hold


# ---------------------------------------------------------------- a Q4_K_M-like model

# Per layer, the type of each projection: Q4_K for most, Q6_K for attn_v and (in llama.cpp, where a row fills
# whole 256-blocks) ffn_down of the first and last layers; ffn_down's rows (FFN = 288) do not divide into
# K-blocks, so it takes Q8_0 there and Q5_0 elsewhere, as llama-quantize falls back. The middle layers carry
# the other types once each, so every type runs through the stages.
def _mix(layer: int) -> dict[str, Q]:
    edge = layer in (0, LAYERS - 1)
    mix = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K if edge else Q.Q4_K, "attn_output": Q.Q4_K,
           "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q8_0 if edge else Q.Q5_0}
    if layer == 1:
        mix.update(attn_k=Q.Q3_K, attn_output=Q.Q5_K, ffn_gate=Q.IQ4_NL)
    if layer == 2:
        mix.update(attn_q=Q.Q2_K, ffn_up=Q.Q5_1, ffn_down=Q.Q4_0)
    return mix


_SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
           "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
           "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def _to_gguf_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF -> GGUF); rows of whole blocks move as they are."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_mixed_llama(path: Path, mix=_mix, seed: int = 0) -> dict[str, np.ndarray]:
    """A random llama GGUF quantized by ``mix``; returns its weights as gguf dequantizes them, HF layout, by
    mlx-lm name."""
    rng = np.random.default_rng(seed)
    reference: dict[str, np.ndarray] = {}
    tensors: list[tuple[str, np.ndarray, Q]] = []

    def add(name: str, rows: int, cols: int, qtype: Q, n_head: int | None = None) -> None:
        if qtype == Q.F32:
            data = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
            reference[gguf_to_mlx_name(name)] = data
        else:
            data = random_blocks(qtype, rows, cols, rng)
            reference[gguf_to_mlx_name(name)] = gguf.quants.dequantize(data, qtype)
            if n_head:
                data = _to_gguf_rows(data, n_head)
        tensors.append((name, data, qtype))

    add("token_embd.weight", VOCAB, HIDDEN, Q.Q4_K)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", 1, HIDDEN, Q.F32)
        add(f"blk.{i}.ffn_norm.weight", 1, HIDDEN, Q.F32)
        for module, qtype in mix(i).items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(module)
            add(f"blk.{i}.{module}.weight", *_SHAPES[module], qtype, heads)
    add("output_norm.weight", 1, HIDDEN, Q.F32)
    add("output.weight", VOCAB, HIDDEN, Q.Q6_K)
    _write_gguf(path, tensors)
    return reference


def write_mlx_checkpoint(directory: Path, weights: dict[str, np.ndarray]) -> Path:
    """The same weights, dense float32, as an MLX checkpoint mlx-lm loads on its own."""
    directory.mkdir()
    config = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6,
              "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "max_position_embeddings": 256}
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return directory


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquants")
    reference = write_mixed_llama(root / "tiny-Q4_K_M.gguf")
    return str(root / "tiny-Q4_K_M.gguf"), write_mlx_checkpoint(root / "reference", reference)


def test_every_stage_weight_is_gguf_dequantized_value_in_hf_layout(mixed):
    """Every tensor of the model as the stages load it (q/k rows un-permuted) against gguf's dequantizer."""
    from stage_worker.checkpoint.stage_weights import load_stage_weights

    path, reference_dir = mixed
    spec = read_model_spec(path)
    reference = dict(mx.load(str(reference_dir / "model.safetensors")))
    weights = load_stage_weights(spec, range(0, LAYERS), with_embedding=True, with_head=True)
    types = {gguf_to_mlx_name(n): info.ggml_type for n, info in read_gguf_header(path).tensors.items()}
    assert {k for k in weights if k.endswith(".weight")} == set(reference)
    for name, expected in reference.items():
        qtype, expected = types[name], np.array(expected)
        if qtype == Q.F32:
            assert np.array_equal(np.array(weights[name]), expected), name
            continue
        ours = _dequantized(weights, name, AFFINE_BITS[qtype])
        if qtype in EXACT_TYPES:
            assert np.array_equal(ours, expected), name
        else:
            assert _within_requantization_bound(ours, expected), name


def _stages(spec) -> list[StageModel]:
    ranges = even_split(spec.num_layers, 2)
    return [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == len(ranges) - 1), mx.float32)
            for i, r in enumerate(ranges)]


def test_q4_k_m_mix_at_pp2_equals_mlx_lm_on_gguf_dequantized_weights(mixed):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    path, reference_dir = mixed
    spec = read_model_spec(path)
    assert spec.quantization_for("model.layers.0.self_attn.q_proj") == QuantParams(32, 4)  # Q4_K
    assert spec.quantization_for("model.layers.0.self_attn.v_proj") == QuantParams(32, 8)  # Q6_K, requantized
    assert spec.quantization_for("model.layers.1.mlp.down_proj") == QuantParams(32, 5)  # Q5_0
    assert spec.quantization_for("lm_head") == QuantParams(32, 8)
    model, _ = load_model(Path(reference_dir))
    prompts, max_tokens = [(1, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11), (3, 2, 1)], 12
    expected = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=max_tokens,
                                                  sampler=lambda logits: mx.argmax(logits, axis=-1))]
                for p in prompts]
    assert len(set(expected[0])) > 2  # the random model does not just repeat one token
    with InProcessPipeline(_stages(spec)) as pipeline:
        assert [pipeline.generate(p, max_tokens) for p in prompts] == expected  # each alone
        together, _ = read_until_finished([pipeline.submit(p, max_tokens) for p in prompts])
        assert together == expected  # both in one batch


# ---------------------------------------------------------------- the planner's bytes


def _uniform(layer: int) -> dict[str, Q]:
    return {**{m: Q.Q4_K for m in _SHAPES}, "attn_v": Q.Q6_K, "ffn_down": Q.Q5_0}


@pytest.mark.parametrize("mix", [
    pytest.param(_uniform, id="same-types-every-layer"),
    pytest.param(_mix, id="types-differ-by-layer"),
])
def test_planner_bytes_equal_the_loaded_stages(tmp_path, mix):
    path = tmp_path / "tiny.gguf"
    write_mixed_llama(path, mix)
    spec = read_model_spec(str(path))
    facts, dense = model_facts(spec), model_facts(spec, dense=True)
    for stage in _stages(spec):
        where = dict(first=stage.role.is_first, last=stage.role.is_last, element_bytes=4)
        start, end = stage.role.layers.start, stage.role.layers.end
        assert facts.slice_weight_bytes(start, end, **where) == stage.weight_bytes
        assert dense.slice_weight_bytes(start, end, **where) == stage.dense_bytes()


# ---------------------------------------------------------------- refused before any stage loads


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.MXFP4, Q.Q8_K], ids=lambda q: q.name)
def test_unsupported_block_type_is_named_with_the_supported_list(tmp_path, qtype):
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    cols = math.lcm(block_elements, HIDDEN)
    data = np.zeros((HIDDEN, cols // block_elements * block_bytes), np.uint8)
    path = tmp_path / "odd.gguf"
    _write_gguf(path, [("blk.0.ffn_down.weight", data, qtype)], n_layers=1)
    with pytest.raises(ModelFormatError) as err:
        read_model_spec(str(path))
    message = str(err.value)
    assert f"blk.0.ffn_down.weight has type {qtype.name}" in message
    assert "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K" in message


def _tensor_record(path: Path, name: str) -> int:
    """Byte position of ``name``'s tensor-table record just after its name (n_dims, dims, type, offset)."""
    data = path.read_bytes()
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded)
    return at + 8 + len(encoded)


def _patch(path: Path, at: int, value: int, size: int) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + size] = value.to_bytes(size, "little")
    path.write_bytes(bytes(data))


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    rng = np.random.default_rng(1)
    _write_gguf(path, [("blk.0.ffn_up.weight", random_blocks(Q.Q4_K, FFN, HIDDEN, rng), Q.Q4_K),
                       ("blk.0.ffn_down.weight", random_blocks(Q.Q6_K, FFN, HIDDEN, rng), Q.Q6_K)], n_layers=1)
    return path


def test_truncated_file_names_the_file_tensor_and_offset(small_gguf):
    info = read_gguf_header(str(small_gguf)).tensors["blk.0.ffn_down.weight"]
    small_gguf.write_bytes(small_gguf.read_bytes()[:-100])
    with pytest.raises(ModelFormatError) as err:
        read_model_spec(str(small_gguf))
    message = str(err.value)
    assert str(small_gguf) in message and "truncated" in message
    assert f"blk.0.ffn_down.weight (Q6_K, shape (288, 256)) at byte offset {info.offset}" in message


def test_misaligned_tensor_offset(small_gguf):
    record = _tensor_record(small_gguf, "blk.0.ffn_down.weight")
    offset_at = record + 4 + 2 * 8 + 4  # n_dims, two dims, type
    relative = int.from_bytes(small_gguf.read_bytes()[offset_at : offset_at + 8], "little")
    _patch(small_gguf, offset_at, relative + 2, 8)
    with pytest.raises(ModelFormatError, match=r"small\.gguf: tensor blk\.0\.ffn_down\.weight .* at byte offset "
                                                r"\d+ is not aligned to 32 bytes; the file is corrupt"):
        read_model_spec(str(small_gguf))


def test_overlapping_tensors(small_gguf):
    record = _tensor_record(small_gguf, "blk.0.ffn_down.weight")
    _patch(small_gguf, record + 4 + 2 * 8 + 4, 0, 8)  # its data now starts where ffn_up's does
    with pytest.raises(ModelFormatError, match=r"tensor blk\.0\.ffn_(up|down)\.weight at byte offset \d+ overlaps "
                                                r"tensor blk\.0\.ffn_(up|down)\.weight .*; the file is corrupt"):
        read_model_spec(str(small_gguf))


def test_rows_that_do_not_fill_whole_blocks(small_gguf):
    record = _tensor_record(small_gguf, "blk.0.ffn_up.weight")
    _patch(small_gguf, record + 4, 288, 8)  # GGUF's first dim is the row length: 256 -> 288
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_up\.weight \(Q4_K, shape \(288, 288\)\) at byte "
                                                r"offset \d+ has rows of 288 elements, not whole 256-element blocks"):
        read_model_spec(str(small_gguf))


def test_serve_exits_2_before_any_stage_on_an_unsupported_type_or_a_truncated_file(tmp_path, small_gguf, capsys):
    # The CLI's entry point in this process; unmarked, so tests/fast_tier.py fails the test if serve starts a
    # process or Ray before refusing.
    from stagemesh.cli import main

    odd = tmp_path / "odd.gguf"
    _write_gguf(odd, [("blk.0.ffn_down.weight", np.zeros((HIDDEN, 66), np.uint8), Q.IQ2_XXS)], n_layers=1)
    small_gguf.write_bytes(small_gguf.read_bytes()[:-100])
    for path, message in ((odd, "blk.0.ffn_down.weight has type IQ2_XXS"), (small_gguf, "it is truncated")):
        code = main(["serve", str(path), "--port", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert message in err
