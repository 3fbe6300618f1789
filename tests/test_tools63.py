"""Auto tool calls streamed equal the non-streamed ones wherever a stream's chunks end, inside a
\\uXXXX escape or between a surrogate pair's halves among them (llama3_json took a call cut there
for text); hermes reads its markers when the model's tokenizer makes them special tokens
(tools63)."""

from __future__ import annotations

import json
import re

import openai
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.tools import ToolPlan, ToolStream, _json_call_at, extract

from test_server import LiveServer

TOOLS = ({"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "add"}})
# a value with escapes of each kind: \u (lower and upper case), a surrogate pair, quotes, backslash, \/
CITY = r'"Zo\u00eb \"q\" \\ \ud83d\ude00 \u00C9\/"'
ARGS = '{"city": ' + CITY + ', "n": 1}'


def _plan(parser: str) -> ToolPlan:
    return ToolPlan("auto", TOOLS, parser=parser)


def _stream(plan: ToolPlan, pieces: list[str], finish: str):
    """(content, [(name, arguments)], finish_reason) of a stream fed pieces."""
    ts, content, calls = ToolStream(plan), "", {}
    steps = [ts.feed(p) for p in pieces]
    c, d, reason = ts.finish(finish)
    for text, deltas in steps + [(c, d)]:
        content += text
        for delta in deltas:
            name, args = calls.get(delta["index"], (None, ""))
            calls[delta["index"]] = (delta["function"].get("name") or name, args + delta["function"]["arguments"])
    return content or None, [calls[i] for i in range(len(calls))], reason


def _extracted(plan: ToolPlan, text: str, finish: str):
    content, calls, reason = extract(plan, text, finish)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], reason


def _splits(text: str):
    """The text one character at a time, and cut in two at every point."""
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


REPLIES = {
    "llama3_json": ['{"name": "get_weather", "parameters": ' + ARGS + "}",
                    '<|python_tag|>{"name": "get_weather", "arguments": ' + ARGS + '}; {"name": "add", '
                    '"parameters": {"s": "\\u00e9"}}',
                    'Code {"note": "\\u00e9\\ud83d\\ude00"} here.',                # JSON that is no call: text
                    '{"name": "get_weather", "parameters": {"city": "Zo\\u00'],      # cut off: text
    "mistral": ['Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + "}]",
                "[TOOL_CALLS]get_weather" + ARGS + '[TOOL_CALLS]add{"s": "\\ud83d\\ude00"}',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "\\ud83d\\ude'],
    "hermes": ['Sure. <tool_call>{"name": "get_weather", "arguments": ' + ARGS + "}</tool_call>",
               '<tool_call>{"arguments": {"city": "\\u00e9\\ud83d\\ude00"}, "name": "add"}</tool_call> done \\u00e9',
               '<tool_call>{"name": "add", "arguments": "{\\"a\\": \\"\\\\u00e9\\"}"}</tool_call>'],
    "pythonic": ['[get_weather(city="Zo\\u00eb \\"q\\" \\\\ \\U0001F600 \\N{DEGREE SIGN}"), add(s=\'\\x41\')]',
                 '[get_weather(city="Zo\\u00'],
}


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_streamed_calls_equal_the_non_streamed_ones_wherever_a_chunk_ends(parser):
    plan = _plan(parser)
    for text in REPLIES[parser]:
        for finish in ("stop", "length"):
            want = _extracted(plan, text, finish)
            for pieces in _splits(text):
                assert _stream(plan, pieces, finish) == want, (text, pieces)


def test_a_call_cut_inside_an_escape_may_still_be_one():
    """llama3_json: no prefix of a call reads as "no call" (an int), the \\u escapes' among them."""
    text = '{"name": "get_weather", "parameters": ' + ARGS + "}"
    verdicts = [_json_call_at(text[:n]) for n in range(1, len(text))]
    assert verdicts == [None] * (len(text) - 1) and _json_call_at(text) is True
    assert json.loads(extract(_plan("llama3_json"), text, "stop")[1][0]["function"]["arguments"]) == {
        "city": 'Zoë "q" \\ 😀 É/', "n": 1}
    # a broken escape is no call: the stream goes on past that `{`
    assert _json_call_at('{"name": "add", "parameters": {"s": "\\u00g') == 1
    assert _json_call_at('{"name": "add", "parameters": {"s": "\\ud83d\\uzz') == 1


# ---- through the server, with the official client ----

@pytest.fixture(scope="module")
def client():
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=256, max_num_seqs=2)   # a token a chunk
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    with LiveServer(build_app(llm, config)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_llama3_json_call_with_escapes_streams_as_it_returns(client):
    """The toy tokenizer writes `\\u00eb` as `\\`, `u`, `00`, `eb`: chunks end inside the escapes."""
    reply = '{"name": "get_weather", "parameters": {"city": "Zo\\u00eb \\ud83d\\ude00"}}'
    kw = dict(model="toy", messages=[{"role": "user", "content": "Weather?"}], tools=list(TOOLS), temperature=0,
              max_tokens=100, extra_body={"structured_outputs": {"regex": re.escape(reply)}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert (whole.message.content, whole.finish_reason) == (None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Zoë 😀"}')]
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        got = s.get_final_completion().choices[0]
    assert (got.message.content or None, got.finish_reason) == (None, "tool_calls")     # no text sent
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        ("get_weather", '{"city": "Zoë 😀"}')]


def test_hermes_reads_markers_that_are_special_tokens(tmp_path):
    """Some Hermes checkpoints make <tool_call> and </tool_call> special tokens: a request with
    tools (tool_choice not "none") keeps special tokens in the reply's text, as vLLM's hermes parser
    (adjust_request) does, so the markers reach the parser; skipped, the call came back as content."""
    import shutil

    folder = tmp_path / "hermes"
    shutil.copytree(BUNDLED_TARGET, folder)
    names = {"<|pad|>": "<tool_call>", "<|system|>": "</tool_call>"}      # ids 2 and 3, special: true
    tok = json.loads((folder / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    vocab = tok["model"]["vocab"]
    for old, new in names.items():
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("pad_token", None)
            path.write_text(json.dumps(config))
    llm = LLM(str(folder), num_speculative_tokens=0, max_model_len=256, max_num_seqs=2)
    ids = llm.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(ids) == 1 and llm.tokenizer.decode(ids, skip_special_tokens=True) == ""     # a special token
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    grammar = 'start: <[%d]> "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\"}}" <[%d]>' % (
        ids[0], llm.tokenizer.encode("</tool_call>", add_special_tokens=False)[0])
    with LiveServer(build_app(llm, config)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="toy", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=list(TOOLS),
                  temperature=0, max_tokens=40, extra_body={"structured_outputs": {"grammar": grammar}})
        whole = client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            streamed = s.get_final_completion().choices[0]
        free = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "Hi"}],
                                              temperature=0, max_tokens=4)     # no tools: skipped as asked
        client.close()
    for choice in (whole, streamed):
        assert (choice.message.content or None, choice.finish_reason) == (None, "tool_calls")
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("get_weather", '{"city": "Oslo"}')]
    assert "<tool_call>" not in (free.choices[0].message.content or "")
