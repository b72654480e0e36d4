"""The multi-turn chat workload of stagemesh bench serve: what each turn sends, how a conversation runs, its flags,
its per-turn statistics and the prefix comparison's verdict (no network)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from stagemesh.bench import serve as bench
from stagemesh.bench.conversation import Exchange, system_prompt, turn_prompt, user_message
from stagemesh.bench.load import closed_loop, converse
from stagemesh.bench.prefix_summary import summarize
from stagemesh.bench.serve import BenchSetupError
from stagemesh.bench.serve_report import format_report
from stagemesh.bench.stats import level_metrics, ratios
from stagemesh.bench.types import Prompt, RequestRecord, RunPlan, Workload
from stagemesh.bench.workload import load_tokenizer, request_body


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(default_model_path)


def test_system_prompt_is_shared_and_sized_and_user_messages_differ_from_their_first_token(tokenizer):
    system = system_prompt("0:1:concurrency=8", 128, tokenizer)
    assert system == system_prompt("0:1:concurrency=8", 128, tokenizer)  # deterministic
    assert system.tokens == len(tokenizer.encode(system.text)) == 128
    assert system.text != system_prompt("0:2:concurrency=8", 128, tokenizer).text  # each round its own
    firsts = [user_message("0:1:concurrency=8", c, 1, 16, tokenizer) for c in range(8)]
    assert all(u.tokens == 16 for u in firsts)
    assert len({tokenizer.encode(u.text)[0] for u in firsts}) > 1  # not all the same first token
    assert len({u.text for u in firsts}) == 8
    assert user_message("0:1:concurrency=8", 3, 2, 16, tokenizer) == user_message("0:1:concurrency=8", 3, 2, 16,
                                                                                    tokenizer)
    assert user_message("0:1:concurrency=8", 3, 2, 16, tokenizer).text != firsts[3].text


def test_every_turn_re_sends_the_whole_history_with_the_replies():
    system, u1, u2 = Prompt("sys", 10, "words"), Prompt("hello", 3, "words"), Prompt("again", 4, "words")
    first = turn_prompt(system, [], u1)
    assert first.messages == (("system", "sys"), ("user", "hello")) and first.tokens == 13
    second = turn_prompt(system, [Exchange(u1, "1, 2, 3", 5)], u2)
    assert second.messages == (("system", "sys"), ("user", "hello"), ("assistant", "1, 2, 3"), ("user", "again"))
    assert second.tokens == 10 + 3 + 5 + 4
    body = request_body(Workload("chat", 8, 16, 0, False, True, 0.0), "m", second)
    assert body["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "1, 2, 3"}, {"role": "user", "content": "again"}]


def _record(index=0, turn=0, ok=True, ttft=0.1, endpoint="a", output_tokens=2, start=0.0) -> RequestRecord:
    return RequestRecord(endpoint=endpoint, level="concurrency=2", round=1, index=index, start=start, latency=0.5,
                         ttft=ttft if ok else None, chunk_times=(ttft, ttft + 0.1) if ok else (),
                         output_tokens=output_tokens if ok else 0, output_tokens_source="usage", prompt_tokens=10,
                         prompt_tokens_source="usage", ok=ok, status=200 if ok else 503,
                         error=None if ok else "overloaded", turn=turn)


def test_a_conversation_sends_each_reply_back_and_stops_at_a_failed_turn():
    sent: list[tuple[int, tuple]] = []

    async def send_turn(prompt, turn, reply):
        sent.append((turn, prompt.messages))
        reply += [f"reply{turn}", "!"]  # streamed in two chunks
        return _record(turn=turn, ok=turn < 3)

    users = [Prompt(f"u{t}", 2, "words") for t in range(1, 5)]
    records = asyncio.run(converse(send_turn, Prompt("s", 5, "words"), users))
    assert [r.turn for r in records] == [1, 2, 3]  # turn 3 failed: turn 4 is not sent
    assert [turn for turn, _ in sent] == [1, 2, 3]
    assert sent[2][1] == (("system", "s"), ("user", "u1"), ("assistant", "reply1!"), ("user", "u2"),
                          ("assistant", "reply2!"), ("user", "u3"))


def test_the_closed_loop_keeps_n_conversations_in_flight_and_orders_records_by_conversation_and_turn():
    in_flight = peak = 0

    async def conversation(i):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (5 - i))  # later conversations finish first
        in_flight -= 1
        return [_record(index=i, turn=2), _record(index=i, turn=1)]

    records = asyncio.run(closed_loop(conversation, 2, RunPlan(5, None, 8, 60.0)))
    assert [(r.index, r.turn) for r in records] == [(i, t) for i in range(5) for t in (1, 2)]
    assert peak == 2


def test_ttft_per_turn_pools_successful_requests_and_ratios_compare_turn_by_turn():
    on = [_record(i, t, ttft=1.0 if t == 1 else 0.2, endpoint="on") for i in range(3) for t in (1, 2)]
    on.append(_record(3, 1, ok=False, endpoint="on"))
    off = [_record(i, t, ttft=1.0 if t == 1 else 1.2, endpoint="off") for i in range(3) for t in (1, 2)]
    m_on, m_off = level_metrics(on), level_metrics(off)
    assert [(d.count, d.p50) for d in m_on.ttft_by_turn] == [(3, 1.0), (3, 0.2)]
    assert m_on.failed == 1
    (ratio,) = ratios([m_off, m_on], [m_off, m_on], ["off", "on"])
    assert ratio.ttft_p50_by_turn == pytest.approx((1.0, 0.2 / 1.2))
    assert level_metrics([_record()]).ttft_by_turn == ()  # synthetic: no turns


def _doc(levels, requests, workload="w"):
    return {"config": {"levels": ["concurrency=8"], "workload_summary": workload}, "environment": {"cpu_count": 2},
            "results": {"levels": levels, "requests": requests}}


def _level(endpoint, ttft_p50, tok_s, by_turn=()):
    d = {"p50": ttft_p50}
    return {"endpoint": endpoint, "level": "concurrency=8", "completed": 24, "sent": 24, "ttft": d,
            "ttft_by_turn": [{"p50": p} for p in by_turn], "output_tokens_per_s": tok_s}


def test_the_prefix_verdict_reads_the_issues_ratios_against_their_targets():
    multi = _doc([_level("off", 2.0, 10.0, (2.0, 2.0)), _level("on", 0.6, 20.0, (2.0, 0.5)),
                  _level("mlx", 0.5, 25.0, (1.5, 0.4))],
                 [{"endpoint": e, "level": "concurrency=8", "ok": True, "turn": t, "ttft": x}
                  for e, turns in (("off", ((1, 2.0), (2, 2.0), (3, 2.0))), ("on", ((1, 2.0), (2, 0.5), (3, 0.3))),
                                   ("mlx", ((1, 1.5), (2, 1.0), (3, 0.6))))
                  for t, x in turns])
    distinct = _doc([_level("off", 1.0, 10.0), _level("on", 1.0, 9.8), _level("mlx", 1.0, 12.0)], [])
    summary = summarize(multi, distinct, counters={"multi-turn": {"on": {"hits": 1.0}}}, baseline="off",
                        cached="on", reference="mlx")
    # Turns 2 and later: on 0.4 s, off 2.0 s, mlx 0.8 s (the medians of two turns each).
    assert [(t["value"], t["met"]) for t in summary["targets"]] == [(0.2, True), (0.5, True), (0.8, False),
                                                                     (0.98, True)]
    assert summary["multi_turn"]["on concurrency=8"]["ttft_p50_later_turns_s"] == pytest.approx(0.4)
    assert summary["prefix_cache_counters"] == {"multi-turn": {"on": {"hits": 1.0}}}


def test_the_report_shows_ttft_per_turn():
    m = level_metrics([_record(i, t, ttft=0.1 * t) for i in range(2) for t in (1, 2, 3)]).to_dict()
    doc = {"results": {"summary": {"sent": 6, "completed": 6, "failed": 0, "warmup_failed": 0}, "warmup": [],
                       "levels": [m]},
           "ratios": []}
    text = format_report(doc)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("TTFT p50 by turn"))
    assert lines[at + 1].split() == ["endpoint", "level", "turn", "1", "turn", "2", "turn", "3"]
    assert lines[at + 2].split() == ["a", "concurrency=2", "100.0", "200.0", "300.0"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, flag", [
    (("--system-len", "64"), "--system-len"),  # a multi-turn flag without the workload
    (("--workload", "multi-turn", "--input-len", "64"), "--input-len"),
    (("--workload", "multi-turn", "--num-prompts", "8"), "--num-prompts"),
    (("--workload", "multi-turn", "--endpoint-type", "completions"), "--endpoint-type completions"),
    (("--workload", "multi-turn", "--request-rate", "2"), "--request-rate"),
    (("--workload", "multi-turn", "--turns", "0"), "--turns"),
])
def test_flags_that_do_not_fit_the_workload_are_refused_by_name(argv, flag):
    with pytest.raises(BenchSetupError, match=flag):
        bench.check_args(parse(*argv))


def test_multi_turn_defaults_to_chat_and_checks_its_lengths(tokenizer):
    workload = bench.workload_from_args(parse("--workload", "multi-turn", "--system-len", "64", "--user-len", "8"),
                                        tokenizer)
    assert workload.endpoint_type == "chat" and workload.kind == "multi-turn"
    assert (workload.multi_turn.system_tokens, workload.multi_turn.user_tokens, workload.multi_turn.turns) == (
        64, 8, bench.DEFAULT_TURNS)
    assert bench.workload_from_args(parse(), tokenizer).endpoint_type == "completions"
    with pytest.raises(BenchSetupError, match="--user-len"):
        bench.workload_from_args(parse("--workload", "multi-turn", "--user-len", "2"), tokenizer)
    with pytest.raises(BenchSetupError, match="--system-len"):
        bench.workload_from_args(parse("--workload", "multi-turn", "--system-len", "4"), tokenizer)
