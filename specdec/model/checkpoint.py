"""Hugging Face checkpoint folders <-> the runtime's `Transformer`.

A folder holds config.json and model.safetensors (or model.safetensors.index.json with shards),
or the PyTorch pickles older folders hold (pytorch_model.bin, or pytorch_model.bin.index.json).
The runtime fuses q/k/v and gate/up; this module is the only place that knows both layouts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DEEPSEEK, FUSED_CHECKPOINTS, GEMMA, O_BIASED, ModelConfig, apply_hf_overrides, text_config
from .llama import Transformer
from .mla import deinterleave_rope, rope_interleaved

log = logging.getLogger("specdec.checkpoint")

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message is one line meant for the user."""


def resolve_dtype(dtype: str | torch.dtype | None, folder_cfg: dict | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        name = (folder_cfg or {}).get("torch_dtype") or (folder_cfg or {}).get("dtype") or "float32"
        return DTYPES.get(str(name), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r} (choose float32, bfloat16 or float16)")
    return DTYPES[dtype]


def read_config(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(_not_a_folder(folder))
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _quantize_config_json(folder) -> dict:
    """An AutoGPTQ export's quantize_config.json (older ones keep their settings there, with no
    quantization_config in config.json; vLLM's gptq reads the file): its settings with quant_method
    "gptq" unless it names one; {} where there is none."""
    path = Path(folder) / "quantize_config.json"
    if not path.is_file():
        return {}
    try:
        qcfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if qcfg.get("is_marlin_format") or str(qcfg.get("checkpoint_format", "")).lower() == "marlin":
        raise CheckpointError(f"{path}: AutoGPTQ's Marlin checkpoint format is not read (its GPTQ format is)")
    return {"quant_method": "gptq", **qcfg}


def _not_a_folder(path: Path) -> str:
    """What is wrong with a --model path that is not a folder: a missing .gguf is a missing
    file; a file of a Hugging Face folder (model.safetensors, config.json) stands for its folder."""
    if path.suffix.lower() == ".gguf" and not path.exists():
        return f"{path}: no such file"
    if path.is_file():
        if path.suffix.lower() in (".safetensors", ".json", ".bin"):
            return f"{path} is a file: pass the folder that holds it ({path.parent})"
        return f"{path} is a file, not a model folder (pass a Hugging Face model folder or a .gguf file)"
    if looks_like_hub_id(str(path)):
        return (f"model folder {str(path)!r} does not exist, and the Hugging Face id is not in the local cache "
                f"(HF_HOME; specdec downloads nothing: pass a folder or a .gguf file)")
    return f"model folder {str(path)!r} does not exist"


def looks_like_hub_id(name: str) -> bool:
    """org/name, as a Hugging Face model id is written (not a path that exists or starts like one)."""
    return (name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)
            and all(part.strip() for part in name.split("/")))


def resolve_hub_id(name):
    """A Hugging Face model id (org/name) that is no local path: its snapshot folder in the local
    Hugging Face cache (HF_HOME / HF_HUB_CACHE), found by huggingface_hub without any download, as
    vLLM resolves `--model org/name` offline; anything else as it is."""
    if not isinstance(name, str) or not looks_like_hub_id(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub")
                                                    if os.environ.get("HF_HOME") else None)
        return snapshot_download(repo_id=name, local_files_only=True, cache_dir=cache)
    except Exception:            # not cached (or no huggingface_hub): the loader says what is missing
        return name


def _weight_files(folder: Path) -> list[Path]:
    """The folder's weight files, as vLLM picks them: safetensors (an index's shards, or one
    file), else PyTorch pickles (pytorch_model.bin.index.json's shards, or pytorch_model.bin)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: corrupt index ({e})") from None
            return [folder / name for name in sorted(set(weight_map.values()))]
        if (folder / single).is_file():
            return [folder / single]
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin (nor their .index.json)")


def _file_tensors(path: Path):
    """(name, tensor) of one weights file, each tensor read when asked for (safetensors), or
    memory-mapped (a PyTorch pickle, loaded with weights_only: tensors, never code)."""
    if path.suffix != ".bin":
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, lambda name=name: f.get_tensor(name)
        return
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        sd = torch.load(path, map_location="cpu", weights_only=True)     # torch's pre-1.6 format: not mappable
    if not isinstance(sd, dict):
        raise ValueError(f"holds a {type(sd).__name__}, not a dict of tensors")
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is a {type(t).__name__}, not a tensor")
        yield name, lambda t=t: t


def read_state_dict(folder: str | os.PathLike, keep=None) -> dict[str, torch.Tensor]:
    """The folder's tensors by name; keep(name) -> bool: only those (the others are never read:
    a target without its MTP layers, or the MTP layers alone, out of a shared checkpoint)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        kind = "a PyTorch checkpoint" if path.suffix == ".bin" else "safetensors"
        try:
            for name, read in _file_tensors(path):
                if keep is None or keep(name):
                    tensors[name] = read()
        except Exception as e:  # safetensors and torch.load raise several types for a damaged file
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: cannot read {kind} ({detail})") from None
    return tensors


# a multimodal checkpoint's language model, under the names a text-only one uses
# (transformers' saved layout, and the one its multimodal modules hold); the vision tower and the
# projector are left out
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))
IMAGE_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")


MTP_PREFIX = "model.mtp_layers."     # MiMo's MTP layers; DeepSeek-V3's and GLM-4.5's follow the last layer


def is_mtp_weight(name: str, num_hidden_layers: int) -> bool:
    """A weight of a multi-token-prediction layer in a target's checkpoint (model/mtp.py)."""
    if name.startswith(MTP_PREFIX):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_hidden_layers


def hf_to_fused(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith(IMAGE_PREFIXES):
            continue
        if cfg.model_type == "mixtral":
            name = _MIXTRAL_IN.sub(lambda m: _MIXTRAL_NAMES[m.group(0)], name)
        if name.startswith("model.") or name.startswith("lm_head."):
            out[name] = t
    if cfg.model_type == "gpt_oss":
        out = _gpt_oss_experts(out, cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [p + f"self_attn.{x}_proj.{kind}" for x in "qkv"]
            if all(n in out for n in parts):
                out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in parts])
    if cfg.model_type in ("granitemoe", "granitemoeshared"):   # experts stacked [E, rows, in]: gate and up fused
        for name in [n for n in out if ".shared_mlp." in n]:
            kind = "gate_up_proj" if "input_linear" in name else "down_proj"
            out[name.split(".shared_mlp.")[0] + f".mlp.shared_expert.{kind}.weight"] = out.pop(name)
        for name in [n for n in out if ".block_sparse_moe." in n]:
            t, p = out.pop(name), name.split(".block_sparse_moe.")[0] + ".mlp."
            if name.endswith("router.layer.weight"):
                out[p + "gate.weight"] = t
            else:
                kind = "gate_up_proj" if "input_linear" in name else "down_proj"
                out.update({p + f"experts.{e}.{kind}.weight": t[e] for e in range(t.shape[0])})
    for name in [n for n in out if ".mlp.shared_experts." in n or n.endswith(".mlp.gate.e_score_correction_bias")]:
        out[name.replace(".shared_experts.", ".shared_expert.").replace(".gate.e_score", ".e_score")] = out.pop(name)
    if not cfg.shared_expert_size:      # n_shared_experts 0: transformers saves a zero-width shared expert
        for name in [n for n in out if ".mlp.shared_expert." in n and out[n].numel() == 0]:
            del out[name]
    for gate in [n for n in out if n.endswith(".gate_proj.weight")]:      # the MLP's, or each expert's
        up = gate.replace(".gate_proj.", ".up_proj.")
        if up in out:
            out[gate.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([out.pop(gate), out.pop(up)])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if cfg.model_type in GEMMA:      # Gemma's RMSNorm scales by (1 + w): the runtime holds 1 + w, in fp32
        out.update({n: t.float() + 1 for n, t in out.items() if _is_norm(n)})
    return out


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 layout (gpt-oss's experts) -> ggml's MXFP4 rows (what GGUF files hold and
    qgemm.c multiplies; model/quant.py dequantizes them): blocks [..., G, 16] uint8 (byte i: values
    2i, 2i + 1 in its low and high nibbles) and E8M0 scales [..., G] -> [..., G * 17], per block
    the scale byte, then 16 bytes holding value j in the low nibble and j + 16 in the high."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                              "([..., G, 16] uint8 and [..., G])")
    nib = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)            # [..., G, 32] in order
    qs = nib[..., :16] | (nib[..., 16:] << 4)
    return torch.cat([scales.to(torch.uint8)[..., None], qs], dim=-1).flatten(-2).contiguous()


def mxfp4_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4_rows undone: ggml MXFP4 rows [..., G * 17] -> OpenAI's (blocks [..., G, 16], scales
    [..., G]) (tests and scripts write MXFP4 folders from gguf-py's quantizer)."""
    g = rows.reshape(*rows.shape[:-1], -1, 17)
    nib = torch.cat([g[..., 1:] & 0x0F, g[..., 1:] >> 4], dim=-1)                 # values 0..31 in order
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous(), g[..., 0].contiguous()


def _gate_then_up(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gpt-oss's gate/up rows, interleaved (g0 u0 g1 u1 ...) -> gate rows, then up rows (and bias)."""
    return torch.cat([w[0::2], w[1::2]]), None if b is None else torch.cat([b[0::2], b[1::2]])


def _gpt_oss_expert_rows(sd: dict[str, torch.Tensor], name: str, packed: bool):
    """One stacked expert matrix of gpt-oss (name: ...experts.gate_up_proj / down_proj), popped
    from sd: per expert (rows [out, in] fp32, or ggml MXFP4 rows [out, bytes] when packed, the
    bias), in_features; None when sd lacks it (load_model names what is missing)."""
    from .quant import dequantize

    bias = sd.pop(name + "_bias", None)
    if name + "_blocks" in sd and name + "_scales" in sd:
        blocks, scales = sd.pop(name + "_blocks"), sd.pop(name + "_scales")
        k = blocks.shape[-2] * 32
        rows = mxfp4_rows(blocks, scales)                                     # [E, out, bytes]
        if not packed:      # exact: every MXFP4 value has at most two significant bits
            rows = dequantize(rows.reshape(-1, rows.shape[-1]), "MXFP4", k).reshape(*rows.shape[:2], k)
    elif name in sd:
        rows = sd.pop(name).transpose(1, 2)                                   # [E, in, out] -> [E, out, in]
        k = rows.shape[-1]
    else:
        return None
    gate_up = name.endswith("gate_up_proj")
    experts = [(rows[e], None if bias is None else bias[e]) for e in range(rows.shape[0])]
    return [_gate_then_up(w, b) if gate_up else (w, b) for w, b in experts], k


def _gpt_oss_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """gpt-oss's mixtures -> the runtime's: the router (mlp.router) as mlp.gate; the experts'
    stacked gate_up_proj [E, D, 2F] (gate and up interleaved) and down_proj [E, F, D], or their
    MXFP4 _blocks / _scales (dequantized), as each expert's [gate; up] and down rows with biases."""
    sd = dict(sd)
    out = {n: t for n, t in sd.items() if ".mlp.experts." not in n and ".mlp.router." not in n}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if p + f"router.{kind}" in sd:
                out[p + f"gate.{kind}"] = sd[p + f"router.{kind}"]
        for mat in ("gate_up_proj", "down_proj"):
            found = _gpt_oss_expert_rows(sd, p + "experts." + mat, packed=False)
            for e, (w, b) in enumerate(found[0] if found else ()):
                out[p + f"experts.{e}.{mat}.weight"] = w.contiguous()
                if b is not None:
                    out[p + f"experts.{e}.{mat}.bias"] = b.contiguous()
    return out


def _gpt_oss_packed(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, tuple]:
    """gpt-oss's MXFP4 experts kept packed: {module name: (ggml rows [out, row bytes], bias,
    in_features)} for each expert's gate_up_proj ([gate; up] rows) and down_proj; their tensors
    leave sd."""
    packed = {}
    for i in range(cfg.num_hidden_layers):
        for mat in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{mat}"
            if name + "_blocks" not in sd or name + "_scales" not in sd:
                continue
            experts, k = _gpt_oss_expert_rows(sd, name, packed=True)
            for e, (rows, bias) in enumerate(experts):
                packed[f"model.layers.{i}.mlp.experts.{e}.{mat}"] = (rows.contiguous(), bias, k)
    return packed


def _gpt_oss_stacked(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The runtime's experts -> gpt-oss's stacked, interleaved layout (_gpt_oss_experts undone)."""
    out = {n: t for n, t in sd.items() if ".mlp." not in n}
    F = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        out[p + "router.weight"], out[p + "router.bias"] = sd[p + "gate.weight"], sd[p + "gate.bias"]
        gu = torch.stack([sd[p + f"experts.{e}.gate_up_proj.weight"] for e in range(cfg.num_experts)])   # [E, 2F, D]
        gu_b = torch.stack([sd[p + f"experts.{e}.gate_up_proj.bias"] for e in range(cfg.num_experts)])
        inter = torch.stack([gu[:, :F], gu[:, F:]], dim=2).flatten(1, 2)                  # rows g0 u0 g1 u1 ...
        out[p + "experts.gate_up_proj"] = inter.transpose(1, 2)
        out[p + "experts.gate_up_proj_bias"] = torch.stack([gu_b[:, :F], gu_b[:, F:]], dim=2).flatten(1, 2)
        out[p + "experts.down_proj"] = torch.stack(
            [sd[p + f"experts.{e}.down_proj.weight"] for e in range(cfg.num_experts)]).transpose(1, 2)
        out[p + "experts.down_proj_bias"] = torch.stack(
            [sd[p + f"experts.{e}.down_proj.bias"] for e in range(cfg.num_experts)])
    return out


# Mixtral's names for its experts' matrices and its mixture (the runtime uses Qwen3-MoE's)
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_IN = re.compile("|".join(re.escape(k) for k in _MIXTRAL_NAMES))


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def fused_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for name, t in sd.items():
        if cfg.model_type in FUSED_CHECKPOINTS:        # stored fused, as the runtime holds them
            out[name] = t
        elif ".qkv_proj." in name:
            for x, part in zip("qkv", t.split((q, kv, kv))):
                out[name.replace("qkv_proj", f"{x}_proj")] = part
        elif cfg.model_type in ("granitemoe", "granitemoeshared") and (".experts." in name or ".shared_expert." in name):
            out[name] = t                          # stacked below
        elif ".gate_up_proj." in name and cfg.model_type != "gpt_oss":      # gpt-oss's: _gpt_oss_stacked
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if cfg.model_type in GEMMA:
        out.update({n: t.float() - 1 for n, t in out.items() if _is_norm(n)})
    if cfg.model_type == "mixtral":
        out = {_mixtral_name(n): t for n, t in out.items()}
    if cfg.model_type in ("granitemoe", "granitemoeshared"):
        out = _granitemoe_stacked(out, cfg)
    if cfg.model_type == "gpt_oss":
        out = _gpt_oss_stacked(out, cfg)
    if cfg.kv_lora_rank:         # DeepSeek's interleaved rotary rows (config.json says rope_interleave)
        out = deinterleave_rope(out, cfg, inverse=True)
    if cfg.model_type in ("glm4_moe", *DEEPSEEK):      # their names: the router holds the choice bias; shared_experts
        out = {n.replace(".shared_expert.", ".shared_experts.").replace(".mlp.e_score", ".mlp.gate.e_score"): t
               for n, t in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


def _granitemoe_stacked(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The runtime's per-expert matrices and router -> GraniteMoE's stacked block_sparse_moe tensors."""
    out = {n: t for n, t in sd.items() if ".mlp." not in n}
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        if cfg.shared_expert_size:
            for kind, theirs in (("gate_up_proj", "input_linear"), ("down_proj", "output_linear")):
                out[f"model.layers.{i}.shared_mlp.{theirs}.weight"] = sd[p + f"shared_expert.{kind}.weight"]
        out[q + "router.layer.weight"] = sd[p + "gate.weight"]
        for kind, theirs in (("gate_up_proj", "input_linear"), ("down_proj", "output_linear")):
            out[q + f"{theirs}.weight"] = torch.stack([sd[p + f"experts.{e}.{kind}.weight"] for e in range(cfg.num_experts)])
    return out


def _mixtral_name(name: str) -> str:
    """The runtime's expert and mixture names -> Mixtral's."""
    if ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
        name = name.replace(ours, theirs)
    return name


def load_model(folder: str | os.PathLike, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", quantization: str | None = None,
               hf_overrides: dict | None = None, disable_sliding_window: bool = False,
               max_model_len: int | None = None, hf_config_path: str | os.PathLike | None = None) -> Transformer:
    """A Hugging Face folder, a .gguf file, or a folder holding one .gguf. quantization applies
    to a GGUF (model/gguf.py: None = auto, "gguf" = keep packed, "none" = dequantize) and to
    gpt-oss's MXFP4 experts in a folder (None, or vLLM's "mxfp4": packed where the CPU kernels
    multiply MXFP4; "none": dequantized);
    hf_overrides, disable_sliding_window and max_model_len as vLLM's flags (ModelConfig.configured);
    hf_config_path (vLLM's, for a GGUF): a folder whose config.json the model runs with."""
    from .gguf import GGUFError, find_gguf, load_gguf

    try:
        gguf_path = find_gguf(folder)
        if gguf_path is not None:
            return load_gguf(gguf_path, dtype, device, quantization, hf_overrides, disable_sliding_window,
                             max_model_len, hf_config_path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    if hf_config_path is not None and Path(hf_config_path).resolve() != Path(folder).resolve():
        raise CheckpointError(f"{folder}: hf_config_path is read for a GGUF model; a Hugging Face folder runs "
                              "with its own config.json (hf_overrides replaces its fields)")
    from . import hf_quant

    if quantization == "gguf":
        raise CheckpointError(f"{folder}: quantization={quantization!r} needs a .gguf checkpoint")
    if quantization not in (None, "auto", "none", "mxfp4", *hf_quant.METHODS):
        raise CheckpointError(f"{folder}: quantization={quantization!r} is not supported (specdec reads unquantized "
                              "folders, compressed-tensors, GPTQ, AWQ and FP8 folders, gpt-oss's MXFP4 experts, and "
                              "GGUF files)")
    raw = read_config(folder)
    qcfg = text_config(raw).get("quantization_config") or raw.get("quantization_config") or _quantize_config_json(folder)
    quant = hf_quant.method(qcfg)
    if quant not in (None, "mxfp4", *hf_quant.METHODS.values()):
        raise CheckpointError(f"{folder}: quantization_config.quant_method {quant!r} is not supported (specdec reads "
                              "unquantized folders, compressed-tensors, GPTQ, AWQ and FP8 folders, gpt-oss's MXFP4 "
                              "experts, and GGUF files)")
    asked = hf_quant.METHODS.get(quantization, quantization)
    if asked == "mxfp4" and quant != "mxfp4":
        raise CheckpointError(f"{folder}: quantization='mxfp4' needs a folder quantized with it (quantization_config "
                              f"quant_method 'mxfp4', as gpt-oss's), this one has {quant or 'none'}")
    if asked not in (None, "auto", "none") and asked != quant:     # vLLM's --quantization names the folder's method
        raise CheckpointError(f"{folder}: quantization={quantization!r} does not match the folder's "
                              f"quantization_config (quant_method {quant or 'none'})")
    try:
        if hf_overrides:
            raw = apply_hf_overrides(text_config(raw), hf_overrides)
        cfg = ModelConfig.from_hf(raw).configured(disable_sliding_window=disable_sliding_window,
                                                  max_model_len=max_model_len)
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    torch_dtype = resolve_dtype(dtype, raw)
    if dtype in (None, "auto") and torch_dtype == torch.float16 and torch.device(device).type == "cpu":
        torch_dtype = torch.bfloat16   # vLLM's rule on the CPU: a float16 folder runs in bfloat16 (GPTQ and AWQ
        #                                folders say float16; the C forward and oneDNN take fp32 and bf16)
    mtp = bool(text_config(raw).get("num_nextn_predict_layers"))     # MTP layers: a drafter's (model/mtp.py)
    sd = read_state_dict(folder, (lambda k: not is_mtp_weight(k, cfg.num_hidden_layers)) if mtp else None)
    if not any(k.startswith(("model.", "lm_head.", "language_model.")) for k in sd) and any(k.startswith("layers.") for k in sd):
        sd = {"model." + k: v for k, v in sd.items()}    # a base model as AutoModel saves it (Qwen3Model, MistralModel)
    if is_classifier(raw):
        sd.pop("score.weight", None)      # the classification head: specdec/pooling.py reads it (LLM.classify)
        sd.pop("score.bias", None)
    if (is_base_model(raw) or is_classifier(raw)) and "lm_head.weight" not in sd and not cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)   # no LM head: embeddings only (runner "pooling")
    if cfg.attention_bias and cfg.model_type in O_BIASED and any(k.endswith("self_attn.o_proj.bias") for k in sd):
        cfg = dataclasses.replace(cfg, o_bias=True)    # Llama's attention_bias: o_proj's too (a file without
        #                                                one: transformers' zeros, the same model)
    interleaved = bool(cfg.kv_lora_rank) and rope_interleaved(text_config(raw))
    if interleaved:
        sd = deinterleave_rope(sd, cfg)
    packed = {}
    if cfg.model_type == "gpt_oss" and quant == "mxfp4" and quantization != "none":
        from .gguf import kernels_cover

        if kernels_cover({"MXFP4"}, torch.device(device)):     # the experts stay MXFP4 (qgemm.c)
            packed = _gpt_oss_packed(sd, cfg)
    if quant in hf_quant.METHODS.values():
        try:
            sd = hf_quant.convert(sd, quant, qcfg, _packable(quantization, device), torch_dtype)
        except hf_quant.QuantFormatError as e:
            raise CheckpointError(f"{folder}: {e}") from None
    cfg = _untie_stored_head(sd, cfg, folder)      # after convert: a quantized head (lm_head.qweight) is a weight now
    # RoPE's inverse frequencies, saved as buffers by transformers before 4.31: recomputed from
    # the config here (vLLM skips them the same way)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    sd = hf_to_fused(sd, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    packed.update(_packed_rows(sd, model, folder))
    expected = {n for n, _ in model.named_parameters()} - {f"{m}.{kind}" for m in packed for kind in ("weight", "bias")}
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing:
        raise CheckpointError(f"{folder}: weights missing from the checkpoint: {sorted(missing)[0]} "
                              f"(and {len(missing) - 1} more)" if len(missing) > 1 else
                              f"{folder}: weight missing from the checkpoint: {next(iter(missing))}")
    if unexpected:
        raise CheckpointError(f"{folder}: unexpected weight in the checkpoint: {sorted(unexpected)[0]}")
    # to_empty, with torch.empty: empty_like on a meta tensor goes through torch._refs, which
    # imports sympy and torch.fx's symbolic shapes (~1 s of CPU at every start)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for name, param in model.named_parameters():
        if name not in sd:  # the tied LM head, re-tied below
            continue
        src = sd[name]
        if src.shape != param.shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(src.shape)}, "
                                  f"config.json implies {tuple(param.shape)}")
        # Gemma's norms (1 + w) stay fp32, as transformers computes them
        keep = (cfg.model_type in GEMMA and _is_norm(name)) or name.endswith("e_score_correction_bias")
        param.data = src.to(device=device, dtype=torch.float32 if keep else torch_dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    from .hf_quant import packed_format
    from .quant import QuantLinear

    kept_packed = bool(packed)
    for name in list(packed):    # popped as built: each expert's rows freed once its panels exist
        rows, bias, k = packed.pop(name)
        owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
        qtype = "MXFP4" if quant == "mxfp4" else packed_format(rows.shape[1], k)
        setattr(model.get_submodule(owner), attr, QuantLinear(rows.to(device), qtype, k,
                                                              None if bias is None else bias.to(device, torch.float32)))
    model.reset_rope(device)  # buffers were left uninitialised on meta
    if kept_packed:
        model.use_fp32_activations()     # packed products take and return fp32
    model.rope_rows_interleaved = interleaved      # load_weights reorders new rotary rows as these were
    return finish(model, torch_dtype, device)


def _text_name(name: str) -> str:
    """A weight's name in a text-only checkpoint (TEXT_PREFIXES)."""
    for old, new in TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _untie_stored_head(sd: dict[str, torch.Tensor], cfg: ModelConfig, folder) -> ModelConfig:
    """transformers 5's rule for a config that says tie_word_embeddings over a file holding an
    lm_head.weight unequal to the embeddings: the stored head is used, untied (with a warning).
    (vLLM skips the stored head and ties; transformers' logits are the reference here.) An equal
    head, as .bin checkpoints store both, stays tied. A quantized head (GPTQ's lm_head.qweight,
    compressed-tensors' lm_head.weight_packed) is read after hf_quant.convert: dequantized, or
    packed rows, which differ from the embeddings too."""
    if not cfg.tie_word_embeddings:
        return cfg
    names = {_text_name(n): n for n in sd}
    head, emb = names.get("lm_head.weight"), names.get("model.embed_tokens.weight")
    if head is None or emb is None:
        return cfg
    h, e = sd[head], sd[emb]
    if h.shape == e.shape and (torch.equal(h, e) if h.dtype == e.dtype else torch.equal(h.float(), e.float())):
        return cfg
    log.warning("%s: config.json says tie_word_embeddings but the checkpoint's lm_head.weight differs from the "
                "embeddings: the stored head is used, untied (as transformers does); set tie_word_embeddings "
                "false to silence this", folder)
    return dataclasses.replace(cfg, tie_word_embeddings=False)


def _packable(quantization: str | None, device):
    """qtype -> whether a quantized folder's matrices in that format stay packed: not with
    quantization="none", nor where the CPU kernels do not multiply it (model/hf_quant.py)."""
    from .gguf import kernels_cover

    if quantization == "none":
        return lambda qtype: False
    cover: dict[str, bool] = {}
    return lambda qtype: cover.setdefault(qtype, kernels_cover({qtype}, torch.device(device)))


def _packed_rows(sd: dict[str, torch.Tensor], model: Transformer, folder) -> dict[str, tuple]:
    """The matrices a quantized folder keeps packed (uint8 ggml rows in sd, model/hf_quant.py),
    popped from sd as {module name: (rows, bias, in_features)}."""
    from .hf_quant import packed_format

    out = {}
    for name in [n for n, t in sd.items() if t.dtype == torch.uint8 and n.endswith(".weight")]:
        owner = name[:-len(".weight")]
        try:
            k = model.get_submodule(owner).in_features
        except AttributeError:
            raise CheckpointError(f"{folder}: unexpected weight in the checkpoint: {name}") from None
        if packed_format(sd[name].shape[1], k) is None:
            raise CheckpointError(f"{folder}: {name} has {sd[name].shape[1]} bytes per row for {k} columns")
        out[owner] = (sd.pop(name), sd.pop(owner + ".bias", None), k)
    return out


def _archs_end_with(raw: dict, suffix: str) -> bool:
    archs = text_config(raw).get("architectures") or raw.get("architectures") or []
    return bool(archs) and all(a.endswith(suffix) for a in archs)


def is_base_model(raw: dict) -> bool:
    """A folder of the bare decoder (architectures like Qwen3Model / MistralModel, no LM head):
    an embedding model, which LLM runs with runner "pooling" by default (specdec/pooling.py)."""
    return _archs_end_with(raw, "Model")


def is_classifier(raw: dict) -> bool:
    """A sequence classifier (LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...:
    the decoder and a `score` head over its last token): runner "pooling", LLM.classify."""
    return _archs_end_with(raw, "ForSequenceClassification")


def finish(model: Transformer, torch_dtype: torch.dtype, device) -> Transformer:
    if torch_dtype == torch.bfloat16 and torch.device(device).type == "cpu" and fp32_activations_pay():
        model.use_fp32_activations()
    return model.eval().requires_grad_(False)


def fp32_activations_pay() -> bool:
    """bf16 weights on the CPU: run them with fp32 activations (kernels/forward.c, the weights
    widened in registers) wherever the kernels load, and on CPUs without native bf16 arithmetic
    (PyTorch emulates it slowly). Even with native bf16 (oneDNN on AVX-512-BF16/AMX), the C
    forward measured 1.3x (SmolLM2-135M) and 1.4x (the bundled target) faster per decoding
    forward than the PyTorch path with bf16 activations (bench/kernels/xeon-avx512vnni)."""
    from .. import kernels

    return kernels.load() is not None or not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def save_model(model: Transformer, folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               extra_config: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    sd = {k: v.to(dtype).contiguous() for k, v in fused_to_hf(sd, cfg).items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    hf.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def read_head_file(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a drafter's folder (an EAGLE-3 head, an MLP speculator), as its authors ship
    them: model.safetensors, else pytorch_model.bin, or either's shards with their index."""
    return read_state_dict(folder)


def weight_names(folder: Path) -> list[str] | None:
    """The tensor names of a folder's weights without reading the tensors (safetensors headers,
    memory-mapped pickles), None where it holds no readable weights file."""
    try:
        return [name for path in _weight_files(folder) if path.is_file() for name, _ in _file_tensors(path)]
    except Exception:           # no weights file, a corrupt index or file: not a folder of this kind
        return None


def check_state(folder, what: str, state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """A drafter's converted weights against the module's: the first missing, unexpected or
    misshapen one raises CheckpointError naming `what` (e.g. "EAGLE weights")."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        name = f"{missing[0]} missing" if missing else f"{unexpected[0]} unexpected"
        raise CheckpointError(f"{folder}: {what} do not match the config: {name}")
    for k, v in state.items():
        if v.shape != expected[k]:
            raise CheckpointError(f"{folder}: {k} is {tuple(v.shape)}, the config gives {tuple(expected[k])}")


def copy_weights(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """src's weights written into dst's own tensors, in place (LLM.reload_weights): every
    parameter and buffer of every module, and the kernels' packed panels of GGUF matrices
    (QuantLinear.prepared), so that whatever shares them (a tied head, a drafter reading the
    target's embedding, the C path's views) sees the new values. The two must be the same model
    (architecture, sizes, quantization; floating-point weights are cast to dst's dtypes): the first
    difference is a ValueError naming it, raised before anything is written. -> the number of tensors written."""
    from ..kernels import PreparedQuant

    mods_d, mods_s = dict(dst.named_modules()), dict(src.named_modules())
    if mods_d.keys() != mods_s.keys():
        diff = sorted(mods_d.keys() ^ mods_s.keys())[0]
        raise ValueError(f"the new weights' model differs from the engine's: module {diff!r} is in "
                         f"{'the engine' if diff in mods_d else 'the new weights'} only")
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, d in mods_d.items():
        s = mods_s[name]
        if type(d) is not type(s):
            raise ValueError(f"the new weights' model differs from the engine's: {name or 'the model'} is a "
                             f"{type(s).__name__} there, a {type(d).__name__} here (another quantization?)")
        for kind in ("_parameters", "_buffers"):
            td, ts = getattr(d, kind), getattr(s, kind)
            for key in sorted(td.keys() | ts.keys()):
                a, b = td.get(key), ts.get(key)
                if (a is None) != (b is None):
                    raise ValueError(f"the new weights' model differs from the engine's: {name}.{key} is "
                                     f"{'missing' if b is None else 'extra'} there")
                if a is not None:
                    pairs.append((f"{name}.{key}".lstrip("."), a, b))
        for key, a in vars(d).items():
            if isinstance(a, PreparedQuant):
                b = getattr(s, key, None)
                if not isinstance(b, PreparedQuant) or (b.qtype, b.n, b.k) != (a.qtype, a.n, a.k):
                    raise ValueError(f"the new weights' model differs from the engine's: {name} is "
                                     f"{a.qtype} [{a.n}, {a.k}] here, not there")
                pairs.append((f"{name}.{key}", a.data, b.data))
    for name, a, b in pairs:     # floating-point weights are cast to the engine's dtype (a float32 save, say)
        if a.shape != b.shape or (a.dtype != b.dtype and not (a.is_floating_point() and b.is_floating_point())):
            raise ValueError(f"the new weights' model differs from the engine's: {name} is {b.dtype} "
                             f"{list(b.shape)} there, {a.dtype} {list(a.shape)} here")
    with torch.no_grad():
        for _, a, b in pairs:
            if a.data_ptr() != b.data_ptr():
                a.copy_(b)
    return len(pairs)
