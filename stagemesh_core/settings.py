"""Every setting stagemesh reads from its environment, with its default, in one place.

Also the constants every service shares: the default ports, the loopback
address, the name of the Ray resource that marks a stage slot, and the
installed version.

Environment variables are read lazily (``settings.RING_BASE_PORT`` looks the
variable up at access time), so tests and launchers can set them after
import; ``settings.read(NAME, env)`` reads one from another mapping (a child's
environment, a test's). Flags always win over these. A malformed value raises
``UserError`` naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from stagemesh_core.errors import UserError
from stagemesh_core.gpus import GPU_PER_STAGE_CHOICES

DEFAULT_RING_BASE_PORT = 32323
DEFAULT_GRPC_BASE_PORT = 50051
DEFAULT_GATEWAY_PORT = 8000
LOOPBACK = "127.0.0.1"
# The Ray resource a node advertises once per stage it can host (`ray start --resources='{"mlx": 1}'`).
MLX_RESOURCE = "mlx"
AUTO_ON_OFF = ("auto", "on", "off")


def switched_on(setting: str, auto: bool) -> bool:
    """An ``AUTO_ON_OFF`` setting's answer (pure): ``on``, ``off``, or ``auto``'s own answer where it is left to."""
    return setting == "on" or (setting == "auto" and auto)


def stagemesh_version() -> str:
    """The installed stagemesh version (stages compare it across nodes)."""
    try:
        return metadata.version("stagemesh")
    except metadata.PackageNotFoundError:
        return "0+unknown"


Reader = Callable[[Mapping[str, str]], Any]


def _number(name: str, default: float | int, parse: Callable[[str], Any], kind: str) -> Reader:
    def read(env: Mapping[str, str]) -> Any:
        raw = env.get(name, "").strip()
        if not raw:
            return default
        try:
            return parse(raw)
        except ValueError:
            raise UserError(f"environment variable {name}={raw!r} must be {kind}") from None

    return read


def _int(name: str, default: int) -> Reader:
    return _number(name, default, int, "an integer")


def _float(name: str, default: float) -> Reader:
    return _number(name, default, float, "a number")


def _positive_int(name: str, unset_means: str) -> Reader:
    def read(env: Mapping[str, str]) -> int | None:
        raw = env.get(name, "").strip()
        if not raw:
            return None
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"{name}={raw!r} must be a positive integer; unset it {unset_means}")
        return int(raw)

    return read


def _str(name: str, default: str | None) -> Reader:
    return lambda env: env.get(name) or default


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``24GB``, ``512MiB``, ``1.5 GB`` or plain bytes as a byte count; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size such as 24GB, 512MB or 1.5GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _size(name: str) -> Reader:
    return _number(name, None, parse_size, "a size such as 24GB or 512MB")  # type: ignore[arg-type]


def _positive_float(name: str, default: float) -> Reader:
    def parse(raw: str) -> float:
        value = float(raw)
        if not value > 0:
            raise ValueError(raw)
        return value

    return _number(name, default, parse, "a positive number")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Reader:
    def read(env: Mapping[str, str]) -> str:
        raw = env.get(name, "").strip()
        if not raw:
            return default
        if raw not in choices:
            raise UserError(f"{name}={raw!r} must be one of {', '.join(choices)}")
        return raw

    return read


@dataclass(frozen=True)
class Variable:
    env_name: str  # what the user sets
    read: Reader
    meaning: str


VARIABLES: dict[str, Variable] = {v.env_name.removeprefix("STAGEMESH_"): v for v in (
    Variable("STAGEMESH_API_KEY", _str("STAGEMESH_API_KEY", None),
             "API key the gateway requires on /v1 (same as --api-key)"),
    Variable("STAGEMESH_MESH_TOKEN", _str("STAGEMESH_MESH_TOKEN", None),
             "secret every state-changing gRPC call to a stage carries (same as --mesh-token; default: "
             "generated at start)"),
    Variable("STAGEMESH_GRPC_TLS_DIR", _str("STAGEMESH_GRPC_TLS_DIR", None),
             "this node's mesh TLS directory (ca.pem, node.pem, node.key) for mutual TLS on the stages' gRPC "
             "(same as --grpc-tls-dir; unset: plaintext)"),
    Variable("STAGEMESH_RING_BASE_PORT", _int("STAGEMESH_RING_BASE_PORT", DEFAULT_RING_BASE_PORT),
             "first MLX ring port; global stage g binds base+g (same as --ring-base-port)"),
    Variable("STAGEMESH_GRPC_BASE_PORT", _int("STAGEMESH_GRPC_BASE_PORT", DEFAULT_GRPC_BASE_PORT),
             "first gRPC port; global stage g binds base+g (same as --grpc-base-port)"),
    Variable("STAGEMESH_HOST_IP", _str("STAGEMESH_HOST_IP", None),
             "address this node advertises for its stages' ring and gRPC ports"),
    Variable("STAGEMESH_RING_TIMEOUT", _float("STAGEMESH_RING_TIMEOUT", 30.0),
             "seconds a ring transfer or an owed reply may take before the stage gives up"),
    Variable("STAGEMESH_CACHE_DIR", _str("STAGEMESH_CACHE_DIR", None),
             "where the default model is cached when not installed"),
    Variable("STAGEMESH_BLAS", _str("STAGEMESH_BLAS", "auto"),
             "BLAS a Linux stage preloads: auto (OpenBLAS, else MKL), none, or a library path"),
    Variable("STAGEMESH_BLAS_THREADS",
             _positive_int("STAGEMESH_BLAS_THREADS", "to let BLAS threads follow the pipeline's load"),
             "fixed BLAS thread count per stage (default: follow the pipeline's load)"),
    Variable("STAGEMESH_PIN_CORES", _str("STAGEMESH_PIN_CORES", ""),
             "pin stages to cores: a core list (0,1) or per-stage (stage g on core g mod cores)"),
    Variable("STAGEMESH_GPU_PER_STAGE", _choice("STAGEMESH_GPU_PER_STAGE", "auto", GPU_PER_STAGE_CHOICES),
             "auto: on a node with several NVIDIA GPUs each stage takes its own (CUDA_VISIBLE_DEVICES); "
             "off: stages keep the node's CUDA_VISIBLE_DEVICES"),
    Variable("STAGEMESH_NODE_MEMORY", _size("STAGEMESH_NODE_MEMORY"),
             "memory stagemesh may count on this node, e.g. 24GB (default: all of it); caps the host's and the "
             "GPU's memory before --memory-fraction applies, for a Mac shared with other work"),
    Variable("STAGEMESH_NODE_SPEED", _positive_float("STAGEMESH_NODE_SPEED", 1.0),
             "this node's speed relative to the others (e.g. its memory bandwidth in GB/s); the layer planner "
             "gives faster nodes more layers (default 1: all alike)"),
    Variable("STAGEMESH_STEP_AHEAD", _choice("STAGEMESH_STEP_AHEAD", "auto", AUTO_ON_OFF),
             "run ahead of the data: auto (stages build each batch's graph before its input arrives; decode "
             "steps are queued before the last one's tokens are back on GPUs, where it pays), on (steps queued "
             "ahead on the CPU too), off (neither)"),
    Variable("STAGEMESH_FUSE_PROJECTIONS", _choice("STAGEMESH_FUSE_PROJECTIONS", "auto", AUTO_ON_OFF),
             "join every layer's q/k/v projections into one matmul and gate/up into another (fewer, wider "
             "kernels; on a GPU results may differ from mlx-lm's layers in the last bits): auto (on GPUs, where "
             "it pays), on (on the CPU too), off (mlx-lm's layers as they are)"),
    Variable("STAGEMESH_DECODE_KERNEL", _choice("STAGEMESH_DECODE_KERNEL", "auto", ("auto", "off")),
             "a decode group's masked attention (rows of different lengths) as one kernel of stagemesh's own: "
             "auto (on CUDA, where MLX has no fused masked decode), off (mlx-lm's masked attention)"),
    Variable("STAGEMESH_LAUNCH_THREAD", _choice("STAGEMESH_LAUNCH_THREAD", "auto", AUTO_ON_OFF),
             "a second host thread launches each step's kernels while the engine thread builds the next "
             "(single-stage pipelines whose layers keep plain KV caches, without speculation): auto (on CUDA, "
             "where it pays), on (on the CPU and Metal too, unmeasured there), off (the engine thread launches)"),
    Variable("STAGEMESH_ALL_EXPERTS_ROWS", _str("STAGEMESH_ALL_EXPERTS_ROWS", "auto"),
             "mixture-of-experts blocks run every expert on every row (one wide matmul) on calls of up to this "
             "many rows, mlx-lm's gathered experts above: auto (on CUDA, where it pays), off, or a row count"),
    Variable("RAY_ADDRESS", _str("RAY_ADDRESS", None), "join this Ray cluster instead of starting a local one"),
)}


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The setting ``name`` (``"RING_BASE_PORT"``) from ``env`` (default: this process's)."""
    return VARIABLES[name].read(os.environ if env is None else env)


def env_name(name: str) -> str:
    """The environment variable behind setting ``name`` (``"HOST_IP"`` -> ``STAGEMESH_HOST_IP``)."""
    return VARIABLES[name].env_name


def __getattr__(name: str) -> Any:
    if name not in VARIABLES:
        raise AttributeError(name)
    return read(name)
