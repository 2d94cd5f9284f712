/* The fp32-activation kernels of the matmul entry points (quant_matmul.c holds them and the task
 * grid; it calls el_matmul_float_rows and el_matmul_f32act_rows for one task's chunk).
 *
 * Dot-product form: W rows and x rows are both K-contiguous, so a register tile of 4 W rows x
 * up to 4 x rows keeps 16 fp32x4 accumulators along K and reduces them once at the end (no
 * packing pass over W, which is read straight from the model file). F16 weights are widened to
 * fp32 in registers (FCVTL, base Armv8.0) and accumulated in fp32: fp16 accumulation loses
 * precision over K in the thousands and can overflow (65504).
 *
 * Block weights (Q4_0, Q4_1, Q8_0) with fp32 x (el_matmul_f32act): the quants of each 32-weight
 * block are widened in registers (int8 -> int16 -> int32 -> fp32, exact) and FMA'd against x
 * unscaled; the block's fp16 scale is applied once to the 4 rows' block sums:
 *     Q8_0: d sum(q x)      Q4_0: d sum((q - 8) x)      Q4_1: d sum(q x) + m sum(x)
 * q and q - 8 are exact in fp32, so this differs from x @ dequantized(W)^T only in rounding
 * order (no int8 rounding of x as in el_matmul). Q4_1's m sum(x) is shared by the tile's rows.
 */
#include <string.h>

#include "el_common.h"

#define EL_PF_BYTES 4096      /* GEMV prefetch distance; measured in quant_matmul.c */

void el_matmul_float_rows(int wtype, int generic, const uint8_t *w, int rows, const float *x, int nx, int K,
                          float *y, size_t ldy, const float *bias);
void el_matmul_f32act_rows(int wtype, int generic, const uint8_t *w, size_t rb, int rows, const float *x, int nx,
                           int K, float *y, size_t ldy, const float *bias);

static inline float32x4_t el_load_w4(const int f16, const uint8_t *row, int k) {
    if (f16) return el_f16x4_load((const uint16_t *)row + k);
    return vld1q_f32((const float *)row + k);
}

static inline float el_load_w1(const int f16, const uint8_t *row, int k) {
    if (f16) {
        uint16_t h;
        memcpy(&h, row + 2 * (size_t)k, 2);
        return el_f16_to_f32(h);
    }
    float v;
    memcpy(&v, row + 4 * (size_t)k, 4);
    return v;
}

/* 4 W rows (rows past the matrix repeat the last real one and are never stored) x nx x rows.
 * out[c] lane r = dot(x row c, W row r). With one x row (GEMV) there are only 4 independent
 * FMA chains, too few to cover FMA latency (4 cycles, 2 pipes on Cortex-A76/X1): ku = 2 keeps
 * a second set of accumulators for the odd 4-wide steps. Only for a GEMV (ku from the caller):
 * the last one-row tile of a longer GEMM sums as its other tiles do, or a row's result would
 * depend on where its chunk cut it. */
static inline __attribute__((always_inline)) void
el_ftile(const int f16, const int nx, const int ku, const uint8_t *const w[4], const float *x, int K,
         float32x4_t out[4]) {
    enum { KU_MAX = 2 };
    float32x4_t acc[KU_MAX][4][4];
    for (int u = 0; u < ku; u++)
        for (int c = 0; c < nx; c++)
            for (int r = 0; r < 4; r++) acc[u][c][r] = vdupq_n_f32(0.0f);
    int k = 0;
    for (; k + 4 * ku <= K; k += 4 * ku) {
        if (ku == 2)   /* GEMV: weights are used once, straight from DRAM (see quant_matmul.c) */
            for (int r = 0; r < 4; r++) __builtin_prefetch(w[r] + (size_t)k * (f16 ? 2 : 4) + EL_PF_BYTES);
        for (int u = 0; u < ku; u++) {
            float32x4_t wv[4];
            for (int r = 0; r < 4; r++) wv[r] = el_load_w4(f16, w[r], k + 4 * u);
            for (int c = 0; c < nx; c++) {
                float32x4_t xv = vld1q_f32(x + (size_t)c * K + k + 4 * u);
                for (int r = 0; r < 4; r++) acc[u][c][r] = vfmaq_f32(acc[u][c][r], wv[r], xv);
            }
        }
    }
    for (; k + 4 <= K; k += 4) {
        float32x4_t wv[4];
        for (int r = 0; r < 4; r++) wv[r] = el_load_w4(f16, w[r], k);
        for (int c = 0; c < nx; c++) {
            float32x4_t xv = vld1q_f32(x + (size_t)c * K + k);
            for (int r = 0; r < 4; r++) acc[0][c][r] = vfmaq_f32(acc[0][c][r], wv[r], xv);
        }
    }
    for (int c = 0; c < nx; c++) {
        if (ku == 2)
            for (int r = 0; r < 4; r++) acc[0][c][r] = vaddq_f32(acc[0][c][r], acc[1][c][r]);
        /* transpose-reduce: lane r = total of row r */
        out[c] = vpaddq_f32(vpaddq_f32(acc[0][c][0], acc[0][c][1]), vpaddq_f32(acc[0][c][2], acc[0][c][3]));
    }
    if (k < K) {                       /* K % 4 leftovers */
        for (int c = 0; c < nx; c++) {
            float t[4] = {0, 0, 0, 0};
            for (int r = 0; r < 4; r++)
                for (int kk = k; kk < K; kk++) t[r] += el_load_w1(f16, w[r], kk) * x[(size_t)c * K + kk];
            out[c] = vaddq_f32(out[c], vld1q_f32(t));
        }
    }
}

static inline __attribute__((always_inline)) void
el_frows(const int f16, const uint8_t *w, int rows, const float *x, int nx_all, int K, float *y, size_t ldy,
         const float *bias) {
    const size_t rb = (size_t)K * (f16 ? 2 : 4);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int nr = EL_MIN(4, rows - r0);
        const uint8_t *wr[4];
        for (int r = 0; r < 4; r++) wr[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;
        const float *br = bias ? bias + r0 : NULL;
        for (int c0 = 0; c0 < nx_all; c0 += 4) {
            const int nx = EL_MIN(4, nx_all - c0);
            const float *xt = x + (size_t)c0 * K;
            float *yt = y + (size_t)c0 * ldy + r0;
            float32x4_t acc[4];
            switch (nx) {
            case 1:
                if (nx_all == 1) el_ftile(f16, 1, 2, wr, xt, K, acc);
                else el_ftile(f16, 1, 1, wr, xt, K, acc);
                break;
            case 2: el_ftile(f16, 2, 1, wr, xt, K, acc); break;
            case 3: el_ftile(f16, 3, 1, wr, xt, K, acc); break;
            default: el_ftile(f16, 4, 1, wr, xt, K, acc); break;
            }
            el_store_tile(acc, nx, nr, yt, ldy, br);
        }
    }
}

static void el_frows_f32(const uint8_t *w, int rows, const float *x, int nx, int K, float *y, size_t ldy,
                         const float *bias) {
    el_frows(0, w, rows, x, nx, K, y, ldy, bias);
}

static void el_frows_f16(const uint8_t *w, int rows, const float *x, int nx, int K, float *y, size_t ldy,
                         const float *bias) {
    el_frows(1, w, rows, x, nx, K, y, ldy, bias);
}

/* The plain twin: one dot at a time, sequential fp32 sum. */
static void el_frows_generic(int f16, const uint8_t *w, int rows, const float *x, int nx, int K, float *y,
                             size_t ldy, const float *bias) {
    const size_t rb = (size_t)K * (f16 ? 2 : 4);
    for (int c = 0; c < nx; c++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += el_load_w1(f16, w + r * rb, k) * x[(size_t)c * K + k];
            y[(size_t)c * ldy + r] = acc + (bias ? bias[r] : 0.0f);
        }
}

void el_matmul_float_rows(int wtype, int generic, const uint8_t *w, int rows, const float *x, int nx, int K,
                          float *y, size_t ldy, const float *bias) {
    const int f16 = wtype == EL_F16;
    if (generic) el_frows_generic(f16, w, rows, x, nx, K, y, ldy, bias);
    else if (f16) el_frows_f16(w, rows, x, nx, K, y, ldy, bias);
    else el_frows_f32(w, rows, x, nx, K, y, ldy, bias);
}

/* ---- block weights, fp32 activations ------------------------------------------------------- */
#define QK 32

/* Block geometry (GGUF layouts, edgellm_neon.h): bytes per block, offset of the quants. */
static inline int el_bq_bytes(int wt) { return wt == EL_Q8_0 ? 34 : wt == EL_Q4_1 ? 20 : 18; }
static inline int el_bq_off(int wt) { return wt == EL_Q4_1 ? 4 : 2; }

static inline uint16_t el_bq_ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* 4 fp16 values at 4 addresses -> fp32x4 (exact): the 4 rows' block scales. Arm: 4 lane loads
 * and one FCVTL; x86: one F16C conversion (SIMDe's vcvt_f32_f16 is 4 scalar conversions). */
static inline float32x4_t el_bq_f16x4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
#if EL_SIMDE && defined(__F16C__)
    __m128i h = _mm_setr_epi16((short)el_bq_ld16(p0), (short)el_bq_ld16(p1), (short)el_bq_ld16(p2),
                               (short)el_bq_ld16(p3), 0, 0, 0, 0);
    return simde_float32x4_from_m128(_mm_cvtph_ps(h));
#else
    uint16x4_t h = vld1_dup_u16((const uint16_t *)p0);
    h = vld1_lane_u16((const uint16_t *)p1, h, 1);
    h = vld1_lane_u16((const uint16_t *)p2, h, 2);
    h = vld1_lane_u16((const uint16_t *)p3, h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
#endif
}

/* 16 int8 -> 4 fp32x4 (exact): SXTL, SXTL2 to int16, the same again to int32, SCVTF. SIMDe
 * builds each widening from an 8-byte vector, which gcc lowers to several shuffles; on x86
 * PMOVSXBD widens 4 bytes straight to int32 lanes (the same lanes). */
static inline void el_s8x16_to_f32(int8x16_t v, float32x4_t out[4]) {
#if EL_SIMDE && defined(__SSE4_1__)
    const __m128i a = simde_int8x16_to_m128i(v);
    out[0] = simde_float32x4_from_m128(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(a)));
    out[1] = simde_float32x4_from_m128(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(a, 4))));
    out[2] = simde_float32x4_from_m128(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(a, 8))));
    out[3] = simde_float32x4_from_m128(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(a, 12))));
#else
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    out[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    out[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    out[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
#endif
}

/* One block's quants as 8 fp32x4 in x order: Q8_0 as stored; Q4 low nibbles are weights 0..15,
 * high nibbles 16..31; Q4_0's -8 is applied in int8 (exact), so its block sum needs no sum(x). */
static inline __attribute__((always_inline)) void el_bq_unpack(const int wt, const uint8_t *blk, float32x4_t wf[8]) {
    int8x16_t v0, v1;
    if (wt == EL_Q8_0) {
        v0 = vld1q_s8((const int8_t *)blk + 2);
        v1 = vld1q_s8((const int8_t *)blk + 18);
    } else {
        const uint8x16_t u = vld1q_u8(blk + el_bq_off(wt));
        v0 = vreinterpretq_s8_u8(vandq_u8(u, vdupq_n_u8(0x0F)));
        v1 = vreinterpretq_s8_u8(vshrq_n_u8(u, 4));
        if (wt == EL_Q4_0) {
            v0 = vsubq_s8(v0, vdupq_n_s8(8));
            v1 = vsubq_s8(v1, vdupq_n_s8(8));
        }
    }
    el_s8x16_to_f32(v0, wf);
    el_s8x16_to_f32(v1, wf + 4);
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2: through SIMDe (with the SSE4.1 widening above) the tile below ran the lm_head GEMV
 * (Q8_0 49152 x 576, one EPYC core) at 7.2 GB/s whether the weights sat in L3 or in DRAM:
 * instruction-bound, where el_matmul reached 12. Here VPMOVSXBD widens 8 quants straight from
 * memory and one 8-lane FMA chain per row and block holds the NEON tile's two 4-lane chains
 * side by side (lanes 0-3: s0, 4-7: s1), so the sums and their order are the NEON tile's own:
 * results are bit-identical to it. Measured 12.7 GB/s from L3, 11.4 from DRAM (el_matmul
 * 18.7 and 10.7). */
static inline __m256 el_s8x8_to_f32_avx2(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

static inline __attribute__((always_inline)) void
el_bqtile_avx2(const int wt, const int nx, const uint8_t *const w[4], const float *x, int K, float32x4_t acc[4]) {
    const int nb = K / QK, bs = el_bq_bytes(wt), off = el_bq_off(wt);
    for (int c = 0; c < nx; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk4[4];
        for (int r = 0; r < 4; r++) blk4[r] = w[r] + (size_t)b * bs;
        if (nx == 1)
            for (int r = 0; r < 4; r++) __builtin_prefetch(blk4[r] + EL_PF_BYTES);
        const float32x4_t dw = el_bq_f16x4(blk4[0], blk4[1], blk4[2], blk4[3]);
        __m128 p[4][4];   /* [x row][W row] */
        for (int r = 0; r < 4; r++) {
            __m256 wf[4];   /* weights 8j .. 8j+7 */
            if (wt == EL_Q8_0) {
                for (int j = 0; j < 4; j++)
                    wf[j] = el_s8x8_to_f32_avx2(_mm_loadl_epi64((const __m128i *)(blk4[r] + off + 8 * j)));
            } else {
                const __m128i u = _mm_loadu_si128((const __m128i *)(blk4[r] + off)), m4 = _mm_set1_epi8(0x0F);
                __m128i lo = _mm_and_si128(u, m4), hi = _mm_and_si128(_mm_srli_epi16(u, 4), m4);
                if (wt == EL_Q4_0) {
                    lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
                    hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
                }
                wf[0] = el_s8x8_to_f32_avx2(lo);
                wf[1] = el_s8x8_to_f32_avx2(_mm_unpackhi_epi64(lo, lo));
                wf[2] = el_s8x8_to_f32_avx2(hi);
                wf[3] = el_s8x8_to_f32_avx2(_mm_unpackhi_epi64(hi, hi));
            }
            for (int c = 0; c < nx; c++) {
                const float *xb = x + (size_t)c * K + (size_t)b * QK;
                __m256 s = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
                for (int j = 1; j < 4; j++) s = _mm256_fmadd_ps(wf[j], _mm256_loadu_ps(xb + 8 * j), s);
                p[c][r] = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));   /* s0 + s1 */
            }
        }
        for (int c = 0; c < nx; c++) {   /* HADDPS is vpaddq_f32 */
            const __m128 t = _mm_hadd_ps(_mm_hadd_ps(p[c][0], p[c][1]), _mm_hadd_ps(p[c][2], p[c][3]));
            acc[c] = vfmaq_f32(acc[c], simde_float32x4_from_m128(t), dw);
        }
        if (wt == EL_Q4_1) {   /* the NEON tile's own code: sum(x) is shared by the 4 rows */
            const float32x4_t mw = el_bq_f16x4(blk4[0] + 2, blk4[1] + 2, blk4[2] + 2, blk4[3] + 2);
            for (int c = 0; c < nx; c++) {
                const float *xb = x + (size_t)c * K + (size_t)b * QK;
                float32x4_t s = vaddq_f32(vld1q_f32(xb), vld1q_f32(xb + 4));
                for (int j = 2; j < 8; j++) s = vaddq_f32(s, vld1q_f32(xb + 4 * j));
                s = vpaddq_f32(s, s);
                acc[c] = vfmaq_f32(acc[c], mw, vpaddq_f32(s, s));
            }
        }
    }
}
#endif

/* 4 W rows (w[r] = row r's first block; rows past the matrix repeat the last real one and are
 * never stored) x nx rows of fp32 x. acc[c] lane r = y[c][row r]. Per block and row, the 32
 * products go into two 4-lane partial sums (two FMA chains of 4, not one of 8); the 4 rows'
 * partials are transpose-reduced so that one FMA applies all 4 rows' scales, as in
 * quant_matmul.c's el_qtile. */
static inline __attribute__((always_inline)) void
el_bqtile(const int wt, const int nx, const uint8_t *const w[4], const float *x, int K, float32x4_t acc[4]) {
#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    el_bqtile_avx2(wt, nx, w, x, K, acc);
    return;
#endif
    const int nb = K / QK, bs = el_bq_bytes(wt);
    for (int c = 0; c < nx; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk4[4];
        for (int r = 0; r < 4; r++) blk4[r] = w[r] + (size_t)b * bs;
        if (nx == 1)   /* GEMV: weights are used once, straight from DRAM (see quant_matmul.c) */
            for (int r = 0; r < 4; r++) __builtin_prefetch(blk4[r] + EL_PF_BYTES);
        const float32x4_t dw = el_bq_f16x4(blk4[0], blk4[1], blk4[2], blk4[3]);
        float32x4_t p[4][4];   /* [x row][W row] */
        for (int r = 0; r < 4; r++) {
            float32x4_t wf[8];
            el_bq_unpack(wt, blk4[r], wf);
            for (int c = 0; c < nx; c++) {
                const float *xb = x + (size_t)c * K + (size_t)b * QK;
                float32x4_t s0 = vmulq_f32(wf[0], vld1q_f32(xb)), s1 = vmulq_f32(wf[1], vld1q_f32(xb + 4));
                for (int j = 2; j < 8; j += 2) {
                    s0 = vfmaq_f32(s0, wf[j], vld1q_f32(xb + 4 * j));
                    s1 = vfmaq_f32(s1, wf[j + 1], vld1q_f32(xb + 4 * j + 4));
                }
                p[c][r] = vaddq_f32(s0, s1);
            }
        }
        for (int c = 0; c < nx; c++) {
            const float32x4_t t = vpaddq_f32(vpaddq_f32(p[c][0], p[c][1]), vpaddq_f32(p[c][2], p[c][3]));
            acc[c] = vfmaq_f32(acc[c], t, dw);
        }
        if (wt == EL_Q4_1) {
            const float32x4_t mw = el_bq_f16x4(blk4[0] + 2, blk4[1] + 2, blk4[2] + 2, blk4[3] + 2);
            for (int c = 0; c < nx; c++) {
                const float *xb = x + (size_t)c * K + (size_t)b * QK;
                float32x4_t s = vaddq_f32(vld1q_f32(xb), vld1q_f32(xb + 4));
                for (int j = 2; j < 8; j++) s = vaddq_f32(s, vld1q_f32(xb + 4 * j));
                s = vpaddq_f32(s, s);
                acc[c] = vfmaq_f32(acc[c], mw, vpaddq_f32(s, s));   /* every lane: sum(x) */
            }
        }
    }
}

#define EL_BQROWS_FN(name, wt)                                                                           \
    static void name(const uint8_t *w, size_t rb, int rows, const float *x, int nx_all, int K, float *y,   \
                     size_t ldy, const float *bias) {                                                    \
        for (int r0 = 0; r0 < rows; r0 += 4) {                                                           \
            const int nr = EL_MIN(4, rows - r0);                                                         \
            const uint8_t *wr[4];                                                                        \
            for (int r = 0; r < 4; r++) wr[r] = w + (size_t)(r0 + EL_MIN(r, nr - 1)) * rb;               \
            const float *br = bias ? bias + r0 : NULL;                                                   \
            for (int c0 = 0; c0 < nx_all; c0 += 4) {                                                     \
                const int nx = EL_MIN(4, nx_all - c0);                                                   \
                const float *xt = x + (size_t)c0 * K;                                                    \
                float *yt = y + (size_t)c0 * ldy + r0;                                                   \
                float32x4_t acc[4];                                                                      \
                switch (nx) {                                                                            \
                case 1: el_bqtile(wt, 1, wr, xt, K, acc); break;                                         \
                case 2: el_bqtile(wt, 2, wr, xt, K, acc); break;                                         \
                case 3: el_bqtile(wt, 3, wr, xt, K, acc); break;                                         \
                default: el_bqtile(wt, 4, wr, xt, K, acc); break;                                        \
                }                                                                                        \
                el_store_tile(acc, nx, nr, yt, ldy, br);                                                 \
            }                                                                                            \
        }                                                                                                \
    }

EL_BQROWS_FN(el_bqrows_q4_0, EL_Q4_0)
EL_BQROWS_FN(el_bqrows_q4_1, EL_Q4_1)
EL_BQROWS_FN(el_bqrows_q8_0, EL_Q8_0)

/* The plain twin: the textbook formula, each weight dequantized (d q, d (q - 8), d q + m) and
 * multiplied into one sequential fp32 sum; this cross-checks the per-block factoring above. */
static void el_bqrows_generic(int wt, const uint8_t *w, size_t rb, int rows, const float *x, int nx, int K,
                              float *y, size_t ldy, const float *bias) {
    const int nb = K / QK, bs = el_bq_bytes(wt), off = el_bq_off(wt);
    for (int c = 0; c < nx; c++)
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)c * K;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = w + (size_t)r * rb + (size_t)b * bs;
                const float d = el_f16_to_f32(el_bq_ld16(blk));
                const float m = wt == EL_Q4_1 ? el_f16_to_f32(el_bq_ld16(blk + 2)) : 0.0f;
                for (int i = 0; i < QK; i++) {
                    float wv;
                    if (wt == EL_Q8_0) {
                        wv = d * (float)((const int8_t *)blk)[off + i];
                    } else {
                        const int q = i < QK / 2 ? blk[off + i] & 0x0F : blk[off + i - QK / 2] >> 4;
                        wv = wt == EL_Q4_0 ? d * (float)(q - 8) : d * (float)q + m;
                    }
                    acc += wv * xr[b * QK + i];
                }
            }
            y[(size_t)c * ldy + r] = acc + (bias ? bias[r] : 0.0f);
        }
}

void el_matmul_f32act_rows(int wtype, int generic, const uint8_t *w, size_t rb, int rows, const float *x, int nx,
                           int K, float *y, size_t ldy, const float *bias) {
    if (generic) el_bqrows_generic(wtype, w, rb, rows, x, nx, K, y, ldy, bias);
    else if (wtype == EL_Q4_0) el_bqrows_q4_0(w, rb, rows, x, nx, K, y, ldy, bias);
    else if (wtype == EL_Q4_1) el_bqrows_q4_1(w, rb, rows, x, nx, K, y, ldy, bias);
    else el_bqrows_q8_0(w, rb, rows, x, nx, K, y, ldy, bias);
}
