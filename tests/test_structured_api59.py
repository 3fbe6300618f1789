"""Structured outputs at the API edges, as vLLM answers them, through a real uvicorn server and the
official openai client: the Responses API takes vLLM's `structured_outputs` (streamed, not, and in
the background; checked as on the chat endpoint; a 400 beside `text.format`), and a
`tool_choice: "required"` array cut by max_tokens is no calls and null content, streamed or not."""

from __future__ import annotations

import re
import time

import openai
import pytest


import test_responses_api

REGEX = "[0-9]{3}"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


# the Responses tests' toy server with a draft model, and its openai client (one fixture, shared)
live, client = test_responses_api.live, test_responses_api.client


def test_responses_structured_outputs_constrains_the_reply(client):
    """The regex holds (the toy writes no digits unconstrained), and the reply is the chat
    endpoint's for the same field; streamed and in the background alike."""
    so = {"structured_outputs": {"regex": REGEX}}
    kw = dict(model="toy", input="hi", max_output_tokens=10, temperature=0, extra_body=so)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0, extra_body=so)
    assert re.fullmatch(REGEX, r.output_text) and r.output_text == chat.choices[0].message.content
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    queued = client.responses.create(background=True, **kw)
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.output_text == r.output_text


@pytest.mark.parametrize("extra,message", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs is invalid"),
    ({"structured_outputs": {"regex": REGEX}, "text": {"format": {"type": "json_object"}}},
     "Cannot specify both structured_outputs and text.format"),
    ({"structured_outputs": {"regex": REGEX}, "text": {"format": {"type": "text"}}},
     "Cannot specify both structured_outputs and text.format")])
@pytest.mark.parametrize("mode", [{}, {"stream": True}, {"background": True}])
def test_responses_structured_outputs_is_checked(client, extra, message, mode):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="toy", input="hi", max_output_tokens=5, extra_body=extra, **mode)
    assert e.value.body["param"] == "structured_outputs" and message in e.value.body["message"], e.value.body


def test_required_cut_by_max_tokens_is_no_call_and_no_content(client):
    """vLLM's required branch: a truncated array parses as no calls, and content is None (not
    the broken JSON); the stream sends neither content nor calls, and ends "length"."""
    kw = dict(model="toy", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
              tool_choice="required", max_tokens=4, temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and not choice.message.tool_calls
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert not "".join(c.delta.content or "" for c in chunks)
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "length"
    # the Responses API over the same path: incomplete, with no output item holding the broken array
    r = client.responses.create(model="toy", input="Weather in Paris?", max_output_tokens=4, temperature=0,
                                tools=[{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER[0]["function"]["parameters"]}], tool_choice="required")
    assert r.status == "incomplete" and r.output_text == "" and not [o for o in r.output if o.type == "function_call"]
