/* Skinny matrix products for CPU decoding: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small.
 *
 * Decoding multiplies a handful of rows (1 for plain decoding, K+1 to verify K drafts) by
 * weights far larger than the caches, so the time is the weight bytes read from memory. BLAS
 * libraries tuned for big products pack w or re-read it per row and lose that; this kernel
 * streams each weight row from memory once and reuses it for every row of x (held in L1/L2),
 * so M = 2..8 costs well under M times what M = 1 does. Each output's sum runs in the same order
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

/* One weight row n against RM rows of x from m. A single sequential stream through w measured
 * fastest here; tiles of several weight rows (1 KB apart) ran 30-40% slower. Each x row keeps
 * U = 4 accumulators (k, k+8, k+16, k+24), so the FMA latency is hidden even for one row,
 * and RM <= 3 keeps 4 * RM accumulators in registers. The summation order (four interleaved
 * partial sums, then their pairwise total) is the same for every M: a token's logits do not
 * depend on the rows around it. */
#define U 4
static inline __attribute__((always_inline)) void
tile(const float *x, const void *w, int bf16, const float *bias, void *out, int out_bf16,
     long n, int m, int RM, int N, int K) {
    __m256 acc[3][U];
    for (int j = 0; j < RM; j++)
        for (int u = 0; u < U; u++) acc[j][u] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8 * U) {
        for (int u = 0; u < U; u++) {
            __m256 wv = load_w(w, bf16, n * K + k + 8 * u);
            for (int j = 0; j < RM; j++)
                acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (long)(m + j) * K + k + 8 * u), acc[j][u]);
        }
    }
    float b = bias ? bias[n] : 0.0f;
    for (int j = 0; j < RM; j++) {
        __m256 s = _mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]), _mm256_add_ps(acc[j][2], acc[j][3]));
        store(out, out_bf16, (long)(m + j) * N + n, hsum(s) + b);
    }
}

/* Requires K % 32 == 0 (the caller falls back to BLAS otherwise). */
void skinny_linear(const float *x, const void *w, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K) {
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        int m = 0;
        for (; m + 3 <= M; m += 3) tile(x, w, w_bf16, bias, out, out_bf16, n, m, 3, N, K);
        if (M - m == 2) tile(x, w, w_bf16, bias, out, out_bf16, n, m, 2, N, K);
        else if (M - m == 1) tile(x, w, w_bf16, bias, out, out_bf16, n, m, 1, N, K);
    }
}
