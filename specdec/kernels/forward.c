/* The whole decoder forward over a flat batch of sequences on the CPU, in one call (llama2.c style).
 *
 * Decoding on a CPU spends as long in Python dispatching ~200 small ops per forward as in
 * reading the weights; a draft model that fits the cache spends most of its time there. This
 * file runs embedding -> layers -> norm -> LM head for N new tokens of several sequences with
 * fp32 activations and weights in any format kernels.h names (fp32, bf16, or GGUF blocks: each
 * matrix its own), writing keys and values into the same paged KV cache the PyTorch path uses
 * (model/kv.py: per layer [n_kv, num_blocks, block_size, hd]), with the same masks (causal, or a
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

#include "kernels.h"
#include "vmath.h"

typedef struct {
    const float *in_norm, *post_norm;     /* [D] fp32 */
    Mat qkv, o, gate_up, down;            /* packed panels (kernels.h) */
    const float *qkv_bias;                /* [(H + 2 KV) * hd] or NULL */
    void *k_cache, *v_cache;              /* [KV, num_blocks, block_size, hd] fp32 (bf16: kv_bf16) */
} Layer;

typedef struct {
    int dim, hidden, n_heads, n_kv, head_dim, vocab, n_layers, num_blocks, block_size, max_blocks, kv_bf16;
    float eps;
    Mat embed;                            /* [V, D] rows as stored (not panels): fp32, bf16 or GGUF blocks */
    const float *final_norm;              /* [D] */
    Mat lm_head;                          /* [V, D] packed panels */
    const float *inv_freq;                /* [hd / 2] */
    const Layer *layers;
    const int32_t *block_table;           /* [max_seqs, max_blocks] block ids */
} Model;

/* Sequence b feeds tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 into its slots start[b] ..;
 * slots before mask_from[b] are visible to all of them; from mask_from[b] on, causal when
 * mask_offset[b] < 0, else the tree mask masks[mask_offset[b] + t * cols + (s - mask_from[b])]
 * with cols = start[b] + T_b - mask_from[b] (model/batch.py: ForwardBatch). */
typedef struct {
    int n_seqs;
    const int32_t *cu_seqlens, *start, *rows, *mask_from;
    const int64_t *mask_offset;
    const uint8_t *masks;
} Batch;

/* head_dim % 8 == 0 everywhere (cforward.supported / attention_supported check) */
/* 8 keys' or values' elements as fp32: bf16 widened exactly (a 16-bit shift) */
static inline __m256 load_kv(const void *p, int bf16, long i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

#if defined(__AVX512F__)
static inline __m512 load_kv16(const void *p, int bf16, long i) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

/* a . b over n (a multiple of 8) as 8 lanes: 16 lanes of partial sums in k order (AVX2 holds
 * them in two 8-lane halves, AVX-512 in one vector: the same sums), lane i + 8 added to lane i. */
static inline __attribute__((always_inline)) __m256 dot8(const float *a, const void *b, int n, int bf16) {
    __m256 lo, hi;
    int i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load_kv16(b, bf16, i), acc);
    lo = _mm512_castps512_ps256(acc);
    hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
#else
    lo = hi = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_kv(b, bf16, i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load_kv(b, bf16, i + 8), hi);
    }
#endif
    if (i < n) lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_kv(b, bf16, i), lo);
    return _mm256_add_ps(lo, hi);
}

/* The sums of 8 vectors' lanes, one per lane: ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)),
 * the same for every position t (a dot product does not depend on the slots beside it). */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* y += a x, elementwise (one FMA per element in any width) */
static inline __attribute__((always_inline)) void axpy_kv(float *y, float a, const void *x, int n, int bf16) {
    int i = 0;
#if defined(__AVX512F__)
    __m512 va16 = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va16, load_kv16(x, bf16, i), _mm512_loadu_ps(y + i)));
#endif
    __m256 va = _mm256_set1_ps(a);
    for (; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_kv(x, bf16, i), _mm256_loadu_ps(y + i)));
}

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
    long row_bytes = e->fmt == Q4_K ? D / 256 * 144 : D / 32 * (e->fmt == Q8_0 ? 34 : e->fmt == Q4_0 ? 18 : 20);
    dequant_row(e->fmt, (const uint8_t *)e->w + token * row_bytes, out, D);
}

static void rms_norm_for(float *out, const float *x, const float *w, int T, int D, float eps) {
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *xt = x + (long)t * D;
        double ss = 0.0;
        for (int i = 0; i < D; i++) ss += (double)xt[i] * xt[i];
        float r = 1.0f / sqrtf((float)(ss / D) + eps);
        for (int i = 0; i < D; i++) out[(long)t * D + i] = w[i] * (xt[i] * r);
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

/* cs [hd]: cos then sin of pos * inv_freq[i] for i < hd / 2, once per token and forward. */
static void rope_angles(float *cs, int hd, const float *inv_freq, long pos) {
    for (int i = 0; i < hd / 2; i++) {
        float a = (float)pos * inv_freq[i];
        cs[i] = cosf(a);
        cs[hd / 2 + i] = sinf(a);
    }
}

/* Rotate the halves of each head's vector (Hugging Face's rotate_half) by the angles cs. */
static void rope(float *v, int n_heads, int hd, const float *cs) {
    int half = hd / 2;
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

/* Where kv head g of slot s of the sequence in block-table row `row` lives. */
static inline long slot_at(const Model *m, int row, long s, int g) {
    int32_t blk = m->block_table[(long)row * m->max_blocks + s / m->block_size];
    return (((long)g * m->num_blocks + blk) * m->block_size + s % m->block_size) * m->head_dim;
}

typedef struct { int seq, t; } TokenOf;   /* a flat token's sequence and index within it */

/* Attention is computed in blocks of up to QB queries that read the same keys and values: the
 * (token, head) pairs of one sequence and one kv head g, token-major (a decoding token's G =
 * H / KV heads share g; a prompt chunk adds its next tokens). Each key and value row is loaded
 * once per block instead of once per query, and the value sums of the block's queries run side
 * by side, so the adds are not one dependent chain. A query's arithmetic is the same whatever
 * block it lands in: its scores come from the same 8-slot groups, and a slot beyond its span
 * adds fma(0, v, acc), which is acc exactly (acc starts at +0 and never becomes -0). */
enum { QB = 4 };

typedef struct {
    int n, span;                      /* the flat token, and the slots it sees */
    const float *q;                   /* [hd] */
    float *o;                         /* [hd] */
    float *sc;                        /* [stride]: scores, then weights e_s / sum */
} Query;

/* Scores of every query of the block, 8 slots at a time (groups of 8 within each cache block,
 * as a lone query's), scaled by 1 / sqrt(hd). */
static inline __attribute__((always_inline)) void
block_scores(const Model *m, const Layer *L, const int32_t *table, int g, Query *qs, int np, int maxspan, int BF16) {
    int hd = m->head_dim, bs = m->block_size, es = BF16 ? 2 : 4;
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)hd));
    for (int s0 = 0; s0 < maxspan; s0 += bs) {
        const char *kb = (const char *)L->k_cache + (((long)g * m->num_blocks + table[s0 / bs]) * bs * hd) * es;
        for (int j0 = 0; j0 < bs && s0 + j0 < maxspan; j0 += 8)
            for (int i = 0; i < np; i++) {
                int lim = qs[i].span - s0 < bs ? qs[i].span - s0 : bs, cnt = lim - j0 < 8 ? lim - j0 : 8;
                if (cnt <= 0) continue;
                __m256 v[8];
                for (int t = 0; t < 8; t++)
                    v[t] = t < cnt ? dot8(qs[i].q, kb + (long)(j0 + t) * hd * es, hd, BF16) : _mm256_setzero_ps();
                __m256 r = _mm256_mul_ps(hsum8x8(v), scale);
                if (cnt == 8) _mm256_storeu_ps(qs[i].sc + s0 + j0, r);
                else store_part(qs[i].sc + s0 + j0, r, cnt);
            }
    }
}

/* Scores -> weights e^(s - max) / sum over the query's span (masked slots exactly 0), and
 * zeros from the span to `upto` (a multiple of 8), where the block's longer queries read. The
 * sum runs in 8 lanes over the visible slots, the k-th visible one in lane k % 8, lanes summed
 * in a fixed tree: a tree node (mask: its row of the tree mask from slot `from` on, else NULL)
 * sums what the same token sums when decoded alone, whatever masked slots lie between. */
static void softmax_weights(float *sc, int span, int upto, const uint8_t *mask, int from) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vm = ninf, acc = _mm256_setzero_ps();
    for (int s = 0; s < span; s += 8) {
        int n = span - s < 8 ? span - s : 8;
        vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, load_part(sc + s, n), _mm256_castsi256_ps(
                 _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    float lane[8], mx = -INFINITY;
    _mm256_storeu_ps(lane, vm);
    for (int k = 0; k < 8; k++) mx = lane[k] > mx ? lane[k] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    for (int s = 0; s < span; s += 8) {
        int n = span - s < 8 ? span - s : 8;
        __m256 v = load_part(sc + s, n);
        __m256 e = _mm256_and_ps(vexp(_mm256_sub_ps(v, vmx)), _mm256_cmp_ps(v, ninf, _CMP_NEQ_UQ));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        _mm256_storeu_ps(sc + s, e);               /* lanes past the span: 0 */
    }
    int dense = mask ? from / 8 * 8 : (span + 7) / 8 * 8, k = 0;
    for (int s = 0; s < dense; s += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sc + s));
    float part[8] = {0};
    for (int s = dense; s < span; s++) {          /* a tree node's tail: the visible slots, packed */
        if (s >= from && !mask[s - from]) continue;
        part[k++] = sc[s];
        if (k == 8) { acc = _mm256_add_ps(acc, _mm256_loadu_ps(part)); memset(part, 0, sizeof(part)); k = 0; }
    }
    if (k) acc = _mm256_add_ps(acc, _mm256_loadu_ps(part));
    _mm256_storeu_ps(lane, acc);
    float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    const __m256 vsum = _mm256_set1_ps(sum);
    int s = 0;
    for (; s < span; s += 8) _mm256_storeu_ps(sc + s, _mm256_div_ps(_mm256_loadu_ps(sc + s), vsum));
    for (; s < upto; s += 8) _mm256_storeu_ps(sc + s, _mm256_setzero_ps());
}

/* o_i = sum_s w_is v_s for NP queries at once, each element's FMAs in slot order. AVX-512: 64
 * columns (4 vectors) per query at a time; AVX2: 16 (2 vectors), to stay within 16 registers. */
static inline __attribute__((always_inline)) void
block_values(const Model *m, const Layer *L, const int32_t *table, int g, Query *qs, int maxspan, int NP, int BF16) {
    int hd = m->head_dim, bs = m->block_size, es = BF16 ? 2 : 4;
#if defined(__AVX512F__)
    enum { W = 16, NV = 4 };
    typedef __m512 vec;
#define VZERO _mm512_setzero_ps()
#define VFMA(a, p, c) _mm512_fmadd_ps(_mm512_set1_ps(a), load_kv16(p, BF16, 0), c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#else
    enum { W = 8, NV = 2 };
    typedef __m256 vec;
#define VZERO _mm256_setzero_ps()
#define VFMA(a, p, c) _mm256_fmadd_ps(_mm256_set1_ps(a), load_kv(p, BF16, 0), c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#endif
    for (int c0 = 0; c0 < hd; c0 += W * NV) {
        int nv = (hd - c0) / W < NV ? (hd - c0) / W : NV;   /* hd % 8 == 0: AVX-512 may end on 8 */
        vec acc[QB][NV];
        for (int i = 0; i < NP; i++)
            for (int k = 0; k < NV; k++) acc[i][k] = VZERO;
        for (int s0 = 0; s0 < maxspan; s0 += bs) {
            const char *vb = (const char *)L->v_cache + (((long)g * m->num_blocks + table[s0 / bs]) * bs * hd + c0) * es;
            int n = maxspan - s0 < bs ? maxspan - s0 : bs;
            for (int j = 0; j < n; j++) {
                const char *vj = vb + (long)j * hd * es;
                for (int i = 0; i < NP; i++) {
                    float a = qs[i].sc[s0 + j];
                    for (int k = 0; k < NV; k++)
                        if (k < nv) acc[i][k] = VFMA(a, vj + (long)k * W * es, acc[i][k]);
                }
            }
        }
        for (int i = 0; i < NP; i++)
            for (int k = 0; k < NV; k++)
                if (k < nv) VSTORE(qs[i].o + c0 + k * W, acc[i][k]);
        if (nv * W < hd - c0 && nv < NV) {          /* AVX-512, hd % 16 == 8: the last 8 columns */
            int c = c0 + nv * W;
            for (int i = 0; i < NP; i++) {
                memset(qs[i].o + c, 0, sizeof(float) * 8);
                for (int s = 0; s < maxspan; s++) {
                    const char *vs = (const char *)L->v_cache +
                        ((((long)g * m->num_blocks + table[s / bs]) * bs + s % bs) * hd + c) * es;
                    axpy_kv(qs[i].o + c, qs[i].sc[s], vs, 8, BF16);
                }
            }
            break;
        }
    }
#undef VZERO
#undef VFMA
#undef VSTORE
}

/* Pairs p0 .. p0 + np - 1 (pair p: token p / G, head g G + p % G) of sequence sq. */
static inline __attribute__((always_inline)) void
attend_block_t(const Model *m, const Layer *L, const Batch *b, int sq, int g, int p0, int np, const float *q,
               float *out, float *scratch, long stride, int BF16) {
    int H = m->n_heads, G = H / m->n_kv, hd = m->head_dim;
    int start = b->start[sq], T = b->cu_seqlens[sq + 1] - b->cu_seqlens[sq], from = b->mask_from[sq];
    int64_t moff = b->mask_offset[sq];
    int cols = start + T - from, maxspan = 0;
    const int32_t *table = m->block_table + (long)b->rows[sq] * m->max_blocks;
    Query qs[QB];
    for (int i = 0; i < np; i++) {
        int t = (p0 + i) / G, h = g * G + (p0 + i) % G, n = b->cu_seqlens[sq] + t;
        qs[i] = (Query){n, moff < 0 ? start + t + 1 : start + T, q + ((long)n * H + h) * hd,
                        out + ((long)n * H + h) * hd, scratch + i * stride};
        if (qs[i].span > maxspan) maxspan = qs[i].span;
    }
    block_scores(m, L, table, g, qs, np, maxspan, BF16);
    for (int i = 0; i < np; i++) {
        int t = qs[i].n - b->cu_seqlens[sq];
        const uint8_t *mask = moff >= 0 ? b->masks + moff + (long)t * cols : NULL;
        if (mask)                                 /* a tree: slots that are not ancestors */
            for (int s = from; s < qs[i].span; s++)
                if (!mask[s - from]) qs[i].sc[s] = -INFINITY;
        softmax_weights(qs[i].sc, qs[i].span, (maxspan + 7) / 8 * 8, mask, from);
    }
    switch (np) {                                 /* the query count as a constant: registers */
    case 1: block_values(m, L, table, g, qs, maxspan, 1, BF16); break;
    case 2: block_values(m, L, table, g, qs, maxspan, 2, BF16); break;
    case 3: block_values(m, L, table, g, qs, maxspan, 3, BF16); break;
    default: block_values(m, L, table, g, qs, maxspan, QB, BF16); break;
    }
}

static void attend_block(const Model *m, const Layer *L, const Batch *b, int sq, int g, int p0, int np,
                         const float *q, float *out, float *scratch, long stride) {
    if (m->kv_bf16) attend_block_t(m, L, b, sq, g, p0, np, q, out, scratch, stride, 1);
    else attend_block_t(m, L, b, sq, g, p0, np, q, out, scratch, stride, 0);
}

/* Floats of attention scratch per thread for the longest span. */
static long attn_scratch(int max_span) { return (long)QB * ((max_span > 0 ? max_span : 1) + 8); }

/* out [N, H * hd] = every (token, head)'s attention, split across the team by blocks (dynamic:
 * a causal prompt's later tokens see more slots); scratch: the team's [threads, attn_scratch]. */
static void attention_for(const Model *m, const Layer *L, const Batch *b, const float *q, float *out,
                          float *scratch, int max_span) {
    int G = m->n_heads / m->n_kv;
    long stride = (max_span > 0 ? max_span : 1) + 8;
    float *mine = scratch + (long)omp_get_thread_num() * attn_scratch(max_span);
    for (int sq = 0; sq < b->n_seqs; sq++) {
        int pairs = (b->cu_seqlens[sq + 1] - b->cu_seqlens[sq]) * G, nblk = (pairs + QB - 1) / QB;
        #pragma omp for collapse(2) schedule(dynamic, 1) nowait
        for (int g = 0; g < m->n_kv; g++)
            for (int k = 0; k < nblk; k++)
                attend_block(m, L, b, sq, g, k * QB, pairs - k * QB < QB ? pairs - k * QB : QB, q, out, mine, stride);
    }
    #pragma omp barrier
}

/* who[n] for every flat token; returns the longest span any sequence's tokens see. */
static int tokens_of(const Batch *b, TokenOf *who) {
    int max_span = 0;
    for (int sq = 0; sq < b->n_seqs; sq++) {
        int T = b->cu_seqlens[sq + 1] - b->cu_seqlens[sq];
        if (who)
            for (int t = 0; t < T; t++) who[b->cu_seqlens[sq] + t] = (TokenOf){sq, t};
        if (b->start[sq] + T > max_span) max_span = b->start[sq] + T;
    }
    return max_span;
}

/* The attention block of one layer for a caller that runs the rest of the layer itself (the
 * PyTorch path on the CPU: bf16 activations, or matrices no kernel covers): write the N new
 * tokens' keys and values (k, v [N, KV * hd], RoPE applied) into their slots of layer `layer`,
 * then out [N, H * hd] = each token's attention over its own sequence, as llama_forward
 * computes it. q, k, v, out and the cache are bf16 when m->kv_bf16, else fp32; the arithmetic
 * is fp32. Only the model's sizes, block table and layers' caches are read (weights may be NULL). */
void paged_attention(const Model *m, int layer, const Batch *b, const void *q, const void *k, const void *v,
                     void *out, int N) {
    if (N <= 0) return;
    const Layer *L = &m->layers[layer];
    int hd = m->head_dim, KV = m->n_kv, H = m->n_heads, es = m->kv_bf16 ? 2 : 4;
    long nq = (long)N * H * hd;
    TokenOf *who = malloc(sizeof(TokenOf) * N);
    int max_span = tokens_of(b, who);
    for (int n = 0; n < N; n++) {
        int sq = who[n].seq;
        for (int g = 0; g < KV; g++) {
            long at = slot_at(m, b->rows[sq], b->start[sq] + who[n].t, g) * es, src = ((long)n * KV + g) * hd * es;
            memcpy((char *)L->k_cache + at, (const char *)k + src, (size_t)es * hd);
            memcpy((char *)L->v_cache + at, (const char *)v + src, (size_t)es * hd);
        }
    }
    const float *qf = q;
    float *of = out;
    if (m->kv_bf16) {
        float *wq = malloc(sizeof(float) * nq);
        for (long i = 0; i < nq; i++) wq[i] = widen(q, 1, i);
        qf = wq;
        of = malloc(sizeof(float) * nq);
    }
    float *scratch = malloc(sizeof(float) * attn_scratch(max_span) * omp_get_max_threads());
    #pragma omp parallel
    attention_for(m, L, b, qf, of, scratch, max_span);
    free(scratch);
    if (m->kv_bf16) {
        for (long i = 0; i < nq; i++) ((uint16_t *)out)[i] = to_bf16(of[i]);
        free((void *)qf);
        free(of);
    }
    free(who);
}

/* Scratch of one forward, carved from the caller's workspace (sizes in floats unless said). */
typedef struct {
    float *x, *buf, *qkv, *att, *ff;      /* [N, D], [N, wide], [N, nqkv], [N, wide], [N, 2F] */
    float *angles;                        /* [N, hd]: each token's rope cos, sin */
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
    if (m->hidden > wide) wide = m->hidden;
    long sizes[9] = {4L * N * D, 4L * N * wide, 4L * N * nqkv, 4L * N * wide, 8L * N * m->hidden,
                     4L * threads * attn_scratch(max_span), quant_act_bytes(N, wide),
                     (long)sizeof(TokenOf) * N, 4L * N * m->head_dim};
    void **at[9] = {(void **)&w->x, (void **)&w->buf, (void **)&w->qkv, (void **)&w->att, (void **)&w->ff,
                    (void **)&w->scores, &w->qs, (void **)&w->who, (void **)&w->angles};
    long off = 0;
    for (int i = 0; i < 9; i++) {
        if (ws) *at[i] = ws + off;
        off += round_up(sizes[i]);
    }
    w->max_span = max_span;
    return off;
}

static void layer_for(const Model *m, const Layer *L, const Batch *b, Work *w, int N) {
    int D = m->dim, H = m->n_heads, KV = m->n_kv, hd = m->head_dim, F = m->hidden;
    int nq = H * hd, nkv = KV * hd, nqkv = nq + 2 * nkv;
    float *x = w->x, *buf = w->buf, *qkv = w->qkv, *att = w->att, *ff = w->ff;
    rms_norm_for(buf, x, L->in_norm, N, D, m->eps);
    linear_for(&L->qkv, buf, L->qkv_bias, qkv, N, nqkv, D, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        float *row = qkv + (long)n * nqkv;
        rope(row, H, hd, w->angles + (long)n * hd);
        rope(row + nq, KV, hd, w->angles + (long)n * hd);
        int sq = w->who[n].seq;
        long slot = b->start[sq] + w->who[n].t;
        for (int g = 0; g < KV; g++) {
            long at = slot_at(m, b->rows[sq], slot, g);
            const float *k = row + nq + (long)g * hd, *v = row + nq + nkv + (long)g * hd;
            if (m->kv_bf16) {           /* a bf16 cache: rounded once, when written */
                uint16_t *kc = (uint16_t *)L->k_cache + at, *vc = (uint16_t *)L->v_cache + at;
                for (int i = 0; i < hd; i++) { kc[i] = to_bf16(k[i]); vc[i] = to_bf16(v[i]); }
            } else {
                memcpy((float *)L->k_cache + at, k, sizeof(float) * hd);
                memcpy((float *)L->v_cache + at, v, sizeof(float) * hd);
            }
        }
        memcpy(buf + (long)n * nq, row, sizeof(float) * nq);   /* q, packed [N, H * hd] */
    }
    attention_for(m, L, b, buf, att, w->scores, w->max_span);
    linear_for(&L->o, att, NULL, buf, N, D, nq, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++)
        for (long i = (long)n * D; i < (long)(n + 1) * D; i++) x[i] += buf[i];
    rms_norm_for(buf, x, L->post_norm, N, D, m->eps);
    linear_for(&L->gate_up, buf, NULL, ff, N, 2 * F, D, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = ff + (long)n * 2 * F, *u = g + F;
        float *o = att + (long)n * F;
        for (int i = 0; i < F; i += 8) {      /* SiLU(gate) * up */
            int k = F - i < 8 ? F - i : 8;
            __m256 gv = load_part(g + i, k), e = vexp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 y = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), load_part(u + i, k));
            store_part(o + i, y, k);
        }
    }
    linear_for(&L->down, att, NULL, buf, N, D, F, w->qs);
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++)
        for (long i = (long)n * D; i < (long)(n + 1) * D; i++) x[i] += buf[i];
}

/* tokens [N] (or, when tokens is NULL, input vectors embeds [N, D] instead of the embedding
 * lookup: EAGLE's head); pos [N] rope positions. Runs the first n_layers layers, then the final
 * norm into hidden_out [N, D] (if not NULL) and the LM head for the n_logits rows logit_rows
 * (all N in order when NULL) into logits [n_logits, V] (if not NULL). ws: ws_bytes of scratch.
 * Returns 0, or (computing nothing) the workspace bytes it needs when ws_bytes is less. */
long llama_forward(const Model *m, const Batch *b, const int64_t *tokens, const float *embeds, int N,
                   const int64_t *pos, int n_layers, float *hidden_out, int n_logits, const int64_t *logit_rows,
                   float *logits, void *ws, long ws_bytes) {
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
            rope_angles(w.angles + (long)n * m->head_dim, m->head_dim, m->inv_freq, pos[n]);
            if (tokens == NULL) memcpy(w.x + (long)n * D, embeds + (long)n * D, sizeof(float) * D);
            else embed_row(&m->embed, tokens[n], w.x + (long)n * D, D);
        }
        for (int l = 0; l < n_layers; l++) layer_for(m, &m->layers[l], b, &w, N);
        rms_norm_for(w.buf, w.x, m->final_norm, N, D, m->eps);
        if (hidden_out) {
            #pragma omp for schedule(static)
            for (int n = 0; n < N; n++) memcpy(hidden_out + (long)n * D, w.buf + (long)n * D, sizeof(float) * D);
        }
        if (logits && n_logits > 0) {
            if (logit_rows) {
                #pragma omp for schedule(static)
                for (int r = 0; r < n_logits; r++) memcpy(w.x + (long)r * D, w.buf + logit_rows[r] * D, sizeof(float) * D);
            }
            linear_for(&m->lm_head, head_in, NULL, logits, n_logits, m->vocab, D, w.qs);
        }
    }
    return 0;
}

/* EAGLE's greedy chains for B sequences in one call. Step s (0-based) of sequence b, while
 * s < steps[b]: x = fc([feat_b ; embed[tok_b]]) (fc: packed [D, 2D] weights + fp32 bias), run
 * the head (`head`: its decoder layers, norm and LM head over the draft vocabulary) on x at
 * slot and position base[b] + s of block-table row rows[b], take the argmax, map it through
 * vocab[] to a target token id (out_tokens[b * max_steps + s]) and carry the head's output
 * feature on. Every active sequence shares one head forward per step. feats [B, D] and toks
 * [B] (each sequence's first token) are updated in place; embed: the target's embedding rows.
 * Returns 0, or -1 when memory runs out. */
int eagle_chain(const Model *head, const void *fc_w, int fc_bf16, const float *fc_b,
                const Mat *embed, const int64_t *vocab, int B, const int32_t *rows,
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
            memcpy(in + (long)a * 2 * D, feats + (long)i * D, sizeof(float) * D);
            embed_row(embed, toks[i], in + (long)a * 2 * D + D, D);
            cu[a + 1] = a + 1;
            start[a] = base[i] + s;
            pos[a] = base[i] + s;
            arow[a] = rows[i];
            moff[a] = -1;
        }
        skinny_linear(in, fc_w, fc_bf16, fc_b, x, 0, n, D, 2 * D);
        Batch b = {n, cu, start, arow, start, moff, NULL};
        long need;
        while ((need = llama_forward(head, &b, NULL, x, n, pos, head->n_layers, feat_out, n, NULL, logits, ws, ws_bytes)) > 0) {
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
