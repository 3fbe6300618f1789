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


def verify_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification.

    draft:         [K] int64     proposed tokens
    target_logits: [K+1, V]      target logits after the prefix and after each draft token
    returns (emitted [K+1] int64, num_accepted [] int64); emitted[:num_accepted + 1] are output.
    """
    best = target_logits.argmax(-1)                               # [K+1]
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
    K = draft.shape[0]
    rows = torch.arange(K, device=p.device)
    if q is None:
        q = torch.zeros_like(p[:K]).scatter_(-1, draft[:, None], 1.0)
    p_x, q_x = p[rows, draft], q[rows, draft]
    accept_prob = torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(q_x))
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
    final = torch.multinomial(candidates, 1, generator=generator).squeeze(-1)
    emitted = torch.cat([draft, draft.new_zeros(1)])
    return emitted.scatter(0, num_accepted[None], final.gather(0, num_accepted[None])), num_accepted
