"""A ``stagemesh serve`` shared by the end-to-end tests that only send it requests.

Starting one is Ray, the model and the stage processes, so tests that test different things on the same
setup share it: one for the whole ``tests/e2e`` package rather than one per module. A test that stops,
kills, freezes or reconfigures a serve starts its own (``start_serve``).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_process import start_serve


@pytest.fixture(scope="package")
def serve_pp1(tmp_path_factory):
    """``stagemesh serve`` with its defaults: PP=1."""
    serve = start_serve(tmp_path_factory.mktemp("serve-pp1"), pp=1)
    yield serve
    serve.stop()
