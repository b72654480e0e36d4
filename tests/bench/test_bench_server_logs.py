"""How a benchmark runs its servers (``stagemesh.bench.compare.server_process``): one that exits or never comes up
ends the run with its own log's last lines, which live in a temporary directory the run removes; one that ran is
stopped by SIGTERM to it alone, then its process group killed. Without a log directory the log is a temporary file:
gone after a run that went well, kept and named where the server failed."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest

from stagemesh.bench.compare import LOG_TAIL_LINES, log_tail, server_process
from tests.conftest import free_port_base


def test_log_tail_keeps_the_last_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert log_tail(str(log)) == "".join(f"line {i}\n" for i in range(40 - LOG_TAIL_LINES, 40))
    assert log_tail(str(log), 2) == "line 38\nline 39\n"


@pytest.mark.e2e
def test_a_server_that_exits_at_start_ends_the_run_with_its_reason(tmp_path):
    command = [sys.executable, "-c", "import sys; print('starting'); "
               "print('stagemesh serve: the draft KV needs 92 GB, 80 GB are free', flush=True); sys.exit(2)"]
    with pytest.raises(SystemExit) as ended:
        with server_process(command, "on", f"http://127.0.0.1:{free_port_base(1)}/health", log_dir=tmp_path,
                            poll_s=0.1):
            pytest.fail("a server that exited was yielded")
    message = str(ended.value)
    assert message.startswith("on exited (2); see ")
    assert message.endswith("starting\nstagemesh serve: the draft KV needs 92 GB, 80 GB are free\n")


@pytest.mark.e2e
def test_a_server_is_stopped_by_sigterm_to_it_and_what_it_leaves_behind_is_killed(tmp_path):
    """The server alone gets SIGTERM and stops in its own order (a stagemesh serve stops its Ray daemons, which a
    SIGTERM to the whole group would kill under it); a child it leaves running is killed with the group."""
    child_pid, child_signalled = tmp_path / "child.pid", tmp_path / "child-got-sigterm"
    child = (f"import signal, time; signal.signal(signal.SIGTERM, lambda *_: open({str(child_signalled)!r}, 'w')); "
             "time.sleep(600)")
    server = (
        "import signal, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "def stop(*_):\n"
        "    print('stopping in order', flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    with server_process([sys.executable, "-c", server], "fake", None, log_dir=tmp_path) as process:
        deadline = time.monotonic() + 30
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline, "the fake server never started its child"
            time.sleep(0.05)
        time.sleep(0.5)  # its SIGTERM handler is set once it has written the child's pid and printed
    assert process.returncode == 0  # it exited by its own handler, not by SIGKILL
    log = next(tmp_path.glob("bench-fake-*.log")).read_text()
    assert "stopping in order" in log
    assert not child_signalled.exists()  # SIGTERM went to the server alone
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, f"the server's child {pid} outlived the run"
        time.sleep(0.05)


@pytest.mark.e2e
def test_a_temporary_log_is_removed_after_a_run_that_went_well_and_kept_where_it_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where NamedTemporaryFile puts it
    with server_process([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                        "bench ran", None):
        pass
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as ended:
        with server_process([sys.executable, "-c", "print('no model here'); raise SystemExit(2)"], "bench failed",
                            f"http://127.0.0.1:{free_port_base(1)}/health", poll_s=0.1):
            pytest.fail("a server that exited was yielded")
    (kept,) = tmp_path.glob("bench-bench-failed-*.log")
    assert f"see {kept}," in str(ended.value) and kept.read_text() == "no model here\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the exited server is reparented and reaped by init; a zombie counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[-1][0] != "Z"
