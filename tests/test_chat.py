"""Chat: LLM.chat, `specdec generate --chat`, the `specdec chat` REPL, and the default model."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import sys
import time

import pytest
import torch

from specdec import LLM, SamplingParams, defaults
from specdec.cli import main

CONV = [{"role": "user", "content": "def add(a, b):"}]
# prompt lookup with explicit sizes (vLLM's "[ngram]" would use 5 and 5, too long to match here)
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
NGRAM = ["--speculative-config", json.dumps(NGRAM_SPEC)]


@pytest.fixture(scope="module")
def chat_llm(gguf_files):
    return LLM(str(gguf_files["llama_q"]), speculative_config=NGRAM_SPEC)


def test_llm_chat_renders_the_template_as_transformers(chat_llm, gguf_files):
    from transformers import AutoTokenizer

    path = gguf_files["llama_q"]
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = chat_llm.chat(CONV, params)
    assert len(out) == 1
    assert out[0].prompt == hf.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    direct = chat_llm.generate({"prompt_token_ids": out[0].prompt_token_ids}, params)[0]
    assert out[0].outputs[0].token_ids == direct.outputs[0].token_ids
    # a list of conversations: one output each, in order; OpenAI-style text parts are accepted
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    two = chat_llm.chat([CONV, [{"role": "user", "content": "class Point:"}], parts], params)
    assert [o.outputs[0].token_ids for o in (two[0], two[2])] == [out[0].outputs[0].token_ids] * 2
    assert two[1].prompt != two[0].prompt
    with pytest.raises(ValueError, match="messages"):
        chat_llm.chat([], params)


def test_generate_chat_compare(gguf_files, capsys):
    code = main(["generate", "--model", str(gguf_files["llama_q"]), *NGRAM, "--chat", "def add(a, b):",
                 "--max-tokens", "12", "--ignore-eos", "--json", "--compare"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and len(result["token_ids"]) == 12
    assert result["compare"]["identical"] is True


def test_chat_repl_through_stdin(gguf_files, chat_llm, capsys, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    say = lambda conv: chat_llm.chat(conv, params)[0].outputs[0].text  # noqa: E731
    u1, u2, u3 = "def add(a, b):", "and again", "class Point:"
    a1 = say([{"role": "user", "content": u1}])
    a2 = say([{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}])
    a3 = say([{"role": "user", "content": u3}])                      # after /reset: a new conversation
    script = f"{u1}\n{u2}\n/reset\n\n{u3}\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "6", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0
    summaries = [line for line in err.splitlines() if line.startswith("[")]
    assert len(summaries) == 3 and "(conversation cleared)" in err
    # answers under SPEEDUP_MIN_TOKENS get no speedup estimate (a few tokens' timing is noise)
    assert all("6 tokens" in s and "acceptance" in s and "speedup" not in s for s in summaries)
    assert out == f"{a1}\n{a2}\n{a3}\n"


def test_chat_session_keeps_the_conversation(chat_llm):
    from specdec.chat import Answer, ChatSession

    session = ChatSession(chat_llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), system=None,
                          compare=True)
    first = list(session.ask("def add(a, b):"))[-1]
    assert isinstance(first, Answer) and first.identical is True and first.plain_rate > 0
    second_prompt = session.prompt_ids("and again")
    assert chat_llm.tokenizer.decode(second_prompt).count("def add(a, b):") == 1    # the history is in it
    assert len(session.messages) == 2 and session.messages[1]["content"] == first.text
    assert "outputs identical" in session.summary(first)
    session.reset()
    assert session.messages == []


def test_chat_compare_decodes_plain_over_the_same_kv_cache_dtype(tiny_pair):
    from specdec.chat import ChatSession

    target, draft = tiny_pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=2, kv_cache_dtype="int8")
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), compare=True)
    assert session.plain.kv.dtype == llm.engine.kv.dtype == torch.int8


def test_default_without_the_package_is_the_bundled_pair(monkeypatch):


    monkeypatch.setattr(defaults, "smollm2_gguf", lambda: None)
    target, spec, draft = defaults.default_model()
    assert target == str(defaults.BUNDLED_TARGET) and spec is None and draft == str(defaults.BUNDLED_DRAFT)


def test_smollm2_is_the_default_with_suffix_decoding(smollm2):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM()
    assert llm.model_path == str(smollm2) and llm.spec.method == "suffix"
    assert llm.spec.model == str(defaults.MODELS_DIR / "smollm2-suffix")     # the bundled datastore
    out = llm.chat(question, params)[0]
    assert out.stats.accepted_tokens > 0
    plain = LLM(model=str(smollm2))                       # a model without speculative arguments: plain
    assert plain.engine.proposer is None
    assert plain.chat(question, params)[0].outputs[0].token_ids == out.outputs[0].token_ids
    exact = LLM(model=str(smollm2), quantization="none")  # weights dequantized, fp32 activations
    assert "Paris" in exact.chat(question, params)[0].outputs[0].text


def test_served_gguf_chat(chat_llm):
    """The OpenAI server on a GGUF: chat completions come out as LLM.chat's."""
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    params = SamplingParams(temperature=0, max_tokens=8)
    expected = chat_llm.chat(CONV, params)[0].outputs[0].text
    with LiveServer(build_app(chat_llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.model_extra["speculative"]["draft_tokens"] > 0


def test_generate_chat_and_the_repl_take_a_chat_template(gguf_files, chat_llm, capsys, monkeypatch, tmp_path):
    """--chat-template (a file or the template itself, as serve's) replaces the tokenizer's."""
    template = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = chat_llm.chat(CONV, params, chat_template=template)[0]
    assert expected.outputs[0].token_ids != chat_llm.chat(CONV, params)[0].outputs[0].token_ids
    for value in (template, str(path)):
        code = main(["generate", "--model", str(gguf_files["llama_q"]), *NGRAM, "--chat", CONV[0]["content"],
                     "--chat-template", value, "--max-tokens", "8", "--ignore-eos", "--json"])
        assert code == 0 and json.loads(capsys.readouterr().out)["token_ids"] == expected.outputs[0].token_ids
    monkeypatch.setattr("sys.stdin", io.StringIO(CONV[0]["content"] + "\n/exit\n"))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "8", "--ignore-eos",
                 "--chat-template", str(path)])
    assert code == 0 and capsys.readouterr().out == expected.outputs[0].text + "\n"
    assert main(["generate", "--model", str(gguf_files["llama_q"]), "--chat", "hi", "--chat-template", "missing.jinja"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_chat_repl_goes_on_after_a_message_too_long(gguf_files, capsys, monkeypatch):
    """A message that overflows the context is an error line; the session goes on."""
    monkeypatch.setattr("sys.stdin", io.StringIO("x " * 200 + "\ndef add(a, b):\n/exit\n"))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), "--max-model-len", "64", "--max-tokens", "4",
                 "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 1 and "prompt is too long" in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1 and out.endswith("\n")


def answers_of(llm, convs, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [llm.chat(conv, params)[0].outputs[0].text for conv in convs]


def test_chat_speedup_estimate_is_against_a_reference_measured_once(chat_llm):
    """The "speedup ~Nx" after an answer: its rate over plain decoding's, measured once at start-up
    as the median of 3 runs of 64 tokens (it was one 32-token run on the first question, and swung
    0.5x-2.3x), printed for answers of at least SPEEDUP_MIN_TOKENS tokens."""
    from specdec.chat import SPEEDUP_MIN_TOKENS, ChatSession

    session = ChatSession(chat_llm, SamplingParams(temperature=0, max_tokens=SPEEDUP_MIN_TOKENS, ignore_eos=True))
    asked, add = [], session.plain.add_request
    session.plain.add_request = lambda ids, params, **kw: asked.append(params.max_tokens) or add(ids, params, **kw)
    rate = session.measure_reference()
    assert rate == session.reference_rate > 0
    assert asked == [4, 64, 64, 64]                        # a warm-up, then the three probes
    long = list(session.ask("def add(a, b):"))[-1]
    assert f"{SPEEDUP_MIN_TOKENS} tokens" in session.summary(long) and "speedup ~" in session.summary(long)
    session.params = SamplingParams(temperature=0, max_tokens=SPEEDUP_MIN_TOKENS - 1, ignore_eos=True)
    short = list(session.ask("class Point:"))[-1]
    assert "speedup" not in session.summary(short)
    assert len(asked) == 4                                 # never measured again


@pytest.mark.parametrize("flags,message", [
    (["--regex", "("], "regex is invalid"),
    (["--json-schema", '{"type": "nope"}'], "json is invalid"),
    (["--logit-bias", '{"999999": 5}'], "logit_bias token id 999999"),
    (["--compare"], "--compare needs a speculative method"),      # plain: it skipped the comparison silently
])
def test_chat_checks_its_flags_against_the_model_before_the_first_message(flags, message, capsys, monkeypatch):
    """Flags the engine refuses once the model is known: one line and exit 2 at start-up, as
    `generate` (every message failed with advice to /reset, and a script ended with status 0)."""
    from specdec.defaults import BUNDLED_TARGET

    stdin = io.StringIO("def add(a, b):\nclass Point:\n")
    monkeypatch.setattr("sys.stdin", stdin)
    code = main(["chat", "--model", str(BUNDLED_TARGET), *flags, "--max-tokens", "3"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err and "specdec chat:" not in err
    assert stdin.tell() == 0                               # before the first prompt


def test_chat_system_may_be_empty(chat_llm):
    """--system "": an empty system message (it replaces a template's default persona), as LLM.chat's."""
    from specdec.chat import ChatSession

    user = {"role": "user", "content": "def add(a, b):"}
    empty = chat_llm.chat_prompt([{"role": "system", "content": ""}, user])["prompt_token_ids"]
    assert empty != chat_llm.chat_prompt([user])["prompt_token_ids"]
    session = ChatSession(chat_llm, SamplingParams(temperature=0, max_tokens=2), system="")
    assert session.prompt_ids(user["content"]) == empty


def test_chat_commands_and_slash_messages(gguf_files, chat_llm, capsys, monkeypatch):
    """A line starting with "/" is a command: unknown ones are named and not sent (they went to the
    model); /help and /?, /clear (= /reset), /bye (= /exit); "//text" sends "/text"."""
    [expected] = answers_of(chat_llm, [[{"role": "user", "content": "/def add(a, b):"}]], 6)
    script = "/x\n/help\n/?\n//def add(a, b):\n/clear\n/bye\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "6", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0 and out == expected + "\n"
    assert "unknown command '/x' (commands: /help, /reset, /exit" in err
    assert err.count("commands:\n") == 2 and "(conversation cleared)" in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1


def test_chat_multi_line_messages_from_a_script(gguf_files, chat_llm, capsys, monkeypatch):
    """A line \"\"\" starts a message of several lines, kept as typed, up to a line \"\"\" (ollama's); a
    line ending in a backslash goes on on the next line (llama-cli's). Each was a message of its own."""
    m1, m2 = "def add(a, b):\n    return a + b", "class Point:\n/x"
    [a1] = answers_of(chat_llm, [[{"role": "user", "content": m1}]], 6)
    conv2 = [{"role": "user", "content": m1}, {"role": "assistant", "content": a1}, {"role": "user", "content": m2}]
    [a2] = answers_of(chat_llm, [conv2], 6)
    script = '"""\ndef add(a, b):\n    return a + b\n"""\nclass Point:\\\n/x\n/exit\n'
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "6", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0 and out == f"{a1}\n{a2}\n" and "unknown command" not in err


def test_ctrl_c_while_answering_stops_the_answer_and_the_chat_goes_on(gguf_files, chat_llm, capsys, monkeypatch):
    """Ctrl-C (a real SIGINT) while an answer streams: the answer stops between engine steps, the
    request is aborted (its KV blocks freed), the turn is not kept, and the next message is answered
    as in a fresh conversation (it ended the chat, exit 130)."""
    import specdec.chat as chat

    llms = []
    load = chat.llm_from_args

    def loaded(args, **kw):
        llm = load(args, **kw)
        steps, step = [], llm.engine.step

        def step_then_ctrl_c():              # the signal arrives while a step is under way
            events = step()
            steps.append(1)
            if len(steps) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return events

        llm.engine.step = step_then_ctrl_c
        llms.append(llm)
        return llm

    monkeypatch.setattr(chat, "llm_from_args", loaded)
    full, expected = answers_of(chat_llm, [[{"role": "user", "content": "def add(a, b):"}],
                                           [{"role": "user", "content": "class Point:"}]], 40)
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\nclass Point:\n/exit\n"))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "40", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "(interrupted: the answer was not added to the conversation)" in err
    assert out.endswith("\n" + expected + "\n")                          # turn 1 left no trace
    partial = out[:-len(expected) - 2]
    assert full.startswith(partial) and len(partial) < len(full)       # the first answer was cut short
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1 and "[40 tokens" in err
    engine = llms[0].engine
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was only around the answer


class Terminal:
    """A child process on a pseudo-terminal (its controlling terminal, as a shell runs it)."""

    def __init__(self, argv: list[str]):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:                                           # the child
            os.environ["OMP_NUM_THREADS"] = "1"
            os.execv(sys.executable, [sys.executable, *argv])
        self.seen = ""

    def send(self, data: str) -> None:
        data = data.encode()
        while data:                   # the child echoes as it reads: drain its output while writing
            r, w, _ = select.select([self.fd], [self.fd], [], 10)
            if r:
                self._read()
            if w:
                data = data[os.write(self.fd, data[:512]):]

    def _read(self) -> None:
        try:
            self.seen += os.read(self.fd, 65536).decode(errors="replace")
        except OSError:                                             # the child has gone
            raise EOFError from None

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                self.seen = self.seen[m.end():]
                return m
            if time.monotonic() > end:
                raise AssertionError(f"{pattern!r} not seen in {self.seen[-2000:]!r}")
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    self._read()
                except EOFError:
                    raise AssertionError(f"{pattern!r} not seen before the end: {self.seen[-2000:]!r}") from None

    def wait(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self._read()
                except EOFError:
                    pass
        self.kill()
        raise AssertionError("the chat did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_chat_in_a_terminal_reads_long_edited_and_multi_line_messages():
    """On a terminal, lines are read by GNU readline: a 6000-character line arrives whole (the tty
    driver's canonical mode cut it at 4095), arrow keys edit it (they arrived as escape codes), and
    \"\"\" blocks are one message. The length that arrives is read back through a template that
    renders two tokens per character of the last message, in a context of 2 tokens."""
    from specdec.defaults import BUNDLED_TARGET

    template = "{% for i in range(messages[-1]['content']|length) %} a a{% endfor %}"
    term = Terminal(["-m", "specdec", "chat", "--model", str(BUNDLED_TARGET), "--max-model-len", "2",
                     "--chat-template", template])
    try:
        term.expect(r"/exit quits")
        term.expect(r"> ")

        def received(keys: str) -> int:
            term.send(keys)
            n = int(term.expect(r"prompt is too long: (\d+) tokens").group(1))
            term.expect(r"> ")
            return n

        one = received("x\r")                                  # a BOS, maybe, and 2 tokens per character
        assert received("x" * 6000 + "\r") == one + 2 * 5999
        assert received("abc\x1b[D\x1b[Dx\r") == one + 2 * 3       # axbc
        assert received('"""\rab\rcd\r"""\r') == one + 2 * 4       # ab\ncd
        assert received("ab\\\rcd\r") == one + 2 * 4
        time.sleep(0.5)           # readline waiting for a key (a signal just before its select() waits for one)
        term.send("\x03")                                       # Ctrl-C at the prompt: quit, as before
        term.expect(r"interrupted")
        assert term.wait() == 130 and "Traceback" not in term.seen
    finally:
        term.kill()


def test_ctrl_c_in_a_terminal_stops_the_answer_not_the_chat():
    """The terminal's Ctrl-C while an answer streams: back at the prompt, the chat goes on."""
    from specdec.defaults import BUNDLED_TARGET

    long = json.dumps({"max_position_embeddings": 1 << 16})         # an answer that outlasts the test
    term = Terminal(["-m", "specdec", "chat", "--model", str(BUNDLED_TARGET), "--hf-overrides", long,
                     "--max-model-len", str(1 << 16), "--max-tokens", str(60000), "--ignore-eos"])
    try:
        term.expect(r"> ")
        term.send("def add(a, b):\r")
        term.expect(r"def add")                                 # the echo
        time.sleep(1.0)
        term.send("\x03")
        term.expect(r"\(interrupted: the answer was not added to the conversation\)")
        term.expect(r"> ")
        term.send("/exit\r")
        assert term.wait() == 0 and "Traceback" not in term.seen
    finally:
        term.kill()
