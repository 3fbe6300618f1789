"""A tester's six defects in the tool-call and reasoning parsers (each case failed before its fix):
1. deep bracket nesting in a call (a RecursionError) was a 500, or a stream cut without [DONE]:
   any parser failure now leaves the reply as text, streamed and not, as vLLM does;
2. the mistral parser's ids could not go back through a Mistral chat template (9 alphanumerics);
3. the mistral parser missed text before [TOOL_CALLS], the v11 `name{args}` / `name[ARGS]{args}`
   calls and text after the array, and showed the marker;
4. qwen3 did not split `thinking</think>answer` (QwQ's and Qwen3-Thinking-2507's replies);
5. a gpt-oss call cut off by max_tokens came back as a call with broken JSON arguments;
6. a chat echo's prefix went through the reasoning and tool parsers."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from test_server import LiveServer

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server import tools as tools_module
from specdec.server.reasoning import ReasoningStream, split_reasoning
from specdec.server.responses import ChatFormat, ChoiceResult
from specdec.server.tools import ToolStream, extract, plan_tools
from specdec.tokenizer import Tokenizer, template_messages

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [ADD, WEATHER]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUNDLED_TARGET)


def _chunks(text: str, rng: random.Random, most: int = 10) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, most)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _tool_stream(plan, pieces, finish="stop"):
    ts, content, calls = ToolStream(plan), "", []
    for p in pieces:
        c, d = ts.feed(p)
        content, calls = content + c, calls + d
    c, d, f = ts.finish(finish)
    return content + c or None, calls + d, f


def _format_stream(fmt, pieces, finish="stop"):
    """A ChatFormat's chunks joined: (reasoning, content, calls, finish_reason)."""
    got = {"r": "", "c": "", "calls": [], "finish": None}
    opening = fmt.opening(0)
    got["c"] += opening["delta"].get("content", "")
    for i, piece in enumerate(pieces):
        d = fmt.delta(0, piece, [], 0, finish if i == len(pieces) - 1 else None, None)
        if d is not None:
            got["r"] += d["delta"].get("reasoning_content", "")
            got["c"] += d["delta"].get("content", "")
            got["calls"] += d["delta"].get("tool_calls", [])
            got["finish"] = d["finish_reason"] or got["finish"]
    return got["r"] or None, got["c"] or None, got["calls"], got["finish"]


# ---- 1. a parser's failure is text, not a 500 or a cut stream ----

DEEP = "[" * 5000 + "]" * 5000
NESTED = {
    "hermes": '<tool_call>{"arguments": ' + DEEP + "}</tool_call>",      # no name: nothing streams before it fails
    "llama3_json": '{"name": "add", "parameters": ' + DEEP + "}",
    "pythonic": "[add(a=" + "-" * 5000 + "1)]",
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": ' + DEEP + "}]",
}


@pytest.mark.parametrize("parser", sorted(NESTED))
def test_deep_nesting_is_text(parser):
    """json.loads / ast.parse raise RecursionError (or MemoryError) on such replies: the reply is
    text, streamed alike (each parser's own catch, as vLLM's parsers catch Exception); a required
    array that cannot be parsed is no calls and no content, as vLLM's required branch."""
    text = NESTED[parser]
    plan = plan_tools(TOOLS, "auto", None, True, parser)
    assert extract(plan, text, "length") == (text, [], "length")
    pieces = [text[i:i + 700] for i in range(0, len(text), 700)]
    assert _tool_stream(plan, pieces, "length") == (text, [], "length")
    required = plan_tools(TOOLS, "required", None, True, None)
    deep = '[{"name": "add", "parameters": ' + DEEP + "}]"
    assert extract(required, deep, "stop") == (None, [], "stop")
    assert _tool_stream(required, [deep]) == (None, [], "stop")


def test_a_failing_parser_gives_the_reply_back_as_text(monkeypatch, tok):
    """Whatever a parser raises (a bug, say), ChatFormat returns the reply as plain content: the
    whole of it non-streamed; streamed, what the parsers held and the rest, as it was written."""
    def broken(body):
        raise ValueError("a parser bug")
    monkeypatch.setattr(tools_module, "_hermes_call", broken)
    monkeypatch.setattr(tools_module._CallReader, "feed", lambda self, text: broken(text))   # the streamed reader
    plan = plan_tools(TOOLS, "auto", None, True, "hermes")
    text = 'Sure, <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> done.'
    msg = ChatFormat(tok, False, tools=plan).choice(ChoiceResult(0, [text], finish_reason="stop"))
    assert (msg["message"]["content"], msg["finish_reason"]) == (text, "stop") and "tool_calls" not in msg["message"]
    rng = random.Random(0)
    for _ in range(30):
        assert _format_stream(ChatFormat(tok, False, tools=plan), _chunks(text, rng)) == (None, text, [], "stop")


@pytest.fixture(scope="module")
def hermes_server():
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=4, max_model_len=512)
    config = ServerConfig(served_model_names=("toy",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    with LiveServer(build_app(llm, config)) as server:
        yield server


def _sse(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def _streamed_content(events: list[str]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e).get("choices", []))


def test_deep_nesting_through_the_server(hermes_server):
    """The tester's reply: <tool_call> and 1100 '[' (the model may write such a thing before
    max_tokens): a 200 with the text as content (was a 500), and a stream that ends with [DONE]
    (was cut off mid-body)."""
    body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 400,
            "temperature": 0, "structured_outputs": {"regex": r"<tool_call>\[{1100}"}}
    r = httpx.post(hermes_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:200]
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "<tool_call>" + "[" * 1100 and not msg.get("tool_calls")
    events = _sse(hermes_server.url, body)
    assert events[-1] == "[DONE]" and _streamed_content(events) == msg["content"]


def test_a_stream_never_ends_without_done(hermes_server, monkeypatch):
    """An unexpected exception while streaming (here planted in the chunk builder) is an error
    event, then [DONE]: never a connection cut mid-body."""
    def broken(self, *a, **kw):
        raise RuntimeError("planted")
    monkeypatch.setattr(ChatFormat, "delta", broken)
    events = _sse(hermes_server.url, {"model": "toy", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4, "temperature": 0})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "internal error: RuntimeError"


def test_a_malformed_tool_call_is_a_400_and_a_500_closes_its_connection(hermes_server, monkeypatch):
    """An earlier assistant call whose `function` is not an object is a 400 naming the field on
    chat and /tokenize (it was a 500). A 500 says `Connection: close`: uvicorn closes the socket
    after it, and a pooled client (the openai SDK's) sent its next request down the dead one."""
    bad = {"model": "toy", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "a", "type": "function", "function": 5}]}]}
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(hermes_server.url + route, json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (route, r.text[:200])
        assert "tool_calls[0]" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="tool_calls"):
        template_messages(bad["messages"])

    def broken(*a, **kw):
        raise RuntimeError("planted")
    monkeypatch.setattr(ChatFormat, "choice", broken)
    good = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            r = client.post(hermes_server.url + "/v1/chat/completions", json=good)
            assert r.status_code == 500 and r.headers["connection"] == "close"
            assert client.post(hermes_server.url + "/tokenize", json=good).status_code == 200


# ---- 2, 3. mistral: its ids, its formats ----

MISTRAL_TEMPLATE = (  # Mistral-7B-Instruct-v0.3's id check, in a minimal template
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m.tool_calls is defined and m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{{ c.function|tojson }}{% endfor %}]{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}{% if m.tool_call_id|length != 9 %}{{ raise_exception('bad id') }}{% endif %}"
    "[TOOL_RESULTS] {{ m['content'] }}[/TOOL_RESULTS]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}")


def test_mistral_ids_go_back_through_a_mistral_template(tok):
    """vLLM's MistralToolCall ids: 9 letters and digits, streamed or not, named and required calls
    on a mistral server too; the next turn renders through a template that checks them."""
    auto = plan_tools(TOOLS, "auto", None, True, "mistral")
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    _, [call], _ = extract(auto, text, "stop")
    _, [streamed], _ = _tool_stream(auto, [text[:15], text[15:]])
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, True, "mistral")
    required = plan_tools(TOOLS, "required", None, True, "mistral")
    ids = [call["id"], streamed["id"], extract(named, '{"a": 1}', "stop")[1][0]["id"],
           _tool_stream(named, ['{"a": 1}'])[1][0]["id"],
           extract(required, '[{"name": "add", "parameters": {"a": 1}}]', "stop")[1][0]["id"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids), ids
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 3}'}]
    rendered = tok.apply_chat_template(template_messages(history), chat_template=MISTRAL_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
    assert '[TOOL_CALLS] [{"name": "get_weather"' in rendered
    # the other parsers keep vLLM's chatcmpl-tool- ids
    hermes = plan_tools(TOOLS, "auto", None, True, "hermes")
    assert extract(hermes, '<tool_call>{"name": "add", "arguments": {}}</tool_call>', "stop")[1][0]["id"].startswith(
        "chatcmpl-tool-")


MISTRAL = {  # reply -> (content, [(name, arguments)])
    'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]':
        ("Let me check. ", [("get_weather", {"city": "Oslo"})]),
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}': (None, [("get_weather", {"city": "Oslo"})]),
    '[TOOL_CALLS]get_weather{"city": "Oslo"}': (None, [("get_weather", {"city": "Oslo"})]),
    'Two.[TOOL_CALLS]get_weather{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}':
        ("Two.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n\nI called the tool.':
        (None, [("get_weather", {"city": "Oslo"})]),
    '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1, "b": 2}}': (None, [("add", {"a": 1, "b": 2})]),
    # not calls: the whole reply is text, the marker included
    'Hmm [TOOL_CALLS]get_weather{"city": "Os': ('Hmm [TOOL_CALLS]get_weather{"city": "Os', []),
    "[TOOL_CALLS]just words": ("[TOOL_CALLS]just words", []),
    "A [TOOL_CALL": ("A [TOOL_CALL", []),
}


def test_mistral_formats_streamed_and_not():
    """vLLM's MistralToolParser: the text before [TOOL_CALLS] is content, the v0.3 array (what
    follows it ignored, as raw_decode ignores it) and the v11 `name{args}` / `name[ARGS]{args}`
    segments are calls; any chunking of the stream gives the same content and calls."""
    plan = plan_tools(TOOLS, "auto", None, True, "mistral")
    rng = random.Random(3)
    for text, (content, want) in MISTRAL.items():
        got_content, calls, finish = extract(plan, text, "stop")
        assert (got_content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]) == \
            (content, want), text
        assert finish == ("tool_calls" if want else "stop")
        for _ in range(30):
            s_content, deltas, s_finish = _tool_stream(plan, _chunks(text, rng))
            assert (s_content, s_finish) == (content, finish), text
            assert [(d["index"], d["function"]) for d in deltas] == [(i, c["function"]) for i, c in enumerate(calls)]
    one = plan_tools(TOOLS, "auto", False, True, "mistral")          # parallel_tool_calls false: the first
    two = next(t for t in MISTRAL if t.startswith("Two."))
    assert [c["function"]["name"] for c in extract(one, two, "stop")[1]] == ["get_weather"]
    assert [d["function"]["name"] for d in _tool_stream(one, [two])[1]] == ["get_weather"]


# ---- 4. qwen3: the opening <think> is optional ----

QWEN3 = ["The user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.", "<think>weigh</think>42", "42",
         "<think>cut short", "a</think", "  x</think>", "", "<thi", "no</think>yes</think>"]


def test_qwen3_reads_a_reply_whose_prompt_opened_the_block(tok):
    """QwQ's and Qwen3-Thinking-2507's templates end the prompt with <think>: the reply is
    `thinking</think>answer`, reasoning up to </think> (vLLM's Qwen3ReasoningParser). Without
    </think>: all reasoning when the reply or the prompt opened the block, else all answer (Qwen3
    with thinking off). Streamed alike under any chunking, whatever the prompt says."""
    assert split_reasoning("qwen3", QWEN3[0]) == ("The user wants 2+2. That is 4.\n", "\n\nThe answer is 4.")
    assert split_reasoning("qwen3", "42") == ("", "42") and split_reasoning("qwen3", "<think>cut") == ("cut", "")
    assert split_reasoning("qwen3", "cut", "open") == ("cut", "")
    assert split_reasoning("qwen3", "a</think>b", "closed") == ("", "a</think>b")
    assert split_reasoning("deepseek_r1", "cut") == ("cut", "")                   # unchanged
    msg = ChatFormat(tok, False, reasoning="qwen3").choice(ChoiceResult(0, [QWEN3[0]], finish_reason="stop"))
    assert (msg["message"]["reasoning_content"], msg["message"]["content"]) == \
        ("The user wants 2+2. That is 4.\n", "\n\nThe answer is 4.")
    rng = random.Random(0)
    for prompt in (None, "open", "closed"):
        for text in QWEN3:
            want = split_reasoning("qwen3", text, prompt)
            for _ in range(20):
                rs, got = ReasoningStream("qwen3", prompt), ["", ""]
                for piece in _chunks(text, rng, 6):
                    r, t = rs.feed(piece)
                    got = [got[0] + r, got[1] + t]
                r, t = rs.finish()
                assert (got[0] + r, got[1] + t) == want, (prompt, text)


def test_qwen3_streams_at_once_when_the_prompt_tells(tok):
    """The prompt's end decides a qwen3 reply that does not open with <think>: after QwQ's
    `<think>\\n` it is reasoning from its first token, after Qwen3's closed empty block (thinking
    off) answer; with neither it is held until </think> or its end."""
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    plain = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    first = {}
    for name, prompt in {"open": opened, "closed": closed, "plain": plain}.items():
        fmt = ChatFormat(tok, False, prompt=prompt, reasoning="qwen3")
        first[name] = fmt.delta(0, "Let me see", [], 0, None, None)
        if first[name] is not None:
            first[name] = first[name]["delta"]
        last = fmt.delta(0, " it.", [], 0, "length", None)["delta"]
        msg = ChatFormat(tok, False, prompt=prompt, reasoning="qwen3").choice(
            ChoiceResult(0, ["Let me see it."], finish_reason="length"))["message"]
        joined = {k: (first[name] or {}).get(k, "") + last.get(k, "") for k in ("reasoning_content", "content")}
        assert (joined["reasoning_content"] or None, joined["content"] or None) == \
            (msg.get("reasoning_content"), msg["content"]), name
    assert first == {"open": {"reasoning": "Let me see", "reasoning_content": "Let me see"},
                     "closed": {"content": "Let me see"}, "plain": None}


def test_reasoning_under_both_names(tok):
    """Thinking is returned as `reasoning` (vLLM's name since late 2025, which clients written for
    it read) and as `reasoning_content` (its older one), in messages and deltas alike; an earlier
    assistant's `reasoning` reaches the chat template under that name from the server as from
    LLM.chat (the server gave it only as reasoning_content / thinking)."""
    msg = ChatFormat(tok, False, reasoning="qwen3").choice(ChoiceResult(0, [QWEN3[1]], finish_reason="stop"))["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "weigh" and msg["content"] == "42"
    delta = ChatFormat(tok, False, reasoning="deepseek_r1").delta(0, "hmm", [], 0, None, None)["delta"]
    assert delta == {"reasoning": "hmm", "reasoning_content": "hmm"}
    template = ("{% for m in messages %}[{{ m.get('reasoning') }}|{{ m.get('reasoning_content') }}|"
                "{{ m.get('thinking') }}]{{ m['content'] }}{% endfor %}")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok", "reasoning": "R1"},
               {"role": "user", "content": "q2"}]
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    offline = llm.chat_prompt(history, chat_template=template)["prompt"]
    assert "[R1|R1|R1]ok" in offline
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), chat_template=template))) as server:
        r = httpx.post(server.url + "/tokenize", json={"model": "toy", "messages": history}, timeout=60)
        assert llm.tokenizer.decode(r.json()["tokens"]) == offline


# ---- 5. gpt-oss: a call cut off by max_tokens is no call ----

CUT_CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Tok')


def test_harmony_call_cut_by_max_tokens_is_no_call(tok):
    """vLLM returns only completed harmony messages as calls: cut off by max_tokens ("length"),
    the call is dropped (its broken arguments were sent as a call), streamed and not; one that
    ended (finish "stop": <|call|> is a stop token) is a call, its JSON arguments re-serialized."""
    plan = plan_tools([WEATHER], "auto", None, True, "openai")
    msg = ChatFormat(tok, False, tools=plan, reasoning="openai_gptoss").choice(
        ChoiceResult(0, [CUT_CALL], finish_reason="length"))
    assert msg["finish_reason"] == "length" and "tool_calls" not in msg["message"]
    assert (msg["message"]["reasoning_content"], msg["message"]["content"]) == ("Need the weather.", None)
    rng = random.Random(0)
    for _ in range(30):
        fmt = ChatFormat(tok, False, tools=plan, reasoning="openai_gptoss")
        assert _format_stream(fmt, _chunks(CUT_CALL, rng, 20), "length") == ("Need the weather.", None, [], "length")
    ended = CUT_CALL + 'yo",\n  "unit":"c"}'
    msg = ChatFormat(tok, False, tools=plan, reasoning="openai_gptoss").choice(
        ChoiceResult(0, [ended], finish_reason="stop"))
    [call] = msg["message"]["tool_calls"]
    assert msg["finish_reason"] == "tool_calls" and call["function"]["arguments"] == '{"city": "Tokyo", "unit": "c"}'
    fmt = ChatFormat(tok, False, tools=plan, reasoning="openai_gptoss")
    _, _, calls, finish = _format_stream(fmt, _chunks(ended, rng, 20), "stop")
    assert finish == "tool_calls" and [c["function"] for c in calls] == [call["function"]]


# ---- 6. a chat echo is not parsed ----

def test_echo_is_not_parsed(tok):
    """vLLM parses only the generated text and puts the echoed message before the content: the
    echo never becomes thinking or a call. (The prefix as collect() and stream() handle it.)"""
    echo, generated = "The answer is", " not not not"
    fmt = ChatFormat(tok, False, reasoning="deepseek_r1", echo=echo)
    msg = fmt.choice(ChoiceResult(0, [fmt.prefix(0), generated], finish_reason="length"))["message"]
    assert (msg["reasoning_content"], msg["content"]) == (generated, echo)
    fmt = ChatFormat(tok, False, reasoning="deepseek_r1", echo=echo)
    assert _format_stream(fmt, [fmt.prefix(0) + generated], "length") == (generated, echo, [], "length")


def test_echoed_call_is_not_a_call(hermes_server):
    """Through the server: an assistant message continued with echo, holding a hermes call block,
    comes back as content before the generated text, with no tool_calls, streamed and not."""
    echo = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    c = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="toy", messages=[{"role": "user", "content": "add"}, {"role": "assistant", "content": echo}],
              tools=TOOLS, max_tokens=8, temperature=0,
              extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                          "structured_outputs": {"regex": " Done\\."}})
    out = c.chat.completions.create(**kw).choices[0]
    assert (out.message.content, out.message.tool_calls, out.finish_reason) == (echo + " Done.", None, "stop")
    content, calls = "", []
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    assert (content, calls) == (echo + " Done.", [])
