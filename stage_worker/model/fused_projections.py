"""Fused projections: a decoder layer's q/k/v as one matmul, and its MLP's gate/up as one.

Contract:
* ``fuse_layer_projections(layer)`` rewrites one loaded mlx-lm decoder layer (llama, qwen2, qwen3) in place:
  ``self_attn.{q,k,v}_proj`` become one ``self_attn.qkv_proj`` and ``mlp.{gate,up}_proj`` one
  ``mlp.gate_up_proj``, holding the same bytes; projections that cannot be joined stay as they are, and it
  says which it fused (``FusedLayer``).
* ``fusion_wanted(setting, backend)`` decides whether a stage joins them (``STAGEMESH_FUSE_PROJECTIONS``).
* ``attention_projections(attn, x)`` and ``feed_forward(mlp, x)`` compute a layer's projections whichever form
  it is in. Once fused, a layer runs only through them (``packed_forward``); mlx-lm's own ``__call__`` would
  look for the projections that are gone.
* Results can differ from the unfused layer's in the last bits; every stage of a pipeline fuses alike, so a
  PP=N pipeline stays bit-identical to PP=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from stage_worker.model.sibling_projections import joined_layer
from stagemesh_core import settings


def fusion_wanted(setting: str, backend: str) -> bool:
    """``STAGEMESH_FUSE_PROJECTIONS`` (auto, on, off) on ``backend`` (pure): auto joins on GPU backends.

    On a GPU a decode step is bound by the host, which builds its graph op by op in Python and launches a
    kernel per op. One projection instead of three, and one instead of two, removes three of a layer's seven
    matmuls, their launches and the Python that builds them, and hands the GPU wider matrices
    (docs/performance.md has the figures). On the CPU backend the step is bound by the arithmetic, not the
    host, and the joined layers are slower there: the strided q/k/v and gate/up views cost the CPU kernels
    more than three fewer GEMM calls save (docs/performance.md). Metal, like CUDA, launches a kernel per op
    from the host; it is joined there on the same reasoning, unmeasured.
    """
    return settings.switched_on(setting, auto=backend != "cpu")


@dataclass(frozen=True)
class FusedLayer:
    """What ``fuse_layer_projections`` joined in one layer."""

    qkv: bool
    gate_up: bool


def fuse_layer_projections(layer: nn.Module) -> FusedLayer:
    """Join ``layer``'s q/k/v and gate/up projections in place.

    ``qkv_proj``'s output is q's rows, then k's, then v's; ``gate_up_proj``'s is gate's rows, then up's.
    Weights, quantization scales and biases are concatenated along the output dimension, so the bytes held are
    the same. Projections that cannot be joined (one quantized and one not, different bits or group sizes, a
    bias on some only) stay as they are.

    Each output element is the same dot product as in the unfused layer, but a GEMM library may block a wider
    matrix differently, so results can differ from it in the last bits: on CUDA, and on the CPU with an
    optimized BLAS (what a stage preloads); MLX's own reference BLAS gives identical results.
    """
    attn, mlp = layer.self_attn, layer.mlp
    qkv = joined_layer([attn.q_proj, attn.k_proj, attn.v_proj])
    if qkv is not None:
        attn.qkv_proj = qkv
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)
    gate_up = joined_layer([mlp.gate_proj, mlp.up_proj])
    if gate_up is not None:
        mlp.gate_up_proj = gate_up
        delattr(mlp, "gate_proj")
        delattr(mlp, "up_proj")
    # Materialised layer by layer, so the parts' memory is freed as we go: a stage's whole weights are
    # never held twice.
    mx.eval([m.parameters() for m in (qkv, gate_up) if m is not None])
    return FusedLayer(qkv=qkv is not None, gate_up=gate_up is not None)


def attention_projections(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``[rows, hidden]`` -> queries ``[rows, heads, dim]``, keys and values ``[rows, kv_heads, dim]``."""
    rows, heads, kv_heads = x.shape[0], attn.n_heads, attn.n_kv_heads
    if "qkv_proj" in attn:
        # Split by heads after one reshape: the three are strided views of the one output, no copies.
        joined = attn.qkv_proj(x).reshape(rows, heads + 2 * kv_heads, -1)
        return joined[:, :heads], joined[:, heads : heads + kv_heads], joined[:, heads + kv_heads :]
    return (attn.q_proj(x).reshape(rows, heads, -1), attn.k_proj(x).reshape(rows, kv_heads, -1),
            attn.v_proj(x).reshape(rows, kv_heads, -1))


def feed_forward(mlp: nn.Module, x: mx.array) -> mx.array:
    """The layer's MLP on ``[rows, hidden]``: ``down(silu(gate(x)) * up(x))``, as mlx-lm's ``MLP``."""
    if "gate_up_proj" in mlp:
        joined = mlp.gate_up_proj(x)
        half = joined.shape[-1] // 2
        return mlp.down_proj(swiglu(joined[..., :half], joined[..., half:]))
    return mlp(x)
