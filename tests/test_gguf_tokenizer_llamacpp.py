"""GGUF files tokenize, add BOS, stop and load as llama.cpp does with them (llama-vocab.cpp,
llama-model-loader.cpp), where transformers' GGUF loader differs. Expected ids are written by
hand from llama.cpp's rules, on tiny vocabularies written here."""

from __future__ import annotations

import logging

import pytest

from gguf_helpers import split_gguf, write_vocab_gguf
from specdec.gguf_tokenizer import PRE_TYPES, GGUFVocab, build_tokenizer
from specdec.tokenizer import Tokenizer

# --- SentencePiece (tokenizer.ggml.model = llama) --------------------------------------------

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# <unk> 0, <s> 1, </s> 2, bytes 3..258, then: ▁ 259, a 260, b 261, ▁a 262, ab 263, ▁ab 264
SPM_TOKENS = ["<unk>", "<s>", "</s>", *BYTES, "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
SPM_TYPES = [2, 3, 3, *[6] * 256, 1, 1, 1, 1, 1, 1]
SPM_SCORES = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
S, A, B, SA, AB, SAB = 259, 260, 261, 262, 263, 264


def spm(tmp_path, **metadata) -> Tokenizer:
    return Tokenizer(write_vocab_gguf(tmp_path / "spm.gguf", SPM_TOKENS, SPM_TYPES, scores=SPM_SCORES,
                                      metadata={"tokenizer.ggml.unknown_token_id": 0, **metadata}))


def test_spm_prefixes_a_space_even_before_a_leading_space(tmp_path):
    """llama.cpp (and sentencepiece) put " " before the text unconditionally: " ab" is
    "▁▁ab" -> ▁ ▁ab; and before the text after each special token. transformers' Metaspace
    skips text that already starts with a space (" ab" -> ▁ab)."""
    tok = spm(tmp_path)
    assert tok.encode("ab") == [1, SAB]
    assert tok.encode(" ab") == [1, S, SAB]
    assert tok.encode(" ") == [1, S, S]
    assert tok.encode("  ab") == [1, S, S, SAB]
    assert tok.encode("ab</s>ab") == [1, SAB, 2, SAB]
    assert tok.encode("") == [1]
    assert tok.decode([1, SAB], skip_special_tokens=True) == "ab" and tok.decode([S, SAB]) == " ab"


def test_spm_honours_add_space_prefix_false(tmp_path):
    """tokenizer.ggml.add_space_prefix = false (Phi-3's, InternLM2's converters write it): no "▁"
    put before the text; decoding keeps a leading space."""
    tok = spm(tmp_path, **{"tokenizer.ggml.add_space_prefix": False})
    assert tok.encode("ab") == [1, AB]
    assert tok.encode(" ab") == [1, SAB]
    assert tok.encode("ab ab") == [1, AB, SAB]
    assert tok.encode("ab</s>ab") == [1, AB, 2, AB]
    assert tok.decode([SAB]) == " ab" and tok.decode([AB, SAB]) == "ab ab"
    assert spm(tmp_path, **{"tokenizer.ggml.add_space_prefix": True}).encode("ab") == [1, SAB]


# --- byte-level (gpt2): llama.cpp's split per `pre` name --------------------------------------

def pieces(pre: str | None, text: str) -> list[str]:
    v = GGUFVocab(model="gpt2", pre=pre, tokens=["a", "b"], token_types=[1, 1], merges=[], scores=None,
                  bos_token_id=None, eos_token_id=None, eot_token_id=None, unk_token_id=None, pad_token_id=None,
                  add_bos_token=False, add_eos_token=False, chat_template=None)
    return [p for p, _ in build_tokenizer(v).pre_tokenizer.pre_tokenize_str(text)]


TEXT = "Pay 12345 now (hello) x.append(y)\n\n  z"
GPT2 = ["Pay", "Ġ12345", "Ġnow", "Ġ(", "hello", ")", "Ġx", ".", "append", "(", "y", ")", "ĊĊĠ", "Ġz"]
LLAMA3 = ["Pay", "Ġ", "123", "45", "Ġnow", "Ġ(", "hello", ")", "Ġx", ".append", "(y", ")ĊĊ", "Ġ", "Ġz"]
ONE_DIGIT = ["Pay", "Ġ", "1", "2", "3", "4", "5", "Ġnow", "Ġ(", "hello", ")", "Ġx", ".append", "(y", ")ĊĊ", "Ġ", "Ġz"]
STARCODER = ["Pay", "Ġ", "1", "2", "3", "4", "5", *GPT2[2:]]


@pytest.mark.parametrize("pre,expected", [
    ("gpt2", GPT2), ("gpt-2", GPT2),
    ("glm4", LLAMA3),                 # GLM-4.5: llama3's regex
    ("deepseek-v3", LLAMA3),          # digits in threes, CJK runs apart, then a llama3-like split
    ("tekken", ONE_DIGIT),            # Mistral Nemo: o200k-like, digits one by one
    ("stablelm2", ONE_DIGIT),         # qwen2's regex
    ("default", ["Pay", "Ġ", "123", "45", "Ġnow", "Ġ", "(", "hello", ")", "Ġx", ".", "append", "(", "y", ")",
                 "ĊĊĠ", "Ġz"]),
    ("deepseek-llm", ["Pay", "Ġ", "12345", "Ġnow", "Ġ(", "hello", ")", "Ġx", ".", "append", "(", "y", ")", "Ċ", "Ċ",
                      "Ġ", "Ġz"]),
    ("starcoder", STARCODER), ("refact", STARCODER), ("command-r", STARCODER), ("smollm", STARCODER),
])
def test_pre_names_split_as_llamacpp(pre, expected):
    assert pieces(pre, TEXT) == expected


def test_a_file_without_pre_gets_llamacpp_default():
    assert pieces(None, TEXT) == pieces("default", TEXT) != GPT2


def test_every_pre_name_builds():
    text = "HelloWorld's 12345 tokens, ok?/\n 日本語 ÉCOLE école\t\t😀 "
    for name in PRE_TYPES:
        assert "".join(pieces(name, text)) == "".join(pieces("gpt2", text)), name     # a split loses nothing


def test_unknown_pre_warns_once_and_splits_as_gpt2(caplog):
    with caplog.at_level(logging.WARNING, logger="specdec.gguf"):
        assert pieces("no-such-pre", TEXT) == GPT2
        assert pieces("no-such-pre", TEXT) == GPT2
    assert [r.getMessage() for r in caplog.records].count(
        "GGUF tokenizer: unknown tokenizer.ggml.pre 'no-such-pre'; splitting text as GPT-2 does") == 1


def test_ignore_merges_takes_a_token_whole(tmp_path):
    """llama3's and tekken's pre types take a piece that is a token whole (llama.cpp's
    ignore_merges), whatever the merges would make of it."""
    tokens = ["<s>", "</s>", "h", "i", "hi", "hii"]
    merges = ["h i"]                      # no merge makes "hii"
    ids = {pre: Tokenizer(write_vocab_gguf(tmp_path / f"{pre}.gguf", tokens, [3, 3, 1, 1, 1, 1], model="gpt2", pre=pre,
                                           merges=merges, bos=0, eos=1, add_bos=False)).encode("hii")
           for pre in ("llama-bpe", "gpt2")}
    assert ids == {"llama-bpe": [5], "gpt2": [4, 3]}


# --- BOS by pre name -------------------------------------------------------------------------

@pytest.mark.parametrize("pre,add_bos,expected", [
    ("llama-bpe", None, True), ("llama3", None, True), ("tekken", None, True), ("pixtral", None, True),
    ("chameleon", None, True), ("gpt2", None, False), ("qwen2", None, False), ("smollm", None, False),
    ("llama-bpe", False, False), ("gpt2", True, True),       # the file's key wins
])
def test_bos_default_follows_pre_name(tmp_path, pre, add_bos, expected):
    tokens = ["<s>", "</s>", "H", "i"]
    tok = Tokenizer(write_vocab_gguf(tmp_path / "v.gguf", tokens, [3, 3, 1, 1], model="gpt2", pre=pre, merges=[],
                                     bos=0, eos=1, add_bos=add_bos))
    assert tok.encode("Hi") == ([0] if expected else []) + [2, 3]


# --- end of generation -----------------------------------------------------------------------

def eog(tmp_path, tokens, eos, **metadata) -> list[str]:
    tok = Tokenizer(write_vocab_gguf(tmp_path / "eog.gguf", tokens, [3] * len(tokens), model="gpt2", pre="gpt2",
                                     merges=[], bos=None, eos=eos, metadata=metadata))
    return [tokens[i] for i in tok.eos_token_ids]


def test_eog_tokens_as_llamacpp(tmp_path):
    phi3 = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
    assert eog(tmp_path, phi3, 3) == ["</s>", "<|endoftext|>", "<|end|>"]
    llama3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    assert eog(tmp_path, llama3, 1) == ["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]
    qwen = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
    assert eog(tmp_path, qwen, 2) == ["<|endoftext|>", "<|im_end|>"]
    # gpt-oss's harmony: <|end|> ends a message, not the answer; <|return|> and <|call|> do
    harmony = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>"]
    assert eog(tmp_path, harmony, 5) == ["<|endoftext|>", "<|call|>", "<|return|>"]
    # the eot / eom keys name tokens of any spelling
    odd = ["<bos>", "<eos>", "<stop1>", "<stop2>", "<other>"]
    assert eog(tmp_path, odd, 1, **{"tokenizer.ggml.eot_token_id": 2, "tokenizer.ggml.eom_token_id": 3}) == \
        ["<eos>", "<stop1>", "<stop2>"]
    # FIM pad / repo name / file separator end generation too, found by their spelling or named by the file
    fim = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_middle|>"]
    assert eog(tmp_path, fim, 0) == ["<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    named = ["<bos>", "<eos>", "<pad-ish>", "<repo-ish>", "<x>"]
    assert eog(tmp_path, named, 1, **{"tokenizer.ggml.fim_pad_token_id": 2, "tokenizer.ggml.fim_rep_token_id": 3}) == \
        ["<eos>", "<pad-ish>", "<repo-ish>"]


def test_smollm2_stops_on_endoftext_too(smollm2):
    """SmolLM2's file names <|im_end|> as eos; llama.cpp also ends on <|endoftext|> (id 0) and
    its FIM repo-name token <reponame> (id 4)."""
    from specdec import LLM, SamplingParams

    assert Tokenizer(smollm2).eos_token_ids == [0, 2, 4]
    llm = LLM(model=str(smollm2))
    out = llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0, logit_bias={0: 100.0}))[0].outputs[0]
    assert out.token_ids == [0] and out.finish_reason == "stop"


# --- split files -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_set(gguf_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    return gguf_files["llama_q"], split_gguf(gguf_files["llama_q"], root / "set", "tiny", 3)


def test_split_gguf_loads_from_first_shard_or_folder(split_set):
    import torch

    from specdec.model.checkpoint import load_model

    whole, shards = split_set
    ids = torch.tensor([[3, 17, 42, 7, 99]])
    with torch.no_grad():
        expected = load_model(whole)(ids).logits
        for target in (shards[0], shards[0].parent):
            assert torch.equal(load_model(target)(ids).logits, expected)
    assert Tokenizer(shards[0].parent).encode("def add") == Tokenizer(whole).encode("def add")


def test_split_gguf_errors_name_the_shard(split_set, tmp_path):
    import shutil

    from specdec.model.checkpoint import CheckpointError, load_model
    from specdec.model.gguf import GGUFError, GGUFFile

    _, shards = split_set
    with pytest.raises(GGUFError, match="shard 2 of a split GGUF .3 files.; name the first, tiny-00001-of-00003.gguf"):
        GGUFFile(shards[1])
    partial = tmp_path / "partial"
    partial.mkdir()
    for s in (shards[0], shards[2]):
        shutil.copy(s, partial / s.name)
    with pytest.raises(CheckpointError, match="shard tiny-00002-of-00003.gguf of the split GGUF .2 of 3. is missing"):
        load_model(partial)
    shutil.copy(shards[0], tmp_path / "renamed.gguf")
    with pytest.raises(GGUFError, match="not named NAME-00001-of-00003.gguf"):
        GGUFFile(tmp_path / "renamed.gguf")
    (partial / shards[0].name).unlink()
    with pytest.raises(CheckpointError, match="shard 3 of a split GGUF .3 files.; name the first"):
        load_model(partial)
    shutil.copy(shards[1], partial / shards[1].name)
    with pytest.raises(CheckpointError, match="holds shards of the split GGUF tiny but not its first, "
                                              "tiny-00001-of-00003.gguf"):
        load_model(partial)
    # a later shard whose split.no is an array: one line (was a TypeError's traceback)
    odd = split_gguf(split_set[0], tmp_path / "odd", "tiny", 3, odd_no={1: [1, 1]})
    with pytest.raises(GGUFError, match=r"not shard 2 of tiny-00001-of-00003.gguf's split GGUF \(split.no is \[1, 1\]"):
        GGUFFile(odd[0])


# --- llama.cpp's defaults and named templates ------------------------------------------------

def test_spm_without_special_ids_gets_llamacpp_defaults(tmp_path):
    """llama-vocab.cpp's SentencePiece branch: UNK 0, BOS 1, EOS 2 when the file names none (and
    BOS is added), each only where the vocabulary has that id."""
    from specdec.model.gguf import GGUFFile

    tok = Tokenizer(write_vocab_gguf(tmp_path / "spm.gguf", SPM_TOKENS, SPM_TYPES, scores=SPM_SCORES, bos=None, eos=None))
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.encode("ab") == [1, SAB] and 2 in tok.eos_token_ids
    short = GGUFVocab.from_gguf(GGUFFile(write_vocab_gguf(tmp_path / "two.gguf", ["<unk>", "<s>"], [2, 3], bos=None,
                                                          eos=None)))
    assert (short.unk_token_id, short.bos_token_id, short.eos_token_id) == (0, 1, None)
    gpt2 = GGUFVocab.from_gguf(GGUFFile(write_vocab_gguf(tmp_path / "bpe.gguf", ["a", "b", "c"], [1, 1, 1],
                                                         model="gpt2", pre="gpt2", merges=[], bos=None, eos=None)))
    assert (gpt2.unk_token_id, gpt2.bos_token_id, gpt2.eos_token_id) == (None, None, None)


DEFAULT, TOOL_USE = ("DEFAULT:{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     "TOOL_USE:{{ (tools or []) | length }}:{% for m in messages %}{{ m['content'] }}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("default", [DEFAULT, None], ids=["both", "tool-use-only"])
def test_tool_use_template_renders_requests_with_tools(tmp_path, default):
    """tokenizer.chat_template.tool_use (llama.cpp's converter writes tokenizer_config.json's named
    templates so): with tools it renders, as llama.cpp's common/chat.cpp and a folder's "tool_use"
    template; without a default template llama.cpp takes it for every request."""
    templates = {"tokenizer.chat_template.tool_use": TOOL_USE, **({"tokenizer.chat_template": default} if default else {})}
    tok = spm(tmp_path, **templates)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True) == "TOOL_USE:1:hi"
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ("DEFAULT:hi" if default else "TOOL_USE:0:hi")


# --- user-defined tokens of a byte-level vocabulary -----------------------------------------

def test_user_defined_tokens_match_whole_and_decode_raw(tmp_path):
    """llama.cpp's converter stores a byte-level vocabulary's added, non-special tokens as
    USER_DEFINED with their raw text; llama.cpp matches each whole in the text
    (tokenizer_st_partition) and prints its text as it is (token_to_piece), where transformers'
    GGUF loader splits "<tool call>" into pieces and byte-decodes "héllo" to "h\\ufffdllo"."""
    from specdec.gguf_tokenizer import byte_alphabet

    alphabet = [byte_alphabet()[b] for b in range(256)]          # token b = byte b
    user = ["<tool call>", "héllo", "日本語", "<think>"]
    tokens = [*alphabet, "ab", *user]
    tok = Tokenizer(write_vocab_gguf(tmp_path / "ud.gguf", tokens, [1] * 257 + [4] * len(user), model="gpt2",
                                     pre="gpt2", merges=["a b"], bos=None, eos=None))
    ids = {t: 257 + i for i, t in enumerate(user)}
    sp = ord(" ")
    for t in user:
        text = f"x {t} y"
        assert tok.encode(text, add_special_tokens=False) == [ord("x"), sp, ids[t], sp, ord("y")], t
        assert tok.decode([ids[t]]) == t and tok.decode(tok.encode(text)) == text
    assert tok.encode("ab é", add_special_tokens=False) == [256, sp, 0xC3, 0xA9]      # normal tokens: byte-level
    assert tok.decode([256, sp, 0xC3, 0xA9]) == "ab é"
