"""Helpers for the deployment tests: load deploy/render.py (a script, not a package) and find mesh.sh."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RENDER = DEPLOY / "render.py"
MESH_SH = DEPLOY / "two-mac" / "mesh.sh"
VENV = str(Path(sys.executable).parent.parent)


def load_render():
    spec = importlib.util.spec_from_file_location("stagemesh_deploy_render", RENDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def render():
    return load_render()
