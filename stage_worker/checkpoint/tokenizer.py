"""The model's tokenizer, offline, from a GGUF's metadata or a model directory.

- ``load_tokenizer(spec)`` returns a transformers ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in
  transformers 5) with ``chat_template`` set. For a GGUF it is rebuilt from ``tokenizer.ggml.*`` (tokens,
  merges, token types, bos/eos/unk/pad ids, pre-tokenizer kind) and ``tokenizer.chat_template``; for a
  directory it is read from the tokenizer files with ``local_files_only=True``. It never contacts a hub and
  changes no global state. A model without a chat template gets a plain ChatML one. A ``--load-format dummy``
  directory without tokenizer files gets the embedded default model's tokenizer (logged): random weights give
  tokens no meaning, and ids it does not know decode to nothing.
- ``eos_token_ids(spec, tokenizer)`` is the set of ids that end a generation: the tokenizer's EOS, any
  eos/eot ids the model files list (generation_config.json, GGUF eot/eom ids) and the end-of-turn marker the
  chat template writes (e.g. ``<|im_end|>``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from stage_worker.checkpoint.default_model import DEFAULT_SERVED_NAME, default_model_path
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec

log = logging.getLogger("stagemesh.tokenizer")

# Markers a chat template writes at the end of every turn; generation stops there.
END_OF_TURN_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GGUF metadata key (under "tokenizer.") -> the name transformers' GGUF converter expects.
_GGUF_TOKENIZER_KEYS: Mapping[str, str] = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
# llama.cpp pre-tokenizer kinds that split every digit apart before byte-level
# BPE (StarCoder-style, which SmolLM uses); transformers' table lacks them.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact"})


def load_tokenizer(spec: ModelSpec) -> Any:
    """A fast tokenizer with its chat template, built without network access."""
    if spec.format == "gguf":
        tok = _gguf_tokenizer(spec)
    elif spec.random_weights and not _has_tokenizer_files(spec.path):
        return _default_model_tokenizer(spec.path)
    else:
        tok = _dir_tokenizer(spec.path)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def _gguf_tokenizer(spec: ModelSpec) -> Any:
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # An internal module of the pinned transformers: its GGUF entry point needs torch,
    # but the vocabulary builders below it do not.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from stage_worker.checkpoint.gguf.format import (
        read_gguf_header,  # lazily: it brings MLX, which a directory's tokenizer never needs
    )

    md = read_gguf_header(spec.path).metadata
    info = {name: md[f"tokenizer.{key}"] for key, name in _GGUF_TOKENIZER_KEYS.items() if f"tokenizer.{key}" in md}
    if "tokens" not in info:
        raise ModelFormatError(f"GGUF {spec.path} carries no tokenizer (tokenizer.ggml.tokens is missing).")
    try:
        backend, _ = convert_gguf_tokenizer(md.get("general.architecture", ""), info)
    except (ValueError, KeyError) as e:
        raise ModelFormatError(
            f"cannot build the tokenizer of {spec.path}: {e}. stagemesh reads GGUF byte-level BPE "
            "(gpt2) and sentencepiece (llama) vocabularies; use an MLX model directory instead."
        ) from e
    if info.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    tokens = info["tokens"]

    def token(key: str) -> str | None:
        idx = info.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "chat_template": md.get("tokenizer.chat_template"),
        "model_max_length": int(spec.args.get("max_position_embeddings") or 4096),
        "clean_up_tokenization_spaces": False,
    }
    for flag in ("add_bos_token", "add_eos_token"):
        if (value := md.get(f"tokenizer.ggml.{flag}")) is not None:
            kwargs[flag] = bool(value)
    if info.get("tokenizer_type") == "llama":
        kwargs.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})


def _has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def default_model_tokenizer() -> Any:
    """The embedded default model's tokenizer (its weights are never loaded)."""
    from stage_worker.checkpoint.model_reader import read_model_spec  # lazily: the format readers bring MLX

    return load_tokenizer(read_model_spec(default_model_path()))


def _default_model_tokenizer(path: str) -> Any:
    """A dummy model's stand-in tokenizer: the embedded default model's."""
    log.warning("%s has no tokenizer files; --load-format dummy uses the embedded default model's tokenizer (%s)",
                path, DEFAULT_SERVED_NAME)
    return default_model_tokenizer()


def _dir_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not _has_tokenizer_files(path):
        raise ModelFormatError(
            f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json); copy the "
            "model's tokenizer files into the directory."
        )
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot load the tokenizer in {path}: {e}") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ModelFormatError(f"the tokenizer in {path} is not a fast (tokenizers) tokenizer; add a tokenizer.json.")
    return tok


def _listed_ids(value: Any) -> set[int]:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_token_ids(spec: ModelSpec, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a generation for this model."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if spec.format == "gguf":
        from stage_worker.checkpoint.gguf.format import read_gguf_header  # lazily: it brings MLX

        md = read_gguf_header(spec.path).metadata
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            ids |= _listed_ids(md.get(f"tokenizer.ggml.{key}"))
    else:
        for name in ("generation_config.json", "config.json"):
            file = os.path.join(spec.path, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    ids |= _listed_ids(json.load(f).get("eos_token_id"))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for marker in END_OF_TURN_MARKERS:
        if marker in template and marker in vocab:
            ids.add(int(vocab[marker]))
    return frozenset(ids)
