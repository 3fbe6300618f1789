"""hermes calls stream as vLLM's Hermes2ProToolParser (and OpenAI) stream them: the name first
(index, id, type, arguments ""), then the arguments in pieces as they are generated. The pieces
join to exactly the non-streamed arguments (json.dumps of the value), whatever the chunking of
the text; names, ids, indices, content and finish_reason are as before (tools62)."""

from __future__ import annotations

import json
import random
import re

import openai
import pytest
from pydantic import BaseModel

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.tools import ToolPlan, ToolStream, extract

from test_server import LiveServer

TOOLS = ({"type": "function", "function": {"name": "add"}},)


def _plan(parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", TOOLS, parser="hermes", parallel=parallel)


def _chunks(text: str, rng: random.Random) -> list[str]:
    """One character at a time, token-sized, random sizes, or all at once."""
    how = rng.randrange(4)
    size = {0: lambda: 1, 1: lambda: rng.randint(2, 5), 2: lambda: rng.randint(1, 40), 3: lambda: len(text)}[how]
    out, at = [], 0
    while at < len(text):
        n = size()
        out.append(text[at:at + n])
        at += n
    return out


def _stream(plan: ToolPlan, pieces: list[str]):
    """(content, {index: (id, name, arguments pieces)}, finish_reason), checking each delta's shape."""
    ts, content, calls = ToolStream(plan), "", {}
    steps = [ts.feed(p) for p in pieces]
    c, d, finish = ts.finish("stop")
    for text, deltas in steps + [(c, d)]:
        content += text
        for delta in deltas:
            fn = delta["function"]
            if delta["index"] not in calls:        # the first: id, type and name
                assert delta["index"] == len(calls) and delta["type"] == "function" and fn["name"] and delta["id"]
                calls[delta["index"]] = (delta["id"], fn["name"], [fn["arguments"]])
            else:                                  # then arguments only
                assert set(delta) == {"index", "function"} and set(fn) == {"arguments"} and fn["arguments"]
                calls[delta["index"]][2].append(fn["arguments"])
    return content or None, calls, finish


def _same_as_extract(plan: ToolPlan, text: str, pieces: list[str]) -> dict:
    want_content, want_calls, want_finish = extract(plan, text, "stop")
    content, calls, finish = _stream(plan, pieces)
    assert (content, finish) == (want_content, want_finish), text
    got = [(calls[i][1], "".join(calls[i][2])) for i in range(len(calls))]
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls], (text, pieces)
    assert len({i for i, _, _ in calls.values()}) == len(calls)
    return calls


# ---- generated calls, written as a model may write them ----

WORDS = ["a", "city", "é", "naïve", "日本", "x y", "tab\there", 'q"uote', "back\\slash", "sl/ash", "nl\n", "😀",
         "", "\x01", "</tool_", "<tool_call>"]
NUMBERS = ["-1.5e3", "10", "0", "-0", "1E+2", "0.25", "3.0", "123456789012345678901234567890", "1e400", "-2.5E-3", "7"]


def _ws(rng) -> str:
    return rng.choice(["", "", " ", "  ", "\n", "\n  ", "\t"])


def _string(rng, s: str) -> str:
    """s as a JSON string, each character raw or escaped in one of the ways JSON allows."""
    out = []
    for ch in s:
        r = rng.random()
        if ch in '"\\' or ord(ch) < 0x20:
            out.append(rng.choice([json.dumps(ch)[1:-1], f"\\u{ord(ch):04x}"]))
        elif ch == "/" and r < 0.5:
            out.append("\\/")
        elif r < 0.3:
            out.append(json.dumps(ch)[1:-1] if ord(ch) > 0xFFFF else f"\\u{ord(ch):04X}")   # a surrogate pair
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(rng, depth: int) -> str:
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return _string(rng, rng.choice(WORDS))
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice(["true", "false", "null"])
    if kind in (3, 4):
        return _object(rng, depth + 1)
    items = [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return "[" + _ws(rng) + ("," + _ws(rng)).join(items) + _ws(rng) + "]"


def _object(rng, depth: int) -> str:
    keys = rng.sample(["k", "city", "é", "n", "a b", "x"], rng.randrange(4))
    items = [_string(rng, k) + _ws(rng) + ":" + _ws(rng) + _value(rng, depth) for k in keys]
    return "{" + _ws(rng) + ("," + _ws(rng)).join(items) + _ws(rng) + "}"


def _call(rng) -> str:
    """One block's JSON: name and arguments in either order, now and then another key, arguments
    an object, an array, a string holding an object, or a bare value."""
    r = rng.random()
    args = (_object(rng, 0) if r < 0.7 else "[1, {\"a\": 2}]" if r < 0.75 else json.dumps(json.dumps({"a": 1}))
            if r < 0.85 else _value(rng, 3))
    items = [f'"name":{_ws(rng)}"{rng.choice(["add", "get_weather"])}"', f'"arguments":{_ws(rng)}{args}']
    if rng.random() < 0.2:
        items.append('"id": 3')
    rng.shuffle(items)
    return _ws(rng) + "{" + _ws(rng) + ("," + _ws(rng)).join(items) + _ws(rng) + "}" + _ws(rng)


def _reply(rng) -> str:
    parts = [rng.choice(["", "Sure. ", "  \n", "Let me check <tool "])]
    for i in range(rng.randint(1, 3)):
        parts.append("<tool_call>" + _call(rng) + "</tool_call>" + rng.choice(["", "\n", " and "]))
    text = "".join(parts)
    return text[:-len("</tool_call>")] if rng.random() < 0.15 and text.endswith("</tool_call>") else text


def test_fuzz_streamed_arguments_join_to_the_non_streamed_ones():
    rng = random.Random(62)
    for n in range(600):
        text = _reply(rng)
        for plan in (_plan(), _plan(parallel=False)):
            for _ in range(3):
                _same_as_extract(plan, text, _chunks(text, rng))


# ---- one call, piece by piece ----

def test_arguments_arrive_in_pieces_of_what_cannot_change():
    text = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a" :10, "b":[true, -1.5e3], '
            '"s": "caf\\u00e9 \\/ \\ud83d\\ude00"}}\n</tool_call>')
    calls = _same_as_extract(_plan(), text, list(text))
    _, name, pieces = calls[0]
    assert name == "add" and pieces[0] == ""
    # a number or literal once the next character ends it; escapes as json.dumps writes them
    assert pieces[1:] == ["{", '"a"', ": ", "10, ", '"b"', ": ", "[", "true, ", "-1500.0]", ", ", '"s"', ": ", '"',
                          "c", "a", "f", "é", " ", "/", " ", "😀", '"', "}"]
    # token-sized steps: the same arguments, fewer pieces
    calls = _same_as_extract(_plan(), text, re.findall(r".{1,4}", text, re.DOTALL))
    assert 1 < len(calls[0][2]) < len(pieces)


def test_the_name_after_the_arguments():
    text = '<tool_call>{"arguments": {"city": "Oslo", "days": 3}, "name": "get_weather"}</tool_call>'
    calls = _same_as_extract(_plan(), text, list(text))
    _, name, pieces = calls[0]
    assert name == "get_weather" and pieces == ['{"city": "Oslo", "days": 3}']     # all read, sent with the name
    calls = _same_as_extract(_plan(), text, [text[:-20], text[-20:]])
    assert calls[0][2] == ['{"city": "Oslo", "days": 3}']


def test_arguments_that_are_not_an_object_come_whole_at_the_end():
    for args, want in (('"{\\"a\\": 1}"', '{"a": 1}'), ('"hello"', '"hello"'), ("null", "null"), ("12", "12")):
        text = f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>'
        calls = _same_as_extract(_plan(), text, list(text))
        assert calls[0][1:] == ("add", ["", want])


def test_blocks_that_are_no_call():
    # nothing of it sent: text, as the non-streamed reply
    for text in ('a <tool_call>{"arguments": {"a": 1}, "nam</tool_call> b', "<tool_call>not json</tool_call>",
                 '<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>["add"]</tool_call>'):
        for size in (1, 3, len(text)):
            assert _same_as_extract(_plan(), text, re.findall(f".{{1,{size}}}", text, re.DOTALL)) == {}
    # the name sent, then text after the object: the call stays as sent and the stream ends well
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1}} oops</tool_call> y'
    assert extract(_plan(), text, "stop") == (text, [], "stop")
    content, calls, finish = _stream(_plan(), list(text))
    assert (content, finish) == ("x  y", "tool_calls")
    assert [(name, "".join(p)) for _, name, p in calls.values()] == [("add", '{"a": 1}')]
    # cut off by max_tokens inside the arguments: the call as sent (9 may have gone on), "length" kept
    text = '<tool_call>{"name": "add", "arguments": {"a": 9'
    assert extract(_plan(), text, "length") == (text, [], "length")
    ts = ToolStream(_plan())
    deltas = [d for ch in text for d in ts.feed(ch)[1]]
    assert ts.finish("length") == ("", [], "length")
    assert [d["function"]["arguments"] for d in deltas] == ["", "{", '"a"', ": "]


def test_parallel_false_streams_the_first_call_only():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    calls = _same_as_extract(_plan(parallel=False), text, list(text))
    assert [(name, "".join(p)) for _, name, p in calls.values()] == [("add", '{"a": 1}')]
    assert len(_same_as_extract(_plan(), text, list(text))) == 2


# ---- through the server, with the official client ----

class get_weather(BaseModel):
    city: str
    note: str


STRICT = [openai.pydantic_function_tool(get_weather)]
CALL = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"note": "caf\\u00e9 by the harbour, before noon"}}\n</tool_call>')


@pytest.fixture(scope="module")
def client():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=512,
              max_num_seqs=2)
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    with LiveServer(build_app(llm, config)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_call_streams_its_arguments_through_the_server(client):
    kw = dict(model="toy", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=STRICT,
              temperature=0, max_tokens=200, extra_body={"structured_outputs": {"regex": re.escape(CALL)}})
    whole = client.chat.completions.create(**kw).choices[0]
    (want,) = whole.message.tool_calls
    assert want.function.arguments == '{"city": "Oslo", "note": "café by the harbour, before noon"}'
    with client.chat.completions.stream(**kw) as s:
        pieces = [e.arguments_delta for e in s if e.type == "tool_calls.function.arguments.delta"]
        final = s.get_final_completion().choices[0]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == want.function.arguments
    (got,) = final.message.tool_calls
    assert (got.function.name, got.function.arguments, got.index) == ("get_weather", want.function.arguments, 0)
    assert got.function.parsed_arguments == get_weather(city="Oslo", note="café by the harbour, before noon")
    assert (final.message.content, final.finish_reason) == (whole.message.content, whole.finish_reason) == (
        "Checking. ", "tool_calls")
