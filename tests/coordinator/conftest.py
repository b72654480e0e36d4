"""Helpers for coordinator tests: port ranges safe from Ray, the fake stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port_base

FAKE_STAGE = (str(Path(__file__).with_name("fake_stage.py")),)


def mesh_ports(total_stages: int) -> tuple[int, int]:
    """(ring_base, grpc_base) for a mesh of ``total_stages``, disjoint and free."""
    base = free_port_base(3 * total_stages)
    return base, base + 2 * total_stages


@pytest.fixture
def fake_stage_command() -> tuple[str, ...]:
    return FAKE_STAGE
