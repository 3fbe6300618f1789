"""Checkpoint folders as vLLM users bring them: attention biases (attention_bias: true) and
PyTorch pickles (pytorch_model.bin, single or sharded), each against transformers' own output."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.model import load_model

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 77]])
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(model, ids=IDS, n: int = 12) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def assert_matches_transformers(folder, ref) -> None:
    """Logits (the PyTorch forward) and greedy tokens (LLM: the C forward where it loads) equal
    transformers' on the same folder."""
    ours = load_model(folder, "float32")
    with torch.inference_mode():
        torch.testing.assert_close(ours(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)
    out = LLM(str(folder), dtype="float32").generate({"prompt_token_ids": IDS[0].tolist()}, GREEDY)
    assert out[0].outputs[0].token_ids == hf_greedy(ref)


# the families whose transformers code puts attention_bias on q, k, v and o_proj
@pytest.mark.parametrize("arch", ["llama", "granite", "smollm3", "olmoe"])
def test_attention_bias_on_q_k_v_and_o(tmp_path, arch):
    folder = make_checkpoint(tmp_path / "m", arch=arch, attention_bias=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():                 # transformers starts biases at zero: make them count
        for name, p in ref.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5 if "o_proj" not in name else 0.1)
    ref.save_pretrained(folder)
    assert_matches_transformers(folder, ref)
    assert load_model(folder).model.layers[0].self_attn.o_proj.bias is not None


def test_families_whose_transformers_code_ignores_attention_bias(tmp_path):
    """Mistral's transformers code has no attention biases whatever its config says."""
    folder = make_checkpoint(tmp_path / "m", arch="mistral")
    cfg = (folder / "config.json").read_text().replace('"attention_bias": false', '"attention_bias": true')
    (folder / "config.json").write_text(cfg if "attention_bias" in cfg else cfg.replace("{", '{"attention_bias": true,', 1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, "float32")
    assert ours.model.layers[0].self_attn.qkv_proj.bias is None
    with torch.inference_mode():
        torch.testing.assert_close(ours(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)
