"""Building a stage's graph before its input arrives: placeholders whose bytes are written in later.

MLX builds graphs lazily, and building one is host work; a stage that builds only once its input is there puts
that work on every token's path, once per stage. Often a stage knows a batch's shape before its data: the
FORWARD header (records, rows) can travel ahead of the hidden states, and a continued decode step's token ids
are the ones the last stage is about to return. Such a stage builds the batch's graph on a ``Placeholder``
(an array already in MLX memory), writes the data's bytes into it when they arrive, and only then evaluates.
``writes_reach_device`` checks once per process that such writes reach what the device computes with;
``build_ahead_enabled`` says whether stages build ahead (where it fails, they build after the data arrives).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from stage_worker.transport import wire

log = logging.getLogger(__name__)


class Placeholder:
    """An array of ``shape`` and ``dtype`` for a graph to be built on, its bytes written in later.

    MLX reads an input's memory when it evaluates, not when a graph is built; the placeholder is held for the
    whole graph's life, so MLX never reuses its buffer for an output (donation needs the only reference).
    """

    def __init__(self, shape: Sequence[int], dtype: mx.Dtype) -> None:
        host_dtype, bits = wire.host_dtype(dtype)
        # Created from host memory: already evaluated, so writing its bytes needs no device sync first.
        # Uninitialised: every byte is written before the graph on it is evaluated (a prefill's is megabytes).
        self._storage = mx.array(np.empty(tuple(shape), dtype=host_dtype))
        self.array = self._storage.view(dtype) if bits is not None else self._storage
        self.nbytes = self._storage.nbytes

    def writable(self) -> memoryview:
        """The placeholder's bytes, to receive the data into (a socket's ``recv_into``)."""
        # mx.array has the buffer protocol (writable); its stubs do not declare it.
        return memoryview(self._storage).cast("B")  # type: ignore[arg-type]

    def write(self, values: np.ndarray) -> None:
        """Copy ``values`` (the placeholder's host dtype and element count) into the placeholder."""
        target = np.frombuffer(self.writable(), dtype=values.dtype)
        if target.size != values.size:
            raise ValueError(f"placeholder holds {target.size} elements, got {values.size}")
        target[:] = values.reshape(-1)


@functools.cache
def writes_reach_device() -> bool:
    """Whether bytes written into a ``Placeholder`` are what the device computes with (once per process).

    Writing into an array's memory relies on MLX handing out host-visible memory through the buffer protocol:
    unified memory on Apple silicon, managed memory on CUDA, host memory on the CPU.
    """
    try:
        placeholder = Placeholder((64,), mx.int32)
        doubled = placeholder.array * 2
        placeholder.write(np.arange(64, dtype=np.int32))
        ok = np.array(doubled).tolist() == list(range(0, 128, 2))
    except (RuntimeError, TypeError, ValueError, BufferError) as exc:
        log.warning("graphs are built once their input has arrived: MLX memory is not writable here (%s)", exc)
        return False
    if not ok:
        log.warning("graphs are built once their input has arrived: writes into MLX memory do not reach the device")
    return ok


def build_ahead_enabled(step_ahead_setting: str) -> bool:
    """Whether stages build graphs ahead: unless ``STAGEMESH_STEP_AHEAD=off``, wherever writes reach the device."""
    return step_ahead_setting != "off" and writes_reach_device()


__all__ = ["Placeholder", "build_ahead_enabled", "writes_reach_device"]
