"""OpenAI's Responses API (POST /v1/responses) through a real uvicorn server and the official
openai client: the reply equals the chat endpoint's for the same conversation, streamed events
rebuild the same output, function calls and their outputs carry a conversation across turns by
previous_response_id, stored responses can be read and deleted, bad input is a 400 naming the
Responses field."""

from __future__ import annotations

import json

import openai
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_server import LiveServer
from test_structured import SCHEMA

ADD = {"type": "function", "name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=256,
              max_num_seqs=8)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_equals_the_chat_endpoint(client):
    r = client.responses.create(model="toy", input="def parse(data):", instructions="Write Python.",
                                max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model="toy", max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Write Python."}, {"role": "user", "content": "def parse(data):"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "toy"
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_stream_rebuilds_the_same_output(client):
    kw = dict(model="toy", input=[{"role": "user", "content": [{"type": "input_text", "text": "import os\n"}]}],
              max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_function_calls_across_turns(client, live):
    import httpx
    first = client.responses.create(model="toy", input="Add 2 and 3.", tools=[ADD], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"a", "b"}
    # the next turn sends only the tool's output; the stored conversation supplies the rest
    second = client.responses.create(model="toy", previous_response_id=first.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "5"}], tools=[ADD], tool_choice="none")
    # the same conversation sent whole to the chat endpoint: the same prompt and reply
    chat = client.chat.completions.create(model="toy", max_tokens=8, temperature=0, tools=[
        {"type": "function", "function": {k: ADD[k] for k in ("name", "description", "parameters")}}],
        tool_choice="none", messages=[
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "add", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "5"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.output_text == chat.choices[0].message.content
    # stored responses: read back, then forgotten
    got = httpx.get(f"{live.url}/v1/responses/{second.id}").json()
    assert got["id"] == second.id and got["output"][0]["content"][0]["text"] == second.output_text
    assert httpx.delete(f"{live.url}/v1/responses/{first.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="toy", previous_response_id=first.id, input="again", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="toy", input="x", store=False, max_output_tokens=2)
    assert httpx.get(f"{live.url}/v1/responses/{unstored.id}").status_code == 404


def test_streamed_function_call(client):
    kw = dict(model="toy", input="Add 2 and 3.", tools=[ADD], tool_choice={"type": "function", "name": "add"},
              max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == whole.output[0].arguments == done[0].arguments and done[0].name == "add"
    assert events[-1].response.output[0].name == "add"


def test_json_schema_text_format(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.responses.create(model="toy", input="def parse(data):", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize("kw,param", [
    (dict(input=[{"type": "image_generation_call"}]), "input"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input"),
    (dict(input="x", max_output_tokens=10**6), "max_output_tokens"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), "text"),
    (dict(input="x", temperature=-1), "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", **kw)
    assert e.value.body["param"] == param, e.value.body


def test_errors_and_fields_in_the_responses_apis_own_names(client, live):
    """Messages name the Responses API's fields, a lookup by id names none, created_at is Unix seconds."""
    import httpx

    for kw, word in [(dict(input="x", max_output_tokens=0), "max_output_tokens"), (dict(input=[]), "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="toy", **kw)
        assert e.value.body["message"].startswith(word), e.value.body
    got = httpx.get(f"{live.url}/v1/responses/resp_nope").json()["error"]
    assert got["param"] is None and got["code"] == "response_not_found"
    body = httpx.post(f"{live.url}/v1/responses", json={"model": "toy", "input": "x", "max_output_tokens": 2}).json()
    assert isinstance(body["created_at"], int)       # the openai client reads it as a float either way


def test_reasoning_items_and_effort_reach_the_chat_request():
    """A reasoning item sent back before a function call (or an assistant message) becomes that
    turn's reasoning_content (gpt-oss's template keeps a call's analysis), one no assistant turn
    follows is an assistant turn of its own (as a stored reply keeps it); a stored reply keeps
    its reasoning; reasoning.effort is the template's reasoning_effort, and a bad one a 400."""
    from specdec.server.errors import APIError
    from specdec.server.responses_api import ResponsesRequest, chat_request, conversation

    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "need the sum"}], "summary": []}
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    req = ResponsesRequest(model="toy", reasoning={"effort": "low"}, input=[
        {"role": "user", "content": "Add 2 and 3."}, thought, call,
        {"type": "function_call_output", "call_id": "c1", "output": "5"}, thought, {"role": "user", "content": "ok"}])
    chat = chat_request(req, [])
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs[1]["reasoning_content"] == "need the sum" and msgs[1]["tool_calls"][0]["id"] == "c1"
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "user"]
    assert msgs[3] == {"role": "assistant", "content": "", "reasoning_content": "need the sum"}
    assert "reasoning_content" not in msgs[2] and "reasoning_content" not in msgs[4] and chat.reasoning_effort == "low"
    reply = conversation([], [{**thought, "id": "rs_1"}, {"type": "message", "content": [{"type": "output_text", "text": "5"}]}])
    assert reply[-1] == {"role": "assistant", "content": "5", "reasoning_content": "need the sum"}
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest(model="toy", input="x", reasoning={"effort": "extreme"}), [])
    assert e.value.status == 400


def test_a_cut_reply_leaves_only_its_last_item_incomplete():
    """max_output_tokens cuts the last item; what came before it is done, as the stream closes
    each item when the next begins (the non-streamed reply marked every item incomplete)."""
    from specdec.server.responses_api import output_items

    msg = {"reasoning_content": "think", "content": "answer",
           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert [i["status"] for i in output_items(msg, "length")] == ["completed", "completed", "incomplete"]
    assert [i["status"] for i in output_items({"reasoning_content": "think"}, "length")] == ["incomplete"]
    assert {i["status"] for i in output_items(msg, "stop")} == {"completed"}
