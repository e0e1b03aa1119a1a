"""Stop strings, matched in the frontend across token boundaries.

Text that could still be the start of a stop string is held back, so a streamed client never sees
characters the final text will not contain: streamed deltas always concatenate to the final text.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything seen
        self.emitted = 0  # characters of self.text already released
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        """Some stop string can still match."""
        return bool(self.stop) and self.matched is None

    def feed(self, delta: str) -> str:
        """Add decoded text; return what can be released now. After a match, matched is set."""
        if self.matched is not None or not delta:
            return ""
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        if self.stop:
            best = None
            for s in self.stop:
                i = self.text.find(s, search_from)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.matched = s
                self.text = self.text[: i + len(s) if self.include else i]
                return self._release(len(self.text))
        return self._release(max(self.emitted, len(self.text) - self.hold))

    def flush(self) -> str:
        """At the end: release what was held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
