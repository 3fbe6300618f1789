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

static inline uint16_t to_bf16(float f) {          /* round to nearest even, NaN kept NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline void store(void *out, int out_bf16, long i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = to_bf16(v);
    else ((float *)out)[i] = v;
}

/* Weights are packed at load into panels of 16 outputs: wp[p][k][i] = w[16p + i][k]
 * (kernels.pack). A panel streams sequentially from memory once per call; each k-slice (two
 * vectors) meets a broadcast x[m][k] for up to RM = 6 rows of x: 12 accumulators, 2 weight
 * vectors and a broadcast fill the 16 registers, and no horizontal sums are needed. Every
 * output is one FMA chain over k in order, the same for every M, so a token's logits do not
 * depend on the rows scored with it. BF16 and RM are compile-time constants in each call
 * (always_inline + the switches below), so the loops unroll with no branch inside. */
#define PANEL 16

static inline __attribute__((always_inline)) void
tile(const float *x, const void *wp, const float *bias, void *out, int out_bf16,
     long p, int m, int RM, int N, int K, int BF16) {
    __m256 acc[6][2];
    for (int j = 0; j < RM; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    const long base = p * K * PANEL;
    for (long k = 0; k < K; k++) {
        __m256 w0 = load_w(wp, BF16, base + k * PANEL), w1 = load_w(wp, BF16, base + k * PANEL + 8);
        for (int j = 0; j < RM; j++) {
            __m256 xb = _mm256_broadcast_ss(x + (long)(m + j) * K + k);
            acc[j][0] = _mm256_fmadd_ps(xb, w0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(xb, w1, acc[j][1]);
        }
    }
    /* All accumulators leave the registers here, in one go: an epilogue that kept some live
     * while it stored others made gcc hold them on the stack throughout the k loop (2x slower). */
    float res[6][PANEL];
    for (int j = 0; j < RM; j++) {
        _mm256_storeu_ps(res[j], acc[j][0]);
        _mm256_storeu_ps(res[j] + 8, acc[j][1]);
    }
    long n0 = p * PANEL;
    int width = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    for (int j = 0; j < RM; j++)
        for (int i = 0; i < width; i++)
            store(out, out_bf16, (long)(m + j) * N + n0 + i, res[j][i] + (bias ? bias[n0 + i] : 0.0f));
}

#define PANEL_ROWS(BF16)                                                                  \
    for (; m + 6 <= M; m += 6) tile(x, wp, bias, out, out_bf16, p, m, 6, N, K, BF16);     \
    switch (M - m) {                                                                      \
    case 0: break;                                                                        \
    case 1: tile(x, wp, bias, out, out_bf16, p, m, 1, N, K, BF16); break;                \
    case 2: tile(x, wp, bias, out, out_bf16, p, m, 2, N, K, BF16); break;                \
    case 3: tile(x, wp, bias, out, out_bf16, p, m, 3, N, K, BF16); break;                \
    case 4: tile(x, wp, bias, out, out_bf16, p, m, 4, N, K, BF16); break;                \
    default: tile(x, wp, bias, out, out_bf16, p, m, 5, N, K, BF16); break;               \
    }

/* x [M, K] fp32; wp packed [ceil(N / 16), K, 16], bf16 or fp32; out [M, N] fp32 or bf16. */
void skinny_linear(const float *x, const void *wp, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K) {
    long panels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        int m = 0;
        if (w_bf16) { PANEL_ROWS(1) } else { PANEL_ROWS(0) }
    }
}
