"""Supervision of a replica: facts in a frozen record, the next step from one pure function.

Contract:
- ``ReplicaRecord`` is what the supervisor knows of one replica; the transitions (``restarting``,
  ``serving``, ``failed``, ``given_up``, ``stopped``) each return a new record. Nothing here mutates, sleeps
  or reads a clock; times are the caller's monotonic seconds.
- ``next_action(record, now, policy)`` is the one decision: ``Restart``, ``WaitUntil``, ``GiveUp`` or
  ``Nothing``. The caller (``coordinator.mesh``) carries it out, records what happened with a transition,
  and asks again.
- A replica that never served gives up; one that has served is restarted forever, after a backoff that
  grows with its failures in a row (``BackoffPolicy``).
- ``replica_state`` and ``pending_restart`` are how a record reads in ``GET /mesh`` (``ReplicaState``, the
  backoff and when it ends).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from stagemesh_core.states import ReplicaState

BACKOFF_BASE_S = 1.0  # the second restart in a row waits this long, each later one twice the one before
BACKOFF_CAP_S = 300.0  # the longest wait between two restarts
STABLE_AFTER_S = 120.0  # serving this long in one go forgets the earlier failures


@dataclass(frozen=True)
class BackoffPolicy:
    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S
    stable_after_s: float = STABLE_AFTER_S

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"backoff base_s must be positive and at most cap_s, got base_s={self.base_s} "
                             f"cap_s={self.cap_s}")
        if self.stable_after_s <= 0:
            raise ValueError(f"backoff stable_after_s must be positive, got {self.stable_after_s}")


class Phase(enum.Enum):
    STARTING = "starting"  # its stages were started (first time or again) and are not all serving yet
    SERVING = "serving"
    DOWN = "down"  # a stage failed; its processes are stopped and it waits for its restart
    GIVEN_UP = "given_up"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ReplicaRecord:
    replica: int
    phase: Phase = Phase.STARTING
    since: float = 0.0  # when it entered its phase
    restarts: int = 0  # restarts begun since the mesh started
    failures: int = 0  # failures in a row, the one being handled included while DOWN
    ever_served: bool = False
    reason: str = ""  # why it last went down
    failed_rank: int | None = None  # the stage that failed first (None: not one stage's fault)


@dataclass(frozen=True)
class Restart:
    replica: int
    attempt: int  # the restart's number since the mesh started


@dataclass(frozen=True)
class WaitUntil:
    at: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class Nothing:
    """No decision to make: the replica is starting, serving or stopped; keep checking its health."""


Action = Restart | WaitUntil | GiveUp | Nothing


def backoff_delay(failures: int, policy: BackoffPolicy) -> float:
    """Seconds before the restart after ``failures`` failures in a row (0: at once)."""
    if failures <= 1:
        return 0.0
    # The exponent is bounded so that a replica dying for weeks cannot overflow the float.
    return min(policy.cap_s, policy.base_s * 2.0 ** min(failures - 2, 64))


def failures_in_a_row(record: ReplicaRecord, now: float, policy: BackoffPolicy) -> int:
    """The streak as of ``now``: none once the replica has served ``stable_after_s`` in one go."""
    if record.phase is Phase.SERVING and now - record.since >= policy.stable_after_s:
        return 0
    return record.failures


def next_action(record: ReplicaRecord, now: float, policy: BackoffPolicy) -> Action:
    """The one decision, like exo's ``plan()``: ``Restart`` the replica now, ``WaitUntil`` a time, ``GiveUp``,
    or ``Nothing`` (keep checking its health).

    A replica that never served gives up (a model or setting that cannot load: ``stagemesh serve`` fails at
    start with the reason). A replica that has served is restarted forever. The first restart of a streak of
    failures is immediate; the n-th waits ``base_s * 2 ** (n - 2)`` seconds, at most ``cap_s``
    (``backoff_delay``). Serving ``stable_after_s`` in one go ends the streak (``failures_in_a_row``).
    """
    if record.phase is not Phase.DOWN:
        return Nothing()
    if not record.ever_served:
        return GiveUp(record.reason)
    due = record.since + backoff_delay(record.failures, policy)
    if now >= due:
        return Restart(record.replica, record.restarts + 1)
    return WaitUntil(due)


# -- transitions ---------------------------------------------------------------


def restarting(record: ReplicaRecord, now: float) -> ReplicaRecord:
    """Its stages are being started again."""
    return replace(record, phase=Phase.STARTING, since=now, restarts=record.restarts + 1)


def serving(record: ReplicaRecord, now: float) -> ReplicaRecord:
    """Every stage serves. The streak stays until it has served ``stable_after_s`` in one go."""
    return replace(record, phase=Phase.SERVING, since=now, ever_served=True)


def failed(record: ReplicaRecord, now: float, reason: str, policy: BackoffPolicy,
           rank: int | None = None) -> ReplicaRecord:
    """A stage failed (or a restart did): the replica is down, one more failure in its streak."""
    return replace(record, phase=Phase.DOWN, since=now, failures=failures_in_a_row(record, now, policy) + 1,
                   reason=reason, failed_rank=rank)


def given_up(record: ReplicaRecord, now: float) -> ReplicaRecord:
    return replace(record, phase=Phase.GIVEN_UP, since=now)


def stopped(record: ReplicaRecord, now: float) -> ReplicaRecord:
    return replace(record, phase=Phase.STOPPED, since=now)


# -- how it reads --------------------------------------------------------------


def replica_state(record: ReplicaRecord, now: float, policy: BackoffPolicy) -> ReplicaState:
    if record.phase is Phase.STARTING:
        return ReplicaState.RESTARTING if record.restarts else ReplicaState.STARTING
    if record.phase is Phase.SERVING:
        return ReplicaState.SERVING
    if record.phase is Phase.STOPPED:
        return ReplicaState.STOPPED
    if record.phase is Phase.GIVEN_UP:
        return ReplicaState.FAILED
    action = next_action(record, now, policy)
    if isinstance(action, GiveUp):
        return ReplicaState.FAILED
    return ReplicaState.BACKING_OFF if isinstance(action, WaitUntil) else ReplicaState.RESTARTING


def pending_restart(record: ReplicaRecord, now: float, policy: BackoffPolicy) -> tuple[float, float] | None:
    """(backoff in seconds, when it ends) while the replica backs off; None otherwise."""
    action = next_action(record, now, policy)
    if not isinstance(action, WaitUntil):
        return None
    return backoff_delay(record.failures, policy), action.at
