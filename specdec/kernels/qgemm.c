/* Skinny products with GGUF-quantized weights: out[M, N] = x[M, K] @ dequant(w)^T (+ bias).
 *
 * Weights keep llama.cpp's block quantization (Q8_0, Q4_0, Q4_1, MXFP4: blocks of 32 along k;
 * Q4_K: super-blocks of 256 with 6-bit scales and mins per 32) but are repacked once
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
#include <math.h>
#include <stdlib.h>

#include "qlanes.h"

#define RCH 64               /* rows per chunk: their accumulators stay in L1 */
#define PCH 32               /* rows per chunk of a longer product (prefill) */
/* The panel bytes ~2 KiB ahead are prefetched (whole units): with several rows the block loop
 * is busy with dot products and the hardware prefetcher alone let the memory stream stall (as
 * in skinny.c). The panels of a matrix are contiguous, so near a panel's end this fetches the
 * next one's start; past the end of the weights a prefetch does not fault. */
#define PF_BYTES 2048

#if defined(__AVX512F__)
#define FEW 12               /* 32 registers: 12 rows' accumulators, 8 weight vectors, broadcasts */
#else
#define FEW 8
#endif

/* The accumulator an output's next block adds to: +0 before its first block (a register zero:
 * no memset of up to 64 rows' L1 accumulators per panel first, a few % at 16-64 rows on the
 * Xeon), acc[j][h] after. */
#define ACC(j, h) (FIRST ? fzero() : acc[j][h])

/* acc[j][h] (+)= unit b of the panel for rows m0 .. m0 + mr - 1; FIRST: b is the first unit. */
static inline __attribute__((always_inline)) void
unit_q(int fmt, const uint8_t *pw, long ub, int b, const Act *a, int m0, int mr, VF acc[][NH], int FIRST) {
    const uint8_t *u = pw + b * ub;
    const long ahead = ub >= PF_BYTES ? ub : (PF_BYTES / ub) * ub;
    for (long o = 0; o < ub; o += 64) _mm_prefetch((const char *)u + ahead + o, _MM_HINT_T0);
    for (int h = 0; h < NH; h++) {
        const int off = h * LANES * 4;
        VI w[8], aux[8];
        if (fmt == Q8_0) {
            for (int v = 0; v < 8; v++) w[v] = vload(u + off + v * PANEL * 4);
            s8_aux(w, aux);
            VF d = load_f16((const uint16_t *)(u + 512) + h * LANES);
            for (int j = 0; j < mr; j++)
                acc[j][h] = epi(Q8_0, ACC(j, h), dot_s8(w, aux, XQ4(m0 + j, b), XU4(m0 + j, b), mr > 1), d, d, a, m0 + j, b);
        } else if (fmt == MXFP4) {     /* Q4_0's nibbles through the FP4 table (offset: unsigned) */
            unpack4(u + off, 4, 0, w);
            lut_mxfp4(w);
            VF d = load_e8m0_half(u + 256 + h * LANES);
            for (int j = 0; j < mr; j++)
                acc[j][h] = epi(MXFP4, ACC(j, h), dot_u24(w, XQ4(m0 + j, b), mr > 1), d, d, a, m0 + j, b);
        } else if (fmt == Q4_0 || fmt == Q4_1) {
            unpack4(u + off, 4, 0, w);
            VF d = load_f16((const uint16_t *)(u + 256) + h * LANES);
            VF m = fmt == Q4_1 ? load_f16((const uint16_t *)(u + 288) + h * LANES) : fzero();
            for (int j = 0; j < mr; j++)
                acc[j][h] = epi(fmt, ACC(j, h), dot_u4(w, XQ4(m0 + j, b), mr > 1), d, m, a, m0 + j, b);
        } else {
            VF d = load_f16((const uint16_t *)(u + 2048) + h * LANES);
            VF dmin = load_f16((const uint16_t *)(u + 2080) + h * LANES);
            for (int sb = 0; sb < 8; sb++) {      /* sub-block sb: chunk sb / 2, nibble sb % 2 */
                unpack4(u + (sb / 2) * 8 * PANEL * 4 + off, 8, sb % 2, w);
                VF sc = fmul(d, load_u8f(u + 2112 + sb * PANEL + h * LANES));      /* exact */
                VF mn = fmul(dmin, load_u8f(u + 2240 + sb * PANEL + h * LANES));   /* exact */
                int blk = b * 8 + sb;
                for (int j = 0; j < mr; j++)
                    acc[j][h] = epi(Q4_K, FIRST && sb == 0 ? fzero() : acc[j][h], dot_u4(w, XQ4(m0 + j, blk), mr > 1),
                                    sc, mn, a, m0 + j, blk);
            }
        }
    }
}
#undef ACC

/* acc[j][h] = the panel's contribution for rows m0 .. m0 + mr - 1, block by block in k order. */
static inline __attribute__((always_inline)) void panel_q(int fmt, const uint8_t *pw, const Act *a, int m0, int mr, VF acc[][NH]) {
    const long ub = unit_bytes(fmt);
    const int units = fmt == Q4_K ? a->nb / 8 : a->nb;
    unit_q(fmt, pw, ub, 0, a, m0, mr, acc, 1);
    for (int b = 1; b < units; b++) unit_q(fmt, pw, ub, b, a, m0, mr, acc, 0);
}

/* Scratch for M rows of K activations: q and u [M, K] bytes, then d, s, ds [M, K / 32] */
long quant_act_bytes(int M, int K) { return (long)M * K * 2 + (long)M * (K / 32) * 12; }

Act quant_act(void *scratch, int M, int K) {
    char *p = scratch;
    long nb = K / 32, mk = (long)M * K;
    return (Act){(int8_t *)p, (uint8_t *)p + mk, (float *)(p + 2 * mk), (float *)(p + 2 * mk + M * nb * 4),
                 (int32_t *)(p + 2 * mk + M * nb * 8), K, (int)nb};
}

/* Per row and block of 32: d = max|x| / 127, q = round-to-even(x / d) (x * (1 / d), as llama.cpp),
 * in 8-lane vectors in every variant: max and the integer sums are exact in any order, and each
 * q is one multiply and one rounding, as the scalar form would do it. A NaN in the block makes d
 * NaN, so the row's outputs are NaN as F.linear's would be (maxps returns its second operand
 * when either is NaN: the max alone could drop it, and the NaN would become a finite -127 d). */
void quantize_rows_for(const float *x, int M, Act *a) {
    int K = a->K, nb = a->nb;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lim = _mm256_set1_epi32(127), off = _mm256_set1_epi8((char)128);
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (long)r * K + b * 32;
            __m256 v[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            float db = _mm256_movemask_ps(nan) ? NAN : amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                __m256i t = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));   /* nearest even */
                q[i] = _mm256_max_epi32(_mm256_min_epi32(t, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
                sum = _mm256_add_epi32(sum, q[i]);
            }
            /* 32 int32 -> 32 int8 in order (the packs interleave 128-bit lanes: undo it) */
            __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a->q + (long)r * K + b * 32), p8);
            _mm256_storeu_si256((__m256i *)(a->u + (long)r * K + b * 32), _mm256_add_epi8(p8, off));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            long k = (long)r * nb + b;
            a->d[k] = db;
            a->s[k] = _mm_cvtsi128_si32(s4);
            a->ds[k] = db * (float)a->s[k];
        }
    }
}

static void store_rows(const VF acc[][NH], int mr, const float *bias, float *out, int N, long p) {
    int width = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
    for (int j = 0; j < mr; j++) {
        float res[PANEL];
        for (int h = 0; h < NH; h++) fstore(res + h * LANES, acc[j][h]);
        float *o = out + (long)j * N + p * PANEL;
        for (int i = 0; i < width; i++) o[i] = res[i] + (bias ? bias[p * PANEL + i] : 0.0f);
    }
}

/* Rows m0 .. m0 + MR - 1 of panel p. MR up to FEW is a compile-time constant in its copy, so
 * the accumulators live in registers (decoding's one row, verification's few); more rows keep
 * theirs in L1. The same operations either way. */
static inline __attribute__((always_inline)) void
rows_of(int fmt, int MR, const uint8_t *pp, const Act *a, int m0, const float *bias, float *out, int N, long p) {
    if (MR <= FEW) {
        VF acc[FEW][NH];
        panel_q(fmt, pp, a, m0, MR, acc);
        store_rows(acc, MR, bias, out + (long)m0 * N, N, p);
    } else {
        VF acc[RCH][NH];
        panel_q(fmt, pp, a, m0, MR, acc);
        store_rows(acc, MR, bias, out + (long)m0 * N, N, p);
    }
}

#if FEW > 8
#define ROWS_ABOVE_8(F) ROWS(F, 9) ROWS(F, 10) ROWS(F, 11) ROWS(F, 12)
#else
#define ROWS_ABOVE_8(F)
#endif
#define ROWS(F, R) case R: rows_of(F, R, pp, a, m0, bias, out, N, p); break;
/* AVX2 (16 registers): from 3 rows on, two halves' accumulators per row beside a block's 8
 * weight vectors made gcc spill the broadcast activations in the unrolled copies; the loop over
 * rows with accumulators in L1 is 9-33% faster there (3 and 5 rows: scripts/qgemm_rows.py). */
#if NH == 2
#define ROWS_ABOVE_2(F)
#else
#define ROWS_ABOVE_2(F) ROWS(F, 3) ROWS(F, 4) ROWS(F, 5) ROWS(F, 6) ROWS(F, 7) ROWS(F, 8)
#endif
#define BY_ROWS(F)                                                                                 \
    switch (mr) {                                                                                  \
    ROWS(F, 1) ROWS(F, 2) ROWS_ABOVE_2(F)                                                          \
    ROWS_ABOVE_8(F)                                                                                \
    default: rows_of(F, mr, pp, a, m0, bias, out, N, p); break;                                    \
    }

/* out[M, N] = the quantized rows a against the prepared panels pw (+ bias), panels split
 * across the team. */
void quant_panels_for(const Act *a, const uint8_t *pw, int fmt, const float *bias, float *out, int M, int N) {
    long panels = (N + PANEL - 1) / PANEL;
    long panel_bytes = unit_bytes(fmt) * (fmt == Q4_K ? a->nb / 8 : a->nb);
    /* Up to RCH rows: one chunk, each panel read once. More (prefill): chunks of PCH rows outside
     * the panels, so that a chunk's outputs stay in L2 while the panels stream by; panels outside
     * had every panel write one line per row of an [M, N] output far larger than L2 (a 512-row
     * [3072, 576] product: 7.6 -> 5.9 ms; scripts/qgemm_rows.py --rows 512). */
    if (M <= 0) return;
    const int ch = M <= RCH ? M : PCH;
    const long chunks = (M + ch - 1) / ch;
    #pragma omp for collapse(2) schedule(static)
    for (long c = 0; c < chunks; c++) {
        for (long p = 0; p < panels; p++) {
            const uint8_t *pp = pw + p * panel_bytes;
            int m0 = (int)(c * ch), mr = M - m0 < ch ? M - m0 : ch;
            switch (fmt) {      /* a constant format in each inlined copy: no branch per block */
            case Q8_0: BY_ROWS(Q8_0) break;
            case Q4_0: BY_ROWS(Q4_0) break;
            case Q4_1: BY_ROWS(Q4_1) break;
            case MXFP4: BY_ROWS(MXFP4) break;
            default: BY_ROWS(Q4_K) break;
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
    if (fmt == MXFP4) {              /* e, nibbles[16] (Q4_0's order); ggml's doubled values x 2^(e - 128) */
        static const int8_t k2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (long)b * 17;
            uint32_t bits = blk[0] < 2 ? 0x00200000u << blk[0] : (uint32_t)(blk[0] - 1) << 23;
            float d;
            memcpy(&d, &bits, 4);
            for (int i = 0; i < 32; i++) {
                int byte = blk[1 + i % 16], q = i < 16 ? byte & 15 : byte >> 4;
                out[b * 32 + i] = (float)k2[q] * d;
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
