/* The self-test a variant runs in a child process before it is trusted (kernels/isa.py).
 *
 * A CPU (or a VM) may list an instruction set in /proc/cpuinfo and still fault on it, so each
 * build runs every kernel it will be asked to run, with its own instructions, on small problems
 * whose exact answers are known: small integers and scales that are powers of two, so every
 * float sum is exact and any difference is a wrong kernel, not rounding. Returns 0 when all pass.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

static uint32_t rng = 12345;
static int next(int n) { rng = rng * 1103515245u + 12345u; return (int)((rng >> 16) % (uint32_t)n); }

static float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

static int check_skinny(int bf16) {
    enum { M = 3, N = 24, K = 16, P = 2 };
    float x[M * K], w[N * K], out[M * N];
    uint16_t wb[P * K * 16];
    float wf[P * K * 16];
    for (int i = 0; i < M * K; i++) x[i] = (float)(next(9) - 4);
    for (int i = 0; i < N * K; i++) w[i] = (float)(next(17) - 8) / 8.0f;   /* exact in bf16 */
    memset(wb, 0, sizeof wb);
    memset(wf, 0, sizeof wf);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            uint32_t u;
            memcpy(&u, &w[n * K + k], 4);
            wb[((n / 16) * K + k) * 16 + n % 16] = (uint16_t)(u >> 16);
            wf[((n / 16) * K + k) * 16 + n % 16] = w[n * K + k];
        }
    skinny_linear(x, bf16 ? (const void *)wb : (const void *)wf, bf16, NULL, out, 0, M, N, K);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float ref = 0.0f;
            for (int k = 0; k < K; k++) ref += x[m * K + k] * w[n * K + k];
            if (ref != out[m * N + n]) return 1;
        }
    return 0;
}

/* The dequantized weight (n, k) of one prepared panel (layout: kernels/qformats.py). */
static float weight(int fmt, const uint8_t *pw, int i, int k) {
    if (fmt == 3) {
        const uint8_t *u = pw + (long)(k / 256) * quant_panel_bytes(3, 256);
        int e = k % 256, sb = e / 32, l = e % 32;
        int byte = u[(sb / 2) * 512 + (l / 4) * 64 + i * 4 + l % 4], q = sb % 2 ? byte >> 4 : byte & 15;
        return f16(u + 2048 + 2 * i) * u[2112 + sb * 16 + i] * q - f16(u + 2080 + 2 * i) * u[2240 + sb * 16 + i];
    }
    const uint8_t *u = pw + (long)(k / 32) * quant_panel_bytes(fmt, 32);
    int e = k % 32;
    if (fmt == 0) return f16(u + 512 + 2 * i) * (int8_t)u[(e / 4) * 64 + i * 4 + e % 4];
    int byte = u[((e % 16) / 4) * 64 + i * 4 + e % 4], q = e < 16 ? byte & 15 : byte >> 4;
    if (fmt == 6) {             /* MXFP4: doubled FP4 values x 2^(e - 128) (the test's e: 127 or 128) */
        static const int k2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        return (float)k2[q] * (u[256 + i] == 128 ? 1.0f : 0.5f);
    }
    return fmt == 1 ? f16(u + 256 + 2 * i) * (q - 8) : f16(u + 256 + 2 * i) * q + f16(u + 288 + 2 * i);
}

static int check_quant(int fmt) {
    enum { M = 17, N = 16, K = 256 };       /* 17 rows: whole row tiles and a remainder */
    static uint8_t pw[8 * 544];
    float x[M * K], out[M * N];
    long unit = quant_panel_bytes(fmt, fmt == 3 ? 256 : 32), units = fmt == 3 ? 1 : K / 32;
    for (long i = 0; i < unit * units; i++) pw[i] = (uint8_t)next(256);
    for (long b = 0; b < units; b++) {     /* scales: powers of two (f16 0x3800 = 0.5, 0x3C00 = 1) */
        uint8_t *u = pw + b * unit;
        int at = fmt == 0 ? 512 : fmt == 3 ? 2048 : 256, count = fmt == 0 || fmt == 1 ? 16 : 32;
        if (fmt == 6)                       /* MXFP4: E8M0 bytes 127 (x 1/2) or 128 (x 1) */
            for (int j = 0; j < 16; j++) u[256 + j] = next(2) ? 127 : 128;
        else
            for (int j = 0; j < count; j++) { u[at + 2 * j] = 0; u[at + 2 * j + 1] = next(2) ? 0x38 : 0x3C; }
        if (fmt == 3)
            for (int j = 0; j < 256; j++) u[2112 + j] = (uint8_t)next(8);
    }
    for (int i = 0; i < M * K; i++)       /* amax 127 per block: the activation scale is exactly 1; */
        x[i] = i % 32 == 5 ? 127.0f : (float)(next(31) - 15);   /* small: every float sum exact */
    if (quant_linear(x, pw, fmt, NULL, out, M, N, K) != 0) return 1;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double ref = 0.0;
            for (int k = 0; k < K; k++) ref += (double)weight(fmt, pw, n, k) * x[m * K + k];
            if (ref != out[m * N + n]) return 1;
        }
    return 0;
}

int specdec_selftest(void) {
    if (check_skinny(0) || check_skinny(1)) return 2;
    for (int fmt = 0; fmt < 4; fmt++)
        if (check_quant(fmt)) return 3 + fmt;
    if (check_quant(6)) return 7;
    return 0;
}
