"""vLLM's client CLIs: `specdec chat --url` and `specdec complete`, against a live specdec server
(the bundled toy target with its draft, an API key) and a small fake OpenAI server (another
server's chunks, an error mid-stream, a slow stream for Ctrl-C)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from test_server import LiveServer

from specdec.cli import main
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app

MODELS = Path(__file__).resolve().parents[1] / "models"
KEY = "sekrit"
STATS = re.compile(r"^\[(\d+) tokens, [\d.]+ tok/s, acceptance ([\d.]+), mean accepted length ([\d.]+)\]$")
GREEDY = ["--temperature", "0", "--max-tokens", "10", "--ignore-eos"]


@pytest.fixture(scope="module")
def server():
    llm = LLM(str(MODELS / "target"), speculative_model=str(MODELS / "draft"), num_speculative_tokens=3,
              max_model_len=256, max_num_seqs=2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), api_key=KEY))) as live:
        live.api = live.url + "/v1"
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0, timeout=60)


def chat_ref(client, messages: list[dict]):
    r = client.chat.completions.create(model="toy", messages=messages, temperature=0, max_tokens=10,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content, r.model_extra["speculative"]


def complete_ref(client, prompt: str):
    r = client.completions.create(model="toy", prompt=prompt, temperature=0, max_tokens=10,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text, r.model_extra["speculative"]


def stats_lines(err: str) -> list[re.Match]:
    return [m for line in err.splitlines() if (m := STATS.match(line))]


def test_chat_quick_equals_the_openai_client(server, client, capsys):
    system, user = "Be brief.", "def add(a, b):"
    text, spec = chat_ref(client, [{"role": "system", "content": system}, {"role": "user", "content": user}])
    code = main(["chat", "--url", server.api, "--api-key", KEY, "--model-name", "toy", "--system-prompt", system,
                 "-q", user, *GREEDY])
    out, err = capsys.readouterr()
    assert code == 0 and out == text + "\n"
    (m,) = stats_lines(err)                     # the speculative field of the stream's last chunk
    assert m.group(1) == "10" and spec["draft_tokens"] > 0
    assert (m.group(2), m.group(3)) == (f"{spec['acceptance_rate']:.2f}", f"{spec['mean_accepted_length']:.2f}")
    assert "Traceback" not in err


def test_complete_quick_first_model_and_env_key(server, client, capsys, monkeypatch):
    text, spec = complete_ref(client, "class Point:")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)   # vLLM's default key; the model: the first one listed
    code = main(["complete", "--url", server.api, "--quick", "class Point:", *GREEDY, "--stats"])
    out, err = capsys.readouterr()
    assert code == 0 and out == text + "\n"
    (m,) = stats_lines(err)
    assert m.group(2) == f"{spec['acceptance_rate']:.2f}"
    assert re.search(r"^TTFT: [\d.]+ ms$", err, re.MULTILINE) and re.search(r"^TPS: +[\d.]+ tokens/s \(10 tokens in", err, re.MULTILINE)


def test_chat_piped_multi_turn(server, client, capsys, monkeypatch):
    u1, u2, u3 = "def add(a, b):", "and again", "line one\nline two"
    a1, _ = chat_ref(client, [{"role": "user", "content": u1}])
    a2, _ = chat_ref(client, [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                              {"role": "user", "content": u2}])
    a3, _ = chat_ref(client, [{"role": "user", "content": u3}])       # after /reset: a new conversation
    script = f'{u1}\n{u2}\n/nope\n/reset\n\n"""\n{u3}\n"""\n/exit\nnever read\n'
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--url", server.api, "--api-key", KEY, *GREEDY])
    out, err = capsys.readouterr()
    assert code == 0 and out == f"{a1}\n{a2}\n{a3}\n"
    assert len(stats_lines(err)) == 3 and "(conversation cleared)" in err and "unknown command '/nope'" in err
    assert "specdec chat: toy at " + server.api in err


def test_complete_piped_prompts(server, client, capsys, monkeypatch):
    prompts = ["def add(a, b):", "import os\nimport sys"]
    refs = [complete_ref(client, p)[0] for p in prompts]
    monkeypatch.setattr("sys.stdin", io.StringIO(f'{prompts[0]}\n\n"""\n{prompts[1]}\n"""\n/exit\nnever read\n'))
    code = main(["complete", "--url", server.api, "--api-key", KEY, *GREEDY])
    out, err = capsys.readouterr()
    assert code == 0 and out == "".join(r + "\n" for r in refs) and len(stats_lines(err)) == 2


def one_error_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def test_errors(server, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    sock.close()                                # nothing listens there
    assert main(["chat", "--url", dead, "-q", "hi"]) == 1
    assert "cannot reach the server at " + dead in one_error_line(capsys.readouterr().err, "specdec chat: error:")
    assert main(["complete", "--url", server.api, "--api-key", "wrong", "-q", "hi"]) == 1
    line = one_error_line(capsys.readouterr().err, "specdec complete: error:")
    assert "refused the API key (401" in line and "--api-key" in line
    assert main(["chat", "--url", server.api, "--api-key", KEY, "--model-name", "nope", "-q", "hi"]) == 1
    assert "`nope` does not exist" in one_error_line(capsys.readouterr().err, "specdec chat: error:")
    assert main(["complete", "--url", server.url, "--api-key", KEY, "-q", "hi"]) == 1     # not the API's base
    assert "is --url the API's base" in one_error_line(capsys.readouterr().err, "specdec complete: error:")
    # in the loop: the message, and the loop goes on (the status says something failed)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nagain\n"))
    assert main(["chat", "--url", server.api, "--api-key", KEY, "--model-name", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("does not exist") == 2 and "Traceback" not in err
    # flags of a local model with --url: one line, status 2, before any connection
    for flags in (["--compare"], ["--speculative-config", '{"method": "ngram"}'], ["--model", "x"], ["--dtype", "auto"],
                  ["--chat-template", "x"]):
        assert main(["chat", "--url", dead, *flags, "-q", "hi"]) == 2
        assert flags[0] in one_error_line(capsys.readouterr().err, "specdec: error:")
    # without --url, -q is still --quantization (checked before a model loads)
    assert main(["chat", "-q", "bogus"]) == 2
    assert "--quantization/-q: invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------- another server (no speculative field)

def fake_app(seen: list) -> FastAPI:
    """/v1/chat/completions: "boom" fails after one piece, "slow" streams for a minute, anything
    else answers `ok <number of messages>`; seen records each request's messages and 'left' when
    a client closes a stream early."""
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "other", "object": "model", "created": 0, "owned_by": "x"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append([m["content"] for m in body["messages"]])
        last = body["messages"][-1]["content"]

        def chunk(text, finish=None):
            return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "other",
                                          "choices": [{"index": 0, "delta": {"content": text},
                                                       "finish_reason": finish}]}) + "\n\n"

        async def events():
            done = False
            try:
                if last == "boom":
                    yield chunk("partial")
                    yield "data: " + json.dumps({"error": {"message": "the engine died", "code": 500}}) + "\n\n"
                elif last == "cut":           # the connection drops mid-answer
                    yield chunk("partial")
                    raise RuntimeError("the server went away")
                elif last == "slow":
                    for _ in range(600):
                        yield chunk("tick ")
                        await asyncio.sleep(0.1)
                else:
                    yield chunk("ok ")
                    yield chunk(str(len(body["messages"])), "stop")
                yield "data: [DONE]\n\n"
                done = True
            finally:                  # cancelled or closed: the client went away
                if not done:
                    seen.append("left")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake():
    seen = []
    with LiveServer(fake_app(seen)) as live:
        live.api, live.seen = live.url + "/v1", seen
        yield live


def test_other_server_and_an_error_mid_stream(fake, capsys, monkeypatch):
    assert main(["chat", "--url", fake.api, "-q", "boom"]) == 1
    out, err = capsys.readouterr()
    assert out == "partial\n"
    assert "the engine died" in one_error_line(err, "specdec chat: error: the server failed while answering")
    assert main(["chat", "--url", fake.api, "-q", "cut"]) == 1
    out, err = capsys.readouterr()
    assert out == "partial\n" and "connection to the server at" in one_error_line(err, "specdec chat: error:")
    # the loop: the failed turn is not kept; another server's answers come without a statistics line
    fake.seen.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("one\nboom\ntwo\n"))
    assert main(["chat", "--url", fake.api, "--system", "sys"]) == 1
    out, err = capsys.readouterr()
    assert out == "ok 2\npartial\nok 4\n" and not stats_lines(err) and "Traceback" not in err
    assert fake.seen == [["sys", "one"], ["sys", "one", "ok 2", "boom"], ["sys", "one", "ok 2", "two"]]


def test_ctrl_c_stops_the_answer_and_the_loop_goes_on(fake):
    """A real process: SIGINT while "slow" streams closes that stream (the server sees the client
    leave), the next message is answered; the end of the input ends the chat."""
    fake.seen.clear()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "chat", "--url", fake.api], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(b"first\nslow\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"ok 1\n"
        assert proc.stdout.read(5) == b"tick "           # the slow answer is streaming
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while "left" not in fake.seen:
            assert time.monotonic() < deadline, "the stream was not closed"
            time.sleep(0.05)
        rest, err = proc.communicate(b"last\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert rest.decode().endswith("\nok 3\n") and "(interrupted" in err.decode() and b"Traceback" not in err
    assert fake.seen[-1] == ["first", "ok 1", "last"]                # the interrupted turn was not kept
