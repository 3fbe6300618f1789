"""Chat content as vLLM and transformers take it: continue_final_message under a template that
trims the content (transformers cuts at its tag and drops the whitespace before it), and the
content parts vLLM's chat_utils reads as text (plain strings, input_text, output_text, refusal; a
part with no text skipped)."""

from __future__ import annotations

import pytest
import transformers

from specdec import LLM, SamplingParams
from specdec.tokenizer import Tokenizer

# Llama 3's way: each message's content `| trim`med
TRIM = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] | trim + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
KEEP = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
PARTS = ("{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}{{ p['text'] | trim }}{% endfor %}"
         "{% endfor %}")
USER = {"role": "user", "content": "What is 2+2?"}
ONE = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]))


@pytest.mark.parametrize("template, content", [
    (TRIM, "The answer is "),        # trimmed: transformers drops the trailing space
    (TRIM, "a\n\n"),
    (TRIM, "  "),
    (TRIM, ""),
    (TRIM, "no space"),
    (KEEP, "kept "),                 # the template keeps it: so does transformers
    (KEEP, "x \n"),
    (PARTS, [{"type": "text", "text": "a "}, {"type": "text", "text": "b "}]),
    (PARTS, [{"type": "text", "text": "a "}, {"type": "image"}]),
])
def test_continue_final_message_cut_as_transformers(tiny_pair, template, content):
    ours, hf = Tokenizer(str(tiny_pair[0])), transformers.AutoTokenizer.from_pretrained(tiny_pair[0])
    conv = [USER, {"role": "assistant", "content": content}]
    kw = dict(chat_template=template, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours.apply_chat_template(conv, **kw) == hf.apply_chat_template(conv, **kw)


@pytest.mark.parametrize("template, last", [
    (TRIM, {"role": "assistant", "content": None}),           # nothing to continue
    (TRIM, {"role": "assistant"}),
    (PARTS, {"role": "assistant", "content": [{"type": "image"}]}),
    ("{% for m in messages %}{{ m['text'] }}{% endfor %}", {"role": "assistant", "content": "x", "text": "y"}),
    ("{% for m in messages %}{{ m.content | replace('CONTINUE', '') }}{% endfor %}",    # the tag removed
     {"role": "assistant", "content": "x"}),
])
def test_continue_final_message_refused_as_transformers(tiny_pair, template, last):
    ours, hf = Tokenizer(str(tiny_pair[0])), transformers.AutoTokenizer.from_pretrained(tiny_pair[0])
    kw = dict(chat_template=template, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message"):
        hf.apply_chat_template([USER, last], **kw)
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template([USER, last], **kw)


def test_llm_chat_continues_a_trimmed_message_as_transformers(llm, tiny_pair):
    """LLM.chat's prompt (what vLLM's chat renders through transformers) ends at "is", not "is "."""
    conv = [USER, {"role": "assistant", "content": "The answer is "}]
    want = transformers.AutoTokenizer.from_pretrained(tiny_pair[0]).apply_chat_template(
        conv, chat_template=TRIM, tokenize=False, continue_final_message=True)
    out = llm.chat(conv, ONE, chat_template=TRIM, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == want and out.prompt.endswith("The answer is")


def _user_text(llm, content, fmt="string"):
    template = KEEP if fmt == "string" else \
        "{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    return llm.chat([{"role": "user", "content": content}], ONE, chat_template=template,
                    chat_template_content_format=fmt, add_generation_prompt=False)[0].prompt


def test_llm_chat_takes_the_text_parts_vllm_takes(llm, caplog):
    """vLLM's chat_utils: plain strings, input_text, output_text and refusal parts are text (each
    was a ValueError); a text part whose text is None is skipped with a warning (it was an empty
    line); parts are joined one per line, or kept as parts for a template that loops over them."""
    cases = [
        (["a", "b"], "a\nb"),
        ([{"type": "input_text", "text": "a"}], "a"),
        ([{"type": "output_text", "text": "a"}, "b"], "a\nb"),
        ([{"type": "refusal", "refusal": "no"}], "no"),
        ([{"type": "text", "text": None}, {"type": "text", "text": "x"}], "x"),
        ([{"type": "refusal", "refusal": None}, {"type": "text", "text": "x"}], "x"),
    ]
    for content, text in cases:
        assert _user_text(llm, content) == f"<|user|>\n{text}<|end|>\n", content
    assert "skipping" in caplog.text
    assert _user_text(llm, ["a", {"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}],
                      "openai") == "<|user|>[a][no]"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"image_url": "http://x/y.png"}, 5])
def test_llm_chat_refuses_media_parts(llm, part):
    with pytest.raises(ValueError, match="text only"):
        _user_text(llm, [{"type": "text", "text": "see"}, part])


@pytest.fixture(scope="module")
def served(tiny_pair):
    """A server on its own engine (a server's worker thread must be its engine's only caller)."""
    from test_server import LiveServer

    from specdec.server import ServerConfig, build_app

    with LiveServer(build_app(LLM(str(tiny_pair[0])), ServerConfig(served_model_names=("toy",), chat_template=TRIM))) \
            as server:
        yield server


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_server_continues_a_trimmed_message_as_transformers(served, tiny_pair):
    """The server's chat renders through the same tokenizer: its prompt is transformers' too."""
    conv = [USER, {"role": "assistant", "content": "The answer is "}]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_pair[0])
    want = hf.apply_chat_template(conv, chat_template=TRIM, tokenize=False, continue_final_message=True)
    out = _client(served).chat.completions.create(model="toy", messages=conv, max_tokens=1, temperature=0,
                                                  extra_body={"add_generation_prompt": False,
                                                              "continue_final_message": True})
    assert out.usage.prompt_tokens == len(hf.encode(want, add_special_tokens=False))
    assert out.usage.prompt_tokens != len(hf.encode(want + " ", add_special_tokens=False))


def test_server_takes_the_text_parts_vllm_takes(served, llm):
    """The chat endpoint reads content parts as LLM.chat does (vLLM's chat_utils); a part without
    its text, or an image, stays a 400 (vLLM's request model requires the text)."""
    import openai

    content = ["a", {"type": "input_text", "text": "b"}, {"type": "refusal", "refusal": "c"},
               {"type": "output_text", "text": "d"}]
    out = _client(served).chat.completions.create(model="toy", messages=[{"role": "user", "content": content}],
                                                  max_tokens=1, temperature=0)
    want = llm.chat([{"role": "user", "content": content}], ONE, chat_template=TRIM)[0]
    assert "a\nb\nc\nd" in want.prompt and out.usage.prompt_tokens == len(want.prompt_token_ids)
    for part in ({"type": "refusal", "refusal": None}, {"type": "text", "text": None},
                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}}):
        with pytest.raises(openai.BadRequestError):
            _client(served).chat.completions.create(model="toy", messages=[{"role": "user", "content": ["a", part]}],
                                                    max_tokens=1)
