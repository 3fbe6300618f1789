"""Small points where the server answers as vLLM's does, end to end (a real uvicorn on a loopback
port, real HTTP clients): the response `model` is the served name the request used; X-Request-Id
(--enable-request-id-headers) names the response, its id and its log lines; /ping and /load
(--enable-server-load-tracking); requests_total counts each request to the API once (5xx as
error, an engine's refusal once as invalid; unknown paths, wrong methods and 401s not at all);
every specdec: series carries vLLM's model_name and engine labels."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from specdec.server.cli import parse_args, server_config
from test_server import LiveServer, metric

NAMES = ("alias-a", "alias-b")


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(tiny_pair[0], speculative_model=str(tiny_pair[1]), num_speculative_tokens=2, max_model_len=128)


@pytest.fixture(scope="module")
def server(llm):
    config = ServerConfig(served_model_names=NAMES, enable_request_id_headers=True, enable_server_load_tracking=True,
                          enable_log_requests=True)
    app = build_app(llm, config)
    with LiveServer(app) as live:
        live.app = app
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def requests_total(http) -> dict[str, float]:
    return {o: metric(http, f'specdec:requests_total{{outcome="{o}"}}')
            for o in ("stop", "length", "abort", "error", "invalid")}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


# --- D6: the response `model` ------------------------------------------------------------------

def test_response_model_is_the_served_name_the_request_used(http):
    body = {"prompt": "def", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in NAMES:
        assert http.post("/v1/completions", json={**body, "model": name}).json()["model"] == name
        assert http.post("/v1/chat/completions", json={**chat, "model": name}).json()["model"] == name
        chunks = sse(http.post("/v1/chat/completions", json={**chat, "model": name, "stream": True}))
        assert chunks and {c["model"] for c in chunks} == {name}
        chunks = sse(http.post("/v1/completions", json={**body, "model": name, "stream": True}))
        assert chunks and {c["model"] for c in chunks} == {name}
        r = http.post("/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == name
        r = http.post("/v1/completions", json={**body, "model": name, "use_beam_search": True, "n": 2})
        assert r.status_code == 200 and r.json()["model"] == name
    # no model given: the first name (vLLM's base_model_paths[0])
    assert http.post("/v1/completions", json=body).json()["model"] == NAMES[0]
    assert http.post("/v1/completions", json={**body, "model": "other"}).status_code == 404


# --- D7: X-Request-Id ----------------------------------------------------------------------------

def test_request_id_header_names_the_response_its_id_and_its_log_lines(http, caplog):
    body = {"prompt": "def", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="specdec.server"):
        r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-123"})
        assert r.headers["x-request-id"] == "trace-123" and r.json()["id"] == "cmpl-trace-123"
        r = http.post("/v1/completions", json={**body, "n": 2}, headers={"X-Request-Id": "trace-n"})
        assert r.json()["id"] == "cmpl-trace-n"
    assert any(m.startswith("Received request cmpl-trace-123:") for m in caplog.messages), caplog.messages
    assert any(m.startswith("Finished request cmpl-trace-123:") for m in caplog.messages)
    assert {m.split(":")[0] for m in caplog.messages if m.startswith("Received request cmpl-trace-n")} == \
        {"Received request cmpl-trace-n-0", "Received request cmpl-trace-n-1"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"})
    assert r.headers["x-request-id"] == "abc" and r.json()["id"] == "chatcmpl-abc"
    r = http.post("/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Request-Id": "abc"})
    assert r.headers["x-request-id"] == "abc" and {c["id"] for c in sse(r)} == {"chatcmpl-abc"}
    # none sent: one is made, and the response's id is made from the same one
    r = http.post("/v1/completions", json=body)
    made = r.headers["x-request-id"]
    assert len(made) == 32 and r.json()["id"] == f"cmpl-{made}"
    # every answer carries it, errors and other routes too
    assert http.get("/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    assert http.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "e"}).headers["x-request-id"] == "e"


def test_without_the_flag_no_request_id_header(llm):
    config = ServerConfig(served_model_names=("tiny",))
    with LiveServer(build_app(llm, config)) as live:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "def", "max_tokens": 2},
                       headers={"X-Request-Id": "trace-9"})
        assert r.status_code == 200 and "x-request-id" not in r.headers
        assert r.json()["id"] == "cmpl-trace-9"         # vLLM's _base_request_id reads it all the same


def test_the_flags_are_taken_not_ignored(capsys):
    args, ignored = parse_args(["--enable-request-id-headers", "--enable-server-load-tracking"], "x")
    config = server_config(args)
    assert not ignored and config.enable_request_id_headers and config.enable_server_load_tracking
    config = server_config(parse_args([], "x")[0])
    assert not config.enable_request_id_headers and not config.enable_server_load_tracking


# --- D8: /ping and /load -------------------------------------------------------------------------

def test_ping_answers_as_health(http):
    for method in ("GET", "POST"):
        r = http.request(method, "/ping")
        assert r.status_code == 200 and r.json() == http.get("/health").json()


def test_load_counts_the_requests_in_flight(server, http, monkeypatch):
    assert http.get("/load").json() == {"server_load": 0}
    engine = server.app.state.service.engine
    real_step = engine.step

    def paced():                # the streams below last a second or more
        time.sleep(0.03)
        return real_step()
    monkeypatch.setattr(engine, "step", paced)
    body = {"prompt": "def", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()          # kept: a dropped iterator closes the stream (the client leaves)
        next(lines)
        assert http.get("/load").json() == {"server_load": 1}
        done = threading.Thread(target=lambda: httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True}))
        done.start()
        deadline = time.monotonic() + 10
        while http.get("/load").json()["server_load"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in lines:
            pass
        done.join()
    # the last bytes reach the client a moment before the server is done with the request
    deadline = time.monotonic() + 10
    while http.get("/load").json() != {"server_load": 0}:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_load_stays_0_without_the_flag(llm, monkeypatch):
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        real_step = llm.engine.step

        def paced():
            time.sleep(0.02)
            return real_step()
        monkeypatch.setattr(llm.engine, "step", paced)
        body = {"prompt": "def", "max_tokens": 30, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=live.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            assert httpx.get(live.url + "/load").json() == {"server_load": 0}     # vLLM's answer too
            assert sum(1 for _ in lines) > 1


# --- D4, D5, D9: requests_total ------------------------------------------------------------------

def test_only_requests_to_the_api_count_as_invalid(http):
    before = requests_total(http)
    for path in ("/favicon.ico", "/.env", "/v1/nothing", "/wp-login.php"):
        assert http.get(path).status_code == 404
    assert http.get("/v1/completions").status_code == 405
    assert http.post("/health").status_code == 405
    assert requests_total(http) == before
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.post("/v1/completions", content=b"x" * (2 << 20)).status_code == 413
    assert http.post("/tokenize", json={}).status_code == 400
    assert delta(before, requests_total(http)) == {"invalid": 4}


def test_401_is_not_an_invalid_request(llm):
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), api_key="k"))) as live:
        with httpx.Client(base_url=live.url, timeout=60) as h:
            before = requests_total(h)
            assert h.post("/v1/completions", json={"prompt": "x"}).status_code == 401
            assert h.get("/v1/models").status_code == 401
            assert requests_total(h) == before


def test_a_5xx_answer_counts_as_an_error(llm):
    app = build_app(llm, ServerConfig(served_model_names=("tiny",)))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as h:
        before = requests_total(h)
        app.state.service.worker.stop()          # as during shutdown: no new work is taken
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        # a stream's status went out first: its error is an event, and counts all the same
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                 "stream": True})
        assert r.status_code == 200 and sse(r)[-1]["error"]["type"] == "service_unavailable"
        assert h.get("/health").status_code == 503        # a probe, not a request to the API
        assert delta(before, requests_total(h)) == {"error": 2}


def test_a_request_the_engine_refuses_counts_once_as_invalid(tiny_pair, tmp_path):
    """An adapter evicted from the CPU cache whose folder is then removed: the engine's
    add_request raises ValueError on the worker; the answer is 400, counted once (as invalid)."""
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from specdec.server.lora import LoRAModulePath

    folders = {n: make_adapter(tiny_pair[0], tmp_path / n, seed) for n, seed in (("A", 1), ("B", 2))}
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64, enable_lora=True, max_loras=1,
              max_cpu_loras=1)
    config = ServerConfig(served_model_names=("tiny",),
                          lora_modules=tuple(LoRAModulePath(n, str(f)) for n, f in folders.items()))
    with LiveServer(build_app(llm, config)) as live, httpx.Client(base_url=live.url, timeout=60) as h:
        for name in ("A", "B"):         # B evicts A from the CPU cache
            assert h.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}).status_code == 200
        shutil.rmtree(folders["A"])
        before = requests_total(h)
        r = h.post("/v1/completions", json={"model": "A", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert delta(before, requests_total(h)) == {"invalid": 1}
        assert h.post("/v1/completions", json={"model": "B", "prompt": "x", "max_tokens": 2}).status_code == 200


# --- D10: the model_name label -------------------------------------------------------------------

def test_every_series_carries_the_model_name_label(http):
    assert http.post("/v1/completions", json={"prompt": "def", "max_tokens": 8, "temperature": 0}).status_code == 200
    text = http.get("/metrics").text
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith("specdec:")]
    assert {"specdec:requests", "specdec:spec_decode_num_accepted_tokens_per_pos", "specdec:num_requests_running",
            "specdec:time_to_first_token_seconds", "specdec:prefix_cache_hits"} <= {f.name for f in families}
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("model_name") == NAMES[0] for s in samples), \
        [s for s in samples if s.labels.get("model_name") != NAMES[0]][:3]
    # a vLLM dashboard's selector (vLLM's label pair: model_name and engine)
    assert f'specdec:requests_total{{engine="0",model_name="{NAMES[0]}",outcome="stop"}}' in text


# -- vLLM's /v1/chat/completions/batch -------------------------------------------------------------

CONVERSATIONS = [[{"role": "user", "content": "Say one word."}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}],
                 [{"role": "user", "content": "Hello"}]]


def test_batch_chat_answers_each_conversation_as_its_own_chat(http):
    """One choice per conversation, index i, each the same reply (text, tokens, finish reason) as
    that conversation alone on /v1/chat/completions; usage is the sum of theirs."""
    common = {"model": NAMES[0], "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    alone = [http.post("/v1/chat/completions", json={**common, "messages": m}).json() for m in CONVERSATIONS]
    r = http.post("/v1/chat/completions/batch", json={**common, "messages": CONVERSATIONS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == NAMES[0]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, one in zip(body["choices"], alone):
        assert choice["message"] == one["choices"][0]["message"]
        assert choice["token_ids"] == one["choices"][0]["token_ids"]
        assert choice["finish_reason"] == one["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(one["usage"][key] for one in alone)
    assert body["speculative"]["output_tokens"] == body["usage"]["completion_tokens"]
    assert body["speculative"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_batch_chat_through_the_openai_client(server):
    """The official client's generic post (vLLM's docs call the route the same way)."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    body = client.post("/chat/completions/batch", cast_to=object,
                       body={"model": NAMES[1], "messages": CONVERSATIONS[:2], "max_completion_tokens": 4,
                             "temperature": 0})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] for c in body["choices"])


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"), ({"n": 2}, "n"),
                                          ({"use_beam_search": True}, "use_beam_search"),
                                          ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                                          ({"messages": []}, "messages"), ({"messages": [[]]}, "messages"),
                                          ({"messages": [{"role": "user", "content": "hi"}]}, "messages")])
def test_batch_chat_refuses_what_vllm_does_not_batch(http, extra, param):
    r = http.post("/v1/chat/completions/batch", json={"model": NAMES[0], "messages": CONVERSATIONS, "max_tokens": 2,
                                                      **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err.get("param") or "") + err["message"]


def test_batch_chat_a_bad_conversation_fails_the_request_and_leaves_nothing_running(server, http):
    """One conversation too long for the context: a 400 naming it, and no other conversation left
    running on the engine."""
    long = [{"role": "user", "content": "word " * 400}]
    r = http.post("/v1/chat/completions/batch", json={"model": NAMES[0], "messages": [CONVERSATIONS[0], long],
                                                      "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("messages[1]") and err["message"].startswith("conversation 1: ")
    deadline = time.time() + 10
    while server.app.state.service.engine.num_running and time.time() < deadline:
        time.sleep(0.05)
    assert server.app.state.service.engine.num_running == 0


# -- vLLM's return_token_ids -----------------------------------------------------------------------

def test_return_token_ids_on_completions_streamed_and_not(http):
    """Each choice's generated ids and its prompt's ids beside the text (vLLM's fields); streamed,
    each chunk carries its new ids (they add up to the whole) and the prompt's come first."""
    req = {"model": NAMES[0], "prompt": ["The cat", "A dog ran"], "max_tokens": 8, "temperature": 0,
           "return_token_ids": True, "logprobs": 0}
    body = http.post("/v1/completions", json=req).json()
    prompts = [http.post("/tokenize", json={"model": NAMES[0], "prompt": p}).json()["tokens"] for p in req["prompt"]]
    for choice, prompt in zip(body["choices"], prompts):
        assert choice["prompt_token_ids"] == prompt
        assert len(choice["token_ids"]) == len(choice["logprobs"]["tokens"]) == body["usage"]["completion_tokens"] // 2
        assert http.post("/detokenize", json={"model": NAMES[0], "tokens": choice["token_ids"]}).json()["prompt"] == \
            choice["text"]
    chunks = sse(http.post("/v1/completions", json={**req, "stream": True}))
    for choice in body["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    plain = http.post("/v1/completions", json={**req, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_token_ids_on_chat_streamed_and_not(http):
    req = {"model": NAMES[0], "messages": CONVERSATIONS[1], "max_tokens": 8, "temperature": 0,
           "return_token_ids": True}
    body = http.post("/v1/chat/completions", json=req).json()
    prompt = http.post("/tokenize", json={"model": NAMES[0], "messages": CONVERSATIONS[1]}).json()["tokens"]
    assert body["prompt_token_ids"] == prompt
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert http.post("/detokenize", json={"model": NAMES[0], "tokens": choice["token_ids"]}).json()["prompt"] == \
        choice["message"]["content"]
    chunks = sse(http.post("/v1/chat/completions", json={**req, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_return_token_ids_streamed_chat_with_n_names_the_prompt_for_each_choice(http):
    """vLLM's: each choice's first chunk (its role) carries prompt_token_ids."""
    req = {"model": NAMES[0], "messages": CONVERSATIONS[0], "max_tokens": 4, "n": 2, "temperature": 1, "seed": 3,
           "return_token_ids": True, "stream": True}
    chunks = sse(http.post("/v1/chat/completions", json=req))
    openings = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(c["choices"][0]["index"] for c in openings) == [0, 1]
    assert all(c["prompt_token_ids"] == openings[0]["prompt_token_ids"] != [] for c in openings)
    assert all("prompt_token_ids" not in c for c in chunks if c not in openings)


def test_return_token_ids_with_beam_search(http):
    """The beams carry their ids as sampled choices do (vLLM's beam search answers too)."""
    base = {"model": NAMES[0], "max_tokens": 5, "n": 2, "use_beam_search": True, "return_token_ids": True}
    body = http.post("/v1/completions", json={**base, "prompt": "The cat"}).json()
    prompt = http.post("/tokenize", json={"model": NAMES[0], "prompt": "The cat"}).json()["tokens"]
    for c in body["choices"]:
        assert c["prompt_token_ids"] == prompt and c["token_ids"]
        assert http.post("/detokenize", json={"model": NAMES[0], "tokens": c["token_ids"]}).json()["prompt"] == c["text"]
    chat = http.post("/v1/chat/completions", json={**base, "messages": CONVERSATIONS[0]}).json()
    assert chat["prompt_token_ids"] == http.post("/tokenize", json={"model": NAMES[0], "messages": CONVERSATIONS[0]}
                                                 ).json()["tokens"]
    assert all(c["token_ids"] for c in chat["choices"])


def test_the_role_chunk_comes_with_the_first_output_as_vllms(tiny_pair, monkeypatch):
    """vLLM's chat stream sends its role chunk with the first output, after the prompt's prefill:
    benchmark clients (vLLM's `bench serve --backend openai-chat`) time TTFT at the first chunk
    with choices. While the engine makes no step, nothing is streamed."""
    import threading

    llm = LLM(tiny_pair[0], num_speculative_tokens=0, max_model_len=128)
    gate = threading.Event()
    step = llm.engine.step

    def gated():
        gate.wait(60)
        return step()

    monkeypatch.setattr(llm.engine, "step", gated)
    got: list[tuple[float, str]] = []
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live:
        def read():
            with httpx.Client(timeout=60) as c, c.stream("POST", live.url + "/v1/chat/completions", json={
                    "model": "m", "messages": CONVERSATIONS[0], "max_tokens": 3, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got.append((time.monotonic(), line))
        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 30
        while not llm.engine.has_unfinished() and time.monotonic() < deadline:      # the request is queued
            time.sleep(0.01)
        time.sleep(0.3)
        assert got == []                        # no role chunk before any output
        released = time.monotonic()
        gate.set()
        reader.join(60)
    first = json.loads(got[0][1][6:])
    assert got[0][0] >= released and first["choices"][0]["delta"]["role"] == "assistant"
