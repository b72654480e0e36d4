"""Synthetic workload of ``stagemesh bench serve``: seeded prompts of a given length, and the request body.

Contract: ``make_prompt(key, input_tokens, tokenizer)`` is deterministic in its arguments: filler words drawn
from ``WORDS`` with ``key``, then ``COUNT_INSTRUCTION``, so outputs run to ``max_tokens`` without the
non-portable ``ignore_eos``. Distinct keys give distinct prompts from the first word, so a server's prefix
cache cannot make one request cheaper than another; ``min_input_tokens`` is the shortest length that still
leaves ``MIN_FILLER_TOKENS`` of filler, and ``stagemesh bench serve`` refuses a shorter ``--input-len``.
``sized_text`` is that sizing alone (the multi-turn user messages); ``request_body`` is the JSON body for
``/v1/completions`` or ``/v1/chat/completions``; ``load_tokenizer(path)`` reads a GGUF file or a
model/tokenizer directory, offline.
"""

from __future__ import annotations

import random
import re
from typing import Any, Protocol

from stagemesh.bench.types import Prompt, Workload

# Common English words: almost all are one token (with their leading space) in
# every BPE vocabulary we serve, so without a tokenizer one word ~ one token.
WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her he she it they we you this an be are or
not have had has but were which one all their there been when who will more no if out so said what up
its about into than them can only other new some could time these two may then do first any my now
such like our over man me even most made after also did many before must through back years where much
your way well down should because each just those people how too little state good very make world
still own see men work long get here between both life being under never day same another know while
last might us great old year off come since against go came right used take three house water small
place light river stone tree green blue red white black city road field garden window table paper
letter music story morning evening summer winter spring autumn number open close bright quiet simple
""".split())

COUNT_INSTRUCTION = "\n\nIgnore the words above and count: 1, 2, 3,"
# Filler tokens every prompt keeps before the instruction, so prompts differ from their first token
# (a shorter --input-len would make every request the same instruction, which prefix caches serve free).
MIN_FILLER_TOKENS = 4

_APPROX_TOKEN = re.compile(r"\d|[^\W\d]+|[^\w\s]|\n+")  # digits apart, as many tokenizers split numbers


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def approx_tokens(text: str) -> int:
    """Words and punctuation marks: a tokenizer-free stand-in for a token count."""
    return len(_APPROX_TOKEN.findall(text))


def _words(key: str, n: int) -> str:
    rng = random.Random(key)  # str seeds hash with SHA-512: the same words on every machine and run
    return " ".join(rng.choice(WORDS) for _ in range(n))


def min_input_tokens(tokenizer: Tokenizer | None = None) -> int:
    """The shortest prompt whose filler still makes it distinct from every other."""
    instruction = len(tokenizer.encode(COUNT_INSTRUCTION)) if tokenizer is not None \
        else approx_tokens(COUNT_INSTRUCTION)
    return instruction + MIN_FILLER_TOKENS


def make_prompt(key: str, input_tokens: int, tokenizer: Tokenizer | None = None) -> Prompt:
    """Filler words drawn with ``key``, then ``COUNT_INSTRUCTION``, which asks the model to count for longer
    than any sensible ``max_tokens``. With a tokenizer the prompt is ``input_tokens`` long as that tokenizer
    counts it (special tokens included; within a token or two where a word boundary re-merges); without one,
    words approximate tokens. A target below the instruction's own length yields just the instruction."""
    return sized_text(key, input_tokens, tokenizer, COUNT_INSTRUCTION)


def sized_text(key: str, tokens: int, tokenizer: Tokenizer | None = None, suffix: str = "") -> Prompt:
    """Filler words drawn with ``key``, then ``suffix``: ``tokens`` long as ``tokenizer`` counts it
    (words ~ tokens without one); just the suffix when it alone is that long."""
    if tokenizer is None:
        n = max(0, tokens - approx_tokens(suffix))
        text = _words(key, n) + suffix if n else suffix.lstrip()
        return Prompt(text, approx_tokens(text), "words")

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    # Every word is at least one token, so ``tokens`` words are enough filler to cut from.
    filler_ids = tokenizer.encode(_words(key, max(tokens, 1)), add_special_tokens=False)
    want = tokens - (count(suffix) if suffix else 0)
    text = suffix.lstrip()
    for _ in range(4):  # cutting and re-encoding can shift a token at the seam; correct a few times
        if want <= 0:
            break
        text = tokenizer.decode(filler_ids[:want]) + suffix
        off = count(text) - tokens
        if off == 0:
            break
        want -= off
    return Prompt(text, count(text), "tokenizer")


def request_body(workload: Workload, model: str, prompt: Prompt) -> dict[str, Any]:
    """The streaming request's JSON body: a prompt's ``messages`` when it has them, else one user message
    (chat) or the prompt text (completions). ``ignore_eos`` and ``stream_options`` appear only when asked for
    (strict servers reject unknown fields with a 400)."""
    body: dict[str, Any] = {"model": model, "max_tokens": workload.output_tokens, "stream": True,
                            "temperature": workload.temperature}
    if prompt.messages is not None:
        body["messages"] = [{"role": role, "content": content} for role, content in prompt.messages]
    elif workload.endpoint_type == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if workload.include_usage:
        body["stream_options"] = {"include_usage": True}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    return body


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a GGUF file or a model directory; a bare tokenizer directory works too."""
    import os

    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer as load_model_tokenizer

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return load_model_tokenizer(read_model_spec(path))
