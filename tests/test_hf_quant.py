"""Quantized Hugging Face folders (model/hf_quant.py): compressed-tensors folders written by the
real `compressed_tensors` package and read back by transformers as the reference; GPTQ and AWQ
folders in AutoGPTQ's and AutoAWQ's layouts (tests/quant_writers.py); transformers' block FP8.
Dense loading (quantization="none") equals the reference to fp32 rounding; packed loading keeps
the stated llama.cpp format, with weights equal to the reference's, and speculative decoding on
it stays lossless."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_same_greedy, make_checkpoint
from quant_writers import LINEARS, save_quantized, save_truth, write_awq, write_compressed_tensors, write_gptq
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.model import CheckpointError, load_model
from specdec.model.gguf import kernels_cover
from specdec.model.quant import QuantLinear

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 70, 11]])


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits[0].float()


def hf_logits(folder, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    with torch.inference_mode():
        return model(IDS).logits[0].float(), model


def assert_near(x, y):
    """int8 activations per block of 32 (qgemm.c, as llama.cpp) against exact dequantized maths."""
    assert ((x - y).norm() / y.norm()).item() < 0.05
    assert (x.argmax(-1) == y.argmax(-1)).float().mean().item() >= 0.8


def runtime_weight(model, layer: int, name: str) -> torch.Tensor:
    """The [out, in] fp32 matrix of an HF module name in the runtime's fused modules."""
    L = model.model.layers[layer]
    fused = {"q_proj": (L.self_attn.qkv_proj, 0), "k_proj": (L.self_attn.qkv_proj, 1), "v_proj": (L.self_attn.qkv_proj, 2),
             "o_proj": (L.self_attn.o_proj, None), "gate_proj": (L.mlp.gate_up_proj, 0), "up_proj": (L.mlp.gate_up_proj, 1),
             "down_proj": (L.mlp.down_proj, None)}
    mod, part = fused[name]
    w = mod.dequantize() if isinstance(mod, QuantLinear) else mod.weight.float()
    if part is None:
        return w
    if name.endswith(("gate_proj", "up_proj")):
        return w.chunk(2)[part]
    cfg = model.config
    hd = cfg.head_dim
    sizes = [cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd]
    return w.split(sizes)[part]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny llama (hidden 256: whole 128-groups and 128x128 FP8 blocks) in a folder."""
    return make_checkpoint(tmp_path_factory.mktemp("hfq") / "dense", hidden=256, layers=2, seed=3)


# --- compressed-tensors ---------------------------------------------------------------------------

# scheme, group size, the kept format (None: dequantized at load)
CT_SCHEMES = [("W4A16", None, "Q4_0"), ("W4A16", 32, "Q4_0"), ("W4A16_ASYM", None, "Q4_1"), ("W8A16", None, "Q8_0"),
              ("W8A8", None, "Q8_0"), ("FP8", None, None), ("FP8_DYNAMIC", None, None), ("FP8_BLOCK", None, None),
              ("NVFP4A16", None, None), ("MXFP4A16", None, "MXFP4")]


@pytest.fixture(scope="module")
def ct_folders(dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return {(s, g): write_compressed_tensors(dense, root / f"{s}-{g}", s, g) for s, g, _ in CT_SCHEMES}


def ct_reference(folder):
    from transformers import CompressedTensorsConfig

    return hf_logits(folder, quantization_config=CompressedTensorsConfig(dequantize=True))


@pytest.mark.parametrize("scheme,group,fmt", CT_SCHEMES, ids=[f"{s}-{g}" for s, g, _ in CT_SCHEMES])
def test_compressed_tensors_dequantized_equals_transformers(ct_folders, scheme, group, fmt):
    folder = ct_folders[(scheme, group)]
    ref, hf = ct_reference(folder)
    model = load_model(folder, "float32", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    for name in LINEARS:
        got = runtime_weight(model, 1, name)
        want = getattr(hf.model.layers[1].self_attn if name in LINEARS[:4] else hf.model.layers[1].mlp, name).weight.float()
        if scheme.startswith("NVFP4"):       # compressed-tensors dequantizes FP4 in bf16 (its unpack's dtype)
            got = got.bfloat16().float()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    tol = 2e-2 if scheme.startswith("NVFP4") else 1e-5
    torch.testing.assert_close(logits(model), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("scheme,group,fmt", CT_SCHEMES, ids=[f"{s}-{g}" for s, g, _ in CT_SCHEMES])
def test_compressed_tensors_packed(ct_folders, scheme, group, fmt):
    folder = ct_folders[(scheme, group)]
    ref, hf = ct_reference(folder)
    model = load_model(folder, "float32")
    qkv = model.model.layers[0].self_attn.qkv_proj
    if fmt is None or not kernels_cover({fmt}, torch.device("cpu")):
        # no block format for this scheme (FP8, NVFP4), or no kernel for it here: loaded dequantized,
        # dense everywhere, and computing what the dequantized checkpoint computes
        assert not any(isinstance(m, QuantLinear) for m in model.modules())
        tol = 2e-2 if scheme.startswith("NVFP4") else 1e-5
        torch.testing.assert_close(logits(model), ref, atol=tol * ref.abs().max().item(), rtol=0)
        return
    assert isinstance(qkv, QuantLinear) and qkv.qtype == fmt
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert not isinstance(model.lm_head, QuantLinear)            # ignored by the scheme: dense
    for name in LINEARS:
        want = getattr(hf.model.layers[0].self_attn if name in LINEARS[:4] else hf.model.layers[0].mlp, name).weight.float()
        # the blocks hold scales (and Q4_1's m = -scale * (8 + zero)) as fp16; these fp32 scales round
        tol = 2 ** -10 * want.abs().max().item()
        torch.testing.assert_close(runtime_weight(model, 0, name), want, atol=tol, rtol=0)
    assert_near(logits(model), ref)


def test_mixed_precision_siblings_share_one_format(dense, tmp_path):
    """q_proj in 4 bits, k/v in 8 (two config groups): the fused q/k/v cannot hold both formats,
    so its parts are dequantized together; gate/up/down and o stay packed. (transformers'
    decompression of this folder did not give back k/v's weights here, compressed-tensors 0.20.1 /
    transformers 5.25: the reference is the source's weights, within a quantization step.)"""
    if not kernels_cover({"Q4_0", "Q8_0"}, torch.device("cpu")):
        pytest.skip("no kernels for Q4_0 / Q8_0 here")
    folder = write_compressed_tensors(dense, tmp_path / "mixed", {"re:.*q_proj$": "W4A16", "re:.*(k|v)_proj$": "W8A16",
                                                                    "re:.*(o|gate|up|down)_proj$": "W4A16"})
    source = load_file(dense / "model.safetensors")
    exact = load_model(folder, "float32", quantization="none")
    for name in LINEARS:
        w0 = source[f"model.layers.0.{'self_attn' if name in LINEARS[:4] else 'mlp'}.{name}.weight"]
        step = w0.abs().max() / (127 if name in ("k_proj", "v_proj") else 7)
        assert (runtime_weight(exact, 0, name) - w0).abs().max() <= step / 2 * 1.01
    model = load_model(folder, "float32")
    L = model.model.layers[0]
    assert not isinstance(L.self_attn.qkv_proj, QuantLinear)
    assert all(isinstance(m, QuantLinear) and m.qtype == "Q4_0" for m in (L.self_attn.o_proj, L.mlp.gate_up_proj,
                                                                           L.mlp.down_proj))
    assert_near(logits(model), logits(exact))


def test_bf16_scales_pack_exactly(dense, tmp_path):
    """llm-compressor on a bf16 model stores bf16 scales: fp16 holds them exactly, so the packed
    Q4_0 / Q8_0 matrices hold the folder's weights exactly (transformers forms scale * q in bf16:
    ours, exact in fp32, rounds to its bits)."""
    for scheme, fmt in (("W4A16", "Q4_0"), ("W8A16", "Q8_0")):
        if not kernels_cover({fmt}, torch.device("cpu")):
            continue
        folder = write_compressed_tensors(dense, tmp_path / scheme, scheme, dtype=torch.bfloat16)
        _, hf = ct_reference(folder)
        model = load_model(folder, "float32")
        assert model.model.layers[0].mlp.down_proj.qtype == fmt
        for name in LINEARS:
            want = getattr(hf.model.layers[0].self_attn if name in LINEARS[:4] else hf.model.layers[0].mlp, name).weight
            assert torch.equal(runtime_weight(model, 0, name).bfloat16().float(), want.float())


# --- GPTQ and AWQ -----------------------------------------------------------------------------

# bits, group, sym, act_order, v2, the kept format
GPTQ_CASES = [(4, 128, True, False, False, "Q4_0"), (4, 32, False, False, False, "Q4_1"), (8, -1, True, False, False, "Q8_0"),
              (4, 64, True, False, True, "Q4_0"), (4, 128, True, True, False, None), (3, 128, True, False, False, "Q4_0"),
              (2, 64, False, False, False, "Q4_1")]      # 2- and 3-bit codes fit 4-bit blocks exactly


@pytest.mark.parametrize("bits,group,sym,act_order,v2,fmt", GPTQ_CASES,
                         ids=["4bit-sym", "4bit-asym-g32", "8bit-channel", "v2", "act-order", "3bit", "2bit"])
def test_gptq_folder(dense, tmp_path, bits, group, sym, act_order, v2, fmt):
    folder, truth = write_gptq(dense, tmp_path / "gptq", bits, group, sym, act_order, v2)
    ref, hf = hf_logits(truth)
    model = load_model(folder, "float32", quantization="none")
    torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    packed = load_model(folder, "float32", quantization="gptq")       # vLLM's name for the method: accepted
    kept = fmt is not None and kernels_cover({fmt}, torch.device("cpu"))
    qkv = packed.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) == kept and (not kept or qkv.qtype == fmt)
    for name in LINEARS:
        want = getattr(hf.model.layers[1].self_attn if name in LINEARS[:4] else hf.model.layers[1].mlp, name).weight
        tol = 2 ** -10 * want.abs().max().item() if fmt == "Q4_1" else 0
        torch.testing.assert_close(runtime_weight(packed, 1, name), want.float(), atol=tol, rtol=0)
    if kept:
        assert_near(logits(packed), ref)


def test_awq_folder_with_biases(tmp_path_factory):
    """AutoAWQ's GEMM layout on a Qwen2 (q/k/v biases): Q4_1 (AWQ's zero points)."""
    src = make_checkpoint(tmp_path_factory.mktemp("awq") / "qwen2", arch="qwen2", hidden=256, layers=2, seed=4)
    folder, truth = write_awq(src, src.parent / "awq")
    ref, hf = hf_logits(truth)
    dense = load_model(folder, "float32", quantization="none")
    torch.testing.assert_close(logits(dense), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    packed = load_model(folder, "float32", quantization="awq_marlin")
    if kernels_cover({"Q4_1"}, torch.device("cpu")):
        qkv = packed.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantLinear) and qkv.qtype == "Q4_1" and qkv.bias is not None
        assert_near(logits(packed), ref)
    for name in LINEARS:
        want = getattr(hf.model.layers[0].self_attn if name in LINEARS[:4] else hf.model.layers[0].mlp, name).weight
        torch.testing.assert_close(runtime_weight(packed, 0, name), want.float(), atol=2 ** -10 * want.abs().max().item(),
                                   rtol=0)


def test_fp8_block_folder(dense, tmp_path):
    """transformers' "fp8" folders (Qwen3-FP8, DeepSeek-V3): float8_e4m3fn weights with
    weight_scale_inv per 128x128 block (a short last block where a side is not a multiple)."""
    sd, truth = load_file(dense / "model.safetensors"), {}
    out = dict(sd)
    for name, w in sd.items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            N, K = w.shape
            w = w[:, :K]
            s = torch.rand(-(-N // 128), -(-K // 128)) * 0.01 + 0.001
            full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
            q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
            truth[name] = q.float() * full
    save_quantized(dense, tmp_path / "fp8", out, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]})
    ref, _ = hf_logits(save_truth(dense, tmp_path / "fp8", sd, truth))
    model = load_model(tmp_path / "fp8", "float32")
    torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


# --- speculation on a quantized target, errors ------------------------------------------------

PROMPTS = [[0, 9, 17, 9, 17, 9, 17, 9], [0, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 30, 31, 32, 33, 34, 35]]


def test_speculative_greedy_on_quantized_target_equals_plain(ct_folders, dense, tmp_path):
    """A W4A16 target with an ngram proposer and with a GPTQ draft: every greedy output equals
    plain decoding of the same quantized target."""
    target = str(ct_folders[("W4A16", None)])
    draft, _ = write_gptq(dense, tmp_path / "draft", bits=8, group=-1)
    plain = LLM(target)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        fast = LLM(target, quantization="compressed-tensors", speculative_config=spec)   # the target's method
        assert assert_same_greedy(plain, fast, PROMPTS, params) > 0


def _with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals(ct_folders, dense, tmp_path, capsys):
    gptq, _ = write_gptq(dense, tmp_path / "gptq")
    cases = [
        (_with_config(gptq, tmp_path / "bnb", lambda q: q.update(quant_method="bitsandbytes")), None,
         "quant_method 'bitsandbytes' is not supported"),
        (_with_config(gptq, tmp_path / "gemv", lambda q: q.update(quant_method="awq", version="gemv")), None,
         "AWQ version 'gemv'"),
        (gptq, "awq", "does not match the folder's quantization_config (quant_method gptq)"),
        (_with_config(ct_folders[("W4A16", None)], tmp_path / "sparse",
                      lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"})), None,
         "sparsity format 'sparse-24-bitmask' is not read"),
        (ct_folders[("W4A16", None)], "gptq", "quant_method compressed-tensors"),
        (dense, "compressed-tensors", "quant_method none"),
    ]
    for folder, quantization, message in cases:
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_model(folder, quantization=quantization)
    code = main(["generate", "--model", str(gptq), "--quantization", "awq", "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not match" in err
    # a damaged tensor: packed words that do not fit the stored shape
    bad = tmp_path / "bad"
    shutil.copytree(ct_folders[("W4A16", None)], bad)
    sd = load_file(bad / "model.safetensors")
    name = next(n for n in sd if n.endswith("o_proj.weight_packed"))
    sd[name] = sd[name][:, :-3].contiguous()
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="does not fit weight_shape"):
        load_model(bad)


@pytest.mark.tp
def test_tensor_parallel_on_a_gptq_folder(dense, tmp_path):
    """The TP workers load the folder with the same loader: TP=2 greedy equals TP=1."""
    folder, _ = write_gptq(dense, tmp_path / "gptq", bits=4, group=64, sym=False)
    kw = dict(model=str(folder), quantization="gptq", num_speculative_tokens=0, max_model_len=96)
    tp1, tp2 = LLM(**kw), LLM(**kw, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for ids in PROMPTS:
            want = tp1.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
            assert tp2.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == want
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gptq_mixture_of_experts(tmp_path, arch):
    """GPTQ on every expert's projections (the router stays dense): each expert's gate and up
    stay packed together; logits as transformers' on the dense weights the codes mean."""
    src = make_checkpoint(tmp_path / arch, arch=arch, hidden=128, layers=2, seed=5)
    folder, truth = write_gptq(src, tmp_path / "gptq", bits=4, group=32, sym=True)
    ref, _ = hf_logits(truth)
    torch.testing.assert_close(logits(load_model(folder, "float32", quantization="none")), ref,
                               atol=1e-5 * ref.abs().max().item(), rtol=0)
    packed = load_model(folder, "float32")
    if kernels_cover({"Q4_0"}, torch.device("cpu")):
        experts = [m for n, m in packed.named_modules() if ".experts." in n and isinstance(m, QuantLinear)]
        assert experts and all(m.qtype == "Q4_0" for m in experts)
        assert_near(logits(packed), ref)


def test_command_line_runs_a_gptq_folder(dense, tmp_path, capsys):
    folder, _ = write_gptq(dense, tmp_path / "gptq", bits=4, group=64, sym=True)
    assert main(["generate", "--model", str(folder), "--quantization", "gptq_marlin", "--max-tokens", "6",
                 "--temperature", "0", "hello"]) == 0
    assert capsys.readouterr().out.strip()


def test_lora_adapter_on_a_gptq_folder(dense, tmp_path):
    """A PEFT adapter served on a packed GPTQ target: its slots sit beside the Q4_0 matrices
    (forward.c's lora_for), logits near PEFT's over the dense weights the codes mean."""
    from specdec.lora import LoRARequest
    from test_lora import adapted_logits, make_adapter, peft_model

    folder, truth = write_gptq(dense, tmp_path / "gptq", bits=4, group=64, sym=True)
    adapter = make_adapter(truth, tmp_path / "adapter", seed=2)
    llm = LLM(str(folder), enable_lora=True, max_lora_rank=8, num_speculative_tokens=0)
    assert isinstance(llm.target.model.layers[0].self_attn.qkv_proj, QuantLinear) == \
        kernels_cover({"Q4_0"}, torch.device("cpu"))
    ids = IDS[0].tolist()
    reference = peft_model(truth, adapter)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
        with reference.disable_adapter():
            base = reference(torch.tensor([ids])).logits[0]
    got = adapted_logits(llm, LoRARequest("a", 1, str(adapter)), ids)
    assert_near(got.float(), want.float())
    assert ((want - base).norm() / base.norm()).item() > 0.05          # the adapter changes the answer


def test_float16_folders_run_in_bfloat16_on_the_cpu(dense, tmp_path):
    """GPTQ and AWQ folders say float16 (as do many dense ones); on the CPU "auto" runs them in
    bfloat16, vLLM's rule there, so the C forward takes them; an explicit float16 is kept."""
    from specdec import kernels

    folder, _ = write_gptq(dense, tmp_path / "gptq", bits=4, group=64)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    llm = LLM(str(folder), num_speculative_tokens=0)
    assert llm.target.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (llm.target.c_view(llm.engine.kv) is not None) == (kernels.load() is not None)
    assert load_model(folder, "float16").model.embed_tokens.weight.dtype == torch.float16


# --- ragged blocks and groups, per-module bits (a bug hunter's finds) -----------------------------

@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """A tiny llama with hidden 160 and intermediate 320: no side a multiple of 128."""
    return make_checkpoint(tmp_path_factory.mktemp("hfq") / "ragged", hidden=160, layers=2, seed=5)


def _fp8_block_quantize(w, bo, bi):
    """FP8 codes and a scale per [bo, bi] block (block (n // bo, k // bi), the last ones short), from
    the format's definition; and the dense weights they mean."""
    N, K = w.shape
    s = torch.empty(-(-N // bo), -(-K // bi))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].abs().amax().clamp_min(1e-6) / 448.0
    full = s.repeat_interleave(bo, 0)[:N].repeat_interleave(bi, 1)[:, :K]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * full


def _ct_fp8_block_config(block):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "dynamic": False}
    if block is not None:
        weights["block_structure"] = block
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


@pytest.mark.parametrize("kind,block", [("fp8", [128, 128]), ("fp8", None), ("fp8", [64, 96]), ("ct", [128, 128]),
                                        ("ct", None), ("ct", [64, 96])])
def test_fp8_block_with_ragged_last_blocks(ragged, tmp_path, kind, block):
    """FP8 block-wise weights whose sides are not multiples of the block: the block comes from
    weight_block_size / block_structure ([128, 128] when left out), the short last block has its
    own scale (the block size was taken as ceil(side / number of blocks): 107 for 320)."""
    bo, bi = block or (128, 128)
    sd, truth, out = load_file(ragged / "model.safetensors"), {}, {}
    scale_name = "weight_scale_inv" if kind == "fp8" else "weight_scale"
    for name, w in sd.items():
        out[name] = w
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            out[name], out[name[:-len("weight")] + scale_name], truth[name] = _fp8_block_quantize(w, bo, bi)
    qcfg = ({"quant_method": "fp8", "activation_scheme": "dynamic", **({"weight_block_size": block} if block else {})}
            if kind == "fp8" else _ct_fp8_block_config(block))
    folder = tmp_path / "q"
    save_quantized(ragged, folder, out, qcfg)
    ref, hf = hf_logits(save_truth(ragged, folder, sd, truth))
    model = load_model(folder, "float32", quantization="none")
    for name in LINEARS:
        want = getattr(hf.model.layers[1].self_attn if name in LINEARS[:4] else hf.model.layers[1].mlp, name).weight
        torch.testing.assert_close(runtime_weight(model, 1, name), want.float(), atol=0, rtol=0)
    torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    # a scale grid that does not fit the block: one line naming the module
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    name = f"model.layers.0.mlp.down_proj.{scale_name}"
    out[name] = out[name][:, :1].contiguous()
    save_file({k: v.contiguous() for k, v in out.items()}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj: block scale of shape \(") as e:
        load_model(bad, "float32", quantization="none")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bits,group", [(4, 128), (8, 64), (4, -1), (2, 96)])
def test_gptq_without_g_idx_groups_by_group_size(ragged, tmp_path, bits, group):
    """GPTQ without g_idx (desc_act false): column k in group k // group_size, ceil(K / group_size)
    groups (K 160 and 320 with groups of 128: the last group short; was read as K / G columns a
    group, or refused)."""
    folder, truth = write_gptq(ragged, tmp_path / "gptq", bits, group, sym=False, g_idx=False)
    ref, hf = hf_logits(truth)
    for quantization in ("none", "gptq"):
        model = load_model(folder, "float32", quantization=quantization)
        for name in LINEARS:
            want = getattr(hf.model.layers[1].self_attn if name in LINEARS[:4] else hf.model.layers[1].mlp, name).weight
            tol = 2 ** -10 * want.abs().max().item() if quantization == "gptq" else 0   # Q4_1's fp16 m
            torch.testing.assert_close(runtime_weight(model, 1, name), want.float(), atol=tol, rtol=0)
        if quantization == "none":
            torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_gptq_dynamic_per_module_overrides(dense, tmp_path):
    """GPTQModel's `dynamic`: the first regex that matches a module overrides its bits / group_size;
    "-:" leaves it unquantized (a plain weight)."""
    dynamic = {"+:.*down_proj": {"bits": 8, "group_size": 64}, r"-:.*layers\.1\.self_attn\.o_proj": {},
               r".*layers\.0\.self_attn\.[qkv]_proj": {"bits": 2}}
    folder, truth = write_gptq(dense, tmp_path / "gptq", 4, 128, sym=False, dynamic=dynamic)
    assert "layers.1.self_attn.o_proj.weight" in "".join(load_file(folder / "model.safetensors"))
    ref, hf = hf_logits(truth)
    model = load_model(folder, "float32", quantization="none")
    torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    for layer in (0, 1):
        for name in LINEARS:
            L = hf.model.layers[layer]
            want = getattr(L.self_attn if name in LINEARS[:4] else L.mlp, name).weight
            torch.testing.assert_close(runtime_weight(model, layer, name), want.float(), atol=0, rtol=0)
    packed = load_model(folder, "float32")
    assert_near(logits(packed), ref)


def test_gptq_bits_that_do_not_fit_the_tensors(dense, tmp_path):
    """A config's bits that do not match the packed words (globally or through `dynamic`): one
    line naming the module (was a raw RuntimeError from the unpacking); a group_size that does not
    fit the scales of a module without g_idx too."""
    gptq, _ = write_gptq(dense, tmp_path / "gptq", 4, 128, g_idx=False)
    cases = [(lambda q: q.update(bits=3), r"model\.layers\.\d\.\w+\.\w+_proj: GPTQ"),
             (lambda q: q.update(dynamic={"+:.*down_proj": {"bits": 8}}), r"model\.layers\.\d\.mlp\.down_proj: GPTQ"),
             (lambda q: q.update(dynamic={"+:.*down_proj": {"group_size": 32}}),
              r"model\.layers\.\d\.mlp\.down_proj: .*group"),
             (lambda q: q.update(dynamic={"-:.*down_proj": {}}), r"model\.layers\.\d\.mlp\.down_proj: .*dynamic")]
    for i, (edit, message) in enumerate(cases):
        folder = _with_config(gptq, tmp_path / f"bad{i}", edit)
        for quantization in ("none", None):
            with pytest.raises(CheckpointError, match=message) as e:
                load_model(folder, "float32", quantization=quantization)
            assert "\n" not in str(e.value)


def test_bitsandbytes_flag_and_autogptq_quantize_config_json(dense, tmp_path):
    """quantization="bitsandbytes" (a vLLM name) is refused as not supported (it said a .gguf was
    needed); an AutoGPTQ export with its settings in quantize_config.json (no quantization_config
    in config.json) is read from that file, as vLLM's gptq reads it (it loaded as unquantized and
    failed on missing weights)."""
    gptq, truth = write_gptq(dense, tmp_path / "gptq", 4, 64, sym=False)
    for folder in (gptq, dense):
        with pytest.raises(CheckpointError, match="quantization='bitsandbytes' is not supported") as e:
            load_model(folder, quantization="bitsandbytes")
        assert "\n" not in str(e.value)
    old = tmp_path / "autogptq"
    shutil.copytree(gptq, old)
    cfg = json.loads((old / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    del qcfg["quant_method"]
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "quantize_config.json").write_text(json.dumps({**qcfg, "true_sequential": True, "damp_percent": 0.01,
                                                          "model_name_or_path": None, "model_file_base_name": None}))
    ref, _ = hf_logits(truth)
    for quantization in ("none", "gptq", None):
        model = load_model(old, "float32", quantization=quantization)
        if quantization == "none":
            torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
        else:
            assert_near(logits(model), ref)
