"""``stagemesh serve`` meshes shared by the end-to-end tests that only send them requests.

Starting one is Ray, the model and the stage processes, so tests that test different things on the same
setup share it: one of each for the whole ``tests/e2e`` package rather than one per module. Under
pytest-xdist every test using them runs on one worker (``SHARED_SERVES``, grouped in tests/conftest.py), so
each starts once per run. They stop as soon as the group's last test is done (``pytest_runtest_teardown``),
not when pytest leaves the package, so two idle meshes do not hold CPU and memory for the rest of the run. A
test that stops, kills, freezes or reconfigures a serve starts its own (``start_serve``).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_process import ServeProcess, start_serve

# Given through STAGEMESH_MESH_TOKEN, as a cluster's nodes would: the stages of serve_pp2 refuse calls without it.
MESH_TOKEN = "e2e-mesh-token-" + "k" * 24

# The package's shared serves: tests/conftest.py keeps every test that uses one on the same xdist worker.
SHARED_SERVES = ("serve_pp1", "serve_pp2")
_running: list[ServeProcess] = []  # the shared serves started and not yet stopped


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared serves after the last test of their group: its tests run one after another on one worker
    (``tests.worker_groups`` keeps a group together in every mode), so none runs after a test of another group."""
    from tests.worker_groups import SHARED_SERVES_GROUP, group_of

    if _running and group_of(item) == SHARED_SERVES_GROUP and (nextitem is None or
                                                                group_of(nextitem) != SHARED_SERVES_GROUP):
        while _running:
            _running.pop().stop()


@pytest.fixture(scope="package")
def serve_pp1(tmp_path_factory):
    """``stagemesh serve`` with its defaults: PP=1."""
    serve = start_serve(tmp_path_factory.mktemp("serve-pp1"), pp=1)
    _running.append(serve)
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
    _running.append(serve)
    yield serve
    serve.stop()
