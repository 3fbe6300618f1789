"""The architecture hyper-parameters of a Llama-family checkpoint, read from config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",        # Phi-3 / Phi-3.5 dense (fused qkv and gate_up in its checkpoints)
    "SmolLM3ForCausalLM": "smollm3",  # llama with no RoPE in every 4th layer (no_rope_layers)
    "GraniteForCausalLM": "granite",  # llama with multipliers: embeddings, residuals, attention, logits
    "GemmaForCausalLM": "gemma",      # GeGLU, embeddings x sqrt(hidden), norms (1 + w)
    "Gemma2ForCausalLM": "gemma2",    # + sandwich norms, soft-capping, sliding window every other layer
    "Gemma3ForCausalLM": "gemma3_text",  # + q/k norms, sliding window 5 layers in 6 with their own RoPE base
    "Olmo2ForCausalLM": "olmo2",      # norms after attention and MLP only; q/k normed over whole projections
    "Olmo3ForCausalLM": "olmo3",      # + a sliding window in 3 layers of 4
    # mixtures of experts: a router picks num_experts_per_tok SwiGLU experts per token
    "MixtralForCausalLM": "mixtral",  # mistral with experts in every layer (weights renormalised)
    "Qwen3MoeForCausalLM": "qwen3_moe",  # qwen3 with experts in the layers decoder_sparse_step / mlp_only_layers say
    "OlmoeForCausalLM": "olmoe",      # llama with q/k normed over whole projections and experts in every layer
    "GraniteMoeForCausalLM": "granitemoe",  # granite with experts in every layer (stacked in its checkpoints)
    "GraniteMoeSharedForCausalLM": "granitemoeshared",  # + a shared expert every token takes
    "Qwen2MoeForCausalLM": "qwen2_moe",  # qwen2 with experts and a shared expert behind a sigmoid gate
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5 / 4.6: partial RoPE, sigmoid group routing (DeepSeek-V3's), shared experts
    # multi-head latent attention (MLA) and DeepSeekMoE: V2 / V2-Lite (softmax routing), V3 / R1,
    # Kimi K2, Moonlight (sigmoid group routing)
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",  # GLM-4.7-Flash: DeepSeek-V3's layers, dense ones where mlp_layer_types says
    # gpt-oss-20b / 120b: attention sinks, biases on every projection, router and expert, a clamped
    # SwiGLU, a 128-token window in every other layer, YaRN; MXFP4 experts in its checkpoints
    "GptOssForCausalLM": "gpt_oss",
}
# families that are another one under a different name: MiMo is Qwen2 with MTP layers (model/mtp.py)
MODEL_TYPE_ALIASES = {"mimo": "qwen2"}
ARCHITECTURE_ALIASES = {"MiMoForCausalLM": "qwen2"}
# multimodal checkpoints whose language model runs alone (text in, text out): the model_type their
# text_config has when it names none
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3_text", "Mistral3ForConditionalGeneration": "mistral",
                      "LlavaForConditionalGeneration": "llama", "Qwen2VLForConditionalGeneration": "qwen2",
                      "Qwen2_5_VLForConditionalGeneration": "qwen2", "Qwen3VLForConditionalGeneration": "qwen3"}
# the text models of the Qwen VL families are Qwen2 / Qwen3: their multimodal RoPE turns every
# section by the same position for text alone, which is plain RoPE
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
                    "qwen3_vl_text": "qwen3", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
FUSED_CHECKPOINTS = ("phi3",)         # families whose checkpoints store qkv_proj and gate_up_proj fused
GEMMA = ("gemma", "gemma2", "gemma3_text")   # checkpoints store RMSNorm weights w for (1 + w)
OLMO = ("olmo2", "olmo3")
MOE = ("mixtral", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "qwen2_moe", "glm4_moe", "deepseek_v2",
       "deepseek_v3", "glm4_moe_lite", "gpt_oss")
DEEPSEEK = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
GRANITE = ("granite", "granitemoe", "granitemoeshared")
# attention_bias as transformers reads it: these families put it on q, k, v and o_proj (the
# o_proj bias is taken where the checkpoint holds it: checkpoint.load_model); these never read it
O_BIASED = ("llama", "smollm3", "granite", "olmoe", "granitemoe", "granitemoeshared")
NO_ATTENTION_BIAS = ("mistral", "mixtral", "phi3")
QWEN_WINDOWED = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")     # a window only when use_sliding_window

# What transformers' config class of each family gives a field config.json leaves out, where it is
# not the default from_hf falls back to (rms_norm_eps 1e-5, RoPE base 10000, untied, ...): written
# from transformers 5's XConfig() defaults (transformers is no runtime dependency). "rope_theta" is
# the class's default_theta, taken when neither the top level nor rope_parameters names a base;
# gpt-oss's "rope_parameters" (YaRN) when the config has neither it nor rope_scaling.
_EPS6 = {"rms_norm_eps": 1e-6}
HF_DEFAULTS = {
    "llama": _EPS6, "mistral": {**_EPS6, "sliding_window": 4096}, "qwen2": _EPS6, "qwen3": _EPS6,
    "phi3": {"rms_norm_eps": 1e-5},
    "smollm3": {**_EPS6, "rope_theta": 2e6, "tie_word_embeddings": True},
    "granite": _EPS6, "granitemoe": _EPS6, "granitemoeshared": _EPS6,
    "gemma": _EPS6, "gemma2": _EPS6, "gemma3_text": _EPS6,
    "olmo2": {"rms_norm_eps": 1e-5}, "olmo3": {"rms_norm_eps": 1e-5, "rope_theta": 5e5},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen3_moe": _EPS6, "olmoe": {"rms_norm_eps": 1e-5},
    "qwen2_moe": {**_EPS6, "shared_expert_intermediate_size": 5632},
    "glm4_moe": {"rms_norm_eps": 1e-5, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "n_shared_experts": 1,
                 "n_group": 1, "topk_group": 1},
    "deepseek_v2": {**_EPS6, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "n_shared_experts": 2},
    "deepseek_v3": {**_EPS6, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "n_shared_experts": 1,
                    "n_group": 8, "topk_group": 4},
    "glm4_moe_lite": {"rms_norm_eps": 1e-5, "routed_scaling_factor": 1.8, "n_shared_experts": 1, "n_group": 1,
                      "topk_group": 1},
    "gpt_oss": {"rms_norm_eps": 1e-5, "rope_theta": 150000.0},
}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def with_hf_defaults(cfg: dict, model_type: str) -> dict:
    """cfg with transformers' defaults (HF_DEFAULTS) for the fields it leaves out."""
    defaults = dict(HF_DEFAULTS.get(model_type, {}))
    theta = defaults.pop("rope_theta", None)
    out = {**defaults, **cfg}
    if model_type == "gpt_oss" and not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        out["rope_parameters"] = dict(GPT_OSS_ROPE)
    flat = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if theta is not None and "rope_theta" not in cfg and "rope_theta" not in flat:
        out["rope_theta"] = theta
    return out


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int | None = None  # Phi-4-mini's partial rotary: RoPE on each head's first rotary_dim dims
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    long_rope: bool = False       # longrope (Phi-3 / Phi-4-mini): its long factors, not its short ones
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    qk_norm: bool = False         # Qwen3: an RMSNorm over each query and key head, before RoPE
    qk_norm_full: bool = False    # OLMo 2: that norm over the whole q and k projections instead
    pre_norms: bool = True        # False in OLMo 2: no norm before the attention and the MLP
    nope_layers: tuple[int, ...] = ()   # SmolLM3: the layers that apply no RoPE (NoPE)
    # Granite's multipliers: embeddings x embedding_multiplier, each block's output x
    # residual_multiplier before its residual add, attention scores x attention_multiplier (None:
    # 1 / sqrt(head_dim)), logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma: the MLP's gate ("silu": SwiGLU; "gelu_tanh": GeGLU); sandwich norms (Gemma 2 / 3:
    # the attention's and the MLP's outputs normed before their residual adds); tanh soft-caps
    # of the attention scores and the final logits (Gemma 2; 0: none); a sliding window in the
    # layers sliding_layers (a token sees itself and the sliding_window - 1 positions before
    # it), whose RoPE base is local_rope_theta, unscaled, when given (Gemma 3)
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    # mixtures of experts: in the layers moe_layers, a router (softmax over num_experts) picks
    # the num_experts_per_tok best experts, SwiGLU MLPs of moe_intermediate_size, whose outputs
    # are summed weighted by their probabilities (renormalised to 1 when norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # a shared expert of that intermediate size every token takes beside its routed ones (0: none),
    # its output scaled by sigmoid(shared_expert_gate(x)) when shared_expert_gate (Qwen2-MoE)
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    # DeepSeek-V3's router (GLM-4.5's too; "noaux_tc"): sigmoid scores, plus a per-expert bias
    # (e_score_correction_bias) for choosing only; the experts chosen within the topk_group of
    # n_group groups with the best sums of their two best biased scores; the chosen experts'
    # unbiased scores as weights (renormalised when norm_topk_prob), x routed_scaling_factor
    router_sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    group_by_max: bool = False    # DeepSeek-V2's group_limited_greedy: groups ranked by their best score
    # multi-head latent attention (DeepSeek-V2 / V3; kv_lora_rank 0: none). Keys and values come
    # from a latent of kv_lora_rank per token (kv_b_proj expands it per head into qk_nope_head_dim
    # key and v_head_dim value dims) and one shared key part of rotary_dim dims with RoPE; queries
    # from q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank > 0). The cache holds
    # [latent ; rotated key part] per token as one KV head: head_dim = kv_lora_rank + rotary_dim
    # (model/mla.py); the scores' scale is attention_multiplier
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss: a learned logit per query head that joins every softmax's denominator (an
    # "attention sink" no value stands behind); a bias on o_proj too (o_bias); biases on the
    # router and on every expert's gate/up and down (mlp_bias); hidden_act "swiglu_oai", its
    # clamped SwiGLU: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    attn_sinks: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        cfg = text_config(cfg)
        archs = cfg.get("architectures") or []
        model_type = MODEL_TYPE_ALIASES.get(cfg.get("model_type"), cfg.get("model_type"))
        alias = next((ARCHITECTURE_ALIASES[a] for a in archs if a in ARCHITECTURE_ALIASES), None)
        if model_type not in SUPPORTED_ARCHITECTURES.values() and alias is not None:
            model_type = alias
        if model_type not in SUPPORTED_ARCHITECTURES.values():
            if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
                raise ValueError(
                    f"unsupported architecture {archs or model_type!r}; "
                    f"supported: {', '.join([*SUPPORTED_ARCHITECTURES, *ARCHITECTURE_ALIASES, *TEXT_OF_MULTIMODAL])}"
                )
            model_type = SUPPORTED_ARCHITECTURES[next(a for a in archs if a in SUPPORTED_ARCHITECTURES)]
        cfg = with_hf_defaults(cfg, model_type)
        try:
            n_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            qwen = model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
            if model_type == "glm4_moe" and "partial_rotary_factor" not in {**cfg, **(cfg.get("rope_parameters") or {})}:
                cfg = {**cfg, "partial_rotary_factor": 0.5}     # transformers' default: RoPE over half of each head
            if model_type in ("qwen3", "qwen3_moe"):
                _check_qwen3(cfg)
            family = (_gemma(cfg, model_type) if model_type in GEMMA else _olmo(cfg, model_type) if model_type in OLMO
                      else _gpt_oss(cfg) if model_type == "gpt_oss" else _moe(cfg, model_type) if model_type in MOE else {})
            if family:     # Gemma 3 / OLMo 3 keep their global layers' RoPE under rope_parameters["full_attention"]
                glob = family.pop("global_rope")
                if glob is not None:
                    cfg = {**cfg, "rope_parameters": glob}
                    if "rope_theta" in glob:
                        cfg["rope_theta"] = glob["rope_theta"]
            if model_type not in GEMMA:
                _check_common(cfg, model_type)
            rope_scaling = _rope_scaling(cfg)
            mla = _mla(cfg, rope_scaling) if model_type in DEEPSEEK else {}
            fields = dict(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=n_heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
                head_dim=(head_dim := cfg.get("head_dim") or hidden // n_heads),
                rotary_dim=_rotary_dim(cfg, head_dim),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if qwen or model_type in GEMMA else 1e-5),
                rope_theta=_rope_theta(cfg),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in GEMMA)),
                # Qwen2 always has q/k/v biases; Qwen2-MoE as its qkv_bias says (it never reads attention_bias)
                attention_bias=(model_type == "qwen2" or bool(cfg.get("qkv_bias", True))) if model_type in ("qwen2", "qwen2_moe")
                else model_type not in NO_ATTENTION_BIAS and bool(cfg.get("attention_bias", model_type == "gpt_oss")),
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmoe", *OLMO)
                or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
                nope_layers=_nope_layers(cfg) if model_type == "smollm3"
                else _granite_nope_layers(cfg) if model_type in GRANITE else (),
                **(_granite(cfg) if model_type in GRANITE else {}),
                **{**_sliding(cfg, model_type, rope_scaling), **family},
                model_type=model_type,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
            )
            return cls(**{**fields, **mla})
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """config.json for LlamaForCausalLM (or the family the checkpoint came from)."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias and self.model_type in (*O_BIASED, "gpt_oss"),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": None,
            "torch_dtype": "bfloat16",
        }
        if self.rotary_dim and not self.kv_lora_rank:      # MLA's rotary dims are qk_rope_head_dim
            out["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.model_type == "smollm3" or (self.model_type in GRANITE and self.nope_layers):
            # Granite: only a GGUF's rope.scaling.finetuned false gives it (no transformers field; kept
            # so that --hf-overrides and a saved folder keep it for specdec)
            out["no_rope_layers"] = [int(i not in self.nope_layers) for i in range(self.num_hidden_layers)]
        if self.model_type in GRANITE:
            out.update(embedding_multiplier=self.embedding_multiplier, residual_multiplier=self.residual_multiplier,
                       attention_multiplier=self.attention_multiplier, logits_scaling=self.logits_scaling)
        if self.model_type == "olmo3":
            out.update(sliding_window=self.sliding_window, layer_types=self._layer_types())
        elif self.sliding_window and self.model_type not in GEMMA:      # Mistral, Phi-3, Qwen2 / Qwen3
            out["sliding_window"] = self.sliding_window
            if self.model_type in QWEN_WINDOWED:
                out.update(use_sliding_window=True, max_window_layers=min(self.sliding_layers, default=0),
                           layer_types=self._layer_types())
        if self.model_type in MOE:
            out.update(num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
                       **{"num_local_experts" if self.model_type in ("mixtral", *GRANITE) else "num_experts":
                          self.num_experts})
            if self.model_type == "qwen2_moe":      # its q/k/v biases are qkv_bias (default true), not attention_bias
                out.update(shared_expert_intermediate_size=self.shared_expert_size, qkv_bias=self.attention_bias)
            if self.model_type == "granitemoeshared":
                out["shared_intermediate_size"] = self.shared_expert_size
            if self.model_type in ("qwen3_moe", "qwen2_moe"):
                out.update(moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1,
                           mlp_only_layers=[i for i in range(self.num_hidden_layers) if i not in self.moe_layers])
            elif self.model_type in DEEPSEEK:
                out.update(moe_intermediate_size=self.moe_intermediate_size, n_routed_experts=self.num_experts,
                           n_shared_experts=self.shared_expert_size // self.moe_intermediate_size,
                           first_k_dense_replace=min(self.moe_layers, default=self.num_hidden_layers),
                           n_group=self.n_group, topk_group=self.topk_group, moe_layer_freq=1,
                           routed_scaling_factor=self.routed_scaling_factor,
                           topk_method="noaux_tc" if self.router_sigmoid else
                           "group_limited_greedy" if self.group_by_max else "greedy",
                           q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                           qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.rotary_dim,
                           v_head_dim=self.v_head_dim, head_dim=self.rotary_dim, rope_interleave=True,
                           num_key_value_heads=self.num_attention_heads, num_nextn_predict_layers=0,
                           attention_bias=False)
                if self.model_type == "glm4_moe_lite":
                    out["mlp_layer_types"] = ["sparse" if i in self.moe_layers else "dense"
                                              for i in range(self.num_hidden_layers)]
            elif self.model_type == "glm4_moe":
                out.update(moe_intermediate_size=self.moe_intermediate_size, n_routed_experts=self.num_experts,
                           n_shared_experts=self.shared_expert_size // self.moe_intermediate_size,
                           first_k_dense_replace=min(self.moe_layers, default=self.num_hidden_layers),
                           n_group=self.n_group, topk_group=self.topk_group,
                           routed_scaling_factor=self.routed_scaling_factor, use_qk_norm=self.qk_norm,
                           attention_bias=self.attention_bias, num_nextn_predict_layers=0)
            else:
                out["intermediate_size"] = self.moe_intermediate_size
        if self.model_type == "gpt_oss":
            out.update(num_local_experts=self.num_experts, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
                       sliding_window=self.sliding_window, layer_types=self._layer_types())
            out.pop("num_experts", None)
            if self.rope_scaling is None:       # plain RoPE said outright: a config without any is YaRN's
                out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.model_type in GEMMA:
            out.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
            if self.model_type != "gemma":
                out.update(query_pre_attn_scalar=_pre_attn_scalar(self), attn_logit_softcapping=self.attn_softcap or None,
                           final_logit_softcapping=self.final_softcap or None, sliding_window=self.sliding_window,
                           layer_types=self._layer_types())
            if self.model_type == "gemma3_text":
                out["rope_local_base_freq"] = self.local_rope_theta
        return out

    def _layer_types(self) -> list[str]:
        """transformers' layer_types: which layers slide."""
        return ["sliding_attention" if i in self.sliding_layers else "full_attention" for i in range(self.num_hidden_layers)]

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def configured(self, hf_overrides: dict | None = None, disable_sliding_window: bool = False,
                   max_model_len: int | None = None) -> "ModelConfig":
        """This config with vLLM's --hf-overrides applied to its config.json form (a GGUF's, whose
        config comes from metadata), --disable-sliding-window (no window, the context capped at
        the shortest one: full attention equals windowed attention that far) and longrope's
        factor set for --max-model-len, chosen once as vLLM chooses it: the short factors and
        the context capped at original_max_position_embeddings unless max_model_len asks for
        more, then the long factors for every position of every sequence (transformers switches
        a sequence to the long ones once it outgrows the original context, over keys cached
        with the short ones: a cache cannot follow that)."""
        cfg = self
        if hf_overrides:
            cfg = ModelConfig.from_hf(apply_hf_overrides(cfg.to_hf(), hf_overrides))
        if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):    # a GGUF's rope.freq_base 0 loaded
            raise ValueError(f"rope_theta (a GGUF's rope.freq_base) must be a positive number, got {cfg.rope_theta}")
        if disable_sliding_window and cfg.sliding_window:
            cfg = cfg.replace(max_position_embeddings=min(cfg.max_position_embeddings, cfg.sliding_window),
                              sliding_window=None, sliding_layers=())
        s = cfg.rope_scaling
        if s is not None and s["rope_type"] in ("yarn", "linear") and s.get("factor") and cfg.model_type != "gemma3_text":
            # vLLM's derived max model len: the original length times the factor (a config.json
            # with Qwen's YaRN recipe serves 4 x 32768 tokens); yarn's original length is pinned
            # in the scaling (by _rope_scaling), so this is said once whatever the route. Not
            # Gemma 3's (as vLLM): its 131072 positions are the scaled length already
            old = s["original_max_position_embeddings"] if s["rope_type"] == "yarn" else cfg.max_position_embeddings
            cfg = cfg.replace(max_position_embeddings=int(old * float(s["factor"])))
        elif s is not None and s["rope_type"] == "dynamic":
            cfg = cfg._static_ntk(max_model_len)
        elif s is not None and s["rope_type"] == "longrope" and not cfg.long_rope:
            old = s["original_max_position_embeddings"]
            if max_model_len is not None and max_model_len > old:
                cfg = cfg.replace(long_rope=True)
            else:
                cfg = cfg.replace(max_position_embeddings=min(cfg.max_position_embeddings, old))
        return cfg

    def _static_ntk(self, max_model_len: int | None) -> "ModelConfig":
        """Dynamic NTK scaling fixed at start-up, as vLLM runs it: within max_position_embeddings
        plain RoPE (what transformers computes for a sequence that short); a max_model_len past
        it, up to max_position_embeddings x factor, moves the base where transformers moves it
        for a sequence of that whole length, base (factor^2 - factor + 1)^(d / (d - 2)), for
        every position (transformers re-bases a growing sequence over keys cached with the old
        base: a cache cannot follow that)."""
        old, factor = self.max_position_embeddings, float(self.rope_scaling["factor"])
        if max_model_len is None or max_model_len <= old:
            return self.replace(rope_scaling=None)
        dim = self.rotary_dim or self.head_dim
        theta = self.rope_theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        return self.replace(rope_scaling=None, rope_theta=theta, max_position_embeddings=int(old * factor))

    def num_parameters(self) -> int:
        d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                           self.num_key_value_heads, self.head_dim)
        attn = d * hd * (h + 2 * kv) + h * hd * d
        per_layer = attn + 2 * d + (2 * hd if self.qk_norm else 0)
        moe = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        mlps = (self.num_hidden_layers - len(self.moe_layers)) * 3 * d * f + len(self.moe_layers) * moe
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + mlps + emb + d


def apply_hf_overrides(raw: dict, overrides: dict) -> dict:
    """vLLM's --hf-overrides on a config.json: its top-level fields replaced (a dict value
    replaces the whole field). A yarn or linear scaling's longer context is derived where every
    config's is (ModelConfig.configured)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    out = {**raw, **overrides}
    key = "rope_scaling" if "rope_scaling" in overrides else "rope_parameters"   # transformers 5's name too
    if key == "rope_parameters" and key in overrides:
        out.pop("rope_scaling", None)     # the config's own scaling would be read first
    return out


def text_config(cfg: dict) -> dict:
    """The language model's config of a multimodal checkpoint (TEXT_OF_MULTIMODAL: its
    text_config, as the family its model_type names), else cfg itself. The top level's
    tie_word_embeddings wins, as transformers ties the multimodal model by it."""
    found = next((a for a in cfg.get("architectures") or [] if a in TEXT_OF_MULTIMODAL), None)
    if found is None:
        return cfg
    # transformers 5 nests text_config; older Qwen VL folders keep the text fields at the top level
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else \
        {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")}
    model_type = text.get("model_type") or TEXT_OF_MULTIMODAL[found]
    model_type = TEXT_MODEL_TYPES.get(model_type, model_type)
    arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type), None)
    if arch is None:
        raise ValueError(f"{found}'s language model {model_type!r} is not supported; "
                         f"supported: {', '.join([*SUPPORTED_ARCHITECTURES, *ARCHITECTURE_ALIASES, *TEXT_OF_MULTIMODAL])}")
    out = {**{k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}, **text}
    if "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return {**out, "architectures": [arch], "model_type": model_type}


def _gemma(cfg: dict, model_type: str) -> dict:
    """The ModelConfig fields of a Gemma, Gemma 2 or Gemma 3 (text) config.json, with transformers'
    defaults for what it leaves out, and its global layers' RoPE settings under "global_rope"."""
    one = model_type == "gemma"
    act = (cfg.get("hidden_act") if one else cfg.get("hidden_activation") or cfg.get("hidden_act")) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu" if one else "gelu_pytorch_tanh"):
        raise ValueError(f"{model_type} with hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention=true is not supported (causal only)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{model_type} with attention_bias=true is not supported (it puts a bias on o_proj too)")
    out = {"hidden_act": "gelu_tanh", "embedding_multiplier": float(cfg["hidden_size"] ** 0.5),
           "global_rope": cfg.get("rope_parameters")}
    if one:
        return out
    gemma2 = model_type == "gemma2"
    soft = lambda key, default: float(cfg.get(key, default) or 0.0)  # noqa: E731  (null: none)
    out.update(sandwich_norms=True, attention_multiplier=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
               # Gemma 3's attention never caps its scores in transformers (nor vLLM), whatever the field says
               attn_softcap=soft("attn_logit_softcapping", 50.0) if gemma2 else 0.0,
               final_softcap=soft("final_logit_softcapping", 30.0 if gemma2 else None))
    # transformers' defaults: every other layer (Gemma 2), 5 in 6 (Gemma 3)
    out.update(_window_layers(cfg, 2 if gemma2 else int(cfg.get("sliding_window_pattern", 6))))
    if not gemma2:
        params = cfg.get("rope_parameters") or {}
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"gemma3 sliding layers' rope_type {local['rope_type']!r} is not supported (default only)")
        out["local_rope_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
        glob = params.get("full_attention")
        if glob is None and "full_attention" not in params:
            glob = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        out["global_rope"] = glob
    return out


def _moe(cfg: dict, model_type: str) -> dict:
    """The experts of Mixtral, Qwen3-MoE and OLMoE (as _gemma: "global_rope" passes the RoPE on)."""
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")   # by family
    if not experts:
        raise KeyError("num_experts")
    out = {"num_experts": int(experts),
           "num_experts_per_tok": int(cfg["num_experts_per_tok"]), "global_rope": cfg.get("rope_parameters")}
    if model_type in ("glm4_moe", *DEEPSEEK):
        first = int(cfg.get("first_k_dense_replace", 1 if model_type == "glm4_moe" else 0))
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (1: experts in every layer "
                             "from first_k_dense_replace on)")
        out.update(moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   moe_layers=tuple(range(first, n)))
        if model_type == "glm4_moe_lite":       # its own list (transformers' default: the first layer dense)
            types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
            if len(types) != n:
                raise ValueError(f"mlp_layer_types has {len(types)} entries for {n} layers")
            out["moe_layers"] = tuple(i for i, t in enumerate(types) if t == "sparse")
        if model_type == "deepseek_v2":     # transformers' DeepSeek-V2 never renormalises
            out["norm_topk_prob"] = False
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        out.update(moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob")),
                   moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0))
    else:          # Mixtral and Granite renormalise; OLMoE as its config says. The experts have intermediate_size
        out.update(moe_intermediate_size=int(cfg["intermediate_size"]), moe_layers=tuple(range(n)),
                   norm_topk_prob=model_type in ("mixtral", "granitemoe", "granitemoeshared")
                   or bool(cfg.get("norm_topk_prob")))
    if model_type == "qwen2_moe":
        out.update(shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0), shared_expert_gate=True)
    if model_type in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):
        out.update(_noaux_router(cfg))
    if model_type == "deepseek_v2":
        out.update(_greedy_router(cfg))
    if model_type == "granitemoeshared":
        out["shared_expert_size"] = int(cfg.get("shared_intermediate_size") or 0)
    if model_type == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"olmoe with clip_qkv={cfg['clip_qkv']} is not supported")
        out["qk_norm_full"] = True
    if out["num_experts_per_tok"] > out["num_experts"] or out["num_experts"] <= 0:
        raise ValueError(f"num_experts_per_tok {out['num_experts_per_tok']} of {out['num_experts']} experts")
    return out


def _gpt_oss(cfg: dict) -> dict:
    """gpt-oss's fields (as _moe's, with "global_rope"): experts of intermediate_size in every
    layer, the top num_experts_per_tok by router logit weighted by the softmax over their logits
    (the whole softmax renormalised: the same weights); its 128-token window in the layers
    layer_types marks (transformers' default: every even layer), the same RoPE in all."""
    if not cfg.get("attention_bias", True):
        raise ValueError("gpt_oss with attention_bias=false is not supported")
    out = _moe(cfg, "gpt_oss")
    out.update(norm_topk_prob=True, attn_sinks=True, o_bias=True, mlp_bias=True, hidden_act="swiglu_oai",
               swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    out.update(_window_layers({**cfg, "sliding_window": cfg.get("sliding_window", 128)}, 2))
    return out


def _noaux_router(cfg: dict) -> dict:
    """DeepSeek-V3's / GLM-4.5's router settings and shared experts (transformers' defaults)."""
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"topk_method {method!r} is not supported (noaux_tc only)")
    experts, groups, top = int(cfg["n_routed_experts"]), int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % groups or not 1 <= top <= groups or (groups > 1 and experts // groups < 2):
        raise ValueError(f"{experts} experts in n_group={groups} groups (topk_group={top}): the groups must split the "
                         "experts evenly, at least two each, and topk_group be in [1, n_group]")
    if groups > 1 and top * (experts // groups) < int(cfg["num_experts_per_tok"]):
        raise ValueError(f"topk_group={top} groups of {experts // groups} experts hold fewer than num_experts_per_tok")
    return {"router_sigmoid": True, "n_group": groups, "topk_group": top,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_size": int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0)}


def _greedy_router(cfg: dict) -> dict:
    """DeepSeek-V2's router: softmax; "greedy" (V2-Lite) or "group_limited_greedy" (V2: the
    experts of the topk_group groups with the best single scores); x routed_scaling_factor."""
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 with topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts"))
    groups, top = (int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)) if method != "greedy" else (1, 1)
    if experts % groups or not 1 <= top <= groups or top * (experts // groups) < int(cfg["num_experts_per_tok"]):
        raise ValueError(f"{experts} experts in n_group={groups} groups (topk_group={top}) cannot hold "
                         "num_experts_per_tok")
    return {"n_group": groups, "topk_group": top, "group_by_max": groups > 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_size": int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0)}


def _mla(cfg: dict, rope_scaling: dict | None) -> dict:
    """DeepSeek-V2 / V3's attention fields (ModelConfig: multi-head latent attention)."""
    rope, nope, v = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    latent = int(cfg["kv_lora_rank"])
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        factor = float(rope_scaling["factor"])      # transformers' yarn_apply_mscale: the scores' temperature
        m = 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    if cfg.get("attention_bias"):
        raise ValueError("deepseek with attention_bias=true is not supported")
    return {"q_lora_rank": int(cfg.get("q_lora_rank") or 0), "kv_lora_rank": latent, "qk_nope_head_dim": nope,
            "v_head_dim": v, "head_dim": latent + rope, "rotary_dim": rope, "num_key_value_heads": 1,
            "attention_multiplier": scale, "attention_bias": False, "qk_norm": False}


def _olmo(cfg: dict, model_type: str) -> dict:
    """OLMo 2 / 3's ModelConfig fields (as _gemma: "global_rope" holds the global layers' RoPE):
    norms after the attention and the MLP only, q and k normed over their whole projections;
    OLMo 3's sliding window in the layers layer_types marks (default: 3 in 4), whose RoPE is
    unscaled at the same base."""
    if cfg.get("attention_bias"):
        raise ValueError(f"{model_type} with attention_bias=true is not supported (it puts a bias on o_proj too)")
    out = {"pre_norms": False, "sandwich_norms": True, "qk_norm_full": True, "global_rope": cfg.get("rope_parameters")}
    if model_type == "olmo2":
        return out
    out.update(_window_layers(cfg, 4))
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"olmo3 sliding layers' rope_type {local['rope_type']!r} is not supported (default only)")
        out["global_rope"] = glob
        local_theta = float(local.get("rope_theta", glob.get("rope_theta", 500000.0)))
        if glob.get("rope_type", "default") != "default" or local_theta != float(glob.get("rope_theta", 500000.0)):
            out["local_rope_theta"] = local_theta
    elif cfg.get("rope_scaling"):       # the old layout: the scaling is the global layers' only
        out["local_rope_theta"] = float(cfg.get("rope_theta", 500000.0))
    return out


def _pre_attn_scalar(cfg: "ModelConfig") -> float | int:
    """Gemma 2 / 3's query_pre_attn_scalar back from the attention's scale (its -2th power)."""
    m = cfg.attention_multiplier
    if m is None:
        return cfg.head_dim
    v = m ** -2
    return int(round(v)) if abs(v - round(v)) < 1e-3 else v


def _partial_rotary_factor(cfg: dict) -> float:
    """config.json's (Phi-4-mini), or transformers 5's rope_parameters'."""
    return float(cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                 or 1.0)


def _rotary_dim(cfg: dict, head_dim: int) -> int | None:
    """The rotated dims of a head when fewer than all (Phi-3's partial_rotary_factor; _check_common
    refuses it for the families whose transformers code rotates whole heads)."""
    dim = int(head_dim * _partial_rotary_factor(cfg))
    return dim if dim < head_dim else None


def _check_common(cfg: dict, model_type: str = "llama") -> None:
    """Settings of these families that the runtime does not compute: refused, never run wrong."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (no bias on the MLP's projections)")
    factor = _partial_rotary_factor(cfg)
    if factor != 1.0 and model_type not in ("phi3", "glm4_moe"):
        raise ValueError(f"partial_rotary_factor {factor} is not supported for {model_type} (rotary over whole heads "
                         f"only; Phi-3 / Phi-4-mini rotate part)")


def _window_layers(cfg: dict, every: int) -> dict:
    """Gemma 2 / 3's and OLMo 3's window (transformers' default 4096) in the layers layer_types
    marks, else in all but every `every`-th layer; {} when none slides."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    window = cfg.get("sliding_window", 4096)
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"sliding_window": int(window), "sliding_layers": layers} if window is not None and layers else {}


def _sliding(cfg: dict, model_type: str, rope_scaling: dict | None = None) -> dict:
    """The sliding window of Mistral and Phi-3 (every layer) and of the Qwen families when
    use_sliding_window is set, as transformers applies them: Qwen2 / Qwen3 in the layers
    layer_types marks, else those from max_window_layers on; Qwen2-MoE in the layers layer_types
    marks, else the even ones below max_window_layers; Qwen3-MoE in every layer (its attention
    reads neither layer_types nor max_window_layers). {} when there is none. (Gemma: _gemma.)"""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if not window or model_type not in ("mistral", "mixtral", "phi3", *QWEN_WINDOWED):
        return {}
    if model_type in QWEN_WINDOWED:
        if not cfg.get("use_sliding_window"):
            return {}                       # Qwen names a window it does not use unless asked
        below = cfg.get("max_window_layers", 28)
        if model_type == "qwen3_moe":
            types = ["sliding_attention"] * n
        elif model_type == "qwen2_moe":
            types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 and i < below else "full_attention"
                                               for i in range(n)]
        else:
            types = cfg.get("layer_types") or ["sliding_attention" if i >= below else "full_attention"
                                               for i in range(n)]
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        layers = tuple(range(n))
    if int(window) >= _longest_context(cfg, rope_scaling) or not layers:
        return {}                           # the window never hides a slot
    return {"sliding_window": int(window), "sliding_layers": layers}


def _longest_context(cfg: dict, rope_scaling: dict | None) -> int:
    """The longest context ModelConfig.configured may give this config (yarn and linear stretch
    max_position_embeddings, dynamic does for a long --max-model-len): a window as long as
    max_position_embeddings still hides slots there, and transformers applies it."""
    n = cfg.get("max_position_embeddings", 2048)
    kind = (rope_scaling or {}).get("rope_type")
    factor = float((rope_scaling or {}).get("factor") or 1.0)
    if kind == "yarn":
        return max(n, int(rope_scaling["original_max_position_embeddings"] * factor))
    return int(n * factor) if kind in ("linear", "dynamic") else n


def longrope_attention_factor(factor: float, original: int) -> float:
    """transformers' default for longrope (Phi-3): sqrt(1 + ln(factor) / ln(original context))."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _granite(cfg: dict) -> dict:
    """GraniteConfig's multipliers (its defaults: 1.0 each, the attention's included). An explicit
    null attention_multiplier is the usual 1 / sqrt(head_dim) (what a drafter's plain layer saves)."""
    out = {name: float(cfg.get(name, 1.0)) for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    m = cfg.get("attention_multiplier", 1.0)
    out["attention_multiplier"] = None if m is None else float(m)
    return out


def _nope_layers(cfg: dict) -> tuple[int, ...]:
    """SmolLM3's no_rope_layers (1: the layer applies RoPE), else its interval (every 4th layer)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        step = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % step != 0) for i in range(cfg["num_hidden_layers"])]
    if len(flags) != cfg["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {cfg['num_hidden_layers']} layers")
    if cfg.get("use_sliding_window"):
        raise ValueError("smollm3 with use_sliding_window=true is not supported (full attention only)")
    return tuple(i for i, f in enumerate(flags) if not f)


def _granite_nope_layers(cfg: dict) -> tuple[int, ...]:
    """The layers without RoPE that specdec's own config.json of a Granite GGUF names (its
    rope.scaling.finetuned false: see ModelConfig.to_hf); none in Granite's own configs."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return ()
    if len(flags) != cfg["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {cfg['num_hidden_layers']} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


def _check_qwen3(cfg: dict) -> None:
    """What Qwen3ForCausalLM can do that the runtime does not (no released dense Qwen3 does it)."""
    if cfg.get("attention_bias"):
        raise ValueError("qwen3 with attention_bias=true is not supported (it puts a bias on o_proj too)")


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default", "mrope"):      # mrope: Qwen VL's, plain RoPE for text (TEXT_MODEL_TYPES)
        return None
    kind = "longrope" if kind == "su" else kind             # Phi-3's first name for it
    if kind == "dynamic":                                   # fixed at start-up: ModelConfig._static_ntk
        if not float(scaling.get("factor") or 0) > 1:
            raise ValueError(f"dynamic rope scaling needs a factor > 1, got {scaling.get('factor')!r}")
        return {"rope_type": "dynamic", "factor": float(scaling["factor"])}
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = kind
    if kind == "yarn":      # transformers' default: the model's own context length
        out.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings")
                       or cfg.get("max_position_embeddings", 2048))
    if kind == "longrope":  # transformers' rules: a top-level original length first; the attention factor
        n = cfg.get("max_position_embeddings", 2048)
        old = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or n
        factor = scaling.get("factor") or n / old
        if out.get("attention_factor") is None:
            out["attention_factor"] = longrope_attention_factor(factor, old)
        out["original_max_position_embeddings"] = old
    return out


# Hugging Face's rope_type values the runtime computes (model/llama.py rope_inv_freq): llama3
# (Llama 3.1+), linear (positions divided by factor), yarn (Qwen2.5 / Qwen3 long context, ...),
# longrope (Phi-3 / Phi-3.5 128k, Phi-4-mini) with the factor set --max-model-len selects
# (ModelConfig.configured); and dynamic (NTK), fixed at start-up by --max-model-len as vLLM does
ROPE_TYPES = ("llama3", "linear", "yarn", "longrope", "dynamic")
