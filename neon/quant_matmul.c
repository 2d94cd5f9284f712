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
 * (M > 1) on their own tile instead, from weights repacked per task (el_g_gemm_avx2), and Q4 GEMVs
 * on an 8-row, 2-block tile (el_qgemv8_q4_avx2), or with AVX-512 VNNI + VBMI on 4 rows of 4-block
 * registers (qgemv_avx512.h).
 */
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "el_common.h"

/* matmul_float.c: rows [0, rows) of an F32 / F16 weight chunk against nx rows of x (K floats
 * each), y rows ldy apart, bias already offset to the chunk. (Internal: hidden by
 * -fvisibility=hidden; the only caller is el_mm_task below.) */
void el_matmul_float_rows(int wtype, int generic, const uint8_t *w, int rows, const float *x, int nx, int K,
                          float *y, size_t ldy, const float *bias);
/* matmul_float.c: the same for block weights (Q4_0, Q4_1, Q8_0, rows rb bytes apart) against
 * fp32 x (el_matmul_f32act). */
void el_matmul_f32act_rows(int wtype, int generic, const uint8_t *w, size_t rb, int rows, const float *x, int nx,
                           int K, float *y, size_t ldy, const float *bias);

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
    return xq;
}

/* ---- x -> int8 blocks ---------------------------------------------------------------------- */
/* Both twins compute d, 1/d and the rounding identically (nearest even: vcvtnq / nearbyintf in
 * the default rounding mode), so they produce the same int8 blocks bit for bit; test differences
 * between the twins then come from the kernels alone. */
static void el_quant_row_generic(const float *x, int8_t *q, float *d, float *s, int nb) {
    for (int b = 0; b < nb; b++, x += QK, q += QK) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = EL_MAX(amax, __builtin_fabsf(x[i]));
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            float v = __builtin_nearbyintf(x[i] * id);
            v = v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v);   /* NaN falls through to 0 below */
            int qi = v == v ? (int)v : 0;
            q[i] = (int8_t)qi;
            sum += qi;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

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

#if EL_SIMDE && defined(__AVX2__)
/* x86 AVX2: even with the shims above a GEMV ran at ~1/3 of DRAM bandwidth, so this tile gets
 * the same int32 block sums from llama.cpp's x86 scheme: one 32-byte VPMADDUBSW per row and block
 * (u8 x s8 -> s16 pair sums), then VPMADDWD by 1. The sums are exact and the fp32 scaling below
 * is the NEON tile's own code, so results are bit-identical to it.
 * Q4: the nibbles 0..15 are the unsigned operand. Q8_0: |w| = VPSIGNB(w, w) is (-128 reads as
 * 128), and x takes w's sign; pair sums <= 2 * 128 * 127 < 32767, so VPMADDUBSW never saturates.
 * Negating x cannot wrap: its scale keeps |q_x| <= 127 for finite x. */
static inline __m256i el_dot32_avx2(const int wt, __m256i w, __m256i x) {
    const __m256i p = wt == EL_Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                    : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline int el_ld32(const uint8_t *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4 only: s16 lanes of 4 rows' VPMADDUBSW results -> int32 lane r of each 128-bit half = row r's
 * total over that half (el_sum4_q4_avx2 adds the halves). The tree adds 4 s16 lanes into one:
 * with 2 products per input lane (the 4-row tile) that is 8 * 15 * 128, with 4 (the GEMV tile,
 * which adds its two nibble halves first) 16 * 15 * 128 = 30720, both < 32767, so the int16 adds
 * are exact and one VPMADDWD finishes all 4 rows (Q8_0's sums would overflow int16). Shifts and
 * blends, not VPHADD: a few % faster for Q4 on Zen 3, where VPHADDD stayed ~5% faster for Q8_0. */
static inline __m256i el_sum4_q4_halves_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i q01 = _mm256_add_epi16(_mm256_blend_epi32(p0, _mm256_slli_epi64(p1, 32), 0xAA),
                                         _mm256_blend_epi32(_mm256_srli_epi64(p0, 32), p1, 0xAA));
    const __m256i q23 = _mm256_add_epi16(_mm256_blend_epi32(p2, _mm256_slli_epi64(p3, 32), 0xAA),
                                         _mm256_blend_epi32(_mm256_srli_epi64(p2, 32), p3, 0xAA));
    return _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_blend_epi32(q01, q23, 0xCC),
                         _mm256_shuffle_epi32(_mm256_blend_epi32(q23, q01, 0xCC), 0x4E)),
        _mm256_set1_epi16(1));
}

static inline __m128i el_sum4_q4_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i r = el_sum4_q4_halves_avx2(p0, p1, p2, p3);
    return _mm_add_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* x86 GEMV, Q4: 8 rows x 2 blocks per step. The 4-row tile above ran a Q4_1 GEMV at ~14 GB/s
 * per thread with the weights in cache, under the ~26 GB/s of DRAM for 2 threads: ~17 instructions
 * per row and block, a quarter of them folding 4 rows' lanes (el_sum4_q4_avx2). Here one register
 * holds a row's blocks b (low half) and b + 1 (high half), so the same fold yields 8 row-block
 * sums instead of 4, and the fp32 scaling runs 8 rows wide: ~10 instructions per row and block,
 * 1.3-1.5x the 4-row tile's speed from cache. The arithmetic per row is unchanged: exact int32
 * block sums, then for b, then b + 1, the same FMA by d_w d_x (the product rounded first) and
 * the same FMA by m_w s_x, so results are bit-identical to the 4-row tile.
 * Prefetch: one linear stream through the 8 rows' bytes, 8 rows (one step of tiles) ahead; the
 * per-row streams EL_PF_BYTES ahead that the 4-row tile uses made this faster tile 10-30% slower
 * than the 4-row tile on DRAM-resident weights (at K = 1536 the 8 rows span 7.5 KiB, so a row's
 * prefetch 4 KiB ahead landed in the same tile, just before its use), the linear stream 10-20%
 * faster. step: blocks b and b + 1 (two = 0: block b alone, the odd tail). */
static inline __attribute__((always_inline)) __m256
el_qgemv8_step(const int wt, const int two, const uint8_t *const w[8], size_t pfd, int b, const int8_t *xq,
               const float *xd, const float *xs, __m256 acc) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt), b1 = two ? bs : 0;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i dm_order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const uint8_t *blk[8];
    for (int r = 0; r < 8; r++) blk[r] = w[r] + (size_t)b * bs;
    for (int j = 0; j < 8 * 2 * bs; j += 64) __builtin_prefetch(w[0] + pfd + (size_t)b * 8 * bs + j);
    const int8_t *xb = xq + (size_t)b * QK;
    const int xo = two ? QK : 0;
    const __m256i xl = _mm256_loadu2_m128i((const __m128i *)(xb + xo), (const __m128i *)xb);
    const __m256i xh = _mm256_loadu2_m128i((const __m128i *)(xb + xo + 16), (const __m128i *)(xb + 16));
    __m256i p[8];
    for (int r = 0; r < 8; r++) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i *)(blk[r] + b1 + off), (const __m128i *)(blk[r] + off));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        p[r] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    }
    const __m256i s03 = el_sum4_q4_halves_avx2(p[0], p[1], p[2], p[3]);
    const __m256i s47 = el_sum4_q4_halves_avx2(p[4], p[5], p[6], p[7]);
    /* lanes: s03 = rows 0..3 of block b | of b + 1, s47 rows 4..7 */
    for (int k = 0; k <= two; k++) {
        const int o = k ? bs : 0;
        /* the 8 blocks' first 4 bytes (d, then m or 2 quants) -> d of rows 0..7 | m of rows 0..7 */
        const __m256i h = _mm256_setr_epi32(el_ld32(blk[0] + o), el_ld32(blk[1] + o), el_ld32(blk[2] + o),
                                            el_ld32(blk[3] + o), el_ld32(blk[4] + o), el_ld32(blk[5] + o),
                                            el_ld32(blk[6] + o), el_ld32(blk[7] + o));
        const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, dm_order), 0xD8);
        const __m256 dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
        const __m256 mw = wt == EL_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1))
                                        : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
        const __m256 t = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(s03, s47, k ? 0x31 : 0x20));
        acc = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + b + k)), acc);
        acc = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs + b + k), acc);
    }
    return acc;
}

/* 8 rows (w[r] = row r's first block; rows past the matrix repeat the last real one and are
 * never stored), pfd: prefetch distance, lane r of the result = row r */
static inline __attribute__((always_inline)) __m256
el_qgemv8_q4_avx2(const int wt, const uint8_t *const w[8], size_t pfd, const int8_t *xq, const float *xd,
                  const float *xs, int nb) {
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) acc = el_qgemv8_step(wt, 1, w, pfd, b, xq, xd, xs, acc);
    if (b < nb) acc = el_qgemv8_step(wt, 0, w, pfd, b, xq, xd, xs, acc);
    return acc;
}

/* int32 lanes of p0..p3 summed per row -> lane r = row r's total */
static inline __m128i el_sum4_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

static inline __attribute__((always_inline)) void
el_qtile_avx2(const int wt, const int nx, const uint8_t *const w[4], const int8_t *xq, const float *xd,
              const float *xs, int nb, float32x4_t acc[4]) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    const __m256i m4 = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    for (int c = 0; c < nx; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        __m256i wv[4];
        const uint8_t *blk4[4];
        for (int r = 0; r < 4; r++) blk4[r] = w[r] + (size_t)b * bs;
        if (nx == 1)
            for (int r = 0; r < 4; r++) __builtin_prefetch(blk4[r] + EL_PF_BYTES);
        /* the 4 blocks' first 4 bytes (d, then m or 2 quants) -> d of rows 0..3 | m of rows 0..3:
         * one F16C conversion, and 4 loads instead of 8 word inserts */
        const __m128i dm16 = _mm_shuffle_epi8(
            _mm_setr_epi32(el_ld32(blk4[0]), el_ld32(blk4[1]), el_ld32(blk4[2]), el_ld32(blk4[3])),
            _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        const __m256 dm = _mm256_cvtph_ps(dm16);
        const float32x4_t dw = simde_float32x4_from_m128(_mm256_castps256_ps128(dm));
        const float32x4_t mw = wt == EL_Q4_1 ? simde_float32x4_from_m128(_mm256_extractf128_ps(dm, 1))
                                             : vmulq_n_f32(dw, -8.0f);
        for (int r = 0; r < 4; r++) {
            if (wt == EL_Q8_0) {
                wv[r] = _mm256_loadu_si256((const __m256i *)(blk4[r] + off));
            } else {   /* low 128 bits: low nibbles (x[0..15]); high: high nibbles (x[16..31]) */
                const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk4[r] + off)));
                wv[r] = _mm256_and_si256(_mm256_srlv_epi64(v, nib_shift), m4);
            }
        }
        for (int c = 0; c < nx; c++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + ((size_t)c * nb + b) * QK));
            /* lane r of the result = row r's block total, as vpaddq gives on the NEON tile */
            const int32x4_t t = simde_int32x4_from_m128i(
                wt == EL_Q8_0 ? el_sum4_avx2(el_dot32_avx2(wt, wv[0], x), el_dot32_avx2(wt, wv[1], x),
                                             el_dot32_avx2(wt, wv[2], x), el_dot32_avx2(wt, wv[3], x))
                              : el_sum4_q4_avx2(_mm256_maddubs_epi16(wv[0], x), _mm256_maddubs_epi16(wv[1], x),
                                                _mm256_maddubs_epi16(wv[2], x), _mm256_maddubs_epi16(wv[3], x)));
            acc[c] = vfmaq_f32(acc[c], vcvtq_f32_s32(t), vmulq_n_f32(dw, xd[(size_t)c * nb + b]));
            if (wt != EL_Q8_0) acc[c] = vfmaq_f32(acc[c], mw, vdupq_n_f32(xs[(size_t)c * nb + b]));
        }
    }
}
#endif

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

/* ---- x86 AVX2 GEMM tile (M > 1) -------------------------------------------------------------- */
/* The 4-row tile above spends most of its instructions folding each row's VPMADDUBSW lanes into
 * one int32 (el_sum4_q4_avx2: ~17 shuffles, blends and adds per x row and block) and scaling 4
 * fp32 lanes of an 8-lane machine. For a GEMM the weights are reused by every x row, so they are
 * worth rearranging once per task: 8 rows (Q4: unpacked to bytes 0..15) are interleaved so that
 * dword j of row r sits in lane r of register j (el_g_repack8). x's dword j, broadcast from
 * memory, then feeds one VPMADDUBSW that serves all 8 rows, Q4's products add up in int16 across
 * the whole block with plain VPADDW, and one VPMADDWD leaves row r's block sum in int32 lane r:
 * no horizontal reduction at all, and the fp32 scaling runs 8 rows wide.
 * int16 bound: a lane holds 8 pair sums of 2 products each, 16 * 15 * 128 = 30720 < 32767, so
 * the int32 block sums are exact (Q8_0: see el_g_tile_avx2); the fp32 scaling is the 4-row tile's
 * own sequence (one FMA by d_w d_x, then Q4's one by m_w s_x): results are bit-identical to it.
 * Zen 3, one thread, SmolLM2-135M's shapes at M = 256: Q4_1 2.4-2.6x the 4-row tile (with
 * el_quant_row_avx2), already 1.2x at M = 2; Q8_0 1.5x. The GEMV does not repack: there each
 * weight is used once and repacking would only add traffic (Q4: el_qgemv8_q4_avx2). */
#if EL_SIMDE && defined(__AVX2__)
#define EL_G_ROWS 8
/* a repacked block of 8 rows: 8 registers of 8 rows x 4 bytes, then d of the 8 rows, then m */
#define EL_G_QBYTES (EL_G_ROWS * QK)
#define EL_G_BLOCK (EL_G_QBYTES + 2 * EL_G_ROWS * (int)sizeof(float))
/* repack buffers (16 rows) up to this size live on the stack: K <= 2048 */
#define EL_G_STACK (2 * 64 * EL_G_BLOCK)
/* x rows in a task from which the repack pays off (1.2x the 4-row tile at 2) */
#define EL_G_MIN_NX 2

/* nb blocks of 8 rows (w[r] = row r's first block) -> out, block b at out + b * stride */
static inline __attribute__((always_inline)) void el_g_repack8(const int wt, const uint8_t *const w[8], int nb,
                                                               uint8_t *out, size_t stride) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    const __m256i m4 = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    const __m128i dm_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int b = 0; b < nb; b++, out += stride) {
        __m256i u[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t *qs = w[r] + (size_t)b * bs + off;
            if (wt == EL_Q8_0) {
                u[r] = _mm256_loadu_si256((const __m256i *)qs);
            } else {   /* bytes 0..15: low nibbles, 16..31: high (x's order) */
                const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
                u[r] = _mm256_and_si256(_mm256_srlv_epi64(v, nib_shift), m4);
            }
        }
        /* 8 x 8 dword transpose: per 128-bit half, s[h + j] holds dword j (half 0) or j + 4
         * (half 1) of rows h..h+3; the permutes then gather rows 0..7 of one dword */
        __m256i s[8];
        for (int h = 0; h < 8; h += 4) {
            const __m256i t0 = _mm256_unpacklo_epi32(u[h], u[h + 1]), t1 = _mm256_unpackhi_epi32(u[h], u[h + 1]);
            const __m256i t2 = _mm256_unpacklo_epi32(u[h + 2], u[h + 3]),
                          t3 = _mm256_unpackhi_epi32(u[h + 2], u[h + 3]);
            s[h] = _mm256_unpacklo_epi64(t0, t2);
            s[h + 1] = _mm256_unpackhi_epi64(t0, t2);
            s[h + 2] = _mm256_unpacklo_epi64(t1, t3);
            s[h + 3] = _mm256_unpackhi_epi64(t1, t3);
        }
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_si256((__m256i *)(out + 32 * j), _mm256_permute2x128_si256(s[j], s[j + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(out + 32 * (j + 4)), _mm256_permute2x128_si256(s[j], s[j + 4], 0x31));
        }
        /* each block's first 4 bytes: d, then m (Q4_1) or 2 quant bytes (Q4_0, Q8_0: unused) */
        __m128i dm[2];
        for (int h = 0; h < 2; h++) {
            const uint8_t *const *wh = w + 4 * h;
            dm[h] = _mm_shuffle_epi8(_mm_setr_epi32(el_ld32(wh[0] + (size_t)b * bs), el_ld32(wh[1] + (size_t)b * bs),
                                                    el_ld32(wh[2] + (size_t)b * bs), el_ld32(wh[3] + (size_t)b * bs)),
                                     dm_order);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_unpacklo_epi64(dm[0], dm[1]));
        const __m256 m = wt == EL_Q4_1 ? _mm256_cvtph_ps(_mm_unpackhi_epi64(dm[0], dm[1]))
                                       : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        _mm256_storeu_ps((float *)(out + EL_G_QBYTES), d);
        _mm256_storeu_ps((float *)(out + EL_G_QBYTES) + EL_G_ROWS, m);
    }
}

/* Q8_0 with VPDPBUSD (AVX-VNNI, or AVX512-VNNI on 256-bit registers): |w| x (x signed like w)
 * summed in fours straight into int32 lanes, one instruction for VPMADDUBSW + VPMADDWD + VPADDD;
 * the int32 block sums are the same exact integers, so results stay bit-identical. Each
 * accumulator runs two 4-long chains (even, odd dwords). Zen 5, 2 threads, Q8_0 3072 x 576 and
 * 576 x 1536 at M = 256: 345-350 -> 440-455 GFLOPS (M = 32: 320-330 -> 395-415). Q4 keeps
 * VPMADDUBSW: its int16 sums need one VPMADDWD per block only, and with VPDPBUSD in the shared
 * tile its GEMM went 545-565 -> 485-490. */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define EL_G_VNNI 1
static inline __m256i el_dpbusd256(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}

static inline __attribute__((always_inline)) void el_g_tile_q8_vnni(const int ng, const int nx, const uint8_t *wp,
                                                                    const int8_t *xq, const float *xd, int nb,
                                                                    __m256 acc[4]) {
    for (int i = 0; i < ng * nx; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, wp += ng * EL_G_BLOCK) {
        __m256i s[2][4];
        for (int j = 0; j < 8; j++) {
            __m256i w[2], wa[2];
            for (int g = 0; g < ng; g++) {
                w[g] = _mm256_loadu_si256((const __m256i *)(wp + g * EL_G_BLOCK + 32 * j));
                wa[g] = _mm256_sign_epi8(w[g], w[g]);
            }
            for (int c = 0; c < nx; c++) {
                const __m256i x = _mm256_set1_epi32(el_ld32((const uint8_t *)xq + ((size_t)c * nb + b) * QK + 4 * j));
                for (int g = 0; g < ng; g++) {
                    __m256i *si = &s[j & 1][g * nx + c];
                    *si = el_dpbusd256(j > 1 ? *si : _mm256_setzero_si256(), wa[g], _mm256_sign_epi8(x, w[g]));
                }
            }
        }
        for (int g = 0; g < ng; g++) {
            const __m256 dw = _mm256_loadu_ps((const float *)(wp + g * EL_G_BLOCK + EL_G_QBYTES));
            for (int c = 0; c < nx; c++) {
                const int i = g * nx + c;
                const __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(s[0][i], s[1][i]));
                acc[i] = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(size_t)c * nb + b])), acc[i]);
            }
        }
    }
}
#endif

/* ng (1, 2) groups of 8 repacked rows, their blocks interleaved (group g of block b at
 * wp + (b * ng + g) * EL_G_BLOCK), x nx x rows: acc[g * nx + c] lane r = y[c][row 8g + r]. Every
 * x broadcast feeds ng VPMADDUBSW: 16 x 2 needs 16 broadcasts per block where 8 x 4 needs 32,
 * and the FP pipes, not the multiplier, were the limit (~5% faster at M = 256).
 * Q8_0: signed weights take el_dot32_avx2's sign trick, VPMADDUBSW(|w|, x signed like w); its pair
 * sums (<= 2 * 128 * 127) leave no int16 headroom, so each goes to int32 (VPMADDWD) at once. */
static inline __attribute__((always_inline)) void el_g_tile_avx2(const int wt, const int ng, const int nx,
                                                                 const uint8_t *wp, const int8_t *xq, const float *xd,
                                                                 const float *xs, int nb, __m256 acc[4]) {
#if defined(EL_G_VNNI)
    if (wt == EL_Q8_0) {
        el_g_tile_q8_vnni(ng, nx, wp, xq, xd, nb, acc);
        return;
    }
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < ng * nx; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, wp += ng * EL_G_BLOCK) {
        __m256i s[4];
        for (int j = 0; j < 8; j++) {
            __m256i w[2], wa[2];
            for (int g = 0; g < ng; g++) {
                w[g] = _mm256_loadu_si256((const __m256i *)(wp + g * EL_G_BLOCK + 32 * j));
                if (wt == EL_Q8_0) wa[g] = _mm256_sign_epi8(w[g], w[g]);
            }
            for (int c = 0; c < nx; c++) {
                const __m256i x = _mm256_set1_epi32(el_ld32((const uint8_t *)xq + ((size_t)c * nb + b) * QK + 4 * j));
                for (int g = 0; g < ng; g++) {
                    const int i = g * nx + c;
                    if (wt == EL_Q8_0) {
                        const __m256i p =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(x, w[g])), ones);
                        s[i] = j ? _mm256_add_epi32(s[i], p) : p;
                    } else {
                        const __m256i p = _mm256_maddubs_epi16(w[g], x);
                        s[i] = j ? _mm256_add_epi16(s[i], p) : p;
                    }
                    /* an empty asm pins the add chain: otherwise gcc 12 rebalances the 8 adds
                     * into a tree, hoists all the VPMADDUBSW and spills them (-25% at M = 256);
                     * a rolled j loop instead is front-end bound (-15%) */
                    __asm__("" : "+x"(s[i]));
                }
            }
        }
        for (int g = 0; g < ng; g++) {
            const float *sc = (const float *)(wp + g * EL_G_BLOCK + EL_G_QBYTES);
            const __m256 dw = _mm256_loadu_ps(sc);
            for (int c = 0; c < nx; c++) {
                const int i = g * nx + c;
                const __m256 t = _mm256_cvtepi32_ps(wt == EL_Q8_0 ? s[i] : _mm256_madd_epi16(s[i], ones));
                acc[i] = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(size_t)c * nb + b])), acc[i]);
                if (wt != EL_Q8_0)
                    acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(sc + EL_G_ROWS), _mm256_set1_ps(xs[(size_t)c * nb + b]),
                                             acc[i]);
            }
        }
    }
}

/* acc[c] lanes 0..nr-1 (+ bias) -> y row c */
static inline void el_store_tile8(const __m256 *acc, int nx, int nr, float *y, size_t ldy, const float *bias) {
    __m256 bv = _mm256_setzero_ps();
    if (bias) {
        float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tmp, bias, (size_t)nr * sizeof(float));
        bv = _mm256_loadu_ps(tmp);
    }
    for (int c = 0; c < nx; c++) {
        const __m256 v = _mm256_add_ps(acc[c], bv);
        if (nr == 8) {
            _mm256_storeu_ps(y + c * ldy, v);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, v);
            memcpy(y + c * ldy, tmp, (size_t)nr * sizeof(float));
        }
    }
}

/* One panel of ng * 8 rows (nr real) against all nx_all x rows: 8 x 4 tiles for a single group,
 * 16 x 2 for two. pf, pf_bytes: the next panel's weights, prefetched a share before each tile. */
static inline __attribute__((always_inline)) void el_g_panel_avx2(const int wt, const int ng, const uint8_t *buf,
                                                                  int nr, const el_xq *xq, int x0, int nx_all,
                                                                  float *y, size_t ldy, const float *bias,
                                                                  const uint8_t *pf, size_t pf_bytes) {
    const int nb = xq->nb, cmax = ng == 1 ? 4 : 2;
    const int tiles = (nx_all + cmax - 1) / cmax;
    const size_t pf_step = (pf_bytes / 64 + (size_t)tiles) / (size_t)tiles * 64;   /* bytes per tile */
    for (int c0 = 0; c0 < nx_all; c0 += cmax) {
        const int nx = EL_MIN(cmax, nx_all - c0);
        for (size_t o = 0; o < pf_step && o < pf_bytes; o += 64) __builtin_prefetch(pf + o);
        if (pf_bytes > pf_step) pf += pf_step, pf_bytes -= pf_step;
        else pf_bytes = 0;
        const size_t xr = (size_t)(x0 + c0);
        const int8_t *q = xq->q + xr * nb * QK;
        const float *d = xq->d + xr * nb, *s = xq->s + xr * nb;
        __m256 acc[4];
        float *yt = y + (size_t)c0 * ldy;
        switch (ng * 8 + nx) {
        case 9: el_g_tile_avx2(wt, 1, 1, buf, q, d, s, nb, acc); break;
        case 10: el_g_tile_avx2(wt, 1, 2, buf, q, d, s, nb, acc); break;
        case 11: el_g_tile_avx2(wt, 1, 3, buf, q, d, s, nb, acc); break;
        case 12: el_g_tile_avx2(wt, 1, 4, buf, q, d, s, nb, acc); break;
        case 17: el_g_tile_avx2(wt, 2, 1, buf, q, d, s, nb, acc); break;
        default: el_g_tile_avx2(wt, 2, 2, buf, q, d, s, nb, acc); break;
        }
        for (int g = 0; g < ng && 8 * g < nr; g++)
            el_store_tile8(acc + g * nx, nx, EL_MIN(8, nr - 8 * g), yt + 8 * g, ldy, bias ? bias + 8 * g : NULL);
    }
}

/* noinline: keeps the repack buffer out of the GEMV's stack frame (its code shares the caller) */
static __attribute__((noinline)) int el_g_gemm_avx2(const int wt, const uint8_t *w, size_t rb, int rows,
                                                    const el_xq *xq, int x0, int nx_all, float *y, size_t ldy,
                                                    const float *bias) {
    const int nb = xq->nb;
    _Alignas(64) uint8_t stack_buf[EL_G_STACK];
    uint8_t *buf = stack_buf, *owned = NULL;
    if ((size_t)nb * 2 * EL_G_BLOCK > sizeof stack_buf) {
        buf = owned = (uint8_t *)malloc((size_t)nb * 2 * EL_G_BLOCK);
        if (!owned) return 0;   /* the caller runs the 4-row tiles instead */
    }
    /* The repack's loads were the tile's stall at small M: a panel's weights (16 rows, 5.6 KiB at
     * K = 576) come from L3 or DRAM, and its 8 row streams kept few misses in flight (~20% of the
     * GEMM's cycles at M = 32, ~2% at M = 256). The first panel is prefetched all at once; each
     * next one a share per tile while the tiles of the current one run. */
    for (size_t o = 0; o < (size_t)EL_MIN(rows, 2 * EL_G_ROWS) * rb; o += 64) __builtin_prefetch(w + o);
    for (int r0 = 0; r0 < rows;) {
        /* 16-row panels; a last 1..8 rows take one group (9..15 pad the second group) */
        const int ng = rows - r0 > EL_G_ROWS ? 2 : 1, nr = EL_MIN(ng * EL_G_ROWS, rows - r0);
        const uint8_t *pf = w + (size_t)(r0 + nr) * rb;
        const size_t pf_bytes = (size_t)EL_MIN(rows - r0 - nr, 2 * EL_G_ROWS) * rb;
        for (int g = 0; g < ng; g++) {
            const uint8_t *wr[EL_G_ROWS];
            for (int r = 0; r < EL_G_ROWS; r++)
                wr[r] = w + (size_t)(r0 + EL_MIN(g * EL_G_ROWS + r, nr - 1)) * rb;
            el_g_repack8(wt, wr, nb, buf + g * EL_G_BLOCK, (size_t)ng * EL_G_BLOCK);
        }
        float *yr = y + r0;
        const float *br = bias ? bias + r0 : NULL;
        if (ng == 1) el_g_panel_avx2(wt, 1, buf, nr, xq, x0, nx_all, yr, ldy, br, pf, pf_bytes);
        else el_g_panel_avx2(wt, 2, buf, nr, xq, x0, nx_all, yr, ldy, br, pf, pf_bytes);
        r0 += nr;
    }
    free(owned);
    return 1;
}
#endif

#include "qgemv_avx512.h"

/* 1: the AVX2 GEMM tile computed these rows; 0: run the portable tiles */
static inline __attribute__((always_inline)) int el_qrows_gemm(const int wt, const uint8_t *w, size_t rb, int rows,
                                                               const el_xq *xq, int x0, int nx_all, float *y,
                                                               size_t ldy, const float *bias) {
#if EL_SIMDE && defined(__AVX2__)
    if (nx_all >= EL_G_MIN_NX) return el_g_gemm_avx2(wt, w, rb, rows, xq, x0, nx_all, y, ldy, bias);
#endif
    (void)wt, (void)w, (void)rb, (void)rows, (void)xq, (void)x0, (void)nx_all, (void)y, (void)ldy, (void)bias;
    return 0;
}

/* 1: the AVX-512 or AVX2 GEMV tile (Q4, one x row) computed these rows; 0: run the portable tiles */
static inline __attribute__((always_inline)) int el_qrows_gemv(const int wt, const uint8_t *w, size_t rb, int rows,
                                                               const el_xq *xq, int x0, int nx_all, float *y,
                                                               const float *bias) {
#if defined(EL_X5_GEMV)
    if (nx_all == 1 && wt != EL_Q8_0 && xq->nb <= EL_X5_MAX_NB) {
        const int nb = xq->nb;
        el_qgemv_q4_avx512(wt, w, rb, rows, xq->q + (size_t)x0 * nb * QK, xq->d + (size_t)x0 * nb,
                           xq->s + (size_t)x0 * nb, nb, y, bias);
        return 1;
    }
#endif
#if EL_SIMDE && defined(__AVX2__)
    if (nx_all == 1 && wt != EL_Q8_0) {
        const int nb = xq->nb;
        const int8_t *q = xq->q + (size_t)x0 * nb * QK;
        const float *d = xq->d + (size_t)x0 * nb, *s = xq->s + (size_t)x0 * nb;
        const size_t pfd = 8 * rb;
        /* the chunk's first tile: nothing ran ahead of it (the other thread works elsewhere) */
        for (size_t o = 0; o < EL_MIN(pfd, (size_t)rows * rb); o += 64) __builtin_prefetch(w + o);
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
    (void)wt, (void)w, (void)rb, (void)rows, (void)xq, (void)x0, (void)nx_all, (void)y, (void)bias;
    return 0;
}

#define EL_QROWS_FN(name, wt)                                                                         \
    static void name(const uint8_t *w, size_t rb, int rows, const el_xq *xq, int x0, int nx_all,    \
                     float *y, size_t ldy, const float *bias) {                                       \
        const int nb = xq->nb;                                                                        \
        if (el_qrows_gemm(wt, w, rb, rows, xq, x0, nx_all, y, ldy, bias)) return;                     \
        if (el_qrows_gemv(wt, w, rb, rows, xq, x0, nx_all, y, bias)) return;                          \
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
/* x86 el_matmul_f32act GEMV, Q8_0 (the lm_head, 49152 x 576, 30 MB a token). matmul_float.c's
 * 4-row tile ran it at ~17 GB/s with 2 threads, instruction-bound: per row and block, besides the
 * widening and the FMAs, an extract + add and a quarter of 3 VHADDPS (4 rows' lanes to 4 sums).
 * Here 8 rows share each folding step (VPERM2F128 pairs two rows' halves, 3 VHADDPS sum 8 rows)
 * and one 8-lane FMA applies the scales, and the prefetch is one linear stream 8 rows ahead as in
 * el_qgemv8_q4_avx2: 0.73x the time (2 threads, Zen 3 guest). Per row the arithmetic is the 4-row
 * tile's own (el_bqtile_avx2): the same 8-lane chain of one multiply and 3 FMAs, its two halves
 * added, the same pairwise sums, one FMA by d: results are bit-identical to it. */
static void el_f32act_q8_gemv_avx2(const uint8_t *w, size_t rb, int rows, const float *x, int K, float *y,
                                   const float *bias) {
    const int nb = K / QK, bs = el_qblock_bytes(EL_Q8_0), off = el_qoff(EL_Q8_0);
    const size_t pfd = 8 * rb;
    for (size_t o = 0; o < EL_MIN(pfd, (size_t)rows * rb); o += 64) __builtin_prefetch(w + o);
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

static void el_mm_task(void *vctx, int task, int n_tasks) {
    (void)n_tasks;
    const el_mm_ctx *c = (const el_mm_ctx *)vctx;
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
    const int x0 = xi * c->cx, nx = EL_MIN(c->cx, c->M - x0);
    const uint8_t *w = (const uint8_t *)c->seg_ptr[s] + (size_t)r0 * c->row_bytes;
    const size_t ldy = (size_t)c->N;
    float *y = c->y + (size_t)x0 * ldy + col0 + r0;
    const float *bias = c->bias ? c->bias + col0 + r0 : NULL;

    if (c->wtype == EL_F32 || c->wtype == EL_F16) {
        el_matmul_float_rows(c->wtype, c->generic, w, rows, c->x + (size_t)x0 * c->K, nx, c->K, y, ldy, bias);
#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    } else if (c->f32act && !c->generic && c->wtype == EL_Q8_0 && nx == 1) {
        el_f32act_q8_gemv_avx2(w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, c->K, y, bias);
#endif
    } else if (c->f32act) {
        el_matmul_f32act_rows(c->wtype, c->generic, w, c->row_bytes, rows, c->x + (size_t)x0 * c->K, nx, c->K, y,
                              ldy, bias);
    } else if (c->generic) {
        el_qrows_generic(c->wtype, w, c->row_bytes, rows, &c->xq, x0, nx, y, ldy, bias);
    } else if (c->wtype == EL_Q4_0) {
        el_qrows_q4_0(w, c->row_bytes, rows, &c->xq, x0, nx, y, ldy, bias);
    } else if (c->wtype == EL_Q4_1) {
        el_qrows_q4_1(w, c->row_bytes, rows, &c->xq, x0, nx, y, ldy, bias);
    } else {
        el_qrows_q8_0(w, c->row_bytes, rows, &c->xq, x0, nx, y, ldy, bias);
    }
}

#if EL_SIMDE && defined(__AVX2__)
/* x86 AVX2 GEMV: each thread streams a contiguous range of W chunks and, when its range is
 * done, takes chunks from the others' ranges. Plain claiming in index order (el_parallel_for
 * over the chunks) interleaves the threads, so each thread's reads jump between rows and every
 * chunk starts a new DRAM stream; with few chunks (4 for a 576-row matrix on 2 threads), one
 * thread starting late left the other 3 of the 4. Here a range is one stream, cut in ~8 small
 * chunks per thread so that the end evens out to within one of them. */
#define EL_GEMV_RANGES 16
typedef struct {
    _Alignas(128) atomic_int next;   /* next chunk of this range to claim */
    int end;
} el_gemv_range;

typedef struct {
    const el_mm_ctx *c;
    int n_ranges;
    el_gemv_range r[EL_GEMV_RANGES];
} el_gemv_job;

static void el_gemv_range_task(void *vctx, int task, int n_tasks) {
    el_gemv_job *j = (el_gemv_job *)vctx;
    (void)n_tasks;
    for (int k = 0; k < j->n_ranges; k++) {     /* own range first, then the others' */
        el_gemv_range *r = &j->r[(task + k) % j->n_ranges];
        for (int i; (i = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed)) < r->end;)
            el_mm_task((void *)j->c, i, j->c->n_wchunks);
    }
}

/* 1: ran the GEMV's chunks as ranges; 0: the caller runs them with el_parallel_for */
static int el_gemv_ranges(el_pool *pool, const el_mm_ctx *c, int threads) {
    if (threads < 2 || threads > EL_GEMV_RANGES) return 0;
    el_gemv_job j;
    j.c = c;
    j.n_ranges = EL_MIN(threads, c->n_wchunks);
    for (int t = 0; t < j.n_ranges; t++) {
        atomic_init(&j.r[t].next, (int)((long long)c->n_wchunks * t / j.n_ranges));
        j.r[t].end = (int)((long long)c->n_wchunks * (t + 1) / j.n_ranges);
    }
    el_parallel_for(pool, j.n_ranges, el_gemv_range_task, &j);
    return 1;
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
                         const float *x, float *y, int M, int K, const float *bias, void *scratch, int f32act) {
    const int blocks = wtype == EL_Q4_0 || wtype == EL_Q4_1 || wtype == EL_Q8_0;
    const int quantized = blocks && !f32act;   /* x goes through int8 blocks in scratch */
    if (!blocks && wtype != EL_F32 && wtype != EL_F16) return EL_EUNSUPPORTED;
    if (!seg_ptr || !seg_rows || n_seg <= 0 || !x || !y || M <= 0 || K <= 0) return EL_EINVAL;
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
    if (quantized) {
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
         * (el_gemv_ranges). Claimed in index order, each chunk started cold (its first tile
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
        const size_t x_row_bytes = quantized ? (size_t)K : (size_t)K * 4;
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
        const int xchunks = (M + c.cx - 1) / c.cx;
        while (c.rw > 16 && (long long)xchunks * ((c.N + c.rw - 1) / c.rw) < min_tasks) c.rw /= 2;
    }
    for (int s = 0; s < n_seg; s++) c.n_wchunks += (seg_rows[s] + c.rw - 1) / c.rw;
#if EL_SIMDE && defined(__AVX2__)
    if (M == 1 && !c.generic && el_gemv_ranges(pool, &c, threads)) {
        free(owned);
        return EL_OK;
    }
#endif
    const long long n_tasks = (long long)c.n_wchunks * ((M + c.cx - 1) / c.cx);
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
    return el_matmul_run(pool, wtype, seg_ptr, seg_rows, n_seg, x, y, M, K, bias, scratch, 0);
}

int el_matmul_f32act(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                     const float *x, float *y, int M, int K, const float *bias) {
    return el_matmul_run(pool, wtype, seg_ptr, seg_rows, n_seg, x, y, M, K, bias, NULL, 1);
}
