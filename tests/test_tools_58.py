"""Tool calling as vLLM does it, a tester's findings (tools58): the official SDK's stream helper
fires tool_calls.function.arguments.done for every call (a call sent with the finishing step
had none: required calls always, hermes calls whose closing tag and end token one speculative
step accepted); --exclude-tools-when-tool-choice-none leaves the tools out of a "none" prompt;
tool names are any string (vLLM checks none: `mcp.github.create_issue`, `ns:tool`, > 64
characters); an earlier call's arguments "" or left out reach the chat template as {}."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.cli import parse_args, server_config
from specdec.server.errors import APIError
from specdec.server.tools import extract, plan_tools
from specdec.tokenizer import template_messages

from test_server import LiveServer

# a Hermes-style template: the tools, earlier calls with their arguments as JSON
TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}<|end|>\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }} "
            "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MSG = [{"role": "user", "content": "What is the weather in Oslo?"}]


class add(BaseModel):
    a: Literal[1, 2]
    b: Literal[1, 2]


class get_weather(BaseModel):
    city: Literal["Oslo", "Rome"]


STRICT = [openai.pydantic_function_tool(add), openai.pydantic_function_tool(get_weather)]
ONE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TWO = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
       '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')


@pytest.fixture(scope="module")
def live():
    # speculative, as the tester's server: a step may accept </tool_call> and the end token together
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=512,
              max_num_seqs=4)
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="hermes",
                          chat_template=TEMPLATE, exclude_tools_when_tool_choice_none=True)
    with LiveServer(build_app(llm, config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- 1. the SDK's stream helper: one arguments.done event per call ----

@pytest.mark.parametrize("case,kw", [
    ("named", dict(tool_choice={"type": "function", "function": {"name": "add"}})),
    ("required", dict(tool_choice="required", parallel_tool_calls=False)),
    ("hermes one call", dict(extra_body={"structured_outputs": {"regex": re.escape(ONE)}})),
    ("hermes two calls", dict(extra_body={"structured_outputs": {"regex": re.escape(TWO)}})),
])
def test_stream_helper_fires_arguments_done_for_every_call(client, case, kw):
    with client.chat.completions.stream(model="toy", messages=MSG, tools=STRICT, temperature=0, max_tokens=120,
                                        **kw) as s:
        done = [(e.name, e.arguments) for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    calls = [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls or []]
    assert calls and done == calls, case
    assert final.choices[0].finish_reason == ("stop" if case == "named" else "tool_calls")
    if case.startswith("hermes"):
        assert [n for n, _ in calls] == (["get_weather"] if case == "hermes one call" else ["get_weather", "add"])


def test_the_finish_reason_follows_the_calls_in_a_chunk_of_its_own(live):
    body = dict(model="toy", messages=MSG, tools=STRICT, tool_choice="required", parallel_tool_calls=False,
                max_tokens=120, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = []
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    with_calls = [c for c in choices if c["delta"].get("tool_calls")]
    assert with_calls and all(c["finish_reason"] is None for c in with_calls)
    last = choices[-1]
    assert last["delta"] == {} and last["finish_reason"] == "tool_calls"
    assert "speculative" in [c for c in chunks if c["choices"]][-1]          # the choice's last chunk's stats


# ---- 2. --exclude-tools-when-tool-choice-none ----

def test_exclude_tools_when_tool_choice_none(client):
    def prompt_tokens(**kw):
        return client.chat.completions.create(model="toy", messages=MSG, max_tokens=1, **kw).usage.prompt_tokens
    bare = prompt_tokens()
    assert prompt_tokens(tools=STRICT, tool_choice="none") == bare             # left out of the template
    assert prompt_tokens(tools=STRICT, tool_choice="required", parallel_tool_calls=False) > bare


def test_exclude_tools_flag_is_specdecs_own():
    args, ignored = parse_args(["m", "--exclude-tools-when-tool-choice-none"])
    assert ignored == [] and server_config(args).exclude_tools_when_tool_choice_none
    assert not server_config(parse_args(["m"])[0]).exclude_tools_when_tool_choice_none
    assert not server_config(parse_args(["m", "--no-exclude-tools-when-tool-choice-none"])[0]) \
        .exclude_tools_when_tool_choice_none


def test_tools_reach_a_none_prompt_without_the_flag():
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=256)
    config = ServerConfig(served_model_names=("toy",), chat_template=TEMPLATE)
    with LiveServer(build_app(llm, config)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        n = [c.chat.completions.create(model="toy", messages=MSG, max_tokens=1, **kw).usage.prompt_tokens
             for kw in (dict(tools=STRICT, tool_choice="none"), {})]
        assert n[0] > n[1]


# ---- 3. tool names: any string, as vLLM ----

NAMES = ["mcp.github.create_issue", "ns:tool", "a" * 65, "has space"]


@pytest.mark.parametrize("name", NAMES)
def test_tool_names_vllm_accepts(client, name):
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}]
    # greedy: an unseeded sampled first token could be EOS ("stop"), which says nothing about the name
    out = client.chat.completions.create(model="toy", messages=MSG, tools=tools, tool_choice="none", max_tokens=1,
                                         temperature=0)
    assert out.choices[0].finish_reason == "length"
    for choice in ({"type": "function", "function": {"name": name}}, "required"):
        out = client.chat.completions.create(model="toy", messages=MSG, tools=tools, tool_choice=choice, max_tokens=40,
                                             temperature=0, parallel_tool_calls=False)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == name and json.loads(call.function.arguments)["x"] in (1, 2)


def test_a_dotted_name_through_the_parsers(client):
    tools = [{"type": "function", "function": {"name": "mcp.github.create_issue", "parameters": {"type": "object"}}}]
    text = '<tool_call>{"name": "mcp.github.create_issue", "arguments": {"title": "x"}}</tool_call>'
    out = client.chat.completions.create(model="toy", messages=MSG, tools=tools, max_tokens=60, temperature=0,
                                         extra_body={"structured_outputs": {"regex": re.escape(text)}})
    assert [(t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls] == [
        ("mcp.github.create_issue", '{"title": "x"}')]
    # Mistral's v11 calls, name[ARGS]{args}: the name is what precedes the arguments
    plan = plan_tools(tools, "auto", None, True, "mistral")
    _, calls, finish = extract(plan, '[TOOL_CALLS]mcp.github.create_issue[ARGS]{"title": "x"}', "stop")
    assert [c["function"]["name"] for c in calls] == ["mcp.github.create_issue"] and finish == "tool_calls"


def test_names_must_be_strings():
    assert plan_tools([{"type": "function", "function": {"name": ""}}], "none", None, False, None).mode == "none"
    for bad in (None, 3):
        with pytest.raises(APIError) as e:
            plan_tools([{"type": "function", "function": {"name": bad}}], "none", None, False, None)
        assert e.value.status == 400 and e.value.param == "tools"


# ---- 4. an earlier call's arguments "" or left out: {} in the template ----

def test_empty_history_arguments_are_an_empty_object(live):
    for fn in ({"name": "f", "arguments": ""}, {"name": "f"}, {"name": "f", "arguments": None}):
        out = template_messages([{"role": "assistant", "content": None,
                                  "tool_calls": [{"id": "c1", "type": "function", "function": fn}]}])
        assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}
    for fn in ({"name": "add", "arguments": ""}, {"name": "add"}):
        msgs = MSG + [{"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c1", "type": "function", "function": fn}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "3"}]
        ids = httpx.post(live.url + "/tokenize", json={"model": "toy", "messages": msgs}).json()["tokens"]
        text = httpx.post(live.url + "/detokenize", json={"model": "toy", "tokens": ids}).json()["prompt"]
        assert "<tool_call>add {}</tool_call>" in text, text
