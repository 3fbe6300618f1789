"""GGUF keys of Gemma 2 / 3, Granite and DeepSeek-V2 / V3 against transformers, on files written as
llama.cpp's converter writes them (convert_hf_to_gguf.py: TextModel.set_gguf_parameters and each
family's own keys), over 40 tokens -- past the 8-token windows where a family has one:

- YaRN's beta_fast / beta_slow / attention_factor, which the converter copies from a config's
  rope_scaling as {arch}.rope.scaling.yarn_beta_fast / yarn_beta_slow / yarn_attn_factor (Kimi K2,
  a deepseek2 file: beta_fast 1, beta_slow 1), were left at YaRN's defaults 32 / 1 / computed;
- Granite: a file without granite.attention.scale (or with 0) scaled the scores by 1, where
  llama.cpp takes 1 / sqrt(head_dim); rope.scaling.finetuned false (llama.cpp's switch: no RoPE in
  any layer, transformers' Granite 4 position_embedding_type "nope") was ignored;
- Gemma 3 as its converter writes it (no window pattern key: llama.cpp's 5 sliding layers in 6;
  rope.freq_base_swa from rope_parameters["sliding_attention"]; the global layers' linear scaling;
  the final soft-cap) equals transformers (a check, no defect)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.numpy import load_file

from arch_checks import cached_logits, reference, without_kernels
from conftest import make_checkpoint, make_tokenizer
from gguf_helpers import write_gguf
from specdec import kernels
from test_gguf import rewritten
from specdec.model import load_model, save_model

TOKENS = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(0))
CHUNKS = [(0, 17), (17, 18), (18, 40)]        # a prefill, one decode step, another prefill


def check_logits(hf, path, **load) -> float:
    """Our logits of the file `path` through the paged cache, against transformers' on the folder hf
    (the same weights): within float tolerance, the same greedy tokens. Returns the difference."""
    with torch.no_grad():
        expected = reference(hf)(TOKENS[None]).logits[0]
        ours = cached_logits(load_model(path, **load), TOKENS, CHUNKS)
    diff = (ours - expected).abs().max().item()
    assert diff < 1e-4, diff
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    return diff



# --- YaRN's betas and attention factor ---------------------------------------------------------

def test_deepseek2_reads_kimi_k2s_yarn_betas(tmp_path):
    """A deepseek2 file with Kimi K2's YaRN (beta_fast 1, beta_slow 1; mscale_all_dim as
    yarn_log_multiplier): transformers' logits. Before: the betas were 32 / 1 (max |diff| 0.019
    on this tiny model; every rotated pair of a real one moves)."""
    from test_deepseek import deepseek_gguf

    yarn = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0}
    hf = make_checkpoint(tmp_path / "hf", arch="deepseek_v3", rope_scaling=yarn, max_position_embeddings=256)
    path = deepseek_gguf({"hf": hf}, tmp_path / "m.gguf", True, extra_meta={
        "deepseek2.rope.scaling.yarn_beta_fast": 1.0, "deepseek2.rope.scaling.yarn_beta_slow": 1.0})
    rope = load_model(path).config.rope_scaling
    assert (rope["beta_fast"], rope["beta_slow"]) == (1.0, 1.0)
    check_logits(hf, path)


def test_yarn_betas_and_attention_factor_of_a_llama_file(tmp_path):
    """A llama file whose config's YaRN names beta_fast 8, beta_slow 2 and attention_factor 1 (the
    converter writes them as yarn_beta_fast / yarn_beta_slow / yarn_attn_factor): transformers'
    frequencies and cos / sin scale, not the defaults (32, 1, 0.1 ln(4) + 1)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8.0,
            "beta_slow": 2.0, "attention_factor": 1.0, "rope_theta": 10000.0}
    hf = make_checkpoint(tmp_path / "hf", rope_parameters=yarn)
    a = "llama.rope.scaling."
    path = write_gguf(hf, tmp_path / "m.gguf", metadata={
        a + "type": "yarn", a + "factor": 4.0, a + "original_context_length": 64, a + "yarn_beta_fast": 8.0,
        a + "yarn_beta_slow": 2.0, a + "yarn_attn_factor": 1.0})
    check_logits(hf, path)


# --- Granite -----------------------------------------------------------------------------------

GRANITE_META = {"granite.embedding_scale": 6.0, "granite.residual_scale": 0.3, "granite.logit_scale": 2.5}


@pytest.mark.parametrize("scale", [None, 0.0], ids=["absent", "zero"])
def test_granite_without_attention_scale_scales_by_inverse_sqrt_head_dim(tmp_path, scale):
    """llama.cpp reads granite.attention.scale as optional, absent or 0 meaning 1 / sqrt(head_dim)
    (its converter leaves out a null or 0 attention_multiplier). Before: 1 (max |diff| 0.008)."""
    hf = make_checkpoint(tmp_path / "hf", arch="granite", embedding_multiplier=6.0, residual_multiplier=0.3,
                         attention_multiplier=16 ** -0.5, logits_scaling=2.5)    # head_dim 16
    meta = {**GRANITE_META, **({} if scale is None else {"granite.attention.scale": scale})}
    path = write_gguf(hf, tmp_path / "m.gguf", metadata=meta)
    assert load_model(path).config.attention_multiplier is None
    check_logits(hf, path)


def granite4(root, position_embedding_type: str):
    """A Granite 4 without Mamba layers (GraniteMoeHybridForCausalLM: every layer attention, no
    experts, its shared_mlp the MLP) and its file as llama.cpp's converter writes it: a `granite`
    file (ffn_gate / ffn_up / ffn_down from shared_mlp, head_count_kv per layer, expert_count 0)."""
    hf = root / f"hf-{position_embedding_type}"
    hf.mkdir(parents=True)
    make_tokenizer(hf)
    tok = json.loads((hf / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok["added_tokens"] if t["content"] not in tok["model"]["vocab"])
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, shared_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, layer_types=["attention"] * 2,
        position_embedding_type=position_embedding_type, max_position_embeddings=256, embedding_multiplier=6.0,
        residual_multiplier=0.3, attention_multiplier=0.5, logits_scaling=2.5, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(hf)
    sd = load_file(str(hf / "model.safetensors"))
    extra, skip = {}, []
    for i in range(2):
        gate_up = sd[f"model.layers.{i}.shared_mlp.input_linear.weight"]
        extra[f"blk.{i}.ffn_gate.weight"], extra[f"blk.{i}.ffn_up.weight"] = gate_up[:128], gate_up[128:]
        extra[f"blk.{i}.ffn_down.weight"] = sd[f"model.layers.{i}.shared_mlp.output_linear.weight"]
        skip += [f"blk.{i}.ffn_{m}_shexp.weight" for m in ("gate", "up", "down")]
    meta = {**GRANITE_META, "granite.attention.scale": 0.5, "granite.attention.head_count_kv": [2, 2],
            "granite.expert_count": 0, "granite.expert_used_count": 0}
    return hf, write_gguf(hf, root / f"{position_embedding_type}.gguf", arch="granite", metadata=meta,
                          extra_tensors=extra, skip=tuple(skip))


@pytest.mark.parametrize("c_path", [True, False], ids=["forward.c", "pytorch"])
def test_granite_rope_finetuned_false_runs_without_rope(tmp_path, monkeypatch, c_path):
    """granite.rope.scaling.finetuned false: no RoPE in any layer (llama.cpp's Granite graph builds
    no positions then), transformers' Granite 4 with position_embedding_type "nope"; the switch
    survives --hf-overrides and a saved folder. Before: RoPE everywhere (max |diff| 0.0025).
    The same file with finetuned true (what the converter writes for a Granite 4 without Mamba
    layers) equals the "rope" model."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    hf_nope, plain = granite4(tmp_path, "nope")
    path = rewritten(plain, tmp_path / "nope-switch.gguf", over={"granite.rope.scaling.finetuned": False})
    assert load_model(path).config.nope_layers == (0, 1)
    check_logits(hf_nope, path)
    check_logits(hf_nope, path, hf_overrides={"logits_scaling": 2.5})
    save_model(load_model(path), tmp_path / "saved", torch.float32)
    check_logits(hf_nope, tmp_path / "saved", dtype="float32")
    hf_rope, plain = granite4(tmp_path, "rope")
    check_logits(hf_rope, rewritten(plain, tmp_path / "rope-switch.gguf", over={"granite.rope.scaling.finetuned": True}))


# --- Gemma 3 (checked: no defect) ------------------------------------------------------------------

def test_gemma3_file_as_the_converter_writes_it(tmp_path):
    """Seven layers (llama.cpp's default pattern: 0-4 and 6 slide, 5 is global; no pattern key),
    an 8-token window, the local RoPE base from rope.freq_base_swa, linear scaling x4 on the global
    layer only, query_pre_attn_scalar = head_dim (the converter leaves it out: llama.cpp's scale),
    a final soft-cap."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
    hf = make_checkpoint(tmp_path / "hf", arch="gemma3_text", layers=7, sliding_window=8, query_pre_attn_scalar=16,
                         rope_parameters=rope, final_logit_softcapping=3.0)
    a = "gemma3."
    path = write_gguf(hf, tmp_path / "m.gguf", metadata={
        a + "attention.sliding_window": 8, a + "rope.freq_base_swa": 50.0, a + "rope.scaling.type": "linear",
        a + "rope.scaling.factor": 4.0, a + "final_logit_softcapping": 3.0})
    cfg = load_model(path).config
    assert (cfg.sliding_layers, cfg.local_rope_theta, cfg.rope_theta) == ((0, 1, 2, 3, 4, 6), 50.0, 1e6)
    check_logits(hf, path)
