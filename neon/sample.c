/* el_sample: one token drawn from a logits row through llama.cpp's sampler chain,
 *
 *     top-k -> top-p -> min-p -> temperature -> draw,
 *
 * as edgellm/sampling.py's Sampler defines it; that numpy code is this file's reference twin
 * (tests/test_native_sampler.py). top-p and min-p see probabilities at temperature 1
 * (renormalised over what top-k kept); temperature only reshapes the surviving set.
 *
 * Why native: a sampled token had to leave the native decode loop for Python's sampler
 * (~0.3 ms a token with the loop, ~12% of a SmolLM2 decode token on the x86 host);
 * el_decode_sample (decode_step.c) draws here between its steps. Only chains with top-k set
 * (0 < k < n, llama.cpp's and edgellm's default is 40) run here: then only k logits are weighed.
 * Without top-k every logit needs an exp, which numpy's vectorized exp does faster than a
 * scalar loop, so those chains stay in numpy (EL_EUNSUPPORTED here).
 *
 * Both twins fix every order that can change which token a uniform u picks: candidates rank by
 * (logit descending, id ascending), so ties at the top-k or top-p boundary keep the lower ids,
 * and the draw walks the final candidates in id order. Sums are float64 over float32 weights,
 * as numpy's; the twins differ only where exp rounds differently (an ulp) or numpy sums
 * pairwise, which moves a pick only when u falls within ~1e-7 of a boundary. */
#include "el_common.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* a ranks worse than b: a lower logit, or the same logit and a higher id */
static inline int el_worse(const float *x, int32_t a, int32_t b) { return x[a] < x[b] || (x[a] == x[b] && a > b); }

static void el_sift_down(const float *x, int32_t *h, int n, int i) {
    for (;;) {
        int w = i;
        const int l = 2 * i + 1, r = l + 1;
        if (l < n && el_worse(x, h[l], h[w])) w = l;
        if (r < n && el_worse(x, h[r], h[w])) w = r;
        if (w == i) return;
        const int32_t t = h[i];
        h[i] = h[w], h[w] = t;
        i = w;
    }
}

/* ids[0..k) = the k best ids of x, best first, 0 < k <= n. A heap of the k best so far with
 * the worst on top: an id that does not beat it (almost all of them, once the heap is full)
 * costs one compare, 16 at a time. A later id never beats an equal logit, so ties keep the
 * lower ids. */
static void el_rank_top(const float *x, int n, int k, int32_t *ids) {
    for (int i = 0; i < k; i++) ids[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) el_sift_down(x, ids, k, i);
    float thr = x[ids[0]];
    for (int i = k; i < n;) {
        if (!el_generic_flag && i % 16 == 0 && i + 16 <= n) {   /* a whole block: one vector compare rejects most */
            const float32x4_t t = vdupq_n_f32(thr);
            uint32x4_t gt = vcgtq_f32(vld1q_f32(x + i), t);
            for (int j = 4; j < 16; j += 4) gt = vorrq_u32(gt, vcgtq_f32(vld1q_f32(x + i + j), t));
            if (vmaxvq_u32(gt) == 0) {
                i += 16;
                continue;
            }
        }
        if (x[i] > thr) {
            ids[0] = i;
            el_sift_down(x, ids, k, 0);
            thr = x[ids[0]];
        }
        i++;
    }
    for (int end = k - 1; end > 0; end--) {   /* heap sort: the worst goes last */
        const int32_t t = ids[0];
        ids[0] = ids[end], ids[end] = t;
        el_sift_down(x, ids, end, 0);
    }
}

/* The maximum of x (n > 0); *nan: whether x holds a NaN (then the maximum is meaningless). */
static float el_max_nan(const float *x, int n, int *nan) {
    float32x4_t mx[4];
    uint32x4_t num = vdupq_n_u32(~0u);   /* lanes that saw no NaN: x == x */
    for (int j = 0; j < 4; j++) mx[j] = vdupq_n_f32(-INFINITY);
    int i = el_generic_flag ? n : 0;   /* the generic twin: the scalar tail takes every element */
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; j++) {
            const float32x4_t v = vld1q_f32(x + i + 4 * j);
            num = vandq_u32(num, vceqq_f32(v, v));
            mx[j] = vmaxq_f32(mx[j], v);
        }
    float m = vmaxvq_f32(vmaxq_f32(vmaxq_f32(mx[0], mx[1]), vmaxq_f32(mx[2], mx[3])));
    int bad = vminvq_u32(num) == 0;
    if (el_generic_flag) i = 0, m = -INFINITY;
    for (; i < n; i++) {
        bad |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *nan = bad;
    return m;
}

static int el_cmp_id(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int el_sampling_check(const el_sampling *s) {
    if (!s) return EL_EINVAL;
    if (!(s->temperature >= 0.0) || !isfinite(s->temperature) || s->top_k < 0) return EL_EINVAL;
    if (!(s->repeat_penalty > 0.0) || !isfinite(s->repeat_penalty) || s->repeat_last_n < -1) return EL_EINVAL;
    if (!(s->top_p > 0.0 && s->top_p <= 1.0) || !(s->min_p >= 0.0 && s->min_p <= 1.0)) return EL_EINVAL;
    return EL_OK;
}

/* the candidates: top_k ids at most */
size_t el_sample_scratch(int n_vocab) { return n_vocab > 0 ? (size_t)n_vocab * sizeof(int32_t) : 0; }

/* The top-p cut over ranked candidates (best first): the fewest whose weights exp(x - m) reach
 * `target`. Returns that count, or 0 when all nc fall short (rounding, top_p near 1). */
static int el_nucleus_cut(const float *x, const int32_t *c, int nc, float m, double target) {
    double acc = 0.0;
    for (int j = 0; j < nc; j++) {
        acc += (double)expf(x[c[j]] - m);
        if (acc >= target) return j + 1;
    }
    return 0;
}

int el_sample(const float *x, int n, const el_sampling *s, double u, void *scratch, size_t scratch_bytes) {
    if (!x || n <= 0 || el_sampling_check(s) != EL_OK || !(s->temperature > 0.0) || !(u >= 0.0 && u < 1.0))
        return EL_EINVAL;
    if (s->top_k <= 0 || s->top_k >= n) return EL_EUNSUPPORTED;   /* see the top of this file */
    if (!scratch || scratch_bytes < el_sample_scratch(n)) return EL_EINVAL;
    int nan;
    const float m = el_max_nan(x, n, &nan);
    if (nan || !isfinite(m)) return EL_ENONFINITE;
    int32_t *c = scratch;
    int nc = s->top_k;
    el_rank_top(x, n, nc, c);
    if (s->top_p < 1.0) {
        double total = 0.0;
        for (int j = 0; j < nc; j++) total += (double)expf(x[c[j]] - m);
        const int cut = el_nucleus_cut(x, c, nc, m, s->top_p * total);
        nc = cut > 0 ? cut : nc;
    }
    if (s->min_p > 0.0) {
        /* p_i >= min_p p_max <=> x_i >= m + log(min_p), in float32 as numpy adds them; the
         * maximum always stays */
        const float thr = m + (float)log(s->min_p);
        int k = 0;
        for (int j = 0; j < nc; j++)
            if (x[c[j]] >= thr) c[k++] = c[j];
        nc = k;
    }
    qsort(c, (size_t)nc, sizeof(int32_t), el_cmp_id);
    /* temperature last; exp(0) = 1 at the maximum, so the weights never all underflow */
    const float inv_t = (float)(1.0 / s->temperature);
    double total = 0.0;
    for (int j = 0; j < nc; j++) total += (double)expf((x[c[j]] - m) * inv_t);
    const double r = u * total;
    double acc = 0.0;
    int last = -1;
    for (int j = 0; j < nc; j++) {
        const double w = (double)expf((x[c[j]] - m) * inv_t);
        if (w > 0.0) last = c[j];
        acc += w;
        if (acc > r) return c[j];
    }
    return last;   /* rounding pushed r past the sum: the last candidate with weight */
}
