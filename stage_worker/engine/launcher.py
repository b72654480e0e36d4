"""A stage's kernel launcher: one thread that evaluates the steps the engine thread builds.

Contract:
* ``KernelLauncher()`` starts a daemon thread and a ``stream``: graphs built on it, on any thread, can be
  evaluated by the launcher's thread. ``launch(arrays)`` queues their evaluation and returns a ``Launched`` at
  once; ``Launched.wait()`` returns once they are launched. Launches run in the order queued; ``idle()`` waits
  until everything queued has been launched; ``close()`` stops the thread.
* The rule callers keep: while the launcher may be evaluating, the engine thread builds graphs and reads arrays
  that no queued graph takes as an input; it evaluates nothing itself (``KernelLauncher`` says why and how).
* ``launcher_wanted(setting, backend, ...)`` decides ``STAGEMESH_LAUNCH_THREAD`` (pure): ``auto`` launches on
  CUDA, where a decode step is bound by the host thread and building step n+1 while step n's kernels are
  launched pays (docs/performance.md, "A second host thread for launching", has the figures).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from stagemesh_core import settings


class Launched:
    """One queued launch: ``wait`` until its kernels are launched."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        """Return once the kernels are launched, re-raising what the evaluation raised; reading one of the
        arrays (``np.array``) then waits for the device only."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"launching a step's kernels failed: {self._error}") from self._error


class KernelLauncher:
    """A thread that evaluates what the constructing thread builds.

    ``stream`` is ``mx.new_thread_unsafe_stream``: graphs built on it (``with mx.stream(launcher.stream)``), on
    whatever thread, can be evaluated by the launcher's thread. ``launch`` evaluates with ``mx.async_eval``
    (kernels encoded and launched, not waited for), which releases the GIL while it encodes, so the engine
    thread's building and the launcher's encoding run in parallel.

    MLX guards nothing on such a stream: its command encoder is one object, and an evaluation on another thread
    while the launcher's thread encodes (mlx-lm's ``BatchKVCache.extract`` evaluating its left padding, say)
    makes two threads append to that encoder's buffers at once, corrupting the heap. Hence a step's tokens are
    read through a copy of their own (``readback``), the next step's graph taking the tokens themselves; batch
    caches change members and hand back rows without reading the device (``kv_store.extract_row``,
    ``KVStore._filter``: mlx-lm's ``extract`` and ``filter`` read the left padding back); and a stage uses the
    launcher only where nothing else in its step evaluates while building (``launcher_wanted``).
    """

    def __init__(self) -> None:
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())
        self._queue: queue.SimpleQueue[tuple[list[mx.array], Launched] | None] = queue.SimpleQueue()
        self._last = Launched()
        self._last._finish(None)
        self._thread = threading.Thread(target=self._run, name="stagemesh-launcher", daemon=True)
        self._thread.start()

    def launch(self, arrays: Sequence[mx.array]) -> Launched:
        launched = Launched()
        self._queue.put((list(arrays), launched))
        self._last = launched
        return launched

    def idle(self) -> None:
        """Wait until everything queued so far has been launched (its errors are the launches' own)."""
        self._last._done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            arrays, launched = item
            try:
                mx.async_eval(*arrays)
            except BaseException as exc:  # handed to the engine thread, which fails the stage with it
                launched._finish(exc)
                continue
            launched._finish(None)


def launcher_wanted(setting: str, backend: str, single_stage: bool, plain_kv_caches: bool, speculating: bool,
                    recording: bool) -> bool:
    """``STAGEMESH_LAUNCH_THREAD`` (auto, on, off) for a stage on ``backend`` (pure): auto launches on CUDA.

    Only a single-stage pipeline (its steps' tokens read back on the stage), whose layers keep plain KV caches
    (mlx-lm's other batch caches read the device when a group shrinks), that neither speculates (a draft
    model evaluates on the engine thread) nor records logits (a parity run reads them at once) can use one.
    On a GPU a decode step is bound by the host thread, and with a launcher it takes the longer of building and
    launching instead of their sum. ``auto`` is CUDA only: on the CPU backend a step is bound by arithmetic, and
    on Metal the launcher is unmeasured.
    """
    able = single_stage and plain_kv_caches and not speculating and not recording
    return able and settings.switched_on(setting, auto=backend == "cuda")


def plain_kv_caches(caches: Sequence[object]) -> bool:
    """Whether every layer keeps mlx-lm's plain ``KVCache`` (its batch form shrinks without reading the device)."""
    return all(type(cache) is KVCache for cache in caches)


__all__ = ["KernelLauncher", "Launched", "launcher_wanted", "plain_kv_caches"]
