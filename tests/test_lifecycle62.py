"""Server lifecycle (fix62): a second Ctrl-C while the server drains exits at once, without the
tracebacks of every task asyncio cancelled on its way out (uvicorn's force exit, vLLM's serve_http);
an empty Predicted Output counts zero accepted and rejected prediction tokens, as OpenAI's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
from serve_helpers import wait_listening
from test_server import LiveServer

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

ROOT = Path(__file__).resolve().parent.parent


def test_a_second_sigint_while_draining_exits_at_once_without_a_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", str(BUNDLED_TARGET), "--port", "0"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        url = wait_listening(proc, log)
        body = {"prompt": "def f(x):", "max_tokens": 1000, "n": 2, "ignore_eos": True, "stream": True}
        lines, started, drained = [], threading.Event(), threading.Event()
        signalled, at_signal = threading.Event(), [0]

        def read_stream():
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for line in filter(None, r.iter_lines()):
                        lines.append(line)
                        started.set()
                        if signalled.is_set() and len(lines) > at_signal[0] + 2:
                            drained.set()            # chunks still come after the first signal
            except httpx.TransportError:             # the forced exit drops the connection
                pass

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(30)
        at_signal[0] = len(lines)
        signalled.set()
        proc.send_signal(signal.SIGINT)              # drains: the stream goes on
        assert drained.wait(30) and proc.poll() is None
        proc.send_signal(signal.SIGINT)              # forced exit
        rc = proc.wait(timeout=30)
        reader.join(30)
        assert lines[-1] != "data: [DONE]"           # the request was in flight when it was dropped
        assert json.loads(lines[-1][6:])["choices"]  # (and the last chunk arrived whole)
        text = log.read_text()
        assert rc == 130, text[-3000:]
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
        assert "Forced exit" in text and "Application shutdown complete." in text   # the engine thread stopped
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as s:                   # nothing listens there any more
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_empty_prediction_counts_zero_prediction_tokens():
    llm = LLM(str(BUNDLED_TARGET), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    config = ServerConfig(served_model_names=("m",), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with LiveServer(build_app(llm, config)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        ask = dict(model="m", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8, temperature=0)
        assert client.chat.completions.create(**ask).usage.completion_tokens_details is None   # no prediction
        for content in ("", []):
            prediction = {"type": "content", "content": content}
            details = client.chat.completions.create(**ask, prediction=prediction, n=2).usage.completion_tokens_details
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
            chunks = list(client.chat.completions.create(**ask, prediction=prediction, stream=True,
                                                         stream_options={"include_usage": True}))
            details = chunks[-1].usage.completion_tokens_details
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
