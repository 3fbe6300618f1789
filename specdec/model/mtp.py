"""Multi-token prediction (MTP) layers that ship inside a target's checkpoint, run as its drafter:
vLLM's `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'` (its older names
deepseek_mtp, mimo_mtp and glm4_moe_mtp too). The target's own folder is the method's `model`
unless another is named.

DeepSeek-V3 (Liu et al. 2024), MiMo and GLM-4.5 train, beside the next-token loss, one more
layer that predicts the token after next: it reads the target's feature of token t (the final
norm's output) and the embedding of token t + 1, each through its own RMSNorm, projects their
concatenation back to the hidden size, and runs one decoder layer of the target's own
architecture (a mixture of experts when the target's last layers are); a norm and the LM head
give the logits for token t + 2, and the layer's output (before that norm) is the state the
next draft step starts from, as vLLM chains it: drafting K > 1 tokens reuses the one layer on
its own states. At position 0 the token embedding is zeroed (vLLM's rule).

Layouts (config.json's num_nextn_predict_layers > 0; the first MTP layer is used):
- the speculators library's standalone MTP drafters (`speculators_model_type` "mtp", vLLM reads
  them by folder): `mtp_layers.0.*` named as MiMo's below but with [embedding ; feature], the
  target's embeddings and LM head, and the normed output as the next step's state;
- DeepSeek-V3 / GLM-4.5: `model.layers.{L}.*` (L = num_hidden_layers) with enorm, hnorm,
  eh_proj (input [embedding ; feature]), shared_head.norm, shared_head.head (else the target's
  LM head), embed_tokens (else the target's) and the decoder layer's own weights;
- MiMo: `model.mtp_layers.0.*` with token_layernorm, hidden_layernorm, input_proj (input
  [feature ; embedding]), final_layernorm and the decoder layer's; the target's LM head.

The proposer is EAGLE's (proposers/eagle.py): the head's cache slot j holds the pair (feature
of token j, token j + 1), on the engine's blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .batch import ForwardBatch, ForwardOutput
from .checkpoint import MTP_PREFIX, CheckpointError, check_state, hf_to_fused, is_mtp_weight, read_config, read_state_dict
from .config import ModelConfig, text_config
from .kv import KVCache
from .llama import Embedding, Linear, RMSNorm, Transformer
from .mla import deinterleave_rope, rope_interleaved
from .heads import place_head, whole_lm_head


def num_mtp_layers(raw: dict) -> int:
    """config.json's count of MTP layers (0: none)."""
    return int(text_config(raw).get("num_nextn_predict_layers") or 0)


class MTPHead(nn.Module):
    """The proposer's interface is EagleHead's: forward(feats, token_embeds, kv, batch) -> logits
    over `draft_vocab` (here the whole vocabulary) and the states the next step starts from."""

    feature_layers: tuple[int, ...] = ()      # it reads the target's final-norm features

    def __init__(self, layer_cfg: ModelConfig, embeds_first: bool, embedding_rows: int = 0, norm_output: bool = False):
        super().__init__()
        self.norm_output = norm_output        # the speculators library's: the normed output is the next state
        D, eps = layer_cfg.hidden_size, layer_cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.eh_proj = Linear(2 * D, D, bias=False)
        self.eh_proj.row_invariant = True   # over prompt features of requests batched together
        self.embeds_first = embeds_first      # DeepSeek / GLM: [embedding ; feature]; MiMo: [feature ; embedding]
        # the decoder: the layer (the target's architecture), the final norm, the LM head, RoPE;
        # its cache is the head's own (one layer) on the engine's blocks
        self.decoder = Transformer(layer_cfg)
        self.decoder.model.embed_tokens.weight = nn.Parameter(torch.empty(0, D))
        self.embed_tokens = Embedding(embedding_rows, D) if embedding_rows else None
        self.register_buffer("draft_vocab", torch.arange(layer_cfg.vocab_size))

    @property
    def decoder_config(self) -> ModelConfig:
        return self.decoder.config

    def forward(self, feats: Tensor, token_embeds: Tensor, kv: KVCache | None = None,
                batch: ForwardBatch | None = None) -> ForwardOutput:
        """feats: the target's features of tokens t or the head's own states; token_embeds: the
        embeddings of tokens t + 1; [B, T, D] without a cache (positions 0..T-1), [N, D] flat
        with one. Returns the logits for tokens t + 2 (the rows batch.logits_indices asks for)
        and the layer's outputs before the final norm."""
        d = self.decoder
        if kv is None:
            positions = torch.arange(token_embeds.shape[-2], device=d.device)
        else:
            positions = batch.positions.to(d.device)
        e = self.enorm(token_embeds.to(d.dtype)).masked_fill((positions == 0)[..., None], 0.0)
        h = self.hnorm(feats.to(d.dtype))
        x = self.eh_proj(torch.cat([e, h] if self.embeds_first else [h, e], -1))
        return d(None, kv, batch, embeds=x, hidden=True if self.norm_output else (1,))

    def use_fp32_activations(self) -> "MTPHead":
        self.decoder.use_fp32_activations()
        for norm in (self.enorm, self.hnorm):
            norm.weight.data = norm.weight.data.float()
        return self


def _layer_config(raw: dict, index: int) -> ModelConfig:
    """The config of the target's architecture for one decoder layer that sits at `index` (an
    MTP layer after the last: a mixture of experts where the target's deep layers are)."""
    raw = {**raw, "num_hidden_layers": index + 1, "layer_types": None}
    types = raw.get("mlp_layer_types")
    if types and len(types) < index + 1:      # GLM-4.7-Flash lists its layers' kinds: an MTP layer is the last one's
        raw["mlp_layer_types"] = list(types) + [types[-1]] * (index + 1 - len(types))
    cfg = ModelConfig.from_hf(raw)
    return cfg.replace(num_hidden_layers=1, tie_word_embeddings=False, nope_layers=(), sliding_window=None,
                       sliding_layers=(), local_rope_theta=None,
                       moe_layers=(0,) if index in cfg.moe_layers else ())


def load_mtp(folder: str | Path, target: Transformer) -> MTPHead:
    """The first MTP layer of the Hugging Face folder or GGUF file `folder` (the target's own,
    usually) as a drafter for `target`: weights in the target's dtype, on its device."""
    from .gguf import GGUFError, find_gguf, load_mtp_gguf

    folder = Path(folder)
    try:
        gguf_path = find_gguf(folder)
        if gguf_path is not None:           # llama.cpp's nextn blocks (GLM-4.5's files)
            return load_mtp_gguf(gguf_path, target)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: neither a Hugging Face folder (config.json) nor a GGUF file")
    raw = text_config(read_config(folder))
    if raw.get("speculators_model_type") == "mtp":
        return _load_speculators_mtp(folder, raw, target)
    if num_mtp_layers(raw) < 1:
        raise CheckpointError(f"{folder}: the checkpoint has no MTP layers (config.json's "
                              f"num_nextn_predict_layers is {raw.get('num_nextn_predict_layers')!r})")
    tcfg = target.config
    L = int(raw["num_hidden_layers"])
    try:
        cfg = _layer_config(raw, L)
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise CheckpointError(f"{folder}: MTP layers of hidden size {cfg.hidden_size} over {cfg.vocab_size} tokens, "
                              f"the target has {tcfg.hidden_size} over {tcfg.vocab_size}")
    sd = read_state_dict(folder, lambda k: is_mtp_weight(k, L))      # the target's own tensors stay unread
    mimo = any(k.startswith(MTP_PREFIX) for k in sd)
    if mimo:
        names = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
                 "final_layernorm": "decoder.model.norm"}
        prefix = MTP_PREFIX + "0."
    else:
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "decoder.model.norm",
                 "shared_head.head": "decoder.lm_head", "embed_tokens": "embed_tokens"}
        prefix = f"model.layers.{L}."
    own, layer = {}, {}
    for name, t in sd.items():
        if not name.startswith(prefix):
            continue        # further MTP layers: vLLM's chains reuse the first one too
        rest = name[len(prefix):]
        module = next((m for m in names if rest.startswith(m + ".")), None)
        if module is not None:
            own[names[module] + rest[len(module):]] = t
        else:
            layer["model.layers.0." + rest] = t
    if not own and not layer:
        raise CheckpointError(f"{folder}: config.json names MTP layers but the checkpoint holds no MTP weights "
                              f"({MTP_PREFIX}0.* or model.layers.{L}.*)")
    embeds = own.pop("embed_tokens.weight", None)
    if embeds is not None and embeds.shape == target.model.embed_tokens.weight.shape and \
            torch.equal(embeds.to(target.model.embed_tokens.weight.dtype), target.model.embed_tokens.weight.cpu()):
        embeds = None                                        # the target's own (DeepSeek-V3's): shared
    # MiMo's layer hands on its final norm's output (vLLM's mimo_mtp returns final_layernorm(h), and
    # its proposer chains that); DeepSeek / GLM layers hand on the state before shared_head.norm
    head = MTPHead(cfg, embeds_first=not mimo, embedding_rows=embeds.shape[0] if embeds is not None else 0,
                   norm_output=mimo)
    if cfg.kv_lora_rank and rope_interleaved(raw):      # DeepSeek's latent attention (model/mla.py)
        layer = deinterleave_rope(layer, cfg)
    state = {**own, **{"decoder." + k: v for k, v in hf_to_fused(layer, cfg).items()}}
    if embeds is not None:
        state["embed_tokens.weight"] = embeds
    # MiMo's layer (and a DeepSeek layout without shared_head.head) uses the target's LM head:
    # shared where the target holds it whole, read from the checkpoint where it is split
    # over tensor-parallel ranks (the head drafts on rank 0 alone)
    shared_head = "decoder.lm_head.weight" not in state and isinstance(target.lm_head, Linear)
    if "decoder.lm_head.weight" not in state and not shared_head:
        heads = read_state_dict(folder, lambda k: k in ("lm_head.weight", "model.embed_tokens.weight"))
        state["decoder.lm_head.weight"] = heads.get("lm_head.weight", heads.get("model.embed_tokens.weight"))
    expected = {k: v.shape for k, v in head.state_dict().items()
                if not k.endswith("model.embed_tokens.weight") and k != "draft_vocab"
                and not (shared_head and k == "decoder.lm_head.weight")}
    check_state(folder, "MTP weights", state, expected)
    head.load_state_dict(state, strict=False)
    return place_head(head, target, target.lm_head if shared_head else None)


def is_speculators_mtp(folder) -> bool:
    """A standalone MTP drafter saved by the speculators library (`speculators_model_type` "mtp")."""
    try:
        return read_config(folder).get("speculators_model_type") == "mtp"
    except CheckpointError:
        return False


def _load_speculators_mtp(folder: Path, raw: dict, target: Transformer) -> MTPHead:
    """The speculators library's MTP drafter (`MTPDraftModel`): its layer's config under
    transformer_layer_config (the verifier's), weights `mtp_layers.0.*` named as MiMo's
    (token_layernorm, hidden_layernorm, input_proj, final_layernorm) but with the embedding first
    in input_proj's input, the verifier's embeddings and LM head, and the normed output handed
    to the next step, as its training chains it."""
    layer_raw = {**(raw.get("transformer_layer_config") or {}), "num_nextn_predict_layers": 1}
    tcfg = target.config
    try:
        if int(raw.get("num_nextn_predict_layers", 1)) != 1:
            raise ValueError(f"{raw['num_nextn_predict_layers']} MTP layers (the speculators format holds one)")
        cfg = _layer_config(layer_raw, int(layer_raw["num_hidden_layers"]))
    except (KeyError, ValueError) as e:
        what = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{folder}: speculators MTP drafter {what}") from None
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise CheckpointError(f"{folder}: an MTP layer of hidden size {cfg.hidden_size} over {cfg.vocab_size} tokens, "
                              f"the target has {tcfg.hidden_size} over {tcfg.vocab_size}")
    sd = read_state_dict(folder)
    names = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
             "final_layernorm": "decoder.model.norm"}
    own, layer = {}, {}
    for name, t in sd.items():
        if name.startswith(("embed_tokens.", "lm_head.", "verifier_lm_head.", "d2t", "t2d")):
            continue                       # the verifier's, shared (the library never saves them)
        if not name.startswith("mtp_layers.0."):
            raise CheckpointError(f"{folder}: unexpected weight in the MTP drafter: {name}")
        rest = name[len("mtp_layers.0."):]
        module = next((m for m in names if rest.startswith(m + ".")), None)
        if module is not None:
            own[names[module] + rest[len(module):]] = t
        else:
            layer["model.layers.0." + rest] = t
    head = MTPHead(cfg, embeds_first=True, norm_output=True)
    state = {**own, **{"decoder." + k: v for k, v in hf_to_fused(layer, cfg).items()}}
    lm_head = whole_lm_head(target, folder, "the speculators MTP drafter")
    expected = {k: v.shape for k, v in head.state_dict().items()
                if not k.endswith("model.embed_tokens.weight") and k not in ("draft_vocab", "decoder.lm_head.weight")}
    check_state(folder, "MTP weights", state, expected)
    head.load_state_dict(state, strict=False)
    return place_head(head, target, lm_head)
