"""CUDA graphs for the target's small forwards (vLLM's `cudagraph_mode` "FULL_DECODE_ONLY").

On a GPU a 30-layer forward of a small model costs its kernel launches, not its arithmetic
(bench/gpu-h100/2026-12-05: 10.4 ms a SmolLM2 step, ~6 us an op). A CUDA graph records a
forward's kernels once and replays them in one launch. A graph holds fixed shapes and fixed
addresses, so each is captured for a bucket (B sequences x T rows a sequence x L slots a
sequence, vLLM's capture sizes for B) over static input buffers, and a forward that fits a
bucket is padded into it:

- every sequence's rows start at row b * T (the padded attention's layout, `PaddedAttention`
  with `dense`): a decoding batch (T = 1), a verification of up to T - 1 drafts (chain or tree:
  the tree is the mask, which is an input), a short prompt chunk;
- padding rows (a sequence's rows past its count, and whole padding sequences) write their keys
  and values into the cache's spare block (`KVCache.spare_block`, never handed out) and see
  every slot; their outputs are dropped;
- a sequence's slots past its span are zeroed after the gather (`stale`), as in the eager path.

What the graph computes is the eager padded path's arithmetic on the same values (the same
function runs, with the inputs read from the buffers), padded to the bucket: on a GPU the
products of a differently padded batch may round their last bits differently, as any two batch
sizes there do on the eager path too (llama.py: _paged_attention). Forwards that do not fit (a long prompt chunk, LoRA, EAGLE-3's feature layers,
mixture-of-experts or latent-attention models, tensor-parallel shards) run eagerly.

Off CUDA, `emulate=True` stands a replay of the captured function in for the graph (tests: the
static-buffer logic, the padding and the capture-safety check run on the CPU); the capture then
fails on anything a CUDA graph cannot hold: a host read of a tensor (`.item()`, `.tolist()`,
`nonzero`) or a tensor made from host data inside the forward.
"""

from __future__ import annotations

import collections

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from .batch import AttentionPlan, ForwardBatch, ForwardOutput, PaddedAttention

# Off CUDA, engines build their graphs emulated (tests set this; elsewhere a CPU model refuses graphs)
EMULATE = False

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)   # vLLM's capture sizes, up to 512
ROW_SIZES = (1, 2, 4, 8, 16)            # rows a sequence (the last token and up to 15 drafts)
MIN_SLOTS = 256                         # the smallest slot bucket; then powers of two
MAX_GRAPHS = 256                        # captured at most (each holds its inputs and a capture's time); then eager

# ops that read a tensor on the host or make one from host data: they break a capture (a graph
# holds device work only, and such a value would be frozen into it)
_HOST_OPS = {"_local_scalar_dense", "nonzero", "lift_fresh", "item", "masked_select", "_assert_async"}


class CaptureError(RuntimeError):
    pass


class _NoHostOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_OPS:
            raise CaptureError(f"aten.{name} inside a captured forward: a CUDA graph cannot hold it")
        return func(*args, **(kwargs or {}))


def _bucket(n: int, sizes) -> int | None:
    return next((s for s in sizes if s >= n), None)


class _Replay:
    """Off CUDA (emulate): the captured function run again into the same output tensors."""

    def __init__(self, fn, outs: tuple):
        self.fn, self.outs = fn, outs

    def replay(self) -> None:
        for o, new in zip(self.outs, self.fn()):
            if o is not None:
                o.copy_(new)


# the static inputs by dtype: each group lives in one device buffer, so a replay's inputs cross to the
# device in two copies, not eight (each a host round trip on a GPU)
_LONGS = ("tokens", "positions", "write_blocks", "write_offsets", "table", "free_from")
_BOOLS = ("mask", "stale")


def _packed(host: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    return (torch.cat([host[n].reshape(-1) for n in _LONGS]), torch.cat([host[n].reshape(-1) for n in _BOOLS]))


class _Graph:
    def __init__(self, buffers: tuple[Tensor, Tensor], inputs: dict[str, Tensor], graph, outs: tuple):
        self.buffers, self.inputs, self.graph, self.outs = buffers, inputs, graph, outs


class CudaGraphs:
    """The target's graphs over one KV cache, captured on first use of each bucket."""

    def __init__(self, model, kv, batch_sizes=BATCH_SIZES, row_sizes=ROW_SIZES, emulate: bool = False):
        if not emulate and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        if kv.spare_block is None:
            raise ValueError("CUDA graphs need a KV cache with a spare block (KVCache(spare=True))")
        self.model, self.kv, self.emulate = model, kv, emulate
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.row_sizes = tuple(sorted(row_sizes))
        bs = kv.block_size
        self.max_slots = kv.blocks.max_blocks_per_seq * bs
        self.graphs: dict[tuple, _Graph] = {}
        self.max_graphs = MAX_GRAPHS
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.stats = collections.Counter()          # captured, replayed, eager (by reason)
        cfg = model.config
        self.unsupported = ("mixture-of-experts layers" if cfg.moe_layers else
                            "latent attention" if cfg.kv_lora_rank else
                            "tensor parallelism" if model.tp_size > 1 else None)

    # -- which forwards -------------------------------------------------------------------

    def key(self, batch: ForwardBatch, logits: bool, hidden) -> tuple | None:
        """(B, T, L, logits, hidden) of the graph a forward fits, or None (then it runs eagerly)."""
        reason = self._why_eager(batch, hidden)
        if reason is not None:
            self.stats[f"eager: {reason}"] += 1
            return None
        B = _bucket(len(batch.seqs), self.batch_sizes)
        T = _bucket(max(batch.counts), self.row_sizes)
        span = max(st + n for st, n in zip(batch.starts, batch.counts))
        L = min(max(MIN_SLOTS, 1 << (span - 1).bit_length()), self.max_slots)
        L = -(-L // self.kv.block_size) * self.kv.block_size
        return B, T, L, bool(logits), bool(hidden)

    def _why_eager(self, batch: ForwardBatch, hidden) -> str | None:
        if self.unsupported:
            return self.unsupported
        if isinstance(hidden, tuple):
            return "feature layers"
        if batch.lora is not None:
            return "LoRA"
        if _bucket(len(batch.seqs), self.batch_sizes) is None:
            return "batch larger than the capture sizes"
        if max(batch.counts) > self.row_sizes[-1] or min(batch.counts) < 1:
            return "rows"
        return None

    # -- running ----------------------------------------------------------------------------

    def __call__(self, tokens: Tensor, batch: ForwardBatch, logits: bool, hidden) -> ForwardOutput | None:
        key = self.key(batch, logits, hidden)
        if key is None:
            return None
        B, T, L, _, _ = key
        g = self.graphs.get(key)
        if g is None and len(self.graphs) >= self.max_graphs:
            self.stats["eager: graph limit"] += 1
            return None
        host, rows = self._host_inputs(tokens, batch, B, T, L)
        if g is None:
            g = self._capture(key, host)
        else:
            for buf, t in zip(g.buffers, _packed(host)):
                buf.copy_(t, non_blocking=True)
            g.graph.replay()
            self.stats["replayed"] += 1
        out_logits, out_hidden = g.outs
        idx = rows.to(self.model.device)
        sel = idx if batch.logits_indices is None else idx[batch.logits_indices.to(idx.device)]
        return ForwardOutput(out_logits.index_select(0, sel) if logits else None,
                             out_hidden.index_select(0, idx) if hidden else None)

    def _host_inputs(self, tokens: Tensor, batch: ForwardBatch, B: int, T: int, L: int) -> tuple[dict, Tensor]:
        """The static inputs of bucket (B, T, L) for this forward, on the host, and each flat
        row's row in the graph [N]: the eager path's padded layout (PaddedAttention.of, padded
        to T rows and L slots), then B - B0 padding sequences over the spare block."""
        kv, bs, spare = self.kv, self.kv.block_size, self.kv.spare_block
        B0, nb = len(batch.seqs), L // bs
        p = PaddedAttention.of(batch, kv, list(range(B0)), "cpu", rows_to=T, slots_to=L)
        own = p.table.view(B0, nb)
        table = torch.full((B, nb), spare, dtype=torch.long)
        table[:B0] = own
        mask = torch.ones(B, 1, T, L, dtype=torch.bool)         # padding sequences see every slot
        mask[:B0] = p.mask
        stale = torch.zeros(B, 1, L, 1, dtype=torch.bool)
        stale[:B0] = p.stale
        free = torch.zeros(B, dtype=torch.long)
        free[:B0] = p.free_from
        pos = torch.zeros(B * T, dtype=torch.long)
        pos[:B0 * T] = p.positions.reshape(-1)
        rows = p.slots                                            # each flat row's row in the graph
        toks = torch.zeros(B * T, dtype=torch.long)
        toks[rows] = tokens.cpu()
        seq_of = rows // T
        slot = batch.start_slots.long()[seq_of] + rows % T         # each token's slot: its sequence's start + its index
        wb = torch.full((B * T,), spare, dtype=torch.long)        # padding rows write into the spare block
        wo = torch.zeros(B * T, dtype=torch.long)
        wb[rows] = own[seq_of, slot // bs]
        wo[rows] = slot % bs
        return {"tokens": toks, "positions": pos, "write_blocks": wb, "write_offsets": wo, "table": table.view(-1),
                "mask": mask, "stale": stale, "free_from": free}, rows

    def _body(self, inputs: dict[str, Tensor], key: tuple):
        B, T, L, logits, hidden = key
        rows = torch.arange(B * T, device=inputs["tokens"].device)
        padded = PaddedAttention(rows, rows, inputs["table"], B, T, L, inputs["mask"],
                                 inputs["positions"].view(B, T), inputs["free_from"], inputs["stale"], dense=True)
        plan = AttentionPlan(inputs["write_blocks"], inputs["write_offsets"], [], None, padded)
        out = self.model._run_layers(inputs["tokens"], None, inputs["positions"], self.model._torch_attention(self.kv, plan),
                                     self.model.config.num_hidden_layers, logits, hidden, None)
        return out.logits, out.hidden

    def _capture(self, key: tuple, host: dict[str, Tensor]) -> _Graph:
        dev = self.model.device
        buffers = tuple(t.to(dev) for t in _packed(host))
        inputs = {}
        for names, buf in zip((_LONGS, _BOOLS), buffers):
            at = 0
            for n in names:         # views of the two buffers, in _packed's order
                k = host[n].numel()
                inputs[n] = buf[at:at + k].view(host[n].shape)
                at += k

        def fn():
            return self._body(inputs, key)

        # a first run unchecked: one-time set-ups on the way (a library loaded, a constant cached)
        # happen there, not in the graph; then every run is checked for per-call host work
        if self.emulate:
            fn()
            with _NoHostOps():
                outs = fn()         # this forward's result, computed
            graph = _Replay(fn, outs)
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                with _NoHostOps():
                    for _ in range(2):      # warm-up: kernels picked, workspaces allocated (the same values written)
                        fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outs = fn()
            graph.replay()          # a capture records, it does not run
        self.stats["captured"] += 1
        g = self.graphs[key] = _Graph(buffers, inputs, graph, outs)
        return g
