"""Incremental text helpers: stop strings that may span chunk boundaries.

Text arrives in small deltas (one token at a time). A stop string can start in one delta and end
in a later one, so anything that might be the beginning of a stop string is held back until the
next delta decides it. Nothing here splits a character: deltas are `str`, never bytes.
"""

from __future__ import annotations

from typing import Collection, Iterable


def partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`."""
    best = 0
    for p in patterns:
        for k in range(min(len(text), len(p) - 1), best, -1):
            if p.startswith(text[-k:]):
                best = k
                break
    return best


def find_first(text: str, patterns: Iterable[str]) -> tuple[int, str] | None:
    """(index, pattern) of the earliest occurrence of any pattern in `text`, or None."""
    hits = [(i, p) for p in patterns if (i := text.find(p)) >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None


def split_at_first(text: str, patterns: Collection[str]) -> tuple[str, str | None, str]:
    """(text before the earliest pattern, that pattern, text after it); with no pattern in `text`:
    (the text that cannot be the start of one, None, the rest, held back until more text decides it)."""
    found = find_first(text, patterns)
    if found is None:
        cut = len(text) - partial_suffix_len(text, patterns)
        return text[:cut], None, text[cut:]
    i, pattern = found
    return text[:i], pattern, text[i + len(pattern) :]


class StopMatcher:
    """Filters a stream of text deltas, cutting it before the first stop string.

    `feed` returns the text that is safe to emit now and whether a stop string was found; the
    stop string and everything after it are dropped. Text that could still grow into a stop
    string is held back; `flush` releases it at the end of the stream.
    """

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a delta; returns (text safe to emit, True if a stop string ended the stream)."""
        if self.stopped:
            return "", True
        out, matched, rest = split_at_first(self._held + text, self.stops)
        if matched is not None:
            self.stopped, self.matched, self._held = True, matched, ""
            return out, True
        self._held = rest
        return out, False

    def flush(self, text: str = "") -> str:
        """Add a final delta and release everything held back (still cut at a stop string)."""
        out, hit = self.feed(text)
        if not hit:
            out, self._held = out + self._held, ""
        return out
