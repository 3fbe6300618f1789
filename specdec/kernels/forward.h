/* The model, batch and cache descriptions forward.c and attention.c share (Python mirrors them:
 * kernels/cforward.py). */
#ifndef SPECDEC_FORWARD_H
#define SPECDEC_FORWARD_H
#include <stdint.h>

#include "kernels.h"

/* How the paged KV cache stores keys and values (Model.kv_type):
 * KV_F32, KV_BF16: rows of hd values; KV_I8: rows of hd int8 values q and, per row (slot, kv
 * head), one fp32 scale d in k_scale / v_scale: the value is q * d (model/kv.py: quantize_rows). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_OAI = 2 };

/* A LoRA adapter's product beside one of a layer's matrices (specdec/lora: LoRAStack), for the
 * tokens whose sequence has an adapter slot s >= 0 (Batch.lora): out += B (A x). The matrix's
 * outputs are nseg segments of widths seg[j] (qkv: q, k, v; gate_up: gate, up; else one), each
 * with its own A [R, K] and B [seg[j], R] (R: Model.lora_rank, the most any slot holds). Per slot,
 * a holds [nseg, R, K]; bt holds the segments' B^T one after another ([R, seg[j]] each, R * N in
 * all), scaled by the adapter's alpha / r. Slot s's rank for matrix kind c (LORA_QKV ..) is
 * Model.lora_ranks[4 s + c]: its rows beyond are zero and skipped. a == NULL: no adapter here. */
enum { LORA_QKV = 0, LORA_O = 1, LORA_GATE_UP = 2, LORA_DOWN = 3 };
typedef struct {
    const void *a, *bt;                   /* fp32, or bf16 when bf16 is set */
    int nseg, seg[3], bf16;
} LoraMat;

typedef struct {
    const float *in_norm, *post_norm;     /* [D] fp32: before the attention and the MLP (NULL: none, OLMo 2) */
    Mat qkv, o, gate_up, down;            /* packed panels (kernels.h) */
    const float *qkv_bias;                /* [(H + 2 KV) * hd] or NULL */
    const float *q_norm, *k_norm;         /* [hd] fp32: Qwen3's per-head RMSNorm before RoPE (OLMo 2's over
                                           * the whole projections: qk_full), or NULL */
    void *k_cache, *v_cache;              /* [KV, num_blocks, block_size, hd] in kv_type's format */
    float *k_scale, *v_scale;             /* [KV, num_blocks, block_size] (KV_I8), else NULL */
    int use_rope;                         /* 0 in SmolLM3's NoPE layers */
    /* Gemma 2 / 3's sandwich norms: the attention's and the MLP's outputs normed before their
     * residual adds ([D] fp32), or NULL */
    const float *attn_out_norm, *ffn_out_norm;
    int window;                           /* sliding window: a token sees the `window` slots up to
                                           * its own position (0: every earlier slot) */
    int local_rope;                       /* RoPE from inv_freq_local (Gemma 3's sliding layers) */
    /* A mixture of experts in place of gate_up / down when n_experts > 0 (Mixtral, Qwen3-MoE,
     * OLMoE): router [E, D]; experts [2 E]: expert e's gate_up [2 F, D] then down [D, F], F =
     * moe_hidden; each token's top_k experts by router softmax, weights renormalised if norm_topk */
    int n_experts, top_k, norm_topk, moe_hidden;
    Mat router;
    const Mat *experts;
    /* a shared expert every token takes (gate_up / down hold it; 0: none), its output scaled by
     * sigmoid(shared_gate x) when shared_gate's w is set (Qwen2-MoE) */
    int shared_hidden;
    Mat shared_gate;
    /* DeepSeek-V3's / GLM-4.5's router (router_sigmoid): sigmoid scores, the choice biased by
     * score_bias [E] (fp32) within the topk_group of n_group groups whose two best biased scores
     * sum highest; weights the unbiased scores (renormalised if norm_topk) x scaling. Softmax
     * routers take the groups and the scaling too (DeepSeek-V2) */
    int router_sigmoid, n_group, topk_group;
    float scaling;
    const float *score_bias;
    int group_by_max;                     /* DeepSeek-V2's groups: ranked by their best score */
    /* gpt-oss: each head's sink logit [H] (joins the softmax's denominator; NULL: none), o's bias
     * [D], the router's bias [E], the experts' biases [E, 2 F + D] (expert e: gate/up's 2 F, then
     * down's D; NULL: none), and the experts' gate (ACT_SILU, or ACT_SWIGLU_OAI: Model's alpha
     * and limit) */
    const float *sinks, *o_bias, *router_bias, *expert_bias;
    int moe_act;
    /* Multi-head latent attention (Model.mla_latent > 0: DeepSeek-V2 / V3, GLM-4.7-Flash; model/mla.py).
     * qkv holds q_proj, or q_b_proj with q_a [q_lora, D] (q_a.w set) and its norm q_a_norm [q_lora]
     * before it; kv_a [latent + rope, D] gives the latent, normed by kv_a_norm [latent], and the
     * shared rotary key. uk: each head's W_UK transposed [latent, nope], uv: its W_UV [v, latent],
     * dense panels (kernels.pack) of mla_bf16 weights, head after head, each head's panels padded
     * to a multiple of 16 rows. The cache row (head_dim = latent + rope, one kv head) is the key
     * and, in its first latent dims, the value. */
    Mat q_a, kv_a;
    const float *q_a_norm, *kv_a_norm;
    const void *uk, *uv;
    int mla_bf16;
    /* EAGLE-3's decoder layer (e_norm set): its attention reads [e_norm(e) ; in_norm(h)] (2 D wide:
     * qkv is [.., 2 D]) for the token embedding e and the state h a forward's input rows carry
     * side by side (Model.two_inputs), and its residual is h, or in_norm(h) with
     * norm_before_residual */
    const float *e_norm;
    int norm_before_residual;
    LoraMat lora[4];                      /* by LORA_QKV .. LORA_DOWN; a == NULL: none */
} Layer;

typedef struct {
    int dim, hidden, n_heads, n_kv, head_dim, vocab, n_layers, num_blocks, block_size, max_blocks, kv_type;
    float eps;
    float rope_attn;                      /* cos and sin are scaled by it (YaRN; 1 otherwise) */
    /* Granite's multipliers (1 otherwise): embeddings x embed_scale, each block's output x
     * residual_scale before its add, scores x attn_scale (0: 1 / sqrt(hd)), logits / logit_scale */
    float embed_scale, residual_scale, attn_scale, logit_scale;
    /* Gemma 2's tanh soft-caps (0: none): scores -> cap tanh(scores / cap), logits the same */
    float attn_softcap, final_softcap;
    int act;                              /* the MLP's gate: ACT_SILU (SwiGLU) or ACT_GELU_TANH (GeGLU) */
    Mat embed;                            /* [V, D] rows as stored (not panels): fp32, bf16 or GGUF blocks */
    const float *final_norm;              /* [D], or NULL: none (the LM head reads the last layer's output) */
    Mat lm_head;                          /* [V, D] packed panels */
    const float *inv_freq;                /* [rot_dim / 2] */
    const float *inv_freq_local;          /* [hd / 2] for layers with local_rope, or NULL */
    const Layer *layers;
    const int32_t *block_table;           /* [max_seqs, max_blocks] block ids */
    int qk_full;                          /* OLMo 2: q_norm / k_norm over the whole [H hd] / [KV hd] */
    int rot_dim;                          /* RoPE over each head's first rot_dim dims (Phi-4-mini; = head_dim) */
    /* ACT_SWIGLU_OAI (gpt-oss): (clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g'), g' = min(g, limit) */
    float swiglu_alpha, swiglu_limit;
    /* latent attention's sizes (mla_latent 0: none; then head_dim = mla_latent + mla_rope, n_kv = 1,
     * rot_dim = mla_rope) and its low-rank norms' epsilon */
    int mla_latent, mla_nope, mla_rope, mla_v, q_lora;
    float mla_eps;
    int two_inputs;                       /* EAGLE-3's head: input rows [h ; e] (2 D) instead of D wide */
    int lora_rank;                        /* LoraMat's R (0: no adapters) */
    const int32_t *lora_ranks;            /* [slots, 4] each slot's rank per matrix kind */
} Model;

/* Sequence b feeds tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 into its slots start[b] ..;
 * slots before mask_from[b] are visible to all of them; from mask_from[b] on, causal when
 * mask_offset[b] < 0, else the tree mask masks[mask_offset[b] + t * cols + (s - mask_from[b])]
 * with cols = start[b] + T_b - mask_from[b] (model/batch.py: ForwardBatch). A layer with a
 * sliding window also hides the slots before mask_from[b] that lie `window` or more positions
 * before the token's own (a slot there holds the token of that position). */
typedef struct {
    int n_seqs;
    const int32_t *cu_seqlens, *start, *rows, *mask_from;
    const int64_t *mask_offset;
    const uint8_t *masks;
    const int64_t *pos;                   /* [N] each token's position (a sliding window counts from it) */
    const int32_t *lora;                  /* [n_seqs] each sequence's LoRA slot (-1: none), or NULL */
} Batch;

/* How a drafter's chain step (forward.c: eagle_chain) turns the state h [D] it carries and the
 * embedding e [D] of the token it just drafted into its layers' input:
 * - EAGLE: fc([h ; e]) + fc_b (fc_w: dense panels [D, 2 D], fc_bf16 their dtype; fc_b may be
 *   NULL), or fc([e ; h]) with embeds_first (the EAGLE authors' heads);
 * - EAGLE-3 (fc_w NULL; the head's Model.two_inputs): [h ; e] itself;
 * - an MTP layer: fc([e_norm(e) ; h_norm(h)]), or [h_norm(h) ; e_norm(e)] unless embeds_first,
 *   e_norm(e) zeroed at position 0 (vLLM's rule), no bias.
 * state_before_norm: the state carried on is the layers' output before the final norm (EAGLE-3,
 * MTP), else after it (EAGLE). */
typedef struct {
    const void *fc_w;
    int fc_bf16;
    const float *fc_b, *e_norm, *h_norm;
    int embeds_first, state_before_norm;
    Mat fc_q;                             /* fc as quantized panels (a GGUF file's eh_proj) when fc_w is NULL */
} Fuse;

typedef struct { int seq, t; } TokenOf;   /* a flat token's sequence and index within it */

/* Where kv head g of slot s of the sequence in block-table row `row` lives: the index of its
 * first element in a layer's k_cache / v_cache (divided by head_dim: of its scale). */
static inline long slot_at(const Model *m, int row, long s, int g) {
    int32_t blk = m->block_table[(long)row * m->max_blocks + s / m->block_size];
    return (((long)g * m->num_blocks + blk) * m->block_size + s % m->block_size) * m->head_dim;
}

/* forward.c */
int tokens_of(const Batch *b, TokenOf *who);

/* attention.c */
void kv_store(const Model *m, const Layer *L, long at, const float *k, const float *v);
long attn_scratch(int max_span);
void attention_for(const Model *m, const Layer *L, const Batch *b, const float *q, float *out, float *scratch,
                   int max_span);

#endif
