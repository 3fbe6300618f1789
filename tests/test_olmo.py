"""OLMo 2 and OLMo 3: no norm before the attention or the MLP, an RMSNorm on each one's output
before its residual add, q and k normed over their whole projections (one weight of H x hd and
KV x hd, not per head); OLMo 3 adds a sliding window in 3 layers of 4 (windows of 8 here).
Each as a Hugging Face folder and as a GGUF file (llama.cpp's olmo2 architecture, which holds
OLMo 3 too, with its window and per-layer pattern), on the PyTorch and the C forward, against
transformers, and every speculative method against plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.model import ModelConfig, load_model, save_model
from specdec.model.llama import shard_config
from arch_checks import (IDS, arch_files, cached_logits, check_tensor_parallel_equals_tp1, reference,  # noqa: F401
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain)

WINDOW = 8
CONFIGS = {"olmo2": {}, "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}}
GGUF_KEYS = {"olmo2": {}, "olmo3": {"olmo2.attention.sliding_window": WINDOW,
                                    "olmo2.attention.sliding_window_pattern": [True, False]}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory) -> dict:
    arch = request.param
    return arch_files(tmp_path_factory.mktemp(arch), arch, CONFIGS[arch], GGUF_KEYS[arch])


def test_config_reads_and_writes_olmo(files, tmp_path):
    model = load_model(files["hf"], "float32")
    for cfg in (model.config, load_model(files["f32"]).config):
        assert (cfg.pre_norms, cfg.sandwich_norms, cfg.qk_norm, cfg.qk_norm_full, cfg.model_type) == \
            (False, True, True, True, files["arch"])
        assert (cfg.sliding_window, cfg.sliding_layers) == ((WINDOW, (0,)) if files["arch"] == "olmo3" else (None, ()))
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and layer.mlp_norm is None
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)
    save_model(model, tmp_path / "saved", torch.float32)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["architectures"] == \
        [{"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}[files["arch"]]]
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)


def test_whole_projection_norms_matter(files):
    """Normed per head instead, the logits leave transformers'."""
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    model = load_model(files["hf"], "float32")
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
        model.config = model.local_config = model.config.replace(qk_norm_full=False)
        for layer in model.model.layers:
            layer.self_attn.qk_full = False
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.data = norm.weight.data[:16].clone()
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() > 1e-3


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    """q and k normed over their whole projections while each rank holds half the heads: the
    ranks' sums of squares are added (ShardedRMSNorm), so TP=2 computes TP=1's logits."""
    assert shard_config(load_model(files["hf"], "float32").config, 2).num_attention_heads == 2
    check_tensor_parallel_equals_tp1(files["hf"])


@pytest.mark.tp
def test_tensor_parallel_with_a_replicated_kv_head(tmp_path):
    """One KV head for two ranks: both hold it, and its sum of squares counts once."""
    from conftest import make_checkpoint

    check_tensor_parallel_equals_tp1(make_checkpoint(tmp_path / "kv1", arch="olmo2", num_key_value_heads=1))


def test_attention_bias_is_refused(files):
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf({**json.loads((files["hf"] / "config.json").read_text()), "attention_bias": True})
