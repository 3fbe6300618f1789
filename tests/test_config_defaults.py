"""config.json read as transformers reads it where it says less than it could: a field it leaves
out takes the family's transformers default (model/config.py HF_DEFAULTS), and a stored LM head
that differs from the embeddings of a config saying tie_word_embeddings is used, untied."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import make_checkpoint
from specdec.model import ModelConfig, load_model
from specdec.model.config import GPT_OSS_ROPE, HF_DEFAULTS, SUPPORTED_ARCHITECTURES
from arch_checks import cached_logits, reference

TOKENS = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(0))


def assert_logits_match(hf, model=None) -> None:
    model = model or load_model(hf, "float32")
    with torch.no_grad():
        ref = reference(hf)(TOKENS[None]).logits[0]
        tol = 1e-4 * max(1.0, ref.abs().max().item())
        assert (model(TOKENS[None]).logits[0] - ref).abs().max() < tol
        assert (cached_logits(model, TOKENS, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < tol


@pytest.mark.parametrize("model_type", sorted(set(SUPPORTED_ARCHITECTURES.values())))
def test_defaults_are_transformers_defaults(model_type):
    """HF_DEFAULTS, and what from_hf falls back to beyond it, as the installed transformers' config
    classes give them."""
    hf = transformers.AutoConfig.for_model(model_type)
    ours = HF_DEFAULTS[model_type]
    for name, value in ours.items():
        if name == "rope_theta":
            assert type(hf).default_theta == value
        else:
            assert getattr(hf, name) == value, name
    if "rope_theta" not in ours and model_type != "gemma3_text":     # Gemma 3's: _gemma (1e6 global, 1e4 local)
        assert type(hf).default_theta == 10000.0
    cfg = {"model_type": model_type, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "n_routed_experts": 8, "moe_intermediate_size": 32, "n_group": 2,
           "topk_group": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 16}
    got = ModelConfig.from_hf(cfg)
    assert got.rms_norm_eps == hf.rms_norm_eps
    assert got.tie_word_embeddings == hf.tie_word_embeddings
    if model_type in ("glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        assert got.routed_scaling_factor == hf.routed_scaling_factor
        assert got.shared_expert_size == 32 * hf.n_shared_experts
        if model_type != "glm4_moe_lite":
            assert got.moe_layers == tuple(range(hf.first_k_dense_replace, 4))


def test_gpt_oss_plain_rope_round_trips():
    """A config without RoPE settings is YaRN's for gpt-oss: to_hf says plain RoPE outright."""
    cfg = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "head_dim": 16}
    yarn = ModelConfig.from_hf(cfg)
    assert yarn.rope_theta == 150000.0 and yarn.rope_scaling["factor"] == GPT_OSS_ROPE["factor"]
    plain = ModelConfig.from_hf({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 5e4
    assert ModelConfig.from_hf(plain.to_hf()) == plain
    assert ModelConfig.from_hf(yarn.to_hf()) == yarn


# (family, settings the checkpoint is written with (transformers' defaults where the old fallback differed), the field
# then taken out of config.json)
ABSENT = [
    ("llama", {"rms_norm_eps": 1e-6}, "rms_norm_eps"),
    ("deepseek_v2", {"rms_norm_eps": 1e-6}, "rms_norm_eps"),
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ("smollm3", {"rope_parameters": {"rope_type": "default", "rope_theta": 2e6}}, "rope_parameters"),
    ("olmo3", {"sliding_window": 8}, "rope_parameters"),
    ("gpt_oss", {"rope_parameters": None}, "rope_parameters"),
    ("smollm3", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("glm4_moe_lite", {"routed_scaling_factor": 1.8}, "routed_scaling_factor"),
    ("deepseek_v3", {"first_k_dense_replace": 3, "layers": 4}, "first_k_dense_replace"),
]


@pytest.mark.parametrize("arch, kw, field", ABSENT, ids=[f"{a}-{f}" for a, _, f in ABSENT])
def test_an_absent_field_takes_the_transformers_default(tmp_path, arch, kw, field):
    hf = make_checkpoint(tmp_path / "hf", arch=arch, **kw)
    path = hf / "config.json"
    raw = json.loads(path.read_text())
    raw.pop(field, None)
    raw.pop("rope_theta", None) if field == "rope_parameters" else None
    path.write_text(json.dumps(raw))
    assert_logits_match(hf)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_a_stored_head_unlike_the_embeddings_is_used(tmp_path, arch, caplog):
    """tie_word_embeddings with an lm_head.weight of its own: transformers 5 uses the stored head
    (untied, with a warning); a stored head equal to the embeddings stays tied."""
    hf = make_checkpoint(tmp_path / "hf", arch=arch, tie_word_embeddings=True)
    sd = load_file(str(hf / "model.safetensors"))
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = emb.clone()
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(hf, "float32")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    sd["lm_head.weight"] = torch.randn(emb.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="specdec.checkpoint"):
        model = load_model(hf, "float32")
    assert "lm_head.weight differs from the embeddings" in caplog.text
    assert not model.config.tie_word_embeddings
    assert_logits_match(hf, model)
