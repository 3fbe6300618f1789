"""Qwen3 (dense): per-head q/k RMSNorm before RoPE, no q/k/v bias, and a head_dim of its own.

A tiny Qwen3ForCausalLM written by transformers (hidden 64, 4 heads, 2 KV heads, head_dim 32:
q_proj is 128 wide, twice the hidden size; q_norm / k_norm weights randomised so that they
count) as a Hugging Face folder and as GGUF files (F32, and Q8_0 everywhere), against
transformers' own forward and generate, speculative decoding against plain decoding on both
forward paths, and a batch against solo runs. (test_kv.py runs its bit-identity tests of the C
forward on this architecture too.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import quants

from conftest import make_checkpoint, noisy_head_copy
from gguf_helpers import T, write_gguf
from specdec import LLM, kernels
from specdec.model import CheckpointError, ForwardBatch, load_model, save_model
from test_heads import _heads_dirs, check_unrolled_is_the_serving_chain
from arch_checks import (GREEDY, IDS, NO_KERNELS, PROMPTS, cached_logits, reference,  # noqa: F401 (tests run here)
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_speculative_greedy_equals_plain, without_kernels)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """hf: the target folder; near: the target with noise on its LM head (a draft that agrees
    often, not always); f32 / q8_0: GGUF files of the target; heads: untrained Medusa / EAGLE."""
    root = tmp_path_factory.mktemp("qwen3")
    hf = make_checkpoint(root / "hf", arch="qwen3", head_dim=32)
    near = noisy_head_copy(hf, root / "near")
    return {"hf": hf, "near": near, "f32": write_gguf(hf, root / "f32.gguf", pre="qwen2"),
            "q8_0": write_gguf(hf, root / "q8" / "model.gguf", lambda name, ndim: T.Q8_0, pre="qwen2"),
            **_heads_dirs(hf, root)}


def test_config_reads_head_dim_and_qk_norm(files, tmp_path):
    model = load_model(files["hf"], "float32")
    cfg = model.config
    assert (cfg.model_type, cfg.qk_norm, cfg.attention_bias, cfg.head_dim) == ("qwen3", True, False, 32)
    assert cfg.num_attention_heads * cfg.head_dim == 2 * cfg.hidden_size
    assert cfg.num_parameters() == sum(p.numel() for p in reference(files["hf"]).parameters())
    g = load_model(files["f32"]).config
    assert (g.model_type, g.qk_norm, g.attention_bias, g.head_dim) == ("qwen3", True, False, 32)
    assert g.rms_norm_eps == np.float32(1e-6)      # GGUF keeps it as a float32
    save_model(model, tmp_path / "saved", torch.float32)     # a Qwen3ForCausalLM folder again
    assert torch.equal(load_model(tmp_path / "saved", "float32")(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(files, tmp_path, monkeypatch, c_path, tied):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    folder = make_checkpoint(tmp_path / "m", arch="qwen3", head_dim=32, tokenizer_from=files["hf"],
                             tie_word_embeddings=True) if tied else files["hf"]
    without_kernels(monkeypatch, c_path)
    ours = load_model(folder, "float32")
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(folder)(tokens).logits
        full = ours(tokens).logits
        chunks = cached_logits(ours, tokens[0], [(0, 17), (17, 18), (18, 40)])
        assert (ours.c_view(ours.new_cache(1, 8)) is not None) == c_path
    assert (full - ref).abs().max() < 1e-4
    assert (chunks - ref[0]).abs().max() < 1e-4


def test_q8_0_gguf_equals_its_dequantized_weights(files):
    """Dequantized at load: transformers' model with the same Q8_0-rounded matrices (gguf-py's
    dequantizer), to fp32 rounding. Packed: the int8-activation kernels, close to it."""
    hf = reference(files["hf"])
    rounded = {}
    for name, p in hf.named_parameters():
        if p.ndim == 2:
            w = p.detach().numpy().astype(np.float32)
            rounded[name] = torch.from_numpy(quants.dequantize(quants.quantize(w, T.Q8_0), T.Q8_0).reshape(w.shape))
    ref = reference(files["hf"], **rounded)
    with torch.no_grad():
        expected = ref(IDS).logits[0]
        dense = load_model(files["q8_0"], quantization="none")(IDS).logits[0]
        packed = load_model(files["q8_0"], quantization="gguf")(IDS).logits[0]
    torch.testing.assert_close(dense, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    assert ((packed - expected).norm() / expected.norm()).item() < 0.05
    assert (packed.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.8


def test_eagle_head_trains_on_the_chain_it_serves(files):
    """A head of a Qwen3 target copies its per-head q/k norms: eagle_unroll computes them too."""
    assert load_model(files["hf"], "float32").config.qk_norm
    check_unrolled_is_the_serving_chain(files["hf"], files["eagle"])


@NO_KERNELS
def test_packed_q8_0_speculative_and_batch_equal_plain_solo(files):
    """The Q8_0 file kept packed (forward.c's quantized kernels), the F32 file as its draft (it
    agrees often, not always): greedy speculation in a batch of 4 equals plain decoding alone."""
    ids = [IDS[0, :n].tolist() for n in (3, 12, 7, 9)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    solo = LLM(str(files["q8_0"]), quantization="gguf", num_speculative_tokens=0, max_num_seqs=1)
    plain = [o.outputs[0].token_ids for o in solo.generate(prompts, GREEDY)]
    batch = LLM(str(files["q8_0"]), quantization="gguf", num_speculative_tokens=0, max_num_seqs=4,
                max_num_batched_tokens=8)
    assert [o.outputs[0].token_ids for o in batch.generate(prompts, GREEDY)] == plain
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                 {"method": "draft_model", "model": str(files["f32"]), "num_speculative_tokens": 3}):
        llm = LLM(str(files["q8_0"]), quantization="gguf", speculative_config=spec, max_num_seqs=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain, spec["method"]


@NO_KERNELS
def test_batch_rows_are_bit_identical_to_solo(files):
    """The C forward: each prompt's logits alone, and among the others in one flat batch."""
    model = load_model(files["hf"], "float32")
    seqs = [IDS[0, :n] for n in (12, 3, 7)]
    alone = [cached_logits(model, s, [(0, len(s))]) for s in seqs]
    cache = model.new_cache(batch=3)
    together = model(torch.cat(seqs), cache, ForwardBatch.build(cache, [0, 1, 2], [len(s) for s in seqs], [0, 0, 0]))
    assert torch.equal(together.logits, torch.cat(alone))


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    """Per-head norms are local to a rank (one weight shared by the heads): TP=2 == TP=1."""
    kw = dict(model=files["hf"], dtype="float32", num_speculative_tokens=0, max_model_len=96)
    tp1, tp2 = LLM(**kw), LLM(**kw, tensor_parallel_size=2)
    try:
        ids = tp1.tokenizer.encode(PROMPTS[1])
        a, b = (cached_logits(m.target, torch.tensor(ids), [(0, len(ids))]) for m in (tp1, tp2))
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())
        assert [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, GREEDY)] == \
            [o.outputs[0].token_ids for o in tp1.generate(PROMPTS, GREEDY)]
    finally:
        tp2.shutdown()


def test_unsupported_qwen3_variants_are_one_line_errors(files, tmp_path):
    for field, message in (("attention_bias", "attention_bias"),):
        folder = tmp_path / field
        folder.mkdir()
        for f in files["hf"].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, field: True}))
        with pytest.raises(CheckpointError, match=message):
            load_model(folder)
    bad = write_gguf(files["hf"], tmp_path / "bad.gguf", skip={"blk.1.attn_k_norm.weight"})
    with pytest.raises(CheckpointError, match="tensor blk.1.attn_k_norm.weight is missing"):
        load_model(bad)
