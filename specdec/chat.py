"""`specdec chat`: an interactive conversation, streamed, with each answer's speculative statistics.

Each answer is followed (on stderr) by its decoding rate, acceptance rate, mean accepted length
and its speedup over plain decoding on this machine. Rates are of the decoding phase (output
tokens over the time after the prompt's forward): the prompt grows with the conversation, and
its prefill is the same work with or without speculation. The plain rate is measured once at
start (a short greedy plain decoding of the first question); `--compare` instead decodes every
answer a second time without speculation, for the exact speedup and an identical-output check.

Lines starting with "/" are commands: /reset (forget the conversation), /exit.

gpt-oss writes harmony replies (server/reasoning.py): its analysis goes to stderr as it comes,
its answer to stdout, and only the answer joins the conversation (gpt-oss's template drops
earlier turns' analysis anyway).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from .cli import add_engine_args, add_model_args, add_sampling_args, llm_from_args, sampling_params
from .config import SamplingParams, SchedulerConfig
from .engine import Engine, kv_cache_dtype_name
from .metrics import RequestStats
from .tokenizer import NO_CHAT_TEMPLATE, load_chat_template

PLAIN_PROBE_TOKENS = 32


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (streaming) with each answer's speedup and acceptance")
    add_model_args(p)
    add_engine_args(p)
    add_sampling_args(p, 256)
    p.add_argument("--system", help="a system message starting the conversation")
    p.add_argument("--chat-template", help="a Jinja chat template file, or the template itself, instead of the "
                                           "tokenizer's (as serve's)")
    p.add_argument("--compare", action="store_true",
                   help="decode every answer plainly too: exact speedup and whether the outputs are identical")


def decode_rate(stats: RequestStats) -> float:
    """Output tokens per second after the prompt's forward."""
    t = stats.wall_time_s - stats.prefill_time_s
    return stats.output_tokens / t if t > 0 else 0.0


def writes_harmony(llm) -> bool:
    """Whether the model replies in OpenAI's harmony format (gpt-oss)."""
    return getattr(getattr(llm.target, "config", None), "model_type", None) == "gpt_oss"


class Thought(str):
    """A piece of a harmony reply's analysis (ChatSession.ask yields it beside the answer's text)."""


class HarmonySplit:
    """A reply's pieces as they are decoded -> (analysis, answer) deltas: a harmony reply split
    by its channels, any other reply all answer."""

    def __init__(self, harmony: bool):
        from .server.reasoning import HarmonyStream

        self.stream = HarmonyStream() if harmony else None
        self.reasoning, self.answer = [], []

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        if self.stream is None:
            thought, piece = "", text
        else:
            thought, piece = self.stream.feed(text)
            if last:
                more = self.stream.finish()
                thought, piece = thought + more[0], piece + more[1]
        self.reasoning.append(thought)
        self.answer.append(piece)
        return thought, piece


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    stats: RequestStats
    plain_rate: float | None = None      # tok/s of plain decoding on this very prompt (--compare)
    identical: bool | None = None        # greedy answers: equal to plain decoding's
    reasoning: str = ""                  # a harmony reply's analysis


class ChatSession:
    """A conversation with one LLM: ask() streams an answer and remembers both turns."""

    def __init__(self, llm, params: SamplingParams, system: str | None = None, compare: bool = False,
                 chat_template: str | None = None):
        self.harmony = writes_harmony(llm)
        if self.harmony:                           # its channels are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        self.llm, self.params, self.system, self.compare = llm, params, system, compare
        self.chat_template = chat_template         # None: the tokenizer's
        self.messages: list[dict] = []
        self.plain = Engine(llm.target, llm.tokenizer, None, 0, llm.engine.max_model_len,     # the same KV cache dtype
                            scheduler_config=SchedulerConfig(max_num_seqs=1,
                                                             enable_prefix_caching=llm.engine.config.enable_prefix_caching),
                            kv_cache_dtype=kv_cache_dtype_name(llm.engine))
        self.speculative = llm.engine.proposer is not None
        self.reference_rate: float | None = None    # plain decoding, measured once

    def reset(self) -> None:
        self.messages = []

    def prompt_ids(self, user: str) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return self.llm.chat_prompt(head + self.messages + [{"role": "user", "content": user}],
                                    chat_template=self.chat_template)["prompt_token_ids"]

    def ask(self, user: str):
        """Yield the answer's text as it is decoded (a harmony reply's analysis as Thought
        pieces); then the Answer (the last item)."""
        ids = self.prompt_ids(user)
        self.llm.engine.check_prompt(ids, self.params)
        if self.speculative and not self.compare and self.reference_rate is None:
            self.reference_rate = self._plain_rate(ids)
        tokens, split, event = [], HarmonySplit(self.harmony), None
        for event in self.llm.engine.generate(ids, self.params):
            tokens += event.token_ids
            thought, piece = split.feed(event.text, last=event.finished)
            if thought:
                yield Thought(thought)
            if piece:
                yield piece
        answer = Answer("".join(split.answer), tokens, event.stats, reasoning="".join(split.reasoning))
        if self.speculative and self.compare:
            plain_tokens, plain_stats = self._run_plain(ids, self.params)
            answer.plain_rate = decode_rate(plain_stats)
            answer.identical = plain_tokens == tokens if self.params.greedy else None
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
        yield answer

    def _run_plain(self, ids: list[int], params: SamplingParams) -> tuple[list[int], RequestStats]:
        tokens, event = [], None
        for event in self.plain.generate(ids, params):
            tokens += event.token_ids
        return tokens, event.stats

    def _plain_rate(self, ids: list[int]) -> float:
        """Plain greedy decoding's rate on this machine (after a short warm-up run)."""
        self._run_plain(ids, SamplingParams(temperature=0, max_tokens=4))
        probe = SamplingParams(temperature=0, max_tokens=PLAIN_PROBE_TOKENS, ignore_eos=True)
        return decode_rate(self._run_plain(ids, probe)[1])

    def summary(self, a: Answer) -> str:
        s, rate = a.stats, decode_rate(a.stats)
        line = f"[{s.output_tokens} tokens, {rate:.1f} tok/s"
        if not self.speculative:
            return line + ", plain decoding]"
        line += f", acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}"
        if a.plain_rate:
            same = {True: "identical", False: "DIFFERENT", None: "sampled"}[a.identical]
            return line + f", speedup {rate / a.plain_rate:.2f}x vs plain {a.plain_rate:.1f} tok/s, outputs {same}]"
        if self.reference_rate:
            return line + f", speedup ~{rate / self.reference_rate:.2f}x vs plain {self.reference_rate:.1f} tok/s]"
        return line + "]"


def _method(llm) -> str:
    spec = llm.spec
    return f"{spec.method}, K={spec.num_speculative_tokens}" if spec and llm.engine.proposer else "plain decoding"


def run(args) -> int:
    sampling_params(args, {})                              # bad flags fail before the model loads
    template = load_chat_template(args.chat_template)
    llm = llm_from_args(args)
    llm.check_runner("generate")
    if template is None and not llm.tokenizer.chat_template:
        raise ValueError(NO_CHAT_TEMPLATE)                 # before the prompt, not at every message
    session = ChatSession(llm, sampling_params(args, llm.generation_defaults), args.system, args.compare, template)
    interactive = sys.stdin.isatty()
    print(f"specdec chat: {llm.model_path} ({_method(llm)}). /reset forgets the conversation, /exit quits.",
          file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        answer = None
        try:
            for answer in session.ask(text):
                if isinstance(answer, Thought):      # gpt-oss's analysis: beside the answer, on stderr
                    sys.stderr.write(answer)
                    sys.stderr.flush()
                elif isinstance(answer, str):
                    sys.stdout.write(answer)
                    sys.stdout.flush()
        except ValueError as e:          # e.g. the conversation outgrew the context: the session goes on
            print(f"error: {e} (the message was not added; /reset clears the conversation)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(session.summary(answer), file=sys.stderr)
