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


def verify_sampling(draft: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rejection-sampling verification of a chain of K drafts.

    draft: [K] int64         proposed tokens
    q:     [K, V] float32    the draft's processed distributions; None = deterministic draft
                             (a point mass on each proposed token, e.g. n-gram lookup)
    p:     [K+1, V] float32  the target's processed distributions
    returns (emitted [K+1] int64, num_accepted [] int64); emitted[:num_accepted + 1] are output.
    """
    K = draft.shape[0]
    rows = torch.arange(K, device=p.device)
    p_x = p[rows, draft]
    if q is None:
        q = torch.zeros_like(p[:K]).scatter_(-1, draft[:, None], 1.0)
    q_x = q[rows, draft]
    u = torch.rand(K, generator=generator, device=p.device)
    accept = u * q_x < p_x                                         # u < p/q, without dividing by 0
    num_accepted = accept.long().cumprod(0).sum()

    residual = (p[:K] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass 0 means p == q on that row: rejection there has probability 0, any row will do
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:K])
    candidates = torch.cat([residual, p[K:]], dim=0)               # [K+1, V]
    final = torch.multinomial(candidates, 1, generator=generator).squeeze(-1)
    emitted = torch.cat([draft, draft.new_zeros(1)])
    emitted = emitted.scatter(0, num_accepted[None], final.gather(0, num_accepted[None]))
    return emitted, num_accepted
