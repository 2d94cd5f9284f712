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
 * Decode (T = 1) takes its own path (el_attn_dec_*, below the tile path): tasks are key ranges
 * over all heads, reading whole K/V rows once; see the comment there.
 *
 * The `_generic` twin is deliberately the plainest form: one query row at a time, one key at a
 * time, scalar exp.
 */
#include "el_common.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define EL_ATTN_MAX_HD 512      /* head_dim bound of the stack scratch (models use 64..256) */
/* (token, head) query rows per tile. Each tile converts (fp16) and transposes its kv head's keys
 * again, so bigger tiles repeat that less: 64 against 32 measured 0.53 vs 0.62 ms per layer for
 * 32 tokens after 400 (2 threads, SmolLM2 shapes), 3.3 vs 3.8 ms for 433 from 0. 96 was no
 * better then; once the score and PV blocks went 16 wide and the exp tails stopped stalling
 * (Zen 5), 96 against 64 took 27.4 vs 29.6 ms of attention for a 432-token prompt and 133 vs
 * 137 for 1024 (timing build, medians of 12, alternating); 128 was no better than 96. Scratch:
 * ~325 KB with EL_ATTN_MAX_HD, per thread on the heap (el_tile_scratch), as the int8 decode
 * path's dequantized chunk (256 KB). */
#define EL_ATTN_QMAX 96
#define EL_ATTN_KVBUF 8192      /* floats per K (transposed) and V chunk buffer: 32 KB each */
#define EL_ATTN_CHMAX 64        /* keys per chunk */
#define EL_ATTN_SPLIT_MIN 64    /* fewest keys worth a split of their own */
/* decode (one query token, below): */
#define EL_ATTN_DEC_CH 64        /* keys per chunk (a multiple of 4) */
#define EL_ATTN_DEC_I8ROW 512    /* KVH * hd of an int8 pool the decode path dequantizes per chunk */


/* Where the K/V rows are. Element offset of (kv head kh, position j):
 *   dense (KVH, n, hd):                       kh * head_stride + j * row_stride
 *   pool  (blocks, layers, bt, KVH, hd):      table[j / bt] * block_stride + layer_off
 *                                             + (j % bt) * row_stride + kh * head_stride */
typedef struct {
    const void *k, *v;
    int f16;
    int i8;                 /* int8 arena: element (kh, j) is k[off] * ks[off / hd] (v: vs) */
    const float *ks, *vs;   /* i8: per (token, kv head) scales, the arena's shape without hd */
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
    size_t q_ld;           /* floats from one token's q row to the next (0: H * hd, contiguous) */
    float *out;
    int T, H, KVH, hd, start, G;
    int gh, n_hsub;        /* query heads per tile, tiles per group */
    int tq, n_ttile;       /* token rows per tile, token tiles */
    int n_split, split_len;
    float scale;
    el_kv_src kv;
    float *part;           /* n_split > 1: (T, H, n_split, hd + 2) partial states: m, l, acc */
    int *nomem;            /* set (atomically) by a tile that got no scratch: the call fails */
} el_attn_job;

/* F(n, args...) with the row count nr (1..4) as the compile-time constant n: the block kernels
 * take it as a constant so that each count gets its own unrolled copy */
#define EL_BY_ROWS(nr, F, ...)                  \
    do {                                        \
        switch (nr) {                           \
        case 4: F(4, __VA_ARGS__); break;       \
        case 3: F(3, __VA_ARGS__); break;       \
        case 2: F(2, __VA_ARGS__); break;       \
        default: F(1, __VA_ARGS__); break;      \
        }                                       \
    } while (0)

/* ---- NEON ------------------------------------------------------------------------------------ */

/* A tile's chunk works like two small GEMMs whose operands are laid out for broadcast-FMA
 * register blocks: K is transposed into kt (hd, ch) so that a score block is q[d] (broadcast)
 * times 4 vectors of 4 keys, summed over d; V stays in rows (ch, hd) so that an output block is
 * p[j] (broadcast) times 4 vectors of 4 dims, summed over j. Two query rows share every load:
 * 8 independent accumulators, 6 loads per 8 FMAs. (One accumulator per dot product, or per
 * 4 output dims, is a chain of dependent FMAs: the first version of this kernel ran at a
 * quarter of the FMA rate for that reason.) */
#define EL_ATTN_KB 16           /* keys per score block: 4 vectors */

/* dst[d * ld + j] = rows[j][d] for j < nr (rows of a 4-row group past nr read as zero) and
 * d < hd: 4x4 register transposes, a scalar pass for the hd % 4 tail */
static void el_transpose_rows(float *dst, int ld, const float *const *rows, int nr, int hd) {
    static const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < nr; j += 4) {
        const float *r[4];
        for (int i = 0; i < 4; i++) r[i] = j + i < nr ? rows[j + i] : NULL;
        int d = 0;
        for (; d + 4 <= hd; d += 4) {
            float32x4_t v[4];
            for (int i = 0; i < 4; i++) v[i] = vld1q_f32(r[i] ? r[i] + d : zero4);
            float32x4x2_t a = vzipq_f32(v[0], v[2]), b = vzipq_f32(v[1], v[3]);
            float32x4x2_t c = vzipq_f32(a.val[0], b.val[0]), e = vzipq_f32(a.val[1], b.val[1]);
            vst1q_f32(dst + (size_t)(d + 0) * ld + j, c.val[0]);
            vst1q_f32(dst + (size_t)(d + 1) * ld + j, c.val[1]);
            vst1q_f32(dst + (size_t)(d + 2) * ld + j, e.val[0]);
            vst1q_f32(dst + (size_t)(d + 3) * ld + j, e.val[1]);
        }
        for (; d < hd; d++)
            for (int i = 0; i < 4; i++) dst[(size_t)d * ld + j + i] = r[i] ? r[i][d] : 0.0f;
    }
}

static inline void el_cvt_row(float *dst, const uint16_t *src, int n) {
    int i = 0;
#if EL_SIMDE && defined(__AVX512F__)
    /* x86: 16 values per VCVTPH2PS (the 4-lane loop cost ~6% of a cached chat turn's samples);
     * the conversion is exact, so the values are the same */
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
    for (; i + 8 <= n; i += 8) {
        vst1q_f32(dst + i, el_f16x4_load(src + i));
        vst1q_f32(dst + i + 4, el_f16x4_load(src + i + 4));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, el_f16x4_load(src + i));
    for (; i < n; i++) dst[i] = el_f16_to_f32(src[i]);
}

/* Element offsets of rows j0..j0+c-1 (kv head 0): one division per pool block, not per row */
static void el_row_offsets(const el_kv_src *s, int j0, int c, size_t *off) {
    for (int i = 0; i < c;) {
        const int j = j0 + i;
        if (!s->table) {
            off[i] = (size_t)j * s->row_stride;
            i++;
            continue;
        }
        const int r = j % s->bt, run = EL_MIN(s->bt - r, c - i);
        const size_t base = (size_t)s->table[j / s->bt] * s->block_stride + s->layer_off + (size_t)r * s->row_stride;
        for (int k = 0; k < run; k++) off[i + k] = base + (size_t)k * s->row_stride;
        i += run;
    }
}

static inline size_t el_kv_esz(const el_kv_src *s) { return s->i8 ? 1 : s->f16 ? 2 : 4; }

/* dst[i] = q[i] * scale: int8 K/V dequantized as the pool's reader does (one rounding each) */
static inline void el_dq_row(float *dst, const int8_t *q, float scale, int n) {
    int i = 0;
#if EL_SIMDE && defined(__AVX512F__)
    const __m512 s16 = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                     _mm_loadu_si128((const __m128i *)(q + i)))), s16));
#endif
    for (; i + 8 <= n; i += 8) {
        const int16x8_t w = vmovl_s8(vld1_s8(q + i));
        vst1q_f32(dst + i, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), scale));
        vst1q_f32(dst + i + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))), scale));
    }
    for (; i < n; i++) dst[i] = (float)q[i] * scale;
}

/* Prefetches the rows at element offsets pf[i], i < npf, of one kv head */
static void el_prefetch_rows(const el_kv_src *s, const void *base, const size_t *pf, int npf, int hd) {
    const size_t esz = el_kv_esz(s), row_bytes = (size_t)hd * esz;
    for (int i = 0; i < npf; i++) {
        const char *r = (const char *)base + pf[i] * esz;
        for (size_t b = 0; b < row_bytes; b += 64) el_prefetch_ahead(r + b);
    }
}

/* Rows i < c of one kv head (element offsets off[i]) as fp32 row pointers: straight into the
 * arena for fp32, through buf (converted) for fp16. While converting it prefetches the next
 * chunk's rows (offsets pf[i], i < npf): pool blocks are far apart in the arena (a block holds
 * every layer), so the hardware prefetcher loses the stream at each block boundary. */
static void el_fetch_rows(const el_kv_src *s, const void *base, const size_t *off, int c, const size_t *pf, int npf,
                          int hd, float *buf, const float **rows) {
    el_prefetch_rows(s, base, pf, npf, hd);
    const float *scale = base == s->k ? s->ks : s->vs;
    for (int i = 0; i < c; i++) {
        if (s->i8) {
            el_dq_row(buf + (size_t)i * hd, (const int8_t *)base + off[i], scale[off[i] / s->head_stride], hd);
            rows[i] = buf + (size_t)i * hd;
        } else if (s->f16) {
            el_cvt_row(buf + (size_t)i * hd, (const uint16_t *)base + off[i], hd);
            rows[i] = buf + (size_t)i * hd;
        } else {
            rows[i] = (const float *)base + off[i];
        }
    }
}

/* s[r][j] = q[r] . key j for NR (1 or 2) query rows and keys 0..nk-1 (nk a multiple of
 * EL_ATTN_KB): kt is (hd, ld). Each dot product is summed in two halves of d, added at the end:
 * one chain of hd FMAs rounds more than the 4-lane sums it replaced (on SmolLM2 that flipped a
 * near-tie top-1 against llama.cpp's golden), two halves of hd/2 round less. */
static inline __attribute__((always_inline)) void
el_scores_block(const int NR, const float *const *q, const float *kt, int ld, int nk, int hd, float *const *s) {
    const int half = hd / 2;
    for (int k0 = 0; k0 < nk; k0 += EL_ATTN_KB) {
        float32x4_t a[2][4], part[2][4];
        for (int pass = 0; pass < 2; pass++) {
            const int d0 = pass ? half : 0, d1 = pass ? hd : half;
            for (int r = 0; r < NR; r++)
                for (int v = 0; v < 4; v++) a[r][v] = vdupq_n_f32(0.0f);
            const float *kc = kt + (size_t)d0 * ld + k0;
            for (int d = d0; d < d1; d++, kc += ld) {
                float32x4_t kv[4];
                for (int v = 0; v < 4; v++) kv[v] = vld1q_f32(kc + 4 * v);
                for (int r = 0; r < NR; r++) {
                    const float32x4_t qd = vdupq_n_f32(q[r][d]);
                    for (int v = 0; v < 4; v++) a[r][v] = vfmaq_f32(a[r][v], kv[v], qd);
                }
            }
            if (pass == 0)
                for (int r = 0; r < NR; r++)
                    for (int v = 0; v < 4; v++) part[r][v] = a[r][v];
        }
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) vst1q_f32(s[r] + k0 + 4 * v, vaddq_f32(part[r][v], a[r][v]));
    }
}

/* acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j for NR (1 or 2) rows over keys 0..nk-1; rows
 * is (nk, hd) as pointers. Each output lane sums its keys in order j = 0..nk-1. */
static inline __attribute__((always_inline)) void
el_pv_block(const int NR, float *const *acc, const float *alpha, const float *const *p, const float *const *rows,
            int nk, int hd) {
    int i = 0;
    for (; i + 16 <= hd; i += 16) {
        float32x4_t a[2][4];
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) a[r][v] = vmulq_n_f32(vld1q_f32(acc[r] + i + 4 * v), alpha[r]);
        for (int j = 0; j < nk; j++) {
            float32x4_t vv[4];
            for (int v = 0; v < 4; v++) vv[v] = vld1q_f32(rows[j] + i + 4 * v);
            for (int r = 0; r < NR; r++) {
                const float32x4_t pj = vdupq_n_f32(p[r][j]);
                for (int v = 0; v < 4; v++) a[r][v] = vfmaq_f32(a[r][v], vv[v], pj);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) vst1q_f32(acc[r] + i + 4 * v, a[r][v]);
    }
    for (; i + 4 <= hd; i += 4) {
        float32x4_t a[2];
        for (int r = 0; r < NR; r++) a[r] = vmulq_n_f32(vld1q_f32(acc[r] + i), alpha[r]);
        for (int j = 0; j < nk; j++) {
            const float32x4_t vv = vld1q_f32(rows[j] + i);
            for (int r = 0; r < NR; r++) a[r] = vfmaq_n_f32(a[r], vv, p[r][j]);
        }
        for (int r = 0; r < NR; r++) vst1q_f32(acc[r] + i, a[r]);
    }
    for (; i < hd; i++)
        for (int r = 0; r < NR; r++) {
            float x = acc[r][i] * alpha[r];
            for (int j = 0; j < nk; j++) x += p[r][j] * rows[j][i];
            acc[r][i] = x;
        }
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2 (development builds): the two blocks above in 8-lane registers, 4 query rows at a
 * time. Through SIMDe they run as 4-lane SSE FMAs, half of what the FMA units take; perf put
 * the T = 32 after 400 tile at ~57% of even that. Each lane is still one key (scores) or one
 * output dim (PV) accumulated in the same order, with the same two halves of d for the scores,
 * so the results are bit-identical to the 4-lane blocks; only the register shape differs. */
#define EL_ATTN_NR 4            /* query rows per block */

static inline __attribute__((always_inline)) void
el_scores_block_avx2(const int NR, const float *const *q, const float *kt, int ld, int nk, int hd, float *const *s) {
    const int half = hd / 2;
    for (int k0 = 0; k0 < nk; k0 += EL_ATTN_KB) {
        /* the first half's sums wait in s, not in registers: held, they left no register for
         * the two key vectors, and every FMA reloaded its key from memory (12 loads per 8 FMAs) */
        for (int pass = 0; pass < 2; pass++) {
            const int d0 = pass ? half : 0, d1 = pass ? hd : half;
            __m256 a[4][2];
            for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
            const float *kc = kt + (size_t)d0 * ld + k0;
            for (int d = d0; d < d1; d++, kc += ld) {
                __m256 k0v = _mm256_loadu_ps(kc), k1v = _mm256_loadu_ps(kc + 8);
                __asm__("" : "+x"(k0v), "+x"(k1v));   /* in registers: gcc would fold a load into each FMA */
                for (int r = 0; r < NR; r++) {
                    const __m256 qd = _mm256_broadcast_ss(q[r] + d);
                    a[r][0] = _mm256_fmadd_ps(k0v, qd, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(k1v, qd, a[r][1]);
                }
            }
            for (int r = 0; r < NR; r++)
                for (int v = 0; v < 2; v++) {
                    float *o = s[r] + k0 + 8 * v;
                    _mm256_storeu_ps(o, pass ? _mm256_add_ps(_mm256_loadu_ps(o), a[r][v]) : a[r][v]);
                }
        }
    }
}

static inline __attribute__((always_inline)) void
el_pv_block_avx2(const int NR, float *const *acc, const float *alpha, const float *const *p, const float *const *rows,
                 int nk, int hd) {
    int i = 0;
    for (; i + 16 <= hd; i += 16) {
        __m256 a[4][2];
        for (int r = 0; r < NR; r++) {
            const __m256 al = _mm256_set1_ps(alpha[r]);
            a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + i), al);
            a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + i + 8), al);
        }
        for (int j = 0; j < nk; j++) {
            const __m256 v0 = _mm256_loadu_ps(rows[j] + i), v1 = _mm256_loadu_ps(rows[j] + i + 8);
            for (int r = 0; r < NR; r++) {
                const __m256 pj = _mm256_broadcast_ss(p[r] + j);
                a[r][0] = _mm256_fmadd_ps(v0, pj, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(v1, pj, a[r][1]);
            }
        }
        for (int r = 0; r < NR; r++) {
            _mm256_storeu_ps(acc[r] + i, a[r][0]);
            _mm256_storeu_ps(acc[r] + i + 8, a[r][1]);
        }
    }
    if (i < hd) {   /* hd % 16: the 4-lane block, 2 rows at a time, on the remaining dims */
        const float *tail[EL_ATTN_CHMAX];
        for (int j = 0; j < nk; j++) tail[j] = rows[j] + i;
        for (int r = 0; r < NR; r += 2) {
            const int nr = EL_MIN(2, NR - r);
            float *ar[2] = {acc[r] + i, nr > 1 ? acc[r + 1] + i : NULL};
            if (nr == 2) el_pv_block(2, ar, alpha + r, p + r, tail, nk, hd - i);
            else el_pv_block(1, ar, alpha + r, p + r, tail, nk, hd - i);
        }
    }
}
#if defined(__AVX512F__)
#include "attn_avx512.h"
#define el_scores_block_x86 el_scores_block_avx512
#define el_pv_block_x86 el_pv_block_avx512
#else
#define el_scores_block_x86 el_scores_block_avx2
#define el_pv_block_x86 el_pv_block_avx2
#endif
#else
#define EL_ATTN_NR 2
#endif

/* Scores and PV for query rows qi..qi+nr-1 (nr <= EL_ATTN_NR) of a tile */
static void el_scores_rows(int nr, const float *const *q, const float *kt, int ld, int nk, int hd, float *const *s) {
#if EL_ATTN_NR == 4
    EL_BY_ROWS(nr, el_scores_block_x86, q, kt, ld, nk, hd, s);
#else
    if (nr == 2) el_scores_block(2, q, kt, ld, nk, hd, s);
    else el_scores_block(1, q, kt, ld, nk, hd, s);
#endif
}

static void el_pv_rows(int nr, float *const *acc, const float *alpha, const float *const *p, const float *const *rows,
                       int nk, int hd) {
#if EL_ATTN_NR == 4
    EL_BY_ROWS(nr, el_pv_block_x86, acc, alpha, p, rows, nk, hd);
#else
    if (nr == 2) el_pv_block(2, acc, alpha, p, rows, nk, hd);
    else el_pv_block(1, acc, alpha, p, rows, nk, hd);
#endif
}

/* A query row's (row = t * H + h) online-softmax state at the end of its keys: without a split
 * its output acc / l (l > 0: every row sees at least key 0), else its partial state (m, l, acc)
 * for el_attn_merge. */
static void el_attn_row_out(const el_attn_job *J, size_t row, const float *acc, float m, float l, int split) {
    const int hd = J->hd;
    if (J->n_split == 1) {
        float *o = J->out + row * hd;
        const float32x4_t inv = vdupq_n_f32(1.0f / l);
        int i = 0;
        for (; i + 4 <= hd; i += 4) vst1q_f32(o + i, vmulq_f32(vld1q_f32(acc + i), inv));
        for (; i < hd; i++) o[i] = acc[i] / l;
    } else {
        float *p = J->part + (row * J->n_split + split) * (size_t)(hd + 2);
        p[0] = m;
        p[1] = l;
        memcpy(p + 2, acc, (size_t)hd * sizeof(float));
    }
}

#ifndef EL_ATTN_X5_KV
#define EL_ATTN_X5_KV 0   /* 1: attn_avx512.h's K/V chunk fetch */
#endif

/* 1: rows[0..n) hold only finite values (an all-ones exponent is an inf or a NaN; integer
 * maxima, which the compiler vectorizes, unlike a float sum it may not reorder) */
static int el_rows_finite(const float *const *rows, int n, int hd) {
    uint32_t e = 0;
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < hd; i++) {
            uint32_t x;
            memcpy(&x, rows[j] + i, 4);   /* (the bits, without breaking aliasing rules) */
            x &= 0x7f800000u;
            e = x > e ? x : e;
        }
    }
    return e != 0x7f800000u;
}

/* A tile's large buffers (~325 KB), one set per thread that runs tiles, kept for the thread's
 * life (freed at its exit). On the stack they crashed a caller whose thread stack was under
 * ~350 KB (an app's worker thread with a 256 KB stack: SIGSEGV, a review's probe; musl's
 * default is 128 KB); the pool's own workers have 2 MB. */
typedef union {
    struct {   /* a prefill tile's */
        float acc[EL_ATTN_QMAX * EL_ATTN_MAX_HD];
        float sc[EL_ATTN_QMAX][EL_ATTN_CHMAX];
        float kt[EL_ATTN_KVBUF], kbuf[EL_ATTN_KVBUF], vbuf[EL_ATTN_KVBUF];
    } t;
    /* an int8 decode range's chunk of K and V rows dequantized (256 KB: on the stack it crashed
     * a generation from an app thread with a 256-320 KB stack under kv_precision int8) */
    struct { float k[EL_ATTN_DEC_CH * EL_ATTN_DEC_I8ROW], v[EL_ATTN_DEC_CH * EL_ATTN_DEC_I8ROW]; } d;
} el_tile_scratch;

static pthread_key_t el_tile_key;
static pthread_once_t el_tile_once = PTHREAD_ONCE_INIT;
static int el_tile_key_ok;

static void el_tile_key_init(void) { el_tile_key_ok = pthread_key_create(&el_tile_key, free) == 0; }

/* this thread's tile scratch, allocated at its first tile; NULL when memory is short */
static el_tile_scratch *el_tile_scratch_get(void) {
    pthread_once(&el_tile_once, el_tile_key_init);
    if (!el_tile_key_ok) return NULL;
    el_tile_scratch *s = pthread_getspecific(el_tile_key);
    if (!s && (s = malloc(sizeof *s)) != NULL && pthread_setspecific(el_tile_key, s) != 0) {
        free(s);
        s = NULL;
    }
    return s;
}

/* One tile: kv head kh, query heads h0..h1-1 (all of group kh), token rows t0..t1-1, keys
 * [j_lo, j_hi) (a split; each row is also capped by causality). */
static void el_attn_tile(const el_attn_job *J, int kh, int h0, int h1, int t0, int t1, int j_lo, int j_hi, int split) {
    const int hd = J->hd, gh = h1 - h0, nq = gh * (t1 - t0);
    /* keys per chunk: a multiple of EL_ATTN_KB whose K and V fit the buffers */
    const int ch = EL_MAX(EL_ATTN_KB, EL_MIN(EL_ATTN_CHMAX, EL_ATTN_KVBUF / hd) / EL_ATTN_KB * EL_ATTN_KB);
    el_tile_scratch *S = el_tile_scratch_get();
    if (!S) {
        __atomic_store_n(J->nomem, 1, __ATOMIC_RELAXED);
        return;
    }
    float *const acc = S->t.acc, *const kt = S->t.kt, *const kbuf = S->t.kbuf, *const vbuf = S->t.vbuf;
    float (*const sc)[EL_ATTN_CHMAX] = S->t.sc;
    const float *krow[EL_ATTN_CHMAX], *vrow[EL_ATTN_CHMAX], *qrow[EL_ATTN_QMAX];
    float m[EL_ATTN_QMAX], l[EL_ATTN_QMAX], alpha[EL_ATTN_QMAX];
    int lim[EL_ATTN_QMAX], nvis[EL_ATTN_QMAX];

    for (int qi = 0; qi < nq; qi++) {
        int t = t0 + qi / gh, h = h0 + qi % gh;
        qrow[qi] = J->q + (size_t)t * J->q_ld + (size_t)h * hd;
        lim[qi] = EL_MIN(j_hi, J->start + t + 1);  /* keys < lim are visible */
        m[qi] = -INFINITY;
        l[qi] = 0.0f;
    }
    memset(acc, 0, (size_t)nq * hd * sizeof(float));
    const int j_end = EL_MIN(j_hi, J->start + t1);
    /* row offsets of this chunk and the next (prefetched), one division per pool block */
    size_t off[2][EL_ATTN_CHMAX];
    const size_t kh_off = (size_t)kh * J->kv.head_stride;
    int cur = 0;
    if (j_lo < j_end) {
        const int c0 = EL_MIN(ch, j_end - j_lo);
        el_row_offsets(&J->kv, j_lo, c0, off[cur]);
        for (int i = 0; i < c0; i++) off[cur][i] += kh_off;
    }
    for (int j0 = j_lo; j0 < j_end; j0 += ch, cur ^= 1) {
        const int c = EL_MIN(ch, j_end - j0), c_next = EL_MAX(0, EL_MIN(ch, j_end - j0 - c));
        if (c_next > 0) el_row_offsets(&J->kv, j0 + c, c_next, off[cur ^ 1]);
        for (int i = 0; i < c_next; i++) off[cur ^ 1][i] += kh_off;
        const int cp = (c + EL_ATTN_KB - 1) / EL_ATTN_KB * EL_ATTN_KB;   /* zero-padded key columns */
#if EL_ATTN_X5_KV
        if (hd % 16 == 0 && !J->kv.i8) {
            el_kt_x5(&J->kv, J->kv.k, off[cur], c, off[cur ^ 1], c_next, hd, kt, cp);
        } else
#endif
        {
            el_fetch_rows(&J->kv, J->kv.k, off[cur], c, off[cur ^ 1], c_next, hd, kbuf, krow);
            el_transpose_rows(kt, cp, krow, c, hd);
            if (cp > (c + 3) / 4 * 4)
                for (int d = 0; d < hd; d++) memset(kt + (size_t)d * cp + (c + 3) / 4 * 4, 0,
                                                    (size_t)(cp - (c + 3) / 4 * 4) * sizeof(float));
        }
        el_fetch_rows(&J->kv, J->kv.v, off[cur], c, off[cur ^ 1], c_next, hd, vbuf, vrow);
        int qi;
        for (qi = 0; qi < nq; qi++) nvis[qi] = EL_MAX(0, EL_MIN(c, lim[qi] - j0));
        /* A row block's scores stop at its widest row's visible keys (rounded up to a score
         * block): the causal diagonal's chunk otherwise scored keys no row of the block sees,
         * and a block whose rows see none of the chunk scores nothing. Scores past a row's
         * keys are never read (the softmax sets them to 0); each key's score is computed as
         * before, so the bits are the same. */
        for (qi = 0; qi < nq; qi += EL_ATTN_NR) {
            const int nr = EL_MIN(EL_ATTN_NR, nq - qi);
            float *srow[EL_ATTN_NR];
            int nk = 0;
            for (int r = 0; r < nr; r++) {
                srow[r] = sc[qi + r];
                nk = EL_MAX(nk, nvis[qi + r]);
            }
            nk = (nk + EL_ATTN_KB - 1) / EL_ATTN_KB * EL_ATTN_KB;
            if (nk > 0) el_scores_rows(nr, qrow + qi, kt, cp, nk, hd, srow);
        }
        /* online softmax per row; probabilities past a row's visible keys are 0 */
        for (qi = 0; qi < nq; qi++) {
            const int nv = nvis[qi];
            float *s = sc[qi];
            alpha[qi] = 1.0f;
            if (nv > 0) {
                const float32x4_t vs = vdupq_n_f32(J->scale);
                float32x4_t vmax = vdupq_n_f32(-INFINITY);
                int j = 0;
#if EL_SIMDE && defined(__AVX512F__)
                /* x86: 16 lanes, not SIMDe's 4 (its vmaxq_f32 adds a NaN blend per vector: ~5% of
                 * the causal T = 256 tile's time sat on it); products are lanewise, a max is a max */
                if (nv >= 16) {
                    const __m512 vs16 = _mm512_set1_ps(J->scale);
                    __m512 vmax16 = _mm512_set1_ps(-INFINITY);
                    for (; j + 16 <= nv; j += 16) {
                        const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(s + j), vs16);
                        _mm512_storeu_ps(s + j, d);
                        vmax16 = _mm512_max_ps(vmax16, d);
                    }
                    vmax = vdupq_n_f32(_mm512_reduce_max_ps(vmax16));
                }
#endif
                for (; j + 4 <= nv; j += 4) {
                    const float32x4_t d = vmulq_f32(vld1q_f32(s + j), vs);
                    vst1q_f32(s + j, d);
                    vmax = vmaxq_f32(vmax, d);
                }
                float mc = vmaxvq_f32(vmax);
                for (; j < nv; j++) {
                    s[j] *= J->scale;
                    mc = s[j] > mc ? s[j] : mc;
                }
                const float mnew = mc > m[qi] ? mc : m[qi];
                alpha[qi] = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mnew);
                l[qi] = l[qi] * alpha[qi] + el_exp_sub_sum(s, nv, mnew);
                m[qi] = mnew;
            }
            for (int j = nv; j < c; j++) s[j] = 0.0f;
        }
        /* A row group runs over its widest row's keys: a key another row of it does not see
         * adds p = 0 there, exactly, unless that V row holds an inf or NaN (an fp16 store that
         * overflowed), when 0 * inf = NaN reached an earlier token's output. Those V rows are
         * checked once per chunk (the causal diagonal's); only then does each row take the
         * keys past its group's common ones alone. The split keeps each lane's sum in key
         * order, so the bits are the same: the second call goes on from the stored acc with
         * alpha 1. */
        int nv_min = c;
        for (qi = 0; qi < nq; qi++) nv_min = EL_MIN(nv_min, nvis[qi]);
        const int split = nv_min < c && !el_rows_finite(vrow + nv_min, c - nv_min, hd);
        for (qi = 0; qi < nq; qi += EL_ATTN_NR) {
            const int nr = EL_MIN(EL_ATTN_NR, nq - qi);
            float *arow[EL_ATTN_NR];
            const float *prow[EL_ATTN_NR];
            int nk = split ? c : 0;
            for (int r = 0; r < nr; r++) {
                nk = split ? EL_MIN(nk, nvis[qi + r]) : EL_MAX(nk, nvis[qi + r]);
                arow[r] = acc + (size_t)(qi + r) * hd;
                prow[r] = sc[qi + r];
            }
            if (nk > 0) el_pv_rows(nr, arow, alpha + qi, prow, vrow, nk, hd);
            for (int r = 0; split && r < nr; r++)
                if (nvis[qi + r] > nk) {
                    const float one = 1.0f, *pr = prow[r] + nk;
                    el_pv_rows(1, arow + r, nk > 0 ? &one : alpha + qi + r, &pr, vrow + nk, nvis[qi + r] - nk, hd);
                }
        }
    }
    for (int qi = 0; qi < nq; qi++)
        el_attn_row_out(J, (size_t)(t0 + qi / gh) * J->H + h0 + qi % gh, acc + (size_t)qi * hd, m[qi], l[qi], split);
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

/* ---- NEON, decode (T = 1) ------------------------------------------------------------------- */

/* One query token against the cache is no GEMM: each K/V element serves only the G query heads
 * of its group, so the cost is reading and converting every element once, plus G FMAs on it.
 * The tile path above splits the work by kv head, so each task reads hd of every KVH * hd row
 * and KVH tasks stride through the same rows separately, and it pays a
 * convert-to-buffer, a transpose and per-row offset divisions per chunk. Here a task owns a key
 * range for ALL kv heads: it reads whole rows (a pool block's rows of one layer are contiguous),
 * converts each K/V element once, straight from the arena into registers, and uses it for every
 * query head of its group. Scores of 4 keys x up to 4 heads are 16 independent accumulators
 * (4-lane partial dots reduced with pairwise adds); PV keeps up to 4 heads x 16 dims of the
 * accumulator in registers while it walks the chunk's keys. The range is done in chunks of
 * EL_ATTN_DEC_CH keys with the online softmax between chunks, and while one chunk is computed
 * the next one's rows are prefetched (K during the scores, V during PV): pool blocks are
 * n_layers * block apart, so the hardware prefetcher restarts at every block. Key ranges are
 * the tasks (several per thread, so that claiming evens out the threads); their partial states
 * are merged like the tile path's splits. */
#define EL_ATTN_DEC_HMAX 64      /* query heads the stack scratch holds */
#define EL_ATTN_DEC_ACC 16384    /* floats of accumulator: H * hd */
#define EL_ATTN_DEC_SPLIT_MIN 48 /* fewest keys worth a task of their own */
#define EL_AI inline __attribute__((always_inline))

static EL_AI float32x4_t el_kv_ld4(const int F16, const char *p) {
    return F16 ? el_f16x4_load((const uint16_t *)p) : vld1q_f32((const float *)p);
}

/* Prefetches bytes [p, p + n): the last byte as well, rows need not start on a line */
static EL_AI void el_prefetch_span(const char *p, size_t n) {
    for (size_t b = 0; b < n; b += 64) el_prefetch_ahead(p + b);
    el_prefetch_ahead(p + n - 1);
}

/* s[r][0..3] = scale * (q[r] . key k), k < 4, for NR (1..4) query rows; kr: the 4 keys' rows
 * (this kv head's part). Each lane sums hd / 4 products, then the lanes are added pairwise. */
static EL_AI void el_dec_scores4(const int NR, const int F16, const float *const *q, const char *const *kr, int hd,
                                 float scale, float *const *s) {
    const int esz = F16 ? 2 : 4;
    float32x4_t a[4][4];
    for (int r = 0; r < NR; r++)
        for (int k = 0; k < 4; k++) a[r][k] = vdupq_n_f32(0.0f);
    /* key by key, the NR q vectors held: 4 NR accumulators + NR + 1 registers, which for NR = 3
     * still fits x86's 16 (holding the 4 converted keys instead spilled an accumulator) */
    for (int d = 0; d < hd; d += 4) {
        float32x4_t qd[4];
        for (int r = 0; r < NR; r++) qd[r] = vld1q_f32(q[r] + d);
        for (int k = 0; k < 4; k++) {
            const float32x4_t kv = el_kv_ld4(F16, kr[k] + (size_t)d * esz);
            for (int r = 0; r < NR; r++) a[r][k] = vfmaq_f32(a[r][k], kv, qd[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        float32x4_t t = vpaddq_f32(vpaddq_f32(a[r][0], a[r][1]), vpaddq_f32(a[r][2], a[r][3]));
        vst1q_f32(s[r], vmulq_n_f32(t, scale));
    }
}

/* acc[r] = acc[r] * alpha[r] + sum_i p[r][i] v_i for NR (1..4) rows over keys i < c; vr: the
 * keys' rows (this kv head's part). While walking the keys for the first dims it prefetches
 * pf[i] (i < npf), the next chunk's rows. Each output lane sums its keys in order. */
static EL_AI void el_dec_pv(const int NR, const int F16, float *const *acc, const float *alpha,
                            const float *const *p, const char *const *vr, int c, int hd, const char *const *pf,
                            int npf) {
    const int esz = F16 ? 2 : 4;
    const size_t pf_bytes = (size_t)hd * esz;
    int d = 0;
    for (; d + 16 <= hd; d += 16) {
        float32x4_t a[4][4];
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) a[r][v] = vmulq_n_f32(vld1q_f32(acc[r] + d + 4 * v), alpha[r]);
        const int n_pf = d == 0 ? npf : 0;
        for (int i = 0; i < c; i++) {
            if (i < n_pf) el_prefetch_span(pf[i], pf_bytes);
            const char *row = vr[i] + (size_t)d * esz;
            for (int v = 0; v < 4; v++) {
                const float32x4_t vv = el_kv_ld4(F16, row + (size_t)4 * v * esz);
                for (int r = 0; r < NR; r++) a[r][v] = vfmaq_n_f32(a[r][v], vv, p[r][i]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) vst1q_f32(acc[r] + d + 4 * v, a[r][v]);
    }
    for (; d < hd; d += 4) {     /* hd % 16 tail, 4 dims at a time */
        float32x4_t a[4];
        for (int r = 0; r < NR; r++) a[r] = vmulq_n_f32(vld1q_f32(acc[r] + d), alpha[r]);
        for (int i = 0; i < c; i++) {
            const float32x4_t vv = el_kv_ld4(F16, vr[i] + (size_t)d * esz);
            for (int r = 0; r < NR; r++) a[r] = vfmaq_n_f32(a[r], vv, p[r][i]);
        }
        for (int r = 0; r < NR; r++) vst1q_f32(acc[r] + d, a[r]);
    }
}

/* Dims [d, hd) (hd % 16 of them, past the wider blocks' passes) through the 4-lane block */
static EL_AI void el_dec_pv_tail(const int NR, const int F16, float *const *acc, const float *alpha,
                                 const float *const *p, const char *const *vr, int c, int d, int hd) {
    if (d >= hd) return;
    const size_t esz = F16 ? 2 : 4;
    const char *tail[EL_ATTN_DEC_CH];
    float *at[4];
    for (int i = 0; i < c; i++) tail[i] = vr[i] + (size_t)d * esz;
    for (int r = 0; r < NR; r++) at[r] = acc[r] + d;
    el_dec_pv(NR, F16, at, alpha, p, tail, c, hd - d, NULL, 0);
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2 (development builds): the two decode blocks above on 8 lanes, bit-identical to them.
 * Scores: each 128-bit half of a register runs the 4-lane loop for one key (keys 2i and 2i + 1
 * side by side, q repeated in both halves), and the lanes are added in the same pairs. PV: a
 * lane is one output dim, its keys summed in order, as before. */
static EL_AI __m256 el_kv_ld4x2(const int F16, const char *a, const char *b) {
    if (F16)
        return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
    return _mm256_set_m128(_mm_loadu_ps((const float *)b), _mm_loadu_ps((const float *)a));
}

static EL_AI __m256 el_kv_ld8(const int F16, const char *p) {
    return F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

static EL_AI void el_dec_scores4_avx2(const int NR, const int F16, const float *const *q, const char *const *kr,
                                      int hd, float scale, float *const *s) {
    const int esz = F16 ? 2 : 4;
    __m256 a[4][2];   /* a[r][0]: keys 0 | 1, a[r][1]: keys 2 | 3 */
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 4) {
        __m256 qd[4];
        for (int r = 0; r < NR; r++) qd[r] = _mm256_broadcast_ps((const __m128 *)(q[r] + d));
        for (int kp = 0; kp < 2; kp++) {
            const __m256 kv = el_kv_ld4x2(F16, kr[2 * kp] + (size_t)d * esz, kr[2 * kp + 1] + (size_t)d * esz);
            for (int r = 0; r < NR; r++) a[r][kp] = _mm256_fmadd_ps(kv, qd[r], a[r][kp]);
        }
    }
    for (int r = 0; r < NR; r++) {
        /* per half: (l0 + l1), (l2 + l3) of each key, then their sum: low half keys 0, 2 and
         * high half keys 1, 3, interleaved back into key order */
        const __m256 h = _mm256_hadd_ps(a[r][0], a[r][1]);
        const __m256 t = _mm256_hadd_ps(h, h);
        const __m128 k = _mm_unpacklo_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        _mm_storeu_ps(s[r], _mm_mul_ps(k, _mm_set1_ps(scale)));
    }
}

static EL_AI void el_dec_pv_avx2(const int NR, const int F16, float *const *acc, const float *alpha,
                                 const float *const *p, const char *const *vr, int c, int hd, const char *const *pf,
                                 int npf) {
    const int esz = F16 ? 2 : 4;
    const size_t pf_bytes = (size_t)hd * esz;
    int d = 0;
    for (; d + 16 <= hd; d += 16) {
        __m256 a[4][2];
        for (int r = 0; r < NR; r++) {
            const __m256 al = _mm256_set1_ps(alpha[r]);
            a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d), al);
            a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d + 8), al);
        }
        const int n_pf = d == 0 ? npf : 0;
        for (int i = 0; i < c; i++) {
            if (i < n_pf) el_prefetch_span(pf[i], pf_bytes);
            const char *row = vr[i] + (size_t)d * esz;
            const __m256 v0 = el_kv_ld8(F16, row), v1 = el_kv_ld8(F16, row + (size_t)8 * esz);
            for (int r = 0; r < NR; r++) {
                const __m256 pi = _mm256_set1_ps(p[r][i]);
                a[r][0] = _mm256_fmadd_ps(v0, pi, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(v1, pi, a[r][1]);
            }
        }
        for (int r = 0; r < NR; r++) {
            _mm256_storeu_ps(acc[r] + d, a[r][0]);
            _mm256_storeu_ps(acc[r] + d + 8, a[r][1]);
        }
    }
    el_dec_pv_tail(NR, F16, acc, alpha, p, vr, c, d, hd);
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "attn_dec_avx512.h"
#define EL_DEC_X5 1
#define el_dec_pv_x el_dec_pv_avx512
#else
#define el_dec_scores4_x el_dec_scores4_avx2
#define el_dec_pv_x el_dec_pv_avx2
#endif
#else
#define el_dec_scores4_x el_dec_scores4
#define el_dec_pv_x el_dec_pv
#endif

#ifndef EL_DEC_X5
#define EL_DEC_X5 0   /* 1: the AVX-512 score block above, 8 keys a call */
#endif

/* Query rows h0..h0+NR-1 of kv head kh over one chunk: scores for every 4 (AVX-512: 8) keys */
static EL_AI void el_dec_chunk_scores(const int NR, const int F16, const el_attn_job *J, int kh, int h0,
                                      const size_t *off, int c, const size_t *off_next, int c_next,
                                      float (*sc)[EL_ATTN_DEC_CH]) {
    const int esz = F16 ? 2 : 4, hd = J->hd;
    const char *kb = (const char *)J->kv.k + (size_t)kh * J->kv.head_stride * esz;
    const float *q[4];
    float *s[4];
    for (int r = 0; r < NR; r++) q[r] = J->q + (size_t)(h0 + r) * hd;
    /* keys KG at a time (EL_ATTN_DEC_CH is a multiple of 8) */
#if EL_DEC_X5
    const int KG = NR <= 3 ? 8 : 4;
#else
    const int KG = 4;
#endif
    for (int i0 = 0; i0 < c; i0 += KG) {
        const char *kr[8];
        /* past the chunk's end repeat its last key: those scores are never read */
        for (int k = 0; k < KG; k++) kr[k] = kb + off[EL_MIN(i0 + k, c - 1)] * esz;
        if (off_next)
            for (int k = i0; k < EL_MIN(i0 + KG, c_next); k++)
                el_prefetch_span(kb + off_next[k] * esz, (size_t)hd * esz);
        for (int r = 0; r < NR; r++) s[r] = sc[h0 + r] + i0;
#if EL_DEC_X5
        if (KG == 8 && hd == 64) el_dec_scoresk_avx512(NR, 8, F16, 64, q, kr, hd, J->scale, s);
        else if (KG == 8) el_dec_scoresk_avx512(NR, 8, F16, 0, q, kr, hd, J->scale, s);
        else if (hd == 64) el_dec_scoresk_avx512(NR, 4, F16, 64, q, kr, hd, J->scale, s);
        else el_dec_scoresk_avx512(NR, 4, F16, 0, q, kr, hd, J->scale, s);
#else
        el_dec_scores4_x(NR, F16, q, kr, hd, J->scale, s);
#endif
    }
}

static EL_AI void el_dec_chunk_pv(const int NR, const int F16, const el_attn_job *J, int h0, float *acc,
                                  const float *alpha, const char *const *vr, int c, const char *const *pf, int npf,
                                  float (*sc)[EL_ATTN_DEC_CH]) {
    float *ar[4];
    const float *p[4];
    for (int r = 0; r < NR; r++) {
        ar[r] = acc + (size_t)(h0 + r) * J->hd;
        p[r] = sc[h0 + r];
    }
    el_dec_pv_x(NR, F16, ar, alpha + h0, p, vr, c, J->hd, pf, npf);
}

/* Keys [j_lo, j_hi) for every query head: split `split` of the job. Its last chunk prefetches
 * the keys after it up to pf_hi (>= j_hi): the next split, when this thread takes it next. */
static EL_AI void el_attn_dec_range(const int F16, const int I8, const el_attn_job *J, int j_lo, int j_hi, int pf_hi,
                                     int split) {
    const int hd = J->hd, H = J->H, G = J->G, esz = F16 ? 2 : 4;
    float acc[EL_ATTN_DEC_ACC];
    /* int8 K/V (I8, with F16 = 0): each chunk's rows are dequantized here (q * scale, as the
     * pool's reader does) and the fp32 blocks run on these buffers through `Jb`, a dense view */
    float *kq8 = NULL, *vq8 = NULL;   /* (the thread's heap scratch: 256 KB) */
    size_t boff[EL_ATTN_DEC_CH];
    el_attn_job Jb;
    if (I8) {
        el_tile_scratch *S = el_tile_scratch_get();
        if (!S) {
            __atomic_store_n(J->nomem, 1, __ATOMIC_RELAXED);
            return;
        }
        kq8 = S->d.k;
        vq8 = S->d.v;
        Jb = *J;
        Jb.kv = (el_kv_src){.k = kq8, .v = vq8, .row_stride = (size_t)J->KVH * hd, .head_stride = (size_t)hd};
        for (int i = 0; i < EL_ATTN_DEC_CH; i++) boff[i] = (size_t)i * J->KVH * hd;
    }
    float sc[EL_ATTN_DEC_HMAX][EL_ATTN_DEC_CH];
    float m[EL_ATTN_DEC_HMAX], l[EL_ATTN_DEC_HMAX], alpha[EL_ATTN_DEC_HMAX];
    size_t off[2][EL_ATTN_DEC_CH];
    const char *vr[EL_ATTN_DEC_CH], *pf[EL_ATTN_DEC_CH];

    for (int h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)H * hd * sizeof(float));
    int cur = 0;
    el_row_offsets(&J->kv, j_lo, EL_MIN(EL_ATTN_DEC_CH, j_hi - j_lo), off[cur]);
    /* The range's first chunk: nothing ran ahead of it (later chunks are prefetched during the
     * one before), and ranges are short (a few chunks, several per thread). One burst of
     * prefetches for its K and V rows puts all their misses in flight at once, where the score
     * loop's loads would miss 4 keys at a time: perf put most of this kernel's time on those
     * loads at 512+ keys. */
    {
        const int pesz = I8 ? 1 : esz;   /* bytes of a stored element */
        const size_t row = (size_t)hd * pesz;
        for (int i = 0; i < EL_MIN(EL_ATTN_DEC_CH, j_hi - j_lo); i++)
            for (int kh = 0; kh < J->KVH; kh++) {
                const size_t o = (off[cur][i] + (size_t)kh * J->kv.head_stride) * pesz;
                el_prefetch_span((const char *)J->kv.k + o, row);
                el_prefetch_span((const char *)J->kv.v + o, row);
            }
    }
    for (int j0 = j_lo; j0 < j_hi; j0 += EL_ATTN_DEC_CH, cur ^= 1) {
        const int c = EL_MIN(EL_ATTN_DEC_CH, j_hi - j0);
        int c_next = EL_MAX(0, EL_MIN(EL_ATTN_DEC_CH, (j0 + c < j_hi ? j_hi : pf_hi) - j0 - c));
        const size_t *on = c_next > 0 ? off[cur ^ 1] : NULL;
        if (c_next > 0) el_row_offsets(&J->kv, j0 + c, c_next, off[cur ^ 1]);
        const el_attn_job *Jc = J;
        const size_t *oc = off[cur];
        if (I8) {   /* this chunk into the buffers, the next one's int8 rows prefetched meanwhile */
            const size_t row = (size_t)J->KVH * hd;
            for (int i = 0; i < c; i++) {
                if (i < c_next) {
                    el_prefetch_span((const char *)J->kv.k + on[i], row);
                    el_prefetch_span((const char *)J->kv.v + on[i], row);
                }
                const size_t s0 = off[cur][i] / (size_t)hd;   /* scale of (row, kv head 0) */
                for (int kh = 0; kh < J->KVH; kh++) {
                    const size_t o = off[cur][i] + (size_t)kh * hd;
                    el_dq_row(kq8 + i * row + (size_t)kh * hd, (const int8_t *)J->kv.k + o, J->kv.ks[s0 + kh], hd);
                    el_dq_row(vq8 + i * row + (size_t)kh * hd, (const int8_t *)J->kv.v + o, J->kv.vs[s0 + kh], hd);
                }
            }
            Jc = &Jb;
            oc = boff;
            on = NULL;
            c_next = 0;
        }

        /* scores, the next chunk's K prefetched with the first head block of each kv head */
        for (int kh = 0; kh < J->KVH; kh++)
            for (int g = 0; g < G;) {
                const int nr = EL_MIN(4, G - g), h0 = kh * G + g;
                const size_t *pn = g == 0 ? on : NULL;
                EL_BY_ROWS(nr, el_dec_chunk_scores, F16, Jc, kh, h0, oc, c, pn, c_next, sc);
                g += nr;
            }

        /* online softmax: every key of the range is visible to the one query token */
        for (int h = 0; h < H; h++) {
            float *s = sc[h];
            float32x4_t vmax = vdupq_n_f32(-INFINITY);
            int j = 0;
            for (; j + 4 <= c; j += 4) vmax = vmaxq_f32(vmax, vld1q_f32(s + j));
            float mc = vmaxvq_f32(vmax);
            for (; j < c; j++) mc = s[j] > mc ? s[j] : mc;
            const float mnew = mc > m[h] ? mc : m[h];
            alpha[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mnew);
            l[h] = l[h] * alpha[h] + el_exp_sub_sum(s, c, mnew);
            m[h] = mnew;
        }

        /* PV, the next chunk's V prefetched with the first head block of each kv head */
        for (int kh = 0; kh < J->KVH; kh++) {
            const char *vb = (const char *)Jc->kv.v + (size_t)kh * Jc->kv.head_stride * esz;
            for (int i = 0; i < c; i++) vr[i] = vb + oc[i] * esz;
            for (int i = 0; i < c_next; i++) pf[i] = vb + on[i] * esz;
            for (int g = 0; g < G;) {
                const int nr = EL_MIN(4, G - g), h0 = kh * G + g, npf = g == 0 ? c_next : 0;
                EL_BY_ROWS(nr, el_dec_chunk_pv, F16, Jc, h0, acc, alpha, vr, c, pf, npf, sc);
                g += nr;
            }
        }
    }
    for (int h = 0; h < H; h++) el_attn_row_out(J, (size_t)h, acc + (size_t)h * hd, m[h], l[h], split);
}

/* Split `split` of a decode job; pf_next: prefetch the first keys of the split after it */
static void el_attn_dec_split(const el_attn_job *J, int split, int pf_next) {
    const int n = J->start + 1, j_lo = split * J->split_len, j_hi = EL_MIN(n, j_lo + J->split_len);
    const int pf_hi = pf_next ? EL_MIN(n, j_hi + EL_ATTN_DEC_CH) : j_hi;
    if (J->kv.i8) el_attn_dec_range(0, 1, J, j_lo, j_hi, pf_hi, split);
    else if (J->kv.f16) el_attn_dec_range(1, 0, J, j_lo, j_hi, pf_hi, split);
    else el_attn_dec_range(0, 0, J, j_lo, j_hi, pf_hi, split);
}

/* The splits as el_parallel_ranges items: a thread takes its own range's splits in key order,
 * each prefetching the next one's first keys while it ends, then splits left in the others'.
 * Claimed one by one in index order, every split started cold: its KV rows come from DRAM (a
 * decode step streams ~100 MB of weights between two visits of a layer's KV), one wait per
 * split. Zen 5, SmolLM2 decode, 2 threads, attention a layer (rdtsc inside el_chunk_step,
 * alternating runs): 500-700 keys 24.5-27.2 us -> 19.1-19.6 with ranges and 2 splits per thread,
 * 1000-1200 keys 38-42 -> 31-33. More than one split per thread is kept: a thread that starts
 * late (descheduled, a slower core) leaves its second to the others. */
static void el_attn_dec_item(void *ctx, int split, int flags) {
    el_attn_dec_split(ctx, split, (flags & EL_ITEM_MORE) != 0);
}

/* (int8 K/V wider than EL_ATTN_DEC_I8ROW a row take the tile path) */
static int el_attn_dec_fits(const el_attn_job *J) {
    return J->T == 1 && (!J->kv.i8 || J->KVH * J->hd <= EL_ATTN_DEC_I8ROW) && J->hd % 4 == 0 && J->H <= EL_ATTN_DEC_HMAX && (size_t)J->H * J->hd <= EL_ATTN_DEC_ACC;
}

/* Decode: tasks are key ranges over all heads, whole pool blocks each where possible */
static void el_attn_dec_run(el_pool *pool, el_attn_job *J) {
    const int n = J->start + 1, threads = el_pool_threads(pool);
    /* 2 splits per thread, not 4: each split costs its own start (its first keys' wait, its
     * partial state, its share of the merge); at 500-700 keys 4 per thread took 22-23 us a layer
     * against 19-20 (ranges, below, in both cases) */
    int S = threads > 1 ? EL_MAX(1, EL_MIN(2 * threads, n / EL_ATTN_DEC_SPLIT_MIN)) : 1;
    int len = (n + S - 1) / S;
    if (J->kv.table) len = (len + J->kv.bt - 1) / J->kv.bt * J->kv.bt;
    S = (n + len - 1) / len;
    if (S > 1) {
        J->part = malloc((size_t)J->H * S * (size_t)(J->hd + 2) * sizeof(float));
        if (!J->part) {  /* just slower */
            S = 1;
            len = n;
        }
    }
    J->n_split = S;
    J->split_len = len;
    el_parallel_ranges(pool, S, el_attn_dec_item, J);
    if (S > 1) {
        if (!*J->nomem) el_attn_merge(J);
        free(J->part);
    }
}

/* ---- generic twin ---------------------------------------------------------------------------- */

static inline float el_kv_at(const el_kv_src *s, const void *base, size_t off) {
    if (s->i8) return (float)((const int8_t *)base)[off] * (base == s->k ? s->ks : s->vs)[off / s->head_stride];
    return s->f16 ? el_f16_to_f32(((const uint16_t *)base)[off]) : ((const float *)base)[off];
}

/* One query row (token t, head h): online softmax one key at a time. */
static void el_attn_row_generic(const el_attn_job *J, int t, int h, float *acc) {
    const int hd = J->hd, kh = h / J->G, n = J->start + t + 1;
    const float *q = J->q + (size_t)t * J->q_ld + (size_t)h * hd;
    float m = -INFINITY, l = 0.0f;
    for (int i = 0; i < hd; i++) acc[i] = 0.0f;
    for (int j = 0; j < n; j++) {
        size_t off = el_kv_off(&J->kv, kh, j);
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s += q[i] * el_kv_at(&J->kv, J->kv.k, off + i);
        s *= J->scale;
        float mnew = s > m ? s : m;
        if (mnew == -INFINITY) continue;   /* every score so far -inf: weight 0 (-inf - -inf is NaN) */
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
    if (J->q_ld == 0) J->q_ld = (size_t)J->H * J->hd;
    J->G = J->H / J->KVH;
    J->scale = 1.0f / sqrtf((float)J->hd);
    J->n_split = 1;
    J->part = NULL;
    if (el_generic_flag) {
        el_parallel_for(pool, J->T * J->H, el_attn_task_generic, J);
        return EL_OK;
    }
    int nomem = 0;   /* set by a thread that got no scratch */
    J->nomem = &nomem;
    if (el_attn_dec_fits(J)) {
        el_attn_dec_run(pool, J);
        return nomem ? EL_ENOMEM : EL_OK;
    }
    /* tile shape: as many heads of the group as fit, then token rows, evened out */
    J->n_hsub = (J->G + EL_ATTN_QMAX - 1) / EL_ATTN_QMAX;
    J->gh = (J->G + J->n_hsub - 1) / J->n_hsub;
    J->tq = EL_MIN(J->T, EL_ATTN_QMAX / J->gh);
    J->n_ttile = (J->T + J->tq - 1) / J->tq;
    J->tq = (J->T + J->n_ttile - 1) / J->n_ttile;
    const int n = J->start + J->T, threads = el_pool_threads(pool);
    int tiles = J->KVH * J->n_hsub * J->n_ttile;
    if (threads > 1 && tiles < 2 * threads && J->T > 1) {
        /* A prompt chunk (T > 1) never splits its keys: the merge rounds otherwise than one
         * tile's online softmax, so a row's output, then its K/V in the cache, would depend on
         * how many rows its chunk had (the same greedy prompt gave another text once part of it
         * came from the prefix cache). More tiles come from token rows (each re-reads its kv
         * head's keys), then from the group's heads, which give every row the same result. */
        while (tiles < 2 * threads && (J->tq > 1 || J->gh > 1)) {
            if (J->tq > 1) {   /* (tq, gh fall by one a turn: the loop ends) */
                J->tq--;
                J->n_ttile = (J->T + J->tq - 1) / J->tq;
            } else {
                J->gh--;
                J->n_hsub = (J->G + J->gh - 1) / J->gh;
            }
            tiles = J->KVH * J->n_hsub * J->n_ttile;
        }
        J->tq = (J->T + J->n_ttile - 1) / J->n_ttile;   /* evened out, as above */
        J->gh = (J->G + J->n_hsub - 1) / J->n_hsub;
    } else if (threads > 1 && tiles < 2 * threads && n >= 2 * EL_ATTN_SPLIT_MIN) {
        /* too few tiles to occupy the pool (decode: one per kv head): split the keys as well,
         * into about 4 tasks per thread, so that claiming them one by one evens out the
         * threads (3 kv heads on 2 threads unsplit: one thread does 2 of the 3) */
        int want = (4 * threads + tiles - 1) / tiles;
        J->n_split = EL_MIN(want, n / EL_ATTN_SPLIT_MIN);
    }
    if (J->n_split > 1) {
        J->part = malloc((size_t)J->T * J->H * J->n_split * (size_t)(J->hd + 2) * sizeof(float));
        if (!J->part) J->n_split = 1;  /* just slower */
    }
    J->split_len = (n + J->n_split - 1) / J->n_split;
    el_parallel_for(pool, tiles * J->n_split, el_attn_task, J);
    if (J->n_split > 1) {
        if (!nomem) el_attn_merge(J);
        free(J->part);
    }
    return nomem ? EL_ENOMEM : EL_OK;
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
    return el_attention_pool_ld(pool, q, (size_t)H * hd, out, T, H, KVH, hd, start, k, v, kv_type, block_table,
                                block_tokens, n_layers, layer);
}

int el_attention_pool_ld(el_pool *pool, const float *q, size_t q_ld, float *out, int T, int H, int KVH, int hd,
                         int start, const void *k, const void *v, int kv_type, const int32_t *block_table,
                         int block_tokens, int n_layers, int layer) {
    int rc = el_attn_check(q, out, T, H, KVH, hd, start, k, v);
    if (rc != EL_OK) return rc;
    if (q_ld < (size_t)H * hd) return EL_EINVAL;
    if (kv_type != EL_F32 && kv_type != EL_F16 && kv_type != EL_KV_I8) return EL_EUNSUPPORTED;
    if (!block_table || block_tokens <= 0 || n_layers <= 0 || layer < 0 || layer >= n_layers) return EL_EINVAL;
    const el_kv_i8 *k8 = k, *v8 = v;
    if (kv_type == EL_KV_I8 && (!k8->q || !k8->scale || !v8->q || !v8->scale)) return EL_EINVAL;
    const int n = start + T, n_blocks = (n - 1) / block_tokens + 1;
    for (int i = 0; i < n_blocks; i++)
        if (block_table[i] < 0) return EL_EINVAL;
    el_attn_job J = {.q = q, .q_ld = q_ld, .out = out, .T = T, .H = H, .KVH = KVH, .hd = hd, .start = start};
    const size_t row = (size_t)KVH * hd, layer_sz = (size_t)block_tokens * row;
    J.kv = (el_kv_src){.k = k, .v = v, .f16 = kv_type == EL_F16, .table = block_table, .bt = block_tokens,
                       .block_stride = (size_t)n_layers * layer_sz, .layer_off = (size_t)layer * layer_sz,
                       .row_stride = row, .head_stride = (size_t)hd};
    if (kv_type == EL_KV_I8)
        J.kv.i8 = 1, J.kv.k = k8->q, J.kv.v = v8->q, J.kv.ks = k8->scale, J.kv.vs = v8->scale;
    return el_attn_run(pool, &J);
}
