"""Suffix decoding: vLLM's method "suffix" (SuffixDecoding, Oliaro et al. 2024), with a datastore.

Model-free, like prompt lookup, and as cheap (tens of microseconds a step), but it also guesses
where the request's own text has nothing to copy, from text the target wrote before:

1. the request's own prompt and output: the continuation of the longest earlier match of its
   tail (`ngram`'s lookup), when that match is at least `prompt_lookup_min` tokens long;
2. otherwise the longest match of the tail (up to `suffix_decoding_max_tree_depth` tokens) in
   - a datastore: a corpus of the target's own answers indexed once (REST, He et al. 2024;
     `specdec train suffix` builds one, models/smollm2-suffix is SmolLM2's), given as the
     method's `model` folder, and
   - the outputs of the last `suffix_decoding_max_cached_requests` finished requests (vLLM's
     global cache), re-indexed in a background thread as they accumulate;
   whichever matches longer drafts the most frequent continuation, token by token, while the
   path's share of the occurrences stays >= `suffix_decoding_min_token_prob`, and at most
   floor(`suffix_decoding_max_spec_factor` x the match length) tokens, as vLLM (Arctic
   Inference) caps it: long matches draft further, and a match too short for one token drafts
   nothing (factor 0: the datastore and the cache never draft).

Lossless: drafts are deterministic (a point-mass q), so verification is plain greedy matching or
exact rejection sampling. A request's drafts depend on its own tokens and the datastore, and on
the cache of other requests' outputs only when it did not ask for a seed: a seeded request's
output is then the same whatever ran before it.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import Committed, Draft, ProposeItem, ProposerBase
from .ngram import match
from .suffix_index import SuffixIndex

ARCH = "SpecdecSuffixDatastore"
INDEX_FILE = "suffix_index.npz"
HEADER_TOKENS = 3       # prompt tokens kept before each answer (the chat template's assistant header)
PREFIX = "suffix_decoding_"
CACHE_KEY = PREFIX + "max_cached_requests"
MAX_MATCH = 1024        # the longest tail matched, whatever max_tree_depth says (vLLM sets no bound; the
                        # response cache's index pads each build with depth + 1 separators)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's suffix_decoding_* settings (same names and defaults)."""
    max_tree_depth: int = 24             # longest tail matched in the datastore and the cache (>= 1;
                                         # MAX_MATCH at most in effect)
    max_cached_requests: int = 10000     # finished requests' outputs kept for matching (0: none)
    max_spec_factor: float = 1.0         # draft at most floor(this x the match length) tokens (>= 0)
    min_token_prob: float = 0.1          # stop where the path's share of the occurrences falls below

    def __post_init__(self):
        # vLLM's bounds: max_tree_depth >= 1 and max_spec_factor >= 0, with no upper bound
        for name, lo, hi in (("max_tree_depth", 1, None), ("max_cached_requests", 0, 10**7)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v and (hi is None or v <= hi)):
                within = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"speculative_config.{PREFIX}{name} must be an integer {within}, got {v!r}")
        for name, lo, hi in (("max_spec_factor", 0, math.inf), ("min_token_prob", 0, 1)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi):
                within = f"in [{lo}, {hi}]" if hi != math.inf else f">= {lo}"
                raise ValueError(f"speculative_config.{PREFIX}{name} must be a number {within}, got {v!r}")

    @property
    def depth(self) -> int:
        """The longest tail matched: max_tree_depth, at most MAX_MATCH."""
        return min(self.max_tree_depth, MAX_MATCH)

    @classmethod
    def from_extra(cls, extra: dict) -> "SuffixSettings":
        return cls(**{k.removeprefix(PREFIX): v for k, v in extra.items() if k.startswith(PREFIX)
                      and k.removeprefix(PREFIX) in cls.__dataclass_fields__})


def load_datastore(folder, vocab_size: int | None = None) -> SuffixIndex:
    """A datastore folder written by `specdec train suffix` (config.json + suffix_index.npz).
    vocab_size: the target's; a datastore made for another vocabulary is refused in one line:
    one whose config records another vocab_size, or (any datastore, older ones too) one holding a
    token id the target does not have (its drafts would index past the target's embedding)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"{folder}: no readable config.json (expected a datastore folder written by "
                         f"`specdec train suffix`)") from None
    if (cfg.get("architectures") or [None])[0] != ARCH:
        raise ValueError(f"{folder}: not a suffix datastore (architectures: {cfg.get('architectures')})")
    recorded = cfg.get("vocab_size")
    if vocab_size is not None and recorded is not None and recorded != vocab_size:
        # not refused: one tokenizer may sit under vocabularies padded to other sizes (Qwen2.5 0.5B
        # and 7B: 151936 and 152064); the ids it holds are checked below
        logger.warning("%s: a suffix datastore built for a vocabulary of %d tokens, the target's has %d: its "
                       "drafts may come from another tokenizer (they stay lossless, only acceptance suffers)",
                       folder, recorded, vocab_size)
    index = SuffixIndex.load(folder / INDEX_FILE)
    if vocab_size is not None and index.max_token >= vocab_size:
        raise ValueError(f"{folder}: a suffix datastore holding token id {index.max_token}, the target's vocabulary "
                         f"has {vocab_size} tokens (build one from this target's answers: `specdec train suffix`)")
    return index


def save_datastore(index: SuffixIndex, folder, extra: dict | None = None, vocab_size: int | None = None) -> None:
    """vocab_size: the vocabulary the documents' ids are of (the target's), recorded for
    load_datastore's check (None: not known, not recorded)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index.save(folder / INDEX_FILE)
    cfg = {"architectures": [ARCH], "depth": index.depth, "num_tokens": index.num_tokens,
           **({"vocab_size": int(vocab_size)} if vocab_size is not None else {}), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


class ResponseCache:
    """The outputs of the last `max_requests` finished requests, indexed for suffix lookup. The
    index is rebuilt in a background thread (numpy's sorts release the GIL) once the outputs not
    yet in it reach a quarter of those that are, so the total indexing work stays within a small
    multiple of the tokens added; lookups use the latest finished index."""

    def __init__(self, max_requests: int, depth: int):
        self.max_requests, self.depth = max_requests, depth
        self.docs: collections.deque = collections.deque()
        self.index: SuffixIndex | None = None
        self.indexed = 0          # documents in self.index
        self.pending = 0          # documents added since the last build started
        self._thread: threading.Thread | None = None

    def add(self, tokens) -> None:
        if self.max_requests <= 0 or len(tokens) < 2:
            return
        self.docs.append(np.asarray(tokens, dtype=np.int64))
        while len(self.docs) > self.max_requests:
            self.docs.popleft()
        self.pending += 1
        if (self._thread is None or not self._thread.is_alive()) and self.pending * 4 >= max(4, self.indexed):
            docs, self.pending = list(self.docs), 0
            self._thread = threading.Thread(target=self._build, args=(docs,), name="specdec-suffix-index",
                                            daemon=True)
            self._thread.start()

    def _build(self, docs) -> None:
        index = SuffixIndex.build(docs, self.depth)
        self.index, self.indexed = index, len(docs)     # one reference swap: readers see old or new

    def wait(self) -> None:
        """Block until a build in flight has finished (tests)."""
        if self._thread is not None:
            self._thread.join()


class SuffixProposer(ProposerBase):
    name = "suffix"

    def __init__(self, settings: SuffixSettings = SuffixSettings(), n_max: int = 4, n_min: int = 2,
                 datastore: SuffixIndex | None = None):
        super().__init__()
        self.settings, self.n_max, self.n_min = settings, n_max, n_min
        self.datastore = datastore
        self.cache = ResponseCache(settings.max_cached_requests, settings.depth)
        self._seq: dict[Hashable, list[int]] = {}       # each request's sequence (kept while preempted)
        self._prompt_len: dict[Hashable, int] = {}      # and its prompt's length

    def add_request(self, request_id: Hashable, ctx) -> None:
        super().add_request(request_id, ctx)
        if ctx.prompt_len is not None:
            self._prompt_len[request_id] = ctx.prompt_len

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        return [Draft(torch.tensor(self.draft(it.request_id, it.seq, it.k), dtype=torch.long)) for it in items]

    def draft(self, request_id: Hashable, seq: list[int], k: int) -> list[int]:
        arr = np.asarray(seq, dtype=np.int64)
        own, n = match(arr, k, self.n_max, self.n_min)
        if n:
            return own.tolist()
        s = self.settings
        tail = arr[-s.depth:]
        ctx = self.ctx.get(request_id)
        sources = [self.datastore]
        # other requests' outputs only where they cannot change the output: greedy, or unseeded
        if ctx is None or ctx.params.greedy or ctx.params.seed is None:
            sources.append(self.cache.index)
        best = (0, None, 0, 0)
        for index in sources:
            if index is not None:
                lo, hi, m = index.match(tail)
                if m > best[0]:
                    best = (m, index, lo, hi)
        m, index, lo, hi = best
        # vLLM's cap: floor(factor x match length) tokens (0: no draft), never more than k
        f = s.max_spec_factor * m
        limit = k if f >= k else math.floor(f)
        if not m or limit <= 0:
            return []
        return index.continue_chain(lo, hi, m, limit, s.min_token_prob)[0]

    def update(self, items: list[Committed]) -> None:
        for it in items:
            if it.request_id not in self._seq and it.request_id not in self._prompt_len and it.prefill:
                # no prompt length given (a RequestContext built without one): a new request's
                # first prompt chunk comes before any output, so its sequence is the prompt
                self._prompt_len[it.request_id] = len(it.seq)
            self._seq[it.request_id] = it.seq

    def preempt_request(self, request_id: Hashable) -> None:
        """Its output so far stays out of the response cache (it joins once, whole, at the end):
        its sequence and prompt length are kept for remove_request."""
        super().remove_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        """The request's output joins the response cache (with the prompt's last tokens: the
        chat template's assistant header, so that the first tokens of an answer can match); a
        request that leaves before any output (aborted in its prefill) adds nothing. Any id is
        taken, one never added or already removed included."""
        super().remove_request(request_id)
        seq, p = self._seq.pop(request_id, None), self._prompt_len.pop(request_id, None)
        if seq is not None and p is not None and len(seq) > p:
            self.cache.add(seq[max(0, p - HEADER_TOKENS):])
