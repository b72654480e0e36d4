"""The benchmark family: ``stagemesh bench KIND``, the flags kinds share, and the one report shape.

All in this process: the parsers are built as the CLI builds them, and the reports come from
``build_report`` with made-up results, rendered by each kind's own text formatter.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json

import pytest

from stagemesh import cli
from stagemesh.bench import command, flags
from stagemesh.bench.report import ENVELOPE_KEYS, build_report, flags_of

PRODUCT = ("serve", "chat", "status", "plan", "doctor", "convert", "certs", "soak")
KINDS = ("serve", "compare", "stack", "gateway", "engine", "prefix", "speculative", "pipeline", "experts",
         "tensor", "hop", "parity")
OLD_FLAGS = ("--out", "--tokens", "--prompt-len", "--max-tokens", "--repeats", "--port", "--stage-rpc")


def kind_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="stagemesh bench")
    command.add_arguments(parser)
    (kinds,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(kinds.choices)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_the_top_level_help_lists_the_products_commands_then_bench(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("    ") and line.split()[0] in (*PRODUCT, "bench")]
    assert listed == [*PRODUCT, "bench"]


@pytest.mark.parametrize("old", ["bench-serving", "bench-hop", "bench-engine", "parity"])
def test_the_old_command_names_are_gone(old, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([old])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{old}'" in err and "'bench'" in err


def test_bench_alone_lists_every_kind(capsys):
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()[0] in KINDS]
    assert listed == list(KINDS) == list(command.KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kinds_help_works_and_ends_with_the_report_flags(kind, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", kind, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: stagemesh bench {kind} ")
    assert f"stagemesh bench {kind}``" in out  # the kind's module docstring is its description
    assert "report (every kind):" in out and "--output FILE" in out and "--json" in out


def test_a_flag_kinds_share_reads_the_same_in_each_and_the_old_names_are_gone():
    parsers = kind_parsers()
    where: dict[str, list[str]] = {}
    for kind, parser in parsers.items():
        flags_here = options(parser)
        assert not set(OLD_FLAGS) & set(flags_here), kind
        for flag, text in flags.HELP.items():
            if flag in flags_here:
                assert (flags_here[flag].help or "").startswith(text), (kind, flag)
                where.setdefault(flag, []).append(kind)
        positional = [a for a in parser._actions if a.dest == "model" and not a.option_strings]
        if positional:
            assert (positional[0].help or "").startswith(flags.HELP["model"]), kind
            where.setdefault("model", []).append(kind)
    assert where["--output"] == where["--json"] == list(KINDS)
    assert where["--output-len"] == ["serve", "compare", "stack", "gateway", "engine", "prefix", "speculative",
                                     "pipeline", "parity"]
    assert where["--input-len"] == ["serve", "compare", "stack", "gateway", "engine"]
    assert where["--rounds"] == ["serve", "compare", "stack", "speculative", "pipeline"]
    assert where["--warmup"] == ["serve", "experts", "tensor", "hop"]
    assert where["--port-base"] == ["compare", "stack", "gateway", "speculative", "tensor", "hop"]
    assert where["--shape"] == ["compare", "stack", "engine", "speculative", "experts"]
    assert where["model"] == ["compare", "stack", "engine", "prefix", "speculative", "pipeline", "tensor", "parity"]


def test_flags_of_keeps_a_kinds_settings_and_drops_the_clis_own():
    args = argparse.Namespace(command="bench", kind="hop", output="r.json", json=True, hidden=64,
                              _run_kind=print, _command_name="bench hop")
    assert flags_of(args) == {"hidden": 64}


ENVIRONMENT = {"hostname": "h", "backend": "cpu", "versions": {"python": "3"}}
STARTED = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def _level(endpoint: str) -> dict:
    dist = {"count": 1, "mean": 0.01, "p50": 0.01, "p90": 0.01, "p99": 0.02, "max": 0.02}
    return {"endpoint": endpoint, "level": "concurrency=1", "load": "concurrency", "load_value": 1, "sent": 1,
            "completed": 1, "failed": 0, "requests_per_s": 2.0, "output_tokens_per_s": 100.0,
            "total_tokens_per_s": 150.0, "ttft": dist, "itl": dist, "tpot": dist, "e2el": dist, "errors": []}


def _engine_runs() -> dict:
    return {"single_stream": {"streams": 1, "tokens": 4, "tokens_per_s": 50.0, "ms_per_token_p50": 20.0,
                              "first_token_ms": 30.0, "slowest_gap_ms": 25.0},
            "streams": {"streams": 2, "tokens": 8, "tokens_per_s": 90.0}}


def _fake(kind: str) -> tuple[dict, dict, list[dict]]:
    """(config, results, ratios) shaped as each kind's run makes them, with made-up figures."""
    layer = {"tokens_per_s": 10.0, "ttft_p50_ms": 1.0, "itl_p50_ms": 2.0, "failed": 0}
    arm = {"ttft_p50_s": 0.1, "ttft_p50_later_turns_s": 0.05, "tokens_per_s": 40.0}
    return {
        "serve": ({}, {"endpoints": [{"label": "a"}], "warmup": [], "levels": [_level("a")], "rounds": [],
                       "requests": [], "summary": {"sent": 1, "completed": 1, "failed": 0, "warmup_failed": 0}}, []),
        "compare": ({}, {"runs": [{"name": "pp", "endpoints": ["pp1", "pp2"], "report": "pp.json", "ok": True}],
                         "bare": None, "prefix": None},
                    [{"run": "pp", "level": "concurrency=1", "endpoint": "pp2", "baseline": "pp1",
                      "output_tokens_per_s": 1.5, "ttft_p50": 1.0, "itl_p50": 0.7,
                      "output_tokens_per_s_by_round": [1.5]}]),
        "stack": ({}, {"levels": [{"streams": 1, "layers": dict.fromkeys(("bare", "engine", "stage_grpc", "gateway"),
                                                                        layer)}]},
                  [{"streams": 1, "compares": "engine / bare tokens per second", "value": 1.0}]),
        "gateway": ({}, {"levels": [{"concurrency": 1, "offered_tokens_per_s": 200.0, "output_tokens_per_s": 190.0,
                                     "ttft_p50_ms": 3.0, "itl_p50_ms": 5.0, "failed": 0, "gateway_cpu_s": 1.0,
                                     "gateway_core_share": 0.5, "gateway_cpu_ms_per_token": 0.2}]},
                    [{"concurrency": 1, "compares": "delivered / offered tokens per second", "value": 0.95}]),
        "engine": ({"model": "m", "dtype": "float32", "blas": "openblas", "step_ahead": False},
                   {"quantized": False, "fused_projections": True, **_engine_runs()}, []),
        "prefix": ({}, {"multi_turn": {"cache_off": arm, "cache_on": {**arm, "prefix_cache_hit_rate": 0.8}}},
                   [{"workload": "multi_turn", "compares": "cache on / cache off", "ttft_p50_s": 0.4}]),
        "speculative": ({}, {"levels": [{"streams": 1, "off": {"tokens": 100, "seconds": 10.0, "tokens_per_s": 10.0},
                                         "on": {"tokens": 100, "seconds": 6.0, "tokens_per_s": 16.7,
                                                "acceptance_rate": 0.5, "tokens_per_verification": 3.2,
                                                "plain_decode_steps": 20}}]},
                        [{"streams": 1, "compares": "speculation on / off", "tokens_per_s": 1.67,
                          "identical_greedy_tokens": True}]),
        "pipeline": ({}, {"summary": {"mlx_lm": {"decode_tokens_per_s": 10.0, "peak_rss_bytes": [1e8]},
                                      "pp1": {"decode_tokens_per_s": 9.0, "peak_rss_bytes": [2e8]}}},
                     [{"arm": "mlx_lm", "vs_mlx_lm": 1.0, "vs_pp1": 1.1},
                      {"arm": "pp1", "vs_mlx_lm": 0.9, "vs_pp1": 1.0, "rss_vs_pp1": [1.0]}]),
        "experts": ({}, {"shape": "s", "model_type": "qwen3_moe", "experts": 8, "top_k": 2, "dims": 64, "hidden": 32,
                         "dtype": "bfloat16", "device": "Device(gpu, 0)",
                         "rows": [{"rows": 16, "experts_touched": 8, "gathered_ms_p50": 1.5,
                                   "all_experts_ms_p50": 0.5, "speedup": 3.0, "max_relative_difference": 0.0}]},
                    [{"rows": 16, "compares": "gathered / all experts time", "value": 3.0}]),
        "tensor": ({}, {"tp": 2, "model": "m", "weight_bytes": 2e8, "member_weight_bytes": 1.2e8, "blas": "openblas",
                        "load_peak_bytes": 2.5e8, "member_load_peak_bytes": 1.5e8,
                        "shapes": [{"rows": 1, "tp1_step_ms": 10.0, "tp_step_ms": 6.0, "tp_allreduce_ms": 1.0,
                                    "tp_compute_ms": 5.0, "tp1_tokens_per_s": 100.0, "tp_tokens_per_s": 166.7,
                                    "speedup": 1.667, "ceiling": 1.9, "of_ceiling": 0.877}]},
                   [{"rows": 1, "compares": "-tp 2 / -tp 1 tokens/s", "value": 1.667}]),
        "hop": ({"device": "Device(cpu, 0)"},
                {"dtype": "bfloat16", "hidden": 64, "shapes": [
                    {"rows": 1, "bytes": 128, **{f"{p}_ms_p50": 0.1 for p in (
                        "ring", "lane", "compute", "sync", "to_host", "from_host")}}]},
                [{"rows": 1, "compares": "lane / ring round trip", "value": 1.0}]),
        "parity": ({}, {"passed": True, "max_abs_diff": 0.0, "logits_equal": True, "tokens_equal": True,
                        "first_divergence": None, "logit_rows": 3, "logit_values": 10, "layers": [[0, 1], [1, 2]],
                        "outputs": [{"prompt": "p", "text": "t"}]}, []),
    }[kind]


def _text(kind: str, report: dict) -> str:
    """The kind's own text, rendered from the report."""
    from stagemesh.bench import (
        compare,
        engine,
        experts,
        gateway,
        hop,
        parity,
        pipeline,
        prefix,
        serve_report,
        speculative,
        stack,
        tensor,
    )

    results = report["results"]
    return {
        "serve": lambda: serve_report.format_report(report),
        "compare": lambda: compare.format_compare(report),
        "stack": lambda: "\n".join(stack._table(report)),
        "gateway": lambda: "\n".join(gateway._table(results["levels"])),
        "engine": lambda: engine.format_engine(report),
        "prefix": lambda: prefix.format_prefix(report),
        "speculative": lambda: speculative.format_speculative(report),
        "pipeline": lambda: pipeline.format_table(results["summary"], report["ratios"]),
        "experts": lambda: experts.format_experts(report),
        "tensor": lambda: tensor.format_tensor(report),
        "hop": lambda: hop.format_hop(report),
        "parity": lambda: "\n".join(parity.format_parity(results)),
    }[kind]()


@pytest.mark.parametrize("kind", KINDS)
def test_every_kinds_report_has_the_one_envelope_and_renders_as_its_text(kind):
    config, results, ratios = _fake(kind)
    report = build_report(kind, started_at=STARTED, config=config, results=results, ratios=ratios,
                          command=["stagemesh", "bench", kind], env=ENVIRONMENT)
    assert list(report) == list(ENVELOPE_KEYS)
    assert (report["schema"], report["kind"], report["command"]) == ("stagemesh-bench/2", kind,
                                                                    ["stagemesh", "bench", kind])
    assert report["started_at"] == "2026-01-02T03:04:05+00:00"
    assert dt.datetime.fromisoformat(report["finished_at"]) >= STARTED
    assert isinstance(report["ratios"], list) and all(isinstance(r, dict) for r in report["ratios"])
    assert json.loads(json.dumps(report, allow_nan=False)) == report  # strict JSON, as written
    assert _text(kind, report).strip()


def test_the_environment_names_the_host_and_the_versions_without_importing_mlx():
    import sys

    from stagemesh.bench.report import environment

    had_mlx = "mlx.core" in sys.modules
    env = environment()
    assert env["hostname"] and env["cpu_count"] and env["backend"] is None
    assert set(env["versions"]) == {"python", "stagemesh", "mlx", "mlx-lm"} and env["versions"]["stagemesh"]
    assert ("mlx.core" in sys.modules) == had_mlx
