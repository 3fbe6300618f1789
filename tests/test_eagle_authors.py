"""EAGLE heads as their authors ship them (yuhuili/EAGLE-*; vLLM's `"method": "eagle"` loads these):
a llama config.json and pytorch_model.bin with fc over [embedding ; feature] (with or without a
bias), one llama layer without its input_layernorm, no final norm, and the target's own LM head.
A tiny head is trained here with a reference forward written from that definition on a tiny
target's greedy continuations. Checked: logits and states against the reference, whole-step and
through the paged cache in chunks, on forward.c and on PyTorch; the first greedy chain (forward.c's
eagle_chain); greedy output identical to plain decoding (chains and EAGLE-2 trees, batched); the
method read from the folder; what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from conftest import greedy_continuations, make_checkpoint
from specdec import LLM, SamplingParams, kernels
from specdec.config import SpeculativeConfig
from specdec.model import CheckpointError, load_model
from specdec.model.heads import is_eagle_authors, load_eagle_authors
from specdec.proposers.eagle import EagleProposer
from arch_checks import without_kernels
from test_eagle3 import D, EPS, FF, H, HD, KV, THETA, paged_head, ref_block


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("eagle-authors") / "target", layers=4, hidden=D, seed=7)


def ref_head(w: dict, lm_head: torch.Tensor, feats: torch.Tensor, embeds: torch.Tensor):
    """The authors' head over one sequence of T rows (causal): feats [T, D] the target's
    final-norm features of tokens t (or the head's own states), embeds [T, D] the embeddings of
    tokens t + 1. Returns (logits from the target's LM head [T, V], the new states [T, D])."""
    x = torch.cat([embeds, feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    h = ref_block(w, "layers.0.", x, x)          # no input norm: the block reads x, its residual is x
    return h @ lm_head.T, h


def config(vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": FF,
            "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": EPS,
            "rope_theta": THETA, "max_position_embeddings": 256, "hidden_act": "silu", "vocab_size": vocab,
            "bias": True, "torch_dtype": "float32"}


def write(folder, w: dict, cfg: dict) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(w, folder / "pytorch_model.bin")
    return str(folder)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A head trained (reference forward, 150 Adam steps) to predict token t + 2 from the target's
    feature of token t and the embedding of token t + 1, on the target's greedy continuations;
    written with and without fc.bias, with the target's embeddings beside it as the authors save."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    prompts, seqs = greedy_continuations(hf)
    with torch.no_grad():
        feats = hf(seqs, output_hidden_states=True).hidden_states[-1]     # after the final norm
        embeds = hf.model.embed_tokens(seqs)
    lm_head = hf.lm_head.weight.detach()
    torch.manual_seed(0)
    w = {"fc.weight": torch.randn(D, 2 * D) * 0.05, "fc.bias": torch.zeros(D),
         "layers.0.post_attention_layernorm.weight": torch.ones(D)}
    for name, shape in (("q_proj", (H * HD, D)), ("k_proj", (KV * HD, D)), ("v_proj", (KV * HD, D)),
                        ("o_proj", (D, H * HD))):
        w[f"layers.0.self_attn.{name}.weight"] = torch.randn(shape) * 0.05
    for name, shape in (("gate_proj", (FF, D)), ("up_proj", (FF, D)), ("down_proj", (D, FF))):
        w[f"layers.0.mlp.{name}.weight"] = torch.randn(shape) * 0.05
    params = [t.requires_grad_() for t in w.values()]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(150):
        loss = 0
        for b in range(seqs.shape[0]):
            logits, _ = ref_head(w, lm_head, feats[b, :-2], embeds[b, 1:-1])
            loss = loss + F.cross_entropy(logits, seqs[b, 2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = {k: t.detach() for k, t in w.items()}
    root = tmp_path_factory.mktemp("eagle-authors-heads")
    saved = {**w, "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone()}
    no_bias = {k: v for k, v in w.items() if k != "fc.bias"}
    return {"weights": w, "lm_head": lm_head, "hf": hf, "prompts": prompts.tolist(),
            "bias": write(root / "bias", saved, config(V)),
            "no_bias": write(root / "no-bias", no_bias, {**config(V), "bias": False})}


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_head_matches_the_reference(target, head, monkeypatch, c_path):
    """Logits and states through the paged cache in chunks equal the reference's; forward.c
    runs the head whole (no input norm in its layer, no final norm) where the kernels load."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    model = load_model(target, "float32")
    ours = load_eagle_authors(head["bias"], model)
    assert ours.fc.bias is not None and ours.embeds_first and not ours.decoder.final_norm
    ids = torch.randint(2, model.config.vocab_size, (25,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = head["hf"](ids[None], output_hidden_states=True).hidden_states[-1][0]
        feats, embeds = hs[:-1], head["hf"].model.embed_tokens(ids[1:])
        ref_logits, ref_h = ref_head(head["weights"], head["lm_head"], feats, embeds)
        logits, hidden, view = paged_head(ours, feats, embeds, ((0, 9), (9, 10), (10, 24)))
    assert (view is not None) == c_path
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_h, atol=1e-4, rtol=1e-4)


def test_first_greedy_chain_equals_the_reference(target, head, monkeypatch):
    """The proposer's first chain after a prompt (K = 4): the prompt's pairs, then each draft's
    own state and embedding appended, argmax of the target's LM head each time; drafted by
    forward.c's eagle_chain where the kernels load."""
    drafts, c_chains = [], []
    propose = EagleProposer.propose

    def spy(self, items):
        out = propose(self, items)
        drafts.append(out[0].tokens.tolist())
        c_chains.append(self.c_chain is not None)
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "eagle", "model": head["no_bias"], "num_speculative_tokens": 4})
    prompt = [5, 17, 33, 8, 61, 12, 40]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    w = {k: v for k, v in head["weights"].items() if k != "fc.bias"}
    hf = head["hf"]
    with torch.no_grad():
        ids = torch.tensor(prompt)
        h = hf(ids[None, :-1], output_hidden_states=True).hidden_states[-1][0]
        embeds = hf.model.embed_tokens(ids[1:])
        chain = []
        for _ in range(4):
            logits, states = ref_head(w, head["lm_head"], h, embeds)
            chain.append(int(logits[-1].argmax()))
            h = torch.cat([h, states[-1:]])
            embeds = torch.cat([embeds, hf.model.embed_tokens(torch.tensor(chain[-1:]))])
    assert drafts[0] == chain
    assert c_chains[0] == (kernels.load() is not None)


@pytest.mark.parametrize("topk", [1, 2])
def test_greedy_speculation_equals_plain(target, head, topk):
    """Chains (vLLM's default for these heads) and EAGLE-2 trees, four requests batched: every
    output identical to plain decoding; the trained head's first drafts are often accepted."""
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:4]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", max_num_seqs=4,
              speculative_config={"method": "eagle", "model": head["bias"], "num_speculative_tokens": 3, "topk": topk})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0.3 * sum(o.stats.draft_tokens for o in outs)


def test_method_read_from_the_folder(target, head):
    assert SpeculativeConfig.from_dict({"model": head["bias"]}).method == "eagle"
    assert is_eagle_authors(head["no_bias"]) and not is_eagle_authors(target)
    assert SpeculativeConfig.from_dict({"model": str(target)}).method == "draft_model"


def test_clear_errors(target, head, tmp_path):
    model = load_model(target, "float32")
    V = model.config.vocab_size
    w = head["weights"]
    bad = write(tmp_path / "wide", w, {**config(V), "hidden_size": 2 * D})
    with pytest.raises(CheckpointError, match="hidden size 128, the target has 64"):
        load_eagle_authors(bad, model)
    bad = write(tmp_path / "no-o", {k: v for k, v in w.items() if "o_proj" not in k}, config(V))
    with pytest.raises(CheckpointError, match="o_proj.weight missing"):
        load_eagle_authors(bad, model)
    bad = write(tmp_path / "hass", w, {**config(V), "add_para_norm": True})
    with pytest.raises(CheckpointError, match="HASS"):
        load_eagle_authors(bad, model)


def test_qkv_bias(target, head, tmp_path, monkeypatch):
    """A head for a Qwen2 target carries q / k / v biases: they load (fused as the layer holds
    them), change the logits, and forward.c's logits through the paged cache equal PyTorch's."""
    w = dict(head["weights"])
    g = torch.Generator().manual_seed(4)
    for n, rows in (("q", H * HD), ("k", KV * HD), ("v", KV * HD)):
        w[f"layers.0.self_attn.{n}_proj.bias"] = torch.randn(rows, generator=g) * 0.5
    folder = write(tmp_path / "qwen2", w, config(head["hf"].config.vocab_size))
    model = load_model(target, "float32")
    ids = torch.randint(2, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = head["hf"](ids[None], output_hidden_states=True).hidden_states[-1][0][:-1]
        embeds = head["hf"].model.embed_tokens(ids[1:])

        def logits(path):
            ours = load_eagle_authors(path, model)
            return paged_head(ours, feats, embeds, ((0, 11),))[0], ours

        c, ours = logits(folder)
        bias = ours.decoder.model.layers[0].self_attn.qkv_proj.bias
        torch.testing.assert_close(bias, torch.cat([w[f"layers.0.self_attn.{n}_proj.bias"] for n in "qkv"]))
        assert (c - logits(head["bias"])[0]).abs().max() > 1e-3
        monkeypatch.setattr(kernels, "load", lambda *a: None)
        torch.testing.assert_close(logits(folder)[0], c, atol=1e-4, rtol=1e-4)


def test_a_sharded_head_folder(target, head, tmp_path):
    """The same head saved in shards with their index (pytorch_model-0000i-of-0000N.bin and
    pytorch_model.bin.index.json) is an EAGLE head and drafts as the single file does (it was
    taken for a draft model: 'weights missing from the checkpoint: lm_head.weight')."""
    import shutil
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(Path(head["bias"]) / "config.json", sharded / "config.json")
    w = torch.load(Path(head["bias"]) / "pytorch_model.bin", weights_only=True)
    names = sorted(w)
    parts = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in parts.items():
        torch.save({k: w[k] for k in keys}, sharded / file)
    (sharded / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: file for file, keys in parts.items() for k in keys}}))
    assert is_eagle_authors(sharded) and SpeculativeConfig.from_dict({"model": str(sharded)}).method == "eagle"
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = [LLM(model=target, dtype="float32", speculative_config={"method": "eagle", "model": str(folder),
                                                                   "num_speculative_tokens": 3}).generate(prompts, params)
            for folder in (head["bias"], sharded)]
    assert [[o.outputs[0].token_ids for o in outs] for outs in runs][0] == [o.outputs[0].token_ids for o in runs[1]]
    assert [o.stats.accepted_tokens for o in runs[0]] == [o.stats.accepted_tokens for o in runs[1]]


@pytest.mark.tp
def test_tensor_parallel_drafts_with_a_tied_head_and_refuses_an_untied_one(target, head, tmp_path):
    """Under tensor parallelism the target's LM head is split over the ranks and only rank 0 drafts:
    a tied target's embedding (whole on every rank) is the head the drafter shares there, greedy
    output identical to plain decoding at TP=1; an untied target's head is refused at load in one
    line (forward.c's chain failed on the split head's missing packed weights, and the PyTorch path
    waited in a collective the other ranks never joined until the rank timeout)."""
    tied = make_checkpoint(tmp_path / "tied", layers=4, hidden=D, seed=7, tie_word_embeddings=True)
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:3]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=tied, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    spec = {"method": "eagle", "model": head["bias"], "num_speculative_tokens": 3}
    llm = LLM(model=tied, dtype="float32", tensor_parallel_size=2, speculative_config=spec, distributed_timeout_s=60)
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.draft_tokens for o in outs) > 0
    with pytest.raises(CheckpointError, match="shares the target's LM head, which is split over tensor-parallel ranks"):
        LLM(model=target, dtype="float32", tensor_parallel_size=2, speculative_config=spec)
