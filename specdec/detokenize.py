"""Incremental detokenization with stop-string handling, for streaming."""

from __future__ import annotations

from .tokenizer import Tokenizer

# The output is decoded after the prompt's last tokens, as vLLM's incremental detokenizer primes
# its stream: a SentencePiece tokenizer's decoder strips the space of a text's first token, which
# the output's first token keeps in the prompt's context (" the", as vLLM returns it, not "the").
# The context is the shortest suffix of CONTEXT_MIN to CONTEXT_MAX tokens that decodes to whole
# characters: a byte-fallback decoder turns a run of byte tokens that starts inside a character
# into U+FFFD as a whole, the output's bytes that join it included. None such (a prompt of ids cut
# inside a character): the Detokenizer reads the prompt's last PRIME_MAX tokens as vLLM primes its
# DecodeStream with the whole prompt (a character is at most 4 bytes: what is left incomplete at
# the end is the same, and a long run of stray bytes costs no quadratic decoding on the engine's thread).
CONTEXT_MIN, CONTEXT_MAX = 4, 23
PRIME_MAX = 64


def prompt_context(tokenizer: Tokenizer, prompt, skip_special_tokens: bool) -> list[int]:
    prompt = list(prompt)
    if len(prompt) <= CONTEXT_MIN:
        return prompt if "\ufffd" not in tokenizer.decode(prompt, skip_special_tokens) else []
    for n in range(CONTEXT_MIN, min(len(prompt), CONTEXT_MAX) + 1):
        if "\ufffd" not in tokenizer.decode(prompt[-n:], skip_special_tokens):
            return prompt[-n:]
    return []


class Detokenizer:
    """Turns output tokens into text one token at a time and watches for stop strings.

    Text grows by whole characters and never changes once there (so the streamed pieces always
    add up to the final text): the tokens since the last complete character are decoded in the
    context of the tokens before them (vLLM's prefix / read offsets), and held while their text
    ends in an incomplete UTF-8 sequence ("\\ufffd"); the end of the output flushes them as they
    decode. Released text also holds back a tail that could still become a stop string.
    vLLM's stop rules: a stop string ends the text and is cut off with it, unless include_stop
    (then the text ends with it and nothing is held back); it counts when it ends after the text
    of the first min_tokens tokens; of the stop strings that one token completes, the first in
    `stop` wins. The output's tokens are checked one at a time, so speculative decoding stops at
    the token plain decoding stops at.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0, prompt: list[int] | tuple = ()):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0                       # characters of `text` already released
        self.stop_reason: str | None = None
        self._hold = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self._all = prompt_context(tokenizer, prompt, skip_special_tokens) if prompt else []   # context, then the output
        self._prefix = 0                    # _all[_prefix:_read]: the tokens of the last piece (context)
        self._read = len(self._all)         # _all[_read:]: tokens whose text is not complete yet
        self._prefix_text = self._decode(0, self._read) if self._all else ""
        self._out = 0
        if prompt and not self._all:
            self._prime(list(prompt)[-PRIME_MAX:])
        self._out = len(self._all)          # _all[_out:]: the output

    def _prime(self, prompt: list[int]) -> None:
        """No suffix decodes whole: read the prompt a token at a time, as vLLM primes its stream, so
        that the bytes of a character it ends inside wait for the output's, which finish the
        character in the output's text ('我', where the output's bytes alone are U+FFFD)."""
        for token in prompt:
            self._all.append(token)
            self._advance()
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._all[start:end], self.skip)

    def _advance(self, flush: bool = False) -> None:
        """Append the text of the tokens since the last complete character, once it is complete
        (flush: as it decodes)."""
        if self._read == len(self._all):
            return
        full = self._decode(self._prefix)
        if not flush and (len(full) <= len(self._prefix_text) or full.endswith("\ufffd")):
            return
        # the context decodes as before in all but a byte-fallback run that the new bytes made
        # invalid (every byte then decodes as U+FFFD; vLLM resets its stream), and the prompt's
        # unfinished character that the output ends without finishing: the output's tokens alone
        pending = self._read < self._out    # the prompt's unfinished character, in the piece
        if full.startswith(self._prefix_text) and not (flush and pending and full.endswith("\ufffd")):
            new = full[len(self._prefix_text):]
        else:
            new = self._decode(max(self._read, self._out))
        self.text += new
        self._prefix, self._read = self._read, len(self._all)
        self._prefix_text = self._decode(self._prefix, self._read)

    def add(self, token: int) -> bool:
        """Append one token; True when a stop string has completed (text is cut at it)."""
        self.ids.append(token)
        self._all.append(token)
        if not self.stop:
            return False                    # decoded by delta(), once a step
        before = len(self.text)
        self._advance()
        if len(self.ids) <= self.min_tokens or len(self.text) == before:
            return False
        for s in self.stop:
            if (i := self.text.find(s, max(before - len(s) + 1, 0))) >= 0:
                self.text, self.stop_reason = self.text[:i + len(s) if self.include_stop else i], s
                return True
        return False

    def feed(self, token: int) -> int:
        """Append one token and decode it at once, whatever the stop strings (vLLM's per-token
        stream; for text_offset). Returns the text's length before it: where its text starts, or
        the character that a piece of one goes into."""
        start = len(self.text)
        self.ids.append(token)
        self._all.append(token)
        self._advance()
        return start

    def delta(self, final: bool) -> str:
        """The newly released text (final: all of it)."""
        if self.stop_reason is None:
            self._advance(flush=final)
        end = len(self.text) if final else len(self.text) - self._hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    @property
    def released(self) -> str:
        """The text released so far (what a stream has sent)."""
        return self.text[:self.sent]
