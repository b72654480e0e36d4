"""Incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

from gateway.parsing.detokenizer import IncrementalDetokenizer

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


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer whose characters outside its vocabulary become <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("\u2581", "a", "b", "\u2581a"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[("\u2581", "a")], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_fallback_tokens_make_whole_characters():
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("a é😀 b", add_special_tokens=False)
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(ids)  # the premise: 😀 is four byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "a é😀 b" and "😀" in pieces and "é" in pieces
    assert all("\ufffd" not in p for p in pieces)
    cut = IncrementalDetokenizer(tokenizer)
    assert cut.push(ids[:5]) == "a é" and cut.flush() == "\ufffd"  # the sequence ended inside 😀
