"""GGUF reading: bit-exact against mx.load, q/k un-permutation, slicing, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.gguf.format import (
    convert_gguf_tensor,
    gguf_to_mlx_name,
    load_gguf_weights,
    read_gguf_header,
)
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, QuantParams
from stage_worker.checkpoint.stage_weights import load_stage_weights

DEFAULT = default_model_path()


@pytest.fixture(scope="module")
def spec():
    return read_model_spec(DEFAULT)


@pytest.fixture(scope="module")
def reference():
    """MLX's own GGUF loader: every tensor under its GGUF name."""
    return mx.load(DEFAULT)


# ---------------------------------------------------------------- tiny GGUFs


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    qtype: Q = Q.F32,
    embed_qtype: Q | None = None,
    tied: bool = True,
    n_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    ffn: int = 128,
    vocab: int = 96,
    extra: dict[str, tuple[np.ndarray, Q]] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a random-weight GGUF; return its float32 weights in HF layout under mlx-lm names."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    hf: dict[str, np.ndarray] = {}
    gg: list[tuple[str, np.ndarray, Q]] = []

    def add(gname: str, w: np.ndarray, qt: Q, permute_heads: int | None = None) -> None:
        hf[gguf_to_mlx_name(gname, arch)] = w
        stored = hf_to_gguf_permute(w, permute_heads) if permute_heads and arch == "llama" else w
        gg.append((gname, stored, qt))

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    add("token_embd.weight", mat(vocab, hidden), embed_qtype or qtype)
    for i in range(n_layers):
        b = f"blk.{i}"
        add(f"{b}.attn_norm.weight", vec(hidden), Q.F32)
        add(f"{b}.ffn_norm.weight", vec(hidden), Q.F32)
        add(f"{b}.attn_q.weight", mat(heads * head_dim, hidden), qtype, heads)
        add(f"{b}.attn_k.weight", mat(kv_heads * head_dim, hidden), qtype, kv_heads)
        add(f"{b}.attn_v.weight", mat(kv_heads * head_dim, hidden), qtype)
        add(f"{b}.attn_output.weight", mat(hidden, heads * head_dim), qtype)
        add(f"{b}.ffn_gate.weight", mat(ffn, hidden), qtype)
        add(f"{b}.ffn_up.weight", mat(ffn, hidden), qtype)
        add(f"{b}.ffn_down.weight", mat(hidden, ffn), qtype)
        if arch == "qwen2":
            for n, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                            ("attn_v", kv_heads * head_dim)):
                add(f"{b}.{n}.bias", vec(rows) - 1, Q.F32)
        if arch == "qwen3":
            add(f"{b}.attn_q_norm.weight", vec(head_dim), Q.F32)
            add(f"{b}.attn_k_norm.weight", vec(head_dim), Q.F32)
    add("output_norm.weight", vec(hidden), Q.F32)
    if not tied:
        add("output.weight", mat(vocab, hidden), qtype)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for name, w, qt in gg:
        if qt == Q.F32:
            writer.add_tensor(name, w)
        elif qt == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)
    for name, (data, qt) in (extra or {}).items():
        writer.add_tensor(name, data, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def build_model(spec, weights):
    """mlx-lm's model for the spec, quantized like the weights, loaded strictly."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    model = module.Model(module.ModelArgs.from_dict(dict(spec.args)))

    def predicate(path, m):
        if f"{path}.scales" not in weights:
            return False
        return spec.quantization_for(path).as_kwargs()

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    return model


# ---------------------------------------------------------------- default model


@pytest.mark.e2e
def test_every_tensor_matches_mx_load_bit_for_bit(reference):
    header = read_gguf_header(DEFAULT)
    seen = 0
    for name in header.tensors:
        for key, ours in convert_gguf_tensor(DEFAULT, name).items():
            ref = reference[key]
            assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
            assert mx.array_equal(ours, ref).item(), key
            seen += 1
    assert seen == len(reference) == 694


@pytest.mark.e2e
def test_stage_weights_are_mx_load_renamed_and_unpermuted(spec, reference):
    weights = load_stage_weights(spec, range(0, 30), with_embedding=True, with_head=True)
    assert len(weights) == len(reference)
    heads = {"attn_q": 9, "attn_k": 3}
    for key, ref in reference.items():
        base, suffix = key.rsplit(".", 1)
        mlx_key = gguf_to_mlx_name(f"{base}.weight").rsplit(".", 1)[0] + f".{suffix}"
        ours = weights[mlx_key]
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, mlx_key
        got = np.array(ours)
        kind = base.split(".")[2] if base.startswith("blk.") else None
        if kind in heads:  # our rows are HF order: permuting them again gives GGUF's
            got = hf_to_gguf_permute(got, heads[kind])
        assert got.tobytes() == np.array(ref).tobytes(), mlx_key
    # dtypes as MLX's loader gives them: uint32 packed, float16 scales/biases, float32 norms
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 72)
    assert weights["model.layers.0.self_attn.k_proj.scales"].dtype == mx.float16
    assert weights["model.embed_tokens.weight"].shape == (49152, 144)  # 8-bit
    assert weights["model.norm.weight"].dtype == mx.float32


@pytest.mark.e2e
def test_unpermuted_standard_rope_equals_raw_gguf_with_traditional_rope(spec, reference):
    """The permutation is exactly what traditional RoPE expects; undoing it allows standard RoPE."""
    weights = load_stage_weights(spec, range(0, 30), with_embedding=True, with_head=True)
    ours = build_model(spec, weights)
    raw = {}
    for key, ref in reference.items():
        base, suffix = key.rsplit(".", 1)
        raw[gguf_to_mlx_name(f"{base}.weight").rsplit(".", 1)[0] + f".{suffix}"] = ref
    traditional = dict(spec.args, rope_traditional=True)
    raw_model = build_model(dataclasses.replace(spec, args=traditional), raw)
    tokens = mx.array([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]])
    a, b = ours(tokens), raw_model(tokens)
    assert mx.allclose(a, b, atol=1e-3, rtol=1e-3).item()
    assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()


def _nbytes(weights):
    return sum(v.nbytes for v in weights.values())


@pytest.mark.e2e
def test_middle_slice_of_three_holds_only_its_layers(spec):
    before = mx.get_active_memory()
    middle = load_stage_weights(spec, range(10, 20), with_embedding=False, with_head=False)
    retained = mx.get_active_memory() - before
    layers = {int(k.split(".")[2]) for k in middle}
    assert layers == set(range(10, 20))
    assert all(k.startswith("model.layers.") for k in middle)
    all_layers = load_gguf_weights(spec, range(0, 30), with_embedding=False, with_head=False)
    ratio = _nbytes(middle) / _nbytes(all_layers)
    assert abs(ratio - 1 / 3) < 0.05 / 3
    # MLX holds just the slice: nothing else of the file stayed in memory
    assert retained <= _nbytes(middle) * 1.02


@pytest.mark.e2e
def test_unevaluated_weights_are_placeholders_whose_blocks_read_whole_are_the_converted_arrays(spec):
    # A tensor-parallel member loads without evaluating: nothing is read, each array is a placeholder of the
    # converted shape and dtype beside where its blocks lie, and read whole from there it is the conversion's.
    from stage_worker.checkpoint.gguf.format import read_gguf_part

    layers = range(26, 30)
    eager = load_gguf_weights(spec, layers, with_embedding=False, with_head=False)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    sources: dict = {}
    lazy = load_gguf_weights(spec, layers, with_embedding=False, with_head=False, evaluate=False, sources=sources)
    assert mx.get_peak_memory() - before < 1 << 20  # nothing of the layers' blocks is held
    assert lazy.keys() == eager.keys() == sources.keys()
    for key, array in eager.items():
        assert (lazy[key].shape, lazy[key].dtype) == (array.shape, array.dtype), key
        whole = read_gguf_part(sources[key], tuple((range(n),) for n in array.shape))
        assert whole.dtype == array.dtype and mx.array_equal(whole, array).item(), key


@pytest.mark.e2e
def test_first_and_last_stage_get_embedding_and_tied_head(spec):
    first = load_stage_weights(spec, range(0, 10), with_embedding=True, with_head=False)
    assert {"model.embed_tokens.weight", "model.embed_tokens.scales", "model.embed_tokens.biases"} <= set(first)
    assert not any(k.startswith(("model.norm", "lm_head")) for k in first)
    last = load_stage_weights(spec, range(20, 30), with_embedding=False, with_head=True)
    assert "model.norm.weight" in last
    assert "model.embed_tokens.weight" in last  # tied: the head is the embedding
    assert not any(k.startswith("lm_head") for k in last)
    assert {int(k.split(".")[2]) for k in last if k.startswith("model.layers.")} == set(range(20, 30))


@pytest.mark.parametrize("layers", [range(25, 31), range(5, 5), range(0, 10, 2), range(-1, 3)])
def test_bad_layer_range(spec, layers):
    with pytest.raises(ModelFormatError, match="range"):
        load_stage_weights(spec, layers, with_embedding=False, with_head=False)


# ---------------------------------------------------------------- tiny synthetic models


def test_llama_q_k_rows_come_back_in_hf_layout(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    hf = write_tiny_gguf(path, "llama", qtype=Q.F32)
    spec = read_model_spec(str(path))
    weights = load_stage_weights(spec, range(0, 2), with_embedding=True, with_head=True)
    assert set(weights) == set(hf)
    for key, value in hf.items():
        assert np.array_equal(np.array(weights[key]), value), key


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16])
def test_block_types_match_mx_load(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, "llama", qtype=qtype, embed_qtype=Q.Q8_0, seed=int(qtype))
    reference = mx.load(str(path))
    for name in read_gguf_header(str(path)).tensors:
        for key, ours in convert_gguf_tensor(str(path), name).items():
            assert ours.dtype == reference[key].dtype, key
            assert mx.array_equal(ours, reference[key]).item(), key
    spec = read_model_spec(str(path))
    bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}.get(qtype)
    assert spec.quantization_for("model.layers.1.mlp.down_proj") == (None if bits is None else QuantParams(32, bits))
    assert spec.quantization_for("model.embed_tokens") == QuantParams(32, 8)
    build_model(spec, load_stage_weights(spec, range(0, 2), True, True))  # strict names and shapes


def test_bf16_tensors(tmp_path):
    path = tmp_path / "tiny-bf16.gguf"
    hf = write_tiny_gguf(path, "llama", qtype=Q.BF16)
    spec = read_model_spec(str(path))
    assert spec.quantization is None
    weights = load_stage_weights(spec, range(0, 2), True, True)
    w = weights["model.layers.1.mlp.up_proj.weight"]
    assert w.dtype == mx.bfloat16
    expected = gguf.quants.dequantize(gguf.quants.quantize(hf["model.layers.1.mlp.up_proj.weight"], Q.BF16), Q.BF16)
    assert np.array_equal(np.array(w.astype(mx.float32)), expected)


def test_qwen2_biases_and_untied_head(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    hf = write_tiny_gguf(path, "qwen2", qtype=Q.F32, tied=False)
    spec = read_model_spec(str(path))
    assert (spec.model_type, spec.tie_word_embeddings) == ("qwen2", False)
    last = load_stage_weights(spec, range(1, 2), with_embedding=False, with_head=True)
    assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
    assert "model.layers.1.self_attn.q_proj.bias" in last
    full = load_stage_weights(spec, range(0, 2), True, True)
    for key, value in hf.items():  # qwen GGUFs are not permuted
        assert np.array_equal(np.array(full[key]), value), key
    build_model(spec, full)


def test_qwen3_head_dim_and_qk_norm(tmp_path):
    path = tmp_path / "tiny-qwen3.gguf"
    hf = write_tiny_gguf(path, "qwen3", qtype=Q.Q4_0, embed_qtype=Q.F16, head_dim=32, tied=True)
    spec = read_model_spec(str(path))
    assert spec.args["head_dim"] == 32 and spec.model_type == "qwen3"
    assert spec.quantization["model.embed_tokens"] is False
    weights = load_stage_weights(spec, range(0, 2), True, True)
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    assert np.array_equal(np.array(weights[q_norm]), hf[q_norm])
    model = build_model(spec, weights)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 96)


# ---------------------------------------------------------------- errors


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match=r"'phi3' is not supported.*llama, qwen2, qwen3"):
        read_model_spec(str(path))


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq2.gguf"
    iq2 = np.zeros((64, 66), np.uint8)  # 64 rows of one 256-element IQ2_XXS block
    write_tiny_gguf(path, "llama", qtype=Q.F32, extra={"blk.1.attn_qkv.weight": (iq2, Q.IQ2_XXS)})
    with pytest.raises(ModelFormatError) as err:
        read_model_spec(str(path))
    message = str(err.value)
    assert "blk.1.attn_qkv.weight has type IQ2_XXS" in message
    assert "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K" in message
    assert "llama-quantize" in message


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "fused.gguf"
    write_tiny_gguf(path, "llama", extra={"blk.0.attn_qkv.weight": (np.zeros((4, 64), np.float32), Q.F32)})
    with pytest.raises(ModelFormatError, match="attn_qkv"):
        read_model_spec(str(path))


def test_not_a_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        read_model_spec(str(path))
