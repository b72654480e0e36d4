"""Port assignment: the one home of the rule that maps a global stage index to ports.

Global stage g (stages numbered across all replicas, replica-major) binds
``ring_base + g`` for the MLX ring (the documented port contract) and
``grpc_base + g`` for its gRPC control server. Each stage also accepts its
predecessor's control lane (the stage's TCP link carrying batch headers) on
``ring_base + total_stages + g``: just past the ring ports, so one firewall
range ``[ring_base, ring_base + 2 * total_stages)`` covers the data plane.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from stagemesh_core.errors import UserError

MIN_PORT = 1024
MAX_PORT = 65535


class PortRangeError(UserError):
    """A base port puts some stage outside the usable range."""


@dataclass(frozen=True)
class StagePorts:
    ring: int
    lane: int
    grpc: int


def check_port_base(flag: str, base: int, count: int) -> None:
    """Refuse a base whose ``count`` consecutive ports leave [1024, 65535]."""
    if base < MIN_PORT or base + count - 1 > MAX_PORT:
        raise PortRangeError(
            f"{flag} {base} needs ports {base}..{base + count - 1}, outside "
            f"{MIN_PORT}..{MAX_PORT}; choose a base between {MIN_PORT} and "
            f"{MAX_PORT - count + 1}"
        )


def stage_ports(global_index: int, total_stages: int, ring_base: int, grpc_base: int) -> StagePorts:
    if not 0 <= global_index < total_stages:
        raise ValueError(f"stage {global_index} outside 0..{total_stages - 1}")
    check_port_base("--ring-base-port", ring_base, 2 * total_stages)
    check_port_base("--grpc-base-port", grpc_base, total_stages)
    return StagePorts(
        ring=ring_base + global_index,
        lane=ring_base + total_stages + global_index,
        grpc=grpc_base + global_index,
    )


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now. SO_REUSEADDR, as our listeners use, so a socket
    left in TIME_WAIT by a previous stage does not count as busy; a live listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
