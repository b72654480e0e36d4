"""The GPU benchmarks' tools, run small on the CPU: a random-weight checkpoint both servers load,
``stagemesh bench hop`` timing a real two-process hop (MLX ring and TCP lane), ``bench engine``, and
``bench stack``: the bare forward, the engine, and a real serve loaded at its stage's gRPC and at its gateway."""

import json
import os
import subprocess
import sys

import pytest

from stage_worker.model.blas import loaded_blas
from stagemesh.bench.random_checkpoint import shape_config, shape_names, write_random_checkpoint
from stagemesh.bench.report import ENVELOPE_KEYS
from stagemesh.cli import main
from tests.architectures import tiny_checkpoint
from tests.conftest import free_port_base


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A small random Llama (hidden 64, 4 layers) with the default model's tokenizer: the tools below are
    tested for what they measure and report, which a small model shows as well as the default one, in a
    fraction of the CPU time."""
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def test_a_random_checkpoint_loads_in_mlx_lm_and_in_stagemesh_with_a_tokenizer_for_every_id(tmp_path):
    from mlx_lm import load

    from stage_worker.checkpoint.model_reader import read_model_spec

    assert {"llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"} <= set(shape_names())
    small = {**shape_config("llama-3.2-1b"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 50000}
    out = write_random_checkpoint(small, tmp_path / "ckpt", "float32")
    model, tokenizer = load(str(out))
    assert len(tokenizer._tokenizer) == 50000  # the default tokenizer's 49152 ids, then reserved ones
    assert tokenizer.decode([49999]) == "<|reserved_847|>"
    spec = read_model_spec(str(out))
    assert (spec.model_type, spec.num_layers, spec.hidden_size, spec.format) == ("llama", 2, 64, "mlx")


def test_a_checkpoint_larger_than_a_shard_is_written_shard_by_shard_with_the_same_weights(tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    from stage_worker.checkpoint.model_reader import read_model_spec
    from tests.architectures import TINY_CONFIGS

    config = TINY_CONFIGS["qwen3_moe"]
    whole = write_random_checkpoint(config, tmp_path / "whole", "float32", seed=3)
    sharded = write_random_checkpoint(config, tmp_path / "sharded", "float32", seed=3, shard_bytes=4_000_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    expected = mx.load(str(whole / "model.safetensors"))
    assert set(index["weight_map"]) == set(expected)
    for file in files:
        for name, array in mx.load(str(sharded / file)).items():
            assert index["weight_map"][name] == file and mx.array_equal(array, expected[name])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    load(str(sharded))  # mlx-lm reads the shards, stagemesh the index
    assert read_model_spec(str(sharded)).details["weight_map"] == index["weight_map"]


@pytest.mark.e2e
def test_bench_hop_times_both_transports_between_two_processes(tmp_path):
    out = tmp_path / "hop.json"
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "hop", "--hidden", "64", "--rows", "1,4",
                           "--iters", "5", "--warmup", "1", "--port-base", str(free_port_base(3)),
                           "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert list(report) == list(ENVELOPE_KEYS) and report["kind"] == "hop"
    assert [s["rows"] for s in report["results"]["shapes"]] == [1, 4]
    for shape in report["results"]["shapes"]:
        assert shape["ring_ms_p50"] > 0 and shape["lane_ms_p50"] > 0 and shape["compute_ms_p50"] > 0
    assert [r["rows"] for r in report["ratios"]] == [1, 4] and all(r["value"] > 0 for r in report["ratios"])
    assert "ring ms" in done.stdout  # the table


@pytest.mark.e2e
def test_bench_engine_drives_the_entry_stage_alone(tmp_path, tiny_llama):
    out = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "engine", tiny_llama, "--output-len", "4",
                           "--streams", "2", "--input-len", "4", "--mixed", "3", "--mixed-max-prompt", "6", "--profile",
                           "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["environment"]["backend"] == "cpu" and report["config"]["step_ahead"] is False
    # Timed on the BLAS a stage preloads (this process loaded the same one: tests/conftest.py).
    assert report["config"]["blas"] == loaded_blas()
    result = report["results"]
    assert result["single_stream"]["tokens"] == 4 and result["single_stream"]["ms_per_token_p50"] > 0
    assert result["streams"]["tokens"] == 8 and result["streams"]["tokens_per_s"] > 0
    assert result["single_stream"]["first_token_ms"] > 0
    mixed = result["mixed"]
    assert mixed["requests"] == 3 and mixed["failed"] == 0 and 3 <= mixed["tokens"] <= 12 and mixed["ttft_p50_ms"] > 0
    assert "engine thread, one stream" in done.stdout and "engine thread, 3 mixed requests" in done.stdout


@pytest.mark.e2e
def test_bench_engine_compares_separate_and_joined_projections_in_turns(tmp_path, tiny_llama):
    out = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "engine", tiny_llama, "--output-len", "4",
                           "--streams", "2", "--input-len", "4", "--mixed", "2", "--mixed-max-prompt", "6",
                           "--compare-projections", "2", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rounds = report["results"]["projections"]
    assert len(rounds) == 2
    for pair in rounds:
        assert pair["joined_in_every_layer"] == {"qkv": True, "gate_up": True}
        for arm in ("separate", "joined"):
            assert pair[arm]["streams"]["tokens"] == 8 and pair[arm]["mixed"]["failed"] == 0
    *each, median = report["ratios"]
    assert [r.pop("round") for r in each] == [1, 2] and median.pop("round") == "median"
    assert {r.pop("compares") for r in (*each, median)} == {"joined / separate projections"}
    for key in ("single_stream", "streams", "mixed"):
        assert all(r[key] > 0 for r in each) and median[key] == round((each[0][key] + each[1][key]) / 2, 3)
    expected = rounds[0]["joined"]["streams"]["tokens_per_s"] / rounds[0]["separate"]["streams"]["tokens_per_s"]
    assert each[0]["streams"] == round(expected, 3)
    assert "round median, joined / separate projections" in done.stdout


def test_bench_engine_refuses_compare_projections_with_profile(capsys, monkeypatch):
    # bench engine sets MLX's serving variables in its environment first: a copy here, so none outlives the test.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert main(["bench", "engine", "--compare-projections", "1", "--profile"]) == 2
    assert "--compare-projections" in capsys.readouterr().err


@pytest.mark.e2e
def test_bench_stack_measures_the_engine_the_stage_grpc_and_the_gateway_of_one_real_serve(tmp_path, tiny_llama):
    out = tmp_path / "stack.json"
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "stack", tiny_llama, "--output-len", "4",
                           "--streams", "2", "--input-len", "4", "--rounds", "1",
                           "--port-base", str(free_port_base(8)), "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report) == list(ENVELOPE_KEYS) and report["kind"] == "stack"
    levels = report["results"]["levels"]
    assert [row["streams"] for row in levels] == [1, 2]
    for row in levels:
        assert set(row["layers"]) == {"bare", "engine", "stage_grpc", "gateway"}
        for layer in row["layers"].values():
            assert layer["failed"] == 0 and layer["tokens_per_s"] > 0
        # Straight at the stage every token arrives: 4 per stream, so gaps and a first token exist.
        assert row["layers"]["stage_grpc"]["ttft_p50_ms"] > 0 and row["layers"]["stage_grpc"]["itl_p50_ms"] > 0
    ratios = {(r["streams"], r["compares"].removesuffix(" tokens per second")): r["value"] for r in report["ratios"]}
    assert set(ratios) == {(streams, pair) for streams in (1, 2) for pair in (
        "engine / bare", "stage_grpc / engine", "gateway / stage_grpc", "gateway / engine", "gateway / bare")}
    assert all(value > 0 for value in ratios.values())
    assert "stage_grpc" in done.stdout and "gateway" in done.stdout  # the table
