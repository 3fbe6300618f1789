"""The OpenAI-compatible server, end to end: a real uvicorn on a loopback port, tiny checkpoints,
the official openai client, raw HTTP for bad input, schemathesis over the OpenAPI schema."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from specdec.server.cli import parse_args, server_config

from serve_helpers import wait_listening

MAX_LEN = 128
K = 3
PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os\n", "print(i)",
           "    return a + b", "if __name__ == '__main__':", "self.x = x"]


class LiveServer:
    """uvicorn serving `app` from a thread, on a socket bound before start (no port races)."""

    def __init__(self, app, config: uvicorn.Config | None = None):
        """config: uvicorn's settings for app (TLS, a root path...); default: quiet, plain HTTP."""
        torch.set_num_threads(1)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        config = config or uvicorn.Config(app, log_level="warning")
        scheme = "https" if config.ssl_keyfile else "http"
        self.url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        if exc[0] is None:              # a server that outlives its test is a leak (a client left open?)
            assert not self.thread.is_alive(), "the server did not stop within 30 s"


async def streamed_text(aclient, prompt: str, **kw) -> str:
    """One streamed completion's text, its chunks joined (model "tiny")."""
    text = ""
    async for ch in await aclient.completions.create(model="tiny", prompt=prompt, stream=True, **kw):
        text += "".join(c.text for c in ch.choices)
    return text


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=K, max_model_len=MAX_LEN, max_num_seqs=6)
    app = build_app(llm, ServerConfig(served_model_names=("tiny", "tiny-alias")))
    with LiveServer(app) as live:
        live.app, live.llm = app, llm
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def metrics_text(http) -> str:
    """/metrics without the engine and model_name labels every sample carries (vLLM's: "0" and the
    first served name), so samples read as `specdec:requests_total{outcome="stop"} 3.0`."""
    return re.sub(r'(engine|model_name)="[^"]*",?', "", http.get("/metrics").text).replace("{}", "")


def metric(http, name: str) -> float:
    """One sample of the Prometheus text at /metrics (0 when absent), named without its model_name label."""
    text = metrics_text(http)
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def healthy(http) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def stream_text(client, **kw) -> tuple[list[str], dict | None, list]:
    """Streamed completion -> (text per choice, usage, chunks)."""
    chat = "messages" in kw
    create = client.chat.completions.create if chat else client.completions.create
    chunks = list(create(model="tiny", stream=True, **kw))
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            part = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + part
    usage = next((ch.usage for ch in chunks if ch.usage is not None), None)
    return [texts[i] for i in sorted(texts)], usage, chunks


# --- endpoints ---------------------------------------------------------------------------

def test_health_version_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert models["data"][0]["max_model_len"] == MAX_LEN
    (perm,) = models["data"][0]["permission"]          # vLLM's ModelPermission (it was missing)
    assert perm["object"] == "model_permission" and perm["allow_sampling"] and perm["organization"] == "*"


def test_completion_and_chat(client, http):
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = {n: metric(http, f"specdec:spec_decode_{n}_total") for n in names}
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    spec = r.model_extra["speculative"]
    assert spec["output_tokens"] == 12 and spec["num_drafts"] > 0
    # the request's figures are what the engine counted for it: the server's counters moved by
    # exactly as much (the only request in flight; counted before its last tokens were sent)
    moved = {n: metric(http, f"specdec:spec_decode_{n}_total") - before[n] for n in names}
    assert moved == {"num_drafts": spec["num_drafts"], "num_draft_tokens": spec["draft_tokens"],
                     "num_accepted_tokens": spec["accepted_tokens"]}
    assert spec["draft_tokens"] >= spec["accepted_tokens"]
    c = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.usage.completion_tokens <= 8 and "speculative" in c.model_extra
    # list prompts and token-id prompts: one choice per prompt
    b = client.completions.create(model="tiny", prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=4, temperature=0)
    assert [ch.index for ch in b.choices] == [0, 1]
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_stop_and_logprobs(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and full.startswith(cut.text) and stop not in cut.text
    lp = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - x) < 1e-4 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)


def test_stream_equals_non_stream(client):
    for kw in (dict(prompt=PROMPTS[0], max_tokens=24, temperature=0),
               dict(prompt=PROMPTS[1], max_tokens=24, temperature=0.9, seed=11, n=2),
               dict(messages=[{"role": "user", "content": "hello"}], max_tokens=16, temperature=0)):
        chat = "messages" in kw
        create = client.chat.completions.create if chat else client.completions.create
        whole = create(model="tiny", extra_body={"ignore_eos": True}, **kw)
        expected = [c.message.content if chat else c.text for c in whole.choices]
        texts, usage, chunks = stream_text(client, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}, **kw)
        assert texts == expected
        assert usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].model_extra["speculative"]["output_tokens"] == usage.completion_tokens
        finishing = [c for ch in chunks for c in ch.choices if c.finish_reason]
        assert len(finishing) == len(expected)


def test_continuous_usage_stats_count_each_choice_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
    far (its prompt's tokens, the tokens it has produced), ending at the non-streamed counts."""
    for kw in (dict(prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=12, temperature=0.9, seed=3, n=2),
               dict(messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0)):
        chat = "messages" in kw
        create = client.chat.completions.create if chat else client.completions.create
        whole = create(model="tiny", extra_body={"ignore_eos": True}, **kw)
        chunks = list(create(model="tiny", stream=True, stream_options={"include_usage": True,
                                                                        "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True}, **kw))
        *steps, last = chunks
        assert not last.choices and last.usage.completion_tokens == whole.usage.completion_tokens
        prompt_tokens = ([whole.usage.prompt_tokens] if chat else
                         [client.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens
                          for p in kw["prompt"]])
        seen: dict[int, list[int]] = {}
        for ch in steps:
            (c,) = ch.choices
            u = ch.usage
            assert u.prompt_tokens == prompt_tokens[c.index // kw.get("n", 1)]
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens
            seen.setdefault(c.index, []).append(u.completion_tokens)
        assert len(seen) == len(whole.choices)
        assert all(c == sorted(c) for c in seen.values())                       # never decreasing
        assert sum(c[-1] for c in seen.values()) == whole.usage.completion_tokens
    plain = list(client.completions.create(model="tiny", prompt="x", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_numeric_edges_do_not_fail(client):
    for extra in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 1e308},
                  {"temperature": 1.0, "min_p": 1.0, "top_k": 10**30}, {"seed": -2**63}):
        r = client.completions.create(model="tiny", prompt="def", max_tokens=4, extra_body=extra)
        assert r.usage.completion_tokens >= 1


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(seed=1234, n=2, **kw)
    b = client.completions.create(seed=1234, n=2, **kw)
    one = client.completions.create(seed=1234, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert one.choices[0].text == a.choices[0].text        # choice i samples with seed + i


def test_greedy_matches_specdec_generate(client, tiny_pair, capsys):
    from specdec.cli import main

    target, draft = tiny_pair
    rc = main(["generate", PROMPTS[4], "--model", str(target), "--speculative-model", str(draft),
               "--num-speculative-tokens", str(K), "--max-model-len", str(MAX_LEN), "--max-tokens", "24", "--json"])
    assert rc == 0
    expected = json.loads(capsys.readouterr().out)
    got = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=24, temperature=0).choices[0]
    assert got.text == expected["text"] and got.finish_reason == expected["finish_reason"]


# --- bad input ---------------------------------------------------------------------------

LONG_PROMPT = "x = 1\n" * 200
BAD = [
    ("malformed JSON", b'{"prompt": "x", ', 400, None),
    ("not an object", b'["prompt"]', 400, None),
    ("not an object (string)", b'"hello"', 400, None),
    ("wrong type", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("bool as int", {"prompt": "x", "n": True}, 400, "n"),
    ("prompt missing", {"max_tokens": 3}, 400, "prompt"),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens beyond context", {"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("prompt too long", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("empty prompt", {"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ("empty token list", {"prompt": [[]], "max_tokens": 1}, 400, "prompt"),
    ("token id outside vocab", {"prompt": [1, 99999], "max_tokens": 1}, 400, "prompt"),
    ("NaN temperature", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("Infinity temperature", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("negative temperature", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("too many stop strings", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("n too large", {"prompt": "x", "n": 1000}, 400, "n"),
    ("logprobs too large", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("seed beyond 64 bits", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("penalty out of range", {"prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty"),
]
BAD_CHAT = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("message not an object", {"messages": ["hi"]}, 400, "messages"),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("max_tokens beyond context", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ("top_logprobs above --max-logprobs", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                           "top_logprobs": 21}, 400, "top_logprobs"),
    ("prompt_logprobs above --max-logprobs", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21},
     400, "prompt_logprobs"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("path,case", [("/v1/completions", c) for c in BAD] + [("/v1/chat/completions", c) for c in BAD_CHAT],
                         ids=lambda x: x[0] if isinstance(x, tuple) else x)
def test_bad_input_gets_openai_error_then_server_is_healthy(http, path, case):
    _, body, status, param = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    healthy(http)


def test_more_bad_requests(http):
    assert http.post("/v1/completions", content=b"prompt=x").status_code == 400    # form, not JSON
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/completions").status_code == 405
    big = json.dumps({"prompt": "x" * (1 << 20 + 1)}).encode()
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunked():
        for _ in range(20):
            yield b" " * 100_000
    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    healthy(http)


# --- serving behaviour -------------------------------------------------------------------

def test_concurrent_streams_match_sequential(server, client, http):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    kw = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    sequential = [client.completions.create(model="tiny", prompt=p, **kw).choices[0].text for p in prompts]

    async def all_streams():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def health_while_busy():
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=server.url) as h:
                t0 = time.perf_counter()
                r = await h.get("/health")
                return r.status_code, time.perf_counter() - t0

        results = await asyncio.gather(*(streamed_text(aclient, p, **kw) for p in prompts), health_while_busy())
        await aclient.close()
        return results[:-1], results[-1]

    concurrent, (status, latency) = asyncio.run(all_streams())
    assert concurrent == sequential
    assert status == 200 and latency < 2.0          # the event loop answers while the worker decodes
    assert metric(http, "specdec:num_requests_running") == 0


def test_disconnect_frees_the_slot(server, http, monkeypatch):
    # the tiny model decodes a whole completion in milliseconds; pace its steps so that the
    # clients below really leave mid-generation
    engine = server.llm.engine
    real_step = engine.step

    def paced():
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(engine, "step", paced)
    aborted = metric(http, 'specdec:requests_total{outcome="abort"}')
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_LEN - 20, "n": 4, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # a non-streaming request whose client gives up
    body.update(stream=False, n=8)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while metric(http, 'specdec:requests_total{outcome="abort"}') < aborted + 12 \
            or metric(http, "specdec:num_requests_running") > 0:
        assert time.monotonic() < deadline, http.get("/metrics").text
        time.sleep(0.05)
    assert metric(http, "specdec:kv_cache_usage_perc") == 0       # every block is back in the pool
    healthy(http)


def test_engine_failure_is_an_error_not_a_crash(server, http, monkeypatch):
    engine = server.app.state.service.engine
    real_step, calls = engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:          # a step fails mid-generation: its requests end with an error
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", failing)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    calls.clear()
    lines = [x for x in http.post("/v1/completions", json={**body, "stream": True}).text.splitlines() if x]
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_error" and lines[-1] == "data: [DONE]"
    monkeypatch.setattr(engine, "step", real_step)
    assert metric(http, 'specdec:requests_total{outcome="error"}') == 2
    # two failures with no step decoding between: the worker probes the engine after answering
    # (its probe request holds blocks for a moment); then every block is free again
    deadline = time.monotonic() + 30
    while metric(http, "specdec:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(http, "specdec:kv_cache_usage_perc") == 0
    healthy(http)


def test_metrics(http):
    text = metrics_text(http)
    for name in ("specdec:prompt_tokens_total", "specdec:generation_tokens_total",
                 "specdec:time_to_first_token_seconds_bucket", "specdec:inter_token_latency_seconds_bucket",
                 "specdec:e2e_request_latency_seconds_bucket", "specdec:spec_decode_num_drafts_total",
                 "specdec:spec_decode_num_draft_tokens_total", "specdec:spec_decode_num_accepted_tokens_total",
                 'specdec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 'specdec:requests_total{outcome="length"}', 'specdec:requests_total{outcome="invalid"}'):
        assert name in text, name
    drafts = metric(http, "specdec:spec_decode_num_drafts_total")
    drafted = metric(http, "specdec:spec_decode_num_draft_tokens_total")
    accepted = metric(http, "specdec:spec_decode_num_accepted_tokens_total")
    per_pos = sum(metric(http, f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
                  for i in range(K))
    assert drafts > 0 and drafted <= K * drafts and per_pos == accepted
    assert metric(http, 'specdec:requests_total{outcome="invalid"}') > 0


def test_invocations_picks_the_route_by_the_body(server, http, client):
    """SageMaker's POST /invocations (vLLM's): `messages` is a chat completion, `prompt` a
    completion, each answered (and streamed, and counted) as its own route answers it."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    r = http.post("/invocations", json=chat)
    want = client.chat.completions.create(**chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["content"] == want.choices[0].message.content
    done = metric(http, 'specdec:requests_total{outcome="length"}')
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    r = http.post("/invocations", json=body)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"] == client.completions.create(**body).choices[0].text
    assert metric(http, 'specdec:requests_total{outcome="length"}') == done + 2
    with http.stream("POST", "/invocations", json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == r.json()["choices"][0]["text"]
    # the chosen route's own checks answer a body of its shape that is wrong
    bad = http.post("/invocations", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    invalid = metric(http, 'specdec:requests_total{outcome="invalid"}')
    for junk in ({"input": "x"}, [1, 2], b"{oops"):
        r = http.post("/invocations", **({"content": junk} if isinstance(junk, bytes) else {"json": junk}))
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "Cannot find suitable handler for request. Expected one of: ChatCompletionRequest, CompletionRequest")
    assert metric(http, 'specdec:requests_total{outcome="invalid"}') == invalid + 3     # as the API's 400s
    assert http.get("/invocations").status_code == 405


def test_api_key(tiny_pair):
    # the target drafting for itself: every greedy draft is accepted, which checks the statistics
    llm = LLM(tiny_pair[0], speculative_model=str(tiny_pair[0]), num_speculative_tokens=2, max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("k",), api_key="sekrit"))) as live:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
            r = httpx.post(live.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # the key is checked before the body is even parsed
        assert httpx.post(live.url + "/v1/completions", content=b"{oops").status_code == 401
        assert httpx.post(live.url + "/invocations", json=body).status_code == 401      # as /v1
        assert httpx.get(live.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=live.url + "/v1", api_key="sekrit", max_retries=0)
        r = ok.completions.create(model="k", prompt="def", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        spec = r.model_extra["speculative"]
        assert spec["accepted_tokens"] == spec["draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0
        with httpx.Client(base_url=live.url) as h:
            drafts = metric(h, "specdec:spec_decode_num_drafts_total")
            assert drafts == spec["num_drafts"] and metric(h, "specdec:spec_decode_num_accepted_tokens_total") == \
                spec["accepted_tokens"]
            assert metric(h, 'specdec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == drafts
        assert httpx.post(live.url + "/invocations", json=body, headers={"authorization": "Bearer sekrit"}
                          ).status_code == 200


def test_schemathesis_finds_no_server_errors(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json())
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in ("/pause", "/resume"):      # they change the server's state for every other test
            continue
        # negative data needs something to break: only the POST bodies have it (not a POST whose only
        # input is an id in its path, such as /v1/responses/{id}/cancel)
        has_body = operation.method.upper() == "POST" and len(operation.body) > 0
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_body else [])
        for mode in modes:
            @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=server.url, timeout=30)
                if response.status_code >= 500:
                    failures.append((case.operation.label, case.body, response.status_code, response.text))
            check()
    assert not failures, failures[:3]
    assert httpx.get(server.url + "/health").status_code == 200


# --- command line ------------------------------------------------------------------------

def test_vllm_flags_are_accepted():
    args, ignored = parse_args(["--model", "m", "--use-v2-block-manager", "--cpu-offload-gb", "0",
                                "--tensor-parallel-size", "1", "--enforce-eager", "--swap-space=4",
                                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}',
                                "--dtype", "half", "--port", "9001", "--served-model-name", "a", "b"])
    assert ignored == ["--use-v2-block-manager", "--cpu-offload-gb 0", "--swap-space=4"]
    assert args.enforce_eager       # vLLM's: no CUDA graphs (specdec captures them only when asked)
    assert args.tensor_parallel_size == 1          # a flag of specdec's own now (README: Scale-out)
    assert args.model == "m" and args.port == 9001 and args.host == "127.0.0.1" and args.dtype == "float16"
    assert args.speculative_config["num_speculative_tokens"] == 3 and args.served_model_name == ["a", "b"]


def test_the_model_may_come_first_as_in_vllm_serve(tmp_path, capsys):
    """`vllm serve MODEL [options]`: the first word names the model (vLLM flags still ignored)."""
    args, ignored = parse_args(["m", "--cpu-offload-gb", "0", "--port", "9001"])
    assert args.model == "m" and args.port == 9001 and ignored == ["--cpu-offload-gb 0"]
    assert parse_args(["m", "--model", "m"])[0].model == "m"
    with pytest.raises(ValueError, match="the model is named twice: 'm' and --model 'n'"):
        parse_args(["m", "--model", "n"])
    from specdec.cli import main

    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2      # loaded as --model: one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: model folder ")
    assert f"{str(tmp_path / 'missing')!r} does not exist" in err


def test_bad_model_fails_fast(tiny_pair, tmp_path, capsys):
    from specdec.cli import main

    target, draft = tiny_pair
    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"specdec: error: model folder {str(tmp_path / 'missing')!r} does not exist" in err
    # a draft whose vocabulary disagrees with the target's
    bad = tmp_path / "draft"
    shutil.copytree(draft, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["serve", "--model", str(target), "--speculative-model", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specdec: error: {bad}: the draft's vocabulary differs from the "
                                               f"target's at token id 40"), err


def test_sigterm_finishes_in_flight_requests(tiny_pair, tmp_path):
    target, draft = tiny_pair
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    log = tmp_path / "server.log"
    proc = subprocess.Popen(      # --port 0: the port the server holds from the start, read from its log
        [sys.executable, "-m", "specdec.entrypoints.openai.api_server", "--model", str(target),
         "--speculative-model", str(draft), "--num-speculative-tokens", "3", "--port", "0",
         "--served-model-name", "t", "--use-v2-block-manager", "--cpu-offload-gb", "0"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        url = wait_listening(proc, log, timeout=120)
        body = {"prompt": PROMPTS[0], "max_tokens": 120, "n": 4, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        lines, started = [], threading.Event()

        def read_stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in filter(None, r.iter_lines()):
                    started.set()
                    lines.append(line)

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)                  # mid-stream
        time.sleep(0.5)
        if reader.is_alive():                             # still draining: new connections are refused
            with pytest.raises(httpx.TransportError):
                httpx.get(url + "/health", timeout=2)
        reader.join(60)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and events[-1]["usage"]["completion_tokens"] == 4 * 120
        # uvicorn drains, then re-raises the signal so the exit status says what ended it
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        stderr = log.read_text()
        assert "ignoring vLLM flag (specdec does not use it): --use-v2-block-manager" in stderr
        assert "--cpu-offload-gb 0" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_several_api_keys_any_of_them_opens_the_api(tiny_pair):
    """vLLM's --api-key k1 k2 (a key rotated without downtime): either key works, a third does not."""
    llm = LLM(tiny_pair[0], num_speculative_tokens=0, max_model_len=64)
    args, _ = parse_args([str(tiny_pair[0]), "--api-key", "old-key", "new-key"])
    config = server_config(args)
    assert config.api_key == ("old-key", "new-key")
    with LiveServer(build_app(llm, config)) as live:
        for key, status in (("old-key", 200), ("new-key", 200), ("other", 401), ("old-keynew-key", 401)):
            r = httpx.get(live.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == status, key
    args, _ = parse_args([str(tiny_pair[0]), "--api-key", "only"])
    assert server_config(args).api_key == "only"


def test_an_overlong_request_id_header_is_not_taken(tiny_pair):
    """X-Request-Id names the response and each of its stream chunks: past 512 bytes the server
    makes its own id instead (a 1 MB id made a 500-token stream 176 MB); probes are not refused;
    a normal one still names the response."""
    llm = LLM(tiny_pair[0], num_speculative_tokens=0, max_model_len=64)
    config = ServerConfig(served_model_names=("k",), enable_request_id_headers=True)
    with LiveServer(build_app(llm, config)) as live:
        body = {"prompt": "x", "max_tokens": 2}
        long = {"x-request-id": "r" * 513}
        r = httpx.post(live.url + "/v1/completions", json=body, headers=long)
        assert r.status_code == 200 and len(r.json()["id"]) < 100 and r.headers["x-request-id"] != "r" * 513
        assert httpx.get(live.url + "/health", headers=long).status_code == 200
        r = httpx.post(live.url + "/v1/completions", json=body, headers={"x-request-id": "r" * 512})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-" + "r" * 512


def test_an_unexpected_error_still_carries_the_request_id(tiny_pair, monkeypatch):
    """With --enable-request-id-headers every response carries X-Request-Id, the 500 of an
    unexpected exception too (Starlette answers it outside the middleware that adds the header:
    the one response a user most needs to find in the logs came without it)."""
    llm = LLM(tiny_pair[0], num_speculative_tokens=0, max_model_len=64)
    config = ServerConfig(served_model_names=("k",), enable_request_id_headers=True)

    def broken(*a, **kw):
        raise TypeError("planted")
    from specdec.server.responses import ChatFormat
    monkeypatch.setattr(ChatFormat, "choice", broken)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with LiveServer(build_app(llm, config)) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"x-request-id": "find-me"}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: TypeError"
        assert r.headers["x-request-id"] == "find-me"
    config = ServerConfig(served_model_names=("k",))
    with LiveServer(build_app(llm, config)) as live:       # without the flag, no response has it
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 500 and "x-request-id" not in r.headers


def test_a_model_after_the_api_key_is_not_taken_as_a_second_key(tiny_pair):
    """--api-key takes several keys, so `--api-key KEY MODEL` would serve the default model with
    MODEL as a key: a key that is a path is refused in one line."""
    with pytest.raises(ValueError, match="--api-key took .* as a second key, and it is a path"):
        parse_args(["--api-key", "k1", str(tiny_pair[0])])
    args, _ = parse_args([str(tiny_pair[0]), "--api-key", "k1", "k2"])
    assert args.model == str(tiny_pair[0]) and args.api_key == ["k1", "k2"]


def test_frontend_flags_and_keep_alive_as_vllm(monkeypatch):
    """vLLM's --ssl-ciphers reaches uvicorn, --enable-offline-docs / --shutdown-timeout are taken
    (the server refused to start: unrecognized arguments), and VLLM_HTTP_TIMEOUT_KEEP_ALIVE sets
    how long an idle keep-alive connection stays open (it stayed uvicorn's 5 s)."""
    from specdec.server.cli import uvicorn_config

    args, ignored = parse_args(["--model", "m", "--ssl-ciphers", "ECDHE+AESGCM", "--enable-offline-docs",
                                "--shutdown-timeout", "30"])
    assert args.ssl_ciphers == "ECDHE+AESGCM" and ignored == ["--enable-offline-docs", "--shutdown-timeout 30"]
    config = ServerConfig(served_model_names=("toy",))
    assert uvicorn_config(None, config).timeout_keep_alive == 5
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "60")
    assert uvicorn_config(None, config).timeout_keep_alive == 60
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "soon")
    with pytest.raises(ValueError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        uvicorn_config(None, config)
