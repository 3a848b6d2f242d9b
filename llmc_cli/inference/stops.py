"""Stop strings: where generated text ends, and how much of it may be shown while tokens still come."""

from __future__ import annotations

from typing import Callable, Iterable


def check_stops(stop) -> tuple[bytes, ...]:
    """`stop` (one string or an iterable of them, each non-empty UTF-8 text) as UTF-8 bytes, else a ValueError of one
    line: an empty string would end every sample before its first token, bytes would never equal decoded text."""
    items = (stop,) if isinstance(stop, str) else stop
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"stop must be a string or a list of strings (got {stop!r:.80})") from None
    out = []
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings (got {s!r:.80})")
        try:
            out.append(s.encode("utf-8"))
        except UnicodeEncodeError:  # (a lone surrogate: bytes that were not UTF-8 on the way in)
            raise ValueError(f"stop: {s!r:.80} is not UTF-8 text") from None
    return tuple(out)


class StopText:
    """The bytes of generated tokens, given out as far as they may be shown. A stop string ends the text where it
    begins: it and whatever follows it are not given out (what llama.cpp's server and OpenAI's API do with `stop`),
    and `stopped` turns True. Bytes that could begin a stop string are held back until the next token says whether
    they do, so a stop string split over tokens is found and never half shown. Matching is on UTF-8 bytes: a stop
    string inside a token's text ends the text too (a tokenizer merges "\\n\\n" with what precedes it)."""

    def __init__(self, stops: Iterable[str], decode_bytes: Callable[[list[int]], bytes]):
        self.stops = check_stops(stops)
        self.decode_bytes = decode_bytes
        self.longest = max(map(len, self.stops), default=0)
        self.held = b""
        self.stopped = False

    def add(self, token: int) -> bytes:
        """The bytes that `token` lets out: its own, less what may begin a stop string, plus what it confirms of the
        bytes held back; after a stop string, nothing."""
        if self.stopped:
            return b""
        self.held += self.decode_bytes([token])
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.held = self.held[:min(found)], b""
            return out
        cut = len(self.held) - self._partial()
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def rest(self) -> bytes:
        """What is still held back, when the text ends without a stop string (the maximum length, end-of-text)."""
        out, self.held = self.held, b""
        return out

    def _partial(self) -> int:
        """The length of the longest end of the held bytes that begins a stop string (0: none)."""
        n = len(self.held)
        for k in range(min(n, self.longest - 1), 0, -1):
            tail = self.held[n - k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
