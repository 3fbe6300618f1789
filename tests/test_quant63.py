"""Quantized folders of review 63 (model/hf_quant.py): compressed-tensors MXFP8 (E8M0 scales) and
"dense" format (llm-compressor's save_compressed=False) written by the real `compressed_tensors`
package and read back by transformers as the reference; a quantized LM head of a tied-embedding
model (used, untied, as a stored float head is); vLLM's / AutoFP8's per-tensor FP8; refusals."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_checkpoint
from quant_writers import (LINEARS, _pack_k, minmax_codes, pack_fields, save_quantized, save_truth,
                           write_compressed_tensors, write_gptq)
from specdec.cli import main
from specdec.model import CheckpointError, load_model

pytest.importorskip("compressed_tensors")

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 70, 11]])


def logits(model):
    with torch.inference_mode():
        return model(IDS).logits[0].float()


def hf_model(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def ct_reference(folder):
    from transformers import CompressedTensorsConfig

    return hf_model(folder, quantization_config=CompressedTensorsConfig(dequantize=True))


def assert_logits_equal(model, hf):
    with torch.inference_mode():
        ref = hf(IDS).logits[0].float()
    torch.testing.assert_close(logits(model), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q63") / "dense", hidden=64, layers=2, seed=3)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q63") / "tied", hidden=64, layers=2, seed=4, vocab=264,
                           tie_word_embeddings=True)    # GPTQ packs the head 8 rows a word


@pytest.mark.parametrize("quantization", ["none", None])
def test_mxfp8_e8m0_scales_are_powers_of_two(dense, tmp_path, quantization):
    """mxfp8-quantized: float8 weights with uint8 E8M0 scales per 32, w = fp8 * 2^(e - 127)."""
    folder = write_compressed_tensors(dense, tmp_path / "mxfp8", "MXFP8A16")
    assert load_file(folder / "model.safetensors")["model.layers.0.self_attn.o_proj.weight_scale"].dtype == torch.uint8
    hf = ct_reference(folder)
    model = load_model(folder, "float32", quantization=quantization)
    torch.testing.assert_close(model.model.layers[0].self_attn.o_proj.weight.float(),
                               hf.model.layers[0].self_attn.o_proj.weight.float(), atol=0, rtol=0)
    assert_logits_equal(model, hf)


def test_dense_format_weights_are_used_as_stored(dense, tmp_path, monkeypatch):
    """format "dense": float weights beside their weight_scale / zero point, which compressed_tensors'
    DenseCompressor (and transformers) leave as they are: not scaled again."""
    from compressed_tensors.compressors import ModelCompressor

    make = ModelCompressor.from_pretrained_model
    with monkeypatch.context() as patch:            # the writer saves as llm-compressor's save_compressed=False
        patch.setattr(ModelCompressor, "from_pretrained_model",
                      lambda model, **kw: make(model, quantization_format="dense"))
        folder = write_compressed_tensors(dense, tmp_path / "w4-dense", "W4A16_ASYM", group=32)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == "dense"
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.self_attn.o_proj.weight_scale" in stored
    model = load_model(folder, "float32")
    torch.testing.assert_close(model.model.layers[0].self_attn.o_proj.weight,
                               stored["model.layers.0.self_attn.o_proj.weight"].float(), atol=0, rtol=0)
    assert_logits_equal(model, ct_reference(folder))


@pytest.mark.parametrize("scheme,group", [("W4A16", 32), ("W8A16", 32)])
def test_quantized_head_of_a_tied_model_is_used_untied(tied, tmp_path, monkeypatch, caplog, scheme, group):
    """compressed-tensors with the LM head quantized too (ignore=[]) on a tie_word_embeddings model:
    the stored head is used, untied, with the warning, as transformers does."""
    from compressed_tensors import quantization

    config = quantization.QuantizationConfig
    with monkeypatch.context() as patch:            # the writer ignores lm_head; quantize it too
        patch.setattr(quantization, "QuantizationConfig", lambda config_groups, ignore: config(
            config_groups=config_groups, ignore=[]))
        folder = write_compressed_tensors(tied, tmp_path / scheme, scheme, group=group)
    assert "lm_head.weight_packed" in load_file(folder / "model.safetensors")
    hf = ct_reference(folder)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    with caplog.at_level(logging.WARNING):
        model = load_model(folder, "float32", quantization="none")
    assert "the stored head is used, untied" in caplog.text
    assert not model.config.tie_word_embeddings
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight.float(), atol=0, rtol=0)
    assert_logits_equal(model, hf)


def test_gptq_quantized_head_of_a_tied_model_is_used_untied(tied, tmp_path, caplog):
    """GPTQModel's lm_head=True on a tied model: lm_head.qweight is the head, dequantized or packed."""
    folder, truth = write_gptq(tied, tmp_path / "gptq", bits=4, group=32)
    sd = load_file(folder / "model.safetensors")
    head = load_file(tied / "model.safetensors")["model.embed_tokens.weight"].float()
    codes, scale, zero = minmax_codes(head, 4, 32, sym=True)
    g = torch.arange(head.shape[1]) // 32
    sd.update({"lm_head.qweight": _pack_k(codes, 4), "lm_head.qzeros": pack_fields(zero.t().long() - 1, 4),
               "lm_head.scales": scale.t().contiguous().half()})
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    out = tmp_path / "gptq-head"
    save_quantized(tied, out, sd, {**qcfg, "lm_head": True})
    want = (codes.float() - zero[:, g]) * scale[:, g]
    for quantization in ("none", None):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model = load_model(out, "float32", quantization=quantization)
        assert "the stored head is used, untied" in caplog.text
        w = model.lm_head.dequantize() if hasattr(model.lm_head, "dequantize") else model.lm_head.weight.float()
        torch.testing.assert_close(w, want, atol=0, rtol=0)        # packed: Q4_0 holds these codes exactly
    ref = hf_model(save_truth(tied, tmp_path / "ref", load_file(truth / "model.safetensors"), {"lm_head.weight": want}))
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight
    assert_logits_equal(load_model(out, "float32", quantization="none"), ref)


def test_autofp8_per_tensor_weight_scale(dense, tmp_path):
    """quant_method "fp8" as vLLM's Fp8Config / AutoFP8 serialize it: float8_e4m3fn weights with a
    per-tensor weight_scale (and a static input_scale, read past): w = weight * weight_scale."""
    sd, out, truth = load_file(dense / "model.safetensors"), {}, {}
    for name, w in sd.items():
        out[name] = w
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            s = w.abs().max() / 448
            out[name] = (w / s).to(torch.float8_e4m3fn)
            out[name[:-len("weight")] + "weight_scale"] = s.reshape(1).float()
            out[name[:-len("weight")] + "input_scale"] = torch.tensor([0.02])
            truth[name] = out[name].float() * s
    save_quantized(dense, tmp_path / "fp8", out, {"quant_method": "fp8", "activation_scheme": "static",
                                                  "ignored_layers": ["lm_head"]})
    ref = hf_model(save_truth(dense, tmp_path / "fp8", sd, truth))
    assert_logits_equal(load_model(tmp_path / "fp8", "float32"), ref)


def test_mxfp6_is_refused_by_name(dense, tmp_path):
    """MXFP6 (four E2M3 values in three bytes) is not read: the refusal names the format."""
    with pytest.raises(CheckpointError, match="compressed-tensors format 'mxfp6-pack-quantized' is not read"):
        load_model(write_compressed_tensors(dense, tmp_path / "mxfp6", "MXFP6A16"))


def test_awq_config_over_gptq_tensors_is_refused(dense, tmp_path, capsys):
    """GPTQ tensors under an AWQ config: one line naming the module, from the library and the
    command line."""
    gptq, _ = write_gptq(dense, tmp_path / "gptq", bits=4, group=32)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                  "zero_point": True}
    (gptq / "config.json").write_text(json.dumps(cfg))
    for quantization in ("none", None):
        with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.down_proj: AWQ tensors .* do not fit"):
            load_model(gptq, quantization=quantization)
    capsys.readouterr()
    code = main(["generate", "--model", str(gptq), "--max-tokens", "2", "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "do not fit AutoAWQ's GEMM layout" in err
