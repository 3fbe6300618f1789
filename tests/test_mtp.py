"""The MTP layers a target ships, as its drafter (`{"method": "mtp"}`, vLLM's; model/mtp.py).

A tiny 4-layer Qwen2 written by transformers becomes a MiMo checkpoint (MiMo is Qwen2 with MTP
layers): an MTP layer trained here for a few seconds by a reference written from the method's
definition in plain torch (RMSNorm the target's final feature of token t and the embedding of
token t + 1, project [feature ; embedding] to the hidden size, one Qwen2 decoder layer, the
final layernorm and the target's LM head give token t + 2; the embedding zeroed at position 0)
is added to its safetensors as `model.mtp_layers.0.*`. The same weights in DeepSeek-V3's layout
(`model.layers.4.*`: enorm, hnorm, eh_proj over [embedding ; feature], shared_head) load to the
same head. Checked: the target ignores the MTP weights; the head's logits and states equal the
reference's (whole and paged, both forward paths); the first greedy chain equals the
reference's; greedy speculation equals plain decoding (chains, trees, batched, every alias);
acceptance; Monte Carlo sampling; errors; tensor parallelism."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from conftest import greedy_continuations, make_checkpoint
from specdec import LLM, SamplingParams, kernels
from specdec.model import CheckpointError, ForwardBatch, load_model
from specdec.model.mtp import MTPHead, load_mtp
from specdec.proposers.eagle import EagleProposer
from arch_checks import NO_KERNELS, without_kernels
from mtp_checks import check_c_chain_equals_pytorch_chain
from test_eagle3 import rope        # the same head size and base: RoPE written out in plain torch
from test_engine import exact_first_two, first_two_tokens, total_variation

D, H, KV, HD, FF, EPS, L = 64, 4, 2, 16, 128, 1e-6, 4
P = "model.mtp_layers.0."


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def ref_mtp(w: dict, lm_head: torch.Tensor, h: torch.Tensor, embeds: torch.Tensor):
    """The method over one sequence of T rows at positions 0..T-1 (causal): h [T, D] features
    (the target's or the layer's own states), embeds [T, D] of the next tokens. Returns
    (logits [T, V], the layer's outputs [T, D])."""
    T = h.shape[0]
    pos = torch.arange(T)
    e = rms(embeds, w[P + "token_layernorm.weight"]) * (pos != 0)[:, None]
    x = torch.cat([rms(h, w[P + "hidden_layernorm.weight"]), e], -1) @ w[P + "input_proj.weight"].T
    a = rms(x, w[P + "input_layernorm.weight"])
    proj = {n: a @ w[P + f"self_attn.{n}_proj.weight"].T + w[P + f"self_attn.{n}_proj.bias"] for n in "qkv"}
    q, k, v = proj["q"].view(T, H, HD), proj["k"].view(T, KV, HD), proj["v"].view(T, KV, HD)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + att.transpose(0, 1).reshape(T, H * HD) @ w[P + "self_attn.o_proj.weight"].T
    m = rms(x, w[P + "post_attention_layernorm.weight"])
    x = x + (F.silu(m @ w[P + "mlp.gate_proj.weight"].T) * (m @ w[P + "mlp.up_proj.weight"].T)) @ w[P + "mlp.down_proj.weight"].T
    return rms(x, w[P + "final_layernorm.weight"]) @ lm_head.T, x


def features(hf, ids: torch.Tensor) -> torch.Tensor:
    """[T, D]: transformers' last hidden states (after the final norm)."""
    return hf(ids[None], output_hidden_states=True).hidden_states[-1][0]


def deepseek_layout(w: dict, lm_head, embed) -> dict:
    """The same layer under DeepSeek-V3's names (`model.layers.{L}.*`, eh_proj over [embedding ; feature])."""
    out, p = {}, f"model.layers.{L}."
    for k, v in w.items():
        rest = k[len(P):]
        for mimo, ds in (("token_layernorm", "enorm"), ("hidden_layernorm", "hnorm"), ("final_layernorm", "shared_head.norm")):
            rest = rest.replace(mimo + ".", ds + ".")
        if rest.startswith("input_proj."):
            rest, v = "eh_proj.weight", torch.cat([v[:, D:], v[:, :D]], 1)
        out[p + rest] = v
    out[p + "shared_head.head.weight"] = lm_head
    out[p + "embed_tokens.weight"] = embed
    return out


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    """A Qwen2 target and its MTP layer trained (reference forward, 150 Adam steps) on the
    target's greedy continuations, written as MiMo and as a DeepSeek-V3 layout."""
    root = tmp_path_factory.mktemp("mtp")
    plain = make_checkpoint(root / "qwen2", arch="qwen2", layers=L, hidden=D, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    prompts, seqs = greedy_continuations(hf)
    with torch.no_grad():
        feats = torch.stack([features(hf, s) for s in seqs])
        embeds = hf.model.embed_tokens(seqs)
    lm_head = hf.lm_head.weight.detach().clone()
    torch.manual_seed(0)
    w = {P + "input_proj.weight": torch.randn(D, 2 * D) * 0.05}
    for name, shape in (("q_proj", (H * HD, D)), ("k_proj", (KV * HD, D)), ("v_proj", (KV * HD, D))):
        w[P + f"self_attn.{name}.weight"] = torch.randn(shape) * 0.05
        w[P + f"self_attn.{name}.bias"] = torch.randn(shape[0]) * 0.05
    w[P + "self_attn.o_proj.weight"] = torch.randn(D, H * HD) * 0.05
    for name, shape in (("gate_proj", (FF, D)), ("up_proj", (FF, D)), ("down_proj", (D, FF))):
        w[P + f"mlp.{name}.weight"] = torch.randn(shape) * 0.05
    for name in ("token_layernorm", "hidden_layernorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
        w[P + f"{name}.weight"] = 1 + 0.1 * torch.randn(D)
    params = [t.requires_grad_() for t in w.values()]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(150):
        loss = 0
        for b in range(seqs.shape[0]):      # row t (pair: feature t, token t + 1) predicts t + 2
            logits, _ = ref_mtp(w, lm_head, feats[b, :-2], embeds[b, 1:-1])
            loss = loss + F.cross_entropy(logits, seqs[b, 2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = {k: t.detach().contiguous() for k, t in w.items()}
    base = load_file(str(plain / "model.safetensors"))
    cfg = json.loads((plain / "config.json").read_text())
    mimo, ds = root / "mimo", root / "deepseek-layout"
    for folder, extra in ((mimo, w), (ds, deepseek_layout(w, lm_head, hf.model.embed_tokens.weight.detach().clone()))):
        shutil.copytree(plain, folder)
        save_file({**base, **{k: v.contiguous() for k, v in extra.items()}}, str(folder / "model.safetensors"))
    (mimo / "config.json").write_text(json.dumps({**cfg, "architectures": ["MiMoForCausalLM"], "model_type": "mimo",
                                                  "num_nextn_predict_layers": 1}))
    (ds / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return {"plain": plain, "mimo": mimo, "deepseek": ds, "weights": w, "lm_head": lm_head, "hf": hf,
            "prompts": prompts.tolist()}


def test_target_ignores_its_mtp_weights(mtp):
    """The MiMo folder loads as its Qwen2 body (MTP weights left to the drafter): logits equal
    transformers' on the plain folder."""
    ids = torch.randint(2, 100, (1, 20), generator=torch.Generator().manual_seed(4))
    want = mtp["hf"](ids).logits
    for name in ("mimo", "deepseek"):
        model = load_model(mtp[name], "float32")
        assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == L
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_layer_matches_the_reference(mtp, monkeypatch, layout, c_path):
    """Logits and states over a sequence of target features, whole and through the paged cache
    in chunks, equal the reference's, from either layout."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    model = load_model(mtp[layout], "float32")
    head = load_mtp(mtp[layout], model)
    assert isinstance(head, MTPHead) and head.embeds_first == (layout == "deepseek")
    assert head.embed_tokens is None          # DeepSeek's copy of the target's embedding is shared, not kept
    hf, w = mtp["hf"], mtp["weights"]
    ids = torch.randint(2, model.config.vocab_size, (25,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats, embeds = features(hf, ids)[:-1], hf.model.embed_tokens(ids[1:])
        ref_logits, ref_h = ref_mtp(w, mtp["lm_head"], feats, embeds)
        if layout == "mimo":        # MiMo's layer hands on its final norm's output (vLLM's mimo_mtp)
            ref_h = rms(ref_h, w[P + "final_layernorm.weight"])
        whole = head(feats[None], embeds[None])
        torch.testing.assert_close(whole.logits[0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(whole.hidden[0], ref_h, atol=1e-4, rtol=1e-4)
        cache = head.decoder.new_cache(batch=1)
        parts = []
        for a, b in ((0, 9), (9, 10), (10, 24)):
            parts.append(head(feats[a:b], embeds[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])))
            cache.set_length(0, b)
        torch.testing.assert_close(torch.cat([p.logits for p in parts]), ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat([p.hidden for p in parts]), ref_h, atol=1e-4, rtol=1e-4)


def test_first_greedy_chain_equals_the_reference(mtp, monkeypatch):
    """The first drafts after a prompt (K = 3, a chain) are the reference's: the prompt's pairs
    (feature of token j, token j + 1), then each draft's own state and embedding appended."""
    drafts = []
    propose = EagleProposer.propose

    def spy(self, items):
        out = propose(self, items)
        drafts.append(out[0].tokens.tolist())
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    llm = LLM(model=mtp["mimo"], dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert llm.engine.proposer.name == "mtp"
    prompt = [5, 17, 33, 8, 61, 12, 40]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    w, hf = mtp["weights"], mtp["hf"]
    with torch.no_grad():
        ids = torch.tensor(prompt)
        h, embeds = features(hf, ids[:-1]), hf.model.embed_tokens(ids[1:])
        chain = []
        for _ in range(3):
            logits, states = ref_mtp(w, mtp["lm_head"], h, embeds)
            chain.append(int(logits[-1].argmax()))
            # MiMo's layer hands on its final norm's output (vLLM's mimo_mtp: final_layernorm(h))
            h = torch.cat([h, rms(states[-1:], w[P + "final_layernorm.weight"])])
            embeds = torch.cat([embeds, hf.model.embed_tokens(torch.tensor(chain[-1:]))])
    assert drafts[0] == chain


@NO_KERNELS
@pytest.mark.parametrize("layout", ["deepseek"])     # MiMo hands on the normed state: PyTorch drafts its chains
def test_c_chain_equals_pytorch_chain(mtp, monkeypatch, layout):
    """Chains drafted in one forward.c call per step (the norms, [h ; e] for MiMo or [e ; h] for
    DeepSeek's layout, the projection and the layer) equal the PyTorch chains at every step."""
    check_c_chain_equals_pytorch_chain(mtp[layout], monkeypatch)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
@pytest.mark.parametrize("method,topk", [("mtp", 1), ("mimo_mtp", 2), ("deepseek_mtp", 1), ("ngram+mtp", 1)])
def test_greedy_speculation_equals_plain(mtp, monkeypatch, c_path, method, topk):
    """Chains (vLLM's default) and EAGLE-2 trees, four requests batched: every output identical
    to plain decoding; the layer's drafts are accepted."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    prompts = [{"prompt_token_ids": p} for p in mtp["prompts"][:4]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=mtp["plain"], dtype="float32").generate(prompts, params)]
    folder = mtp["deepseek" if method == "deepseek_mtp" else "mimo"]
    llm = LLM(model=folder, dtype="float32", max_num_seqs=4,
              speculative_config={"method": method, "num_speculative_tokens": 3, "topk": topk})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_trained_layer_is_accepted(mtp):
    """One draft a step (what the layer was trained for): most are accepted, so the features and
    the embeddings reach it right."""
    prompts = [{"prompt_token_ids": p} for p in mtp["prompts"][:8]]
    llm = LLM(model=mtp["mimo"], dtype="float32", max_num_seqs=8,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    accepted, drafted = (sum(getattr(o.stats, f) for o in outs) for f in ("accepted_tokens", "draft_tokens"))
    assert accepted > 0.6 * drafted, (accepted, drafted)


def test_monte_carlo_sampling_matches_target(mtp):
    """Seeded Monte Carlo over two-token sequences through the whole engine."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    llm = LLM(model=mtp["mimo"], dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)
    assert total_variation(first_two_tokens(llm, prompt, params, n), exact, n) < 0.05


def test_clear_errors(mtp, tmp_path):
    with pytest.raises(CheckpointError, match="has no MTP layers"):
        LLM(model=mtp["plain"], dtype="float32", speculative_config={"method": "mtp"})
    bad = tmp_path / "bad"
    shutil.copytree(mtp["mimo"], bad)
    sd = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != P + "input_proj.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="eh_proj.weight missing"):
        LLM(model=bad, dtype="float32", speculative_config={"method": "mtp"})
    save_file({k: v for k, v in sd.items() if not k.startswith(P)}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="holds no MTP weights"):
        LLM(model=bad, dtype="float32", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="speculative_config.topk must be an integer"):
        LLM(model=mtp["mimo"], dtype="float32", speculative_config={"method": "mtp", "topk": 0})


@pytest.mark.tp
def test_under_tensor_parallelism(mtp):
    """The target split over two ranks: its final features are whole on rank 0; outputs
    identical to plain decoding."""
    prompts = [{"prompt_token_ids": p} for p in mtp["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=mtp["plain"], dtype="float32").generate(prompts, params)]
    llm = LLM(model=mtp["mimo"], dtype="float32", tensor_parallel_size=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_served_with_the_openai_client(mtp):
    """`specdec serve MODEL --speculative-config '{"method": "mtp"}'`'s app on a real uvicorn: greedy
    completions through the official openai client equal plain decoding's text, and the
    Prometheus counters show the MTP layer's drafts."""
    import httpx
    import openai
    from specdec.server import ServerConfig, build_app
    from specdec.server.cli import parse_args
    from test_server import LiveServer

    args, _ = parse_args(["--model", str(mtp["mimo"]), "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    prompts = [p[:6] for p in mtp["prompts"][:3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=mtp["plain"], dtype="float32")
    expected = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(model=mtp["mimo"], dtype="float32", speculative_config=args.speculative_config)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("mimo",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [client.completions.create(model="mimo", prompt=p, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        metrics = httpx.get(live.url + "/metrics").text
    assert texts == expected
    drafted = [line for line in metrics.splitlines() if line.startswith("specdec:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted


def speculators_layout(mtp, folder):
    """The trained layer as the speculators library saves an MTP drafter: a folder of its own,
    `mtp_layers.0.*` (input_proj over [embedding ; feature]), the verifier's config under
    transformer_layer_config, no embeddings or LM head (the verifier's)."""
    folder.mkdir()
    out = {}
    for k, v in mtp["weights"].items():
        rest = k[len(P):]
        if rest.startswith("input_proj."):
            v = torch.cat([v[:, D:], v[:, :D]], 1)
        out["mtp_layers.0." + rest] = v.contiguous()
    out["verifier_lm_head.weight"] = mtp["lm_head"]            # a training-time copy: read past
    save_file(out, str(folder / "model.safetensors"))
    layer = json.loads((mtp["plain"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MTPDraftModel"], "speculators_model_type": "mtp", "num_nextn_predict_layers": 1,
        "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "mtp", "proposal_methods": [{"proposal_type": "greedy",
                                                                         "speculative_tokens": 3}]}}))
    return folder


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_speculators_mtp_drafter(mtp, tmp_path, monkeypatch, c_path):
    """The speculators library's standalone MTP drafter: the method is read from the folder;
    logits equal the reference's and the state handed on is the normed output (its training's
    chaining), whole and through the paged cache; greedy speculation equals plain decoding."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    folder = speculators_layout(mtp, tmp_path / "speculators-mtp")
    model = load_model(mtp["plain"], "float32")
    head = load_mtp(folder, model)
    assert head.embeds_first and head.norm_output
    hf, w = mtp["hf"], mtp["weights"]
    ids = torch.randint(2, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        feats, embeds = features(hf, ids)[:-1], hf.model.embed_tokens(ids[1:])
        ref_logits, ref_x = ref_mtp(w, mtp["lm_head"], feats, embeds)
        ref_h = rms(ref_x, w[P + "final_layernorm.weight"])
        whole = head(feats[None], embeds[None])
        torch.testing.assert_close(whole.logits[0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(whole.hidden[0], ref_h, atol=1e-4, rtol=1e-4)
        cache = head.decoder.new_cache(batch=1)
        parts = []
        for a, b in ((0, 7), (7, 19)):
            parts.append(head(feats[a:b], embeds[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])))
            cache.set_length(0, b)
        assert (head.decoder.c_view(cache) is not None) == c_path
        torch.testing.assert_close(torch.cat([p.logits for p in parts]), ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat([p.hidden for p in parts]), ref_h, atol=1e-4, rtol=1e-4)
    prompts = [{"prompt_token_ids": p} for p in mtp["prompts"][:3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=mtp["plain"], dtype="float32",
                                                 num_speculative_tokens=0).generate(prompts, params)]
    llm = LLM(model=mtp["plain"], dtype="float32", speculative_config={"model": str(folder), "num_speculative_tokens": 3})
    assert llm.spec.method == "mtp"                         # read from the folder, as vLLM does
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    assert llm.engine.proposer.c_chain is None               # the normed state: PyTorch drafts the chains
