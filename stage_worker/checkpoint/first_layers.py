"""A model's config cut to its first N decoder layers, its layer pattern kept (``--shape-layers N``).

Contract: ``first_layers_config(config, n)`` returns the Hugging Face ``config.json`` of a model made of the
first ``n`` decoder layers of ``config``'s (same embedding, head and layer shapes), so a benchmark can run
part of a model too big for its machine. Layer ``i`` of the cut model is layer ``i`` of the whole one.
``least_layers(config)`` is the smallest ``n`` whose cut still holds one layer of every kind the model's own
forward looks up by position; ``first_layers_config`` raises ``ModelFormatError`` for an ``n`` below it or
beyond the model's layers, naming the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stage_worker.checkpoint.model_spec import ModelFormatError

PER_LAYER_LISTS: tuple[str, ...] = ("layer_types", "no_rope_layers")
LAYER_INDEX_LISTS: tuple[str, ...] = ("mlp_only_layers",)


def least_layers(config: Mapping[str, Any]) -> tuple[int, str]:
    """The fewest first layers that keep the model's layer pattern, and why (empty when any number does).

    gpt-oss needs its first sliding and first full attention layer; Qwen3-Next a whole full-attention
    interval; Gemma 3 a whole sliding-window pattern.
    """
    least, why = 1, ""
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        kinds = sorted(set(types))
        needed = max(types.index(kind) + 1 for kind in kinds)
        if needed > least:
            least, why = needed, f"its first {needed} layers hold one of each of its layer types ({', '.join(kinds)})"
    interval = config.get("full_attention_interval")
    if config.get("model_type") == "qwen3_next" and isinstance(interval, int) and interval > least:
        least, why = interval, f"every {interval}th layer is full attention, the others linear attention"
    pattern = config.get("sliding_window_pattern")
    if config.get("model_type", "").startswith("gemma3") and isinstance(pattern, int) and pattern > least:
        least, why = pattern, f"its layers repeat {pattern - 1} sliding-window layers and a global one"
    return least, why


def first_layers_config(config: Mapping[str, Any], n: int, flag: str = "--shape-layers") -> dict[str, Any]:
    """``config`` cut to its first ``n`` decoder layers.

    * ``num_hidden_layers`` becomes ``n``;
    * per-layer lists (``PER_LAYER_LISTS``: gpt-oss's ``layer_types``, Llama 4's ``no_rope_layers``) keep their
      first ``n`` entries; lists of layer indices (``LAYER_INDEX_LISTS``: Qwen3-MoE's ``mlp_only_layers``) keep
      the indices below ``n``;
    * settings that give each layer its kind from its index stay as they are (DeepSeek's and GLM's
      ``first_k_dense_replace``, Qwen3-Next's ``full_attention_interval``, Gemma 3's ``sliding_window_pattern``,
      ``decoder_sparse_step``), so dense first layers stay first and dense.
    """
    total = int(config["num_hidden_layers"])
    least, why = least_layers(config)
    if n < 1:
        raise ModelFormatError(f"{flag} must be at least 1, got {n}")
    if n > total:
        raise ModelFormatError(f"{flag} {n} exceeds the model's {total} decoder layers; use {total} or fewer")
    if n < least:
        raise ModelFormatError(f"{flag} {n} would break the model's layer pattern: {why}; use at least {least}")
    cut = {**config, "num_hidden_layers": n}
    for key in PER_LAYER_LISTS:
        if isinstance(config.get(key), list):
            cut[key] = config[key][:n]
    for key in LAYER_INDEX_LISTS:
        if isinstance(config.get(key), list):
            cut[key] = [i for i in config[key] if i < n]
    return cut
