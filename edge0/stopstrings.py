"""Stop strings over streamed text: emit only text that cannot be the start of a stop string,
so a stop string split across chunks is still caught and never shown."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops):
        if isinstance(stops, str):
            stops = [stops]
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a chunk; returns (text safe to emit, whether a stop string was hit)."""
        buf = self.held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self, delta: str = "") -> str:
        """End of generation: everything still held is plain text (up to any stop string)."""
        text, hit = self.feed(delta)
        if not hit:
            text, self.held = text + self.held, ""
        return text
