"""Stop strings matched on the detokenized text, across chunk boundaries.

Contract: ``StopStringMatcher(stops)``; ``feed(text)`` returns
``(emit, stopped)``: the text that is safe to show now and whether a stop
string was completed. On a match, ``emit`` is the text before the earliest
stop string (the stop string itself is never shown) and the matcher must not
be fed again; ``matched`` is the stop string that matched. Without a match, text that could still be the beginning of a
stop string is held back; ``flush()`` releases it when generation ends for
another reason.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._stopped = False
        self.matched = ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        if self._stopped:
            raise RuntimeError("StopStringMatcher fed after a stop string matched")
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._stopped = True
            self._held = ""
            at, self.matched = min(hits, key=lambda h: h[0])
            return buf[:at], True
        cut = self._partial_start(buf)
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_start(self, buf: str) -> int:
        """Index of the earliest suffix of ``buf`` that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops)
        for start in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[start:]
            if any(s.startswith(tail) for s in self._stops):
                return start
        return len(buf)
