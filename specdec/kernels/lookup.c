/* The model-free proposers' lookups on the CPU (proposers/ngram.py `match`, proposers/suffix_index.py
 * `SuffixIndex.match` and `continue_chain`), with exactly their results. In NumPy each is a
 * dozen array calls or a Python binary search per step: ~0.25 ms of a suffix-decoding step on
 * SmolLM2, 3-4% of it; here a few microseconds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { NGRAM_MAX = 64 };

/* ngram.match (n_max <= NGRAM_MAX): the length n (0: none) of the longest match (n_max at most, n_min at least) of
 * seq's last n tokens ending earlier in seq, and in *start where the k tokens after it begin:
 * after the latest such match with k tokens after it, else after the earliest. */
int ngram_match(const int64_t *seq, int L, int k, int n_max, int n_min, int *start) {
    *start = -1;
    if (L < 2 || n_max < 1 || n_max > NGRAM_MAX) return 0;
    int cap = n_max < L - 1 ? n_max : L - 1;           /* the longest length counted */
    int first[NGRAM_MAX + 1], full[NGRAM_MAX + 1], longest = 0;
    for (int n = 0; n <= cap; n++) first[n] = full[n] = -1;
    const int64_t last = seq[L - 1];
    for (int e = 0; e < L - 1; e++) {
        if (seq[e] != last) continue;
        int len = 1;
        while (len < cap && e >= len && seq[e - len] == seq[L - 1 - len]) len++;
        if (len > longest) longest = len;
        for (int n = 0; n <= len; n++) {                 /* n = 0 too: what n_min <= 0 returns */
            if (first[n] < 0) first[n] = e;
            if (L - 1 - e >= k) full[n] = e;
        }
    }
    for (int n = longest; n >= n_min && n >= 0; n--) {
        if (first[n] < 0) continue;
        *start = (full[n] >= 0 ? full[n] : first[n]) + 1;
        return n;
    }
    return 0;                                            /* *start = -1: no match */
}

/* SuffixIndex.match: the suffix-array range [*lo, *hi) of the occurrences of tail's last m
 * tokens (rev: the reversed corpus with ids + 1; sa [nsa]: its suffix array), m as long as the
 * corpus allows (limit at most); returns m (0: no match, *lo = *hi = 0). */
int suffix_match(const int32_t *rev, const int32_t *sa, long nsa, const int64_t *tail, int tail_len, int limit,
                 long *lo_out, long *hi_out) {
    long lo = 0, hi = nsa;
    int m = 0;
    if (limit > tail_len) limit = tail_len;
    while (m < limit) {
        int64_t c = tail[tail_len - 1 - m] + 1;
        long a = lo, b = hi;
        while (a < b) {
            long mid = (a + b) >> 1;
            if (rev[sa[mid] + m] < c) a = mid + 1;
            else b = mid;
        }
        long first = a;
        b = hi;
        while (a < b) {
            long mid = (a + b) >> 1;
            if (rev[sa[mid] + m] <= c) a = mid + 1;
            else b = mid;
        }
        if (a == first) break;
        lo = first;
        hi = a;
        m++;
    }
    if (!m) lo = hi = 0;
    *lo_out = lo;
    *hi_out = hi;
    return m;
}

static int by_value(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* SuffixIndex.continue_chain: up to k tokens after the occurrences sa[lo:hi] (an even spread of
 * max_occ of them when there are more, as NumPy's linspace picks them) of a match of length m:
 * each the most frequent next token among the occurrences that agree so far (ties: the smaller
 * id), while its count over all the occurrences stays >= min_prob. fwd: the forward corpus
 * (ids + 1, 0 = separator), n its length proper. Writes tokens (ids) and their path
 * probabilities; returns how many. Returns -1 when memory runs out. */
int suffix_continue(const int32_t *fwd, const int32_t *sa, long n, long lo, long hi, int k, double min_prob,
                    long max_occ, int64_t *tokens, double *probs) {
    if (hi <= lo || k <= 0) return 0;
    long total = hi - lo;
    if (total > max_occ) total = max_occ;
    int64_t *pos = malloc(sizeof(int64_t) * total);
    int32_t *nxt = malloc(sizeof(int32_t) * total);
    if (!pos || !nxt) {
        free(pos);
        free(nxt);
        return -1;
    }
    if (hi - lo > max_occ) {
        double step = (double)(hi - lo - 1) / (double)(max_occ - 1);
        for (long i = 0; i < total; i++) {
            long at = i == total - 1 ? hi - lo - 1 : (long)((double)i * step);
            pos[i] = n - 1 - sa[lo + at];
        }
    } else {
        for (long i = 0; i < total; i++) pos[i] = n - 1 - sa[lo + i];
    }
    long alive = total;
    int made = 0;
    for (int j = 1; j <= k; j++) {
        long cnt = 0;
        for (long i = 0; i < alive; i++)
            if (fwd[pos[i] + j] != 0) nxt[cnt++] = fwd[pos[i] + j];
        if (!cnt) break;
        qsort(nxt, cnt, sizeof(int32_t), by_value);
        int32_t best = nxt[0];
        long best_n = 0;
        for (long i = 0; i < cnt;) {
            long r = i;
            while (r < cnt && nxt[r] == nxt[i]) r++;
            if (r - i > best_n) {                        /* strictly more: ties keep the smaller id */
                best_n = r - i;
                best = nxt[i];
            }
            i = r;
        }
        if ((double)best_n / (double)total < min_prob) break;
        tokens[made] = best - 1;
        probs[made] = (double)best_n / (double)total;
        made++;
        long kept = 0;
        for (long i = 0; i < alive; i++)
            if (fwd[pos[i] + j] == best) pos[kept++] = pos[i];
        alive = kept;
    }
    free(pos);
    free(nxt);
    return made;
}
