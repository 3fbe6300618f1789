"""The rest of the OpenAI surface through a real uvicorn server and the official openai client:
structured outputs (response_format, structured_outputs, guided_*), penalties and logit bias,
echo, n with best_of, roles (tools: test_tools.py); bad input is a 400 naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_server import LiveServer
from test_structured import SCHEMA

MSG = [{"role": "user", "content": "def parse(data):"}]
# what a completion may still need to be JSON, after an open string is closed: nothing, a value (after
# a colon, a comma in an array or a number cut at "1." / "1e"), a key's colon and value, the rest of a
# literal, a next member (after a comma in an object)
_MIDDLES = ("", "0", ":0", "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l", '"k":0')


def json_prefix(text: str) -> bool:
    """Whether `text` starts some valid JSON document (a reply cut short by max_tokens): true only
    when one of a few completions (its open string closed, one of _MIDDLES, its open brackets closed)
    parses, so a True is proof; the few prefixes no completion here fixes would read False."""
    stack, in_string, escape, hex_left = [], False, False, 0
    for ch in text:
        if in_string:
            if hex_left:
                hex_left -= 1
            elif escape:
                escape, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    close = (("n" if escape else "0" * hex_left) + '"') if in_string else ""
    for middle in _MIDDLES:
        try:
            json.loads(text + close + middle + "".join(reversed(stack)))
            return True
        except json.JSONDecodeError:
            continue
    return False


def test_json_prefix_checker():
    for good in ('{', '{"a', '{"a"', '{"a":', '{"a": [1, 2.', '{"a": tr', '{"a": "x\\', '{"a": "\\u00',
                 '{"a": 1, ', '{"a": [{"b": null}, ', '{"a": 1}'):
        assert json_prefix(good), good
    for bad in ('class A:', '{"a": 1}}', '{"a" 1', '{1: 2', '{"a": [}', '{"a": tx', ']'):
        assert not json_prefix(bad), bad


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=256,
              max_num_seqs=8)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        server.llm = llm
        yield server


@pytest.fixture(scope="module")
def ref():
    """The same model outside the server, for expected outputs: the live server's worker thread
    is its engine's only caller, so tests never drive live.llm themselves."""
    return LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=256)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_response_format_and_guided_fields(client):
    jsonschema = pytest.importorskip("jsonschema")
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    chat = client.chat.completions.create(model="toy", messages=MSG, response_format=rf, max_tokens=80,
                                          temperature=1.0, seed=3, n=3)
    for c in chat.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = client.chat.completions.create(model="toy", messages=MSG, response_format={"type": "json_object"},
                                         max_tokens=120, temperature=0)
    # json_object: a JSON object; the toy model never closes one, so it is cut short by max_tokens
    # (the test would take a "stop" too), but what it wrote is an object's start (unconstrained it
    # answers with Python)
    content, finish = obj.choices[0].message.content, obj.choices[0].finish_reason
    assert content.startswith("{") and (isinstance(json.loads(content), dict) if finish == "stop" else
                                        finish == "length" and json_prefix(content)), (finish, content)
    done = client.completions.create(model="toy", prompt="x = ", max_tokens=80, temperature=0,
                                     extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    regex = client.completions.create(model="toy", prompt="x = ", max_tokens=20, temperature=0.8, seed=1,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    choice = client.chat.completions.create(model="toy", messages=MSG, max_tokens=10, temperature=1.0, seed=2,
                                            extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in {"yes", "no", "maybe"}
    # vLLM's JSON options: whitespace as a pattern (older guided_whitespace_pattern too), closed objects
    for extra in ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]"},
                  {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]", "disable_fallback": True}}):
        spaced = client.completions.create(model="toy", prompt="x = ", max_tokens=80, temperature=0, extra_body=extra)
        jsonschema.validate(json.loads(spaced.choices[0].text), SCHEMA)
        assert " " in spaced.choices[0].text and "\n" not in spaced.choices[0].text   # SCHEMA's values hold no space
    closed = client.completions.create(model="toy", prompt="x = ", max_tokens=80, temperature=0, extra_body={
        "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                               "disable_additional_properties": True, "disable_any_whitespace": True}})
    assert json.loads(closed.choices[0].text).keys() == {"a"}
    # closed by default, strict or not (xgrammar's strict mode, OpenAI's strict: true); oneOf read as anyOf
    person = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    for schema in (person, {"oneOf": [person, {"type": "object", "properties": {"b": {"type": "boolean"}}}]}):
        for strict in (True, None):
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": strict}}
            reply = client.chat.completions.create(model="toy", messages=MSG, response_format=rf, max_tokens=40,
                                                   temperature=0)
            assert reply.choices[0].finish_reason == "stop"
            assert json.loads(reply.choices[0].message.content).keys() in ({"a"}, {"b"}, set())
    tag = {"type": "structural_tag", "triggers": ["<call="],
           "structures": [{"begin": "<call=f>", "schema": {"type": "integer"}, "end": "</call>"}]}
    free = client.chat.completions.create(model="toy", messages=MSG, max_tokens=16, temperature=0)
    tagged = client.chat.completions.create(model="toy", messages=MSG, max_tokens=16, temperature=0, response_format=tag)
    assert tagged.choices[0].message.content == free.choices[0].message.content      # no trigger: free text


def test_penalties_bias_and_min_tokens_match_the_engine(client, live):
    """The server passes every control through: its greedy output equals LLM.generate's."""
    body = dict(presence_penalty=0.5, frequency_penalty=0.7, logit_bias={"29": 3.0})
    extra = dict(repetition_penalty=1.2, min_tokens=10, bad_words=["the"])
    got = client.completions.create(model="toy", prompt="def parse(data):", max_tokens=20, temperature=0,
                                    **body, extra_body=extra)
    params = SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.7,
                            logit_bias={29: 3.0}, **extra)
    plain = LLM(BUNDLED_TARGET, num_speculative_tokens=0).generate("def parse(data):", params)[0].outputs[0]
    assert got.choices[0].text == plain.text
    unconstrained = client.completions.create(model="toy", prompt="def parse(data):", max_tokens=20, temperature=0)
    assert unconstrained.choices[0].text != plain.text


def test_echo_and_best_of(client):
    out = client.completions.create(model="toy", prompt="import os\n", max_tokens=6, temperature=0, echo=True)
    assert out.choices[0].text.startswith("import os\n") and len(out.choices[0].text) > len("import os\n")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="toy", prompt="import os\n", max_tokens=6, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == out.choices[0].text
    best = client.completions.create(model="toy", prompt="def f(x):", max_tokens=8, temperature=1.0, seed=5, n=2,
                                     best_of=4)
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens >= 8 * 2


def test_best_of_keeps_the_most_likely_candidates(live):
    """best_of=4, n=2 returns the two of the four seeded candidates (the same as n=4 draws)
    whose cumulative log-probability, recomputed here from the target, is highest."""
    import torch
    llm, prompt = live.llm, "def f(x):"
    draws = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=6))[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=6))[0].outputs
    ids = llm.tokenizer.encode(prompt)

    def logprob(out):
        with torch.no_grad():
            logits = llm.target(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.token_ids)[:, None]).sum().item()

    ranked = sorted(draws, key=logprob, reverse=True)
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    # bf16 weights: the verifier's rows and this whole-sequence forward round a little apart
    assert best[0].cumulative_logprob == pytest.approx(logprob(ranked[0]), abs=0.05)


@pytest.mark.parametrize("kind,kw,param", [
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    ("chat", dict(response_format={"type": "yaml"}), "response_format"),
    ("completion", dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    ("completion", dict(extra_body={"guided_json": "{not json"}), "guided_json"),
    ("completion", dict(extra_body={"structured_outputs": {"grammar": "start: missing_rule"}}), "structured_outputs"),
    ("completion", dict(extra_body={"structured_outputs": {"yaml": "x"}}), "structured_outputs"),
    ("completion", dict(extra_body={"structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}}),
     "structured_outputs"),
    ("completion", dict(extra_body={"structured_outputs": {"json": {}, "structural_tag": "{}"}}), "structured_outputs"),
    ("completion", dict(extra_body={"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<"]}}}),
     "structured_outputs"),
    ("chat", dict(response_format={"type": "structural_tag", "triggers": ["<f="]}), "response_format"),
    ("completion", dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice"),
    ("chat", dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tool_choice"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": 3}}], tool_choice="none"), "tools"),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("completion", dict(logit_bias={"abc": 1}), "logit_bias"),
    ("completion", dict(logit_bias={"5": "x"}), "logit_bias"),        # 500 is clamped to 100 (vLLM's)
    ("completion", dict(logit_bias={"99999": 1}), "logit_bias"),
    ("completion", dict(frequency_penalty=-3), "frequency_penalty"),
    ("completion", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completion", dict(n=3, best_of=2), "best_of"),
    ("completion", dict(stream_options={"include_usage": True}), "stream_options"),
    ("chat", dict(stream=False, stream_options={"include_usage": True}), "stream_options"),
    ("completion", dict(best_of=3, stream=True), "best_of"),
])
def test_bad_input_is_a_400_naming_the_field(client, kind, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(**{"model": "toy", "messages": MSG, "max_tokens": 4, **kw})
        else:
            client.completions.create(**{"model": "toy", "prompt": "x", "max_tokens": 4, **kw})
    assert e.value.body["param"] == param, e.value.body
    assert client.models.list().data              # still serving


def test_structured_outputs_in_the_python_api_names_the_field():
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))


# vLLM's chat template surface: --chat-template / --response-role, and per request
# chat_template, chat_template_kwargs, add_generation_prompt, continue_final_message
PLAIN_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}{{ tag or '' }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}### The reply, in full:{% endif %}")


@pytest.fixture(scope="module")
def templated(live, tmp_path_factory):
    """A second server on the same engine with --chat-template's file and --response-role."""
    from specdec.tokenizer import load_chat_template

    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(PLAIN_TEMPLATE)
    config = ServerConfig(served_model_names=("toy",), chat_template=load_chat_template(str(path)), response_role="bot",
                          trust_request_chat_template=True)
    # its own engine: a server's worker thread must be its engine's only caller
    with LiveServer(build_app(_own_llm(), config)) as server:
        yield server


def _chat_json(url: str, **body) -> tuple[int, dict]:
    import httpx

    r = httpx.post(url + "/v1/chat/completions", json={"model": "toy", "max_tokens": 4, "temperature": 0, **body},
                   timeout=120)
    return r.status_code, r.json()


def _prompt_tokens(llm: LLM, text: str) -> int:
    return len(llm.tokenizer.encode(text, add_special_tokens=False))


def test_server_chat_template_and_response_role(templated, live):
    msgs = [{"role": "user", "content": "def f(x):"}]
    status, out = _chat_json(templated.url, messages=msgs)
    assert status == 200 and out["choices"][0]["message"]["role"] == "bot"
    assert out["usage"]["prompt_tokens"] == _prompt_tokens(live.llm, "[user] def f(x):\n### The reply, in full:")
    # the same request to the server without the flag renders the tokenizer's own template
    status, plain = _chat_json(live.url, messages=msgs)
    assert status == 200 and plain["choices"][0]["message"]["role"] == "assistant"
    own = live.llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert plain["usage"]["prompt_tokens"] == _prompt_tokens(live.llm, own) != out["usage"]["prompt_tokens"]
    # streamed: the role is named once, in the first chunk
    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="toy", messages=msgs, max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "bot"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out["choices"][0]["message"]["content"]


def test_request_chat_template_kwargs_and_continuation(templated, live, ref):
    msgs = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return"}]
    # a request's own template wins over the server's (one started with --trust-request-chat-template),
    # and its kwargs reach the template
    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="toy", messages=msgs[:1], max_tokens=4, temperature=0,
                                          extra_body={"chat_template": PLAIN_TEMPLATE, "chat_template_kwargs": {"tag": "!"}})
    assert chat.usage.prompt_tokens == _prompt_tokens(live.llm, "[user!] def f(x):\n### The reply, in full:")
    # continue_final_message: the reply continues the assistant's text, as LLM.chat does it
    status, out = _chat_json(templated.url, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    expected = ref.chat(msgs, SamplingParams(temperature=0, max_tokens=4), chat_template=PLAIN_TEMPLATE,
                             add_generation_prompt=False, continue_final_message=True)[0]
    assert status == 200 and expected.prompt.endswith("[assistant]     return")
    assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert out["choices"][0]["message"]["content"] == expected.outputs[0].text
    # add_generation_prompt false alone: no reply header
    status, out = _chat_json(templated.url, messages=msgs[:1], add_generation_prompt=False)
    assert status == 200 and out["usage"]["prompt_tokens"] == _prompt_tokens(live.llm, "[user] def f(x):\n")


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),          # with add_generation_prompt (default)
    ({"chat_template": "{% for m in messages %}"}, "chat_template"),       # does not compile
    ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),  # the server's own variable
    ({"chat_template_kwargs": "tag"}, None),                               # not an object
])
def test_bad_chat_template_fields_are_400(templated, body, param):
    status, out = _chat_json(templated.url, messages=[{"role": "user", "content": "hi"}], **body)
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    if param:
        assert out["error"]["param"] == param


def test_a_request_template_is_refused_unless_trusted(live):
    status, out = _chat_json(live.url, messages=[{"role": "user", "content": "hi"}], chat_template=PLAIN_TEMPLATE)
    assert status == 400 and out["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in out["error"]["message"]


def test_chat_template_flag_bad_values_exit_2(tmp_path, capsys):
    from specdec.cli import main

    for value, says in [(str(tmp_path / "missing.jinja"), "no such file"), ("{% if %}", "not a valid template")]:
        assert main(["serve", "--model", str(BUNDLED_TARGET), "--chat-template", value, "--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


# vLLM's HTTP flags: CORS (--allowed-origins ...), --root-path, TLS (--ssl-keyfile / --ssl-certfile)
def _own_llm() -> LLM:
    return LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=256)


def _app(live, **config):
    return build_app(_own_llm(), ServerConfig(served_model_names=("toy",), **config))


def test_cors_answers_preflights_before_the_api_key_and_marks_every_response(live):
    import httpx

    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with LiveServer(_app(live, api_key="k")) as server:     # vLLM's defaults: any origin
        r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://ui.example"})   # no key: 401, readable
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with LiveServer(_app(live, allowed_origins=("https://ui.example",), allow_credentials=True)) as server:
        ok = httpx.options(server.url + "/v1/completions", headers=preflight)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def _served(app, config: ServerConfig, ssl: dict | None = None) -> LiveServer:
    """A live server with serve()'s uvicorn settings (server.cli.uvicorn_config)."""
    from specdec.server.cli import uvicorn_config

    return LiveServer(app, uvicorn_config(app, config, "warning", ssl))


def test_root_path_is_the_prefix_the_openapi_schema_names(live):
    import httpx

    config = ServerConfig(served_model_names=("toy",), root_path="/llm")
    with _served(build_app(_own_llm(), config), config) as server:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "toy"
        assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with pytest.raises(ValueError, match="root_path"):
        ServerConfig(root_path="llm/")


def test_the_api_key_holds_under_a_root_path(live):
    """uvicorn leaves --root-path in the request's path (/llm/v1/models): the key check looked
    for paths starting with /v1 and let every request through (a tester's find)."""
    import httpx

    config = ServerConfig(served_model_names=("toy",), root_path="/llm", api_key="k")
    with _served(build_app(_own_llm(), config), config) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200


def test_lone_surrogates_are_a_400_and_the_engine_goes_on(live, monkeypatch):
    """JSON may spell a lone surrogate; in bad_words it killed the engine thread (a TypeError
    the worker did not catch: every later request hung), elsewhere it was a 500. Now a 400 naming
    the field; and a request whose admission fails for any reason fails alone."""
    import httpx

    llm = _own_llm()
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        cases = [("/v1/completions", {"prompt": "x", "max_tokens": 2, "bad_words": ["\ud800"]}, "bad_words[0]"),
                 ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt[1]"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2},
                  "messages[0].content"),
                 ("/tokenize", {"prompt": "\ud800"}, "prompt")]
        for path, body, field in cases:
            r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), (path, r.text)
            assert r.json()["error"]["param"] == field.split("[")[0].split(".")[0]
        real = llm.engine.add_request

        def add_request(prompt, params, *a, **kw):     # an unexpected failure admitting one request
            if params.max_tokens == 3:
                raise TypeError("boom")
            return real(prompt, params, *a, **kw)

        monkeypatch.setattr(llm.engine, "add_request", add_request)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and httpx.get(server.url + "/health").status_code == 200


def test_https_with_the_ssl_flags(live, ref, tmp_path):
    import shutil
    import ssl
    import subprocess

    import httpx

    from specdec.server.cli import build_parser, ssl_settings

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    args = build_parser().parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    config = ServerConfig(served_model_names=("toy",))
    trust = ssl.create_default_context(cafile=str(cert))
    with _served(build_app(_own_llm(), config), config, ssl_settings(args)) as server:
        assert server.url.startswith("https://")
        assert httpx.get(server.url + "/health", verify=trust).json() == {"status": "ok"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=httpx.Client(verify=trust))
        out = client.completions.create(model="toy", prompt="def f(x):", max_tokens=4, temperature=0)
        alone = ref.generate("def f(x):", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
        assert out.choices[0].text == alone
        with pytest.raises(httpx.ConnectError):        # a client that does not trust the certificate
            httpx.get(server.url + "/health")
        stopping = time.monotonic()
    # the client's keep-alive connection was still open and idle: the server dropped it rather than
    # wait (up to asyncio's 30 s) for a TLS close_notify that a client not reading never sends
    assert time.monotonic() - stopping < 10
    client.close()


@pytest.mark.parametrize("flags, says", [
    (["--ssl-keyfile", "k.pem"], "both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "--ssl-keyfile k.pem: no such file"),
    (["--allowed-origins", '{"a": 1}'], "--allowed-origins: must be a JSON list of strings"),
])
def test_http_flags_bad_values_exit_2(flags, says, capsys, tmp_path, monkeypatch):
    from specdec.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(["serve", "--model", str(BUNDLED_TARGET), *flags, "--port", "0"])
    except SystemExit as e:          # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1], err


def test_echo_with_logprobs_scores_the_prompt(client, live, ref):
    """OpenAI's echo + logprobs (what lm-evaluation-harness reads for loglikelihoods): the prompt's
    tokens first, a null logprob and alternatives for the first, then the completion's; the
    figures are the engine's prompt_logprobs; streamed, the same lists arrive across the chunks."""
    prompt = "def fib(n):\n    if n < 2:"
    out = client.completions.create(model="toy", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    expect = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2))[0]
    lp, ids = out.choices[0].logprobs, expect.prompt_token_ids
    n = len(ids)
    assert out.choices[0].text == prompt + expect.outputs[0].text
    assert len(lp.tokens) == n + len(expect.outputs[0].token_ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    name = lambda t: live.llm.tokenizer.decode([t], skip_special_tokens=False)   # noqa: E731
    assert lp.tokens[:n] == [name(t) for t in ids]
    expected = [x.logprob for x in expect.prompt_logprobs[1:]] + [x.logprob for x in expect.outputs[0].logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-6)
    # the two most likely tokens and the token itself (OpenAI's legacy completions, vLLM's)
    assert all(tok in top and len(top) == 2 + (tok not in list(top)[:2]) for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model="toy", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected, abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    # without echo nothing of the prompt is listed (and nothing of it is scored)
    plain = client.completions.create(model="toy", prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    assert len(plain.choices[0].logprobs.tokens) == len(expect.outputs[0].token_ids)


def test_vllm_prompt_logprobs_field(client, ref):
    """vLLM's prompt_logprobs extension: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token and its alternatives; per choice for completions, once
    for chat; not streamed (400)."""
    prompt = "class Point:"
    out = client.completions.create(model="toy", prompt=prompt, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 2})
    expect = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(expect.prompt_token_ids) and got[0] is None
        for t, entry, x in zip(expect.prompt_token_ids[1:], got[1:], expect.prompt_logprobs[1:]):
            mine = entry[str(t)]
            assert mine["logprob"] == pytest.approx(x.logprob, abs=1e-6) and mine["rank"] == x.rank
            assert mine["decoded_token"] == ref.tokenizer.decode([t], skip_special_tokens=False)
            assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) == 2 + (x.rank > 2)
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="toy", messages=msgs, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    listed = chat.model_extra["prompt_logprobs"]
    assert len(listed) == chat.usage.prompt_tokens and listed[0] is None
    assert all(len(d) == 1 and next(iter(d.values()))["rank"] >= 1 for d in listed[1:])
    assert "prompt_logprobs" not in client.chat.completions.create(model="toy", messages=msgs, max_tokens=2).model_extra
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="toy", prompt=prompt, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_token_id_names_and_docs_flags(live):
    """--return-tokens-as-token-ids names logprob tokens "token_id:<id>" unless a request says
    otherwise; --disable-fastapi-docs drops /docs, /redoc and /openapi.json."""
    import httpx

    body = {"model": "toy", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    with LiveServer(_app(live, return_tokens_as_token_ids=True, disable_fastapi_docs=True)) as server:
        named = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
        assert all(t.startswith("token_id:") for t in named["tokens"])
        assert all(k.startswith("token_id:") for top in named["top_logprobs"] for k in top)
        texts = httpx.post(server.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": False},
                           timeout=120).json()["choices"][0]["logprobs"]["tokens"]
        assert [f"token_id:{live.llm.tokenizer.encode(t, add_special_tokens=False)[0]}" for t in texts] == named["tokens"]
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 404
    assert httpx.get(live.url + "/openapi.json").status_code == 200
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
        "model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "return_tokens_as_token_ids": True}).json()
    assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])


def test_enable_log_requests_logs_each_request_and_its_end(tiny_pair, caplog):
    """vLLM's --enable-log-requests / --max-log-len: a line per queued choice (prompt text and ids
    cut at max_log_len, the parameters, the priority) and one as it ends; nothing by default."""
    import logging

    from specdec.server.cli import parse_args, server_config

    args, _ = parse_args(["--enable-log-requests", "--max-log-len", "5"], "x")
    assert server_config(args).enable_log_requests and server_config(args).max_log_len == 5
    assert not server_config(parse_args([], "x")[0]).enable_log_requests
    assert not server_config(parse_args(["--disable-log-requests"], "x")[0]).enable_log_requests
    llm = LLM(tiny_pair[0], dtype="float32", num_speculative_tokens=0, max_model_len=64)
    prompt = "def fibonacci(n):"
    for enabled in (True, False):
        config = ServerConfig(served_model_names=("tiny",), enable_log_requests=enabled, max_log_len=5)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specdec.server"), LiveServer(build_app(llm, config)) as live:
            with httpx.Client(base_url=live.url, timeout=60) as http:
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2,
                                                       "ignore_eos": True})
                assert r.status_code == 200
        received = [m for m in caplog.messages if m.startswith("Received request")]
        finished = [m for m in caplog.messages if m.startswith("Finished request")]
        if not enabled:
            assert not received and not finished
            continue
        ids = llm.tokenizer.encode(prompt)
        text = llm.tokenizer.decode(ids, skip_special_tokens=False)
        assert len(received) == 2 and all(f"prompt: {text[:5]!r}" in m and f"prompt_token_ids: {ids[:5]}" in m
                                          and "max_tokens=3" in m for m in received)
        assert len(finished) == 2 and all("length" in m and "3 output tokens" in m for m in finished)
        assert not any(m.startswith("Generated response") for m in caplog.messages)


def test_enable_log_outputs_logs_each_completion(tiny_pair, caplog):
    """vLLM's --enable-log-outputs (with --enable-log-requests): each completion's output text,
    token ids (cut at max_log_len) and finish reason as it ends, streamed or not."""
    import logging

    from specdec.server.cli import parse_args, server_config

    assert server_config(parse_args(["--enable-log-requests", "--enable-log-outputs"], "x")[0]).enable_log_outputs
    llm = LLM(tiny_pair[0], dtype="float32", num_speculative_tokens=0, max_model_len=64)
    config = ServerConfig(served_model_names=("tiny",), enable_log_requests=True, enable_log_outputs=True,
                          max_log_len=4)
    with caplog.at_level(logging.INFO, logger="specdec.server"), LiveServer(build_app(llm, config)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, n=2,
                                      extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "out-1"})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="import os", max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "out-2"}) if c.choices)
    logged = {m.split(":")[0]: m for m in caplog.messages if m.startswith("Generated response")}
    assert set(logged) == {"Generated response cmpl-out-1-0", "Generated response cmpl-out-1-1",
                           "Generated response cmpl-out-2"}
    for i, choice in enumerate(r.choices):
        line = logged[f"Generated response cmpl-out-1-{i}"]
        assert f"output: {choice.text[:4]!r}" in line and line.endswith("finish_reason: length")
        assert "output_token_ids: [" in line and len(line.split("output_token_ids: [")[1].split("]")[0].split(",")) == 4
    assert f"output: {streamed[:4]!r}" in logged["Generated response cmpl-out-2"]


def test_openai_details_found_by_a_users_probe(client, live, ref):
    """What a probe of the API as a vLLM user found: echo with max_tokens 0 scores the prompt
    alone; logprobs 0 still names the chosen token; chat echo; text parts joined by newlines;
    every 64-bit seed; the field sent is the field named; suffix and a non-ASCII digit in
    logit_bias are 400s (the latter was a 500 that closed the connection)."""
    prompt = "def fib(n):"
    scored = client.completions.create(model="toy", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    expect = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    c = scored.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(expect.prompt_token_ids) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx([x.logprob for x in expect.prompt_logprobs[1:]], abs=1e-6)
    chunks = list(client.completions.create(model="toy", prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="toy", prompt=prompt, max_tokens=0)       # without echo: nothing to return

    zero = client.completions.create(model="toy", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]

    msgs = [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def f(x):"}]
    kw = dict(model="toy", messages=msgs, max_tokens=5, temperature=0,
              extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    echoed = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "def f(x):" + plain

    def tokens(content):
        return httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()["tokens"]
    assert tokens([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == tokens("a\nb")

    top = 2**63 - 1
    a, b = (client.completions.create(model="toy", prompt=prompt, max_tokens=6, temperature=1.0, seed=top, n=2)
            for _ in range(2))
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    for body, param in [({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="toy", messages=MSG, extra_body=body)
        assert e.value.body["param"] == param and param in e.value.body["message"]
    full = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full[4:7]
    kept = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == full[:full.index(stop) + len(stop)] and kept.stop_reason == stop
    ids = live.llm.tokenizer.encode(prompt)
    short = client.completions.create(model="toy", prompt=ids, max_tokens=3, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 3})
    assert short.usage.prompt_tokens == 3
    assert short.choices[0].text == client.completions.create(model="toy", prompt=ids[-3:], max_tokens=3,
                                                              temperature=0).choices[0].text
    # a text prompt is cut where it is tokenized, its BOS kept (vLLM's left-truncating tokenizer)
    kept = [ids[0], *ids[-2:]]
    assert ids[0] == live.llm.tokenizer.bos_token_id and len(ids) > 3
    short = client.completions.create(model="toy", prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert short.usage.prompt_tokens == 3 and short.choices[0].model_extra["prompt_token_ids"] == kept
    assert short.choices[0].text == client.completions.create(model="toy", prompt=kept, max_tokens=3,
                                                              temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as e:       # vLLM's: more than max_model_len (256)
        client.completions.create(model="toy", prompt=prompt, max_tokens=3, extra_body={"truncate_prompt_tokens": 257})
    assert e.value.body["param"] == "truncate_prompt_tokens" and "greater than max_model_len" in e.value.body["message"]
    # apply_chat_template's own arguments are no template variables: a 400 each (a new one was a 500)
    for key, value in (("tokenize", True), ("conversation", []), ("return_assistant_tokens_mask", True),
                       ("sandbox_process", False), ("padding", True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="toy", messages=MSG, extra_body={"chat_template_kwargs": {key: value}})
        assert e.value.body["param"] == "chat_template_kwargs" and key in e.value.body["message"]
        r = httpx.post(live.url + "/tokenize", json={"model": "toy", "messages": MSG, "chat_template_kwargs": {key: value}})
        assert r.status_code == 400, r.text
        with pytest.raises(ValueError, match=key):
            live.llm.chat(MSG, chat_template_kwargs={key: value})
    with httpx.Client(base_url=live.url, timeout=30) as http:
        for body, param in [({"suffix": "return x"}, "suffix"), ({"logit_bias": {"\u00b2": 1}}, "logit_bias")]:
            r = http.post("/v1/completions", json={"model": "toy", "prompt": prompt, "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert http.get("/health").status_code == 200          # the same connection, still open


@pytest.mark.parametrize("template, what", [
    ("{{ 'a' * 10**10 }}", "repetition"),                               # 10 GB asked at once: refused first
    ("{% for i in range(100000) %}{% for j in range(100000) %}aaaaaaaaaa{% endfor %}{% endfor %}",
     "rendered prompt"),                                                 # 10 GB written bit by bit: stopped
    ("{{ 7 ** 100000000 }}", "exponent"),
    ("{% for i in range(10**9) %}{% endfor %}", "OverflowError"),       # the sandbox's own guard: was a 500
    ("{{ (10**400) / 1.5 }}", "OverflowError"),
    # what the sandbox does not bound runs into the child's memory limit (the server's stays flat)
    ("{{ 'a' | center(700000000) }}", "MiB"), ("{{ '%300000000d' % 1 }}", "MiB"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
     "MiB")])
def test_a_request_template_that_would_eat_the_server_is_a_400(templated, template, what, monkeypatch):
    """A request's own template (--trust-request-chat-template) runs in a child process with a
    memory limit: products, powers and the rendered text are bounded, what they do not bound
    (a filter's width, a doubling loop) meets the limit, the server's own memory does not grow,
    and whatever a template raises is a 400 naming chat_template, on chat and on /tokenize
    (which needs no key)."""
    import httpx

    def peak_rss() -> int:               # this process's (the server's) high-water mark, in bytes
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) << 10

    def current_rss() -> int:
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) << 10

    # the memory limit is what these cases meet: a '%300000000d' takes ~4 s to reach it on a quiet
    # 2-core machine, past the 10 s deadline on a loaded one (a CI at 117e510 beside five helpers)
    monkeypatch.setattr("specdec.jinja_sandbox.TEMPLATE_SECONDS", 120.0)
    # the mark reset to now (Linux's clear_refs 5): what the worker process ran before is not counted
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = current_rss()
    msgs = [{"role": "user", "content": "hi"}]
    status, out = _chat_json(templated.url, messages=msgs, chat_template=template)
    assert status == 400 and what in out["error"]["message"], out
    r = httpx.post(templated.url + "/tokenize", json={"model": "toy", "messages": msgs, "chat_template": template},
                   timeout=120)
    assert r.status_code == 400 and what in r.json()["error"]["message"], r.text
    assert _chat_json(templated.url, messages=msgs)[0] == 200            # and the server serves on
    assert peak_rss() - before < 1 << 30, (peak_rss(), before)


def test_a_request_template_that_never_ends_is_stopped(templated, monkeypatch):
    """Two nested loops that write nothing (10^10 iterations) end at the time limit with a 400;
    the next request's template renders in a new child."""
    from specdec import jinja_sandbox

    monkeypatch.setattr(jinja_sandbox, "TEMPLATE_SECONDS", 2.0)
    msgs = [{"role": "user", "content": "hi"}]
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    status, out = _chat_json(templated.url, messages=msgs, chat_template=loop)
    assert status == 400 and "longer than 2 s" in out["error"]["message"] and time.monotonic() - t0 < 30
    status, out = _chat_json(templated.url, messages=msgs, chat_template=PLAIN_TEMPLATE)
    assert status == 200 and out["usage"]["prompt_tokens"] > 0


def test_client_certificates_with_ssl_ca_certs_and_cert_reqs(live, tmp_path):
    """vLLM's --ssl-ca-certs and --ssl-cert-reqs 2 (CERT_REQUIRED): a client without a certificate
    that CA signed is refused at the handshake; one with it is served."""
    import shutil
    import ssl
    import subprocess

    import httpx

    from specdec.server.cli import build_parser, ssl_settings

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make certificates")

    def run(*cmd):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)

    ca_key, ca = tmp_path / "ca.key", tmp_path / "ca.pem"
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test CA")
    paths = {}
    for who, subject in (("server", "/CN=127.0.0.1"), ("client", "/CN=a client")):
        key, csr, cert = (tmp_path / f"{who}.{ext}" for ext in ("key", "csr", "pem"))
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", subject)
        ext = tmp_path / f"{who}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n" if who == "server" else "extendedKeyUsage=clientAuth\n")
        run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "1",
            "-extfile", ext)
        paths[who] = (key, cert)
    args = build_parser().parse_args(["--ssl-keyfile", str(paths["server"][0]), "--ssl-certfile", str(paths["server"][1]),
                                      "--ssl-ca-certs", str(ca), "--ssl-cert-reqs", "2"])
    config = ServerConfig(served_model_names=("toy",))
    with _served(build_app(_own_llm(), config), config, ssl_settings(args)) as server:
        anonymous = ssl.create_default_context(cafile=str(ca))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(server.url + "/health", verify=anonymous)
        known = ssl.create_default_context(cafile=str(ca))
        known.load_cert_chain(str(paths["client"][1]), str(paths["client"][0]))
        assert httpx.get(server.url + "/health", verify=known).json() == {"status": "ok"}


def test_the_http_flags_reach_the_server_from_the_command_line(live):
    """--max-request-bytes, --allowed-methods and --allowed-headers as a command line gives them:
    a body over the set limit is a 413 (one under it is read), and a preflight asking for a method
    or header outside the lists is refused while the listed ones are allowed."""
    import httpx

    from specdec.server.cli import parse_args, server_config

    args, _ = parse_args([str(BUNDLED_TARGET), "--served-model-name", "toy", "--max-request-bytes", "4096",
                          "--allowed-methods", '["POST"]', "--allowed-headers", '["content-type"]'])
    config = server_config(args)
    with LiveServer(build_app(_own_llm(), config)) as server:
        pad = {"model": "toy", "prompt": "x", "max_tokens": 1, "user": "u" * 5000}
        assert httpx.post(server.url + "/v1/completions", json=pad).status_code == 413
        assert httpx.post(server.url + "/v1/completions", json={**pad, "user": "u" * 3000}).status_code == 200
        asked = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
        ok = httpx.options(server.url + "/v1/completions", headers=asked)
        assert ok.status_code == 200 and "POST" in ok.headers["access-control-allow-methods"]
        assert "DELETE" not in ok.headers["access-control-allow-methods"]
        for bad in ({"Access-Control-Request-Method": "DELETE"}, {"Access-Control-Request-Headers": "x-secret"}):
            assert httpx.options(server.url + "/v1/completions", headers={**asked, **bad}).status_code == 400


def test_request_templates_wait_for_the_child_at_most_one_deep_and_others_flow(templated, monkeypatch):
    """The child renders one request's template while one more waits; a third is refused at once
    (429) instead of holding a thread that every other request is prepared on: a plain /tokenize
    sent meanwhile is answered before the slow templates end."""
    import threading

    import httpx

    from specdec import jinja_sandbox

    monkeypatch.setattr(jinja_sandbox, "TEMPLATE_SECONDS", 2.0)
    msgs = [{"role": "user", "content": "hi"}]
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    done: list[tuple[str, int, float]] = []

    def send(name, body):
        r = httpx.post(templated.url + "/tokenize", json={"model": "toy", "messages": msgs, **body}, timeout=60)
        done.append((name, r.status_code, time.monotonic()))

    slow = [threading.Thread(target=send, args=(f"slow{i}", {"chat_template": loop})) for i in range(3)]
    for t in slow:
        t.start()
    time.sleep(0.3)
    send("plain", {})
    for t in slow:
        t.join(60)
    by = {name: (status, at) for name, status, at in done}
    assert by["plain"][0] == 200
    statuses = sorted(by[f"slow{i}"][0] for i in range(3))
    assert statuses == [400, 400, 429], done                   # two timed out in turn, one refused
    assert by["plain"][1] < max(by[f"slow{i}"][1] for i in range(3))


@pytest.mark.parametrize("template, status, what", [
    ("{{ 'x' * 3000000 }}", 400, "passes 2097152 characters"),      # twice the default body: the text to tokenize
    ("{{ '\\ud800' }}", 400, "not valid Unicode")])                   # a lone surrogate: the child lives on
def test_what_a_request_template_writes_is_bounded_and_checked(templated, template, status, what):
    msgs = [{"role": "user", "content": "hi"}]
    code, out = _chat_json(templated.url, messages=msgs, chat_template=template)
    assert code == status and what in out["error"]["message"], out
    assert _chat_json(templated.url, messages=msgs, chat_template=PLAIN_TEMPLATE)[0] == 200


def test_the_template_child_ends_with_its_parent(tmp_path):
    """A server killed (SIGKILL) mid-render leaves no child spinning on: the child watches its
    parent and ends within a second or so."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        "from specdec.jinja_sandbox import IsolatedRenderer\n"
        "r = IsolatedRenderer(seconds=3600)\n"
        "loop = '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}'\n"
        "threading.Thread(target=r.render, args=(loop, {}), daemon=True).start()\n"
        "while r._proc is None: time.sleep(0.01)\n"
        "print(r._proc.pid, flush=True)\n"
        "time.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":       # ended, not yet reaped (by init)
                break
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split(")")[-1].split()[0] != "Z"
    assert not alive
