"""Speculative decoding's configuration: vLLM's ``--speculative-config`` JSON, parsed and checked in one place.

Contract:
- ``SpeculativeConfig`` is the frozen, checked form. ``parse_speculative_config(text)`` reads the flag's JSON
  (vLLM's keys) and raises ``SpeculativeConfigError`` (a ``UserError``) naming the key to change: an unknown
  key or method, ``num_speculative_tokens`` outside 1..``MAX_SPECULATIVE_TOKENS``, a ``prompt_lookup_min``
  above ``prompt_lookup_max``, a ``disable_by_batch_size`` below 1. A draft model (``"model"``, or the
  method ``draft_model``) is refused: only the ``ngram`` (prompt lookup) method is served.
- vLLM's defaults for ngram: both lookup bounds 5 when neither is given, else the missing one equals the
  other. ``disable_by_batch_size`` (vLLM's key): no sequence speculates while more than this many run
  (default ``DEFAULT_DISABLE_BY_BATCH_SIZE``).
- ``to_json`` / ``from_json`` are the form the launch plan carries to every stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from stagemesh.core.errors import UserError

FLAG = "--speculative-config"
METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, for both bounds when neither is given
# Above this many running sequences a step's extra verification rows cost more than the trips they save: the
# batch is no longer bound by the walk through the stages but by its rows (docs/performance.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


class SpeculativeConfigError(UserError):
    """A ``--speculative-config`` that cannot be served; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculation: up to ``num_speculative_tokens`` proposals per sequence and step, from the
    longest suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens seen earlier in the sequence."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"{FLAG}: method {self.method!r} is not supported; use \"ngram\"")
        for key, value in asdict(self).items():
            if key != "method" and (not isinstance(value, int) or isinstance(value, bool)):
                raise SpeculativeConfigError(f"{FLAG}: {key} must be an integer, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"{FLAG}: num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                                         f"got {self.num_speculative_tokens}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if getattr(self, key) < 1:
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
    """The flag's JSON as a checked config (vLLM's keys and ngram defaults)."""
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
    method = raw.get("method")
    if raw.get("model") is not None or method == "draft_model":
        raise SpeculativeConfigError(f"{FLAG}: a draft model (\"model\") is not supported yet; use "
                                     '"method": "ngram" (prompt lookup) without "model"')
    if method is None:
        raise SpeculativeConfigError(f"{FLAG}: \"method\" is missing; use \"ngram\"")
    if "num_speculative_tokens" not in raw:
        raise SpeculativeConfigError(f"{FLAG}: \"num_speculative_tokens\" is missing (1..{MAX_SPECULATIVE_TOKENS})")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    # vLLM's defaults: both 5 when neither is given, else the missing bound equals the given one.
    low = high if low is None else low
    high = low if high is None else high
    if low is None or high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    return SpeculativeConfig(
        num_speculative_tokens=raw["num_speculative_tokens"], method=method, prompt_lookup_max=high,
        prompt_lookup_min=low,
        disable_by_batch_size=raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE))


__all__ = ["DEFAULT_DISABLE_BY_BATCH_SIZE", "MAX_SPECULATIVE_TOKENS", "SpeculativeConfig", "SpeculativeConfigError",
           "parse_speculative_config"]
