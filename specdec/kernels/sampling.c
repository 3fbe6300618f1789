/* The per-row work of sampling on the CPU (sampling.py): the processed distribution of a row of
 * logits (temperature, softmax, min-p, top-p, renormalised: vLLM's order) and the inverse-CDF draw.
 *
 * PyTorch spends ~20 dispatched ops on a row of SmolLM2's 49152 logits (topk alone ~0.4 ms
 * for 3 rows), more than a verification step's own arithmetic; here each row is two or three
 * passes over V floats. p and q go through the same function (sampling.process_rows), so
 * rejection sampling reproduces this processed distribution exactly.
 *
 * Top-p keeps token x when the tokens ranked before it (probability descending, ties by token
 * id) hold less than top_p; the first always stays. The ranked set is found without sorting V
 * tokens: S = {p >= t} has at most 1 / t members, and when S already holds top_p of the mass,
 * every token outside it has at least that much ranked before it, so the nucleus lies in S and
 * only S is sorted (t = 1/256, then 1/4096, then every positive token).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

typedef struct {
    float p;
    int32_t i;
} Ranked;

static int by_rank(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

static float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static double hsum8(__m256 v) {
    float lane[8];
    _mm256_storeu_ps(lane, v);
    return (((double)lane[0] + lane[1]) + ((double)lane[2] + lane[3])) + (((double)lane[4] + lane[5]) + ((double)lane[6] + lane[7]));
}

/* p = x / temp (the max of which is returned) over n < 8 trailing elements, the rest -inf */
static inline __m256 scaled_part(const float *x, int n, __m256 vt) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_div_ps(load_part(x, n), vt), in);
}

/* p = exp(x / temp - max) over the row, normalised; returns the largest probability. -inf,
 * and anything e^-87 below the row's best, becomes exactly 0. */
static float softmax_row(const float *x, float *p, int V, float temp) {
    const __m256 vt = _mm256_set1_ps(temp), lo = _mm256_set1_ps(-87.0f);
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int v = 0, tail = V % 8, body = V - tail;
    for (; v < body; v += 8) {
        __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + v), vt);
        _mm256_storeu_ps(p + v, s);
        vm = _mm256_max_ps(vm, s);
    }
    if (tail) vm = _mm256_max_ps(vm, scaled_part(x + body, tail, vt));
    const __m256 mx = _mm256_set1_ps(hmax8(vm));
    __m256 acc = _mm256_setzero_ps(), last = _mm256_setzero_ps();
    for (v = 0; v < body; v += 8) {
        __m256 d = _mm256_sub_ps(_mm256_loadu_ps(p + v), mx);
        __m256 e = _mm256_and_ps(vexp(d), _mm256_cmp_ps(d, lo, _CMP_GE_OQ));
        _mm256_storeu_ps(p + v, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (tail) {
        __m256 d = _mm256_sub_ps(scaled_part(x + body, tail, vt), mx);
        last = _mm256_and_ps(vexp(d), _mm256_cmp_ps(d, lo, _CMP_GE_OQ));
        store_part(p + body, last, tail);
    }
    const __m256 inv = _mm256_set1_ps((float)(1.0 / (hsum8(acc) + hsum8(last))));
    __m256 best = _mm256_setzero_ps();
    for (v = 0; v < body; v += 8) {
        __m256 q = _mm256_mul_ps(_mm256_loadu_ps(p + v), inv);
        _mm256_storeu_ps(p + v, q);
        best = _mm256_max_ps(best, q);
    }
    float b = hmax8(best);
    for (; v < V; v++) {
        p[v] *= _mm256_cvtss_f32(inv);
        b = p[v] > b ? p[v] : b;
    }
    return b;
}

/* The tokens of row p with probability >= t (> 0), into buf; returns their count, *mass their sum. */
static int at_least(const float *p, int V, float t, Ranked *buf, double *mass) {
    const __m256 vt = _mm256_set1_ps(t);
    int n = 0, v = 0;
    double m = 0.0;
    for (; v + 8 <= V; v += 8) {
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + v), vt, _CMP_GE_OQ));
        while (bits) {
            int k = __builtin_ctz(bits);
            bits &= bits - 1;
            buf[n++] = (Ranked){p[v + k], v + k};
            m += p[v + k];
        }
    }
    for (; v < V; v++)
        if (p[v] >= t) {
            buf[n++] = (Ranked){p[v], v};
            m += p[v];
        }
    *mass = m;
    return n;
}

/* Zero the tokens outside row p's top-p nucleus (p sums to ~1); the kept ones are left in
 * buf[0 .. return value) (V entries of scratch), most likely first. */
static int nucleus(float *p, int V, double top_p, Ranked *buf) {
    static const float tiers[] = {1.0f / 256, 1.0f / 4096, 0.0f};
    for (int t = 0; t < 3; t++) {
        double mass;
        int n = at_least(p, V, tiers[t] > 0.0f ? tiers[t] : 1e-45f, buf, &mass);
        if (tiers[t] > 0.0f && mass < top_p) continue;  /* the nucleus reaches below this tier */
        qsort(buf, n, sizeof(Ranked), by_rank);
        double before = 0.0;
        int keep = 0;
        while (keep < n && (keep == 0 || before < top_p)) before += buf[keep++].p;
        memset(p, 0, sizeof(float) * V);
        for (int k = 0; k < keep; k++) p[buf[k].i] = buf[k].p;
        return keep;
    }
    return 0;                                            /* not reached: the last tier takes every p > 0 */
}

/* One row of sampling_process: softmax(logits / temp), then min-p (min_p > 0: tokens below min_p
 * times the row's best dropped), then top-p (top_p < 1) over what min-p kept, renormalised after
 * each filter that ran (vLLM's order; min-p commutes with the top-k applied before).
 * buf: V entries of scratch, allocated on first need. */
static int process_row(const float *x, float *p, int V, float temp, float top_p, float min_p, Ranked **buf) {
    float best = softmax_row(x, p, V, temp), cut = min_p > 0.0f ? min_p * best : 0.0f;
    if (cut > 0.0f) {
        const __m256 vc = _mm256_set1_ps(cut);
        __m256 acc = _mm256_setzero_ps();
        int v = 0;
        for (; v + 8 <= V; v += 8) {
            __m256 q = _mm256_loadu_ps(p + v);
            q = _mm256_and_ps(q, _mm256_cmp_ps(q, vc, _CMP_GE_OQ));
            _mm256_storeu_ps(p + v, q);
            acc = _mm256_add_ps(acc, q);
        }
        double sum = hsum8(acc);
        for (; v < V; v++) {
            if (p[v] < cut) p[v] = 0.0f;
            sum += p[v];
        }
        /* divided, not multiplied by a rounded reciprocal: n tied tokens become exactly 1 / n, so
         * top-p then ends a run of ties where PyTorch's division (and vLLM's sampler) ends it */
        const float fs = (float)sum;
        const __m256 s8 = _mm256_set1_ps(fs);
        for (v = 0; v + 8 <= V; v += 8) _mm256_storeu_ps(p + v, _mm256_div_ps(_mm256_loadu_ps(p + v), s8));
        for (; v < V; v++) p[v] /= fs;
    }
    if (top_p < 1.0f) {                                  /* a sparse row now: the rest on its kept tokens */
        if (!*buf && !(*buf = malloc(sizeof(Ranked) * V))) return -1;
        Ranked *b = *buf;
        int keep = nucleus(p, V, top_p, b);
        double sum = 0.0;
        for (int k = 0; k < keep; k++) sum += b[k].p;
        const float fs = (float)sum;
        for (int k = 0; k < keep; k++) p[b[k].i] /= fs;
    }
    return 0;
}

/* probs [R, V] = the processed distributions of logits [R, V] (top-k already applied as -inf):
 * softmax(logits / temp), then min-p (min_p > 0: tokens below min_p times the row's best
 * dropped), then top-p (top_p < 1), renormalised after each filter that ran. Rows are independent (a row's
 * result does not depend on the others or on which thread ran it); a batch of 8 or more rows is
 * shared out over the calling thread's team. Returns 0, or -1 when scratch memory runs out. */
int sampling_process(const float *logits, float *probs, int R, int V, const float *temp, const float *top_p,
                     const float *min_p) {
    int failed = 0;
    #pragma omp parallel if (R >= 8) reduction(|:failed)
    {
        Ranked *buf = NULL;
        #pragma omp for schedule(static)
        for (int r = 0; r < R; r++)
            failed |= process_row(logits + (long)r * V, probs + (long)r * V, V, temp[r], top_p[r], min_p[r], &buf) != 0;
        free(buf);
    }
    return failed ? -1 : 0;
}

/* out[r] = a draw from probs[r] (rows need not sum to 1) with uniform u[r]: the first token of
 * positive probability whose running sum exceeds u[r] times the row's total. The sums run in
 * double over blocks of 256 tokens (4 lanes each), then token by token inside the block where
 * the running sum crosses; a token of probability 0 is never drawn (when rounding leaves the
 * crossing past the end, the row's last positive token is). */
enum { DRAW_BLOCK = 256 };

static double block_sum(const float *p, int n) {
    __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
    int v = 0;
    for (; v + 8 <= n; v += 8) {
        __m256 x = _mm256_loadu_ps(p + v);
        a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    }
    double lane[4];
    _mm256_storeu_pd(lane, _mm256_add_pd(a, b));
    double s = (lane[0] + lane[1]) + (lane[2] + lane[3]);
    for (; v < n; v++) s += p[v];
    return s;
}

void sampling_draw(const float *probs, int R, int V, const double *u, int64_t *out) {
    int nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double sums[nb];                                     /* 8 bytes per 256 tokens: a few KiB */
    for (int r = 0; r < R; r++) {
        const float *p = probs + (long)r * V;
        double total = 0.0;
        for (int b = 0; b < nb; b++) {
            int n = V - b * DRAW_BLOCK < DRAW_BLOCK ? V - b * DRAW_BLOCK : DRAW_BLOCK;
            sums[b] = block_sum(p + b * DRAW_BLOCK, n);
            total += sums[b];
        }
        double target = u[r] * total, before = 0.0;
        int64_t pick = -1;
        for (int b = 0; b < nb && pick < 0; b++) {
            if (before + sums[b] <= target && b + 1 < nb) {
                before += sums[b];
                continue;
            }
            double c = before;
            int end = V < (b + 1) * DRAW_BLOCK ? V : (b + 1) * DRAW_BLOCK;
            for (int v = b * DRAW_BLOCK; v < end; v++) {
                if (p[v] <= 0.0f) continue;
                c += p[v];
                if (c > target) {
                    pick = v;
                    break;
                }
            }
            before += sums[b];
        }
        for (int64_t v = V - 1; pick < 0 && v >= 0; v--)  /* rounding: the last positive token */
            if (p[v] > 0.0f) pick = v;
        out[r] = pick < 0 ? V - 1 : pick;
    }
}

/* The deterministic half of rejection sampling (verify.py: rejection_plan) for a chain of K
 * drafts: accept[i] = min(1, p_i(x_i) / q_i(x_i)) (0 where q_i(x_i) = 0: x cannot have come from q), cand[i] =
 * norm(max(0, p_i - q_i)) for i < K (p_i itself where that is all zero: a rejection there has
 * probability 0), cand[K] = p_K. p [K + 1, V]; q [K, V], or NULL for a point mass on each draft
 * (n-gram and suffix lookups); draft [K]. */
void sampling_residual(const float *p, const float *q, const int64_t *draft, int K, int V, float *accept, float *cand) {
    for (int i = 0; i < K; i++) {
        const float *pi = p + (long)i * V, *qi = q ? q + (long)i * V : NULL;
        float *ci = cand + (long)i * V;
        int64_t x = draft[i];
        float px = pi[x], qx = qi ? qi[x] : 1.0f;
        accept[i] = qx > 0.0f ? fminf(px / fmaxf(qx, 1e-30f), 1.0f) : 0.0f;   /* q(x) = 0: x cannot come from q */
        double mass = 0.0;
        if (qi) {
            __m256 acc = _mm256_setzero_ps();
            int v = 0;
            for (; v + 8 <= V; v += 8) {
                __m256 d = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(pi + v), _mm256_loadu_ps(qi + v)), _mm256_setzero_ps());
                _mm256_storeu_ps(ci + v, d);
                acc = _mm256_add_ps(acc, d);
            }
            mass = hsum8(acc);
            for (; v < V; v++) {
                float d = pi[v] - qi[v];
                ci[v] = d > 0.0f ? d : 0.0f;
                mass += ci[v];
            }
        } else {                                         /* p with x removed: max(0, p - onehot(x)) */
            memcpy(ci, pi, sizeof(float) * V);
            ci[x] = px > 1.0f ? px - 1.0f : 0.0f;
            mass = block_sum(ci, V);
        }
        if (mass > 0.0) {
            const __m256 k8 = _mm256_set1_ps((float)(1.0 / mass));
            int v = 0;
            for (; v + 8 <= V; v += 8) _mm256_storeu_ps(ci + v, _mm256_mul_ps(_mm256_loadu_ps(ci + v), k8));
            for (; v < V; v++) ci[v] *= _mm256_cvtss_f32(k8);
        } else {
            memcpy(ci, pi, sizeof(float) * V);
        }
    }
    memcpy(cand + (long)K * V, p + (long)K * V, sizeof(float) * V);
}
