/* Fused causal GQA attention with an online softmax: scores never exist as a (T, n) matrix.
 *
 * Work is cut into tiles: one kv head, a few of its query heads (the GQA group shares each K/V
 * row, so a row loaded or converted once serves every head of the group) and a few token rows,
 * at most EL_ATTN_QMAX (token, head) query rows in all. A tile walks its keys in chunks of CH
 * rows: scores for the chunk, then per query row the running max m and sum l are updated, the
 * accumulator is rescaled by e^(m_old - m_new) and the chunk's p_j v_j are added
 * (flash-attention's recurrence, in fp32 whatever the K/V storage). fp16 K/V rows are converted
 * once per tile and chunk with vcvt_f32_f16 into a small buffer.
 *
 * Tasks are (kv head, head group slice, token tile), latest token tiles first (they see the
 * most keys: the dynamic task claiming then balances the causal triangle). When that gives too
 * few tasks for the pool (decode: T = 1, one task per kv head), the keys are split too, and the
 * partial (m, l, acc) states are merged afterwards: out = sum_s e^(m_s - M) acc_s / sum_s
 * e^(m_s - M) l_s.
 *
 * The `_generic` twin is deliberately the plainest form: one query row at a time, one key at a
 * time, scalar exp.
 */
#include "el_common.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define EL_ATTN_MAX_HD 512      /* head_dim bound of the stack scratch (models use 64..256) */
#define EL_ATTN_QMAX 16         /* (token, head) query rows per tile */
#define EL_ATTN_KVBUF 4096      /* floats per converted K (and V) chunk: 16 KB each */
#define EL_ATTN_CHMAX 64        /* keys per chunk */
#define EL_ATTN_SPLIT_MIN 256   /* fewest keys worth a split of their own */


/* Where the K/V rows are. Element offset of (kv head kh, position j):
 *   dense (KVH, n, hd):                       kh * head_stride + j * row_stride
 *   pool  (blocks, layers, bt, KVH, hd):      table[j / bt] * block_stride + layer_off
 *                                             + (j % bt) * row_stride + kh * head_stride */
typedef struct {
    const void *k, *v;
    int f16;
    const int32_t *table;   /* NULL: dense */
    int bt;
    size_t block_stride, layer_off, row_stride, head_stride;
} el_kv_src;

static inline size_t el_kv_off(const el_kv_src *s, int kh, int j) {
    if (!s->table) return (size_t)kh * s->head_stride + (size_t)j * s->row_stride;
    return (size_t)s->table[j / s->bt] * s->block_stride + s->layer_off + (size_t)(j % s->bt) * s->row_stride +
           (size_t)kh * s->head_stride;
}

typedef struct {
    const float *q;
    float *out;
    int T, H, KVH, hd, start, G;
    int gh, n_hsub;        /* query heads per tile, tiles per group */
    int tq, n_ttile;       /* token rows per tile, token tiles */
    int n_split, split_len;
    float scale;
    el_kv_src kv;
    float *part;           /* n_split > 1: (T, H, n_split, hd + 2) partial states: m, l, acc */
} el_attn_job;

/* ---- NEON ------------------------------------------------------------------------------------ */

static inline float el_dot(const float *a, const float *b, int n) {
    float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0, s2 = s0, s3 = s0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
        s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
        s2 = vfmaq_f32(s2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
        s3 = vfmaq_f32(s3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
    }
    for (; i + 4 <= n; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* q against four keys at once: each q load serves four FMAs (a lone dot is load-bound), and
 * one pairwise-add tree reduces the four accumulators into the four scores. */
static inline float32x4_t el_dot4(const float *q, const float *const *k, int n) {
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t vq = vld1q_f32(q + i);
        a0 = vfmaq_f32(a0, vq, vld1q_f32(k[0] + i));
        a1 = vfmaq_f32(a1, vq, vld1q_f32(k[1] + i));
        a2 = vfmaq_f32(a2, vq, vld1q_f32(k[2] + i));
        a3 = vfmaq_f32(a3, vq, vld1q_f32(k[3] + i));
    }
    float32x4_t s = vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
    if (i < n) {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (; i < n; i++)
            for (int j = 0; j < 4; j++) t[j] += q[i] * k[j][i];
        s = vaddq_f32(s, vld1q_f32(t));
    }
    return s;
}

/* acc = acc * alpha + sum_j p[j] * rows[j] */
static inline void el_scale_axpy(float *acc, float alpha, const float *p, const float *const *rows, int nr, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        float32x4_t a0 = vmulq_n_f32(vld1q_f32(acc + i), alpha), a1 = vmulq_n_f32(vld1q_f32(acc + i + 4), alpha);
        for (int j = 0; j < nr; j++) {
            a0 = vfmaq_n_f32(a0, vld1q_f32(rows[j] + i), p[j]);
            a1 = vfmaq_n_f32(a1, vld1q_f32(rows[j] + i + 4), p[j]);
        }
        vst1q_f32(acc + i, a0);
        vst1q_f32(acc + i + 4, a1);
    }
    for (; i + 4 <= n; i += 4) {
        float32x4_t a0 = vmulq_n_f32(vld1q_f32(acc + i), alpha);
        for (int j = 0; j < nr; j++) a0 = vfmaq_n_f32(a0, vld1q_f32(rows[j] + i), p[j]);
        vst1q_f32(acc + i, a0);
    }
    for (; i < n; i++) {
        float a = acc[i] * alpha;
        for (int j = 0; j < nr; j++) a += p[j] * rows[j][i];
        acc[i] = a;
    }
}

static inline void el_cvt_row(float *dst, const uint16_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        vst1q_f32(dst + i, el_f16x4_load(src + i));
        vst1q_f32(dst + i + 4, el_f16x4_load(src + i + 4));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, el_f16x4_load(src + i));
    for (; i < n; i++) dst[i] = el_f16_to_f32(src[i]);
}

/* Rows j0..j0+c-1 of kv head kh as fp32 row pointers: straight into the arena for fp32, through
 * buf (converted) for fp16. */
static void el_fetch_rows(const el_kv_src *s, const void *base, int kh, int j0, int c, int hd, float *buf,
                          const float **rows) {
    for (int i = 0; i < c; i++) {
        size_t off = el_kv_off(s, kh, j0 + i);
        if (s->f16) {
            el_cvt_row(buf + (size_t)i * hd, (const uint16_t *)base + off, hd);
            rows[i] = buf + (size_t)i * hd;
        } else {
            rows[i] = (const float *)base + off;
        }
    }
}

/* One tile: kv head kh, query heads h0..h1-1 (all of group kh), token rows t0..t1-1, keys
 * [j_lo, j_hi) (a split; each row is also capped by causality). */
static void el_attn_tile(const el_attn_job *J, int kh, int h0, int h1, int t0, int t1, int j_lo, int j_hi, int split) {
    const int hd = J->hd, gh = h1 - h0, nq = gh * (t1 - t0);
    const int ch = EL_MIN(EL_ATTN_CHMAX, EL_ATTN_KVBUF / hd);
    float acc[EL_ATTN_QMAX * EL_ATTN_MAX_HD];
    float sc[EL_ATTN_QMAX][EL_ATTN_CHMAX];
    float kbuf[EL_ATTN_KVBUF], vbuf[EL_ATTN_KVBUF];
    const float *krow[EL_ATTN_CHMAX], *vrow[EL_ATTN_CHMAX], *qrow[EL_ATTN_QMAX];
    float m[EL_ATTN_QMAX], l[EL_ATTN_QMAX];
    int lim[EL_ATTN_QMAX];

    for (int qi = 0; qi < nq; qi++) {
        int t = t0 + qi / gh, h = h0 + qi % gh;
        qrow[qi] = J->q + ((size_t)t * J->H + h) * hd;
        lim[qi] = EL_MIN(j_hi, J->start + t + 1);  /* keys < lim are visible */
        m[qi] = -INFINITY;
        l[qi] = 0.0f;
    }
    memset(acc, 0, (size_t)nq * hd * sizeof(float));
    const int j_end = EL_MIN(j_hi, J->start + t1);
    for (int j0 = j_lo; j0 < j_end; j0 += ch) {
        const int c = EL_MIN(ch, j_end - j0);
        el_fetch_rows(&J->kv, J->kv.k, kh, j0, c, hd, kbuf, krow);
        el_fetch_rows(&J->kv, J->kv.v, kh, j0, c, hd, vbuf, vrow);
        for (int qi = 0; qi < nq; qi++) {
            const int nv = EL_MIN(c, lim[qi] - j0);
            if (nv <= 0) continue;
            float *s = sc[qi], mc = -INFINITY;
            int j = 0;
            if (nv >= 4) {
                float32x4_t vmax = vdupq_n_f32(-INFINITY);
                for (; j + 4 <= nv; j += 4) {
                    float32x4_t d = vmulq_n_f32(el_dot4(qrow[qi], krow + j, hd), J->scale);
                    vst1q_f32(s + j, d);
                    vmax = vmaxq_f32(vmax, d);
                }
                mc = vmaxvq_f32(vmax);
            }
            for (; j < nv; j++) {
                s[j] = el_dot(qrow[qi], krow[j], hd) * J->scale;
                mc = s[j] > mc ? s[j] : mc;
            }
            const float mnew = mc > m[qi] ? mc : m[qi];
            const float alpha = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mnew);
            const float sum = el_exp_sub_sum(s, nv, mnew);
            l[qi] = l[qi] * alpha + sum;
            m[qi] = mnew;
            el_scale_axpy(acc + (size_t)qi * hd, alpha, s, vrow, nv, hd);
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        int t = t0 + qi / gh, h = h0 + qi % gh;
        const float *a = acc + (size_t)qi * hd;
        if (J->n_split == 1) {
            /* l > 0: without a split every row sees at least key 0 */
            float *o = J->out + ((size_t)t * J->H + h) * hd;
            float32x4_t inv = vdupq_n_f32(1.0f / l[qi]);
            int i = 0;
            for (; i + 4 <= hd; i += 4) vst1q_f32(o + i, vmulq_f32(vld1q_f32(a + i), inv));
            for (; i < hd; i++) o[i] = a[i] / l[qi];
        } else {
            float *p = J->part + (((size_t)t * J->H + h) * J->n_split + split) * (size_t)(hd + 2);
            p[0] = m[qi];
            p[1] = l[qi];
            memcpy(p + 2, a, (size_t)hd * sizeof(float));
        }
    }
}

static void el_attn_task(void *ctx, int task, int n_tasks) {
    const el_attn_job *J = ctx;
    (void)n_tasks;
    const int per_tt = J->KVH * J->n_hsub * J->n_split;
    const int tt = J->n_ttile - 1 - task / per_tt;      /* latest (costliest) token tiles first */
    int r = task % per_tt;
    const int split = r % J->n_split;
    r /= J->n_split;
    const int hs = r % J->n_hsub, kh = r / J->n_hsub;
    const int t0 = tt * J->tq, t1 = EL_MIN(J->T, t0 + J->tq);
    const int g0 = hs * J->gh, g1 = EL_MIN(J->G, g0 + J->gh);
    const int j_lo = split * J->split_len;
    const int j_hi = EL_MIN(J->start + J->T, j_lo + J->split_len);
    el_attn_tile(J, kh, kh * J->G + g0, kh * J->G + g1, t0, t1, j_lo, j_hi, split);
}

/* out = merge of the n_split partial states of every (token, head) row */
static void el_attn_merge(const el_attn_job *J) {
    const int hd = J->hd, S = J->n_split;
    for (size_t row = 0; row < (size_t)J->T * J->H; row++) {
        const float *p = J->part + row * S * (size_t)(hd + 2);
        float M = -INFINITY, L = 0.0f;
        for (int s = 0; s < S; s++)
            if (p[s * (hd + 2) + 1] > 0.0f && p[s * (hd + 2)] > M) M = p[s * (hd + 2)];
        float *o = J->out + row * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int s = 0; s < S; s++) {
            const float *ps = p + s * (hd + 2);
            if (!(ps[1] > 0.0f)) continue;      /* this split held no key visible to the row */
            float w = expf(ps[0] - M);
            L += w * ps[1];
            for (int i = 0; i < hd; i++) o[i] += w * ps[2 + i];
        }
        float inv = 1.0f / L;
        for (int i = 0; i < hd; i++) o[i] *= inv;
    }
}

/* ---- generic twin ---------------------------------------------------------------------------- */

static inline float el_kv_at(const el_kv_src *s, const void *base, size_t off) {
    return s->f16 ? el_f16_to_f32(((const uint16_t *)base)[off]) : ((const float *)base)[off];
}

/* One query row (token t, head h): online softmax one key at a time. */
static void el_attn_row_generic(const el_attn_job *J, int t, int h, float *acc) {
    const int hd = J->hd, kh = h / J->G, n = J->start + t + 1;
    const float *q = J->q + ((size_t)t * J->H + h) * hd;
    float m = -INFINITY, l = 0.0f;
    for (int i = 0; i < hd; i++) acc[i] = 0.0f;
    for (int j = 0; j < n; j++) {
        size_t off = el_kv_off(&J->kv, kh, j);
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s += q[i] * el_kv_at(&J->kv, J->kv.k, off + i);
        s *= J->scale;
        float mnew = s > m ? s : m;
        float alpha = expf(m - mnew), p = expf(s - mnew);  /* expf(-inf) = 0 on the first key */
        l = l * alpha + p;
        for (int i = 0; i < hd; i++) acc[i] = acc[i] * alpha + p * el_kv_at(&J->kv, J->kv.v, off + i);
        m = mnew;
    }
    float *o = J->out + ((size_t)t * J->H + h) * hd;
    for (int i = 0; i < hd; i++) o[i] = acc[i] / l;
}

static void el_attn_task_generic(void *ctx, int task, int n_tasks) {
    const el_attn_job *J = ctx;
    (void)n_tasks;
    float acc[EL_ATTN_MAX_HD];
    /* task = a query row, latest tokens first */
    const int row = J->T * J->H - 1 - task;
    el_attn_row_generic(J, row / J->H, row % J->H, acc);
}

/* ---- entry points ---------------------------------------------------------------------------- */

static int el_attn_check(const float *q, const float *out, int T, int H, int KVH, int hd, int start, const void *k,
                         const void *v) {
    if (!q || !out || !k || !v) return EL_EINVAL;
    if (T <= 0 || H <= 0 || KVH <= 0 || hd <= 0 || start < 0 || start > INT_MAX - T) return EL_EINVAL;
    if (H % KVH != 0) return EL_EINVAL;
    if ((int64_t)T * H > INT_MAX) return EL_EINVAL;     /* query rows are counted in int tasks */
    if (hd > EL_ATTN_MAX_HD) return EL_EUNSUPPORTED;
    return EL_OK;
}

static int el_attn_run(el_pool *pool, el_attn_job *J) {
    J->G = J->H / J->KVH;
    J->scale = 1.0f / sqrtf((float)J->hd);
    J->n_split = 1;
    J->part = NULL;
    if (el_generic_flag) {
        el_parallel_for(pool, J->T * J->H, el_attn_task_generic, J);
        return EL_OK;
    }
    /* tile shape: as many heads of the group as fit, then token rows, evened out */
    J->n_hsub = (J->G + EL_ATTN_QMAX - 1) / EL_ATTN_QMAX;
    J->gh = (J->G + J->n_hsub - 1) / J->n_hsub;
    J->tq = EL_MIN(J->T, EL_ATTN_QMAX / J->gh);
    J->n_ttile = (J->T + J->tq - 1) / J->tq;
    J->tq = (J->T + J->n_ttile - 1) / J->n_ttile;
    const int n = J->start + J->T;
    const int tiles = J->KVH * J->n_hsub * J->n_ttile, threads = el_pool_threads(pool);
    if (threads > 1 && tiles < 2 * threads && n >= 2 * EL_ATTN_SPLIT_MIN) {
        /* too few tiles to occupy the pool (decode): split the keys as well */
        int want = (2 * threads + tiles - 1) / tiles;
        J->n_split = EL_MIN(want, n / EL_ATTN_SPLIT_MIN);
    }
    if (J->n_split > 1) {
        J->part = malloc((size_t)J->T * J->H * J->n_split * (size_t)(J->hd + 2) * sizeof(float));
        if (!J->part) J->n_split = 1;  /* just slower */
    }
    J->split_len = (n + J->n_split - 1) / J->n_split;
    el_parallel_for(pool, tiles * J->n_split, el_attn_task, J);
    if (J->n_split > 1) {
        el_attn_merge(J);
        free(J->part);
    }
    return EL_OK;
}

int el_attention_dense(el_pool *pool, const float *q, float *out, int T, int H, int KVH, int hd, int start,
                       const float *k, const float *v) {
    int rc = el_attn_check(q, out, T, H, KVH, hd, start, k, v);
    if (rc != EL_OK) return rc;
    el_attn_job J = {.q = q, .out = out, .T = T, .H = H, .KVH = KVH, .hd = hd, .start = start};
    J.kv = (el_kv_src){.k = k, .v = v, .f16 = 0, .table = NULL, .bt = start + T,
                       .row_stride = (size_t)hd, .head_stride = (size_t)(start + T) * (size_t)hd};
    return el_attn_run(pool, &J);
}

int el_attention_pool(el_pool *pool, const float *q, float *out, int T, int H, int KVH, int hd, int start,
                      const void *k, const void *v, int kv_type, const int32_t *block_table, int block_tokens,
                      int n_layers, int layer) {
    int rc = el_attn_check(q, out, T, H, KVH, hd, start, k, v);
    if (rc != EL_OK) return rc;
    if (kv_type != EL_F32 && kv_type != EL_F16) return EL_EUNSUPPORTED;
    if (!block_table || block_tokens <= 0 || n_layers <= 0 || layer < 0 || layer >= n_layers) return EL_EINVAL;
    const int n = start + T, n_blocks = (n - 1) / block_tokens + 1;
    for (int i = 0; i < n_blocks; i++)
        if (block_table[i] < 0) return EL_EINVAL;
    el_attn_job J = {.q = q, .out = out, .T = T, .H = H, .KVH = KVH, .hd = hd, .start = start};
    const size_t row = (size_t)KVH * hd, layer_sz = (size_t)block_tokens * row;
    J.kv = (el_kv_src){.k = k, .v = v, .f16 = kv_type == EL_F16, .table = block_table, .bt = block_tokens,
                       .block_stride = (size_t)n_layers * layer_sz, .layer_off = (size_t)layer * layer_sz,
                       .row_stride = row, .head_stride = (size_t)hd};
    return el_attn_run(pool, &J);
}
