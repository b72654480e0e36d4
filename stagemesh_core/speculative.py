"""Speculative decoding's configuration: vLLM's ``--speculative-config`` JSON, parsed and checked in one place.

Contract:
- ``SpeculativeConfig`` is the frozen, checked form. ``parse_speculative_config(text)`` reads the flag's JSON
  (vLLM's keys and defaults) and raises ``SpeculativeConfigError`` (a ``UserError``) naming the key to change.
- Two methods: ``ngram`` (prompt lookup) and ``draft_model`` (a small mlx-lm model at ``model``, a path; vLLM
  takes ``"model"`` alone to mean this method). Whether the path holds a model whose vocabulary is the
  target's is checked where both are read (``stage_worker.speculation.draft_proposer.check_draft_model``), not here.
- ``disable_by_batch_size`` (vLLM's key): no sequence speculates while more than this many run; unset, the
  entry stage's backend decides (``SpeculativeConfig.limit_for``).
- ``to_json`` / ``from_json`` are the form the launch plan carries to every stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from stagemesh_core.errors import UserError

FLAG = "--speculative-config"
NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, for both bounds when neither is given
# Above this many running sequences a step's extra verification rows cost more than the trips they save: the
# batch is bound by its rows rather than by the walk through the stages (docs/performance.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# On an NVIDIA GPU a verification of several sequences costs more than the trips it saves, so only a lone
# sequence speculates (docs/performance.md has the figures).
CUDA_DISABLE_BY_BATCH_SIZE = 1
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")


class SpeculativeConfigError(UserError):
    """A ``--speculative-config`` that cannot be served; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Up to ``num_speculative_tokens`` proposals per sequence and step: with ``ngram``, from the longest suffix
    of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens seen earlier in the sequence; with
    ``draft_model``, the greedy tokens of the draft model at ``model``."""

    num_speculative_tokens: int
    method: str = NGRAM
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None  # None: the backend's default (``limit_for``)
    model: str | None = None  # the draft model's directory (draft_model only)

    def limit_for(self, backend: str | None) -> int:
        """The most running sequences at which a sequence speculates on ``backend`` (MLX's: cpu, metal, cuda;
        None: the largest any backend takes by default, what memory is planned for)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return CUDA_DISABLE_BY_BATCH_SIZE if backend == "cuda" else DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"{FLAG}: method {self.method!r} is not supported; use "
                                         f"{' or '.join(repr(m) for m in METHODS)}")
        if (self.method == DRAFT_MODEL) != (self.model is not None):
            raise SpeculativeConfigError(
                f"{FLAG}: the method \"draft_model\" needs \"model\" (the draft model's directory)"
                if self.method == DRAFT_MODEL else
                f"{FLAG}: \"model\" is a draft model; use \"method\": \"draft_model\" or leave \"method\" out")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpeculativeConfigError(f"{FLAG}: \"model\" must be a directory path, got {self.model!r}")
        for key, value in asdict(self).items():
            if key == "disable_by_batch_size" and value is None:
                continue
            if key not in ("method", "model") and (not isinstance(value, int) or isinstance(value, bool)):
                raise SpeculativeConfigError(f"{FLAG}: {key} must be an integer, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"{FLAG}: num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                                         f"got {self.num_speculative_tokens}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise SpeculativeConfigError(f"{FLAG}: {key} must be at least 1, got {getattr(self, key)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(f"{FLAG}: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                                         f"prompt_lookup_max ({self.prompt_lookup_max})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        return cls(**raw)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's JSON as a checked config (vLLM's keys and ngram defaults).

    Raises ``SpeculativeConfigError`` naming the key: an unknown key or method, ``num_speculative_tokens``
    outside 1..``MAX_SPECULATIVE_TOKENS``, a ``prompt_lookup_min`` above ``prompt_lookup_max``, a
    ``disable_by_batch_size`` below 1, a ``draft_model`` method without a ``"model"`` or a ``"model"`` with
    another method."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(f"{FLAG}: not valid JSON ({exc}); e.g. "
                                     '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(f"{FLAG}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise SpeculativeConfigError(f"{FLAG}: unknown key {unknown[0]!r}; known keys: {', '.join(_KEYS)}")
    model = raw.get("model")
    method = raw.get("method", DRAFT_MODEL if model is not None else None)  # vLLM: "model" alone is a draft
    if method is None:
        raise SpeculativeConfigError(f"{FLAG}: \"method\" is missing; use \"ngram\", or \"model\" for a draft model")
    if "num_speculative_tokens" not in raw:
        raise SpeculativeConfigError(f"{FLAG}: \"num_speculative_tokens\" is missing (1..{MAX_SPECULATIVE_TOKENS})")
    if method == DRAFT_MODEL:
        lookup = [key for key in _NGRAM_KEYS if key in raw]
        if lookup:
            raise SpeculativeConfigError(f"{FLAG}: {lookup[0]} is prompt lookup's (\"ngram\"); a draft model "
                                         "does not take it")
        return SpeculativeConfig(
            num_speculative_tokens=raw["num_speculative_tokens"], method=method, model=model,
            disable_by_batch_size=raw.get("disable_by_batch_size"))
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    # vLLM's defaults: both 5 when neither is given, else the missing bound equals the given one.
    low = high if low is None else low
    high = low if high is None else high
    if low is None or high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    return SpeculativeConfig(
        num_speculative_tokens=raw["num_speculative_tokens"], method=method, prompt_lookup_max=high,
        prompt_lookup_min=low, model=model,
        disable_by_batch_size=raw.get("disable_by_batch_size"))


__all__ = ["CUDA_DISABLE_BY_BATCH_SIZE", "DEFAULT_DISABLE_BY_BATCH_SIZE", "DRAFT_MODEL", "MAX_SPECULATIVE_TOKENS",
           "NGRAM", "SpeculativeConfig", "SpeculativeConfigError", "parse_speculative_config"]
