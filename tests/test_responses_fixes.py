"""A tester's findings on the Responses API and the chat request surface (#3-#11), each checked
through the official openai client where a client sees it: the stream's error event is OpenAI's
ResponseErrorEvent; a message arrives with no parts and gets its one part in content_part.added;
vLLM's Responses sampling fields and output logprobs take effect; chat `documents` reach the
template; a reasoning-only turn is kept alike by previous_response_id and by hand; text parts are
joined as on the chat path; errors name the Responses fields; the reply echoes the sampling values
used and counts reasoning tokens; a text part without text is a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

from test_server import LiveServer

# the toy's template, with vLLM's RAG documents written before the messages
TEMPLATE = ("{{ bos_token }}{% for d in documents or [] %}<doc {{ d['title'] }}: {{ d['text'] }}>\n{% endfor %}"
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=256,
              max_num_seqs=4)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), chat_template=TEMPLATE))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model="toy", messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


# 3 ---------------------------------------------------------------------------------------------

def test_stream_error_event_is_openais_response_error_event():
    """An error after the stream began (the engine refusing the request, a shutdown's 503) is
    OpenAI's ResponseErrorEvent: "type": "error" (it was the error body's "invalid_request_error")."""
    from openai.types.responses import ResponseErrorEvent, ResponseStreamEvent
    from pydantic import TypeAdapter

    from specdec.server.errors import APIError
    from specdec.server.responses_api import ResponsesRequest, stream

    class Refused:
        prompts, stats = [[1, 2, 3]], []

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        async def steps(self):
            raise APIError(400, "prompt is too long", "input")
            yield                                   # unreachable: makes steps an async generator

    async def events():
        req = ResponsesRequest.model_validate({"input": "hi"})
        return [chunk async for chunk in stream(Refused(), None, req, "toy", "resp_1", lambda body: None)]

    chunks = asyncio.run(events())
    assert chunks[-1].startswith("event: error\n")
    data = json.loads(chunks[-1].split("data: ", 1)[1])
    event = TypeAdapter(ResponseStreamEvent).validate_python(data)
    assert isinstance(event, ResponseErrorEvent)
    assert (event.type, event.message, event.param, event.sequence_number) == \
        ("error", "prompt is too long", "input", 2)


# 4 ---------------------------------------------------------------------------------------------

def test_message_is_added_without_parts_and_accumulates_one(client):
    """output_item.added carries the message with content [] (OpenAI's and vLLM's), its part
    comes in content_part.added: the openai client's responses.stream() accumulates one part."""
    kw = dict(model="toy", input="def parse(data):", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as st:
        events = list(st)
        accumulated = st._state._output_items[0]        # the client's own snapshot of the stream
    added = [e.item for e in events if e.type == "response.output_item.added"]
    final = events[-1].response                           # response.completed or .incomplete
    assert added[0].type == "message" and added[0].content == []
    assert [(p.type, p.text) for p in accumulated.content] == [("output_text", whole.output_text)]
    assert [(p.type, p.text) for p in final.output[0].content] == [("output_text", whole.output_text)]


# 5 ---------------------------------------------------------------------------------------------

def test_vllms_sampling_fields_reach_the_chat_request():
    """Each field vLLM's ResponsesRequest.to_sampling_params passes is passed on (all were dropped)."""
    from specdec.server.responses_api import ResponsesRequest, chat_request

    given = dict(stop=[","], logit_bias={"5": -100.0}, frequency_penalty=0.5, presence_penalty=0.25,
                 repetition_penalty=1.2, ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True)
    chat = chat_request(ResponsesRequest(input="x", **given), [])
    assert {k: getattr(chat, k) for k in given} == given
    assert not chat.logprobs          # top_logprobs without the include: no logprobs (vLLM's rule)
    assert not chat_request(ResponsesRequest(input="x", top_logprobs=3), []).logprobs
    chat = chat_request(ResponsesRequest(input="x", top_logprobs=3, include=LOGPROBS), [])
    assert chat.logprobs and chat.top_logprobs == 3


def test_stop_and_logit_bias_act_as_on_the_chat_endpoint(client, live):
    prompt = "def parse(data):"
    plain = _chat(client, prompt, max_tokens=16).choices[0].message.content
    stop = plain.strip()[2:4]
    first = httpx.post(f"{live.url}/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"][0]
    assert stop and stop in plain
    for extra in ({"stop": [stop]}, {"logit_bias": {str(first): -100.0}}, {"frequency_penalty": 2.0}):
        chat = _chat(client, prompt, max_tokens=16, extra_body=extra).choices[0].message.content
        r = client.responses.create(model="toy", input=prompt, max_output_tokens=16, temperature=0, extra_body=extra)
        assert r.output_text == chat, extra
        if "frequency_penalty" not in extra:
            assert chat != plain, extra          # the field does change the reply here


def test_output_text_logprobs_streamed_and_not(client):
    """top_logprobs with include ["message.output_text.logprobs"]: the output_text part carries
    OpenAI's Logprob objects, one per token, as the chat endpoint scores them; streamed, the
    deltas carry them and add up to the same list; top_logprobs is echoed."""
    kw = dict(model="toy", input="def parse(data):", max_output_tokens=10, temperature=0, top_logprobs=2,
              include=LOGPROBS)
    r = client.responses.create(**kw)
    chat = _chat(client, "def parse(data):", max_tokens=10, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    part = r.output[0].content[0]
    assert r.top_logprobs == 2 and len(part.logprobs) == r.usage.output_tokens == len(chat)
    assert [(lp.token, lp.logprob, lp.bytes, [t.token for t in lp.top_logprobs]) for lp in part.logprobs] == \
        [(c.token, c.logprob, c.bytes, [t.token for t in c.top_logprobs]) for c in chat]
    events = list(client.responses.create(stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0]
    expected = [lp.model_dump() for lp in part.logprobs]
    assert [lp.model_dump() for lp in deltas] == expected
    assert [lp.model_dump() for lp in done.logprobs] == expected == [lp.model_dump() for lp in final.logprobs]
    plain = client.responses.create(**{**kw, "include": None})
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs is None


# 6 ---------------------------------------------------------------------------------------------

def test_chat_documents_reach_the_template(client, live):
    docs = [{"title": "A", "text": "aaa"}]
    messages = [{"role": "user", "content": "Hi"}]
    tok = lambda **kw: httpx.post(f"{live.url}/tokenize", json={"model": "toy", "messages": messages, **kw}).json()
    without, with_docs = tok(), tok(documents=docs)
    assert with_docs["count"] > without["count"]
    assert with_docs == tok(chat_template_kwargs={"documents": docs})     # the same variable
    chat = client.chat.completions.create(model="toy", messages=messages, max_tokens=1, extra_body={"documents": docs})
    assert chat.usage.prompt_tokens == with_docs["count"]


# 7, 8 ------------------------------------------------------------------------------------------

def test_a_reasoning_only_turn_is_kept_by_hand_as_by_previous_response_id():
    """A reply that is only a reasoning item: sent back by hand it becomes the assistant turn a
    stored reply keeps (it was dropped before a user message)."""
    from specdec.server.responses_api import ResponsesRequest, chat_request, conversation

    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "4"}]}
    first = {"role": "user", "content": "What is 2+2?"}
    follow = {"role": "user", "content": "And 3+3?"}
    stored = conversation([first], [thought])
    chained = chat_request(ResponsesRequest(input=[follow]), stored)
    by_hand = chat_request(ResponsesRequest(input=[first, thought, follow]), [])
    dump = lambda chat: [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dump(by_hand) == dump(chained)
    assert dump(by_hand)[1] == {"role": "assistant", "content": "", "reasoning_content": "4"}


def test_text_parts_are_joined_as_on_the_chat_path(client):
    parts = [{"type": "input_text", "text": "Line one."}, {"type": "input_text", "text": "Line two."}]
    r = client.responses.create(model="toy", input=[{"role": "user", "content": parts}], max_output_tokens=1)
    chat = client.chat.completions.create(model="toy", max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": p["text"]} for p in parts]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens


# 9 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,param,start", [
    (dict(input="x", reasoning={"effort": "extreme"}), "reasoning.effort", "reasoning.effort: Input should be"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "s"}}), "text", "text.format.schema is required"),
    (dict(input="x", text={"format": {"type": "yaml"}}), "text", "text.format.type must be"),
    (dict(input=[{"role": "wizard", "content": "x"}], instructions="Be brief."), "input[0].role", "input[0].role must"),
    (dict(input=[{"role": "user", "content": "x"}, {"type": "reasoning", "content": [{"type": "reasoning_text",
                                                                                      "text": "t"}]},
                 {"role": "wizard", "content": "x"}]), "input[2].role", "input[2].role"),
])
def test_errors_name_the_responses_fields_and_items(client, kw, param, start):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", **kw)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(start), e.value.body
    assert "messages" not in e.value.body["message"] and "response_format" not in e.value.body["message"]


def test_context_overflow_names_the_input(client):
    """max_output_tokens past what the context leaves is capped to it, as vLLM's; an input that
    leaves no room is a 400 naming the input."""
    r = client.responses.create(model="toy", input="x", max_output_tokens=5000, temperature=0)
    assert r.max_output_tokens == 256 - r.usage.input_tokens and r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", input="x " * 400, max_output_tokens=5)
    assert e.value.body["param"] == "input", e.value.body


def test_an_error_with_a_stored_history_names_the_input_item(client):
    first = client.responses.create(model="toy", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", input=[{"role": "wizard", "content": "x"}], previous_response_id=first.id,
                                instructions="Be brief.")
    assert e.value.body["param"] == "input[0].role", e.value.body


# 10 --------------------------------------------------------------------------------------------

def test_reply_echoes_the_sampling_values_used(client):
    r = client.responses.create(model="toy", input="x", max_output_tokens=3)
    assert (r.temperature, r.top_p, r.max_output_tokens) == (1.0, 1.0, 3)
    r = client.responses.create(model="toy", input="x", temperature=0, top_p=0.5)
    assert (r.temperature, r.top_p) == (0.0, 0.5)
    assert r.max_output_tokens == 256 - r.usage.input_tokens        # what the context leaves, as vLLM's
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_tokens_are_counted():
    """deepseek_r1: the toy never closes its think block, so the whole reply is reasoning."""
    llm = LLM(BUNDLED_TARGET, max_model_len=128)
    config = ServerConfig(served_model_names=("toy",), reasoning_parser="deepseek_r1")
    with LiveServer(build_app(llm, config)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="toy", input="def f(x):", max_output_tokens=12, temperature=0)
        r = c.responses.create(**kw)
        streamed = list(c.responses.create(stream=True, **kw))[-1].response
        c.close()
    assert [o.type for o in r.output] == ["reasoning"]
    n = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < n <= r.usage.output_tokens and n >= r.usage.output_tokens - 2
    assert streamed.usage.output_tokens_details.reasoning_tokens == n


# 11 --------------------------------------------------------------------------------------------

def test_a_text_part_without_text_is_a_400(client, live):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="toy", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}])
    assert e.value.body["param"] == "messages[0].content[1].text", e.value.body
    got = httpx.post(f"{live.url}/tokenize", json={"model": "toy", "messages": [
        {"role": "user", "content": [{"type": "text"}]}]})
    assert got.status_code == 400 and got.json()["error"]["param"] == "messages[0].content[0].text"
