"""Every environment variable stagemesh reads, with its default, in one place.

Read lazily (``envs.RING_BASE_PORT`` looks the variable up at access time), so
tests and launchers can set them after import. Flags always win over these.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} must be a number") from None

    return read


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


# name -> (reader, what it means)
VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "API_KEY": (_str("STAGEMESH_API_KEY", None), "API key the gateway requires on /v1 (same as --api-key)"),
    "RING_BASE_PORT": (_int("STAGEMESH_RING_BASE_PORT", 32323),
                       "first MLX ring port; global stage g binds base+g (same as --ring-base-port)"),
    "GRPC_BASE_PORT": (_int("STAGEMESH_GRPC_BASE_PORT", 50051),
                       "first gRPC port; global stage g binds base+g (same as --grpc-base-port)"),
    "HOST_IP": (_str("STAGEMESH_HOST_IP", None),
                "address this node advertises for its stages' ring and gRPC ports"),
    "RING_TIMEOUT": (_float("STAGEMESH_RING_TIMEOUT", 30.0),
                     "seconds a ring transfer or an owed reply may take before the stage gives up"),
    "CACHE_DIR": (_str("STAGEMESH_CACHE_DIR", None), "where the default model is cached when not installed"),
    "RAY_ADDRESS": (_str("RAY_ADDRESS", None), "join this Ray cluster instead of starting a local one"),
}


def __getattr__(name: str) -> Any:
    try:
        reader, _ = VARIABLES[name]
    except KeyError:
        raise AttributeError(name) from None
    return reader()
