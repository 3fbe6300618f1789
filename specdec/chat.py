'''`specdec chat`: an interactive conversation, streamed, with each answer's speculative statistics.

Each answer is followed (on stderr) by its decoding rate, acceptance rate, mean accepted length
and an estimate of its speedup over plain decoding on this machine. Rates are of the decoding
phase (output tokens over the time after the prompt's forward): the prompt grows with the
conversation, and its prefill is the same work with or without speculation. The plain reference
is measured once at start-up (the median of REFERENCE_PROBES greedy runs of REFERENCE_TOKENS
tokens), and the estimate is printed for answers of at least SPEEDUP_MIN_TOKENS tokens; `--compare`
instead decodes every answer a second time without speculation, for the exact speedup and an
identical-output check.

Input: from a terminal through GNU readline (no 4095-byte line limit, line editing, history), else
line by line. A line `"""` starts a multi-line message that a line `"""` ends; a line ending in a
backslash goes on on the next line. A line starting with "/" is a command (COMMANDS; "//text"
sends "/text"). Ctrl-C while an answer streams stops it between engine steps (the request is
aborted, the turn is not kept); at the prompt it quits. A message that fails (text that is not
Unicode, a conversation outgrowing the context) is one line on stderr and is not kept; the chat
goes on and exits 1 at the end of its input.

gpt-oss writes harmony replies (server/reasoning.py): its analysis goes to stderr as it comes,
its answer to stdout, and only the answer joins the conversation (gpt-oss's template drops
earlier turns' analysis anyway).

With --url, --model-name or --api-key (vLLM's `vllm chat` flags) the chat loads no model: it talks
to that running OpenAI-compatible server instead (client_cli.py), with the same input and commands.
'''

from __future__ import annotations

import dataclasses
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from .cli import add_engine_args, add_model_args, add_sampling_args, llm_from_args, sampling_params
from .config import SamplingParams, SchedulerConfig
from .engine import Engine, kv_cache_dtype_name
from .metrics import RequestStats
from .tokenizer import NO_CHAT_TEMPLATE, load_chat_template, template_in_use

REFERENCE_PROBES = 3          # plain decoding's reference rate: the median of this many runs ...
REFERENCE_TOKENS = 64         # ... of this many tokens, measured once at start-up
SPEEDUP_MIN_TOKENS = 16       # the estimated speedup is printed for answers at least this long
BLOCK = '"""'                 # a line of its own: starts / ends a multi-line message (ollama's)
COMMANDS = {"/exit": "exit", "/quit": "exit", "/bye": "exit", "/reset": "reset", "/clear": "reset",
            "/help": "help", "/?": "help"}
HELP = "\n".join([
    "commands:",
    "  /reset, /clear        forget the conversation (the system message stays)",
    "  /exit, /quit, /bye    quit (also Ctrl-D at the prompt)",
    "  /help, /?             this help",
    '  //text                send the message "/text"',
    '  """                   on a line of its own: a multi-line message follows, up to a line """',
    "  a line ending in \\    the message goes on on the next line",
    "  Ctrl-C                stop the answer being written (it is not kept); at the prompt: quit",
])


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (streaming) with each answer's speedup and acceptance",
                       allow_abbrev=False)
    add_model_args(p)
    add_engine_args(p)
    add_sampling_args(p, 256, remote="with --url: ")
    p.add_argument("--system", "--system-prompt", dest="system", help="a system message starting the conversation "
                                                                      "(--system-prompt: vLLM's name)")
    # vLLM's client flags: with any of --url, --model-name, --api-key the chat talks to that server
    # (client_cli.py) instead of loading a model. -q is vLLM's --quick there, --quantization here.
    from .client_cli import add_client_args

    add_client_args(p)
    quantization = next(a for a in p._actions if a.dest == "quantization")
    quantization.option_strings.remove("-q")
    del p._option_string_actions["-q"]
    p.add_argument("-q", dest="q", metavar="MESSAGE|METHOD",
                   help="with a server (--url ...): --quick MESSAGE; else --quantization METHOD")
    p.add_argument("--quick", metavar="MESSAGE", help="send this one message, print the answer, exit (vLLM's)")
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
    stats: RequestStats | None
    plain_rate: float | None = None      # tok/s of plain decoding on this very prompt (--compare)
    identical: bool | None = None        # greedy answers: equal to plain decoding's
    reasoning: str = ""                  # a harmony reply's analysis
    interrupted: bool = False            # stopped (Ctrl-C) before the end: not part of the conversation
    compare_interrupted: bool = False    # --compare's plain run stopped: no exact speedup


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
        self.reference_rate: float | None = None    # plain decoding, measured once (measure_reference)
        self.stop_requested = False                 # interrupt(): the answer being decoded stops

    def reset(self) -> None:
        self.messages = []

    def prompt_ids(self, user: str) -> list[int]:
        # an empty system message is a message (it replaces a template's default one, as LLM.chat's)
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return self.llm.chat_prompt(head + self.messages + [{"role": "user", "content": user}],
                                    chat_template=self.chat_template)["prompt_token_ids"]

    def check_params(self) -> None:
        """The engine's checks of a request's sampling parameters against the loaded model (grammar,
        regex and JSON schema, logit_bias ids in the vocabulary, bad_words, ...), made once before
        the first message: a ValueError names the bad one (a one-token prompt that fits any context)."""
        self.llm.engine.check_prompt([0], self.params, room=0)

    def interrupt(self) -> None:
        """Stop the answer being decoded, between two engine steps (safe from a signal handler)."""
        self.stop_requested = True

    def ask(self, user: str):
        """Yield the answer's text as it is decoded (a harmony reply's analysis as Thought
        pieces); then the Answer (the last item). After interrupt(), the request is aborted and the
        Answer has interrupted=True and joins no conversation."""
        self.stop_requested = False
        ids = self.prompt_ids(user)
        self.llm.engine.check_prompt(ids, self.params)
        params = self.llm._params(self.params)      # unseeded sampling: the LLM's next seed (a run reproduces)
        tokens, split, event = [], HarmonySplit(self.harmony), None
        for event in self._stream(self.llm.engine, ids, params):
            tokens += event.token_ids
            thought, piece = split.feed(event.text, last=event.finished)
            if thought:
                yield Thought(thought)
            if piece:
                yield piece
        stats = event.stats if event is not None else None
        answer = Answer("".join(split.answer), tokens, stats, reasoning="".join(split.reasoning))
        if event is None or not event.finished:
            answer.interrupted = True
            yield answer
            return
        if self.speculative and self.compare:
            plain = self._run_plain(ids, params)
            if plain is None:
                answer.compare_interrupted = True
            else:
                answer.plain_rate = decode_rate(plain[1])
                answer.identical = plain[0] == tokens if self.params.greedy else None
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
        yield answer

    def _stream(self, engine, ids: list[int], params: SamplingParams):
        """engine.generate, checking stop_requested between steps: once it is set, the request
        leaves (its KV blocks and proposer state freed) and the stream ends without a finished event."""
        return engine.generate(ids, params, stop=lambda: self.stop_requested)

    def _run_plain(self, ids: list[int], params: SamplingParams) -> tuple[list[int], RequestStats] | None:
        """Plain decoding of ids: (tokens, stats), or None when interrupt() stopped it."""
        tokens, event = [], None
        for event in self._stream(self.plain, ids, params):
            tokens += event.token_ids
        return (tokens, event.stats) if event is not None and event.finished else None

    def measure_reference(self) -> float | None:
        """Plain greedy decoding's rate on this machine, for the speedup estimates of speculative
        answers (not with --compare): the median of REFERENCE_PROBES runs of REFERENCE_TOKENS tokens
        on a short chat prompt, after a warm-up run. Measured once: call it at start-up."""
        if not self.speculative or self.compare:
            return None
        ids = self.prompt_ids("Hello")
        n = min(REFERENCE_TOKENS, self.plain.max_model_len - len(ids))
        if n < SPEEDUP_MIN_TOKENS:             # a context too small to time plain decoding
            return None
        self.stop_requested = False
        if self._run_plain(ids, SamplingParams(temperature=0, max_tokens=4)) is None:
            return None
        probe = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        rates = []
        for _ in range(REFERENCE_PROBES):
            run = self._run_plain(ids, probe)
            if run is None:
                return None
            rates.append(decode_rate(run[1]))
        self.reference_rate = sorted(rates)[len(rates) // 2]
        return self.reference_rate

    def summary(self, a: Answer) -> str:
        s, rate = a.stats, decode_rate(a.stats)
        line = f"[{s.output_tokens} tokens, {rate:.1f} tok/s"
        if not self.speculative:
            return line + ", plain decoding]"
        line += f", acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}"
        if a.plain_rate:
            same = {True: "identical", False: "DIFFERENT", None: "sampled"}[a.identical]
            return line + f", speedup {rate / a.plain_rate:.2f}x vs plain {a.plain_rate:.1f} tok/s, outputs {same}]"
        if a.compare_interrupted:
            return line + ", plain run interrupted]"
        if self.reference_rate and s.output_tokens >= SPEEDUP_MIN_TOKENS:
            return line + f", speedup ~{rate / self.reference_rate:.2f}x vs plain {self.reference_rate:.1f} tok/s]"
        return line + "]"


def _method(llm) -> str:
    spec = llm.spec
    return f"{spec.method}, K={spec.num_speculative_tokens}" if spec and llm.engine.proposer else "plain decoding"


class LineReader:
    """The chat's input lines, without their newline. A terminal is read with input() after
    `import readline`: GNU readline reads in raw mode, so there is no 4095-byte line limit (the
    tty driver's, in canonical mode), and lines can be edited and recalled (history). A pipe or
    file is read line by line. Bytes that are not UTF-8 are read as lone surrogates (as a C
    locale's Python reads them), whatever the locale: the message that holds them fails alone,
    not the reading of the rest."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stdin
        if hasattr(self.stream, "reconfigure"):
            self.stream.reconfigure(errors="surrogateescape")
        self.terminal = self.stream is sys.stdin and self.stream.isatty()
        if self.terminal:
            try:
                import readline  # noqa: F401  (input() edits lines with it from now on)
            except ImportError:           # a Python built without it: input() alone
                pass

    def line(self, prompt: str) -> str | None:
        """The next line (None at the end of the input); a terminal shows prompt first."""
        if not self.terminal:
            line = self.stream.readline()
            if not line:
                return None
            return line[:-1].removesuffix("\r") if line.endswith("\n") else line
        if not sys.stdout.isatty():       # answers go to a file: the prompt to the terminal
            print(prompt, end="", file=sys.stderr, flush=True)
            prompt = ""
        try:
            return input(prompt)
        except EOFError:
            return None

    def message(self) -> tuple[str, bool] | None:
        """The next message and whether it came as a `\"\"\"` block (kept as typed, never a command);
        None at the end of the input. A line `\"\"\"` starts a block that a line `\"\"\"` ends (or the
        end of the input); a line ending in a backslash goes on on the next line, the backslash
        becoming a newline."""
        line = self.line("> ")
        if line is None:
            return None
        if line.strip() == BLOCK:
            lines = []
            while (line := self.line("... ")) is not None and line.strip() != BLOCK:
                lines.append(line)
            return "\n".join(lines), True
        parts = []
        while line.endswith("\\"):
            parts.append(line[:-1])
            line = self.line("... ")
            if line is None:
                line = ""
                break
        parts.append(line)
        return "\n".join(parts), False


@contextmanager
def ctrl_c_stops(session: ChatSession):
    """While an answer is decoded, Ctrl-C (SIGINT) asks the session to stop it: the handler only
    sets a flag, read between engine steps, so no step is cut in half. A second Ctrl-C before the
    answer stops is KeyboardInterrupt as usual (the chat exits)."""
    def handler(signum, frame):
        if session.stop_requested:
            raise KeyboardInterrupt
        session.interrupt()

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:                    # not the main thread: Ctrl-C keeps its default
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def command(session: ChatSession, text: str) -> bool:
    """Run a "/" command line; False: quit."""
    action = COMMANDS.get(text)
    if action == "exit":
        return False
    if action == "reset":
        session.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif action == "help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {text!r} (commands: /help, /reset, /exit; //text sends \"/text\"); "
              f"not sent", file=sys.stderr)
    return True


def run(args) -> int:
    from . import client_cli

    remote = client_cli.wants_server(args)
    args.quick = getattr(args, "quick", None)
    if getattr(args, "q", None) is not None:                                 # -q: --quick with a server, --quantization here
        if remote:
            if args.quick is not None:
                raise ValueError("-q is --quick with --url: give the message once")
            args.quick = args.q
        else:
            choices = next(a for a in _own_parser(args)._actions if a.dest == "quantization").choices
            if args.q not in choices:
                raise ValueError(f"argument --quantization/-q: invalid choice: {args.q!r} (choose from "
                                 f"{', '.join(choices)})")
            args.quantization = args.q
    if remote:
        client_cli.check_local_flags(args, _own_parser(args))
        return client_cli.run_chat(args)
    sampling_params(args, {})                              # bad flags fail before the model loads
    template = load_chat_template(args.chat_template)
    llm = llm_from_args(args, seed=0)        # as vLLM's LLM: unseeded sampling reproduces run to run
    llm.check_runner("generate")
    if template is None and template_in_use(llm.tokenizer) is None:   # none, or only named ones without a default
        raise ValueError(NO_CHAT_TEMPLATE)                 # before the prompt, not at every message
    if args.compare and llm.engine.proposer is None:       # as generate --compare
        raise ValueError("--compare needs a speculative method (this chat decodes plainly: nothing to compare "
                         "with plain decoding)")
    session = ChatSession(llm, sampling_params(args, llm.generation_defaults), args.system, args.compare, template)
    session.check_params()                                 # flags bad for this model: exit 2 now
    session.measure_reference()
    reader = LineReader()
    quick = [(args.quick, True)] if args.quick is not None else None       # --quick: one message, kept as typed
    print(f"specdec chat: {llm.model_path} ({_method(llm)}). /reset forgets the conversation, /exit quits, "
          f"/help for more.", file=sys.stderr)
    failed = False                       # a message failed: exit 1 at the end (as the remote chat)
    while True:
        message = reader.message() if quick is None else (quick.pop() if quick else None)
        if message is None:
            return 1 if failed else 0
        text, block = message
        if not block:
            text = text.strip()
            if text.startswith("//"):
                text = text[1:]                            # a message that starts with "/"
            elif text.startswith("/"):
                if not command(session, text):
                    return 1 if failed else 0
                continue
        if not text.strip():
            continue
        answer = None
        try:
            if why := client_cli.not_unicode(text):      # named in the message, not in the templated prompt
                raise ValueError(why)
            with ctrl_c_stops(session):
                for answer in session.ask(text):
                    if isinstance(answer, Thought):      # gpt-oss's analysis: beside the answer, on stderr
                        sys.stderr.write(answer)
                        sys.stderr.flush()
                    elif isinstance(answer, str):
                        sys.stdout.write(answer)
                        sys.stdout.flush()
        except ValueError as e:          # e.g. the conversation outgrew the context: the session goes on
            if quick is not None:
                raise
            failed = True
            print(f"error: {e} (the message was not added; /reset clears the conversation)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if answer.interrupted:
            print("(interrupted: the answer was not added to the conversation)", file=sys.stderr)
            continue
        print(session.summary(answer), file=sys.stderr)


def _own_parser(args):
    """specdec chat's parser (to read its flags' definitions)."""
    from .cli import _subparser, build_parser

    return _subparser(build_parser("chat"), "chat")
