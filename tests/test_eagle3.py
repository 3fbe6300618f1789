"""EAGLE-3 heads in the folders vLLM and the EAGLE authors use (`{"method": "eagle3"}`).

A tiny 8-layer Llama target written by transformers; an EAGLE-3 head trained here for a few
seconds on the target's own greedy continuations by a reference written from the method's
definition in plain torch (features from transformers' hidden_states entering layers 2, 4 and
5, fused by fc; one layer over [input_layernorm(embed) ; hidden_norm(h)]; norm; LM head over a
draft vocabulary with d2t), saved in the authors' layout (midlayer.*, pytorch_model.bin) and in
the speculators library's. Checked: the target's captured features against transformers', the
head's logits and states against the reference (whole sequence and through the paged cache),
the proposer's first greedy chain against the reference's, greedy speculation identical to
plain decoding (chains and trees, batched, both forward paths), acceptance, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from conftest import greedy_continuations, make_checkpoint
from specdec import LLM, SamplingParams, kernels
from specdec.model import CheckpointError, ForwardBatch, load_model
from specdec.model.eagle3 import load_eagle3
from specdec.proposers.eagle import EagleProposer
from arch_checks import NO_KERNELS, without_kernels
from test_engine import exact_first_two, first_two_tokens, total_variation

LAYERS = (2, 4, 5)        # vLLM's default for 8 layers: 2, 8 // 2, 8 - 3
D, H, KV, HD, FF, EPS, THETA = 64, 4, 2, 16, 128, 1e-5, 10000.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("eagle3") / "target", layers=8, hidden=D, seed=3)


def features(hf, ids: torch.Tensor) -> torch.Tensor:
    """[T, 3D]: transformers' hidden states entering layers 2, 4, 5 (hidden_states[i] is layer i's input)."""
    hs = hf(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in LAYERS], -1)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, pos):
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
    return x * cos + half * sin


def ref_block(w: dict, p: str, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One llama layer (weights under prefix p) over T rows: causal attention with RoPE over x
    added to the residual h, then its SwiGLU MLP behind post_attention_layernorm."""
    T = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, H, HD)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, HD)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, HD)
    pos = torch.arange(T)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h = h + att.transpose(0, 1).reshape(T, H * HD) @ w[p + "self_attn.o_proj.weight"].T
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    return h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T


def ref_head(w: dict, h: torch.Tensor, embeds: torch.Tensor):
    """The method's definition over one sequence of T rows (causal): h [T, D] the rows' states
    (fc of the target's features, or the head's own), embeds [T, D] of the next tokens.
    Returns (logits over the draft vocabulary [T, V'], the new states [T, D])."""
    hn = rms(h, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), hn], -1)
    h = ref_block(w, "midlayer.", x, h)
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T, h


def paged_head(head, feats: torch.Tensor, embeds: torch.Tensor, chunks):
    """A drafter head (EAGLE, EAGLE-3) fed one sequence's (feature, next-token embedding) pairs
    through its own paged cache in chunks [(a, b)]: (logits, states, the decoder's C view or None)."""
    cache = head.decoder.new_cache(batch=1)
    parts = []
    for a, b in chunks:
        parts.append(head(feats[a:b], embeds[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])))
        cache.set_length(0, b)
    return torch.cat([p.logits for p in parts]), torch.cat([p.hidden for p in parts]), head.decoder.c_view(cache)


def config(vocab: int, draft: int) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
            "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": 1,
            "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 256, "hidden_act": "silu",
            "vocab_size": vocab, "draft_vocab_size": draft, "target_hidden_size": D, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """An EAGLE-3 head trained (reference forward, 120 Adam steps) to predict token t + 2 from
    the target's features of token t and the embedding of token t + 1, on the target's greedy
    continuations; its draft vocabulary: the 64 tokens those continuations use most."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    prompts, seqs = greedy_continuations(hf)
    with torch.no_grad():
        feats = torch.stack([features(hf, s) for s in seqs])
        embeds = hf.model.embed_tokens(seqs)
    counts = torch.bincount(seqs.flatten(), minlength=V)
    vocab = counts.argsort(descending=True)[:64].sort().values
    d2t = vocab - torch.arange(64)
    index = torch.full((V,), -100)
    index[vocab] = torch.arange(64)
    torch.manual_seed(0)
    w = {"fc.weight": torch.randn(D, 3 * D) * 0.05, "norm.weight": torch.ones(D),
         "lm_head.weight": hf.lm_head.weight[vocab].detach().clone(), "d2t": d2t, "t2d": torch.zeros(V, dtype=torch.bool)}
    w["t2d"][vocab] = True
    for name, shape in (("q_proj", (H * HD, 2 * D)), ("k_proj", (KV * HD, 2 * D)), ("v_proj", (KV * HD, 2 * D)),
                        ("o_proj", (D, H * HD))):
        w[f"midlayer.self_attn.{name}.weight"] = torch.randn(shape) * 0.05
    for name, shape in (("gate_proj", (FF, D)), ("up_proj", (FF, D)), ("down_proj", (D, FF))):
        w[f"midlayer.mlp.{name}.weight"] = torch.randn(shape) * 0.05
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{name}.weight"] = torch.ones(D)
    params = [t.requires_grad_() for k, t in w.items() if t.is_floating_point()]
    opt = torch.optim.Adam(params, lr=3e-3)
    labels = index[seqs[:, 2:]]                   # row t (pair: features t, token t + 1) predicts t + 2
    for _ in range(120):
        loss = 0
        for b in range(seqs.shape[0]):
            logits, _ = ref_head(w, feats[b, :-2] @ w["fc.weight"].T, embeds[b, 1:-1])
            loss = loss + F.cross_entropy(logits, labels[b], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = {k: t.detach() for k, t in w.items()}
    root = tmp_path_factory.mktemp("eagle3-heads")
    authors = root / "authors"
    authors.mkdir()
    (authors / "config.json").write_text(json.dumps(config(V, 64)))
    torch.save(w, authors / "pytorch_model.bin")
    spec = root / "speculators"                   # the speculators library's layout of the same weights
    spec.mkdir()
    layer = {k: v for k, v in config(V, 64).items() if k not in ("architectures", "draft_vocab_size",
                                                                   "target_hidden_size")}
    (spec / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"],
                                                  "speculators_model_type": "eagle3", "draft_vocab_size": 64,
                                                  "norm_before_residual": False, "transformer_layer_config": layer}))
    save_file({k.replace("midlayer.", "layers.0."): v.contiguous() for k, v in w.items()},
              str(spec / "model.safetensors"))
    return {"weights": w, "authors": authors, "speculators": spec, "hf": hf, "vocab": vocab, "prompts": prompts.tolist()}


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_target_features_are_the_inputs_of_layers_2_4_5(target, head, monkeypatch, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    model = load_model(target, "float32")
    ids = torch.randint(2, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = features(head["hf"], ids)
        cache, parts = model.new_cache(batch=1), []
        for a, b in ((0, 11), (11, 12), (12, 30)):
            parts.append(model(ids[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a]), hidden=LAYERS).hidden)
            cache.set_length(0, b)
        got = torch.cat(parts)
        assert got.shape == (30, 3 * D)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids[None], hidden=LAYERS).hidden[0], want, atol=1e-4, rtol=1e-4)
        # layer 8 of 8: the stream after the last layer, which the final norm turns into transformers' last state
        cache = model.new_cache(batch=1)
        last = model(ids, cache, ForwardBatch.build(cache, [0], [30], [0]), hidden=(8,)).hidden
        hs = head["hf"](ids[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(model.model.norm(last), hs[8][0], atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="entering layers \\(2, 9\\)"):
            model(ids[None], hidden=(2, 9))


@pytest.mark.parametrize("layout", ["authors", "speculators"])
@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_head_matches_the_reference(target, head, monkeypatch, layout, c_path):
    """Logits and states over a sequence of target features, whole and through the paged cache
    in chunks, equal the reference's; the draft vocabulary is arange + d2t."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    model = load_model(target, "float32")
    ours = load_eagle3(head[layout], model)
    assert ours.feature_layers == LAYERS and torch.equal(ours.draft_vocab, head["vocab"])
    w, hf = head["weights"], head["hf"]
    ids = torch.randint(2, model.config.vocab_size, (25,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats, embeds = features(hf, ids)[:-1], hf.model.embed_tokens(ids[1:])
        ref_logits, ref_h = ref_head(w, feats @ w["fc.weight"].T, embeds)
        whole = ours(feats[None], embeds[None])
        torch.testing.assert_close(whole.logits[0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(whole.hidden[0], ref_h, atol=1e-4, rtol=1e-4)
        logits, hidden, view = paged_head(ours, feats, embeds, ((0, 9), (9, 10), (10, 24)))
        assert (view is not None) == c_path      # forward.c runs the head's layer whole
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden, ref_h, atol=1e-4, rtol=1e-4)


@NO_KERNELS
def test_norm_before_residual_on_forward_c(target, head, tmp_path, monkeypatch):
    """A speculators head with norm_before_residual (its residual is hidden_norm(h)): forward.c's
    logits and states through the paged cache equal the PyTorch path's, and differ from the
    same weights without the flag."""
    import shutil
    folder = tmp_path / "nbr"
    shutil.copytree(head["speculators"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    model = load_model(target, "float32")
    ids = torch.randint(2, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats, embeds = features(head["hf"], ids)[:-1], head["hf"].model.embed_tokens(ids[1:])

        def run(ours):
            return paged_head(ours, feats, embeds, ((0, 7), (7, 15)))

        c_logits, c_hidden, view = run(load_eagle3(folder, model))
        assert view is not None
        plain_logits = run(load_eagle3(head["speculators"], model))[0]
        assert (plain_logits - c_logits).abs().max() > 1e-3
        monkeypatch.setattr(kernels, "load", lambda *a: None)
        t_logits, t_hidden, view = run(load_eagle3(folder, model))
        assert view is None
    torch.testing.assert_close(c_logits, t_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c_hidden, t_hidden, atol=1e-4, rtol=1e-4)


def test_first_greedy_chain_equals_the_reference(target, head, monkeypatch):
    """The proposer's first drafts after a prompt (K = 4, a chain) are the reference's: the
    prompt's pairs (features of token j, token j + 1; the target's cache holds all but the
    prompt's last token when the first step drafts), then each draft's own state and embedding
    appended, argmax through d2t each time. Drafted in one C call (forward.c's eagle_chain) where
    the kernels load."""
    drafts, c_chains = [], []
    propose = EagleProposer.propose

    def spy(self, items):
        out = propose(self, items)
        drafts.append(out[0].tokens.tolist())
        c_chains.append(self.c_chain)
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "eagle3", "model": str(head["authors"]), "num_speculative_tokens": 4})
    prompt = [5, 17, 33, 8, 61, 12, 40]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    w, hf, vocab = head["weights"], head["hf"], head["vocab"]
    with torch.no_grad():
        ids = torch.tensor(prompt)
        h = features(hf, ids[:-1]) @ w["fc.weight"].T
        embeds = hf.model.embed_tokens(ids[1:])
        chain = []
        for _ in range(4):
            logits, states = ref_head(w, h, embeds)
            tok = int(vocab[logits[-1].argmax()])
            chain.append(tok)
            h = torch.cat([h, states[-1:]])
            embeds = torch.cat([embeds, hf.model.embed_tokens(torch.tensor([tok]))])
    assert drafts[0] == chain
    assert (c_chains[0] is not None) == (kernels.load() is not None)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
@pytest.mark.parametrize("topk", [1, 2])
def test_greedy_speculation_equals_plain(target, head, monkeypatch, c_path, topk):
    """Chains (vLLM's default) and EAGLE-2 trees, four requests batched: every output identical
    to plain decoding; the trained head's drafts are accepted often."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    # four of the training prompts (the tiny head generalises little): wrong features would be rejected
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:4]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": str(head["authors"]), "num_speculative_tokens": 4,
                                  "topk": topk})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_trained_head_is_accepted(target, head):
    """One draft a step (what the head was trained for; deeper drafts start from its own states,
    which this short training never saw): most are accepted, so the features reach it right."""
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:8]]
    llm = LLM(model=target, dtype="float32", max_num_seqs=8,
              speculative_config={"method": "eagle3", "model": str(head["authors"]), "num_speculative_tokens": 1})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    accepted, drafted = (sum(getattr(o.stats, f) for o in outs) for f in ("accepted_tokens", "draft_tokens"))
    assert accepted > 0.6 * drafted, (accepted, drafted)


def test_monte_carlo_sampling_matches_target(target, head):
    """Seeded Monte Carlo over two-token sequences through the whole engine (test_heads' check)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "eagle3", "model": str(head["authors"]), "num_speculative_tokens": 3})
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)
    assert total_variation(first_two_tokens(llm, prompt, params, n), exact, n) < 0.05


def test_clear_errors(target, head, tmp_path):
    model = load_model(target, "float32")
    bad, V = tmp_path / "bad", model.config.vocab_size
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config(V, 64), "target_hidden_size": 128}))
    torch.save(head["weights"], bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="trained on features of hidden size 128, the target's is 64"):
        load_eagle3(bad, model)
    (bad / "config.json").write_text(json.dumps(config(V, 64)))
    torch.save({k: v for k, v in head["weights"].items() if k != "fc.weight"}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="fc.weight missing"):
        load_eagle3(bad, model)
    with pytest.raises(CheckpointError, match="not an EAGLE-3 folder"):
        load_eagle3(target, model)
    with pytest.raises(ValueError, match="speculative_config.model is required for method 'eagle3'"):
        LLM(model=target, dtype="float32", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


@pytest.mark.tp
def test_under_tensor_parallelism(target, head):
    """The target split over two ranks: rank 0's residual stream is whole between layers, so the
    features are the same; outputs identical to plain decoding."""
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", tensor_parallel_size=2,
              speculative_config={"method": "eagle3", "model": str(head["authors"]), "num_speculative_tokens": 2})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_train_eagle3_end_to_end(target, head, tmp_path):
    """`specdec train eagle3` on a datastore of the target's own continuations (seconds): a
    folder in vLLM's layout that loads, drafts, and leaves greedy output identical to plain;
    its training chain (training-time test) at depth 0 is the head's own forward."""
    from specdec.cli import main
    from specdec.proposers.suffix import save_datastore
    from specdec.proposers.suffix_index import SuffixIndex
    from specdec.train.eagle3 import unrolled

    hf = head["hf"]
    with torch.no_grad():
        seqs = hf.generate(torch.tensor(head["prompts"][:16]), max_new_tokens=30, do_sample=False,
                           min_new_tokens=30, pad_token_id=0)
    save_datastore(SuffixIndex.build(seqs.tolist()), tmp_path / "store")
    out = tmp_path / "head"
    assert main(["train", "eagle3", "--target", str(target), "--data", str(tmp_path / "store"), "--out", str(out),
                 "--work", str(tmp_path / "work"), "--steps", "30", "--batch", "2", "--window", "16", "--unroll", "3",
                 "--draft-vocab", "64", "--val-docs", "2", "--feature-layers", "2,4,5", "--precision", "fp32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    trained = json.loads((out / "training.json").read_text())["result"]
    assert trained["steps"] == 30 and len(trained["chain_top1_by_depth"]) == 4
    model = load_model(target, "float32")
    ours = load_eagle3(out, model).float()
    ids = seqs[0]
    with torch.no_grad():
        feats, embeds = features(hf, ids)[:-1][None], hf.model.embed_tokens(ids[1:])[None]
        torch.testing.assert_close(unrolled(ours, feats, embeds, 2)[0], ours(feats, embeds).logits, atol=1e-4, rtol=1e-4)
    greedy_equals_plain(target, head, out)


@pytest.mark.parametrize("option", ["norm_before_fc", "fc_norm", "norm_output"])
def test_speculators_norm_options(target, head, tmp_path, monkeypatch, option):
    """The speculators library's later EAGLE-3 options, on the trained head's weights: an RMSNorm
    over the concatenated features before fc (norm_before_fc: `input_norm`), one per feature layer
    (fc_norm: `fc_norm.i`), the normed state handed to the next step (norm_output, EAGLE 3.1).
    Logits and states equal the reference's, whole and through the paged cache on both forward
    paths; greedy speculation stays identical to plain decoding."""
    import shutil

    from safetensors.torch import load_file

    folder = shutil.copytree(head["speculators"], tmp_path / option)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, option: True}))
    sd = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    extra = {"input_norm.weight": 1 + 0.3 * torch.randn(3 * D, generator=gen)} if option == "norm_before_fc" else \
        {f"fc_norm.{i}.weight": 1 + 0.3 * torch.randn(D, generator=gen) for i in range(3)} if option == "fc_norm" else {}
    extra["verifier_norm.weight"] = torch.ones(D)        # training-only: read past
    save_file({**sd, **extra}, str(folder / "model.safetensors"))
    w, hf = head["weights"], head["hf"]

    def fused(feats):
        if option == "norm_before_fc":
            feats = rms(feats, extra["input_norm.weight"])
        elif option == "fc_norm":
            feats = torch.cat([rms(p, extra[f"fc_norm.{i}.weight"]) for i, p in enumerate(feats.chunk(3, -1))], -1)
        return feats @ w["fc.weight"].T

    ids = torch.randint(2, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats, embeds = features(hf, ids)[:-1], hf.model.embed_tokens(ids[1:])
        ref_logits, ref_h = ref_head(w, fused(feats), embeds)
        if option == "norm_output":
            ref_h = rms(ref_h, w["norm.weight"])
        for c_path in ([True, False] if kernels.load() is not None else [False]):
            with monkeypatch.context() as m:
                without_kernels(m, c_path)
                ours = load_eagle3(folder, load_model(target, "float32"))
                whole = ours(feats[None], embeds[None])
                torch.testing.assert_close(whole.logits[0], ref_logits, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(whole.hidden[0], ref_h, atol=1e-4, rtol=1e-4)
                logits, hidden, view = paged_head(ours, feats, embeds, ((0, 8), (8, 19)))
                assert (view is not None) == c_path
                torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(hidden, ref_h, atol=1e-4, rtol=1e-4)
    llm = greedy_equals_plain(target, head, folder)
    if option == "norm_output":      # forward.c's chain hands on the unnormed state: Python drafts the chains
        assert llm.engine.proposer.c_chain is None


def greedy_equals_plain(target, head, folder) -> LLM:
    """Two training prompts, greedy, K = 3: the EAGLE-3 head in `folder` changes no token."""
    prompts = [{"prompt_token_ids": p} for p in head["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    return llm


def test_speculators_config_without_norm_before_residual_reads_true(target, head, tmp_path):
    """A speculators config that leaves norm_before_residual out means True, as vLLM reads it
    (speculators/algos.py update_eagle3); the authors' layout has no such key and means False."""
    import shutil
    folder = tmp_path / "no-nbr"
    shutil.copytree(head["speculators"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["norm_before_residual"]
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(target, "float32")
    assert load_eagle3(folder, model).decoder.model.layers[0].norm_before_residual is True
    assert load_eagle3(head["speculators"], model).decoder.model.layers[0].norm_before_residual is False
    assert load_eagle3(head["authors"], model).decoder.model.layers[0].norm_before_residual is False


def test_features_are_extracted_over_the_served_kv_cache(gguf_files):
    """`train eagle3` extracts the target's features over the KV cache the engine keeps for it (bf16
    for a packed GGUF on the CPU), as `train answers` does: not over a float32 one."""
    from specdec.engine import kv_cache_dtype_of
    from specdec.model import ForwardBatch, load_model
    from specdec.train.answers import _new_cache
    from specdec.train.eagle3 import extract

    target = load_model(str(gguf_files["llama_q"]), "float32")
    assert kv_cache_dtype_of(target, "auto") == torch.bfloat16
    doc = list(range(5, 45))
    L = target.config.num_hidden_layers
    got = extract(target, [doc], [], 0, (1,), 10_000, lambda s: None)      # after a layer of attention

    def feats(kv_dtype):
        cache = _new_cache(target, 1, len(doc) + 1, kv_dtype)
        out = target(torch.tensor(doc), cache, ForwardBatch.build(cache, [0], [len(doc)], [0]), logits=False,
                     hidden=(1, L))
        return out.hidden.float()[:, :target.config.hidden_size].half()

    assert torch.equal(got.feats, feats("bfloat16"))
    assert not torch.equal(got.feats, feats("float32"))
