/* The F32 / F16 weight kernels of el_matmul (quant_matmul.c holds the entry point and the task
 * grid; it calls el_matmul_float_rows for one task's chunk).
 *
 * Dot-product form: W rows and x rows are both K-contiguous, so a register tile of 4 W rows x
 * up to 4 x rows keeps 16 fp32x4 accumulators along K and reduces them once at the end (no
 * packing pass over W, which is read straight from the model file). F16 weights are widened to
 * fp32 in registers (FCVTL, base Armv8.0) and accumulated in fp32: fp16 accumulation loses
 * precision over K in the thousands and can overflow (65504).
 */
#include <string.h>

#include "el_common.h"

#define EL_PF_BYTES 4096      /* GEMV prefetch distance; measured in quant_matmul.c */

void el_matmul_float_rows(int wtype, int generic, const uint8_t *w, int rows, const float *x, int nx, int K,
                          float *y, size_t ldy, const float *bias);

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
 * a second set of accumulators for the odd 4-wide steps. */
static inline __attribute__((always_inline)) void
el_ftile(const int f16, const int nx, const uint8_t *const w[4], const float *x, int K, float32x4_t out[4]) {
    enum { KU_MAX = 2 };
    const int ku = nx == 1 ? 2 : 1;
    float32x4_t acc[KU_MAX][4][4];
    for (int u = 0; u < ku; u++)
        for (int c = 0; c < nx; c++)
            for (int r = 0; r < 4; r++) acc[u][c][r] = vdupq_n_f32(0.0f);
    int k = 0;
    for (; k + 4 * ku <= K; k += 4 * ku) {
        if (nx == 1)   /* GEMV: weights are used once, straight from DRAM (see quant_matmul.c) */
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
            case 1: el_ftile(f16, 1, wr, xt, K, acc); break;
            case 2: el_ftile(f16, 2, wr, xt, K, acc); break;
            case 3: el_ftile(f16, 3, wr, xt, K, acc); break;
            default: el_ftile(f16, 4, wr, xt, K, acc); break;
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
