"""`specdec chat --url` / `specdec complete` (client_cli.py) against what a --url can really point at:
a web page or another JSON API instead of an OpenAI one, and flags no request can carry (a URL
without its scheme, an API key read with a carriage return, a model name that is not Unicode),
beside a live specdec server on the bundled toy target."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route
from test_server import LiveServer

from specdec.cli import main
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app

MODELS = Path(__file__).resolve().parents[1] / "models"
KEY = "sekrit"


def one_error_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def other_app(kind: str) -> Starlette:
    """Every path, GET or POST, answers 200: a web UI's page (html) or another API's JSON (json)."""
    def page(request):
        if kind == "html":
            return HTMLResponse("<!doctype html><html><body>a web app</body></html>")
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/{path:path}", page, methods=["GET", "POST"])])


@pytest.fixture(scope="module")
def web():
    with LiveServer(other_app("html")) as html, LiveServer(other_app("json")) as other:
        yield html.url + "/v1", other.url + "/v1"


@pytest.fixture(scope="module")
def server():
    llm = LLM(str(MODELS / "target"), max_model_len=256, max_num_seqs=1)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), api_key=KEY))) as live:
        yield live.url + "/v1"


def test_a_url_that_is_no_openai_api(web, capsys, monkeypatch):
    """GET /models answered by a web page was a traceback (the client's parser: AttributeError),
    by other JSON status 2 ("Expecting value"); a page answering the POST was an empty answer and
    status 0. Now each is one line naming what came, status 1."""
    html, other = web
    assert main(["complete", "--url", html, "-q", "hi"]) == 1
    line = one_error_line(capsys.readouterr().err, "specdec complete: error:")
    assert "no OpenAI model list (a body of type text/html)" in line and "is --url" in line
    assert main(["chat", "--url", other, "-q", "hi"]) == 1
    assert "no OpenAI model list" in one_error_line(capsys.readouterr().err, "specdec chat: error:")
    for url, kind in ((html, "text/html"), (other, "application/json")):
        for cmd in ("chat", "complete"):
            assert main([cmd, "--url", url, "--model-name", "x", "-q", "hi"]) == 1
            out, err = capsys.readouterr()
            assert out == ""                                  # no empty "answer"
            line = one_error_line(err, f"specdec {cmd}: error:")
            assert f"answered a body of type {kind} instead of a stream of chunks" in line
    # in the loop: each message fails alone, the status says so
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert main(["chat", "--url", html, "--model-name", "x"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("instead of a stream of chunks") == 2 and "Traceback" not in err


def test_no_traceback_in_a_real_process(web):
    html, _ = web
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "specdec", "complete", "--url", html], input=b"hi\n",
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout == b""
    err = proc.stderr.decode()
    assert "Traceback" not in err
    one_error_line(err, "specdec complete: error: the server at " + html + " answered GET /models")


def test_flags_no_request_can_carry(server, capsys, monkeypatch):
    """Named before connecting, status 2 (as the sampling flags): a --url without http:// was "the
    connection ... broke"; a key with a carriage return (read from a CRLF file) was an error line
    quoting the whole key; a --model-name of bytes that are not UTF-8 named no flag."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    bare = server.removeprefix("http://")                      # 127.0.0.1:PORT/v1
    assert main(["complete", "--url", bare, "--api-key", KEY, "-q", "hi"]) == 2
    assert f"--url {bare!r} is not an http:// or https:// URL" in one_error_line(capsys.readouterr().err,
                                                                                 "specdec: error:")
    monkeypatch.setenv("OPENAI_API_KEY", KEY + "\r")
    assert main(["chat", "--url", server, "-q", "hi"]) == 2
    line = one_error_line(capsys.readouterr().err, "specdec: error:")
    assert "$OPENAI_API_KEY" in line and "('\\r') at position 6" in line and KEY not in line
    assert main(["complete", "--url", server, "--api-key", "clé", "-q", "hi"]) == 2
    line = one_error_line(capsys.readouterr().err, "specdec: error:")
    assert line.startswith("specdec: error: --api-key:") and "not ASCII" in line
    assert main(["complete", "--url", server, "--api-key", KEY, "--model-name", "toy\udcff", "-q", "hi"]) == 2
    line = one_error_line(capsys.readouterr().err, "specdec: error:")
    assert "--model-name" in line and "not valid Unicode" in line
    # the same server, with what it can carry: answered
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main(["complete", "--url", server, "-q", "hi", "--max-tokens", "3", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "[3 tokens, " in err
