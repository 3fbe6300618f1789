"""A tester's abuse report on `specdec serve` (sec60): a lone surrogate in a JSON object key is
a 400 naming the field, with nothing logged; a LoRA path the system cannot look up is vLLM's 404
and a huge name is not echoed whole; with --api-key the control routes that change state ask
for the key (replicas forward it); two 400s name the field the client sent."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_server import LiveServer

KEY = {"Authorization": "Bearer sekret"}
JSON = {**KEY, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, max_model_len=256, max_num_seqs=4, enable_lora=True)
    config = ServerConfig(served_model_names=("toy",), api_key="sekret", allow_runtime_lora_updating=True,
                          dev_mode=True)
    with LiveServer(build_app(llm, config)) as server:
        server.llm = llm
        yield server


@contextlib.contextmanager
def logged(*names):
    """The records the named loggers (and their children) write meanwhile, whatever they propagate."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


# --- 1. a lone surrogate in a key --------------------------------------------------------------

# raw JSON: "\ud800" spelled as JSON's escape, which no UTF-8 text holds
SURROGATE_KEYS = [
    ("/v1/completions", r'{"prompt":"x","max_tokens":1,"\ud800":1}', r"\ud800", r"\ud800 (a key)"),
    ("/v1/completions", r'{"prompt":"x","max_tokens":1,"logit_bias":{"\ud800":1}}', "logit_bias",
     r"logit_bias.\ud800 (a key)"),
    ("/v1/completions", r'{"prompt":"x","max_tokens":1,"guided_json":{"type":"object","properties":{"a\udc00":{}}}}',
     "guided_json", r"guided_json.properties.a\udc00 (a key)"),
    ("/v1/chat/completions", r'{"messages":[{"role":"user","content":"x","\ud800":1}],"max_tokens":1}', "messages",
     r"messages[0].\ud800 (a key)"),
    ("/v1/chat/completions", r'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"\ud800":1}}',
     "chat_template_kwargs", r"chat_template_kwargs.\ud800 (a key)"),
    ("/v1/responses", r'{"input":"hi","max_output_tokens":2,"metadata":{"\ud800":"v"}}', "metadata",
     r"metadata.\ud800 (a key)"),
    ("/tokenize", r'{"prompt":"x","\ud800":1}', r"\ud800", r"\ud800 (a key)"),
    ("/detokenize", r'{"tokens":[1],"\ud800":1}', r"\ud800", r"\ud800 (a key)"),
]


@pytest.mark.parametrize("path, body, param, where", SURROGATE_KEYS, ids=[f"{p}:{w}" for p, _, _, w in SURROGATE_KEYS])
def test_a_lone_surrogate_in_a_key_is_a_400_naming_it_escaped(live, path, body, param, where):
    with logged("specdec", "uvicorn.error") as records:
        r = httpx.post(live.url + path, content=body.encode(), headers=JSON, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == f"{where} is not valid Unicode text (a lone surrogate)"
    assert err["param"] == param
    assert r.headers.get("connection") != "close"
    assert not [rec for rec in records if rec.levelno >= logging.ERROR], [rec.getMessage() for rec in records]


def test_a_huge_bad_key_is_not_echoed_whole(live):
    body = '{"prompt":"x","logit_bias":{"' + "k" * 100_000 + r'\ud800":1}}'
    r = httpx.post(live.url + "/v1/completions", content=body.encode(), headers=JSON, timeout=60)
    assert r.status_code == 400 and len(r.content) < 1000
    assert r.json()["error"]["message"] == f"logit_bias.{'k' * 100}... (a key) is not valid Unicode text (a lone surrogate)"


# --- 2. LoRA paths and names ---------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/" + "a" * 300, "/tmp/" + "b/" * 3000], ids=["long-name", "long-path"])
def test_a_lora_path_too_long_to_look_up_is_vllms_404(live, path):
    """ENAMETOOLONG (a name over 255 bytes, a path over PATH_MAX): no such adapter, not an OSError."""
    r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=KEY,
                   timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and err["message"] == f"No adapter found for 'x': {path[:100]}... does not exist"


def test_a_huge_adapter_name_is_cut_in_errors(live):
    name = "n" * 500_000
    r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/nonexistent"},
                   headers=KEY, timeout=60)
    assert r.status_code == 404 and len(r.content) < 1000
    assert r.json()["error"]["message"] == f"No adapter found for '{'n' * 100}...': /nonexistent does not exist"
    r = httpx.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=KEY, timeout=60)
    assert r.status_code == 404 and len(r.content) < 1000


# --- 3. the key on the control routes --------------------------------------------------------------

KEYED = [("/pause", {"mode": "abort"}, None), ("/resume", None, None), ("/reload_weights", None, {}),
         ("/collective_rpc", None, {"method": "get_model"}), ("/reset_prefix_cache", None, None),
         ("/reset_mm_cache", None, None), ("/sleep", None, None), ("/wake_up", None, None)]


@pytest.mark.parametrize("path, params, body", KEYED)
def test_control_routes_that_change_state_need_the_key(live, path, params, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(live.url + path, params=params, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(live.url + "/is_paused", timeout=60).json() == {"is_paused": False}


def test_with_the_key_pause_and_resume_work_and_reads_stay_open(live):
    assert httpx.post(live.url + "/pause", params={"mode": "keep"}, headers=KEY, timeout=60).json() == {"status": "paused"}
    try:
        assert httpx.get(live.url + "/is_paused", timeout=60).json() == {"is_paused": True}     # no key: open
    finally:
        assert httpx.post(live.url + "/resume", headers=KEY, timeout=60).json() == {"status": "resumed"}
    assert httpx.get(live.url + "/get_world_size", timeout=60).status_code == 200
    assert httpx.get(live.url + "/is_sleeping", timeout=60).json() == {"is_sleeping": False}
    assert httpx.post(live.url + "/reset_mm_cache", headers=KEY, timeout=60).status_code == 200
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=KEY, timeout=60)
    assert r.status_code == 200, r.text


def test_replicas_forward_the_key_to_every_replica():
    """--replicas: the replica a control request reaches sends it on with the client's key; without
    the key every replica answers 401 and none pauses."""
    pytest.importorskip("ray")
    from specdec.server.replicas import ReplicaApp, RequireToken, broadcast

    async def metrics():
        return b""

    llms = [LLM(BUNDLED_TARGET, max_model_len=128, max_num_seqs=2) for _ in range(2)]
    apps = [build_app(llm, ServerConfig(api_key="sekret")) for llm in llms]
    # each app under uvicorn (its lifespan starts its worker); b's port is its direct one
    with LiveServer(apps[0]), LiveServer(RequireToken(apps[1], "tok")) as b:
        async def fan_out(*request):
            status, body, _ = await broadcast(apps[0], "a", {"b": b.url}, *request, "tok")
            return status, body
        front = ReplicaApp(apps[0], "a", metrics, fan_out)

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://x",
                                         timeout=60) as c:
                out = {"anonymous": await c.post("/pause", params={"mode": "keep"}),
                       "still": await c.get("/is_paused"),
                       "pause": await c.post("/pause", params={"mode": "keep"}, headers=KEY),
                       "each": [llm.engine.owner.paused for llm in llms],
                       "paused": await c.get("/is_paused"),
                       "resume": await c.post("/resume", headers=KEY)}
                out["after"] = [llm.engine.owner.paused for llm in llms]
                return out
        out = asyncio.run(main())
    assert out["anonymous"].status_code == 401 and out["still"].json() == {"is_paused": False}
    assert out["pause"].json() == {"status": "paused"} and out["each"] == [True, True]
    assert out["paused"].json() == {"is_paused": True}
    assert out["resume"].status_code == 200 and out["after"] == [False, False]


# --- 4. the param of two 400s --------------------------------------------------------------------

def test_allowed_token_ids_outside_the_vocabulary_names_its_field(live):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "allowed_token_ids": [99999999]},
                   headers=KEY, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "allowed_token_ids"
    assert "99999999 is outside the vocabulary" in r.json()["error"]["message"]


def test_a_self_recursive_schema_names_response_format_in_plain_words(live):
    schema = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    r = httpx.post(live.url + "/v1/chat/completions", headers=KEY, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format"
    assert err["message"] == ("response_format is invalid: no JSON value matches the schema: is it recursive with "
                              "no way out (a $ref that leads only back to itself)?")
