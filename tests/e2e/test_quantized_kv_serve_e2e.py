"""``stagemesh serve --kv-cache-dtype q4`` at PP=2 end to end on the embedded default model: real Ray, stage
processes, lanes, gRPC and the OpenAI SDK (q8, and q4 at PP=1, alone and batched, run through the real
in-process pipeline in tests/test_quantized_kv.py; one served mesh here keeps the suite's time).

Greedy completions, some sent at once so they decode in one batch (``BatchQuantizedKVCache``), equal mlx-lm's
own ``generate_step`` over ``QuantizedKVCache`` (same bits, group 64, from the first position) on the same
weights: token for token, and each token's logprob within float noise. ``--dequantize off`` keeps the
stages on the stored quantized weights, the ones mlx-lm's model is given here.

That the quantized path is really taken is checked against auto, computed by mlx-lm over its plain
``KVCache`` (what ``--kv-cache-dtype auto`` serves: tests/e2e/test_openai_api_e2e.py checks the served model
against that same model), rather than another served mesh: q4 changes the greedy tokens themselves. The
stages' ``/metrics`` KV capacity is the plan's for q4, and q4 holds about 6.4x what the same stage would in
float32 (``stagemesh serve --dry-run`` states both)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_process import start_serve
from tests.e2e.test_openai_api_e2e import mlx_lm_model, tokenizer  # noqa: F401 (fixtures: mlx-lm's model, ours)

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
GROUP = 64  # --kv-cache-group-size's default; the model's heads are 64 wide
MAX_TOKENS = 8
TEXTS = ("The capital of France is", "def fibonacci(n):",
         "Here is a long story about a lighthouse keeper. " * 8 + "The keeper's name was")
SERVE_FLAGS = ("--dequantize", "off", "--max-model-len", "2048", "--max-num-seqs", "4")
LOGPROB_NOISE = 2e-3  # batched against alone, as tests/e2e/test_openai_api_e2e.py allows


@pytest.fixture(scope="module")
def starting(tmp_path_factory):
    """q4 at PP=2, starting in the background (Ray, the model and the stages, mostly waiting) while mlx-lm
    computes the references in this process."""
    def start(dtype, pp):
        return start_serve(tmp_path_factory.mktemp(f"serve-{dtype}"), "--kv-cache-dtype", dtype, *SERVE_FLAGS,
                           pp=pp)

    with ThreadPoolExecutor(1) as pool:
        futures = {"q4": pool.submit(start, "q4", 2)}
        try:
            yield futures
        finally:
            for future in futures.values():
                if future.exception() is None:  # a start that failed stopped what it started
                    future.result().stop()


@pytest.fixture(scope="module")
def serves(starting):
    return {name: future.result() for name, future in starting.items()}


@pytest.fixture(scope="module")
def prompts(tokenizer):  # noqa: F811 (the imported fixture)
    return [tokenizer.encode(text, add_special_tokens=True) for text in TEXTS]


def _mlx_lm(model, prompt: list[int], bits: int | None) -> list[tuple[int, float]]:
    """mlx-lm's greedy (token, logprob) steps, every plain KV layer a ``QuantizedKVCache`` when ``bits``."""
    cache = make_prompt_cache(model)
    if bits is not None:
        cache = [QuantizedKVCache(GROUP, bits) if type(c) is KVCache else c for c in cache]
    steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, prompt_cache=cache,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [(int(token), float(logprobs[int(token)])) for token, logprobs in steps]


@pytest.fixture(scope="module")
def references(starting, mlx_lm_model, prompts):  # noqa: F811 (the imported fixture)
    return {bits: [_mlx_lm(mlx_lm_model, p, bits) for p in prompts] for bits in (None, 4)}


def _served(serve, prompts: list[list[int]]) -> list[tuple[str, list[float]]]:
    """Each prompt's greedy completion (text, token logprobs), all sent at once so they decode together."""
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def complete(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
        choice = r.choices[0]
        assert r.usage.completion_tokens == MAX_TOKENS
        return choice.text, list(choice.logprobs.token_logprobs)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


@pytest.mark.parametrize("name, bits", [("q4", 4)])
def test_greedy_completions_equal_mlx_lms_over_its_quantized_cache_and_not_autos(
        references, serves, prompts, tokenizer, name, bits):  # noqa: F811
    served = _served(serves[name], prompts)
    expected, auto = references[bits], references[None]
    for (text, logprobs), steps in zip(served, expected):
        assert text == tokenizer.decode([t for t, _ in steps])
        assert logprobs == pytest.approx([lp for _, lp in steps], abs=LOGPROB_NOISE)
    assert [t for t, _ in expected[0]] and len(served) == len(TEXTS)
    # Served quantized differs from auto in its tokens: the comparison can tell them apart.
    assert any([t for t, _ in q] != [t for t, _ in a] for q, a in zip(expected, auto)), \
        f"{name}: mlx-lm's {name} gives auto's tokens; the comparison would say nothing"


def _kv_capacity(url: str) -> list[int]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    return [int(s.value) for f in families if f.name == "stagemesh_stage_kv_token_capacity" for s in f.samples
            if s.name == f.name]


def test_metrics_report_the_q4_kv_capacity_the_plan_states(serves):
    capacity = _kv_capacity(serves["q4"].url)  # each stage's; the replica holds its smallest
    assert len(capacity) == 2 and min(capacity) > 0
    dry = subprocess.run([sys.executable, "-m", "stagemesh.cli", "serve", "--dry-run", "--kv-cache-dtype", "q4",
                          "-pp", "2", *SERVE_FLAGS], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    line = next(line for line in dry.stdout.splitlines() if line.startswith("KV cache: "))
    found = re.fullmatch(r"KV cache: q4 \(4-bit, group 64\): ([\d,]+) tokens, ([\d.]+)x of auto \(([\d,]+) tokens\)",
                         line)
    assert found, line
    planned, gain = int(found[1].replace(",", "")), float(found[2])
    # float32 keys and values against 4-bit codes with a float32 scale and bias per 64 elements: 4 / 0.625.
    assert gain == pytest.approx(4 / (0.5 + 2 * 4 / GROUP), rel=0.01)
    # serve logs the same plan line as it starts (the layer plan it launches with).
    assert line in serves["q4"].log()
    # The plan counts the weights from the model's facts, the stage what it loaded and the runtime it sees:
    # the same budget, so the same count within a few percent (the budget is the host's total memory).
    assert min(capacity) == pytest.approx(planned, rel=0.05)


def test_an_unknown_kv_cache_dtype_exits_2_naming_the_values(capsys):
    from stagemesh.cli import main

    with pytest.raises(SystemExit) as bad:  # argparse's refusal, before anything is read or started
        main(["serve", "--kv-cache-dtype", "q3"])
    assert bad.value.code == 2
    stderr = capsys.readouterr().err
    assert "--kv-cache-dtype: invalid choice: 'q3'" in stderr
    assert all(f"'{value}'" in stderr for value in ("auto", "q8", "q4")), stderr
