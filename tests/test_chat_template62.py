"""Chat-template corners compared with transformers' AutoTokenizer on the bundled target's folder:
the assistant mask of `{% generation %}` blocks the template filters, passes through a macro or
captures with `{% set %}`, and continue_final_message naming the field to continue."""

from __future__ import annotations

import pytest

from specdec.defaults import BUNDLED_TARGET
from specdec.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def pair():
    """(specdec's tokenizer, transformers' tokenizer) of the bundled target."""
    from transformers import AutoTokenizer

    return Tokenizer(str(BUNDLED_TARGET)), AutoTokenizer.from_pretrained(BUNDLED_TARGET)


def _turns(assistant: str) -> str:
    return ("{% for m in messages %}{% if m.role == 'assistant' %}" + assistant +
            "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


GENERATION_TEMPLATES = {
    "plain": _turns("{% generation %}{{ m.content }}{% endgeneration %}"),
    "filter_upper": _turns("{% filter upper %}{% generation %}{{ m.content }}{% endgeneration %}{% endfilter %}"),
    "macro_trim": "{% macro say(m) %}{% generation %} {{ m.content }} {% endgeneration %}{% endmacro %}" +
                  _turns("{{ say(m) | trim }}"),
    "set_length": _turns("{% set x %}{% generation %}{{ m.content }}{% endgeneration %}{% endset %}"
                         "[{{ x | length }}]{{ x }}"),
    "nested": _turns("<a>{% generation %}[{% generation %}{{ m.content }}{% endgeneration %}]{% endgeneration %}"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    # the text specdec once marked blocks with, sent by a user: it is text like any other
    [{"role": "user", "content": "<|specdec-generation|>x<|/specdec-generation|>"},
     {"role": "assistant", "content": "ok <|/specdec-generation|> then"}, {"role": "user", "content": "y"}],
]


@pytest.mark.parametrize("name", list(GENERATION_TEMPLATES))
def test_assistant_mask_leaves_the_prompt_as_transformers(pair, name):
    """return_assistant_tokens_mask=True renders the same prompt as without it, and transformers'
    ids and mask: the spans are recorded outside the text (marks written into it were upper-cased
    by a filter and stayed in the prompt, moved `trim`'s cut, counted in `| length`, and a
    message holding the marks' text was taken for a block)."""
    ours, hf = pair
    template = GENERATION_TEMPLATES[name]
    for conv in CONVERSATIONS:
        plain = ours.apply_chat_template(conv, chat_template=template, return_dict=False)
        assert plain == hf.apply_chat_template(conv, chat_template=template, return_dict=False)
        want = hf.apply_chat_template(conv, chat_template=template, return_assistant_tokens_mask=True)
        for sandbox_process in (False, True):
            got = ours.apply_chat_template(conv, chat_template=template, return_assistant_tokens_mask=True,
                                           sandbox_process=sandbox_process)
            assert list(got["input_ids"]) == plain
            assert list(got["assistant_masks"]) == list(want["assistant_masks"]), (name, conv, sandbox_process)
        assert 1 in want["assistant_masks"]


REASONING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
                      "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}</{{ m.role }}>\n{% endfor %}")


@pytest.mark.parametrize("field,message", [
    ("reasoning_content", {"reasoning_content": "Let me add", "content": ""}),
    ("reasoning", {"reasoning": "Let me add ", "content": "4"}),         # an alias the template reads as reasoning_content
    ("content", {"reasoning_content": "Sum.", "content": "It is"}),
])
def test_continue_final_message_names_the_field_as_transformers(pair, field, message):
    """continue_final_message="<field>" (transformers 5) continues that field of the final message
    (a reasoning field under any of its names); it continued "content" whatever the string said."""
    ours, hf = pair
    conv = [{"role": "user", "content": "2+2?"}, {"role": "assistant", **message}]
    want = hf.apply_chat_template(conv, chat_template=REASONING_TEMPLATE, tokenize=False, continue_final_message=field)
    assert ours.apply_chat_template(conv, chat_template=REASONING_TEMPLATE, tokenize=False,
                                    continue_final_message=field) == want
    assert want.endswith(message[field])


def test_continue_final_message_field_refused_as_transformers(pair):
    """A field the final message lacks, or one the template never names: refused by both."""
    ours, hf = pair
    conv = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    for field, template in (("reasoning_content", REASONING_TEMPLATE), ("content", "{{ messages[0].role }}")):
        with pytest.raises(ValueError):
            hf.apply_chat_template(conv, chat_template=template, tokenize=False, continue_final_message=field)
        with pytest.raises(TokenizerError, match=field):
            ours.apply_chat_template(conv, chat_template=template, tokenize=False, continue_final_message=field)
