"""Verification: which draft tokens the target keeps, and the one token it adds.

Glossary (vLLM's): each step emits `accepted` draft tokens plus one token chosen by the target,
either a `recovered` token (sampled after a rejection) or a `bonus` token (every draft
accepted). Output tokens = accepted + recovered + bonus. p = target, q = draft.

Worked example, greedy, K = 3: drafts [a, b, c]; the target's argmax after the prefix and
after each draft is [a, b, x, y]. a and b match, c != x, so the step emits [a, b, x]:
2 accepted, 1 recovered. Had the argmax been [a, b, c, y], all 3 are accepted plus bonus y.

Sampling uses the modified rejection sampling of Leviathan et al. / Chen et al.: accept draft
x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the recovered
token from norm(max(0, p_i - q_i)); if none is rejected, draw the bonus from p_K. Each emitted
token is then distributed exactly as the target's own sample would be.

Every function returns tensors only; the caller turns them into host ints with one sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import rejection_rows
from .sampling import sample


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits.argmax(-1), the greedy choice of every row. On the CPU in fp32 through numpy, which
    picks the same index (the first maximum; a NaN counts as the maximum, as in torch) 10-25x
    faster for a step's few rows of a 49K vocabulary (3 rows: 9 us against 229 on the Xeon)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.as_tensor(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


def verify_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification.

    draft:         [K] int64     proposed tokens
    target_logits: [K+1, V]      target logits after the prefix and after each draft token
    returns (emitted [K+1] int64, num_accepted [] int64); emitted[:num_accepted + 1] are output.
    """
    best = greedy_tokens(target_logits)                           # [K+1]
    num_accepted = (draft == best[:-1]).long().cumprod(0).sum()
    return best, num_accepted


def rejection_plan(draft: Tensor, q: Tensor | None, p: Tensor) -> tuple[Tensor, Tensor]:
    """The deterministic half of rejection sampling: what is accepted with which probability,
    and what is drawn after each possible first rejection.

    draft: [K] int64         proposed tokens
    q:     [K, V] float32    the draft's processed distributions; None = deterministic draft
                             (a point mass on each proposed token, e.g. n-gram lookup)
    p:     [K+1, V] float32  the target's processed distributions
    returns (accept_prob [K] = min(1, p(x)/q(x)),
             candidates [K+1, V]: row i < K is norm(max(0, p_i - q_i)), row K is p_K (bonus))
    """
    fast = rejection_rows(draft, q, p)        # the same rule in one pass per row (kernels, CPU)
    return fast if fast is not None else rejection_plan_torch(draft, q, p)


def rejection_plan_torch(draft: Tensor, q: Tensor | None, p: Tensor) -> tuple[Tensor, Tensor]:
    """rejection_plan in PyTorch ops (GPUs, no kernels; the reference the kernel is tested on)."""
    K = draft.shape[0]
    rows = torch.arange(K, device=p.device)
    if q is None:
        q = torch.zeros_like(p[:K]).scatter_(-1, draft[:, None], 1.0)
    p_x, q_x = p[rows, draft], q[rows, draft]
    # q(x) = 0: x cannot have been drawn from q (a proposer's inconsistent q, a duplicate sibling):
    # rejected, so the position draws from the residual and never emits a token p forbids
    accept_prob = torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q_x))
    residual = (p[:K] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass 0 means p == q on that row: a rejection there has probability 0, any row will do
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:K])
    return accept_prob, torch.cat([residual, p[K:]], dim=0)


def verify_sampling(draft: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rejection-sampling verification of a chain of K drafts (shapes as in rejection_plan).

    returns (emitted [K+1] int64, num_accepted [] int64); emitted[:num_accepted + 1] are output.
    """
    accept_prob, candidates = rejection_plan(draft, q, p)
    u = torch.rand(accept_prob.shape, generator=generator, device=p.device)
    num_accepted = (u < accept_prob).long().cumprod(0).sum()
    # one draw per row, independent of u: the row used is chosen after the fact
    final = sample(candidates, generator)
    emitted = torch.cat([draft, draft.new_zeros(1)])
    return emitted.scatter(0, num_accepted[None], final.gather(0, num_accepted[None])), num_accepted


# ---------------------------------------------------------------------------------------------
# Batches (vLLM's layout). The drafts of B requests lie flat, request after request:
# num_draft[b] tokens each (0 for a request that decodes plainly), and the target scored
# num_draft[b] + 1 rows for request b, also flat. The result is one [B, max_k + 1] tensor whose
# row b holds request b's emitted tokens followed by PLACEHOLDER; the engine turns it into
# ragged host lists with one sync (`parse_output`).
#
# Worked example: num_draft [2, 0, 3], drafts [a, b | - | c, d, e], target argmax rows
# [a, x, y | z | c, d, e, w]: request 0 accepts a, then b != x, so it emits [a, x]; request 1
# emits [z]; request 2 accepts everything and adds the bonus w:
#     [[a, x, -1, -1], [z, -1, -1, -1], [c, d, e, w]]
# ---------------------------------------------------------------------------------------------

PLACEHOLDER = -1


def verify_greedy_batch(draft_tokens: Tensor, num_draft: list[int], target_argmax: Tensor) -> Tensor:
    """Greedy verification of B chains at once.

    draft_tokens:  [sum(num_draft)] int64  all requests' drafts, flat
    num_draft:     B host ints
    target_argmax: [sum(num_draft) + B] int64  the target's argmax at every scored row, flat
    returns [B, max(num_draft) + 1] int64: emitted tokens, then PLACEHOLDER
    """
    dev = target_argmax.device
    B, M = len(num_draft), max(num_draft, default=0)
    nd = torch.tensor(num_draft, device=dev)
    first_draft = torch.cumsum(nd, 0) - nd
    j = torch.arange(M + 1, device=dev)
    rows = (first_draft + torch.arange(B, device=dev))[:, None] + j               # [B, M + 1]
    tgt = target_argmax[rows.clamp(max=target_argmax.shape[0] - 1)]
    if M and draft_tokens.numel():
        drafted = draft_tokens.to(dev)[(first_draft[:, None] + j[:M]).clamp(max=draft_tokens.shape[0] - 1)]
        match = (drafted == tgt[:, :M]) & (j[:M] < nd[:, None])
        num_accepted = match.long().cumprod(1).sum(1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
    return torch.where(j <= num_accepted[:, None], tgt, torch.full_like(tgt, PLACEHOLDER))


def verify_greedy_host(drafts: list[list[int]], target_argmax: list[int]) -> list[list[int]]:
    """verify_greedy_batch on host lists (a CPU's cheaper form: a dozen tensor ops cost more
    than the comparison): drafts[b] request b's drafts, target_argmax its rows' argmax, flat
    as there; returns each request's emitted tokens (accepted drafts + recovered or bonus)."""
    out, at = [], 0
    for d in drafts:
        tgt = target_argmax[at:at + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == tgt[n]:
            n += 1
        out.append(tgt[:n + 1])
        at += len(d) + 1
    return out


def padded_row(emitted: Tensor, num_accepted: Tensor, width: int) -> Tensor:
    """One request's (emitted [K+1], num_accepted []) as a row of the batch output [width]."""
    row = torch.full((width,), PLACEHOLDER, dtype=torch.long, device=emitted.device)
    j = torch.arange(emitted.shape[0], device=emitted.device)
    row[:emitted.shape[0]] = torch.where(j <= num_accepted, emitted, torch.full_like(emitted, PLACEHOLDER))
    return row


def parse_output(rows: list[list[int]]) -> list[list[int]]:
    """Host rows of the batch output -> each request's emitted tokens (placeholders dropped;
    they only ever trail)."""
    out = []
    for row in rows:
        n = len(row)
        while n and row[n - 1] == PLACEHOLDER:
            n -= 1
        out.append(row[:n])
    return out


# ---------------------------------------------------------------------------------------------
# Trees. A draft tree is plain data: node i (0-based, topologically ordered) holds token
# tokens[i] and hangs below parents[i] (-1 = the root, i.e. the last committed token). The
# target scores the root and every node in one forward (a tree attention mask), giving a row of
# logits per node: row 0 = after the root, row i + 1 = after node i.
#
# Worked example, greedy: root r with children a (node 0) and b (node 1); a has child c (node 2).
# parents = [-1, -1, 0]. The target's argmax after r is b, after b is y: b is accepted, b has no
# children, so the step emits [b, y] (1 accepted + bonus). Had the argmax after r been a and
# after a been c, it would emit [a, c, argmax after c].
#
# Sampling: the children of a node are candidates drawn one after another WITHOUT replacement
# from the node's draft distribution q (or fixed tokens with q = None). Recursive rejection
# sampling (SpecInfer's multi-round sampling; Jeon et al. 2024 for the without-replacement
# form): with p_1 = p and q_1 = q, candidate x_i is accepted with probability
# min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(0, p_i - q_i)) and q_{i+1} is q
# without x_1..x_i, renormalised. If every candidate is rejected, the token is drawn from the
# last p. Each x_i is distributed as q_i given the earlier rejections, so by backward induction
# every round emits exactly p_i, and the node emits exactly p. An accepted candidate's own
# children are then verified against the target's distribution after it.
# ---------------------------------------------------------------------------------------------


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[j + 1] = the nodes below node j, in order (children[0]: below the root)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"tree node {i} has parent {par}: parents must come before children")
        children[par + 1].append(i)
    return children


def verify_tree_greedy(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree (host lists; argmax has len(tokens) + 1 entries, row 0 for
    the root). Returns (path: the accepted nodes in order, emitted tokens = their tokens plus
    the target's token after the last of them)."""
    children = tree_children(parents)
    path, row = [], 0
    while True:
        want = argmax[row]
        nxt = next((c for c in children[row] if tokens[c] == want), None)
        if nxt is None:
            return path, [tokens[i] for i in path] + [want]
        path.append(nxt)
        row = nxt + 1


def sibling_plan(p: Tensor, q: Tensor | None, candidates: list[int]) -> tuple[list[float], Tensor]:
    """Recursive rejection sampling at one node, its deterministic half.

    p: [V] float32   the target's processed distribution at the node
    q: [V] float32   the distribution the candidates were drawn from without replacement;
                     None = fixed candidates (each is a point mass)
    candidates: tokens in the order they were drawn
    returns (accept_prob [m]: of candidate i given candidates < i were rejected,
             final [V]: what to draw from when all are rejected)
    """
    accept = []
    q_left = q.clone() if q is not None else None
    for x in candidates:
        if q_left is None:
            qi = torch.zeros_like(p)
            qi[x] = 1.0
        else:
            mass = q_left.sum()
            qi = q_left / mass if mass > 0 else q_left
        px, qx = p[x].item(), qi[x].item()
        accept.append(0.0 if qx <= 0 else min(1.0, px / qx))     # q(x) = 0 (a duplicate sibling): rejected
        residual = (p - qi).clamp_min(0.0)
        total = residual.sum()
        # total 0: p == q_i, so a rejection has probability 0 and p stays as good as any
        p = residual / total if total > 0 else p
        if q_left is not None:      # our own copy (cloned above); qi was divided out of it
            q_left[x] = 0.0
    return accept, p


def verify_tree_sampling(tokens: list[int], parents: list[int], p: Tensor, q: Tensor | None,
                         generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Sampling verification of a tree. p: [N+1, V] the target's processed distributions (row 0
    after the root, row i + 1 after node i); q: [N, V] row i = the distribution node i was
    drawn from (siblings share it), None = fixed candidates. Returns (path, emitted) as
    verify_tree_greedy does."""
    children = tree_children(parents)
    path, row = [], 0
    while True:
        kids = children[row]
        q_row = q[kids[0]] if (q is not None and kids) else None
        accept, final = sibling_plan(p[row], q_row, [tokens[c] for c in kids])
        nxt = None
        for c, a in zip(kids, accept):
            if torch.rand((), generator=generator, device=p.device).item() < a:
                nxt = c
                break
        if nxt is None:
            tok = sample(final[None], generator).item()
            return path, [tokens[i] for i in path] + [tok]
        path.append(nxt)
        row = nxt + 1


def verify_tree_typical(tokens: list[int], parents: list[int], p: Tensor, generator: torch.Generator,
                        threshold: float = 0.09, alpha: float = 0.3) -> tuple[list[int], list[int]]:
    """Medusa's typical acceptance: LOSSY, an explicit opt-in (acceptance_method
    "typical_acceptance_sampler"); the output is no longer distributed as the target's.

    A candidate x is accepted when p(x) > min(threshold, alpha * exp(-H(p))), H the entropy of
    the target's distribution p at its parent; among acceptable siblings the most likely one
    is followed. After the accepted path, one token is sampled from p (the bonus).
    p: [N+1, V] the target's processed distributions (row 0 after the root).
    """
    children = tree_children(parents)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)                    # [N+1]
    bar = torch.clamp(alpha * torch.exp(-entropy), max=threshold).tolist()
    path, row = [], 0
    while True:
        ok = [(p[row, tokens[c]].item(), c) for c in children[row] if p[row, tokens[c]].item() > bar[row]]
        if not ok:
            tok = sample(p[row][None], generator).item()
            return path, [tokens[i] for i in path] + [tok]
        path.append(max(ok)[1])
        row = path[-1] + 1
