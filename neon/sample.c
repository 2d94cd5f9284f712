/* el_sample: one token drawn from a logits row through llama.cpp's sampler chain,
 *
 *     top-k -> top-p -> min-p -> temperature -> draw,
 *
 * as edgellm/sampling.py's Sampler defines it; that numpy code is this file's twin, and
 * backends/reference.py's sample_chain the chain's definition in float64
 * (tests/test_native_sampler.py). top-p and min-p see probabilities at temperature 1
 * (renormalised over what top-k kept); temperature only reshapes the surviving set.
 *
 * Why native: a sampled token had to leave the native decode loop for Python's sampler
 * (with the Python loop, default sampled decoding ran ~10% slower than greedy on the x86 host);
 * el_decode_sample (decode_step.c) draws here between its steps. With top-k set (llama.cpp's and
 * edgellm's default is 40) only k logits are weighed, with a scalar exp; without it every logit
 * is, with the softmax's vectorized exp (el_exp_sub_sum).
 *
 * Both twins fix every order that can change which token a uniform u picks: candidates rank by
 * (logit descending, id ascending), so ties at the top-k or top-p boundary keep the lower ids,
 * and the draw walks the final candidates in id order. Sums are float64 over float32 weights,
 * as numpy's; the twins differ only where exp rounds differently (an ulp) or numpy sums
 * pairwise, which moves a pick only when u falls within ~1e-7 of a boundary. */
#include "el_common.h"

#include <float.h>
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

/* h[0..n) into a heap with the worst id on top */
static void el_heapify(const float *x, int32_t *h, int n) {
    for (int i = n / 2 - 1; i >= 0; i--) el_sift_down(x, h, n, i);
}

/* a heap h[0..n) (el_heapify's) sorted best first: the worst goes last, then the next */
static void el_heap_sort(const float *x, int32_t *h, int n) {
    for (int end = n - 1; end > 0; end--) {
        const int32_t t = h[0];
        h[0] = h[end], h[end] = t;
        el_sift_down(x, h, end, 0);
    }
}

/* Whether any of x[0..16) is above t (ge: at or above), in one vector compare */
static inline int el_any16(const float *x, float t, int ge) {
    const float32x4_t v = vdupq_n_f32(t);
    uint32x4_t r = vdupq_n_u32(0);
    for (int j = 0; j < 16; j += 4) r = vorrq_u32(r, ge ? vcgeq_f32(vld1q_f32(x + j), v) : vcgtq_f32(vld1q_f32(x + j), v));
    return vmaxvq_u32(r) != 0;
}

/* ids[0..k) = the k best ids of x, best first, 0 < k <= n. A heap of the k best so far with
 * the worst on top: an id that does not beat it (almost all of them, once the heap is full)
 * costs one compare, 16 at a time. A later id never beats an equal logit, so ties keep the
 * lower ids. */
static void el_rank_top(const float *x, int n, int k, int32_t *ids) {
    for (int i = 0; i < k; i++) ids[i] = i;
    el_heapify(x, ids, k);
    float thr = x[ids[0]];
    for (int i = k; i < n;) {
        if (!el_generic_flag && i % 16 == 0 && i + 16 <= n && !el_any16(x + i, thr, 0)) {   /* one compare rejects most */
            i += 16;
            continue;
        }
        if (x[i] > thr) {
            ids[0] = i;
            el_sift_down(x, ids, k, 0);
            thr = x[ids[0]];
        }
        i++;
    }
    el_heap_sort(x, ids, k);
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
    if (!(s->top_p >= 0.0 && s->top_p <= 1.0) || !(s->min_p >= 0.0 && s->min_p <= 1.0)) return EL_EINVAL;
    return EL_OK;
}

/* the candidates (ids) and, for a chain without top-k, every logit's weight */
size_t el_sample_scratch(int n_vocab) { return n_vocab > 0 ? (size_t)n_vocab * (sizeof(int32_t) + sizeof(float)) : 0; }

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

/* w[0..n) = exp(w[i]) in place, vectorized (the softmax's exp; its scalar twin under
 * el_use_generic) */
static void el_exp_inplace(float *w, int n) { (void)(el_generic_flag ? el_exp_sub_sum_generic : el_exp_sub_sum)(w, n, 0.0f); }

/* sum of w[0..n) in float64, 4 running sums (one is a chain of dependent adds) */
static double el_sum_f64(const float *w, int n) {
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) a[j] += (double)w[i + j];
    for (; i < n; i++) a[0] += (double)w[i];
    return (a[0] + a[1]) + (a[2] + a[3]);
}

/* The draw over candidates in id order: c[0..nc) (sorted ids, weights exp((x - m) * inv_t)
 * computed here), or every id when c is NULL (weights w[0..nc)). The first candidate whose
 * cumulative weight exceeds u * total: a whole vocabulary is walked by blocks of 256 first. */
#define EL_DRAW_BLOCK 256
static int el_draw(const float *x, const int32_t *c, const float *w, int nc, float m, float inv_t, double u) {
    double total;
    if (c) {
        total = 0.0;
        for (int j = 0; j < nc; j++) total += (double)expf((x[c[j]] - m) * inv_t);
    } else {
        total = el_sum_f64(w, nc);
    }
    double r = u * total, acc = 0.0;
    int j = 0, last = -1;
    if (!c)   /* skip whole blocks that end at or below r */
        for (double bs; j + EL_DRAW_BLOCK <= nc && acc + (bs = el_sum_f64(w + j, EL_DRAW_BLOCK)) <= r; j += EL_DRAW_BLOCK) {
            acc += bs;
            if (bs > 0.0) last = j + EL_DRAW_BLOCK - 1;   /* (its last id with weight: found below if needed) */
        }
    for (; j < nc; j++) {
        const double wj = c ? (double)expf((x[c[j]] - m) * inv_t) : (double)w[j];
        if (wj > 0.0) last = c ? c[j] : j;
        acc += wj;
        if (acc > r) return c ? c[j] : j;
    }
    /* rounding pushed r past the sum: the last candidate with weight */
    if (!c)
        while (last > 0 && w[last] == 0.0f) last--;
    return last;
}

/* The last member of a ranked prefix (logit descending, id ascending): the prefix is every id
 * with a higher logit, or the same logit and an id up to this one's. */
typedef struct {
    float x;
    int id;
} el_rank_end;

/* The top-p nucleus of a whole vocabulary whose weights w = exp(x - m) sum to target / top_p,
 * without ranking it all (a heap of thousands of ids took ~2 ms a draw, numpy's SIMD sort ~0.5): the weights' mass by bucket of m - x (the buckets follow the ranking:
 * a higher logit never falls in a later bucket) finds the bucket where the cumulative mass
 * reaches target; only that bucket's members are ranked (a heap sort in c), and the cut falls
 * among them. The float64 sums run in another order than the ranked one: they differ in the
 * last bits, which moves a cut only where the mass lies within that much of the target. */
#define EL_NUC_BUCKETS 4096
#define EL_NUC_RANGE 104.0f   /* exp(x - m) is 0 in fp32 below m - 104 */
static inline int el_nuc_bucket(float x, float m) {
    const float d = (m - x) * (EL_NUC_BUCKETS / EL_NUC_RANGE);
    return d < (float)(EL_NUC_BUCKETS - 1) ? (int)d : EL_NUC_BUCKETS - 1;
}

static el_rank_end el_nucleus_flat(const float *x, const float *w, int n, float m, double target, int32_t *c) {
    double mass[EL_NUC_BUCKETS] = {0};
    for (int i = 0; i < n; i++) mass[el_nuc_bucket(x[i], m)] += (double)w[i];
    double before = 0.0;
    int b = 0;
    while (b < EL_NUC_BUCKETS - 1 && before + mass[b] < target) before += mass[b++];
    int k = 0;
    for (int i = 0; i < n; i++)
        if (el_nuc_bucket(x[i], m) == b) c[k++] = i;
    if (k == 0) return (el_rank_end){-INFINITY, n};   /* the mass fell short in the last bucket: every id */
    el_heapify(x, c, k);
    el_heap_sort(x, c, k);
    int j = 0;
    for (double acc = before; j < k - 1 && (acc += (double)w[c[j]]) < target;) j++;
    return (el_rank_end){x[c[j]], c[j]};   /* short of the target (rounding): the bucket's last */
}

int el_sample(const float *x, int n, const el_sampling *s, double u, void *scratch, size_t scratch_bytes) {
    if (!x || n <= 0 || el_sampling_check(s) != EL_OK || !(s->temperature > 0.0) || !(u >= 0.0 && u < 1.0))
        return EL_EINVAL;
    if (!scratch || scratch_bytes < el_sample_scratch(n)) return EL_EINVAL;
    int nan;
    const float m = el_max_nan(x, n, &nan);
    if (nan || !isfinite(m)) return EL_ENONFINITE;
    int32_t *c = scratch;
    float *w = (float *)(c + n);
    /* a temperature below 1/FLT_MAX (~2.9e-39) would make 1/t infinite, and (m - m) * inf a NaN
     * weight at the maximum: at FLT_MAX every other weight still underflows to 0, the argmax */
    const double inv_td = 1.0 / s->temperature;
    const float inv_t = inv_td < (double)FLT_MAX ? (float)inv_td : FLT_MAX;
    /* min-p: p_i >= min_p p_max <=> x_i >= m + log(min_p), in float32 as numpy adds them; the
     * maximum always stays */
    const float thr = s->min_p > 0.0 ? m + (float)log(s->min_p) : -INFINITY;
    if (s->top_k > 0 && s->top_k < n) {
        int nc = s->top_k;
        el_rank_top(x, n, nc, c);
        if (s->top_p < 1.0) {
            double total = 0.0;
            for (int j = 0; j < nc; j++) total += (double)expf(x[c[j]] - m);
            const int cut = el_nucleus_cut(x, c, nc, m, s->top_p * total);
            nc = cut > 0 ? cut : nc;
        }
        if (s->min_p > 0.0) {
            int k = 0;
            for (int j = 0; j < nc; j++)
                if (x[c[j]] >= thr) c[k++] = c[j];
            nc = k;
        }
        qsort(c, (size_t)nc, sizeof(int32_t), el_cmp_id);
        /* temperature last; exp(0) = 1 at the maximum, so the weights never all underflow */
        return el_draw(x, c, NULL, nc, m, inv_t, u);
    }
    /* Without top-k every id is a candidate, in id order, its weight (vectorized exp) 0 outside
     * the nucleus or below min-p. The nucleus: the ids ranked up to its last member e, found
     * by buckets (a flat distribution's holds thousands of ids: no full ranking). */
    el_rank_end e = {-INFINITY, n};
    if (s->top_p >= 1.0 && s->min_p > 0.0) {
        /* min-p alone usually keeps a few ids: weigh only those (scalar exp), in id order */
        int nc = 0;
        for (int i = 0; i < n && nc <= n / 16;) {
            if (!el_generic_flag && i % 16 == 0 && i + 16 <= n && !el_any16(x + i, thr, 1)) {   /* a block below thr */
                i += 16;
                continue;
            }
            if (x[i] >= thr) c[nc++] = i;
            i++;
        }
        if (nc <= n / 16) return el_draw(x, c, NULL, nc, m, inv_t, u);
    }
    if (s->top_p < 1.0) {
        for (int i = 0; i < n; i++) w[i] = x[i] - m;
        el_exp_inplace(w, n);
        e = el_nucleus_flat(x, w, n, m, s->top_p * el_sum_f64(w, n), c);
    }
    for (int i = 0; i < n; i++)
        w[i] = (x[i] > e.x || (x[i] == e.x && i <= e.id)) && x[i] >= thr ? (x[i] - m) * inv_t : -INFINITY;
    el_exp_inplace(w, n);
    return el_draw(x, NULL, w, n, m, inv_t, u);
}
