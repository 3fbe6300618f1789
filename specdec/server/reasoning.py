"""vLLM's reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, written between
`<think>` and `</think>`, is returned apart from its answer, as `reasoning_content` beside
`content` (deltas likewise when streamed).

- `deepseek_r1` (DeepSeek-R1 and its Qwen / Llama distills): the chat template opens the think
  block itself, so the reply starts inside it: everything before `</think>` is reasoning (a
  leading `<think>` is dropped), what follows is the answer; a reply that never closes the block
  is all reasoning.
- `qwen3` (Qwen3, QwQ): the reply opens the block itself: a reply that starts with `<think>` is
  reasoning up to `</think>` (or to its end, if cut short), one that does not is all answer (Qwen3
  with thinking switched off writes no block).

The answer then goes to the tool-call parser, if any. A constrained reply (structured outputs,
named or required tool calls) is not split: the grammar leaves the model no think block.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str, str]:
    """A finished reply -> (reasoning, answer); either may be empty."""
    s = text.lstrip()
    if s.startswith(START):
        body = s[len(START):]
    elif parser == "deepseek_r1":
        body = text
    else:                                                  # qwen3 without a think block
        return "", text
    reasoning, found, answer = body.partition(END)
    return reasoning, answer if found else ""


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag: what a stream holds back, since the
    tag may be arriving (also the tool parsers' call tags)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One streamed choice: feed() each step's text -> (reasoning delta, answer delta); finish()
    -> what is still held. The deltas joined equal split_reasoning's parts."""
    parser: str
    state: str = "start"          # start (nothing decided yet) | reasoning | answer
    buf: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        if self.state == "start":
            s = self.buf.lstrip()
            if START.startswith(s):                  # whitespace, or the opening tag arriving
                return "", ""
            if s.startswith(START):
                self.buf, self.state = s[len(START):], "reasoning"
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "answer"
        if self.state == "answer":
            text, self.buf = self.buf, ""
            return "", text
        at = self.buf.find(END)
        if at >= 0:
            reasoning, answer = self.buf[:at], self.buf[at + len(END):]
            self.buf, self.state = "", "answer"
            return reasoning, answer
        keep = held_back(self.buf, END)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What is still held: (reasoning, answer)."""
        rest, self.buf = self.buf, ""
        reasoning = self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1")
        return (rest, "") if reasoning else ("", rest)
