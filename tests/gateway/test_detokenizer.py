"""Incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

from gateway.detokenizer import IncrementalDetokenizer

TEXT = "héllo 世界 🙂 ok"


def test_token_by_token_never_emits_partial_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The premise: some tokens of this text are incomplete UTF-8 on their own.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False))
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT
    # Each CJK character shows up whole, in the step its last byte arrived.
    assert "世" in pieces and "界" in pieces
    assert " 🙂" in pieces


def test_chunks_of_several_tokens_and_no_prompt(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for size in (2, 3, 5):
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push(ids[i:i + size]) for i in range(0, len(ids), size)] + [detok.flush()]
        assert "".join(pieces) == TEXT
        assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_not_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
    assert detok.push([2]) == ""  # <|im_end|>
    assert detok.flush() == ""


def test_an_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == "\ufffd"
