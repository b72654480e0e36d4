"""Argument checking and the text report of stagemesh bench serve (no network)."""

from __future__ import annotations

import argparse

import pytest

from stagemesh.bench import flags
from stagemesh.bench import serve as bench
from stagemesh.bench.serve import BenchSetupError
from stagemesh.bench.serve_report import format_report
from stagemesh.bench.types import Level


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags.add_report_flags(parser)
    return parser.parse_args(list(argv))


def test_lists_and_urls():
    assert bench.parse_list("1,4, 16", int, "--concurrency") == [1, 4, 16]
    assert bench.parse_list("0.5,inf", float, "--request-rate") == [0.5, float("inf")]
    with pytest.raises(BenchSetupError, match="--concurrency"):
        bench.parse_list("1,x", int, "--concurrency")
    with pytest.raises(BenchSetupError, match="positive"):
        bench.parse_list("0", int, "--concurrency")
    assert bench.normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert bench.normalize_base_url("https://h/x") == "https://h/x"
    with pytest.raises(BenchSetupError, match="--base-url"):
        bench.normalize_base_url("h:8000")


def test_per_endpoint_flags_once_for_all_or_once_each(monkeypatch):
    monkeypatch.delenv("STAGEMESH_API_KEY", raising=False)
    eps = bench.endpoints_from_args(parse("--base-url", "http://a:1", "--base-url", "http://b:2/v1",
                                          "--model", "m", "--api-key", "k1", "--api-key", "k2"))
    assert [(e.label, e.base_url, e.model, e.api_key) for e in eps] == [
        ("a:1", "http://a:1", "m", "k1"), ("b:2", "http://b:2", "m", "k2")]
    with pytest.raises(BenchSetupError, match="--model"):
        bench.endpoints_from_args(parse("--base-url", "http://a:1", "--base-url", "http://b:2", "--base-url",
                                        "http://c:3", "--model", "x", "--model", "y"))
    with pytest.raises(BenchSetupError, match="--label"):  # one label cannot name two endpoints
        bench.endpoints_from_args(parse("--base-url", "http://a:1", "--base-url", "http://b:2", "--label", "x"))
    with pytest.raises(BenchSetupError, match="distinct labels"):
        bench.endpoints_from_args(parse("--base-url", "http://a:1", "--base-url", "http://a:1"))
    (default,) = bench.endpoints_from_args(parse())
    assert default.base_url == bench.DEFAULT_BASE_URL and default.model is None


def test_levels_and_default_request_counts():
    assert bench.levels_from_args(parse()) == [Level("concurrency", 1)]
    levels = bench.levels_from_args(parse("--concurrency", "2,8", "--request-rate", "0.5"))
    assert [lv.name for lv in levels] == ["concurrency=2", "concurrency=8", "rate=0.5"]
    assert [bench.default_num_prompts(lv, None, None) for lv in levels] == [16, 32, 16]
    assert bench.default_num_prompts(Level("rate", 3.0), None, None) == 30
    assert bench.default_num_prompts(levels[0], 5, None) == 5
    assert bench.default_num_prompts(levels[0], None, 10.0) is None  # duration-bound
    with pytest.raises(BenchSetupError, match="--num-prompts"):
        bench.levels_from_args(parse("--request-rate", "inf", "--duration", "5"))


def test_bad_numbers_are_rejected_before_anything_runs():
    with pytest.raises(BenchSetupError, match="--rounds"):
        bench.check_args(parse("--rounds", "0"))
    with pytest.raises(BenchSetupError, match="--duration"):
        bench.check_args(parse("--duration", "-1"))


def test_prompts_too_short_to_differ_are_refused(capsys):
    # shorter than the counting instruction, every request would be the same text
    assert bench.run(parse("--input-len", "10", "--base-url", "http://127.0.0.1:9")) == 2
    assert "--input-len 10 is shorter than the counting instruction" in capsys.readouterr().err


def _level(endpoint, failed=0, errors=()):
    dist = {"count": 1, "mean": 0.01, "p50": 0.01, "p90": 0.01, "p99": 0.02, "max": 0.02}
    return {"endpoint": endpoint, "level": "concurrency=1", "load": "concurrency", "load_value": 1, "sent": 4,
            "completed": 4 - failed, "failed": failed, "requests_per_s": 2.0, "output_tokens_per_s": 100.0,
            "total_tokens_per_s": 150.0, "ttft": dist, "itl": dist, "tpot": dist, "e2el": dist,
            "errors": list(errors)}


def test_report_shows_failures_with_status_and_message_and_the_ratios():
    doc = {
        "results": {
            "summary": {"sent": 8, "completed": 7, "failed": 1, "warmup_failed": 0},
            "levels": [_level("a"), _level("b", 1, [{"status": 503, "message": "overloaded", "count": 1}])],
            "warmup": [],
        },
        "ratios": [{"level": "concurrency=1", "endpoint": "b", "baseline": "a", "output_tokens_per_s": 0.5,
                    "ttft_p50": 1.0, "itl_p50": 2.0, "output_tokens_per_s_by_round": [0.5]}],
    }
    text = format_report(doc)
    assert "FAILED: 1 of 8 requests" in text
    assert "1 x HTTP 503: overloaded" in text
    assert "ratios to a" in text and "0.50x" in text and "2.00x" in text
    assert text.splitlines()[0].split()[:3] == ["endpoint", "level", "ok"]


def test_bench_compare_levels_default_to_several_waves_and_flags_win():
    from stagemesh.bench.compare import _sizes

    def args(**given):
        base = dict(input_len=None, output_len=None, num_prompts=None, system_len=1024, user_len=64, conversations=8)
        return argparse.Namespace(**{**base, **given})

    # No --num-prompts: stagemesh bench serve picks 4 x each level's concurrency, so no level is a single wave.
    assert _sizes(args(), "gpus") == (32, 48, None)
    assert _sizes(args(num_prompts=96, output_len=64), "gpus") == (32, 64, 96)
    # The prefix comparison's prompts follow its conversations; its prompt is the system prompt plus a turn.
    assert _sizes(args(), "prefix") == (1088, 16, 16)


def test_bench_gateway_refuses_a_level_below_one(capsys):
    # The CLI's entry point in this process: tests/fast_tier.py fails the test if the command starts a process.
    from stagemesh.cli import main

    assert main(["bench", "gateway", "--concurrency", "0"]) == 2
    assert "stagemesh bench gateway: error: --concurrency takes positive integers" in capsys.readouterr().err


def test_bench_compare_refuses_a_gguf_comparison_of_a_model_directory(tmp_path, capsys):
    """A model directory is served to both sides as it is; ``stock`` converts a GGUF for mlx_lm, so it is refused
    with the comparisons that do take a directory, before any server starts."""
    from stagemesh.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "compare", str(tmp_path), "--comparisons", "mlx-lm,stock",
                 "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--comparisons stock compare against the GGUF converted for mlx_lm" in err
    assert f"{tmp_path} is not a .gguf file" in err and "mlx-lm" in err.split("choose from")[1]
