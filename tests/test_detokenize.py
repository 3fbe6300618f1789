"""Incremental detokenization (specdec/detokenize.py) with a SentencePiece-style tokenizer: Metaspace
words, `<0xNN>` byte-fallback tokens and a decoder that strips the text's first space, as Llama 2's,
Mistral's and their GGUF files' tokenizers. The streamed pieces always add up to the final text (a
character once sent is never replaced by U+FFFD), stop strings and min_tokens follow vLLM's rules,
the output is decoded in the prompt's context (its first token keeps its space, as vLLM returns it),
and the engine's intermediate outputs only hold released text."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.detokenize import Detokenizer, prompt_context
from specdec.tokenizer import Tokenizer

TEXTS = ["Hello world, the quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Alice and Bob are friends. They like apples and bananas."] * 30


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A tiny checkpoint whose tokenizer is SentencePiece-style (ids: <unk> 0, <s> 1, </s> 2, bytes 3-258)."""
    out = tmp_path_factory.mktemp("sp")
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
                                                       initial_alphabet=[], limit_alphabet=60))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.save(str(out / "tokenizer.json"))
    data = json.loads((out / "tokenizer.json").read_text())      # byte tokens are vocabulary, not added tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    (out / "tokenizer.json").write_text(json.dumps(data))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False}))
    make_checkpoint(out, tokenizer_from=out, seed=0)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"bos_token_id": 1, "eos_token_id": 2}))
    return out


@pytest.fixture(scope="module")
def tok(sp_dir):
    return Tokenizer(str(sp_dir))


def _bytes(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]


def _stream(d: Detokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ids a step at a time (chunks: tokens per step, as speculative steps accept several)."""
    parts, i, steps = [], 0, list(chunks or [1] * len(ids))
    while i < len(ids):
        n = steps.pop(0) if steps else 1
        for t in ids[i:i + n]:
            i += 1
            if d.add(t):
                parts.append(d.delta(final=True))
                return parts
        parts.append(d.delta(final=i >= len(ids)))
    return parts


def test_sent_text_is_never_taken_back(tok):
    """"中文" is six byte tokens; cut after five, HF's decode turns all five into U+FFFD (a byte run is
    decoded whole), where '中' had already been streamed: the text stays '中' + what the stray bytes
    decode to, and the pieces add up to it, with stop strings and without."""
    ids = _bytes(tok, "中文")
    assert len(ids) == 6 and tok.decode(ids[:5]) == "\ufffd" * 5
    for stop, pieces in (([], ["", "", "中", "", "\ufffd\ufffd"]), (["zz"], ["", "", "", "", "中\ufffd\ufffd"])):
        d = Detokenizer(tok, stop)
        assert _stream(d, ids[:5]) == pieces and d.text == "中\ufffd\ufffd"


def test_pieces_add_up_to_the_text_for_any_tokens_and_steps(tok):
    """Random outputs mixing words, whole characters and stray bytes, fed in random step sizes: the
    pieces add up to the final text; with whole characters only, the text is the output decoded
    after the prompt's last tokens (a run of bytes that was valid stays the characters it made)."""
    rng = random.Random(0)
    words = [tok.convert_tokens_to_ids(t) for t in ("\u2581the", "\u2581Hello", "o", "\u2581and", ",")]
    chars = [_bytes(tok, c) for c in ("中", "文", "é", "🦊", "a")]
    prompt = tok.encode("Alice and Bob")
    for case in range(300):
        whole = case % 2 == 0
        ids = []
        while len(ids) < 12:
            pick = rng.random()
            ids += [rng.choice(words)] if pick < 0.4 else rng.choice(chars) if whole or pick < 0.8 \
                else [rng.randrange(3, 259)]
        steps = [rng.randint(1, 4) for _ in ids]
        d = Detokenizer(tok, [], prompt=prompt)
        parts = _stream(d, ids, steps)
        assert "".join(parts) == d.text, (ids, parts)
        if whole:
            ctx = prompt_context(tok, prompt, True)
            assert ctx == prompt[-4:]
            assert d.text == tok.decode(ctx + ids, True)[len(tok.decode(ctx, True)):], ids


def test_first_token_keeps_its_space_as_vllm_returns_it(tok):
    """The decoder strips the space of a text's first token: decoded after the prompt's last tokens
    (vLLM's prefix offset), ' the' keeps it, so prompt + completion reads 'Bob the'."""
    prompt = tok.encode("Alice and Bob")
    ids = [tok.convert_tokens_to_ids("\u2581the"), tok.convert_tokens_to_ids("\u2581Hello")]
    assert tok.decode(ids) == "the Hello"                       # HF's decode of the output alone
    d = Detokenizer(tok, [], prompt=prompt)
    assert "".join(_stream(d, ids)) == d.text == " the Hello"
    d = Detokenizer(tok, [" the"], prompt=prompt)                # a stop string at the very first token
    assert _stream(d, ids) == [""] and d.text == "" and d.stop_reason == " the"


def test_min_tokens_boundary_inside_a_character(tok):
    """'中' is three byte tokens; min_tokens ending inside it must not hide a stop string right after it
    (the boundary was taken while the character was still U+FFFD placeholders, past where ' the' starts)."""
    ids = _bytes(tok, "中") + tok.encode(" the dog")[1:]
    assert tok.convert_ids_to_tokens(ids[3]) == "\u2581the"
    for min_tokens in range(4):
        d = Detokenizer(tok, [" the"], min_tokens=min_tokens)
        _stream(d, ids)
        assert d.text == "中" and d.stop_reason == " the" and len(d.ids) == 4, min_tokens


def test_stop_rules_follow_vllm(tok):
    """Of two stop strings one token completes, the first listed wins; a stop string that starts
    inside the first min_tokens tokens' text and ends after it counts; one that ends inside it does not."""
    ids = tok.encode("the quick brown fox jumps")[1:]
    names = tok.convert_ids_to_tokens(ids)
    fox = names.index("\u2581fox") if "\u2581fox" in names else None
    assert fox is not None, names
    d = Detokenizer(tok, ["fox", "brown fox"])
    _stream(d, ids)
    assert (d.text, d.stop_reason, len(d.ids)) == ("the quick brown ", "fox", fox + 1)
    d = Detokenizer(tok, ["brown fox", "fox"])
    _stream(d, ids)
    assert (d.text, d.stop_reason) == ("the quick ", "brown fox")
    d = Detokenizer(tok, ["brown fox"], min_tokens=fox)          # 'brown' inside, ' fox' after: it counts
    _stream(d, ids)
    assert (d.text, d.stop_reason) == ("the quick ", "brown fox")
    d = Detokenizer(tok, ["quick"], min_tokens=fox)              # wholly inside: ignored
    _stream(d, ids)
    assert d.stop_reason is None and d.text == tok.decode(ids)


def test_llm_stream_equals_generate_and_engine_steps_release_prefixes(sp_dir, tok):
    """Sampling byte tokens with the tiny model (outputs full of cut characters): LLM.stream's pieces
    add up to LLM.generate's text, and LLMEngine.step's intermediate texts are prefixes of the final
    one (a stop string's tail was handed out before the stop cut it)."""
    llm = LLM(model=str(sp_dir), num_speculative_tokens=0)
    allowed = sorted({i for c in "中文é🦊" for i in _bytes(tok, c)} | set(tok.encode(" the Hello and")[1:]))
    prompt = "Hello 中文 and the 🦊"
    for seed in range(12):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, allowed_token_ids=allowed)
        whole = llm.generate([prompt], params)[0].outputs[0]
        assert "".join(e.text for e in llm.stream(prompt, params)) == whole.text, seed
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:4]
    assert stop.strip()
    engine = llm.llm_engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    assert texts and all(texts[-1].startswith(t) for t in texts), texts
    assert texts[-1] == full.text[:full.text.index(stop)]


def test_chat_logprob_bytes_add_up_to_the_reply(tok, tiny_pair):
    """OpenAI's chat logprobs carry each token's `bytes` so that pieces of a character can be put
    together: a byte-level BPE token's own bytes, a byte-fallback token's byte, a SentencePiece piece
    with its space (vLLM gave U+FFFD's three bytes for each piece of a character); with
    return_tokens_as_token_ids the bytes are the "token_id:N" name's."""
    from specdec.logprobs import TokenLogprob
    from specdec.server.logprobs import chat_logprobs, token_namer

    text = "Hi 🦊 中文 the ÿ café\n\t~ ¡¬®"
    for t in (tok, Tokenizer(str(tiny_pair[0]))):
        ids = t.encode(text, add_special_tokens=False)
        pieces = [t.token_bytes(i) for i in ids]
        assert b"".join(pieces) in (text.encode(), b" " + text.encode()), pieces     # Metaspace: the prefix space
        assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)                     # pieces of characters
        entries = [TokenLogprob(i, -0.5, ((i, -0.5),)) for i in ids]
        content = chat_logprobs(token_namer(t), entries, t.token_bytes)["content"]
        assert b"".join(bytes(c["bytes"]) for c in content) == b"".join(pieces)
        assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
        # token and bytes agree: a SentencePiece piece's space in both (its decode alone strips it)
        assert all(c["token"] == bytes(c["bytes"]).decode("utf-8", "replace") for c in content)
        named = chat_logprobs(token_namer(t, as_ids=True), entries)["content"]
        assert named[0]["bytes"] == list(f"token_id:{ids[0]}".encode())
    assert tok.token_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_a_prompt_ending_in_a_cut_run_of_bytes_leaves_the_output_whole(tok):
    """The context starts where the prompt's tokens decode to whole characters: "Alice said 中文" ends
    in six byte tokens, and a context of its last 5 began inside 中, so the byte-fallback decoder made
    the whole run, the output's 'ddd' included, U+FFFD."""
    prompt = tok.encode("Alice said 中文")
    assert "\ufffd" in tok.decode(prompt[-5:])
    ctx = prompt_context(tok, prompt, True)
    assert "\ufffd" not in tok.decode(ctx) and len(ctx) > 5
    ids = _bytes(tok, "ddd") + _bytes(tok, "中") + tok.encode(" the dog")[1:]
    for stop in ([], ["zz"]):
        d = Detokenizer(tok, stop, prompt=prompt)
        assert "".join(_stream(d, ids)) == d.text == "ddd中 the dog"
    # nothing in reach decodes whole (a prompt cut inside a character): no context, the output alone
    cut = _bytes(tok, "中")[:2]
    assert prompt_context(tok, cut, True) == [] and prompt_context(tok, tok.encode("abc") + cut * 12, True) == []
    d = Detokenizer(tok, [], prompt=cut)
    assert "".join(_stream(d, _bytes(tok, "d"))) == "d"
