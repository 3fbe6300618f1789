/* Attention over the paged KV cache (forward.c's layers and paged_attention), and the write of
 * new keys and values into it, for the three cache formats (forward.h: kv_type).
 *
 * Every (token, head) attends over its own sequence's slots in slot order; nothing depends on
 * what else is in the batch (forward.c: the invariant). An int8 cache is dequantized on the fly:
 * a key row's int8 values are converted to fp32 and dotted with the query, the row's scale
 * multiplies the dot (one product per slot, not per element); a value row's scale multiplies
 * its softmax weight before the row's converted values are added. A row is quantized once,
 * when written, from the fp32 key or value that the forward computes bit-identically however
 * the tokens were batched or chunked, so the cache holds the same bytes either way.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "vmath.h"

/* head_dim % 8 == 0 everywhere (cforward.supported / attention_supported check) */
/* 8 keys' or values' elements as fp32: bf16 widened exactly (a 16-bit shift), int8 converted
 * exactly (the row's scale is the caller's) */
static inline __m256 load_kv(const void *p, int kind, long i) {
    if (kind == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    if (kind == KV_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

#if defined(__AVX512F__)
static inline __m512 load_kv16(const void *p, int kind, long i) {
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    if (kind == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

/* a . b over n (a multiple of 8) as 8 lanes, for one query a against CNT rows b of kr (row
 * stride rs bytes): 16 lanes of partial sums in k order (AVX2 holds them in two 8-lane halves,
 * AVX-512 in one vector: the same sums), lane i + 8 added to lane i; each row's FMAs in the
 * same order whatever CNT. The rows' chains run side by side (a lone row's is 4 dependent FMAs
 * at hd = 64, whose latency had bounded the scores) and the query's vectors are loaded once for
 * the rows. AVX-512: up to 8 rows (32 registers); AVX2: up to 4 (16 registers: 4 rows' two
 * accumulators and the query's two vectors). */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void dot8_rows(const float *a, const char *kr, long rs, int n, int kind,
                                                            int cnt, __m256 *v) {
    __m512 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 q = _mm512_loadu_ps(a + i);
        for (int t = 0; t < cnt; t++) acc[t] = _mm512_fmadd_ps(q, load_kv16(kr + t * rs, kind, i), acc[t]);
    }
    for (int t = 0; t < cnt; t++) {
        __m256 lo = _mm512_castps512_ps256(acc[t]);
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1));
        if (i < n) lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_kv(kr + t * rs, kind, i), lo);
        v[t] = _mm256_add_ps(lo, hi);
    }
}
#else
static inline __attribute__((always_inline)) void dot8_rows(const float *a, const char *kr, long rs, int n, int kind,
                                                            int cnt, __m256 *v) {
    __m256 lo[4], hi[4];
    for (int t = 0; t < 4; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 al = _mm256_loadu_ps(a + i), ah = _mm256_loadu_ps(a + i + 8);
        for (int t = 0; t < cnt; t++) {
            lo[t] = _mm256_fmadd_ps(al, load_kv(kr + t * rs, kind, i), lo[t]);
            hi[t] = _mm256_fmadd_ps(ah, load_kv(kr + t * rs, kind, i + 8), hi[t]);
        }
    }
    if (i < n) {
        __m256 al = _mm256_loadu_ps(a + i);
        for (int t = 0; t < cnt; t++) lo[t] = _mm256_fmadd_ps(al, load_kv(kr + t * rs, kind, i), lo[t]);
    }
    for (int t = 0; t < cnt; t++) v[t] = _mm256_add_ps(lo[t], hi[t]);
}
#endif

/* dot8_rows over a group of CNT <= 8 rows (AVX2: two calls of up to 4). */
static inline __attribute__((always_inline)) void dot8_group(const float *a, const char *kr, long rs, int n, int kind,
                                                             int cnt, __m256 *v) {
#if defined(__AVX512F__)
    dot8_rows(a, kr, rs, n, kind, cnt, v);
#else
    dot8_rows(a, kr, rs, n, kind, cnt < 4 ? cnt : 4, v);
    if (cnt > 4) dot8_rows(a, kr + 4 * rs, rs, n, kind, cnt - 4, v + 4);
#endif
}

/* The sums of 8 vectors' lanes, one per lane: ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)),
 * the same for every position t (a dot product does not depend on the slots beside it). */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* y += a x, elementwise (one FMA per element in any width) */
static inline __attribute__((always_inline)) void axpy_kv(float *y, float a, const void *x, int n, int kind) {
    int i = 0;
#if defined(__AVX512F__)
    __m512 va16 = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va16, load_kv16(x, kind, i), _mm512_loadu_ps(y + i)));
#endif
    __m256 va = _mm256_set1_ps(a);
    for (; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_kv(x, kind, i), _mm256_loadu_ps(y + i)));
}

/* Bytes of one cached element. */
static inline int kv_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

/* Ask for the cache block `specdec_kv_prefetch` blocks after the one at slot s0 (its rows of kv
 * head g, and their int8 scales) while this one is computed (0: ask for nothing). A hint only:
 * nothing computed changes. Set once per process (kernels/__init__.py: by the machine, or
 * SPECDEC_KV_PREFETCH): two blocks ahead helped a decoding step's reads on an AVX2 Zen 3, where the
 * weights streamed by between two steps evict the cache's rows, and on an AVX-512 Xeon (suffix
 * K = 2 after a 3000-token prompt 5-10% faster); on an AVX-512 Zen 4 the hardware's own
 * prefetchers did better without it, with either build (1-token forwards after 4096 cached
 * tokens: 8.5 against 10.8 ms on two threads; scripts/kv_prefetch.py), the software's requests
 * crowding the loads that need the lines now. */
int specdec_kv_prefetch = 2;

static inline __attribute__((always_inline)) void
prefetch_block(const Model *m, const int32_t *table, int g, int s0, int maxspan, const void *cache,
               const float *scale, int es) {
    int bs = m->block_size, s = s0 + specdec_kv_prefetch * bs;
    if (specdec_kv_prefetch <= 0 || s >= maxspan) return;
    long row0 = ((long)g * m->num_blocks + table[s / bs]) * bs;
    int n = maxspan - s < bs ? maxspan - s : bs;
    const char *p = (const char *)cache + row0 * m->head_dim * es;
    for (long off = 0; off < (long)n * m->head_dim * es; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    if (scale)
        for (long off = 0; off < (long)n * 4; off += 64) _mm_prefetch((const char *)(scale + row0) + off, _MM_HINT_T0);
}

/* Attention is computed in blocks of up to QB queries that read the same keys and values: the
 * (token, head) pairs of one sequence and one kv head g, token-major (a decoding token's G =
 * H / KV heads share g; a prompt chunk adds its next tokens). Each key and value row is loaded
 * once per block instead of once per query, and the value sums of the block's queries run side
 * by side, so the adds are not one dependent chain. A query's arithmetic is the same whatever
 * block it lands in: its scores come from the same 8-slot groups, and a slot beyond its span
 * adds fma(0, v, acc), which is acc exactly (acc starts at +0 and never becomes -0). QB = 6: two
 * prompt tokens' 3 heads (SmolLM2's G) per block; 2-4% off a 1024-token prefill on the AVX-512
 * Xeon against 4, even on AVX2 (whose 6 x 2 value accumulators still fit 16 registers). */
enum { QB = 6 };

typedef struct {
    int n, span;                      /* the flat token, and the slots it sees */
    const float *q;                   /* [hd] */
    float *o;                         /* [hd] */
    float *sc;                        /* [stride]: scores, then weights e_s / sum */
} Query;

/* n (a multiple of 8) elements of format KIND -> fp32, exactly. */
static inline __attribute__((always_inline)) void widen_rows(float *dst, const char *src, long n, int KIND) {
    long e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= n; e += 16) _mm512_storeu_ps(dst + e, load_kv16(src, KIND, e));
#endif
    for (; e < n; e += 8) _mm256_storeu_ps(dst + e, load_kv(src, KIND, e));
}

/* The scores of every query against rows j0 .. j0 + 7 of the cache block that starts at slot
 * s0 (kr: row j0, in format KIND; d: the rows' scales, or NULL), scaled by 1 / sqrt(hd). */
static inline __attribute__((always_inline)) void
group_scores(Query *qs, int np, int s0, int j0, int bs, int hd, const char *kr, const float *d, __m256 scale,
             int KIND) {
    int es = kv_bytes(KIND);
    for (int i = 0; i < np; i++) {
        int lim = qs[i].span - s0 < bs ? qs[i].span - s0 : bs, cnt = lim - j0 < 8 ? lim - j0 : 8;
        if (cnt <= 0) continue;
        __m256 v[8];
        if (cnt == 8) {                   /* a constant count: the unrolled copy */
            dot8_group(qs[i].q, kr, (long)hd * es, hd, KIND, 8, v);
        } else {                          /* a span's last group */
            dot8_group(qs[i].q, kr, (long)hd * es, hd, KIND, cnt, v);
            for (int t = cnt; t < 8; t++) v[t] = _mm256_setzero_ps();
        }
        __m256 r = hsum8x8(v);
        if (d) r = _mm256_mul_ps(r, cnt == 8 ? _mm256_loadu_ps(d) : load_part(d, cnt));
        r = _mm256_mul_ps(r, scale);
        if (cnt == 8) _mm256_storeu_ps(qs[i].sc + s0 + j0, r);
        else store_part(qs[i].sc + s0 + j0, r, cnt);
    }
}

/* Scores of every query of the block, 8 slots at a time (groups of 8 within each cache block,
 * as a lone query's), times each key row's scale (int8), scaled by 1 / sqrt(hd). With several
 * queries, a bf16 or int8 group is widened to fp32 once (exactly) instead of once per query. */
static inline __attribute__((always_inline)) void
block_scores(const Model *m, const Layer *L, const int32_t *table, int g, Query *qs, int np, int first, int maxspan,
             int KIND) {
    int hd = m->head_dim, bs = m->block_size, es = kv_bytes(KIND);
    const __m256 scale = _mm256_set1_ps(m->attn_scale != 0.0f ? m->attn_scale : 1.0f / sqrtf((float)hd));
    float kf[KIND == KV_F32 ? 1 : 8 * hd];
    for (int s0 = first; s0 < maxspan; s0 += bs) {
        long row0 = ((long)g * m->num_blocks + table[s0 / bs]) * bs;   /* the block's first row */
        prefetch_block(m, table, g, s0, maxspan, L->k_cache, KIND == KV_I8 ? L->k_scale : NULL, es);
        for (int j0 = 0; j0 < bs && s0 + j0 < maxspan; j0 += 8) {
            const char *kr = (const char *)L->k_cache + (row0 + j0) * hd * es;
            const float *d = KIND == KV_I8 ? L->k_scale + row0 + j0 : NULL;
            if (KIND == KV_F32 || np == 1) {
                group_scores(qs, np, s0, j0, bs, hd, kr, d, scale, KIND);
            } else {
                int rows = bs - j0 < maxspan - s0 - j0 ? bs - j0 : maxspan - s0 - j0;
                widen_rows(kf, kr, (long)(rows < 8 ? rows : 8) * hd, KIND);
                group_scores(qs, np, s0, j0, bs, hd, (const char *)kf, d, scale, KV_F32);
            }
        }
    }
}

/* Scores -> weights e^(s - max) / sum over the query's span (masked slots exactly 0; a sink
 * (gpt-oss; -inf: none) is one more logit in the max and the sum, weighing no value), and
 * zeros from the span to `upto` (a multiple of 8), where the block's longer queries read. The
 * sum runs in 8 lanes over the visible slots, the k-th visible one in lane k % 8, lanes summed
 * in a fixed tree: a tree node (mask: its row of the tree mask from slot `from` on, else NULL)
 * sums what the same token sums when decoded alone, whatever masked slots lie between. Slots
 * before `lo` (a multiple of 8: a sliding window's skipped blocks) are neither read nor
 * written; their weights would be exact zeros, which leave the lanes' sums as they are. */
static void softmax_weights(float *sc, int lo, int span, int upto, const uint8_t *mask, int from, float sink) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vm = ninf, acc = _mm256_setzero_ps();
    for (int s = lo; s < span; s += 8) {
        int n = span - s < 8 ? span - s : 8;
        vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, load_part(sc + s, n), _mm256_castsi256_ps(
                 _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    float lane[8], mx = -INFINITY;
    _mm256_storeu_ps(lane, vm);
    for (int k = 0; k < 8; k++) mx = lane[k] > mx ? lane[k] : mx;
    if (sink > mx) mx = sink;                     /* gpt-oss: the sink's logit joins the max and the sum */
    const __m256 vmx = _mm256_set1_ps(mx);
    int s8 = lo;
#if defined(__AVX512F__)
    const __m512 vmx16 = _mm512_set1_ps(mx), ninf16 = _mm512_set1_ps(-INFINITY);
    for (; s8 + 16 <= span; s8 += 16) {           /* the same operations per slot in 16 lanes */
        __m512 v = _mm512_loadu_ps(sc + s8);
        __m512 e = vexp16(_mm512_sub_ps(v, vmx16));
        _mm512_storeu_ps(sc + s8, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf16, _CMP_NEQ_UQ), e));
    }
#endif
    for (int s = s8; s < span; s += 8) {
        int n = span - s < 8 ? span - s : 8;
        __m256 v = load_part(sc + s, n);
        __m256 e = _mm256_and_ps(vexp(_mm256_sub_ps(v, vmx)), _mm256_cmp_ps(v, ninf, _CMP_NEQ_UQ));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        _mm256_storeu_ps(sc + s, e);               /* lanes past the span: 0 */
    }
    int dense = mask ? from / 8 * 8 : (span + 7) / 8 * 8, k = 0;
    for (int s = lo; s < dense; s += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sc + s));
    float part[8] = {0};
    for (int s = dense; s < span; s++) {          /* a tree node's tail: the visible slots, packed */
        if (s >= from && !mask[s - from]) continue;
        part[k++] = sc[s];
        if (k == 8) { acc = _mm256_add_ps(acc, _mm256_loadu_ps(part)); memset(part, 0, sizeof(part)); k = 0; }
    }
    if (k) acc = _mm256_add_ps(acc, _mm256_loadu_ps(part));
    _mm256_storeu_ps(lane, acc);
    float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    if (sink != -INFINITY) sum += expf(sink - mx);
    const __m256 vsum = _mm256_set1_ps(sum);
    int s = lo;
#if defined(__AVX512F__)
    const __m512 vsum16 = _mm512_set1_ps(sum);
    for (; s + 16 <= span; s += 16) _mm512_storeu_ps(sc + s, _mm512_div_ps(_mm512_loadu_ps(sc + s), vsum16));
#endif
    for (; s < span; s += 8) _mm256_storeu_ps(sc + s, _mm256_div_ps(_mm256_loadu_ps(sc + s), vsum));
    for (; s < upto; s += 8) _mm256_storeu_ps(sc + s, _mm256_setzero_ps());
}

/* o_i = sum_s w_is v_s for NP queries at once, each element's FMAs in slot order (int8: w_is
 * times the row's scale, then the FMA over the converted row). AVX-512: 64 columns (4 vectors)
 * per query at a time; AVX2: 16 (2 vectors), to stay within 16 registers. */
static inline __attribute__((always_inline)) void
block_values(const Model *m, const Layer *L, const int32_t *table, int g, Query *qs, int first, int maxspan, int NP,
             int KIND) {
    int hd = m->head_dim, bs = m->block_size, es = kv_bytes(KIND);
#if defined(__AVX512F__)
    enum { W = 16, NV = 4 };
    typedef __m512 vec;
#define VZERO _mm512_setzero_ps()
#define VLOAD(p) load_kv16(p, KIND, 0)
#define VFMA(a, x, c) _mm512_fmadd_ps(_mm512_set1_ps(a), x, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#else
    enum { W = 8, NV = 2 };
    typedef __m256 vec;
#define VZERO _mm256_setzero_ps()
#define VLOAD(p) load_kv(p, KIND, 0)
#define VFMA(a, x, c) _mm256_fmadd_ps(_mm256_set1_ps(a), x, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#endif
    /* Column passes of W * NV (the last may hold fewer vectors); AVX-512 with hd % 16 == 8 ends
     * on 8 columns, summed after. Blocks outermost: each block's rows are read from memory once
     * and stay in L1 for every pass (passes outermost had read each row's lines once per pass,
     * with a 128-byte stride); a pass's accumulators wait in `accs` between blocks. Each element
     * still sums its slots in slot order, from +0: the same results. */
    int npass = 0, tail = -1, nvs[hd / (W * NV) + 1];      /* each pass's vector count */
    for (int c0 = 0; c0 < hd; c0 += W * NV) {
        int nv = (hd - c0) / W < NV ? (hd - c0) / W : NV;   /* hd % 8 == 0: AVX-512 may end on 8 */
        nvs[npass++] = nv;
        if (nv * W < hd - c0 && nv < NV) {
            tail = c0 + nv * W;
            break;
        }
    }
    vec accs[npass][NP][NV];
    for (int p = 0; p < npass; p++)
        for (int i = 0; i < NP; i++)
            for (int k = 0; k < NV; k++) accs[p][i][k] = VZERO;
    for (int s0 = first; s0 < maxspan; s0 += bs) {
        long row0 = ((long)g * m->num_blocks + table[s0 / bs]) * bs;
        prefetch_block(m, table, g, s0, maxspan, L->v_cache, KIND == KV_I8 ? L->v_scale : NULL, es);
        int n = maxspan - s0 < bs ? maxspan - s0 : bs;
        for (int p = 0; p < npass; p++) {
            int c0 = p * W * NV, nv = nvs[p];
            const char *vb = (const char *)L->v_cache + (row0 * hd + c0) * es;
            vec acc[QB][NV];
            for (int i = 0; i < NP; i++)
                for (int k = 0; k < NV; k++) acc[i][k] = accs[p][i][k];
            for (int j = 0; j < n; j++) {
                const char *vj = vb + (long)j * hd * es;
                vec x[NV];                          /* the row, widened once for every query */
                for (int k = 0; k < NV; k++)
                    if (k < nv) x[k] = VLOAD(vj + (long)k * W * es);
                for (int i = 0; i < NP; i++) {
                    float a = qs[i].sc[s0 + j];
                    if (KIND == KV_I8) a *= L->v_scale[row0 + j];
                    for (int k = 0; k < NV; k++)
                        if (k < nv) acc[i][k] = VFMA(a, x[k], acc[i][k]);
                }
            }
            for (int i = 0; i < NP; i++)
                for (int k = 0; k < NV; k++) accs[p][i][k] = acc[i][k];
        }
    }
    for (int p = 0; p < npass; p++) {
        int c0 = p * W * NV, nv = nvs[p];
        for (int i = 0; i < NP; i++)
            for (int k = 0; k < NV; k++)
                if (k < nv) VSTORE(qs[i].o + c0 + k * W, accs[p][i][k]);
    }
    if (tail >= 0) {                                /* AVX-512, hd % 16 == 8: the last 8 columns */
        int c = tail;
        for (int i = 0; i < NP; i++) {
            memset(qs[i].o + c, 0, sizeof(float) * 8);
            for (int s = first; s < maxspan; s++) {
                long row = ((long)g * m->num_blocks + table[s / bs]) * bs + s % bs;
                float a = KIND == KV_I8 ? qs[i].sc[s] * L->v_scale[row] : qs[i].sc[s];
                axpy_kv(qs[i].o + c, a, (const char *)L->v_cache + (row * hd + c) * es, 8, KIND);
            }
        }
    }
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VSTORE
}

/* Pairs p0 .. p0 + np - 1 (pair p: token p / G, head g G + p % G) of sequence sq. */
static inline __attribute__((always_inline)) void
attend_block_t(const Model *m, const Layer *L, const Batch *b, int sq, int g, int p0, int np, const float *q,
               float *out, float *scratch, long stride, int KIND) {
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
    /* A sliding window: whole cache blocks before every query's window are skipped. Their
     * weights would be exact zeros, and adding a zero term (or fma(0, v, acc)) leaves every sum
     * as it is: the same results as attending over them. */
    int first = 0;
    if (L->window > 0) {
        long lo = from;                           /* a tree's own slots: all computed */
        for (int i = 0; i < np; i++) {
            long w = b->pos[qs[i].n] - L->window + 1;
            if (w < lo) lo = w;
        }
        first = lo > 0 ? (int)(lo / m->block_size) * m->block_size : 0;
    }
    int first8 = first / 8 * 8;                   /* softmax's lanes start on a multiple of 8 */
    for (int i = 0; i < np; i++)
        for (int s = first8; s < first; s++) qs[i].sc[s] = -INFINITY;
    block_scores(m, L, table, g, qs, np, first, maxspan, KIND);
    for (int i = 0; i < np; i++) {
        int t = qs[i].n - b->cu_seqlens[sq];
        const uint8_t *mask = moff >= 0 ? b->masks + moff + (long)t * cols : NULL;
        if (m->attn_softcap != 0.0f) {            /* Gemma 2: cap tanh(s / cap), before any mask */
            float cap = m->attn_softcap;
            for (int s = first; s < qs[i].span; s++) qs[i].sc[s] = cap * tanhf(qs[i].sc[s] / cap);
        }
        if (L->window > 0) {                      /* a sliding window: slots `window` or more back */
            long lo = b->pos[qs[i].n] - L->window + 1;
            int lim = mask ? from : qs[i].span;   /* a tree's own slots: its mask decides */
            for (int s = first; s < lo && s < lim; s++) qs[i].sc[s] = -INFINITY;
        }
        if (mask)                                 /* a tree: slots that are not ancestors */
            for (int s = from; s < qs[i].span; s++)
                if (!mask[s - from]) qs[i].sc[s] = -INFINITY;
        float sink = L->sinks ? L->sinks[g * G + (p0 + i) % G] : -INFINITY;    /* gpt-oss: the head's sink */
        softmax_weights(qs[i].sc, first8, qs[i].span, (maxspan + 7) / 8 * 8, mask, from, sink);
    }
    switch (np) {                                 /* the query count as a constant: registers */
    case 1: block_values(m, L, table, g, qs, first, maxspan, 1, KIND); break;
    case 2: block_values(m, L, table, g, qs, first, maxspan, 2, KIND); break;
    case 3: block_values(m, L, table, g, qs, first, maxspan, 3, KIND); break;
    case 4: block_values(m, L, table, g, qs, first, maxspan, 4, KIND); break;
    case 5: block_values(m, L, table, g, qs, first, maxspan, 5, KIND); break;
    default: block_values(m, L, table, g, qs, first, maxspan, QB, KIND); break;
    }
}

static void attend_block(const Model *m, const Layer *L, const Batch *b, int sq, int g, int p0, int np,
                         const float *q, float *out, float *scratch, long stride) {
    switch (m->kv_type) {                         /* the format as a constant: one copy each */
    case KV_I8: attend_block_t(m, L, b, sq, g, p0, np, q, out, scratch, stride, KV_I8); break;
    case KV_BF16: attend_block_t(m, L, b, sq, g, p0, np, q, out, scratch, stride, KV_BF16); break;
    default: attend_block_t(m, L, b, sq, g, p0, np, q, out, scratch, stride, KV_F32); break;
    }
}

/* Floats of attention scratch per thread for the longest span. */
long attn_scratch(int max_span) { return (long)QB * ((max_span > 0 ? max_span : 1) + 8); }

/* out [N, H * hd] = every (token, head)'s attention, split across the team by blocks (dynamic:
 * a causal prompt's later tokens see more slots); scratch: the team's [threads, attn_scratch]. */
void attention_for(const Model *m, const Layer *L, const Batch *b, const float *q, float *out, float *scratch,
                   int max_span) {
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

/* One row of n values -> int8 q [n] and its scale d = absmax / 127, q = x / d rounded to the
 * nearest (ties to even), so that the row reads back as q * d (d = 0: all zeros). The same
 * operations as model/kv.py's quantize_rows, so both paths store the same bytes. A NaN in the
 * row makes amax, so d, NaN (as torch's amax does; fmaxf would skip it and store the NaN as a
 * finite value): q is then all zeros and the whole row reads back NaN. */
static void quantize_row(const float *x, int n, int8_t *q, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax;      /* once NaN, stays NaN */
    }
    float d = amax / 127.0f;
    *scale = d;
    for (int i = 0; i < n; i++) {
        float r = d > 0.0f ? nearbyintf(x[i] / d) : 0.0f;
        q[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
}

/* Write one kv head's key and value (fp32 [hd] each) at element `at` (slot_at) of layer L's
 * cache, in the cache's format: rounded to bf16 or quantized to int8 once, here. */
void kv_store(const Model *m, const Layer *L, long at, const float *k, const float *v) {
    int hd = m->head_dim;
    if (m->kv_type == KV_I8) {
        quantize_row(k, hd, (int8_t *)L->k_cache + at, L->k_scale + at / hd);
        quantize_row(v, hd, (int8_t *)L->v_cache + at, L->v_scale + at / hd);
    } else if (m->kv_type == KV_BF16) {
        uint16_t *kc = (uint16_t *)L->k_cache + at, *vc = (uint16_t *)L->v_cache + at;
        for (int i = 0; i < hd; i++) { kc[i] = to_bf16(k[i]); vc[i] = to_bf16(v[i]); }
    } else {
        memcpy((float *)L->k_cache + at, k, sizeof(float) * hd);
        memcpy((float *)L->v_cache + at, v, sizeof(float) * hd);
    }
}

/* The attention block of one layer for a caller that runs the rest of the layer itself (the
 * PyTorch path on the CPU: bf16 activations, or matrices no kernel covers): write the N new
 * tokens' keys and values (k, v [N, KV * hd], RoPE applied) into their slots of layer `layer`,
 * then out [N, H * hd] = each token's attention over its own sequence, as llama_forward
 * computes it. q, k, v and out are bf16 when the cache is (kv_type KV_BF16), else fp32 (an
 * fp32 or int8 cache); the arithmetic is fp32. Only the model's sizes, block table and layers' caches are read (weights may be NULL). */
void paged_attention(const Model *m, int layer, const Batch *b, const void *q, const void *k, const void *v,
                     void *out, int N) {
    if (N <= 0) return;
    const Layer *L = &m->layers[layer];
    int hd = m->head_dim, KV = m->n_kv, H = m->n_heads, bf16 = m->kv_type == KV_BF16, es = bf16 ? 2 : 4;
    long nq = (long)N * H * hd;
    TokenOf *who = malloc(sizeof(TokenOf) * N);
    int max_span = tokens_of(b, who);
    for (int n = 0; n < N; n++) {
        int sq = who[n].seq;
        for (int g = 0; g < KV; g++) {
            long at = slot_at(m, b->rows[sq], b->start[sq] + who[n].t, g), src = ((long)n * KV + g) * hd * es;
            if (!bf16) {                          /* fp32 rows: stored, or quantized */
                kv_store(m, L, at, (const float *)((const char *)k + src), (const float *)((const char *)v + src));
                continue;
            }
            at *= es;
            memcpy((char *)L->k_cache + at, (const char *)k + src, (size_t)es * hd);
            memcpy((char *)L->v_cache + at, (const char *)v + src, (size_t)es * hd);
        }
    }
    const float *qf = q;
    float *of = out;
    if (bf16) {
        float *wq = malloc(sizeof(float) * nq);
        for (long i = 0; i < nq; i++) {
            uint32_t u = (uint32_t)((const uint16_t *)q)[i] << 16;
            memcpy(wq + i, &u, 4);
        }
        qf = wq;
        of = malloc(sizeof(float) * nq);
    }
    float *scratch = malloc(sizeof(float) * attn_scratch(max_span) * omp_get_max_threads());
    #pragma omp parallel
    attention_for(m, L, b, qf, of, scratch, max_span);
    free(scratch);
    if (bf16) {
        for (long i = 0; i < nq; i++) ((uint16_t *)out)[i] = to_bf16(of[i]);
        free((void *)qf);
        free(of);
    }
    free(who);
}
