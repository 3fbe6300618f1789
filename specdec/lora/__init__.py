"""LoRA adapters served beside the base model (vLLM's multi-LoRA serving, small).

Each request may name an adapter (LoRARequest: a Hugging Face PEFT folder). The model holds
`max_loras` slots of adapter weights beside its q/k/v/o/gate/up/down matrices (LoRAStack); a
step's tokens carry their sequence's slot, and every projection adds B (A x) for the tokens of
sequences that have one: in forward.c (lora_for) on the CPU, in PyTorch (LoRAMat.add) elsewhere.
Requests with different adapters and without any share a batch. The scheduler keeps at most
`max_loras` distinct adapters among the running requests; the others wait.

Speculation stays lossless: proposers draft without the adapter (a draft model, EAGLE's head,
n-grams), the target verifies with it, so the output is the adapted model's. Prefix-cache
blocks are keyed by the adapter too: the same tokens under another adapter hold other keys and
values.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor

from ..config import LoRAConfig
from .adapter import KINDS, LoRAAdapter, load_adapter
from .request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAConfig", "LoRAManager", "LoRARequest", "LoRAStack"]

log = logging.getLogger("specdec.lora")


class LoRAMat:
    """One projection's slots (forward.h: LoraMat): a [S, nseg, R, K]; bt [S, R N], segment j's
    B^T [R, seg[j]] at R * (its first output); scales folded into B."""

    def __init__(self, stack: "LoRAStack", segs: tuple[int, ...], k: int):
        S, R = stack.max_loras, stack.max_rank
        self.stack, self.segs, self.k = stack, segs, k
        self.offsets = [sum(segs[:j]) for j in range(len(segs))]
        self.a = torch.zeros(S, len(segs), R, k, dtype=stack.dtype)
        self.bt = torch.zeros(S, R * sum(segs), dtype=stack.dtype)

    def segment(self, slot: int, j: int) -> Tensor:
        """Slot's B^T of segment j, [R, seg[j]] (a view)."""
        R, off, n = self.stack.max_rank, self.offsets[j], self.segs[j]
        return self.bt[slot, R * off:R * (off + n)].view(R, n)

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """y [N, out] (x [N, in]'s product) plus each token's adapter product, for the PyTorch
        path (Transformer.forward sets the tokens' slots; none: y unchanged)."""
        slots = self.stack.token_slots
        if slots is None or x.dim() != 2 or x.shape[0] != slots.shape[0]:
            return y
        for s in slots.unique().tolist():
            if s < 0:
                continue
            idx = (slots == s).nonzero().squeeze(1)
            xs = x[idx].to(torch.float32)
            delta = torch.cat([(xs @ self.a[s, j].float().t()) @ self.segment(s, j).float()
                               for j in range(len(self.segs))], dim=1)
            y = y.index_add(0, idx, delta.to(y.dtype))
        return y


class LoRAStack:
    """`max_loras` slots of adapter weights beside a Transformer's matrices, each layer's
    mats[layer][kind] (kind: adapter.KINDS), and each slot's rank per kind (ranks [S, 4],
    forward.h: Model.lora_ranks). token_slots: the PyTorch path's per-token slots during a
    forward (None: no adapter in it)."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32):
        cfg = model.config
        self.dtype = dtype
        H, KV, hd, D, F = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                           cfg.intermediate_size)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.heads = (H, KV)
        self.shapes = {("qkv", 0): (H * hd, D), ("qkv", 1): (KV * hd, D), ("qkv", 2): (KV * hd, D),
                       ("o", 0): (D, H * hd), ("gate_up", 0): (F, D), ("gate_up", 1): (F, D), ("down", 0): (D, F)}
        segs = {"qkv": (H * hd, KV * hd, KV * hd), "o": (D,), "gate_up": (F, F), "down": (D,)}
        ins = {"qkv": D, "o": H * hd, "gate_up": D, "down": F}
        self.num_layers = len(model.model.layers)
        self.mats = [{kind: LoRAMat(self, segs[kind], ins[kind]) for kind in KINDS} for _ in range(self.num_layers)]
        self.ranks = torch.zeros(max_loras, len(KINDS), dtype=torch.int32)
        self.token_slots: Tensor | None = None

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put adapter's matrices in slot (what was there is zeroed first)."""
        for layer in self.mats:
            for m in layer.values():
                m.a[slot].zero_()
                m.bt[slot].zero_()
        self.ranks[slot].zero_()
        for (i, kind, seg), (a, b) in adapter.mats.items():
            m, r = self.mats[i][kind], a.shape[0]
            m.a[slot, seg, :r] = a
            m.segment(slot, seg)[:r] = b.t()
            c = KINDS.index(kind)
            self.ranks[slot, c] = max(int(self.ranks[slot, c]), r)


def check_model(model) -> None:
    """LoRA covers the dense layers of a single-process model: grouped-query attention and a
    gated MLP (not latent attention, mixtures of experts or a tensor-parallel shard)."""
    from ..model.mla import MLAttention

    if model.tp_size > 1:
        raise ValueError("LoRA adapters are not supported with tensor parallelism")
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAttention) or hasattr(layer.mlp, "experts"):
            raise ValueError("LoRA adapters are supported for dense models (attention and a gated MLP per "
                             "layer); this one has latent attention or a mixture of experts")


def slot_dtype(model, name: str) -> torch.dtype:
    """lora_dtype "auto": bf16 beside quantized (GGUF) or bf16 matrices, else fp32. "float16"
    (vLLM's): fp16 slots off the CPU; the CPU's C forward reads fp32 or bf16 slots only, so
    there fp32, which holds every fp16 value exactly."""
    if name == "float16" and model.device.type == "cpu":
        log.warning("lora_dtype float16: the CPU forward reads float32 or bfloat16 LoRA weights; using float32")
        return torch.float32
    if name != "auto":
        return getattr(torch, name)
    w = getattr(model.model.layers[0].self_attn.qkv_proj, "weight", None)
    return torch.float32 if isinstance(w, Tensor) and w.dtype == torch.float32 else torch.bfloat16


_LOADS = itertools.count(1)


def _stamp(path: str) -> tuple | None:
    """What the files of an adapter folder (or a GGUF file) are now: name, size, inode and
    times of each; a rewrite changes the change time at least. None: unreadable."""
    root = Path(path)
    try:
        files = [root] if root.is_file() else sorted(f for f in root.iterdir() if f.is_file())
        return tuple((f.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for f in files
                     for st in [f.stat()])
    except OSError:
        return None


def _same(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    return a.mats.keys() == b.mats.keys() and all(torch.equal(x, y) for k, pair in a.mats.items()
                                                  for x, y in zip(pair, b.mats[k]))


class LoRAManager:
    """Adapters loaded from their folders (kept, least recently used first out, up to
    max_cpu_loras beyond those requests hold) and the slots of the model's LoRAStack."""

    def __init__(self, model, config: LoRAConfig):
        check_model(model)
        self.config = config
        self.stack = LoRAStack(model, config.max_loras, config.max_lora_rank, slot_dtype(model, config.lora_dtype))
        model.set_lora(self.stack)
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()      # by lora_int_id
        # every adapter some request still holds, by id: one copy each, however many requests
        # (an adapter past max_cpu_loras is read again only once nobody holds it)
        self._held: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        self._in_slot: list[LoRAAdapter | None] = [None] * config.max_loras
        self._slot_used: list[int] = [0] * config.max_loras             # step of last use (LRU)
        self._steps = 0
        self._pinned: set[int] = set()                                   # pin(): never evicted
        # by id: the request that last read the folder, the folder's files then (_stamp) and that
        # reading's uid (kept past eviction: an unchanged folder read again keeps its cached prefixes)
        self._read: dict[int, tuple[LoRARequest, tuple | None, int]] = {}
        self._paths: dict[int, set[str]] = {}        # by id: every folder it was read from (load_inplace)

    @property
    def max_loras(self) -> int:
        return self.config.max_loras

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names, loaded (once per id): a ValueError names what is wrong.
        load_inplace=True (vLLM's): the id's folder is read again, and if its weights changed they
        replace the loaded ones under the id for new requests (a new reading: its own slot and
        prefix-cache keys); running requests finish with the weights they started with."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        found = self._loaded.get(request.lora_int_id) or self._held.get(request.lora_int_id)
        if found is not None and request.load_inplace:
            found = self._reload(request, found)
        if found is not None:
            # a request routed to an id before an in-place load from another folder reaches the
            # engine after it: it runs on the id's new weights, as vLLM looks adapters up by id
            moved = found.name == request.lora_name and str(request.lora_path) in self._paths.get(found.id, ())
            if found.name != request.lora_name or (found.path != str(request.lora_path) and not moved):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {found.name!r} "
                                 f"({found.path}); each adapter needs its own id")
            self._loaded[request.lora_int_id] = found
            self._loaded.move_to_end(request.lora_int_id)
            self._trim()
            return found
        return self._load(request)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        """A new reading of the request's folder, now what its id names."""
        stamp = _stamp(request.lora_path)       # before reading: a write during the read shows next time
        adapter = load_adapter(request.lora_name, request.lora_path, self.stack.shapes, self.stack.num_layers,
                               self.config.max_lora_rank, self.stack.heads)
        adapter.id = request.lora_int_id
        # this reading of the folder (the prefix cache's key): the last reading's if the id's folder
        # is the same and its files are untouched since (an adapter evicted past max_cpu_loras and
        # read again keeps its cached blocks, as vLLM's are keyed by the adapter, not its loading)
        last, last_stamp, last_uid = self._read.get(request.lora_int_id, (None, None, 0))
        same = last is not None and stamp is not None and last_stamp == stamp \
            and str(last.lora_path) == str(request.lora_path)
        adapter.uid = last_uid if same else next(_LOADS)
        self._loaded[request.lora_int_id] = self._held[request.lora_int_id] = adapter
        self._read[request.lora_int_id] = (request, stamp, adapter.uid)
        self._paths.setdefault(request.lora_int_id, set()).add(str(request.lora_path))
        self._trim()
        return adapter

    def _reload(self, request: LoRARequest, found: LoRAAdapter) -> LoRAAdapter:
        """load_inplace: the id's adapter as its folder now holds it. The folder is read again
        unless this very request read it and its files are untouched since (one generate() over
        many prompts reads it once); the same weights from the same place keep the loaded
        adapter, so requests that name it still batch together and share cached prefixes."""
        last, stamp, _ = self._read.get(request.lora_int_id, (None, None, 0))
        if last is request and stamp is not None and stamp == _stamp(request.lora_path):
            return found
        adapter = self._load(request)
        if (adapter.name, adapter.path) == (found.name, found.path) and _same(adapter, found):
            self._loaded[found.id] = self._held[found.id] = found
            return found
        return adapter

    def _trim(self) -> None:
        """Keep max_cpu_loras adapters loaded (least recently used out, pinned ones stay; requests
        that hold one keep it)."""
        cap = self.config.max_cpu_loras or self.config.max_loras
        for i in [i for i in self._loaded if i not in self._pinned][:max(0, len(self._loaded) - cap)]:
            del self._loaded[i]

    def pin(self, lora_id: int) -> bool:
        """vLLM's pin_lora: the loaded adapter of that id is never evicted (until removed); False: none loaded."""
        if lora_id not in self._loaded:
            return False
        self._pinned.add(lora_id)
        return True

    def remove(self, lora_name: str) -> bool:
        """Forget the loaded adapters of that name (running requests keep theirs); False: none."""
        ids = {i for i, a in [*self._loaded.items(), *self._held.items()] if a.name == lora_name}
        return any([self.remove_id(i) for i in ids])

    def remove_id(self, lora_id: int) -> bool:
        """Forget the adapter of that lora_int_id (vLLM's remove_lora): its running requests keep
        their copy, new ones read the folder again; False: none."""
        found = self._loaded.pop(lora_id, None) is not None
        self._pinned.discard(lora_id)
        self._read.pop(lora_id, None)
        self._paths.pop(lora_id, None)
        return self._held.pop(lora_id, None) is not None or found

    def loaded(self) -> list[LoRAAdapter]:
        return list(self._loaded.values())

    def _current(self, adapter: LoRAAdapter | None) -> bool:
        """Whether adapter is what its id names now (not a reading replaced or removed since)."""
        return adapter is not None and (self._loaded.get(adapter.id) or self._held.get(adapter.id)) is adapter

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Slots for this step's adapters (at most max_loras distinct ones: the scheduler's
        rule), loading those not in a slot into the least recently used free ones. Returns
        {adapter uid: slot}: by each reading of an adapter, not its lora_int_id, which a removed
        adapter's running requests share with one added as it afterwards."""
        self._steps += 1
        wanted = {a.uid: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, max_loras is {self.max_loras}")
        slot_of = {a.uid: s for s, a in enumerate(self._in_slot) if a is not None and wanted.get(a.uid) is a}
        for key, adapter in wanted.items():
            if key in slot_of:
                continue
            free = [s for s in range(self.max_loras) if s not in slot_of.values()]
            # empty slots and those of replaced readings (load_inplace, removed ids) first
            s = min(free, key=lambda s: (self._current(self._in_slot[s]), self._slot_used[s]))
            self.stack.load(s, adapter)
            self._in_slot[s] = adapter
            slot_of[key] = s
        for s in slot_of.values():
            self._slot_used[s] = self._steps
        return slot_of
