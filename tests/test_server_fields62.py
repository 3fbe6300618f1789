"""A tester's review of the server (review62): a logit_bias key or an input_items `limit` that
Python's int() refuses (over 4300 digits, a superscript) is a 400 that does not echo it whole,
not a 500; `model: ""` is the served model on every endpoint (vLLM's _is_model_supported); and
top_logprobs 0, prompt_logprobs 0 streamed and an empty stream_options pass, as vLLM's protocol
validators let them (check_logprobs, validate_stream_options)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_server import LiveServer

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, max_model_len=256, max_num_seqs=4)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _bad(r: httpx.Response, param: str) -> str:
    """A 400 naming `param`, short enough not to echo a huge value; its message."""
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and len(error["message"]) < 300, error
    return error["message"]


# 1: a logit_bias key int() refuses ---------------------------------------------------------------

@pytest.mark.parametrize("path, body", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)])
def test_a_logit_bias_key_of_thousands_of_digits_is_a_400(live, path, body):
    for key in ["9" * 4300, "9" * 4301, "0" * 5000 + "5"]:
        r = httpx.post(live.url + path, json={**body, "model": "toy", "logit_bias": {key: 1}}, timeout=60)
        _bad(r, "logit_bias")
    r = httpx.post(live.url + path, json={**body, "model": "toy", "logit_bias": {"05": 1}}, timeout=60)
    assert r.status_code == 200, r.text[:300]         # leading zeros int() takes: token 5, as vLLM's


# 2: input_items' limit ---------------------------------------------------------------------------

def test_input_items_limit_takes_ascii_digits_only(client, live):
    rid = client.responses.create(model="toy", input="Hi", max_output_tokens=2).id
    url = f"{live.url}/v1/responses/{rid}/input_items"
    for limit in ["²", "\u0663", "9" * 4301, "0", "101", "abc"]:
        assert "limit must be an integer from 1 to 100" in _bad(httpx.get(url, params={"limit": limit}, timeout=60),
                                                                "limit")
    assert len(httpx.get(url, params={"limit": "1"}, timeout=60).json()["data"]) == 1


# 3: an empty model name is the served model ------------------------------------------------------

def test_an_empty_model_is_the_served_model(client, live):
    assert client.completions.create(model="", prompt="Hello", max_tokens=2).model == "toy"
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "toy"
    assert client.responses.create(model="", input="Hi", max_output_tokens=2).model == "toy"
    tokens = httpx.post(live.url + "/tokenize", json={"model": "", "prompt": "Hi"}, timeout=60)
    assert tokens.status_code == 200, tokens.text[:300]
    text = httpx.post(live.url + "/detokenize", json={"model": "", "tokens": tokens.json()["tokens"]}, timeout=60)
    assert text.status_code == 200, text.text[:300]
    # a name that is not served is still vLLM's 404
    assert httpx.post(live.url + "/v1/completions", json={**TEXT, "model": "nope"}, timeout=60).status_code == 404


# 4: the gates vLLM's validators draw -------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 0}),
    ("/v1/completions", {**TEXT, "stream": True, "prompt_logprobs": 0}),
    ("/v1/chat/completions", {**CHAT, "stream_options": {}}),
    ("/v1/completions", {**TEXT, "stream": False, "stream_options": {}}),
])
def test_what_vllm_validators_accept_is_served(live, path, body):
    r = httpx.post(live.url + path, json={**body, "model": "toy"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    else:
        assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {**TEXT, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {**TEXT, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_vllm_validators_refuse_is_still_a_400(live, path, body, param):
    _bad(httpx.post(live.url + path, json={**body, "model": "toy"}, timeout=60), param)
