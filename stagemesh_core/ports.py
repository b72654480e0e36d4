"""Port assignment: the one home of the rule that maps a global stage index to ports.

Global stage g (stages numbered across all replicas, replica-major) binds
``ring_base + g`` for the MLX ring (the documented port contract) and
``grpc_base + g`` for its gRPC control server. Each stage also accepts its
predecessor's control lane (the stage's TCP link carrying batch headers) on
``ring_base + total_stages + g``: just past the ring ports, so one firewall
range ``[ring_base, ring_base + 2 * total_stages)`` covers the data plane.

With tensor parallelism (``-tp T``) each stage is a group of T workers: the stage's worker 0 keeps the ports
above, and the group's own ports follow, member ``m`` of stage ``g`` binding its group port (its rank in the
group's MLX ring, or the rendezvous of jaccl / nccl at member 0) at ``ring_base + 2S + g*T + m``; members
``m >= 1`` also accept worker 0's mirror lane at ``ring_base + 2S + S*T + g*(T-1) + m-1`` and serve gRPC on
``grpc_base + S + g*(T-1) + m-1``. One range ``[ring_base, ring_base + S*(2T+1))`` still covers the data plane
(``data_plane_ports``), ``[grpc_base, grpc_base + S*T)`` the control plane.
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


@dataclass(frozen=True)
class MemberPorts:
    """A tensor-parallel group member's ports: ``group`` always; ``lane`` and ``grpc`` for members 1.. (worker 0
    uses its stage's)."""

    group: int
    lane: int
    grpc: int


def data_plane_ports(total_stages: int, tensor_parallel_size: int = 1) -> int:
    """How many consecutive ports from the ring base the data plane takes."""
    t = tensor_parallel_size
    return 2 * total_stages if t == 1 else total_stages * (2 * t + 1)


def member_ports(global_index: int, member: int, total_stages: int, tensor_parallel_size: int, ring_base: int,
                 grpc_base: int) -> MemberPorts:
    """Member ``member`` of stage ``global_index``'s tensor-parallel group (module docstring)."""
    s, t, g = total_stages, tensor_parallel_size, global_index
    if t < 2 or not 0 <= member < t:
        raise ValueError(f"member {member} of a tensor-parallel group of {t}")
    if not 0 <= g < s:
        raise ValueError(f"stage {g} outside 0..{s - 1}")
    check_port_base("--ring-base-port", ring_base, data_plane_ports(s, t))
    check_port_base("--grpc-base-port", grpc_base, s * t)
    group = ring_base + 2 * s + g * t + member
    if member == 0:
        ports = stage_ports(g, s, ring_base, grpc_base)
        return MemberPorts(group, ports.lane, ports.grpc)
    follower = g * (t - 1) + member - 1
    return MemberPorts(group, ring_base + 2 * s + s * t + follower, grpc_base + s + follower)


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
