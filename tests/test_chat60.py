"""Chat messages reach the template as vLLM's chat_utils hands them over (parse_chat_messages,
_postprocess_messages), through LLM.chat, the server and the tokenizer; and the llama3_json, hermes
and pythonic tool parsers answer vLLM's own test cases. The templates are real ones (Llama 3.1's
and Qwen3's as published; Mistral Small 3.1's two lines that matter, its loop over content parts and
`[TOOL_RESULTS]` + `content|string`; Phi-4-mini's), on the toy model's tokenizer; the expected
text is transformers' rendering of the messages vLLM would give it."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import transformers
from conftest import make_checkpoint

from specdec import LLM, SamplingParams
from specdec.server.tools import ToolPlan, ToolStream, extract

ONE = SamplingParams(max_tokens=1, temperature=0)
USER = {"role": "user", "content": "Weather in Oslo?"}

LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Mistral-Small-3.1-24B-Instruct-2503's template cut down to its loop over content parts and its
# `[TOOL_RESULTS]` + `content|string` (both lines as in llama.cpp's copy of the real one)
MISTRAL31 = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if message['content'] is string %}
            {{- '[INST]' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST]' }}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- endif %}
            {%- endfor %}
            {{- '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for b in message['content'] %}{{- b['text'] }}{%- endfor %}{%- endif %}
        {%- if message.tool_calls is defined and message.tool_calls is not none %}
            {{- '[TOOL_CALLS]' + message.tool_calls|tojson }}
        {%- endif %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content|string + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

PHI4MINI = r"""{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A one-layer toy whose context holds Llama 3.1's system preamble (the toy tokenizer's
    tokens are short)."""
    return make_checkpoint(tmp_path_factory.mktemp("chat60") / "m", layers=1, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model))


@pytest.fixture(scope="module")
def served(model):
    """A server on its own engine that runs a request's chat_template (each test names its own)."""
    from test_server import LiveServer

    from specdec.server import ServerConfig, build_app

    config = ServerConfig(served_model_names=("toy",), trust_request_chat_template=True)
    with LiveServer(build_app(LLM(str(model)), config)) as server:
        yield server


def _want(hf, messages, template) -> str:
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False)


def _llm_prompt(llm, messages, template) -> str:
    return llm.chat(messages, ONE, chat_template=template, add_generation_prompt=False)[0].prompt


def _server_prompt(served, messages, template) -> str:
    """The server's prompt for messages (/tokenize, then /detokenize)."""
    body = {"model": "toy", "messages": messages, "chat_template": template, "add_generation_prompt": False}
    r = httpx.post(served.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return httpx.post(served.url + "/detokenize", json={"model": "toy", "tokens": r.json()["tokens"]},
                      timeout=60).json()["prompt"]


def _call(name: str, arguments: str) -> dict:
    return {"id": "abcDEF123", "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- D1: an assistant's `tool_calls: []` is dropped (vLLM's _postprocess_messages) ----

def test_empty_tool_calls_render_the_plain_turn(llm, served, hf):
    """OpenAI clients echo `tool_calls: []` back: Llama 3.1's template, which tests `'tool_calls' in
    message`, refused it ("only supports single tool-calls at once", a 400); vLLM drops the list."""
    import openai

    conv = [USER, {"role": "assistant", "content": "ok", "tool_calls": []}, {"role": "user", "content": "Thanks"}]
    want = _want(hf, [USER, {"role": "assistant", "content": "ok"}, conv[2]], LLAMA31)
    assert "assistant<|end_header_id|>\n\nok<|eot_id|>" in want
    assert _llm_prompt(llm, conv, LLAMA31) == want
    assert _server_prompt(served, conv, LLAMA31) == want
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="toy", messages=conv, max_tokens=1, temperature=0,
                                         extra_body={"chat_template": LLAMA31, "add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(hf.encode(want, add_special_tokens=False))


# ---- D2: a tool message's content parts are joined into a string ----

def test_tool_results_reach_an_openai_format_template_as_text(llm, served, hf):
    """Mistral Small 3.1's template loops over content parts (so parts are given as parts) but
    prints a tool result with `content|string`: it printed Python's repr of the parts list.
    vLLM joins a tool message's text parts with newlines."""
    call = {"role": "assistant", "content": None, "tool_calls": [_call("w", '{"c": 1}')]}
    for content, text in (([{"type": "text", "text": "sunny"}, {"type": "text", "text": "3C"}], "sunny\n3C"),
                          ("plain", "plain")):
        conv = [USER, call, {"role": "tool", "tool_call_id": "abcDEF123", "content": content}]
        vllm = [{"role": "user", "content": [{"type": "text", "text": USER["content"]}]},
                {"role": "assistant", "content": "", "tool_calls": [{**_call("w", ""), "function": {
                    "name": "w", "arguments": {"c": 1}}}]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": text}]
        want = _want(hf, vllm, MISTRAL31)
        assert want.endswith(f"[TOOL_RESULTS]{text}[/TOOL_RESULTS]"), want
        assert _llm_prompt(llm, conv, MISTRAL31) == want
        assert _server_prompt(served, conv, MISTRAL31) == want


# ---- D3: history arguments that are not JSON are {} ----

def test_history_arguments_that_are_not_json_are_an_empty_object(llm, served, hf):
    """Qwen3's template prints string arguments as they are: `{"city": "Os` made the prompt's call
    broken JSON. vLLM gives {} for any string that does not parse (whitespace too), and for "null"."""
    for arguments in ('{"city": "Os', "  ", "null"):
        conv = [USER, {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", arguments)]}]
        want = _want(hf, [USER, {"role": "assistant", "content": "", "tool_calls": [
            {**_call("get_weather", ""), "function": {"name": "get_weather", "arguments": {}}}]}], QWEN3)
        assert '{"name": "get_weather", "arguments": {}}' in want
        assert _llm_prompt(llm, conv, QWEN3) == want
        assert _server_prompt(served, conv, QWEN3) == want


# ---- D4: the tokenizer copies `reasoning` as transformers 5 does ----

def test_tokenizer_gives_reasoning_to_the_template_as_transformers(llm, hf):
    """llm.get_tokenizer().apply_chat_template: Qwen3's template reads reasoning_content, which
    transformers 5 fills from `reasoning` (or `thinking`); the thought was lost."""
    tok = llm.get_tokenizer()
    for key in ("reasoning", "thinking"):
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", key: "greet back"}]
        for gen in (False, True):
            want = hf.apply_chat_template(conv, chat_template=QWEN3, tokenize=False, add_generation_prompt=gen)
            assert "<think>\ngreet back\n</think>" in want
            assert tok.apply_chat_template(conv, chat_template=QWEN3, tokenize=False, add_generation_prompt=gen) == want


# ---- D8: LLM.chat gives the template vLLM's message fields only, as the server does ----

def test_llm_chat_leaves_out_fields_vllm_leaves_out(llm, served, hf):
    """Phi-4-mini's template prints a system message's `tools`: vLLM (and specdec's server) keep
    only role, content, name, tool_calls, tool_call_id, reasoning (tools on a developer message),
    so the same conversation rendered differently through LLM.chat."""
    conv = [{"role": "system", "content": "sys", "tools": '[{"name": "f"}]', "extra": 1}, USER]
    want = _want(hf, [{"role": "system", "content": "sys"}, USER], PHI4MINI)
    assert "<|tool|>" not in want
    assert _llm_prompt(llm, conv, PHI4MINI) == want
    assert _server_prompt(served, conv, PHI4MINI) == want


# ---- the tool parsers, against vLLM's tests/tool_parsers cases ----

def _plan(parser: str) -> ToolPlan:
    return ToolPlan("auto", ({"type": "function", "function": {"name": "x"}},), parser=parser)


def _streamed(parser: str, text: str, seed: int) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of the reply fed in random pieces."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    ts, content, calls = ToolStream(_plan(parser)), "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        c, d = ts.feed(text[a:b])
        content, calls = content + c, calls + d
    c, d, finish = ts.finish("stop")
    joined = {}             # a call's first delta names it, the others add to its arguments
    for x in calls + d:
        joined.setdefault(x["index"], [x["function"].get("name"), ""])[1] += x["function"]["arguments"]
    return content + c or None, [tuple(v) for v in joined.values()], finish


def _strict(arguments: str):
    """json.loads as a strict parser (JavaScript's, Go's) reads it: no NaN or Infinity."""
    return json.loads(arguments, parse_constant=lambda c: pytest.fail(f"{c} in {arguments!r}"))


Q1, Q2 = '{"name": "searchTool", "parameters": {"query": "test1"}}', '{"name": "getOpenIncidentsTool", "parameters": {}}'
LLAMA3_CASES = [     # vLLM's tests/tool_parsers/test_llama3_json_tool_parser.py: (reply, calls, prose before)
    ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     [("getOpenIncidentsTool", {})], "Here is the result: "),
    (f"Here are the results: {Q1}; {Q2}; " + '{"name": "searchTool", "parameters": {"query": "test2"}} Would you '
     "like to know more?", [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
                            ("searchTool", {"query": "test2"})], "Here are the results: "),
    ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
     [("searchTool", {"query": "test"})], None),
    ('{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}',
     [("searchTool", {"query": "test"})], None),
    (f"<|python_tag|>{Q1}\n{Q2}", [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})], None),
    ('{"name": "searchTool", "arguments": {"query": "test"}}', [("searchTool", {"query": "test"})], None),
]


@pytest.mark.parametrize("text,calls,prose", LLAMA3_CASES)
def test_llama3_json_finds_the_calls_vllm_finds(text, calls, prose):
    """A call after prose, or followed by prose with braces in it, was no call (the parser took
    only a reply that was all calls); vLLM's parser returns the calls and content null. A stream
    finds the same calls, its prose before the first `{` sent before they were known."""
    content, got, finish = extract(_plan("llama3_json"), text, "stop")
    assert (content, finish) == (None, "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    for seed in range(10):
        s_content, s_calls, s_finish = _streamed("llama3_json", text, seed)
        assert (s_content, s_finish) == (prose, "tool_calls")
        assert [(n, json.loads(a)) for n, a in s_calls] == calls


@pytest.mark.parametrize("text", ['{"name": "invalidTool", "parameters": {invalid json}', '{"parameters": {}}',
                                  '{"name": "toolWithoutParams"}', "This is just some text without any tool calls",
                                  "Use {braces} and {\"a\": 1} freely."])
def test_llama3_json_text_without_calls_stays_text(text):
    assert extract(_plan("llama3_json"), text, "stop") == (text, [], "stop")
    for seed in range(5):
        assert _streamed("llama3_json", text, seed) == (text, [], "stop")


def test_llama3_json_streams_code_and_json_that_are_no_call_as_they_come():
    """A brace in prose or code held the rest of the reply to its end (a 5.7k-character C answer
    streamed 43 characters live, the regression tester's t_l3stream.py); a `{` is held only while
    it may still open a call, so text streams on once it shows it does not, and a call after it
    is still found, as the whole reply's parse finds it."""
    code = "Here:\n```c\nint main(void) {\n  if (x) { return 1; }\n  return 0;\n}\n```\nAnd {\"a\": 1} too. "
    ts, sent = ToolStream(_plan("llama3_json")), ""
    for i, ch in enumerate(code):
        sent += ts.feed(ch)[0]
        assert len(sent) >= i + 1 - 9, (i, sent)        # at most a short tail held back at any point
    call = '{"name": "searchTool", "parameters": {"query": "x", "on": true, "n": -1.5}}'
    for seed in range(10):
        assert _streamed("llama3_json", code + call, seed)[1:] == (
            [("searchTool", json.dumps({"query": "x", "on": True, "n": -1.5}))], "tool_calls")
        assert _streamed("llama3_json", code, seed) == (code, [], "stop")
    assert extract(_plan("llama3_json"), code + call, "stop")[1][0]["function"]["name"] == "searchTool"


def test_hermes_bare_string_arguments_are_json():
    """vLLM's test_hermes_parser_non_streaming_bare_string_arguments: `"arguments": "hello"` is
    the JSON string '"hello"' (it was `hello`, which no client parses); a string that is itself
    a serialized object is still those arguments (…_serialized_arguments)."""
    for body, want in (('{"name": "do_thing", "arguments": "hello"}', "hello"),
                       ('{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}',
                        {"param": "max_connections"})):
        text = f"<tool_call>\n{body}\n</tool_call>"
        content, calls, _ = extract(_plan("hermes"), text, "stop")
        assert content is None and json.loads(calls[0]["function"]["arguments"]) == want
        for seed in range(5):
            _, s_calls, _ = _streamed("hermes", text, seed)
            assert [json.loads(a) for _, a in s_calls] == [want]


WEATHER = "get_weather(city='San Francisco', metric='celsius')"


@pytest.mark.parametrize("bad", ["calc(x=1e999)", "bad(x=b'z')", "calc(x=[1, -1e999])"])
def test_pythonic_drops_a_bad_call_and_keeps_its_siblings(bad):
    """vLLM's test_non_finite_argument_rejected and test_bad_sibling_call_does_not_drop_good_calls:
    1e999 gave arguments `{"x": Infinity}` (no JSON to a strict parser), and one call whose
    arguments are not JSON made the whole list text."""
    text = f"[{bad}, {WEATHER}]"
    content, calls, finish = extract(_plan("pythonic"), text, "stop")
    assert (content, finish) == (None, "tool_calls")
    assert [(c["function"]["name"], _strict(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"})]
    for seed in range(5):
        s_content, s_calls, _ = _streamed("pythonic", text, seed)
        assert s_content is None and [(n, _strict(a)) for n, a in s_calls] == [
            ("get_weather", {"city": "San Francisco", "metric": "celsius"})]
    assert extract(_plan("pythonic"), f"[{bad}]", "stop") == (f"[{bad}]", [], "stop")   # none left: text
