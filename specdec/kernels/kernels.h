/* What the kernel sources share: weight formats, a matrix in one of them, and the entry points
 * one file calls in another. Python mirrors the format codes (kernels/qformats.py: FORMATS).
 *
 * Functions named *_for run their loop as an OpenMP worksharing `for`: called inside a
 * parallel region the team splits it (the whole forward shares one region, forward.c), called
 * outside one the calling thread runs it all. They end with the worksharing barrier.
 */
#ifndef SPECDEC_KERNELS_H
#define SPECDEC_KERNELS_H
#include <stdint.h>
#include <string.h>

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, F32 = 4, BF16 = 5, MXFP4 = 6 };

/* A weight matrix [N, K]: dense ones packed in panels of 16 outputs (skinny.c), quantized ones
 * in their prepared panels (qgemm.c). */
typedef struct {
    const void *w;
    int fmt;
} Mat;

/* The int8 activations of M rows (qgemm.c), in caller-owned scratch of quant_act_bytes(M, K). */
typedef struct {
    int8_t *q;               /* [M, K] */
    uint8_t *u;              /* [M, K] q + 128 (the unsigned operand of vpdpbusd) */
    float *d, *ds;           /* [M, K / 32]: scale, scale * sum(q) */
    int32_t *s;              /* [M, K / 32]: sum(q) */
    int K, nb;
} Act;

/* skinny.c */
void skinny_linear(const float *x, const void *wp, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K);
void skinny_for(const float *x, const void *wp, int w_bf16, const float *bias, float *out, int M, int N, int K);

/* qgemm.c */
long quant_act_bytes(int M, int K);
Act quant_act(void *scratch, int M, int K);
void quantize_rows_for(const float *x, int M, Act *a);
void quant_panels_for(const Act *a, const uint8_t *pw, int fmt, const float *bias, float *out, int M, int N);
int quant_linear(const float *x, const uint8_t *pw, int fmt, const float *bias, float *out, int M, int N, int K);
long quant_panel_bytes(int fmt, int K);
/* One row of a GGUF tensor as the file stores it (row_bytes per row) -> K floats, with the
 * operations model/quant.py's dequantize uses (bit-identical to it). */
void dequant_row(int fmt, const uint8_t *row, float *out, int K);

/* fp32 -> bf16, round to nearest even, NaN kept NaN: the one rounding every kernel that writes
 * bf16 uses (weights, the KV cache, outputs), so the paths agree bit for bit. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#endif
