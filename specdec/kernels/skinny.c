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
 * fastest here; tiles of several weight rows (1 KB apart) ran 30-40% slower. Every x row has
 * one accumulator walked in k order: the same summation order for every M, which is what makes
 * a token's logits independent of the rows around it. (Unrolling k with more accumulators
 * for small M gained under 2% and would break that.) */
static inline __attribute__((always_inline)) void
tile(const float *x, const void *w, int bf16, const float *bias, void *out, int out_bf16,
     long n, int m, int RM, int N, int K) {
    __m256 acc[8];
    for (int j = 0; j < RM; j++) acc[j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        __m256 wv = load_w(w, bf16, n * K + k);
        for (int j = 0; j < RM; j++)
            acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (long)(m + j) * K + k), acc[j]);
    }
    float b = bias ? bias[n] : 0.0f;
    for (int j = 0; j < RM; j++) store(out, out_bf16, (long)(m + j) * N + n, hsum(acc[j]) + b);
}

/* Requires K % 8 == 0 (the caller falls back to BLAS otherwise). */
void skinny_linear(const float *x, const void *w, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K) {
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        int m = 0;
        for (; m + 8 <= M; m += 8) tile(x, w, w_bf16, bias, out, out_bf16, n, m, 8, N, K);
        switch (M - m) {   /* constant RM and U in each call: every loop unrolls */
        case 0: break;
        case 1: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 1, N, K); break;
        case 2: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 2, N, K); break;
        case 3: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 3, N, K); break;
        case 4: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 4, N, K); break;
        case 5: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 5, N, K); break;
        case 6: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 6, N, K); break;
        default: tile(x, w, w_bf16, bias, out, out_bf16, n, m, 7, N, K); break;
        }
    }
}
