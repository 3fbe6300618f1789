"""llama.cpp's defaults where a GGUF leaves a key out: a RoPE factor without a scaling type on the
architectures read through a Hugging Face config (glm4moe, deepseek2, gpt-oss), and a byte-level
vocabulary's BOS / EOS ids without their keys."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_checkpoint
from gguf_helpers import write_gguf, write_vocab_gguf
from specdec.model import load_model
from specdec.tokenizer import Tokenizer

IDS = (torch.arange(40)[None] * 7) % 90

# llama.cpp's keys for the experts that write_gguf does not derive (as its converters write them)
GLM = {"expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2, "expert_weights_scale": 2.5,
       "expert_weights_norm": True, "expert_group_count": 2, "expert_group_used_count": 1}


def _deepseek_keys(cfg: dict) -> dict:
    C, r, nope, v = (cfg[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    return {"attention.head_count_kv": 1, "leading_dense_block_count": 1, "attention.kv_lora_rank": C,
            "attention.key_length": C + r, "attention.value_length": C, "attention.key_length_mla": nope + r,
            "attention.value_length_mla": v, "rope.dimension_count": r, "attention.q_lora_rank": cfg["q_lora_rank"],
            "expert_shared_count": 1, "expert_weights_scale": 2.5, "expert_gating_func": 2, "expert_weights_norm": True,
            "expert_group_count": 2, "expert_group_used_count": 1}


@pytest.mark.parametrize("hf_arch,arch", [("glm4_moe", "glm4moe"), ("deepseek_v3", "deepseek2"), ("gpt_oss", "gpt-oss")])
@pytest.mark.parametrize("typed", [False, True], ids=["factor-only", "linear"])
def test_rope_factor_without_type_is_linear(tmp_path, hf_arch, arch, typed):
    """llama.cpp reads {arch}.rope.scaling.type as "linear" where the file has none, for every
    architecture, and takes rope.scaling.factor with it: the model is transformers' with linear
    scaling x4 (the factor was dropped on these three, and an explicit "linear" refused)."""
    from transformers import AutoModelForCausalLM

    linear = {"rope_type": "linear", "factor": 4.0}
    rope = ({"rope_parameters": {**linear, "rope_theta": 10000.0}} if hf_arch == "gpt_oss"
            else {"rope_scaling": dict(linear)})        # transformers adds to the dict it is given
    hf = make_checkpoint(tmp_path / "hf", arch=hf_arch, **rope)
    cfg = json.loads((hf / "config.json").read_text())
    keys = GLM if arch == "glm4moe" else _deepseek_keys(cfg) if arch == "deepseek2" else {}
    meta = {f"{arch}.{k}": v for k, v in keys.items()}
    meta[f"{arch}.rope.scaling.factor"] = 4.0
    if typed:
        meta[f"{arch}.rope.scaling.type"] = "linear"
    ours = load_model(write_gguf(hf, tmp_path / "m.gguf", metadata=meta))
    assert {k: ours.config.rope_scaling[k] for k in ("rope_type", "factor")} == linear
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(IDS).logits[0]
        torch.testing.assert_close(ours(IDS).logits[0], ref, atol=1e-4, rtol=1e-4)


def test_bpe_without_special_ids_gets_llamacpp_11(tmp_path):
    """llama-vocab.cpp's BPE branch: BOS = EOS = 11 where the file names neither (Falcon's
    <|endoftext|>). Id 11 then begins (where BOS is added) and ends generation, but stays a plain
    token when its type is normal, as llama.cpp matches and hides tokens by their type only: text
    around it encodes and decodes as before."""
    from specdec.gguf_tokenizer import byte_alphabet

    alphabet = [byte_alphabet()[b] for b in range(256)]          # token b = byte b
    comma = ord(",")
    tokens = alphabet[:]
    tokens[11], tokens[comma] = tokens[comma], tokens[11]        # id 11 is ",", as in GPT-2's vocabulary
    path = write_vocab_gguf(tmp_path / "bpe.gguf", tokens, [1] * 256, model="gpt2", pre="llama3", merges=[],
                            bos=None, eos=None)
    tok = Tokenizer(path)
    assert (tok.bos_token_id, tok.eos_token_id) == (11, 11) and 11 in tok.eos_token_ids
    assert tok.encode("a,b") == [11, ord("a"), 11, ord("b")]        # llama3's pre adds BOS
    assert tok.decode([ord("a"), 11, ord("b")], skip_special_tokens=True) == "a,b"
    assert 11 not in tok.special_ids

    # Falcon's own: id 11 a control token, special as any control token
    falcon = alphabet[:]
    falcon[11], falcon[comma] = "<|endoftext|>", alphabet[11]
    types = [1] * 256
    types[11] = 3
    tok = Tokenizer(write_vocab_gguf(tmp_path / "falcon.gguf", falcon, types, model="gpt2", pre="falcon", merges=[],
                                     bos=None, eos=None))
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token) == (11, 11, "<|endoftext|>")
    assert tok.encode("x<|endoftext|>", add_special_tokens=False) == [ord("x"), 11]
    assert tok.decode([ord("x"), 11], skip_special_tokens=True) == "x"

    # a named id wins; the other keeps the default; a vocabulary without id 11 has none
    tok = Tokenizer(write_vocab_gguf(tmp_path / "eos.gguf", tokens, [1] * 256, model="gpt2", pre="gpt2", merges=[],
                                     bos=None, eos=5))
    assert (tok.bos_token_id, tok.eos_token_id) == (11, 5)
    tok = Tokenizer(write_vocab_gguf(tmp_path / "short.gguf", alphabet[:11], [1] * 11, model="gpt2", pre="gpt2",
                                     merges=[], bos=None, eos=None))
    assert (tok.bos_token_id, tok.eos_token_id) == (None, None)
