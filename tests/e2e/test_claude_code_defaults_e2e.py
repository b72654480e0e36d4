"""Claude Code with its default settings (no ``--bare``: its own system prompt, every tool, ``max_tokens: 32000``)
against a real ``stagemesh serve`` whose model's context holds all of that.

Claude Code's default prompt and tools are about 12,400 tokens, over the default model's 8,192, and it asks for
32,000 output tokens on every request whatever the model. The model here is a checkpoint the test writes: a
llama of one layer with a 16,384-token context whose layer adds nothing to the residual stream, so each next
token depends only on the last one (a bigram table in the embedding and the head): after the prompt's last
token it says "Hello!" and ends. The whole stack is real (the tokenizer and chat template of the default model,
the stage, the gateway, Claude Code from npm); only what the model says is fixed, so the test can be exact.
What it checks: the 32,000-token budget past the room left is served (Anthropic's semantics, not vLLM's 400)
and Claude Code answers with the model's text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stage_worker.checkpoint.default_model import resolve_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.tokenizer import load_tokenizer
from tests.e2e.serve_process import start_serve

pytestmark = pytest.mark.e2e

CLAUDE = shutil.which("claude")
MODEL = "bigram-16k"
CONTEXT = 16384
HIDDEN = 64
ANSWER = "Hello!"


def _bigram_checkpoint(path: Path) -> Path:
    """The model directory: config, weights and the default model's tokenizer files."""
    tokenizer = load_tokenizer(read_model_spec(resolve_model_path(None)))
    tokenizer.save_pretrained(path)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    last = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)[-1]
    said = tokenizer.encode(ANSWER, add_special_tokens=False)
    # next token of each source token: the prompt's last -> the answer's tokens in turn -> EOS.
    chain = dict(zip([last, *said], [*said, eos], strict=True))
    rng = np.random.default_rng(0)
    embed = np.zeros((vocab, HIDDEN), np.float32)
    embed[:, 0] = 1.0  # every other token: direction 0, which the head maps to EOS
    head = np.zeros((vocab, HIDDEN), np.float32)
    head[eos, 0] = 10.0
    for k, (source, target) in enumerate(chain.items(), start=1):
        embed[source] = 0.0
        embed[source, k] = 1.0
        head[target, k] = 10.0
    intermediate = 128
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head,
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    layer = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (HIDDEN, HIDDEN)),
                        ("self_attn.v_proj", (HIDDEN, HIDDEN)), ("mlp.gate_proj", (intermediate, HIDDEN)),
                        ("mlp.up_proj", (intermediate, HIDDEN))):
        weights[f"{layer}{name}.weight"] = rng.normal(0, 0.02, shape).astype(np.float32)
    # The layer's outputs are zero, so the residual stream is the last token's embedding.
    weights[f"{layer}self_attn.o_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
    weights[f"{layer}mlp.down_proj.weight"] = np.zeros((HIDDEN, intermediate), np.float32)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        weights[f"{layer}{norm}.weight"] = np.ones(HIDDEN, np.float32)
    save_file(weights, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": vocab, "max_position_embeddings": CONTEXT,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": False,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    model = _bigram_checkpoint(tmp_path_factory.mktemp(MODEL))
    s = start_serve(tmp_path_factory.mktemp("claude-defaults"), str(model), "--served-model-name", MODEL)
    yield s
    s.stop()


def test_claude_code_with_its_defaults_answers(serve, tmp_path):
    if CLAUDE is None:
        pytest.skip("needs Claude Code (npm install -g @anthropic-ai/claude-code; .ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    # The environment docs/clients.md gives, and Claude Code's switches that keep it off the network.
    env.update(HOME=str(tmp_path), ANTHROPIC_BASE_URL=serve.url, ANTHROPIC_AUTH_TOKEN="unused",
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    done = subprocess.run([CLAUDE, "-p", "Say hi in one short sentence.", "--model", MODEL, "--output-format", "json",
                           "--no-session-persistence"], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"] == ANSWER, result
    assert result["usage"]["input_tokens"] > 8192  # its own prompt and tools: over the default model's context
    assert result["modelUsage"][MODEL]["maxOutputTokens"] == 32000  # and its default budget, past the room left
