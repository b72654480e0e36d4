"""``--kv-cache-dtype``: how a stage stores keys and values, and what that costs per position (pure).

Contract: ``parse_kv_cache_dtype`` turns the flag's value (``auto``, ``q8``, ``q4``) and
``--kv-cache-group-size`` into a ``KVCacheDtype`` or raises ``UserError`` naming what works. ``auto`` keeps
keys and values in the compute dtype. ``q8`` / ``q4`` store every position of a plain KV layer as mlx-lm's
``QuantizedKVCache`` does (``mx.quantize``: 8 or 4-bit codes with a scale and a bias in the compute dtype per
``group_size`` elements along the head dimension), and attention reads them quantized. vLLM's ``fp8``
values name CUDA's 8-bit float KV, which MLX has no kernels for: they are refused, pointing to ``q8``.

``quantized_bytes`` is the one formula for the bytes a quantized position takes; the planner and every stage
count KV by it (``stagemesh_core.memory``), so both agree on the context a choice buys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stagemesh_core.errors import UserError

KV_CACHE_DTYPES = ("auto", "q8", "q4")
_BITS = {"q8": 8, "q4": 4}
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's --kv-group-size default
_VLLM_ONLY = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


@dataclass(frozen=True)
class KVCacheDtype:
    """How keys and values are stored: ``bits`` None keeps the compute dtype; else ``bits``-bit codes with a
    scale and a bias per ``group_size`` elements."""

    name: str = "auto"
    bits: int | None = None
    group_size: int = DEFAULT_KV_GROUP_SIZE

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def quantized_bytes(self, elements: int) -> tuple[int, int]:
        """(bytes independent of the compute dtype, elements in it) that ``elements`` keys or values of
        positions take quantized: the packed codes, and a scale and a bias per group."""
        assert self.bits is not None
        return elements * self.bits // 8, 2 * (elements // self.group_size)

    def describe(self) -> str:
        if self.bits is None:
            return "auto (the compute dtype)"
        return f"{self.name} ({self.bits}-bit, group {self.group_size})"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVCacheDtype:
        """The value as ``dataclasses.asdict`` wrote it (a stage's launch file)."""
        return parse_kv_cache_dtype(str(raw["name"]), int(raw["group_size"]))


AUTO = KVCacheDtype()


def parse_kv_cache_dtype(name: str, group_size: int = DEFAULT_KV_GROUP_SIZE) -> KVCacheDtype:
    """The flag's value as a ``KVCacheDtype``; ``UserError`` naming the values that work."""
    if name in _VLLM_ONLY:
        raise UserError(f"--kv-cache-dtype {name} is vLLM's 8-bit float KV for CUDA, which MLX has no kernels "
                        "for; use q8 (8-bit quantized keys and values) or q4")
    if name not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if group_size not in KV_GROUP_SIZES:
        raise UserError(f"--kv-cache-group-size {group_size} is not one of "
                        f"{', '.join(map(str, KV_GROUP_SIZES))} (the group sizes mx.quantize takes)")
    return KVCacheDtype(name, _BITS.get(name), group_size)


def check_head_dims(kv_dtype: KVCacheDtype, head_dims: dict[str, int]) -> None:
    """Refuse a group size that does not divide the heads it quantizes (``head_dims``: what -> its width)."""
    if not kv_dtype.quantized:
        return
    for what, width in head_dims.items():
        if width % kv_dtype.group_size:
            fits = [g for g in KV_GROUP_SIZES if width % g == 0]
            hint = (f"use --kv-cache-group-size {fits[-1]}" if fits
                    else "no group size divides it: serve with --kv-cache-dtype auto")
            raise UserError(f"--kv-cache-dtype {kv_dtype.name}: {what} of {width} do not split into groups of "
                            f"{kv_dtype.group_size}; {hint}")
