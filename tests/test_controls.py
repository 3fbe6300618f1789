"""Penalties, logit bias, bad words, min_tokens and a grammar mask, exactly.

The controls read the sequence before each row, so under speculation a row at draft position i
must be processed with drafts 0..i-1 counted as output. These tests check the vectorised
controls against a plain loop written from the definitions (vLLM's / OpenAI's), then enumerate
the exact output distribution of a two-token continuation under speculation (the batch
verifier's p, the proposers' q) and compare it with plain decoding's, for a draft model (q
sampled), n-gram lookup (fixed drafts, cut where they leave the grammar) and trees (sampled and
fixed candidates).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from specdec.config import SamplingParams, StructuredOutputsParams
from specdec.proposers import Draft, RequestContext
from specdec.sampling import Controls, Row, adjust_rows, process
from specdec.structured import GrammarCompiler
from specdec.verifier import controlled_logits, cut_to_grammar, target_probs
from specdec.verify import rejection_plan

from test_tree import exact_tree_distribution
from test_verify import V, _tables, exact_step_distribution

EOS = 4
PROMPT = [1, 3, 3]
OUTPUT = [0, 2]                      # committed output: "ac", inside the grammar below
REGEX = "[ab][ca]*d?"                # tokens a b c d, EOS = 4


def tiny_tokenizer():
    """Five tokens: a b c d and </s> (EOS), byte-level, for a real llguidance grammar."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "d": 3}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("</s>", special=True)])
    return SimpleNamespace(backend=tk)


def allowed_by_regex(seq: tuple) -> set[int]:
    """REGEX's next tokens after seq, by hand (independent of llguidance). Past EOS only EOS
    stays allowed (nothing else can follow; the enumeration goes on past it)."""
    if EOS in seq:
        return {EOS}
    text = "".join("abcd"[t] for t in seq)
    if not text:
        return {0, 1}
    if text[0] not in "ab" or any(ch not in "ca" for ch in text[1:-1]) or (len(text) > 1 and text[-1] not in "cad"):
        raise AssertionError(f"{text!r} left the grammar")
    return {EOS} if text.endswith("d") and len(text) > 1 else {0, 2, 3, EOS}


def reference(logits: torch.Tensor, params: SamplingParams, output: list[int], bad_words, grammar: bool) -> torch.Tensor:
    """One row's controls by their definitions, a token at a time."""
    x = logits.clone().float()
    if grammar:
        for t in set(range(V)) - allowed_by_regex(tuple(output)):
            x[t] = float("-inf")
    banned = {EOS} if len(output) < params.min_tokens else set()
    banned |= {w[-1] for w in bad_words if len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1]}
    y = x.clone()
    for t in banned:
        y[t] = float("-inf")
    if all(v == float("-inf") for v in y.tolist()):
        y = x
    for t, b in (params.logit_bias or {}).items():
        y[t] += b
    for t in range(V):
        c = output.count(t)
        if c or t in PROMPT:
            y[t] = y[t] / params.repetition_penalty if y[t] > 0 else y[t] * params.repetition_penalty
        y[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return y


CONTROLS = {
    "penalties": dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3),
    "bias+min_tokens": dict(logit_bias={1: 2.0, 3: -1.5}, min_tokens=3),
    "bad_words": dict(repetition_penalty=0.8, frequency_penalty=-0.5),
    "grammar+penalties": dict(presence_penalty=-0.5, repetition_penalty=1.5, top_k=4,
                              structured_outputs=StructuredOutputsParams(regex=REGEX)),
}
BAD_WORDS = {"bad_words": [[0, 1], [3]]}     # "b" after "a"; "d" anywhere


def make_controls(name: str, **sampling) -> tuple[SamplingParams, Controls]:
    params = SamplingParams(**{"temperature": 1.0, **CONTROLS[name], **sampling})
    grammar = None
    if params.structured_outputs is not None:
        grammar = GrammarCompiler(tiny_tokenizer(), V, [EOS]).grammar(params.structured_outputs)
        grammar.advance(OUTPUT)
    return params, Controls(params, PROMPT, BAD_WORDS.get(name, []), [EOS], grammar)


def reference_p(name, params, controls, table):
    return lambda prefix: process(reference(table("p", prefix), params, OUTPUT + list(prefix),
                                            controls.bad_words, controls.grammar is not None)[None], params)[0]


NEIGHBOUR = SamplingParams(temperature=0.9, top_k=2)


def _req(params, controls, seq):
    return SimpleNamespace(params=params, seq=seq, ctx=SimpleNamespace(controls=controls, generator=None))


def verifier_p(params, controls, table, tree: bool):
    """p after prefix as the batch verifier computes it: the row of a request whose draft puts
    prefix on a chain (or on a tree beside a sibling branch), next to an uncontrolled request."""
    g = torch.Generator().manual_seed(5)

    def p_of(prefix):
        prefix = list(prefix)
        if tree and prefix:      # a sibling branch first: node 0 = another token under the root
            sib = (prefix[0] + 1) % V
            tokens, parents = [sib] + prefix, [-1, -1] + list(range(1, len(prefix)))
            paths = [[], [sib]] + [prefix[:j] for j in range(1, len(prefix) + 1)]
            draft = Draft(torch.tensor(tokens), parents=parents)
        else:
            paths = [prefix[:j] for j in range(len(prefix) + 1)]
            draft = Draft(torch.tensor(prefix, dtype=torch.long)) if prefix else None
        rows = torch.stack([table("p", tuple(p)) for p in paths])
        logits = torch.cat([torch.randn(2, V, generator=g), rows])
        reqs = [_req(NEIGHBOUR, None, [0]), _req(params, controls, PROMPT + OUTPUT)]
        ks = [1, len(paths) - 1]
        adjusted = controlled_logits(reqs, [Draft(torch.tensor([1])), draft], logits, [0, 2])
        return target_probs(reqs, ks, adjusted, [0, 2])[1][-1]
    return p_of


def proposer_q(params, controls, table):
    """q after prefix as the proposers compute it (RequestContext.adjust, then process)."""
    ctx = RequestContext(params, torch.Generator(), V, controls)
    return lambda prefix: process(ctx.adjust(table("q", prefix)[None], PROMPT + OUTPUT, [list(prefix)]), params)[0]


def assert_plain(got: dict, p_ref) -> None:
    first = p_ref(())
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    for a, b in itertools.product(range(V), repeat=2):
        want = first[a].item() * (p_ref((a,))[b].item() if first[a] > 0 else 0.0)
        assert abs(got.get((a, b), 0.0) - want) < 1e-6, (a, b, got.get((a, b), 0.0), want)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_adjust_rows_equals_the_definitions(name):
    """Rows of two requests with different histories and paths, against the loop."""
    params, controls = make_controls(name)
    other, other_controls = make_controls("penalties", temperature=0.5)
    g = torch.Generator().manual_seed(0)
    paths = [[], [0], [0, 2], [2, 3]]          # all inside the grammar after "ac"
    rows = [Row(controls, OUTPUT, p) for p in paths] + [Row(other_controls, [3, 3, 1], p) for p in ([], [1])]
    logits = torch.randn(len(rows), V, generator=g) * 2
    got = adjust_rows(logits, rows)
    for r, row in enumerate(rows):
        want = reference(logits[r], row.controls.params, row.output + row.path, row.controls.bad_words,
                         row.controls.grammar is not None)
        assert torch.allclose(got[r], want, atol=1e-6), (r, got[r], want)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_draft_model_chain_distribution_equals_plain(name, K):
    """q drawn by the draft (processed with the same controls at each position)."""
    params, controls = make_controls(name)
    table = _tables(seed=11 + K, K=K, zero_q=False)
    got = exact_step_distribution(K, params, table, p_of=verifier_p(params, controls, table, tree=False),
                                  q_of=proposer_q(params, controls, table))
    assert_plain(got, reference_p(name, params, controls, table))


def fixed_chain_distribution(draft: list[int], p_of) -> dict:
    """A fixed (n-gram) draft: every acceptance pattern with rejection_plan's probabilities."""
    K, out = len(draft), {}
    p = torch.stack([p_of(tuple(draft[:j])) for j in range(K + 1)])
    acc, cand = rejection_plan(torch.tensor(draft, dtype=torch.long), None, p)
    for n in range(K + 1):
        w = torch.prod(acc[:n]).item() * ((1 - acc[n].item()) if n < K else 1.0)
        for y in range(V):
            emitted = draft[:n] + [y]
            wy = w * cand[n, y].item()
            if wy == 0:
                continue
            pairs = [(tuple(emitted[:2]), 1.0)] if len(emitted) >= 2 else \
                [((y, b), pb) for b, pb in enumerate(p_of((y,)).tolist())]
            for key, pk in pairs:
                out[key] = out.get(key, 0.0) + wy * pk
    return out


@pytest.mark.parametrize("name", list(CONTROLS))
def test_ngram_fixed_drafts_distribution_equals_plain(name):
    """Every fixed draft of two tokens, those leaving the grammar cut by cut_to_grammar."""
    params, controls = make_controls(name)
    table = _tables(seed=21, K=2, zero_q=False)
    p_ref, p_of = reference_p(name, params, controls, table), verifier_p(params, controls, table, tree=False)
    cut = 0
    for draft in itertools.product(range(V), repeat=2):
        d = Draft(torch.tensor(draft))
        if controls.grammar is not None:
            d = cut_to_grammar(d, controls.grammar)
            cut += d.k < 2
        assert_plain(fixed_chain_distribution(d.tokens.tolist(), p_of), p_ref)
    assert (cut > 0) == (controls.grammar is not None)


@pytest.mark.parametrize("fixed", [False, True], ids=["sampled", "fixed-candidates"])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_tree_distribution_equals_plain(name, fixed):
    """Medusa / EAGLE-shaped trees: each node's p and q from its own path."""
    params, controls = make_controls(name)
    table = _tables(seed=31, K=3, zero_q=False)
    got = exact_tree_distribution(params, table, fixed, p_of=verifier_p(params, controls, table, tree=True),
                                  q_of=proposer_q(params, controls, table))
    assert_plain(got, reference_p(name, params, controls, table))


def test_processing_without_the_drafts_history_is_caught():
    """A verifier that processed every row with the committed output only (the drafts not
    counted) must fail the same comparison."""
    params, controls = make_controls("penalties")
    table = _tables(seed=12, K=2, zero_q=False)

    def stale(prefix):
        return process(adjust_rows(table("p", prefix)[None], [Row(controls, OUTPUT, [])]), params)[0]
    got = exact_step_distribution(2, params, table, p_of=stale, q_of=proposer_q(params, controls, table))
    with pytest.raises(AssertionError):
        assert_plain(got, reference_p("penalties", params, controls, table))


def test_tree_fixed_candidates_leaving_the_grammar_are_pruned():
    params, controls = make_controls("grammar+penalties")
    # root -> b (invalid after "ac"), c; c -> d, b (invalid after "acc")
    draft = Draft(torch.tensor([1, 2, 3, 1]), parents=[-1, -1, 1, 1])
    cut = cut_to_grammar(draft, controls.grammar)
    assert cut.tokens.tolist() == [2, 3] and cut.parents == [-1, 0]


def test_forced_tokens_fill_short_chains():
    """Where the grammar leaves no choice, its tokens fill a chain up to k: fixed drafts (a
    one-hot q where the chain carries q), so the enumerations above cover their exactness."""
    from specdec.verifier import extend_with_forced

    grammar = GrammarCompiler(tiny_tokenizer(), V, [EOS]).grammar(StructuredOutputsParams(regex="abc(a|d)"))
    assert extend_with_forced(None, grammar, 4).tokens.tolist() == [0, 1, 2]
    assert extend_with_forced(None, grammar, 2).tokens.tolist() == [0, 1]
    q = torch.full((1, V), 0.2)
    got = extend_with_forced(Draft(torch.tensor([0]), q), grammar, 3)
    assert got.tokens.tolist() == [0, 1, 2] and torch.equal(got.probs[1:], torch.eye(V)[[1, 2]])
    assert extend_with_forced(Draft(torch.tensor([1])), grammar, 3).tokens.tolist() == [1]   # left the grammar
    grammar.advance([0, 1, 2])
    assert extend_with_forced(None, grammar, 3) is None                                        # a choice: a or d


@pytest.mark.parametrize("name", list(CONTROLS))
def test_every_row_of_a_chain_is_controlled_with_its_own_path(name):
    """controlled_logits processes row j of a chain with the first j drafts counted as output
    (penalties, bad words, min_tokens, the grammar), each row against the definitions; a path
    one draft too long on the earlier rows had passed the tests that read the last row only."""
    from specdec.verifier import row_paths

    params, controls = make_controls(name)
    assert row_paths(Draft(torch.tensor([0, 2]))) == [[], [0], [0, 2]]
    assert row_paths(Draft(torch.tensor([0, 2, 3]), parents=[-1, 0, 0])) == [[], [0], [0, 2], [0, 3]]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 + 3, V, generator=g) * 2
    reqs = [_req(NEIGHBOUR, None, [0]), _req(params, controls, PROMPT + OUTPUT)]
    got = controlled_logits(reqs, [Draft(torch.tensor([1])), Draft(torch.tensor([0, 2]))], logits, [0, 2])
    assert torch.equal(got[:2], logits[:2])                    # the uncontrolled neighbour is left alone
    for j, path in enumerate([[], [0], [0, 2]]):
        want = reference(logits[2 + j], params, OUTPUT + path, controls.bad_words, controls.grammar is not None)
        assert torch.allclose(got[2 + j], want, atol=1e-6), (name, j)


def test_a_sampled_draft_that_leaves_the_grammar_is_kept_as_the_last():
    """cut_to_grammar: a fixed draft (no q) is cut before its first forbidden token (exact: p of it
    is 0 after the mask); a draft drawn from q keeps that token as its last, because its rejection
    must still draw from norm(max(0, p - q)) (dropping it would sample p instead: inexact)."""
    from specdec.verifier import cut_to_grammar

    _, controls = make_controls("grammar+penalties")
    grammar = controls.grammar
    tokens = [0, 2, 3, 1]
    n = grammar.valid_prefix(tokens)
    assert 0 < n < len(tokens)                      # a forbidden token inside the draft
    fixed = cut_to_grammar(Draft(torch.tensor(tokens)), grammar)
    assert fixed.tokens.tolist() == tokens[:n] and fixed.probs is None
    q = torch.full((len(tokens), V), 1 / V)
    drawn = cut_to_grammar(Draft(torch.tensor(tokens), q), grammar)
    assert drawn.tokens.tolist() == tokens[:n + 1] and torch.equal(drawn.probs, q[:n + 1])
