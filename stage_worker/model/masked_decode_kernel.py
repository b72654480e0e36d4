"""Masked decode attention as one CUDA kernel: each row's one query over its own window of a batch KV buffer.

A decode group's rows hold histories of different lengths, left-padded in one ``BatchKVCache`` buffer
(``kv_store``), so their attention needs a mask, and MLX's CUDA backend has no fused kernel for that.

Contract: ``attend(q, keys, values, starts, end, scale)`` with ``q`` ``[B, Hq, 1, D]`` and the cache's whole
buffers ``keys`` / ``values`` ``[B, Hkv, capacity, D]`` (``Hq`` a multiple of ``Hkv``), returns ``[B, Hq, 1, D]``:
row ``b``'s query attends to positions ``starts[b] <= j < end`` of its buffer row, exactly the positions
``BatchKVCache.make_mask(1)`` leaves visible. Results equal the unfused path's up to float rounding, not bit for
bit. ``supported`` says where it applies; everywhere else the caller keeps mlx-lm's attention.
``decode_kernel_wanted`` reads the ``STAGEMESH_DECODE_KERNEL`` setting.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import cast

import mlx.core as mx

_WARPS = 4  # warps per (row, query head); each takes every _WARPS-th key of the window

# Without this kernel MLX's CUDA backend (its vector attention takes no array mask) falls back to two
# matmuls, a select and a softmax per layer: four kernels and their graph nodes where an unmasked decode has
# one. Softmax in float32, online per warp, the warps combined at the end (the shape of MLX's own vector kernel).
_SOURCE = """
    constexpr int PER_LANE = D / 32;
    const float neg_inf = -__int_as_float(0x7f800000);  // MLX 0.32 defines no inf for custom kernels
    const int bh = blockIdx.x;            // row * HQ + query head
    const int row = bh / HQ;
    const int kv_head = (bh % HQ) / (HQ / HKV);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int capacity = keys_shape[2];
    const int start = starts[row];
    const int stop = end[0];
    const float s = scale[0];

    float qr[PER_LANE];
    const T* qp = q + (size_t)bh * D + lane * PER_LANE;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) qr[i] = static_cast<float>(qp[i]) * s;

    float m = neg_inf, l = 0.f, acc[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;

    const size_t base = ((size_t)row * HKV + kv_head) * capacity * D + lane * PER_LANE;
    for (int j = start + warp; j < stop; j += WARPS) {
        const T* kp = keys + base + (size_t)j * D;
        float dot = 0.f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) dot += qr[i] * static_cast<float>(kp[i]);
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, offset);
        const float m_new = fmaxf(m, dot);
        const float correction = __expf(m - m_new);
        const float p = __expf(dot - m_new);
        l = l * correction + p;
        const T* vp = values + base + (size_t)j * D;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[i] = acc[i] * correction + p * static_cast<float>(vp[i]);
        m = m_new;
    }

    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][D];
    if (lane == 0) { warp_max[warp] = m; warp_sum[warp] = l; }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) warp_acc[warp][lane * PER_LANE + i] = acc[i];
    __syncthreads();

    float top = neg_inf;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_max[w]);
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        float num = 0.f, den = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            // a warp that saw no key has max -inf and weighs nothing
            const float f = warp_max[w] == neg_inf ? 0.f : __expf(warp_max[w] - top);
            num += f * warp_acc[w][d];
            den += f * warp_sum[w];
        }
        out[(size_t)bh * D + d] = static_cast<T>(num / den);
    }
"""

_kernel: Callable[..., list[mx.array]] | None = None  # built on first use: building it needs a CUDA device
_scales: dict[float, mx.array] = {}


def decode_kernel_wanted(setting: str, backend: str) -> bool:
    """``STAGEMESH_DECODE_KERNEL`` (auto, off) on ``backend`` (pure): auto uses the kernel on CUDA."""
    return setting == "auto" and backend == "cuda"


def supported(q: mx.array, keys: mx.array) -> bool:
    """Whether ``attend`` applies: a CUDA device, one query per row, a head dimension MLX's layouts use (a
    multiple of 32 up to 256), float dtypes."""
    head_dim = q.shape[-1]
    return (q.ndim == 4 and q.shape[2] == 1 and head_dim % 32 == 0 and head_dim <= 256
            and keys.shape[-1] == head_dim and q.shape[1] % keys.shape[1] == 0
            and q.dtype in (mx.float16, mx.bfloat16, mx.float32) and keys.dtype == q.dtype
            and _cuda_available())


def attend(q: mx.array, keys: mx.array, values: mx.array, starts: mx.array, end: mx.array,
           scale: float) -> mx.array:
    """``[B, Hq, 1, D]``: each row's query over positions ``starts[b] <= j < end[0]`` of its buffers (module
    docstring). ``starts`` int32 ``[B]``, ``end`` int32 ``[1]``: arrays, so a new step is no new kernel.
    Kernels are compiled once per (head dimension, query heads, key/value heads, dtype) by MLX's JIT and cached
    by it; the scale is an input, not a constant."""
    global _kernel
    if _kernel is None:
        _kernel = cast(Callable[..., list[mx.array]], mx.fast.cuda_kernel(
            name="stagemesh_masked_decode", input_names=["q", "keys", "values", "starts", "end", "scale"],
            output_names=["out"], source=_SOURCE))
    batch, q_heads, _, head_dim = q.shape
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    threads = _WARPS * 32
    (out,) = _kernel(inputs=[q, keys, values, starts, end, _scales[scale]],
                     template=[("T", q.dtype), ("D", head_dim), ("HQ", q_heads), ("HKV", keys.shape[1]),
                               ("WARPS", _WARPS)],
                     grid=(batch * q_heads * threads, 1, 1), threadgroup=(threads, 1, 1),
                     output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out


@cache  # asked for every layer of every decode step; the answer never changes within a process
def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())
