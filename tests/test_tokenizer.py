"""Tokenizers from GGUF metadata encode and decode like transformers' GGUF loader; HF folders as
transformers 5 writes them (chat_template.jinja, generation_config.json) are read whole."""

from __future__ import annotations

import json

import pytest

from conftest import make_checkpoint
from gguf_helpers import sample_strings, sentencepiece_vocab, write_gguf
from specdec import LLM, SamplingParams
from specdec.tokenizer import Tokenizer

STRINGS = sample_strings(300)
CONVERSATIONS = [
    [{"role": "user", "content": "Write a sort."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "naïve?"}],
]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory) -> dict:
    """One tiny model per tokenizer flavour: byte-level BPE under four `pre` names, and
    SentencePiece BPE with and without merges in the file."""
    from specdec.train.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("vocab")
    train_tokenizer(root / "bpe", 500, STRINGS * 3)
    hf = make_checkpoint(root / "bpe_hf", hidden=32, layers=1, tokenizer_from=root / "bpe")
    files = {f"gpt2-{pre}": write_gguf(hf, root / f"bpe_{pre}" / "m.gguf", pre=pre)
             for pre in ("gpt2", "smollm", "llama-bpe", "qwen2")}
    for merges in (True, False):
        v = sentencepiece_vocab(STRINGS * 3, 600, with_merges=merges)
        sp = make_checkpoint(root / f"sp{merges}_hf", hidden=32, layers=1, vocab=len(v["tokens"]))
        files[f"llama-merges={merges}"] = write_gguf(sp, root / f"sp{merges}" / "m.gguf", vocab=v, bos=1, eos=2,
                                                     add_bos=None, chat_template=None)
    return files


def llamacpp_reference(path, hf, ours: Tokenizer, strings: list[str]) -> list[str]:
    """Where specdec follows llama.cpp and transformers' GGUF loader does not, the reference is
    fixed up or the strings are left to tests/test_gguf_tokenizer_llamacpp.py:
    - pre "smollm": llama.cpp splits digits one by one first (as the model's own tokenizer.json:
      Digits(individual_digits) then ByteLevel); transformers' loader uses ByteLevel alone;
    - SentencePiece: llama.cpp puts "▁" before text that starts with a space and before the
      text after a special token; transformers' loader does neither (its Metaspace "first")."""
    from tokenizers import pre_tokenizers

    from specdec.model.gguf import GGUFFile

    g = GGUFFile(path)
    if g.get("tokenizer.ggml.pre") == "smollm":
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if g.get("tokenizer.ggml.model") == "llama" and g.architecture not in ("gemma", "gemma2", "gemma3"):
        special = [t.content for t in ours.backend.get_added_tokens_decoder().values()]
        strings = [s for s in strings if not s.startswith(" ") and not any(t in s for t in special)]
    return strings


def assert_same_as_transformers(path, strings=STRINGS):
    from transformers import AutoTokenizer

    ours = Tokenizer(path)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    strings = llamacpp_reference(path, hf, ours, strings)
    assert len(strings) > 50
    for s in strings:
        ids = hf(s).input_ids
        assert ours.encode(s) == ids, s
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), s
    return ours, hf


@pytest.mark.parametrize("flavour", ["gpt2-gpt2", "gpt2-smollm", "gpt2-llama-bpe", "gpt2-qwen2",
                                     "llama-merges=True", "llama-merges=False"])
def test_gguf_tokenizer_matches_transformers(vocab_files, flavour):
    ours, _ = assert_same_as_transformers(vocab_files[flavour])
    if flavour.startswith("llama"):          # SentencePiece files add BOS by default
        assert ours.encode("x")[0] == 1


@pytest.fixture(scope="module")
def gemma_vocab(tmp_path_factory):
    """A Gemma GGUF's SentencePiece vocabulary: no merges, scores that do not rank the merges,
    tokens of spaces stored as real spaces, and Gemma's turn tokens."""
    v = sentencepiece_vocab(STRINGS * 3, 600, with_merges=False)
    extra = ["  ", "    ", "<start_of_turn>", "<end_of_turn>"]
    v = {**v, "tokens": v["tokens"] + extra, "types": v["types"] + [1, 1, 3, 3],
         "scores": [0.0] * len(v["tokens"]) + [0.0] * 4}         # Gemma's files: scores carry no order
    root = tmp_path_factory.mktemp("gemma_vocab")
    hf = make_checkpoint(root / "hf", arch="gemma2", hidden=32, layers=1, vocab=len(v["tokens"]))
    return write_gguf(hf, root / "gguf" / "m.gguf", vocab=v, bos=1, eos=2, add_bos=True, chat_template=None)


def test_gemma_gguf_tokenizer_matches_transformers(gemma_vocab):
    """Gemma's SentencePiece files: no prefix space, runs of spaces as their own tokens, merges
    rebuilt in file order (transformers' Gemma GGUF loader); <end_of_turn> ends generation."""
    ours, hf = assert_same_as_transformers(gemma_vocab)
    assert ours.encode("hi", add_special_tokens=False) != Tokenizer(gemma_vocab).encode(" hi", add_special_tokens=False)
    assert ours.encode("x")[0] == 1
    assert hf.convert_tokens_to_ids("<end_of_turn>") in ours.eos_token_ids and 2 in ours.eos_token_ids


def test_pre_tokenizer_families_split_differently(vocab_files):
    """The `pre` name matters: llama3's split groups digits in threes, qwen2's one by one."""
    text = "1234567 tokens"
    a, b = (Tokenizer(vocab_files[k]).encode(text) for k in ("gpt2-llama-bpe", "gpt2-qwen2"))
    assert a != b


def test_gguf_chat_template_ids_equal_transformers(vocab_files):
    from transformers import AutoTokenizer

    path = vocab_files["gpt2-smollm"]
    ours = Tokenizer(path)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for conv in CONVERSATIONS:
        text = ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        expected = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert text == expected
        assert ours.encode(text, add_special_tokens=False) == hf(expected, add_special_tokens=False).input_ids


def test_transformers5_folder(tiny_pair, tmp_path):
    """save_pretrained writes chat_template.jinja; generation_config.json may list several eos ids."""
    from transformers import AutoTokenizer

    folder = tmp_path / "m"
    make_checkpoint(folder, tokenizer_from=tiny_pair[0])
    hf = AutoTokenizer.from_pretrained(folder)
    hf.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").unlink()
    hf.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    ours = Tokenizer(folder)
    assert ours.chat_template == hf.chat_template and 5 in ours.eos_token_ids
    conv = CONVERSATIONS[1]
    assert ours.encode(ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) == \
        hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def test_generation_config_sampling_defaults(tiny_pair, tmp_path, capsys):
    from specdec.cli import main

    folder = tmp_path / "m"
    make_checkpoint(folder, tokenizer_from=tiny_pair[0])
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "repetition_penalty": 1.1}))
    llm = LLM(str(folder))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5,
                                                               repetition_penalty=1.1)
    out = llm.generate("def", None)[0]                      # no SamplingParams: the model's defaults
    assert len(out.outputs[0].token_ids) == 5 or out.outputs[0].finish_reason == "stop"
    explicit = llm.generate("def", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(explicit.outputs[0].token_ids) == 3
    assert LLM(str(folder), generation_config="vllm").get_default_sampling_params() == SamplingParams()
    assert main(["generate", "--model", str(folder), "--ignore-eos", "--json", "def"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    assert main(["generate", "--model", str(folder), "--ignore-eos", "--json", "--max-tokens", "2", "def"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


def test_tokenizer_override(gguf_files, tiny_pair):
    """--tokenizer / LLM(tokenizer=...) replaces the model's own, as in vLLM."""
    llm = LLM(str(gguf_files["llama_q"]), tokenizer=str(tiny_pair[0]))
    assert llm.tokenizer.chat_template == Tokenizer(tiny_pair[0]).chat_template
    assert llm.tokenizer.chat_template != Tokenizer(gguf_files["llama_q"]).chat_template


def test_smollm2_tokenizer_matches_transformers(smollm2):
    ours, hf = assert_same_as_transformers(smollm2, STRINGS[:150])
    for conv in CONVERSATIONS:
        assert ours.encode(ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False) == \
            hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        # llama.cpp's end of generation: eos <|im_end|>, <|endoftext|> and the FIM repo name <reponame>
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == [0, 2, 4]


def test_gpt4o_pre_tokenizer_splits_as_o200k():
    """llama.cpp's "gpt-4o" pre type (gpt-oss's files; Llama 4's call it "llama4"): o200k's split,
    letter runs cut where lower case turns to upper and contractions kept, digits in threes, a
    trailing "/" kept with punctuation; GPT-2's split (the default) differs on each."""
    from specdec.gguf_tokenizer import GGUFVocab, build_tokenizer

    def pieces(pre: str, text: str) -> list[str]:
        v = GGUFVocab(model="gpt2", pre=pre, tokens=["a", "b"], token_types=[1, 1], merges=[], scores=None,
                      bos_token_id=None, eos_token_id=None, eot_token_id=None, unk_token_id=None, pad_token_id=None,
                      add_bos_token=False, add_eos_token=False, chat_template=None)
        return [p for p, _ in build_tokenizer(v).pre_tokenizer.pre_tokenize_str(text)]

    text = "HelloWorld's 12345 tokens, ok?/\n"
    expected = ["Hello", "World's", "Ġ", "123", "45", "Ġtokens", ",", "Ġok", "?/Ċ"]
    assert pieces("gpt-4o", text) == pieces("llama4", text) == expected
    assert pieces("gpt2", text) != expected


def test_long_texts_encode_to_the_same_ids(tiny_pair, gguf_files):
    """Texts past LONG_TEXT go through the backend's encode_batch (it lets the GIL go): the same ids
    as its encode, BOS rules included, for a tokenizer.json and a GGUF's tokenizer."""
    from specdec.tokenizer import LONG_TEXT

    text = ("def add(a, b):\n    return a + b  # naïve ☃ — café\n" * (LONG_TEXT // 40 + 50))
    assert len(text) > LONG_TEXT
    for tok in (Tokenizer(tiny_pair[0]), Tokenizer(gguf_files["llama_q"])):
        for special in (True, False):
            want = tok.backend.encode(text, add_special_tokens=special).ids
            want = tok._with_bos(want) if special else want
            assert tok.encode(text, add_special_tokens=special) == want


def test_text_that_is_not_unicode_is_a_clear_value_error(tiny_pair, capsys):
    """Undecodable bytes of argv / stdin arrive as lone surrogates (Python's surrogateescape): the
    tokenizer's binding says only `TypeError: TextInputSequence must be str`. The LLM and the CLI
    say what is wrong, as the server's 400 does."""
    import pytest

    from specdec import LLM, SamplingParams
    from specdec.cli import main

    llm = LLM(model=str(tiny_pair[0]))
    for call in (lambda: llm.generate(["caf\udce9"], SamplingParams(max_tokens=2)),
                 lambda: llm.chat([{"role": "user", "content": "x\udcff"}], SamplingParams(max_tokens=2),
                                  chat_template="{{ messages[0]['content'] }}"),
                 lambda: llm.get_tokenizer().encode_pair("a", "b\ud800")):
        with pytest.raises(ValueError, match="not valid Unicode: a lone surrogate at character"):
            call()
    assert main(["generate", "--model", str(tiny_pair[0]), "caf\udce9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid Unicode" in err


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = ("{% for t in tools %}TOOL {{ t['function']['name'] }}\n{% endfor %}"
         "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.mark.parametrize("named", [False, True])
def test_chat_templates_render_as_transformers(tiny_pair, tmp_path, named):
    """transformers' rendering: `{% generation %}` blocks (TRL's assistant-only-loss templates; a
    400 for every chat request before) render their body; continue_final_message keeps the final
    message's trailing whitespace and continues an empty one (the turn was closed); keys set to None
    are left out (a None content printed "None"); with tools, a folder's "tool_use" template is the
    one rendered (the default was, and the tools never reached the prompt)."""
    import shutil

    import transformers

    folder = shutil.copytree(tiny_pair[0], tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}] \
        if named else CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    cases = [
        dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}],
             add_generation_prompt=False, continue_final_message=True),
        dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a\n"}],
             add_generation_prompt=False, continue_final_message=True),
        dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
             add_generation_prompt=False, continue_final_message=True),
        dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "name": None},
                       {"role": "user", "content": "and?"}], add_generation_prompt=True),
        dict(messages=[{"role": "user", "content": "weather?"}], add_generation_prompt=True, tools=tools),
    ]
    for kw in cases:
        rest = {k: v for k, v in kw.items() if k != "messages"}
        want = hf.apply_chat_template(kw["messages"], tokenize=False, **rest)
        assert ours.apply_chat_template(kw["messages"], tokenize=False, **rest) == want, kw
    last = {k: v for k, v in cases[-1].items() if k != "messages"}
    assert ("TOOL weather" in ours.apply_chat_template(cases[-1]["messages"], tokenize=False, **last)) == named


def test_template_variables_are_transformers(tiny_pair, tmp_path):
    """The variables a template sees are transformers': every named special token that is set
    (sep / cls / mask included; they were missing, so a BERT-style template printed nothing),
    an unset one undefined, and tools / documents None unless given (a template testing
    `tools is not none` showed a tool preamble to every request)."""
    import shutil

    import transformers

    folder = shutil.copytree(tiny_pair[0], tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(sep_token="</s>", cls_token="<s>", chat_template=(
        "{{ cls_token }}|{{ sep_token }}|{{ mask_token is defined }}|{{ tools is none }}|{{ documents is none }}|"
        "{% for m in messages %}{{ m['content'] }}{{ sep_token }}{% endfor %}"))
    cfg.pop("mask_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "hi"}]
    for kw in ({}, {"tools": []}, {"documents": [{"text": "d"}]}):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw)
        assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw) == want, kw
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).startswith(
        "<s>|</s>|False|True|True|hi</s>")


def test_assistant_tokens_mask_as_transformers(tiny_pair, tmp_path):
    """return_assistant_tokens_mask (TRL's assistant-only loss): transformers' "assistant_masks",
    1 for each token overlapping a `{% generation %}` block's text, single and batched, padded,
    truncated, as tensors (it was taken for a template variable and ignored)."""
    import shutil

    import transformers

    folder = shutil.copytree(tiny_pair[0], tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML.replace("{{ m['content'] }}{% endgeneration %}", "{{ m['content'] }}<|im_end|>"
                                          "{% endgeneration %}")
    cfg["pad_token"] = cfg.get("pad_token") or cfg["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    convs = [[{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "x"}, {"role": "assistant", "content": "déjà vu 中文"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"}]]
    for kw in ({}, {"padding": True}, {"padding": True, "return_tensors": "pt"}, {"truncation": True, "max_length": 9}):
        for messages in (convs[0], convs):
            a, b = (t.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                          add_generation_prompt=False, **kw) for t in (ours, hf))
            for key in ("input_ids", "attention_mask", "assistant_masks"):
                got, want = (x.tolist() if hasattr(x, "tolist") else x for x in (a[key], b[key]))
                assert got == want, (kw, key)
    assert 1 in ours.apply_chat_template(convs[0], tokenize=True, add_generation_prompt=True,
                                         return_assistant_tokens_mask=True)["assistant_masks"]
    with pytest.raises(ValueError, match="tokenize=True"):
        ours.apply_chat_template(convs[0], tokenize=False, return_assistant_tokens_mask=True)
