"""EAGLE-3 heads (Li et al. 2025) as vLLM and the EAGLE authors ship them: `--speculative-config
'{"method": "eagle3", "model": FOLDER}'`.

An EAGLE-3 head reads the target's residual stream entering three of its layers (vLLM's
default: 2, L // 2 and L - 3 of L; the config's `eagle_aux_hidden_state_layer_ids` when given),
fused by `fc` (3 x target hidden -> hidden). Its one decoder layer attends over
[input_layernorm(embedding of token t + 1) ; hidden_norm(h_t)], twice the hidden size wide,
with h_t as the residual (hidden_norm(h_t) with `norm_before_residual`); norm and an LM head
over a draft vocabulary give the next token, and the layer's output h (before the norm) is the
state the next draft step starts from: the target's fused features at committed slots, the
head's own outputs at drafted ones. Draft index i is target token i + d2t[i].

Folders: config.json with "architectures" LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM (the
authors' and vLLM's) or "speculators_model_type": "eagle3" (the speculators library, its layer
settings under transformer_layer_config); weights in model.safetensors or pytorch_model.bin,
named midlayer.* or layers.0.*, fc, norm, lm_head, d2t (t2d is not needed), and embed_tokens
when the head has its own (else the target's embedding is shared, as vLLM does).

The speculators library's later options are read too: `norm_before_fc` (an RMSNorm,
`input_norm`, over the concatenated features before fc: its gpt-oss heads), `fc_norm` (one
RMSNorm per feature layer, `fc_norm.i`), and `norm_output` (EAGLE 3.1: the state a draft step
hands to the next is the final norm's output rather than the layer's); its training-only
`verifier_norm` / `verifier_lm_head` weights are read past.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from .batch import ForwardBatch, ForwardOutput
from .checkpoint import CheckpointError, _not_a_folder, read_head_file
from .config import ModelConfig
from .kv import KVCache
from .llama import MLP, Attention, Embedding, Linear, RMSNorm, Transformer
from .heads import place_head

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def is_eagle3(folder: str | os.PathLike) -> bool:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    return cfg.get("speculators_model_type") == "eagle3" or any(a in ARCHITECTURES for a in cfg.get("architectures") or [])


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embeds) ; hidden_norm(h)]
    (q, k, v projections 2 x hidden wide), residual h, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attn = Attention(cfg.replace(hidden_size=2 * D))
        self.self_attn.o_proj = Linear(cfg.num_attention_heads * cfg.head_dim, D, bias=False)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual
        self.sandwich = False

    # what forward.c reads of a layer (kernels/cforward.CView): the state's norm gives the
    # attention input's second half (the embeddings' norm, its first, comes as e_norm)
    @property
    def in_norm(self) -> RMSNorm:
        return self.hidden_norm

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.post_attention_layernorm

    def forward(self, embeds: Tensor, h: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        h = residual + self.self_attn(x, cos, sin, 0, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The proposer's interface is EagleHead's (proposers/eagle.py): forward(feats, token_embeds,
    kv, batch) -> logits over the draft vocabulary and the states the next step starts from."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, feature_layers: tuple[int, ...], draft_vocab: Tensor,
                 norm_before_residual: bool = False, embedding_rows: int = 0, logit_scale: float = 1.0,
                 fc_norm: str | None = None, norm_output: bool = False):
        super().__init__()
        D = cfg.hidden_size
        self.feature_layers = feature_layers
        n = len(feature_layers)
        # the speculators library's options: an RMSNorm over the concatenated features before fc
        # ("concat": norm_before_fc, gpt-oss's heads) or one per feature layer ("each": fc_norm);
        # norm_output (EAGLE 3.1): the state carried to the next draft step is the normed one
        self.input_norm = RMSNorm(n * target_hidden, cfg.rms_norm_eps) if fc_norm == "concat" else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, cfg.rms_norm_eps) for _ in range(n)) \
            if fc_norm == "each" else None
        self.norm_output = norm_output
        self.fc = Linear(n * target_hidden, D, bias=False)
        self.fc.row_invariant = True      # over prompt features of requests batched together
        # the decoder holds the layer, the final norm, the LM head over the draft vocabulary and
        # the rotary frequencies; its cache is the head's (one layer) on the engine's blocks
        self.decoder = Transformer(cfg.replace(num_hidden_layers=1, vocab_size=draft_vocab.numel(),
                                               tie_word_embeddings=False))
        self.decoder.model.layers[0] = Eagle3Layer(cfg, norm_before_residual)
        self.decoder.model.embed_tokens.weight = nn.Parameter(torch.empty(0, D))
        # its own token embedding (over the target's vocabulary) when the checkpoint has one
        self.embed_tokens = Embedding(embedding_rows, D) if embedding_rows else None
        self.logit_scale = logit_scale
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))

    @property
    def decoder_config(self) -> ModelConfig:
        return self.decoder.config

    def forward(self, feats: Tensor, token_embeds: Tensor, kv: KVCache | None = None,
                batch: ForwardBatch | None = None) -> ForwardOutput:
        """feats: the target's features of tokens t ([.., len(feature_layers) x target hidden],
        fused by fc) or the head's own states (hidden wide); token_embeds: embeddings of tokens
        t + 1; [B, T, .] without a cache, [N, .] flat with one. Returns the logits for tokens
        t + 2 (rows batch.logits_indices asks for) and the head's states [.., hidden] (before
        its final norm)."""
        d = self.decoder
        h = feats.to(d.dtype)
        if h.shape[-1] == self.fc.in_features:
            if self.input_norm is not None:
                h = self.input_norm(h)
            elif self.fc_norm is not None:
                h = torch.cat([norm(part) for norm, part in zip(self.fc_norm, h.chunk(len(self.fc_norm), -1))], -1)
            h = self.fc(h)
        if kv is not None and d.c_view(kv) is not None:     # forward.c: rows [h ; e], the state before the norm
            out = d(None, kv, batch, embeds=torch.cat([h, token_embeds.to(d.dtype)], -1),
                    hidden=True if self.norm_output else (1,))   # (True: the final norm's output)
            return ForwardOutput(out.logits * self.logit_scale if self.logit_scale != 1.0 else out.logits, out.hidden)
        if kv is None:      # training / scoring a whole sequence: [B, T, .]
            B, T = h.shape[:2]
            positions, attend = torch.arange(T, device=d.device).expand(B, T), None
        else:
            positions, attend = batch.positions.to(d.device), d._attention(kv, batch)
        cos, sin = d._ropes(positions, h.dtype, 1)[0]
        h = d.model.layers[0](token_embeds.to(d.dtype), h, cos, sin, attend)
        rows = batch.logits_indices if batch is not None else None
        if self.norm_output:
            h = d.model.norm(h)
            logits = d.lm_head(h if rows is None else h[rows.to(d.device)])
        else:
            logits = d.lm_head(d.model.norm(h if rows is None else h[rows.to(d.device)]))
        return ForwardOutput(logits * self.logit_scale if self.logit_scale != 1.0 else logits, h)

    def use_fp32_activations(self) -> "Eagle3Head":
        self.decoder.use_fp32_activations()
        return self


def _settings(cfg: dict) -> dict:
    """The authors' / vLLM's config.json, or the speculators library's (its layer under
    transformer_layer_config), as one flat dict."""
    if cfg.get("speculators_model_type") == "eagle3":
        layer = cfg.get("transformer_layer_config") or {}
        # norm_before_residual left out: True, as vLLM reads these configs (speculators/algos.py
        # update_eagle3); the library itself always writes it. The authors' layout: False.
        return {**layer, "norm_before_residual": True,
                **{k: cfg[k] for k in ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
                                       "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm",
                                       "norm_output") if k in cfg}}
    return cfg


def feature_layers_of(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads, in layer order (vLLM's capture order):
    the config's eagle_aux_hidden_state_layer_ids (top level or in eagle_config), else
    (2, L // 2, L - 3)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    layers = tuple(sorted(set(ids if ids else (2, num_layers // 2, num_layers - 3))))
    if not layers or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"EAGLE-3 feature layers {layers} fall outside the target's {num_layers} layers")
    return layers


def _weights(folder: Path) -> dict[str, Tensor]:
    return {name.removeprefix("model.").replace("midlayer.", "layers.0."): t for name, t in read_head_file(folder).items()}


def load_eagle3(folder: str | os.PathLike, target: Transformer) -> Eagle3Head:
    """An EAGLE-3 folder for `target`: weights in the target's dtype, on its device."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(_not_a_folder(folder))
    if not is_eagle3(folder):
        raise CheckpointError(f"{folder}: not an EAGLE-3 folder (config.json needs architectures "
                              f"{' / '.join(ARCHITECTURES[:2])} or speculators_model_type eagle3)")
    raw = _settings(json.loads((folder / "config.json").read_text()))
    tcfg = target.config
    try:
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{raw['num_hidden_layers']} decoder layers (one is supported, what EAGLE-3 heads have)")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("biases on the attention or the MLP are not supported")
        D = raw["hidden_size"]
        target_hidden = raw.get("target_hidden_size") or D
        if target_hidden != tcfg.hidden_size:
            raise ValueError(f"trained on features of hidden size {target_hidden}, the target's is {tcfg.hidden_size}")
        vocab = raw.get("vocab_size", tcfg.vocab_size)
        if vocab != tcfg.vocab_size:
            raise ValueError(f"a vocabulary of {vocab} tokens, the target's has {tcfg.vocab_size}")
        layers = feature_layers_of(raw, tcfg.num_hidden_layers)
        if len(layers) * target_hidden == D:
            raise ValueError(f"a hidden size of {D} is also its fused input's width: features and states "
                             "would be told apart by width")
        cfg = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "num_hidden_layers": 1, "tie_word_embeddings": False})
    except (KeyError, ValueError) as e:
        what = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{folder}: EAGLE-3 head {what}") from None
    sd = _weights(folder)
    V = int(raw.get("draft_vocab_size") or vocab)
    if "lm_head.weight" not in sd or sd["lm_head.weight"].shape != (V, D):
        got = tuple(sd["lm_head.weight"].shape) if "lm_head.weight" in sd else "none"
        raise CheckpointError(f"{folder}: lm_head.weight should be [{V}, {D}] (draft_vocab_size x hidden), got {got}")
    d2t = sd.pop("d2t", None)
    sd.pop("t2d", None)
    draft_vocab = torch.arange(V) + (d2t.to(torch.long) if d2t is not None else 0)
    if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= tcfg.vocab_size:
        raise CheckpointError(f"{folder}: d2t maps draft tokens outside the target's vocabulary [0, {tcfg.vocab_size})")
    own = sd.pop("embed_tokens.weight", None)
    if own is None and D != tcfg.hidden_size:
        raise CheckpointError(f"{folder}: no embed_tokens.weight, and the target's embeddings are {tcfg.hidden_size} "
                              f"wide, not {D}")
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise CheckpointError(f"{folder}: EAGLE-3 head sets both norm_before_fc and fc_norm (one norm before fc)")
    fc_norm = "concat" if raw.get("norm_before_fc") else "each" if raw.get("fc_norm") else None
    head = Eagle3Head(cfg, target_hidden, layers, draft_vocab, bool(raw.get("norm_before_residual", False)),
                      embedding_rows=own.shape[0] if own is not None else 0,
                      logit_scale=float(raw.get("logit_scale", 1.0)), fc_norm=fc_norm,
                      norm_output=bool(raw.get("norm_output", False)))
    for name in [n for n in sd if n.startswith(("verifier_norm.", "verifier_lm_head."))]:
        del sd[name]                    # the speculators library's training-time copies of the target's
    p = "layers.0."
    state = {"fc.weight": sd.pop("fc.weight", None), "decoder.model.norm.weight": sd.pop("norm.weight", None),
             "decoder.lm_head.weight": sd.pop("lm_head.weight")}
    if fc_norm == "concat":
        state["input_norm.weight"] = sd.pop("input_norm.weight", None)
    elif fc_norm == "each":
        state.update({f"fc_norm.{i}.weight": sd.pop(f"fc_norm.{i}.weight", None) for i in range(len(layers))})
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        state[f"decoder.model.layers.0.{name}.weight"] = sd.pop(f"{p}{name}.weight", None)
    qkv = [sd.pop(f"{p}self_attn.{n}_proj.weight", None) for n in "qkv"]
    gate_up = [sd.pop(f"{p}mlp.{n}_proj.weight", None) for n in ("gate", "up")]
    state["decoder.model.layers.0.self_attn.qkv_proj.weight"] = None if None in qkv else torch.cat(qkv)
    state["decoder.model.layers.0.self_attn.o_proj.weight"] = sd.pop(f"{p}self_attn.o_proj.weight", None)
    state["decoder.model.layers.0.mlp.gate_up_proj.weight"] = None if any(t is None for t in gate_up) else torch.cat(gate_up)
    state["decoder.model.layers.0.mlp.down_proj.weight"] = sd.pop(f"{p}mlp.down_proj.weight", None)
    if own is not None:
        state["embed_tokens.weight"] = own
    missing = [k for k, v in state.items() if v is None]
    if missing or sd:
        what = f"{missing[0]} missing" if missing else f"{next(iter(sd))} unexpected"
        raise CheckpointError(f"{folder}: EAGLE-3 weights do not match the config: {what}")
    expected = {k: v.shape for k, v in head.state_dict().items() if k in state}
    for k, v in state.items():
        if v.shape != expected[k]:
            raise CheckpointError(f"{folder}: {k} is {tuple(v.shape)}, the config gives {tuple(expected[k])}")
    head.load_state_dict(state, strict=False)
    return place_head(head, target)


def save_eagle3(head: Eagle3Head, folder: str | os.PathLike, dtype=torch.bfloat16, extra: dict | None = None) -> None:
    """The authors' / vLLM's layout (what `load_eagle3` and vLLM's `"method": "eagle3"` read):
    config.json with LlamaForCausalLMEagle3 and the feature layers named, model.safetensors with
    fc, midlayer.*, norm, lm_head, d2t and t2d."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, layer = head.decoder.config, head.decoder.model.layers[0]
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    V = head.draft_vocab.numel()
    vocab_size = int(head.embed_tokens.num_embeddings) if head.embed_tokens is not None else None
    cast = lambda t: t.detach().to("cpu", dtype).contiguous()  # noqa: E731
    sd = {"fc.weight": cast(head.fc.weight), "norm.weight": cast(head.decoder.model.norm.weight),
          "lm_head.weight": cast(head.decoder.lm_head.weight),
          "midlayer.self_attn.q_proj.weight": cast(wq), "midlayer.self_attn.k_proj.weight": cast(wk),
          "midlayer.self_attn.v_proj.weight": cast(wv), "midlayer.self_attn.o_proj.weight": cast(layer.self_attn.o_proj.weight),
          "midlayer.mlp.gate_proj.weight": cast(gate), "midlayer.mlp.up_proj.weight": cast(up),
          "midlayer.mlp.down_proj.weight": cast(layer.mlp.down_proj.weight),
          "d2t": (head.draft_vocab.cpu() - torch.arange(V)).contiguous()}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[f"midlayer.{name}.weight"] = cast(getattr(layer, name).weight)
    if head.embed_tokens is not None:
        sd["embed_tokens.weight"] = cast(head.embed_tokens.weight)
    if head.input_norm is not None:
        sd["input_norm.weight"] = cast(head.input_norm.weight)
    for i, norm in enumerate(head.fc_norm or ()):
        sd[f"fc_norm.{i}.weight"] = cast(norm.weight)
    target_vocab = (extra or {}).get("vocab_size", vocab_size)
    if target_vocab is not None:
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[head.draft_vocab.cpu()] = True
        sd["t2d"] = t2d
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
           "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
           "tie_word_embeddings": False, "draft_vocab_size": V, "target_hidden_size": head.fc.in_features // len(head.feature_layers),
           "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
           "norm_before_residual": layer.norm_before_residual, "torch_dtype": str(dtype).removeprefix("torch."),
           **({"norm_before_fc": True} if head.input_norm is not None else {}),
           **({"fc_norm": True} if head.fc_norm is not None else {}),
           **({"norm_output": True} if head.norm_output else {}), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(out, indent=2) + "\n")
