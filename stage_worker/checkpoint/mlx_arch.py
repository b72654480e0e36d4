"""Which mlx-lm architectures a pipeline stage runs, and by which path; refused ones by name, with the reason.

* ``mlx_model_type(config)`` is the ``mlx_lm.models`` module a Hugging Face ``config.json`` is implemented by
  (mlx-lm's own remapping: ``mistral`` -> ``llama``, ``kimi_k2`` -> ``deepseek_v3``, ...).
* ``check_servable(model_type)`` raises ``ModelFormatError`` (exit 2, before any stage loads) naming the model
  type, why it cannot be split across stages when that is the reason, and what is served:
  ``PACKED_ARCHITECTURES`` (``packed_forward``) and ``STACK_ARCHITECTURES`` (``layer_stack``: mlx-lm's own
  layers and caches). An mlx-lm architecture not among them is refused rather than risked.
* ``describe(model_type, args)`` builds mlx-lm's model lazily (shapes only, nothing allocated) and returns
  ``ArchFacts``: the kind of cache each layer holds, whether its attention needs array masks, the names of its
  head parameters, and whether the prefix cache can restart a sequence from a copy of another's first
  positions (``exact_prefix_reuse``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import KVCacheDtype, check_head_dims

# Run by ``packed_forward`` (these with full attention); the stack ones by ``layer_stack``.
PACKED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
STACK_ARCHITECTURES: tuple[str, ...] = (
    "deepseek_v3", "gemma3_text", "glm4_moe", "gpt_oss", "llama4_text", "mixtral", "olmoe", "phi3",
    "qwen2_moe", "qwen3_moe", "qwen3_next",
)
# Architectures whose layers need state from layers of other stages: refused with the reason.
UNSPLITTABLE: Mapping[str, str] = {
    "gemma4_text": "its later layers reuse the keys and values of earlier layers (KV sharing) and every layer "
                   "takes per-layer inputs computed from the token embeddings, state that spans the whole model",
    "gemma4": "its later layers reuse the keys and values of earlier layers (KV sharing) and every layer takes "
              "per-layer inputs computed from the token embeddings, state that spans the whole model",
    "gemma3n": "its layers share keys and values across the model and mix every layer's alternating-update "
               "streams with per-layer inputs from the token embeddings, state that spans the whole model",
}


@dataclass(frozen=True)
class ArchFacts:
    """What a stage needs to know about an architecture's mlx-lm implementation."""

    cache_kinds: tuple[str, ...]  # per layer: "kv", "rotating", "arrays" or another cache class's name
    array_masks: bool  # the attention takes masks only as arrays (MLA adds them to its rotary scores)
    head_names: tuple[str, ...]  # parameters outside ``model.``: the output projection when untied
    windows: tuple[int | None, ...]  # per layer: the rotating cache's size, None for the others

    @property
    def exact_prefix_reuse(self) -> bool:
        """Every layer keeps plain keys and values per position, so a prefix copied from another sequence is
        exactly what prefilling it would hold. A sliding window has dropped the positions a copy would need
        and a recurrent state cannot be cut at a position, so those models are served without prefix reuse."""
        return all(kind == "kv" for kind in self.cache_kinds)


def mlx_model_type(config: Mapping[str, Any]) -> str | None:
    """mlx-lm's module for a config.json, or None without a ``model_type``."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    from mlx_lm.utils import MODEL_REMAPPING

    return str(MODEL_REMAPPING.get(model_type, model_type))


def served_architectures() -> tuple[str, ...]:
    return PACKED_ARCHITECTURES + STACK_ARCHITECTURES


def check_servable(model_type: str | None, where: str) -> None:
    """Raise ``ModelFormatError`` unless a stage can run ``model_type`` (see the module docstring).

    Each served architecture is run in the test suite against mlx-lm's own generation
    (``tests/architectures.py``); any other is refused, since a model whose forward does more than
    ``h = layer(h, mask, cache)`` between its embedding and its norm would give wrong tokens silently."""
    served = ", ".join(served_architectures())
    if model_type is not None and model_type in UNSPLITTABLE:
        raise ModelFormatError(
            f"{where} is a {model_type!r} model, which cannot be split across pipeline stages: "
            f"{UNSPLITTABLE[model_type]}. stagemesh serves {served}."
        )
    if model_type not in served_architectures():
        known = model_type is not None and importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None
        why = ("mlx-lm implements it, but stagemesh has not verified its split against mlx-lm's own generation yet"
               if known else "mlx-lm has no implementation of it")
        raise ModelFormatError(f"{where} is a {model_type!r} model; {why}. stagemesh serves {served}.")


def describe(model_type: str, args: Mapping[str, Any]) -> ArchFacts:
    """Facts of mlx-lm's model for ``args`` (built lazily: nothing is allocated)."""
    return _describe(model_type, json.dumps(dict(args), sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _describe(model_type: str, args_json: str) -> ArchFacts:
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(json.loads(args_json)))
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.model.layers]
    kinds, windows = [], []
    for cache in caches:
        if type(cache) is KVCache:
            kinds.append("kv")
        elif isinstance(cache, RotatingKVCache):
            kinds.append("rotating")
        elif isinstance(cache, ArraysCache):
            kinds.append("arrays")
        else:
            kinds.append(type(cache).__name__)
        windows.append(getattr(cache, "max_size", None))
    # mlx annotates tree_flatten as returning a list or a dict; without ``destination`` it is the list.
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    names = [name for name, _ in flat]
    inner = type(model.model)
    source = inspect.getsource(inner)
    return ArchFacts(cache_kinds=tuple(kinds), array_masks="return_array=True" in source,
                     head_names=tuple(n for n in names if not n.startswith("model.")), windows=tuple(windows))


def exact_prefix_reuse(spec: ModelSpec) -> bool:
    """Whether the prefix cache may start ``spec``'s sequences from copies of others' first positions."""
    return describe(spec.model_type, spec.args).exact_prefix_reuse


# Cache kinds whose whole state mlx-lm keeps in array attributes (a copy of them is the state): a sequence's
# end state can be kept and restored whole (``stage_worker.cache.kv_store``).
WHOLE_STATE_KINDS = frozenset({"kv", "rotating", "arrays"})


def whole_state_reuse(spec: ModelSpec) -> bool:
    """Whether the prefix cache may start ``spec``'s sequences from a copy of a finished sequence's whole state
    (the models whose layers cannot be cut at a position: sliding windows, recurrent state)."""
    return all(kind in WHOLE_STATE_KINDS for kind in describe(spec.model_type, spec.args).cache_kinds)


# Architectures whose plain KV layers are served quantized (``--kv-cache-dtype q8|q4``), each tested equal to
# mlx-lm's generate over QuantizedKVCache: their attention reads keys and values through mlx-lm's
# ``scaled_dot_product_attention``, which takes the quantized path. gpt_oss adds attention sinks, which that
# path refuses; DeepSeek's MLA keeps a latent, not keys and values.
QUANTIZED_KV_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "mixtral")


def check_kv_cache_dtype(spec: ModelSpec, kv_dtype: KVCacheDtype) -> None:
    """Refuse a quantized ``--kv-cache-dtype`` that ``spec``'s layers cannot take, naming what works (pure but for
    mlx-lm's lazy model description)."""
    if not kv_dtype.quantized:
        return
    if spec.model_type not in QUANTIZED_KV_ARCHITECTURES:
        why = (" (its attention adds sinks, which mlx-lm's quantized attention cannot take)"
               if spec.model_type == "gpt_oss" else "")
        raise UserError(f"--kv-cache-dtype {kv_dtype.name}: {spec.model_type}{why} is not served with quantized KV; "
                        f"serve it with --kv-cache-dtype auto (quantized KV: {', '.join(QUANTIZED_KV_ARCHITECTURES)})")
    if "kv" not in describe(spec.model_type, spec.args).cache_kinds:
        raise UserError(f"--kv-cache-dtype {kv_dtype.name}: no layer of {spec.model_type} keeps plain keys and values "
                        "(only sliding windows or recurrent state, which stay in the compute dtype); use auto")
    args = spec.args
    heads = int(args["num_attention_heads"])
    head_dim = int(args.get("head_dim") or int(args["hidden_size"]) // heads)
    check_head_dims(kv_dtype, {"its attention heads": head_dim})
