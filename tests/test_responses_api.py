"""OpenAI's Responses API (POST /v1/responses) through a real uvicorn server and the official
openai client: the reply equals the chat endpoint's for the same conversation, streamed events
rebuild the same output, function calls and their outputs carry a conversation across turns by
previous_response_id, stored responses can be read and deleted, bad input is a 400 naming the
Responses field. Scripted replies (a fake generation through the real ChatFormat) check what the
toy cannot be made to say: text around calls, replies cut short."""

from __future__ import annotations

import asyncio
import json
import time
import types

import httpx
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
    stored = conversation([{"role": "user", "content": "Add 2 and 3."}], [{**thought, "id": "rs_1"}, {
        "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "5", "logprobs": []}]}])
    reply = chat_request(ResponsesRequest(model="toy", input="ok"), stored).messages[1]
    assert reply.model_dump(exclude_none=True) == {"role": "assistant", "content": "5", "reasoning_content": "need the sum"}
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest(model="toy", input="x", reasoning={"effort": "extreme"}), [])
    assert e.value.status == 400


# scripted replies -----------------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _call(city: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}</tool_call>"


class _Scripted:
    """A generation that emits the given text chunks, one token each."""

    def __init__(self, chunks: list[str], finish: str = "stop"):
        self.chunks, self.finish = chunks, finish
        self.prompts, self.stats, self.per_prompt, self.prediction = [[1, 2, 3]], [], 1, None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def steps(self):
        for i, text in enumerate(self.chunks):
            last = i == len(self.chunks) - 1
            yield 0, types.SimpleNamespace(text=text, token_ids=[1], logprobs=[], finished=last,
                                           finish_reason=self.finish if last else None, stop_reason=None)


def _both(chunks: list[str], finish: str = "stop", reasoning: str | None = None) -> tuple[dict, dict]:
    """(the non-streamed response, the streamed one's final body) of one scripted reply (hermes calls)."""
    from specdec.server.responses import ChatFormat
    from specdec.server.responses_api import ResponsesRequest, respond, stream
    from specdec.server.tools import plan_tools
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_TARGET)
    fmt = lambda: ChatFormat(tok, False, False, "assistant", [1, 2, 3], plan_tools(WEATHER, None, None, True, "hermes"),
                             reasoning)
    req = ResponsesRequest.model_validate({"input": "hi", "tools": [{"type": "function", "name": "get_weather"}]})
    whole, _ = asyncio.run(respond(_Scripted(chunks, finish), fmt(), req, "toy", "resp_1"))

    async def events():
        return [json.loads(e.split("data: ", 1)[1])
                async for e in stream(_Scripted(chunks, finish), fmt(), req, "toy", "resp_2", lambda body: None)]
    return whole, asyncio.run(events())[-1]["response"]


def _shape(items: list[dict]) -> list[tuple]:
    return [(i["type"], i["status"], i["content"][0]["text"] if i["type"] in ("message", "reasoning")
             else (i["name"], i["arguments"])) for i in items]


def test_items_in_generation_order_streamed_or_not():
    """Text around calls: a message item for each stretch, in the order generated, streamed or
    not (the non-streamed reply joined the text into one message before the calls)."""
    whole, streamed = _both(["Let me check. ", _call("Oslo"), " And then ", _call("Rome"), " Done."])
    expected = [("message", "completed", "Let me check. "), ("function_call", "completed", ("get_weather", '{"city": "Oslo"}')),
                ("message", "completed", " And then "), ("function_call", "completed", ("get_weather", '{"city": "Rome"}')),
                ("message", "completed", " Done.")]
    assert _shape(whole["output"]) == _shape(streamed["output"]) == expected
    whole, streamed = _both([_call("Oslo"), " ok"])
    assert [i["type"] for i in whole["output"]] == [i["type"] for i in streamed["output"]] == ["function_call", "message"]
    assert whole["usage"] == streamed["usage"]


def test_a_cut_reply_leaves_only_its_last_item_incomplete():
    """max_output_tokens cuts the last item; what came before it is done, as the stream closes
    each item when the next begins."""
    whole, streamed = _both(["think</think>", "answer ", _call("Oslo")], "length", "deepseek_r1")
    assert _shape(whole["output"]) == _shape(streamed["output"])
    assert [i["status"] for i in whole["output"]] == ["completed", "completed", "incomplete"]
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    whole, _ = _both(["think", " more"], "length", "deepseek_r1")
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "incomplete")]


def test_output_items_sent_back_mean_what_previous_response_id_means():
    """A reply of text and a call: its stored conversation and its output items sent back by hand
    give one prompt, the text and the call in one assistant turn (by hand gave two turns)."""
    from specdec.server.responses_api import ResponsesRequest, chat_request, conversation

    whole, _ = _both(["Let me check.", _call("Oslo")])
    turn = [{"role": "user", "content": "Weather in Oslo?"}]
    output = [{"type": "function_call_output", "call_id": whole["output"][1]["call_id"], "output": "Sunny"}]
    chained = chat_request(ResponsesRequest(input=output), conversation(turn, whole["output"]))
    by_hand = chat_request(ResponsesRequest(input=turn + whole["output"] + output), [])
    dump = lambda chat: [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dump(chained) == dump(by_hand)
    assert [m["role"] for m in dump(by_hand)] == ["user", "assistant", "tool"]
    assert dump(by_hand)[1]["content"] == "Let me check." and len(dump(by_hand)[1]["tool_calls"]) == 1


def test_function_call_output_as_text_parts():
    """OpenAI's output: a string or a list of input_text parts (their text, one per line, as a
    chat tool message's parts); any other part is a 400 naming the item."""
    from specdec.server.errors import APIError
    from specdec.server.responses_api import ResponsesRequest, input_messages

    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    parts = [{"type": "input_text", "text": "Sunny,"}, {"type": "input_text", "text": "21 C"}]
    got = input_messages(ResponsesRequest(input=[call, {"type": "function_call_output", "call_id": "c1",
                                                        "output": parts}]))
    assert got[-1] == {"role": "tool", "tool_call_id": "c1", "content": "Sunny,\n21 C"}
    for output in ([{"type": "input_image", "image_url": "x"}], {"a": 1}, None):
        with pytest.raises(APIError) as e:
            input_messages(ResponsesRequest(input=[call, {"type": "function_call_output", "call_id": "c1",
                                                          "output": output}]))
        assert e.value.status == 400 and e.value.message.startswith("input[1].output"), e.value.message


@pytest.mark.parametrize("bad", [dict(summary=[{"type": "summary_text", "text": 5}]),
                                 dict(content=[{"type": "reasoning_text", "text": None}]),
                                 dict(content=True), dict(summary=1.5), dict(content=["x"])])
def test_a_malformed_reasoning_item_is_a_400(client, bad):
    item = {"type": "reasoning", "summary": [], **bad}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="toy", input=[{"role": "user", "content": "x"}, item], stream=stream,
                                    max_output_tokens=2)
        assert e.value.body["param"] == "input" and e.value.body["message"].startswith("input[1]."), e.value.body


def test_tool_choice_auto_without_tools_is_no_tools(client):
    plain = client.responses.create(model="toy", input="def f(x):", max_output_tokens=6, temperature=0)
    for kw in (dict(tool_choice="auto"), dict(tool_choice="auto", tools=[])):
        r = client.responses.create(model="toy", input="def f(x):", max_output_tokens=6, temperature=0, **kw)
        assert r.output_text == plain.output_text and r.usage.input_tokens == plain.usage.input_tokens


def test_max_output_tokens_past_the_context_is_capped(client):
    """vLLM's: capped at what the context (256) leaves; the reply ends incomplete (was a 400)."""
    r = client.responses.create(model="toy", input="x", max_output_tokens=5000, temperature=0,
                                extra_body={"ignore_eos": True})
    room = 256 - r.usage.input_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == room and r.max_output_tokens == room


@pytest.mark.parametrize("kw,param", [(dict(include=["bogus"]), "include"), (dict(truncation="bogus"), "truncation"),
                                      (dict(background=True, store=False), "background")])
def test_include_truncation_and_background_are_checked(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", input="x", max_output_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_truncation_and_include_values_are_accepted_and_echoed(client):
    r = client.responses.create(model="toy", input="x", max_output_tokens=2, truncation="auto",
                                include=["reasoning.encrypted_content"])
    assert r.truncation == "auto" and r.background is False
    assert client.responses.create(model="toy", input="x", max_output_tokens=2).truncation == "disabled"


def test_background_runs_after_the_answer(client, live):
    """vLLM's background mode: queued at once, read by id until done; the same reply as in the
    foreground; cancel stops a running one and is a 400 for any other (vLLM's message)."""
    kw = dict(model="toy", input="def parse(data):", max_output_tokens=12, temperature=0)
    fore = client.responses.create(**kw)
    r = client.responses.create(background=True, **kw)
    assert r.status in ("queued", "in_progress") and r.background is True and r.output == []
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status == fore.status and got.output_text == fore.output_text and got.id == r.id
    for rid, status in ((r.id, 400), (fore.id, 400), ("resp_nope", 404)):
        assert httpx.post(f"{live.url}/v1/responses/{rid}/cancel").status_code == status
    # the stored background response continues a conversation as any other
    nxt = client.responses.create(model="toy", input="more", previous_response_id=r.id, max_output_tokens=2)
    assert nxt.usage.input_tokens > fore.usage.input_tokens


def test_cancel_stops_a_background_response():
    """Cancelled while it runs: its work is cancelled (the engine request with it), it is kept
    "cancelled"; one cancelled or finished is a 400 to cancel; deleting one stops it too."""
    from specdec.server.errors import APIError
    from specdec.server.responses_api import Background, ResponseStore

    async def scenario():
        store = ResponseStore()
        runs = Background(store)
        stopped = []

        async def work(started):
            started()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                stopped.append(True)
                raise
        queued = {"id": "resp_1", "status": "queued", "output": []}
        assert runs.start("resp_1", [{"role": "user", "content": "x"}], queued, work)["status"] == "queued"
        await asyncio.sleep(0)
        assert json.loads(store.get("resp_1")[1])["status"] == "in_progress"
        assert (await runs.cancel("resp_1"))["status"] == "cancelled" and stopped == [True]
        assert json.loads(store.get("resp_1")[1])["status"] == "cancelled"
        with pytest.raises(APIError) as e:
            await runs.cancel("resp_1")
        assert e.value.status == 400

        async def quick(started):
            return {"id": "resp_2", "status": "completed", "output": []}
        runs.start("resp_2", [], {"id": "resp_2", "status": "queued", "output": []}, quick)
        await asyncio.sleep(0.01)
        assert json.loads(store.get("resp_2")[1])["status"] == "completed" and not runs.tasks
        with pytest.raises(APIError) as e:
            await runs.cancel("resp_2")
        assert e.value.status == 400
        runs.start("resp_3", [], {"id": "resp_3", "status": "queued", "output": []}, work)
        await asyncio.sleep(0)
        await runs.stop("resp_3")
        assert stopped == [True, True] and not runs.tasks
    asyncio.run(scenario())


def test_a_response_carries_speculative(client):
    """Like every response of this server (README), a Responses reply carries the request's
    speculative statistics."""
    r = client.responses.create(model="toy", input="def add(a, b):", max_output_tokens=8, temperature=0)
    spec = r.model_extra["speculative"]
    assert spec["prompt_tokens"] == r.usage.input_tokens and spec["output_tokens"] == r.usage.output_tokens
    assert spec["num_drafts"] > 0
