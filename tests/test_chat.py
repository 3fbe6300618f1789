"""Chat: LLM.chat, `specdec generate --chat`, the `specdec chat` REPL, and the default model."""

from __future__ import annotations

import io
import json

import pytest
import torch

from specdec import LLM, SamplingParams, defaults
from specdec.cli import main

CONV = [{"role": "user", "content": "def add(a, b):"}]
# prompt lookup with explicit sizes (vLLM's "[ngram]" would use 5 and 5, too long to match here)
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
NGRAM = ["--speculative-config", json.dumps(NGRAM_SPEC)]


@pytest.fixture(scope="module")
def chat_llm(gguf_files):
    return LLM(str(gguf_files["llama_q"]), speculative_config=NGRAM_SPEC)


def test_llm_chat_renders_the_template_as_transformers(chat_llm, gguf_files):
    from transformers import AutoTokenizer

    path = gguf_files["llama_q"]
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = chat_llm.chat(CONV, params)
    assert len(out) == 1
    assert out[0].prompt == hf.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    direct = chat_llm.generate({"prompt_token_ids": out[0].prompt_token_ids}, params)[0]
    assert out[0].outputs[0].token_ids == direct.outputs[0].token_ids
    # a list of conversations: one output each, in order; OpenAI-style text parts are accepted
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    two = chat_llm.chat([CONV, [{"role": "user", "content": "class Point:"}], parts], params)
    assert [o.outputs[0].token_ids for o in (two[0], two[2])] == [out[0].outputs[0].token_ids] * 2
    assert two[1].prompt != two[0].prompt
    with pytest.raises(ValueError, match="messages"):
        chat_llm.chat([], params)


def test_generate_chat_compare(gguf_files, capsys):
    code = main(["generate", "--model", str(gguf_files["llama_q"]), *NGRAM, "--chat", "def add(a, b):",
                 "--max-tokens", "12", "--ignore-eos", "--json", "--compare"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and len(result["token_ids"]) == 12
    assert result["compare"]["identical"] is True


def test_chat_repl_through_stdin(gguf_files, chat_llm, capsys, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    say = lambda conv: chat_llm.chat(conv, params)[0].outputs[0].text  # noqa: E731
    u1, u2, u3 = "def add(a, b):", "and again", "class Point:"
    a1 = say([{"role": "user", "content": u1}])
    a2 = say([{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}])
    a3 = say([{"role": "user", "content": u3}])                      # after /reset: a new conversation
    script = f"{u1}\n{u2}\n/reset\n\n{u3}\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "6", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0
    summaries = [line for line in err.splitlines() if line.startswith("[")]
    assert len(summaries) == 3 and "(conversation cleared)" in err
    assert all("6 tokens" in s and "acceptance" in s and "speedup ~" in s for s in summaries)
    assert out == f"{a1}\n{a2}\n{a3}\n"


def test_chat_session_keeps_the_conversation(chat_llm):
    from specdec.chat import Answer, ChatSession

    session = ChatSession(chat_llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), system=None,
                          compare=True)
    first = list(session.ask("def add(a, b):"))[-1]
    assert isinstance(first, Answer) and first.identical is True and first.plain_rate > 0
    second_prompt = session.prompt_ids("and again")
    assert chat_llm.tokenizer.decode(second_prompt).count("def add(a, b):") == 1    # the history is in it
    assert len(session.messages) == 2 and session.messages[1]["content"] == first.text
    assert "outputs identical" in session.summary(first)
    session.reset()
    assert session.messages == []


def test_chat_compare_decodes_plain_over_the_same_kv_cache_dtype(tiny_pair):
    from specdec.chat import ChatSession

    target, draft = tiny_pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=2, kv_cache_dtype="int8")
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), compare=True)
    assert session.plain.kv.dtype == llm.engine.kv.dtype == torch.int8


def test_default_without_the_package_is_the_bundled_pair(monkeypatch):


    monkeypatch.setattr(defaults, "smollm2_gguf", lambda: None)
    target, spec, draft = defaults.default_model()
    assert target == str(defaults.BUNDLED_TARGET) and spec is None and draft == str(defaults.BUNDLED_DRAFT)


def test_smollm2_is_the_default_with_suffix_decoding(smollm2):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM()
    assert llm.model_path == str(smollm2) and llm.spec.method == "suffix"
    assert llm.spec.model == str(defaults.MODELS_DIR / "smollm2-suffix")     # the bundled datastore
    out = llm.chat(question, params)[0]
    assert out.stats.accepted_tokens > 0
    plain = LLM(model=str(smollm2))                       # a model without speculative arguments: plain
    assert plain.engine.proposer is None
    assert plain.chat(question, params)[0].outputs[0].token_ids == out.outputs[0].token_ids
    exact = LLM(model=str(smollm2), quantization="none")  # weights dequantized, fp32 activations
    assert "Paris" in exact.chat(question, params)[0].outputs[0].text


def test_served_gguf_chat(chat_llm):
    """The OpenAI server on a GGUF: chat completions come out as LLM.chat's."""
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    params = SamplingParams(temperature=0, max_tokens=8)
    expected = chat_llm.chat(CONV, params)[0].outputs[0].text
    with LiveServer(build_app(chat_llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.model_extra["speculative"]["draft_tokens"] > 0


def test_generate_chat_and_the_repl_take_a_chat_template(gguf_files, chat_llm, capsys, monkeypatch, tmp_path):
    """--chat-template (a file or the template itself, as serve's) replaces the tokenizer's."""
    template = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = chat_llm.chat(CONV, params, chat_template=template)[0]
    assert expected.outputs[0].token_ids != chat_llm.chat(CONV, params)[0].outputs[0].token_ids
    for value in (template, str(path)):
        code = main(["generate", "--model", str(gguf_files["llama_q"]), *NGRAM, "--chat", CONV[0]["content"],
                     "--chat-template", value, "--max-tokens", "8", "--ignore-eos", "--json"])
        assert code == 0 and json.loads(capsys.readouterr().out)["token_ids"] == expected.outputs[0].token_ids
    monkeypatch.setattr("sys.stdin", io.StringIO(CONV[0]["content"] + "\n/exit\n"))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), *NGRAM, "--max-tokens", "8", "--ignore-eos",
                 "--chat-template", str(path)])
    assert code == 0 and capsys.readouterr().out == expected.outputs[0].text + "\n"
    assert main(["generate", "--model", str(gguf_files["llama_q"]), "--chat", "hi", "--chat-template", "missing.jinja"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_chat_repl_goes_on_after_a_message_too_long(gguf_files, capsys, monkeypatch):
    """A message that overflows the context is an error line; the session goes on."""
    monkeypatch.setattr("sys.stdin", io.StringIO("x " * 200 + "\ndef add(a, b):\n/exit\n"))
    code = main(["chat", "--model", str(gguf_files["llama_q"]), "--max-model-len", "64", "--max-tokens", "4",
                 "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0 and "prompt is too long" in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1 and out.endswith("\n")
