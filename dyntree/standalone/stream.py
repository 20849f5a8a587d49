"""Streaming text out of committed token ids: what ``dyntree generate`` prints as it decodes.

Tokens arrive a run at a time (a whole accepted path per step). :class:`TextStream` decodes the
tokens so far and hands out only text that can no longer change: not a trailing partial UTF-8
character (a byte-level token may hold half of one), and, when stop strings are set, not the tail
that could still turn out to be the start of a stop string. The streamed text ends exactly where
:meth:`SpecEngine.generate <dyntree.standalone.engine.SpecEngine.generate>`'s ``text`` does.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["TextStream"]


class TextStream:
    """Incremental detokenizer: ``push(new_ids)`` returns the newly final text; ``finish()`` the rest."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped = False

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        elif not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence so far
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(text) - hold, self.sent)]
        out, self.sent = text[self.sent :], max(self.sent, len(text))
        return out
