/* The lane helpers of the GGUF kernels (qgemm.c): the panel layout's sizes, the integer dot
 * products of one block against one activation row, and the float step (`epi`) that adds a
 * block's exact integer sum to an output's accumulator, in k order. Any other way of getting
 * the integer sums (AMX tiles were tried: bench/kernels) must end in the same step to stay
 * bit-identical.
 */
#ifndef SPECDEC_QLANES_H
#define SPECDEC_QLANES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define PANEL 16
#define RCH 64               /* rows per chunk: their accumulators stay in L1 */

/* Prepared bytes per panel and unit (32 k, or 256 for Q4_K); qformats.py writes this layout. */
static inline long unit_bytes(int fmt) {
    switch (fmt) {
    case Q8_0: return 512 + 32;                  /* int8 [8 quads][16][4], f16 d [16] */
    case Q4_0: return 256 + 32;                  /* nibbles [4][16][4], f16 d [16] */
    case Q4_1: return 256 + 64;                  /* nibbles, f16 d [16], f16 m [16] */
    case MXFP4: return 256 + 32;                 /* nibbles [4][16][4], u8 E8M0 e [16], 16 zero bytes */
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
static inline __attribute__((always_inline)) VI dot_u4(const VI w[8], const int8_t *x, int one_chain);

/* dot_u4 for bytes up to 24 (MXFP4's offset values): without VNNI the 16-bit pair sums of
 * 8 quads could reach 8 * 2 * 24 * 127 = 48768, so each half of the quads widens on its own. */
static inline __attribute__((always_inline)) VI dot_u24(const VI w[8], const int8_t *x, int one_chain) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return dot_u4(w, x, one_chain);
#elif defined(__AVX512F__)
    (void)one_chain;
    __m512i s = _mm512_maddubs_epi16(w[0], vset1(ld32(x))), t = _mm512_maddubs_epi16(w[4], vset1(ld32(x + 16)));
    for (int v = 1; v < 4; v++) {
        s = _mm512_add_epi16(s, _mm512_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
        t = _mm512_add_epi16(t, _mm512_maddubs_epi16(w[v + 4], vset1(ld32(x + 16 + 4 * v))));
    }
    return vadd32(_mm512_madd_epi16(s, _mm512_set1_epi16(1)), _mm512_madd_epi16(t, _mm512_set1_epi16(1)));
#else
    (void)one_chain;
    __m256i s = _mm256_maddubs_epi16(w[0], vset1(ld32(x))), t = _mm256_maddubs_epi16(w[4], vset1(ld32(x + 16)));
    for (int v = 1; v < 4; v++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[v + 4], vset1(ld32(x + 16 + 4 * v))));
    }
    return vadd32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) VI dot_u4(const VI w[8], const int8_t *x, int one_chain) {
#if defined(__AVX512VNNI__)
    if (one_chain) {        /* several rows in flight: their chains hide the latency, save the add */
        VI a = _mm512_dpbusd_epi32(vzero(), w[0], vset1(ld32(x)));
        for (int v = 1; v < 8; v++) a = _mm512_dpbusd_epi32(a, w[v], vset1(ld32(x + 4 * v)));
        return a;
    }
    VI a = _mm512_dpbusd_epi32(vzero(), w[0], vset1(ld32(x))), b = _mm512_dpbusd_epi32(vzero(), w[1], vset1(ld32(x + 4)));
    for (int v = 2; v < 8; v += 2) {
        a = _mm512_dpbusd_epi32(a, w[v], vset1(ld32(x + 4 * v)));
        b = _mm512_dpbusd_epi32(b, w[v + 1], vset1(ld32(x + 4 * v + 4)));
    }
    return vadd32(a, b);
#elif defined(__AVX512F__)
    (void)one_chain;
    /* 16-bit pair sums stay below 8 * 2 * 15 * 127 = 30480: add them before widening */
    __m512i s = _mm512_maddubs_epi16(w[0], vset1(ld32(x)));
    for (int v = 1; v < 8; v++) s = _mm512_add_epi16(s, _mm512_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
    return _mm512_madd_epi16(s, _mm512_set1_epi16(1));
#elif defined(__AVXVNNI__)
    (void)one_chain;
    VI a = _mm256_dpbusd_avx_epi32(vzero(), w[0], vset1(ld32(x))), b = _mm256_dpbusd_avx_epi32(vzero(), w[1], vset1(ld32(x + 4)));
    for (int v = 2; v < 8; v += 2) {
        a = _mm256_dpbusd_avx_epi32(a, w[v], vset1(ld32(x + 4 * v)));
        b = _mm256_dpbusd_avx_epi32(b, w[v + 1], vset1(ld32(x + 4 * v + 4)));
    }
    return vadd32(a, b);
#else
    (void)one_chain;
    __m256i s = _mm256_maddubs_epi16(w[0], vset1(ld32(x)));
    for (int v = 1; v < 8; v++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[v], vset1(ld32(x + 4 * v))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* Sum over 8 quads of w[v] (s8) . x (s8) per lane, exact. aux: per-ISA data shared by all rows
 * (VNNI-512: 128 * sum(w) per lane, since vpdpbusd takes x + 128 unsigned; else |w|). */
static inline __attribute__((always_inline)) VI dot_s8(const VI w[8], const VI aux[8], const int8_t *x, const int8_t *xu, int one_chain) {
#if defined(__AVX512VNNI__)
    (void)x;
    if (one_chain) {
        VI a = _mm512_dpbusd_epi32(vzero(), vset1(ld32(xu)), w[0]);
        for (int v = 1; v < 8; v++) a = _mm512_dpbusd_epi32(a, vset1(ld32(xu + 4 * v)), w[v]);
        return vsub32(a, aux[0]);
    }
    VI a = _mm512_dpbusd_epi32(vzero(), vset1(ld32(xu)), w[0]), b = _mm512_dpbusd_epi32(vzero(), vset1(ld32(xu + 4)), w[1]);
    for (int v = 2; v < 8; v += 2) {
        a = _mm512_dpbusd_epi32(a, vset1(ld32(xu + 4 * v)), w[v]);
        b = _mm512_dpbusd_epi32(b, vset1(ld32(xu + 4 * v + 4)), w[v + 1]);
    }
    return vsub32(vadd32(a, b), aux[0]);
#elif defined(__AVX512F__)
    /* no vpsignb in AVX-512: negate x where w < 0 with a byte mask, then |w| * that */
    (void)xu, (void)one_chain;
    __m512i acc = vzero();
    for (int v = 0; v < 8; v++) {
        __m512i xv = vset1(ld32(x + 4 * v));
        xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w[v]), _mm512_setzero_si512(), xv);
        acc = vadd32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(aux[v], xv), _mm512_set1_epi16(1)));
    }
    return acc;
#elif defined(__AVXVNNI__)
    (void)xu, (void)one_chain;
    VI a = vzero(), b = vzero();
    for (int v = 0; v < 8; v += 2) {
        a = _mm256_dpbusd_avx_epi32(a, aux[v], _mm256_sign_epi8(vset1(ld32(x + 4 * v)), w[v]));
        b = _mm256_dpbusd_avx_epi32(b, aux[v + 1], _mm256_sign_epi8(vset1(ld32(x + 4 * v + 4)), w[v + 1]));
    }
    return vadd32(a, b);
#else
    /* |w| * (x signed by w): 16-bit pair sums reach 2 * 128 * 127 = 32512, so widen per quad */
    (void)xu, (void)one_chain;
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

/* MXFP4: 4-bit indices -> FP4 E2M1 values doubled (ggml's kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8,
 * 12 and their negatives) plus 12, unsigned bytes 0..24, by a byte shuffle in each 128-bit
 * lane: the unsigned products of Q4_0 (dot_u24), then 12 * sum(x) taken off (epi), exactly. */
#define MXFP4_OFFSET 12
static inline void lut_mxfp4(VI w[8]) {
    const __m128i t = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
#if defined(__AVX512F__)
    const VI lut = _mm512_broadcast_i32x4(t);
    for (int v = 0; v < 8; v++) w[v] = _mm512_shuffle_epi8(lut, w[v]);
#else
    const VI lut = _mm256_broadcastsi128_si256(t);
    for (int v = 0; v < 8; v++) w[v] = _mm256_shuffle_epi8(lut, w[v]);
#endif
}

/* 16 (8) E8M0 bytes -> 2^(e - 128), the scale of the doubled values (ggml's
 * e8m0_to_fp32_half: subnormal for e < 2), exact. */
static inline VF load_e8m0_half(const uint8_t *p) {
#if defined(__AVX512F__)
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), big, small));
#else
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, is_small));
#endif
}

#define XQ4(row, blk) (a->q + (long)(row) * a->K + (long)(blk) * 32)
#define XU4(row, blk) ((const int8_t *)a->u + (long)(row) * a->K + (long)(blk) * 32)
#define AIX(row, blk) ((long)(row) * a->nb + (blk))

/* acc + one block's exact integer sum s (16 or 8 lanes) of row r, block blk, scaled: d is the
 * weights' scale (Q4_K: d * sc), m their offset (Q4_1: m; Q4_K: dmin * mn; else unused). */
static inline __attribute__((always_inline)) VF epi(int fmt, VF acc, VI s, VF d, VF m, const Act *a, int r, int blk) {
    if (fmt == Q4_0) s = vsub32(s, vset1(8 * a->s[AIX(r, blk)]));           /* (q - 8) * x */
    if (fmt == MXFP4) s = vsub32(s, vset1(MXFP4_OFFSET * a->s[AIX(r, blk)]));
    acc = ffma(fcvt(s), fmul(d, fset1(a->d[AIX(r, blk)])), acc);
    if (fmt == Q4_1) acc = ffma(m, fset1(a->ds[AIX(r, blk)]), acc);
    if (fmt == Q4_K) acc = ffnma(m, fset1(a->ds[AIX(r, blk)]), acc);
    return acc;
}

#endif
