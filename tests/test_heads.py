"""Medusa and EAGLE end to end on a tiny target: lossless greedy for every tree size, exact
sampling (Monte Carlo), KV paths moved into place, training, loading errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec import verify as verify_mod
from specdec.cli import main
from specdec.model import CheckpointError, load_model
from specdec.model.heads import EagleHead, MedusaHeads, load_heads, save_heads
from specdec.proposers.base import Draft, ProposerBase, ProposerCaps
from specdec.proposers.medusa import build_tree

from test_engine import PROMPTS, exact_first_two, first_two_tokens, tokens, total_variation

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _heads_dirs(target_dir, root):
    """Untrained heads with the target's LM-head rows: they agree with the target sometimes."""
    target = load_model(target_dir, "float32")
    V = target.config.vocab_size
    vocab = torch.arange(0, V, 2)            # a draft vocabulary of every other token
    torch.manual_seed(0)
    medusa = MedusaHeads(target.config.hidden_size, 3, vocab)
    eagle = EagleHead(target.config, vocab)
    with torch.no_grad():
        for b in medusa.blocks:
            b.weight.normal_(0, 0.05)
        medusa.lm_head.weight.copy_(target.lm_head.weight[vocab])
        eagle.decoder.lm_head.weight.copy_(target.lm_head.weight[vocab])
        eagle.decoder.model.norm.weight.copy_(target.model.norm.weight)
        eagle.fc.weight.zero_()
        eagle.fc.weight[:, :target.config.hidden_size] = torch.eye(target.config.hidden_size)  # pass the feature on
    save_heads(medusa, root / "medusa", torch.float32)
    save_heads(eagle, root / "eagle", torch.float32, extra={"default_topk": 3})
    return {"medusa": root / "medusa", "eagle": root / "eagle"}


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    target, _ = tiny_pair
    dirs = _heads_dirs(target, tmp_path_factory.mktemp("heads"))
    return {"target": target, "plain": LLM(model=target, dtype="float32", num_speculative_tokens=0), **dirs}


def _llm(heads, method, size, **extra):
    return LLM(model=heads["target"], dtype="float32",
               speculative_config={"method": method, "model": str(heads[method]), "num_speculative_tokens": size, **extra})


@pytest.mark.parametrize("method,extra", [("medusa", {}), ("eagle", {}), ("eagle", {"topk": 1})],
                         ids=["medusa", "eagle-tree", "eagle-chain"])
def test_greedy_trees_equal_plain_for_every_size(heads, method, extra):
    """Trees of 1..8 nodes and "auto"; EAGLE's topk-1 chains run in one C call per step."""
    plain = tokens(heads["plain"], PROMPTS, GREEDY)
    accepted = 0
    for size in [1, 2, 3, 4, 5, 6, 7, 8, "auto"]:
        llm = _llm(heads, method, size, **extra)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain, f"{method} size {size}"
        accepted += sum(o.stats.accepted_tokens for o in outs)
    assert accepted > 0          # accepted paths (and their moved cache entries) were exercised


class OracleTree(ProposerBase):
    """A test proposer: random trees that hide the target's true continuation on one branch,
    at a random sibling position, so that deep paths get accepted and moved into place.
    truth: prompt (tuple) -> its plain greedy output; a request's prompt is found as the
    longest key its sequence starts with."""
    name = "oracle"
    caps = ProposerCaps(tree=True)

    def __init__(self, truth: dict, seed: int):
        super().__init__()
        self.truth, self.g = truth, torch.Generator().manual_seed(seed)

    def propose(self, items):
        return [self._one(it.seq, it.k) for it in items]

    def _one(self, seq, k):
        prompt = max((p for p in self.truth if tuple(seq[:len(p)]) == p), key=len)
        true_next = self.truth[prompt][len(seq) - len(prompt):]
        tokens, parents, on_path = [], [], -1
        for depth in range(min(k, len(true_next))):
            width = int(torch.randint(1, 4, (), generator=self.g))
            slot = int(torch.randint(0, width, (), generator=self.g))
            nxt = -1
            for j in range(width):
                tok = true_next[depth] if j == slot else int(torch.randint(0, 90, (), generator=self.g))
                if j != slot and tok == true_next[depth]:
                    continue
                tokens.append(tok)
                parents.append(on_path)
                if j == slot:
                    nxt = len(tokens) - 1
            on_path = nxt
            if len(tokens) >= k:
                break
        tokens, parents = tokens[:k], parents[:k]
        return Draft(torch.tensor(tokens, dtype=torch.long), parents=parents)


def test_deep_accepted_tree_paths_are_moved_into_place(heads):
    from specdec.engine import Engine

    plain_llm = heads["plain"]
    prompts = PROMPTS[:8]
    ids = [plain_llm.tokenizer.encode(p) for p in prompts]
    plain = tokens(plain_llm, prompts, GREEDY)
    truth = {tuple(i): out for i, out in zip(ids, plain)}
    engine = Engine(plain_llm.target, plain_llm.tokenizer, OracleTree(truth, 0), 12, plain_llm.engine.max_model_len)
    for prompt, want in zip(ids, plain):
        events = list(engine.generate(prompt, GREEDY))
        got = [t for e in events for t in e.token_ids]
        assert got == want
        assert events[-1].stats.mean_accepted_length > 3      # deep paths accepted


def test_medusa_tree_is_best_first_and_rank_prefixed():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.05]]
    for size in range(1, 20):
        parents, depth, rank = build_tree(acc, size)
        assert len(parents) == size
        assert all(-1 <= par < i for i, par in enumerate(parents))
        for i, par in enumerate(parents):
            sib_ranks = sorted(rank[j] for j, q in enumerate(parents) if q == par)
            assert sib_ranks == list(range(len(sib_ranks)))       # children = first draws
            assert depth[i] == (0 if par == -1 else depth[par] + 1)
    parents, depth, rank = build_tree(acc, 3)
    assert (parents, rank) == ([-1, 0, -1], [0, 0, 1])            # 0.6, 0.6*0.5, then 0.2


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_monte_carlo_tree_sampling_matches_target(heads, method, monkeypatch):
    """Seeded Monte Carlo over two-token sequences through the whole engine; a verifier that
    accepts every candidate must fail the same threshold."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    llm = _llm(heads, method, 6)
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)
    good = total_variation(first_two_tokens(llm, prompt, params, n), exact, n)
    assert good < 0.05, good
    stats = [o.stats for o in llm.generate([prompt] * 4, [dataclasses.replace(params, seed=s, max_tokens=32)
                                                          for s in range(4)])]
    assert sum(s.accepted_tokens for s in stats) > 0
    assert all(s.draft_tokens > s.num_drafts for s in stats)      # trees, not chains

    real = verify_mod.sibling_plan

    def accept_all(p, q, candidates):            # never rejects: the output follows the heads
        acc, final = real(p, q, candidates)
        return [1.0] * len(acc), final

    monkeypatch.setattr(verify_mod, "sibling_plan", accept_all)
    bad = total_variation(first_two_tokens(llm, prompt, params, n), exact, n)
    assert bad > 0.05, bad     # the subtler rules are pinned by exact enumeration (test_tree.py)


def test_proposals_stay_in_the_draft_vocabulary(heads):
    llm = _llm(heads, "eagle", 8)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    draft = _eagle_draft(llm, prompt, torch.randn(len(prompt) - 1, 64), 8)
    assert draft.k == 8 and all(t % 2 == 0 for t in draft.tokens.tolist())


def _ctx(llm, params):
    from specdec.proposers import RequestContext
    return RequestContext(params, torch.Generator().manual_seed(0), llm.target.config.vocab_size)


def _eagle_draft(llm, prompt, feats, k, rid="t"):
    """A fresh EAGLE request in the LLM's own pool: feed the prompt's features, draft k."""
    from specdec.proposers import Committed, ProposeItem

    proposer, blocks = llm.engine.proposer, llm.engine.blocks
    blocks.add(rid)
    blocks.ensure(rid, len(prompt) + proposer.lookahead_slots(k) + 1)
    try:
        proposer.add_request(rid, _ctx(llm, GREEDY))
        proposer.update([Committed(rid, prompt, len(prompt) - 1, feats, prefill=True)])
        return proposer.propose([ProposeItem(rid, prompt, k)])[0]
    finally:
        proposer.remove_request(rid)
        blocks.remove(rid)


def test_heads_errors_are_one_line(heads, tmp_path, capsys):
    target = load_model(heads["target"], "float32")
    with pytest.raises(CheckpointError, match="needs Medusa heads"):
        load_heads(heads["eagle"], target, "SpecdecMedusaHeads")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_heads(tmp_path, target)
    cfg = json.loads((heads["medusa"] / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="hidden size 32"):
        load_heads(bad, target)
    with pytest.raises(ValueError, match="model is required for method 'medusa'"):
        LLM(model=heads["target"], dtype="float32", speculative_config={"method": "medusa"})
    rc = main(["generate", "x", "--model", str(heads["target"]), "--speculative-config",
               json.dumps({"method": "eagle", "model": str(heads["eagle"]), "topk": 0})])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "topk must be an integer in [1, 16]" in err and "\n" not in err


def test_train_medusa_and_eagle_tiny_end_to_end(heads, tmp_path):
    """A few steps each on the tiny target's own generations; a resumed run equals a straight one."""
    from specdec.train.heads import HeadsConfig, train_heads

    data = tmp_path / "data"
    for kind in ("medusa", "eagle"):
        cfg = HeadsConfig(kind=kind, steps=6, batch=32 if kind == "medusa" else 2, window=16, shards=2, val_shards=2,
                          num_heads=2, draft_vocab=48, corpus_limit_mb=0.2, save_every=3)
        first = train_heads(cfg, heads["target"], tmp_path / f"{kind}-a", tmp_path / f"w-{kind}-a", data,
                            command=f"specdec train {kind}", stop_after=3, report_prompts=0)
        assert first == {"finished": False, "step": 3}
        train_heads(cfg, heads["target"], tmp_path / f"{kind}-a", tmp_path / f"w-{kind}-a", data,
                    command=f"specdec train {kind}", report_prompts=0)
        r = train_heads(cfg, heads["target"], tmp_path / f"{kind}-b", tmp_path / f"w-{kind}-b", data,
                        command=f"specdec train {kind}", report_prompts=2)
        target = load_model(heads["target"], "float32")
        a, b = load_heads(tmp_path / f"{kind}-a", target), load_heads(tmp_path / f"{kind}-b", target)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
        card = (tmp_path / f"{kind}-b" / "README.md").read_text()
        assert f"specdec train {kind}" in card and "mean accepted length" in card
        assert r["speculation"]["tree8_greedy"]["mean_accepted_length"] >= 1.0
        llm = LLM(model=heads["target"], dtype="float32",
                  speculative_config={"method": kind, "model": str(tmp_path / f"{kind}-b"), "num_speculative_tokens": 4})
        assert tokens(llm, PROMPTS[:4], GREEDY) == tokens(heads["plain"], PROMPTS[:4], GREEDY)


def test_train_medusa_freeze_lm_head_keeps_the_target_rows(heads, tmp_path):
    """--freeze-lm-head: the heads' shared LM head stays the target's rows over the draft
    vocabulary while the residual blocks train; without it the head moves."""
    from specdec.train.heads import HeadsConfig, train_heads

    target = load_model(heads["target"], "float32")
    for freeze in (True, False):
        cfg = HeadsConfig(kind="medusa", steps=4, batch=32, shards=2, val_shards=2, num_heads=2, draft_vocab=48,
                          corpus_limit_mb=0.2, freeze_lm_head=freeze)
        out = tmp_path / f"m-{freeze}"
        train_heads(cfg, heads["target"], out, tmp_path / f"w-{freeze}", tmp_path / "data",
                    command="specdec train medusa", report_prompts=0)
        m = load_heads(out, target)
        rows = target.lm_head.weight[m.draft_vocab].bfloat16().to(m.lm_head.weight.dtype)   # saved in bf16
        assert torch.equal(m.lm_head.weight, rows) == freeze
        assert not torch.equal(m.blocks[0].weight, torch.zeros_like(m.blocks[0].weight))


def test_typical_acceptance_is_opt_in_and_lossy(heads):
    """Medusa's typical acceptance must be asked for, leaves greedy alone, and is not exact:
    here it always takes a candidate the target would pick half the time."""
    from specdec.verify import verify_tree_typical

    assert _llm(heads, "medusa", 4).engine.typical is None
    llm = _llm(heads, "medusa", 4, acceptance_method="typical_acceptance_sampler")
    assert llm.engine.typical == (0.09, 0.3)
    assert tokens(llm, PROMPTS[:4], GREEDY) == tokens(heads["plain"], PROMPTS[:4], GREEDY)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    g = torch.Generator().manual_seed(0)
    firsts = {verify_tree_typical([0], [-1], p, g)[1][0] for _ in range(50)}
    assert firsts == {0}                   # exact sampling would give 1 half of the time
    with pytest.raises(ValueError, match="acceptance_method must be one of"):
        _llm(heads, "medusa", 4, acceptance_method="greedy")


def test_generate_cli_with_heads_compares_equal(heads, capsys):
    """`specdec generate --speculative-config` with a heads folder: --compare reports identical
    output to plain decoding."""
    for method in ("medusa", "eagle"):
        spec = json.dumps({"method": method, "model": str(heads[method]), "num_speculative_tokens": 4})
        rc = main(["generate", "def add(a, b):", "--model", str(heads["target"]), "--dtype", "float32",
                   "--speculative-config", spec, "--max-tokens", "16", "--ignore-eos", "--compare", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["compare"]["identical"] is True, out


def test_eagle_c_chain_drafts_what_the_python_chain_drafts(heads):
    fast, slow = _llm(heads, "eagle", 6, topk=1), _llm(heads, "eagle", 6, topk=1)
    slow.engine.proposer.c_chain = False      # the Python chain, one head forward per depth
    assert fast.engine.proposer.c_chain
    prompt = fast.tokenizer.encode(PROMPTS[3])
    feats = fast.target(torch.tensor([prompt[:-1]]), hidden=True).hidden[0]
    drafted = _eagle_draft(fast, prompt, feats, 6).tokens.tolist()
    assert _eagle_draft(slow, prompt, feats, 6).tokens.tolist() == drafted and len(drafted) == 6


def test_unrolled_training_chain_is_the_serving_chain(heads):
    """Training at depth s (eagle_unroll.unrolled, --unroll) computes what the engine's chain
    computes at draft position s + 1 from the head's own features through its KV cache: the
    depths trained are the depths served (teacher forcing alone trained depth 0 only)."""
    check_unrolled_is_the_serving_chain(heads["target"], heads["eagle"])


def check_unrolled_is_the_serving_chain(target_dir, eagle_dir) -> None:
    """(Also run on a Qwen3 target by test_qwen3.py: its head's layer norms q and k per head.)"""
    from specdec.model import ForwardBatch
    from specdec.train.eagle_unroll import unrolled

    target = load_model(target_dir, "float32")
    head = load_heads(eagle_dir, target)
    torch.manual_seed(0)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)          # predicted features unlike the inputs
        for name, p in head.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 2.0)
    W, D = 12, target.config.hidden_size
    feats, toks = torch.randn(W, D), torch.randint(0, target.config.vocab_size, (W + 1,))
    embeds = target.model.embed_tokens(toks[1:])
    with torch.no_grad():
        depths = unrolled(head, feats[None], embeds[None], 3)
        assert torch.allclose(depths[0][0][0], head(feats[None], embeds[None]).logits[0], atol=1e-5)
        for t in (2, 5, 9):
            kv = head.decoder.new_cache(1, 32)
            out = head(feats[:t], embeds[:t], kv, ForwardBatch.build(kv, [0], [t], [0]))
            for s in (1, 2):      # chain slot t + s - 1: (the last predicted feature, the next token)
                out = head(out.hidden[-1:], embeds[t + s - 1:t + s], kv, ForwardBatch.build(kv, [0], [1], [t + s - 1]))
                assert torch.allclose(depths[s][0][0, t + s - 1], out.logits[0], atol=1e-4), (t, s)
                assert torch.allclose(depths[s][1][0, t + s - 1], out.hidden[0], atol=1e-4), (t, s)


def test_eagle_python_chains_of_a_batch_draft_what_each_drafts_alone(heads):
    """The Python chain (a GPU's) drafts every greedy row of a batch in one argmax per depth;
    rows that stop early (smaller k) and a row with controls (drafted one by one) keep the
    drafts each request gets alone."""
    from specdec import SamplingParams
    from specdec.proposers import Committed, ProposeItem, RequestContext

    llm = _llm(heads, "eagle", 6, topk=1)
    proposer, blocks, engine = llm.engine.proposer, llm.engine.blocks, llm.engine
    proposer.c_chain = None
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    feats = [llm.target(torch.tensor([p[:-1]]), hidden=True).hidden[0] for p in prompts]
    ks = [2, 6, 4]

    def draft(rows: list[int], params: list) -> list[list[int]]:
        ids = [f"r{i}" for i in rows]
        for i, rid in zip(rows, ids):
            blocks.add(rid)
            blocks.ensure(rid, len(prompts[i]) + proposer.lookahead_slots(ks[i]) + 1)
            ctx = RequestContext(params[i], torch.Generator().manual_seed(0), llm.target.config.vocab_size,
                                 engine.controls(prompts[i], params[i]))
            proposer.add_request(rid, ctx)
        try:
            proposer.update([Committed(rid, prompts[i], len(prompts[i]) - 1, feats[i], prefill=True)
                             for i, rid in zip(rows, ids)])
            out = proposer.propose([ProposeItem(rid, prompts[i], ks[i]) for i, rid in zip(rows, ids)])
            return [d.tokens.tolist() for d in out]
        finally:
            for rid in ids:
                proposer.remove_request(rid)
                blocks.remove(rid)

    params = [GREEDY] * 3
    alone = [draft([i], params)[0] for i in range(3)]
    assert [len(d) for d in alone] == ks
    assert draft([0, 1, 2], params) == alone
    banned = alone[2][1]           # row 2 with a control: its second draft token banned
    params[2] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={banned: -100.0})
    together = draft([0, 1, 2], params)
    assert together[:2] == alone[:2] and together == [draft([i], params)[0] for i in range(3)]
    assert together[2][0] == alone[2][0] and together[2][1] != banned


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_auto_defers_the_heads_update_while_a_request_does_not_draft(heads, monkeypatch, topk):
    """Under "auto" a request that drafts nothing leaves EAGLE's head alone: its steps' features
    are kept and handed over in one update when it drafts again (or after DEFER_ROWS rows). The
    greedy output stays plain's; the head runs far fewer updates."""
    from specdec import engine as engine_module

    plain = tokens(heads["plain"], PROMPTS[:3], GREEDY)
    llm = _llm(heads, "eagle", "auto", topk=topk)
    schedule = None
    monkeypatch.setattr(llm.engine.policy.goodput, "choose", lambda seqs, prompt_tokens=0: [next(schedule)] * len(seqs))
    items = []
    update = llm.engine.proposer.update

    def counted(batch):
        items.extend((it.prefill, len(it.hidden)) for it in batch)
        return update(batch)

    monkeypatch.setattr(llm.engine.proposer, "update", counted)
    outputs = {}
    for defer in (False, True):
        del items[:]
        schedule = iter([0, 0, 0, 4, 0, 0, 0, 0, 0, 2, 3, 0] * 100)
        if not defer:       # every step's update at once, as with a fixed K
            monkeypatch.setattr(llm.engine, "_update_proposer", lambda plan, committed: llm.engine.proposer.update(committed))
        else:
            monkeypatch.delattr(llm.engine, "_update_proposer")
        outputs[defer] = tokens(llm, PROMPTS[:3], GREEDY)
        counts = [n for prefill, n in items if not prefill]
        if not defer:
            every = len(counts)
    assert outputs[False] == outputs[True] == plain
    # one update per request and step before; now a catch-up when drafting resumes and one after each drafting step
    assert not llm.engine._deferred and len(counts) < 0.6 * every and max(counts) >= 5
    # a batch whose requests never draft: only the prompts reach the head, then DEFER_ROWS rows at a time
    monkeypatch.setattr(engine_module, "DEFER_ROWS", 8)
    monkeypatch.setattr(llm.engine.policy.goodput, "choose", lambda seqs, prompt_tokens=0: [0] * len(seqs))
    del items[:]
    assert tokens(llm, PROMPTS[:3], GREEDY) == plain
    decoding = [n for prefill, n in items if not prefill]
    assert decoding and all(n == 8 for n in decoding)


def test_auto_models_eagle_chains_as_chains_and_trees_as_trees(heads):
    """EAGLE at topk 1 drafts chains: "auto" estimates them per position (a long chain it rarely
    tried from the positions before it); at topk > 1 by tree size."""
    from specdec.goodput import ChainAcceptance, TreeAcceptance

    chain, tree = _llm(heads, "eagle", "auto", topk=1), _llm(heads, "eagle", "auto", topk=3)
    assert chain.engine.proposer.caps.chain and not tree.engine.proposer.caps.chain
    assert isinstance(chain.engine.policy.goodput.acceptance[True], ChainAcceptance)
    assert isinstance(tree.engine.policy.goodput.acceptance[True], TreeAcceptance)
    plain = tokens(heads["plain"], PROMPTS[:2], GREEDY)
    assert tokens(chain, PROMPTS[:2], GREEDY) == plain == tokens(tree, PROMPTS[:2], GREEDY)


def test_auto_defers_a_draft_models_catch_up_and_keeps_plains_output(heads, tiny_pair, monkeypatch):
    """The draft model's update (its own forward over the kept tokens) is deferred the same way
    under "auto": skipped while a request drafts nothing, merged when it drafts again."""
    plain = tokens(heads["plain"], PROMPTS[:4], GREEDY)
    llm = LLM(model=tiny_pair[0], dtype="float32", max_num_seqs=4,
              speculative_config={"model": str(tiny_pair[1]), "num_speculative_tokens": "auto"})
    schedule = iter([0, 0, 3, 0, 0, 0, 0, 2, 0, 4] * 200)
    monkeypatch.setattr(llm.engine.policy.goodput, "choose", lambda seqs, prompt_tokens=0: [next(schedule)] * len(seqs))
    calls = []
    update = llm.engine.proposer.update
    monkeypatch.setattr(llm.engine.proposer, "update", lambda items: (calls.append(len(items)), update(items))[1])
    assert tokens(llm, PROMPTS[:4], GREEDY) == plain
    assert calls and not llm.engine._deferred


def test_disable_by_batch_size_defers_eagle_then_catches_up(heads):
    """vLLM's disable_by_batch_size with a fixed K: while 3 or more requests run nobody drafts (and
    EAGLE's head is not run); as they finish, the rest draft again after one catch-up update, with
    plain's greedy output."""
    from specdec import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 10, 24, 40)]
    prompts = PROMPTS[:4]
    plain = [o.outputs[0].token_ids for o in heads["plain"].generate(prompts, params)]
    llm = _llm(heads, "eagle", 3, topk=1, disable_by_batch_size=3)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.stats.draft_tokens for o in outs[2:]) > 0 and not llm.engine._deferred


@pytest.mark.parametrize("method,extra", [("eagle", {"topk": 1}), ("eagle", {}), ("medusa", {})],
                         ids=["eagle-chain", "eagle-tree", "medusa"])
def test_learned_drafters_under_cuda_graphs_keep_the_eager_greedy_output(heads, method, extra, monkeypatch):
    """The GPU's path (no C kernels, padded attention) with the target's forwards as CUDA graphs
    (emulated here): the heads' features (hidden=True) and tree verifications come out of the graphs,
    and every greedy output is the eager engine's."""
    from specdec import kernels
    from specdec.model import batch as batch_module
    from specdec.model import graphs as graphs_module

    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(batch_module, "PADDED", True)
    monkeypatch.setattr(graphs_module, "EMULATE", True)
    outs = []
    for graphs in (None, {"cudagraph_mode": "FULL_DECODE_ONLY"}):
        llm = LLM(model=heads["target"], dtype="float32", compilation_config=graphs, max_num_seqs=4,
                  speculative_config={"method": method, "model": str(heads[method]), "num_speculative_tokens": 3, **extra})
        outs.append(tokens(llm, PROMPTS, GREEDY))
        if graphs:
            stats = llm.engine.graphs.stats
            assert stats["replayed"] > 5 and all(k[4] for k in llm.engine.graphs.graphs), stats   # features
    assert outs[0] == outs[1]


def test_typical_acceptance_bar_is_the_smaller_of_threshold_and_entropy_term():
    """Medusa's rule: accept x when p(x) > min(threshold, alpha * exp(-H(p))). A flat p (high
    entropy) lowers the bar below the threshold: a candidate under the threshold but over the
    entropy term is taken; a peaked p raises the entropy term past the threshold, which then bars."""
    from specdec.verify import verify_tree_typical

    g = torch.Generator().manual_seed(0)
    flat = torch.full((2, 8), 1 / 8)                     # H = ln 8: alpha e^-H = 0.3 / 8 = 0.0375 < 0.09
    assert verify_tree_typical([3], [-1], flat, g, threshold=0.2, alpha=0.3)[0] == [0]     # 0.125 > 0.0375
    assert verify_tree_typical([3], [-1], flat, g, threshold=0.1, alpha=0.3)[0] == [0]     # 0.125 > 0.0375
    peaked = torch.tensor([[0.94, 0.06, 0.0], [1 / 3, 1 / 3, 1 / 3]])   # H ~ 0.23: alpha e^-H ~ 0.24
    assert verify_tree_typical([1], [-1], peaked, g, threshold=0.05, alpha=0.3)[0] == [0]   # 0.06 > min = 0.05
    assert verify_tree_typical([1], [-1], peaked, g, threshold=0.09, alpha=0.3)[0] == []    # 0.06 < 0.09
