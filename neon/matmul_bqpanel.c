/* Block weights (Q4_0, Q4_1, Q8_0) against fp32 x in GEMM form (el_matmul_f32act calls of 2 x
 * rows or more, quant_matmul.c): a panel of W rows is dequantized once per slice of k into a
 * k-major buffer, then every x row of the task's chunk sweeps it in a broadcast-FMA register block.
 *
 * Why: matmul_float.c's 4 x 4 tile widens each weight again for every 4 x rows and folds its
 * lanes per block: 82-86 GFLOPS at 16-256 rows (Zen 5, 2 threads), a third of numpy's sgemm. The
 * dispatcher then put a precision plan's fp32 GEMMs (the `quality` preset's prefill) on the
 * reference unit, which holds a dequantized fp32 copy of every matrix (592 MiB resident for
 * SmolLM2-135M against 187 without) and whose BLAS threads wait on each other when the other core
 * is busy. This form: 158-352 GFLOPS at 16-256 rows on the same machine (SmolLM2's layer GEMM
 * shapes, Q4_1).
 *
 * Each weight in the buffer is dequantized by the reference's formula: d q + m (Q4_1), d (q - 8)
 * (Q4_0), d q (Q8_0). Each output is one fp32 FMA chain over k in order from 0 (kept in y between
 * slices, which stores it exactly), plus the bias at the end: a row's result does not depend on
 * the chunk or task it falls in.
 *
 * Panel width (W rows per panel) and x rows per register block: AVX-512 (x86 development builds)
 * 32 and 6: 12 accumulators, 2 loads and 6 broadcasts per 12 FMAs; AVX2 16 and 4 (it has 16
 * registers: at 6 rows the block spilled, 48-56 GFLOPS a core against 65-84 at 4, Zen 5, 41-128
 * x rows); NEON 16 and 4: 16 accumulators, 4 loads per 16 FMAs (x by lane: FMLA by element). */
#include "el_common.h"

#if EL_SIMDE && defined(__AVX512F__)
#include "el_avx512.h"
#define EL_BQP_W 32
#define EL_BQP_R 6
#elif EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
#define EL_BQP_W 16
#define EL_BQP_R 4
#else
#define EL_BQP_W 16
#define EL_BQP_R 4
#endif
#define QK 32
/* (EL_BQP_KC, k per slice, is in el_common.h: the task grid sizes its x chunks by it) */

void el_bqpanel_rows(int wtype, const uint8_t *w, size_t rb, int rows, const float *x, int nx, int K, float *y,
                     size_t ldy, const float *bias);

static inline int el_bqp_bytes(int wt) { return wt == EL_Q8_0 ? 34 : wt == EL_Q4_1 ? 20 : 18; }

static inline float el_bqp_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return el_f16_to_f32(h);
}

#if EL_SIMDE && defined(__AVX512F__)
/* Half `half` (weights 16 half .. 16 half + 15) of one block as 16 dequantized fp32 */
static inline __m512 el_bqp_half_x5(const int wt, const uint8_t *blk, int half) {
    const __m512 d = _mm512_set1_ps(el_bqp_f16(blk));
    if (wt == EL_Q8_0)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * half)))), d);
    const __m128i u = _mm_loadu_si128((const __m128i *)(blk + (wt == EL_Q4_1 ? 4 : 2)));
    const __m128i q = _mm_and_si128(half ? _mm_srli_epi16(u, 4) : u, _mm_set1_epi8(0x0F));
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    if (wt == EL_Q4_0) return _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(8.0f)), d);
    return _mm512_add_ps(_mm512_mul_ps(v, d), _mm512_set1_ps(el_bqp_f16(blk + 2)));
}

/* wp[k * 32 + r] = W row r's weight k0 + k, r < 32 (row pointers wr), k < kc: 16 rows' 16
 * weights as 16 registers, transposed in registers, stored as 16 k-rows */
static void el_bqp_pack(const int wt, const uint8_t *const wr[EL_BQP_W], int k0, int kc, float *wp) {
    const int bs = el_bqp_bytes(wt);
    for (int h = 0; h < EL_BQP_W / 16; h++)
        for (int k = 0; k < kc; k += 16) {
            const int b = (k0 + k) / QK, half = ((k0 + k) % QK) / 16;
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = el_bqp_half_x5(wt, wr[16 * h + i] + (size_t)b * bs, half);
            el_x5_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(wp + (size_t)(k + i) * EL_BQP_W + 16 * h, r[i]);
        }
}

/* NR x rows (x: the first one's slice start, rows K apart) against the panel: y (NR rows, ldy
 * apart, the panel's first column) holds the running sums unless first; last adds the bias.
 * m0, m1: the panel's columns that exist (a short last panel) */
static inline __attribute__((always_inline)) void
el_bqp_block(const int NR, const float *wp, int kc, const float *x, int K, float *y, size_t ldy, int first,
             const float *bias, __mmask16 m0, __mmask16 m1) {
    __m512 a[EL_BQP_R][2];
    for (int r = 0; r < NR; r++) {
        a[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + r * ldy);
        a[r][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);
    }
    for (int k = 0; k < kc; k++) {
        const __m512 w0 = _mm512_loadu_ps(wp + (size_t)k * EL_BQP_W), w1 = _mm512_loadu_ps(wp + (size_t)k * EL_BQP_W + 16);
        for (int r = 0; r < NR; r++) {
            const __m512 xb = _mm512_set1_ps(x[(size_t)r * K + k]);
            a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < NR; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(a[r][0], b0) : a[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(a[r][1], b1) : a[r][1]);
    }
}

#define EL_BQP_BLOCK(n) el_bqp_block(n, wp, kc, xs, K, yr, ldy, first, b, m0, m1)

static void el_bqp_rows_of_panel(const float *wp, int kc, const float *x, int nx, int K, float *y, size_t ldy,
                                 int first, const float *bias, int np) {
    const unsigned full = np >= 32 ? 0xFFFFFFFFu : (1u << np) - 1u;   /* the columns that exist */
    const __mmask16 m0 = (__mmask16)(np >= 16 ? 0xFFFF : full), m1 = (__mmask16)(np > 16 ? full >> 16 : 0);
    for (int r0 = 0; r0 < nx; r0 += EL_BQP_R) {
        const float *xs = x + (size_t)r0 * K;
        float *yr = y + (size_t)r0 * ldy;
        const float *b = bias;
        switch (EL_MIN(EL_BQP_R, nx - r0)) {
        case 6: EL_BQP_BLOCK(6); break;
        case 5: EL_BQP_BLOCK(5); break;
        case 4: EL_BQP_BLOCK(4); break;
        case 3: EL_BQP_BLOCK(3); break;
        case 2: EL_BQP_BLOCK(2); break;
        default: EL_BQP_BLOCK(1); break;
        }
    }
}
#elif EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2 (development builds without AVX-512): the AVX-512 form at 8 lanes. Through SIMDe the
 * NEON form below ran at 35-39 GFLOPS a core (Zen 5), the lane FMAs becoming shuffles. */
static inline __m256 el_bqp_eighth_x2(const int wt, const uint8_t *blk, int e) {
    const __m256 d = _mm256_set1_ps(el_bqp_f16(blk));
    if (wt == EL_Q8_0)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * e)))), d);
    /* weights 8e .. 8e + 7: bytes 8 (e % 2) .., low nibbles for e < 2, high ones after */
    const __m128i u = _mm_loadl_epi64((const __m128i *)(blk + (wt == EL_Q4_1 ? 4 : 2) + 8 * (e % 2)));
    const __m128i q = _mm_and_si128(e >= 2 ? _mm_srli_epi16(u, 4) : u, _mm_set1_epi8(0x0F));
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    if (wt == EL_Q4_0) return _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(8.0f)), d);
    return _mm256_add_ps(_mm256_mul_ps(v, d), _mm256_set1_ps(el_bqp_f16(blk + 2)));
}

static inline void el_bqp_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) {
        u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
        u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

static void el_bqp_pack(const int wt, const uint8_t *const wr[EL_BQP_W], int k0, int kc, float *wp) {
    const int bs = el_bqp_bytes(wt);
    for (int h = 0; h < EL_BQP_W / 8; h++)
        for (int k = 0; k < kc; k += 8) {
            const int b = (k0 + k) / QK, e = ((k0 + k) % QK) / 8;
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = el_bqp_eighth_x2(wt, wr[8 * h + i] + (size_t)b * bs, e);
            el_bqp_transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(wp + (size_t)(k + i) * EL_BQP_W + 8 * h, r[i]);
        }
}

static inline __attribute__((always_inline)) void
el_bqp_block(const int NR, const float *wp, int kc, const float *x, int K, float *y, size_t ldy, int first,
             const float *bias, int np) {
    __m256 a[EL_BQP_R][2];
    float tmp[EL_BQP_W];
    for (int r = 0; r < NR; r++) {
        const float *src = y + r * ldy;
        if (!first && np < EL_BQP_W) {
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, src, (size_t)np * sizeof(float));
            src = tmp;
        }
        a[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(src);
        a[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(src + 8);
    }
    for (int k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(wp + (size_t)k * EL_BQP_W), w1 = _mm256_loadu_ps(wp + (size_t)k * EL_BQP_W + 8);
        for (int r = 0; r < NR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + (size_t)r * K + k);
            a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(tmp, a[r][0]);
        _mm256_storeu_ps(tmp + 8, a[r][1]);
        for (int c = 0; c < np; c++) y[r * ldy + c] = bias ? tmp[c] + bias[c] : tmp[c];
    }
}

#else
/* 4 rows x 4 values -> their transpose (lane i of out[j] = lane j of in[i]) */
static inline void el_bqp_transpose4(float32x4_t v[4]) {
    const float32x4x2_t a = vtrnq_f32(v[0], v[1]), b = vtrnq_f32(v[2], v[3]);
    v[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0]));
    v[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1]));
    v[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0]));
    v[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1]));
}

/* One block of one row as 8 fp32x4 of dequantized weights, in k order */
static inline void el_bqp_block_deq(const int wt, const uint8_t *blk, float32x4_t out[8]) {
    int8x16_t v0, v1;
    if (wt == EL_Q8_0) {
        v0 = vld1q_s8((const int8_t *)blk + 2);
        v1 = vld1q_s8((const int8_t *)blk + 18);
    } else {
        const uint8x16_t u = vld1q_u8(blk + (wt == EL_Q4_1 ? 4 : 2));
        v0 = vreinterpretq_s8_u8(vandq_u8(u, vdupq_n_u8(0x0F)));
        v1 = vreinterpretq_s8_u8(vshrq_n_u8(u, 4));
    }
    const float d = el_bqp_f16(blk), m = wt == EL_Q4_1 ? el_bqp_f16(blk + 2) : 0.0f;
    for (int h = 0; h < 2; h++) {
        const int8x16_t v = h ? v1 : v0;
        const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
        const int32x4_t q[4] = {vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)),
                                vmovl_high_s16(hi)};
        for (int j = 0; j < 4; j++) {
            float32x4_t f = vcvtq_f32_s32(q[j]);
            if (wt == EL_Q4_0) f = vsubq_f32(f, vdupq_n_f32(8.0f));
            f = vmulq_n_f32(f, d);
            out[4 * h + j] = wt == EL_Q4_1 ? vaddq_f32(f, vdupq_n_f32(m)) : f;
        }
    }
}

/* wp[k * 16 + r] = W row r's weight k0 + k, r < 16 (row pointers wr), k < kc */
static void el_bqp_pack(const int wt, const uint8_t *const wr[EL_BQP_W], int k0, int kc, float *wp) {
    const int bs = el_bqp_bytes(wt);
    for (int g = 0; g < EL_BQP_W / 4; g++)
        for (int k = 0; k < kc; k += QK) {
            float32x4_t f[4][8];
            for (int i = 0; i < 4; i++) el_bqp_block_deq(wt, wr[4 * g + i] + (size_t)((k0 + k) / QK) * bs, f[i]);
            for (int j = 0; j < 8; j++) {
                float32x4_t t[4] = {f[0][j], f[1][j], f[2][j], f[3][j]};
                el_bqp_transpose4(t);
                for (int i = 0; i < 4; i++) vst1q_f32(wp + (size_t)(k + 4 * j + i) * EL_BQP_W + 4 * g, t[i]);
            }
        }
}

#define EL_BQP_FMA4(l)                                                                          \
    do {                                                                                        \
        const float *wk = wp + (size_t)(k + (l)) * EL_BQP_W;                                    \
        const float32x4_t w0 = vld1q_f32(wk), w1 = vld1q_f32(wk + 4), w2 = vld1q_f32(wk + 8),   \
                          w3 = vld1q_f32(wk + 12);                                              \
        for (int r = 0; r < NR; r++) {                                                          \
            a[r][0] = vfmaq_laneq_f32(a[r][0], w0, xv[r], l);                                   \
            a[r][1] = vfmaq_laneq_f32(a[r][1], w1, xv[r], l);                                   \
            a[r][2] = vfmaq_laneq_f32(a[r][2], w2, xv[r], l);                                   \
            a[r][3] = vfmaq_laneq_f32(a[r][3], w3, xv[r], l);                                   \
        }                                                                                       \
    } while (0)

/* As the AVX-512 block: NR x rows against the panel, np <= 16 of its columns stored */
static inline __attribute__((always_inline)) void
el_bqp_block(const int NR, const float *wp, int kc, const float *x, int K, float *y, size_t ldy, int first,
             const float *bias, int np) {
    float32x4_t a[EL_BQP_R][4];
    float tmp[EL_BQP_W];
    for (int r = 0; r < NR; r++) {
        const float *src = y + r * ldy;
        if (!first && np < EL_BQP_W) {   /* a short last panel: its running sums through tmp */
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, src, (size_t)np * sizeof(float));
            src = tmp;
        }
        for (int j = 0; j < 4; j++) a[r][j] = first ? vdupq_n_f32(0.0f) : vld1q_f32(src + 4 * j);
    }
    for (int k = 0; k < kc; k += 4) {
        float32x4_t xv[EL_BQP_R];
        for (int r = 0; r < NR; r++) xv[r] = vld1q_f32(x + (size_t)r * K + k);
        EL_BQP_FMA4(0);
        EL_BQP_FMA4(1);
        EL_BQP_FMA4(2);
        EL_BQP_FMA4(3);
    }
    for (int r = 0; r < NR; r++) {
        for (int j = 0; j < 4; j++) vst1q_f32(tmp + 4 * j, a[r][j]);
        for (int c = 0; c < np; c++) y[r * ldy + c] = bias ? tmp[c] + bias[c] : tmp[c];
    }
}

#endif

#if !(EL_SIMDE && defined(__AVX512F__))
/* (AVX2 and NEON: blocks of up to 4 x rows) */
#define EL_BQP_BLOCK(n) el_bqp_block(n, wp, kc, xs, K, yr, ldy, first, bias, np)

static void el_bqp_rows_of_panel(const float *wp, int kc, const float *x, int nx, int K, float *y, size_t ldy,
                                 int first, const float *bias, int np) {
    for (int r0 = 0; r0 < nx; r0 += EL_BQP_R) {
        const float *xs = x + (size_t)r0 * K;
        float *yr = y + (size_t)r0 * ldy;
        switch (EL_MIN(EL_BQP_R, nx - r0)) {
        case 4: EL_BQP_BLOCK(4); break;
        case 3: EL_BQP_BLOCK(3); break;
        case 2: EL_BQP_BLOCK(2); break;
        default: EL_BQP_BLOCK(1); break;
        }
    }
}
#endif

/* y[c * ldy + r] = x row c . W row r (+ bias[r]) for r < rows (rb bytes per W row), c < nx; K a
 * multiple of 32 */
void el_bqpanel_rows(int wt, const uint8_t *w, size_t rb, int rows, const float *x, int nx, int K, float *y,
                     size_t ldy, const float *bias) {
    float wp[EL_BQP_W * EL_BQP_KC] __attribute__((aligned(64)));
    for (int p0 = 0; p0 < rows; p0 += EL_BQP_W) {
        const int np = EL_MIN(EL_BQP_W, rows - p0);
        const uint8_t *wr[EL_BQP_W];   /* rows past np repeat the last one; their sums are not stored */
        for (int r = 0; r < EL_BQP_W; r++) wr[r] = w + (size_t)(p0 + EL_MIN(r, np - 1)) * rb;
        for (int k0 = 0; k0 < K; k0 += EL_BQP_KC) {
            const int kc = EL_MIN(EL_BQP_KC, K - k0);
            el_bqp_pack(wt, wr, k0, kc, wp);
            el_bqp_rows_of_panel(wp, kc, x + k0, nx, K, y + p0, ldy, k0 == 0,
                                 k0 + kc == K && bias ? bias + p0 : NULL, np);
        }
    }
}
