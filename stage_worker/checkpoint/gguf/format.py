"""GGUF files: spec from metadata, and a stage's tensors as mlx-lm weights.

Contract:
- ``read_gguf_spec(path)`` builds a ``ModelSpec`` from the GGUF header only; an architecture, a tensor type or
  a tensor it cannot serve, and a truncated or corrupt tensor table, raise ``ModelFormatError`` naming the file
  and the offset before any weight is read.
- ``load_gguf_weights(spec, layers, with_embedding, with_head, evaluate=True)`` reads the bytes of only the
  tensors that slice needs and returns them under mlx-lm's parameter names, layer indices global, quantized
  tensors in MLX's affine layout (as close to ``gguf.quants.dequantize`` as ``gguf_quants`` states), the
  converter's quirks undone; ``evaluate=False`` reads nothing: placeholders of each array's shape and dtype,
  and where each comes from (``sources``), for a tensor-parallel member to read only its part.
- ``read_gguf_part(source, keep)``: the part of one converted array (``StoredGGUF``) keeping index runs per
  axis, from the blocks of only those rows and columns (converted, un-permuted as the whole would be).
- ``convert_gguf_tensor(path, name)`` gives one tensor exactly as ``mx.load`` names and lays it out (no
  permutation undone); tests compare the two.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from stage_worker.checkpoint import load_progress
from stage_worker.checkpoint.gguf.architectures import BLOCK_RE, CommonFacts, GGUFArchitecture, gguf_architecture
from stage_worker.checkpoint.gguf.quants import AFFINE_BITS, GROUP_SIZE, blocks_to_affine
from stage_worker.checkpoint.model_spec import (
    ModelFormatError,
    ModelSpec,
    served_name_from_path,
)
from stage_worker.checkpoint.safetensors_format import StoredTensor, read_part_array

T = GGMLQuantizationType
PLAIN_TYPES: Mapping[int, np.dtype] = {
    T.F32: np.dtype("<f4"),
    T.F16: np.dtype("<f2"),
    T.BF16: np.dtype("<u2"),  # reinterpreted as bfloat16 on the MLX side
}
# GGML block type -> bits of the MLX affine layout it maps to (group size 32; gguf_quants converts).
QUANT_BITS: Mapping[int, int] = AFFINE_BITS
GGUF_GROUP_SIZE = GROUP_SIZE
SUPPORTED_TYPES_TEXT = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K"

# Tensors a GGUF may carry that mlx-lm recomputes itself.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
_BLOCK_RE = BLOCK_RE  # the tensor-name tables per architecture live in gguf_architectures


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF's dims reversed (rows first)
    ggml_type: int
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type#{self.ggml_type}"


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensorInfo]


_SCALARS: Mapping[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    """Sequential little-endian reader over a read-only mapping of the header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[etype])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return arr.tolist()  # a copy: nothing keeps the mapping alive
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise ModelFormatError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse metadata and tensor table of a GGUF file (cached per file version).

    Parsed here with ``struct`` rather than ``gguf.GGUFReader`` (whose per-element numpy views are slow on a
    large vocabulary); the ``gguf`` package still supplies the type tables and writes our test files.
    """
    st = os.stat(path)
    return _read_header_cached(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read_header_cached(path: str, _mtime_ns: int, size: int) -> GGUFHeader:
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise ModelFormatError(f"{path} is not a GGUF file (bad magic); pass a valid .gguf file.")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse_header(path, buf, size)
            except (struct.error, IndexError, UnicodeDecodeError) as e:
                raise ModelFormatError(f"{path} has a truncated or corrupt GGUF header ({e}).") from e


def _parse_header(path: str, buf: mmap.mmap, size: int) -> GGUFHeader:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFormatError(
            f"{path} is GGUF version {version}; stagemesh reads little-endian GGUF v2/v3. "
            "Re-convert it with a current llama.cpp."
        )
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        raw_infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, rel in raw_infos:
        n_elements = math.prod(dims)
        block, type_size = GGML_QUANT_SIZES.get(ggml_type, (1, 0))
        nbytes = n_elements // block * type_size
        info = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, data_start + rel, nbytes)
        _check_extent(path, info, block, alignment, size)
        tensors[name] = info
    in_file_order = sorted(tensors.values(), key=lambda i: i.offset)
    for before, after in zip(in_file_order, in_file_order[1:]):
        if before.offset + before.nbytes > after.offset:
            raise ModelFormatError(
                f"{path}: tensor {after.name} at byte offset {after.offset} overlaps tensor {before.name} "
                f"(offset {before.offset}, {before.nbytes} bytes); the file is corrupt."
            )
    return GGUFHeader(path, version, metadata, tensors)


def _check_extent(path: str, info: GGUFTensorInfo, block: int, alignment: int, size: int) -> None:
    """Refuse a tensor whose data cannot be where the table says: the file is corrupt or cut short."""
    where = f"{path}: tensor {info.name} ({info.type_name}, shape {info.shape}) at byte offset {info.offset}"
    if info.offset % alignment:
        raise ModelFormatError(f"{where} is not aligned to {alignment} bytes; the file is corrupt.")
    if info.shape and info.shape[-1] % block:
        raise ModelFormatError(
            f"{where} has rows of {info.shape[-1]} elements, not whole {block}-element blocks; the file is corrupt."
        )
    if info.offset + info.nbytes > size:
        raise ModelFormatError(
            f"{where} needs {info.nbytes} bytes, up to offset {info.offset + info.nbytes}, but the file ends at "
            f"{size}: it is truncated. Download it again."
        )


# --------------------------------------------------------------------------- spec


def _unsupported_type_error(info: GGUFTensorInfo) -> ModelFormatError:
    return ModelFormatError(
        f"GGUF tensor {info.name} has type {info.type_name}; stagemesh reads "
        f"{SUPPORTED_TYPES_TEXT} GGUF tensors. Use a GGUF quantized to one of these "
        "(llama-quantize Q4_K_M, Q5_K_M, Q6_K or Q8_0, say), or an MLX model directory."
    )


def gguf_to_mlx_name(name: str, architecture: str = "llama") -> str | None:
    """GGUF tensor name -> mlx-lm parameter name in ``architecture``'s model (None if not one of its parameters)."""
    return gguf_architecture(architecture).mlx_name(name)


def _architecture(header: GGUFHeader) -> GGUFArchitecture:
    return gguf_architecture(header.metadata.get("general.architecture"))


def _meta(md: Mapping[str, Any], arch: str, key: str, default: Any = ...) -> Any:
    full = f"{arch}.{key}"
    if full in md:
        return md[full]
    if default is ...:
        raise ModelFormatError(f"GGUF metadata lacks {full}; the file is incomplete or not a {arch} model.")
    return default


def _f32(x: float) -> float:
    """The shortest decimal of a float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(header: GGUFHeader, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    md = header.metadata
    kind = _meta(md, arch, "rope.scaling.type", None)
    factor = _meta(md, arch, "rope.scaling.factor", None)
    orig = _meta(md, arch, "rope.scaling.original_context_length", None)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        if arch == "llama" and "rope_freqs.weight" in header.tensors:
            return _llama3_scaling(header, head_dim, theta)
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor is not None:
        cfg: dict[str, Any] = {"type": "yarn", "factor": _f32(factor)}
        if orig is not None:
            cfg["original_max_position_embeddings"] = int(orig)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (v := _meta(md, arch, f"rope.scaling.{key}", None)) is not None:
                cfg[name] = _f32(v)
        return cfg
    raise ModelFormatError(
        f"GGUF rope scaling {kind!r} is not supported; stagemesh reads linear, yarn and "
        "Llama 3 (rope_freqs) scaling. Use an MLX model directory for this model."
    )


def _llama3_scaling(header: GGUFHeader, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3's rope_scaling from the per-frequency factors llama.cpp stores.

    The converter writes ``rope_freqs`` = 1, factor, or a smooth blend per
    frequency; we take factor = max and check the rest against Meta's defaults.
    """
    info = header.tensors["rope_freqs.weight"]
    if info.ggml_type != T.F32:
        raise _unsupported_type_error(info)
    stored = _read_bytes(header.path, [info])[info.name].view("<f4")
    factor, low, high, orig = float(stored.max()), 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ModelFormatError(
            "GGUF rope_freqs does not match Llama 3 rope scaling with low/high frequency "
            "factors 1/4 and original context 8192; use an MLX model directory for this model."
        )
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def _quantization_map(header: GGUFHeader) -> dict[str, Any] | None:
    """mlx-lm quantization config from the tensor types of every 2-D weight."""
    per_module: dict[str, tuple[int, int] | None] = {}
    arch = _architecture(header)
    for name, info in header.tensors.items():
        mlx_name = arch.mlx_name(name)
        # Matrices and expert stacks (experts, out, in); norms are never quantized.
        if mlx_name is None or not mlx_name.endswith(".weight") or len(info.shape) < 2:
            continue
        bits = QUANT_BITS.get(info.ggml_type)
        per_module[mlx_name[: -len(".weight")]] = None if bits is None else (GGUF_GROUP_SIZE, bits)
    counts = Counter(v for v in per_module.values() if v is not None)
    if not counts:
        return None
    group_size, bits = counts.most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for module, gb in sorted(per_module.items()):
        if gb is None:
            quant[module] = False
        elif gb != (group_size, bits):
            quant[module] = {"group_size": gb[0], "bits": gb[1]}
    return quant


def _check_tensors(header: GGUFHeader, num_layers: int) -> None:
    arch = _architecture(header)
    for name, info in header.tensors.items():
        if name in _IGNORED_TENSORS:
            continue
        if info.ggml_type not in PLAIN_TYPES and info.ggml_type not in QUANT_BITS:
            raise _unsupported_type_error(info)
        mlx_name = arch.mlx_name(name)
        if mlx_name is None:
            raise ModelFormatError(
                f"GGUF tensor {name} has no counterpart in mlx-lm's {arch.model_type} model (the {arch.name} "
                "architecture); this file is a variant stagemesh does not serve. Use an MLX model directory."
            )
        if arch.norm_shift and mlx_name.endswith("norm.weight") and info.ggml_type not in PLAIN_TYPES:
            raise ModelFormatError(f"GGUF norm tensor {name} is {info.type_name}; a {arch.name} norm must be "
                                   "F32, F16 or BF16 (llama.cpp never quantizes norms). The file is corrupt.")
        if (m := _BLOCK_RE.match(name)) and int(m.group(1)) >= num_layers:
            raise ModelFormatError(f"GGUF tensor {name} lies beyond block_count={num_layers}; the file is corrupt.")
        if info.ggml_type in QUANT_BITS and info.shape[-1] % GGUF_GROUP_SIZE:
            raise ModelFormatError(
                f"GGUF tensor {name} has rows of {info.shape[-1]} elements; MLX's quantized layers need a "
                f"multiple of {GGUF_GROUP_SIZE}."
            )


def read_gguf_spec(path: str) -> ModelSpec:
    """The ``ModelSpec`` of the GGUF at ``path``, from its header alone.

    It reads the architectures of ``gguf_architectures`` (llama, qwen2, qwen3, qwen3moe, qwen2moe, gemma3) and
    tensor types F32, F16, BF16 and the block types of ``gguf_quants`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
    Q2_K to Q6_K). Anything else (an architecture, a tensor type, a tensor the architecture's mlx-lm model has
    no counterpart of), and a truncated or corrupt tensor table (data past the end of the file, a misaligned
    offset, tensors that overlap, a row that does not fill whole blocks), raises ``ModelFormatError``.
    """
    header = read_gguf_header(path)
    md = header.metadata
    table = _architecture(header)
    arch = table.name
    num_layers = int(_meta(md, arch, "block_count"))
    hidden = int(_meta(md, arch, "embedding_length"))
    heads = _meta(md, arch, "attention.head_count")
    kv_heads = _meta(md, arch, "attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ModelFormatError("GGUF with per-layer head counts is not supported; use a uniform-attention model.")
    heads, kv_heads = int(heads), int(kv_heads)
    head_dim = int(_meta(md, arch, "attention.key_length", hidden // heads))
    rope_dims = int(_meta(md, arch, "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFormatError(f"GGUF uses partial rotary embeddings ({rope_dims} of {head_dim} dims); not supported.")
    _check_tensors(header, num_layers)
    if "token_embd.weight" not in header.tensors:
        raise ModelFormatError(f"GGUF {path} has no token_embd.weight tensor; the file is incomplete.")
    vocab = header.tensors["token_embd.weight"].shape[0]
    tied = "output.weight" not in header.tensors
    theta = _f32(_meta(md, arch, "rope.freq_base", table.default_rope_theta))
    context = int(_meta(md, arch, "context_length", 4096))
    rope_scaling = _rope_scaling(header, arch, head_dim, theta)
    common = CommonFacts(num_layers=num_layers, hidden_size=hidden, num_heads=heads, head_dim=head_dim,
                         context_length=context, rope_scaling=rope_scaling, tensor_names=frozenset(header.tensors))
    args: dict[str, Any] = {
        "model_type": table.model_type,
        "architectures": [table.hf_architecture],
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_meta(md, arch, "attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rope_theta": theta,
        "rope_traditional": False,  # q/k rows are un-permuted on load
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "mlp_bias": False,
    }
    if (ffn := _meta(md, arch, "feed_forward_length", None)) is not None:
        args["intermediate_size"] = int(ffn)
    args.update(table.model_args(lambda key, default=...: _meta(md, arch, key, default), common))
    _check_model_args(path, table, args)
    return ModelSpec(
        path=os.path.abspath(path),
        format="gguf",
        model_type=table.model_type,
        args=args,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        quantization=_quantization_map(header),
        default_served_name=served_name_from_path(path),
        details={"gguf_version": header.version, "general.name": md.get("general.name"),
                 "general.architecture": arch, "general.file_type": md.get("general.file_type")},
    )


def _check_model_args(path: str, table: GGUFArchitecture, args: Mapping[str, Any]) -> None:
    """``ModelFormatError`` unless mlx-lm's model for the architecture takes ``args`` (metadata it needs is there)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{table.model_type}")
    try:
        module.ModelArgs.from_dict(dict(args))
    except TypeError as e:
        raise ModelFormatError(f"GGUF {path} lacks metadata mlx-lm's {table.model_type} model needs ({e}); the file "
                               f"is incomplete or not a {table.name} model.") from e


# --------------------------------------------------------------------------- tensors


def _read_bytes(path: str, infos: Iterable[GGUFTensorInfo], expected: bool = False) -> dict[str, np.ndarray]:
    """Copy each tensor's raw bytes out of the file (in file order, no mapping kept); ``expected``: the caller
    has already told ``load_progress`` of these bytes."""
    out: dict[str, np.ndarray] = {}
    infos = list(infos)
    if not expected:
        load_progress.expect(sum(info.nbytes for info in infos))
    with open(path, "rb", buffering=0) as f:
        for info in sorted(infos, key=lambda i: i.offset):
            buf = np.empty(info.nbytes, dtype=np.uint8)
            f.seek(info.offset)
            # numpy's stubs give ndarray ``__buffer__`` only for Python 3.12+, but it is a buffer on 3.11 too.
            got = f.readinto(memoryview(buf))  # type: ignore[arg-type]
            if got != info.nbytes:
                raise ModelFormatError(
                    f"{path} is truncated inside tensor {info.name}: {info.nbytes} bytes from offset "
                    f"{info.offset}, the file ends at {info.offset + (got or 0)}. Download it again."
                )
            out[info.name] = buf
            load_progress.read(info.nbytes)
    return out


def _tensor_arrays(info: GGUFTensorInfo, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Raw GGUF bytes -> {suffix: numpy array} in GGUF row order."""
    if info.ggml_type in QUANT_BITS:
        return blocks_to_affine(raw, info.ggml_type, info.shape)
    if info.ggml_type in PLAIN_TYPES:
        return {"weight": raw.view(PLAIN_TYPES[info.ggml_type]).reshape(info.shape)}
    raise _unsupported_type_error(info)


def _to_mx(arr: np.ndarray, ggml_type: int) -> mx.array:
    a = mx.array(arr)
    return a.view(mx.bfloat16) if ggml_type == T.BF16 and arr.dtype == np.uint16 else a


def _unpermute_rows(arr: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's HF->GGUF q/k row permutation (rows grouped per head)."""
    rows = arr.shape[0]
    return (
        arr.reshape(n_head, rows // n_head // 2, 2, *arr.shape[1:])
        .swapaxes(1, 2)
        .reshape(arr.shape)
    )


def convert_gguf_tensor(path: str, name: str) -> dict[str, mx.array]:
    """One GGUF tensor exactly as ``mx.load`` gives it (GGUF names, GGUF row order)."""
    info = read_gguf_header(path).tensors[name]
    raw = _read_bytes(path, [info])[name]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    out = {}
    for suffix, arr in _tensor_arrays(info, raw).items():
        key = name if suffix == "weight" else f"{base}.{suffix}"
        out[key] = _to_mx(arr, info.ggml_type)
    return out


def needed_gguf_tensors(
    header: GGUFHeader, layers: range, with_embedding: bool, with_head: bool, tied: bool
) -> list[str]:
    """Names of the GGUF tensors a stage holding ``layers`` must read."""
    wanted_layers = set(layers)
    names = []
    for name in header.tensors:
        if m := _BLOCK_RE.match(name):
            if int(m.group(1)) in wanted_layers:
                names.append(name)
        elif name.startswith("token_embd."):
            if with_embedding or (with_head and tied):
                names.append(name)
        elif name.startswith(("output_norm.", "output.")):
            if with_head:
                names.append(name)
    return names


def load_gguf_weights(
    spec: ModelSpec, layers: range, with_embedding: bool, with_head: bool, evaluate: bool = True,
    sources: dict[str, StoredGGUF] | None = None,
) -> dict[str, mx.array]:
    """Read only the slice's tensors from a GGUF and return them under mlx-lm names, the converter's quirks undone.

    Plain file reads, no mapping kept. Quantized tensors come out in MLX's affine layout (group size 32, bits
    per type and closeness to ``gguf.quants.dequantize`` as ``gguf_quants`` states: bit-identical but for Q2_K
    and Q6_K), Q4_0/Q4_1/Q8_0 bit-identical to ``mx.load(path)`` for the same GGUF tensor; the spec's
    quantization map says the same bits. llama q/k rows are un-permuted back to the Hugging Face layout (so the
    model runs with standard RoPE), and Gemma 3's norm scales, stored as ``1 + weight``, come back as
    ``weight`` in float32.

    ``evaluate=False`` (a tensor-parallel member) reads nothing: each array is an unevaluated placeholder of
    its converted shape and dtype, and ``sources`` (required then) says which blocks it comes from. The
    member reads every one of them through ``read_gguf_part``: its part of a cut tensor, the rest whole.
    """
    header = read_gguf_header(spec.path)
    table = _architecture(header)
    names = needed_gguf_tensors(header, layers, with_embedding, with_head, spec.tie_word_embeddings)
    infos = [header.tensors[n] for n in names]
    load_progress.expect(sum(info.nbytes for info in infos))
    permute = {
        "attn_q": int(spec.args["num_attention_heads"]),
        "attn_k": int(spec.args["num_key_value_heads"]),
    } if table.permuted_qk else {}
    if evaluate:
        return _converted(spec.path, table, infos, permute)
    if sources is None:
        raise ValueError("a GGUF loaded without evaluating needs sources to read its placeholders from")
    weights: dict[str, mx.array] = {}
    for info in infos:
        for key, source in _sources(spec.path, table, info, permute).items():
            weights[key] = mx.zeros(source.shape, source.dtype)  # never evaluated: the member reads it
            sources[key] = source
    return weights


@dataclass(frozen=True)
class StoredGGUF:
    """One array a GGUF tensor converts to (``suffix``: ``weight``, or a quantized one's ``scales`` or
    ``biases``), in the ``shape`` and ``dtype`` the conversion gives, by where its blocks lie."""

    path: str
    info: GGUFTensorInfo
    suffix: str
    shape: tuple[int, ...]
    dtype: mx.Dtype
    head_rows: int | None  # rows per head where llama.cpp permuted them (q, k): un-permuted per head
    norm_shift: float | None  # Gemma's norm scales, stored as shift + weight


def _sources(path: str, table: GGUFArchitecture, info: GGUFTensorInfo,
             permute: Mapping[str, int]) -> dict[str, StoredGGUF]:
    """Each array ``info``'s tensor converts to, by its mlx-lm name (as ``_converted`` names them); shapes and
    dtypes from converting the first block of one row, so they are the conversion's own."""
    mlx_name = table.mlx_name(info.name)
    assert mlx_name is not None  # _check_tensors ran when the spec was read
    module, kind = mlx_name.rsplit(".", 1)
    m = _BLOCK_RE.match(info.name)
    n_head = permute.get(m.group(2)) if m else None
    block_elements, block_bytes = _block(info)
    with open(path, "rb") as f:
        f.seek(info.offset)
        first = np.frombuffer(f.read(block_bytes), dtype=np.uint8)
    sample = _tensor_arrays(replace(info, shape=(1, block_elements)), first)
    out = {}
    for suffix, arr in sample.items():
        key = f"{module}.{kind}" if suffix == "weight" else f"{module}.{suffix}"
        shift = table.norm_shift if table.norm_shift and key.endswith("norm.weight") else None
        per_element = arr.shape[-1] / block_elements
        shape = (*info.shape[:-1], int(info.shape[-1] * per_element))
        dtype = mx.float32 if shift else _to_mx(arr, info.ggml_type).dtype
        out[key] = StoredGGUF(path, info, suffix, shape, dtype, None if n_head is None else info.shape[0] // n_head,
                              shift)
    return out


def _block(info: GGUFTensorInfo) -> tuple[int, int]:
    """(elements, bytes) of one of the tensor's blocks; a plain tensor's block is one element."""
    if info.ggml_type in PLAIN_TYPES:
        return 1, PLAIN_TYPES[info.ggml_type].itemsize
    elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    return elements, nbytes


def read_gguf_part(source: StoredGGUF, keep: tuple[tuple[range, ...], ...]) -> mx.array:
    """The part of ``source`` keeping, along each axis, the runs ``keep`` (in the converted array's indices),
    converted from the blocks of only the rows and columns it needs: each run widened to whole blocks (whole
    heads, for permuted rows), those converted and un-permuted, then the run cut out of them. The values are
    converting the whole and cutting's, since each block converts alone and llama.cpp's q/k permutation
    stays inside each head."""
    info = source.info
    block_elements, _ = _block(info)
    per_element = source.shape[-1] / info.shape[-1]  # packed codes, a value per group, or one per element
    blocks = tuple(range(int(r.start / per_element) // block_elements,
                         -(-math.ceil(r.stop / per_element) // block_elements)) for r in keep[-1])
    rows = keep[-2] if len(keep) > 1 else ()
    if source.head_rows and rows:
        rows = _widened(rows, source.head_rows)
    arr = _converted_part(source.path, info, (*keep[:-2], *([rows] if len(keep) > 1 else [])), blocks)[source.suffix]
    if source.head_rows and rows:
        arr = _unpermute_rows(arr, arr.shape[0] // source.head_rows)
        arr = _picked(arr, 0, rows, keep[-2])
    per_block = int(block_elements * per_element)
    arr = _picked(arr, arr.ndim - 1, tuple(range(b.start * per_block, b.stop * per_block) for b in blocks), keep[-1])
    if source.norm_shift is not None:
        return mx.array(_float32(arr, info.ggml_type) - np.float32(source.norm_shift))
    return _to_mx(np.ascontiguousarray(arr), info.ggml_type)


@functools.lru_cache(maxsize=1)
def _converted_part(path: str, info: GGUFTensorInfo, outer: tuple[tuple[range, ...], ...],
                    blocks: tuple[range, ...]) -> dict[str, np.ndarray]:
    """The blocks ``blocks`` of the rows ``outer`` names (every axis but the last), read and converted. The last
    one is kept: a quantized tensor's codes, scales and biases are read one after the other from the same
    blocks (``forget_converted_parts`` lets it go)."""
    block_elements, block_bytes = _block(info)
    row_bytes = info.shape[-1] // block_elements * block_bytes
    raw = read_part_array(StoredTensor(path, info.offset, "U8", (*info.shape[:-1], row_bytes)),
                          (*outer, tuple(range(b.start * block_bytes, b.stop * block_bytes) for b in blocks)))
    shape = (*raw.shape[:-1], sum(len(b) for b in blocks) * block_elements)
    return _tensor_arrays(replace(info, shape=shape), np.ascontiguousarray(raw).reshape(-1))


def forget_converted_parts() -> None:
    """Drop the part ``read_gguf_part`` converted last."""
    _converted_part.cache_clear()


def _widened(runs: tuple[range, ...], unit: int) -> tuple[range, ...]:
    """Each run widened to whole multiples of ``unit`` (pure)."""
    return tuple(range(r.start // unit * unit, -(-r.stop // unit) * unit) for r in runs)


def _picked(arr: np.ndarray, axis: int, widened: tuple[range, ...], runs: tuple[range, ...]) -> np.ndarray:
    """From ``arr``, whose ``axis`` holds the ``widened`` runs one after the other, the original ``runs``."""
    pieces, offset = [], 0
    for wide, run in zip(widened, runs):
        at = offset + run.start - wide.start
        pieces.append(arr[(slice(None),) * axis + (slice(at, at + len(run)),)])
        offset += len(wide)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)


def _converted(path: str, table: GGUFArchitecture, infos: list[GGUFTensorInfo],
               permute: Mapping[str, int]) -> dict[str, mx.array]:
    """``infos``' tensors read and converted to mlx-lm's names and layouts (``load_gguf_weights``)."""
    raw = _read_bytes(path, infos, expected=True)
    weights: dict[str, mx.array] = {}
    for info in infos:
        mlx_name = table.mlx_name(info.name)
        assert mlx_name is not None  # _check_tensors ran when the spec was read
        module, kind = mlx_name.rsplit(".", 1)
        m = _BLOCK_RE.match(info.name)
        n_head = permute.get(m.group(2)) if m else None
        for suffix, arr in _tensor_arrays(info, raw.pop(info.name)).items():
            if n_head is not None:
                arr = _unpermute_rows(arr, n_head)  # exact for quantized rows too
            key = f"{module}.{kind}" if suffix == "weight" else f"{module}.{suffix}"
            if table.norm_shift and key.endswith("norm.weight"):
                # Stored as shift + weight; float32 keeps the difference exact for every stored value near 1.
                weights[key] = mx.array(_float32(arr, info.ggml_type) - np.float32(table.norm_shift))
            else:
                weights[key] = _to_mx(arr, info.ggml_type)
    return weights


def _float32(arr: np.ndarray, ggml_type: int) -> np.ndarray:
    """A plain (F32 / F16 / BF16) tensor's values as float32."""
    if ggml_type == T.BF16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)
