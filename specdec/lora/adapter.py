"""Reading a Hugging Face PEFT LoRA folder into per-matrix (A, B) pairs for a specdec model.

PEFT writes adapter_config.json (r, lora_alpha, target_modules, use_rslora, rank_pattern,
alpha_pattern, ...) and adapter_model.safetensors with keys such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). A targeted projection W then computes W x + s B A x, s = alpha / r (alpha / sqrt(r)
with rsLoRA). specdec's layers fuse q/k/v into one matrix (qkv) and gate/up into another
(gate_up): each projection is a segment of the fused matrix's outputs, with its own A and B.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# PEFT module name -> (specdec matrix kind, segment)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
# checkpoints whose projections are fused already (Phi-3): one A, and B's rows split by segment
FUSED = {"qkv_proj": ("qkv", (0, 1, 2)), "gate_up_proj": ("gate_up", (0, 1))}
KINDS = ("qkv", "o", "gate_up", "down")          # forward.h: LORA_QKV .. LORA_DOWN
NAMES = (*TARGETS, *FUSED)
log = logging.getLogger(__name__)

# the modules of a vision-language checkpoint outside its language model (PEFT's q_proj / v_proj or
# all-linear adapters adapt them too: their "layers.N" are the tower's)
_TOWERS = frozenset({"vision_tower", "vision_model", "visual", "multi_modal_projector", "mm_projector",
                     "vision_encoder", "image_encoder", "audio_tower"})
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter's matrices: mats[(layer, kind, segment)] = (A [r, in], B [out_segment, r] times
    the scale), fp32 on the CPU; rank: the largest r of any of them."""
    name: str
    path: str
    rank: int
    mats: dict
    id: int = 0                          # the LoRARequest's lora_int_id
    uid: int = 0                         # which reading of its folder (LoRAManager: one per load)

    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.mats.values())


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the end of the module name
    (load_adapter has checked them)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_numbers(path, cfg: dict) -> None:
    """r and lora_alpha positive numbers (r an integer), rank_pattern / alpha_pattern objects
    of valid regular expressions to such numbers: one ValueError for anything else (a null alpha
    or a list of patterns had been a TypeError deep in the loader)."""
    if "r" in cfg and not (_number(cfg["r"]) and isinstance(cfg["r"], int)):
        _fail(path, f"adapter_config.json: r must be a positive integer, got {cfg['r']!r}")
    if "lora_alpha" in cfg and not _number(cfg["lora_alpha"]):
        _fail(path, f"adapter_config.json: lora_alpha must be a positive number, got {cfg['lora_alpha']!r}")
    for name, integer in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = cfg.get(name)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            _fail(path, f"adapter_config.json: {name} must be an object of module patterns, got {patterns!r}")
        for key, value in patterns.items():
            try:
                re.compile(key)
            except re.error as e:
                _fail(path, f"adapter_config.json: {name} key {key!r} is not a regular expression ({e})")
            if not _number(value) or (integer and not isinstance(value, int)):
                _fail(path, f"adapter_config.json: {name}[{key!r}] must be a positive "
                            f"{'integer' if integer else 'number'}, got {value!r}")


def _fail(path, why: str):
    raise ValueError(f"LoRA adapter {path}: {why}")


def load_adapter(name: str, path: str | Path, shapes: dict, num_layers: int, max_rank: int,
                 heads: tuple[int, int] | None = None) -> LoRAAdapter:
    """Read the PEFT folder at path, or llama.cpp's GGUF LoRA file (load_gguf_adapter; heads:
    the model's attention and kv heads). shapes: {(kind, segment): (out, in)} of the model's
    projections; every problem is one ValueError naming the folder or file."""
    root = Path(path)
    if root.is_file():
        if heads is None:
            _fail(path, "a file: a PEFT folder (adapter_config.json) or a llama.cpp GGUF LoRA is expected")
        return load_gguf_adapter(name, path, shapes, num_layers, max_rank, heads)
    if not root.exists():
        _fail(path, "does not exist (no adapter found there)")
    cfg_file = root / "adapter_config.json"
    if not cfg_file.is_file():
        _fail(path, "no adapter_config.json there (a Hugging Face PEFT LoRA folder is expected)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        _fail(path, f"adapter_config.json is not valid JSON ({e})")
    if not isinstance(cfg, dict):
        _fail(path, "adapter_config.json is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        _fail(path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if cfg.get(flag):
            _fail(path, f"{why} is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        _fail(path, f"bias={cfg['bias']!r}: adapters that train biases are not supported")
    if cfg.get("lora_bias"):
        _fail(path, "lora_bias: adapters whose lora_B has a trained bias are not supported")
    _check_numbers(path, cfg)
    if cfg.get("modules_to_save"):
        _fail(path, f"modules_to_save {cfg['modules_to_save']} (whole modules replaced) is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):            # a list of names (a string is a regex: the weights say)
        other = [t for t in targets if t.rsplit(".", 1)[-1] not in NAMES]
        if other:
            _fail(path, f"it adapts {', '.join(map(str, other))}: LoRA applies to {', '.join(NAMES)} only")
    r0, alpha0 = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rslora = bool(cfg.get("use_rslora"))
    weights = _read_weights(root, path)
    pairs: dict = {}
    tower = sorted({part for key in weights for part in key.split(".") if part in _TOWERS})
    if tower:               # vLLM's: a vision-language adapter's tower part is ignored (its layers are not the decoder's)
        log.warning("LoRA adapter %s: its %s tensors are ignored (LoRA applies to the language model)",
                    path, " / ".join(tower))
    for key, t in weights.items():
        if any(part in _TOWERS for part in key.split(".")):
            continue
        m = _KEY.search(key)
        if m is None:
            what = "lora_" in key and key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1]
            _fail(path, f"tensor {key} " + (f"adapts {what}: LoRA applies to {', '.join(NAMES)} only"
                                            if what else "is not a LoRA A/B matrix of a decoder layer"))
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in NAMES:
            _fail(path, f"tensor {key} adapts {module}: LoRA applies to {', '.join(NAMES)} only")
        if layer >= num_layers:
            _fail(path, f"tensor {key}: the model has {num_layers} layers")
        if ab in pairs.setdefault((layer, module), {}):
            _fail(path, f"tensor {key}: a second lora_{ab} of layer {layer} {module}")
        pairs[(layer, module)][ab] = t
    if not pairs:
        _fail(path, "no LoRA matrices in its weights")

    def scale(layer: int, module: str, r: int) -> float:
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
        full = f"model.layers.{layer}.{block}.{module}"
        r_cfg = _pattern(cfg.get("rank_pattern"), full, r0)
        alpha = _pattern(cfg.get("alpha_pattern"), full, alpha0)
        if r_cfg != r:
            _fail(path, f"layer {layer} {module}: its matrices have rank {r}, the config says {r_cfg}")
        return alpha / math.sqrt(r) if rslora else alpha / r

    mats, rank = _matrices(path, pairs, shapes, max_rank, scale)
    return LoRAAdapter(name, str(path), rank, mats)


def _matrices(path, pairs: dict, shapes: dict, max_rank: int, scale) -> tuple[dict, int]:
    """{(layer, PEFT module name): {"A": [r, in], "B": [out, r]}} -> mats (LoRAAdapter's) and the
    largest rank; scale(layer, module, r): the factor B is multiplied by."""
    mats, rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            _fail(path, f"layer {layer} {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        kind, segs = FUSED[module] if module in FUSED else (TARGETS[module][0], (TARGETS[module][1],))
        widths = [shapes[(kind, g)][0] for g in segs]
        out, inp = sum(widths), shapes[(kind, segs[0])][1]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, r):
            _fail(path, f"layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the "
                        f"model's {out} x {inp} projection")
        if r > max_rank:
            _fail(path, f"rank {r} is above max_lora_rank {max_rank} (--max-lora-rank)")
        for g, rows in zip(segs, (b * scale(layer, module, r)).split(widths)):
            if (layer, kind, g) in mats:
                _fail(path, f"layer {layer}: {module} and a separate projection adapt the same outputs")
            mats[(layer, kind, g)] = (a.contiguous(), rows.contiguous())
        rank = max(rank, r)
    return mats, rank


# llama.cpp's tensor names (convert_lora_to_gguf.py writes `<base tensor>.lora_a` / `.lora_b`)
GGUF_NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "attn_qkv": "qkv_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def load_gguf_adapter(name: str, path: str | Path, shapes: dict, num_layers: int, max_rank: int,
                      heads: tuple[int, int]) -> LoRAAdapter:
    """A llama.cpp LoRA adapter file (general.type "adapter", adapter.type "lora",
    adapter.lora.alpha; llama.cpp's `--lora`): the same matrices, B's rows of attn_q / attn_k
    put back in Hugging Face's order where llama.cpp's converter interleaved them (llama and
    its kin), scaled alpha / r as llama.cpp does (alpha 0: unscaled). heads: (attention heads,
    kv heads) of the model."""
    from ..model.gguf import PERMUTED, GGUFError, GGUFFile, _dense, _raw_rows, rotary_unpermutation

    try:
        g = GGUFFile(path)
    except GGUFError as e:
        _fail(path, str(e).split(": ", 1)[-1])
    if g.get("general.type") != "adapter" or g.get("adapter.type") != "lora":
        _fail(path, f"a GGUF file of general.type {g.get('general.type')!r}, not a LoRA adapter "
                    f"(llama.cpp's convert_lora_to_gguf.py writes general.type 'adapter', adapter.type 'lora')")
    alpha = float(g.get("adapter.lora.alpha") or 0.0)
    pairs: dict = {}
    for tname, t in g.tensors.items():
        m = _GGUF_KEY.match(tname)
        if m is None or m.group(2) not in GGUF_NAMES:
            _fail(path, f"tensor {tname}: LoRA applies to {', '.join(GGUF_NAMES)} of the decoder layers only")
        layer, base, ab = int(m.group(1)), m.group(2), m.group(3).upper()
        if layer >= num_layers:
            _fail(path, f"tensor {tname}: the model has {num_layers} layers")
        value = _dense(t, _raw_rows(t)).reshape(-1, int(t.shape[0]))
        if ab == "B" and g.architecture in PERMUTED and base in ("attn_q", "attn_k"):
            value = value[rotary_unpermutation(value.shape[0], heads[base == "attn_k"])]
        pairs.setdefault((layer, base), {})[ab] = value
    if not pairs:
        _fail(path, "no LoRA matrices in it")
    named = {}
    for (layer, base), ab in pairs.items():
        module = GGUF_NAMES[base]
        if base == "ffn_up" and "B" in ab and ab["B"].shape[0] == 2 * shapes[("gate_up", 1)][0]:
            module = "gate_up_proj"        # Phi-3's fused gate and up (llama.cpp keeps it as ffn_up)
        named[(layer, module)] = ab
    mats, rank = _matrices(path, named, shapes, max_rank, lambda layer, module, r: alpha / r if alpha else 1.0)
    return LoRAAdapter(name, str(path), rank, mats)


def _read_weights(root: Path, path) -> dict:
    st, pt = root / "adapter_model.safetensors", root / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return load_file(str(st))
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:                  # noqa: BLE001 - any unreadable file is the user's error
        _fail(path, f"cannot read its weights ({type(e).__name__}: {e})")
    _fail(path, "no adapter_model.safetensors (or adapter_model.bin) there")
