/* Skinny products with GGUF-quantized weights: out[M, N] = x[M, K] @ dequant(w)^T (+ bias).
 *
 * Weights keep llama.cpp's block quantization (Q8_0, Q4_0, Q4_1: blocks of 32 along k; Q4_K:
 * super-blocks of 256 with 6-bit scales and mins per 32) but are repacked once
 * (kernels/qformats.py) into panels of 16 outputs whose bytes are interleaved the way the
 * integer dot-product instructions want them: each 4-byte group is 4 consecutive k of one
 * output, so one VNNI `vpdpbusd` (or AVX2 `maddubs` + `madd`) against 4 broadcast activation
 * bytes gives 16 outputs' partial sums in 16 lanes with no horizontal reduction. 4-bit panels
 * are a pure byte permutation of the file's blocks (a byte keeps its two nibbles), and the
 * per-block scales of 16 outputs sit next to their nibbles, so a panel streams sequentially.
 *
 * Activations are quantized like llama.cpp's Q8_0 (per row and block of 32: d = max|x| / 127,
 * q = round-to-even(x / d)), which depends only on the row itself. Integer block sums are exact,
 * and each output then accumulates its blocks' float terms in k order with the same
 * instructions whatever M is and whichever instruction set runs (AVX2's 8-lane halves do per
 * lane what AVX-512 does in 16 lanes), so a row's result is bit-identical alone, among M
 * rows, and across variants.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define PANEL 16
#define RCH 64               /* rows per chunk: their accumulators stay in L1 */

/* Prepared bytes per panel and unit (32 k, or 256 for Q4_K); qformats.py writes this layout. */
static long unit_bytes(int fmt) {
    switch (fmt) {
    case Q8_0: return 512 + 32;                  /* int8 [8 quads][16][4], f16 d [16] */
    case Q4_0: return 256 + 32;                  /* nibbles [4][16][4], f16 d [16] */
    case Q4_1: return 256 + 64;                  /* nibbles, f16 d [16], f16 m [16] */
    default: return 2048 + 64 + 256;             /* nibbles [4 chunks][8][16][4], f16 d, dmin [16], u8 sc, m [8][16] */
    }
}

static inline int32_t ld32(const int8_t *p) {   /* 4 activation bytes as one int (no aliasing) */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- lanes: one 16-lane vector per panel (AVX-512) or two 8-lane halves (AVX2) ---- */
#if defined(__AVX512F__)
#define LANES 16
#define NH 1
typedef __m512i VI;
typedef __m512 VF;
#define vload(p) _mm512_loadu_si512((const void *)(p))
#define vset1(i) _mm512_set1_epi32(i)
#define vand(a, b) _mm512_and_si512(a, b)
#define vsrl16(a, n) _mm512_srli_epi16(a, n)
#define vadd32(a, b) _mm512_add_epi32(a, b)
#define vsub32(a, b) _mm512_sub_epi32(a, b)
#define vzero() _mm512_setzero_si512()
#define fset1(f) _mm512_set1_ps(f)
#define fzero() _mm512_setzero_ps()
#define fmul(a, b) _mm512_mul_ps(a, b)
#define ffma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ffnma(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define fcvt(a) _mm512_cvtepi32_ps(a)
#define fstore(p, a) _mm512_storeu_ps(p, a)
static inline VF load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline VF load_u8f(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
#else
#define LANES 8
#define NH 2
typedef __m256i VI;
typedef __m256 VF;
#define vload(p) _mm256_loadu_si256((const __m256i *)(p))
#define vset1(i) _mm256_set1_epi32(i)
#define vand(a, b) _mm256_and_si256(a, b)
#define vsrl16(a, n) _mm256_srli_epi16(a, n)
#define vadd32(a, b) _mm256_add_epi32(a, b)
#define vsub32(a, b) _mm256_sub_epi32(a, b)
#define vzero() _mm256_setzero_si256()
#define fset1(f) _mm256_set1_ps(f)
#define fzero() _mm256_setzero_ps()
#define fmul(a, b) _mm256_mul_ps(a, b)
#define ffma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ffnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define fcvt(a) _mm256_cvtepi32_ps(a)
#define fstore(p, a) _mm256_storeu_ps(p, a)
static inline VF load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline VF load_u8f(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
#endif

/* Sum over the block's 8 quads of w[v] (u8, < 16) . x[4v .. 4v+3] (s8) per lane: exact. */
static inline VI dot_u4(const VI w[8], const int8_t *x) {
#if defined(__AVX512VNNI__)
    VI a = _mm512_dpbusd_epi32(vzero(), w[0], vset1(ld32(x))), b = _mm512_dpbusd_epi32(vzero(), w[1], vset1(ld32(x + 4)));
    for (int v = 2; v < 8; v += 2) {
        a = _mm512_dpbusd_epi32(a, w[v], vset1(ld32(x + 4 * v)));
        b = _mm512_dpbusd_epi32(b, w[v + 1], vset1(ld32(x + 4 * v + 4)));
    }
    return vadd32(a, b);
#elif defined(__AVX512F__)
    /* 16-bit pair sums stay below 8 * 2 * 15 * 127 = 30480: add them before widening */
    __m512i s = _mm512_maddubs_epi16(w[0], vset1(ld32(x)));
    for (int v = 1; v < 8; v++) s = _mm512_add_epi16(s, _mm512_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
    return _mm512_madd_epi16(s, _mm512_set1_epi16(1));
#elif defined(__AVXVNNI__)
    VI a = _mm256_dpbusd_avx_epi32(vzero(), w[0], vset1(ld32(x))), b = _mm256_dpbusd_avx_epi32(vzero(), w[1], vset1(ld32(x + 4)));
    for (int v = 2; v < 8; v += 2) {
        a = _mm256_dpbusd_avx_epi32(a, w[v], vset1(ld32(x + 4 * v)));
        b = _mm256_dpbusd_avx_epi32(b, w[v + 1], vset1(ld32(x + 4 * v + 4)));
    }
    return vadd32(a, b);
#else
    __m256i s = _mm256_maddubs_epi16(w[0], vset1(ld32(x)));
    for (int v = 1; v < 8; v++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* Sum over 8 quads of w[v] (s8) . x (s8) per lane, exact. aux: per-ISA data shared by all rows
 * (VNNI-512: 128 * sum(w) per lane, since vpdpbusd takes x + 128 unsigned; else |w|). */
static inline VI dot_s8(const VI w[8], const VI aux[8], const int8_t *x, const int8_t *xu) {
#if defined(__AVX512VNNI__)
    (void)x;
    VI a = _mm512_dpbusd_epi32(vzero(), vset1(ld32(xu)), w[0]), b = _mm512_dpbusd_epi32(vzero(), vset1(ld32(xu + 4)), w[1]);
    for (int v = 2; v < 8; v += 2) {
        a = _mm512_dpbusd_epi32(a, vset1(ld32(xu + 4 * v)), w[v]);
        b = _mm512_dpbusd_epi32(b, vset1(ld32(xu + 4 * v + 4)), w[v + 1]);
    }
    return vsub32(vadd32(a, b), aux[0]);
#elif defined(__AVX512F__)
    /* no vpsignb in AVX-512: negate x where w < 0 with a byte mask, then |w| * that */
    (void)xu;
    __m512i acc = vzero();
    for (int v = 0; v < 8; v++) {
        __m512i xv = vset1(ld32(x + 4 * v));
        xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w[v]), _mm512_setzero_si512(), xv);
        acc = vadd32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(aux[v], xv), _mm512_set1_epi16(1)));
    }
    return acc;
#elif defined(__AVXVNNI__)
    (void)xu;
    VI a = vzero(), b = vzero();
    for (int v = 0; v < 8; v += 2) {
        a = _mm256_dpbusd_avx_epi32(a, aux[v], _mm256_sign_epi8(vset1(ld32(x + 4 * v)), w[v]));
        b = _mm256_dpbusd_avx_epi32(b, aux[v + 1], _mm256_sign_epi8(vset1(ld32(x + 4 * v + 4)), w[v + 1]));
    }
    return vadd32(a, b);
#else
    /* |w| * (x signed by w): 16-bit pair sums reach 2 * 128 * 127 = 32512, so widen per quad */
    (void)xu;
    __m256i acc = vzero();
    for (int v = 0; v < 8; v++) {
        __m256i p = _mm256_maddubs_epi16(aux[v], _mm256_sign_epi8(vset1(ld32(x + 4 * v)), w[v]));
        acc = vadd32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
    return acc;
#endif
}

static inline void s8_aux(const VI w[8], VI aux[8]) {
#if defined(__AVX512VNNI__)
    VI s = vzero();
    for (int v = 0; v < 8; v++) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi8(1), w[v]);
    aux[0] = _mm512_slli_epi32(s, 7);
#elif defined(__AVX512F__)
    for (int v = 0; v < 8; v++) aux[v] = _mm512_abs_epi8(w[v]);
#else
    for (int v = 0; v < 8; v++) aux[v] = _mm256_abs_epi8(w[v]);
#endif
}

/* The 8 quads of a 4-bit block: vector v holds quad v in its low nibbles, quad v + 4 (Q4_0,
 * Q4_1: elements 16..31) or the other sub-block (Q4_K, hi = 1) in its high nibbles. */
static inline void unpack4(const uint8_t *raw, int nvec, int shift, VI w[8]) {
    const VI lo = vset1(0x0f0f0f0f);
    for (int v = 0; v < nvec; v++) {
        VI r = vload(raw + v * PANEL * 4);
        if (nvec == 4) {
            w[v] = vand(r, lo);
            w[v + 4] = vand(vsrl16(r, 4), lo);
        } else {
            w[v] = vand(shift ? vsrl16(r, 4) : r, lo);
        }
    }
}

#define XQ4(row, blk) (a->q + (long)(row) * a->K + (long)(blk) * 32)
#define XU4(row, blk) ((const int8_t *)a->u + (long)(row) * a->K + (long)(blk) * 32)
#define AIX(row, blk) ((long)(row) * a->nb + (blk))

/* acc[j][h] += the panel's contribution for rows m0 .. m0 + mr - 1, block by block in k order. */
static inline __attribute__((always_inline)) void panel_q(int fmt, const uint8_t *pw, const Act *a, int m0, int mr, VF acc[][NH]) {
    const long ub = unit_bytes(fmt);
    const int units = fmt == Q4_K ? a->nb / 8 : a->nb;
    for (int b = 0; b < units; b++) {
        const uint8_t *u = pw + b * ub;
        for (int h = 0; h < NH; h++) {
            const int off = h * LANES * 4;
            VI w[8], aux[8];
            if (fmt == Q8_0) {
                for (int v = 0; v < 8; v++) w[v] = vload(u + off + v * PANEL * 4);
                s8_aux(w, aux);
                VF d = load_f16((const uint16_t *)(u + 512) + h * LANES);
                for (int j = 0; j < mr; j++) {
                    int r = m0 + j;
                    VI s = dot_s8(w, aux, XQ4(r, b), XU4(r, b));
                    acc[j][h] = ffma(fcvt(s), fmul(d, fset1(a->d[AIX(r, b)])), acc[j][h]);
                }
            } else if (fmt == Q4_0 || fmt == Q4_1) {
                unpack4(u + off, 4, 0, w);
                VF d = load_f16((const uint16_t *)(u + 256) + h * LANES);
                VF m = fmt == Q4_1 ? load_f16((const uint16_t *)(u + 288) + h * LANES) : fzero();
                for (int j = 0; j < mr; j++) {
                    int r = m0 + j;
                    VI s = dot_u4(w, XQ4(r, b));
                    if (fmt == Q4_0) s = vsub32(s, vset1(8 * a->s[AIX(r, b)]));   /* (q - 8) * x */
                    acc[j][h] = ffma(fcvt(s), fmul(d, fset1(a->d[AIX(r, b)])), acc[j][h]);
                    if (fmt == Q4_1) acc[j][h] = ffma(m, fset1(a->ds[AIX(r, b)]), acc[j][h]);
                }
            } else {
                VF d = load_f16((const uint16_t *)(u + 2048) + h * LANES);
                VF dmin = load_f16((const uint16_t *)(u + 2080) + h * LANES);
                for (int sb = 0; sb < 8; sb++) {      /* sub-block sb: chunk sb / 2, nibble sb % 2 */
                    unpack4(u + (sb / 2) * 8 * PANEL * 4 + off, 8, sb % 2, w);
                    VF sc = fmul(d, load_u8f(u + 2112 + sb * PANEL + h * LANES));      /* exact */
                    VF mn = fmul(dmin, load_u8f(u + 2240 + sb * PANEL + h * LANES));   /* exact */
                    int blk = b * 8 + sb;
                    for (int j = 0; j < mr; j++) {
                        int r = m0 + j;
                        VI s = dot_u4(w, XQ4(r, blk));
                        acc[j][h] = ffma(fcvt(s), fmul(sc, fset1(a->d[AIX(r, blk)])), acc[j][h]);
                        acc[j][h] = ffnma(mn, fset1(a->ds[AIX(r, blk)]), acc[j][h]);
                    }
                }
            }
        }
    }
}

/* Scratch for M rows of K activations: q and u [M, K] bytes, then d, s, ds [M, K / 32] */
long quant_act_bytes(int M, int K) { return (long)M * K * 2 + (long)M * (K / 32) * 12; }

Act quant_act(void *scratch, int M, int K) {
    char *p = scratch;
    long nb = K / 32, mk = (long)M * K;
    return (Act){(int8_t *)p, (uint8_t *)p + mk, (float *)(p + 2 * mk), (float *)(p + 2 * mk + M * nb * 4),
                 (int32_t *)(p + 2 * mk + M * nb * 8), K, (int)nb};
}

/* Per row and block of 32: d = max|x| / 127, q = round-to-even(x / d) (x * (1 / d), as llama.cpp). */
void quantize_rows_for(const float *x, int M, Act *a) {
    int K = a->K, nb = a->nb;
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (long)r * K + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                float v = nearbyintf(xb[i] * id);
                int qi = v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v;
                a->q[(long)r * K + b * 32 + i] = (int8_t)qi;
                a->u[(long)r * K + b * 32 + i] = (uint8_t)(qi + 128);
                sum += qi;
            }
            long k = (long)r * nb + b;
            a->d[k] = db;
            a->s[k] = sum;
            a->ds[k] = db * (float)sum;
        }
    }
}

/* out[M, N] = the quantized rows a against the prepared panels pw (+ bias), panels split
 * across the team. */
void quant_panels_for(const Act *a, const uint8_t *pw, int fmt, const float *bias, float *out, int M, int N) {
    long panels = (N + PANEL - 1) / PANEL;
    long panel_bytes = unit_bytes(fmt) * (fmt == Q4_K ? a->nb / 8 : a->nb);
    #pragma omp for schedule(static)
    for (long p = 0; p < panels; p++) {
        VF acc[RCH][NH];
        float res[PANEL];
        int width = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
        for (int m0 = 0; m0 < M; m0 += RCH) {
            int mr = M - m0 < RCH ? M - m0 : RCH;
            for (int j = 0; j < mr; j++)
                for (int h = 0; h < NH; h++) acc[j][h] = fzero();
            const uint8_t *pp = pw + p * panel_bytes;
            switch (fmt) {      /* a constant format in each inlined copy: no branch per block */
            case Q8_0: panel_q(Q8_0, pp, a, m0, mr, acc); break;
            case Q4_0: panel_q(Q4_0, pp, a, m0, mr, acc); break;
            case Q4_1: panel_q(Q4_1, pp, a, m0, mr, acc); break;
            default: panel_q(Q4_K, pp, a, m0, mr, acc); break;
            }
            for (int j = 0; j < mr; j++) {
                for (int h = 0; h < NH; h++) fstore(res + h * LANES, acc[j][h]);
                float *o = out + (long)(m0 + j) * N + p * PANEL;
                for (int i = 0; i < width; i++) o[i] = res[i] + (bias ? bias[p * PANEL + i] : 0.0f);
            }
        }
    }
}

/* x [M, K] fp32; pw the prepared panels (kernels/qformats.py); bias [N] or NULL; out [M, N].
 * K % 32 == 0 (K % 256 for Q4_K). Returns 0, or -1 when scratch memory runs out. */
int quant_linear(const float *x, const uint8_t *pw, int fmt, const float *bias, float *out, int M, int N, int K) {
    void *scratch = malloc(quant_act_bytes(M, K));
    if (!scratch) return -1;
    Act a = quant_act(scratch, M, K);
    #pragma omp parallel
    {
        quantize_rows_for(x, M, &a);
        quant_panels_for(&a, pw, fmt, bias, out, M, N);
    }
    free(scratch);
    return 0;
}

long quant_panel_bytes(int fmt, int K) { return unit_bytes(fmt) * (fmt == Q4_K ? K / 256 : K / 32); }

static float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The same operations, in the same order, as model/quant.py (each a separate rounding). */
void dequant_row(int fmt, const uint8_t *row, float *out, int K) {
    if (fmt == Q4_K) {
        for (int b = 0; b < K / 256; b++) {
            const uint8_t *blk = row + b * 144, *p = blk + 4, *qs = blk + 16;
            float d = half(blk), dmin = half(blk + 2);
            for (int j = 0; j < 8; j++) {
                int sc = j < 4 ? p[j] & 63 : (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
                int mn = j < 4 ? p[j + 4] & 63 : (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
                float scale = d * (float)sc, offset = dmin * (float)mn;
                for (int i = 0; i < 32; i++) {
                    int byte = qs[(j / 2) * 32 + i], q = j % 2 ? byte >> 4 : byte & 15;
                    out[b * 256 + j * 32 + i] = scale * (float)q - offset;
                }
            }
        }
        return;
    }
    int bytes = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        float d = half(blk);
        for (int i = 0; i < 32; i++) {
            float *o = out + b * 32 + i;
            if (fmt == Q8_0) *o = (float)(int8_t)blk[2 + i] * d;
            else {
                int byte = blk[(fmt == Q4_1 ? 4 : 2) + i % 16], q = i < 16 ? byte & 15 : byte >> 4;
                *o = fmt == Q4_0 ? d * (float)(q - 8) : d * (float)q + half(blk + 2);
            }
        }
    }
}
