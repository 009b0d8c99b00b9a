"""One answer's text as its tokens arrive: its decoding, where a stop string cuts it, and what ``on_token`` may
send."""

from __future__ import annotations

from typing import Sequence

INCOMPLETE = "\ufffd"  # what a decoder writes for a character whose UTF-8 bytes have not all arrived


class AnswerText:
    """The decoded text of an answer's tokens, one token at a time.

    A tokenizer that declares ``suffix_decodable`` (decoding ``ids[i:]`` gives the text of ``ids`` from token i on,
    when token i begins a character, a leading space of its first token aside: every HF decoder) is decoded over a
    window of the last tokens only: the window's text less that of its tokens already emitted is the new text, and
    the window moves on once that text ends in a whole character, so a token's cost does not grow with the answer.
    Any other tokenizer decodes the whole answer at every token. Where the whole decode's characters are complete
    the two texts are equal; around bytes that are not valid UTF-8 (a byte-fallback run) they may differ in where
    U+FFFD stands, so the answer's final text is the whole decode (:meth:`whole`, once per answer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.incremental = bool(getattr(tokenizer, "suffix_decodable", False))
        self.ids: list[int] = []
        self.done = ""  # the text of ids[:read], every character whole
        self.prefix = self.read = 0  # the window: ids[prefix:]; ids[prefix:read] are decoded into ``done``

    def add(self, token: int) -> str:
        """Append ``token``; the answer's text so far (it may end in U+FFFD while a character is incomplete)."""
        self.ids.append(int(token))
        if not self.incremental:
            return self.tok.decode(self.ids)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        new = now[len(before):]
        if new and not new.endswith(INCOMPLETE):
            self.done += new
            self.prefix, self.read = self.read, len(self.ids)
            return self.done
        return self.done + new

    def whole(self) -> str:
        """The whole answer decoded at once: its final text."""
        return self.tok.decode(self.ids)


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start (not the whole) of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class AnswerStream:
    """The answer's text and the part of it streamed so far.

    ``update`` takes the decode of every token so far and returns the new text that no later token can
    change: a trailing U+FFFD is held back until its character is complete, and an end that could still
    become a stop string until it cannot. When a stop string appears the text is cut before the earliest
    one (``stopped``) and the rest of the cut text is returned; ``flush`` returns whatever is still held
    back. The pieces returned, joined, are ``text``.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0  # characters of ``text`` returned
        self.stopped = False

    def update(self, decoded: str) -> str:
        cuts = [i for i in (decoded.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text, self.stopped = decoded[: min(cuts)], True
            return self.flush()
        self.text = decoded
        end = len(decoded.rstrip(INCOMPLETE))
        end -= stop_prefix_len(decoded[:end], self.stops)
        return self._send(end)

    def flush(self) -> str:
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
