"""Token logprobs in OpenAI's shapes, for chat and for completions.

Contract:
- The entries are the core's ``TokenLogprobs`` (``gateway.chat.generation``): one generated
  token as the stage reported it (id, natural-log probability, the most likely alternatives).
- ``LogprobFormatter(tokenizer)`` names tokens: ``token`` is the token's text and
  ``bytes`` its exact UTF-8 bytes (a byte-level BPE token that holds part of a character
  has its bytes exact and its text with U+FFFD, as OpenAI does). ``chat(entries)`` is
  the list for ``choices[].logprobs.content`` (``{token, logprob, bytes, top_logprobs}``);
  ``completion(entries, offset)`` is ``choices[].logprobs`` of a text completion
  (``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``,
  ``text_offset``) with offsets counted in characters from ``offset``.
- A logprob of -inf (a token a processor masked out) is reported as -9999.0, OpenAI's
  convention (JSON has no infinity).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

from gateway.chat.generation import TokenLogprobs

MASKED_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:  # SentencePiece byte fallback
            return bytes([int(byte.group(1), 16)])
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def chat(self, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        out = []
        for e in entries:
            text, raw = self.token(e.token_id)
            top = []
            for token_id, logprob in e.top:
                t_text, t_raw = self.token(token_id)
                top.append({"token": t_text, "logprob": _value(logprob), "bytes": t_raw})
            out.append({"token": text, "logprob": _value(e.logprob), "bytes": raw, "top_logprobs": top})
        return out

    def completion(self, entries: Sequence[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
        """The completion ``logprobs`` object and the offset after its last token."""
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            text, _ = self.token(e.token_id)
            tokens.append(text)
            values.append(_value(e.logprob))
            tops.append({self.token(t)[0]: _value(v) for t, v in e.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
