"""A stage's and a replica's lifecycle states and a stage process's exit codes: one enum each.

``StageState`` is what a stage reports (``GetStageInfo.state``), what the
coordinator's snapshot shows and what drives the standard health status.
``state_to_proto`` / ``state_from_proto`` are the only translation to and from
``stagemesh.v1.StageState``; a value this version does not know is an error
(``UnknownStateError``), never silently "starting".

``ReplicaState`` is how the coordinator's supervision reads for one replica
(``GET /mesh`` ``replicas[].state``; ``coordinator.supervision`` decides it).

``ExitCode`` is how a stage process says why it stopped; ``describe_exit``
turns a process's return code (negative: killed by a signal) into words. The
coordinator uses ``caused_by_neighbour`` to name the stage that failed first
rather than the neighbours that exited because of it.
"""

from __future__ import annotations

import enum

from stagemesh_core.v1 import stage_pb2


class StageState(enum.StrEnum):  # compares equal to its JSON name ("serving")
    STARTING = "starting"  # process started, not yet reporting (coordinator's view only)
    LOADING = "loading"  # reading its weights
    CONNECTING = "connecting"  # handshaking with neighbours, joining the ring
    SERVING = "serving"
    DRAINING = "draining"  # admits nothing new; running requests finish
    FAILED = "failed"  # final for this process
    STOPPED = "stopped"


class ReplicaState(enum.StrEnum):  # compares equal to its JSON name ("backing_off")
    STARTING = "starting"  # its stages are starting for the first time
    SERVING = "serving"  # it served at its last check (a stage may still be failing a check: see ``healthy``)
    RESTARTING = "restarting"  # being stopped whole and started again
    BACKING_OFF = "backing_off"  # it died again soon after a restart; it waits before the next one
    FAILED = "failed"  # given up: it never served (a model or setting that cannot load)
    STOPPED = "stopped"


_TO_PROTO: dict[StageState, int] = {
    StageState.STARTING: stage_pb2.STAGE_STATE_UNSPECIFIED,
    StageState.LOADING: stage_pb2.STAGE_STATE_LOADING,
    StageState.CONNECTING: stage_pb2.STAGE_STATE_CONNECTING,
    StageState.SERVING: stage_pb2.STAGE_STATE_SERVING,
    StageState.DRAINING: stage_pb2.STAGE_STATE_DRAINING,
    StageState.FAILED: stage_pb2.STAGE_STATE_FAILED,
    StageState.STOPPED: stage_pb2.STAGE_STATE_STOPPED,
}
_FROM_PROTO: dict[int, StageState] = {number: state for state, number in _TO_PROTO.items()}


class UnknownStateError(ValueError):
    """A stage reported a state this version does not know (a newer stagemesh on another node)."""


def state_to_proto(state: StageState) -> int:
    return _TO_PROTO[state]


def state_from_proto(number: int) -> StageState:
    try:
        return _FROM_PROTO[int(number)]
    except KeyError:
        raise UnknownStateError(
            f"stage reported state {number}, which this stagemesh does not know; run one stagemesh "
            f"version on every node") from None


class ExitCode(enum.IntEnum):
    """Why a stage process exited."""

    OK = 0  # stopped as asked
    CONFIG = 2  # a setting to change (model, flag, memory); restarting will not help
    PEER = 3  # a neighbour failed or refused the handshake
    ORPHANED = 70  # its StageHost died before the stage started (Linux PDEATHSIG shim)
    RING_TIMEOUT = 75  # a ring operation outlived --ring-timeout (a frozen peer)

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "it stopped",
    ExitCode.CONFIG: "configuration error",
    ExitCode.PEER: "a neighbour failed or refused it",
    ExitCode.ORPHANED: "its StageHost died before it started",
    ExitCode.RING_TIMEOUT: "a ring operation outlived --ring-timeout",
}


def describe_exit(code: int) -> str:
    """A process return code in words: ``exited with code 3 (a neighbour failed or refused it)``."""
    if code < 0:
        return f"killed by signal {-code}"
    try:
        return f"exited with code {code} ({ExitCode(code).meaning})"
    except ValueError:
        return f"exited with code {code}"


def caused_by_neighbour(exit_code: int | None) -> bool:
    """Whether a stage stopped only because a neighbour failed (so it is not the cause)."""
    return exit_code == ExitCode.PEER
