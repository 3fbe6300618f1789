"""The ngram+eagle / ngram+draft_model hybrids: lossless greedy on the bundled toy pair, the
sampled distribution exact by enumeration through the hybrid's own source choices, the switch
between sources seen on its counters, and the learned drafter's deferred updates equal to
updates at every step."""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR
from specdec.model import BlockManager, load_model
from specdec.proposers import Committed, ProposeItem, RequestContext, build_proposer
from specdec.proposers.base import merge_committed
from specdec.proposers.hybrid import LEARNED, LOOKUP, Choice, HybridSettings, SourceRecords
from specdec.proposers.ngram import match
from specdec.sampling import make_generator, process
from specdec.verify import rejection_plan

from test_verify import SETTINGS

TOY_HEADS = {"ngram+eagle": MODELS_DIR / "eagle", "ngram+draft_model": BUNDLED_DRAFT}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n",
           "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
           "class Point3:\n    def __init__(self, x, y, z):\n        self.x = x\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# costs of a machine where drafting is cheap (a GPU; the defaults are this CPU's, where the
# toy drafters would rarely pay): there both sources draft
CHEAP = {"verify_cost": 0.05, "learned_cost": 0.05, "catch_up_cost": 0.0}


@pytest.fixture(scope="module")
def toy():
    plain = LLM(model=str(BUNDLED_TARGET), num_speculative_tokens=0)
    return {"plain": plain, "outputs": [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]}


def _hybrid(method: str, k, **extra) -> LLM:
    return LLM(model=str(BUNDLED_TARGET), speculative_config={"method": method, "model": str(TOY_HEADS[method]),
                                                             "num_speculative_tokens": k, **extra})


@pytest.mark.parametrize("method", sorted(TOY_HEADS))
@pytest.mark.parametrize("k", [1, 4, 8, "auto"])
def test_greedy_hybrid_equals_plain_on_the_toy_pair(toy, method, k):
    llm = _hybrid(method, k, **CHEAP)
    outs = llm.generate(PROMPTS, GREEDY)       # every prompt in one batch
    assert [o.outputs[0].token_ids for o in outs] == toy["outputs"]
    counts = llm.engine.proposer.counts
    assert counts.lookup_accepted > 0 and counts.learned_accepted > 0, counts   # both sources drafted, and paid


def test_the_bundled_pair_is_found_by_method():
    llm = LLM(model=str(BUNDLED_TARGET), speculative_config={"method": "ngram+eagle", "num_speculative_tokens": 2})
    assert llm.engine.proposer.name == "ngram+eagle" and llm.spec.model == str(MODELS_DIR / "eagle")


def _one_step_counts(method: str, prompt_ids: list[int]):
    llm = _hybrid(method, 4, **CHEAP)
    # two new tokens: the first step may draft one, so the source choice is made exactly once
    llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return llm.engine.proposer.counts


@pytest.mark.parametrize("method", sorted(TOY_HEADS))
def test_a_repeated_span_drafts_by_lookup_and_fresh_text_by_the_learned_drafter(method, toy):
    tok = toy["plain"].tokenizer
    repeated = tok.encode("x = compute(alpha, beta)\ny = 1\nx = compute(alpha")
    fresh = list(range(40, 60))                    # twenty distinct token ids: nothing to look up
    assert len(match(np.asarray(repeated), 4, 4, 1)[0]) and not len(match(np.asarray(fresh), 4, 4, 1)[0])
    by_lookup, by_learned = _one_step_counts(method, repeated), _one_step_counts(method, fresh)
    assert (by_lookup.lookup_drafts, by_lookup.learned_drafts) == (1, 0)
    assert (by_learned.lookup_drafts, by_learned.learned_drafts) == (0, 1)
    # neither had decoding steps to catch up on (prompts are handed over as they are prefilled)
    assert by_lookup.learned_catch_ups == 0 and by_learned.learned_catch_ups == 0


def test_speculation_switched_off_costs_the_learned_drafter_nothing(toy):
    """From disable_by_batch_size requests on nobody drafts (as "auto" may decide): the hybrid is
    never asked, and the learned drafter never catches up."""
    llm = _hybrid("ngram+eagle", 4, disable_by_batch_size=2)
    llm.engine.policy.disable_by_batch_size = 1      # off for one request too (the config refuses < 2, as vLLM)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == toy["outputs"]
    c = llm.engine.proposer.counts
    assert c.lookup_drafts == c.learned_drafts == c.empty == c.learned_catch_ups == 0
    assert sum(o.stats.draft_tokens for o in outs) == 0


def test_bad_hybrid_settings_are_one_line_errors():
    for extra, field in (({"verify_cost": -1}, "verify_cost"), ({"probe_every": 0}, "probe_every"),
                         ({"catch_up_cost": "x"}, "catch_up_cost"),
                         ({"topk": 3}, "topk")):
        with pytest.raises(ValueError, match=field):
            _hybrid("ngram+eagle", 4, **extra)
    with pytest.raises(ValueError, match="model is required"):
        SpeculativeConfig(method="ngram+eagle")


def test_the_choice_weighs_what_each_source_achieved_and_costs():
    cheap = HybridSettings(**CHEAP)
    rec = SourceRecords(8, cheap)
    assert rec.choose(0, 0, 4).source == LEARNED                      # no match: the learned drafter
    assert rec.choose(3, 4, 4).source == LOOKUP                       # a match: lookup, as likely and free
    for _ in range(6):                                                # this request's lookups keep failing
        rec.observe(Choice(LOOKUP, 2, 3), 0)
    assert rec.choose(3, 4, 4).source == LEARNED
    # the defaults (this CPU): a learned drafter that must first catch up on a long prompt does not pay
    assert SourceRecords(8, HybridSettings()).choose(0, 0, 4, catch_up=1000).source is None
    # a long match that has paid is drafted long; a short one that has not, not at all
    rec = SourceRecords(8, HybridSettings())
    for _ in range(6):
        rec.observe(Choice(LOOKUP, 8, 8), 8)
        rec.observe(Choice(LOOKUP, 2, 2), 0)
    assert rec.choose(8, 8, 0) == Choice(LOOKUP, 8, 8) and rec.choose(2, 8, 0).source is None
    # ... until it has sat unused for probe_every steps: then one token, so its figures stay measured
    choices = [rec.choose(2, 8, 0) for _ in range(HybridSettings().probe_every)]
    assert [c.source for c in choices].count(LOOKUP) == 1 and choices[-1] == Choice(LOOKUP, 1, 2)


# -- exactness by enumeration ------------------------------------------------------------------

V = 4
CONTEXT = [0, 1, 2, 3, 1, 2, 0, 3]      # the prompt: tails 1-2, 2-0, 0-3, 3-1... recur in it


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    cache = {}

    def logits(kind: str, prefix: tuple) -> torch.Tensor:
        if (kind, prefix) not in cache:
            cache[kind, prefix] = torch.randn(V, generator=g) * 1.5
        return cache[kind, prefix]
    return logits


def _exact_through_hybrid(params: SamplingParams, logits, steps: int, k: int, settings: HybridSettings,
                          context: list[int] = CONTEXT, lookup_q: bool = False):
    """P(first `steps` + 1 output tokens) when every step drafts what the hybrid's own records
    choose (lookup in context + output, or a learned chain drawn from q), verified by
    rejection_plan; each branch carries its own copy of the records, so a later step's choice
    depends on the earlier outcomes as in the engine. Also returns the choices made. lookup_q:
    the bug of verifying lookup's fixed tokens against the learned drafter's q."""
    p_of = lambda pre: process(logits("p", pre)[None], params)[0]          # noqa: E731
    q_of = lambda pre: process(logits("q", pre)[None], params)[0]          # noqa: E731
    out, seen = {}, set()

    def walk(prefix: tuple, records: SourceRecords, weight: float, step: int):
        if len(prefix) > steps:
            key = prefix[:steps + 1]
            out[key] = out.get(key, 0.0) + weight
            return
        if step == steps:               # no more drafting: the rest is plain decoding
            nxt = p_of(prefix)
            for y in range(V):
                if nxt[y] > 0:
                    walk(prefix + (y,), records, weight * nxt[y].item(), step)
            return
        tokens, n = match(np.asarray(context + list(prefix)), k, 4, 1)
        choice = records.choose(n, len(tokens), k)
        seen.add((step, choice.source, choice.m))
        if choice.source == LOOKUP:
            draft = tuple(int(t) for t in tokens[:choice.m])
            q = torch.stack([q_of(prefix + draft[:i]) for i in range(len(draft))]) if lookup_q else None
            options = [(draft, 1.0, q)]
        elif choice.source == LEARNED:
            options = []
            for draft in itertools.product(range(V), repeat=choice.m):
                q_rows = [q_of(prefix + draft[:i]) for i in range(choice.m)]
                w = float(np.prod([q_rows[i][draft[i]].item() for i in range(choice.m)]))
                if w > 0:
                    options.append((draft, w, torch.stack(q_rows)))
        else:
            options = [((), 1.0, None)]
        for draft, w_draft, q in options:
            m = len(draft)
            p = torch.stack([p_of(prefix + draft[:i]) for i in range(m + 1)])
            acc, cand = rejection_plan(torch.tensor(draft, dtype=torch.long), q, p)
            for a in range(m + 1):      # exactly a accepted
                w = w_draft * float(torch.prod(acc[:a])) * ((1 - acc[a].item()) if a < m else 1.0)
                for y in range(V):
                    wy = w * cand[a, y].item()
                    if wy > 0:
                        rec = copy.deepcopy(records)
                        if choice.source is not None:
                            rec.observe(choice, a)
                        walk(prefix + draft[:a] + (y,), rec, weight * wy, step + 1)

    walk((), SourceRecords(16, settings), 1.0, 0)
    return out, p_of, seen


@pytest.mark.parametrize("settings", SETTINGS[:3], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_mixing_sources_step_by_step_keeps_the_target_distribution(settings):
    params = SamplingParams(**settings)
    logits = _tables(seed=len(settings))
    # costs under which the first step's outcome changes the second step's source or length
    hybrid = HybridSettings(verify_cost=0.3, learned_cost=0.05, probe_every=1)
    got, p_of, seen = _exact_through_hybrid(params, logits, steps=2, k=2, settings=hybrid)
    assert {s for (step, s, _) in seen if step == 1} >= {LOOKUP, LEARNED}, seen
    for a, b, c in itertools.product(range(V), repeat=3):
        want = p_of(())[a].item() * p_of((a,))[b].item() * p_of((a, b))[c].item()
        assert abs(got.get((a, b, c), 0.0) - want) < 1e-6, (a, b, c)


def test_lookup_tokens_verified_against_the_learned_q_are_not_exact():
    """The enumeration can fail: a hybrid that hands lookup's fixed tokens the learned drafter's
    q (accepting x with min(1, p(x)/q(x)) though x was never drawn from q) is biased."""
    params = SamplingParams(temperature=1.0)
    logits = _tables(seed=5)
    got, p_of, seen = _exact_through_hybrid(params, logits, steps=1, k=2, settings=HybridSettings(), lookup_q=True)
    assert {s for (_, s, _) in seen} == {LOOKUP}
    worst = max(abs(got.get((a, b), 0.0) - p_of(())[a].item() * p_of((a,))[b].item())
                for a, b in itertools.product(range(V), repeat=2))
    assert worst > 1e-3


# -- deferred updates --------------------------------------------------------------------------

def _commits(target, seq: list[int], cuts: list[int]):
    """Committed items as the engine makes them for a sequence kept in chunks: a prefill of
    cuts[0] tokens, then steps that keep the next cuts[i] tokens each (features included)."""
    with torch.inference_mode():
        hidden = target(torch.tensor([seq]), hidden=True).hidden[0].float()
    out, cached = [], 0
    for i, n in enumerate(cuts):
        new = cached + n
        out.append(Committed("r", seq[:new + 1], new, hidden[cached:new], prefill=i == 0))
        cached = new
    return out


@pytest.mark.parametrize("method", sorted(TOY_HEADS))
def test_a_merged_catch_up_drafts_what_updates_at_every_step_draft(method, toy):
    target = toy["plain"].target
    spec = SpeculativeConfig.from_dict({"method": method.split("+")[1], "model": str(TOY_HEADS[method]), "topk": 1})
    seq = toy["plain"].tokenizer.encode(PROMPTS[2]) + toy["outputs"][2][:12]
    commits = _commits(target, seq, [len(seq) - 13, 2, 1, 3, 1, 2, 3])
    drafts = []
    for deferred in (False, True):
        learned = build_proposer(spec, target, lambda d: load_model(d), 256)
        assert learned.caps.deferrable
        blocks = BlockManager(64, 16, 2, 32)
        learned.initialize_kv(blocks, target.new_kv(blocks))
        blocks.add("r")
        blocks.ensure("r", len(seq) + 8)
        learned.add_request("r", RequestContext(GREEDY, make_generator(0, target.device), target.config.vocab_size))
        with torch.inference_mode():
            if deferred:          # nothing until the end, then one merged update
                learned.update([merge_committed(commits)])
            else:                 # updates at every step, each followed by drafts (written into the
                for c in commits[:-1]:  # caches, which the next update must roll back)
                    learned.update([c])
                    learned.propose([ProposeItem("r", c.seq, 3)])
                learned.update(commits[-1:])
            drafts.append(learned.propose([ProposeItem("r", seq, 3)])[0].tokens.tolist())
    assert drafts[0] == drafts[1] and len(drafts[0]) == 3


@pytest.fixture(scope="module")
def tiny_drafters(tiny_pair, near_draft, tmp_path_factory):
    """Learned drafters for the tests' tiny target: a near copy of it, untrained EAGLE heads."""
    from test_heads import _heads_dirs

    target, _ = tiny_pair
    return target, {"ngram+draft_model": near_draft,
                    "ngram+eagle": _heads_dirs(target, tmp_path_factory.mktemp("hybrid_heads"))["eagle"]}


def _contested_lookup_prompt(llm, params) -> list[int]:
    """A prompt whose lookup proposal x is one of the target's candidates without being certain
    (0.2 < p(x) < 0.8 after processing), so that verifying it against a wrong q would show."""
    rest = list(range(30, 38))
    with torch.no_grad():
        for x in range(3, llm.target.config.vocab_size):
            ids = [5, 6, x] + rest + [5, 6]                  # the tail 5 6 was followed by x
            p = process(llm.target(torch.tensor([ids])).logits[0, -1:], params)[0]
            if 0.2 < p[x].item() < 0.8:
                return ids
    pytest.fail("no prompt where the lookup proposal is contested")


@pytest.mark.parametrize("method", sorted(TOY_HEADS))
def test_monte_carlo_through_the_engine_matches_the_target(method, tiny_drafters, monkeypatch):
    """Seeded samples of the first two tokens through the engine, where the first step drafts from
    lookup (a contested proposal) or from the learned drafter (fresh tokens): both follow p, and
    each draft carries its own source's q (none for lookup)."""
    from test_engine import total_variation

    target, folders = tiny_drafters
    llm = LLM(model=target, dtype="float32", speculative_config={"method": method, "model": str(folders[method]),
                                                                 "num_speculative_tokens": 2, **CHEAP})
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=2, ignore_eos=True)
    proposer, drafts = llm.engine.proposer, []
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda items: drafts.extend(propose(items)) or drafts[-len(items):])
    n = 600
    for ids, source in ((_contested_lookup_prompt(llm, params), "lookup"), (list(range(40, 60)), "learned")):
        before, drafts[:] = copy.copy(proposer.counts), []
        outs = llm.generate([{"prompt_token_ids": ids}] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
        drafted = getattr(proposer.counts, f"{source}_drafts") - getattr(before, f"{source}_drafts")
        assert drafted == n == len(drafts), source
        if source == "lookup":
            assert all(d.probs is None for d in drafts)
        else:
            assert all(d.probs.shape == (d.k, llm.target.config.vocab_size) for d in drafts)
            assert torch.allclose(torch.cat([d.probs for d in drafts]).sum(-1), torch.tensor(1.0))
        with torch.no_grad():
            p1 = process(llm.target(torch.tensor([ids])).logits[0, -1:], params)[0]
            exact = {}
            for a in torch.nonzero(p1).flatten().tolist():
                p2 = process(llm.target(torch.tensor([ids + [a]])).logits[0, -1:], params)[0]
                for b in torch.nonzero(p2).flatten().tolist():
                    exact[(a, b)] = p1[a].item() * p2[b].item()
        sampled = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
        assert total_variation(sampled, exact, n) < 0.05, source


def test_cli_and_bench_take_the_hybrid_by_method(toy, tmp_path, capsys):
    import json

    from specdec.cli import main

    spec = json.dumps({"method": "ngram+eagle", "num_speculative_tokens": 4})    # the bundled head, found by method
    rc = main(["generate", PROMPTS[2], "--model", str(BUNDLED_TARGET), "--speculative-config", spec,
               "--max-tokens", "24", "--ignore-eos", "--compare", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["compare"]["identical"] is True and out["stats"]["accepted_tokens"] > 0, out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = main(["bench", "--model", str(BUNDLED_TARGET), "--methods", "ngram+eagle,ngram+draft_model",
               "--num-speculative-tokens", "4,auto", "--temperature", "0", "--prompts", str(prompts), "--max-tokens", "16",
               "--repeats", "1", "--no-peers", "--out", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    methods = {m["name"]: m for m in results["scenarios"][0]["methods"]}
    assert rc == 0 and set(methods) == {"plain", "ngram+eagle K=4", "ngram+eagle K=auto", "ngram+draft_model K=4",
                                        "ngram+draft_model K=auto"}
    assert all(m["greedy_match"]["identical"] for m in methods.values())
