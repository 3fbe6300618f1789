"""A step's verification over the whole batch: what each decoding request feeds, and what it keeps.

The rules themselves are verify.py's pure functions; this module lays a batch out for them:
greedy chains are verified together as tensors (vLLM's placeholder-padded output), sampled
requests share one logits processing with per-row parameters and then draw from their own
generators, in the same order as alone; trees walk their node lists. Everything lands in one
[B, max_k + 1] tensor that reaches the host in one sync (plus what greedy trees need from the
target's argmax, in the same transfer). Sampled trees walk on the host afterwards, each draw
depending on the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from .model import TreeAttention
from .proposers import Draft
from .proposers.base import prune_tree
from .sampling import Row, adjust_rows, process_rows
from .verify import (PLACEHOLDER, greedy_tokens, padded_row, parse_output, verify_greedy_batch, verify_greedy_host, verify_sampling,
                     verify_tree_greedy, verify_tree_sampling, verify_tree_typical)


@dataclass(frozen=True)
class Verified:
    """One decoding request's step."""
    emitted: list[int]          # accepted drafts + the recovered / bonus token
    accepted: int
    rows: list[int]             # its fed rows that stay: 0 = the last token, i + 1 = draft (node) i
    tree: bool                  # verified under a tree mask: the kept rows must move next to the prefix
    path: list[int] | None      # the accepted nodes when a tree proposer drafted (for "auto" tree sizes)


def _is_chain(parents: list[int]) -> bool:
    return all(par == i - 1 for i, par in enumerate(parents))


def limit_depth(draft: Draft, max_depth: int) -> Draft:
    """Drop the nodes deeper than max_depth (a rule on positions only, never on the drawn
    tokens, so the verification of what remains stays exact)."""
    depth = []
    for par in draft.parents:
        depth.append(1 if par == -1 else depth[par] + 1)
    if not depth or max(depth) <= max_depth:
        return draft
    keep = [d <= max_depth for d in depth]
    tokens, parents, kept = prune_tree(draft.tokens.tolist(), draft.parents, keep)
    probs = draft.probs[kept] if draft.probs is not None and kept else None
    return Draft(torch.tensor(tokens, dtype=torch.long, device=draft.tokens.device), probs, parents)


def cut_to_grammar(draft: Draft, grammar) -> Draft:
    """Drop the drafts a grammar forbids (with everything after or below them) before they are
    verified.

    Exact: a forbidden token x has p(x) = 0 after the mask. A fixed draft (q = None, a point
    mass on x) is then accepted with probability p(x) = 0 and the token is drawn from
    norm(max(0, p - onehot(x))) = p, which is what the position draws with no draft at all;
    a fixed tree candidate likewise leaves its siblings' recursive rejection sampling as it
    was. Greedy: the masked argmax is never x. A draft drawn from q came from the masked q, so
    it never leaves the grammar; should one (a q without the mask), it is kept as the last
    draft, because its rejection must still draw from norm(max(0, p - q))."""
    tokens = draft.tokens.tolist()
    if not draft.is_tree:
        n = grammar.valid_prefix(tokens)
        keep = n if draft.probs is None else min(n + 1, len(tokens))
        if keep == len(tokens):
            return draft
        return Draft(draft.tokens[:keep], draft.probs[:keep] if draft.probs is not None else None)
    if draft.probs is not None:
        return draft
    paths, keep = [[]], []
    for i, par in enumerate(draft.parents):
        paths.append(paths[par + 1] + [tokens[i]])
        keep.append(grammar.valid_prefix(paths[-1]) == len(paths[-1]))
    if all(keep):
        return draft
    kept_tokens, parents, _ = prune_tree(tokens, draft.parents, keep)
    return Draft(torch.tensor(kept_tokens, dtype=torch.long, device=draft.tokens.device), None, parents)


def extend_with_forced(draft: Draft | None, grammar, k: int) -> Draft | None:
    """A chain shorter than k (an n-gram lookup that found little, a draft cut to the grammar)
    filled up to k with the tokens the grammar forces after it. They are drafts like any other
    (a point mass each, q = one-hot where the chain carries q), so verification stays exact;
    the target almost always agrees, since its masked p leaves it little else."""
    tokens = draft.tokens.tolist() if draft is not None else []
    if len(tokens) >= k or (draft is not None and draft.is_tree):
        return draft
    forced = grammar.forced(tokens, k - len(tokens))
    if not forced:
        return draft
    device = draft.tokens.device if draft is not None else torch.device("cpu")
    extra = torch.tensor(forced, dtype=torch.long, device=device)
    probs = None
    if draft is not None and draft.probs is not None:
        one_hot = torch.zeros(len(forced), draft.probs.shape[-1], dtype=draft.probs.dtype, device=draft.probs.device)
        probs = torch.cat([draft.probs, one_hot.scatter_(1, extra[:, None].to(one_hot.device), 1.0)])
    return Draft(torch.cat([draft.tokens, extra]) if draft is not None else extra, probs)


def tree_parents(draft: Draft | None, typical_sampled: bool) -> list[int] | None:
    """The parents to verify as a tree, or None for the chain path. Chain-shaped trees take the
    chain path (no mask, nothing to move), except under typical acceptance, which is a tree rule."""
    if draft is None:
        return None
    parents = draft.parents if draft.is_tree else list(range(-1, draft.k - 1))
    if typical_sampled or (draft.is_tree and not _is_chain(parents)):
        return parents
    return None


@lru_cache(maxsize=256)
def _tree_attention(parents: tuple[int, ...]) -> TreeAttention:
    return TreeAttention.from_parents(parents)      # static trees (Medusa's) are built once


def feed_of(last: int, draft: Draft | None, drafted: list[int], typical_sampled: bool
            ) -> tuple[list[int], TreeAttention | None]:
    """The tokens a decoding request feeds ([last, drafts or nodes...]; drafted: the draft's
    tokens on the host) and its tree mask."""
    if draft is None:
        return [last], None
    parents = tree_parents(draft, typical_sampled)
    return [last] + drafted, (_tree_attention(tuple(parents)) if parents is not None else None)


def verify_batch(reqs, drafts: list[Draft | None], logits: Tensor | None, offsets: list[int],
                 typical: tuple[float, float] | None) -> list[Verified]:
    """reqs: the decoding requests (params, ctx); drafts: theirs (None = K 0); logits [R, V]:
    the target's rows, request i's K_i + 1 rows from offsets[i], with the requests' controls
    already applied (controlled_logits: the engine applies them once and reads logprobs off
    the same rows)."""
    B = len(reqs)
    if B == 0:
        return []
    ks = [d.k if d is not None else 0 for d in drafts]
    greedy = [r.params.greedy for r in reqs]
    parents = [tree_parents(d, typical is not None and not g) for d, g in zip(drafts, greedy)]
    if all(greedy) and all(p is None for p in parents) and _packed(offsets, ks):
        return _greedy_chains(drafts, ks, logits)
    rows = [torch.arange(off, off + k + 1) for off, k in zip(offsets, ks)]
    width = max(ks) + 1
    out = torch.full((B, width), PLACEHOLDER, dtype=torch.long, device=logits.device)
    argmax = greedy_tokens(logits) if any(greedy) else None
    chains = [i for i in range(B) if greedy[i] and parents[i] is None]
    if chains:
        drafted = [drafts[i].tokens for i in chains if drafts[i] is not None]
        res = verify_greedy_batch(torch.cat(drafted).to(logits.device) if drafted else torch.empty(0, dtype=torch.long),
                                  [ks[i] for i in chains], argmax[torch.cat([rows[i] for i in chains]).to(logits.device)])
        out[torch.tensor(chains, device=logits.device), :res.shape[1]] = res
    p = target_probs(reqs, ks, logits, offsets)
    sampled = list(p)
    for i in sampled:
        if parents[i] is None:
            d = drafts[i]
            drafted = d.tokens.to(logits.device) if d is not None else torch.empty(0, dtype=torch.long, device=logits.device)
            q = d.probs.to(logits.device) if d is not None and d.probs is not None else None
            emitted, n = verify_sampling(drafted, q, p[i], reqs[i].ctx.generator)
            out[i] = padded_row(emitted, n, width)
    trees = [i for i in range(B) if greedy[i] and parents[i] is not None]
    tree_rows = torch.cat([rows[i] for i in trees]).to(logits.device) if trees else None
    # the step's one sync: every chain's output, and the argmax rows greedy trees walk
    host = torch.cat([out.flatten()] + ([argmax[tree_rows]] if trees else [])).tolist()
    emitted = parse_output([host[i * width:(i + 1) * width] for i in range(B)])
    tree_argmax, at = {}, B * width
    for i in trees:
        tree_argmax[i] = host[at:at + ks[i] + 1]
        at += ks[i] + 1
    return [_verified(i, drafts[i], parents[i], emitted[i], tree_argmax.get(i), p.get(i), reqs[i], typical)
            for i in range(B)]


def row_paths(draft: Draft | None) -> list[list[int]]:
    """The drafts before each of a request's scored rows: row 0 after the last committed token
    ([]), row i + 1 after draft (node) i: a chain's prefixes, a tree node's root-to-node path."""
    if draft is None:
        return [[]]
    tokens = draft.tokens.tolist()
    if not draft.is_tree:
        return [tokens[:j] for j in range(len(tokens) + 1)]
    paths = [[]]
    for i, par in enumerate(draft.parents):
        paths.append(paths[par + 1] + [tokens[i]])
    return paths


def controlled_logits(reqs, drafts: list[Draft | None], logits: Tensor, offsets: list[int],
                      masked: list | None = None) -> Tensor:
    """logits [R, V] with each controlled request's rows adjusted (sampling.adjust_rows): row j
    processed with the drafts on its path counted as output, as plain decoding processes that
    position once they are accepted. The same function gives the proposers' q. masked, a list:
    gets logits [R, V] with the grammar masks alone applied (vLLM applies them before its
    sampler, so its raw logprobs see them; the other controls are the sampler's)."""
    ctl = [i for i, r in enumerate(reqs) if r.ctx.controls is not None]
    if not ctl:
        if masked is not None:
            masked.append(logits)
        return logits
    rows, index = [], []
    for i in ctl:
        r, paths = reqs[i], row_paths(drafts[i])
        output = r.seq[len(r.ctx.controls.prompt):]
        rows += [Row(r.ctx.controls, output, p) for p in paths]
        index += range(offsets[i], offsets[i] + len(paths))
    index = torch.tensor(index, device=logits.device)
    grammar_only = [] if masked is not None else None
    adjusted = logits.float().index_copy(0, index, adjust_rows(logits[index], rows, grammar_only))
    if masked is not None:
        masked.append(logits.float().index_copy(0, index, grammar_only[0]))
    return adjusted


def _packed(offsets: list[int], ks: list[int]) -> bool:
    """Request i's rows start where request i - 1's end (the engine lays them out so)."""
    at = 0
    for off, k in zip(offsets, ks):
        if off != at:
            return False
        at += k + 1
    return True


def _greedy_chains(drafts, ks: list[int], logits: Tensor) -> list[Verified]:
    """Every request greedy with a chain (the common case, plain decoding included): the
    whole step is an argmax, a comparison and one sync."""
    argmax = greedy_tokens(logits)
    drafted = [d.tokens for d in drafts if d is not None]
    if not drafted:           # plain decoding: the argmax is the output
        return [Verified([t], 0, [0], False, None) for t in argmax.tolist()]
    if logits.device.type == "cpu":           # the comparison on host lists: no tensor ops to dispatch
        emitted = verify_greedy_host([d.tokens.tolist() if d is not None else [] for d in drafts], argmax.tolist())
    else:
        emitted = parse_output(verify_greedy_batch(torch.cat(drafted).to(logits.device), ks, argmax).tolist())
    return [Verified(e, len(e) - 1, list(range(len(e))), False,
                     list(range(len(e) - 1)) if d is not None and d.is_tree else None) for e, d in zip(emitted, drafts)]


def target_probs(reqs, ks: list[int], logits: Tensor, offsets: list[int]) -> dict[int, Tensor]:
    """The processed target distributions of the sampled requests' rows: {i: [K_i + 1, V]},
    every row processed at once with its own request's parameters (bit-identical to process()
    on that request's rows alone)."""
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if not sampled:
        return {}
    spans = [(offsets[i], offsets[i] + ks[i] + 1) for i in sampled]
    if all(a == b for (_, b), (a, _) in zip(spans, spans[1:])):
        rows = logits[spans[0][0]:spans[-1][1]]          # one run of rows: a view, nothing copied
    else:
        rows = logits[torch.cat([torch.arange(a, b) for a, b in spans]).to(logits.device)]
    probs = process_rows(rows, [reqs[i].params for i in sampled], [ks[i] + 1 for i in sampled])
    return dict(zip(sampled, probs.split([ks[i] + 1 for i in sampled])))


def _verified(i, draft, parents, emitted, argmax, p, req, typical) -> Verified:
    if parents is None:
        n = len(emitted) - 1
        return Verified(emitted, n, list(range(n + 1)), False,
                        list(range(n)) if draft is not None and draft.is_tree else None)
    tokens = draft.tokens.tolist()
    if req.params.greedy:
        path, emitted = verify_tree_greedy(tokens, parents, argmax)
    elif typical is not None:
        path, emitted = verify_tree_typical(tokens, parents, p, req.ctx.generator, *typical)
    else:
        q = draft.probs.to(p.device) if draft.probs is not None else None
        path, emitted = verify_tree_sampling(tokens, parents, p, q, req.ctx.generator)
    return Verified(emitted, len(path), [0] + [node + 1 for node in path], True, path)
