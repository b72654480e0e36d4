"""A pipeline stage's weights, whatever the file format.

Contract: ``load_stage_weights(spec, layers, with_embedding, with_head)``
returns ``mx.array``s (lazy with ``evaluate=False``) named exactly as mlx-lm's
``mlx_lm.models.<spec.model_type>.Model`` names its parameters, with GLOBAL
layer indices (``model.layers.12...``), holding only:
- ``model.layers.{i}.*`` for i in ``layers``;
- ``model.embed_tokens.*`` if ``with_embedding``, or if ``with_head`` and the
  embeddings are tied (the head multiplies by the embedding matrix);
- ``model.norm.weight`` and (untied) the head (``lm_head.*``, ``output.*``) if ``with_head``.
A bad layer range raises ``ModelFormatError``.

A spec read with ``--load-format dummy`` gets random weights of the same names
and shapes instead (``dummy_weights``), made directly in ``dtype``; weights read
from files keep their stored dtype (``StageModel.load`` casts them).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec


def check_layer_range(spec: ModelSpec, layers: range) -> None:
    """Raise unless ``layers`` is a non-empty contiguous slice of the model's layers."""
    if not isinstance(layers, range) or layers.step != 1:
        raise ModelFormatError(f"layers must be a contiguous range with step 1, got {layers!r}.")
    if not (0 <= layers.start < layers.stop <= spec.num_layers):
        raise ModelFormatError(
            f"layer range [{layers.start}, {layers.stop}) does not fit the model's "
            f"{spec.num_layers} layers; use a non-empty range within [0, {spec.num_layers})."
        )


def load_stage_weights(
    spec: ModelSpec, layers: range, with_embedding: bool, with_head: bool, *, dtype: mx.Dtype = mx.float32,
    evaluate: bool = True, sources: dict[str, Any] | None = None,
) -> dict[str, mx.array]:
    """Load (and, with ``evaluate``, evaluate) only the tensors of one stage (generate them, for dummy
    weights). ``evaluate=False`` reads nothing yet (from a GGUF not even lazily) and makes no dummy weight yet:
    a tensor-parallel member cuts the lazy arrays to its share before they are evaluated, so it never holds
    the whole stage. ``sources``, if given, is filled with where each tensor loaded lazily lies in its file (a
    safetensors ``StoredTensor``; a GGUF's ``StoredGGUF``, whose returned array is a placeholder never to be
    evaluated), for such a member to read its part alone."""
    check_layer_range(spec, layers)
    # Each format's loader is imported only for a model of that format.
    if spec.random_weights:
        from stage_worker.checkpoint.dummy_weights import dummy_stage_weights

        weights = dummy_stage_weights(spec, layers, with_embedding, with_head, dtype, evaluate)
    elif spec.format == "gguf":
        from stage_worker.checkpoint.gguf.format import load_gguf_weights

        weights = load_gguf_weights(spec, layers, with_embedding, with_head, evaluate, sources)
    elif spec.format == "mlx":
        from stage_worker.checkpoint.safetensors_format import load_safetensors_weights

        weights = load_safetensors_weights(spec, layers, with_embedding, with_head, evaluate, sources)
    else:
        raise ModelFormatError(f"unknown model format {spec.format!r}; expected 'gguf' or 'mlx'.")
    _check_complete(spec, weights, layers, with_embedding, with_head)
    if evaluate:
        mx.eval(list(weights.values()))
    return weights


def _check_complete(
    spec: ModelSpec, weights: dict[str, mx.array], layers: range, with_embedding: bool, with_head: bool
) -> None:
    """Fail loudly on a file that lacks a tensor the stage needs."""
    held_layers = {int(name.split(".", 3)[2]) for name in weights if name.startswith("model.layers.")}
    expected = [f"model.layers.{i}.*" for i in layers if i not in held_layers]
    if with_embedding or (with_head and spec.tie_word_embeddings):
        expected.append("model.embed_tokens.weight")
    if with_head:
        expected.append("model.norm.weight")
    missing = [name for name in expected if name.endswith("*") or name not in weights]
    if missing:
        raise ModelFormatError(f"{spec.path} lacks tensors this stage needs: {', '.join(missing[:5])}.")
