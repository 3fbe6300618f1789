/* Skinny matrix products for CPU decoding: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small.
 *
 * Decoding multiplies a handful of rows (1 for plain decoding, K+1 to verify K drafts) by
 * weights far larger than the caches, so the time is the weight bytes read from memory. BLAS
 * libraries tuned for big products lose that at small M; this kernel streams each weight panel
 * from memory once and reuses it for every row of x, so M = 2..6 costs little more than M = 1
 * where memory, not arithmetic, is the limit. Each output's sum runs in the same order
 * whatever M is: scoring a token alone or among K drafts gives bit-identical logits.
 * bf16 weights are widened to fp32 in registers (a 16-bit shift); accumulation is fp32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

static inline __m256 load_w(const void *w, int bf16, long i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void store(void *out, int out_bf16, long i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = to_bf16(v);
    else ((float *)out)[i] = v;
}

/* Weights are packed at load into panels of 16 outputs: wp[p][k][i] = w[16p + i][k]
 * (kernels.pack). A panel streams sequentially from memory once per call; each k-slice meets
 * a broadcast x[m][k] for up to RM rows of x. Every output is one FMA chain over k in order,
 * the same for every M and for every instruction set (AVX2 holds a panel in two 8-lane
 * vectors, AVX-512 in one 16-lane vector: the lanes are outputs, so the chains are the same),
 * so a token's logits depend neither on the rows scored with it nor on the CPU's vector width.
 * BF16, RM and PN are compile-time constants in each call (always_inline + the switches below),
 * so the loops unroll with no branch inside. */
#define PANEL 16

/* All accumulators leave the registers in one go, then the epilogue adds the bias: an epilogue
 * that kept some live while it stored others made gcc hold them on the stack throughout the k
 * loop (2x slower). */
static __attribute__((noinline)) void   /* one copy: it runs once per tile, not per k */
store_tile(float res[][PANEL], const float *bias, void *out, int out_bf16, long p, int m, int RM, int N) {
    long n0 = p * PANEL;
    int width = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    for (int j = 0; j < RM; j++)
        for (int i = 0; i < width; i++)
            store(out, out_bf16, (long)(m + j) * N + n0 + i, res[j][i] + (bias ? bias[n0 + i] : 0.0f));
}

#define MAXPN 4

/* Each panel's weights are prefetched PF k-steps ahead (4 KiB fp32, 2 KiB bf16): with several
 * rows the k loop is busy with FMAs and the hardware prefetcher alone let the memory stream
 * stall (SmolLM2's products, 9 rows, one thread: 1.3x faster with it; see bench/kernels). A
 * prefetch past the end of the weights does not fault. */
#define PF 64
static inline void prefetch_w(const void *w, int bf16, long i) {
    _mm_prefetch((const char *)w + i * (bf16 ? 2 : 4), _MM_HINT_T0);
}
#if defined(__AVX512F__)
#define MAXRM 12        /* 32 registers: up to 24 accumulators (12 rows x 2 panels), weights, a broadcast */

static inline __m512 load_w16(const void *w, int bf16, long i) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + i);
}

/* PN panels at once: their FMA chains are independent, so with few rows the ~4-cycle FMA
 * latency does not bound the product (2 FMA ports x 4 cycles want 8 chains in flight). */
static inline __attribute__((always_inline)) void
tile(const float *x, const void *wp, const float *bias, void *out, int out_bf16,
     long p, int m, int RM, int PN, int N, int K, int BF16) {
    __m512 acc[MAXPN][MAXRM];
    for (int q = 0; q < PN; q++)
        for (int j = 0; j < RM; j++) acc[q][j] = _mm512_setzero_ps();
    const long base = p * K * PANEL;
    for (long k = 0; k < K; k++) {
        __m512 w[MAXPN];
        if ((k & (BF16 ? 1 : 0)) == 0)        /* a 64-byte line per panel every 1 (fp32) or 2 (bf16) k */
            for (int q = 0; q < PN; q++) prefetch_w(wp, BF16, base + (q * K + k + PF) * PANEL);
        for (int q = 0; q < PN; q++) w[q] = load_w16(wp, BF16, base + (q * K + k) * PANEL);
        for (int j = 0; j < RM; j++) {
            __m512 xb = _mm512_set1_ps(x[(long)(m + j) * K + k]);
            for (int q = 0; q < PN; q++) acc[q][j] = _mm512_fmadd_ps(xb, w[q], acc[q][j]);
        }
    }
    for (int q = 0; q < PN; q++) {
        float res[MAXRM][PANEL];
        for (int j = 0; j < RM; j++) _mm512_storeu_ps(res[j], acc[q][j]);
        store_tile(res, bias, out, out_bf16, p + q, m, RM, N);
    }
}
#else
#define MAXRM 6         /* 16 registers: up to 12 accumulators (6 rows x 1 panel x 2 halves), weights, a broadcast */

static inline __attribute__((always_inline)) void
tile(const float *x, const void *wp, const float *bias, void *out, int out_bf16,
     long p, int m, int RM, int PN, int N, int K, int BF16) {
    __m256 acc[MAXPN][MAXRM][2];
    for (int q = 0; q < PN; q++)
        for (int j = 0; j < RM; j++) acc[q][j][0] = acc[q][j][1] = _mm256_setzero_ps();
    const long base = p * K * PANEL;
    for (long k = 0; k < K; k++) {
        __m256 w[MAXPN][2];
        if ((k & (BF16 ? 1 : 0)) == 0)        /* a 64-byte line per panel every 1 (fp32) or 2 (bf16) k */
            for (int q = 0; q < PN; q++) prefetch_w(wp, BF16, base + (q * K + k + PF) * PANEL);
        for (int q = 0; q < PN; q++) {
            w[q][0] = load_w(wp, BF16, base + (q * K + k) * PANEL);
            w[q][1] = load_w(wp, BF16, base + (q * K + k) * PANEL + 8);
        }
        for (int j = 0; j < RM; j++) {
            __m256 xb = _mm256_broadcast_ss(x + (long)(m + j) * K + k);
            for (int q = 0; q < PN; q++) {
                acc[q][j][0] = _mm256_fmadd_ps(xb, w[q][0], acc[q][j][0]);
                acc[q][j][1] = _mm256_fmadd_ps(xb, w[q][1], acc[q][j][1]);
            }
        }
    }
    for (int q = 0; q < PN; q++) {
        float res[MAXRM][PANEL];
        for (int j = 0; j < RM; j++) {
            _mm256_storeu_ps(res[j], acc[q][j][0]);
            _mm256_storeu_ps(res[j] + 8, acc[q][j][1]);
        }
        store_tile(res, bias, out, out_bf16, p + q, m, RM, N);
    }
}
#endif

#define T(RM, PN) tile(x, wp, bias, out, out_bf16, p, m, RM, PN, N, K, BF16)

/* One group of PN panels, all M rows, in tiles of up to MAXRM rows. */
#define ROWS_ABOVE_5(PN) case 6: T(6, PN); break; case 7: T(7, PN); break; case 8: T(8, PN); break; \
    case 9: T(9, PN); break; case 10: T(10, PN); break; default: T(11, PN); break;
#define PANEL_ROWS(PN)                                                                    \
    for (; m + MAXRM <= M; m += MAXRM) T(MAXRM, PN);                                      \
    switch (M - m) {                                                                      \
    case 0: break;                                                                        \
    case 1: T(1, PN); break;                                                              \
    case 2: T(2, PN); break;                                                              \
    case 3: T(3, PN); break;                                                              \
    case 4: T(4, PN); break;                                                              \
    case 5: T(5, PN); break;                                                              \
    ROWS_ABOVE_5_IF(PN)                                                                   \
    }

#if MAXRM > 6
#define ROWS_ABOVE_5_IF(PN) ROWS_ABOVE_5(PN)
#else
#define ROWS_ABOVE_5_IF(PN)
#endif

/* Panels per group for M rows: enough independent FMA chains (rows x panels x vectors per
 * panel) to cover the FMA latency, within the registers. Which panels share a group changes
 * nothing in any output's sum. */
static inline int group_of(int M) {
#if defined(__AVX512F__)
    return M <= 2 ? 4 : M <= 8 ? 3 : 2;
#else
    return M == 1 ? 4 : M == 2 ? 2 : 1;
#endif
}

static inline __attribute__((always_inline)) void panels(const float *x, const void *wp, const float *bias, void *out, int out_bf16,
                   int M, int N, int K, long p, int pn, int BF16) {
    int m = 0;
    switch (pn) {
    case 1: { PANEL_ROWS(1) } break;
    case 2: { PANEL_ROWS(2) } break;
    case 3: { PANEL_ROWS(3) } break;
    default: { PANEL_ROWS(4) } break;
    }
}

static void panels_for(const float *x, const void *wp, int w_bf16, const float *bias, void *out, int out_bf16,
                       int M, int N, int K) {
    long panel_count = (N + PANEL - 1) / PANEL;
    long step = group_of(M);
    long iters = (panel_count + step - 1) / step;
    #pragma omp for schedule(static)
    for (long it = 0; it < iters; it++) {
        long p = it * step;
        int pn = (int)(panel_count - p < step ? panel_count - p : step);     /* the last group may be short */
        if (w_bf16) panels(x, wp, bias, out, out_bf16, M, N, K, p, pn, 1);
        else panels(x, wp, bias, out, out_bf16, M, N, K, p, pn, 0);
    }
}

/* The same product with fp32 output, its panels split across the enclosing team (kernels.h). */
void skinny_for(const float *x, const void *wp, int w_bf16, const float *bias, float *out, int M, int N, int K) {
    panels_for(x, wp, w_bf16, bias, out, 0, M, N, K);
}

/* x [M, K] fp32; wp packed [ceil(N / 16), K, 16], bf16 or fp32; out [M, N] fp32 or bf16. */
void skinny_linear(const float *x, const void *wp, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K) {
    #pragma omp parallel
    panels_for(x, wp, w_bf16, bias, out, out_bf16, M, N, K);
}
