"""Incremental detokenization: token ids in, complete text out, once.

Contract: ``IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)``; ``push(ids)`` returns
the text the new ids complete (possibly ""), ``flush()`` returns what is still held when the sequence ends.
The concatenation of every ``push`` and the final ``flush`` equals the text of all pushed ids decoded at once
(special tokens skipped unless ``skip_special_tokens`` is false); a character split over several tokens is
emitted only once complete. ``gateway.chat.generation`` runs one per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT = 5  # prompt ids kept as left context of the first window
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """A fast tokenizer (every one stagemesh loads) decodes through tokenizers' own ``DecodeStream``: one step
    per token, no re-decoding, and byte-level and byte-fallback tokens that hold part of a character are held
    until it is complete (an emoji is often 3-4 tokens). It is seeded with the prompt's last ids so tokenizers
    that drop a word's leading space at the start of a decode (SentencePiece) get it right. Ids still held when
    the sequence ends are decoded on their own at ``flush`` (an incomplete character becomes U+FFFD).

    Other tokenizers use vLLM's prefix/read-offset window: decode a small window of recent ids and emit only
    the text beyond what the window's older part already produced, and only when it does not end in U+FFFD.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this have been emitted as text
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # DecodeStream: ids that produced no text yet

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        if self._stream is not None:
            out = []
            for token in token_ids:
                text = self._stream.step(self._backend, token)
                if not text:  # None, or "" for a byte-fallback token holding part of a character
                    self._held.append(token)
                else:
                    self._held.clear()
                    out.append(text)
            return "".join(out)
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held; an incomplete character at the very end is emitted as U+FFFD."""
        if self._stream is not None:
            held, self._held = self._held, []
            return self._decode(held) if held else ""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith(_REPLACEMENT) and not final):
            # Nothing printable yet (a special token, or a character still missing bytes).
            if final:
                self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
