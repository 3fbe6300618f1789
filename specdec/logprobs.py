"""Log-probabilities of emitted tokens, read from the verification forward's own logits.

A step's target forward already scored every emitted token: emitted token j of a request was
predicted by its fed row rows[j] (0 = the last committed token, i + 1 = draft i or tree node
i), whether it was an accepted draft, a recovered token or the bonus. So logprobs cost no
second forward, only a log-softmax over the rows of the requests that ask.

Modes (vLLM's `logprobs_mode`, its default first):
- "raw_logprobs" (default, as vLLM's): log-softmax of the raw logits, before any processing but
  a grammar's mask (vLLM masks the logits before its sampler).
- "raw_logits": the raw logits themselves.
- "processed_logprobs": log p(x) under the distribution the token was verified against: the
  request's controls (penalties, bias, grammar mask: the rows the engine passes in), then
  temperature, top-k, top-p and min-p (sampling.processed_logits: log-softmax of its logits);
  tokens those removed get -inf (the server sends FLOOR), and only those. Greedy requests report
  the unscaled distribution (temperature 0 has no distribution of its own), so greedy logprobs
  are the same as raw ones where no control acts.
- "processed_logits": the logits after the controls and the temperature, -inf where top-k,
  top-p or min-p removed the token (FLOOR in the server's JSON).
cumulative_logprob (and best_of's ranking) sums what the mode reports, as vLLM does.
A recovered token is drawn from norm(max(0, p - q)), yet the figure reported is log p(x): the
probability of the token under the target at its position, as if decoded without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .sampling import processed_logits

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
FLOOR = -9999.0          # what -inf becomes in the server's JSON, which has no infinity (vLLM's serving_*;
                         # offline, as vLLM's Logprob, -inf stays -inf)


@dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log-probability, its rank (1 = the likeliest) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True, eq=True)
class TokenLogprob(Mapping):
    """One position's figures: the token there (token_id, logprob, rank) and the position's most
    likely tokens (top, best first). Also vLLM's shape of the same thing, a mapping
    {token id: Logprob} holding the token and the top ones (`entry[token_id].logprob`,
    `.rank`, `.decoded_token`; `names` are the tokens' texts, filled in for LLM outputs)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]      # the `params.logprobs` most likely tokens, best first
    rank: int | None = None                 # 1 + how many tokens are likelier
    names: tuple[tuple[int, str], ...] | None = None    # (token id, text) of the token and the top ones

    @cached_property
    def _entries(self) -> dict[int, Logprob]:
        names = dict(self.names or ())
        out = {self.token_id: Logprob(self.logprob, self.rank, names.get(self.token_id))}
        for r, (t, lp) in enumerate(self.top):
            out.setdefault(t, Logprob(lp, r + 1, names.get(t)))
        return out

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    __hash__ = None       # type: ignore[assignment]  (a mapping, as vLLM's dict)

    def named(self, name) -> "TokenLogprob":
        """This entry with its tokens' texts (name: token id -> text)."""
        ids = dict.fromkeys([self.token_id, *(t for t, _ in self.top)])
        return TokenLogprob(self.token_id, self.logprob, self.top, self.rank, tuple((t, name(t)) for t in ids))


def step_logprobs(logits: Tensor, wanted: list[tuple[object, list[int], list[int]]], mode: str) -> list[list[TokenLogprob]]:
    """logits [R, V]: a step's target rows; wanted: per asking request (its SamplingParams,
    the logits rows predicting its emitted tokens, those tokens). One list per request, each
    token with its rank."""
    if not wanted:
        return []
    dev = logits.device
    rows = torch.tensor([r for _, rows, _ in wanted for r in rows], device=dev, dtype=torch.long)
    tokens = torch.tensor([t for _, _, toks in wanted for t in toks], device=dev, dtype=torch.long)
    counts = [len(rows) for _, rows, _ in wanted]
    logp = _log_distribution(logits[rows], [p for p, _, _ in wanted], counts, mode)      # [M, V]
    picked = logp.gather(1, tokens[:, None])
    rank = ((logp > picked).sum(-1) + 1).tolist()           # vLLM reports it for every token
    chosen = picked[:, 0].tolist()
    n_top = min(max(p.logprobs or 0 for p, _, _ in wanted), logp.shape[-1])
    top_v, top_i = _top(logp, n_top) if n_top else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out, at = [], 0
    for (params, _, toks), n in zip(wanted, counts):
        k = params.logprobs or 0
        out.append([TokenLogprob(t, chosen[at + j], tuple(zip(top_i[at + j][:k], top_v[at + j][:k])), rank[at + j])
                    for j, t in enumerate(toks)])
        at += n
    return out


def _top(logp: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n largest of each row, best first, equal values by token id: topk leaves ties in an
    order (and, at the n-th place, a choice) that depends on the batch's shape, and a grammar's
    masked tokens all score the same."""
    top_i = logp.topk(n, dim=-1).indices
    last = logp.gather(1, top_i[:, -1:])
    # rows where a token left out ties with the n-th: the tied value's lowest ids fill the places
    for r in ((logp == last).sum(-1) > (logp.gather(1, top_i) == last).sum(-1)).nonzero().flatten().tolist():
        above = (logp[r] > last[r]).nonzero().flatten()
        top_i[r] = torch.cat([above, (logp[r] == last[r]).nonzero().flatten()[:n - above.numel()]])
    top_i = top_i.sort(dim=-1).values                                   # by id, then (stably) by value
    order = logp.gather(1, top_i).argsort(dim=-1, descending=True, stable=True)
    top_i = top_i.gather(1, order)
    return logp.gather(1, top_i), top_i


def _log_distribution(rows: Tensor, params: list, counts: list[int], mode: str) -> Tensor:
    """[M, V] what mode reports of each request's rows (counts[i] rows of request i)."""
    logits_mode = mode.endswith("_logits")
    out = rows.float() if logits_mode else torch.log_softmax(rows.float(), dim=-1)
    if mode.startswith("raw_"):
        return out
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return out
    starts = [sum(counts[:i]) for i in range(len(counts))]
    index = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in sampled]).to(rows.device)
    # from the logits, not log(probs): a probability that underflowed to 0 is not a removed token
    x = processed_logits(rows[index], [params[i] for i in sampled], [counts[i] for i in sampled])
    out[index] = x if logits_mode else torch.log_softmax(x, dim=-1)
    return out
