"""Mixtures of experts: Mixtral (experts in every layer, weights renormalised), Granite MoE (the
same with Granite's multipliers and stacked experts in its checkpoints), Qwen3-MoE (q/k
head norms; a dense layer where mlp_only_layers says; norm_topk_prob) and OLMoE (q/k normed over
whole projections; weights not renormalised), with 4 experts and 2 per token. Each as a Hugging
Face folder and a GGUF file (llama.cpp's stacked [E, rows, in] expert tensors and router
ffn_gate_inp; Mixtral as a `llama` file with experts), on the PyTorch and the C forward, against
transformers, and every speculative method against plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from gguf_helpers import T
from specdec.model import load_model, save_model
from specdec.model.llama import MoE, shard_config
from arch_checks import (GREEDY, IDS, NO_KERNELS, arch_files, cached_logits, check_packed_batch_equals_solo,  # noqa: F401
                         check_tensor_parallel_equals_tp1,
                         check_rows_bit_identical, reference,
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain)

GRANITE = {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.05, "logits_scaling": 2.5}
CONFIGS = {"mixtral": {}, "qwen3_moe": {"mlp_only_layers": [0], "norm_topk_prob": True}, "olmoe": {}, "granitemoe": GRANITE,
           "granitemoeshared": {**GRANITE, "shared_intermediate_size": 64},
           "qwen2_moe": {"shared_expert_intermediate_size": 64}}
GRANITE_KEYS = {"embedding_scale": 6.0, "residual_scale": 0.3, "attention.scale": 0.05, "logit_scale": 2.5}
GGUF_KEYS = {"granitemoe": {f"granitemoe.{k}": v for k, v in GRANITE_KEYS.items()},
             "granitemoeshared": {f"granitemoe.{k}": v for k, v in GRANITE_KEYS.items()}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory) -> dict:
    arch = request.param
    return arch_files(tmp_path_factory.mktemp(arch), arch, CONFIGS[arch], GGUF_KEYS.get(arch),
                      q8_0=lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)


def test_config_reads_and_writes_the_experts(files, tmp_path):
    model = load_model(files["hf"], "float32")
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layers",
              "model_type", "qk_norm", "qk_norm_full")
    expected = {"mixtral": (4, 2, 128, True, (0, 1), "mixtral", False, False),
                "qwen3_moe": (4, 2, 32, True, (1,), "qwen3_moe", True, False),
                "olmoe": (4, 2, 128, False, (0, 1), "olmoe", True, True),
                "granitemoe": (4, 2, 128, True, (0, 1), "granitemoe", False, False),
                "granitemoeshared": (4, 2, 128, True, (0, 1), "granitemoeshared", False, False),
                "qwen2_moe": (4, 2, 32, False, (0, 1), "qwen2_moe", False, False)}[files["arch"]]
    for cfg in (model.config, load_model(files["f32"]).config):
        assert tuple(getattr(cfg, f) for f in fields) == expected
    assert [isinstance(layer.mlp, MoE) for layer in model.model.layers] == [i in expected[4] for i in range(2)]
    save_model(model, tmp_path / "saved", torch.float32)
    json.loads((tmp_path / "saved" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)
    if not model.config.qk_norm_full:
        local = shard_config(model.config, 2)
        assert (local.moe_intermediate_size, local.shared_expert_size) == \
            (model.config.moe_intermediate_size // 2, model.config.shared_expert_size // 2)
        with pytest.raises(ValueError, match="must divide the model's moe_intermediate_size"):
            shard_config(model.config.replace(moe_intermediate_size=model.config.moe_intermediate_size + 1), 2)


def test_routing_matters(files):
    """One expert per token instead of two: the logits leave transformers'."""
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    model = load_model(files["hf"], "float32")
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.top_k = 1
        model._c_views.clear()
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() > 1e-3


@NO_KERNELS
def test_expert_rows_are_bit_identical_however_chunked_and_batched(files):
    """Each expert runs once over the rows routed to it: a token's logits are the same bits
    however chunked and batched."""
    check_rows_bit_identical(load_model(files["hf"], "float32"), 24)


@NO_KERNELS
def test_packed_q8_0_experts(files):
    """Q8_0 experts stay packed (the C kernels multiply them); greedy output four at once with
    speculation equals plain decoding one at a time."""
    model = load_model(files["q8_0"], quantization="gguf")
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    assert type(moe.experts[0].gate_up_proj).__name__ == "QuantLinear"
    with torch.no_grad():
        ref = reference(files["hf"])(IDS).logits[0]
        assert (cached_logits(model, IDS[0], [(0, 5), (5, 12)]) - ref).abs().max() < 0.1 * ref.abs().max()
    check_packed_batch_equals_solo(files["q8_0"])


def test_eagle_head_of_a_mixture_is_a_plain_layer(files):
    from specdec.model.heads import EagleHead

    head = EagleHead(load_model(files["hf"], "float32").config, torch.arange(8))
    assert not isinstance(head.decoder.model.layers[0].mlp, MoE) and head.decoder.config.model_type == "llama"


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    """Each expert's (and the shared expert's) rows split over 2 ranks, one all-reduce of the
    mixture's sum (OLMoE: its whole-projection q/k norms sum their squares over the ranks too):
    logits within float tolerance of TP=1, greedy output identical."""
    check_tensor_parallel_equals_tp1(files["hf"])
