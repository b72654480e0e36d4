"""The fast tier's rule, enforced: a test without the ``e2e`` marker may not start a process, Ray or the real model.

``python -m pytest -m "not e2e"`` is the quick loop for a change; it stays quick only while nothing slow
hides in it. For every test NOT marked ``e2e`` (its setup, call and teardown, fixtures included) this
plugin fails the test, with a message naming the rule and the fix, when the test:

- starts a process: Python's audit events for ``subprocess.Popen`` (under ``subprocess.run`` and asyncio's
  subprocesses too), ``os.fork``, ``os.posix_spawn``, ``os.exec*``, ``os.system``; or starts a
  ``multiprocessing`` process (any start method);
- calls ``ray.init`` (a local Ray starts processes anyway; this names it);
- reads the real default model's weights (SmolLM2's GGUF tensors, through stagemesh's GGUF reader or
  ``mx.load``). Reading only its header, for the tokenizer or the model's shape, stays allowed.

In-process servers on loopback (a grpc.aio server or uvicorn on a thread inside the test process) are
a test's harness, not a slow setup: they may stay in the fast tier while the test stays quick.

The fix is the marker: ``@pytest.mark.e2e`` on the test, or ``pytestmark = pytest.mark.e2e`` for a file
whose every test qualifies; or a test that does without the process (a tiny config, dummy weights,
the function instead of the CLI).
"""

from __future__ import annotations

import multiprocessing.process
import os
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

# Audit events that start a process (https://docs.python.org/3/library/audit_events.html).
PROCESS_EVENTS = frozenset({
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
    "pty.spawn",
})


# The standard library asks the OS small questions through a process of its own, on behalf of whatever
# library needs the answer: platform.processor() runs `uname -p` (the OpenAI SDK's request headers),
# ctypes.util.find_library runs `ldconfig -p` (trio, at import). Those are not the test starting a process.
STDLIB_PROBES = frozenset({"platform", "ctypes.util"})


class UnmarkedSlowTest(RuntimeError):
    """A test outside the ``e2e`` tier did something that belongs in it."""


class _Guard:
    """Which test is guarded now, and what it did that the fast tier forbids."""

    def __init__(self) -> None:
        self.test: str | None = None  # the guarded test's node id; None while an e2e test (or nothing) runs
        self.violations: list[str] = []

    def forbid(self, what: str) -> None:
        if self.test is None:
            return
        message = (f"{self.test} is not marked e2e but {what}. Tests that start a process, Ray or load the "
                   "real model carry @pytest.mark.e2e (tests/fast_tier.py says why and how).")
        self.violations.append(message)
        raise UnmarkedSlowTest(message)


_GUARD = _Guard()


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if _GUARD.test is not None and event in PROCESS_EVENTS and not _started_by_a_stdlib_probe():
        _GUARD.forbid(f"starts a process ({event}: {_describe(args)})")


def _started_by_a_stdlib_probe() -> bool:
    frame = sys._getframe(2)  # above this function and the audit hook
    while frame is not None and frame.f_globals.get("__name__") in ("subprocess", "os"):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") in STDLIB_PROBES


def _describe(args: tuple[Any, ...]) -> str:
    shown = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else args[:1]
    return " ".join(map(str, shown)).replace("\n", " ")[:160]


def _guarded(original: Callable[..., Any], what: Callable[..., str | None]) -> Callable[..., Any]:
    """``original`` wrapped: when ``what(*args, **kwargs)`` names something forbidden, the guard decides."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _GUARD.test is not None and (found := what(*args, **kwargs)) is not None:
            _GUARD.forbid(found)
        return original(*args, **kwargs)

    wrapper.fast_tier_guarded = True  # type: ignore[attr-defined]
    return wrapper


def _install_model_guard() -> None:
    import mlx.core as mx

    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.gguf import format as gguf_format
    from stage_worker.checkpoint.model_spec import ModelFormatError

    try:
        default = os.path.realpath(default_model_path())
    except ModelFormatError:
        return  # not installed: the tests that need it fail on their own, saying how to install it

    def reads_default(path: Any, *_: Any, **__: Any) -> str | None:
        if isinstance(path, str | os.PathLike) and os.path.realpath(path) == default:
            return f"reads the real model's weights ({default})"
        return None

    # _read_bytes is the one place stagemesh reads GGUF tensor data (a slice's weights, one tensor,
    # a conversion); mx.load is what reference checks use.
    if not hasattr(gguf_format, "_read_bytes"):
        raise RuntimeError("tests/fast_tier.py guards stage_worker.checkpoint.gguf.format._read_bytes, which is gone; "
                           "point the guard at the function that now reads GGUF tensor data")
    gguf_format._read_bytes = _guarded(gguf_format._read_bytes, reads_default)  # type: ignore[attr-defined]
    mx.load = _guarded(mx.load, reads_default)


def _install_ray_guard() -> None:
    """Guard ``ray.init`` once Ray is imported (importing it here would slow every run by seconds)."""
    ray = sys.modules.get("ray")
    if ray is None or getattr(ray.init, "fast_tier_guarded", False):
        return
    ray.init = _guarded(ray.init, lambda *a, **k: "calls ray.init")


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_on_audit)
    original_start = multiprocessing.process.BaseProcess.start
    multiprocessing.process.BaseProcess.start = _guarded(  # type: ignore[method-assign]
        original_start, lambda process: f"starts a multiprocessing process ({process.name})")
    _install_model_guard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    _install_ray_guard()
    _GUARD.test = None if item.get_closest_marker("e2e") else item.nodeid
    _GUARD.violations.clear()
    try:
        return (yield)
    finally:
        _GUARD.test = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport,
                                                                                     pytest.TestReport]:
    """Fail the phase even when the code under test caught the guard's exception (or it rose in another thread)."""
    report = yield
    if _GUARD.violations:
        if report.outcome != "failed":
            report.outcome = "failed"
            report.longrepr = "\n".join(_GUARD.violations)
        _GUARD.violations.clear()
    return report
