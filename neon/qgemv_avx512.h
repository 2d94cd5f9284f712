/* x86 AVX-512 (VNNI + VBMI) GEMVs for development builds: included by quant_matmul.c, which
 * owns the int8 blocks of x (el_xq) these read. The Q4 one: the same arithmetic per block as the
 * other tiles (exact int32 block sums, then d_w d_x in fp32, plus m_w s_x), in another summation
 * order, so results agree with the NEON / AVX2 tiles to fp32 rounding, not bit for bit. The Q8_0
 * one (el_qgemv_q8_avx512, below) keeps their order: bit-identical.
 *
 * Why: on a Zen 5 the 8-row AVX2 tile (el_qgemv8_q4_avx2) is compute-bound at ~25-30 GB/s per
 * core, so two cores stream weights at ~47 GB/s of the ~62 GB/s DRAM gives. Here one 512-bit
 * register holds 4 blocks of a row: two VPERMT2B gather their 64 quant bytes and their 4 scales
 * (replicated per 32-bit lane, so the fp32 scaling runs lane-wise across blocks), two VPDPBUSD
 * form the 4 blocks' int32 sums (u8 nibbles x s8 x; each lane a partial sum of 8 products), and
 * one horizontal reduction per row at the end replaces the per-block folds: ~16 instructions per
 * row and 4 blocks, against ~40 for the AVX2 tile.
 *
 * x is laid out once per call, which is once per chunk of rows (a few per thread and GEMV: by
 * instruction count ~2% of a 32-row chunk at K = 576), per group of 4 blocks: the low 16 bytes
 * of each block, the high 16, d per lane, and s in the first lane of each block only, so that
 * the 4 lanes of a block add m_w s_x once). Weight blocks past the row's end are read with masked loads (zeros: no fault at
 * the matrix's end), and x is zero there: their terms are 0 * 0. */
#if EL_SIMDE && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define EL_X5_GEMV 1
#include "el_avx512.h"
/* K up to 16384 (x's layout lives on the stack: 256 bytes per 4 blocks, 32 KiB at most) */
#define EL_X5_MAX_NB 512
/* How far ahead of the 4 rows in use the one linear prefetch stream runs (like the AVX2 GEMV's),
 * in bytes, at least 8 rows. A decode GEMV is short (0.1-0.6 MB per thread), so its stream must
 * reach full speed at once: at 8 rows (2.9 KB at K = 576) SmolLM2's gate|up GEMV took ~55 kcycles
 * a layer inside a decode step, at 32 rows (11.5 KB) ~44; 64 rows was slower again. */
#define EL_X5_PF_BYTES 12288

typedef struct {
    __m512i lo, hi;   /* x bytes 0..15 | 16..31 of blocks 4k..4k+3, one 128-bit lane per block */
    __m512 d, s;      /* d_x in every lane of its block; s_x in the block's first lane, 0 elsewhere */
} el_x5_group;

/* byte i of the result = byte idx[i] of the 128 bytes a | b (VPERMT2B) */
static inline __m512i el_x5_idx(int base, int stride, int off) {
    uint8_t idx[64];
    for (int i = 0; i < 64; i++) idx[i] = (uint8_t)(base + stride * (i / 16) + off + i % 16);
    return _mm512_loadu_si512(idx);
}

/* n bytes from p into a zeroed register (masked: nothing past p + n is touched) */
static inline __m512i el_x5_load(const void *p, int n) {
    const __mmask64 m = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n > 0 ? n : 0)) - 1);
    return _mm512_maskz_loadu_epi8(m, p);
}

static inline void el_x5_layout(const int8_t *xq, const float *xd, const float *xs, int nb, el_x5_group *g) {
    const __m512i lo_idx = el_x5_idx(0, QK, 0), hi_idx = el_x5_idx(0, QK, 16);
    const __m512i rep = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int b = 0, k = 0; b < nb; b += 4, k++) {
        const int n = EL_MIN(4, nb - b), bytes = n * QK;
        const __m512i a = el_x5_load(xq + (size_t)b * QK, bytes), c = el_x5_load(xq + (size_t)b * QK + 64, bytes - 64);
        g[k].lo = _mm512_permutex2var_epi8(a, lo_idx, c);
        g[k].hi = _mm512_permutex2var_epi8(a, hi_idx, c);
        const __mmask16 first = (__mmask16)((1u << n) - 1);
        const __m512 d4 = _mm512_maskz_loadu_ps(first, xd + b), s4 = _mm512_maskz_loadu_ps(first, xs + b);
        g[k].d = _mm512_permutexvar_ps(rep, d4);
        g[k].s = _mm512_maskz_permutexvar_ps((__mmask16)0x1111, rep, s4);
    }
}

/* One row's group k of 4 blocks (G = 4 bs bytes at p, `left` bytes of the row from p on) -> acc */
static inline __attribute__((always_inline)) __m512
el_x5_step(const int wt, const uint8_t *p, int G, int left, const el_x5_group *x, __m512i qs_idx, __m512i dm_idx,
           __m512 acc) {
    __m512i a, c;
    if (left >= G) {    /* bytes 0..63, then G - 64 (16 or 8) more: VPERMT2B reads them as 64.. */
        a = _mm512_loadu_si512(p);
        c = wt == EL_Q4_1 ? _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 64)))
                          : _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(p + 64)));
    } else {
        a = el_x5_load(p, left);
        c = el_x5_load(p + 64, left - 64);
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i q = _mm512_permutex2var_epi8(a, qs_idx, c), dm = _mm512_permutex2var_epi8(a, dm_idx, c);
#if defined(__GFNI__)
    /* the high nibbles in one GF2P8AFFINEQB (result bit i = source bit i + 4, i < 4) instead of a
     * shift and a mask: the same bytes; single-thread GEMVs 1.5-3% faster (Zen 5, SmolLM2's
     * qkv, gate|up and down, two builds alternating in one process) */
    const __m512i lo = _mm512_and_si512(q, m4),
                  hi = _mm512_gf2p8affine_epi64_epi8(q, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
    const __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
#endif
    const __m512i isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x->lo), hi, x->hi);
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    const __m512 mw = wt == EL_Q4_1 ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1))
                                    : _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, x->d), acc);
    return _mm512_fmadd_ps(mw, x->s, acc);
}

/* The row walk both GEMVs share: 4 rows at a time, one linear prefetch stream pfd bytes ahead. */
static inline size_t el_x5_pfd(size_t rb) { return EL_MAX((size_t)8, (EL_X5_PF_BYTES + rb - 1) / rb) * rb; }

/* row[r]: rows r0..r0+3 (the last real one repeated past nr); the stream runs on by 4 rows */
static inline __attribute__((always_inline)) void el_x5_rows4(const uint8_t *w, size_t rb, int r0, int nr, size_t pfd,
                                                              const uint8_t *row[4]) {
    for (int r = 0; r < 4; r++) row[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;
    for (size_t o = 0; o < 4 * rb; o += 64) el_prefetch_ahead(row[0] + pfd + o);
}

/* y[r0 + r] = sum of acc[r]'s lanes (+ bias[r0 + r]), r < nr */
static inline __attribute__((always_inline)) void el_x5_store4(const __m512 acc[4], int r0, int nr, float *y,
                                                               const float *bias) {
    const __mmask8 keep = (__mmask8)((1u << nr) - 1);
    __m128 v = el_x5_sum4(acc[0], acc[1], acc[2], acc[3]);
    if (bias) v = _mm_add_ps(v, _mm_maskz_loadu_ps(keep, bias + r0));
    _mm_mask_storeu_ps(y + r0, keep, v);
}

/* Rows [0, rows) of a Q4_0 / Q4_1 chunk (rb bytes a row) against one int8 x row: y[r] (+ bias[r]).
 * after: this thread's previous chunk ended where this one starts, its prefetch stream ran on
 * into these rows (EL_ITEM_AFTER). */
static inline __attribute__((always_inline)) void
el_qgemv_q4_avx512(const int wt, const uint8_t *w, size_t rb, int rows, const int8_t *xq, const float *xd,
                   const float *xs, int nb, float *y, const float *bias, int after) {
    el_x5_group xg[EL_X5_MAX_NB / 4];
    el_x5_layout(xq, xd, xs, nb, xg);
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt), ng = (nb + 3) / 4, G = 4 * bs;
    /* from a group's bytes: the 4 blocks' quants; their d (bytes 0..31: each f16 d in 4
     * slots, one per 32-bit lane of its block) and m (bytes 32..63, Q4_1) */
    const __m512i qs_idx = el_x5_idx(off, bs, 0);
    uint8_t dm[64];
    for (int i = 0; i < 64; i++) dm[i] = (uint8_t)(bs * ((i % 32) / 8) + (i >= 32 ? 2 : 0) + i % 2);
    const __m512i dm_idx = _mm512_loadu_si512(dm);
    const size_t pfd = el_x5_pfd(rb);
    el_prefetch_chunk_start(w, rb, rows, pfd, after);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int nr = EL_MIN(4, rows - r0);
        const uint8_t *row[4];
        el_x5_rows4(w, rb, r0, nr, pfd, row);
        __m512 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
        for (int k = 0; k < ng; k++) {
            const int left = (nb - 4 * k) * bs;
            for (int r = 0; r < 4; r++)
                acc[r] = el_x5_step(wt, row[r] + (size_t)k * G, G, left, &xg[k], qs_idx, dm_idx, acc[r]);
        }
        el_x5_store4(acc, r0, nr, y, bias);
    }
}

/* Q8_0 against int8 x (a K-quant model's Q8_0 copy, llama.cpp Q8_0 files): unlike the Q4 GEMV
 * above, bit-identical to the AVX2 / NEON tiles and the GEMM tiles, whose exact int32 block sums
 * and per-row order (one FMA by d_w d_x per block, in block order) it keeps: the rows' int32 sums
 * are folded per block, not per row at the end. A register holds block b of two rows (32 quant
 * bytes each), u = q_w XOR 0x80 = q_w + 128, and one VPDPBUSD against x's block in both halves
 * leaves 8 partial sums per row; each lane's accumulator starts at -16 sum(q_x), so that a row's
 * 8 lanes add up to sum(q_w q_x) exactly. 8 such registers (16 rows) fold in 21 shuffles and
 * adds to one register of the 16 rows' block sums (lane r = row r), and the fp32 scaling runs 16
 * rows wide. d_w of the 16 rows: 16 scalar loads through the stack; one VPGATHERDD instead made
 * the GEMV 10-25% slower (Zen 5). Zen 5, 2 threads, against the 4-row AVX2 tile: SmolLM2's
 * shapes from cache 1.12-1.18x, 576 x 49152 (30 MB) 1.35x; the Q8_0 file's decode 212-223 ->
 * 276-299 tok/s with the GEMM tile above (qmatmul_avx512.h).
 * Row pairs: register k holds rows k | k + 4 (k < 4) and k + 4 | k + 8 (k >= 4), so that the
 * fold's last step leaves the rows in order. G = 8: registers 0..3 only, lanes 8..15 repeat 0..7. */
static inline __attribute__((always_inline)) __m512i el_q8_fold8(const __m512i p[8], const int G) {
    __m512i q[4], r[2];
    for (int k = 0; k < G / 4; k++)
        q[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * k], p[2 * k + 1]),
                                _mm512_unpackhi_epi32(p[2 * k], p[2 * k + 1]));
    for (int k = 0; k < G / 8; k++)
        r[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2 * k], q[2 * k + 1]),
                                _mm512_unpackhi_epi64(q[2 * k], q[2 * k + 1]));
    const __m512i a = r[0], b = G == 16 ? r[1] : r[0];
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

/* G (8, 16) rows from row0 (rb bytes apart; nr real, the rest repeat the last) against x's nb
 * blocks (xc: -16 sum(q_x) per block) -> y[0..nr) (+ bias) */
static inline __attribute__((always_inline)) void el_q8_gemv_group(const int G, const uint8_t *row0, size_t rb, int nr,
                                                                   size_t pfd, const int8_t *xq, const float *xd,
                                                                   const int32_t *xc, int nb, float *y,
                                                                   const float *bias) {
    const int bs = el_qblock_bytes(EL_Q8_0), off = el_qoff(EL_Q8_0);
    const uint8_t *lo[8], *hi[8];
    for (int k = 0; k < G / 2; k++) {
        const int r = k < 4 ? k : k + 4;
        lo[k] = row0 + (size_t)EL_MIN(r, nr - 1) * rb + off;
        hi[k] = row0 + (size_t)EL_MIN(r + 4, nr - 1) * rb + off;
    }
    const uint8_t *rp[16];
    for (int r = 0; r < 16; r++) rp[r] = row0 + (size_t)EL_MIN(r % G, nr - 1) * rb;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const size_t o0 = (size_t)b * G * bs, o1 = o0 + (size_t)G * bs;
        for (size_t o = (o0 + 63) & ~(size_t)63; o < o1; o += 64) el_prefetch_ahead(row0 + pfd + o);
        const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + (size_t)b * QK)));
        const __m512i c = _mm512_set1_epi32(xc[b]);
        __m512i p[8];
        for (int k = 0; k < G / 2; k++) {
            const size_t o = (size_t)b * bs;
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(lo[k] + o))),
                                                 _mm256_loadu_si256((const __m256i *)(hi[k] + o)), 1);
            p[k] = _mm512_dpbusd_epi32(c, _mm512_xor_si512(w, flip), x);
        }
        const __m512i t = el_q8_fold8(p, G);
        uint16_t dh[16];
        for (int r = 0; r < 16; r++) dh[r] = (uint16_t)el_ld16(rp[r] + (size_t)b * bs);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, _mm512_set1_ps(xd[b])), acc);
    }
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(keep, bias));
    _mm512_mask_storeu_ps(y, keep, acc);
}

/* Rows [0, rows) of a Q8_0 chunk against one int8 x row (nb <= EL_X5_MAX_NB); after: as
 * el_qgemv_q4_avx512's */
static inline __attribute__((always_inline)) void el_qgemv_q8_avx512(const uint8_t *w, size_t rb, int rows,
                                                                     const int8_t *xq, const float *xd, int nb,
                                                                     float *y, const float *bias, int after) {
    int32_t xc[EL_X5_MAX_NB];
    el_q8_xcorr(xq, nb, 16, xc);
    const size_t pfd = el_x5_pfd(rb);
    el_prefetch_chunk_start(w, rb, rows, pfd, after);
    int r0 = 0;
    for (; r0 + 8 < rows; r0 += 16)
        el_q8_gemv_group(16, w + (size_t)r0 * rb, rb, EL_MIN(16, rows - r0), pfd, xq, xd, xc, nb, y + r0,
                         bias ? bias + r0 : NULL);
    if (r0 < rows)
        el_q8_gemv_group(8, w + (size_t)r0 * rb, rb, rows - r0, pfd, xq, xd, xc, nb, y + r0, bias ? bias + r0 : NULL);
}

/* Rows [0, rows) of a Q8_0 chunk (rb bytes a row) against fp32 x (el_matmul_f32act's GEMV: the
 * lm_head, 49152 x 576, 30 MB a token). The AVX2 8-row tile (el_f32act_q8_gemv_avx2) ran it at
 * ~26 GB/s per core, instruction-bound on 8-lane widening and folding. Here a block of one row is
 * two 16-lane halves (sign-extended, converted, multiplied by x's fp32 halves), scaled by its d
 * into one accumulator per row, and each row is folded once at its end: ~11 instructions per row
 * and block against ~20. Another summation order than the AVX2 / NEON tiles: equal to fp32
 * rounding, not bit for bit. */
static inline __attribute__((always_inline)) void
el_f32act_q8_gemv_avx512(const uint8_t *w, size_t rb, int rows, const float *x, int K, float *y, const float *bias,
                         int after) {
    const int nb = K / QK, bs = el_qblock_bytes(EL_Q8_0), off = el_qoff(EL_Q8_0);
    const size_t pfd = el_x5_pfd(rb);
    el_prefetch_chunk_start(w, rb, rows, pfd, after);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int nr = EL_MIN(4, rows - r0);
        const uint8_t *row[4];
        el_x5_rows4(w, rb, r0, nr, pfd, row);
        __m512 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + (size_t)b * QK), x1 = _mm512_loadu_ps(x + (size_t)b * QK + 16);
            for (int r = 0; r < 4; r++) {
                const uint8_t *q = row[r] + (size_t)b * bs;
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + off))));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + off + 16))));
                const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)el_ld16(q)));
                acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(w1, x1, _mm512_mul_ps(w0, x0)), d, acc[r]);
            }
        }
        el_x5_store4(acc, r0, nr, y, bias);
    }
}
#endif
