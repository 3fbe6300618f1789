"""The Responses API, against vLLM's: a background response may be streamed, its events kept so a
client that lost the stream reconnects with GET /v1/responses/{id}?stream=true&starting_after=n
(and a cancelled one's stream ends); generation_config.json's max_new_tokens past what the context
leaves is capped there, as vLLM's get_max_tokens does, where it made every request a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from conftest import make_checkpoint
from specdec import LLM
from specdec.server import ServerConfig, build_app

import test_responses_api
from test_server import LiveServer


# the Responses tests' toy server with a draft model, and its openai client (one fixture, shared)
live, client = test_responses_api.live, test_responses_api.client


def _events(text: str) -> list[dict]:
    """A server-sent event stream's data, split at blank lines only (a toy's text may hold U+2028)."""
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if block.strip()]


def test_a_background_response_streams_and_a_client_reconnects(client, live):
    kw = dict(model="toy", input="def parse(data):", max_output_tokens=24, temperature=0)
    fore = client.responses.create(**kw)
    stream = client.responses.create(background=True, stream=True, **kw)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break                       # the connection is lost here
    stream.close()
    rid, last = seen[0].response.id, seen[-1].sequence_number
    assert seen[0].type == "response.created" and seen[0].response.background is True
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    # the rest, by id: the stored events after the last one seen, then the live ones
    rest = httpx.get(f"{live.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": last}, timeout=120)
    assert rest.status_code == 200 and rest.headers["content-type"].startswith("text/event-stream")
    rest = _events(rest.text)
    assert [e["sequence_number"] for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1]["type"] == ("response.incomplete" if fore.status == "incomplete" else "response.completed")
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta") + \
        "".join(e["delta"] for e in rest if e["type"] == "response.output_text.delta")
    assert text == fore.output_text and rest[-1]["response"]["output"][0]["content"][0]["text"] == fore.output_text
    # once done: stored as any background response, and its whole stream replayed by the official client
    got = client.responses.retrieve(rid)
    assert got.status == fore.status and got.output_text == fore.output_text
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(last + 1 + len(rest)))
    assert [e.type for e in again[last + 1:]] == [e["type"] for e in rest]
    assert [e.type for e in client.responses.retrieve(rid, stream=True, starting_after=last + len(rest))] == []


def test_only_a_background_stream_is_streamed_again(client, live):
    r = client.responses.create(model="toy", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.retrieve(r.id, stream=True)
    assert e.value.body["param"] == "stream"
    assert httpx.get(f"{live.url}/v1/responses/resp_nope", params={"stream": "true"}).status_code == 404
    # a deleted one's events are forgotten with it
    events = list(client.responses.create(model="toy", input="x", max_output_tokens=2, background=True, stream=True))
    rid = events[0].response.id
    assert len(list(client.responses.retrieve(rid, stream=True))) == len(events)
    client.responses.delete(rid)
    assert httpx.get(f"{live.url}/v1/responses/{rid}", params={"stream": "true"}).status_code == 404


def test_a_streamed_background_response_is_cancelled_and_fails():
    """Cancelled while it streams: its work stops, it is kept "cancelled", and its readers' streams
    (the first and one that reconnects) end after the events made; one whose stream ends in an
    error event is kept "failed" with its message."""
    from specdec.server.responses_api import Background, ResponseStore

    def sse(kind: str, seq: int, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"

    async def scenario():
        store = ResponseStore()
        runs = Background(store)
        stopped, never = [], asyncio.Event()

        async def endless(started, done):
            yield sse("response.created", 0)
            started()
            yield sse("response.output_text.delta", 1, delta="a")
            try:
                await never.wait()
            except asyncio.CancelledError:
                stopped.append(True)
                raise
        queued = {"id": "resp_1", "status": "queued", "output": []}
        first = runs.start_stream("resp_1", [{"role": "user", "content": "x"}], queued, endless)
        assert [json.loads(e.split("data: ")[1])["sequence_number"] async for e in _take(first, 2)] == [0, 1]
        assert json.loads(store.get("resp_1")[1])["status"] == "in_progress"
        later = runs.follow("resp_1", 0)
        assert (await runs.cancel("resp_1"))["status"] == "cancelled" and stopped == [True]
        assert json.loads(store.get("resp_1")[1])["status"] == "cancelled"
        assert [e async for e in first] == []                       # the stream ends
        assert [json.loads(e.split("data: ")[1])["delta"] async for e in later] == ["a"]

        async def failing(started, done):
            yield sse("response.created", 0)
            yield sse("error", 1, code=None, message="grammar broke", param=None)
        stream = runs.start_stream("resp_2", [], {"id": "resp_2", "status": "queued", "output": []}, failing)
        assert len([e async for e in stream]) == 2
        await asyncio.sleep(0.01)
        body = json.loads(store.get("resp_2")[1])
        assert body["status"] == "failed" and body["error"]["message"] == "grammar broke" and not runs.tasks
    asyncio.run(scenario())


async def _take(events, n: int):
    for _ in range(n):
        yield await anext(events)


@pytest.fixture(scope="module")
def long_default(tiny_pair, tmp_path_factory):
    """A model whose generation_config.json asks for more new tokens than its context holds."""
    model = tmp_path_factory.mktemp("gen58") / "m"
    make_checkpoint(model, tokenizer_from=tiny_pair[0])
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1000}))
    llm = LLM(str(model), num_speculative_tokens=0, max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as server:
        yield server


def test_max_new_tokens_past_the_context_is_capped_there(long_default):
    """vLLM's get_max_tokens: the default cap is min'd with what the context leaves (the reply ends
    incomplete there), the request's own budget still bounds it; only a request's own max_tokens
    past the context is a 400."""
    client = openai.OpenAI(base_url=long_default.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model="m", input="hi", temperature=0, extra_body={"ignore_eos": True})
    room = 64 - r.usage.input_tokens
    assert r.status == "incomplete" and r.usage.output_tokens == room and r.max_output_tokens == room
    short = client.responses.create(model="m", input="hi", max_output_tokens=5, extra_body={"ignore_eos": True})
    assert short.usage.output_tokens == 5
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 64 - chat.usage.prompt_tokens and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1000)


def test_completions_with_max_tokens_null_are_capped_there_too(long_default):
    """/v1/completions with max_tokens null (not OpenAI's default 16) takes the default cap min'd
    with the room left, as vLLM's; it was a 400 naming 1000 tokens. Beam completions alike."""
    client = openai.OpenAI(base_url=long_default.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="m", prompt="hi there", max_tokens=None, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 64 - r.usage.prompt_tokens and r.choices[0].finish_reason == "length"
    two = client.completions.create(model="m", prompt=["hi", "hi there again and again"], max_tokens=None,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert {c.finish_reason for c in two.choices} == {"length"}
    # each prompt's own room, as vLLM's (the longer prompt's had capped both)
    lens = [len(client.completions.create(model="m", prompt=p, max_tokens=1, echo=True, logprobs=0)
                .choices[0].logprobs.tokens) - 1 for p in ("hi", "hi there again and again")]
    assert two.usage.completion_tokens == sum(64 - n for n in lens), (two.usage, lens)
    beams = client.completions.create(model="m", prompt="hi", max_tokens=None, n=2,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(beams.choices) == 2
    assert client.completions.create(model="m", prompt="hi", temperature=0).usage.completion_tokens <= 16


def test_a_chain_on_a_background_response_still_running_is_refused(client, live):
    """previous_response_id naming a background response not done yet: a 400, where the chain had
    been built without its reply (the stored entry held only its input)."""
    r = client.responses.create(model="toy", input="hi", max_output_tokens=400, background=True, temperature=0,
                                extra_body={"ignore_eos": True})
    try:
        got = httpx.post(f"{live.url}/v1/responses", json={"model": "toy", "input": "next", "previous_response_id": r.id,
                                                           "max_output_tokens": 4}, timeout=60)
        if client.responses.retrieve(r.id).status in ("queued", "in_progress"):   # still running when asked
            assert got.status_code == 400 and got.json()["error"]["param"] == "previous_response_id", got.text
    finally:
        httpx.post(f"{live.url}/v1/responses/{r.id}/cancel", timeout=60)
