"""How far a stage has got reading its weights: counted by the format readers, shown in the log and status.

Contract:
- ``WeightProgress`` counts the bytes a stage reads (or converts) from its model files against the total it
  will read: ``expect(nbytes)`` adds to the total before reading, ``read(nbytes)`` to what is done, both cheap
  and safe from any thread; ``snapshot()`` gives a frozen ``LoadCounts``. With a ``log`` it logs a line at most
  every ``interval_s`` (and one at the end); ``on_change`` receives every update (the stage's status, a
  progress bar).
- ``reporting(progress)`` makes a ``WeightProgress`` the current one for the block; the readers
  (``safetensors_format``, ``gguf_format``, ``dummy_weights``) report through the module functions ``expect``
  and ``read``, which do nothing when no progress is current. A reader asked not to evaluate leaves the reads
  to whoever evaluates (``StageModel.shard``), who counts ``outstanding()`` down.
- ``progress_text(counts, seconds)`` is the pure formatting of the log line.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadCounts:
    """Bytes of model files read (or converted) so far of the total a stage will read."""

    done_bytes: int = 0
    total_bytes: int = 0

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done_bytes / self.total_bytes) if self.total_bytes else None


def progress_text(counts: LoadCounts, seconds: float) -> str:
    """``reading weights: 31% (3.2 of 10.4 GB, 850 MB/s)``."""
    rate = f", {counts.done_bytes / seconds / 1e6:.0f} MB/s" if seconds > 0 and counts.done_bytes else ""
    percent = f"{100 * counts.fraction:.0f}% " if counts.fraction is not None else ""
    return f"reading weights: {percent}({counts.done_bytes / 1e9:.1f} of {counts.total_bytes / 1e9:.1f} GB{rate})"


class WeightProgress:
    def __init__(self, *, log: logging.Logger | None = None, interval_s: float = 2.0,
                 on_change: Callable[[LoadCounts], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._log = log
        self._interval_s = interval_s
        self._on_change = on_change
        self._clock = clock
        self._started = clock()
        self._logged_at = self._started

    def snapshot(self) -> LoadCounts:
        with self._lock:
            return LoadCounts(self._done, self._total)

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self._total += int(nbytes)
        self._changed(final=False)

    def read(self, nbytes: int) -> None:
        with self._lock:
            self._done += int(nbytes)
        self._changed(final=False)

    def finish(self) -> None:
        """Log the last line (when anything was read)."""
        self._changed(final=True)

    def _changed(self, *, final: bool) -> None:
        counts = self.snapshot()
        if self._on_change is not None:
            self._on_change(counts)
        if self._log is None or not counts.total_bytes:
            return
        now = self._clock()
        if final or now - self._logged_at >= self._interval_s:
            self._logged_at = now
            self._log.info("%s", progress_text(counts, now - self._started))


# A context variable rather than a parameter: the readers sit several calls below the stage's load, behind
# mlx-lm's own code. Unset (tests, benchmarks, conversion without a bar), ``expect`` and ``read`` do nothing.
_CURRENT: contextvars.ContextVar[WeightProgress | None] = contextvars.ContextVar("weight_progress", default=None)


@contextlib.contextmanager
def reporting(progress: WeightProgress) -> Iterator[WeightProgress]:
    """Make ``progress`` the one the readers report to inside the block; log its last line at the end."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.finish()


def expect(nbytes: int) -> None:
    """The current reader will read ``nbytes`` more (no-op without a current progress)."""
    if (progress := _CURRENT.get()) is not None:
        progress.expect(nbytes)


def read(nbytes: int) -> None:
    """The current reader has read ``nbytes`` more (no-op without a current progress)."""
    if (progress := _CURRENT.get()) is not None:
        progress.read(nbytes)


def outstanding() -> int:
    """Bytes the current progress expects but has not counted as read (0 without a current progress): what a
    stage that evaluates its weights later (a tensor-parallel member's lazy load) reports as it goes."""
    if (progress := _CURRENT.get()) is None:
        return 0
    counts = progress.snapshot()
    return max(0, counts.total_bytes - counts.done_bytes)
