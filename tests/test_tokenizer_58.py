"""`tok(texts)` and the chat templates against transformers 5 on tiny folders: the memory a call's
result holds, add_bos_token in tokenizer_config.json, a nested input read as a pair, overflowing
tokens with a stride, and a folder's several named chat templates."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest
from conftest import make_tokenizer

from specdec.tokenizer import Tokenizer

from test_tokenizer_hf_api import same

CONV = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]




def word_level(folder, post_processor=None, **cfg):
    """A whitespace word-level tokenizer.json (<s>, </s>, <pad>, a..e) and tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    t = Backend(models.WordLevel({w: i for i, w in enumerate("<s> </s> <pad> <unk> a b c d e".split())},
                                 unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>", "<pad>"])
    t.post_processor = post_processor
    folder.mkdir(parents=True, exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>", **cfg}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """name -> (specdec's tokenizer, transformers') of a byte-level BPE folder and a word-level one
    whose template marks a pair (<s> A </s> B:1 </s>:1)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok58")
    make_tokenizer(root / "bpe")
    template = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                             special_tokens=[("<s>", 0), ("</s>", 1)])
    word_level(root / "words", template, pad_token="<pad>")
    return {name: (Tokenizer(root / name), AutoTokenizer.from_pretrained(root / name)) for name in ("bpe", "words")}


def test_call_result_holds_no_per_token_lists(tiny):
    """tok(texts) held eight Python lists per text (~150 bytes a token here, 20 for the ids and
    mask); the token columns are read from the tokenizers.Encoding when asked, as transformers
    does, and still match it."""
    ours, hf = tiny["bpe"]
    texts = ["def add(a, b):\n    return a + b\n" * 6 + str(i) for i in range(200)]
    ours(texts)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        enc = ours(texts)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    n = sum(map(len, enc["input_ids"]))
    assert held / n < 60, f"{held / n:.0f} bytes held per token"
    want = hf(texts)
    same(enc, want)
    for i in (0, 199):
        assert enc.tokens(i) == want.tokens(i) and enc.word_ids(i) == want.word_ids(i)
        assert enc.sequence_ids(i) == want.sequence_ids(i)
        assert [enc.char_to_token(i, c) for c in range(40)] == [want.char_to_token(i, c) for c in range(40)]


def test_padded_rows_token_columns(tiny):
    """Padding and a pair put tokens around an Encoding: the columns read afterwards have them."""
    for ours, hf in tiny.values():
        kw = dict(padding=True, return_special_tokens_mask=True, return_offsets_mapping=True,
                  return_token_type_ids=True)
        for args in ((["a b c", "d"],), (["a b", "c"], ["d e", "a b c d"])):
            a, b = ours(*args, **kw), hf(*args, **kw)
            same(a, b)
            for i in range(2):
                assert (a.tokens(i), a.word_ids(i), a.sequence_ids(i)) == (b.tokens(i), b.word_ids(i),
                                                                           b.sequence_ids(i))


@pytest.mark.parametrize("tokenizer_class", [None, "PreTrainedTokenizerFast", "LlamaTokenizer"])
def test_add_bos_token_in_config_is_ignored_as_transformers(tmp_path, tokenizer_class):
    """transformers 5 drops tokenizer_config.json's add_bos_token where a tokenizer.json is
    present (BOS is its post-processor's to add): specdec put BOS in front of every text."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    cfg = {"add_bos_token": True, **({"tokenizer_class": tokenizer_class} if tokenizer_class else {})}
    for name, post in (("none", None), ("eos", processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B:1", special_tokens=[("</s>", 1)]))):
        folder = word_level(tmp_path / name, post, **cfg)
        ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert ours.encode("a b") == hf.encode("a b") and ours("a b").input_ids[0] != ours.bos_token_id
        same(ours(["a b", "c"], ["d", "e a"]), hf(["a b", "c"], ["d", "e a"]))
        assert ours.add_bos_token == hf.add_bos_token is False


def test_nested_single_input_is_a_batch_of_pairs(tiny):
    """tok([["a", "b"]]) is a batch of one (text, pair), as transformers reads it (a TypeError)."""
    for ours, hf in tiny.values():
        for batch in ([["a b", "c"]], [("a", "b c"), ("d", "e")], ["a b", ("c", "d")]):
            a, b = ours(batch, return_token_type_ids=True), hf(batch, return_token_type_ids=True)
            same(a, b)
            assert a.sequence_ids(0) == b.sequence_ids(0) and a.n_sequences == b.n_sequences
        assert ours.encode([["a b", "c"]]) == hf([["a b", "c"]])["input_ids"]


def test_overflowing_tokens_with_stride_as_transformers(tiny):
    """return_overflowing_tokens=True: a row per window of the truncated text(s), overlapping by
    `stride` tokens, and overflow_to_sample_mapping (it was refused)."""
    text, long = "a b c d e a b c d e", "def add(a, b):\n    return a + b\n" * 3
    cases = [((["a b c d e a", "b"],), dict(max_length=5, stride=1)),
             ((text,), dict(max_length=6, stride=2, truncation_side="left")),
             ((text, "d e"), dict(max_length=7, stride=1, truncation="only_first")),
             ((["d e", "a"], [text, "b c d e a b"]), dict(max_length=7, stride=1, truncation="only_second")),
             ((text, "a b c d e"), dict(max_length=8, stride=1)),
             ((text,), dict(max_length=5, stride=1, return_tensors="pt", padding=True,
                            return_offsets_mapping=True, return_length=True)),
             (("a b",), dict(max_length=6, stride=1)), ((["a b c"],), {})]
    for ours, hf in tiny.values():
        for args, kw in cases + [(([long, long[:20]],), dict(max_length=9, stride=3))]:
            kw = {"truncation": True, "return_overflowing_tokens": True, **kw}
            a, b = ours(*args, **kw), hf(*args, **kw)
            same(a, b)
            assert "overflow_to_sample_mapping" in a
            for i in range(len(a["input_ids"])):
                assert (a.tokens(i), a.sequence_ids(i)) == (b.tokens(i), b.sequence_ids(i)), (args, kw, i)
        with pytest.raises(ValueError, match="stride"):      # tokenizers panics
            ours(text, truncation=True, max_length=4, stride=3, return_overflowing_tokens=True)


def named_folder(folder, layout: str):
    """A folder with templates "default", "tool_use" and "rag" (as tokenizer_config.json's list
    or as chat_template.jinja + additional_chat_templates/), or the extra ones alone."""
    make_tokenizer(folder)
    templates = {n: f"{n.upper()}:{{{{ tools | length if tools else 0 }}}}:{{% for m in messages %}}"
                    "{{ m.content }}{% endfor %}" for n in ("default", "tool_use", "rag")}
    if layout == "config":
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        return folder
    if layout == "files":
        (folder / "chat_template.jinja").write_text(templates["default"])
    (folder / "additional_chat_templates").mkdir()
    for name in ("tool_use", "rag"):
        (folder / "additional_chat_templates" / f"{name}.jinja").write_text(templates[name])
    return folder


@pytest.mark.parametrize("layout", ["config", "files", "extra_only"])
def test_several_chat_templates_are_a_dict_as_transformers(tmp_path, layout):
    """tok.chat_template is transformers' dict by name where a folder has several templates (it
    was the default one's text); the default, tool_use and named ones render as transformers'."""
    from transformers import AutoTokenizer

    folder = named_folder(tmp_path / "named", layout)
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(hf.chat_template, dict) and ours.chat_template == hf.chat_template
    calls = [{"chat_template": "rag"}, {"chat_template": "tool_use", "tools": TOOLS}, {"chat_template": "X{{ 1 }}"}]
    if layout != "extra_only":
        calls += [{}, {"tools": TOOLS}, {"chat_template": "default"}]
    for kw in calls:
        assert ours.apply_chat_template(CONV, tokenize=False, **kw) == hf.apply_chat_template(CONV, tokenize=False, **kw)
    if layout == "extra_only":          # no default: a name or a template must be given
        with pytest.raises(ValueError):
            ours.apply_chat_template(CONV, tokenize=False)
        return
    ours.save_pretrained(tmp_path / "saved")
    assert Tokenizer(tmp_path / "saved").chat_template == AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template \
        == hf.chat_template


def test_single_chat_template_stays_a_string(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "one"
    make_tokenizer(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours.chat_template, str) and ours.chat_template == hf.chat_template
