"""Whatever a proposer drafts, the output is plain decoding's (a tester's adversarial proposers):
a tree whose parents do not match its tokens, a draft longer than the k asked for, a q of the
wrong width are dropped or cut in the engine (the request decodes plainly that step); a drafted
token that q gives probability 0 (or NaN), a duplicated sibling among them, is rejected, so no
token the target forbids is ever emitted."""

from __future__ import annotations

import collections

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.proposers.base import Draft, ProposerBase, ProposerCaps
from specdec.sampling import process

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TOP3 = dict(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)


class Fn(ProposerBase):
    name = "adversarial"

    def __init__(self, f, caps=ProposerCaps()):
        super().__init__()
        self.f, self.caps = f, caps

    def propose(self, items):
        return [self.f(it, self.ctx[it.request_id]) for it in items]


@pytest.fixture(scope="module")
def setup(tiny_pair):
    target, _ = tiny_pair
    llm = LLM(model=str(target), dtype="float32", num_speculative_tokens=0)
    prompt = llm.tokenizer.encode("def add(a, b):")
    want = [t for e in llm.engine.generate(prompt, GREEDY) for t in e.token_ids]
    return llm, prompt, want


def engine(llm, f, k, caps=ProposerCaps()):
    return Engine(llm.target, llm.tokenizer, Fn(f, caps), k, llm.engine.max_model_len)


def run(eng, prompt, params=GREEDY):
    return [t for e in eng.generate(prompt, params) for t in e.token_ids]


@pytest.mark.parametrize("parents", [[-1, 0, -1], [-1, 0, -1, 2, 2, 4], [-1, 1, 0, 1], [-1, 0, 5, 1]])
def test_trees_whose_parents_do_not_fit_their_tokens(setup, parents):
    """Fewer parents than tokens gave other output than plain's; more crashed the process in the C
    forward; a parent after its child or out of range failed the step."""
    llm, prompt, want = setup

    def tree(it, ctx):
        pos = len(it.seq) - len(prompt)
        return Draft(torch.tensor((want[pos:] + [5] * 4)[:4]), None, list(parents))

    assert run(engine(llm, tree, 6, ProposerCaps(tree=True)), prompt) == want


def test_a_draft_longer_than_asked_is_cut(setup):
    """A chain past the k asked for (17 tokens more): the step raised (slots beyond the allocation) and
    took the other request of the batch down with it."""
    llm, prompt, want = setup
    eng = engine(llm, lambda it, c: Draft(torch.tensor((want[len(it.seq) - len(prompt):] + [5] * 40)[:it.k + 17])), 3)
    good, bad = eng.add_request(prompt, GREEDY, request_id="good"), eng.add_request(prompt, GREEDY, request_id="bad")
    while eng.has_unfinished():
        eng.step()
    assert good.out == bad.out == want


def _allowed(llm, prompt) -> list[int]:
    with torch.no_grad():
        p = process(llm.target(torch.tensor([prompt])).logits[0, -1:], SamplingParams(**TOP3))[0]
    return torch.nonzero(p).flatten().tolist()


def _first_tokens(eng, prompt, n) -> collections.Counter:
    reqs = [eng.add_request(prompt, SamplingParams(**TOP3, seed=s)) for s in range(n)]
    while eng.has_unfinished():
        eng.step()
    return collections.Counter(r.out[0] for r in reqs)


def test_a_token_q_gives_no_probability_is_rejected(setup):
    """top_k 3: a draft of a token outside the three, with q 0 (or NaN) there, was accepted with
    probability 1 (200 of 200 first tokens); a sampled tree's duplicated sibling has q 0 once its
    first copy is rejected, and was accepted (202 of 400)."""
    llm, prompt, _ = setup
    V = llm.target.config.vocab_size
    allowed = _allowed(llm, prompt)
    bad = next(t for t in range(V) if t not in allowed)
    q = torch.zeros(V)
    q[allowed] = 1 / 3
    qn = q.clone()
    qn[bad] = float("nan")
    for qq in (q, qn):
        got = _first_tokens(engine(llm, lambda it, c, qq=qq: Draft(torch.tensor([bad] * it.k), qq.expand(it.k, V).clone()), 2),
                            prompt, 100)
        assert set(got) <= set(allowed), got
    qd = torch.zeros(V)
    qd[[allowed[1], bad]] = 0.5

    def dup(it, c):
        x = int(torch.multinomial(qd, 1, generator=c.generator))
        return Draft(torch.tensor([x, x]), qd.expand(2, V).clone(), [-1, -1])

    got = _first_tokens(engine(llm, dup, 2, ProposerCaps(tree=True)), prompt, 200)
    assert set(got) <= set(allowed), got


def test_a_q_of_the_wrong_width_is_dropped(setup):
    """q 1000 wide on a 16384-token target: the C kernel read past it and emitted tokens the
    target gives probability 0."""
    llm, prompt, _ = setup
    allowed = _allowed(llm, prompt)
    eng = engine(llm, lambda it, c: Draft(torch.randint(0, 1000, (it.k,), generator=c.generator),
                                          torch.full((it.k, 1000), 1e-3)), 3)
    got = _first_tokens(eng, prompt, 200)
    assert set(got) <= set(allowed), got
    assert eng._warned_draft                 # dropped as malformed (what the kernel read past is chance)
