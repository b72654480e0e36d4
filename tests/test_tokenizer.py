"""Tokenizer from the GGUF metadata and from a model directory, offline."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import PreTrainedTokenizerFast

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.gguf.format import read_gguf_header
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError
from stage_worker.checkpoint.tokenizer import CHATML_TEMPLATE, eos_token_ids, load_tokenizer

DEFAULT = default_model_path()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def spec():
    return read_model_spec(DEFAULT)


@pytest.fixture(scope="module")
def tok(spec):
    return load_tokenizer(spec)


def test_round_trip_multibyte(tok):
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    assert ids[0] != tok.bos_token_id  # SmolLM2's GGUF says add_bos_token = false
    assert tok.decode(ids) == text


def test_chat_template_renders_smollm2(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    rendered = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered == RENDERED
    assert tok.encode(rendered)[:3] == [1, 9690, 198]  # <|im_start|> kept whole, then "system\n"


def test_matches_gguf_metadata(tok):
    md = read_gguf_header(DEFAULT).metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tok) == len(tokens) == 49152
    assert tok.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert [" ".join(m) if isinstance(m, list) else m for m in merges] == md["tokenizer.ggml.merges"]
    assert tok.bos_token_id == md["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_token_id == md["tokenizer.ggml.eos_token_id"] == 2
    assert tok.pad_token_id == md["tokenizer.ggml.padding_token_id"]
    assert tok.chat_template == md["tokenizer.chat_template"]


def test_pre_tokenizer_splits_digits_and_keeps_specials(tok):
    assert tok.convert_ids_to_tokens(tok.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]


def test_eos_ids_include_im_end(spec, tok):
    eos = eos_token_ids(spec, tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    assert eos == {2}


def test_directory_tokenizer(spec, tok, tmp_path):
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    dir_spec = dataclasses.replace(spec, format="mlx", path=str(tmp_path))
    loaded = load_tokenizer(dir_spec)
    text = "héllo 世界 🙂 in 2024"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == RENDERED
    assert eos_token_ids(dir_spec, loaded) == {0, 2}


def test_directory_without_template_gets_chatml(spec, tok, tmp_path):
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(dataclasses.replace(spec, format="mlx", path=str(tmp_path)))
    assert loaded.chat_template == CHATML_TEMPLATE
    rendered = loaded.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_directory_without_tokenizer(spec, tmp_path):
    with pytest.raises(ModelFormatError, match="no tokenizer files"):
        load_tokenizer(dataclasses.replace(spec, format="mlx", path=str(tmp_path)))
