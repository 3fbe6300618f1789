"""Medusa heads as they are released: vLLM's `MedusaModel` folders (model_type "medusa":
blocks.{i}.layers.{j}, lm_heads.{i} or one original lm_head, an optional token_map for a
truncated vocabulary) and the Medusa authors' (medusa_num_heads in config.json,
medusa_lm_head.pt). Two heads trained here (reference forward written from the definition, Adam)
on a tiny target's greedy continuations, written in each layout. Checked: logits against the
reference, greedy output identical to plain decoding, the method read from the folder, what is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from conftest import greedy_continuations, make_checkpoint
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.model import CheckpointError, load_model
from specdec.model.heads import ResidualMedusaHeads, load_medusa_released

D, HEADS = 64, 2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("medusa-released") / "target", layers=4, hidden=D, seed=9)


def ref_heads(w: dict, h: torch.Tensor, lm_heads: list[str]) -> torch.Tensor:
    """[HEADS, T, V'] from features h [T, D]: head i = x + SiLU(W x + b), then its LM head."""
    out = []
    for i in range(HEADS):
        x = h + F.silu(h @ w[f"blocks.{i}.layers.0.weight"].T + w[f"blocks.{i}.layers.0.bias"])
        out.append(x @ w[lm_heads[i]].T)
    return torch.stack(out)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Head i (0-based) trained to predict token t + 2 + i from the target's final-norm feature of
    token t; written as vLLM's folder, as the authors' folder, and as vLLM's with a truncated
    vocabulary (the 64 tokens the continuations use most, token_map)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    prompts, seqs = greedy_continuations(hf)
    with torch.no_grad():
        feats = hf(seqs, output_hidden_states=True).hidden_states[-1]
    counts = torch.bincount(seqs.flatten(), minlength=V)
    token_map = counts.argsort(descending=True)[:64].sort().values
    index = torch.full((V,), -100)
    index[token_map] = torch.arange(64)
    torch.manual_seed(0)
    w = {}
    for i in range(HEADS):
        w[f"blocks.{i}.layers.0.weight"] = torch.randn(D, D) * 0.05
        w[f"blocks.{i}.layers.0.bias"] = torch.zeros(D)
        w[f"lm_heads.{i}.weight"] = hf.lm_head.weight.detach().clone()
        w[f"small.{i}.weight"] = hf.lm_head.weight.detach()[token_map].clone()
    params = [t.requires_grad_() for t in w.values()]
    opt = torch.optim.Adam(params, lr=3e-3)
    T = seqs.shape[1] - HEADS - 1
    for _ in range(150):
        full = ref_heads(w, feats[:, :T], [f"lm_heads.{i}.weight" for i in range(HEADS)])
        small = ref_heads(w, feats[:, :T], [f"small.{i}.weight" for i in range(HEADS)])
        loss = 0
        for i in range(HEADS):
            labels = seqs[:, 2 + i:2 + i + T]
            loss = loss + F.cross_entropy(full[i].reshape(-1, V), labels.reshape(-1))
            loss = loss + F.cross_entropy(small[i].reshape(-1, 64), index[labels].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = {k: t.detach().contiguous() for k, t in w.items()}
    root = tmp_path_factory.mktemp("medusa-folders")
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": D, "num_heads": HEADS,
           "num_hidden_layers": 1, "vocab_size": V, "truncated_vocab_size": V, "medusa_fc_bias": True}
    vllm_dir, authors, truncated = root / "vllm", root / "authors", root / "truncated"
    for folder in (vllm_dir, authors, truncated):
        folder.mkdir()
    blocks = {k: v for k, v in w.items() if k.startswith("blocks.")}
    (vllm_dir / "config.json").write_text(json.dumps(cfg))
    save_file({**blocks, **{f"lm_heads.{i}.weight": w[f"lm_heads.{i}.weight"] for i in range(HEADS)}},
              str(vllm_dir / "model.safetensors"))
    (truncated / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 64}))
    save_file({**blocks, **{f"lm_heads.{i}.weight": w[f"small.{i}.weight"] for i in range(HEADS)},
               "token_map": token_map}, str(truncated / "model.safetensors"))
    (authors / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS, "medusa_num_layers": 1,
                                                     "base_model_name_or_path": "target"}))
    authors_sd = {}
    for i in range(HEADS):
        authors_sd[f"{i}.0.linear.weight"] = w[f"blocks.{i}.layers.0.weight"]
        authors_sd[f"{i}.0.linear.bias"] = w[f"blocks.{i}.layers.0.bias"]
        authors_sd[f"{i}.1.weight"] = w[f"lm_heads.{i}.weight"]
    torch.save(authors_sd, authors / "medusa_lm_head.pt")
    return {"weights": w, "hf": hf, "prompts": prompts.tolist(), "token_map": token_map,
            "vllm": str(vllm_dir), "authors": str(authors), "truncated": str(truncated)}


@pytest.mark.parametrize("layout", ["vllm", "authors", "truncated"])
def test_logits_equal_the_reference(target, heads, layout):
    model = load_model(target, "float32")
    ours = load_medusa_released(heads[layout], model)
    assert isinstance(ours, ResidualMedusaHeads) and ours.num_heads == HEADS
    lm = "small" if layout == "truncated" else "lm_heads"
    expected_vocab = heads["token_map"] if layout == "truncated" else torch.arange(model.config.vocab_size)
    assert torch.equal(ours.draft_vocab, expected_vocab)
    h = torch.randn(5, D)
    with torch.no_grad():
        ref = ref_heads(heads["weights"], h, [f"{lm}.{i}.weight" for i in range(HEADS)])
        torch.testing.assert_close(ours(h), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["vllm", "authors", "truncated"])
def test_greedy_speculation_equals_plain(target, heads, layout):
    """Four requests batched, trees of 4 nodes: every output identical to plain decoding, and
    the trained heads' drafts accepted (the features reach them right)."""
    prompts = [{"prompt_token_ids": p} for p in heads["prompts"][:4]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", max_num_seqs=4,
              speculative_config={"method": "medusa", "model": heads[layout], "num_speculative_tokens": 4})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0.2 * sum(o.stats.draft_tokens for o in outs)


def test_method_read_from_the_folder(heads):
    for layout in ("vllm", "authors"):
        assert SpeculativeConfig.from_dict({"model": heads[layout]}).method == "medusa"


def test_clear_errors(target, heads, tmp_path):
    model = load_model(target, "float32")
    bad = tmp_path / "wide"
    bad.mkdir()
    src = Path(heads["vllm"])
    cfg = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * D}))
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="hidden size 128, the target has 64"):
        load_medusa_released(bad, model)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_heads": 3}))
    with pytest.raises(CheckpointError, match="blocks.2.layers.0.bias missing"):
        load_medusa_released(bad, model)
    with pytest.raises(CheckpointError, match="not a Medusa heads folder"):
        load_medusa_released(target, model)
