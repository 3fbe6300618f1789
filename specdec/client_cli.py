'''`specdec chat --url URL` and `specdec complete`: vLLM's client CLIs (`vllm chat`, `vllm complete`),
which talk to a running OpenAI-compatible server (specdec's own, vLLM, OpenAI, ...) through the
official `openai` client, streaming.

Flags are vLLM's: --url (default http://localhost:8000/v1), --model-name (default: the first model
GET /models lists), --api-key (default: $OPENAI_API_KEY), -q/--quick (one message or prompt, its
answer, exit), --stats (time to first token and tokens per second, measured here); chat's
--system-prompt (specdec chat's --system). The sampling flags of `specdec chat` go into each request
(OpenAI's fields as they are, vLLM's extensions -- top_k, min_p, repetition_penalty, min_tokens,
bad_words, ignore_eos, structured_outputs -- in the body as vLLM names them). Flags that only mean
something for a model loaded here (--model, --speculative-config, --compare, ...) are an error.

Answers go to stdout; everything else (banner, statistics, errors) to stderr. specdec's server ends
each streamed choice with a "speculative" field (server/responses.py): from it the answer is followed
by the line the local chat prints, `[N tokens, R tok/s, acceptance A, mean accepted length L]`
(the server's decoding-phase rate); other servers' answers stand alone. A reasoning parser's
reasoning_content goes to stderr as it comes, as the local chat writes gpt-oss's analysis.

Input is chat.py's: readline from a terminal, `"""` blocks, a backslash continuing a line, "/"
commands. A --url without http(s)://, a key no HTTP header can carry (never quoted) or a --model-name
that is not Unicode is an error before connecting (status 2, as a bad flag). Errors (server
unreachable, an unknown model, a refused key, a --url answering with a web page or another API's
JSON instead of OpenAI's, a server error mid-stream) are one line on stderr: with --quick the command exits 1; in the loop the message is dropped, the
loop goes on, and the command exits 1 at the end of its input. Ctrl-C while an answer streams
closes the stream (the server aborts the request) and the answer is not kept; at the prompt it quits.
'''

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

DEFAULT_URL = "http://localhost:8000/v1"
# flags that go to the server (their dests); any other of `specdec chat`'s flags needs a local model
SAMPLING_DESTS = {"temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "stop", "ignore_eos",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
                  "min_tokens", "json_schema", "json_object", "regex", "choice", "grammar"}
CLIENT_DESTS = {"url", "model_name", "api_key", "stats", "quick", "q", "system", "help", "config"} | SAMPLING_DESTS
EXIT_COMMANDS = {"/exit", "/quit", "/bye"}
COMPLETE_HELP = "\n".join([
    "commands:",
    "  /exit, /quit, /bye    quit (also Ctrl-D at the prompt)",
    "  /help, /?             this help",
    '  """                   on a line of its own: a prompt of several lines follows, up to a line """',
    "  a line ending in \\    the prompt goes on on the next line",
    "  Ctrl-C                stop the completion being written; at the prompt: quit",
    "any other line is a prompt, sent as typed",
])


class ClientError(Exception):
    """One line for stderr; the command exits with status 1."""


class NotAStream(ClientError):
    """A streamed request answered 200 with no chunk at all: what came instead (a web page, a JSON
    body), as describe() words it."""


def add_client_args(p, local: bool = True) -> None:
    """vLLM's --url, --model-name, --api-key and --stats (local: the command also runs without a
    server, printing statistics of its own there)."""
    p.add_argument("--url", help=f"a running OpenAI-compatible server's API base (default {DEFAULT_URL}, vLLM's)")
    p.add_argument("--model-name", help="the served model to ask (default: the first of the server's GET /models)")
    p.add_argument("--api-key", help="the server's API key (default: $OPENAI_API_KEY)")
    p.add_argument("--stats", action="store_true",
                   help="after each answer: time to first token and tokens per second, measured here, on "
                        "stderr (vLLM's" + ("; without a server the local chat prints its own statistics anyway)"
                                            if local else ")"))


def wants_server(args) -> bool:
    """specdec chat talks to a server when any of the client flags is given."""
    return any(getattr(args, dest, None) is not None for dest in ("url", "model_name", "api_key"))


def check_local_flags(args, sub) -> None:
    """With --url, a flag of `specdec chat` that only a model loaded here reads is a ValueError
    naming it. sub: the chat subparser; the words given (args.words) are parsed again with every
    default suppressed, so a flag given at its default value still counts."""
    import argparse

    actions = [a for a in sub._actions if a.dest not in CLIENT_DESTS and a.dest != argparse.SUPPRESS]
    words = getattr(args, "words", None)
    if words is not None:
        saved = [(a, a.default) for a in sub._actions]
        defaults, sub._defaults = sub._defaults, {}
        try:
            for a in sub._actions:
                a.default = argparse.SUPPRESS
            given = vars(sub.parse_known_args(list(words[1:]), argparse.Namespace())[0])
        finally:
            for a, default in saved:
                a.default = default
            sub._defaults = defaults
    else:                                  # a Namespace built by hand: what differs from the defaults
        given = {a.dest: True for a in actions if getattr(args, a.dest, a.default) != a.default}
    for a in actions:
        if a.dest in given:
            flag = max(a.option_strings, key=len) if a.option_strings else a.dest
            hint = " (name the server's model with --model-name)" if a.dest == "model" else ""
            raise ValueError(f"{flag} is for a model loaded here; with --url the server answers: leave it "
                             f"out{hint}")


def not_unicode(text: str) -> str | None:
    """Why text cannot be sent (a lone surrogate: Python's stand-in for bytes of stdin or argv that
    are not UTF-8, which no JSON body can carry), as the local chat's tokenizer words it; None if it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        i = e.start
        return (f"the text is not valid Unicode: a lone surrogate at character {i} (bytes that are not UTF-8?): "
                f"{text[max(0, i - 20):i + 1]!r}")
    return None


def _check_sendable(value, where: str) -> None:
    """A ValueError naming the flag whose text (strings in lists and JSON objects too) cannot be sent."""
    if isinstance(value, str) and (why := not_unicode(value)):
        raise ValueError(f"{where}: {why}")
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        _check_sendable(item, where)


def request_fields(args) -> dict:
    """The sampling flags given, as create() keywords: OpenAI's fields as they are, vLLM's
    extensions in extra_body. Text no request can carry (in these, --system or --quick) is a
    ValueError naming the flag."""
    fields = {k: getattr(args, k) for k in ("temperature", "top_p", "max_tokens", "seed", "stop",
                                            "presence_penalty", "frequency_penalty", "logit_bias")
              if getattr(args, k, None) is not None}
    extra = {k: getattr(args, k) for k in ("top_k", "min_p", "repetition_penalty", "min_tokens", "bad_words")
             if getattr(args, k, None) is not None}
    if getattr(args, "ignore_eos", False):
        extra["ignore_eos"] = True
    structured = {"json": getattr(args, "json_schema", None), "json_object": getattr(args, "json_object", False) or None,
                  "regex": getattr(args, "regex", None), "choice": getattr(args, "choice", None),
                  "grammar": getattr(args, "grammar", None)}
    structured = {k: v for k, v in structured.items() if v is not None}
    if len(structured) > 1:
        raise ValueError("give at most one of --json-schema, --json-object, --regex, --choice, --grammar")
    if structured:
        extra["structured_outputs"] = structured
    if extra:
        fields["extra_body"] = extra
    if getattr(args, "stats", False):
        fields["stream_options"] = {"include_usage": True}
    for dest in sorted(SAMPLING_DESTS | {"system", "quick"}):   # before connecting: the requests would fail
        _check_sendable(getattr(args, dest, None), f"--{dest.replace('_', '-')}")
    return fields


# ---------------------------------------------------------------- talking to the server

def connect(args):
    """(client, model name, url): the openai client for --url and the model to ask. A --url, key
    or --model-name that no request can carry is a ValueError naming it, before connecting."""
    try:
        import openai
    except ImportError:
        raise ClientError("talking to a server needs the openai package (pip install openai)") from None
    url = (args.url or DEFAULT_URL).rstrip("/")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    check_target(url, key, "--api-key" if args.api_key else "$OPENAI_API_KEY", args.model_name)
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    if args.model_name:
        return client, args.model_name, url
    try:
        answer = client.models.with_raw_response.list().http_response
    except client_errors() as e:
        raise ClientError(describe(e, url)) from None
    models = model_ids(answer)
    if models is None:                 # a web page, another API: what the client would fail to parse
        raise ClientError(f"the server at {url} answered GET /models with no OpenAI model list "
                          f"({content_type(answer)}): is --url an OpenAI-compatible API's base, such as "
                          f"{DEFAULT_URL}?")
    if not models:
        raise ClientError(f"the server at {url} lists no models: name one with --model-name")
    return client, models[0], url


def check_target(url: str, key: str, key_source: str, model: str | None) -> None:
    """A ValueError naming what the request cannot carry: a --url that is not http(s) (the HTTP
    library's words say the connection broke), an API key with a character no HTTP header holds
    (its words quote the whole key), a --model-name that is not Unicode. The key is never quoted."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r} is not an http:// or https:// URL (such as {DEFAULT_URL})")
    for i, ch in enumerate(key):
        if not (ch.isascii() and ch.isprintable()):
            kind = "a control character" if ch.isascii() else "a character that is not ASCII"
            raise ValueError(f"{key_source}: the API key holds {kind} ({ch!r}) at position {i}, which no HTTP "
                             f"header can carry")
    _check_sendable(model, "--model-name")


def model_ids(answer) -> list[str] | None:
    """The model ids of a GET /models answer (an httpx response); None if it is no OpenAI list."""
    try:
        body = answer.json()
    except ValueError:                 # not JSON (UnicodeDecodeError is one too)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        return None
    return [m["id"] for m in data]


def content_type(answer) -> str:
    """What an HTTP answer's body is, in words: "a body of type text/html"."""
    kind = (answer.headers.get("content-type") or "").split(";")[0].strip()
    return f"a body of type {kind}" if kind else "a body of no Content-Type"


def client_errors() -> tuple:
    """What a request can raise: openai's errors, and the HTTP library's for a connection broken
    mid-stream (older openai clients wrap only those before the response)."""
    import importlib

    import openai

    errors = [openai.APIError, NotAStream]
    for name in ("httpx", "httpx2"):               # openai's HTTP library, by version
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def describe(e, url: str) -> str:
    """A client_errors() error as one line."""
    import openai

    if isinstance(e, NotAStream):
        return (f"the server at {url} answered {e} instead of a stream of chunks: is --url an OpenAI-compatible "
                f"API's base, such as {DEFAULT_URL}?")
    if not isinstance(e, openai.APIError):         # the HTTP library's own
        return f"the connection to the server at {url} broke ({' '.join(str(e).split()) or type(e).__name__})"
    if isinstance(e, openai.APIConnectionError) and not isinstance(e, openai.APITimeoutError):
        cause = e.__cause__ or e.__context__
        if cause is None:
            return f"cannot reach the server at {url}"
        why = " ".join(str(cause).split()) or type(cause).__name__
        if type(cause).__name__ not in ("ConnectError", "ConnectTimeout"):     # mid-answer (newer clients wrap it)
            return f"the connection to the server at {url} broke ({why})"
        return f"cannot reach the server at {url} ({why})"
    if isinstance(e, openai.APITimeoutError):
        return f"the server at {url} did not answer in time"
    body = getattr(e, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    message = " ".join(str(message or getattr(e, "message", "") or type(e).__name__).split())
    if isinstance(e, openai.APIStatusError):
        status = e.status_code
        if status == 401:
            return f"the server at {url} refused the API key (401: {message}); give --api-key or set OPENAI_API_KEY"
        if status == 404:
            code = body.get("code") if isinstance(body, dict) else None
            if code == "model_not_found" or "model" in message.lower():
                return f"{message} (404; {url}/models lists the served models)"
            return f"{url}: {message} (404; is --url the API's base, such as {DEFAULT_URL}?)"
        return f"the server answered {status}: {message}"
    return f"the server failed while answering: {message}"       # an error event in the stream


@dataclass
class Reply:
    text: str = ""
    speculative: dict | None = None      # specdec's server: the answer's RequestStats.to_dict()
    completion_tokens: int | None = None   # usage (--stats)
    ttft: float | None = None            # seconds to the first piece of text, measured here
    elapsed: float = 0.0
    finish_reason: str | None = None
    interrupted: bool = False            # Ctrl-C: the stream was closed before its end


def stream_reply(create, chat: bool) -> Reply:
    """Run create() (a streaming request), write its first choice's text to stdout as it comes
    (reasoning_content to stderr) and return the Reply. Ctrl-C closes the stream: the Reply is
    interrupted. openai errors propagate (the stream closed), and NotAStream where a 200 answer
    held no chunk at all."""
    import openai

    reply, pieces, stream, ended, chunks = Reply(), [], None, False, 0
    start = time.perf_counter()
    try:
        stream = create()
        for chunk in stream:
            chunks += 1
            extra = chunk.model_extra or {}
            if getattr(chunk, "object", None) == "error":    # an error event the client does not raise
                raise openai.APIError(str(extra.get("message") or "an error event"), None, body=extra)  # (older vLLM)
            if extra.get("speculative") is not None:
                reply.speculative = extra["speculative"]
            if chunk.usage is not None:
                reply.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.index != 0:
                    continue
                if chat:
                    delta_extra = choice.delta.model_extra or {}
                    thought = delta_extra.get("reasoning_content") or delta_extra.get("reasoning")
                    if thought:
                        sys.stderr.write(thought)
                        sys.stderr.flush()
                    piece = choice.delta.content
                else:
                    piece = choice.text
                if piece:
                    if reply.ttft is None:
                        reply.ttft = time.perf_counter() - start
                    pieces.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                if choice.finish_reason:
                    reply.finish_reason = choice.finish_reason
        if not chunks:                   # a web page, a JSON body: no server answers a stream with nothing
            answer = getattr(stream, "response", None)
            kind = content_type(answer) if answer is not None else "nothing"
            raise NotAStream("an empty event stream" if kind == "a body of type text/event-stream" else kind)
        ended = True
    except KeyboardInterrupt:
        reply.interrupted = ended = True
    finally:
        reply.elapsed = time.perf_counter() - start
        reply.text = "".join(pieces)
        if stream is not None:
            stream.close()               # the server sees the client leave and aborts the request
        if ended or pieces:              # the answer's line ends (before an error's line too)
            sys.stdout.write("\n")
            sys.stdout.flush()
    return reply


def summary(reply: Reply) -> str | None:
    """specdec's server: the answer's line as the local chat prints it (less the speedup, which
    needs plain decoding's rate on the server's machine); None for other servers."""
    s = reply.speculative
    if not isinstance(s, dict) or "output_tokens" not in s:
        return None
    n = s.get("output_tokens", 0)
    t = s.get("wall_time_s", 0.0) - s.get("prefill_time_s", 0.0)        # the decoding phase, as chat.decode_rate
    line = f"[{n} tokens, {n / t if t > 0 else 0.0:.1f} tok/s"
    if not s.get("draft_tokens"):
        return line + ", no drafts]"
    return line + (f", acceptance {s.get('acceptance_rate', 0.0):.2f}, "
                   f"mean accepted length {s.get('mean_accepted_length', 0.0):.2f}]")


def report(reply: Reply, stats: bool) -> None:
    """The lines after an answer, on stderr."""
    if reply.interrupted:
        print("(interrupted: the answer was not kept)", file=sys.stderr)
        return
    line = summary(reply)
    if line:
        print(line, file=sys.stderr)
    if stats and reply.ttft is not None and reply.elapsed > 0:
        tokens = reply.completion_tokens
        if tokens is None and reply.speculative:
            tokens = reply.speculative.get("output_tokens")
        print(f"TTFT: {reply.ttft * 1000:.2f} ms", file=sys.stderr)
        if tokens is not None:
            print(f"TPS:  {tokens / reply.elapsed:.2f} tokens/s ({tokens} tokens in {reply.elapsed:.2f}s)",
                  file=sys.stderr)


def _fail(command: str, message: str) -> int:
    print(f"specdec {command}: error: {message}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- specdec chat --url

class RemoteChat:
    """A conversation with a served model: ask() streams an answer and keeps both turns (not an
    interrupted or failed one)."""

    def __init__(self, client, model: str, system: str | None, fields: dict):
        self.client, self.model, self.system, self.fields = client, model, system, fields
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.messages = []

    def ask(self, user: str) -> Reply:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages = head + self.messages + [{"role": "user", "content": user}]
        reply = stream_reply(lambda: self.client.chat.completions.create(
            model=self.model, messages=messages, stream=True, **self.fields), chat=True)
        if not reply.interrupted:
            self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply.text}]
        return reply


def run_chat(args) -> int:
    """`specdec chat --url ...` (chat.run hands over when a client flag is given)."""
    from .chat import LineReader, command

    fields = request_fields(args)                          # bad flags: exit 2 before connecting
    try:
        client, model, url = connect(args)
    except ClientError as e:
        return _fail("chat", str(e))
    session = RemoteChat(client, model, args.system, fields)
    if args.quick is not None:
        return _quick("chat", session.ask, args.quick, url, args.stats)
    reader, failed = LineReader(), False
    print(f"specdec chat: {model} at {url}. /reset forgets the conversation, /exit quits, /help for more.",
          file=sys.stderr)
    while True:
        message = reader.message()
        if message is None:
            return 1 if failed else 0
        text, block = message
        if not block:
            text = text.strip()
            if text.startswith("//"):
                text = text[1:]
            elif text.startswith("/"):
                if not command(session, text):
                    return 1 if failed else 0
                continue
        if not text.strip():
            continue
        if why := not_unicode(text):
            failed = True
            print(f"error: {why} (the message was not sent)", file=sys.stderr)
            continue
        try:
            reply = session.ask(text)
        except client_errors() as e:           # the session goes on; this turn is not kept
            failed = True
            print(f"error: {describe(e, url)} (the message was not added)", file=sys.stderr)
            continue
        report(reply, args.stats)


# ---------------------------------------------------------------- specdec complete

def add_parser(sub) -> None:
    from .cli import add_sampling_args

    p = sub.add_parser("complete", help="complete prompts on a running OpenAI-compatible server (vLLM's "
                                        "`vllm complete`), streaming",
                       description="Complete prompts on a running OpenAI-compatible server (/v1/completions), "
                                   "streaming: -q PROMPT once, else each prompt read (a line, or a \"\"\" block).",
                       allow_abbrev=False)
    p.add_argument("--config", metavar="FILE",
                   help="vLLM's: a YAML file of flags, e.g. `url: http://host:8000/v1`, `max-tokens: 64`; flags "
                        "on the command line win over it")
    add_client_args(p, local=False)
    p.add_argument("-q", "--quick", metavar="PROMPT", help="complete this prompt, print the completion, exit")
    add_sampling_args(p, None)


def with_config(args):
    """--config FILE: the words parsed again with the file's flags before the command line's (as
    specdec's main reads them for chat). specdec's main leaves complete's words as they are."""
    from .cli import _subparser, build_parser, expand_argv

    sub = _subparser(build_parser("complete"), "complete")
    words = expand_argv(list(args.words[1:]), sub)
    new = sub.parse_args(words)
    new.cmd, new.words, new.command_line = args.cmd, [args.words[0], *words], getattr(args, "command_line", None)
    return new


def run(args) -> int:
    from .chat import LineReader

    if args.config is not None and getattr(args, "words", None) is not None:
        try:
            args = with_config(args)
        except ValueError as e:
            print(f"specdec complete: error: {e}", file=sys.stderr)
            return 2
    fields = request_fields(args)
    try:
        client, model, url = connect(args)
    except ClientError as e:
        return _fail("complete", str(e))

    def complete(prompt: str) -> Reply:
        return stream_reply(lambda: client.completions.create(model=model, prompt=prompt, stream=True, **fields),
                            chat=False)

    if args.quick is not None:
        return _quick("complete", complete, args.quick, url, args.stats)
    reader, failed = LineReader(), False
    print(f"specdec complete: {model} at {url}. Each line is a prompt; /exit quits, /help for more.",
          file=sys.stderr)
    while True:
        message = reader.message()
        if message is None:
            return 1 if failed else 0
        text, block = message
        if not block and text.strip() in EXIT_COMMANDS:
            return 1 if failed else 0
        if not block and text.strip() in ("/help", "/?"):
            print(COMPLETE_HELP, file=sys.stderr)
            continue
        if not text.strip():
            continue
        if why := not_unicode(text):
            failed = True
            print(f"error: {why} (the prompt was not sent)", file=sys.stderr)
            continue
        try:
            reply = complete(text)
        except client_errors() as e:
            failed = True
            print(f"error: {describe(e, url)}", file=sys.stderr)
            continue
        report(reply, args.stats)


def _quick(command: str, ask, text: str, url: str, stats: bool) -> int:
    """-q / --quick: one message or prompt, its answer, the exit status (130: interrupted)."""
    try:
        reply = ask(text)
    except client_errors() as e:
        return _fail(command, describe(e, url))
    report(reply, stats)
    return 130 if reply.interrupted else 0
