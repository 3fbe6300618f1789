"""What one forward over many sequences is told (vLLM's attention metadata), and what it returns.

A forward feeds N new tokens, flat: sequence b's T_b tokens follow sequence b-1's
(`cu_seqlens`). Sequence b's tokens go to its slots start_b .. start_b + T_b - 1 and see every
earlier slot of their own sequence, and among the new ones either the causal pattern or the
ancestor mask of a token tree (`TreeAttention`). Nothing crosses sequences, so a token's
logits do not depend on what else is in the batch.

Worked example: sequence 7 decodes with 2 drafts (3 tokens at slots 40..42), sequence 3
prefills a chunk of 4 tokens at slots 0..3, and only the decoding rows need logits:
    seqs (7, 3)   counts (3, 4)   starts (40, 0)   cu_seqlens [0, 3, 7]
    positions [40, 41, 42, 0, 1, 2, 3]            logits_indices [0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class ForwardOutput:
    """What Transformer.forward returns, always.

    logits: the rows asked for ([R, V] with a cache: `ForwardBatch.logits_indices`, all N when
            None; [B, T, V] without a cache), or None when the LM head was skipped
    hidden: the final-norm features of every fed token ([N, D] / [B, T, D]), when asked for
    """
    logits: Tensor | None = None
    hidden: Tensor | None = None


@dataclass(frozen=True)
class TreeAttention:
    """The attention pattern of one sequence's T new tokens when they form a tree.

    depth: [T] int   position offset of each node from the sequence's start slot (root = 0)
    mask:  [T, past + T] bool  over slots start - past .. start + T - 1: mask[i, past + j] =
           new node j is node i itself or one of its ancestors. Slots before start - past are
           visible to every node. past > 0 lets a tree grow over several forwards (EAGLE's
           drafting): earlier nodes stay in the cache and each new node sees its ancestors only.
    """
    depth: Tensor
    mask: Tensor
    past: int = 0

    @classmethod
    def from_parents(cls, parents: Sequence[int], device=None) -> "TreeAttention":
        """The root (the first token) and nodes hanging below parents[i] (-1 = the root)."""
        T = len(parents) + 1
        depth = [0] * T
        mask = torch.eye(T, dtype=torch.bool)
        mask[:, 0] = True
        for i, par in enumerate(parents):
            depth[i + 1] = depth[par + 1] + 1
            mask[i + 1] |= mask[par + 1]
        return cls(torch.tensor(depth, device=device), mask.to(device))


@dataclass(frozen=True)
class ForwardBatch:
    """Host-side metadata of one forward (see the module docstring); built by `build`."""
    seqs: tuple                      # [B] sequence ids in the cache
    counts: tuple[int, ...]          # [B] new tokens per sequence
    starts: tuple[int, ...]          # [B] slot of each sequence's first new token
    trees: tuple                     # [B] TreeAttention or None (causal)
    positions: Tensor                # [N] int64 rope positions
    cu_seqlens: Tensor               # [B + 1] int32
    start_slots: Tensor              # [B] int32 (starts as a tensor)
    rows: Tensor                     # [B] int32 block-table rows
    mask_from: Tensor                # [B] int32 first slot under the tree mask (= start when causal)
    mask_offsets: Tensor             # [B] int64 offset of each tree mask in `masks`, -1 = causal
    masks: Tensor | None             # [sum over trees of T * (past + T)] uint8
    logits_indices: Tensor | None    # [R] int64 rows that need logits; None = every row
    lora: Tensor | None = None       # [B] int32 each sequence's LoRA slot (-1: none); None: no adapter

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, kv, seqs: Sequence[Hashable], counts: Sequence[int], starts: Sequence[int] | None = None,
              trees: Sequence[TreeAttention | None] | None = None,
              logits: Sequence[int] | None = None, lora: Sequence[int] | None = None) -> "ForwardBatch":
        """seqs/counts/starts as above (starts default to the cache's lengths); trees per
        sequence or None; logits: per sequence how many of its LAST rows need logits, None = all;
        lora: per sequence its LoRA adapter's slot (-1: none), None = no adapter."""
        B = len(seqs)
        starts = [kv.length(s) for s in seqs] if starts is None else list(starts)
        trees = [None] * B if trees is None else list(trees)
        cu, positions, mask_from, offsets, masks, n_mask = [0], [], [], [], [], 0
        for seq, st, n, tree in zip(seqs, starts, counts, trees):
            if st + n > kv.blocks.capacity(seq):
                raise ValueError(f"sequence {seq!r}: slots {st}..{st + n - 1} lie beyond its "
                                 f"{kv.blocks.capacity(seq)} allocated slots")
            cu.append(cu[-1] + n)
            if tree is None:
                positions += range(st, st + n)
                mask_from.append(st)
                offsets.append(-1)
            else:
                positions += [st + d for d in tree.depth.tolist()]
                mask_from.append(st - tree.past)
                offsets.append(n_mask)
                masks.append(tree.mask.cpu().to(torch.uint8).flatten())
                n_mask += masks[-1].numel()
        idx = None
        if logits is not None:
            idx = torch.tensor([i for b, m in enumerate(logits) for i in range(cu[b + 1] - m, cu[b + 1])],
                               dtype=torch.long)
        # the int32 fields in one tensor (one allocation), handed out as contiguous slices
        meta = torch.tensor(cu + starts + [kv.blocks.row(s) for s in seqs] + mask_from, dtype=torch.int32)
        cu_t, starts_t, rows_t, from_t = meta[:B + 1], meta[B + 1:2 * B + 1], meta[2 * B + 1:3 * B + 1], meta[3 * B + 1:]
        return cls(tuple(seqs), tuple(counts), tuple(starts), tuple(trees), torch.tensor(positions, dtype=torch.long),
                   cu_t, starts_t, rows_t, from_t, torch.tensor(offsets, dtype=torch.long),
                   torch.cat(masks) if masks else None, idx,
                   None if lora is None else torch.tensor(lora, dtype=torch.int32))


@dataclass(frozen=True)
class SeqAttention:
    """One sequence's part of a forward, for the PyTorch path."""
    first: int                       # its first row among the N flat tokens
    count: int                       # its new tokens
    blocks: Tensor                   # [ceil(span / block_size)] its block ids, in slot order
    span: int                        # start + count: the slots its tokens may see
    seen: list | None                # per token: how many leading slots it sees (causal), or the
                                     # indices [n] of the slots it sees (tree); None when masked
    mask: Tensor | None              # [1, 1, count, span] bool, for a chunk too long to go row by row
    positions: Tensor | None = None  # [count] its tokens' positions (a sliding window counts from them)
    free_from: int = 0               # its first slot under a tree mask, which a sliding window leaves be
                                     # (span when causal: the window covers every slot)


# Whether the PyTorch path attends the decoding sequences of a batch in one padded call
# (PaddedAttention) rather than token by token; None: padded on devices other than the CPU.
PADDED: bool | None = None


@dataclass(frozen=True)
class PaddedAttention:
    """The sequences of a forward that feed at most kernels.MAX_ROWS tokens each (decoding,
    verification, trees), attended in one call: their B sequences padded to T rows and L slots.

    rows [n]: their tokens' rows among the N flat ones; slots [n]: the same tokens' rows of the
    padded [B * T] layout; table [B * L / block_size]: each sequence's blocks, padded with its
    first; mask [B, 1, T, L]: what each token sees (causal, or its tree's ancestors); positions
    [B, T] and free_from [B] for a sliding window (as SeqAttention); stale [B, 1, L, 1]: the slots
    at or past each sequence's span, never written or left by other work (a pool's memory is not
    cleared), zeroed after the gather since 0 x NaN is NaN. Padding rows see every slot (their
    results are dropped), so no softmax row is empty. dense: no padding rows and the tokens in
    their flat order (every sequence feeds T tokens and they are all of the forward's: decoding a
    batch), so the flat queries are already the padded layout and need no scatter nor gather."""
    rows: Tensor
    slots: Tensor
    table: Tensor
    B: int
    T: int
    L: int
    mask: Tensor
    positions: Tensor
    free_from: Tensor
    stale: Tensor
    dense: bool = False

    _by_window: dict = field(default_factory=dict, compare=False, repr=False)

    def masks(self, window: int | None) -> tuple[Tensor, Tensor]:
        """(what each token sees [B, 1, T, L], the slots no token of a sequence reads [B, 1, L, 1])
        under a sliding window of `window` positions (None: none), computed once per forward for
        all the layers with that window. Behind a window a slot is unread by every token (its block
        may have been given back and reused: KVCache.trim); the per-token attention never gathers it."""
        if window not in self._by_window:
            if window is None:
                self._by_window[window] = (self.mask, self.stale)
            else:
                s = torch.arange(self.L, device=self.mask.device)
                under_tree = s >= self.free_from[:, None]
                seen = (s > self.positions[..., None] - window) | under_tree[:, None]
                behind = (s <= self.positions[:, :1] - window) & ~under_tree     # row 0: the lowest position
                self._by_window[window] = (self.mask & seen[:, None], self.stale | behind[:, None, :, None])
        return self._by_window[window]

    @classmethod
    def of(cls, batch: "ForwardBatch", kv, picked: list[int], device, rows_to: int | None = None,
           slots_to: int | None = None) -> "PaddedAttention":
        """Vectorised over the sequences (a loop over them cost ~13 us a sequence every forward);
        only trees are walked one by one. rows_to / slots_to: pad T and L up to these (a CUDA
        graph's bucket, model/graphs.py) instead of the batch's own maxima."""
        bs = kv.block_size
        counts_list = [batch.counts[b] for b in picked]
        B, T, N = len(picked), max(max(counts_list), rows_to or 0), batch.num_tokens
        everyone = picked == list(range(len(batch.counts)))
        dense = everyone and B * T == N         # and T rows each: the flat rows are the padded layout
        sel = slice(None) if everyone else torch.tensor(picked, dtype=torch.long)
        counts = torch.tensor(counts_list)
        starts = batch.start_slots.long()[sel]
        spans = starts + counts
        nb = -(-max(max(batch.starts[b] + batch.counts[b] for b in picked), slots_to or 0) // bs)
        L = nb * bs
        j = torch.arange(T)
        table = kv.blocks.table[batch.rows.long()[sel], :nb].long()
        used = (spans + bs - 1) // bs                                    # a sequence's blocks; padded with its first
        table = torch.where(torch.arange(nb)[None, :] < used[:, None], table, table[:, :1])
        if dense:
            rows = slots = torch.arange(N)
            positions = batch.positions.view(B, T)
            ends = starts[:, None] + j[None, :] + 1
        else:
            real = j[None, :] < counts[:, None]                          # [B, T] rows that are tokens
            rows = (batch.cu_seqlens.long()[:-1][sel][:, None] + j[None, :])[real]
            slots = (torch.arange(B)[:, None] * T + j[None, :])[real]
            positions = torch.zeros(B, T, dtype=torch.long)
            positions[real] = batch.positions[rows]
            ends = torch.where(real, starts[:, None] + j[None, :] + 1, L)   # causal rows; padding sees all
        mask = torch.arange(L)[None, None, :] < ends[..., None]
        frees = spans.clone()
        for i, b in enumerate(picked):
            tree = batch.trees[b]
            if tree is None:
                continue
            m, lo = tree.mask, batch.starts[b] - tree.past
            n = m.shape[0]
            mask[i, :n] = False
            mask[i, :n, :lo] = True
            mask[i, :n, lo:lo + m.shape[1]] = m.cpu()
            frees[i] = lo
        return cls(rows.to(device), slots.to(device), table.reshape(-1).to(device), B, T, L, mask[:, None].to(device),
                   positions.to(device), frees.to(device),
                   (torch.arange(L)[None, :] >= spans[:, None])[:, None, :, None].to(device), dense=dense)


@dataclass(frozen=True)
class AttentionPlan:
    """The PyTorch path's view of a ForwardBatch, built once per forward for every layer.

    write_blocks, write_offsets: [N] where each new token's k/v go
    seqs: per sequence attended on its own, what its tokens attend to (model/llama.py: _paged_attention)
    padded: the sequences attended together in one padded call, or None
    slot: (block, offset) of the only new token when N == 1 (plain decoding of one sequence)
    """
    write_blocks: Tensor
    write_offsets: Tensor
    seqs: list[SeqAttention]
    slot: tuple[int, int] | None = None
    padded: PaddedAttention | None = None

    @classmethod
    def of(cls, batch: ForwardBatch, kv, device, max_rows: int, padded: bool | None = None) -> "AttentionPlan":
        """Sequences of at most max_rows tokens go token by token (or, padded, in one call when
        they are two or more or feed several rows: default PADDED), longer ones masked."""
        bs = kv.block_size
        device = torch.device(device)
        padded = (device.type != "cpu" if PADDED is None else PADDED) if padded is None else padded
        short = [b for b, n in enumerate(batch.counts) if n <= max_rows] if padded else []
        # one call for two or more sequences, or for one sequence's several rows (verifying a
        # chain or a tree, a drafter's update): token by token, each row would cost a layer its
        # own gather and attention call, ~10 launches a row on a GPU. A single row stays on the
        # per-token path (plain decoding of one sequence: its slot fast path)
        short = short if len(short) > 1 or (short and batch.counts[short[0]] > 1) else []
        seqs, first, N = [], 0, batch.num_tokens
        if N == 1:          # plain decoding of one sequence: its slot in plain ints, no index tensors
            st = batch.starts[0]
            slot = (kv.blocks.blocks(batch.seqs[0])[st // bs], st % bs)
            write_blocks, write_offsets = torch.tensor([slot[0]]), torch.tensor([slot[1]])
        else:               # each token's slot: its sequence's start + its index among the sequence's tokens
            slot = None
            counts = torch.tensor(batch.counts)
            seq_of = torch.repeat_interleave(torch.arange(len(counts)), counts)
            cu = batch.cu_seqlens.long()
            slots = batch.start_slots.long()[seq_of] + torch.arange(N) - cu[seq_of]
            write_blocks = kv.blocks.table[batch.rows.long()[seq_of], slots // bs].long()
            write_offsets = slots % bs
        for b, (seq, st, n, tree) in enumerate(zip(batch.seqs, batch.starts, batch.counts, batch.trees)):
            span = st + n
            if short and n <= max_rows:      # in the padded call
                first += n
                continue
            blocks = torch.tensor(kv.blocks.blocks(seq)[:-(-span // bs)], device=device)
            seen, mask = None, None
            if n <= max_rows:
                seen = list(range(st + 1, span + 1)) if tree is None else _tree_seen(tree, st, device)
            else:
                mask = _chunk_mask(tree, st, n).to(device)[None, None]
            seqs.append(SeqAttention(first, n, blocks, span, seen, mask, batch.positions[first:first + n].to(device),
                                     span if tree is None else st - tree.past))
            first += n
        return cls(write_blocks.to(device), write_offsets.to(device), seqs, slot,
                   PaddedAttention.of(batch, kv, short, device) if short else None)


def _tree_seen(tree: TreeAttention, start: int, device) -> list[Tensor]:
    """Per node: the slots it sees, the prefix before start - past, then its tree ancestors."""
    lo = start - tree.past
    prefix = torch.arange(lo)
    return [torch.cat([prefix, lo + row.nonzero().flatten()]).to(device) for row in tree.mask.cpu()]


def _chunk_mask(tree: TreeAttention | None, start: int, n: int) -> Tensor:
    """[n, start + n] bool: what each of n new tokens sees."""
    cols = torch.arange(start + n)
    if tree is None:
        return cols[None, :] <= start + torch.arange(n)[:, None]
    lo = start - tree.past
    mask = (cols < lo)[None, :].expand(n, -1).clone()
    mask[:, lo:] = tree.mask.cpu()
    return mask
