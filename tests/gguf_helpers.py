"""Tiny GGUF files for the tests, written with gguf-py's writer from checkpoints written by
transformers: llama.cpp's tensor names, its rotary permutation of q/k (llama, mistral), the
tokenizer as `tokenizer.ggml.*` metadata, and each tensor in the ggml type asked for. gguf-py
cannot quantize Q4_K, so `quantize_q4_k` below encodes it (a plain min/max fit per 32 weights)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file

T = GGMLQuantizationType
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",      # phi3's fused tensors
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              # GLM-4.5 / DeepSeek: shared experts; DeepSeek's latent attention
              "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
              "mlp.shared_experts.down_proj": "ffn_down_shexp", "self_attn.q_a_proj": "attn_q_a",
              "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
              "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
              "self_attn.kv_b_proj": "attn_kv_b",
              # MTP layers after the last (GLM-4.5 / DeepSeek-V3: llama.cpp's nextn tensors)
              "enorm": "nextn.enorm", "hnorm": "nextn.hnorm", "eh_proj": "nextn.eh_proj",
              "shared_head.norm": "nextn.shared_head_norm", "shared_head.head": "nextn.shared_head_head",
              "embed_tokens": "nextn.embed_tokens"}


# Gemma 2 / 3's sandwich norms: post_attention_layernorm norms the attention's output there
SANDWICH_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, sandwich: bool = False) -> str:
    if hf.startswith("blk."):              # already llama.cpp's (stacked experts)
        return hf
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{(SANDWICH_TO_GGUF if sandwich and module in SANDWICH_TO_GGUF else HF_TO_GGUF)[module]}.{kind}"


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's split-halves rotary rows -> llama.cpp's interleaved pairs (its converter's permute)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> [N, K / 256 * 144] uint8 Q4_K blocks."""
    x = w.astype(np.float32).reshape(-1, 8, 32)                    # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15                                  # [blocks, 8]
    d = (scale.max(-1) / 63).astype(np.float16)                    # super-block scales
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d.astype(np.float32)[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.round(-lo / dmin.astype(np.float32)[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d.astype(np.float32)[:, None] * sc                   # [blocks, 8]
        offset = dmin.astype(np.float32)[:, None] * mn
        q = np.where(step[..., None] > 0, np.round((x + offset[..., None]) / step[..., None]), 0).clip(0, 15).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), np.uint8)                   # 6-bit scales and mins
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = q.reshape(-1, 4, 2, 32)
    nibbles = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, nibbles], axis=1)
    return blocks.reshape(w.shape[0], -1)


def encode(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.Q4_K:
        return quantize_q4_k(w)
    if qtype in RANDOM_BLOCKS:
        # gguf-py cannot encode these: random blocks with sane scales (loading only)
        return _random_blocks(w, qtype)
    return quants.quantize(w.astype(np.float32), qtype)


# where each format gguf-py cannot encode keeps its fp16 block scale(s) (byte offsets; ggml's
# block structs); IQ1_M spreads its scale over the top nibbles of its four 16-bit sub-scales.
# (gguf-py encodes MXFP4 itself.)
RANDOM_BLOCKS = {T.Q5_K: (0, 2), T.Q6_K: (-2,), T.Q2_K: (-4, -2), T.Q3_K: (-2,), T.TQ1_0: (-2,), T.TQ2_0: (-2,),
                 T.IQ1_S: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
                 T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ1_M: (), T.Q8_1: ()}


def _random_blocks(w: np.ndarray, qtype) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES
    per, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (w.size // per, size), dtype=np.uint8)
    d = np.array([np.abs(w).max() / 2048], dtype=np.float16)
    for at in RANDOM_BLOCKS[qtype]:
        blocks[:, at:at + 2 if at != -2 else None] = d.view(np.uint8)
    if qtype == T.IQ1_M:                      # scale = the top nibbles of sub-scales 0..3 (low to high)
        sc = blocks[:, 48:56].copy().view(np.uint16)
        bits = int(d.view(np.uint16)[0])
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


def byte_level_vocab(hf_dir: Path) -> dict:
    """tokens / types / merges of a byte-level tokenizer.json (added special tokens: control)."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges}


def write_gguf(hf_dir: Path, out: Path, qtypes=None, arch: str | None = None, vocab: dict | None = None,
               pre: str = "gpt2", chat_template: str | None = "default", bos: int = 0, eos: int = 1,
               add_bos: bool | None = False, name: str = "tiny", skip=(), extra_tensors: dict | None = None,
               metadata: dict | None = None) -> Path:
    """A .gguf of the transformers checkpoint in hf_dir. qtypes(gguf_name, ndim) -> GGMLQuantizationType
    (default: F32 everywhere)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or {"gemma3_text": "gemma3", "olmo3": "olmo2", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
                    "mixtral": "llama", "granitemoeshared": "granitemoe", "glm4_moe": "glm4moe",
                    "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
                    "glm4_moe_lite": "deepseek2", "gpt_oss": "gpt-oss"}.get(cfg["model_type"], cfg["model_type"])
    meta = dict(metadata or {})       # keys given here replace the ones derived below
    sd = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    w.add_name(name)

    def base(key, add, value):          # a derived key, unless `metadata` gives it
        if f"{arch}.{key}" not in meta:
            add(value)
    base("context_length", w.add_context_length, cfg["max_position_embeddings"])
    base("embedding_length", w.add_embedding_length, cfg["hidden_size"])
    base("block_count", w.add_block_count, cfg["num_hidden_layers"])
    base("feed_forward_length", w.add_feed_forward_length, cfg["intermediate_size"])
    base("attention.head_count", w.add_head_count, heads)
    base("attention.head_count_kv", w.add_head_count_kv, kv)
    rope = cfg.get("rope_parameters") or {}      # a partial rotary (Phi-4-mini): the rotated dims, as llama.cpp
    base("rope.dimension_count", w.add_rope_dimension_count,
         int(head_dim * (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1)))
    if cfg.get("head_dim"):          # as llama.cpp's converter: the head size where config.json names it
        base("attention.key_length", w.add_key_length, head_dim)
        base("attention.value_length", w.add_value_length, head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)        # Gemma 3: its global layers' (the local base is llama.cpp's 10000)
    base("rope.freq_base", w.add_rope_freq_base, float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    base("attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, float(cfg["rms_norm_eps"]))
    w.add_file_type(1)
    _write_vocab(w, vocab or byte_level_vocab(hf_dir), pre, bos, eos, add_bos)
    if chat_template:
        w.add_chat_template(_CHAT if chat_template == "default" else chat_template)
    for key, value in meta.items():
        (w.add_array if isinstance(value, list) else w.add_string if isinstance(value, str)
         else w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    qtypes = qtypes or (lambda n, ndim: T.F32)
    gemma = arch.startswith("gemma")
    if gemma:          # llama.cpp's converter stores Gemma's norms as 1 + w
        sd = {k: v + 1 if k.endswith("norm.weight") else v for k, v in sd.items()}
    sd = _stack_experts(sd, cfg)
    if "num_experts_per_tok" in cfg:     # llama.cpp's expert keys
        base("expert_count", w.add_expert_count, cfg.get("num_local_experts") or cfg.get("num_experts")
             or cfg.get("n_routed_experts"))
        base("expert_used_count", w.add_expert_used_count, cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            base("expert_feed_forward_length", w.add_expert_feed_forward_length, cfg["moe_intermediate_size"])
    if arch == "gpt-oss":                # as llama.cpp's converter: the experts' size, the window, YaRN
        base("expert_feed_forward_length", w.add_expert_feed_forward_length, cfg["intermediate_size"])
        base("attention.sliding_window", w.add_sliding_window, cfg["sliding_window"])
        if rope.get("rope_type") == "yarn":
            from gguf import RopeScalingType
            base("rope.scaling.type", w.add_rope_scaling_type, RopeScalingType.YARN)
            base("rope.scaling.factor", w.add_rope_scaling_factor, rope["factor"])
            base("rope.scaling.original_context_length", w.add_rope_scaling_orig_ctx_len,
                 rope["original_max_position_embeddings"])
    # GLM-4.5's MLP input norm is llama.cpp's post_attention_norm, as in the sandwich families
    tensors = {gguf_name(k, arch in ("gemma2", "gemma3", "olmo2", "glm4moe", "gpt-oss")): v for k, v in sd.items()}
    tensors.update(extra_tensors or {})
    for gname, v in tensors.items():
        if gname in skip:
            continue
        v = v.astype(np.float32)
        if arch in ("llama", "mistral", "smollm3", "granite", "granitemoe") and (".attn_q." in gname or ".attn_k." in gname):
            v = permute_rotary(v, kv if ".attn_k." in gname else heads)
        qtype = qtypes(gname, v.ndim) if v.ndim >= 2 and gname.endswith(".weight") else T.F32   # biases stay F32
        data = encode(v.reshape(-1, v.shape[-1]), qtype)
        data = data.reshape(*v.shape[:-1], data.shape[-1])      # a stack of experts stays 3-D
        w.add_tensor(gname, data, raw_dtype=None if qtype == T.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _stack_experts(sd: dict, cfg: dict) -> dict:
    """Each layer's experts as llama.cpp stores them: one [E, rows, in] tensor per matrix, the
    router as ffn_gate_inp (Hugging Face: mlp.* / Mixtral's block_sparse_moe.*)."""
    out, stacks = {}, {}
    for k, v in sd.items():
        parts = k.split(".")
        if k.endswith("self_attn.sinks"):                    # gpt-oss: its sinks; router and stacked experts below
            out[f"blk.{parts[2]}.attn_sinks.weight"] = v
        elif ".mlp.router." in k:
            out[f"blk.{parts[2]}.ffn_gate_inp.{parts[-1]}"] = v
        elif parts[-1] in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") and parts[-2] == "experts":
            i = parts[2]        # gate_up [E, D, 2F] with gate and up columns interleaved; down [E, F, D]
            if parts[-1] == "gate_up_proj":
                v = v.transpose(0, 2, 1)
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = v[:, 0::2], v[:, 1::2]
            elif parts[-1] == "gate_up_proj_bias":
                out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = v[:, 0::2], v[:, 1::2]
            elif parts[-1] == "down_proj":
                out[f"blk.{i}.ffn_down_exps.weight"] = v.transpose(0, 2, 1)
            else:
                out[f"blk.{i}.ffn_down_exps.bias"] = v
        elif len(parts) > 3 and parts[-3] == "shared_mlp":        # Granite MoE shared: its shared expert, gate and up fused
            i = parts[2]
            if parts[-2] == "input_linear":
                half = v.shape[0] // 2
                out[f"blk.{i}.ffn_gate_shexp.weight"], out[f"blk.{i}.ffn_up_shexp.weight"] = v[:half], v[half:]
            else:
                out[f"blk.{i}.ffn_down_shexp.weight"] = v
        elif k.endswith("mlp.gate.e_score_correction_bias"):     # GLM-4.5 / DeepSeek-V3's choice bias
            out[f"blk.{parts[2]}.exp_probs_b.bias"] = v
        elif k.endswith("shared_expert_gate.weight"):      # Qwen2-MoE: llama.cpp keeps it as a vector
            out[f"blk.{parts[2]}.ffn_gate_inp_shexp.weight"] = v.reshape(-1)
        elif parts[-2] in ("input_linear", "output_linear"):       # GraniteMoE: stacked already, gate and up fused
            i = parts[2]
            if parts[-2] == "input_linear":
                half = v.shape[1] // 2
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = v[:, :half], v[:, half:]
            else:
                out[f"blk.{i}.ffn_down_exps.weight"] = v
        elif parts[-2] == "layer" and parts[-3] == "router":
            out[f"blk.{parts[2]}.ffn_gate_inp.weight"] = v
        elif "experts" in parts:
            i, e, mat = parts[2], int(parts[parts.index("experts") + 1]), parts[parts.index("experts") + 2]
            stacks.setdefault(f"blk.{i}.{EXPERT_NAMES[mat]}.weight", {})[e] = v
        elif parts[-2] == "gate" and parts[-3] in ("mlp", "block_sparse_moe"):
            out[f"blk.{parts[2]}.ffn_gate_inp.weight"] = v
        else:
            out[k] = v
    out.update({name: np.stack([d[e] for e in sorted(d)]) for name, d in stacks.items()})
    return out


def _write_vocab(w: GGUFWriter, v: dict, pre: str, bos: int, eos: int, add_bos) -> None:
    w.add_tokenizer_model(v["model"])
    if v["model"] == "gpt2":
        w.add_tokenizer_pre(pre)
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if v.get("scores") is not None:
        w.add_token_scores(v["scores"])
    if v.get("merges") is not None:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if v.get("unk") is not None:
        w.add_unk_token_id(v["unk"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)


_CHAT = ("{% for m in messages %}{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }}\n"
         "{{ m['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def sentencepiece_vocab(texts: list[str], size: int = 400, with_merges: bool = True) -> dict:
    """A llama-type (SentencePiece BPE) vocabulary: <unk> <s> </s>, the 256 <0xNN> byte tokens,
    then BPE pieces learned on `texts` with "\u2581" for spaces; scores rank the pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, show_progress=False, min_frequency=2))
    data = json.loads(tk.to_str())
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    reserved = {"<unk>", "<s>", "</s>", *byte_tokens}
    pieces = [t for t, _ in learned if t not in reserved]    # a token listed twice is ambiguous
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores,
            "merges": merges if with_merges else None, "unk": 0}


def sample_strings(n: int = 300, seed: int = 0) -> list[str]:
    """Code, prose, unicode, whitespace runs, digits and special tokens, mixed at random."""
    pieces = [
        "def add(a, b):\n    return a + b\n", "class Point:\n\tdef __init__(self, x):\n\t\tself.x = x",
        "for i in range(10):  # loop\n    print(f\"{i:03d}\")", "if (x != y && y >= 0) { return -1; }",
        "Hello, world!", "The quick brown fox jumps over the lazy dog.", "don't won't I'm we've they'll",
        "naïve café résumé", "日本語のテキスト", "中文字符", "Привет, мир", "مرحبا بالعالم", "🤖🚀✨ emoji",
        "e\u0301 combining", "\u00a0non-breaking\u2009thin", "1234567890", "3.14159 2,718 1e-10",
        "   leading", "trailing   ", "\n\n\ttabs\t\t", "  \n  ", "<|user|>", "<|end|>", "<|bos|>", "<s>", "</s>",
        "<unk>", "ABC abc AbC", "snake_case camelCase kebab-case", "https://example.com/a?b=c#d", "\\n \\t \"quoted\"",
    ]
    rng = random.Random(seed)
    out = list(pieces)
    while len(out) < n:
        k = rng.randint(1, 4)
        sep = rng.choice(["", " ", "\n", "  ", "\t"])
        out.append(sep.join(rng.choice(pieces) for _ in range(k)))
    return out


def write_vocab_gguf(path: Path, tokens: list[str], types: list[int], model: str = "llama", pre: str | None = None,
                     scores: list[float] | None = None, merges: list[str] | None = None, bos: int | None = 1,
                     eos: int | None = 2, add_bos: bool | None = None, metadata: dict | None = None) -> Path:
    """A .gguf holding only a tokenizer (tokenizer.ggml.* keys) and one dummy tensor: enough for
    specdec.tokenizer.Tokenizer. metadata: more keys (bool, int, str)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    for key, value in (metadata or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int) else w.add_string)(key, value)
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def split_gguf(src: Path, folder: Path, prefix: str, n: int, odd_no: dict | None = None) -> list[Path]:
    """src cut into n shards as llama.cpp's gguf-split writes them: PREFIX-0000i-of-0000n.gguf, all
    metadata in the first, split.no / split.count / split.tensors.count in each, the tensors
    dealt out in order (odd_no {shard index: a list}: that shard's split.no written as an array)."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(str(src))
    tensors = list(r.tensors)
    per = -(-len(tensors) // n)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"{prefix}-{i + 1:05d}-of-{n:05d}.gguf"
        w = GGUFWriter(str(path), r.fields["general.architecture"].contents() if i == 0 else None)
        if i == 0:
            for key, field in r.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                kind = field.types[0]
                sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), kind, sub)
        if odd_no and i in odd_no:
            w.add_key_value("split.no", odd_no[i], GGUFValueType.ARRAY, GGUFValueType.UINT16)
        else:
            w.add_key_value("split.no", i, GGUFValueType.UINT16)
        w.add_key_value("split.count", n, GGUFValueType.UINT16)
        w.add_key_value("split.tensors.count", len(tensors), GGUFValueType.INT32)
        for t in tensors[i * per:(i + 1) * per]:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths
