"""Paged KV memory (vLLM's layout): fixed-size blocks shared by every sequence in flight.

- `BlockManager` decides which blocks each sequence owns: a free list, a block table per
  sequence (a row of one persistent [max_seqs, max_blocks] int32 tensor, so a forward passes
  row indices, never rebuilt tables) and, per sequence, a host-side length for each cache that
  mirrors it. Several caches share one manager: the target's, a draft model's, an EAGLE
  head's. One allocation covers them all, and freeing a sequence frees it everywhere.
- `KVCache` holds the tensors of one model: per layer k, v [n_kv, num_blocks, block_size,
  head_dim]. Slot s of a sequence lives in block table[s // block_size], offset s % block_size;
  kv heads outermost, so that a sequence's blocks gathered for one head are one contiguous run.
  An int8 cache (`--kv-cache-dtype int8`) adds per layer k_scale, v_scale [n_kv, num_blocks,
  block_size] fp32: each (slot, kv head) row of head_dim values is stored as round(x / d) with
  d = absmax / 127 (`quantize_rows`), computed once when the slot is written. The scales sit in
  the same blocks as the rows, so whatever shares or reuses a block (prefix caching, a
  preempted request's recompute) carries them, and `move` copies them with the rows.

Prefix caching (vLLM's automatic prefix caching, `enable_prefix_caching`: LLM and the CLI default to on): a full block
whose slots hold the keys and values of known tokens in every cache (the target's, and a draft
model's or an EAGLE head's once they have caught up) is registered under a hash of those tokens
and of every token before them (a chain over the blocks). A new sequence whose
prompt starts with registered blocks takes them (reference counts) instead of computing them
again; a block nobody holds stays registered until the pool needs it (least recently freed
first). The C forward computes each token's keys and values bit-identically whatever the
chunking, so a reused block holds exactly what recomputing it would give.

Sliding windows (Mistral, Phi-3, Qwen2 with every layer windowed): when every cache sharing
the manager attends only to the last `window` positions (each cache says so when it registers),
the blocks wholly behind every cache's window are given back after each step (`trim`, vLLM frees
them the same way), so a long sequence holds about window + a step's slots. Their block-table
entries stay as they were: no forward reads them (the C attention skips whole blocks before a
window, the PyTorch one masks them) and they always point at written, finite rows.

Rejected drafts are never erased: `rollback` only lowers the length, and the next step
overwrites those slots (vLLM's scheduler rewinds the same way). `move` copies a tree's
accepted path next to the prefix. A contiguous cache of B rows x max_len slots is the special
case block_size = max_len, one block per row (`KVCache.dense`): [n_kv, batch, max_len, head_dim].
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class _SeqBlocks:
    row: int
    blocks: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)   # one per registered cache
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its first full blocks
    released: int = 0          # its first blocks given back behind a sliding window (`trim`)
    root: bytes = b""          # the parent of its first block's hash (a LoRA adapter's key: admit)
    shares: bool = True        # its full blocks become findable (False: KV of weights since replaced)


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block: its tokens and (through parent) every token before them."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("l", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Blocks and block tables of up to `max_seqs` sequences (any hashable ids)."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        if num_blocks < 1 or block_size < 1 or max_seqs < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"a KV pool needs at least one block, row and slot, got num_blocks={num_blocks}, "
                             f"block_size={block_size}, max_seqs={max_seqs}, max_blocks_per_seq={max_blocks_per_seq}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)   # host, persistent
        self._free = list(range(num_blocks - 1, -1, -1))      # a stack: block 0 is handed out first
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._num_caches = 0
        self._windows: list[int | None] = []     # each cache's sliding window (None: full attention)
        # the positions every cache may still read behind a sequence's next token when each of
        # them is windowed (the largest window); None when any attends to its whole context
        self.window: int | None = None
        # prefix caching: blocks by hash, hashes by block, holders per block, and the registered
        # blocks nobody holds (least recently freed first: evicted in that order)
        self.prefix_caching = False
        # a hit's last block computed again (Medusa's, MLP speculators': they draft from the
        # feature of the token before the last, which a hit up to the last would leave uncomputed)
        self.recompute_last_hit = False
        # tokens after a block that its key covers too: 1 where a cache's slot j also depends on
        # token j + 1 (EAGLE's pairs): a block's last slot then reads the next block's first token,
        # so its content is a function of its key's tokens (else, held by a sequence that went on
        # otherwise, it would be found behind another sequence's next block)
        self.key_overlap = 0
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * num_blocks
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries = 0          # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_hits = 0             # ... found in the cache
        self.returned_hits = 0           # tokens preempted requests found cached on their return (not in the metrics)

    def register_cache(self, window: int | None = None) -> int:
        """A cache mirroring these sequences; returns its index into each sequence's lengths.
        window: every layer of its model attends to the last `window` positions only."""
        self._num_caches += 1
        self._windows.append(window)
        self.window = None if None in self._windows else max(self._windows)
        for s in self._seqs.values():
            s.lengths.append(0)
        return self._num_caches - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: free ones and registered ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def max_slots_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    def blocks_for(self, num_slots: int) -> int:
        return math.ceil(num_slots / self.block_size)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def add(self, seq: Hashable) -> None:
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} already holds KV blocks")
        if not self._free_rows:
            raise RuntimeError("no free block-table row: more sequences than max_seqs")
        self._seqs[seq] = _SeqBlocks(self._free_rows.pop(), lengths=[0] * self._num_caches)

    def remove(self, seq: Hashable) -> None:
        """Free the sequence's blocks and row in every cache (finished, aborted, preempted);
        registered blocks stay findable until the pool needs them."""
        s = self._seqs.pop(seq)
        for b in reversed(s.blocks[s.released:]):
            self._unref(b)
        self._free_rows.append(s.row)

    def _unref(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._free.append(b)

    def trim(self, seq: Hashable) -> int:
        """Give back seq's blocks that no cache will read again: those whose slots all lie
        `window` or more positions behind the first slot any cache writes next (its length).
        Returns how many it gave back (0 unless every cache is windowed)."""
        window = self.window
        if window is None:
            return 0
        s = self._seqs[seq]
        keep_from = min(s.lengths, default=0) - window + 1     # the oldest slot a future token sees
        upto = min(max(0, keep_from) // self.block_size, len(s.blocks))
        for i in range(s.released, upto):
            self._unref(s.blocks[i])
        n, s.released = max(0, upto - s.released), max(s.released, upto)
        return n

    def _take(self) -> int:
        """A block for new slots: a free one, else the least recently freed registered one."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
        self._refs[b] = 1
        return b

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block (vLLM's reset_prefix_cache): all become plain free
        blocks. False, and nothing changed, while a sequence holds blocks."""
        if self._seqs:
            return False
        self._by_hash.clear()
        self._hash_of.clear()
        self._idle.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return True

    def forget_prefixes(self) -> None:
        """No block findable from now on, held or not (new weights: KV computed with the old ones
        must not be found by a later prompt); those nobody holds become free. Unlike
        reset_prefix_cache it works while sequences hold blocks: a held block that loses its key
        is freed as a private one, and the sequences holding blocks now register none of their
        later blocks either (they attend over the old weights' KV)."""
        for s in self._seqs.values():
            s.shares = False
        self._by_hash.clear()
        self._hash_of.clear()
        self._free.extend(self._idle)
        self._idle.clear()

    def cached_prefix(self, tokens: Sequence[int], root: bytes = b"") -> list[int]:
        """The registered blocks that hold the longest run of tokens' full blocks from the start
        (root: what else the keys and values depend on, a LoRA adapter: part of every hash)."""
        found, parent, bs, over = [], root, self.block_size, self.key_overlap
        for i in range(max(0, len(tokens) - over) // bs):
            parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs + over])
            b = self._by_hash.get(parent)
            if b is None:
                break
            found.append(b)
        return found

    def shares(self, seq: Hashable) -> bool:
        """Will seq's full blocks become findable as it computes them (prefix caching on, and its
        KV not of weights since replaced)?"""
        return self.prefix_caching and seq in self._seqs and self._seqs[seq].shares

    def admit(self, seq: Hashable, tokens: Sequence[int], num_slots: int, ahead: int | None = None,
              root: bytes = b"", queries: int | None = -1) -> int | None:
        """Add seq with room for num_slots slots, its first blocks taken from the prefix cache
        when tokens (what its cache may hold: the prompt but its last token) start with
        registered blocks. Returns how many leading tokens it found cached, or None (nothing
        changed) when the pool lacks the blocks. ahead: room only for that many slots past the
        cached ones (at most num_slots), the rest allocated as it is written (sliding windows).
        root: the key of what else the cache depends on (cached_prefix), kept for register.
        queries: the tokens this admission counts as looked up in prefix_queries (its hits in
        prefix_hits); -1: len(tokens); None: it is not counted (a preempted request's return: vLLM
        keeps those apart from the prefix-cache metrics, they would hit the request's own blocks)."""
        hit = self.cached_prefix(tokens, root) if self.prefix_caching else []
        if self.recompute_last_hit and len(hit) * self.block_size >= len(tokens):
            hit = hit[:-1]          # it holds the token before the last, whose feature must be computed
        if ahead is not None:
            num_slots = min(num_slots, len(hit) * self.block_size + ahead)
        idle = sum(1 for b in hit if self._refs[b] == 0)
        if self.blocks_for(num_slots) - len(hit) > self.num_free_blocks - idle:
            return None
        self.add(seq)
        s = self._seqs[seq]
        s.root = root
        for b in hit:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1
            self.table[s.row, len(s.blocks)] = b
            s.blocks.append(b)
            s.hashes.append(self._hash_of[b])
        self.ensure(seq, num_slots)
        cached = len(hit) * self.block_size
        if self.prefix_caching and queries is not None:
            self.prefix_queries += len(tokens) if queries == -1 else queries
            self.prefix_hits += cached
        elif self.prefix_caching:
            self.returned_hits += cached        # a preempted request's own blocks, found again
        s.lengths = [cached] * self._num_caches
        return cached

    def register(self, seq: Hashable, tokens: Sequence[int], num_written: int) -> None:
        """Every cache of seq holds what it holds for tokens[:num_written] (the target's, and a
        draft model's or an EAGLE head's as far as they have caught up): its full blocks among
        them become findable (a block whose content is registered already, by a sequence that
        computed it at the same time, stays private and is freed as usual)."""
        if not self.prefix_caching:
            return
        s, bs, over = self._seqs[seq], self.block_size, self.key_overlap
        if not s.shares:
            return
        for i in range(len(s.hashes), min(num_written // bs, len(s.blocks), max(0, len(tokens) - over) // bs)):
            h = chain_hash(s.hashes[-1] if s.hashes else s.root, tokens[i * bs:(i + 1) * bs + over])
            s.hashes.append(h)
            b = s.blocks[i]
            if i >= s.released and h not in self._by_hash and b not in self._hash_of:
                self._by_hash[h], self._hash_of[b] = b, h

    def mirror(self, tables: Sequence[tuple[Hashable, int, Sequence[int]]]) -> None:
        """Hold exactly these sequences, as another manager placed them: (id, block-table row,
        blocks). A tensor-parallel worker's caches follow rank 0's allocations this way; its own
        free lists stay unused."""
        self._seqs = {}
        for seq, row, blocks in tables:
            self.table[row, :len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
            self._seqs[seq] = _SeqBlocks(row, list(blocks), [0] * self._num_caches)

    def row(self, seq: Hashable) -> int:
        return self._seqs[seq].row

    def capacity(self, seq: Hashable) -> int:
        """Slots the sequence can write without allocating."""
        return len(self._seqs[seq].blocks) * self.block_size

    def missing_blocks(self, seq: Hashable, num_slots: int) -> int:
        return max(0, self.blocks_for(num_slots) - len(self._seqs[seq].blocks))

    def ensure(self, seq: Hashable, num_slots: int) -> bool:
        """Grow the sequence to hold `num_slots` slots; False (nothing allocated) when the pool
        lacks the blocks. Never shrinks: blocks stay until the sequence is removed."""
        if num_slots > self.max_slots_per_seq:
            raise ValueError(f"{num_slots} slots exceed the {self.max_slots_per_seq} a sequence may hold")
        s = self._seqs[seq]
        need = self.blocks_for(num_slots) - len(s.blocks)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self._take()
            self.table[s.row, len(s.blocks)] = block
            s.blocks.append(block)
        return True

    def blocks(self, seq: Hashable) -> list[int]:
        return self._seqs[seq].blocks

    def length(self, seq: Hashable, cache: int) -> int:
        return self._seqs[seq].lengths[cache]

    def set_length(self, seq: Hashable, cache: int, length: int) -> None:
        s = self._seqs[seq]
        if not 0 <= length <= len(s.blocks) * self.block_size:
            raise ValueError(f"sequence {seq!r}: length {length} is outside its {len(s.blocks) * self.block_size} slots")
        s.lengths[cache] = length


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., hd] -> (int8 [..., hd], fp32 scales [...]): d = absmax / 127 per row and
    round(x / d), ties to even (d = 0: zeros). A NaN in a row makes its d NaN (amax propagates
    it) and its q zeros, so the whole row reads back NaN. attention.c's
    quantize_row does the same fp32 operations, so both paths store the same bytes for the same
    keys and values."""
    x = x.float()
    d = x.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(x / torch.where(d > 0, d, 1)[..., None]), 0)
    return q.clamp_(-127, 127).to(torch.int8), d


class KVCache:
    """One model's keys and values over the blocks of a BlockManager (see the module docstring).

    dtype: fp32, bf16 (the rows as stored) or torch.int8 (rows quantized, with k_scale and
    v_scale; None otherwise)."""

    def __init__(self, blocks: BlockManager, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, window: int | None = None,
                 values_are_keys: bool = False, spare: bool = False):
        """values_are_keys: the model's values are its keys (DeepSeek's latent attention caches one
        [latent ; rotary key] row per token and reads values from the same rows): v is k, stored once.
        spare: one more block past the pool's, never handed out (`spare_block`): where the padding
        rows of a CUDA graph's forward write (model/graphs.py)."""
        self.spare_block = blocks.num_blocks if spare else None
        shape = (num_kv_heads, blocks.num_blocks + int(spare), blocks.block_size, head_dim)
        # empty: no path ever reads a slot before writing it (attention sees slots < start + T
        # only), and untouched pages of a large pool cost no memory until used
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = self.k if values_are_keys else [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[Tensor] | None = None
        self.v_scale: list[Tensor] | None = None
        if dtype == torch.int8:
            self.k_scale = [torch.empty(shape[:-1], dtype=torch.float32, device=device) for _ in range(num_layers)]
            self.v_scale = self.k_scale if values_are_keys else \
                [torch.empty(shape[:-1], dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.dtype = dtype
        self.blocks = blocks
        self.index = blocks.register_cache(window)     # window: every layer's sliding window

    @classmethod
    def dense(cls, batch: int, max_len: int, num_layers: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device, **kw) -> "KVCache":
        """`batch` sequences 0..batch-1 of `max_len` slots each, one block per sequence (kw: a
        subclass's own arguments)."""
        manager = BlockManager(batch, max_len, batch, 1)
        cache = cls(manager, num_layers, num_kv_heads, head_dim, dtype, device, **kw)
        for row in range(batch):
            manager.add(row)
            manager.ensure(row, max_len)
        return cache

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       values_are_keys: bool = False) -> int:
        """Keys and values of one slot in every layer (int8: head_dim bytes and a 4-byte scale per row)."""
        row = head_dim + 4 if dtype == torch.int8 else head_dim * torch.empty(0, dtype=dtype).element_size()
        return (1 if values_are_keys else 2) * num_layers * num_kv_heads * row

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def length(self, seq: Hashable = 0) -> int:
        """Valid slots of the sequence in this cache (host-side: reading it costs no sync)."""
        return self.blocks.length(seq, self.index)

    def set_length(self, seq: Hashable, length: int) -> None:
        self.blocks.set_length(seq, self.index, length)

    def rollback(self, seq: Hashable, length: int) -> None:
        """Forget every slot from `length` on; O(1), the stale slots are simply overwritten."""
        if not 0 <= length <= self.length(seq):
            raise ValueError(f"cannot roll back sequence {seq!r} from {self.length(seq)} to {length}")
        self.set_length(seq, length)

    def slot_index(self, seq: Hashable, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(block ids [n], offsets [n]) of the sequence's logical slots."""
        table = self.blocks.blocks(seq)
        bs = self.block_size
        blk = torch.tensor([table[s // bs] for s in slots], device=self.k[0].device)
        off = torch.tensor([s % bs for s in slots], device=self.k[0].device)
        return blk, off

    def entries(self, seq: Hashable, slots: Sequence[int], layer: int) -> tuple[Tensor, Tensor]:
        """The (keys, values) [n, n_kv, head_dim] a layer holds at the sequence's slots (an int8
        cache's dequantized to fp32: what attention reads)."""
        blk, off = self.slot_index(seq, slots)
        k, v = self.k[layer][:, blk, off], self.v[layer][:, blk, off]
        if self.k_scale is not None:
            k = k.float() * self.k_scale[layer][:, blk, off][..., None]
            v = v.float() * self.v_scale[layer][:, blk, off][..., None]
        return k.transpose(0, 1), v.transpose(0, 1)

    def write(self, layer: int, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new keys and values k, v [n_kv, n, head_dim] at (blocks [n], offsets [n]) of a
        layer, rounded (bf16) or quantized (int8) to the cache's format (the PyTorch path)."""
        if self.k_scale is None:
            same = k.dtype == self.dtype         # index_put_ takes only its own dtype
            self.k[layer][:, blocks, offsets] = k if same else k.to(self.dtype)
            self.v[layer][:, blocks, offsets] = v if same else v.to(self.dtype)
            return
        for rows, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, d = quantize_rows(x)
            rows[layer][:, blocks, offsets] = q
            scales[layer][:, blocks, offsets] = d

    def gather(self, layer: int, blocks: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A sequence's blocks [nb] of a layer, dequantized: (keys, values) [n_kv, nb * bs, head_dim]
        in dtype (the PyTorch path's attention reads these)."""
        out = []
        for rows, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = torch.index_select(rows[layer], 1, blocks)
            if scales is not None:   # the row's scale in fp32, as forward.c applies it
                x = x.float() * torch.index_select(scales[layer], 1, blocks)[..., None]
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            out.append(x if x.dtype == dtype else x.to(dtype))
        return out[0], out[1]

    def move(self, seq: Hashable, src: Sequence[int], dst_start: int) -> None:
        """Copy the entries of slots `src` to `dst_start, dst_start+1, ...` in every layer.

        Tree verification writes each node at its own slot; the accepted path is then moved
        to be contiguous after the prefix. The sources are read before anything is written.
        """
        src = list(src)
        dst = list(range(dst_start, dst_start + len(src)))
        if src == dst:
            return
        sb, so = self.slot_index(seq, src)
        db, do = self.slot_index(seq, dst)
        # each tensor once: with values_are_keys v is k (and v_scale k_scale), and a second copy
        # of the same rows would read sources the first already overwrote (dst overlaps src)
        seen: set[int] = set()
        for cache in (self.k, self.v, self.k_scale or [], self.v_scale or []):
            for t in cache:
                if id(t) not in seen:
                    seen.add(id(t))
                    t[:, db, do] = t[:, sb, so]


def plan_blocks(config, bytes_per_slot: int, max_slots_per_seq: int, device) -> tuple[int, int]:
    """(blocks in the pool, blocks one sequence may hold) for a SchedulerConfig's budget.

    bytes_per_slot: every cache sharing the blocks (target + draft); max_slots_per_seq: the
    most slots one sequence can need (max_model_len plus what drafting writes past it). The
    pool must hold one such sequence, so that a lone request always runs.
    """
    from ..config import DEFAULT_KV_CAP

    bs = config.block_size
    per_seq = math.ceil(max_slots_per_seq / bs)
    block_bytes = bytes_per_slot * bs
    budget = config.kv_cache_memory
    override = getattr(config, "num_gpu_blocks_override", None)
    if override is not None:          # vLLM's: this many blocks, whatever the budget (tests of preemption)
        if override < per_seq:
            raise ValueError(f"num_gpu_blocks_override {override} holds {override * bs} token slots; one sequence "
                             f"of max_model_len needs {per_seq} blocks ({per_seq * bs} slots)")
        return override, per_seq
    if budget is None and config.gpu_memory_utilization is not None and torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(config.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device)
    if budget is None:
        num_blocks = min(config.max_num_seqs * per_seq, max(per_seq, DEFAULT_KV_CAP // block_bytes))
    else:
        num_blocks = budget // block_bytes
        if num_blocks < per_seq:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds {num_blocks * bs} token slots; one sequence "
                             f"of max_model_len needs {per_seq * bs} ({per_seq * block_bytes} bytes)")
    return num_blocks, per_seq
