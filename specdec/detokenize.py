"""Incremental detokenization with stop-string handling, for streaming."""

from __future__ import annotations

from .tokenizer import Tokenizer


class Detokenizer:
    """Turns output tokens into text one token at a time and watches for stop strings.

    Text is released only when it is final: a trailing incomplete UTF-8 sequence ("\\ufffd")
    and a tail that could still become a stop string are held back until the next token.
    vLLM's rules: a stop string ends the text and is cut off with it, unless include_stop (then
    the text ends with it and nothing is held back); stop strings are looked for only in the
    text after the first min_tokens tokens.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0                       # characters of `text` already released
        self.stop_reason: str | None = None
        self._window = max((len(s) for s in stop), default=1) - 1    # a stop string's reach into earlier text
        self._hold = 0 if include_stop else self._window
        self._from = 0                      # stop strings start at or after this character

    def add(self, token: int) -> bool:
        """Append one token; True when a stop string has completed (text is cut at it)."""
        self.ids.append(token)
        if not self.stop:
            return False
        before = len(self.text.rstrip("\ufffd"))      # complete characters so far
        self.text = self.tokenizer.decode(self.ids, self.skip)
        if len(self.ids) <= self.min_tokens:
            self._from = len(self.text)
            return False
        lo = max(self._from, before - self._window)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, lo)) >= 0]
        if hits:
            i, s = min(hits)
            self.text, self.stop_reason = self.text[:i + len(s) if self.include_stop else i], s
            return True
        return False

    def delta(self, final: bool) -> str:
        """The newly released text."""
        if not self.stop:
            self.text = self.tokenizer.decode(self.ids, self.skip)
        end = len(self.text)
        if not final:
            # the hold counts complete characters: a trailing partial one (U+FFFD until its last
            # byte token comes) must not stand in for the start of a stop string
            end = len(self.text.rstrip("\ufffd"))
            if self.stop:
                end -= self._hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out
