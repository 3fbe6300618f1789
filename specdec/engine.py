"""The decoding loop: prefill -> repeat(propose -> verify -> commit) -> stream.

Invariant: the target's cache holds every committed token but the last one; each step feeds
[last token, d_1 .. d_K] in one forward pass, so a plain decoding step is the K = 0 case.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .adaptive import AdaptiveK, AdaptiveSize, FixedK
from .config import SamplingParams
from .detokenize import Detokenizer
from .metrics import RequestStats
from .model import Transformer, TreeAttention
from .proposers import Draft, Proposer, RequestContext
from .proposers.base import prune_tree
from .sampling import make_generator, process
from .tokenizer import Tokenizer
from .verify import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling, verify_tree_typical


@dataclass
class StepEvent:
    """What one decoding step adds to a request's output."""
    token_ids: list[int]                 # new output tokens
    text: str                            # new text (held back while it could still change)
    num_accepted: int                    # token_ids[:num_accepted] were accepted drafts
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length"
    stop_reason: int | str | None = None
    stats: RequestStats = field(default_factory=RequestStats)


def _is_chain(parents: list[int]) -> bool:
    return all(par == i - 1 for i, par in enumerate(parents))


def _limit_depth(draft: Draft, max_depth: int) -> Draft:
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


class Engine:
    def __init__(self, target: Transformer, tokenizer: Tokenizer, proposer: Proposer | None = None,
                 num_speculative_tokens: int | str = 0, max_model_len: int | None = None, max_k: int = 8):
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.max_k = max_k
        self.max_model_len = min(max_model_len or target.config.max_position_embeddings,
                                 target.config.max_position_embeddings)
        self.eos_ids = set(tokenizer.eos_token_ids)
        # proposers that read the target's features (Medusa, EAGLE) get them after every forward
        self.feeds_hidden = bool(getattr(proposer, "needs_hidden", False))
        # (threshold, alpha) of Medusa's typical acceptance: lossy, only when asked for
        self.typical = getattr(proposer, "typical_acceptance", None)
        self.trees = bool(getattr(proposer, "tree", False))
        # "auto" K learns acceptance and costs across requests: they belong to the method and the
        # machine, and one request of a few dozen steps is too short to learn them from scratch
        # "auto" keeps one policy for greedy requests and one for sampled ones: their acceptance
        # differs systematically, and estimates learned on one would mislead the other
        self._adaptive = None
        if self.num_speculative_tokens == "auto":
            if getattr(proposer, "tree", False):
                # no ladder rung beyond what the proposer can draft (EAGLE's chains: its depth)
                size = min(max_k, getattr(proposer, "max_tree_size", None) or max_k)
                self._adaptive = {greedy: AdaptiveSize(size) for greedy in (True, False)}
            else:
                self._adaptive = {greedy: AdaptiveK(max_k) for greedy in (True, False)}

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt is too long: {len(prompt)} tokens, the context holds "
                             f"{self.max_model_len} (prompt + output)")
        vocab = self.target.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def _policy(self, greedy: bool):
        return self._adaptive[greedy] if self._adaptive else FixedK(int(self.num_speculative_tokens))

    def generate(self, prompt: list[int], params: SamplingParams, seed_offset: int = 0) -> Iterator[StepEvent]:
        """Stream one request; the last event has finished=True and the final stats."""
        self.check_prompt(prompt, params)
        t_start = time.perf_counter()
        seed = None if params.seed is None else params.seed + seed_offset
        ctx = RequestContext(params, make_generator(seed, self.target.device), self.target.config.vocab_size)
        stats = RequestStats(prompt_tokens=len(prompt))
        max_tokens = params.max_tokens or self.max_model_len - len(prompt)
        cache = self.target.new_cache(1, self.max_model_len)
        session = None
        if self.feeds_hidden:
            h = self._forward(torch.tensor(prompt[:-1])[None], cache, [0], logits=False, hidden=True)
            session = self.proposer.start(prompt, ctx, cache, hidden=h)
        else:
            self._forward(torch.tensor(prompt[:-1])[None], cache, [0], logits=False)
            if self.proposer is not None:
                session = self.proposer.start(prompt, ctx, cache)
        stats.prefill_time_s = time.perf_counter() - t_start
        policy = self._policy(params.greedy)
        detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        seq, out = list(prompt), []
        while True:
            # room: how many drafts can still be emitted; a tree may hold more nodes than that
            # (as long as they fit in the cache), but no path deeper than it
            room = min(self.max_model_len - len(seq) - 1, max_tokens - len(out) - 1)
            slots = self.max_model_len - len(seq) if self.trees else room
            k = max(0, min(policy.choose(), slots)) if session is not None and room > 0 else 0
            t0 = time.perf_counter()
            draft = session.propose(seq, k) if k > 0 else None
            if draft is not None and draft.is_tree:
                draft = _limit_depth(draft, room)
            k = draft.k if draft is not None else 0
            t1 = time.perf_counter()
            emitted, n, feats, path = self._verify_any(seq, draft, cache, ctx)
            t2 = time.perf_counter()
            seq += emitted
            cache.rollback(len(seq) - 1)
            if self.feeds_hidden:
                session.commit(seq, feats)
            elif session is not None:
                session.commit(seq)
            # what the proposer does after verification (EAGLE re-reads the kept features) is
            # drafting cost too: "auto" must weigh it
            draft_s = (t1 - t0) + (time.perf_counter() - t2)
            # greedy tree steps tell what every smaller (nested) tree would have accepted
            policy.update(k, n, draft_s, t2 - t1, path=path if ctx.params.greedy else None)
            stats.draft_time_s += draft_s
            stats.target_time_s += t2 - t1
            event = self._accept(emitted, n, out, detok, params, max_tokens, len(prompt))
            stats.record_step(k, n, len(event.token_ids))
            if not stats.time_to_first_token_s:
                stats.time_to_first_token_s = time.perf_counter() - t_start
            stats.wall_time_s = time.perf_counter() - t_start
            event.stats = stats
            yield event
            if event.finished:
                return

    @torch.inference_mode()
    def _forward(self, tokens, cache, start, logits=True, hidden=False):
        if tokens.shape[1] == 0:
            return tokens.new_zeros(0, self.target.config.hidden_size, dtype=torch.float32) if hidden else None
        out = self.target(tokens.to(self.target.device), cache, start, logits=logits, hidden=hidden)
        return out[1][0] if hidden else out

    def _verify_any(self, seq: list[int], draft, cache, ctx: RequestContext):
        """One target forward over the draft (chain or tree); returns (emitted tokens, accepted
        count, the kept tokens' features or None, the accepted tree path or None)."""
        if draft is not None and self.typical is not None and not ctx.params.greedy and not draft.is_tree:
            draft = Draft(draft.tokens, draft.probs, list(range(-1, draft.k - 1)))   # a chain is a tree
        if draft is not None and draft.is_tree and not (self.typical is None and _is_chain(draft.parents)):
            return self._verify_tree(seq, draft, cache, ctx)
        # a chain, a tree proposer's included: no tree mask, nothing to move
        emitted, n, feats = self._verify(seq, draft, cache, ctx)
        return emitted, n, feats, (list(range(n)) if draft is not None and draft.is_tree else None)

    @torch.inference_mode()
    def _verify(self, seq: list[int], draft, cache, ctx: RequestContext) -> tuple[list[int], int, torch.Tensor | None]:
        """A chain step; returns (emitted tokens, accepted count, the target's features of the
        fed tokens that are now committed, when the proposer reads them)."""
        dev = self.target.device
        drafted = draft.tokens.to(dev) if draft is not None else torch.empty(0, dtype=torch.long, device=dev)
        tokens = torch.cat([torch.tensor(seq[-1:], device=dev), drafted])[None]
        feats = None
        if self.feeds_hidden:
            logits, feats = self.target(tokens, cache, [len(seq) - 1], hidden=True)
            logits, feats = logits[0], feats[0]
        else:
            logits = self.target(tokens, cache, [len(seq) - 1])[0]               # [K+1, V]
        if ctx.params.greedy:
            emitted, n = verify_greedy(drafted, logits)
        else:
            p = process(logits, ctx.params)
            q = draft.probs.to(dev) if draft is not None and draft.probs is not None else None
            emitted, n = verify_sampling(drafted, q, p, ctx.generator)
        host = torch.cat([n[None], emitted]).tolist()                       # the step's one sync
        n = host[0]
        return host[1:n + 2], n, (feats[:n + 1] if feats is not None else None)

    @torch.inference_mode()
    def _verify_tree(self, seq: list[int], draft, cache, ctx: RequestContext):
        """A tree step: [last token, nodes...] in one forward under the tree mask, then the
        accepted path's cache entries moved to follow the prefix (verify.py has the rules)."""
        dev = self.target.device
        start = len(seq) - 1
        tokens = [seq[-1]] + draft.tokens.tolist()
        tree = TreeAttention.from_parents(draft.parents, dev)
        out = self.target(torch.tensor(tokens, device=dev)[None], cache, [start], tree=tree, hidden=self.feeds_hidden)
        logits, feats = (out[0][0], out[1][0]) if self.feeds_hidden else (out[0], None)
        if ctx.params.greedy:
            path, emitted = verify_tree_greedy(tokens[1:], draft.parents, logits.argmax(-1).tolist())
        elif self.typical is not None:
            path, emitted = verify_tree_typical(tokens[1:], draft.parents, process(logits, ctx.params),
                                                ctx.generator, *self.typical)
        else:
            p = process(logits, ctx.params)
            q = draft.probs.to(dev) if draft.probs is not None else None
            path, emitted = verify_tree_sampling(tokens[1:], draft.parents, p, q, ctx.generator)
        rows = [0] + [i + 1 for i in path]                                   # root + accepted nodes
        cache.move([start + r for r in rows[1:]], start + 1)
        return emitted, len(path), (feats[rows] if feats is not None else None), path

    def _accept(self, emitted, n, out, detok: Detokenizer, params, max_tokens, prompt_len) -> StepEvent:
        """Append emitted tokens one by one until a stop condition; nothing after it is kept."""
        new, reason, stop_reason = [], None, None
        for tok in emitted:
            new.append(tok)
            out.append(tok)
            if (tok in self.eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                reason, stop_reason = "stop", (tok if tok in params.stop_token_ids else None)
                detok.add(tok)
                break
            if detok.add(tok):
                reason, stop_reason = "stop", detok.stop_reason
                break
            if len(out) >= max_tokens or prompt_len + len(out) >= self.max_model_len:
                reason = "length"
                break
        text = detok.delta(final=reason is not None)
        return StepEvent(new, text, min(n, len(new)), reason is not None, reason, stop_reason)
