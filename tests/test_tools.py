"""Tool calling (OpenAI's tools / tool_choice, vLLM's --enable-auto-tool-choice --tool-call-parser):
the parsers on their own, then through a real uvicorn server with the official openai client:
named and required calls are constrained to the tools' schemas and equal plain decoding's
constrained output, streamed == not streamed, auto calls parsed (hermes), tool messages in the
history reach the chat template, bad input is a 400 naming the field."""

from __future__ import annotations

import json
import random

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.errors import APIError
from specdec.server.tools import ToolStream, extract, plan_tools
from specdec.tokenizer import template_messages

from test_server import LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
MSG = [{"role": "user", "content": "def weather(city):"}]
# a chat template that shows tools and earlier calls, as tool-calling models' templates do
TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}<|end|>\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }} "
            "{{ c['function']['arguments']['city'] }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def plan(mode, parser="hermes"):
    choice = {"named": {"type": "function", "function": {"name": "add"}}}.get(mode, mode)
    return plan_tools(TOOLS, choice, None, True, parser)


# ---- the parsers alone ----

def test_hermes_extract_content_calls_and_bad_blocks():
    auto = plan("auto")
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls, finish = extract(auto, text, "stop")
    assert content == "Let me check.\n\n" and finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    # a block that is not a call stays text; no calls: finish_reason unchanged
    content, calls, finish = extract(auto, "x <tool_call>not json</tool_call> y", "stop")
    assert (content, calls, finish) == ("x <tool_call>not json</tool_call> y", [], "stop")
    # the reply ended inside a block (EOS before the closing tag): still a call
    content, calls, _ = extract(auto, '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}', "stop")
    assert content is None and calls[0]["function"]["name"] == "add"
    # cut by max_tokens: "length" is kept
    assert extract(auto, '<tool_call>{"name": "add", "argu', "length")[2] == "length"


def test_required_and_named_extract():
    content, calls, finish = extract(plan("required"), '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "stop")
    assert content is None and finish == "tool_calls" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    # cut short, the array does not parse: no calls and no content (vLLM's), not the partial JSON
    assert extract(plan("required"), '[{"name": "add", "param', "length") == (None, [], "length")
    content, calls, finish = extract(plan("named"), '{"a": 5, "b": 6}', "stop")
    assert content is None and finish == "stop" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 5, "b": 6}'}


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n',
    '  \n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>  <tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Rome", "unit": "celsius"}}</tool_call>',
    "no calls here, just <tool and < text",
    'a <tool_call>broken</tool_call> b <tool_call>{"name": "add", "arguments": {"a": 0, "b": 0}}',
    '<tool_call>{"name": "add", "arguments": {"a": 9}}',
])
def test_hermes_stream_equals_extract_for_any_chunking(text):
    auto = plan("auto")
    want_content, want_calls, want_finish = extract(auto, text, "stop")
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        ts, content, calls = ToolStream(auto), "", []
        for p in pieces:
            c, d = ts.feed(p)
            content, calls = content + c, calls + d
        c, d, finish = ts.finish("stop")
        content, calls = content + c, calls + d
        assert (content or None) == want_content and finish == want_finish
        joined = {}
        for d in calls:         # a call's first delta names it, the others add to its arguments
            fn = joined.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
            fn["arguments"] += d["function"]["arguments"]
        assert list(joined.items()) == [(i, c["function"]) for i, c in enumerate(want_calls)]


WHOLE_REPLIES = {
    "llama3_json": ['{"name": "add", "parameters": {"a": 1, "b": 2}}',
                    '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
                    '"parameters": {"city": "Oslo", "unit": "celsius"}}',
                    '{"answer": 42}', "The sum is 3.", '{"name": "add", "parameters": {"a": 1'],
    "pythonic": ['[add(a=1, b=2)]', '[add(a=1, b=2), get_weather(city="Oslo", unit="celsius")]',
                 '[1, 2, 3]', "[add(1, 2)]", "Sure: [add(a=1, b=2)]", '[add(a=1, b=open("x"))]'],
    "mistral": ['[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
                '"arguments": {"city": "Oslo", "unit": "celsius"}}]',
                "[1, 2]", "Hello there", '[TOOL_CALLS][{"name": "add", "argu'],
}
CALLS = {"llama3_json": [1, 2, 0, 0, 0], "pythonic": [1, 2, 0, 0, 0, 0], "mistral": [1, 2, 0, 0, 0]}


@pytest.mark.parametrize("parser", sorted(WHOLE_REPLIES))
def test_whole_reply_parsers(parser):
    """llama3_json, pythonic, mistral: calls when the whole reply is calls, else text; any
    chunking of a stream gives the same."""
    p = plan("auto", parser)
    for text, n in zip(WHOLE_REPLIES[parser], CALLS[parser]):
        content, calls, finish = extract(p, text, "stop")
        assert len(calls) == n, (text, calls)
        if n:
            assert content is None and finish == "tool_calls" and calls[0]["function"]["name"] == "add"
            assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
        else:
            assert content == text and finish == "stop"
        rng = random.Random(1)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
            ts, got, deltas = ToolStream(p), "", []
            for a, b in zip([0] + cuts, cuts + [len(text)]):
                c, d = ts.feed(text[a:b])
                got, deltas = got + c, deltas + d
            c, d, f = ts.finish("stop")
            got, deltas = got + c, deltas + d
            assert (got or None, f) == (content, finish)
            assert [d["function"] for d in deltas] == [c["function"] for c in calls]
    # text that cannot be a call streams at once
    ts = ToolStream(p)
    assert ts.feed("Hello")[0] == "Hello"


def test_named_and_required_streams():
    ts = ToolStream(plan("named"))
    deltas = [ts.feed(t)[1] for t in ['{"a"', ": 1, ", '"b": 2}']]
    assert deltas[0][0]["function"]["name"] == "add" and "id" in deltas[0][0] and "id" not in deltas[1][0]
    assert "".join(d[0]["function"]["arguments"] for d in deltas) == '{"a": 1, "b": 2}'
    assert ts.finish("stop") == ("", [], "stop")
    ts = ToolStream(plan("required"))
    assert ts.feed('[{"name": "add", ') == ("", []) and ts.feed('"parameters": {"a": 1, "b": 2}}]') == ("", [])
    content, calls, finish = ts.finish("stop")
    assert content == "" and finish == "tool_calls" and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"


def test_what_a_users_probe_found():
    """A pythonic reply whose arguments are not JSON (a set, bytes, complex) stays text (was a
    500); parallel_tool_calls false keeps the first parsed call, streamed too; a null
    `parameters` is as omitted; `required` hoists the tools' $defs to the root, where their
    references resolve (pydantic's tool schemas use them); named and required calls take no
    undeclared arguments, and a function without parameters gets {}."""
    p = plan("auto", "pythonic")
    for text in ["[add(a={1, 2})]", "[add(a=b'xy')]", "[add(a=1j)]"]:
        assert extract(p, text, "stop") == (text, [], "stop")
        ts = ToolStream(p)
        c, d = ts.feed(text)
        c2, d2, f = ts.finish("stop")
        assert (c + c2, d + d2, f) == (text, [], "stop")
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    one = plan_tools(TOOLS, "auto", False, True, "hermes")
    assert len(extract(plan("auto"), text, "stop")[1]) == 2
    content, calls, finish = extract(one, text, "stop")
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2} and len(calls) == 1
    ts = ToolStream(one)
    deltas = ts.feed(text)[1] + ts.finish("stop")[1]
    assert [d["index"] for d in deltas] == [0]
    bare = {"type": "function", "function": {"name": "now", "parameters": None}}
    named = plan_tools([bare], {"type": "function", "function": {"name": "now"}}, None, True, None)
    assert named.constraint.json == {"type": "object", "properties": {}, "additionalProperties": False}
    units = {"$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}, "type": "object",
             "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}}, "required": ["city"]}
    req = plan_tools([{"type": "function", "function": {"name": "w", "parameters": units}}, ADD], "required",
                     None, True, None).constraint.json
    assert req["$defs"] == units["$defs"] and all("$defs" not in o["properties"]["parameters"]
                                                   for o in req["items"]["anyOf"])
    assert req["items"]["anyOf"][0]["properties"]["parameters"]["additionalProperties"] is False
    clash = {**units, "$defs": {"Unit": {"type": "integer"}}}
    with pytest.raises(APIError) as e:
        plan_tools([{"type": "function", "function": {"name": "w", "parameters": units}},
                    {"type": "function", "function": {"name": "v", "parameters": clash}}], "required", None, True, None)
    assert e.value.param == "tools"
    free = {"type": "object", "properties": {"meta": {"type": "object"}}}      # a free-form object stays free
    got = plan_tools([{"type": "function", "function": {"name": "f", "parameters": free}}],
                     {"type": "function", "function": {"name": "f"}}, None, True, None).constraint.json
    assert got["additionalProperties"] is False and "additionalProperties" not in got["properties"]["meta"]


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": 7}}], "required", "tools"),       # any string is a name (vLLM's)
    ([{"type": "retrieval"}], "required", "tools"),
    ([WEATHER, WEATHER], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "nope"}}], "required", "tools"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
])
def test_plan_rejects_bad_tools(tools, choice, param):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, None, True, "hermes")
    assert e.value.status == 400 and e.value.param == param


def test_auto_needs_the_server_flags():
    with pytest.raises(APIError) as e:
        plan_tools(TOOLS, None, None, False, None)        # tools given: "auto" is the default
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    assert plan_tools(TOOLS, "none", None, False, None).mode == "none"
    assert plan_tools(TOOLS, None, None, True, "hermes").mode == "auto"


def test_template_messages_parse_arguments():
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}])
    assert out[0]["content"] == "" and out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert out[1] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert template_messages([{"role": "user", "content": "hi", "name": None, "extra": 1}]) == [
        {"role": "user", "content": "hi"}]                  # vLLM's fields only (test_chat60)


# ---- through the server ----

@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=256,
              max_num_seqs=8)
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="hermes",
                          chat_template=TEMPLATE)
    with LiveServer(build_app(llm, config)) as server:
        yield server


@pytest.fixture(scope="module")
def ref():
    """Plain decoding of the same model outside the server (expected outputs)."""
    return LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=256)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_ids(ref, messages, tools):
    text = ref.tokenizer.apply_chat_template(template_messages(messages), chat_template=TEMPLATE, tools=tools,
                                             tokenize=False, add_generation_prompt=True)
    return ref.tokenizer.encode(text, add_special_tokens=False)


def _streamed(client, **kw):
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def test_named_call_is_the_constrained_plain_output(client, ref):
    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                         temperature=0)
    msg = out.choices[0].message
    assert msg.content is None and out.choices[0].finish_reason == "stop" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # lossless: the speculative server's call is what plain decoding writes under the same schema
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=WEATHER["function"]["parameters"]))
    plain = ref.generate({"prompt_token_ids": _prompt_ids(ref, MSG, TOOLS)}, params)[0].outputs[0]
    assert call.function.arguments == plain.text
    assert out.usage.prompt_tokens == len(_prompt_ids(ref, MSG, TOOLS))
    content, calls, finish = _streamed(client, model="toy", messages=MSG, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0)
    assert content is None and finish == "stop" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments and calls[0]["id"]


def test_required_calls_follow_the_tools_schemas(client):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = client.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=1.0, seed=4, n=3)
    for ch in out.choices:
        if ch.finish_reason == "length":
            continue
        assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    one = client.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    content, calls, finish = _streamed(client, model="toy", messages=MSG, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    want = one.choices[0].message.tool_calls[0].function
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [(want.name, want.arguments)]


def test_auto_calls_are_parsed_from_the_text(client):
    """The model's own hermes call (steered here by a regex, as the toy model knows no tools):
    the server's parser returns it as a call, streamed or not."""
    regex = r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", "unit": "celsius"\}\}</tool_call>'
    kw = dict(model="toy", messages=MSG, tools=TOOLS, max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    out = client.chat.completions.create(**kw)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    assert ch.message.tool_calls[0].function.name == "get_weather"
    args = json.loads(ch.message.tool_calls[0].function.arguments)
    assert args["unit"] == "celsius" and args["city"].istitle()
    content, calls, finish = _streamed(client, **kw)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ch.message.tool_calls[0].function.arguments)]
    # without a call in the reply: plain text, finish_reason stop or length
    text = client.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, max_tokens=8, temperature=0)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_tool_messages_reach_the_template(client, ref):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out = client.chat.completions.create(model="toy", messages=history, tools=TOOLS, tool_choice="none", max_tokens=6,
                                         temperature=0)
    ids = _prompt_ids(ref, history, TOOLS)
    assert "Oslo" in ref.tokenizer.decode(ids) and "tools: get_weather add" in ref.tokenizer.decode(ids)
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.tool_calls is None
    assert ref.chat_prompt(history, chat_template=TEMPLATE, tools=TOOLS)["prompt_token_ids"] == ids   # LLM.chat's
    plain = ref.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.choices[0].message.content == plain.text


@pytest.mark.parametrize("kw,param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": ["f"]}}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="toy", messages=MSG, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert client.models.list().data


def test_auto_is_refused_without_the_flags():
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
        # "required" needs neither flag: the reply is held to an array of calls. One call at most
        # (parallel_tool_calls false: the array closes after it), so the toy model, which would
        # otherwise go on calling until max_tokens, ends it and the call is taken out
        ok = c.chat.completions.create(model="toy", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=60,
                                       temperature=0, parallel_tool_calls=False)
        (call,) = ok.choices[0].message.tool_calls
        assert ok.choices[0].finish_reason == "tool_calls" and ok.choices[0].message.content is None
        assert call.function.name in {t["function"]["name"] for t in TOOLS}
        assert isinstance(json.loads(call.function.arguments), dict)


def test_pythonic_parser_through_the_server():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=2, max_model_len=128)
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="pythonic")
    with LiveServer(build_app(llm, config)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="toy", messages=MSG, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body={"structured_outputs": {"regex": r'\[get_weather\(city="[A-Z][a-z]{2,6}", unit="celsius"\)\]'}})
        out = c.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        args = json.loads(out.message.tool_calls[0].function.arguments)
        assert out.message.tool_calls[0].function.name == "get_weather" and args["unit"] == "celsius"
        content, calls, finish = _streamed(c, **kw)
        assert (content, finish) == (None, "tool_calls")
        assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", out.message.tool_calls[0].function.arguments)]
        # skip_special_tokens (vLLM's field) reaches the engine: the toy model's <|end|> shows when kept
        kept = c.completions.create(model="toy", prompt="x", max_tokens=3, temperature=0, logit_bias={"3": 100},
                                    extra_body={"skip_special_tokens": False, "ignore_eos": True})
        skipped = c.completions.create(model="toy", prompt="x", max_tokens=3, temperature=0, logit_bias={"3": 100},
                                       extra_body={"ignore_eos": True})
        assert len(kept.choices[0].text) > len(skipped.choices[0].text)


def test_server_flags_are_validated():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="granite")


# ---- vLLM's /tokenize and /detokenize (the same server) ----

def test_tokenize_and_detokenize(live, ref):
    import httpx
    tok = ref.tokenizer
    r = httpx.post(live.url + "/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("def f(x):") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == [tok.id_to_token(i) for i in r["tokens"]]
    plain = httpx.post(live.url + "/tokenize", json={"prompt": "def f(x):", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("def f(x):", add_special_tokens=False) and plain["token_strs"] is None
    # messages: the ids a chat completion is given (its usage counts them), tools rendered by the template
    chat = httpx.post(live.url + "/tokenize", json={"messages": MSG, "tools": TOOLS}).json()
    assert chat["tokens"] == _prompt_ids(ref, MSG, TOOLS)
    back = httpx.post(live.url + "/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back["prompt"] == tok.decode(chat["tokens"], skip_special_tokens=False) and "tools: get_weather" in back["prompt"]
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "x", "messages": MSG}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens")]:
        r = httpx.post(live.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)
    assert httpx.post(live.url + "/detokenize", json={"tokens": "abc"}).status_code == 400


def test_required_with_defs_and_named_without_parameters_through_the_server(client):
    """pydantic's tool schemas ($defs and $ref) under tool_choice required compile and hold;
    a named function without parameters answers {}."""
    jsonschema = pytest.importorskip("jsonschema")
    units = {"$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "type": "object",
             "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "unit": {"$ref": "#/$defs/Unit"}},
             "required": ["city", "unit"]}
    tool = {"type": "function", "function": {"name": "weather", "parameters": units}}
    out = client.chat.completions.create(model="toy", messages=MSG, tools=[tool, ADD], tool_choice="required",
                                         max_tokens=80, temperature=0)
    ch = out.choices[0]
    if ch.finish_reason != "length":
        for call in ch.message.tool_calls:
            schema = units if call.function.name == "weather" else ADD["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            if call.function.name == "weather":
                assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    bare = {"type": "function", "function": {"name": "now"}}
    named = client.chat.completions.create(model="toy", messages=MSG, tools=[bare], max_tokens=20, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.choices[0].message.tool_calls[0].function.arguments == "{}"


NONE_TEST = ("{% if tools is not none %}<|system|>\ntools[{{ tools|length }}]<|end|>\n{% endif %}"
             "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.get('reasoning_content') %}<think>"
             "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_empty_tools_and_earlier_reasoning_reach_the_template():
    """`tools: []` reaches the template as an empty list (vLLM's; a template that tests
    `tools is not none`, as Llama 3.1's, shows its tool preamble): the chat endpoint dropped it
    while /tokenize kept it. An assistant's earlier `reasoning` reaches the template as
    reasoning_content through the server and through LLM.chat alike (LLM.chat dropped it)."""
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "reasoning": "ponder"},
               {"role": "user", "content": "and?"}]
    want = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        template_messages([*history[:1], {**history[1], "reasoning_content": "ponder"}, history[2]]),
        chat_template=NONE_TEST, tools=[], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert "tools[0]" in llm.tokenizer.decode(want) and "<think>ponder</think>yes" in llm.tokenizer.decode(want)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), chat_template=NONE_TEST))) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = c.chat.completions.create(model="toy", messages=history, tools=[], max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens == len(want)
        tok = c.post("/../tokenize", body={"model": "toy", "messages": history, "tools": []}, cast_to=object)
        assert tok["tokens"] == want
        without = c.chat.completions.create(model="toy", messages=history, max_tokens=2, temperature=0)
        assert without.usage.prompt_tokens < len(want)          # no tools: no preamble
    offline = llm.chat(history, SamplingParams(temperature=0, max_tokens=2), chat_template=NONE_TEST, tools=[])
    assert offline[0].prompt_token_ids == want
