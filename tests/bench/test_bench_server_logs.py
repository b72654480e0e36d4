"""A benchmark's server that exits or never comes up ends the run with its own log's last lines, which live in a
temporary directory the run removes."""

from __future__ import annotations

import sys

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
