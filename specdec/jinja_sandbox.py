"""Chat templates in Jinja's immutable sandbox, and a child process that renders the templates
requests bring (vLLM's --trust-request-chat-template) under a memory and a time limit.

Jinja's sandbox keeps a template from reaching Python's internals but not from using the
machine: `{{ 'a' | center(10**10) }}` asks for 10 GB in 31 bytes, and two nested loops run for
hours. A model's own template is trusted and renders in the process; a request's runs in a child
with an address-space limit (RLIMIT_AS) and a deadline, killed and restarted when it passes
either, so that the server itself neither grows nor waits. This file imports nothing of specdec
(the child runs it as a script, without the package and its torch).
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a chat template may make: its rendered text, and any one string or list its `*` builds
# (characters or items); the exponent of an integer power.
MAX_RENDERED_CHARS = 1 << 24
MAX_POWER_EXPONENT = 1 << 16
# A request's template (rendered in the child): its address space, its time, the text it may write
# (twice the default request body: the server then tokenizes that text, ~200 bytes a character
# at its peak), and how many requests may wait for the child beside the one it renders.
TEMPLATE_MEMORY_BYTES = 1 << 30
TEMPLATE_SECONDS = 10.0
REQUEST_TEMPLATE_CHARS = 1 << 21
TEMPLATE_WAITERS = 1
# Compiled templates kept by their source, least recently used out first: compiling Llama 3.1's
# takes ~15 ms, rendering it ~0.05 ms. At most this many, and this much source in all (the
# child's cache lives under its memory limit: a few tens of bytes compiled per character).
CACHED_TEMPLATES = 32
CACHED_TEMPLATE_CHARS = 1 << 20


def bounded(chunks, limit: int | None = None) -> str:
    """The rendered chunks joined, refused once they pass `limit` characters (MAX_RENDERED_CHARS;
    a loop that writes without end stops there, before it holds the memory)."""
    limit = MAX_RENDERED_CHARS if limit is None else limit
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise jinja2.TemplateError(f"the rendered prompt passes {limit} characters")
        out.append(chunk)
    return "".join(out)


class ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, whose `range` is capped but whose `*` and `**` are not: a
    repeated string or list larger than MAX_RENDERED_CHARS, and an integer power of an exponent
    over MAX_POWER_EXPONENT, are refused before they are computed (a model's template is trusted
    beyond that; a request's runs in the child's limits too)."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                        len(seq) * times > MAX_RENDERED_CHARS:
                    raise jinja2.sandbox.SecurityError(f"a repetition larger than {MAX_RENDERED_CHARS} is not allowed")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(right) > MAX_POWER_EXPONENT and abs(left) > 1:
            raise jinja2.sandbox.SecurityError(f"an exponent over {MAX_POWER_EXPONENT} is not allowed")
        return super().call_binop(context, operator, left, right)


# the GenerationTracker of the render running in this thread (None: no spans asked for)
TRACKER: contextvars.ContextVar[GenerationTracker | None] = contextvars.ContextVar("generation_tracker", default=None)


class GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %} ... {% endgeneration %}` (its AssistantTracker: the span of
    an assistant's reply, for return_assistant_tokens_mask; TRL's assistant-only-loss templates):
    rendered as its body, unchanged. While a render's GenerationTracker is set (TRACKER: one
    compiled template serves every render), each block's (start, end) goes to it, as
    transformers records it: start is what the template had yielded when the block ran, end
    start plus the block's length (a block inside a filter, macro or `{% set %}` is counted from
    where that began, and the filter's output is not measured)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller):
        text = caller()
        if (tracker := TRACKER.get()) is not None:
            tracker.spans.append((tracker.written, tracker.written + len(text)))
        return text


class GenerationTracker:
    """The characters a template has yielded so far, and its `{% generation %}` blocks' spans."""

    def __init__(self, spans: list):
        self.spans, self.written = spans, 0

    def count(self, chunks):
        for chunk in chunks:
            self.written += len(chunk)
            yield chunk


def environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers renders chat templates: trimmed blocks, loop controls,
    raise_exception, strftime_now, a tojson that keeps non-ASCII text; bounded as ChatSandbox."""
    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock])

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson
    return env


def render(template: str, context: dict, limit: int | None = None, spans: list | None = None) -> str:
    """The template's text for `context` (raises what the template raises); spans, when a list:
    filled with each `{% generation %}` block's (start, end), as GenerationBlock records them
    (outside the text, which is the same with or without them)."""
    tracker = None if spans is None else GenerationTracker(spans)
    chunks = compiled(template).generate(**context)
    token = TRACKER.set(tracker)
    try:
        return bounded(chunks if tracker is None else tracker.count(chunks), limit)
    finally:
        TRACKER.reset(token)


@functools.lru_cache(maxsize=8)
def literal_text(template: str) -> str:
    """The template's literal strings (its text outside tags, its string constants), joined by NULs
    so that no search matches across two (transformers 5's _get_template_literal_text)."""
    ast = environment().parse(template)
    literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


_compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
_compiled_lock = threading.Lock()


def compiled(template: str) -> jinja2.Template:
    """The template compiled in `environment()`, from the cache of recent ones (CACHED_TEMPLATES;
    a compiled template holds no state of a render: the limits are the environment's and
    `bounded`'s, applied as each render runs)."""
    with _compiled_lock:
        if (hit := _compiled.get(template)) is not None:
            _compiled.move_to_end(template)
            return hit
    out = environment().from_string(template)       # outside the lock: compiling takes milliseconds
    if len(template) <= CACHED_TEMPLATE_CHARS:
        with _compiled_lock:
            _compiled[template] = out
            _compiled.move_to_end(template)
            chars = sum(map(len, _compiled))
            while len(_compiled) > CACHED_TEMPLATES or chars > CACHED_TEMPLATE_CHARS:
                chars -= len(_compiled.popitem(last=False)[0])
    return out


def failure(e: BaseException) -> str:
    """A template's error as one line: Jinja's own message, else the exception's name and text."""
    if isinstance(e, jinja2.TemplateError):
        return str(e)
    if isinstance(e, MemoryError):
        return f"the template needed more than {TEMPLATE_MEMORY_BYTES >> 20} MiB"
    return f"{type(e).__name__}: {e}"


class TemplateProcessError(Exception):
    """A request's template failed in the child (its message is the one line to answer with)."""


class TemplateProcessBusy(TemplateProcessError):
    """The child renders another request's template and one more waits for it: refused at once,
    so that requests' templates never hold the threads every other request is prepared on."""


class IsolatedRenderer:
    """The child process that renders requests' templates, one at a time (a lock; TEMPLATE_WAITERS
    more may wait, later ones are refused at once: TemplateProcessBusy): JSON lines in and out over
    its pipes. A render that passes TEMPLATE_SECONDS, or a child that dies (its memory limit
    reached outside Python's reach), kills it; the next render starts a new one. The child ends
    itself when this process is gone, and past its own deadline."""

    def __init__(self, memory_bytes: int = TEMPLATE_MEMORY_BYTES, seconds: float | None = None):
        self.memory_bytes, self.seconds = memory_bytes, seconds
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._seats = threading.Semaphore(1 + TEMPLATE_WAITERS)

    def render(self, template: str, context: dict, limit: int | None = None, spans: list | None = None) -> str:
        """As `render`, in the child."""
        if not self._seats.acquire(blocking=False):
            raise TemplateProcessBusy("the server renders one request's chat template at a time and another "
                                      "waits: try again")
        try:
            return self._render(template, context, REQUEST_TEMPLATE_CHARS if limit is None else limit, spans)
        finally:
            self._seats.release()

    def _render(self, template: str, context: dict, limit: int, spans: list | None) -> str:
        seconds = TEMPLATE_SECONDS if self.seconds is None else self.seconds
        job = {"template": template, "context": context, "limit": limit, "seconds": seconds, "spans": spans is not None}
        line = (json.dumps(job) + "\n").encode()
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                answer = self._read_line(proc, time.monotonic() + seconds)
            except TimeoutError:
                self._kill()
                raise TemplateProcessError(f"the template ran longer than {seconds:g} s") from None
            except (BrokenPipeError, EOFError, OSError):
                self._kill()
                raise TemplateProcessError(f"the template's process ended (its limits: {self.memory_bytes >> 20} MiB, "
                                           f"{seconds:g} s)") from None
        out = json.loads(answer)
        if "error" in out:
            raise TemplateProcessError(out["error"])
        if spans is not None:
            spans.extend(map(tuple, out["spans"]))
        return out["text"]

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _child(self) -> subprocess.Popen:
        # -P: this file's folder (the package's modules) is not put on the child's path; the rest
        # of the parent's environment is, so that jinja2 is found where the parent found it
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(self.memory_bytes)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes:
        fd, buf = proc.stdout.fileno(), bytearray()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)


_shared: IsolatedRenderer | None = None
_shared_lock = threading.Lock()


def isolated_renderer() -> IsolatedRenderer:
    """The process's one child for requests' templates (started at its first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import atexit

            _shared = IsolatedRenderer()
            atexit.register(_shared.close)
        return _shared


def _serve(memory_bytes: int) -> None:
    """The child: under the memory limit, render each request line and answer one line (ASCII
    JSON: any string, a lone surrogate too, travels). It ends when its parent does (a watchdog
    thread: a render does not notice its pipe closing), and a render past twice its deadline ends
    it (SIGALRM), should the parent not be there to."""
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    for line in stdin:
        try:
            job = json.loads(line)
            signal.alarm(int(2 * job.get("seconds", TEMPLATE_SECONDS)) + 1)
            spans = [] if job.get("spans") else None
            out = {"text": render(job["template"], job["context"], job.get("limit"), spans), "spans": spans}
        except BaseException as e:          # noqa: BLE001 - every failure is the template's answer
            out = {"error": failure(e)}
        finally:
            signal.alarm(0)
        stdout.write((json.dumps(out) + "\n").encode())
        stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
