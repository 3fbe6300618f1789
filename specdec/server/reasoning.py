"""vLLM's reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, written between
`<think>` and `</think>`, is returned apart from its answer, as `reasoning_content` beside
`content` (deltas likewise when streamed).

- `deepseek_r1` (DeepSeek-R1 and its Qwen / Llama distills): the chat template opens the think
  block itself, so the reply starts inside it: everything before `</think>` is reasoning (a
  leading `<think>` is dropped), what follows is the answer; a reply that never closes the block
  is all reasoning.
- `qwen3` (Qwen3, QwQ): the opening `<think>` is optional, as in vLLM's parser: the reply's
  text before `</think>` is reasoning (a leading `<think>` dropped), what follows the answer.
  Qwen3 writes the opening tag itself; QwQ's and Qwen3-Thinking-2507's templates end the prompt
  with it, so their replies start inside the block. A reply without `</think>` is all reasoning
  when it opened the block (cut short) or the prompt did, else all answer (Qwen3 with thinking
  switched off writes no block; its template closes an empty one in the prompt). Streamed, a
  reply that neither starts with `<think>` nor follows a prompt that opened or closed a block is
  held until `</think>` or its end decides which it is.
- `openai_gptoss` (gpt-oss; chosen by itself for a gpt_oss model, as vLLM does): OpenAI's harmony
  format. After the prompt's `<|start|>assistant` the reply is a run of messages
  `<|channel|>NAME<|message|>BODY<|end|>`, each after the first opened by
  `<|start|>assistant`: the `analysis` channel's bodies are reasoning, the others' (`final`,
  and `commentary` preambles) the answer. The reply keeps its special tokens for this parser
  (serving.py), and the markup never reaches the client. Messages addressed to a function
  (`to=functions.NAME` in the header) are tool calls under `--tool-call-parser openai`
  (parse_harmony(calls=True), responses.ChatFormat); otherwise their arguments are answer text.

The answer then goes to the tool-call parser, if any. Only generated text is parsed (a chat
echo's prefix is not: responses.ChatFormat).

Under structured outputs the engine reads the reasoning too, as vLLM's: with this parser in its
StructuredOutputsConfig (reasoning_parser, enable_in_reasoning off, vLLM's default) a
constrained reply (structured outputs, named or required tool calls) thinks freely and the
grammar constrains only what follows the end marker (`</think>`, harmony's final channel;
structured.ReasoningGrammar), unless the prompt already ended the reasoning (a template that
closed the think block). With enable_in_reasoning the grammar constrains the reply from its
first token, leaving it no think block. The server hands --reasoning-parser to its engine's
StructuredOutputsConfig (serving.Service) and splits a constrained reply as any other
(Service.reasoning_for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import REASONING_PARSERS

PARSERS = REASONING_PARSERS
START, END = "<think>", "</think>"
HARMONY = "openai_gptoss"
# the harmony markup: a message's header runs from <|start|> (or the reply's start) to
# <|message|>, naming its channel after <|channel|>; its body runs to <|end|> (<|return|> and
# <|call|> end the reply: they are stop tokens, never in the text)
_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@dataclass(frozen=True)
class HarmonyCall:
    """A message the reply addressed to a function (`to=functions.NAME` in its header)."""
    name: str
    arguments: str
    closed: bool              # its body ended (<|end|>, or <|call|> / the reply's end when final)


def parse_harmony(text: str, final: bool = True, calls: bool = False,
                  cut: bool = False) -> tuple[str, str, list[HarmonyCall]]:
    """A harmony reply (special tokens kept) -> (reasoning, answer, function calls). final=False:
    the reply may be cut mid-marker (a stream): an unfinished marker or header is left out.
    calls=False: a call's arguments are answer text (no tool parsing asked). cut: the reply was
    cut off (finish_reason "length"): a last call whose body did not end is incomplete, so it is
    no call and its arguments are dropped (vLLM returns only completed messages; a call that
    ended has finish_reason "stop", <|call|> being a stop token)."""
    reasoning, answer, found = [], [], []
    # text before the first header is outside the format: answer
    pos = min((i for m in (_H_CHANNEL, _H_START) if (i := text.find(m)) >= 0), default=len(text))
    lead = text[:pos]
    if pos == len(text) and not final:
        lead = lead[:len(lead) - max(held_back(lead, m) for m in (_H_CHANNEL, _H_START))]
    answer.append(lead)
    while pos < len(text):
        if text.startswith(_H_START, pos):
            pos += len(_H_START)
        at = text.find(_H_MESSAGE, pos)
        if at < 0:
            break                                  # a header still arriving, or cut off: dropped
        header = text[pos:at]
        channel = header.split(_H_CHANNEL, 1)[1] if _H_CHANNEL in header else ""
        body_at = at + len(_H_MESSAGE)
        ends = [(i, tag) for tag in _H_ENDS if (i := text.find(tag, body_at)) >= 0]
        end, tag = min(ends) if ends else (len(text), "")
        body = text[body_at:end]
        if not ends and not final:                 # the last body, maybe ending in a marker's first part
            body = body[:len(body) - max(held_back(body, t) for t in (*_H_ENDS, _H_START))]
        recipient = _RECIPIENT.search(header)
        if calls and recipient is not None:
            if ends or not (final and cut):
                found.append(HarmonyCall(recipient.group(1), body, bool(ends) or final))
        else:
            (reasoning if channel.split()[:1] == ["analysis"] else answer).append(body)
        pos = end + len(tag)
    # messages of one channel kind read as paragraphs (a commentary preamble, then the final answer)
    return "\n\n".join(r for r in reasoning if r), "\n\n".join(a for a in answer if a), found


def split_harmony(text: str, final: bool = True) -> tuple[str, str]:
    """parse_harmony's (reasoning, answer), function calls' arguments as answer text."""
    return parse_harmony(text, final)[:2]


def prompt_think(prompt_tail: str) -> str | None:
    """How the prompt (its last tokens' text) leaves a qwen3 reply: "open" when it ends inside a
    think block (QwQ's and Qwen3-Thinking-2507's generation prompts end with <think>), "closed"
    when it ends one (Qwen3 with enable_thinking false), None when it does neither."""
    s = prompt_tail.rstrip()
    return "open" if s.endswith(START) else "closed" if s.endswith(END) else None


def split_reasoning(parser: str, text: str, prompt: str | None = None) -> tuple[str, str]:
    """A finished reply -> (reasoning, answer); either may be empty. prompt: prompt_think's."""
    if parser == HARMONY:
        return split_harmony(text)
    s = text.lstrip()
    if s.startswith(START):                                # the reply opens the block: cut short, all reasoning
        reasoning, _, answer = s[len(START):].partition(END)
        return reasoning, answer
    if prompt == "closed":                                 # qwen3, thinking off
        return "", text
    reasoning, found, answer = text.partition(END)
    if found or parser == "deepseek_r1" or prompt == "open":   # inside a block the prompt opened
        return reasoning, answer
    return "", text                                        # qwen3 without a think block


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag: what a stream holds back, since the
    tag may be arriving (also the tool parsers' call tags)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HarmonyStream:
    """ReasoningStream for harmony replies: the reply so far is parsed again at each step (a
    harmony reply only grows at its end) and what its parts gained is sent. calls=True: function
    calls are kept apart; take_calls() returns each once its arguments are complete."""

    def __init__(self, calls: bool = False):
        self.text, self.sent, self.calls, self.calls_sent = "", ("", ""), calls, 0
        self._calls: list[HarmonyCall] = []

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._gained(parse_harmony(self.text, False, self.calls))

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """cut: the reply was cut off (finish_reason "length"): parse_harmony's."""
        return self._gained(parse_harmony(self.text, True, self.calls, cut))

    def pending(self) -> tuple[str, ...]:
        return ()                  # the whole reply is parsed again each step: nothing held as fed

    def take_calls(self) -> list[HarmonyCall]:
        ready = []
        for c in self._calls[self.calls_sent:]:
            if not c.closed:
                break
            ready.append(c)
        self.calls_sent += len(ready)
        return ready

    def _gained(self, parsed) -> tuple[str, str]:
        reasoning, answer, self._calls = parsed
        out = tuple(now[len(before):] for now, before in zip((reasoning, answer), self.sent))
        self.sent = (reasoning, answer)
        return out


def reasoning_stream(parser: str, calls: bool = False, prompt: str | None = None):
    return HarmonyStream(calls) if parser == HARMONY else ReasoningStream(parser, prompt)


@dataclass
class ReasoningStream:
    """One streamed choice: feed() each step's text -> (reasoning delta, answer delta); finish()
    -> what is still held. The deltas joined equal split_reasoning's parts."""
    parser: str
    prompt: str | None = None     # prompt_think's: "open" | "closed" | None
    state: str = "start"          # start (nothing decided yet) | reasoning | answer | undecided (qwen3: held)
    buf: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(START):                  # the whole tag (a reply may end right after it)
                self.buf, self.state = s[len(START):], "reasoning"
            elif START.startswith(s):                # whitespace, or the opening tag arriving
                return "", ""
            elif self.prompt == "closed":            # the prompt closed the block: the answer (split_reasoning's)
                self.state = "answer"
            elif self.parser == "deepseek_r1" or self.prompt == "open":
                self.state = "reasoning"
            else:                                    # qwen3: answer, unless a </think> comes
                self.state = "undecided"
        if self.state == "answer":
            text, self.buf = self.buf, ""
            return "", text
        at = self.buf.find(END)
        if self.state == "undecided" and at < 0:
            return "", ""
        if at >= 0:
            reasoning, answer = self.buf[:at], self.buf[at + len(END):]
            self.buf, self.state = "", "answer"
            return reasoning, answer
        keep = held_back(self.buf, END)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """What is still held: (reasoning, answer)."""
        rest, self.buf = self.buf, ""
        reasoning = self.state == "reasoning" or (self.state == "start" and self.prompt != "closed" and (
            self.parser == "deepseek_r1" or self.prompt == "open"))
        return (rest, "") if reasoning else ("", rest)

    def pending(self) -> tuple[str, ...]:
        """The text fed and not yet sent (a leading <think> already dropped)."""
        return (self.buf,)
