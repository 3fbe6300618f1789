"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; Kimi K2 and Moonlight are V3) and
GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: V3's layers, its dense ones listed by mlp_layer_types):
multi-head latent attention with the latent cache (model/mla.py) and DeepSeekMoE. Tiny folders
written by transformers: V3 with q_a/q_b projections, interleaved RoPE and sigmoid group routing
with a choice bias; V2 with a plain q_proj, YaRN with mscale_all_dim (the scores' temperature)
and softmax group_limited_greedy routing. Checked against transformers on forward.c's whole
forward and on the PyTorch forward (with forward.c's paged attention, and without the kernels):
logits whole and through the paged cache, the router, greedy output, every speculative method;
forward.c's rows bit-identical however chunked and batched; V3's MTP layer (latent attention
and experts) against transformers' own decoder layer; the cache's size; what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import make_checkpoint, noisy_head_copy
from specdec import LLM, SamplingParams, kernels
from specdec.model import load_model, save_model
from specdec.model.config import ModelConfig
from specdec.model.llama import MoE
from specdec.model.mla import MLAttention
from specdec.model.mtp import load_mtp
from arch_checks import (IDS, NO_KERNELS, cached_logits, check_greedy_equals_transformers_generate,  # noqa: F401
                         check_grouped_routing_matches_transformers, check_rows_bit_identical,
                         check_speculative_greedy_equals_plain,
                         check_tensor_parallel_equals_tp1, reference, test_logits_match_transformers, without_kernels)
from mtp_checks import (add_mtp_layer, check_c_chain_equals_pytorch_chain, check_mtp_gguf,
                        check_mtp_layer_matches_transformers)
from test_heads import _heads_dirs

L = 2
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}}
CONFIGS = {"deepseek_v3": {}, "deepseek_v2": YARN, "glm4_moe_lite": {}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory) -> dict:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    hf = make_checkpoint(root / "hf", arch=arch, layers=L, **CONFIGS[arch])
    return {"arch": arch, "hf": hf, "near": noisy_head_copy(hf, root / "near"), **_heads_dirs(hf, root)}


def test_config_and_latent_cache(files, tmp_path):
    model = load_model(files["hf"], "float32")
    cfg = model.config
    v2 = files["arch"] == "deepseek_v2"
    assert (cfg.kv_lora_rank, cfg.rotary_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank) == \
        (32, 16, 32, 24, 0 if v2 else 64)
    assert (cfg.router_sigmoid, cfg.group_by_max, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == {
        "deepseek_v3": (True, False, 2, 1, 2.5), "deepseek_v2": (False, True, 2, 1, 1.5),
        "glm4_moe_lite": (True, False, 2, 1, 1.8)}[files["arch"]]
    assert isinstance(model.model.layers[0].self_attn, MLAttention)
    assert [isinstance(layer.mlp, MoE) for layer in model.model.layers] == [False, True]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg          # what --hf-overrides goes through
    # one cached row per token and layer, [latent ; rotary key]: 48 floats, read as keys and values
    assert model.kv_bytes_per_slot() == L * 1 * (32 + 16) * 4
    assert model.kv_bytes_per_slot() * 6 == L * 4 * ((32 + 16) + 24) * 4     # 1/6 of four heads' keys and values
    kv = model.new_cache(batch=1, max_len=8)
    assert kv.v is kv.k
    save_model(model, tmp_path / "saved", torch.float32)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["rope_interleave"] is True
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)


def test_non_interleaved_rope(tmp_path):
    """A V3 folder with rope_interleave false: its rotary rows are used as they are."""
    hf = make_checkpoint(tmp_path / "hf", arch="deepseek_v3", layers=L, rope_interleave=False)
    with torch.no_grad():
        torch.testing.assert_close(load_model(hf, "float32")(IDS).logits, reference(hf)(IDS).logits,
                                   atol=1e-4, rtol=1e-4)


def test_routing_matches_transformers_router(files):
    check_grouped_routing_matches_transformers(files["hf"])


@pytest.mark.parametrize("c_path", [True, False], ids=["c-attention", "pytorch"])
def test_greedy_output_equals_transformers_generate(files, monkeypatch, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    check_greedy_equals_transformers_generate(files["hf"], files["hf"])


@pytest.mark.parametrize("c_path", [True, False], ids=["c-attention", "pytorch"])
def test_speculative_greedy_equals_plain(files, monkeypatch, c_path):
    """ngram, draft model, self-draft, layer skip, EAGLE tree and chain, alone and four at once."""
    check_speculative_greedy_equals_plain(files, monkeypatch, c_path)


def test_speculative_greedy_equals_plain_padded_attention(files, monkeypatch):
    """The same with a GPU's padded attention over the latent cache (keys = values)."""
    check_speculative_greedy_equals_plain(files, monkeypatch, False, padded=True)


@NO_KERNELS
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["fp32-cache", "int8-cache"])
def test_c_forward_rows_are_bit_identical_however_chunked_and_batched(files, kv_dtype):
    """forward.c runs latent attention whole (q_proj, or q_a -> norm -> q_b; the latent's norm; each
    head's absorbed query and value products; one cached [latent ; rotary key] row read as key and
    value): a token's logits are the same bits however its prompt is chunked and whatever shares
    its batch, with an fp32 or an int8 latent cache; the int8 cache's logits stay near fp32's."""
    model = load_model(files["hf"], "float32")
    exact = check_rows_bit_identical(model, 24)
    if kv_dtype is not None:
        rounded = check_rows_bit_identical(model, 24, kv_dtype)
        assert 0 < (rounded - exact).abs().max() < 0.1 * exact.abs().max()


@NO_KERNELS
def test_bf16_checkpoint_absorbs_through_bf16_panels(files, tmp_path, monkeypatch):
    """A bf16 folder (kv_b widened to fp32 at load): forward.c reads each head's absorbed
    products from bf16 panels, and its logits are the same bits as from fp32 panels of the same
    values."""
    from specdec.kernels import cforward
    save_model(load_model(files["hf"], "float32"), tmp_path / "bf16", torch.bfloat16)
    model = load_model(tmp_path / "bf16")
    att = model.model.layers[0].self_attn
    assert att.kv_b_proj.weight.dtype == torch.float32 and model.c_view(model.new_cache(1, 8)) is not None
    assert all(t.dtype == torch.bfloat16 for t in cforward._absorbed(att))
    tokens = IDS[0, :12]
    half = cached_logits(model, tokens, [(0, 5), (5, 12)])
    widened = cforward._absorbed
    monkeypatch.setattr(cforward, "_absorbed", lambda a: tuple(t.float() for t in widened(a)))
    model = load_model(tmp_path / "bf16")
    assert cforward._absorbed(model.model.layers[0].self_attn)[0].dtype == torch.float32
    assert torch.equal(cached_logits(model, tokens, [(0, 5), (5, 12)]), half)


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    """Two ranks with two query heads each (their slices of q, kv_b and o), the latent rows
    cached whole on both: logits within float tolerance of TP=1, greedy output identical."""
    check_tensor_parallel_equals_tp1(files["hf"])


@pytest.mark.tp
def test_mtp_under_tensor_parallelism(v3_mtp):
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=v3_mtp["plain"], dtype="float32").generate(prompts, params)]
    llm = LLM(model=v3_mtp["hf"], dtype="float32", tensor_parallel_size=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    """A V3 folder with an MTP layer after its last (enorm, hnorm, eh_proj, shared_head, and a
    latent-attention + experts decoder layer), random weights, in interleaved-RoPE layout; and
    the folder without it."""
    root = tmp_path_factory.mktemp("ds-mtp")
    plain = make_checkpoint(root / "plain", arch="deepseek_v3", layers=L)
    return {"hf": root / "hf", "plain": plain, "weights": add_mtp_layer(plain, root / "hf", L, 64)}


@pytest.mark.parametrize("c_path", [True, False], ids=["c-attention", "pytorch"])
def test_mtp_layer_matches_transformers_layer(v3_mtp, monkeypatch, c_path):
    """Against transformers' own DeepseekV3DecoderLayer at index L (latent attention, experts)."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    check_mtp_layer_matches_transformers(reference(v3_mtp["plain"]), v3_mtp["hf"], v3_mtp["weights"],
                                         transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
                                         L, 8)
    head = load_mtp(v3_mtp["hf"], load_model(v3_mtp["hf"], "float32"))
    assert isinstance(head.decoder.model.layers[0].self_attn, MLAttention)


def test_mtp_greedy_equals_plain(v3_mtp):
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=v3_mtp["plain"], dtype="float32").generate(prompts, params)]
    llm = LLM(model=v3_mtp["hf"], dtype="float32", max_num_seqs=4,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


@pytest.fixture(scope="module")
def flash_mtp(tmp_path_factory):
    """A GLM-4.7-Flash folder (V3's layers, dense ones listed by mlp_layer_types) with an MTP layer."""
    root = tmp_path_factory.mktemp("glm-flash-mtp")
    plain = make_checkpoint(root / "plain", arch="glm4_moe_lite", layers=L)
    return {"hf": root / "hf", "plain": plain, "weights": add_mtp_layer(plain, root / "hf", L, 64)}


def test_glm_flash_mtp_greedy_equals_plain(flash_mtp, monkeypatch):
    """GLM-4.7-Flash's MTP layer (latent attention, experts; mlp_layer_types lists only the
    target's layers, so it takes the last one's kind) drafts: output identical to plain decoding;
    where the kernels load, its chains in forward.c equal the PyTorch chains."""
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=flash_mtp["plain"], dtype="float32").generate(prompts, params)]
    llm = LLM(model=flash_mtp["hf"], dtype="float32", max_num_seqs=3,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert llm.engine.proposer.name == "mtp"
    layer = llm.engine.proposer.head.decoder.model.layers[0]       # the last layer's kind: experts
    assert isinstance(layer.self_attn, MLAttention) and isinstance(layer.mlp, MoE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    if kernels.load() is not None:
        check_c_chain_equals_pytorch_chain(flash_mtp["hf"], monkeypatch)


@pytest.mark.parametrize("which,quant", [("v3", "f32"), ("flash", "f32"), ("flash", "q8_0")])
def test_mtp_from_gguf(v3_mtp, flash_mtp, tmp_path, monkeypatch, which, quant):
    """llama.cpp's deepseek2 file with the MTP layer as block L (nextn.* tensors, latent
    attention, experts; block_count counts it, nextn_predict_layers says so): the target leaves
    it out, the mtp method reads it, the head's logits equal the folder's head's (F32), and
    greedy speculation equals plain decoding of the file (F32, and packed Q8_0 run by forward.c)."""
    from gguf_helpers import T
    files = {"v3": v3_mtp, "flash": flash_mtp}[which]
    qtypes = None if quant == "f32" else (lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)
    path = deepseek_gguf({"hf": files["hf"]}, tmp_path / f"{quant}.gguf", True, qtypes=qtypes,
                         extra_meta={"deepseek2.block_count": L + 1, "deepseek2.nextn_predict_layers": 1})
    assert load_model(path).config.num_hidden_layers == L
    check_mtp_gguf(path, files["hf"], monkeypatch, packed=quant != "f32")


@NO_KERNELS
def test_mtp_c_chain_equals_pytorch_chain(v3_mtp, monkeypatch):
    """[enorm(e) ; hnorm(h)] through eh_proj, then latent attention and experts, drafted in
    forward.c: the PyTorch chain's drafts at every step."""
    check_c_chain_equals_pytorch_chain(v3_mtp["hf"], monkeypatch)


def deepseek_gguf(files, out, split_kv_b: bool, qtypes=None, extra_meta: dict | None = None):
    """llama.cpp's deepseek2 file of the folder, as its converter writes it: MLA as one KV head of
    kv_lora_rank + rope dims (key_length) with the head sizes under key_length_mla /
    value_length_mla, sigmoid gating (2) for V3, YaRN's mscale_all_dim as yarn_log_multiplier;
    split_kv_b: kv_b_proj as k_b [H, latent, nope] and v_b [H, v, latent] (its converters since
    the MLA cache), else the older attn_kv_b."""
    from gguf_helpers import write_gguf
    cfg = json.loads((files["hf"] / "config.json").read_text())
    H, C, r, nope, v = (cfg[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                         "v_head_dim"))
    a = "deepseek2."
    dense = cfg.get("first_k_dense_replace", (cfg.get("mlp_layer_types") or ["sparse"]).index("sparse"))
    meta = {a + "attention.head_count_kv": 1, a + "leading_dense_block_count": dense,
            a + "vocab_size": cfg["vocab_size"], a + "attention.kv_lora_rank": C, a + "attention.key_length": C + r,
            a + "attention.value_length": C, a + "attention.key_length_mla": nope + r,
            a + "attention.value_length_mla": v, a + "rope.dimension_count": r,
            a + "expert_shared_count": cfg["n_shared_experts"], a + "expert_weights_scale": float(cfg["routed_scaling_factor"]),
            a + "expert_group_count": cfg["n_group"], a + "expert_group_used_count": cfg["topk_group"]}
    if cfg["model_type"] != "deepseek_v2":       # V3 and GLM-4.7-Flash: q_lora, sigmoid routing
        meta.update({a + "attention.q_lora_rank": cfg["q_lora_rank"], a + "expert_gating_func": 2,
                     a + "expert_weights_norm": True})
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        meta.update({a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(rope["factor"]),
                     a + "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                     a + "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]})
    meta.update(extra_meta or {})
    extra, skip = {}, ()
    if split_kv_b:
        sd = load_file(str(files["hf"] / "model.safetensors"))
        blocks = sorted(int(k.split(".")[2]) for k in sd if k.endswith("self_attn.kv_b_proj.weight"))
        for i in blocks:       # an MTP layer's block too
            kv_b = sd[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(H, nope + v, C)
            extra[f"blk.{i}.attn_k_b.weight"] = kv_b[:, :nope].transpose(1, 2).contiguous().numpy()
            extra[f"blk.{i}.attn_v_b.weight"] = kv_b[:, nope:].contiguous().numpy()
        skip = tuple(f"blk.{i}.attn_kv_b.weight" for i in blocks)
    return write_gguf(files["hf"], out, qtypes=qtypes, metadata=meta, extra_tensors=extra, skip=skip)


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["kv_b", "k_b-v_b"])
def test_gguf_equals_the_checkpoint(files, tmp_path, split_kv_b):
    """An F32 deepseek2 file: the same config, the same logits as the folder (whole and paged)."""
    path = deepseek_gguf(files, tmp_path / "f32.gguf", split_kv_b)
    ours = load_model(path)
    hf_cfg = load_model(files["hf"], "float32").config
    assert ours.config.model_type == ("deepseek_v2" if files["arch"] == "deepseek_v2" else "deepseek_v3")
    fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "rotary_dim", "head_dim",
              "num_key_value_heads", "moe_layers", "num_experts", "shared_expert_size", "router_sigmoid", "n_group",
              "topk_group", "group_by_max", "norm_topk_prob")
    assert [getattr(ours.config, f) for f in fields] == [getattr(hf_cfg, f) for f in fields]
    for f in ("attention_multiplier", "routed_scaling_factor"):       # float32 metadata
        assert getattr(ours.config, f) == pytest.approx(getattr(hf_cfg, f), rel=1e-6)
    with torch.no_grad():
        expected = reference(files["hf"])(IDS).logits[0]
        torch.testing.assert_close(ours(IDS).logits[0], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached_logits(ours, IDS[0], [(0, 5), (5, 12)]), expected, atol=1e-4, rtol=1e-4)


def test_packed_gguf_speculation_equals_plain(files, tmp_path):
    """A Q8_0 file kept packed (its projections as quantized panels; kv_b dense), run whole by
    forward.c (its rows bit-identical however batched): greedy with ngram and layer-skip drafts,
    four at once, equals plain decoding of the same file."""
    from gguf_helpers import T
    from specdec.model.quant import QuantLinear
    path = deepseek_gguf(files, tmp_path / "q8.gguf", True,
                         qtypes=lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)
    model = load_model(path)
    assert isinstance(model.model.layers[0].self_attn.kv_a_proj_with_mqa, QuantLinear)
    if kernels.load() is not None:       # forward.c runs it whole, its projections packed
        assert model.c_view(model.new_cache(1, 8)) is not None
        check_rows_bit_identical(model, 24)
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(path), num_speculative_tokens=0, max_num_seqs=1).generate(
        prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                 {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}):
        llm = LLM(model=str(path), speculative_config=spec, max_num_seqs=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain, spec


def test_int8_latent_cache(files):
    """--kv-cache-dtype int8 over the latent rows (one scale per row, shared by keys and values):
    speculation equals plain decoding with the same cache, and the output stays close to fp32's
    (most tokens the same)."""
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(model=files["hf"], dtype="float32", kv_cache_dtype="int8")
    plain = [o.outputs[0].token_ids for o in LLM(**kw, num_speculative_tokens=0).generate(prompts, params)]
    spec = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, max_num_seqs=3)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    fp32 = [o.outputs[0].token_ids for o in LLM(model=files["hf"], dtype="float32").generate(prompts, params)]
    same = sum(a == b for p, q in zip(plain, fp32) for a, b in zip(p, q))
    assert same >= 0.5 * sum(map(len, fp32)), (plain, fp32)


@pytest.mark.tp
def test_packed_gguf_tensor_parallel_equals_tp1(tmp_path):
    """A Q8_0 deepseek2 file split over two ranks: q_b's rows and o_proj's columns stay packed
    (v_head_dim 32: each rank's columns are whole Q8_0 blocks), kv_b dense; greedy output
    identical to one rank's."""
    from gguf_helpers import T
    hf = make_checkpoint(tmp_path / "hf", arch="deepseek_v3", layers=L, v_head_dim=32)
    path = deepseek_gguf({"hf": hf}, tmp_path / "q8.gguf", True,
                         qtypes=lambda n, ndim: T.Q8_0 if ndim >= 2 and "token_embd" not in n else T.F32)
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 7)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model=str(path), num_speculative_tokens=0).generate(prompts, params)]
    llm = LLM(model=str(path), num_speculative_tokens=0, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == one
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_deep_tree_paths_moved_in_the_latent_cache(files, kv_dtype):
    """Accepted tree paths through a later sibling (an oracle tree hides the true continuation at a
    random sibling position) are moved into place in the latent cache, where values are keys:
    the move copied that one tensor twice, the second copy reading rows the first had overwritten,
    and the output left plain's at the first such path."""
    from specdec.engine import Engine
    from test_heads import OracleTree

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [IDS[0, :n].tolist() for n in (3, 12, 7, 20)]
    llm = LLM(model=files["hf"], dtype="float32", kv_cache_dtype=kv_dtype, num_speculative_tokens=0)
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    engine = Engine(llm.target, llm.tokenizer, OracleTree(truth, 0), 12, llm.engine.max_model_len)
    for prompt, want in zip(prompts, plain):
        events = list(engine.generate(prompt, params))
        assert [t for e in events for t in e.token_ids] == want
        assert events[-1].stats.mean_accepted_length > 3      # deep paths accepted and moved
