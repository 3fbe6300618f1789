/* The whole decoder forward over a flat batch of sequences on the CPU, in one call (llama2.c style).
 *
 * Decoding on a CPU spends as long in Python dispatching ~200 small ops per forward as in
 * reading the weights; a draft model that fits the cache spends most of its time there. This
 * file runs embedding -> layers -> norm -> LM head for N new tokens of several sequences with
 * fp32 activations and weights in any format kernels.h names (fp32, bf16, or GGUF blocks: each
 * matrix its own), writing keys and values into the same paged KV cache the PyTorch path uses
 * (model/kv.py: per layer [n_kv, num_blocks, block_size, hd], fp32, bf16 or int8 with a scale
 * per row: forward.h), with the same masks (causal, or a
 * token tree's ancestor mask, per sequence).
 *
 * Invariant (what lossless batching needs): a token's logits, features and cache entries are
 * bit-identical whatever else is in the batch and however its prompt was chunked. Matrix
 * products run over all N rows at once (the weights stream from memory once per forward) with
 * skinny.c's or qgemm.c's kernels, whose every output is computed in a fixed order whatever the
 * number of rows; norms, RoPE and the int8 quantization of activations are per row; attention
 * is per token over its own sequence's slots in slot order (invisible slots add exact zeros),
 * never across sequences. The thread count changes which thread computes a row or panel, never
 * how.
 *
 * One OpenMP parallel region covers the whole forward: each step is a worksharing loop over
 * rows, panels or (token, head) pairs, separated by the loops' barriers, so a forward costs one
 * fork and join instead of one per matrix product. Scratch comes from one caller-owned
 * workspace (llama_forward returns the size it needs when given too little).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "vmath.h"

/* (The attention and the cache writes live in attention.c.) */

static float widen(const void *w, int bf16, long i) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row `token` of an embedding table as stored (fp32, bf16, or GGUF blocks) -> D floats. */
static void embed_row(const Mat *e, int64_t token, float *out, int D) {
    if (e->fmt == F32 || e->fmt == BF16) {
        for (int i = 0; i < D; i++) out[i] = widen(e->w, e->fmt == BF16, token * D + i);
        return;
    }
    long row_bytes = e->fmt == Q4_K ? D / 256 * 144
                     : D / 32 * (e->fmt == Q8_0 ? 34 : e->fmt == Q4_0 ? 18 : e->fmt == MXFP4 ? 17 : 20);
    dequant_row(e->fmt, (const uint8_t *)e->w + token * row_bytes, out, D);
}

/* out [D] = x [D] RMS-normed, times w (out may be x). */
static void norm_row(float *out, const float *x, const float *w, int D, float eps) {
    double ss = 0.0;
    for (int i = 0; i < D; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / D) + eps);
    for (int i = 0; i < D; i++) out[i] = w[i] * (x[i] * r);
}

static void rms_norm_for(float *out, const float *x, const float *w, int T, int D, float eps) {
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) norm_row(out + (long)t * D, x + (long)t * D, w, D, eps);
}

/* out = the rows of x normed by w, or copied when w is NULL (OLMo 2: no norm before a block). */
static void norm_or_copy(float *out, const float *x, const float *w, int T, int D, float eps) {
    if (w) {
        rms_norm_for(out, x, w, T, D, eps);
        return;
    }
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) memcpy(out + (long)t * D, x + (long)t * D, sizeof(float) * D);
}

/* Each of n_heads vectors of hd in v, in place: rms_norm_for's operations on one head (Qwen3's
 * q_norm / k_norm, one weight w [hd] shared by the heads). */
static void head_norm(float *v, int n_heads, int hd, const float *w, float eps) {
    for (int h = 0; h < n_heads; h++) {
        float *x = v + (long)h * hd;
        double ss = 0.0;
        for (int i = 0; i < hd; i++) ss += (double)x[i] * x[i];
        float r = 1.0f / sqrtf((float)(ss / hd) + eps);
        for (int i = 0; i < hd; i++) x[i] = w[i] * (x[i] * r);
    }
}

/* out [M, N] = x [M, K] @ w^T (+ bias) by the team; qs: scratch for M quantized rows of K. */
static void linear_for(const Mat *w, const float *x, const float *bias, float *out, int M, int N, int K, void *qs) {
    if (w->fmt == F32 || w->fmt == BF16) {
        skinny_for(x, w->w, w->fmt == BF16, bias, out, M, N, K);
        return;
    }
    Act a = quant_act(qs, M, K);
    quantize_rows_for(x, M, &a);
    quant_panels_for(&a, w->w, w->fmt, bias, out, M, N);
}

/* cs [hd]: cos then sin of pos * inv_freq[i] for i < hd / 2, times scale (YaRN's attention
 * factor: 1 leaves them exact), once per token and forward. */
static void rope_angles(float *cs, int hd, const float *inv_freq, float scale, long pos) {
    for (int i = 0; i < hd / 2; i++) {
        float a = (float)pos * inv_freq[i];
        cs[i] = cosf(a) * scale;
        cs[hd / 2 + i] = sinf(a) * scale;
    }
}

/* Rotate the halves of each head's first rot dims (all hd but in a partial rotary; Hugging
 * Face's rotate_half) by the angles cs [rot]. */
static void rope(float *v, int n_heads, int hd, int rot, const float *cs) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float c = cs[i], s = cs[half + i];
        for (int h = 0; h < n_heads; h++) {
            float *x = v + (long)h * hd;
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }
}

/* who[n] for every flat token; returns the longest span any sequence's tokens see. */
int tokens_of(const Batch *b, TokenOf *who) {
    int max_span = 0;
    for (int sq = 0; sq < b->n_seqs; sq++) {
        int T = b->cu_seqlens[sq + 1] - b->cu_seqlens[sq];
        if (who)
            for (int t = 0; t < T; t++) who[b->cu_seqlens[sq] + t] = (TokenOf){sq, t};
        if (b->start[sq] + T > max_span) max_span = b->start[sq] + T;
    }
    return max_span;
}

/* Scratch of one forward, carved from the caller's workspace (sizes in floats unless said). */
typedef struct {
    float *x, *buf, *qkv, *att, *ff;      /* [N, D], [N, wide], [N, nqkv], [N, wide], [N, 2F] */
    float *angles;                        /* [N, hd]: each token's rope cos, sin */
    float *angles_local;                  /* [N, hd]: the same from inv_freq_local (or unused) */
    /* mixtures of experts (sized for the largest layer; unused without one): router probabilities
     * [N, E], each token's experts and weights [N, K], the rows each expert takes grouped by
     * expert [N K] (expert e's from off[e]: token indices, and which of the token's K), offsets
     * [E + 1] and a cursor [E + 1]; an expert's gathered inputs, gate/up, activations and
     * outputs; the sum [N, D] */
    float *moe_probs, *moe_w, *moe_x, *moe_ff, *moe_act, *moe_y, *moe_sum;
    int *moe_sel, *moe_rows, *moe_slot, *moe_off;
    /* latent attention (unused without it): queries [N, H (nope + rope)], latents and rotary keys
     * [N, latent + rope], q_a's output [N, q_lora], one head's gathered inputs and outputs of its
     * absorbed products [N, max(nope, latent)], [N, max(latent, v)] */
    float *mla_q, *mla_kv, *mla_lora, *mla_in, *mla_out;
    float *e;                             /* [N, D]: EAGLE-3's token embeddings (two_inputs) */
    float *lora_t;                        /* [N, 3 lora_rank]: LoRA's A x per token (lora_for) */
    float *scores;                        /* [threads, attn_scratch(max_span)] */
    void *qs;                             /* quant_act_bytes(N, wide) */
    TokenOf *who;                         /* [N] */
    int max_span;
} Work;

static long round_up(long n) { return (n + 63) / 64 * 64; }

/* Bytes of workspace a forward of N tokens needs (carve: also lay it out from ws). */
static long work_layout(const Model *m, int N, int max_span, int threads, char *ws, Work *w) {
    int D = m->dim, nq = m->n_heads * m->head_dim, nqkv = nq + 2 * m->n_kv * m->head_dim;
    int wide = D > nq ? D : nq;
    if (m->two_inputs && 2 * D > wide) wide = 2 * D;     /* EAGLE-3's attention input */
    if (m->hidden > wide) wide = m->hidden;
    int E = 0, K = 0, FM = 0;
    for (int l = 0; l < m->n_layers; l++) {
        const Layer *L = &m->layers[l];
        if (L->n_experts > E) E = L->n_experts;
        if (L->top_k > K) K = L->top_k;
        if (L->moe_hidden > FM) FM = L->moe_hidden;
        if (L->shared_hidden > FM) FM = L->shared_hidden;
    }
    int qwide = wide > FM ? wide : FM;
    if (m->q_lora > qwide) qwide = m->q_lora;
    int C = m->mla_latent, P = m->mla_nope, R = m->mla_rope, V = m->mla_v;
    long mla_in = C ? (P > C ? P : C) : 0, mla_out = C ? (V > C ? V : C) : 0;
    long sizes[28] = {4L * N * D, 4L * N * wide, 4L * N * nqkv, 4L * N * wide, 8L * N * m->hidden,
                      4L * threads * attn_scratch(max_span), quant_act_bytes(N, qwide),
                      (long)sizeof(TokenOf) * N, 4L * N * m->head_dim, m->inv_freq_local ? 4L * N * m->head_dim : 0,
                      4L * N * E, 4L * N * K, E ? 4L * N * D : 0, 8L * N * FM, 4L * N * FM, E ? 4L * N * D : 0,
                      E ? 4L * N * D : 0, 4L * N * K, 4L * N * K, 4L * N * K, E ? 8L * (E + 1) : 0,
                      C ? 4L * N * m->n_heads * (P + R) : 0, C ? 4L * N * (C + R) : 0, 4L * N * m->q_lora,
                      4L * N * mla_in, 4L * N * mla_out, m->two_inputs ? 4L * N * D : 0, 12L * N * m->lora_rank};
    void **at[28] = {(void **)&w->x, (void **)&w->buf, (void **)&w->qkv, (void **)&w->att, (void **)&w->ff,
                     (void **)&w->scores, &w->qs, (void **)&w->who, (void **)&w->angles, (void **)&w->angles_local,
                     (void **)&w->moe_probs, (void **)&w->moe_w, (void **)&w->moe_x, (void **)&w->moe_ff,
                     (void **)&w->moe_act, (void **)&w->moe_y, (void **)&w->moe_sum, (void **)&w->moe_sel,
                     (void **)&w->moe_rows, (void **)&w->moe_slot, (void **)&w->moe_off,
                     (void **)&w->mla_q, (void **)&w->mla_kv, (void **)&w->mla_lora, (void **)&w->mla_in,
                     (void **)&w->mla_out, (void **)&w->e, (void **)&w->lora_t};
    long off = 0;
    for (int i = 0; i < 28; i++) {
        if (ws) *at[i] = ws + off;
        off += round_up(sizes[i]);
    }
    w->max_span = max_span;
    return off;
}

/* LoRA's products in 8-lane FMAs (every build has AVX2 and FMA), on fp32 or bf16 weights (bf16
 * widened exactly). Up to 4 rows at once share the loads of x (dots) or of o (axpys); each row's
 * arithmetic is the same in any group, so a token's result does not depend on the batch. */
static inline __m256 ld8(const void *p, int bf16, long i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float ld1(const void *p, int bf16, long i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* t[r] = a[r] . x over K for rows r < nr (<= 4) of a (rows K apart): two chains per row over 16
 * floats a round, then the tail in order */
static inline __attribute__((always_inline)) void dots(const void *a, int bf16, const float *x, int K, int nr,
                                                       float *t) {
    __m256 s[4][2];
    for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int r = 0; r < nr; r++) {        /* the row's bytes ~1 KiB ahead (the next rows' starts near its end) */
            _mm_prefetch((const char *)a + (((long)r * K + k) << (bf16 ? 1 : 2)) + 1024, _MM_HINT_T0);
            s[r][0] = _mm256_fmadd_ps(ld8(a, bf16, (long)r * K + k), x0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(ld8(a, bf16, (long)r * K + k + 8), x1, s[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float v = hsum8(_mm256_add_ps(s[r][0], s[r][1]));
        for (int kk = k; kk < K; kk++) v = fmaf(ld1(a, bf16, (long)r * K + kk), x[kk], v);
        t[r] = v;
    }
}

/* o[c] += t[0] b[0][c] + .. + t[nr-1] b[nr-1][c] (in that order) for c < n; rows of b `ld` apart */
static inline __attribute__((always_inline)) void axpys(float *o, const float *t, const void *b, int bf16, long ld,
                                                        int n, int nr) {
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 v = _mm256_loadu_ps(o + c);
        for (int r = 0; r < nr; r++) {
            _mm_prefetch((const char *)b + ((r * ld + c) << (bf16 ? 1 : 2)) + 1024, _MM_HINT_T0);
            v = _mm256_fmadd_ps(_mm256_set1_ps(t[r]), ld8(b, bf16, r * ld + c), v);
        }
        _mm256_storeu_ps(o + c, v);
    }
    for (; c < n; c++)
        for (int r = 0; r < nr; r++) o[c] = fmaf(t[r], ld1(b, bf16, r * ld + c), o[c]);
}

/* out [M, N] += each token's LoRA product B (A x) (forward.h: LoraMat), for the M tokens whose
 * sequence has an adapter slot, by the team in two passes: the tokens' rows of t = A x in groups
 * of up to 4 rank rows of a segment, then each token's outputs in as many parts as threads. A
 * row of t and an output's sum take the same operations whatever the grouping and the split, so
 * a token's result does not depend on the batch. Nothing without adapters in the batch. */
static void lora_for(const Model *m, const Layer *L, int kind, const Batch *b, const Work *w, const float *x,
                     float *out, int M, int N, int K) {
    const LoraMat *l = &L->lora[kind];
    if (b->lora == NULL || l->a == NULL) return;
    const int R = m->lora_rank, SR = l->nseg * R, RG = (R + 3) / 4, bf = l->bf16;
    const int parts = omp_get_num_threads(), span = (N + parts - 1) / parts;
    const char *A = l->a, *Bt = l->bt;
    float *T = w->lora_t;                     /* [M, SR] */
    #pragma omp for schedule(static)
    for (long i = 0; i < (long)M * l->nseg * RG; i++) {
        int n = (int)(i / ((long)l->nseg * RG)), j = (int)(i / RG % l->nseg), r0 = (int)(i % RG) * 4;
        int s = b->lora[w->who[n].seq], rank = s < 0 ? 0 : m->lora_ranks[4 * s + kind];
        if (r0 >= rank) continue;
        int nr = rank - r0 < 4 ? rank - r0 : 4;
        long row = (long)s * SR + (long)j * R + r0;
        float *t = T + (long)n * SR + (long)j * R + r0;
        if (bf) dots((const uint16_t *)A + row * K, 1, x + (long)n * K, K, nr, t);
        else dots((const float *)A + row * K, 0, x + (long)n * K, K, nr, t);
    }
    #pragma omp for schedule(static)
    for (long i = 0; i < (long)M * parts; i++) {
        int n = (int)(i / parts), s = b->lora[w->who[n].seq];
        if (s < 0) continue;
        int rank = m->lora_ranks[4 * s + kind], c0 = (int)(i % parts) * span, c1 = c0 + span < N ? c0 + span : N;
        for (int j = 0, off = 0; j < l->nseg; off += l->seg[j], j++) {
            int lo = c0 > off ? c0 : off, hi = c1 < off + l->seg[j] ? c1 : off + l->seg[j];
            const float *t = T + (long)n * SR + (long)j * R;
            long b0 = (long)s * R * N + (long)R * off + (lo - off);
            for (int r = 0; r < rank && lo < hi; r += 4) {
                int nr = rank - r < 4 ? rank - r : 4;
                float *o = out + (long)n * N + lo;
                if (bf) axpys(o, t + r, (const uint16_t *)Bt + b0 + (long)r * l->seg[j], 1, l->seg[j], hi - lo, nr);
                else axpys(o, t + r, (const float *)Bt + b0 + (long)r * l->seg[j], 0, l->seg[j], hi - lo, nr);
            }
        }
    }
}

/* x += h, or x += h * scale (Granite's residual multiplier), row by row across the team. */
static void residual_add(float *x, const float *h, int N, int D, float scale) {
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        if (scale == 1.0f)
            for (long i = (long)n * D; i < (long)(n + 1) * D; i++) x[i] += h[i];
        else
            for (long i = (long)n * D; i < (long)(n + 1) * D; i++) x[i] += h[i] * scale;
    }
}

/* o = act(g) * u over F elements, both gates as g / (1 + e^z): SiLU (SwiGLU) with z = -g;
 * GELU_tanh (Gemma's GeGLU), 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), with
 * z = -2y; SWIGLU_OAI (gpt-oss), g clamped above at limit, z = -alpha g, times (u clamped to
 * +-limit) + 1. `act` is the model's constant: the branch goes the same way for every element. */
static void gate_mul(const float *g, const float *u, float *o, int F, int act, float alpha, float limit) {
    const float c = -2.0f * 0.7978845608028654f, c3 = 0.044715f;
    const int oai = act == ACT_SWIGLU_OAI;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= F; i += 16) {            /* the same operations per element in 16 lanes */
        __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
        if (oai) {
            gv = _mm512_min_ps(gv, _mm512_set1_ps(limit));
            uv = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(uv, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit)),
                               _mm512_set1_ps(1.0f));
        }
        __m512 z = act == ACT_GELU_TANH
            ? _mm512_mul_ps(_mm512_set1_ps(c), _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c3), gv), _mm512_mul_ps(gv, gv), gv))
            : oai ? _mm512_mul_ps(_mm512_set1_ps(-alpha), gv) : _mm512_sub_ps(_mm512_setzero_ps(), gv);
        __m512 e = vexp16(z);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv));
    }
#endif
    for (; i < F; i += 8) {
        int k = F - i < 8 ? F - i : 8;
        __m256 gv = load_part(g + i, k), uv = load_part(u + i, k);
        if (oai) {
            gv = _mm256_min_ps(gv, _mm256_set1_ps(limit));
            uv = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(uv, _mm256_set1_ps(limit)), _mm256_set1_ps(-limit)),
                               _mm256_set1_ps(1.0f));
        }
        __m256 z = act == ACT_GELU_TANH
            ? _mm256_mul_ps(_mm256_set1_ps(c), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c3), gv), _mm256_mul_ps(gv, gv), gv))
            : oai ? _mm256_mul_ps(_mm256_set1_ps(-alpha), gv) : _mm256_sub_ps(_mm256_setzero_ps(), gv);
        __m256 e = vexp(z);
        store_part(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), uv), k);
    }
}

/* The index of the largest of v [n] not yet in taken [k] (ties to the lower index). */
static int best_untaken(const float *v, int n, const int *taken, int k) {
    int best = -1;
    for (int e = 0; e < n; e++) {
        int t = 0;
        for (int j = 0; j < k; j++) t |= taken[j] == e;
        if (!t && (best < 0 || v[e] > v[best])) best = e;
    }
    return best;
}

/* Token n's experts: the top K of softmax(logits [E]) (fp32; ties to the lower index), weights
 * renormalised to sum 1 when norm; sel / wts [K] in descending probability. With the layer's
 * router_sigmoid, DeepSeek-V3's choice instead (Layer). */
static void route(const Layer *L, const float *logits, int E, int K, int *sel, float *wts) {
    float p[E], c[E], total = 0.0f;
    if (L->router_sigmoid) {
        for (int e = 0; e < E; e++) {
            p[e] = 1.0f / (1.0f + expf(-logits[e]));
            c[e] = p[e] + L->score_bias[e];
        }
    } else {
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < E; e++) sum += (p[e] = expf(logits[e] - mx));
        for (int e = 0; e < E; e++) c[e] = p[e] /= sum;
    }
    int G = L->n_group, per = E / (G > 0 ? G : 1);
    if (G > 1) {                           /* groups ranked by their best choice, or their two best's sum */
        float gs[G];
        int kept[G];
        for (int g = 0; g < G; g++) {
            const float *x = c + g * per;
            int a = best_untaken(x, per, NULL, 0);
            if (L->group_by_max) {
                gs[g] = x[a];
            } else {
                int b = best_untaken(x, per, &a, 1);
                gs[g] = x[a] + x[b];
            }
        }
        for (int t = 0; t < L->topk_group; t++) kept[t] = best_untaken(gs, G, kept, t);
        for (int g = 0; g < G; g++) {
            int keep = 0;
            for (int t = 0; t < L->topk_group; t++) keep |= kept[t] == g;
            if (!keep)
                for (int e = g * per; e < (g + 1) * per; e++) c[e] = -INFINITY;
        }
    }
    for (int k = 0; k < K; k++) {
        sel[k] = best_untaken(c, E, sel, k);
        total += (wts[k] = p[sel[k]]);
    }
    if (L->norm_topk)
        for (int k = 0; k < K; k++) wts[k] /= L->router_sigmoid ? total + 1e-20f : total;
    if (L->scaling != 1.0f)
        for (int k = 0; k < K; k++) wts[k] *= L->scaling;
}

/* buf [N, D] (the MLP's normed input) -> buf = the layer's mixture of experts. Each expert runs
 * once over the rows routed to it (gathered in token order); each token's weighted outputs are
 * added in expert order into a zeroed sum: a token's result does not depend on the batch. */
static void moe_for(const Model *m, const Layer *L, Work *w, int N) {
    int D = m->dim, E = L->n_experts, K = L->top_k, F = L->moe_hidden;
    linear_for(&L->router, w->buf, L->router_bias, w->moe_probs, N, E, D, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        route(L, w->moe_probs + (long)n * E, E, K, w->moe_sel + (long)n * K, w->moe_w + (long)n * K);
        memset(w->moe_sum + (long)n * D, 0, sizeof(float) * D);
    }
    #pragma omp single
    {                                     /* rows grouped by expert, tokens in order */
        int *off = w->moe_off;
        memset(off, 0, sizeof(int) * (E + 1));
        for (long i = 0; i < (long)N * K; i++) off[w->moe_sel[i] + 1]++;
        for (int e = 0; e < E; e++) off[e + 1] += off[e];
        int *fill = off + E + 1;
        for (int e = 0; e < E; e++) fill[e] = off[e];
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) {
                int e = w->moe_sel[(long)n * K + k];
                w->moe_rows[fill[e]] = n;
                w->moe_slot[fill[e]++] = k;
            }
    }
    for (int e = 0; e < E; e++) {
        int first = w->moe_off[e], c = w->moe_off[e + 1] - first;
        if (c == 0) continue;
        const int *rows = w->moe_rows + first, *slot = w->moe_slot + first;
        #pragma omp for schedule(static)
        for (int r = 0; r < c; r++) memcpy(w->moe_x + (long)r * D, w->buf + (long)rows[r] * D, sizeof(float) * D);
        const float *eb = L->expert_bias ? L->expert_bias + (long)e * (2 * F + D) : NULL;
        linear_for(&L->experts[2 * e], w->moe_x, eb, w->moe_ff, c, 2 * F, D, w->qs);
        #pragma omp for schedule(static)
        for (int r = 0; r < c; r++) {
            const float *g = w->moe_ff + (long)r * 2 * F;
            gate_mul(g, g + F, w->moe_act + (long)r * F, F, L->moe_act, m->swiglu_alpha, m->swiglu_limit);
        }
        linear_for(&L->experts[2 * e + 1], w->moe_act, eb ? eb + 2 * F : NULL, w->moe_y, c, D, F, w->qs);
        #pragma omp for schedule(static)
        for (int r = 0; r < c; r++) {     /* a token takes an expert once: rows never collide */
            float wt = w->moe_w[(long)rows[r] * K + slot[r]];
            float *dst = w->moe_sum + (long)rows[r] * D;
            const float *y = w->moe_y + (long)r * D;
            for (int i = 0; i < D; i++) dst[i] += wt * y[i];
        }
    }
    if (L->shared_hidden) {               /* the shared expert over every row, added last */
        int S = L->shared_hidden;
        linear_for(&L->gate_up, w->buf, NULL, w->moe_ff, N, 2 * S, D, w->qs);
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *g = w->moe_ff + (long)n * 2 * S;
            gate_mul(g, g + S, w->moe_act + (long)n * S, S, ACT_SILU, 0.0f, 0.0f);
        }
        linear_for(&L->down, w->moe_act, NULL, w->moe_y, N, D, S, w->qs);
        if (L->shared_gate.w) linear_for(&L->shared_gate, w->buf, NULL, w->moe_probs, N, 1, D, w->qs);
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float *dst = w->moe_sum + (long)n * D;
            const float *y = w->moe_y + (long)n * D;
            if (L->shared_gate.w) {
                float sig = 1.0f / (1.0f + expf(-w->moe_probs[n]));
                for (int i = 0; i < D; i++) dst[i] += sig * y[i];
            } else {
                for (int i = 0; i < D; i++) dst[i] += y[i];
            }
        }
    }
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) memcpy(w->buf + (long)n * D, w->moe_sum + (long)n * D, sizeof(float) * D);
}

/* out [N, rows] = head h's block of dense panels (kernels.pack; each head's padded to a multiple of
 * 16 rows) applied to columns col .. col + K of each row of x [N, x_stride], by the team: the
 * columns gathered into w->mla_in first (the kernel reads contiguous rows). */
static void head_product(const Layer *L, const void *panels, int h, int rows, int K, const float *x, long x_stride,
                         long col, float *out, Work *w, int N) {
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) memcpy(w->mla_in + (long)n * K, x + n * x_stride + col, sizeof(float) * K);
    long per_head = (long)(rows + 15) / 16 * 16 * K;
    const char *wp = (const char *)panels + (size_t)h * per_head * (L->mla_bf16 ? 2 : 4);
    skinny_for(w->mla_in, wp, L->mla_bf16, NULL, out, N, rows, K);
}

/* Latent attention (model/mla.py, absorbed): buf [N, D] (the normed input) -> buf [N, D] = the
 * attention block's output (after o). Each head's query W_UK[h]^T q_nope joins its rotary part
 * in a row of the cache's width; every head attends over the same cached [latent ; rotary key]
 * rows (one kv head), and W_UV[h] turns each head's weighted latent into its value. */
static void mla_for(const Model *m, const Layer *L, const Batch *b, Work *w, int N) {
    int D = m->dim, H = m->n_heads, hd = m->head_dim;
    int C = m->mla_latent, P = m->mla_nope, R = m->mla_rope, V = m->mla_v, QH = P + R;
    float *buf = w->buf, *q = w->mla_q, *kv = w->mla_kv, *rows = w->qkv, *att = w->att;
    if (L->q_a.w) {
        linear_for(&L->q_a, buf, NULL, w->mla_lora, N, m->q_lora, D, w->qs);
        rms_norm_for(w->mla_lora, w->mla_lora, L->q_a_norm, N, m->q_lora, m->mla_eps);
        linear_for(&L->qkv, w->mla_lora, NULL, q, N, H * QH, m->q_lora, w->qs);
    } else {
        linear_for(&L->qkv, buf, NULL, q, N, H * QH, D, w->qs);
    }
    linear_for(&L->kv_a, buf, NULL, kv, N, C + R, D, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        float *k = kv + (long)n * (C + R), *qn = q + (long)n * H * QH, *row = rows + (long)n * H * hd;
        const float *cs = w->angles + (long)n * hd;
        head_norm(k, 1, C, L->kv_a_norm, m->mla_eps);
        rope(k + C, 1, R, R, cs);
        rope(qn + P, H, QH, R, cs);       /* each head's rotary dims follow its nope dims */
        for (int h = 0; h < H; h++) memcpy(row + (long)h * hd + C, qn + (long)h * QH + P, sizeof(float) * R);
        int sq = w->who[n].seq;
        kv_store(m, L, slot_at(m, b->rows[sq], b->start[sq] + w->who[n].t, 0), k, k);   /* v is k: one row */
    }
    for (int h = 0; h < H; h++) {         /* the absorbed queries: row[n, h, :C] = W_UK[h]^T q_nope[n, h] */
        head_product(L, L->uk, h, C, P, q, (long)H * QH, (long)h * QH, w->mla_out, w, N);
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) memcpy(rows + ((long)n * H + h) * hd, w->mla_out + (long)n * C, sizeof(float) * C);
    }
    attention_for(m, L, b, rows, att, w->scores, w->max_span);
    for (int h = 0; h < H; h++) {         /* values: rows[n, h * V ..] = W_UV[h] (weighted latent of head h) */
        head_product(L, L->uv, h, V, C, att, (long)H * hd, (long)h * hd, w->mla_out, w, N);
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) memcpy(rows + (long)n * H * V + (long)h * V, w->mla_out + (long)n * V, sizeof(float) * V);
    }
    linear_for(&L->o, rows, L->o_bias, buf, N, D, H * V, w->qs);
}

/* The attention block (grouped-query): buf [N, D] (the normed input) -> buf [N, D] = its output
 * (after o), the new tokens' keys and values written to the cache. */
static void gqa_for(const Model *m, const Layer *L, const Batch *b, Work *w, int N) {
    int D = m->dim, H = m->n_heads, KV = m->n_kv, hd = m->head_dim;
    int nq = H * hd, nkv = KV * hd, nqkv = nq + 2 * nkv;
    float *buf = w->buf, *qkv = w->qkv, *att = w->att;
    linear_for(&L->qkv, buf, L->qkv_bias, qkv, N, nqkv, L->e_norm ? 2 * D : D, w->qs);
    lora_for(m, L, LORA_QKV, b, w, buf, qkv, N, nqkv, D);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        float *row = qkv + (long)n * nqkv;
        if (L->q_norm && m->qk_full) {      /* OLMo 2: one norm over each whole projection */
            head_norm(row, 1, nq, L->q_norm, m->eps);
            head_norm(row + nq, 1, nkv, L->k_norm, m->eps);
        } else if (L->q_norm) {
            head_norm(row, H, hd, L->q_norm, m->eps);
            head_norm(row + nq, KV, hd, L->k_norm, m->eps);
        }
        if (L->use_rope) {
            const float *cs = (L->local_rope ? w->angles_local : w->angles) + (long)n * hd;
            rope(row, H, hd, m->rot_dim, cs);
            rope(row + nq, KV, hd, m->rot_dim, cs);
        }
        int sq = w->who[n].seq;
        long slot = b->start[sq] + w->who[n].t;
        for (int g = 0; g < KV; g++)        /* bf16 / int8 caches: rounded once, when written */
            kv_store(m, L, slot_at(m, b->rows[sq], slot, g), row + nq + (long)g * hd, row + nq + nkv + (long)g * hd);
        memcpy(buf + (long)n * nq, row, sizeof(float) * nq);   /* q, packed [N, H * hd] */
    }
    attention_for(m, L, b, buf, att, w->scores, w->max_span);
    linear_for(&L->o, att, L->o_bias, buf, N, D, nq, w->qs);
    lora_for(m, L, LORA_O, b, w, att, buf, N, D, nq);
}

static void layer_for(const Model *m, const Layer *L, const Batch *b, Work *w, int N) {
    int D = m->dim, F = m->hidden;
    float *x = w->x, *buf = w->buf, *att = w->att, *ff = w->ff;
    if (L->e_norm) {                      /* EAGLE-3: buf = [e_norm(e) ; in_norm(h)], residual h or in_norm(h) */
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float *row = buf + (long)n * 2 * D, *h = x + (long)n * D;
            norm_row(row, w->e + (long)n * D, L->e_norm, D, m->eps);
            norm_row(row + D, h, L->in_norm, D, m->eps);
            if (L->norm_before_residual) memcpy(h, row + D, sizeof(float) * D);
        }
    } else {
        norm_or_copy(buf, x, L->in_norm, N, D, m->eps);
    }
    if (m->mla_latent) mla_for(m, L, b, w, N);
    else gqa_for(m, L, b, w, N);
    if (L->attn_out_norm) rms_norm_for(buf, buf, L->attn_out_norm, N, D, m->eps);   /* Gemma 2 / 3 */
    residual_add(x, buf, N, D, m->residual_scale);
    norm_or_copy(buf, x, L->post_norm, N, D, m->eps);
    if (L->n_experts) {
        moe_for(m, L, w, N);
        if (L->ffn_out_norm) rms_norm_for(buf, buf, L->ffn_out_norm, N, D, m->eps);
        residual_add(x, buf, N, D, m->residual_scale);
        return;
    }
    linear_for(&L->gate_up, buf, NULL, ff, N, 2 * F, D, w->qs);
    lora_for(m, L, LORA_GATE_UP, b, w, buf, ff, N, 2 * F, D);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = ff + (long)n * 2 * F, *u = g + F;
        float *o = att + (long)n * F;
        gate_mul(g, u, o, F, m->act, m->swiglu_alpha, m->swiglu_limit);
    }
    linear_for(&L->down, att, NULL, buf, N, D, F, w->qs);
    lora_for(m, L, LORA_DOWN, b, w, att, buf, N, D, F);
    if (L->ffn_out_norm) rms_norm_for(buf, buf, L->ffn_out_norm, N, D, m->eps);     /* Gemma 2 / 3 */
    residual_add(x, buf, N, D, m->residual_scale);
}

/* tokens [N] (or, when tokens is NULL, input vectors embeds [N, D] instead of the embedding
 * lookup: EAGLE's head; [N, 2 D] for EAGLE-3's, Model.two_inputs: each row the state, then the
 * token's embedding); pos [N] rope positions. Runs the first n_layers layers, then the final
 * norm into hidden_out [N, D] (if not NULL) and the LM head for the n_logits rows logit_rows
 * (all N in order when NULL) into logits [n_logits, V] (if not NULL). With n_aux > 0, hidden_out
 * [N, n_aux * D] takes instead the residual stream entering each layer aux_layers[a] (n_layers:
 * after the last one, before the final norm; EAGLE-3's features: row n holds its n_aux vectors
 * side by side). ws: ws_bytes of scratch.
 * Returns 0, or (computing nothing) the workspace bytes it needs when ws_bytes is less. */
long llama_forward(const Model *m, const Batch *b, const int64_t *tokens, const float *embeds, int N,
                   const int64_t *pos, int n_layers, float *hidden_out, const int32_t *aux_layers, int n_aux,
                   int n_logits, const int64_t *logit_rows, float *logits, void *ws, long ws_bytes) {
    if (N <= 0) return 0;
    int D = m->dim, max_span = tokens_of(b, NULL);
    Work w;
    long need = work_layout(m, N, max_span, omp_get_max_threads(), NULL, &w);
    if (need > ws_bytes || ws == NULL) return need;
    work_layout(m, N, max_span, omp_get_max_threads(), ws, &w);
    tokens_of(b, w.who);
    /* the rows that need logits, gathered into x after the final norm: only they meet the LM head */
    const float *head_in = logit_rows ? w.x : w.buf;
    #pragma omp parallel firstprivate(w)
    {
        #pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            rope_angles(w.angles + (long)n * m->head_dim, m->rot_dim, m->inv_freq, m->rope_attn, pos[n]);
            if (m->inv_freq_local)            /* Gemma 3's sliding layers: their own base, unscaled */
                rope_angles(w.angles_local + (long)n * m->head_dim, m->rot_dim, m->inv_freq_local, 1.0f, pos[n]);
            if (tokens == NULL && m->two_inputs) {    /* EAGLE-3: rows [h ; e] */
                memcpy(w.x + (long)n * D, embeds + (long)n * 2 * D, sizeof(float) * D);
                memcpy(w.e + (long)n * D, embeds + (long)n * 2 * D + D, sizeof(float) * D);
            } else if (tokens == NULL) {
                memcpy(w.x + (long)n * D, embeds + (long)n * D, sizeof(float) * D);
            } else {
                embed_row(&m->embed, tokens[n], w.x + (long)n * D, D);
            }
            if (m->embed_scale != 1.0f)       /* Granite: inputs (looked up or given) scaled */
                for (long i = (long)n * D; i < (long)(n + 1) * D; i++) w.x[i] *= m->embed_scale;
        }
        for (int l = 0; l <= n_layers; l++) {
            for (int a = 0; a < n_aux; a++) {
                if (aux_layers[a] != l || !hidden_out) continue;
                #pragma omp for schedule(static)
                for (int n = 0; n < N; n++)
                    memcpy(hidden_out + ((long)n * n_aux + a) * D, w.x + (long)n * D, sizeof(float) * D);
            }
            if (l < n_layers) layer_for(m, &m->layers[l], b, &w, N);
        }
        norm_or_copy(w.buf, w.x, m->final_norm, N, D, m->eps);     /* NULL: the EAGLE authors' heads */
        if (hidden_out && n_aux == 0) {
            #pragma omp for schedule(static)
            for (int n = 0; n < N; n++) memcpy(hidden_out + (long)n * D, w.buf + (long)n * D, sizeof(float) * D);
        }
        if (logits && n_logits > 0) {
            if (logit_rows) {
                #pragma omp for schedule(static)
                for (int r = 0; r < n_logits; r++) memcpy(w.x + (long)r * D, w.buf + logit_rows[r] * D, sizeof(float) * D);
            }
            linear_for(&m->lm_head, head_in, NULL, logits, n_logits, m->vocab, D, w.qs);
            if (m->logit_scale != 1.0f) {     /* Granite: logits / logits_scaling */
                #pragma omp for schedule(static)
                for (long i = 0; i < (long)n_logits * m->vocab; i++) logits[i] /= m->logit_scale;
            }
            if (m->final_softcap != 0.0f) {   /* Gemma 2: cap tanh(logits / cap) */
                float cap = m->final_softcap;
                #pragma omp for schedule(static)
                for (long i = 0; i < (long)n_logits * m->vocab; i++) logits[i] = cap * tanhf(logits[i] / cap);
            }
        }
    }
    return 0;
}

/* Greedy drafter chains for B sequences in one call. Step s (0-based) of sequence b, while
 * s < steps[b]: the input from the state feat_b and embed[tok_b] (`f`: EAGLE's fc, EAGLE-3's two
 * inputs or an MTP layer's norms and projection), the head (`head`: its decoder layers, norm and
 * LM head over the draft vocabulary) run on it at slot and position base[b] + s of block-table
 * row rows[b], the argmax mapped through vocab[] to a target token id (out_tokens[b * max_steps +
 * s]), and the head's state carried on. Every active sequence shares one head forward per step.
 * feats [B, D] and toks [B] (each sequence's first token) are updated in place; embed: the
 * drafter's token embedding rows. Returns 0, or -1 when memory runs out. */
int eagle_chain(const Model *head, const Fuse *f, const Mat *embed, const int64_t *vocab, int B, const int32_t *rows,
                const int32_t *base, const int32_t *steps, float *feats, int64_t *toks, int max_steps,
                int64_t *out_tokens) {
    int D = head->dim, V = head->vocab, rc = 0;
    float *in = malloc(sizeof(float) * B * 2 * D), *x = malloc(sizeof(float) * B * D);
    float *feat_out = malloc(sizeof(float) * B * D), *logits = malloc(sizeof(float) * B * V);
    int32_t *act = malloc(sizeof(int32_t) * B), *cu = malloc(sizeof(int32_t) * (B + 1));
    int32_t *start = malloc(sizeof(int32_t) * B), *arow = malloc(sizeof(int32_t) * B);
    int64_t *pos = malloc(sizeof(int64_t) * B), *moff = malloc(sizeof(int64_t) * B);
    void *ws = NULL;
    long ws_bytes = 0;
    for (int s = 0; s < max_steps && rc == 0; s++) {
        int n = 0;
        for (int i = 0; i < B; i++) if (steps[i] > s) act[n++] = i;
        if (n == 0) break;
        cu[0] = 0;
        for (int a = 0; a < n; a++) {
            int i = act[a];
            float *row = in + (long)a * 2 * D, *h = row, *e = row + D;
            if (f->embeds_first) { e = row; h = row + D; }
            memcpy(h, feats + (long)i * D, sizeof(float) * D);
            embed_row(embed, toks[i], e, D);
            if (f->e_norm) {                  /* an MTP layer: both normed, the embedding zeroed at position 0 */
                if (base[i] + s == 0) memset(e, 0, sizeof(float) * D);
                else norm_row(e, e, f->e_norm, D, head->eps);
                norm_row(h, h, f->h_norm, D, head->eps);
            }
            cu[a + 1] = a + 1;
            start[a] = base[i] + s;
            pos[a] = base[i] + s;
            arow[a] = rows[i];
            moff[a] = -1;
        }
        int fused = f->fc_w || f->fc_q.w;
        if (f->fc_w) skinny_linear(in, f->fc_w, f->fc_bf16, f->fc_b, x, 0, n, D, 2 * D);
        else if (f->fc_q.w && quant_linear(in, f->fc_q.w, f->fc_q.fmt, f->fc_b, x, n, D, 2 * D)) { rc = -1; break; }
        Batch b = {n, cu, start, arow, start, moff, NULL, pos};
        long need;
        const int32_t last[1] = {head->n_layers};      /* the state before the final norm */
        while ((need = llama_forward(head, &b, NULL, fused ? x : in, n, pos, head->n_layers, feat_out,
                                     f->state_before_norm ? last : NULL, f->state_before_norm, n, NULL, logits, ws,
                                     ws_bytes)) > 0) {
            free(ws);
            ws_bytes = need;
            if (!(ws = malloc(ws_bytes))) { rc = -1; break; }
        }
        for (int a = 0; a < n && rc == 0; a++) {
            int i = act[a], best = 0;
            const float *lg = logits + (long)a * V;
            for (int v = 1; v < V; v++) if (lg[v] > lg[best]) best = v;
            toks[i] = vocab[best];
            out_tokens[(long)i * max_steps + s] = toks[i];
            memcpy(feats + (long)i * D, feat_out + (long)a * D, sizeof(float) * D);
        }
    }
    free(ws); free(in); free(x); free(feat_out); free(logits); free(act); free(cu); free(start); free(arow); free(pos); free(moff);
    return rc;
}

/* The thread count of the calling thread's parallel regions (torch.set_num_threads sets the
 * same runtime's count when torch loaded libgomp first; this sets it when it did not). */
void specdec_set_threads(int n) { omp_set_num_threads(n); }
