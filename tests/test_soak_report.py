"""The soak's verdict (``stagemesh.soak.report.judge``) on plain values: which failures a fault excuses,
hung requests, unrecovered faults, slow recovery, and memory or descriptors that grew."""

from __future__ import annotations

from stagemesh.soak.report import FaultRecord, ProcessSample, RequestRecord, format_report, judge

CONFIG = {"pp": 2, "dp": 1, "streams": 2, "faults": ["kill"]}
KILL = FaultRecord("kill", replica=0, rank=1, pid=10, injected=20.0, ended=20.0, recovered=35.0)
SAMPLES = [ProcessSample("gateway", 1, 200 * 2**20, 40), ProcessSample("replica 0 stage 1", 10, 300 * 2**20, 30)]


def ok(at: float) -> RequestRecord:
    return RequestRecord("stream", at, at + 2, "ok", 200, "", 16)


def test_a_failure_in_flight_during_a_fault_is_excused_and_one_outside_is_not():
    during = RequestRecord("stream", 18.0, 21.0, "failed", 200, "The pipeline failed: ring peer lost")
    after = RequestRecord("stream", 50.0, 51.0, "failed", 503, "overloaded")
    report = judge(CONFIG, 60, [ok(1), during, after], [KILL], SAMPLES, SAMPLES)
    assert len(report.failures_excused) == 1 and len(report.failures_unexcused) == 1
    assert not report.passed and "outside any fault's window" in report.problems[0]
    assert report.recovery_median_s == report.recovery_worst_s == 15.0
    passing = judge(CONFIG, 60, [ok(1), during], [KILL], SAMPLES, SAMPLES)
    assert passing.passed and "PASSED" in format_report(passing)


def test_a_failure_without_a_message_is_never_excused():
    silent = RequestRecord("stream", 19.0, 22.0, "failed", None, "")
    assert judge(CONFIG, 60, [ok(1), silent], [KILL], SAMPLES, SAMPLES).failures_unexcused


def test_hung_requests_unrecovered_faults_and_slow_recovery_fail_the_run():
    hung = RequestRecord("stream", 5.0, 125.0, "hung", None, "no end after 120 s")
    never = FaultRecord("stop", 0, 0, 11, injected=40.0, ended=48.0, recovered=None)
    slow = FaultRecord("block", 0, 1, 12, injected=70.0, ended=78.0, recovered=150.0)
    problems = judge(CONFIG, 200, [ok(1), hung], [never, slow], SAMPLES, SAMPLES).problems
    assert any("hung" in p for p in problems)
    assert any("never recovered" in p and "stop replica 0 stage 0" in p for p in problems)
    assert any("worst recovery 80.0 s" in p for p in problems)


def test_growth_counts_only_for_a_process_that_ran_throughout():
    grown = [ProcessSample("gateway", 1, 260 * 2**20, 40), ProcessSample("replica 0 stage 1", 99, 900 * 2**20, 90)]
    report = judge(CONFIG, 60, [ok(1)], [KILL], SAMPLES, grown)
    assert report.problems == ["gateway: memory grew more than 10% (rss 200 -> 260 MB, fds 40 -> 40)"]
    restarted = next(r for r in report.resources if r["name"] == "replica 0 stage 1")
    assert restarted["same_process"] is False
    few_fds = [ProcessSample("gateway", 1, 200 * 2**20, 44), SAMPLES[1]]
    assert judge(CONFIG, 60, [ok(1)], [], SAMPLES, few_fds).passed  # +4 descriptors is noise, not a leak
