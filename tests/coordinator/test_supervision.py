"""Supervision's rule over fake time: restart at once, back off doubling to a cap, forget after stable health,
give up only on a replica that never served; and how a record reads in the snapshot (pure, no Ray)."""

from __future__ import annotations

import pytest

from coordinator.placement import StageSlot
from coordinator.publish import replica_snapshot
from coordinator.replica import LiveReplica, LiveStage
from coordinator.supervision import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    STABLE_AFTER_S,
    BackoffPolicy,
    GiveUp,
    Nothing,
    Phase,
    ReplicaRecord,
    Restart,
    WaitUntil,
    failed,
    failures_in_a_row,
    given_up,
    next_action,
    pending_restart,
    replica_state,
    restarting,
    serving,
    stopped,
)
from stagemesh_core.states import ReplicaState

POLICY = BackoffPolicy(base_s=1.0, cap_s=30.0, stable_after_s=100.0)


def _serving_since(now: float) -> ReplicaRecord:
    return serving(ReplicaRecord(0), now)


def _die_and_restart(record: ReplicaRecord, now: float) -> tuple[ReplicaRecord, float, float]:
    """The replica dies at ``now``; follow the actions until it is restarted. (record, wait, restart time)."""
    record = failed(record, now, "killed by signal 9", POLICY, rank=1)
    action = next_action(record, now, POLICY)
    if isinstance(action, WaitUntil):
        assert action.at > now
        assert next_action(record, action.at - 0.001, POLICY) == action  # still waiting just before
        now = action.at
        action = next_action(record, now, POLICY)
    assert action == Restart(0, record.restarts + 1)
    return restarting(record, now), now - record.since, now


def test_a_replica_that_keeps_dying_backs_off_doubling_up_to_the_cap():
    record, now, waits = _serving_since(0.0), 10.0, []
    for _ in range(9):
        record, wait, now = _die_and_restart(record, now)
        waits.append(wait)
        record = serving(record, now + 5)  # serves briefly, then dies again
        now += 10
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert record.restarts == 9 and record.failures == 9


def test_dying_while_restarting_counts_too():
    record, _, now = _die_and_restart(_serving_since(0.0), 10.0)
    record = failed(record, now + 3, "exited with code 3 (a neighbour failed or refused it)", POLICY)
    assert next_action(record, now + 3, POLICY) == WaitUntil(now + 4)
    assert replica_state(record, now + 3, POLICY) is ReplicaState.BACKING_OFF


def test_serving_long_enough_in_one_go_forgets_the_failures():
    record, now = _serving_since(0.0), 10.0
    for _ in range(4):
        record, _, now = _die_and_restart(record, now)
        record = serving(record, now)
        now += 1
    assert failures_in_a_row(record, now, POLICY) == 4
    # Just short of stable: the next failure still waits.
    almost = record.since + POLICY.stable_after_s - 1
    assert isinstance(next_action(failed(record, almost, "x", POLICY), almost, POLICY), WaitUntil)
    # Stable: the streak is gone, and the next failure restarts at once.
    stable = record.since + POLICY.stable_after_s
    assert failures_in_a_row(record, stable, POLICY) == 0
    down = failed(record, stable, "x", POLICY)
    assert down.failures == 1 and next_action(down, stable, POLICY) == Restart(0, 5)


def test_a_replica_that_never_served_is_given_up_at_once():
    at_start = failed(ReplicaRecord(2), 3.0, "replica 2 stage 0 failed (exited with code 2 (configuration error))",
                      POLICY, rank=0)
    assert next_action(at_start, 3.0, POLICY) == GiveUp(at_start.reason)
    assert replica_state(at_start, 3.0, POLICY) is ReplicaState.FAILED
    done = given_up(at_start, 3.0)
    assert next_action(done, 1e9, POLICY) == Nothing() and replica_state(done, 3.0, POLICY) is ReplicaState.FAILED


def test_it_never_gives_up_on_a_replica_that_has_served():
    record = ReplicaRecord(0, Phase.DOWN, since=0.0, restarts=10_000, failures=10_000, ever_served=True)
    assert next_action(record, 0.0, POLICY) == WaitUntil(POLICY.cap_s)  # no overflow, the cap holds
    assert next_action(record, POLICY.cap_s, POLICY) == Restart(0, 10_001)


def test_nothing_to_do_while_starting_serving_or_stopped():
    for record in (ReplicaRecord(0), _serving_since(0.0), stopped(_serving_since(0.0), 5.0)):
        assert next_action(record, 1e6, POLICY) == Nothing()


def test_how_a_record_reads():
    assert replica_state(ReplicaRecord(0), 0.0, POLICY) is ReplicaState.STARTING
    record = _serving_since(0.0)
    assert replica_state(record, 1.0, POLICY) is ReplicaState.SERVING and pending_restart(record, 1, POLICY) is None
    first = failed(record, 10.0, "x", POLICY)
    assert replica_state(first, 10.0, POLICY) is ReplicaState.RESTARTING  # due at once
    again = failed(restarting(first, 10.0), 12.0, "x", POLICY)
    assert replica_state(again, 12.5, POLICY) is ReplicaState.BACKING_OFF
    assert pending_restart(again, 12.5, POLICY) == (1.0, 13.0)
    assert replica_state(again, 13.0, POLICY) is ReplicaState.RESTARTING
    assert replica_state(restarting(again, 13.0), 13.0, POLICY) is ReplicaState.RESTARTING
    assert replica_state(stopped(again, 14.0), 14.0, POLICY) is ReplicaState.STOPPED


def test_the_default_policy_is_the_named_constants():
    assert BackoffPolicy() == BackoffPolicy(BACKOFF_BASE_S, BACKOFF_CAP_S, STABLE_AFTER_S)
    assert BACKOFF_BASE_S < BACKOFF_CAP_S <= 600  # a few minutes at most between two restarts


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"base_s": 0}, "base_s must be positive"),
    ({"base_s": 10, "cap_s": 5}, "at most cap_s"),
    ({"stable_after_s": 0}, "stable_after_s must be positive"),
])
def test_a_policy_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BackoffPolicy(**kwargs)


def test_the_snapshot_carries_the_backoff():
    stage = LiveStage(1, StageSlot(replica=1, rank=0, node_id="n", address="127.0.0.1"), actor=None)
    record = failed(restarting(failed(_serving_since(0.0), 10.0, "x", POLICY), 10.0), 20.0, "y", POLICY)
    snapshot = replica_snapshot(LiveReplica(1, None, [stage], record), now=20.5, wall_offset=1000.0,
                                policy=POLICY, compute_dtype="float32")
    document = snapshot.to_json()
    assert {k: document[k] for k in ("replica", "healthy", "restarts", "state", "consecutive_failures",
                                     "backoff_s", "next_restart_at")} == {
        "replica": 1, "healthy": False, "restarts": 1, "state": "backing_off", "consecutive_failures": 2,
        "backoff_s": 1.0, "next_restart_at": 1021.0}
    serving_again = replica_snapshot(LiveReplica(1, None, [stage], serving(restarting(record, 21.0), 22.0)),
                                     now=22.0, wall_offset=1000.0, policy=POLICY, compute_dtype="float32")
    assert (serving_again.state, serving_again.consecutive_failures, serving_again.backoff_s,
            serving_again.next_restart_at) == (ReplicaState.SERVING, 2, None, None)
