"""GGML quantized blocks -> MLX affine arrays (codes packed in uint32, a scale and a bias per group of 32).

Contract:
- ``AFFINE_BITS`` maps each GGML block type we read to the bits of the MLX affine layout (group size
  ``GROUP_SIZE`` = 32) it lands in; ``EXACT_TYPES`` are those whose values land unchanged.
- ``blocks_to_affine(raw, ggml_type, shape)`` turns a tensor's raw block bytes into ``{"weight", "scales",
  "biases"}`` in MLX's layout; a byte count that does not match ``shape`` raises ``ValueError``.
- The values MLX dequantizes (``scale * code + bias`` in float32) equal ``gguf.quants.dequantize``'s bit for
  bit for ``EXACT_TYPES``. Q2_K and Q6_K, which scale 16-element sub-blocks, are requantized to 8 bits per
  group of 32: no value moves by more than ``(max - min) / 510`` of its group, plus float32 rounding.
- Every type but Q4_0, Q4_1 and Q8_0 gives float32 scales and biases; a stage casts them to its compute dtype,
  which rounds them like any dense weight in float16 or bfloat16.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
GROUP_SIZE = 32
# GGML block type -> bits of the MLX affine layout (group size 32) it converts to.
AFFINE_BITS: Mapping[int, int] = {
    T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8, T.Q5_0: 5, T.Q5_1: 5, T.IQ4_NL: 8,
    T.Q2_K: 8, T.Q3_K: 8, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 8,
}
# Types whose MLX values equal gguf's dequantized values exactly (the rest are requantized: ``blocks_to_affine``).
EXACT_TYPES = frozenset(AFFINE_BITS) - {T.Q2_K, T.Q6_K}

_CHUNK_ELEMENTS = 1 << 19
_MAX_THREADS = 8
_IQ4_NL_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)

# A decoder: (n_blocks, block_bytes) uint8 -> per group of 32: codes (n_groups, 32) uint8, scales, biases.
Affine = tuple[np.ndarray, np.ndarray, np.ndarray]


def blocks_to_affine(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A tensor's GGML blocks as MLX affine ``weight``/``scales``/``biases``.

    ``shape`` is in numpy order, rows first. ``weight`` is ``(*rows, cols * bits / 32)`` uint32 (MLX's packing:
    element j at bits ``[bits*j, bits*(j+1))`` of the row's little-endian bit stream), ``scales`` and
    ``biases`` are ``(*rows, cols / 32)``. Decoding is vectorised numpy over chunks of blocks, on a few threads.

    How close the values are to ``gguf.quants.dequantize``:
    - bit-identical: Q4_0, Q4_1, Q8_0 (float16 scales and biases, exactly ``mx.load``'s own layout); Q5_0,
      Q5_1 (5-bit); Q4_K, Q5_K (4/5-bit, scale ``d*sc``, bias ``-dmin*m`` of each 32-element sub-block);
      Q3_K (8-bit: every value of a Q3_K block is ``d`` times an integer in [-124, 128], so code ``128 - n``,
      scale ``-d``, bias ``128*d``); IQ4_NL (8-bit: ``d`` times a table entry in [-127, 113], so code
      ``128 + entry``, scale ``d``, bias ``-128*d``).
    - requantized: Q2_K and Q6_K scale 16-element sub-blocks, a group MLX does not have; each group of 32 of
      their exact float32 values is requantized to 8 bits over its own [min, max] (``_requantize_8bit``), so no
      value moves by more than ``(max - min) / 510`` of its group (for Q6_K, whose values lie within 32 steps
      of zero, an eighth of the larger sub-block step) plus float32 rounding.
    Every type but the first three gives float32 scales and biases (``d*sc`` needs 17 bits of mantissa).
    """
    block_elements, block_bytes = GGML_QUANT_SIZES[T(ggml_type)]
    n_elements = math.prod(shape)
    if shape[-1] % block_elements or raw.size != n_elements // block_elements * block_bytes:
        raise ValueError(
            f"{raw.size} bytes of {T(ggml_type).name} blocks do not hold a tensor of shape {shape} "
            f"({block_elements}-element blocks of {block_bytes} bytes)"
        )
    blocks, bits, decode = raw.reshape(-1, block_bytes), AFFINE_BITS[ggml_type], _DECODERS[ggml_type]

    def convert(start: int) -> Affine:
        codes, scales, biases = decode(blocks[start : start + chunk])
        # Every group of 32 codes packs into whole uint32 words, so groups pack alone, in row order.
        return pack_codes(codes.reshape(-1, GROUP_SIZE), bits), scales, biases

    # Chunks small enough for the CPU caches (numpy's temporaries then stay in them), on threads: numpy
    # releases the GIL inside its loops.
    chunk = max(1, _CHUNK_ELEMENTS // block_elements)
    starts = range(0, blocks.shape[0], chunk)
    if len(starts) == 1:
        parts = [convert(0)]
    else:
        with ThreadPoolExecutor(min(_MAX_THREADS, os.cpu_count() or 1)) as pool:
            parts = list(pool.map(convert, starts))
    return {key: np.concatenate([part[i] for part in parts]).reshape(*shape[:-1], -1)
            for i, key in enumerate(("weight", "scales", "biases"))}


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) codes below 2**bits -> (rows, cols*bits/32) uint32 in MLX's bit-stream order."""
    rows, cols = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8).view("<u4")
    if bits == 4:
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return np.ascontiguousarray(pairs).view("<u4")
    # 3, 5, 6 bits: eight codes fill ``bits`` bytes; build them in a uint64 and keep its low bytes.
    eights = codes.reshape(rows, cols // 8, 8).astype(np.uint64)
    word = np.zeros(eights.shape[:-1], np.uint64)
    for j in range(8):
        word |= eights[..., j] << np.uint64(bits * j)
    as_bytes = word.view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return np.ascontiguousarray(as_bytes).reshape(rows, -1).view("<u4")


# --------------------------------------------------------------------------- shared pieces


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 (n_blocks, 1)."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view("<f2").astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32-element block -> 32 nibbles: element i in the low nibble of byte i, i+16 in the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    """(..., n) bytes -> (..., count, n): field k (``width`` bits wide, from the low end) of every byte."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(count, 1)
    return (packed[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per block (llama.cpp's get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _requantize_8bit(values: np.ndarray) -> Affine:
    """Exact float32 values -> 8-bit affine over each group of 32, spanning the group's [min, max]."""
    groups = values.reshape(-1, GROUP_SIZE)
    low = groups.min(axis=1, keepdims=True)
    step = (groups.max(axis=1, keepdims=True) - low) / np.float32(255)
    inverse = np.divide(1, step, out=np.zeros_like(step), where=step > 0)  # a constant group: every code 0
    scaled = groups - low
    scaled *= inverse
    np.rint(scaled, out=scaled)
    np.clip(scaled, 0, 255, out=scaled)
    return scaled.astype(np.uint8), step[:, 0], low[:, 0]


def _per_group(value: np.ndarray) -> np.ndarray:
    return value.reshape(-1).astype(np.float32)


# --------------------------------------------------------------------------- 32-element blocks


def _q4_0(blocks: np.ndarray) -> Affine:
    d = np.ascontiguousarray(blocks[:, 0:2]).view("<f2")[:, 0]
    return _nibbles32(blocks[:, 2:18]), d, (np.float32(-8) * d.astype(np.float32)).astype(np.float16)  # d*(q-8)


def _q4_1(blocks: np.ndarray) -> Affine:
    d = np.ascontiguousarray(blocks[:, 0:2]).view("<f2")[:, 0]
    m = np.ascontiguousarray(blocks[:, 2:4]).view("<f2")[:, 0]
    return _nibbles32(blocks[:, 4:20]), d, m  # d*q + m


def _q8_0(blocks: np.ndarray) -> Affine:
    d = np.ascontiguousarray(blocks[:, 0:2]).view("<f2")[:, 0]
    # int8 q -> q + 128 unsigned (flip the sign bit); d*q = d*(q+128) - 128d.
    return blocks[:, 2:34] ^ 0x80, d, (np.float32(-128) * d.astype(np.float32)).astype(np.float16)


def _q5_codes(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1: low nibbles as in Q4_0, the fifth bit of element i is bit i of the little-endian uint32 qh."""
    qh = _bits_of(blocks[:, qh_at : qh_at + 4], 8, 1).transpose(0, 2, 1).reshape(-1, 32)
    return _nibbles32(blocks[:, qh_at + 4 : qh_at + 20]) | (qh << 4)


def _q5_0(blocks: np.ndarray) -> Affine:
    d = _f16(blocks, 0)
    return _q5_codes(blocks, 2), _per_group(d), _per_group(np.float32(-16) * d)  # d*(q-16)


def _q5_1(blocks: np.ndarray) -> Affine:
    return _q5_codes(blocks, 4), _per_group(_f16(blocks, 0)), _per_group(_f16(blocks, 2))  # d*q + m


def _iq4_nl(blocks: np.ndarray) -> Affine:
    d = _f16(blocks, 0)
    codes = (_IQ4_NL_TABLE[_nibbles32(blocks[:, 2:18])] + 128).astype(np.uint8)  # d*entry = d*(code-128)
    return codes, _per_group(d), _per_group(np.float32(-128) * d)


# --------------------------------------------------------------------------- 256-element super-blocks


def _q4_k(blocks: np.ndarray) -> Affine:
    # d, dmin, 12 bytes of scales/mins, then 4 chunks of 32 bytes: sub-block 2c in the low, 2c+1 in the high nibbles.
    scales, mins = _k_scales(blocks[:, 4:16])
    codes = _bits_of(blocks[:, 16:144].reshape(-1, 4, 32), 2, 4)
    return _k_affine(blocks, codes, scales, mins)


def _q5_k(blocks: np.ndarray) -> Affine:
    # As Q4_K, with the fifth bit of sub-block j's element i at bit j of qh byte i.
    scales, mins = _k_scales(blocks[:, 4:16])
    low = _bits_of(blocks[:, 48:176].reshape(-1, 4, 32), 2, 4).reshape(-1, 8, 32)
    high = _bits_of(blocks[:, 16:48], 8, 1)
    return _k_affine(blocks, low | (high << 4), scales, mins)


def _k_affine(blocks: np.ndarray, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> Affine:
    """Q4_K/Q5_K: w = d*sc*q - dmin*m per 32-element sub-block, which is MLX affine as it stands."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return codes.reshape(-1, 32), _per_group(d * scales), _per_group(-(dmin * mins))


def _q3_k(blocks: np.ndarray) -> Affine:
    # hmask (32 bytes), 2-bit codes (64), 12 bytes of 6-bit scales, d; w = d*(sc-32)*q per 16 elements, with q
    # the 2-bit code less 4 where its hmask bit is clear.
    n = blocks.shape[0]
    low = _bits_of(blocks[:, 32:96].reshape(n, 2, 32), 4, 2).reshape(n, 16, 16)
    high = _bits_of(blocks[:, 0:32], 8, 1).reshape(n, 16, 16)
    packed = blocks[:, 96:108]
    low_sc = _bits_of(packed[:, 0:8], 2, 4).reshape(n, 16)
    high_sc = _bits_of(packed[:, 8:12], 4, 2).reshape(n, 16)
    scales = (low_sc | (high_sc << 4)).astype(np.int16) - 32
    q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))  # the offset is 4 when the mask bit is clear
    n_int = scales[:, :, None] * q  # in [-124, 128]: one 8-bit grid of step d holds every value
    d = _f16(blocks, 108)
    return (128 - n_int).astype(np.uint8).reshape(-1, 32), _per_group(np.repeat(-d, 8, 1)), _per_group(
        np.repeat(np.float32(128) * d, 8, 1))


def _q2_k(blocks: np.ndarray) -> Affine:
    # 16 bytes of (min << 4 | scale), 2-bit codes (64 bytes), d, dmin; w = d*sc*q - dmin*m per 16 elements.
    n = blocks.shape[0]
    packed = blocks[:, 0:16]
    q = _bits_of(blocks[:, 16:80].reshape(n, 2, 32), 4, 2).reshape(n, 16, 16).astype(np.float32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scale = (d * (packed & 0x0F).astype(np.float32))[:, :, None]
    low = (dmin * (packed >> 4).astype(np.float32))[:, :, None]
    return _requantize_8bit(scale * q - low)


def _q6_k(blocks: np.ndarray) -> Affine:
    # 4-bit lows (128), 2-bit highs (64), 16 int8 scales, d; w = d*sc*(q - 32) per 16 elements.
    n = blocks.shape[0]
    # Sub-block of 32 number 4*half + f: lows from nibble f//2 of ql bytes 64*half + 32*(f%2) + i, highs from
    # field f of qh byte 32*half + i.
    low = _bits_of(blocks[:, 0:128].reshape(n, 2, 64), 2, 4).reshape(n, 2, 4, 32)
    high = _bits_of(blocks[:, 128:192].reshape(n, 2, 32), 4, 2)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    scale = (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    return _requantize_8bit(scale * q)


_DECODERS: Mapping[int, Callable[[np.ndarray], Affine]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.IQ4_NL: _iq4_nl,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
