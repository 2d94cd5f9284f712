/* el_matmul: y (M, N) = x (M, K) @ W^T (+ bias), W in GGUF blocks (Q4_0, Q4_1, Q8_0) or plain
 * F32 / F16 rows (those kernels live in matmul_float.c). This file holds the entry points
 * (argument checks, segments, the task grid) and the int8-activation kernels. el_matmul_f32act
 * shares the grid; its block kernels, which keep x in fp32, are in matmul_float.c.
 *
 * Quantized path: x is quantized once per call to int8 blocks of 32 with one fp32 scale each
 * (symmetric, d = max|x| / 127, round to nearest even), plus s = d * sum(q) per block. A
 * block's dot product is then exact in int32 and scaled once in fp32:
 *     Q8_0: d_w d_x sum(q_w q_x)
 *     Q4_1: d_w d_x sum(q_w q_x) + m_w s_x               (w = d_w q_w + m_w)
 *     Q4_0: d_w d_x sum(q_w q_x) - 8 d_w s_x             (w = d_w (q_w - 8): Q4_1 with m_w = -8 d_w)
 * The int32 block sum is at most 32 * 127 * 128 < 2^24, so its conversion to fp32 is exact.
 *
 * Work split: tasks are (chunk of W rows) x (chunk of x rows); el_parallel_for spreads them.
 * Inside a task, register tiles of 4 weight rows x up to 4 x rows: every weight block is loaded
 * and unpacked once per x tile, every x block once per 4 weight rows (on AArch64 the 4 x 4 tile
 * needs ~26 of the 32 vector registers). M == 1 (GEMV) is the same code with a 4 x 1 tile, and
 * its chunks cover only W rows: the weights stream once, prefetched. x86 AVX2 builds run the GEMMs
 * (M > 1) on their own tile instead, from weights repacked per task (el_g_gemm_avx2, or 16 rows
 * wide with AVX-512: el_g5_gemm, el_g5_gemm_q8), and Q4 GEMVs on an 8-row, 2-block tile
 * (el_qgemv8_q4_avx2), or with AVX-512 VNNI + VBMI on 4 rows of 4-block registers, Q8_0 GEMVs
 * there on 16 rows (el_qgemv_q8_avx512); those x86 tiles live in qmatmul_avx2.h,
 * qmatmul_avx512.h and qgemv_avx512.h.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "el_common.h"

/* matmul_float.c: rows [0, rows) of an F32 / F16 weight chunk against nx rows of x (K floats
 * each), y rows ldy apart, bias already offset to the chunk. (Internal: hidden by
 * -fvisibility=hidden; the only caller is el_mm_chunk below.) */
void el_matmul_float_rows(int wtype, int generic, const uint8_t *w, int rows, const float *x, int nx, int K,
                          float *y, size_t ldy, const float *bias);
/* matmul_float.c: the same for block weights (Q4_0, Q4_1, Q8_0, rows rb bytes apart) against
 * fp32 x (el_matmul_f32act). */
void el_matmul_f32act_rows(int wtype, int generic, const uint8_t *w, size_t rb, int rows, const float *x, int nx,
                           int K, float *y, size_t ldy, const float *bias);
/* matmul_bqpanel.c: the same product in GEMM form, for every call of 2 or more x rows. Below ~6
 * rows the 4 x 4 tile here would be faster (the panel's dequantization is shared by too few rows:
 * SmolLM2's layer GEMMs, Q4_1, Zen 5, 2 threads, at 2 and 4 rows took 4.3-5.3x the int8 path's time
 * in GEMM form against 2.5-4.1x in the tile's), but the two forms sum in different orders: a
 * row's logits would then depend on how its prompt was cut into calls (prefill_chunk=2 against
 * the default chunks, tests/test_chunk_bounds.py). One row stays a GEMV. */
void el_bqpanel_rows(int wtype, const uint8_t *w, size_t rb, int rows, const float *x, int nx, int K, float *y,
                     size_t ldy, const float *bias);

#define QK 32
/* GEMV prefetch distance. The 4 rows of a tile are 4 interleaved streams a row apart; each
 * prefetches EL_PF_BYTES ahead of its own position, which together cover the region that far
 * ahead of the tile whatever K is (a row's prefetches run on into the rows after it). The
 * hardware prefetchers alone left a DRAM-resident GEMV at 40% of the cache-resident speed on
 * x86 (4.8 vs 13.5 GB/s, Q8_0 49152x576, one thread); 4 KiB ahead restored it to 11 GB/s
 * (2 KiB: 10.5, 8 KiB: 9.5). 4 KiB is also ~2x latency x bandwidth of a phone core's DRAM
 * path (~150 ns x ~15 GB/s). */
#define EL_PF_BYTES 4096

/* ---- quantized x layout in scratch --------------------------------------------------------- */
/* q (M, nb, 32) int8 | d (M, nb) fp32 | s (M, nb) fp32, each part 64-byte aligned. */
static size_t el_align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t el_matmul_scratch(int M, int K) {
    if (M <= 0 || K <= 0) return 0;
    size_t nb = ((size_t)K + QK - 1) / QK;
    /* + 64: the caller's buffer may be unaligned; we align its start */
    return 64 + el_align64((size_t)M * nb * QK) + 2 * el_align64((size_t)M * nb * sizeof(float));
}

typedef struct {
    int8_t *q;
    float *d, *s;
    int nb;
    /* -128 sum(q) per block, (M, nb): only the AVX-512 Q8_0 GEMM fills it, in its own view of a
     * task's x rows (el_g5_gemm_q8); NULL elsewhere */
    const int32_t *qc;
} el_xq;

static el_xq el_xq_layout(void *scratch, int M, int nb) {
    uint8_t *p = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    el_xq xq;
    xq.q = (int8_t *)p;
    p += el_align64((size_t)M * nb * QK);
    xq.d = (float *)p;
    p += el_align64((size_t)M * nb * sizeof(float));
    xq.s = (float *)p;
    xq.nb = nb;
    xq.qc = NULL;
    return xq;
}

/* ---- x -> int8 blocks ---------------------------------------------------------------------- */
/* Both twins compute d, 1/d and the rounding identically (nearest even: vcvtnq / nearbyintf in
 * the default rounding mode), so they produce the same int8 blocks bit for bit; test differences
 * between the twins then come from the kernels alone. */
static void el_quant_row_generic(const float *x, int8_t *q, float *d, float *s, int nb) {
    for (int b = 0; b < nb; b++, x += QK, q += QK) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {   /* a NaN is kept, as the SIMD maxima keep it (EL_MAX dropped it) */
            const float a = __builtin_fabsf(x[i]);
            amax = a > amax || a != a ? a : amax;
        }
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            float v = __builtin_nearbyintf(x[i] * id);
            /* symmetric, as d = amax / 127 makes every finite scale: -128 only ever came from an
             * infinite 1/d, and the x86 Q8_0 tiles' sign trick cannot take it (-(-128) = -128).
             * A NaN falls through to 0 below */
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            int qi = v == v ? (int)v : 0;
            q[i] = (int8_t)qi;
            sum += qi;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* A block whose 1/d is not finite (|x| below ~3.7e-37 everywhere, or a NaN) takes the generic
 * twin's clamped form in the SIMD rows too: their int32 conversions saturate there, and summing
 * those overflowed (undefined; the generic twin sums the clamped int8 values) */
#define EL_QUANT_ID_OK(id) ((id) <= 3.0e38f)

/* (x86 AVX2 builds quantize with el_quant_row_avx2 below; this twin still compiles there) */
static __attribute__((unused)) void el_quant_row_neon(const float *x, int8_t *q, float *d, float *s, int nb) {
    for (int b = 0; b < nb; b++, x += QK, q += QK) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(x + 4 * i);
            m = vmaxq_f32(m, vabsq_f32(v[i]));
        }
        float amax = vmaxvq_f32(m);
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        if (!EL_QUANT_ID_OK(id)) {
            el_quant_row_generic(x, q, d + b, s + b, 1);
            continue;
        }
        int32x4_t acc = vdupq_n_s32(0);
        for (int i = 0; i < 8; i += 2) {
            /* vcvtnq: round to nearest even, the same rule as the generic twin's nearbyintf */
            int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[i], id));
            int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(v[i + 1], id));
            acc = vaddq_s32(acc, vaddq_s32(a, c));
            int16x8_t h = vcombine_s16(vqmovn_s32(a), vqmovn_s32(c));
            vst1_s8(q + 4 * i, vqmovn_s16(h));
        }
        d[b] = db;
        s[b] = db * (float)vaddvq_s32(acc);
    }
}

#if EL_SIMDE && defined(__AVX2__)
/* x86: the NEON twin through SIMDe took ~1.5 ns per element (an MXCSR read in every vcvtnq,
 * emulated horizontal max and add), 10-16% of a Q4 GEMM's time once the GEMM tile below was
 * fast. The same operations in AVX2: exact max, the same scalar d and 1/d, one rounding multiply
 * and VCVTPS2DQ (nearest even in the default mode, as SIMDe's vcvtnq), int32 sum before the
 * saturating narrow: bit-identical blocks. A NaN anywhere in the block makes d NaN, as NEON's
 * FMAXV would (MAXPS alone drops NaNs depending on the operand order). */
static void el_quant_row_avx2(const float *x, int8_t *q, float *d, float *s, int nb) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < nb; b++, x += QK, q += QK) {
        __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        if (!_mm256_testz_ps(nan, nan)) amax = __builtin_nanf("");
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        if (!EL_QUANT_ID_OK(id)) {
            el_quant_row_generic(x, q, d + b, s + b, 1);
            continue;
        }
        const __m256 vid = _mm256_set1_ps(id);
        __m256i n[4];
        for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
        /* packs work per 128-bit half: dwords come out as 4-element groups 0,2,4,6 | 1,3,5,7 */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, order));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 1));
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(u);
    }
}
#endif

/* ---- quantized dot products ------------------------------------------------------------------ */
/* Block geometry: bytes per block, offset of the quants. */
static inline int el_qblock_bytes(int wt) { return wt == EL_Q8_0 ? 34 : wt == EL_Q4_1 ? 20 : 18; }
static inline int el_qoff(int wt) { return wt == EL_Q4_1 ? 4 : 2; }

/* A GEMV chunk's first pfd bytes (rows rb bytes, `rows` of them), when nothing ran ahead of them
 * (a thread's first chunk, or one taken from another thread's range). after = EL_ITEM_AFTER: the
 * thread's previous chunk ended here and its prefetch stream ran on into these rows; asking
 * again cost ~9% of a 576 x 576 GEMV from cache (Zen 5, one thread). */
static inline void el_prefetch_chunk_start(const uint8_t *w, size_t rb, int rows, size_t pfd, int after) {
    if (!after)
        for (size_t o = 0; o < EL_MIN(pfd, (size_t)rows * rb); o += 64) __builtin_prefetch(w + o);
}

static inline uint16_t el_ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* ---- instruction shims ---------------------------------------------------------------------- */
/* On Arm these are the instructions themselves. On x86, SIMDe implements vdotq_s32 as a scalar
 * loop (3.5x slower than the whole base kernel), vmull_s8 through an 8-byte vector conversion
 * that gcc 12 lowers to 4 instructions per widening, and vcvt_f32_f16 as 4 scalar conversions
 * plus shuffles. The SIMDe versions below compute the same lanes, bit for bit, from ops that map
 * 1:1 onto SSE (PSLLW/PSRAW, PUNPCKLBW, PMULLW, PMADDWD; F16C VCVTPH2PS), so x86 runs the
 * kernels' exact data flow at a usable speed. `pos`: the caller guarantees a >= 0 (Q4 nibbles),
 * so widening needs no sign mask; it is a compile-time constant at every call. */
#if EL_SIMDE
static inline int8x16_t el_sign_s8(int8x16_t a, const int pos) {
    return pos ? vdupq_n_s8(0) : vreinterpretq_s8_u8(vcltzq_s8(a));
}
static inline int16x8_t el_widen_lo_s8(int8x16_t a, const int pos) {   /* vmovl_s8(vget_low_s8(a)) */
    return vreinterpretq_s16_s8(vzip1q_s8(a, el_sign_s8(a, pos)));
}
static inline int16x8_t el_widen_hi_s8(int8x16_t a, const int pos) {   /* vmovl_high_s8(a) */
    return vreinterpretq_s16_s8(vzip2q_s8(a, el_sign_s8(a, pos)));
}
#endif

/* vmull_s8(vget_low_s8(a), vget_low_s8(b)) */
static inline int16x8_t el_vmull_lo_s8(int8x16_t a, int8x16_t b, const int pos) {
#if EL_SIMDE
    return vmulq_s16(el_widen_lo_s8(a, pos), el_widen_lo_s8(b, 0));
#else
    (void)pos;
    return vmull_s8(vget_low_s8(a), vget_low_s8(b));
#endif
}

/* vmlal_s8(acc, vget_low_s8(a), vget_low_s8(b)) */
static inline int16x8_t el_vmlal_lo_s8(int16x8_t acc, int8x16_t a, int8x16_t b, const int pos) {
#if EL_SIMDE
    return vmlaq_s16(acc, el_widen_lo_s8(a, pos), el_widen_lo_s8(b, 0));
#else
    (void)pos;
    return vmlal_s8(acc, vget_low_s8(a), vget_low_s8(b));
#endif
}

/* vmlal_high_s8(acc, a, b) */
static inline int16x8_t el_vmlal_hi_s8(int16x8_t acc, int8x16_t a, int8x16_t b, const int pos) {
#if EL_SIMDE
    return vmlaq_s16(acc, el_widen_hi_s8(a, pos), el_widen_hi_s8(b, 0));
#else
    (void)pos;
    return vmlal_high_s8(acc, a, b);
#endif
}

#if EL_DOTPROD
/* vdotq_s32(acc, a, b) */
static inline int32x4_t el_vdotq_s32(int32x4_t acc, int8x16_t a, int8x16_t b, const int pos) {
#if EL_SIMDE
    /* lane i = sum_j<4 a[4i+j] b[4i+j]: the even bytes' products pair-summed (PMADDWD by 1)
     * give a[4i]b[4i] + a[4i+2]b[4i+2], the odd bytes' the other two. int8 x int8 fits int16. */
    int16x8_t a16 = vreinterpretq_s16_s8(a), b16 = vreinterpretq_s16_s8(b);
    int16x8_t ae = pos ? vandq_s16(a16, vdupq_n_s16(0xFF)) : vshrq_n_s16(vshlq_n_s16(a16, 8), 8);
    int16x8_t ao = pos ? vreinterpretq_s16_u16(vshrq_n_u16(vreinterpretq_u16_s16(a16), 8)) : vshrq_n_s16(a16, 8);
    int16x8_t be = vshrq_n_s16(vshlq_n_s16(b16, 8), 8), bo = vshrq_n_s16(b16, 8);
    return vpadalq_s16(vpadalq_s16(acc, vmulq_s16(ae, be)), vmulq_s16(ao, bo));
#else
    (void)pos;
    return vdotq_s32(acc, a, b);
#endif
}
#endif

/* 4 fp16 values at 4 addresses -> fp32x4 (exact). Arm: 4 lane loads and one FCVTL (base
 * Armv8.0 has the conversion). */
static inline float32x4_t el_f16x4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
#if EL_SIMDE && defined(__F16C__)
    __m128i h = _mm_setr_epi16((short)el_ld16(p0), (short)el_ld16(p1), (short)el_ld16(p2), (short)el_ld16(p3), 0, 0,
                               0, 0);
    return simde_float32x4_from_m128(_mm_cvtph_ps(h));
#else
    uint16x4_t h = vld1_dup_u16((const uint16_t *)p0);
    h = vld1_lane_u16((const uint16_t *)p1, h, 1);
    h = vld1_lane_u16((const uint16_t *)p2, h, 2);
    h = vld1_lane_u16((const uint16_t *)p3, h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
#endif
}

/* 32 int8 products summed into int32x4 lanes (only the lane total matters: the caller reduces).
 * dotprod: two SDOT. Base Armv8.0: widening multiplies accumulate in int16 first, then one
 * pairwise widening add (SADALP) per block. int16 headroom decides how many products a lane may
 * take: Q4 (0 <= q_w <= 15) x 127 x 4 = 7620 fits 4 products per lane; Q8_0 (|q_w| <= 128)
 * x 127 x 2 = 32512 fits only 2, so Q8_0 widens to int32 after every 16 products. */
static inline int32x4_t el_dot32_q4(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
#if EL_DOTPROD
    return el_vdotq_s32(el_vdotq_s32(vdupq_n_s32(0), w0, x0, 1), w1, x1, 1);
#else
    int16x8_t t = el_vmull_lo_s8(w0, x0, 1);
    t = el_vmlal_hi_s8(t, w0, x0, 1);
    t = el_vmlal_lo_s8(t, w1, x1, 1);
    t = el_vmlal_hi_s8(t, w1, x1, 1);
    return vpaddlq_s16(t);
#endif
}

static inline int32x4_t el_dot32_q8(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
#if EL_DOTPROD
    return el_vdotq_s32(el_vdotq_s32(vdupq_n_s32(0), w0, x0, 0), w1, x1, 0);
#else
    int16x8_t t0 = el_vmlal_hi_s8(el_vmull_lo_s8(w0, x0, 0), w0, x0, 0);
    int16x8_t t1 = el_vmlal_hi_s8(el_vmull_lo_s8(w1, x1, 0), w1, x1, 0);
    return vpadalq_s16(vpaddlq_s16(t0), t1);
#endif
}

#include "qmatmul_avx2.h"
#include "qmatmul_avx512.h"
#include "qgemv_avx512.h"

/* One register tile: 4 weight rows (w[r] = row r's first block; rows past the matrix repeat the
 * last real row and are never stored) x nx rows of quantized x. acc[c] lane r = y[c][row r].
 * wt and nx are compile-time constants at every call site (always_inline), so the loops unroll
 * and acc / the unpacked weights live in registers. */
static inline __attribute__((always_inline)) void
el_qtile(const int wt, const int nx, const uint8_t *const w[4], const int8_t *xq, const float *xd, const float *xs,
         int nb, float32x4_t acc[4]) {
#if EL_SIMDE && defined(__AVX2__)
    el_qtile_avx2(wt, nx, w, xq, xd, xs, nb, acc);
    return;
#endif
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int c = 0; c < nx; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        int8x16_t w0[4], w1[4];
        const uint8_t *blk4[4];
        for (int r = 0; r < 4; r++) blk4[r] = w[r] + (size_t)b * bs;
        if (nx == 1)   /* GEMV: weights are used once, straight from DRAM */
            for (int r = 0; r < 4; r++) __builtin_prefetch(blk4[r] + EL_PF_BYTES);
        const float32x4_t dw = el_f16x4(blk4[0], blk4[1], blk4[2], blk4[3]);
        const float32x4_t mw = wt == EL_Q4_1 ? el_f16x4(blk4[0] + 2, blk4[1] + 2, blk4[2] + 2, blk4[3] + 2)
                                             : vmulq_n_f32(dw, -8.0f);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = blk4[r];
            if (wt == EL_Q8_0) {
                w0[r] = vld1q_s8((const int8_t *)blk + off);
                w1[r] = vld1q_s8((const int8_t *)blk + off + 16);
            } else {
                /* nibbles stay unsigned 0..15: Q4_0's -8 is folded into the m term (no subtract
                 * per weight; SDOT and SMULL are signed, and 0..15 is a valid int8) */
                uint8x16_t v = vld1q_u8(blk + off);
                w0[r] = vreinterpretq_s8_u8(vandq_u8(v, m4));
                w1[r] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
            }
        }
        for (int c = 0; c < nx; c++) {
            const int8_t *xb = xq + ((size_t)c * nb + b) * QK;
            int8x16_t x0 = vld1q_s8(xb), x1 = vld1q_s8(xb + 16);
            int32x4_t p[4];
            for (int r = 0; r < 4; r++)
                p[r] = wt == EL_Q8_0 ? el_dot32_q8(w0[r], w1[r], x0, x1) : el_dot32_q4(w0[r], w1[r], x0, x1);
            /* transpose-reduce: lane r = row r's block total, so one convert and one FMA serve
             * 4 rows, and the accumulator is already y's layout (no horizontal sum at the end) */
            int32x4_t t = vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]));
            acc[c] = vfmaq_f32(acc[c], vcvtq_f32_s32(t), vmulq_n_f32(dw, xd[(size_t)c * nb + b]));
            if (wt != EL_Q8_0) acc[c] = vfmaq_f32(acc[c], mw, vdupq_n_f32(xs[(size_t)c * nb + b]));
        }
    }
}


/* 1: the AVX-512 or AVX2 GEMM tile computed these rows; 0: run the portable tiles */
static inline __attribute__((always_inline)) int el_qrows_gemm(const int wt, const uint8_t *w, size_t rb, int rows,
                                                               int rows_after, const el_xq *xq, int x0, int nx_all,
                                                               float *y, size_t ldy, const float *bias) {
#if defined(EL_G5)
    if (wt != EL_Q8_0 && nx_all >= EL_G_MIN_NX && el_g5_gemm(wt, w, rb, rows, rows_after, xq, x0, nx_all, y, ldy, bias))
        return 1;
#endif
#if defined(EL_G5_Q8)
    if (wt == EL_Q8_0 && nx_all >= EL_G_MIN_NX && el_g5_gemm_q8(w, rb, rows, rows_after, xq, x0, nx_all, y, ldy, bias))
        return 1;
#endif
#if EL_SIMDE && defined(__AVX2__)
    if (nx_all >= EL_G_MIN_NX) return el_g_gemm_avx2(wt, w, rb, rows, rows_after, xq, x0, nx_all, y, ldy, bias);
#endif
    (void)wt, (void)w, (void)rb, (void)rows, (void)rows_after, (void)xq, (void)x0, (void)nx_all, (void)y, (void)ldy,
        (void)bias;
    return 0;
}

/* 1: the AVX-512 or AVX2 GEMV tile (Q4; Q8_0 on AVX-512 only: one x row) computed these rows; 0: run
 * the portable tiles (x86 Q8_0 without them: el_qtile_avx2).
 * after: the thread's previous chunk ended at w (EL_ITEM_AFTER): its prefetch stream ran on into
 * these rows. */
static inline __attribute__((always_inline)) int el_qrows_gemv(const int wt, const uint8_t *w, size_t rb, int rows,
                                                               const el_xq *xq, int x0, int nx_all, float *y,
                                                               const float *bias, int after) {
#if defined(EL_X5_GEMV)
    if (el_wide_gemv(1) && nx_all == 1 && wt != EL_Q8_0 && xq->nb <= EL_X5_MAX_NB) {
        const int nb = xq->nb;
        el_qgemv_q4_avx512(wt, w, rb, rows, xq->q + (size_t)x0 * nb * QK, xq->d + (size_t)x0 * nb,
                           xq->s + (size_t)x0 * nb, nb, y, bias, after);
        return 1;
    }
    if (el_wide_gemv(1) && nx_all == 1 && wt == EL_Q8_0 && xq->nb <= EL_X5_MAX_NB) {
        const int nb = xq->nb;
        el_qgemv_q8_avx512(w, rb, rows, xq->q + (size_t)x0 * nb * QK, xq->d + (size_t)x0 * nb, nb, y, bias, after);
        return 1;
    }
#endif
#if EL_SIMDE && defined(__AVX2__)
    if (nx_all == 1 && wt != EL_Q8_0) {
        const int nb = xq->nb;
        const int8_t *q = xq->q + (size_t)x0 * nb * QK;
        const float *d = xq->d + (size_t)x0 * nb, *s = xq->s + (size_t)x0 * nb;
        const size_t pfd = 8 * rb;
        el_prefetch_chunk_start(w, rb, rows, pfd, after);
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int nr = EL_MIN(8, rows - r0);
            const uint8_t *wr[8];
            for (int r = 0; r < 8; r++) wr[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;
            const __m256 acc = el_qgemv8_q4_avx2(wt, wr, pfd, q, d, s, nb);
            el_store_tile8(&acc, 1, nr, y + r0, 0, bias ? bias + r0 : NULL);
        }
        return 1;
    }
#endif
    (void)wt, (void)w, (void)rb, (void)rows, (void)xq, (void)x0, (void)nx_all, (void)y, (void)bias, (void)after;
    return 0;
}

#define EL_QROWS_FN(name, wt)                                                                         \
    static void name(const uint8_t *w, size_t rb, int rows, int rows_after, const el_xq *xq, int x0, \
                     int nx_all, float *y, size_t ldy, const float *bias, int after) {                \
        const int nb = xq->nb;                                                                        \
        if (el_qrows_gemm(wt, w, rb, rows, rows_after, xq, x0, nx_all, y, ldy, bias)) return;         \
        if (el_qrows_gemv(wt, w, rb, rows, xq, x0, nx_all, y, bias, after)) return;                   \
        for (int r0 = 0; r0 < rows; r0 += 4) {                                                        \
            const int nr = EL_MIN(4, rows - r0);                                                      \
            const uint8_t *wr[4];                                                                     \
            for (int r = 0; r < 4; r++) wr[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;            \
            const float *br = bias ? bias + r0 : NULL;                                                \
            for (int c0 = 0; c0 < nx_all; c0 += 4) {                                                  \
                const int nx = EL_MIN(4, nx_all - c0);                                                \
                const size_t xr = (size_t)(x0 + c0);                                                  \
                const int8_t *q = xq->q + xr * nb * QK;                                               \
                const float *d = xq->d + xr * nb, *s = xq->s + xr * nb;                               \
                float32x4_t acc[4];                                                                   \
                float *yt = y + (size_t)c0 * ldy + r0;                                                \
                switch (nx) {                                                                         \
                case 1: el_qtile(wt, 1, wr, q, d, s, nb, acc); el_store_tile(acc, 1, nr, yt, ldy, br); break; \
                case 2: el_qtile(wt, 2, wr, q, d, s, nb, acc); el_store_tile(acc, 2, nr, yt, ldy, br); break; \
                case 3: el_qtile(wt, 3, wr, q, d, s, nb, acc); el_store_tile(acc, 3, nr, yt, ldy, br); break; \
                default: el_qtile(wt, 4, wr, q, d, s, nb, acc); el_store_tile(acc, 4, nr, yt, ldy, br); break; \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

EL_QROWS_FN(el_qrows_q4_0, EL_Q4_0)
EL_QROWS_FN(el_qrows_q4_1, EL_Q4_1)
EL_QROWS_FN(el_qrows_q8_0, EL_Q8_0)

/* The plain twin: one (row, x row) dot at a time, the textbook formula per block (Q4_0 subtracts
 * its 8 per weight here, which cross-checks the folded form above). */
static void el_qrows_generic(int wt, const uint8_t *w, size_t rb, int rows, const el_xq *xq, int x0, int nx_all,
                             float *y, size_t ldy, const float *bias) {
    const int nb = xq->nb, bs = el_qblock_bytes(wt), off = el_qoff(wt);
    for (int c = 0; c < nx_all; c++) {
        const int8_t *q = xq->q + (size_t)(x0 + c) * nb * QK;
        const float *d = xq->d + (size_t)(x0 + c) * nb, *s = xq->s + (size_t)(x0 + c) * nb;
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = w + (size_t)r * rb + (size_t)b * bs;
                const int8_t *xb = q + b * QK;
                const float dw = el_f16_to_f32(el_ld16(blk));
                int32_t sum = 0;
                if (wt == EL_Q8_0) {
                    const int8_t *qw = (const int8_t *)blk + off;
                    for (int i = 0; i < QK; i++) sum += qw[i] * xb[i];
                    acc += dw * d[b] * (float)sum;
                } else {
                    const uint8_t *qw = blk + off;
                    const int sub = wt == EL_Q4_0 ? 8 : 0;
                    for (int i = 0; i < QK / 2; i++)
                        sum += ((qw[i] & 0x0F) - sub) * xb[i] + ((qw[i] >> 4) - sub) * xb[i + QK / 2];
                    acc += dw * d[b] * (float)sum;
                    if (wt == EL_Q4_1) acc += el_f16_to_f32(el_ld16(blk + 2)) * s[b];
                }
            }
            y[(size_t)c * ldy + r] = acc + (bias ? bias[r] : 0.0f);
        }
    }
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* (AVX-512 builds run el_f32act_q8_gemv_avx512 instead where el_x86_gemv says so) */
/* x86 el_matmul_f32act GEMV, Q8_0 (the lm_head, 49152 x 576, 30 MB a token). matmul_float.c's
 * 4-row tile ran it at ~17 GB/s with 2 threads, instruction-bound: per row and block, besides the
 * widening and the FMAs, an extract + add and a quarter of 3 VHADDPS (4 rows' lanes to 4 sums).
 * Here 8 rows share each folding step (VPERM2F128 pairs two rows' halves, 3 VHADDPS sum 8 rows)
 * and one 8-lane FMA applies the scales, and the prefetch is one linear stream 8 rows ahead as in
 * el_qgemv8_q4_avx2: 0.73x the time (2 threads, Zen 3 guest). Per row the arithmetic is the 4-row
 * tile's own (el_bqtile_avx2): the same 8-lane chain of one multiply and 3 FMAs, its two halves
 * added, the same pairwise sums, one FMA by d: results are bit-identical to it. */
static void el_f32act_q8_gemv_avx2(const uint8_t *w, size_t rb, int rows, const float *x, int K, float *y,
                                   const float *bias, int after) {
    const int nb = K / QK, bs = el_qblock_bytes(EL_Q8_0), off = el_qoff(EL_Q8_0);
    const size_t pfd = 8 * rb;
    el_prefetch_chunk_start(w, rb, rows, pfd, after);
    /* the sums come out in lanes 0, 2, 4, 6 | 1, 3, 5, 7 (VHADDPS works per 128-bit half) */
    const __m256i row_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        const int nr = EL_MIN(8, rows - r0);
        const uint8_t *wr[8];
        for (int r = 0; r < 8; r++) wr[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const size_t ob = (size_t)b * bs;
            for (int j = 0; j < 8 * bs; j += 64) __builtin_prefetch(wr[0] + pfd + 8 * ob + j);
            const float *xb = x + (size_t)b * QK;
            __m256 xv[4], p[4];
            for (int j = 0; j < 4; j++) xv[j] = _mm256_loadu_ps(xb + 8 * j);
            for (int h = 0; h < 4; h++) {
                __m256 s[2];
                for (int k = 0; k < 2; k++) {
                    const uint8_t *q = wr[2 * h + k] + ob + off;
                    __m256 wf[4];
                    for (int j = 0; j < 4; j++)
                        wf[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
                    s[k] = _mm256_mul_ps(wf[0], xv[0]);
                    for (int j = 1; j < 4; j++) s[k] = _mm256_fmadd_ps(wf[j], xv[j], s[k]);
                }
                /* rows 2h | 2h + 1, each its chain's low half + high half */
                p[h] = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                                     _mm256_permute2f128_ps(s[0], s[1], 0x31));
            }
            const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
            const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(
                (short)el_ld16(wr[0] + ob), (short)el_ld16(wr[2] + ob), (short)el_ld16(wr[4] + ob),
                (short)el_ld16(wr[6] + ob), (short)el_ld16(wr[1] + ob), (short)el_ld16(wr[3] + ob),
                (short)el_ld16(wr[5] + ob), (short)el_ld16(wr[7] + ob)));
            acc = _mm256_fmadd_ps(t, d, acc);
        }
        acc = _mm256_permutevar8x32_ps(acc, row_order);
        el_store_tile8(&acc, 1, nr, y + r0, 0, bias ? bias + r0 : NULL);
    }
}
#endif

/* ---- entry points ---------------------------------------------------------------------------- */
typedef struct {
    int wtype, generic;
    int f32act;                    /* block types: x stays fp32 (el_matmul_f32act) */
    int panel;                     /* f32act in GEMM form (matmul_bqpanel.c): M >= 2 */
    const void *const *seg_ptr;
    const int *seg_rows;
    int n_seg;
    size_t row_bytes;
    int rw;                        /* W rows per task chunk (multiple of 4) */
    int cx;                        /* x rows per task chunk (multiple of 4, or M) */
    int n_wchunks;                 /* over all segments */
    const float *x;                /* fp32 input (float types, f32act) */
    el_xq xq;                      /* quantized input (block types) */
    float *y;
    int M, K, N;
    const float *bias;
} el_mm_ctx;

/* x chunks of a GEMM of M rows cut in cx: the last one takes what is left, and a lone row left
 * over joins the chunk before it (M = 129, cx = 128: one chunk of 129). A chunk of one row runs
 * the GEMV kernels, whose sums round otherwise than the GEMM tiles': a prompt row's result
 * would depend on where its chunk cut it. */
static int el_x_chunks(int M, int cx) {
    const int n = (M + cx - 1) / cx;
    return n > 1 && M % cx == 1 ? n - 1 : n;
}

/* Task `task` of the grid; after: EL_ITEM_AFTER of a GEMV's ranges walk (see el_qrows_gemv) */
static void el_mm_chunk(const el_mm_ctx *c, int task, int after) {
    int wi = task % c->n_wchunks, xi = task / c->n_wchunks;
    /* find the segment holding W chunk wi; col0 = its first output column */
    int s = 0, col0 = 0;
    for (;; s++) {
        int nch = (c->seg_rows[s] + c->rw - 1) / c->rw;
        if (wi < nch) break;
        wi -= nch;
        col0 += c->seg_rows[s];
    }
    const int r0 = wi * c->rw, rows = EL_MIN(c->rw, c->seg_rows[s] - r0);
    const int x0 = xi * c->cx, nx = xi + 1 == el_x_chunks(c->M, c->cx) ? c->M - x0 : c->cx;
    const uint8_t *w = (const uint8_t *)c->seg_ptr[s] + (size_t)r0 * c->row_bytes;
    /* rows of the segment after this chunk: the next chunk, which a thread walking its range
     * claims next; the GEMM tiles prefetch the first of them while finishing their own */
    const int rows_after = c->seg_rows[s] - r0 - rows;
    const size_t ldy = (size_t)c->N;
    float *y = c->y + (size_t)x0 * ldy + col0 + r0;
    const float *bias = c->bias ? c->bias + col0 + r0 : NULL;

    if (c->wtype == EL_F32 || c->wtype == EL_F16) {
        el_matmul_float_rows(c->wtype, c->generic, w, rows, c->x + (size_t)x0 * c->K, nx, c->K, y, ldy, bias);
#if defined(EL_X5_GEMV)
    } else if (c->f32act && !c->generic && c->wtype == EL_Q8_0 && nx == 1 && el_wide_gemv(2)) {
        el_f32act_q8_gemv_avx512(w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, c->K, y, bias, after);
#endif
#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    } else if (c->f32act && !c->generic && c->wtype == EL_Q8_0 && nx == 1) {
        el_f32act_q8_gemv_avx2(w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, c->K, y, bias, after);
#endif
    } else if (c->panel) {
        el_bqpanel_rows(c->wtype, w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, nx, c->K, y, ldy, bias);
    } else if (c->f32act) {
        el_matmul_f32act_rows(c->wtype, c->generic, w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, nx, c->K, y,
                              ldy, bias);
    } else if (c->generic) {
        el_qrows_generic(c->wtype, w, c->row_bytes, rows, &c->xq, x0, nx, y, ldy, bias);
    } else if (c->wtype == EL_Q4_0) {
        el_qrows_q4_0(w, c->row_bytes, rows, rows_after, &c->xq, x0, nx, y, ldy, bias, after);
    } else if (c->wtype == EL_Q4_1) {
        el_qrows_q4_1(w, c->row_bytes, rows, rows_after, &c->xq, x0, nx, y, ldy, bias, after);
    } else {
        el_qrows_q8_0(w, c->row_bytes, rows, rows_after, &c->xq, x0, nx, y, ldy, bias, after);
    }
}

static void el_mm_task(void *vctx, int task, int n_tasks) {
    (void)n_tasks;
    el_mm_chunk((const el_mm_ctx *)vctx, task, 0);
}

#if EL_SIMDE && defined(__AVX2__)
/* x86 GEMVs (and GEMMs with one x chunk): the W chunks as el_parallel_ranges items, so each
 * thread streams a contiguous range of them and, when its range is done, takes chunks from the
 * others' ranges. Plain claiming in index order (el_parallel_for over the chunks) interleaves the
 * threads, so each thread's reads jump between rows and every chunk starts a new DRAM stream;
 * with few chunks (4 for a 576-row matrix on 2 threads), one thread starting late left the other
 * 3 of the 4. Here a range is one stream, cut in ~8 small chunks per thread so that the end
 * evens out to within one of them. */
static void el_mm_item(void *vctx, int item, int flags) {
    /* (the GEMM tiles prefetch the following rows themselves: rows_after) */
    el_mm_chunk((const el_mm_ctx *)vctx, item, (flags & EL_ITEM_AFTER) != 0);
}
#endif

typedef struct {
    const float *x;
    el_xq xq;
    int M, rows_per_task, generic;
} el_quant_ctx;

static void el_quant_task(void *vctx, int task, int n_tasks) {
    (void)n_tasks;
    const el_quant_ctx *c = (const el_quant_ctx *)vctx;
    const int nb = c->xq.nb, m1 = EL_MIN(c->M, (task + 1) * c->rows_per_task);
    for (int m = task * c->rows_per_task; m < m1; m++) {
        const float *x = c->x + (size_t)m * nb * QK;
        int8_t *q = c->xq.q + (size_t)m * nb * QK;
        float *d = c->xq.d + (size_t)m * nb, *s = c->xq.s + (size_t)m * nb;
        if (c->generic) el_quant_row_generic(x, q, d, s, nb);
#if EL_SIMDE && defined(__AVX2__)
        else el_quant_row_avx2(x, q, d, s, nb);
#else
        else el_quant_row_neon(x, q, d, s, nb);
#endif
    }
}

/* (x86 AVX2 GEMVs round their chunks to 8 rows instead) */
static __attribute__((unused)) int el_round4(int v) { return (v + 3) & ~3; }

/* Both entry points: f32act = 0 quantizes x for the block types (el_matmul), 1 keeps it fp32. */
static int el_matmul_run(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                         const float *x, float *y, int M, int K, const float *bias, void *scratch, int f32act,
                         const el_xq *pre) {
    const int blocks = wtype == EL_Q4_0 || wtype == EL_Q4_1 || wtype == EL_Q8_0;
    const int quantized = blocks && !f32act;   /* x goes through int8 blocks in scratch (or pre) */
    if (!blocks && wtype != EL_F32 && wtype != EL_F16) return EL_EUNSUPPORTED;
    if (pre && !quantized) return EL_EINVAL;
    if (!seg_ptr || !seg_rows || n_seg <= 0 || (!x && !pre) || !y || M <= 0 || K <= 0) return EL_EINVAL;
    if (blocks && K % QK) return EL_EINVAL;
    long long n_total = 0;
    for (int s = 0; s < n_seg; s++) {
        if (seg_rows[s] < 0 || (seg_rows[s] > 0 && !seg_ptr[s])) return EL_EINVAL;
        n_total += seg_rows[s];
    }
    if (n_total <= 0 || n_total > INT_MAX) return EL_EINVAL;

    el_mm_ctx c;
    memset(&c, 0, sizeof c);
    c.wtype = wtype;
    c.generic = el_generic_flag;
    c.f32act = f32act;
    c.panel = f32act && blocks && !c.generic && M >= 2;
    c.seg_ptr = seg_ptr;
    c.seg_rows = seg_rows;
    c.n_seg = n_seg;
    c.x = x;
    c.y = y;
    c.M = M;
    c.K = K;
    c.N = (int)n_total;
    c.bias = bias;
    switch (wtype) {
    case EL_F32: c.row_bytes = (size_t)K * 4; break;
    case EL_F16: c.row_bytes = (size_t)K * 2; break;
    default: c.row_bytes = (size_t)(K / QK) * el_qblock_bytes(wtype); break;   /* block types */
    }
    const int threads = pool ? EL_MAX(1, el_pool_threads(pool)) : 1;

    void *owned = NULL;
    if (pre) {
        c.xq = *pre;
    } else if (quantized) {
        if (!scratch) {
            scratch = owned = malloc(el_matmul_scratch(M, K));
            if (!owned) return EL_ENOMEM;
        }
        c.xq = el_xq_layout(scratch, M, K / QK);
        el_quant_ctx qc = {x, c.xq, M, 0, c.generic};
        /* quantizing a row costs about as much as one output column of the GEMM: split it only
         * when there are enough rows to pay for the trip through the pool (~1-2 us while the
         * workers still spin: a prefill chunk's GEMMs follow one another; serial, a 32-row
         * chunk left the other thread spinning through 4 quantizations per layer) */
        const int qtasks = M >= 16 ? EL_MIN(M / 8, 4 * threads) : 1;
        qc.rows_per_task = (M + qtasks - 1) / qtasks;
        el_parallel_for(qtasks > 1 ? pool : NULL, (M + qc.rows_per_task - 1) / qc.rows_per_task, el_quant_task, &qc);
    }

    if (M == 1) {
        /* GEMV: memory-bound; chunks of W rows only. About 8 chunks per thread balance the
         * threads' different speeds (big.LITTLE) while keeping each chunk >= 16 rows long. */
#if EL_SIMDE && defined(__AVX2__)
        /* x86: whole 8-row tiles, ~8 chunks per thread, each thread's a contiguous range
         * (el_parallel_ranges). Claimed in index order, each chunk started cold (its first tile
         * waits on DRAM, see el_qrows_gemv) and 8 per thread took 20-30% longer than 2; with 2,
         * a thread starting late left the other 3 of 4 chunks. */
        c.rw = EL_MAX(16, EL_MIN(256, (c.N / (8 * threads)) & ~7));
#else
        c.rw = EL_MAX(16, EL_MIN(256, el_round4(c.N / (8 * threads))));
#endif
        c.cx = 1;
    } else {
        /* GEMM: a task's x rows (cx x K int8 or fp32) and W rows should stay in L2 while its
         * tiles sweep them: ~128 KiB of x per task, 64 W rows. */
        /* (fp32 x against block weights, matmul_bqpanel.c: a task's x is read a slice of
         * EL_BQP_KC k at a time, so its rows take that much of L2 each, not K) */
        const size_t x_row_bytes = quantized ? (size_t)K : c.panel ? (size_t)EL_MIN(K, EL_BQP_KC) * 4 : (size_t)K * 4;
        size_t x_bytes = 131072;
#if EL_SIMDE && defined(__AVX2__)
        /* the x86 GEMM tile repacks each 16 W rows once per task: at large K, 128 KiB left it
         * ~16 x rows to amortize that over (-15% at K = 8192, Q4_1); 512 KiB measured the same
         * as 128 KiB at K = 1536 (cx 128 instead of 84) */
        if (quantized) x_bytes = 524288;
#endif
        c.cx = (int)EL_MAX(4, EL_MIN(128, (x_bytes / x_row_bytes) & ~(size_t)3));
        if (c.cx >= M) c.cx = M;
        c.rw = 64;
        int min_tasks = 4 * threads;
#if EL_SIMDE && defined(__AVX2__)
        /* the x86 GEMM tile repacks per 16-row panel, not per task, and rereads x per panel, so
         * smaller W chunks cost it only more first panels, whose prefetch no tile hides; 4 per
         * thread left 9 tasks for 2 threads at N = 576 (one thread ran 5) and 15 at N = 960 */
        if (quantized) min_tasks = 8 * threads;
#endif
        /* small N or M: shrink the W chunk so every thread still gets work */
        const int xchunks = el_x_chunks(M, c.cx);
        while (c.rw > 16 && (long long)xchunks * ((c.N + c.rw - 1) / c.rw) < min_tasks) c.rw /= 2;
    }
    for (int s = 0; s < n_seg; s++) c.n_wchunks += (seg_rows[s] + c.rw - 1) / c.rw;
#if EL_SIMDE && defined(__AVX2__)
    /* a GEMM whose x rows are one chunk (M <= cx: a chat turn's short prefill) walks its W
     * chunks as the GEMV does, each thread a contiguous range: claimed in index order, the two
     * threads alternated chunks and each chunk's first panel came cold from DRAM. Zen 5, Q4_1
     * weights streaming from DRAM, M = 32: 576 x 576 350-360 -> 383-393 GFLOPS, 3072 x 576
     * 444-465 -> 483-505; M = 128 +1-3%; a cached 400-token prefix + 32-token turn 2-4% faster */
    const int one_x_chunk = quantized && c.cx >= M;
    if ((M == 1 || one_x_chunk) && !c.generic) {
        el_parallel_ranges(pool, c.n_wchunks, el_mm_item, &c);
        free(owned);
        return EL_OK;
    }
#endif
    const long long n_tasks = (long long)c.n_wchunks * el_x_chunks(M, c.cx);
    if (n_tasks > INT_MAX) {
        free(owned);
        return EL_EINVAL;
    }
    el_parallel_for(pool, (int)n_tasks, el_mm_task, &c);
    free(owned);
    return EL_OK;
}

int el_matmul(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
              const float *x, float *y, int M, int K, const float *bias, void *scratch) {
    return el_matmul_run(pool, wtype, seg_ptr, seg_rows, n_seg, x, y, M, K, bias, scratch, 0, NULL);
}

void el_quant_row_xq(const float *x, void *xq, int M, int K, int r) {
    const int nb = K / QK;
    const el_xq L = el_xq_layout(xq, M, nb);
    int8_t *q = L.q + (size_t)r * nb * QK;
    float *d = L.d + (size_t)r * nb, *s = L.s + (size_t)r * nb;
    if (el_generic_flag) el_quant_row_generic(x, q, d, s, nb);
#if EL_SIMDE && defined(__AVX2__)
    else el_quant_row_avx2(x, q, d, s, nb);
#else
    else el_quant_row_neon(x, q, d, s, nb);
#endif
}

int el_matmul_xq(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                 const void *xq, int M, int row0, int rows, int K, float *y, const float *bias) {
    if (!xq || K <= 0 || K % QK || row0 < 0 || rows <= 0 || row0 > M - rows) return EL_EINVAL;
    const int nb = K / QK;
    el_xq v = el_xq_layout((void *)xq, M, nb);
    v.q += (size_t)row0 * nb * QK;
    v.d += (size_t)row0 * nb;
    v.s += (size_t)row0 * nb;
    return el_matmul_run(pool, wtype, seg_ptr, seg_rows, n_seg, NULL, y, rows, K, bias, NULL, 0, &v);
}

int el_matmul_f32act(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                     const float *x, float *y, int M, int K, const float *bias) {
    return el_matmul_run(pool, wtype, seg_ptr, seg_rows, n_seg, x, y, M, K, bias, NULL, 1, NULL);
}

int el_x86_gemv(int set) {
#if defined(EL_X5_GEMV)
    if (set >= 0) __atomic_store_n(&el_x86_wide_gemv, set & 3, __ATOMIC_RELAXED);
    return __atomic_load_n(&el_x86_wide_gemv, __ATOMIC_RELAXED);
#else
    (void)set;
    return -1;
#endif
}
