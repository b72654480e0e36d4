"""``stagemesh serve`` meshes shared by the end-to-end tests that only send them requests.

Starting one is Ray, the model and the stage processes, so tests that test different things on the same
setup share it: one of each for the whole ``tests/e2e`` package rather than one per module. Under
pytest-xdist every test using them runs on one worker (``SHARED_SERVES``, grouped in tests/conftest.py), so
each starts once per run. A test that stops, kills, freezes or reconfigures a serve starts its own
(``start_serve``).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_process import start_serve

# Given through STAGEMESH_MESH_TOKEN, as a cluster's nodes would: the stages of serve_pp2 refuse calls without it.
MESH_TOKEN = "e2e-mesh-token-" + "k" * 24

# The package's shared serves: tests/conftest.py keeps every test that uses one on the same xdist worker.
SHARED_SERVES = ("serve_pp1", "serve_pp2")


@pytest.fixture(scope="package")
def serve_pp1(tmp_path_factory):
    """``stagemesh serve`` with its defaults: PP=1."""
    serve = start_serve(tmp_path_factory.mktemp("serve-pp1"), pp=1)
    yield serve
    serve.stop()


@pytest.fixture(scope="package")
def serve_pp2(tmp_path_factory):
    """``stagemesh serve`` at PP=2 with a mesh token and step-ahead on.

    Auto leaves step-ahead off on the CPU; on here, PP=2 also covers decode steps built ahead, which compute
    what plain steps do, so PP=2 still equals PP=1 exactly (tokens and logprobs).
    """
    serve = start_serve(tmp_path_factory.mktemp("serve-pp2"), pp=2,
                        env={"STAGEMESH_MESH_TOKEN": MESH_TOKEN, "STAGEMESH_STEP_AHEAD": "on"})
    yield serve
    serve.stop()
