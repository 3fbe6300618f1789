"""Logits processing shared by the target (p) and every draft (q).

Two stages, in vLLM's order:
1. controls (`adjust_rows`): the grammar's mask, allowed_token_ids, bad words, min_tokens, logit_bias, then the
   repetition / frequency / presence penalties. They read the sequence before the row, so a
   row at draft position i is processed with drafts 0..i-1 counted as output (a tree node:
   the drafts on its own path), exactly as plain decoding would process that position once
   they are accepted. Greedy decoding takes the argmax here.
2. sampling filters (`process` / `process_rows`): temperature -> top-k -> min-p -> top-p, as vLLM's
   sampler (min-p before top-k there: the two commute), not Hugging Face's warpers (top-p, then min-p).
Both p and q go through both stages with the same rows' histories, so rejection sampling
reproduces exactly the *processed* target distribution.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from . import kernels
from .config import SamplingParams


NUCLEUS_TIERS = (256, 4096)      # tokens ranked first; a nucleus wider than all of them sorts its whole row
UNDERFLOW = -80.0                # log p - log p(best) below which a float32 probability may be 0 (sampling.c: -87)


def nucleus_drop(probs: Tensor, top_p: Tensor) -> Tensor:
    """probs [R, V], top_p [R] -> [R, V] bool: the tokens top-p sampling drops (those whose more
    likely tokens already hold top_p of the mass; the most likely token always stays).

    Sorting a 49k-token row costs ~3 ms on a CPU core, more than a 135M model's forward; the
    nucleus is usually far narrower, so the best 256 tokens are ranked first (topk), rows whose
    nucleus does not end inside them get the best 4096, and only what is left sorts whole. Every
    tier ranks as a descending sort does, so the result is the sort's (up to the order among
    exactly equal probabilities, which a sort leaves unspecified too)."""
    R, V = probs.shape
    top_p = top_p.to(probs.device, torch.float32)[:, None]
    if probs.device.type != "cpu":        # an accelerator sorts fast, and the tiers would sync the host
        return _sorted_drop(probs, top_p)
    drop = (top_p < 1.0).expand(R, V).clone()         # rows with top_p 1 drop nothing
    rows = (top_p[:, 0] < 1.0).nonzero().squeeze(-1)
    for k in (*(t for t in NUCLEUS_TIERS if t < V), V):
        if rows.numel() == 0:
            break
        sub = probs[rows]
        vals, idx = sub.sort(dim=-1, descending=True) if k == V else sub.topk(k, dim=-1, sorted=True)
        before = vals.double().cumsum(-1) - vals          # mass of strictly more likely tokens (float64:
        #   the sum of a prefix must not depend on how long a row the scan ran over)
        keep = before < top_p[rows]
        keep[:, 0] = True
        done = ~keep[:, -1] | (k == V)                    # the nucleus ends inside these k tokens
        if bool(done.all()):
            drop[rows] = torch.ones_like(sub, dtype=torch.bool).scatter_(-1, idx, ~keep)
            break
        d = done.nonzero().squeeze(-1)
        drop[rows[d]] = torch.ones_like(sub[d], dtype=torch.bool).scatter_(-1, idx[d], ~keep[d])
        rows = rows[~done]
    return drop


def _sorted_drop(probs: Tensor, top_p: Tensor) -> Tensor:
    """nucleus_drop by one descending sort of every row (top_p [R, 1]), without host syncs."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    drop = (sorted_p.double().cumsum(-1) - sorted_p >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    return torch.empty_like(drop).scatter_(-1, idx, drop)


def process(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k, min-p, top-p."""
    rows = logits.reshape(-1, logits.shape[-1])
    return process_rows(rows, [params], [rows.shape[0]]).reshape(logits.shape)


def process_rows(logits: Tensor, params: list[SamplingParams], repeats: list[int] | None = None,
                 kernel: bool = True) -> Tensor:
    """process() over the rows of several requests at once, each with its own parameters.

    logits:  [R, V]
    params:  one SamplingParams per request
    repeats: rows per request (sum = R); None = one row each
    Row r gets exactly process(logits[r:r+1], params of its request): the same operations in
    the same order, the filters only touching the rows that use them. On the CPU the kernels
    (sampling.c) compute the rows unless kernel=False (PyTorch ops: GPUs, and the reference
    tests compare the kernel with).
    """
    dev = logits.device
    repeats = [1] * len(params) if repeats is None else repeats
    per_row = _per_row(repeats, dev)
    V = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if kernel and dev.type == "cpu" and kernels.load() is not None:
        temp, top_p, min_p = per_row([(p.temperature, p.top_p, p.min_p) for p in params], torch.float32).unbind(-1)
        if any(top_k):                       # scaled first, as below: ties after the division count
            logits = _top_k(logits.float() / temp[:, None], top_k, per_row)
            temp = torch.ones_like(temp)
        return kernels.processed_probs(logits, temp, top_p, min_p)
    temp = per_row([p.temperature for p in params], torch.float32)
    logits = logits.float() / temp[:, None]
    if any(top_k):
        logits = _top_k(logits, top_k, per_row)
    probs = torch.softmax(logits, dim=-1)
    # vLLM's order: min-p (before top-k there; the two commute: a token's ratio to the best one
    # does not change when others go), then top-p over what min-p kept, renormalised after each
    use_min = [p.min_p > 0.0 for p in params]
    if any(use_min):
        min_p = per_row([p.min_p for p in params], torch.float32)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        probs = torch.where(per_row(use_min, torch.bool)[:, None], probs / probs.sum(-1, keepdim=True), probs)
    use_p = [p.top_p < 1.0 for p in params]
    if any(use_p):
        top_p = per_row([p.top_p for p in params], torch.float32)
        probs = probs.masked_fill(nucleus_drop(probs, top_p), 0.0)      # top_p 1.0 rows drop nothing
        probs = torch.where(per_row(use_p, torch.bool)[:, None], probs / probs.sum(-1, keepdim=True), probs)
    return probs


def processed_logits(logits: Tensor, params: list[SamplingParams], repeats: list[int] | None = None,
                     kernel: bool = True) -> Tensor:
    """logits [R, V] -> [R, V] float32: each row divided by its temperature, -inf exactly where
    top-k, min-p or top-p removed the token (process_rows's decisions: what vLLM's processed
    logits report; log_softmax of them is its processed logprobs).

    A probability of 0 alone does not say that: float32 softmax underflows (sampling.c zeroes
    every token e^-87 below the best), so a token that far below the best is read as removed
    only where a filter would remove it: top-k by its rank, top-p < 1 always (the mass ranked
    before it is 1 in float32), min-p where its ratio to the best is under min_p."""
    dev = logits.device
    repeats = [1] * len(params) if repeats is None else repeats
    per_row = _per_row(repeats, dev)
    temp, top_p, min_p = per_row([(p.temperature, p.top_p, p.min_p) for p in params], torch.float32).unbind(-1)
    x = logits.float() / temp[:, None]
    top_k = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
    if not any(top_k) and all(p.top_p >= 1.0 and p.min_p == 0.0 for p in params):
        return x                                     # no filter: nothing removed
    if any(top_k):
        x = _top_k(x, top_k, per_row)
    probs = process_rows(logits, params, repeats, kernel)
    below = x - x.amax(-1, keepdim=True)             # log p - log p(best)
    # 0 by underflow, not removed: far below the best, with no top-p and a min-p it passes
    kept = (below < UNDERFLOW) & (top_p >= 1.0)[:, None] & (below >= min_p.log()[:, None])
    return x.masked_fill((probs == 0) & ~kept, float("-inf"))


def _per_row(repeats: list[int], dev):
    def per_row(values, dtype):              # one value per request -> one per row
        return torch.tensor([v for v, r in zip(values, repeats) for _ in range(r)], dtype=dtype, device=dev)
    return per_row


def _top_k(logits: Tensor, top_k: list[int], per_row) -> Tensor:
    """logits [R, V] with everything below each row's k-th largest set to -inf (k 0: kept)."""
    k = per_row(top_k, torch.long)
    kth = torch.topk(logits, max(top_k), dim=-1).values.gather(-1, (k - 1).clamp_min(0)[:, None])
    return logits.masked_fill((logits < kth) & (k > 0)[:, None], float("-inf"))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: seeded runs reproduce, unseeded ones draw fresh OS entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64 if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """probs [N, V] (rows need not sum to 1) -> token ids [N], one draw per row.

    Inverse CDF in float64: one uniform per row against the row's running sum. torch.multinomial
    draws V exponentials per row (~0.9 ms for 49k tokens on a CPU core; this is ~0.1 ms). The
    first index whose running sum exceeds u * total has positive probability, so a token of
    probability 0 is never drawn."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    drawn = kernels.draw(probs, u[:, 0])      # None off the CPU or without the kernels
    return drawn if drawn is not None else sample_with(probs, u)


def sample_with(probs: Tensor, u: Tensor) -> Tensor:
    """sample() in PyTorch ops with the uniforms u [N, 1] (float64) given."""
    c = probs.double().cumsum(-1)
    return torch.searchsorted(c, u * c[:, -1:], right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)



# ---------------------------------------------------------------------------------------------
# Controls: what a row's processing reads from the sequence before it.
# ---------------------------------------------------------------------------------------------

_pause_lock = threading.Lock()
_pauses = 0                 # threads inside _collector_paused
_resume = False             # whether the last one out turns the collector back on


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off while indexing, across threads: a server prepares several
    requests at once, and a plain disable / enable pair per thread could leave it off for good (one
    thread disabling right after another re-enabled: every later cycle leaked). Counted: the first
    in turns it off (if it was on), the last out turns it back on."""
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


class BadWords:
    """A request's bad words as token sequences, indexed so that what a step costs does not grow
    with their number (a loop over every word, per row and step, let one request with 50,000
    words slow every other stream ~10x).

    vLLM's rule (its bad-words logits processor): a word's last token is banned at a row where the tokens before the row (the output, then the
    row's path) end with the word's other tokens; a one-token word is banned everywhere.
    One-token words: one [V] mask (a masked fill per row). Longer words: a trie of their prefixes
    read backwards, {token: (last tokens banned, {the token before: ...})}, which a row walks from
    the end of its sequence only as far as that end matches some prefix (usually 0-2 lookups)."""

    def __init__(self, words: list[list[int]]):
        self.words = list(words)
        single = sorted({w[0] for w in self.words if len(w) == 1})
        self.single = torch.tensor(single, dtype=torch.long)       # [S] one-token words
        self._masks: dict[tuple, Tensor] = {}
        self._trie: dict[int, tuple[list[int], dict]] = {}
        with _collector_paused():     # the cyclic collector, run by the allocations below, took 3/4 of the time
            self._index()

    def _index(self) -> None:
        for w in self.words:
            if len(w) < 2:
                continue
            node = self._trie
            for t in w[-2:0:-1]:           # the prefix backwards, its first token left for last
                entry = node.get(t)
                if entry is None:
                    entry = node[t] = ([], {})
                node = entry[1]
            entry = node.get(w[0])
            if entry is None:
                entry = node[w[0]] = ([], {})
            entry[0].append(w[-1])

    @classmethod
    def tokenize(cls, tokenizer, words: list[str]) -> "BadWords":
        """vLLM's rule: each word as given and with a leading space (a different token in
        byte-level vocabularies), the latter only when it is a distinct same-length encoding."""
        seqs = []
        for word in words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            seqs += [w for w in (plain, spaced) if w]
            if spaced and plain and (spaced[0] == plain[0] or len(spaced) != len(plain)):
                seqs.pop()
        return cls(seqs)

    def __len__(self) -> int:
        return len(self.words)

    def __iter__(self):
        return iter(self.words)

    def single_mask(self, vocab: int, device) -> Tensor | None:
        """[V] bool: the one-token words (ids past the vocabulary left out); None without any."""
        if self.single.numel() == 0:
            return None
        key = (vocab, str(device))
        if key not in self._masks:
            ids = self.single[self.single < vocab]
            self._masks[key] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True).to(device)
        return self._masks[key]

    def after(self, output: list[int], path: list[int]) -> list[int]:
        """The last tokens of the longer words whose other tokens output + path ends with."""
        banned, node = [], self._trie
        if not node:
            return banned
        for seq in (path, output):
            for i in range(len(seq) - 1, -1, -1):
                entry = node.get(seq[i])
                if entry is None:
                    return banned
                banned += entry[0]
                node = entry[1]
                if not node:
                    return banned
        return banned


def bad_words_of(params: SamplingParams, tokenizer) -> BadWords:
    """params.bad_words tokenized by tokenizer and indexed, kept on params (SamplingParams.clone
    shares it) so that the engine thread reads it ready: the engine's check_prompt, which the
    server runs when it prepares a request, tokenizes them (vLLM tokenizes them in its frontend,
    SamplingParams.update_from_tokenizer, not in the engine core). Tokenized again when the
    words or the tokenizer change."""
    words = params.bad_words or []
    cached = params.__dict__.get("_bad_words_tokenized")
    if cached is None or cached[0] is not tokenizer or cached[1] != words:
        cached = (tokenizer, list(words), BadWords.tokenize(tokenizer, words))
        object.__setattr__(params, "_bad_words_tokenized", cached)
    return cached[2]


@dataclass(eq=False)
class Controls:
    """One request's sequence-reading controls (built once, when the request is added).

    bad_words: BadWords, or its token sequences (each word tokenized with and without a leading
    space, vLLM's rule: BadWords.tokenize); stop_ids: the tokens min_tokens bans (EOS, even with
    ignore_eos as vLLM's, and stop_token_ids); grammar: a structured.Grammar or None."""
    params: SamplingParams
    prompt: list[int]
    bad_words: BadWords | list[list[int]] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    grammar: object | None = None
    _prompt_mask: Tensor | None = None
    _allowed: Tensor | None = None
    _bias: tuple[Tensor, Tensor] | None = None

    def __post_init__(self):
        if not isinstance(self.bad_words, BadWords):
            self.bad_words = BadWords(self.bad_words)

    def bias(self, device) -> tuple[Tensor, Tensor]:
        """logit_bias as ([n] token ids, [n] float32 biases), built once."""
        if self._bias is None or self._bias[0].device != torch.device(device):
            bias = self.params.logit_bias or {}
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
        return self._bias

    def allowed_mask(self, vocab: int, device) -> Tensor:
        """[V] bool: the tokens allowed_token_ids lets through."""
        if self._allowed is None or self._allowed.shape[0] != vocab or self._allowed.device != torch.device(device):
            ids = torch.tensor([t for t in self.params.allowed_token_ids if t < vocab], dtype=torch.long)
            self._allowed = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True).to(device)
        return self._allowed

    def prompt_mask(self, vocab: int) -> Tensor:
        """[V] bool: tokens of the prompt (what repetition_penalty counts besides the output)."""
        if self._prompt_mask is None or self._prompt_mask.shape[0] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool)
            ids = torch.tensor([t for t in self.prompt if t < vocab], dtype=torch.long)
            self._prompt_mask = mask.index_fill_(0, ids, True)
        return self._prompt_mask


def needs_controls(params: SamplingParams) -> bool:
    return params.reads_sequence or bool(params.logit_bias) or params.allowed_token_ids is not None


class Row(NamedTuple):
    """A logits row to adjust: its request's controls, the request's committed output tokens
    and the drafts before the row (its path; [] for the first row of a step)."""
    controls: Controls
    output: list[int]
    path: list[int]


def adjust_rows(logits: Tensor, rows: list[Row], masked: list | None = None) -> Tensor:
    """logits [R, V] -> float32 logits [R, V] with every row's controls applied (grammar mask,
    bad words, min_tokens, logit_bias, penalties, in vLLM's order). Rows of one request must
    be consecutive (the grammar walks its paths in order). masked, a list: gets the logits with
    the grammar mask alone applied (what vLLM's raw logprobs are read from)."""
    logits = logits.float().clone()
    V, dev = logits.shape[-1], logits.device
    _apply_grammar(logits, rows)
    if masked is not None:
        masked.append(logits.clone())
    for r, row in enumerate(rows):          # allowed_token_ids: every other token out
        if row.controls.params.allowed_token_ids is not None:
            kept = logits[r].masked_fill(~row.controls.allowed_mask(V, dev), float("-inf"))
            # unless that leaves no token (none the grammar allows): lifted for the row, as bans are
            logits[r] = torch.where((kept > float("-inf")).any(), kept, logits[r])
    bans_r, bans_t, masked, biased = [], [], [], []
    for r, (c, output, path) in enumerate(rows):
        p = c.params
        banned = list(c.stop_ids) if len(output) + len(path) < p.min_tokens else []
        if c.bad_words:
            if c.bad_words.single_mask(V, dev) is not None:
                masked.append(r)
            banned += c.bad_words.after(output, path)
        bans_r += [r] * len(banned)
        bans_t += banned
        if p.logit_bias:
            biased.append(r)
    if bans_t or masked:
        keep = [i for i, t in enumerate(bans_t) if t < V]
        banned = logits.clone()
        banned[torch.tensor([bans_r[i] for i in keep], device=dev, dtype=torch.long),
               torch.tensor([bans_t[i] for i in keep], device=dev, dtype=torch.long)] = float("-inf")
        for r in masked:                    # one-token bad words: one masked fill per row
            banned[r].masked_fill_(rows[r].controls.bad_words.single_mask(V, dev), float("-inf"))
        # a ban that leaves no token at all (min_tokens where the grammar allows only EOS) is
        # lifted for that row: the same rule in p, q and plain decoding, so nothing is lost
        alive = (banned > float("-inf")).any(-1, keepdim=True)
        logits = torch.where(alive, banned, logits)
    if biased:                              # each request's ids and biases as tensors, built once
        ids, values = zip(*(rows[r].controls.bias(dev) for r in biased))
        at = torch.cat([torch.full_like(i, r) for i, r in zip(ids, biased)])
        logits.index_put_((at, torch.cat(ids)), torch.cat(values), accumulate=True)
    _apply_penalties(logits, rows)
    return logits


def _apply_grammar(logits: Tensor, rows: list[Row]) -> None:
    idx = [r for r, row in enumerate(rows) if row.controls.grammar is not None]
    if not idx:
        return
    masks, at = [], 0
    while at < len(idx):      # one call per request: its rows' paths walked in order
        c = rows[idx[at]].controls
        end = at
        while end < len(idx) and rows[idx[end]].controls is c:
            end += 1
        masks.append(c.grammar.masks([rows[r].path for r in idx[at:end]]))
        at = end
    sel = torch.tensor(idx, device=logits.device)
    logits[sel] = apply_bitmask(logits[sel], torch.cat(masks).to(logits.device))


# bits of a byte, low first: the bitmask's int32 words are little-endian, so bit j of word w
# is byte w * 4 + j // 8, bit j % 8
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1        # [256, 8] bool


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits [R, V], bitmask [R, ceil(V / 32)] int32 (bit set = allowed) -> logits with the
    forbidden tokens at -inf."""
    V = logits.shape[-1]
    allowed = _BYTE_BITS.to(logits.device)[bitmask.contiguous().view(torch.uint8).long()].flatten(1)[:, :V]
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_penalties(logits: Tensor, rows: list[Row]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, vLLM's maths."""
    idx = [r for r, row in enumerate(rows) if row.controls.params.penalties]
    if not idx:
        return
    V, dev = logits.shape[-1], logits.device
    counts = torch.zeros(len(idx), V, device=dev)
    prompt = torch.zeros(len(idx), V, dtype=torch.bool, device=dev)
    base: dict[int, tuple[Tensor, Tensor]] = {}       # per request: output counts, prompt mask
    path_r, path_t = [], []
    for j, r in enumerate(idx):
        c, output, path = rows[r]
        if id(c) not in base:
            ids = torch.tensor([t for t in output if t < V], dtype=torch.long)
            base[id(c)] = (torch.bincount(ids, minlength=V).float().to(dev), c.prompt_mask(V).to(dev))
        counts[j], prompt[j] = base[id(c)]
        path_r += [j] * len(path)
        path_t += path
    if path_t:
        counts.index_put_((torch.tensor(path_r, device=dev), torch.tensor(path_t, device=dev)),
                          torch.ones(len(path_t), device=dev), accumulate=True)
    params = [rows[r].controls.params for r in idx]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    sel = torch.tensor(idx, device=dev)
    x = logits[sel]
    seen = counts > 0
    x = torch.where(seen | prompt, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * seen.float()
    logits[sel] = x
