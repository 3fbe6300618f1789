"""IBM's MLP speculators (vLLM's `"method": "mlp_speculator"`; model/mlp_speculator.py): a tiny
speculator of three stages trained here (reference forward written from the method's definition,
Adam) on a tiny llama target's greedy continuations, written as IBM's folders are. Checked: the
loader (plain and "speculator."-prefixed names, tied stages, what is refused), the first chain
against the reference, greedy output identical to plain decoding (batched, with "auto" K and
with penalties), the sampling distribution through the engine (Monte Carlo), the method read
from the folder with K defaulting to n_predict, and the OpenAI server."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from conftest import greedy_continuations, make_checkpoint
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.model import CheckpointError, load_model
from specdec.model.mlp_speculator import load_mlp_speculator
from specdec.proposers.mlp_speculator import MLPSpeculatorProposer
from test_engine import exact_first_two, first_two_tokens, total_variation

D, INNER, N_PREDICT = 64, 48, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mlpspec") / "target", layers=4, hidden=D, seed=5)


def norm(x, w=None, b=None):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x if w is None else x * w + b


def ref_stage(w: dict, i: int, state: torch.Tensor, tokens: torch.Tensor, scale_input: bool = False):
    """Stage i from the definition (IBM's report; vLLM's MLPSpeculator): (logits, new state)."""
    if i == 0 and scale_input:
        state = norm(state) / math.sqrt(2)
    sw = 0.5 ** (0.5 / N_PREDICT)
    ew = math.sqrt((1 - sw ** 2) * (INNER / 2))
    s = state @ w[f"proj.{i}.weight"].T + w[f"emb.{i}.weight"][tokens] * (ew / sw)
    s = F.gelu(norm(s, w[f"ln.{i}.weight"], w[f"ln.{i}.bias"]))
    return s @ w[f"head.{i}.weight"].T, s


def config(vocab: int, **kw) -> dict:
    return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": D,
            "inner_dim": INNER, "n_predict": N_PREDICT, "vocab_size": vocab, "top_k_tokens_per_head": [4, 3, 2],
            "n_candidates": 4, "tie_weights": False, "scale_input": False, "torch_dtype": "float32", **kw}


@pytest.fixture(scope="module")
def spec(target, tmp_path_factory):
    """Three stages trained (150 Adam steps, teacher-forced) to predict tokens t + 2, t + 3, t + 4
    from the target's final-norm feature of token t and tokens t + 1.. on its greedy continuations."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    prompts, seqs = greedy_continuations(hf)
    with torch.no_grad():
        feats = hf(seqs, output_hidden_states=True).hidden_states[-1]      # after the final norm
    torch.manual_seed(0)
    w = {}
    for i in range(N_PREDICT):
        w[f"emb.{i}.weight"] = torch.randn(V, INNER) * 0.1
        w[f"proj.{i}.weight"] = torch.randn(INNER, D if i == 0 else INNER) * 0.1
        w[f"head.{i}.weight"] = torch.randn(V, INNER) * 0.1
        w[f"ln.{i}.weight"], w[f"ln.{i}.bias"] = torch.ones(INNER), torch.zeros(INNER)
    params = [t.requires_grad_() for t in w.values()]
    opt = torch.optim.Adam(params, lr=1e-2)
    T = seqs.shape[1] - N_PREDICT - 1
    for _ in range(150):
        state, loss = feats[:, :T], 0
        for i in range(N_PREDICT):
            logits, state = ref_stage(w, i, state, seqs[:, 1 + i:1 + i + T])
            loss = loss + F.cross_entropy(logits.reshape(-1, V), seqs[:, 2 + i:2 + i + T].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = {k: t.detach().contiguous() for k, t in w.items()}
    root = tmp_path_factory.mktemp("mlpspec-folders")
    plain, prefixed = root / "plain", root / "prefixed"
    for folder, names in ((plain, lambda k: k), (prefixed, lambda k: "speculator." + k)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config(V)))
        save_file({names(k): v for k, v in w.items()}, str(folder / "model.safetensors"))
    return {"weights": w, "plain": plain, "prefixed": prefixed, "hf": hf, "prompts": prompts.tolist()}


def test_loads_both_layouts(target, spec):
    """Both name layouts load the same stages, whose logits and states are the definition's."""
    model = load_model(target, "float32")
    for layout in ("plain", "prefixed"):
        s = load_mlp_speculator(spec[layout], model)
        assert (s.n_predict, s.emb_dim, s.inner_dim, s.tie_weights) == (N_PREDICT, D, INNER, False)
        torch.testing.assert_close(s.head[2].weight, spec["weights"]["head.2.weight"])
        feature, tok = torch.randn(3, D), torch.tensor([4, 11, 30])
        with torch.no_grad():
            state, ref_state = s.start(feature), feature
            for i in range(N_PREDICT):        # each stage's logits and state against the definition
                logits, state = s.step(i, state, tok)
                ref_logits, ref_state = ref_stage(spec["weights"], i, ref_state, tok)
                torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
                tok = ref_logits.argmax(-1)


def test_bf16_checkpoint_stays_bf16(target, spec, tmp_path):
    """A bf16 checkpoint beside an fp32 target on the CPU keeps bf16 weights (half the bytes);
    its states are fp32 and its logits those of the same bf16 values in fp32."""
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text((spec["plain"] / "config.json").read_text())
    half = {k: v.to(torch.bfloat16) for k, v in spec["weights"].items()}
    save_file(half, str(folder / "model.safetensors"))
    s = load_mlp_speculator(folder, load_model(target, "float32"))
    assert s.head[0].weight.dtype == torch.bfloat16
    feature, tok = torch.randn(2, D), torch.tensor([3, 8])
    with torch.no_grad():
        logits, state = s.step(0, s.start(feature), tok)
        ref_logits, _ = ref_stage({k: v.float() for k, v in half.items()}, 0, feature, tok)
    assert state.dtype == torch.float32
    torch.testing.assert_close(logits.float(), ref_logits, atol=1e-4, rtol=1e-4)


def test_first_chain_equals_the_reference(target, spec, monkeypatch):
    """The first drafts after a prompt: stage i fed the feature of the prompt's second-to-last
    token (the target's final norm) and the token drafted last, argmax each time."""
    drafts = []
    propose = MLPSpeculatorProposer.propose

    def spy(self, items):
        out = propose(self, items)
        drafts.append(out[0].tokens.tolist())
        return out

    monkeypatch.setattr(MLPSpeculatorProposer, "propose", spy)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "mlp_speculator", "model": str(spec["plain"]), "num_speculative_tokens": 3})
    prompt = [5, 17, 33, 8, 61, 12, 40]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        state = spec["hf"](torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -2:-1]
        tok, chain = torch.tensor([prompt[-1]]), []
        for i in range(N_PREDICT):
            logits, state = ref_stage(spec["weights"], i, state, tok)
            tok = logits.argmax(-1)
            chain.append(int(tok))
    assert drafts[0] == chain


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_speculation_equals_plain(target, spec, k):
    """Four requests batched: every output identical to plain decoding; the trained stages'
    drafts are accepted often (the features and tokens reach them right)."""
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"][:4]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", max_num_seqs=4,
              speculative_config={"method": "mlp_speculator", "model": str(spec["prefixed"]),
                                  "num_speculative_tokens": k})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    accepted, drafted = (sum(getattr(o.stats, f) for o in outs) for f in ("accepted_tokens", "draft_tokens"))
    assert accepted > 0.5 * drafted, (accepted, drafted)


def test_penalties_keep_greedy_output(target, spec):
    """Drafts chosen from logits adjusted for their path: output equal to plain decoding with
    the same repetition penalty."""
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"][4:7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", max_num_seqs=3,
              speculative_config={"method": "mlp_speculator", "model": str(spec["plain"])})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_monte_carlo_sampling_matches_target(target, spec):
    """Seeded Monte Carlo over two-token sequences through the whole engine: drafts drawn from
    each stage's processed q, verified by rejection sampling, leave the target's distribution."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"method": "mlp_speculator", "model": str(spec["plain"]), "num_speculative_tokens": 2})
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)
    assert total_variation(first_two_tokens(llm, prompt, params, n), exact, n) < 0.05


def test_tied_weights(target, spec, tmp_path):
    """tie_weights: one emb, head and norm for every stage and one proj after the first (the
    checkpoint lists each stage's copy, as vLLM's tied ModuleLists save them); the chain equals
    the reference run with the shared weights; greedy output equals plain."""
    w = spec["weights"]
    tied = {}
    for i in range(N_PREDICT):
        for name in ("emb", "head", "ln"):
            for part in (("weight", "bias") if name == "ln" else ("weight",)):
                tied[f"{name}.{i}.{part}"] = w[f"{name}.0.{part}"]
        tied[f"proj.{i}.weight"] = w["proj.0.weight"] if i == 0 else w["proj.1.weight"]
    folder = tmp_path / "tied"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config(spec["hf"].config.vocab_size, tie_weights=True,
                                                          scale_input=True)))
    save_file({k: v.clone() for k, v in tied.items()}, str(folder / "model.safetensors"))
    model = load_model(target, "float32")
    s = load_mlp_speculator(folder, model)
    feature, tok = torch.randn(2, D), torch.tensor([7, 9])
    with torch.no_grad():
        state, ref_state = s.start(feature), feature
        for i in range(N_PREDICT):
            logits, state = s.step(i, state, tok)
            ref_logits, ref_state = ref_stage(tied, i, ref_state, tok, scale_input=True)
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
            tok = ref_logits.argmax(-1)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    llm = LLM(model=target, dtype="float32", speculative_config={"model": str(folder)}, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_method_read_from_the_folder(target, spec):
    """As vLLM: a speculative_config naming only the folder (or the older speculative_model)
    means mlp_speculator, K = n_predict."""
    llm = LLM(model=target, dtype="float32", speculative_model=str(spec["plain"]))
    assert (llm.engine.proposer.name, llm.spec.num_speculative_tokens) == ("mlp_speculator", N_PREDICT)
    cfg = SpeculativeConfig.from_dict({"model": str(spec["plain"])})
    assert (cfg.method, cfg.num_speculative_tokens) == ("mlp_speculator", N_PREDICT)
    assert SpeculativeConfig.from_dict({"model": str(spec["plain"]), "num_speculative_tokens": 2}).num_speculative_tokens == 2


def test_clear_errors(target, spec, tmp_path):
    model = load_model(target, "float32")
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(5\) exceeds the MLP speculator's n_predict \(3\)"):
        LLM(model=target, dtype="float32",
            speculative_config={"method": "mlp_speculator", "model": str(spec["plain"]), "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match="speculative_config.model is required for method 'mlp_speculator'"):
        LLM(model=target, dtype="float32", speculative_config={"method": "mlp_speculator"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config(V, emb_dim=128)))
    save_file(spec["weights"], str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="features of size 128 \\(emb_dim\\), the target's hidden size is 64"):
        load_mlp_speculator(bad, model)
    (bad / "config.json").write_text(json.dumps(config(V)))
    save_file({k: v for k, v in spec["weights"].items() if k != "head.1.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="head.1.weight missing"):
        load_mlp_speculator(bad, model)
    with pytest.raises(CheckpointError, match="not an MLP speculator folder"):
        load_mlp_speculator(target, model)


def test_served_with_the_openai_client(target, spec):
    """`specdec serve --speculative-config '{"model": FOLDER}'` (the method read from the folder)
    on a real uvicorn: greedy completions through the official openai client equal plain
    decoding's text, and the Prometheus counters show the speculator's drafts."""
    import httpx
    import openai
    from specdec.server import ServerConfig, build_app
    from specdec.server.cli import parse_args
    from test_server import LiveServer

    args, _ = parse_args(["--model", str(target), "--speculative-config", json.dumps({"model": str(spec["plain"])})])
    prompts = spec["prompts"][:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    expected = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(model=target, dtype="float32", speculative_config=args.speculative_config)
    assert llm.engine.proposer.name == "mlp_speculator"
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("target",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [client.completions.create(model="target", prompt=p, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        metrics = httpx.get(live.url + "/metrics").text
    assert texts == expected
    drafted = [line for line in metrics.splitlines() if line.startswith("specdec:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted
