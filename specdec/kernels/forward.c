/* The whole decoder forward for one sequence on the CPU, in one call (llama2.c style).
 *
 * Decoding on a CPU spends as long in Python dispatching ~200 small ops per forward as in
 * reading the weights; a draft model that fits the cache spends most of its time there. This
 * file runs embedding -> layers -> norm -> LM head for T new tokens with fp32 activations and
 * bf16 or fp32 weights, writing keys and values into the same KV cache tensors the PyTorch
 * path uses, with the same masks (causal, or a token tree's ancestor mask). Matrix products use
 * skinny.c's kernel, so logits are bit-identical whichever T a token is scored in.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void skinny_linear(const float *x, const void *w, int w_bf16, const float *bias, void *out,
                   int out_bf16, int M, int N, int K);

typedef struct {
    const float *in_norm, *post_norm;     /* [D] fp32 */
    const void *qkv, *o, *gate_up, *down; /* weights, bf16 or fp32 */
    const float *qkv_bias;                /* [(H + 2 KV) * hd] or NULL */
    float *k_cache, *v_cache;             /* [KV, max_len, hd] fp32 (batch row 0) */
} Layer;

typedef struct {
    int dim, hidden, n_heads, n_kv, head_dim, vocab, n_layers, max_len, w_bf16;
    float eps;
    const void *embed;                    /* [V, D] */
    const float *final_norm;              /* [D] */
    const void *lm_head;                  /* [V, D] */
    const float *inv_freq;                /* [hd / 2] */
    const Layer *layers;
} Model;

/* head_dim % 8 == 0 (cforward.supported checks) */
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void axpy(float *y, float a, const float *x, int n) {
    __m256 va = _mm256_set1_ps(a);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

static float widen(const void *w, int bf16, long i) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void rms_norm(float *out, const float *x, const float *w, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (long)t * D;
        double ss = 0.0;
        for (int i = 0; i < D; i++) ss += (double)xt[i] * xt[i];
        float r = 1.0f / sqrtf((float)(ss / D) + eps);
        for (int i = 0; i < D; i++) out[(long)t * D + i] = w[i] * (xt[i] * r);
    }
}

/* Rotate the halves of each head's vector by position pos (Hugging Face's rotate_half). */
static void rope(float *v, int n_heads, int hd, const float *inv_freq, long pos) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = (float)pos * inv_freq[i], c = cosf(a), s = sinf(a);
        for (int h = 0; h < n_heads; h++) {
            float *x = v + (long)h * hd;
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }
}

/* Attention of T new queries over slots [0, start + T). NULL mask: every slot before `start`
 * is visible, causal among the new ones. Otherwise slots before mask_from are visible and slot
 * s >= mask_from is visible to query t iff mask[t * (span - mask_from) + s - mask_from]. */
static void attention(const Model *m, const Layer *L, const float *q, float *out, int T, int start,
                      const uint8_t *mask, int mask_from) {
    int H = m->n_heads, hd = m->head_dim, group = m->n_heads / m->n_kv, span = start + T;
    int cols = span - mask_from;
    float scale = 1.0f / sqrtf((float)hd);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            float *scores = malloc(sizeof(float) * span);
            const float *qt = q + ((long)t * H + h) * hd;
            const float *kc = L->k_cache + (long)(h / group) * m->max_len * hd;
            const float *vc = L->v_cache + (long)(h / group) * m->max_len * hd;
            float mx = -INFINITY;
            for (int s = 0; s < span; s++) {
                int vis = mask ? (s < mask_from || mask[(long)t * cols + s - mask_from]) : s <= start + t;
                if (!vis) { scores[s] = -INFINITY; continue; }
                scores[s] = dot(qt, kc + (long)s * hd, hd) * scale;
                if (scores[s] > mx) mx = scores[s];
            }
            float sum = 0.0f;
            for (int s = 0; s < span; s++) {
                scores[s] = scores[s] == -INFINITY ? 0.0f : expf(scores[s] - mx);
                sum += scores[s];
            }
            float *o = out + ((long)t * H + h) * hd;
            memset(o, 0, sizeof(float) * hd);
            for (int s = 0; s < span; s++) {
                if (scores[s] == 0.0f) continue;
                axpy(o, scores[s] / sum, vc + (long)s * hd, hd);
            }
            free(scores);
        }
    }
}

static void layer_forward(const Model *m, const Layer *L, float *x, float *buf, float *qkv, float *att,
                          float *ff, int T, int start, const long *pos, const uint8_t *mask, int mask_from) {
    int D = m->dim, H = m->n_heads, KV = m->n_kv, hd = m->head_dim, F = m->hidden;
    int nq = H * hd, nkv = KV * hd, nqkv = nq + 2 * nkv;
    rms_norm(buf, x, L->in_norm, T, D, m->eps);
    skinny_linear(buf, L->qkv, m->w_bf16, L->qkv_bias, qkv, 0, T, nqkv, D);
    for (int t = 0; t < T; t++) {
        float *row = qkv + (long)t * nqkv;
        rope(row, H, hd, m->inv_freq, pos[t]);
        rope(row + nq, KV, hd, m->inv_freq, pos[t]);
        for (int g = 0; g < KV; g++) {   /* cache slot start + t */
            long slot = ((long)g * m->max_len + start + t) * hd;
            memcpy(L->k_cache + slot, row + nq + (long)g * hd, sizeof(float) * hd);
            memcpy(L->v_cache + slot, row + nq + nkv + (long)g * hd, sizeof(float) * hd);
        }
        memcpy(buf + (long)t * nq, row, sizeof(float) * nq);   /* q, packed [T, H * hd] */
    }
    attention(m, L, buf, att, T, start, mask, mask_from);
    skinny_linear(att, L->o, m->w_bf16, NULL, buf, 0, T, D, nq);
    for (long i = 0; i < (long)T * D; i++) x[i] += buf[i];
    rms_norm(buf, x, L->post_norm, T, D, m->eps);
    skinny_linear(buf, L->gate_up, m->w_bf16, NULL, ff, 0, T, 2 * F, D);
    for (int t = 0; t < T; t++) {
        float *g = ff + (long)t * 2 * F, *u = g + F, *o = att + (long)t * F;
        for (int i = 0; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    skinny_linear(att, L->down, m->w_bf16, NULL, buf, 0, T, D, F);
    for (long i = 0; i < (long)T * D; i++) x[i] += buf[i];
}

/* mask: see attention(); tokens [T] (or, when tokens is NULL, input vectors embeds [T, D] instead of the embedding
 * lookup: EAGLE's head); pos [T] rope positions; new tokens go to slots start .. start+T-1.
 * Runs the first n_layers layers, then the final norm into hidden_out [T, D] (if not NULL)
 * and the LM head for rows [logit_from, T) into logits [T - logit_from, V] (if not NULL). */
void llama_forward(const Model *m, const int64_t *tokens, const float *embeds, int T, int start, const long *pos,
                   const uint8_t *mask, int mask_from, int n_layers, float *hidden_out, int logit_from, float *logits) {
    int D = m->dim, nqkv = (m->n_heads + 2 * m->n_kv) * m->head_dim;
    int wide = D > m->n_heads * m->head_dim ? D : m->n_heads * m->head_dim;
    if (m->hidden > wide) wide = m->hidden;
    float *x = malloc(sizeof(float) * T * D), *buf = malloc(sizeof(float) * T * wide);
    float *qkv = malloc(sizeof(float) * T * nqkv), *att = malloc(sizeof(float) * T * wide);
    float *ff = malloc(sizeof(float) * T * 2 * m->hidden);
    if (tokens == NULL) memcpy(x, embeds, sizeof(float) * T * D);
    else
        for (int t = 0; t < T; t++)
            for (int i = 0; i < D; i++) x[(long)t * D + i] = widen(m->embed, m->w_bf16, tokens[t] * D + i);
    for (int l = 0; l < n_layers; l++) layer_forward(m, &m->layers[l], x, buf, qkv, att, ff, T, start, pos, mask, mask_from);
    rms_norm(buf, x, m->final_norm, T, D, m->eps);
    if (hidden_out) memcpy(hidden_out, buf, sizeof(float) * T * D);
    if (logits && logit_from < T)
        skinny_linear(buf + (long)logit_from * D, m->lm_head, m->w_bf16, NULL, logits, 0, T - logit_from, m->vocab, D);
    free(x); free(buf); free(qkv); free(att); free(ff);
}

/* EAGLE's greedy chain in one call: n times, x = fc([feat ; embed[tok]]) (fc: packed [D, 2D]
 * weights + fp32 bias), run the head (`head`: its decoder layers, norm and LM head over the
 * draft vocabulary) on x at slot start + s, take the argmax, map it through vocab[] to a target
 * token id, and carry the head's output feature on. feat [D] is updated in place. */
void eagle_chain(const Model *head, const void *fc_w, int fc_bf16, const float *fc_b,
                 const void *embed, int embed_bf16, const int64_t *vocab, float *feat,
                 int64_t tok, int start, int n, int64_t *out_tokens) {
    int D = head->dim, V = head->vocab;
    float *in = malloc(sizeof(float) * 2 * D), *x = malloc(sizeof(float) * D);
    float *logits = malloc(sizeof(float) * V);
    for (int s = 0; s < n; s++) {
        memcpy(in, feat, sizeof(float) * D);
        for (int i = 0; i < D; i++) in[D + i] = widen(embed, embed_bf16, tok * D + i);
        skinny_linear(in, fc_w, fc_bf16, fc_b, x, 0, 1, D, 2 * D);
        long pos = start + s;
        llama_forward(head, NULL, x, 1, start + s, &pos, NULL, 0, head->n_layers, feat, 0, logits);
        int best = 0;
        for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
        tok = vocab[best];
        out_tokens[s] = tok;
    }
    free(in); free(x); free(logits);
}
