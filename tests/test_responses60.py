"""A tester's findings on the Responses API (resp60), through the official openai client against
a live server, bodies and events checked strictly with the client's own pydantic types: a
reasoning item's part comes in content_part.added / .done as a message's does (vLLM's
simple_streaming_events); GET /v1/responses/{id}/input_items lists a stored response's input
items as OpenAI pages them; usage carries input_tokens_details.cache_write_tokens; a json_schema
format needs its name, a message item its content; top_logprobs errors say top_logprobs;
tool_choice allowed_tools restricts the callable tools; text without format echoes the default."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_responses_api import ADD, _Scripted
from test_server import LiveServer

EVENT = TypeAdapter(ResponseStreamEvent)
MUL = {**ADD, "name": "mul", "description": "Multiply two numbers"}
# the toy's template, with the tools' names written first
TEMPLATE = ("{{ bos_token }}{% for t in tools or [] %}<tool {{ t['function']['name'] }}>\n{% endfor %}"
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _serve(**config):
    llm = LLM(BUNDLED_TARGET, max_model_len=256)
    return LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), **config)))


@pytest.fixture(scope="module")
def live():
    with _serve(enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _sse(url: str, body: dict) -> list[dict]:
    """The events of a streamed response, each checked as the openai client's ResponseStreamEvent."""
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENT.validate_python(e, strict=True)
    return events


def _post(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", json={"model": "toy", "max_output_tokens": 4, **body}, timeout=120)


# 1: a reasoning item's part opens and closes as a message's ---------------------------------------

def test_a_streamed_reasoning_item_opens_and_closes_its_part():
    """deepseek_r1: the toy never closes its think block, so the reply is one reasoning item."""
    body = dict(model="toy", input="def f(x):", max_output_tokens=8, temperature=0)
    with _serve(reasoning_parser="deepseek_r1") as server:
        events = _sse(server.url, body)
        whole = httpx.post(server.url + "/v1/responses", json=body, timeout=120).json()
    item = [e for e in events if e.get("output_index") == 0]
    kinds = [e["type"] for e in item]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas > 0 and kinds == ["response.output_item.added", "response.content_part.added",
                                    *["response.reasoning_text.delta"] * deltas, "response.reasoning_text.done",
                                    "response.content_part.done", "response.output_item.done"]
    text = "".join(e["delta"] for e in item if e["type"] == "response.reasoning_text.delta")
    assert item[0]["item"]["type"] == "reasoning" and item[0]["item"]["content"] == []
    assert item[1]["part"] == {"type": "reasoning_text", "text": ""} and item[1]["content_index"] == 0
    assert item[-2]["part"] == {"type": "reasoning_text", "text": text} and item[-2]["content_index"] == 0
    assert item[-1]["item"]["content"] == [{"type": "reasoning_text", "text": text}]
    final = Response.model_validate(events[-1]["response"], strict=True)
    whole = Response.model_validate(whole, strict=True)
    assert [(o.type, o.status, o.content[0].text) for o in final.output] == \
        [(o.type, o.status, o.content[0].text) for o in whole.output] == [("reasoning", "incomplete", text)]


def test_reasoning_then_message_parts_in_order():
    """A reasoning item then a message (scripted deepseek_r1 reply): each part opens after its
    item and closes before it, with content_index 0, every event one of the client's types."""
    from specdec.server.responses import ChatFormat
    from specdec.server.responses_api import ResponsesRequest, stream
    from specdec.tokenizer import Tokenizer

    fmt = ChatFormat(Tokenizer(BUNDLED_TARGET), False, False, "assistant", [1, 2, 3], None, "deepseek_r1")

    async def events():
        return [json.loads(e.split("data: ", 1)[1]) async for e in stream(
            _Scripted(["think</think>", "answer"]), fmt, ResponsesRequest(input="hi"), "toy", "resp_1", lambda b: None)]
    got = asyncio.run(events())
    for e in got:
        EVENT.validate_python(e, strict=True)
    assert [(e["type"], e.get("output_index")) for e in got if "delta" not in e["type"]] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.done", 1),
        ("response.content_part.done", 1), ("response.output_item.done", 1), ("response.completed", None)]


# 2: GET /v1/responses/{id}/input_items ----------------------------------------------------------

def test_input_items_are_listed_and_paged_as_openai(client, live):
    first = client.responses.create(model="toy", input="one", max_output_tokens=2, temperature=0)
    second = client.responses.create(model="toy", previous_response_id=first.id, max_output_tokens=2, temperature=0,
                                     input=[{"role": "user", "content": "two"},
                                            {"type": "message", "role": "developer",
                                             "content": [{"type": "input_text", "text": "three"}]}])
    raw = httpx.get(f"{live.url}/v1/responses/{second.id}/input_items", timeout=60).json()
    listed = ResponseItemList.model_validate(raw, strict=True)
    # the conversation it was made from, newest first: its input, then the first turn's output and input
    texts = [(i.type, i.role, i.content[0].text) for i in listed.data]
    assert texts == [("message", "developer", "three"), ("message", "user", "two"),
                     ("message", "assistant", first.output_text), ("message", "user", "one")]
    assert listed.data[2].id == first.output[0].id and len({i.id for i in listed.data}) == 4
    assert (listed.first_id, listed.last_id, listed.has_more) == (listed.data[0].id, listed.data[-1].id, False)
    # the client's pages (limit, after, order asc, include[]) give the same items, oldest first
    paged = client.responses.input_items.list(second.id, limit=1, order="asc", include=["message.output_text.logprobs"])
    assert [i.id for i in paged] == [i.id for i in reversed(listed.data)]
    page = client.responses.input_items.list(second.id, limit=2, after=listed.data[0].id)
    assert [i.id for i in page.data] == [i.id for i in listed.data[1:3]] and page.has_more
    # the first response's: its own input only; stable ids
    assert [i.id for i in client.responses.input_items.list(first.id)] == [listed.data[-1].id]


def test_input_items_refusals(client, live):
    r = client.responses.create(model="toy", input="x", max_output_tokens=2)
    for missing in ("resp_nope", client.responses.create(model="toy", input="x", max_output_tokens=2, store=False).id):
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(missing)
    for query, param in ((dict(limit=0), "limit"), (dict(limit=101), "limit"), (dict(order="up"), "order"),
                         (dict(after="msg_nope"), "after"), ({"include[]": "bad"}, "include")):
        got = httpx.get(f"{live.url}/v1/responses/{r.id}/input_items", params=query, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (query, got.text)


# 3: usage.input_tokens_details.cache_write_tokens ----------------------------------------------

def test_usage_is_the_clients_strict_response_usage(live):
    body = {"model": "toy", "input": "def f(x):", "max_output_tokens": 4}
    whole = Response.model_validate(_post(live, **body).json(), strict=True)
    done = _sse(live.url, body)[-1]
    streamed = Response.model_validate(done["response"], strict=True)
    assert whole.usage.input_tokens_details.cache_write_tokens == 0 == \
        streamed.usage.input_tokens_details.cache_write_tokens


# 4: validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, says", [
    (dict(input="hi", text={"format": {"type": "json_schema", "schema": {"type": "object"}}}), "text",
     "text.format.name is required"),
    (dict(input=[{"type": "message", "role": "user"}]), "input", "input[0].content is required"),
    (dict(input="hi", top_logprobs=21, include=["message.output_text.logprobs"]), "top_logprobs",
     "top_logprobs must be at most 20"),
    (dict(input="hi", tools=[ADD], tool_choice={"type": "file_search"}), "tool_choice",
     'tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} or {"type": "allowed_tools"'),
    (dict(input="hi", tools=[ADD], tool_choice={"type": "allowed_tools", "mode": "auto",
                                                "tools": [{"type": "function", "name": "mul"}]}),
     "tool_choice.tools", "tool_choice.tools[0] names 'mul', which is not one of the tools"),
    (dict(input="hi", tools=[ADD], tool_choice={"type": "allowed_tools", "mode": "none", "tools": []}),
     "tool_choice.mode", 'tool_choice.mode must be "auto" or "required"'),
])
def test_responses_fields_are_checked_in_their_own_words(client, body, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", max_output_tokens=4, **body)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(says), e.value.body


def test_allowed_tools_restrict_the_calls(client):
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "mul"}]}
    r = client.responses.create(model="toy", input="Add 2 and 3.", tools=[ADD, MUL], tool_choice=allowed,
                                parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "mul")]
    assert json.loads(r.output[0].arguments).keys() == {"a", "b"}
    assert r.tool_choice.type == "allowed_tools" and [t.name for t in r.tools] == ["add", "mul"]
    # the prompt shows the tools it allows, as sending only those (the template writes each tool)
    kw = dict(model="toy", input="Add 2 and 3.", max_output_tokens=1)
    auto = client.responses.create(tools=[ADD, MUL], tool_choice={**allowed, "mode": "auto"}, **kw)
    only = client.responses.create(tools=[MUL], **kw)
    both = client.responses.create(tools=[ADD, MUL], **kw)
    assert auto.usage.input_tokens == only.usage.input_tokens < both.usage.input_tokens


def test_text_without_format_echoes_the_default_format(live):
    r = Response.model_validate(_post(live, input="hi", text={"verbosity": "low"}).json(), strict=True)
    assert r.text.format.type == "text" and r.text.verbosity == "low"
