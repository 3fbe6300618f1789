"""vLLM's --reasoning-parser: a reasoning model's <think> block returned as reasoning_content,
split alike streamed and not (any chunking), composed with the tool-call parser, and through a
real uvicorn server with the openai client."""

from __future__ import annotations

import random

import openai
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.reasoning import ReasoningStream, reasoning_stream, split_reasoning
from specdec.server.responses import ChatFormat, ChoiceResult
from specdec.server.tools import plan_tools

from test_server import LiveServer

REPLIES = ["<think>\nplan</think>\n\nAnswer.", "plan step</think>answer", "just thinking, cut short",
           "  <think>x</think>", "Plain answer", "<thi", "", "a</think", "<think>unclosed </thi",
           "<think>", " <think>"]           # a reply cut right after its opening tag: nothing of it is sent


def test_split():
    assert split_reasoning("deepseek_r1", "weigh it</think>\n\n42") == ("weigh it", "\n\n42")
    assert split_reasoning("deepseek_r1", "<think>weigh</think>42") == ("weigh", "42")
    assert split_reasoning("deepseek_r1", "never closed") == ("never closed", "")     # all reasoning
    assert split_reasoning("qwen3", "<think>weigh</think>42") == ("weigh", "42")
    assert split_reasoning("qwen3", "42") == ("", "42")                               # thinking off
    assert split_reasoning("qwen3", "<think>cut short") == ("cut short", "")


@pytest.mark.parametrize("prompt", [None, "open", "closed"])     # prompt_think's: what the prompt left open
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_stream_equals_split_for_any_chunking(parser, prompt):
    rng = random.Random(0)
    for text in REPLIES:
        want = split_reasoning(parser, text, prompt)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
            rs, got = ReasoningStream(parser, prompt), ["", ""]
            for a, b in zip([0] + cuts, cuts + [len(text)]):
                r, t = rs.feed(text[a:b])
                got = [got[0] + r, got[1] + t]
            r, t = rs.finish()
            assert (got[0] + r, got[1] + t) == want, (text, cuts)


HARMONY = ["<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>4.",
           "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check."
           "<|end|><|start|>assistant<|channel|>final<|message|>Done <b>.",
           "<|channel|>analysis<|message|>cut off in thought", "<|channel|>analysis<|message|>x<|end|><|start|>assis",
           "Plain answer <i>, no markup", "", "<|chan"]


def test_harmony_split():
    """gpt-oss's harmony replies: analysis bodies are reasoning, final (and commentary) bodies the
    answer, as paragraphs; the markup never shows; text outside the format is answer."""
    assert [split_reasoning("openai_gptoss", t) for t in HARMONY] == [
        ("User asks 2+2. Easy.", "4."), ("a", "Let me check.\n\nDone <b>."), ("cut off in thought", ""), ("x", ""),
        ("", "Plain answer <i>, no markup"), ("", ""), ("", "<|chan")]


def test_harmony_stream_equals_split_for_any_chunking():
    rng = random.Random(0)
    for text in HARMONY:
        want = split_reasoning("openai_gptoss", text)
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 30)))) if len(text) > 1 else []
            rs, got = reasoning_stream("openai_gptoss"), ["", ""]
            for a, b in zip([0] + cuts, cuts + [len(text)]):
                r, t = rs.feed(text[a:b])
                got = [got[0] + r, got[1] + t]
            r, t = rs.finish()
            assert (got[0] + r, got[1] + t) == want, (text, cuts)


def _format(reasoning, tools=None, include=True):
    from specdec.tokenizer import Tokenizer
    return ChatFormat(Tokenizer(BUNDLED_TARGET), False, tools=tools, reasoning=reasoning, include_reasoning=include)


def test_reasoning_then_tool_calls_streamed_and_not():
    """The answer after </think> goes to the tool parser: one hermes call, the same both ways."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, True, "hermes")
    text = 'Add them.</think>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    msg = _format("deepseek_r1", plan).choice(ChoiceResult(0, [text], finish_reason="stop"))
    assert msg["message"]["reasoning_content"] == "Add them." and msg["finish_reason"] == "tool_calls"
    assert msg["message"]["content"] is None and msg["message"]["tool_calls"][0]["function"]["name"] == "add"
    fmt, thought, content, calls, finish = _format("deepseek_r1", plan), "", "", [], None
    for i in range(0, len(text), 5):
        last = i + 5 >= len(text)
        d = fmt.delta(0, text[i:i + 5], [], 0, "stop" if last else None, None)
        if d is not None:
            thought += d["delta"].get("reasoning_content", "")
            content += d["delta"].get("content", "")
            calls += d["delta"].get("tool_calls", [])
            finish = d["finish_reason"] or finish
    assert (thought, content or None, finish) == ("Add them.", None, "tool_calls")
    joined = {}             # a call's first delta names it, the others add to its arguments
    for c in calls:
        joined.setdefault(c["index"], {"name": c["function"].get("name"), "arguments": ""})["arguments"] += \
            c["function"]["arguments"]
    assert list(joined.values()) == [c["function"] for c in msg["message"]["tool_calls"]]
    hidden = _format("deepseek_r1", include=False).choice(ChoiceResult(0, ["hmm</think>42"], finish_reason="stop"))
    assert "reasoning_content" not in hidden["message"] and hidden["message"]["content"] == "42"


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def live(request):
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=2, max_model_len=128)
    config = ServerConfig(served_model_names=("toy",), reasoning_parser=request.param)
    with LiveServer(build_app(llm, config)) as server:
        server.parser = request.param
        yield server


def test_through_the_server(live):
    """The toy model never closes a think block: with deepseek_r1 its whole reply is reasoning
    (the template would have opened the block), with qwen3 it is all answer; streamed alike."""
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="toy", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=12, temperature=0)
    msg = c.chat.completions.create(**kw).choices[0].message
    thought = msg.model_extra.get("reasoning_content")
    if live.parser == "deepseek_r1":
        assert thought and msg.content is None
    else:
        assert thought is None and msg.content
    streamed_thought, streamed_content = "", ""
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            streamed_thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_thought or None, streamed_content or None) == (thought, msg.content)
    off = c.chat.completions.create(extra_body={"include_reasoning": False}, **kw).choices[0].message
    assert "reasoning_content" not in (off.model_extra or {}) and off.content == msg.content
    # the toy's tokenizer has no <think> / </think> tokens (vLLM refuses the parser there): its
    # constrained replies are held from the first token, not split (a grammar waiting for a
    # </think> made of several ordinary tokens would never have started)
    choice = c.chat.completions.create(extra_body={"guided_choice": ["yes", "no"]}, **kw).choices[0].message
    assert choice.content in ("yes", "no") and not (choice.model_extra or {}).get("reasoning_content")


def test_a_reasoning_parser_needs_its_marker_tokens_in_the_grammar():
    """vLLM's parser refuses a tokenizer without <think> / </think> tokens: an explicit
    structured-outputs reasoning_parser there is a one-line ValueError, not a grammar that waits
    forever for markers the model never writes; enable_in_reasoning takes it."""
    with pytest.raises(ValueError, match="reasoning_parser 'deepseek_r1': the tokenizer has no <think> / </think> tokens"):
        LLM(BUNDLED_TARGET, num_speculative_tokens=0, structured_outputs_config={"reasoning_parser": "deepseek_r1"})
    LLM(BUNDLED_TARGET, num_speculative_tokens=0,
        structured_outputs_config={"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True})


def test_enable_in_reasoning_constrains_from_the_first_token():
    """--structured-outputs-config '{"enable_in_reasoning": true}': the grammar holds the reply
    from its first token, so a constrained reply has no think block and is not split."""
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128,
              structured_outputs_config={"enable_in_reasoning": True})
    config = ServerConfig(served_model_names=("toy",), reasoning_parser="deepseek_r1")
    with LiveServer(build_app(llm, config)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        choice = c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "def f(x):"}],
                                           max_tokens=12, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no"]}).choices[0].message
    assert choice.content in ("yes", "no") and not (choice.model_extra or {}).get("reasoning_content")


def test_flag_is_validated():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="granite")


def test_responses_api_returns_a_reasoning_item(live):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.responses.create(model="toy", input="def f(x):", max_output_tokens=12, temperature=0)
    chat = c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=12,
                                     temperature=0).choices[0].message
    kinds = [o.type for o in r.output]
    if live.parser == "deepseek_r1":           # never closed: all thinking, no message
        assert kinds == ["reasoning"] and r.output[0].content[0].text == chat.model_extra["reasoning_content"]
    else:
        assert kinds == ["message"] and r.output_text == chat.content


def test_harmony_tool_calls_streamed_and_not():
    """--tool-call-parser openai (gpt-oss): a harmony message to=functions.NAME is a call, its body
    the arguments (the header's two orders); the analysis is reasoning; finish_reason tool_calls;
    the same calls streamed under any chunking."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, True, "openai")
    replies = {
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Tokyo\"}": ("Need the weather.", None),
        "<|channel|>analysis<|message|>Two.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
        "<|message|>{\"city\": \"Oslo\"}<|call|>": ("Two.", None),
    }
    rng = random.Random(0)
    for text, (thought, content) in replies.items():
        msg = _format("openai_gptoss", plan).choice(ChoiceResult(0, [text], finish_reason="stop"))
        assert (msg["message"]["reasoning_content"], msg["message"]["content"], msg["finish_reason"]) == \
            (thought, content, "tool_calls")
        [call] = msg["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith('{"city"')
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 20)))
            fmt, got = _format("openai_gptoss", plan), {"r": "", "c": "", "calls": [], "finish": None}
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            for i, piece in enumerate(pieces):
                d = fmt.delta(0, piece, [], 0, "stop" if i == len(pieces) - 1 else None, None)
                if d is not None:
                    got["r"] += d["delta"].get("reasoning_content", "")
                    got["c"] += d["delta"].get("content", "")
                    got["calls"] += d["delta"].get("tool_calls", [])
                    got["finish"] = d["finish_reason"] or got["finish"]
            assert (got["r"], got["c"] or None, got["finish"]) == (thought, content, "tool_calls")
            assert [c["function"] for c in got["calls"]] == [call["function"]] and got["calls"][0]["index"] == 0
    # without tools the call's arguments are answer text; a non-harmony model cannot use the parser
    plain = _format("openai_gptoss").choice(ChoiceResult(0, [next(iter(replies))], finish_reason="stop"))
    assert plain["message"]["content"] == '{"city": "Tokyo"}' and "tool_calls" not in plain["message"]
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=64)
    with pytest.raises(ValueError, match="needs a gpt-oss model"):
        build_app(llm, ServerConfig(enable_auto_tool_choice=True, tool_call_parser="openai"))


def test_earlier_reasoning_reaches_the_chat_template():
    """An assistant message's reasoning_content (or reasoning) goes back to the template as
    reasoning_content (Qwen3's templates read it) and thinking (gpt-oss's keeps the analysis
    before a tool call); without it neither key is set."""
    from specdec.server.protocol import ChatCompletionRequest

    template = ("{% for m in messages %}{{ m.role }}[{{ m.thinking | default('-') }}|{{ m.reasoning_content | default('-') }}]"
                "{{ m.content }};{% endfor %}")
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=64)
    service = build_app(llm, ServerConfig(chat_template=template)).state.service
    for field in ("reasoning_content", "reasoning"):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4", field: "add them"},
                                              {"role": "user", "content": "and 3+3?"}])
        assert service._chat_text(req) == "user[-|-]2+2?;assistant[add them|add them]4;user[-|-]and 3+3?;"
