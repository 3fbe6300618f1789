"""llama.cpp's GGUF checkpoints -> the runtime's `Transformer` (architectures llama, mistral, qwen2,
qwen3, phi3, smollm3, granite, gemma, gemma2, gemma3, olmo2 -- OLMo 2 and OLMo 3 --, and the
mixtures of experts qwen3moe, olmoe, llama with experts -- Mixtral --, granitemoe, qwen2moe,
glm4moe, deepseek2 and gpt-oss).

A .gguf holds the hyper-parameters and the tokenizer as metadata and every tensor in a ggml
format (F32, F16, BF16, or a block-quantized one). The file is memory-mapped (gguf-py's
GGUFReader) and checked whole -- architecture, tensor names, types and shapes -- before any
weight is built, so a bad file fails with one line and nothing half-loaded.

Two llama.cpp conventions are undone here:
- its converter permutes the rows of attn_q / attn_k of llama and mistral models (rotary pairs
  interleaved instead of split into halves); qwen2 and qwen3 are stored unpermuted. ggml rows
  are whole in every format, so the inverse permutation is a row shuffle, valid on quantized
  rows too;
- q/k/v and gate/up are separate tensors; the runtime fuses them (a row concatenation).

Packed matrices (`load_gguf`'s quantization): Q8_0 / Q4_0 / Q4_1 / Q4_K matrices can stay in
their blocks (model/quant.py); other types, and fused matrices whose parts differ in type (as in
Q4_K_M files), are dequantized at load to the model dtype.
- "gguf" (vLLM's spelling): keep them packed.
- "none": dequantize everything to `dtype` ("auto": float32, exact for every ggml format).
- None / "auto" (the default): packed where a CPU kernel multiplies that format
  (`kernels.quant_linear`), else dequantized: the PyTorch reference for packed weights is exact
  but dequantizes every matrix at every step, an order of magnitude slower than dense decoding.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import GEMMA, ModelConfig, longrope_attention_factor, text_config
from .quant import QTYPES, QuantEmbedding, QuantLinear, dequantize
from .llama import Transformer
from .mla import rope_row_order

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma", "gemma2", "gemma3",
                 "olmo2", "qwen3moe", "olmoe", "granitemoe", "qwen2moe", "glm4moe", "deepseek2", "gpt-oss")
# read through a Hugging Face config built from their metadata (_hf_config); MTP ("nextn")
# blocks after the last layer are left out
HF_LIKE = ("glm4moe", "deepseek2", "gpt-oss")
# the MLP's input norm where it is not ffn_norm
MLP_NORM = {"glm4_moe": "post_attention_norm", "gpt_oss": "post_attention_norm"}
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}   # GGUF architecture -> Hugging Face model_type
# llama.cpp's default for renormalising the chosen experts' weights (its expert_weights_norm key wins)
EXPERTS_NORM = {"qwen3moe": True, "olmoe": False, "llama": True, "granitemoe": True, "qwen2moe": False}
SANDWICH = ("gemma2", "gemma3")            # post_attention_norm, ffn_norm (the MLP's input) and post_ffw_norm
FUSED = ("phi3",)                        # attn_qkv and ffn_up (gate rows, then up rows) as one tensor each
PERMUTED = ("llama", "mistral", "smollm3", "granite", "mixtral", "granitemoe", "granitemoeshared")    # q/k rows interleaved by llama.cpp's converter
# every ggml format gguf-py can dequantize: the legacy and k-quants, the i-quants of llama.cpp's
# importance-matrix presets (IQ1_S .. IQ4_XS), the ternary TQ1_0 / TQ2_0 and MXFP4
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0",
                "TQ2_0", "MXFP4")
QUANTIZATIONS = (None, "auto", "gguf", "none")
# hyper-parameters llama.cpp reads as one value or one per layer (get_key_or_arr); the runtime has one
PER_LAYER = (".attention.head_count", ".attention.head_count_kv", ".feed_forward_length", ".rope.freq_base")
# ggml type ids llama.cpp has removed (gguf-py no longer knows them): name, what replaced it
REMOVED_TYPES = {4: ("Q4_2", None), 5: ("Q4_3", None), 31: ("Q4_0_4_4", "Q4_0"), 32: ("Q4_0_4_8", "Q4_0"),
                 33: ("Q4_0_8_8", "Q4_0"), 36: ("IQ4_NL_4_4", "IQ4_NL"), 37: ("IQ4_NL_4_8", "IQ4_NL"),
                 38: ("IQ4_NL_8_8", "IQ4_NL")}
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A .gguf that cannot be used; the message is one line naming the file."""


# llama.cpp's split files (gguf-split): NAME-00001-of-00003.gguf, ...; the first holds the metadata
# and split.no / split.count / split.tensors.count, every shard some of the tensors
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def is_gguf_file(p: Path) -> bool:
    """A file named .gguf, or one that starts with GGUF's magic (Ollama's blobs have no suffix):
    vLLM's check_gguf_file; llama.cpp never looks at the name."""
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file that `path` names: the file itself (is_gguf_file), or the only .gguf of a
    folder that is not a Hugging Face folder (no config.json) -- or the first shard where the
    folder's .gguf files are one split set. None for anything else."""
    p = Path(path)
    if is_gguf_file(p):
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(q for q in p.iterdir() if q.suffix.lower() == ".gguf" and q.is_file())
        names = [SPLIT_NAME.match(q.name) for q in found]
        if len(found) > 1 and all(names) and len({(m["prefix"], m["count"]) for m in names}) == 1:
            first = next((q for q, m in zip(found, names) if int(m["no"]) == 1), None)
            if first is None:
                raise GGUFError(f"{p}: holds shards of the split GGUF {names[0]['prefix']} but not its first, "
                                f"{names[0]['prefix']}-00001-of-{names[0]['count']}.gguf")
            return first
        if len(found) > 1:
            raise GGUFError(f"{p}: holds {len(found)} .gguf files ({', '.join(q.name for q in found[:3])}"
                            f"{', ...' if len(found) > 3 else ''}); name the one to load")
        return found[0] if found else None
    return None


def _reader(path: Path):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """gguf-py's reader, slicing a plain ndarray view of the map instead of the np.memmap
        itself: every slice of a memmap builds a memmap object, and parsing a 50k-token
        vocabulary takes a few hundred thousand slices (2.6x faster to open)."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_tensors(self, start_offs, fields):
            """A type id gguf-py does not know is named here with its tensor (gguf-py's own error is
            the bare id), and as llama.cpp names it where llama.cpp removed it."""
            from gguf import GGMLQuantizationType

            known = {int(t) for t in GGMLQuantizationType}
            for field in fields:          # parts: name length, name, n_dims, dims, type, offset
                kind = int(field.parts[4][0])
                if kind not in known:
                    name = bytes(field.parts[1]).decode("utf-8", "replace")
                    raise GGUFError(f"tensor {name} has {_type_words(kind)}")
            super()._build_tensors(start_offs, fields)

    return Reader(path, mode="c")


def _type_words(kind: int) -> str:
    """What to say of a ggml type id that cannot be read."""
    if kind in REMOVED_TYPES:
        name, instead = REMOVED_TYPES[kind]
        return (f"type {kind} ({name}), which llama.cpp removed: re-quantize the model"
                + (f" (to {instead}, which llama.cpp repacks at load time)" if instead else ""))
    return f"type {kind}, which is no ggml type gguf-py knows (a newer one?)"


def _open(path: Path):
    """gguf-py's reader of `path`, its byte order and tensor data offsets checked as llama.cpp
    checks them; a GGUFError naming the file otherwise."""
    try:
        reader = _reader(path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:   # gguf-py raises ValueError, IndexError, KeyError, ... on damage
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GGUFError(f"{path}: not a readable GGUF file ({detail})") from None
    if reader.byte_order == "S":         # gguf-py reads the header either way, the tensor data not
        order = "big" if sys.byteorder == "little" else "little"
        raise GGUFError(f"{path}: a {order}-endian GGUF file, which this {sys.byteorder}-endian machine cannot "
                        "use (llama.cpp refuses it too; gguf-py's gguf_convert_endian.py converts it)")
    _check_offsets(path, reader)
    return reader


def _check_offsets(path: Path, reader) -> None:
    """Each tensor's data where llama.cpp requires it: at the sum of the sizes of the tensors
    before it, each padded to the alignment. A damaged offset would otherwise read another
    tensor's bytes (or part of its own) without a word."""
    align, expected = int(reader.alignment), 0
    for t in reader.tensors:
        offset = int(t.field.parts[-1][0])
        if offset != expected:
            raise GGUFError(f"{path}: tensor {t.name} has data offset {offset}, expected {expected} "
                            "(its data overlaps another tensor's or is out of place: a damaged file)")
        expected += -(-int(t.n_bytes) // align) * align


class GGUFFile:
    """An opened .gguf: metadata and tensor views (memory-mapped, copy-on-write)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _open(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.shards = [self.reader]
        count = self.get("split.count")
        if count is not None and int(count) > 1:
            self._open_shards(int(count))
        self.architecture = self.get("general.architecture")

    def _open_shards(self, count: int) -> None:
        """A split GGUF named by its first shard: the other shards' tensors, found as llama.cpp
        finds them (PREFIX-0000i-of-0000N.gguf beside the first)."""
        no = int(self.get("split.no") or 0)
        m = SPLIT_NAME.match(self.path.name)
        if no != 0:
            first = f"{m['prefix']}-00001-of-{count:05d}.gguf" if m else "the first shard"
            raise GGUFError(f"{self.path}: shard {no + 1} of a split GGUF ({count} files); name the first, {first}")
        if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
            raise GGUFError(f"{self.path}: the first of a split GGUF ({count} files), but not named "
                            f"NAME-00001-of-{count:05d}.gguf, so its other shards cannot be found")
        for i in range(2, count + 1):
            path = self.path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            if not path.is_file():
                raise GGUFError(f"{self.path}: shard {path.name} of the split GGUF ({i} of {count}) is missing")
            reader = _open(path)
            field = reader.fields.get("split.no")
            value = field.contents() if field is not None else None
            if not isinstance(value, int) or value != i - 1:       # a list there was a TypeError
                raise GGUFError(f"{path}: not shard {i} of {self.path.name}'s split GGUF (split.no is "
                                f"{value!r}, expected {i - 1})")
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{path}: tensor {t.name} is in two shards of the split GGUF")
                self.tensors[t.name] = t
            self.shards.append(reader)
        total = self.get("split.tensors.count")
        if total is not None and int(total) != len(self.tensors):
            raise GGUFError(f"{self.path}: the split GGUF's {count} shards hold {len(self.tensors)} tensors, "
                            f"split.tensors.count says {int(total)}")

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception:
            raise GGUFError(f"{self.path}: metadata {key} is unreadable") from None
        return self._one_value(key, value) if isinstance(value, list) and self._scalar_key(key) else value

    def _scalar_key(self, key: str) -> bool:
        """A key specdec reads as one value: the architecture's hyper-parameters (but its
        per-layer sliding-window pattern), the special token ids and the split keys."""
        arch = self.__dict__.get("architecture")
        return ((arch is not None and key.startswith(f"{arch}.") and not key.endswith(".sliding_window_pattern"))
                or key.endswith("_token_id") or key.startswith("split."))

    def _one_value(self, key: str, values: list):
        """A list where one value is read: llama.cpp's per-layer arrays (get_key_or_arr: one value
        per layer) are taken when every layer has the same value, as is a list of one repeated id;
        anything else is refused."""
        shown = f"[{', '.join(map(str, values[:4]))}{', ...' if len(values) > 4 else ''}]"
        if not key.endswith(PER_LAYER) and not key.endswith("_token_id"):
            raise GGUFError(f"{self.path}: metadata {key} is a list {shown}, one value expected")
        if key.endswith(PER_LAYER):
            layers = self.get(f"{self.architecture}.block_count")
            if layers is not None and len(values) != int(layers):
                raise GGUFError(f"{self.path}: metadata {key} has {len(values)} per-layer values for {int(layers)} layers")
        if not values or any(v != values[0] for v in values):
            raise GGUFError(f"{self.path}: metadata {key} holds differing values {shown}; "
                            + ("per-layer values are not supported" if key.endswith(PER_LAYER) else "one id expected"))
        return values[0]

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata lacks {key}")
        return value

    @property
    def nextn_layers(self) -> int:
        """MTP blocks stored after the last layer (llama.cpp's nextn_predict_layers)."""
        return int(self.get(f"{self.architecture}.nextn_predict_layers") or 0)

    def config(self) -> ModelConfig:
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if arch in HF_LIKE:
            return ModelConfig.from_hf(self._hf_config())
        a = lambda key, default=None: self.get(f"{arch}.{key}", default)  # noqa: E731
        n_heads = int(self.require(f"{arch}.attention.head_count"))
        hidden = int(self.require(f"{arch}.embedding_length"))
        context = self.context_length()
        rope_scaling = self._rope_scaling(context)
        n_layers = int(self.require(f"{arch}.block_count"))
        if "rope_factors_short.weight" in self.tensors:     # Phi-3's longrope, as its converter writes it
            old = int(a("rope.scaling.original_context_length") or context)
            factors = {k: _dense(self.tensors[f"rope_factors_{k}.weight"],
                                 _raw_rows(self.tensors[f"rope_factors_{k}.weight"])).tolist()
                       for k in ("short", "long") if f"rope_factors_{k}.weight" in self.tensors}
            attn = a("rope.scaling.attn_factor")
            if attn is None:
                attn = longrope_attention_factor(context / old, old)
            rope_scaling = {"rope_type": "longrope", "short_factor": factors["short"],
                            "long_factor": factors.get("long", factors["short"]),
                            "original_max_position_embeddings": old, "attention_factor": float(attn)}
        embd = self.tensors.get("token_embd.weight")
        vocab = a("vocab_size") or (int(embd.shape[1]) if embd is not None else None)
        if vocab is None:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor")
        eos = self.get("tokenizer.ggml.eos_token_id")
        # Phi-3's rope.dimension_count is the rotated part of a head (Phi-4-mini: 96 of 128)
        head_dim = int(a("attention.key_length") or (hidden // n_heads if arch == "phi3" else None)
                       or a("rope.dimension_count") or hidden // n_heads)
        rotary = int(a("rope.dimension_count") or head_dim) if arch == "phi3" else head_dim
        family = (_gemma_fields(self, arch, n_layers, hidden, n_heads) if arch.startswith("gemma")
                  else _olmo_fields(self, arch, n_layers, rope_scaling) if arch == "olmo2" else {})
        if a("expert_count"):
            family.update(_moe_fields(self, arch, n_layers))
        return ModelConfig(
            vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(self.require(f"{arch}.feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(a("attention.head_count_kv") or n_heads),
            head_dim=head_dim,
            rotary_dim=rotary if rotary < head_dim else None,
            max_position_embeddings=context,
            rms_norm_eps=float(self.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm=arch in ("qwen3", "gemma3", "olmo2", "qwen3moe", "olmoe"),
            # SmolLM3: llama.cpp skips RoPE in every 4th layer (its n_no_rope_layer_step)
            **({"nope_layers": tuple(range(3, n_layers, 4))} if arch == "smollm3" else {}),
            **(_granite_fields(self, arch, n_layers) if arch in ("granite", "granitemoe") else {}),
            **(family or _sliding_fields(a("attention.sliding_window"), context, n_layers)),
            **({"model_type": MODEL_TYPES.get(arch, arch)} if "model_type" not in family else {}),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=None if eos is None else int(eos),
        )

    def config_from(self, folder: str | os.PathLike) -> ModelConfig:
        """vLLM's hf_config_path: the model's config.json read from `folder`, its fields winning
        over the metadata but for what the file itself fixes (vLLM's
        maybe_patch_hf_config_from_gguf): the vocabulary's size and whether the output layer is
        tied (no output.weight)."""
        from .checkpoint import CheckpointError, read_config

        try:
            raw = text_config(read_config(folder))
        except CheckpointError as e:
            raise GGUFError(f"{self.path}: hf_config_path {e}") from None
        except ValueError as e:
            raise GGUFError(f"{self.path}: hf_config_path {folder}: {e}") from None
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor")
        vocab = self.get(f"{self.architecture}.vocab_size") or embd.shape[1]
        raw = {**raw, "vocab_size": int(vocab), "tie_word_embeddings": "output.weight" not in self.tensors}
        try:
            return ModelConfig.from_hf(raw)
        except (ValueError, TypeError) as e:
            raise GGUFError(f"{self.path}: hf_config_path {folder}: {e}") from None

    def context_length(self) -> int:
        """{arch}.context_length, which llama.cpp requires (its n_ctx_train)."""
        context = int(self.require(f"{self.architecture}.context_length"))
        if context < 1:
            raise GGUFError(f"{self.path}: metadata {self.architecture}.context_length is {context}")
        return context

    def _rope_scaling(self, context: int) -> dict | None:
        """llama.cpp's keys -> transformers' rope_scaling: the type is linear unless
        rope.scaling.type says otherwise; the factor is rope.scaling.factor or the old key
        rope.scale_linear, none (or 0, or 1) meaning no scaling -- but YaRN needs one. YaRN's
        beta_fast, beta_slow and attention_factor where the file has them (llama.cpp's converter
        writes a config's as rope.scaling.yarn_beta_fast / yarn_beta_slow / yarn_attn_factor:
        Kimi K2's betas are 1 and 1, not the defaults 32 and 1), as transformers applies them."""
        a = lambda key, default=None: self.get(f"{self.architecture}.{key}", default)  # noqa: E731
        scaling = a("rope.scaling.type", "linear")
        if scaling not in ("none", "linear", "yarn"):
            raise GGUFError(f"{self.path}: unsupported rope scaling {scaling!r} (supported: linear, yarn)")
        if scaling == "yarn":
            out = {"rope_type": "yarn", "factor": float(self.require(f"{self.architecture}.rope.scaling.factor")),
                   "original_max_position_embeddings": int(a("rope.scaling.original_context_length") or context)}
            for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                              ("yarn_attn_factor", "attention_factor")):
                if a(f"rope.scaling.{key}") is not None:
                    out[name] = float(a(f"rope.scaling.{key}"))
            return out
        factor = a("rope.scaling.factor")
        factor = float(a("rope.scale_linear", 0.0) if factor is None else factor)
        return {"rope_type": "linear", "factor": factor} if scaling == "linear" and factor not in (0.0, 1.0) else None

    def _hf_config(self) -> dict:
        """GLM-4.5's and DeepSeek-V2 / V3's config.json from llama.cpp's keys (its converters'
        names; expert_gating_func 2 is sigmoid routing, 1 or none softmax; DeepSeek's
        yarn_log_multiplier is 0.1 x mscale_all_dim; files before MLA's split store the head
        sizes as key_length / value_length)."""
        arch = self.architecture
        a = lambda key, default=None: self.get(f"{arch}.{key}", default)  # noqa: E731
        req = lambda key: self.require(f"{arch}.{key}")  # noqa: E731
        heads, hidden = int(req("attention.head_count")), int(req("embedding_length"))
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor")
        sigmoid = int(a("expert_gating_func") or 1) == 2
        groups, used_groups = int(a("expert_group_count") or 1), int(a("expert_group_used_count") or 1)
        eos = self.get("tokenizer.ggml.eos_token_id")
        cfg = {"vocab_size": int(a("vocab_size") or embd.shape[1]), "hidden_size": hidden, "num_attention_heads": heads,
               "intermediate_size": int(req("feed_forward_length")),
               "num_hidden_layers": int(req("block_count")) - self.nextn_layers,
               "max_position_embeddings": self.context_length(),
               "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
               "rope_theta": float(a("rope.freq_base", 10000.0)), "tie_word_embeddings": "output.weight" not in self.tensors,
               "n_routed_experts": int(req("expert_count")), "num_experts_per_tok": int(req("expert_used_count")),
               "moe_intermediate_size": int(req("expert_feed_forward_length")),
               "n_shared_experts": int(a("expert_shared_count") or 0),
               "first_k_dense_replace": int(a("leading_dense_block_count") or 0),
               "routed_scaling_factor": float(a("expert_weights_scale") or 1.0),
               "norm_topk_prob": bool(a("expert_weights_norm") or False), "n_group": groups, "topk_group": used_groups,
               "bos_token_id": self.get("tokenizer.ggml.bos_token_id"), "eos_token_id": None if eos is None else int(eos)}
        # llama.cpp reads the scaling keys alike for every architecture: a factor without a type is linear
        rope_scaling = self._rope_scaling(cfg["max_position_embeddings"])
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
            mul = a("rope.scaling.yarn_log_multiplier")
            if mul and arch == "deepseek2" and rope_scaling["rope_type"] == "yarn":
                # mscale = mscale_all_dim: cos and sin unscaled, as DeepSeek's configs
                rope_scaling.update(mscale=float(mul) / 0.1, mscale_all_dim=float(mul) / 0.1)
        if arch == "gpt-oss":
            return self._gpt_oss_config(cfg)
        if arch == "glm4moe":
            if not sigmoid:
                raise GGUFError(f"{self.path}: glm4moe with softmax routing is not supported (expert_gating_func 2)")
            head_dim = int(a("attention.key_length") or hidden // heads)
            cfg.update(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", head_dim=head_dim,
                       num_key_value_heads=int(a("attention.head_count_kv") or heads),
                       partial_rotary_factor=int(a("rope.dimension_count") or head_dim) / head_dim,
                       attention_bias="blk.0.attn_q.bias" in self.tensors,
                       use_qk_norm="blk.0.attn_q_norm.weight" in self.tensors)
            return cfg
        rope = int(req("rope.dimension_count"))
        key_mla, value_mla = a("attention.key_length_mla"), a("attention.value_length_mla")
        cfg.update(architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
                   model_type="deepseek_v3" if sigmoid else "deepseek_v2",
                   q_lora_rank=a("attention.q_lora_rank"), kv_lora_rank=int(req("attention.kv_lora_rank")),
                   qk_rope_head_dim=rope, qk_nope_head_dim=int(key_mla or req("attention.key_length")) - rope,
                   v_head_dim=int(value_mla or req("attention.value_length")), rope_interleave=True,
                   topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy")
        return cfg


    def _gpt_oss_config(self, cfg: dict) -> dict:
        """gpt-oss's config.json from llama.cpp's keys: experts of expert_feed_forward_length,
        its window in the layers sliding_window_pattern marks (llama.cpp's default: the even
        ones), YaRN with the model's own untruncated ramp (transformers' and vLLM's truncate=false)."""
        a = lambda key, default=None: self.get(f"gpt-oss.{key}", default)  # noqa: E731
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        n = cfg["num_hidden_layers"]
        window = _gguf_window_layers(self, "gpt-oss", n, 2)
        rope = {**cfg.pop("rope_scaling", {"rope_type": "default"}), "rope_theta": cfg["rope_theta"]}
        if rope["rope_type"] == "yarn":
            rope.update(beta_fast=float(a("rope.scaling.yarn_beta_fast") or 32.0),
                        beta_slow=float(a("rope.scaling.yarn_beta_slow") or 1.0), truncate=False)
        cfg.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                   head_dim=int(a("attention.key_length") or hidden // heads),
                   num_key_value_heads=int(a("attention.head_count_kv") or heads),
                   intermediate_size=int(self.require("gpt-oss.expert_feed_forward_length")),
                   num_local_experts=cfg["n_routed_experts"], attention_bias=True, rope_parameters=rope,
                   sliding_window=window.get("sliding_window"),
                   layer_types=["sliding_attention" if i in window.get("sliding_layers", ()) else "full_attention"
                                for i in range(n)])
        return cfg


def _moe_fields(g: GGUFFile, arch: str, n_layers: int) -> dict:
    """A mixture of experts: llama.cpp's expert_count / expert_used_count /
    expert_feed_forward_length, in the layers that have a router (ffn_gate_inp); Mixtral's
    files are `llama` ones with experts."""
    a = lambda key, default=None: g.get(f"{arch}.{key}", default)  # noqa: E731
    norm = a("expert_weights_norm")
    out = {"num_experts": int(a("expert_count")), "num_experts_per_tok": int(g.require(f"{arch}.expert_used_count")),
           "moe_intermediate_size": int(a("expert_feed_forward_length") or g.require(f"{arch}.feed_forward_length")),
           "norm_topk_prob": EXPERTS_NORM.get(arch, True) if norm is None else bool(norm),
           "moe_layers": tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in g.tensors)}
    shared = next((g.tensors[f"blk.{i}.ffn_down_shexp.weight"] for i in out["moe_layers"]
                   if f"blk.{i}.ffn_down_shexp.weight" in g.tensors), None)
    if shared is not None:                 # a shared expert (Qwen2-MoE: behind a gate; Granite MoE shared)
        out["shared_expert_size"] = int(a("expert_shared_feed_forward_length") or shared.shape[0])
        out["shared_expert_gate"] = any(f"blk.{i}.ffn_gate_inp_shexp.weight" in g.tensors for i in out["moe_layers"])
        if arch == "granitemoe":
            out["model_type"] = "granitemoeshared"
    if arch == "llama":
        out["model_type"] = "mixtral"
    if arch == "olmoe":
        out["qk_norm_full"] = True
    return out


def _granite_fields(g: GGUFFile, arch: str, n_layers: int) -> dict:
    """Granite's multipliers as llama.cpp reads its keys: embedding_scale, residual_scale and
    attention.scale are optional, absent or 0 meaning none (the attention's: the usual
    1 / sqrt(head_dim); its converter leaves out a multiplier the config has as null or 0), and
    logit_scale 1 where absent (llama.cpp requires it); rope.scaling.finetuned false turns RoPE off in every layer (llama.cpp's switch for Granite,
    transformers' position_embedding_type "nope" of Granite 4)."""
    a = lambda key: g.get(f"{arch}.{key}")  # noqa: E731
    scale = a("attention.scale")
    out = {"embedding_multiplier": float(a("embedding_scale") or 1.0),
           "residual_multiplier": float(a("residual_scale") or 1.0),
           "attention_multiplier": float(scale) if scale else None,
           "logits_scaling": float(a("logit_scale") or 1.0)}
    if a("rope.scaling.finetuned") is False:
        out["nope_layers"] = tuple(range(n_layers))
    return out


def _olmo_fields(g: GGUFFile, arch: str, n_layers: int, rope_scaling: dict | None) -> dict:
    """OLMo 2's fields (llama.cpp converts OLMo 3 to the same architecture, with a sliding window
    and its per-layer pattern; the window's layers keep the RoPE base unscaled, as transformers)."""
    out = {"pre_norms": False, "sandwich_norms": True, "qk_norm_full": True}
    window = _gguf_window_layers(g, arch, n_layers, 4)
    if window:
        out.update(window, model_type="olmo3")
        if rope_scaling is not None:
            out["local_rope_theta"] = float(g.get(f"{arch}.rope.freq_base", 10000.0))
    return out


def _gguf_window_layers(g: GGUFFile, arch: str, n_layers: int, every: int, window: int | None = None) -> dict:
    """{arch}.attention.sliding_window (else `window`, llama.cpp's default for the family) in the
    layers {arch}.attention.sliding_window_pattern marks (a per-layer list: true slides; or a
    period), else in all but every `every`-th layer (llama.cpp's default); {} without a window."""
    window = g.get(f"{arch}.attention.sliding_window", window)
    pattern = g.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = tuple(i for i, f in enumerate(pattern) if f)
    else:
        period = int(pattern) if pattern else every
        sliding = tuple(i for i in range(n_layers) if (i + 1) % period)
    return {"sliding_window": int(window), "sliding_layers": sliding} if window and sliding else {}


def _sliding_fields(window, context: int, n_layers: int) -> dict:
    """A sliding window in every layer (llama.cpp writes one for Phi-3: phi3.attention.sliding_window)."""
    if not window or int(window) >= context:
        return {}
    return {"sliding_window": int(window), "sliding_layers": tuple(range(n_layers))}


def _gemma_fields(g: GGUFFile, arch: str, n_layers: int, hidden: int, n_heads: int) -> dict:
    """Gemma's ModelConfig fields from llama.cpp's keys and its rules: embeddings x sqrt(hidden),
    GeGLU; Gemma 2 / 3: sandwich norms, a sliding window (every even layer; 5 layers in 6 for
    Gemma 3, whose sliding layers take RoPE base 10000 unless rope.freq_base_swa says), the
    attention scaled by attention.scale or else llama.cpp's 1 / sqrt(head_dim) (the 27B models:
    1 / sqrt(hidden / heads)), Gemma 2's soft-caps. A Gemma 2 file without the soft-cap or window
    keys (converted before llama.cpp wrote them) gets llama.cpp's defaults: 50 / 30, window 4096."""
    a = lambda key, default=None: g.get(f"{arch}.{key}", default)  # noqa: E731
    out = {"hidden_act": "gelu_tanh", "embedding_multiplier": float(hidden ** 0.5)}
    if arch == "gemma":
        return out
    head_dim = int(a("attention.key_length") or hidden // n_heads)
    big = n_layers == (46 if arch == "gemma2" else 62)          # the 27B models
    scale = a("attention.scale")
    out.update(sandwich_norms=True,
               attention_multiplier=float(scale) if scale is not None else (hidden / n_heads if big else head_dim) ** -0.5,
               attn_softcap=float(a("attn_logit_softcapping", 50.0 if arch == "gemma2" else 0.0)),
               final_softcap=float(a("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)))
    out.update(_gguf_window_layers(g, arch, n_layers, 2 if arch == "gemma2" else 6, 4096 if arch == "gemma2" else None))
    if arch == "gemma3":
        out["local_rope_theta"] = float(a("rope.freq_base_swa", 10000.0))
    return out



def _qkv_names(cfg: ModelConfig, p: str) -> list[str]:
    return [p + "attn_qkv.weight"] if cfg.model_type in FUSED else [p + f"attn_{x}.weight" for x in "qkv"]


def _gate_up_names(cfg: ModelConfig, p: str) -> list[str]:
    return [p + "ffn_up.weight"] if cfg.model_type in FUSED else [p + "ffn_gate.weight", p + "ffn_up.weight"]


def _mla_shapes(cfg: ModelConfig, p: str, split_kv_b: bool) -> dict[str, tuple[int, ...]]:
    """DeepSeek's latent attention tensors (llama.cpp's names; kv_b split into k_b, stored
    [H, latent, nope], and v_b, [H, v, latent], by its converters since MLA's cache)."""
    d, H, r, C = cfg.hidden_size, cfg.num_attention_heads, cfg.rotary_dim, cfg.kv_lora_rank
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    out = {p + "attn_kv_a_mqa.weight": (C + r, d), p + "attn_kv_a_norm.weight": (C,)}
    if cfg.q_lora_rank:
        out.update({p + "attn_q_a.weight": (cfg.q_lora_rank, d), p + "attn_q_a_norm.weight": (cfg.q_lora_rank,),
                    p + "attn_q_b.weight": (H * (nope + r), cfg.q_lora_rank)})
    else:
        out[p + "attn_q.weight"] = (H * (nope + r), d)
    if split_kv_b:
        out.update({p + "attn_k_b.weight": (H, C, nope), p + "attn_v_b.weight": (H, v, C)})
    else:
        out[p + "attn_kv_b.weight"] = (H * (nope + v), C)
    return out


def _shapes(cfg: ModelConfig, split_kv_b: bool = False) -> dict[str, tuple[int, ...]]:
    """Expected tensor shapes, PyTorch order ([out, in])."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    if cfg.kv_lora_rank:
        q = cfg.num_attention_heads * cfg.v_head_dim      # attn_output's input
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        p = f"blk.{i}."
        out.update({p + "attn_output.weight": (d, q)})
        if cfg.kv_lora_rank:
            out.update(_mla_shapes(cfg, p, split_kv_b))
        if cfg.router_sigmoid and i in cfg.moe_layers:
            out[p + "exp_probs_b.bias"] = (cfg.num_experts,)
        if i in cfg.moe_layers:             # a router and each expert's matrices stacked: [E, rows, in]
            E, fm = cfg.num_experts, cfg.moe_intermediate_size
            out.update({p + "ffn_gate_inp.weight": (E, d), p + "ffn_gate_exps.weight": (E, fm, d),
                        p + "ffn_up_exps.weight": (E, fm, d), p + "ffn_down_exps.weight": (E, d, fm)})
            if cfg.shared_expert_size:
                sz = cfg.shared_expert_size
                out.update({p + "ffn_gate_shexp.weight": (sz, d), p + "ffn_up_shexp.weight": (sz, d),
                            p + "ffn_down_shexp.weight": (d, sz)})
            if cfg.shared_expert_gate:
                out[p + "ffn_gate_inp_shexp.weight"] = (d,)
            if cfg.mlp_bias:              # gpt-oss: the router's and the experts' biases
                out.update({p + "ffn_gate_inp.bias": (E,), p + "ffn_gate_exps.bias": (E, fm),
                            p + "ffn_up_exps.bias": (E, fm), p + "ffn_down_exps.bias": (E, d)})
        else:
            out[p + "ffn_down.weight"] = (d, f)
        if cfg.pre_norms:
            out.update({p + "attn_norm.weight": (d,), p + MLP_NORM.get(cfg.model_type, "ffn_norm") + ".weight": (d,)})
        if cfg.model_type in FUSED:
            out.update({p + "attn_qkv.weight": (q + 2 * kv, d), p + "ffn_up.weight": (2 * f, d)})
        else:
            if not cfg.kv_lora_rank:
                out.update({p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d)})
            if i not in cfg.moe_layers:
                out.update({p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d)})
        if cfg.attention_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        if cfg.o_bias:
            out[p + "attn_output.bias"] = (d,)
        if cfg.attn_sinks:
            out[p + "attn_sinks.weight"] = (cfg.num_attention_heads,)
        if cfg.qk_norm:
            out.update({p + "attn_q_norm.weight": (q if cfg.qk_norm_full else hd,),
                        p + "attn_k_norm.weight": (kv if cfg.qk_norm_full else hd,)})
        if cfg.sandwich_norms:
            out.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    return out


def check_tensors(g: GGUFFile, cfg: ModelConfig, source: str = "the metadata") -> None:
    """Every tensor the model needs is there, of a type and shape we can load; nothing else is
    (source: where cfg came from, for the errors)."""
    expected = _shapes(cfg, "blk.0.attn_k_b.weight" in g.tensors)
    half = (cfg.rotary_dim or cfg.head_dim) // 2
    optional = {"rope_freqs.weight": (half,), "rope_factors_short.weight": (half,), "rope_factors_long.weight": (half,)}
    for name in expected:
        if name not in g.tensors:
            raise GGUFError(f"{g.path}: tensor {name} is missing")
    for name, t in g.tensors.items():
        block = re.match(r"blk\.(\d+)\.", name)
        if g.nextn_layers and block is not None and int(block.group(1)) >= cfg.num_hidden_layers:
            continue                      # an MTP block (not loaded: the mtp method reads Hugging Face folders)
        shape = expected.get(name) or optional.get(name)
        if shape is None:
            raise GGUFError(f"{g.path}: unexpected tensor {name} for architecture {g.architecture}")
        if int(t.tensor_type) in REMOVED_TYPES:          # an older gguf-py still knows them
            raise GGUFError(f"{g.path}: tensor {name} has {_type_words(int(t.tensor_type))}")
        if t.tensor_type.name not in TENSOR_TYPES:
            raise GGUFError(f"{g.path}: tensor {name} has type {t.tensor_type.name}, which specdec cannot load "
                            f"(supported: {', '.join(TENSOR_TYPES)})")
        got = tuple(int(x) for x in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(f"{g.path}: tensor {name} has shape {got}, {source} implies {shape}")
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) > cfg.vocab_size:     # llama.cpp's n_vocab is the list's length
        raise GGUFError(f"{g.path}: the vocabulary holds {len(tokens.data)} tokens (tokenizer.ggml.tokens), "
                        f"token_embd.weight has rows for {cfg.vocab_size}")


def _raw_rows(t) -> torch.Tensor:
    """The tensor's rows as stored: [rows, row_bytes] uint8 for block formats and BF16, else
    the float values ([n] for a vector). Shares memory with the mapped file."""
    return torch.from_numpy(np.asarray(t.data))


def _stacked_rows(t) -> torch.Tensor:
    """A 3-D tensor's rows as stored, its outer dimensions flattened: [E x rows, row]."""
    rows = _raw_rows(t)
    return rows.reshape(-1, rows.shape[-1])


def _dense(t, rows: torch.Tensor) -> torch.Tensor:
    """rows (from _raw_rows, maybe shuffled) -> fp32 values, [rows, in] or [n]."""
    kind = t.tensor_type.name
    cols = int(t.shape[0])
    if kind in ("F32", "F16"):
        return rows.float()
    if kind == "BF16":
        return rows.contiguous().view(torch.bfloat16).float()
    if kind in QTYPES:
        return dequantize(rows.contiguous(), kind, cols)
    from gguf import quants
    return torch.from_numpy(quants.dequantize(rows.contiguous().numpy(), t.tensor_type)).reshape(rows.shape[0], cols)


def rotary_unpermutation(rows: int, n_heads: int) -> torch.Tensor:
    """[rows] index: HF row r = GGUF row perm[r]. llama.cpp stores each head's rotary pairs
    interleaved (row 2i + s of a head holds HF row s * hd/2 + i)."""
    hd = rows // n_heads
    h, s, i = torch.meshgrid(torch.arange(n_heads), torch.arange(2), torch.arange(hd // 2), indexing="ij")
    return (h * hd + 2 * i + s).reshape(-1)


class _Builder:
    """Turns checked GGUF tensors into parameters and (packed) modules."""

    def __init__(self, g: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device, quantize: bool):
        self.g, self.cfg, self.dtype, self.device, self.quantize = g, cfg, dtype, device, quantize

    def rows(self, name: str) -> torch.Tensor:
        t = self.g.tensors[name]
        rows = _raw_rows(t)
        kv = ".attn_k." in name
        if self.cfg.model_type in PERMUTED and (kv or ".attn_q." in name):
            n = self.cfg.num_key_value_heads if kv else self.cfg.num_attention_heads
            rows = rows[rotary_unpermutation(rows.shape[0], n)]
        if self.cfg.kv_lora_rank and (".attn_q." in name or ".attn_q_b." in name or ".attn_kv_a_mqa." in name):
            rows = rows[rope_row_order(self.cfg, rows.shape[0], ".attn_kv_a_mqa." in name)]   # DeepSeek's pairs
        return rows

    def param(self, name: str, dtype: torch.dtype | None = None) -> nn.Parameter:
        value = _dense(self.g.tensors[name], self.rows(name))
        return nn.Parameter(value.to(self.device, dtype or self.dtype), requires_grad=False)

    def norm(self, name: str) -> nn.Parameter:
        """A norm's weight; Gemma's (stored as 1 + w by llama.cpp's converter, as the runtime
        holds them) stay fp32, as transformers computes them."""
        return self.param(name, torch.float32 if self.cfg.model_type in GEMMA else None)

    def linear(self, names: list[str], biases: list[str] | None = None) -> nn.Module:
        """The row concatenation of `names`: packed when they share a kept format, else dense."""
        kinds = {self.g.tensors[n].tensor_type.name for n in names}
        in_features = int(self.g.tensors[names[0]].shape[0])
        bias = torch.cat([_dense(self.g.tensors[b], self.rows(b)) for b in biases]) if biases else None
        if self.quantize and len(kinds) == 1 and next(iter(kinds)) in QTYPES:
            qweight = torch.cat([self.rows(n) for n in names]).contiguous()
            return QuantLinear(qweight.to(self.device), next(iter(kinds)), in_features,
                               None if bias is None else bias.to(self.device))
        weight = torch.cat([_dense(self.g.tensors[n], self.rows(n)) for n in names])
        lin = nn.Linear(in_features, weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(weight.to(self.device, self.dtype), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.to(self.device, self.dtype), requires_grad=False)
        return lin

    def expert_linear(self, names: list[str], e: int, biases: list[str] | None = None) -> nn.Module:
        """Expert e's rows of the stacked [E, rows, in] tensors `names`, concatenated (as linear),
        with its rows of the stacked [E, rows] `biases` (gpt-oss)."""
        parts = []
        for n in names:
            t = self.g.tensors[n]
            per = int(t.shape[1])                    # rows of one expert
            parts.append(_stacked_rows(t)[e * per:(e + 1) * per])
        kinds = {self.g.tensors[n].tensor_type.name for n in names}
        in_features = int(self.g.tensors[names[0]].shape[0])
        bias = None
        if biases:
            bias = torch.cat([_dense(self.g.tensors[b], _raw_rows(self.g.tensors[b]))[e] for b in biases])
        if self.quantize and len(kinds) == 1 and next(iter(kinds)) in QTYPES:
            return QuantLinear(torch.cat(parts).contiguous().to(self.device), next(iter(kinds)), in_features,
                               None if bias is None else bias.to(self.device))
        weight = torch.cat([_dense(self.g.tensors[n], r) for n, r in zip(names, parts)])
        lin = nn.Linear(in_features, weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(weight.to(self.device, self.dtype), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.to(self.device, self.dtype), requires_grad=False)
        return lin

    def packed(self, name: str) -> torch.Tensor | None:
        """The raw rows of `name` if it stays packed, else None."""
        t = self.g.tensors[name]
        return _raw_rows(t).to(self.device) if self.quantize and t.tensor_type.name in QTYPES else None


def _swap_linear(owner: nn.Module, attr: str, new: nn.Module) -> None:
    """Put `new` in place of a runtime Linear: packed modules go in as they are, a dense one
    lends its parameters to the runtime's Linear (which takes the CPU kernels)."""
    if isinstance(new, QuantLinear):
        setattr(owner, attr, new)
        return
    old = getattr(owner, attr)
    old.weight = new.weight
    if new.bias is not None:
        old.bias = new.bias


def load_gguf(g: GGUFFile | str | os.PathLike, dtype=None, device="cpu", quantization: str | None = None,
              hf_overrides: dict | None = None, disable_sliding_window: bool = False,
              max_model_len: int | None = None, hf_config_path: str | os.PathLike | None = None) -> Transformer:
    """The runtime model of a .gguf (see the module docstring for `quantization`; hf_overrides,
    disable_sliding_window and max_model_len: ModelConfig.configured; hf_config_path: a folder
    whose config.json the model runs with, GGUFFile.config_from)."""
    from .checkpoint import finish, resolve_dtype

    from .hf_quant import METHODS

    if quantization == "mxfp4":
        raise GGUFError(f"{Path(getattr(g, 'path', g))}: quantization='mxfp4' is for Hugging Face folders with MXFP4 "
                        "weights; a GGUF file's MXFP4 tensors stay packed with 'gguf' or auto")
    if quantization in METHODS:
        raise GGUFError(f"{Path(getattr(g, 'path', g))}: quantization={quantization!r} is for Hugging Face folders "
                        "quantized with it; a GGUF file takes 'gguf', 'none' or auto")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be 'gguf', 'none' or None (auto), got {quantization!r}")
    g = g if isinstance(g, GGUFFile) else GGUFFile(g)
    try:
        own = g.config() if hf_config_path is None else g.config_from(hf_config_path)
        cfg = own.configured(hf_overrides, disable_sliding_window, max_model_len)
    except GGUFError:
        raise                      # it names the file already
    except (ValueError, TypeError) as e:      # a value of the wrong kind in the metadata
        raise GGUFError(f"{g.path}: {e}") from None
    check_tensors(g, cfg, "the metadata" if hf_config_path is None else f"{Path(hf_config_path) / 'config.json'}")
    torch_dtype = resolve_dtype(dtype, {"torch_dtype": "float32"})
    packed = quantization == "gguf" or (quantization in (None, "auto") and kernels_cover(
        {t.tensor_type.name for t in g.tensors.values()} & set(QTYPES), torch.device(device)))
    # a config.json says its RoPE scaling itself: llama.cpp's rope_freqs tensor is not read (vLLM's)
    model = build_model(g, cfg, torch_dtype, device, packed, rope_freqs=hf_config_path is None)
    return finish(model, torch_dtype, device)


def kernels_cover(qtypes: set[str], device: torch.device) -> bool:
    """Whether specdec's CPU kernels multiply every one of these formats directly on this machine:
    asked on one all-zero row of 256 weights (a whole block in every format)."""
    from .. import kernels
    from .quant import row_bytes

    if not qtypes or device.type != "cpu":
        return False
    for qtype in qtypes:
        qweight = torch.zeros(16, row_bytes(qtype, 256), dtype=torch.uint8)
        if kernels.quant_linear(torch.zeros(1, 256), qweight, qtype, None, kernels.prepare_quant(qweight, qtype)) is None:
            return False
    return True


def build_model(g: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device, packed: bool,
                rope_freqs: bool = True) -> Transformer:
    """The model of a checked file (check_tensors); packed: keep the kept formats packed;
    rope_freqs: apply the file's rope_freqs tensor (llama3 scaling as llama.cpp stores it)."""
    b = _Builder(g, cfg, dtype, device, packed)
    with torch.device("meta"):
        model = Transformer(cfg)
    for i, layer in enumerate(model.model.layers):
        _fill_layer(layer, b, cfg, f"blk.{i}.", i in cfg.moe_layers)
    model.model.norm.weight = b.norm("output_norm.weight")
    _set_embeddings(model, b, cfg)
    model.reset_rope(device)
    if rope_freqs and "rope_freqs.weight" in g.tensors:    # llama3-style scaling, stored as per-frequency divisors
        model.inv_freq = model.inv_freq / _dense(g.tensors["rope_freqs.weight"],
                                                 _raw_rows(g.tensors["rope_freqs.weight"])).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"GGUF loader left {left[0]} unset")   # a bug here, not bad input
    if packed:
        model.use_fp32_activations()     # packed products take and return fp32
    return model


def _fill_layer(layer: nn.Module, b: _Builder, cfg: ModelConfig, p: str, moe: bool) -> None:
    """One decoder layer's weights from the tensors named p + ... (blk.{i}.)."""
    if layer.pre_norms:
        layer.input_layernorm.weight = b.norm(p + "attn_norm.weight")
        layer.mlp_norm.weight = b.norm(p + MLP_NORM.get(cfg.model_type, "ffn_norm") + ".weight")
    if layer.sandwich:
        layer.post_attention_layernorm.weight = b.norm(p + "post_attention_norm.weight")
        layer.post_feedforward_layernorm.weight = b.norm(p + "post_ffw_norm.weight")
    if cfg.kv_lora_rank:
        _mla(layer.self_attn, b, cfg, p)
    else:
        biases = [p + f"attn_{x}.bias" for x in "qkv"] if cfg.attention_bias else None
        _swap_linear(layer.self_attn, "qkv_proj", b.linear(_qkv_names(cfg, p), biases))
    _swap_linear(layer.self_attn, "o_proj", b.linear([p + "attn_output.weight"],
                                                     [p + "attn_output.bias"] if cfg.o_bias else None))
    if cfg.attn_sinks:
        layer.self_attn.sinks = b.param(p + "attn_sinks.weight")
    if cfg.qk_norm:
        layer.self_attn.q_norm.weight = b.norm(p + "attn_q_norm.weight")
        layer.self_attn.k_norm.weight = b.norm(p + "attn_k_norm.weight")
    if moe:
        bias = (lambda *names: [p + f"{n}.bias" for n in names]) if cfg.mlp_bias else (lambda *names: None)
        _swap_linear(layer.mlp, "gate", b.linear([p + "ffn_gate_inp.weight"], bias("ffn_gate_inp")))
        if cfg.router_sigmoid:         # the choice bias, fp32
            layer.mlp.e_score_correction_bias = b.param(p + "exp_probs_b.bias", torch.float32)
        for e, expert in enumerate(layer.mlp.experts):
            _swap_linear(expert, "gate_up_proj", b.expert_linear([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], e,
                                                                 bias("ffn_gate_exps", "ffn_up_exps")))
            _swap_linear(expert, "down_proj", b.expert_linear([p + "ffn_down_exps.weight"], e, bias("ffn_down_exps")))
        if cfg.shared_expert_size:
            shared = layer.mlp.shared_expert
            _swap_linear(shared, "gate_up_proj", b.linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]))
            _swap_linear(shared, "down_proj", b.linear([p + "ffn_down_shexp.weight"]))
        if cfg.shared_expert_gate:     # stored as a vector [D]
            layer.mlp.shared_expert_gate.weight = nn.Parameter(
                b.param(p + "ffn_gate_inp_shexp.weight").data.reshape(1, -1), requires_grad=False)
    else:
        _swap_linear(layer.mlp, "gate_up_proj", b.linear(_gate_up_names(cfg, p)))
        _swap_linear(layer.mlp, "down_proj", b.linear([p + "ffn_down.weight"]))


def _mla(att: nn.Module, b: _Builder, cfg: ModelConfig, p: str) -> None:
    """DeepSeek's latent attention from llama.cpp's tensors: its projections (packed where they
    can be), norms, and kv_b_proj dense (model/mla.py reads its per-head slices), rebuilt from
    k_b / v_b in the files that split it."""
    if cfg.q_lora_rank:
        _swap_linear(att, "q_a_proj", b.linear([p + "attn_q_a.weight"]))
        att.q_a_layernorm.weight = b.norm(p + "attn_q_a_norm.weight")
        _swap_linear(att, "q_b_proj", b.linear([p + "attn_q_b.weight"]))
    else:
        _swap_linear(att, "q_proj", b.linear([p + "attn_q.weight"]))
    _swap_linear(att, "kv_a_proj_with_mqa", b.linear([p + "attn_kv_a_mqa.weight"]))
    att.kv_a_layernorm.weight = b.norm(p + "attn_kv_a_norm.weight")
    if p + "attn_kv_b.weight" in b.g.tensors:
        kv_b = b.param(p + "attn_kv_b.weight").data
    else:
        H, C = cfg.num_attention_heads, cfg.kv_lora_rank
        k, v = (_dense(t, _stacked_rows(t)) for t in (b.g.tensors[p + f"attn_{x}_b.weight"] for x in "kv"))
        kv_b = torch.cat([k.reshape(H, C, -1).transpose(1, 2), v.reshape(H, -1, C)], 1).reshape(-1, C)
        kv_b = kv_b.to(b.device, b.dtype)
    att.kv_b_proj.weight = nn.Parameter(kv_b, requires_grad=False)


def load_mtp_gguf(path: str | os.PathLike, target: Transformer):
    """The first MTP ("nextn") block of a GGUF file (GLM-4.5's, as llama.cpp's converter writes
    it: block num_hidden_layers holds a decoder layer and nextn.enorm / hnorm / eh_proj /
    shared_head_norm / shared_head_head) as the drafter model/mtp.py describes, packed as the
    target's file is where the kernels multiply its formats."""
    from .checkpoint import resolve_dtype
    from .mtp import MTPHead

    g = GGUFFile(path)
    if g.architecture not in ARCHITECTURES:
        raise GGUFError(f"{g.path}: unsupported architecture {g.architecture!r}")
    if g.nextn_layers < 1:
        raise GGUFError(f"{g.path}: the file has no MTP blocks ({g.architecture}.nextn_predict_layers is not set)")
    try:
        full = g.config()
    except GGUFError:
        raise
    except (ValueError, TypeError) as e:
        raise GGUFError(f"{g.path}: {e}") from None
    L = full.num_hidden_layers
    p = f"blk.{L}."
    moe = p + "ffn_gate_inp.weight" in g.tensors
    cfg = full.replace(num_hidden_layers=1, moe_layers=(0,) if moe else (), tie_word_embeddings=False,
                       sliding_window=None, sliding_layers=(), local_rope_theta=None)
    need = [p + n for n in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                            "nextn.shared_head_norm.weight", "attn_norm.weight", "attn_output.weight")]
    missing = [n for n in need if n not in g.tensors]
    if missing:
        raise GGUFError(f"{g.path}: MTP tensor {missing[0]} is missing")
    dtype = resolve_dtype(None, {"torch_dtype": "float32"})
    device = target.device
    packed = kernels_cover({t.tensor_type.name for t in g.tensors.values()} & set(QTYPES), torch.device(device))
    b = _Builder(g, cfg, dtype, device, packed)
    with torch.device("meta"):
        head = MTPHead(cfg, embeds_first=True)
    _fill_layer(head.decoder.model.layers[0], b, cfg, p, moe)
    head.enorm.weight, head.hnorm.weight = b.norm(p + "nextn.enorm.weight"), b.norm(p + "nextn.hnorm.weight")
    _swap_linear(head, "eh_proj", b.linear([p + "nextn.eh_proj.weight"]))
    head.decoder.model.norm.weight = b.norm(p + "nextn.shared_head_norm.weight")
    head.decoder.model.embed_tokens.weight = nn.Parameter(torch.empty(0, cfg.hidden_size, device=device),
                                                          requires_grad=False)
    if p + "nextn.shared_head_head.weight" in g.tensors:
        _swap_linear(head.decoder, "lm_head", b.linear([p + "nextn.shared_head_head.weight"]))
    else:
        head.decoder.lm_head = target.lm_head
    head.draft_vocab = torch.arange(cfg.vocab_size, device=device)
    head.decoder.reset_rope(device)
    left = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"GGUF MTP loader left {left[0]} unset")   # a bug here, not bad input
    if packed or target.compute_dtype == torch.float32:
        head.use_fp32_activations()
    return head.eval().requires_grad_(False)


def _set_embeddings(model: Transformer, b: _Builder, cfg: ModelConfig) -> None:
    packed = b.packed("token_embd.weight")
    kind = b.g.tensors["token_embd.weight"].tensor_type.name
    if packed is not None:
        model.model.embed_tokens = QuantEmbedding(packed, kind, cfg.hidden_size)
    else:
        model.model.embed_tokens.weight = b.param("token_embd.weight")
    if cfg.tie_word_embeddings:
        if packed is not None:   # the same bytes serve both: no copy
            model.lm_head = QuantLinear(packed, kind, cfg.hidden_size)
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    else:
        _swap_linear(model, "lm_head", b.linear(["output.weight"]))
