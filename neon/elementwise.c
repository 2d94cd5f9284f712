/* Elementwise kernels: RMSNorm, RoPE, SwiGLU, softmax, add. fp32 in, out and accumulation.
 *
 * Each op has a NEON row kernel and a plain C `_generic` twin with the same signature; the
 * public entry point validates, picks one (el_generic_flag) and, for the ops given a pool, splits
 * large inputs into tasks. Vector loops run 16 lanes (4 registers) at a time where a reduction
 * benefits from independent accumulators, then 4, then a scalar tail.
 */
#include "el_common.h"

#include <math.h>
#include <string.h>

/* Below this many elements a job is not worth a trip through the pool (~1-2 us round trip). */
#define EL_EW_PAR_MIN 16384
/* Elements per task once parallel: several tasks per thread so uneven cores balance. */
#define EL_EW_TASK 8192

/* Shared with attention.c (hidden): x[i] = exp(x[i] - m) for i < n, returns the fp32 sum. */

/* ---- exp ------------------------------------------------------------------------------------ */

/* exp on four lanes, Cephes' expf: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two so n ln2 is
 * exact), a degree-7 polynomial for e^r, and 2^n built in the exponent field. Relative error
 * ~1e-7 (2 ulp) over the normal range. x < -87.33 gives 0 (numpy gives a subnormal there, below
 * 1.2e-38), x > 88.72 gives inf; -inf gives 0, which the masked scores of attention rely on.
 * In (88.37, 88.72] the result saturates at e^88.37 (the 2^n construction stops at 2^127). */
static inline float32x4_t el_vexpq_f32(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.3365478515625f), hi = vdupq_n_f32(88.37f);
    uint32x4_t under = vcltq_f32(x, lo), over = vcgtq_f32(x, vdupq_n_f32(88.72283935546875f));
    float32x4_t xc = vminq_f32(vmaxq_f32(x, lo), hi);
    int32x4_t n = vcvtnq_s32_f32(vmulq_n_f32(xc, 1.44269504088896341f));
    float32x4_t nf = vcvtq_f32_s32(n);
    float32x4_t r = vfmsq_f32(xc, nf, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, nf, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    float32x4_t y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    float32x4_t scale = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
    y = vmulq_f32(y, scale);
    y = vbslq_f32(under, vdupq_n_f32(0.0f), y);
    return vbslq_f32(over, vdupq_n_f32(INFINITY), y);
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2 (development builds): el_vexpq_f32 on 8 lanes, operation for operation as SIMDe
 * compiles the 4-lane one (its vfmsq_f32 is a rounded product subtracted, not a fused one; its
 * vmaxq/vminq keep a NaN operand, as MAXPS/MINPS with x second do; vcvtnq rounds with MXCSR's
 * default nearest-even), so every lane is bit-identical. Through SIMDe the softmax core took
 * 15-20% of a prefill attention tile: half-width vectors plus SIMDe's NaN blends and MXCSR reads.
 * GCC would contract the product-then-subtract into an FMA (intrinsics are plain vector
 * arithmetic to it): 1 ulp away from the 4-lane path on some inputs, so contraction is off here. */
#define EL_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
static inline EL_NO_CONTRACT __m256 el_vexp8_f32(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365478515625f), hi = _mm256_set1_ps(88.37f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    const __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)));
    const __m256 nf = _mm256_cvtepi32_ps(n);
    __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(nf, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(nf, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    y = _mm256_andnot_ps(under, y);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

#if defined(__AVX512F__)
/* el_vexp8_f32 on 16 lanes, operation for operation (VMAXPS/VMINPS keep x, the NaN, second as
 * before; compares to masks, the blends masked moves): lane for lane the same results. On Zen 5
 * the prefill attention tile spent ~22% of its time here once its FMA blocks went 16 wide. */
static inline EL_NO_CONTRACT __m512 el_vexp16_f32(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3365478515625f), hi = _mm512_set1_ps(88.37f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    const __m512 xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
    const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)));
    const __m512 nf = _mm512_cvtepi32_ps(n);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(nf, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(nf, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    y = _mm512_maskz_mov_ps((__mmask16)~under, y);
    return _mm512_mask_blend_ps(over, y, _mm512_set1_ps(INFINITY));
}
#endif

#if defined(__AVX512F__)
/* The end of el_exp_sub_sum_avx2 from element i (n - i in 1..15, s its 8-lane sums so far): the
 * last elements in one masked 16-lane exp, lanes past n -inf as in the buffer below (the lane
 * values, and so the sums, are the same). The buffer's memcpy then a 256-bit load missed store
 * forwarding, and the diagonal chunks of a prefill attention tile end here on most rows (perf:
 * ~30% of this function's samples on that load). */
static inline EL_NO_CONTRACT float el_exp_sub_sum_tail16(float *x, int i, int n, __m512 vm16, __m256 s) {
    const int rest = n - i;
    const __mmask16 k = (__mmask16)((1u << rest) - 1);
    const __m512 a = el_vexp16_f32(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i), vm16));
    _mm512_mask_storeu_ps(x + i, k, a);
    __m128 s0, s1;
    if (rest >= 8) {   /* the 8-block, then a tail of rest - 8 */
        s = _mm256_add_ps(s, _mm512_castps512_ps256(a));
        s0 = _mm256_castps256_ps128(s), s1 = _mm256_extractf128_ps(s, 1);
        if (rest > 8) {
            const __m256 t = _mm512_extractf32x8_ps(a, 1);
            s0 = _mm_add_ps(s0, _mm256_castps256_ps128(t));
            if (rest > 12) s0 = _mm_add_ps(s0, _mm256_extractf128_ps(t, 1));
        }
    } else {
        const __m256 t = _mm512_castps512_ps256(a);
        s0 = _mm256_castps256_ps128(s), s1 = _mm256_extractf128_ps(s, 1);
        s0 = _mm_add_ps(s0, _mm256_castps256_ps128(t));
        if (rest > 4) s0 = _mm_add_ps(s0, _mm256_extractf128_ps(t, 1));
    }
    return vaddvq_f32(simde_float32x4_from_m128(_mm_add_ps(s0, s1)));
}
#endif

/* The same sums as the 4-lane loop below: lanes 0-3 of the 8-lane accumulator are its s0,
 * lanes 4-7 its s1; the 4-key block and the tail go to s0 only, in the same order. */
static EL_NO_CONTRACT float el_exp_sub_sum_avx2(float *x, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    int i = 0;
#if defined(__AVX512F__)
    const __m512 vm16 = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {   /* two 8-blocks per exp, added to s one after the other */
        const __m512 a = el_vexp16_f32(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm16));
        _mm512_storeu_ps(x + i, a);
        s = _mm256_add_ps(s, _mm512_castps512_ps256(a));
        s = _mm256_add_ps(s, _mm512_extractf32x8_ps(a, 1));
    }
    if (i < n) return el_exp_sub_sum_tail16(x, i, n, vm16, s);
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 a = el_vexp8_f32(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, a);
        s = _mm256_add_ps(s, a);
    }
    __m128 s0 = _mm256_castps256_ps128(s);
    const __m128 s1 = _mm256_extractf128_ps(s, 1);
    if (i < n) {
        /* the rest (< 8) through the same polynomial, padding lanes -inf (exp gives 0); masked
         * moves, not a buffer filled by memcpy (its 256-bit load missed store forwarding) */
        const int rest = n - i;
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 xr = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + i, k), _mm256_castsi256_ps(k));
        const __m256 a = el_vexp8_f32(_mm256_sub_ps(xr, vm));
        _mm256_maskstore_ps(x + i, k, a);
        s0 = _mm_add_ps(s0, _mm256_castps256_ps128(a));
        if (rest > 4) s0 = _mm_add_ps(s0, _mm256_extractf128_ps(a, 1));
    }
    return vaddvq_f32(simde_float32x4_from_m128(_mm_add_ps(s0, s1)));
}
#endif

float el_exp_sub_sum(float *x, int n, float m) {
#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    return el_exp_sub_sum_avx2(x, n, m);
#endif
    float32x4_t vm = vdupq_n_f32(m), s0 = vdupq_n_f32(0.0f), s1 = s0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        float32x4_t a = el_vexpq_f32(vsubq_f32(vld1q_f32(x + i), vm));
        float32x4_t b = el_vexpq_f32(vsubq_f32(vld1q_f32(x + i + 4), vm));
        vst1q_f32(x + i, a);
        vst1q_f32(x + i + 4, b);
        s0 = vaddq_f32(s0, a);
        s1 = vaddq_f32(s1, b);
    }
    for (; i + 4 <= n; i += 4) {
        float32x4_t a = el_vexpq_f32(vsubq_f32(vld1q_f32(x + i), vm));
        vst1q_f32(x + i, a);
        s0 = vaddq_f32(s0, a);
    }
    if (i < n) {
        /* the tail through the same polynomial (padding lanes are -inf, so exp gives 0) */
        float buf[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(float));
        float32x4_t a = el_vexpq_f32(vsubq_f32(vld1q_f32(buf), vm));
        vst1q_f32(buf, a);
        memcpy(x + i, buf, (size_t)(n - i) * sizeof(float));
        s0 = vaddq_f32(s0, a);
    }
    return vaddvq_f32(vaddq_f32(s0, s1));
}

float el_exp_sub_sum_generic(float *x, int n, float m) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    return s;
}

/* ---- splitting a (rows, cols) op over the pool ----------------------------------------------- */

typedef struct {
    el_rows_fn fn;
    const void *args;
    int rows, rows_per_task;
} el_rows_job;

static void el_rows_task(void *ctx, int t, int n_tasks) {
    const el_rows_job *j = ctx;
    (void)n_tasks;
    int r0 = t * j->rows_per_task, r1 = EL_MIN(j->rows, r0 + j->rows_per_task);
    j->fn(j->args, r0, r1);
}

/* Runs fn over rows [0, rows) of `cols` elements each: inline when small, else in tasks of
 * about EL_EW_TASK elements (at least one row) across the pool. */
void el_for_rows(el_pool *pool, el_rows_fn fn, const void *args, int rows, int cols) {
    size_t total = (size_t)rows * (size_t)cols;
    if (pool == NULL || el_pool_threads(pool) <= 1 || rows < 2 || total < EL_EW_PAR_MIN) {
        fn(args, 0, rows);
        return;
    }
    int per = (int)EL_MAX((size_t)1, (size_t)EL_EW_TASK / (size_t)cols);
    el_rows_job job = {fn, args, rows, per};
    el_parallel_for(pool, (rows + per - 1) / per, el_rows_task, &job);
}

/* ---- RMSNorm --------------------------------------------------------------------------------- */

typedef struct {
    const float *x, *w;
    float *y;
    int d;
    float eps;
} el_rmsnorm_args;

void el_rmsnorm_generic(const float *x, const float *w, float *y, int d, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    float s = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; i++) y[i] = x[i] * s * w[i];
}

static void el_rmsnorm_neon(const float *x, const float *w, float *y, int d, float eps) {
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        float32x4_t v0 = vld1q_f32(x + i), v1 = vld1q_f32(x + i + 4);
        float32x4_t v2 = vld1q_f32(x + i + 8), v3 = vld1q_f32(x + i + 12);
        a0 = vfmaq_f32(a0, v0, v0);
        a1 = vfmaq_f32(a1, v1, v1);
        a2 = vfmaq_f32(a2, v2, v2);
        a3 = vfmaq_f32(a3, v3, v3);
    }
    for (; i + 4 <= d; i += 4) {
        float32x4_t v = vld1q_f32(x + i);
        a0 = vfmaq_f32(a0, v, v);
    }
    float ss = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
    for (; i < d; i++) ss += x[i] * x[i];
    float s = 1.0f / sqrtf(ss / (float)d + eps);
    float32x4_t vs = vdupq_n_f32(s);
    i = 0;
    for (; i + 4 <= d; i += 4)
        vst1q_f32(y + i, vmulq_f32(vmulq_f32(vld1q_f32(x + i), vs), vld1q_f32(w + i)));
    for (; i < d; i++) y[i] = x[i] * s * w[i];
}

static void el_rmsnorm_rows(const void *args, int r0, int r1) {
    const el_rmsnorm_args *a = args;
    void (*row)(const float *, const float *, float *, int, float) =
        el_generic_flag ? el_rmsnorm_generic : el_rmsnorm_neon;
    for (int r = r0; r < r1; r++) {
        size_t o = (size_t)r * (size_t)a->d;
        row(a->x + o, a->w, a->y + o, a->d, a->eps);
    }
}

int el_rmsnorm(el_pool *pool, const float *x, const float *w, float *y, int T, int d, float eps) {
    if (!x || !w || !y || T <= 0 || d <= 0 || !(eps >= 0.0f)) return EL_EINVAL;
    el_rmsnorm_args a = {x, w, y, d, eps};
    el_for_rows(pool, el_rmsnorm_rows, &a, T, d);
    return EL_OK;
}

/* ---- RoPE ------------------------------------------------------------------------------------ */

/* One head's vector: xr, yr (hd,), c, s (rope_dim / 2,). */
void el_rope_generic(const float *xr, float *yr, int hd, int rope_dim, const float *c, const float *s, int neox) {
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = xr[i0], x1 = xr[i1];
        yr[i0] = x0 * c[i] - x1 * s[i];
        yr[i1] = x0 * s[i] + x1 * c[i];
    }
    if (yr != xr) memmove(yr + rope_dim, xr + rope_dim, (size_t)(hd - rope_dim) * sizeof(float));
}

static void el_rope_neon(const float *xr, float *yr, int hd, int rope_dim, const float *c, const float *s, int neox) {
    int half = rope_dim / 2, i = 0;
    if (neox) {
        for (; i + 4 <= half; i += 4) {
            float32x4_t x0 = vld1q_f32(xr + i), x1 = vld1q_f32(xr + half + i);
            float32x4_t vc = vld1q_f32(c + i), vs = vld1q_f32(s + i);
            vst1q_f32(yr + i, vfmsq_f32(vmulq_f32(x0, vc), x1, vs));
            vst1q_f32(yr + half + i, vfmaq_f32(vmulq_f32(x0, vs), x1, vc));
        }
    } else {
        /* vld2 splits 4 interleaved pairs into evens and odds; both are loaded before either
         * is stored, so y == x is safe */
        for (; i + 4 <= half; i += 4) {
            float32x4x2_t v = vld2q_f32(xr + 2 * i);
            float32x4_t vc = vld1q_f32(c + i), vs = vld1q_f32(s + i);
            float32x4x2_t o;
            o.val[0] = vfmsq_f32(vmulq_f32(v.val[0], vc), v.val[1], vs);
            o.val[1] = vfmaq_f32(vmulq_f32(v.val[0], vs), v.val[1], vc);
            vst2q_f32(yr + 2 * i, o);
        }
    }
    for (; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = xr[i0], x1 = xr[i1];
        yr[i0] = x0 * c[i] - x1 * s[i];
        yr[i1] = x0 * s[i] + x1 * c[i];
    }
    if (yr != xr) memmove(yr + rope_dim, xr + rope_dim, (size_t)(hd - rope_dim) * sizeof(float));
}

int el_rope(const float *x, float *y, int T, int heads, int hd, int rope_dim, const float *cos, const float *sin,
            int neox) {
    if (!x || !y || !cos || !sin || T <= 0 || heads <= 0 || hd <= 0) return EL_EINVAL;
    if (rope_dim <= 0 || rope_dim > hd || rope_dim % 2 != 0 || (neox != 0 && neox != 1)) return EL_EINVAL;
    void (*fn)(const float *, float *, int, int, const float *, const float *, int) =
        el_generic_flag ? el_rope_generic : el_rope_neon;
    int half = rope_dim / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            size_t o = ((size_t)t * (size_t)heads + (size_t)h) * (size_t)hd;
            fn(x + o, y + o, hd, rope_dim, cos + (size_t)t * half, sin + (size_t)t * half, neox);
        }
    return EL_OK;
}

/* ---- SwiGLU ---------------------------------------------------------------------------------- */

typedef struct {
    const float *gate_up;
    float *y;
    int ff;
} el_swiglu_args;

/* g, u, y (n,): y = g * u / (1 + e^-g), the reference's order of operations */
void el_swiglu_generic(const float *g, const float *u, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static inline float32x4_t el_silu_mul(float32x4_t g, float32x4_t u) {
    float32x4_t den = vaddq_f32(vdupq_n_f32(1.0f), el_vexpq_f32(vnegq_f32(g)));
    return vmulq_f32(vdivq_f32(g, den), u);
}

#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
/* x86 AVX2: el_silu_mul on 8 lanes with el_vexp8_f32, the same operations lane for lane
 * (negate, exp, 1 +, divide, multiply): bit-identical, ~5% of a cold prefill through SIMDe */
static inline EL_NO_CONTRACT __m256 el_silu_mul8(__m256 g, __m256 u) {
    const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), el_vexp8_f32(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f))));
    return _mm256_mul_ps(_mm256_div_ps(g, den), u);
}

#if defined(__AVX512F__)
/* 16 lanes with el_vexp16_f32, the same operations again (lanewise: bit-identical) */
static inline EL_NO_CONTRACT __m512 el_silu_mul16(__m512 g, __m512 u) {
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), el_vexp16_f32(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f))));
    return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}
#endif

static EL_NO_CONTRACT void el_swiglu_avx2(const float *g, const float *u, float *y, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, el_silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, el_silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {   /* the tail through the same lanes, zero-padded */
        float gb[8] = {0}, ub[8] = {0}, yb[8];
        memcpy(gb, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(ub, u + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(yb, el_silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
        memcpy(y + i, yb, (size_t)(n - i) * sizeof(float));
    }
}
#endif

static void el_swiglu_neon(const float *g, const float *u, float *y, int n) {
#if EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    el_swiglu_avx2(g, u, y, n);
    return;
#endif
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        vst1q_f32(y + i, el_silu_mul(vld1q_f32(g + i), vld1q_f32(u + i)));
        vst1q_f32(y + i + 4, el_silu_mul(vld1q_f32(g + i + 4), vld1q_f32(u + i + 4)));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, el_silu_mul(vld1q_f32(g + i), vld1q_f32(u + i)));
    if (i < n) {
        float gb[4] = {0}, ub[4] = {0}, yb[4];
        memcpy(gb, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(ub, u + i, (size_t)(n - i) * sizeof(float));
        vst1q_f32(yb, el_silu_mul(vld1q_f32(gb), vld1q_f32(ub)));
        memcpy(y + i, yb, (size_t)(n - i) * sizeof(float));
    }
}

static void el_swiglu_rows(const void *args, int r0, int r1) {
    const el_swiglu_args *a = args;
    void (*fn)(const float *, const float *, float *, int) = el_generic_flag ? el_swiglu_generic : el_swiglu_neon;
    for (int r = r0; r < r1; r++) {
        const float *g = a->gate_up + (size_t)r * 2 * (size_t)a->ff;
        fn(g, g + a->ff, a->y + (size_t)r * (size_t)a->ff, a->ff);
    }
}

typedef struct {
    const el_swiglu_args *a;
    int per;
} el_swiglu_cols_job;

/* a single row (decode) split by columns */
static void el_swiglu_cols_task(void *ctx, int t, int n_tasks) {
    const el_swiglu_cols_job *j = ctx;
    (void)n_tasks;
    int c0 = t * j->per, c1 = EL_MIN(j->a->ff, c0 + j->per);
    const float *g = j->a->gate_up;
    void (*fn)(const float *, const float *, float *, int) = el_generic_flag ? el_swiglu_generic : el_swiglu_neon;
    fn(g + c0, g + j->a->ff + c0, j->a->y + c0, c1 - c0);
}

int el_swiglu(el_pool *pool, const float *gate_up, float *y, int T, int ff) {
    if (!gate_up || !y || T <= 0 || ff <= 0) return EL_EINVAL;
    el_swiglu_args a = {gate_up, y, ff};
    if (T == 1 && ff >= EL_EW_PAR_MIN && pool && el_pool_threads(pool) > 1) {
        el_swiglu_cols_job j = {&a, EL_EW_TASK};
        el_parallel_for(pool, (ff + EL_EW_TASK - 1) / EL_EW_TASK, el_swiglu_cols_task, &j);
    } else {
        el_for_rows(pool, el_swiglu_rows, &a, T, ff);
    }
    return EL_OK;
}

/* ---- softmax --------------------------------------------------------------------------------- */

void el_softmax_generic(float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    float inv = 1.0f / el_exp_sub_sum_generic(x, n, m);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

static void el_softmax_neon(float *x, int n) {
    float32x4_t vm = vdupq_n_f32(-INFINITY);
    int i = 0;
    for (; i + 4 <= n; i += 4) vm = vmaxq_f32(vm, vld1q_f32(x + i));
    float m = vmaxvq_f32(vm);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    float inv = 1.0f / el_exp_sub_sum(x, n, m);
    float32x4_t vi = vdupq_n_f32(inv);
    for (i = 0; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_f32(vld1q_f32(x + i), vi));
    for (; i < n; i++) x[i] *= inv;
}

int el_softmax(float *x, int rows, int n) {
    if (!x || rows <= 0 || n <= 0) return EL_EINVAL;
    void (*fn)(float *, int) = el_generic_flag ? el_softmax_generic : el_softmax_neon;
    for (int r = 0; r < rows; r++) fn(x + (size_t)r * (size_t)n, n);
    return EL_OK;
}

/* ---- add ------------------------------------------------------------------------------------- */

void el_add_generic(const float *a, const float *b, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

static void el_add_neon(const float *a, const float *b, float *y, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        float32x4_t a0 = vld1q_f32(a + i), a1 = vld1q_f32(a + i + 4), a2 = vld1q_f32(a + i + 8),
                    a3 = vld1q_f32(a + i + 12);
        float32x4_t b0 = vld1q_f32(b + i), b1 = vld1q_f32(b + i + 4), b2 = vld1q_f32(b + i + 8),
                    b3 = vld1q_f32(b + i + 12);
        vst1q_f32(y + i, vaddq_f32(a0, b0));
        vst1q_f32(y + i + 4, vaddq_f32(a1, b1));
        vst1q_f32(y + i + 8, vaddq_f32(a2, b2));
        vst1q_f32(y + i + 12, vaddq_f32(a3, b3));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vaddq_f32(vld1q_f32(a + i), vld1q_f32(b + i)));
    for (; i < n; i++) y[i] = a[i] + b[i];
}

int el_add(const float *a, const float *b, float *y, size_t n) {
    if (!a || !b || !y) return EL_EINVAL;
    (el_generic_flag ? el_add_generic : el_add_neon)(a, b, y, n);
    return EL_OK;
}
