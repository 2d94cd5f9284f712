/* x86 AVX-512 (development builds on AVX-512 CPUs): attention.c's two decode blocks on 16-lane
 * registers. Included by attention.c inside its AVX2 section; the PV block has el_dec_pv's
 * signature, the score block also takes its key count and a compile-time hd.
 *
 * Why: inside a decode step (Zen 5, SmolLM2, 2 threads) the 8-lane blocks took 13.2 us a layer
 * at 500-700 keys with the K/V rows already in cache, 17.9 us from DRAM: compute, not memory.
 * The 8-lane score block puts 4 dims of 2 keys in a register (two 8-byte loads and an unpack per
 * conversion, then VHADDPS folds per key); here a register is 16 consecutive dims of one key,
 * converted straight from its row, one accumulator per key and query row, and the 4 keys x NR
 * rows are folded once at the end (el_x5_sum4). That is another summation order: scores equal the
 * 4- and 8-lane blocks' to fp32 rounding, not bit for bit. PV keeps their order (a lane is one
 * output dim, its keys summed in order from acc * alpha): bit-identical to them. */
#ifndef EL_ATTN_DEC_AVX512_H
#define EL_ATTN_DEC_AVX512_H

#include "el_avx512.h"

/* dims [0, n) of a K/V row (n <= 16; lanes past n are 0) as fp32 */
static EL_AI __m512 el_kv_ld16(const int F16, const char *p, int n) {
    if (n >= 16) return F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps(p);
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    return F16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)) : _mm512_maskz_loadu_ps(m, p);
}

/* s[r][k] = scale * (q[r] . key k), k < KG (4 or 8), for NR (1..4) query rows; kr: the KG keys'
 * rows (this kv head's part). HD: hd as a compile-time constant (64: the dim loop unrolls, no
 * masks), or 0 for any hd (the last 16 dims masked). Each register is 16 consecutive dims of one
 * key, one accumulator per key and row, folded 4 keys at a time at the end (el_x5_sum4): the
 * same sums in the same order for KG 4 and 8 and either HD. 8 keys a call halve the per-call
 * work (the key pointers, the zeroed accumulators, the loop) against the FMAs: at hd 64 that
 * work and a dim loop the compiler kept rolled took ~60% of the scores' time. NR 4 x 8 keys
 * would need 32 accumulators, the whole register file: 4 keys there. */
static EL_AI void el_dec_scoresk_avx512(const int NR, const int KG, const int F16, const int HD, const float *const *q,
                                        const char *const *kr, int hd_rt, float scale, float *const *s) {
    const int esz = F16 ? 2 : 4, hd = HD ? HD : hd_rt;
    __m512 a[4][8];   /* [query row][key] */
    for (int r = 0; r < NR; r++)
        for (int k = 0; k < KG; k++) a[r][k] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) {
        const int n = hd - d;
        __m512 qd[4];
        for (int r = 0; r < NR; r++)
            qd[r] = n >= 16 ? _mm512_loadu_ps(q[r] + d) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), q[r] + d);
        for (int k = 0; k < KG; k++) {
            const __m512 kv = el_kv_ld16(F16, kr[k] + (size_t)d * esz, n);
            for (int r = 0; r < NR; r++) a[r][k] = _mm512_fmadd_ps(kv, qd[r], a[r][k]);
        }
    }
    const __m128 sc = _mm_set1_ps(scale);
    for (int r = 0; r < NR; r++)
        for (int k = 0; k < KG; k += 4)
            _mm_storeu_ps(s[r] + k, _mm_mul_ps(el_x5_sum4(a[r][k], a[r][k + 1], a[r][k + 2], a[r][k + 3]), sc));
}

/* NV registers (16 dims each) of NR rows' accumulators from dim d over keys i < c */
static EL_AI void el_dec_pv16(const int NR, const int NV, const int F16, float *const *acc, const float *alpha,
                              const float *const *p, const char *const *vr, int c, int d, const char *const *pf,
                              int npf, size_t pf_bytes) {
    const int esz = F16 ? 2 : 4;
    __m512 a[4][4];
    for (int r = 0; r < NR; r++) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int v = 0; v < NV; v++) a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d + 16 * v), al);
    }
    for (int i = 0; i < c; i++) {
        if (i < npf) el_prefetch_span(pf[i], pf_bytes);
        const char *row = vr[i] + (size_t)d * esz;
        __m512 vv[4];
        for (int v = 0; v < NV; v++) vv[v] = el_kv_ld16(F16, row + (size_t)16 * v * esz, 16);
        for (int r = 0; r < NR; r++) {
            const __m512 pi = _mm512_set1_ps(p[r][i]);
            for (int v = 0; v < NV; v++) a[r][v] = _mm512_fmadd_ps(vv[v], pi, a[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc[r] + d + 16 * v, a[r][v]);
}

static EL_AI void el_dec_pv_avx512(const int NR, const int F16, float *const *acc, const float *alpha,
                                   const float *const *p, const char *const *vr, int c, int hd, const char *const *pf,
                                   int npf) {
    const int esz = F16 ? 2 : 4;
    const size_t pf_bytes = (size_t)hd * esz;
    int d = 0;
    /* 64 dims at a time (4 x NR accumulators in registers), the next chunk's rows prefetched
     * during the first pass only */
    for (; d + 64 <= hd; d += 64) el_dec_pv16(NR, 4, F16, acc, alpha, p, vr, c, d, pf, d == 0 ? npf : 0, pf_bytes);
    for (; d + 16 <= hd; d += 16) el_dec_pv16(NR, 1, F16, acc, alpha, p, vr, c, d, pf, d == 0 ? npf : 0, pf_bytes);
    el_dec_pv_tail(NR, F16, acc, alpha, p, vr, c, d, hd);   /* hd % 16 */
}

#endif
