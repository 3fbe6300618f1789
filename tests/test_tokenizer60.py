"""Tokenizer parity with transformers 5 on tiny folders: split_special_tokens (a call's keyword,
tokenizer_config.json's, the attribute, generate()'s tokenization_kwargs), a tokenizer.json
with no decoder or no post-processor (convert_tokens_to_string, a pair's token_type_ids), and
get_special_tokens_mask."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import make_checkpoint, make_tokenizer
from test_tokenizer_58 import word_level

from specdec import LLM, SamplingParams
from specdec.async_llm import AsyncLLM
from specdec.tokenizer import Tokenizer

TEXT = "hi <|user|> there<|end|>"       # the text of two of make_tokenizer's special tokens
TEXTS = [TEXT, "def add(a, b):<|bos|>", "<|pad|><|eos|>"]


def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok60")
    make_tokenizer(folder)
    return folder


def test_split_special_tokens_keyword_as_transformers(bpe):
    ours, hf = Tokenizer(bpe), hf_tokenizer(bpe)
    assert hf(TEXT, split_special_tokens=True)["input_ids"] != hf(TEXT)["input_ids"]   # the text splits
    for split in (True, False):
        kw = {"split_special_tokens": split}
        assert ours(TEXT, **kw) == hf(TEXT, **kw)
        assert ours(TEXTS, TEXTS[::-1], padding=True, **kw) == hf(TEXTS, TEXTS[::-1], padding=True, **kw)
        assert ours.encode(TEXT, **kw) == hf.encode(TEXT, **kw)
        assert ours.tokenize(TEXT, **kw) == hf.tokenize(TEXT, **kw)
        assert ours(TEXT, tokenizer_kwargs=kw) == hf(TEXT, **kw)
        conv = [{"role": "user", "content": TEXT}]
        assert ours.apply_chat_template(conv, tokenizer_kwargs=kw) == hf.apply_chat_template(conv, tokenizer_kwargs=kw)
    assert not ours.split_special_tokens and ours(TEXT) == hf(TEXT)     # the call's keyword changed nothing


def test_split_special_tokens_attribute_and_config_as_transformers(bpe, tmp_path):
    """tokenizer_config.json's split_special_tokens, and the attribute set after loading, split every
    encoding the keyword does not override (save_pretrained keeps it)."""
    ours, hf = Tokenizer(bpe), hf_tokenizer(bpe)
    ours.split_special_tokens = hf.split_special_tokens = True
    ours.save_pretrained(tmp_path / "saved")
    for tok_ours, tok_hf in ((ours, hf), (Tokenizer(tmp_path / "saved"), hf_tokenizer(tmp_path / "saved"))):
        assert tok_ours.split_special_tokens and tok_hf.split_special_tokens
        assert tok_ours.encode(TEXT) == tok_hf.encode(TEXT) != Tokenizer(bpe).encode(TEXT)
        assert tok_ours(TEXTS) == tok_hf(TEXTS)
        assert tok_ours(TEXT, split_special_tokens=False) == tok_hf(TEXT, split_special_tokens=False)
        conv = [{"role": "user", "content": TEXT}]
        assert tok_ours.apply_chat_template(conv, add_generation_prompt=True) == \
            tok_hf.apply_chat_template(conv, add_generation_prompt=True)
    cfg = json.loads((bpe / "tokenizer_config.json").read_text())
    (tmp_path / "config").mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / "config" / name).write_bytes((bpe / name).read_bytes())
    (tmp_path / "config" / "tokenizer_config.json").write_text(json.dumps({**cfg, "split_special_tokens": True}))
    split = hf.encode(TEXT)
    assert Tokenizer(tmp_path / "config").encode(TEXT) == hf_tokenizer(tmp_path / "config").encode(TEXT) == split


def test_generate_tokenization_kwargs_split_special_tokens(tmp_path):
    """LLM.generate's and AsyncLLM.generate's tokenization_kwargs reach the tokenizer, as vLLM's
    reach transformers': the prompt's special-token text is split into ordinary tokens."""
    folder = make_checkpoint(tmp_path / "m", layers=1, hidden=32)
    split = hf_tokenizer(folder)(TEXT, split_special_tokens=True)["input_ids"]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm = LLM(str(folder))
    out = llm.generate([TEXT], params, tokenization_kwargs={"split_special_tokens": True})[0]
    assert out.prompt_token_ids == split != llm.generate([TEXT], params)[0].prompt_token_ids
    eng = AsyncLLM(model=str(folder), num_speculative_tokens=0)
    try:
        first = asyncio.run(eng.generate(TEXT, params, "s", tokenization_kwargs={"split_special_tokens": True})
                            .__anext__())
        assert first.prompt_token_ids == split
    finally:
        eng.shutdown()


def no_decoder_no_processor(folder):
    """A Unigram tokenizer.json with neither a decoder nor a post-processor."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    t = Backend(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["hello world pair text"] * 50,
                          trainers.UnigramTrainer(vocab_size=40, special_tokens=["<pad>", "<unk>"], unk_token="<unk>"))
    folder.mkdir()
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>", "pad_token": "<pad>"}))
    return folder


def test_no_decoder_joins_tokens_with_spaces_as_transformers(tmp_path):
    folder = no_decoder_no_processor(tmp_path / "ug")
    ours, hf = Tokenizer(folder), hf_tokenizer(folder)
    tokens = hf.convert_ids_to_tokens(hf.encode("hello world"))
    assert ours.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens) == " ".join(tokens)


def test_pair_type_ids_as_transformers(bpe, tmp_path):
    """A pair's second text gets type id 1 where the tokenizer.json has no post-processor, and in
    the windows of its overflowing tokens under any post-processor (they got 0), as tokenizers'
    encode(text, pair) gives them to transformers."""
    from tokenizers import processors

    bert_like = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                              special_tokens=[("<s>", 0), ("</s>", 1)])
    cases = [(no_decoder_no_processor(tmp_path / "ug"), ["hello world", "pair"], ["pair text", "hello world hello"], 14),
             (word_level(tmp_path / "words", bert_like, pad_token="<pad>"), ["a b", "c"], ["c d e a b", "a b c d e"], 8),
             (bpe, ["def add", "class"], ["import os\nimport sys", "for i in range(10):"], 12)]
    for folder, texts, pairs, max_length in cases:
        ours, hf = Tokenizer(folder), hf_tokenizer(folder)
        for kw in ({}, {"padding": "max_length", "max_length": 24},
                   {"truncation": "only_second", "max_length": max_length, "stride": 1,
                    "return_overflowing_tokens": True}):
            a = ours(texts, pairs, return_token_type_ids=True, **kw)
            b = hf(texts, pairs, return_token_type_ids=True, **kw)
            assert a == b, (folder.name, kw)
            assert [a.sequence_ids(i) for i in range(len(a["input_ids"]))] == \
                [b.sequence_ids(i) for i in range(len(b["input_ids"]))]
        assert ours(texts[0], return_token_type_ids=True) == hf(texts[0], return_token_type_ids=True)
    ours = Tokenizer(tmp_path / "ug")
    assert 1 in ours("hello world", "pair text", return_token_type_ids=True)["token_type_ids"]


def test_get_special_tokens_mask_as_transformers(bpe, tmp_path):
    """already_has_special_tokens: the ids of all_special_ids marked (what data collators ask), as
    transformers; else the mask of the sequence the tokenizer makes of the ids: transformers 5 gives
    it from a call with return_special_tokens_mask=True."""
    from tokenizers import processors

    bert_like = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                              special_tokens=[("<s>", 0), ("</s>", 1)])
    folders = [bpe, word_level(tmp_path / "words", bert_like, pad_token="<pad>"),
               word_level(tmp_path / "plain", pad_token="<pad>"), no_decoder_no_processor(tmp_path / "ug")]
    for folder in folders:
        ours, hf = Tokenizer(folder), hf_tokenizer(folder)
        ids = hf("a b c <pad> hello")["input_ids"]
        assert ours.get_special_tokens_mask(ids, already_has_special_tokens=True) == \
            hf.get_special_tokens_mask(ids, already_has_special_tokens=True)
        with pytest.raises(ValueError, match="already formatted"):
            ours.get_special_tokens_mask(ids, ids, already_has_special_tokens=True)
        for first, second in (("a b c", None), ("a b", "c d e"), ("", None), ("a", "")):
            ids_0 = hf(first, add_special_tokens=False)["input_ids"]
            ids_1 = None if second is None else hf(second, add_special_tokens=False)["input_ids"]
            batch = hf([first], None if second is None else [second], return_special_tokens_mask=True)
            assert ours.get_special_tokens_mask(ids_0, ids_1) == batch["special_tokens_mask"][0], (folder, first, second)
