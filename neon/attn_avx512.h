/* x86 AVX-512 (development builds on AVX-512 CPUs): the prefill tile's score and PV blocks of
 * attention.c on 16-lane registers. Included by attention.c inside its AVX2 section.
 *
 * A Zen 5 core issues two 512-bit FMAs per cycle, twice the 256-bit rate (measured by
 * el_peak_probe: 251 vs ~130 GFLOPS a core), and the 8-lane blocks were FMA-bound: perf put
 * most of the T = 32 after 400 tile's samples on their FMAs and broadcasts. Same shapes as the
 * AVX2 blocks, twice as wide: 4 query rows x 32 keys (scores) or 32 dims (PV), 8 independent
 * accumulators (fewer would leave the 4-cycle FMA latency exposed). Each lane is still one key
 * (scores) or one output dim (PV) accumulated in the same order, with the same two halves of d
 * for the scores, so results are bit-identical to the 4- and 8-lane blocks. A last 16 keys or
 * dims take one register per row; a dim tail under 16 goes to the 4-lane block. */
#ifndef EL_ATTN_AVX512_H
#define EL_ATTN_AVX512_H

#include "el_avx512.h"

/* The first half's sums stay in registers for the second (32 of them here: 8 accumulators,
 * 8 held sums, 2 key vectors and a broadcast), where the AVX2 block has to park them in s and
 * reload them; the sum is the same add, first half + second half. */
static inline __attribute__((always_inline)) void
el_scores_block_avx512(const int NR, const float *const *q, const float *kt, int ld, int nk, int hd,
                       float *const *s) {
    const int half = hd / 2;
    for (int k0 = 0; k0 < nk;) {
        const int wide = nk - k0 >= 32;   /* 2 registers of keys per row, else 1 (nk % 16 == 0) */
        __m512 part[4][2], a[4][2];
        for (int pass = 0; pass < 2; pass++) {
            const int d0 = pass ? half : 0, d1 = pass ? hd : half;
            for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            const float *kc = kt + (size_t)d0 * ld + k0;
            if (wide) {
                for (int d = d0; d < d1; d++, kc += ld) {
                    __m512 k0v = _mm512_loadu_ps(kc), k1v = _mm512_loadu_ps(kc + 16);
                    __asm__("" : "+v"(k0v), "+v"(k1v));   /* in registers, as in the AVX2 block */
                    for (int r = 0; r < NR; r++) {
                        const __m512 qd = _mm512_set1_ps(q[r][d]);
                        a[r][0] = _mm512_fmadd_ps(k0v, qd, a[r][0]);
                        a[r][1] = _mm512_fmadd_ps(k1v, qd, a[r][1]);
                    }
                }
            } else {
                for (int d = d0; d < d1; d++, kc += ld) {
                    const __m512 k0v = _mm512_loadu_ps(kc);
                    for (int r = 0; r < NR; r++) a[r][0] = _mm512_fmadd_ps(k0v, _mm512_set1_ps(q[r][d]), a[r][0]);
                }
            }
            if (pass == 0)
                for (int r = 0; r < NR; r++) part[r][0] = a[r][0], part[r][1] = a[r][1];
        }
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 1 + wide; v++) _mm512_storeu_ps(s[r] + k0 + 16 * v, _mm512_add_ps(part[r][v], a[r][v]));
        k0 += wide ? 32 : 16;
    }
}

static inline __attribute__((always_inline)) void
el_pv_block_avx512(const int NR, float *const *acc, const float *alpha, const float *const *p,
                   const float *const *rows, int nk, int hd) {
    int i = 0;
    /* 64 dims a pass where hd allows: 16 accumulators, and each key's row pointer and each p
     * broadcast serve 4 vectors, not 2 (the 32-dim pass made 7 loads per 8 FMAs) */
    for (; i + 64 <= hd; i += 64) {
        __m512 a[4][4];
        for (int r = 0; r < NR; r++) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            for (int v = 0; v < 4; v++) a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + i + 16 * v), al);
        }
        for (int j = 0; j < nk; j++) {
            __m512 vv[4];
            for (int v = 0; v < 4; v++) vv[v] = _mm512_loadu_ps(rows[j] + i + 16 * v);
            for (int r = 0; r < NR; r++) {
                const __m512 pj = _mm512_set1_ps(p[r][j]);
                for (int v = 0; v < 4; v++) a[r][v] = _mm512_fmadd_ps(vv[v], pj, a[r][v]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc[r] + i + 16 * v, a[r][v]);
    }
    for (; i + 32 <= hd; i += 32) {
        __m512 a[4][2];
        for (int r = 0; r < NR; r++) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            a[r][0] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + i), al);
            a[r][1] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + i + 16), al);
        }
        for (int j = 0; j < nk; j++) {
            const __m512 v0 = _mm512_loadu_ps(rows[j] + i), v1 = _mm512_loadu_ps(rows[j] + i + 16);
            for (int r = 0; r < NR; r++) {
                const __m512 pj = _mm512_set1_ps(p[r][j]);
                a[r][0] = _mm512_fmadd_ps(v0, pj, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(v1, pj, a[r][1]);
            }
        }
        for (int r = 0; r < NR; r++) {
            _mm512_storeu_ps(acc[r] + i, a[r][0]);
            _mm512_storeu_ps(acc[r] + i + 16, a[r][1]);
        }
    }
    if (i + 16 <= hd) {
        __m512 a[4];
        for (int r = 0; r < NR; r++) a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + i), _mm512_set1_ps(alpha[r]));
        for (int j = 0; j < nk; j++) {
            const __m512 v0 = _mm512_loadu_ps(rows[j] + i);
            for (int r = 0; r < NR; r++) a[r] = _mm512_fmadd_ps(v0, _mm512_set1_ps(p[r][j]), a[r]);
        }
        for (int r = 0; r < NR; r++) _mm512_storeu_ps(acc[r] + i, a[r]);
        i += 16;
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


/* ---- a chunk's K and V into the tile's buffers ------------------------------------------------
 * The tile reads K transposed (kt: hd rows of cp keys) and V as fp32 rows. The 4-lane path
 * (el_fetch_rows, el_transpose_rows) converts fp16 4 values at a time into a buffer, then
 * transposes that buffer in 4 x 4 blocks: perf put ~6% of a cached 32-token chat turn's samples
 * (SmolLM2, 401 keys cached) on the conversion alone. Here 16 keys' 16 dims are converted
 * straight from the arena into 16 registers and transposed there (64 shuffles); V rows go
 * through el_fetch_rows, whose conversion is 16-lane on x86. The same values land in the same
 * places (conversion is exact, keys past c are zeros): the tile's results are bit-identical. */
#define EL_ATTN_X5_KV 1

/* kt[d * cp + j] = key j's dim d (keys at element offsets off[j], j < c; zeros for c <= j < cp),
 * cp a multiple of 16, hd a multiple of 16; prefetches the next chunk's rows (pf[i], i < npf) */
static void el_kt_x5(const el_kv_src *s, const void *base, const size_t *off, int c, const size_t *pf, int npf,
                     int hd, float *kt, int cp) {
    const size_t esz = s->f16 ? 2 : 4;
    el_prefetch_rows(s, base, pf, npf, hd);
    for (int j0 = 0; j0 < cp; j0 += 16) {
        const char *row[16];
        for (int i = 0; i < 16; i++) row[i] = j0 + i < c ? (const char *)base + off[j0 + i] * esz : NULL;
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                if (!row[i]) r[i] = _mm512_setzero_ps();
                else if (s->f16) r[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row[i] + (size_t)d0 * 2)));
                else r[i] = _mm512_loadu_ps((const float *)row[i] + d0);
            }
            el_x5_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(kt + (size_t)(d0 + i) * cp + j0, r[i]);
        }
    }
}

#endif
