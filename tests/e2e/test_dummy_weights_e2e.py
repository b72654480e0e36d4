"""``--load-format dummy`` end to end: random weights over the real ring are the same model at every layout,
and ``stagemesh serve`` answers from a directory holding only a config.json."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from coordinator.local_launcher import start_local_pipeline
from stagemesh_core.plan import make_local_plan
from tests.conftest import free_port_base, tiny_config
from tests.e2e.serve_process import start_serve

pytestmark = pytest.mark.e2e

PROMPTS = [[1, 17, 300, 42, 9], [500, 3]]


def _run(model: str, pp: int, workdir) -> tuple[list[list[int]], str]:
    plan = make_local_plan(model, 4, pp, "float32", ring_base_port=free_port_base(2 * pp), load_format="dummy")
    pipeline = start_local_pipeline(plan, job={"prompts": PROMPTS, "max_tokens": 12}, workdir=str(workdir))
    pipeline.wait(300)
    logs = "".join((workdir / f"stage-{r}.log").read_text() for r in range(pp))
    return json.loads((workdir / "result.json").read_text())["outputs"], logs


def test_pp2_generates_exactly_the_tokens_pp1_does(tmp_path):
    model = tiny_config(tmp_path / "tiny")
    one, one_logs = _run(model, 1, tmp_path / "pp1")
    two, two_logs = _run(model, 2, tmp_path / "pp2")
    assert [len(o) for o in one] == [12, 12]
    assert two == one
    assert "dummy (random) weights" in one_logs and two_logs.count("dummy (random) weights") == 2


@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["dense", "4-bit"])
def test_parity_tool_finds_dummy_pp2_bit_identical_to_pp1(tmp_path, quantization):
    extra = {"quantization": quantization, "tie_word_embeddings": False} if quantization else {}
    model = tiny_config(tmp_path / "tiny", **extra)
    result = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "bench", "parity", model, "--load-format", "dummy", "-pp", "2",
         "--output-len", "8", "--dtype", "bfloat16", "--ring-base-port", str(free_port_base(4))],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dummy (random) weights" in result.stdout
    assert "logits bit-identical: True; greedy tokens identical: True" in result.stdout


def test_serve_answers_a_completion_from_a_config_only_directory(tmp_path):
    # The borrowed default tokenizer knows 49152 tokens; the model must have an embedding for each.
    model = tiny_config(tmp_path / "tiny-llama", vocab_size=49152)
    serve = start_serve(tmp_path, model, "--load-format", "dummy", pp=2)
    try:
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
        again = client.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == reply.choices[0].text
        mesh = serve.mesh()
        assert mesh["model"] == "tiny-llama"
        assert [s["layers"] for s in mesh["replicas"][0]["stages"]] == [[0, 2], [2, 4]]
        assert "embedded default model's tokenizer" in serve.log()
    finally:
        serve.stop()
