"""Config fields transformers honours that specdec read differently (arch59):

- a sliding window as long as max_position_embeddings still hides slots once RoPE scaling
  (yarn, linear, dynamic) stretches the context past it: transformers keeps it there, so must we;
- Qwen2-MoE's qkv_bias=false: no q/k/v biases (transformers' Qwen2MoeAttention reads it).

Tiny checkpoints written by transformers, against its forward and greedy generate."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.model import load_model
from specdec.model.config import ModelConfig

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
PROMPT = (list(range(20, 33)) * 4)[:40]      # 40 tokens: well past the 16-token window


def _reference(folder, rope_scaling=None):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    if rope_scaling is not None:       # what --hf-overrides brings, as transformers 5 reads it
        cfg.rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_parameters["rope_theta"]}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32).eval()


def _hf_greedy(ref, prompt, n=20):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=9999, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(llm, prompt, n=20):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


@pytest.mark.parametrize("arch,extra", [
    ("mistral", {"rope_scaling": YARN}),
    ("mistral", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ("qwen2", {"rope_scaling": YARN, "use_sliding_window": True, "max_window_layers": 0}),
])
def test_window_as_long_as_max_positions_is_kept_when_scaling_stretches_the_context(tmp_path, arch, extra):
    folder = make_checkpoint(tmp_path / arch, arch=arch, vocab=512, sliding_window=16, max_position_embeddings=16,
                             **extra)
    ours = load_model(folder, "float32")
    assert (ours.config.sliding_window, ours.config.max_position_embeddings) == (16, 128)
    ref = _reference(folder)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        diff = (ours(ids).logits.reshape(len(PROMPT), -1) - ref(ids).logits[0]).abs().max().item()
    assert diff < 1e-4
    llm = LLM(str(folder), dtype="float32", num_speculative_tokens=0)
    assert _greedy(llm, PROMPT) == _hf_greedy(ref, PROMPT)


def test_window_kept_when_hf_overrides_bring_yarn(tmp_path):
    """The README's --hf-overrides recipe on a config whose window equals its context."""
    folder = make_checkpoint(tmp_path / "m", arch="mistral", vocab=512, sliding_window=16, max_position_embeddings=16)
    assert load_model(folder, "float32").config.sliding_window is None      # no scaling: it never hides a slot
    llm = LLM(str(folder), dtype="float32", num_speculative_tokens=0, hf_overrides={"rope_scaling": YARN})
    cfg = llm.target.config
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (16, 128)
    assert _greedy(llm, PROMPT) == _hf_greedy(_reference(folder, YARN), PROMPT)


def test_window_kept_under_dynamic_scaling_with_a_long_max_model_len(tmp_path):
    folder = make_checkpoint(tmp_path / "d", arch="mistral", vocab=512, sliding_window=16, max_position_embeddings=16,
                             rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    ours = load_model(folder, "float32", max_model_len=64)
    assert (ours.config.sliding_window, ours.config.max_position_embeddings) == (16, 64)
    prompt = (list(range(20, 37)) * 4)[:64]     # a whole-context forward: transformers' NTK base for 64 tokens
    ids = torch.tensor([prompt])
    with torch.no_grad():
        diff = (ours(ids).logits.reshape(64, -1) - _reference(folder)(ids).logits[0]).abs().max().item()
    assert diff < 1e-4


def test_windows_no_context_reaches_are_still_dropped():
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 512}
    assert ModelConfig.from_hf({**base, "sliding_window": 512}).sliding_window is None
    assert ModelConfig.from_hf({**base, "sliding_window": 4096, "rope_scaling": YARN}).sliding_window is None  # 128
    assert ModelConfig.from_hf({**base, "sliding_window": 4096,
                                "rope_scaling": {"rope_type": "linear", "factor": 4.0}}).sliding_window is None
    assert ModelConfig.from_hf({**base, "sliding_window": 1024,
                                "rope_scaling": {"rope_type": "linear", "factor": 4.0}}).sliding_window == 1024
    # Phi-3.5-mini's shape: a window twice its longest (longrope) context
    phi = {**base, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 1024,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
           "original_max_position_embeddings": 128}
    assert ModelConfig.from_hf(phi).sliding_window is None


def test_qwen2_moe_without_qkv_bias_matches_transformers(tmp_path):
    folder = make_checkpoint(tmp_path / "q", arch="qwen2_moe", vocab=512, qkv_bias=False)
    ours = load_model(folder, "float32")
    assert not ours.config.attention_bias
    ref = _reference(folder)
    assert ref.model.layers[0].self_attn.q_proj.bias is None
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        diff = (ours(ids).logits.reshape(len(PROMPT), -1) - ref(ids).logits[0]).abs().max().item()
    assert diff < 1e-4
    assert _greedy(LLM(str(folder), dtype="float32", num_speculative_tokens=0), PROMPT) == _hf_greedy(ref, PROMPT)
    # the setting survives config.json's round trip (--hf-overrides on a GGUF's config goes through it)
    assert not ours.config.configured(hf_overrides={"rope_theta": 20000.0}).attention_bias
    assert ModelConfig.from_hf(ours.config.replace(attention_bias=True).to_hf()).attention_bias   # the default: biases
