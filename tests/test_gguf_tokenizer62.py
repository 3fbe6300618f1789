"""Byte-level GGUFs whose control tokens are spelled outside GPT-2's byte alphabet: llama.cpp's
converter writes added tokens with their raw text, so DeepSeek-V3/R1 and R1-Distill files hold
"<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>" (fullwidth bars, U+2581) as CONTROL
tokens. llama.cpp matches them by that text (tokenizer_st_partition) and prints it (token_to_piece)."""

from __future__ import annotations

import pytest

from conftest import make_checkpoint
from gguf_helpers import write_gguf, write_vocab_gguf
from specdec import LLM, SamplingParams
from specdec.gguf_tokenizer import byte_alphabet
from specdec.tokenizer import Tokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
# token b = byte b, then "hi" 256, "Ġt" 257, "he" 258, "Ġthe" 259, "Ġther" 260, "Ġthere" 261, then the
# control tokens: BOS 262, EOS 263, USER 264, ASSISTANT 265, "<ø>" 266 (raw, made of alphabet characters)
WORDS = ["hi", "Ġt", "he", "Ġthe", "Ġther", "Ġthere"]
MERGES = ["h i", "Ġ t", "h e", "Ġt he", "Ġthe r", "Ġther e"]
CONTROL = [BOS, EOS, USER, ASSISTANT, "<ø>"]
TOKENS = [*(byte_alphabet()[b] for b in range(256)), *WORDS, *CONTROL]
TYPES = [1] * (256 + len(WORDS)) + [3] * len(CONTROL)
IDS = {t: TOKENS.index(t) for t in CONTROL}
HI, THERE = 256, 261
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' if m['role'] == 'user' else '<｜Assistant｜>' }}"
            "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def test_control_tokens_spelled_outside_the_byte_alphabet(tmp_path):
    tok = Tokenizer(write_vocab_gguf(tmp_path / "ds.gguf", TOKENS, TYPES, model="gpt2", pre="deepseek-r1-qwen",
                                     merges=MERGES, bos=IDS[BOS], eos=IDS[EOS], add_bos=True))
    assert len(tok) == len(TOKENS)                      # no token added past the file's vocabulary
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (BOS, IDS[BOS], EOS, IDS[EOS])
    assert tok.convert_tokens_to_ids([BOS, USER]) == [IDS[BOS], IDS[USER]]
    assert IDS[EOS] in tok.eos_token_ids
    text = f"{USER}hi there{ASSISTANT}"
    ids = tok.encode(text)
    assert ids == [IDS[BOS], IDS[USER], HI, THERE, IDS[ASSISTANT]]
    assert tok.encode(f"{BOS}hi{EOS}<ø>", add_special_tokens=False) == [IDS[BOS], HI, IDS[EOS], IDS["<ø>"]]
    assert tok.decode(ids) == BOS + text and tok.decode([IDS["<ø>"]]) == "<ø>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi there"
    assert tok.decode([HI, IDS[EOS], IDS[USER]], skip_special_tokens=True) == "hi"


@pytest.fixture(scope="module")
def ds_gguf(tmp_path_factory):
    """A tiny random llama with that vocabulary and a DeepSeek-R1-Distill-like chat template."""
    root = tmp_path_factory.mktemp("ds62")
    hf = make_checkpoint(root / "hf", hidden=32, layers=1, vocab=len(TOKENS))
    vocab = {"model": "gpt2", "tokens": TOKENS, "types": TYPES, "merges": MERGES}
    return write_gguf(hf, root / "gguf" / "m.gguf", vocab=vocab, pre="deepseek-r1-qwen", chat_template=TEMPLATE,
                      bos=IDS[BOS], eos=IDS[EOS], add_bos=True)


def test_chat_and_generate_with_deepseek_control_tokens(ds_gguf):
    llm = LLM(str(ds_gguf))
    params = SamplingParams(max_tokens=4, temperature=0)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi there"},
                {"role": "user", "content": "hi"}]
    out = llm.chat(messages, params)[0]
    assert out.prompt_token_ids == [IDS[BOS], IDS[USER], HI, IDS[ASSISTANT], HI, THERE, IDS[EOS],
                                    IDS[USER], HI, IDS[ASSISTANT]]
    gen = out.outputs[0]
    assert gen.token_ids and all(0 <= i < len(TOKENS) for i in gen.token_ids)
    assert gen.text == llm.get_tokenizer().decode(gen.token_ids, skip_special_tokens=True)
    raw = llm.generate([f"{USER}hi{ASSISTANT}"], params)[0]      # the file's add_bos puts BOS first
    assert raw.prompt_token_ids == [IDS[BOS], IDS[USER], HI, IDS[ASSISTANT]]
    assert all(0 <= i < len(TOKENS) for i in raw.outputs[0].token_ids)
