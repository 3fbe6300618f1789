"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): RoPE over half of each head, biased q/k/v, a dense first
layer, then 8 experts in 2 groups routed as DeepSeek-V3 routes (sigmoid scores, a choice bias,
the best group only, weights renormalised x 2.5) beside a shared expert; and its MTP layer
(`model.layers.{L}.*`, a mixture of experts too) as the drafter. A Hugging Face folder written by
transformers, on the C and the PyTorch forward: logits and greedy output against transformers,
every speculative method against plain decoding, the MTP layer against transformers' own
decoder layer, tensor parallelism."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import make_checkpoint, noisy_head_copy
from specdec import LLM, SamplingParams, kernels
from specdec.model import ForwardBatch, load_model, save_model
from specdec.model.config import ModelConfig
from specdec.model.llama import MoE, shard_config
from arch_checks import (IDS, NO_KERNELS, check_greedy_equals_transformers_generate,  # noqa: F401
                         check_grouped_routing_matches_transformers, check_tensor_parallel_equals_tp1, reference,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain, without_kernels)
from mtp_checks import add_mtp_layer, check_mtp_gguf, check_mtp_layer_matches_transformers
from test_heads import _heads_dirs

L = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("glm4_moe")
    hf = make_checkpoint(root / "hf", arch="glm4_moe", layers=L, use_qk_norm=True)
    return {"arch": "glm4_moe", "hf": hf, "near": noisy_head_copy(hf, root / "near"), **_heads_dirs(hf, root)}


def test_config_reads_and_writes_the_router(files, tmp_path):
    model = load_model(files["hf"], "float32")
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers,
            cfg.shared_expert_size, cfg.router_sigmoid, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
            cfg.rotary_dim, cfg.qk_norm, cfg.attention_bias) == \
        ("glm4_moe", 8, 2, 32, (1,), 32, True, 2, 1, 2.5, 8, True, True)
    assert [isinstance(layer.mlp, MoE) for layer in model.model.layers] == [False, True]
    assert model.model.layers[1].mlp.e_score_correction_bias.dtype == torch.float32
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg          # what --hf-overrides goes through
    save_model(model, tmp_path / "saved", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)
    assert shard_config(cfg, 2).shared_expert_size == 16


def test_routing_matches_transformers_router(files):
    check_grouped_routing_matches_transformers(files["hf"])


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_greedy_output_equals_transformers_generate(files, monkeypatch, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    check_greedy_equals_transformers_generate(files["hf"], files["hf"])


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    check_tensor_parallel_equals_tp1(files["hf"])


@pytest.fixture(scope="module")
def mtp(files, tmp_path_factory):
    """The checkpoint with an MTP layer after its last (GLM's layout: enorm, hnorm, eh_proj,
    shared_head, and a mixture-of-experts decoder layer), random weights."""
    folder = tmp_path_factory.mktemp("glm-mtp") / "hf"
    return {"hf": folder, "weights": add_mtp_layer(files["hf"], folder, L, 64)}


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_mtp_layer_matches_transformers_layer(files, mtp, monkeypatch, c_path):
    """Against transformers' own Glm4MoeDecoderLayer (index L: a mixture of experts) and RoPE."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    check_mtp_layer_matches_transformers(reference(files["hf"]), mtp["hf"], mtp["weights"],
                                         transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer, L, 8)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_mtp_greedy_equals_plain(files, mtp, monkeypatch, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=files["hf"], dtype="float32").generate(prompts, params)]
    for spec in ({"method": "glm4_moe_mtp", "num_speculative_tokens": 3},
                 {"method": "mtp", "num_speculative_tokens": 4, "topk": 2}):
        llm = LLM(model=mtp["hf"], dtype="float32", max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain, spec


def glm_gguf(files, out, qtypes=None, metadata=None):
    """llama.cpp's glm4moe file of the folder (its converter's keys: sigmoid gating, the shared
    experts, the leading dense layer; the MLP's input norm as post_attention_norm)."""
    from gguf_helpers import write_gguf
    cfg = json.loads((files["hf"] / "config.json").read_text())
    a = "glm4moe."
    meta = {a + "expert_shared_count": cfg["n_shared_experts"], a + "leading_dense_block_count": cfg["first_k_dense_replace"],
            a + "expert_gating_func": 2, a + "expert_weights_scale": float(cfg["routed_scaling_factor"]),
            a + "expert_weights_norm": True, a + "expert_group_count": cfg["n_group"],
            a + "expert_group_used_count": cfg["topk_group"], **(metadata or {})}
    return write_gguf(files["hf"], out, qtypes=qtypes, metadata=meta)


def test_gguf_equals_the_checkpoint(files, tmp_path):
    path = glm_gguf(files, tmp_path / "f32.gguf")
    ours = load_model(path)
    ref = load_model(files["hf"], "float32")
    fields = ("model_type", "rotary_dim", "qk_norm", "attention_bias", "moe_layers", "num_experts", "shared_expert_size",
              "router_sigmoid", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")
    assert [getattr(ours.config, f) for f in fields] == [getattr(ref.config, f) for f in fields]
    with torch.no_grad():
        expected = reference(files["hf"])(IDS).logits[0]
        torch.testing.assert_close(ours(IDS).logits[0], expected, atol=1e-4, rtol=1e-4)
        cache = ours.new_cache(batch=1)
        parts = []
        for a, b in ((0, 5), (5, 12)):
            parts.append(ours(IDS[0, a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])).logits)
            cache.set_length(0, b)
        torch.testing.assert_close(torch.cat(parts), expected, atol=1e-4, rtol=1e-4)


def test_packed_gguf_speculation_equals_plain(files, tmp_path):
    """A Q8_0 file kept packed, on the C forward where it runs: greedy with ngram and layer-skip
    drafts, four at once, equals plain decoding of the same file."""
    from gguf_helpers import T
    from specdec.model.quant import QuantLinear
    path = glm_gguf(files, tmp_path / "q8.gguf", qtypes=lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)
    model = load_model(path)
    assert isinstance(model.model.layers[1].mlp.experts[0].gate_up_proj, QuantLinear)
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(path), num_speculative_tokens=0, max_num_seqs=1).generate(
        prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                 {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}):
        llm = LLM(model=str(path), speculative_config=spec, max_num_seqs=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain, spec


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_mtp_from_gguf(files, mtp, tmp_path, monkeypatch, quant):
    """llama.cpp's layout: block L holds the MTP layer (nextn.* tensors and a decoder layer),
    block_count counts it and nextn_predict_layers says so. The target leaves it out; the mtp
    method reads it from the same file: the head's logits equal the folder's head's (F32), and
    greedy speculation equals plain decoding of the file (F32 and packed Q8_0)."""
    from gguf_helpers import T
    qtypes = None if quant == "f32" else (lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)
    path = glm_gguf({"hf": mtp["hf"]}, tmp_path / f"{quant}.gguf", qtypes,
                    {"glm4moe.block_count": L + 1, "glm4moe.nextn_predict_layers": 1})
    assert load_model(path).config.num_hidden_layers == L
    check_mtp_gguf(path, mtp["hf"], monkeypatch, packed=quant != "f32")


def test_mtp_needs_nextn_blocks(files, tmp_path):
    from specdec.model import CheckpointError
    path = glm_gguf(files, tmp_path / "plain.gguf")
    with pytest.raises(CheckpointError, match="has no MTP blocks"):
        LLM(model=str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_no_shared_expert(tmp_path):
    """n_shared_experts 0: transformers saves a zero-width shared expert and runs without one."""
    hf = make_checkpoint(tmp_path / "hf", arch="glm4_moe", layers=L, n_shared_experts=0)
    model = load_model(hf, "float32")
    assert model.config.shared_expert_size == 0
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, reference(hf)(IDS).logits, rtol=1e-4, atol=1e-4)
