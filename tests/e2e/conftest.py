"""``stagemesh serve`` meshes shared by the end-to-end tests that only send them requests.

Starting one is Ray, the model and the stage processes, so tests that test different things on the same
setup share it: one per layout for the whole ``tests/e2e`` package rather than one per module. A test that
stops, kills, freezes or reconfigures a serve starts its own (``start_serve``).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_process import start_serve

MESH_TOKEN = "e2e-mesh-token-" + "k" * 24  # given through STAGEMESH_MESH_TOKEN, as a cluster's nodes would


@pytest.fixture(scope="package")
def serve_pp1(tmp_path_factory):
    """``stagemesh serve`` with its defaults: PP=1."""
    serve = start_serve(tmp_path_factory.mktemp("serve-pp1"), pp=1)
    yield serve
    serve.stop()


@pytest.fixture(scope="package")
def serve_pp2(tmp_path_factory):
    """PP=2 with a mesh token, decode steps built ahead and joined projections.

    Step-ahead and joined projections are on (auto leaves both off on the CPU), so PP=2 also covers decode
    steps built ahead and the GPU's layer form; on the CPU backend joined layers compute exactly what separate
    ones do, so PP=2 still equals PP=1 token for token.
    """
    serve = start_serve(tmp_path_factory.mktemp("serve-pp2"), pp=2,
                        env={"STAGEMESH_MESH_TOKEN": MESH_TOKEN, "STAGEMESH_STEP_AHEAD": "on",
                             "STAGEMESH_FUSE_PROJECTIONS": "on"})
    yield serve
    serve.stop()
