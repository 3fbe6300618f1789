"""One rank's shard of a loaded Transformer (Megatron's split, as gpt-fast's tp.py does it).

- column-parallel: q/k/v and gate/up. The runtime fuses each into one matrix, so each part is
  split on its own and the rank's pieces are concatenated again: rows of its query heads, of
  the KV heads those heads read (GQA: a share of the KV heads, or one replicated head when
  there are fewer KV heads than ranks), its slice of gate and the same slice of up. No
  communication: every rank keeps its heads' keys and values in its own KV cache. Qwen3's
  per-head q/k norms (one weight shared by the heads) stay whole on every rank; OLMo 2 / 3's
  and OLMoE's, over the whole q and k projections, take the rank's part of their weight and
  add the ranks' sums of squares with one small all-reduce each (`ShardedRMSNorm`).
- row-parallel: o and down take the matching input columns; their outputs are partial sums,
  added over the ranks by one all-reduce each (`RowParallel`); a bias (gpt-oss's) stays on
  rank 0 only, so the sum adds it once. A mixture of experts splits each expert (and its
  shared expert) as an MLP, keeps the router whole, and adds the experts' weighted partial
  sums locally before one all-reduce (`_shard_moe`, MoE.comm). gpt-oss's attention sinks go
  with their query heads.
- vocabulary-parallel LM head: each rank scores its share of the vocabulary; rank 0 gathers
  the columns before verification (`VocabParallelHead`). The embedding, the norms and RoPE stay
  whole on every rank.

GGUF matrices stay packed: column splits select whole rows (a quantized row is whole), row
splits cut every row on a block boundary (blocks are independent). A row split that would cut
a block (a Q4_K block holds 256 weights) dequantizes that matrix's shard instead.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..model.llama import Linear, Transformer
from ..model.mla import MLAttention
from ..model.quant import BLOCKS, QuantLinear, dequantize
from .comm import Collectives


class RowParallel(nn.Module):
    """A row-parallel product: this rank's input columns, then the sum over ranks."""

    def __init__(self, inner: nn.Module, comm: Collectives):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in / tp] -> [..., out], the same on every rank."""
        return self.comm.all_reduce(self.inner(x))


class ShardedRMSNorm(nn.Module):
    """An RMS norm over a vector whose parts the ranks hold (OLMo 2's q and k norms span every
    head): this rank's sum of squares, the sum over ranks (an all-reduce of [..., 1]), then each
    rank scales its own part with its slice of the weight. `replicas`: how many ranks hold each
    part (GQA with fewer KV heads than ranks replicates a head), whose sums are divided by it."""

    def __init__(self, weight: Tensor, eps: float, full_dim: int, replicas: int, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.full_dim, self.replicas, self.comm = eps, full_dim, replicas, comm

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        squares = xf.square().sum(-1, keepdim=True)
        if self.replicas > 1:
            squares = squares / self.replicas
        mean = self.comm.all_reduce(squares) / self.full_dim
        return (xf * torch.rsqrt(mean + self.eps) * self.weight.float()).to(x.dtype)


class VocabParallelHead(nn.Module):
    """This rank's rows of the LM head; rank 0 receives the whole vocabulary's logits."""

    def __init__(self, inner: nn.Module, widths: list[int], comm: Collectives):
        super().__init__()
        self.inner, self.widths, self.comm = inner, widths, comm

    @property
    def weight(self) -> Tensor:
        """The local rows (dense heads: callers read the dtype from here)."""
        return self.inner.weight

    def forward(self, h: Tensor) -> Tensor:
        """h [R, D] -> logits [R, V] on rank 0 (gathered), this rank's [R, V / tp] elsewhere."""
        local = self.inner(h)
        pad = max(self.widths) - local.shape[-1]
        padded = torch.nn.functional.pad(local, (0, pad)) if pad else local
        full = self.comm.gather_columns(padded.reshape(-1, padded.shape[-1]), self.widths)
        return local if full is None else full.reshape(*h.shape[:-1], -1)


def vocab_split(vocab: int, world: int) -> list[int]:
    """Rows of the LM head per rank: as even as can be (the first ranks take one more)."""
    return [vocab // world + (r < vocab % world) for r in range(world)]


def shard_model(full: Transformer, comm: Collectives, cls: type[Transformer] = Transformer, **kw) -> Transformer:
    """Rank comm.rank's shard of `full` (which it may drop afterwards); cls(config, tp_size, **kw)."""
    cfg, rank, world = full.config, comm.rank, comm.world_size
    with torch.device("meta"):
        model = cls(cfg, world, **kw)
    model.compute_dtype = full.compute_dtype
    model.inv_freq, model.inv_freq_local = full.inv_freq, full.inv_freq_local
    model.model.embed_tokens, model.model.norm = full.model.embed_tokens, full.model.norm
    local = model.local_config
    H, hd, inter = cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    q_rows = _span(rank * local.num_attention_heads * hd, local.num_attention_heads * hd)
    kv_rows = _span(_first_kv_head(cfg.num_key_value_heads, rank, world) * hd, local.num_key_value_heads * hd)
    mlp_rows = _span(rank * local.intermediate_size, local.intermediate_size)
    kv_width = cfg.num_key_value_heads * hd
    kv_replicas = max(1, world // cfg.num_key_value_heads)     # ranks holding each KV head
    qkv_rows = torch.cat([q_rows, H * hd + kv_rows, H * hd + kv_width + kv_rows])
    for src, dst in zip(full.model.layers, model.model.layers):
        # the layer's norms are over the hidden size, whole on each rank (OLMo 2 has no input
        # norm; Gemma 2 / 3 and OLMo 2 norm the blocks' outputs too)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            if hasattr(src, name):
                setattr(dst, name, getattr(src, name))
        if isinstance(src.self_attn, MLAttention):
            _shard_mla(src.self_attn, dst.self_attn, rank, comm)
        else:
            _shard_attention(src.self_attn, dst.self_attn, qkv_rows, q_rows, kv_rows, H * hd, kv_width,
                             kv_replicas, comm, hd)
        if hasattr(src.mlp, "experts"):
            _shard_moe(src.mlp, dst.mlp, rank, comm)
            continue
        dst.mlp.gate_up_proj = column(src.mlp.gate_up_proj, torch.cat([mlp_rows, inter + mlp_rows]))
        dst.mlp.down_proj = RowParallel(row(src.mlp.down_proj, mlp_rows), comm)
    widths = vocab_split(cfg.vocab_size, world)
    model.lm_head = VocabParallelHead(column(full.lm_head, _span(sum(widths[:rank]), widths[rank])), widths, comm)
    # the PyTorch path runs here (no C path between all-reduces): tall products on the kernel, whose
    # rows never depend on each other, as forward.c's at TP=1, so a row's logits ignore its batch
    for m in model.modules():
        if isinstance(m, (Linear, MLAttention)):       # MLA's absorbed per-head products too
            m.row_invariant = True
    return model.eval().requires_grad_(False)


def _shard_attention(src: nn.Module, dst: nn.Module, qkv_rows: Tensor, q_rows: Tensor, kv_rows: Tensor, q_width: int,
                     kv_width: int, kv_replicas: int, comm: Collectives, head_dim: int) -> None:
    """Grouped-query attention: this rank's query heads and the KV heads they read."""
    dst.qkv_proj = column(src.qkv_proj, qkv_rows)
    dst.o_proj = RowParallel(row(src.o_proj, q_rows, bias=comm.rank == 0), comm)
    if src.sinks is not None:        # gpt-oss: this rank's heads' sinks
        dst.sinks = nn.Parameter(src.sinks.detach()[q_rows[::head_dim] // head_dim].clone(), requires_grad=False)
    if src.qk_full:     # OLMo 2 / OLMoE: norms over the whole projections, split
        qn, kn = src.q_norm, src.k_norm
        dst.q_norm = ShardedRMSNorm(qn.weight.detach()[q_rows].clone(), qn.eps, q_width, 1, comm)
        dst.k_norm = ShardedRMSNorm(kn.weight.detach()[kv_rows].clone(), kn.eps, kv_width, kv_replicas, comm)
    else:   # Qwen3's per-head q/k norms: one [hd] weight for every head, whole on each rank
        dst.q_norm, dst.k_norm = src.q_norm, src.k_norm


def _shard_mla(src: MLAttention, dst: MLAttention, rank: int, comm: Collectives) -> None:
    """Latent attention (vLLM's split): this rank's query heads (q_proj / q_b_proj rows), their
    slices of kv_b_proj and their o_proj columns; the latent projection kv_a, its norm and q_a
    whole on every rank, so each rank caches the same [latent ; rotary key] rows."""
    heads = _span(rank * dst.n_heads, dst.n_heads)[:, None]

    def rows(per: int) -> Tensor:
        return (heads * per + torch.arange(per)).reshape(-1)

    qk = src.nope + src.rope
    if src.q_proj is not None:
        dst.q_proj = column(src.q_proj, rows(qk))
    else:
        dst.q_a_proj, dst.q_a_layernorm, dst.q_b_proj = src.q_a_proj, src.q_a_layernorm, column(src.q_b_proj, rows(qk))
    dst.kv_a_proj_with_mqa, dst.kv_a_layernorm = src.kv_a_proj_with_mqa, src.kv_a_layernorm
    dst.kv_b_proj = column(src.kv_b_proj, rows(src.nope + src.v_dim))
    dst.o_proj = RowParallel(row(src.o_proj, rows(src.v_dim)), comm)


def _shard_moe(src: nn.Module, dst: nn.Module, rank: int, comm: Collectives) -> None:
    """A mixture of experts split as its MLPs are: each expert's (and the shared expert's) gate/up
    rows and down columns; the router and the shared expert's gate whole. The experts' partial
    sums are added locally, weighted, and summed over the ranks once (MoE.comm)."""
    def split(mlp_src, mlp_dst):
        local = mlp_dst.down_proj.in_features
        rows = _span(rank * local, local)
        mlp_dst.gate_up_proj = column(mlp_src.gate_up_proj, torch.cat([rows, mlp_src.down_proj.in_features + rows]))
        mlp_dst.down_proj = row(mlp_src.down_proj, rows, bias=rank == 0)     # gpt-oss's: added once

    dst.gate, dst.shared_expert_gate = src.gate, src.shared_expert_gate
    dst.e_score_correction_bias = src.e_score_correction_bias
    for e_src, e_dst in zip(src.experts, dst.experts):
        split(e_src, e_dst)
    if src.shared_expert is not None:
        split(src.shared_expert, dst.shared_expert)
    dst.comm = comm


def _span(start: int, n: int) -> Tensor:
    return torch.arange(start, start + n)


def _first_kv_head(num_kv: int, rank: int, world: int) -> int:
    """The first KV head rank `rank` holds: its share, or the one its query heads read."""
    return rank * (num_kv // world) if num_kv >= world else rank // (world // num_kv)


def column(module: nn.Module, rows: Tensor) -> nn.Module:
    """The module's output rows `rows` [n] (a column-parallel shard), in the same format."""
    bias = None if module.bias is None else module.bias[rows].clone()
    if isinstance(module, QuantLinear):
        return QuantLinear(module.qweight[rows].contiguous(), module.qtype, module.in_features, bias)
    with torch.device("meta"):
        out = Linear(module.in_features, len(rows), bias=bias is not None)
    out.weight = nn.Parameter(module.weight[rows].contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def row(module: nn.Module, cols: Tensor, bias: bool = False) -> nn.Module:
    """The module's input columns `cols` [n] (a contiguous run; a row-parallel shard), with the
    module's bias only when `bias` (one rank keeps it: the ranks' outputs are summed)."""
    start, n = int(cols[0]), len(cols)
    b = module.bias.detach().clone() if bias and module.bias is not None else None
    if isinstance(module, QuantLinear):
        per_block, nbytes = BLOCKS[module.qtype]
        if start % per_block == 0 and n % per_block == 0:
            qweight = module.qweight[:, start // per_block * nbytes:(start + n) // per_block * nbytes]
            return QuantLinear(qweight.contiguous(), module.qtype, n, b)
        weight = dequantize(module.qweight, module.qtype, module.in_features)[:, start:start + n]
    else:
        weight = module.weight[:, start:start + n]
    with torch.device("meta"):
        out = Linear(n, weight.shape[0], bias=b is not None)
    out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if b is not None:
        out.bias = nn.Parameter(b, requires_grad=False)
    return out
