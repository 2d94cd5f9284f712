/* The arithmetic peak of one core, for `edgellm profile`: independent chains of the widest
 * multiply-accumulate this build can issue, so that nothing but the SIMD pipes limits them.
 * The caller times el_peak_probe(kind, iters) on one pinned thread; ops counts every multiply
 * and every add (2 per MAC), as GEMM FLOPS are counted.
 *
 * Why measure it: the nominal figure (clock x lanes x an assumed count of SIMD pipes) can miss
 * either way. A Zen 5 core runs 512-bit FMAs and VPDPBUSD at two per cycle near 4 GHz: 251 GFLOPS
 * and 996 GOPS measured, three times the nominal 83 / 332 (256-bit at the 2.6 GHz base clock),
 * so a GEMM efficiency quoted against the nominal figure flattered it threefold.
 *
 * 12 chains: FMA latency is about 4 cycles on current big cores, which issue two to four of them
 * per cycle, so 12 independent chains keep the pipes busy. Each chain
 * multiplies by a value just below 1 and adds a small one, so fp values stay finite however
 * long it runs; the results go to sink so that the compiler keeps every operation. */
#include "el_common.h"

#if EL_SIMDE && defined(__AVX2__)
#include <immintrin.h>
#endif

#define EL_PEAK_CHAINS 12

#define EL_CHAINS(OP)                                                                                    \
    do {                                                                                                 \
        for (long it = 0; it < iters; it++) {                                                            \
            a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5);                 \
            a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9); a10 = OP(a10); a11 = OP(a11);             \
        }                                                                                                \
    } while (0)

/* the 12 chains summed (into the sink) with ADD */
#define EL_SUM12(ADD) \
    ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))), ADD(ADD(a8, a9), ADD(a10, a11)))

/* chains of `type`, each started from a different value so the compiler cannot merge them */
#define EL_CHAIN_VARS(type, init) type a0 = init(1), a1 = init(2), a2 = init(3), a3 = init(4), a4 = init(5), \
    a5 = init(6), a6 = init(7), a7 = init(8), a8 = init(9), a9 = init(10), a10 = init(11), a11 = init(12)

/* ---- fp32 ------------------------------------------------------------------------------------ */
static double el_peak_fp32(long iters, volatile float *sink, float mul, float add) {
#if EL_SIMDE && defined(__AVX512F__)
    const __m512 m = _mm512_set1_ps(mul), c = _mm512_set1_ps(add);
#define EL_I(k) _mm512_set1_ps(add * (float)(k))
#define EL_OP(a) _mm512_fmadd_ps(a, m, c)
    EL_CHAIN_VARS(__m512, EL_I);
    EL_CHAINS(EL_OP);
    *sink = _mm512_reduce_add_ps(EL_SUM12(_mm512_add_ps));
    return (double)iters * EL_PEAK_CHAINS * 16 * 2;
#undef EL_I
#undef EL_OP
#elif EL_SIMDE && defined(__AVX2__) && defined(__FMA__)
    const __m256 m = _mm256_set1_ps(mul), c = _mm256_set1_ps(add);
#define EL_I(k) _mm256_set1_ps(add * (float)(k))
#define EL_OP(a) _mm256_fmadd_ps(a, m, c)
    EL_CHAIN_VARS(__m256, EL_I);
    EL_CHAINS(EL_OP);
    const __m256 s = EL_SUM12(_mm256_add_ps);
    *sink = s[0] + s[7];
    return (double)iters * EL_PEAK_CHAINS * 8 * 2;
#undef EL_I
#undef EL_OP
#else
    const float32x4_t m = vdupq_n_f32(mul), c = vdupq_n_f32(add);
#define EL_I(k) vdupq_n_f32(add * (float)(k))
#define EL_OP(a) vfmaq_f32(c, a, m)
    EL_CHAIN_VARS(float32x4_t, EL_I);
    EL_CHAINS(EL_OP);
    *sink = vaddvq_f32(EL_SUM12(vaddq_f32));
    return (double)iters * EL_PEAK_CHAINS * 4 * 2;
#undef EL_I
#undef EL_OP
#endif
}

/* ---- fp16: Arm fp16 vector arithmetic only (x86 has no fp16 FMA here; SIMDe would emulate it
 * in fp32 and time the emulation) ---------------------------------------------------------------- */
#if !EL_SIMDE && defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC)
#define EL_PEAK_HAS_FP16 1
static double el_peak_fp16(long iters, volatile float *sink, float mul, float add) {
    const float16x8_t m = vdupq_n_f16((float16_t)mul), c = vdupq_n_f16((float16_t)add);
#define EL_I(k) vdupq_n_f16((float16_t)(add * (float)(k)))
#define EL_OP(a) vfmaq_f16(c, a, m)
    EL_CHAIN_VARS(float16x8_t, EL_I);
    EL_CHAINS(EL_OP);
    *sink = vaddvq_f32(vcvt_f32_f16(vget_low_f16(EL_SUM12(vaddq_f16))));
    return (double)iters * EL_PEAK_CHAINS * 8 * 2;
#undef EL_I
#undef EL_OP
}
#else
#define EL_PEAK_HAS_FP16 0
#endif

/* ---- int8: dot products into int32 (sums wrap: only the timing matters) ------------------------- */
static double el_peak_int8(long iters, volatile float *sink, int8_t bv) {
#if EL_SIMDE && defined(__AVX512VNNI__)
    const __m512i u = _mm512_set1_epi8(bv), s = _mm512_set1_epi8((char)(bv + 1));
#define EL_I(k) _mm512_set1_epi32(k)
#define EL_OP(a) _mm512_dpbusd_epi32(a, u, s)
    EL_CHAIN_VARS(__m512i, EL_I);
    EL_CHAINS(EL_OP);
    *sink = (float)_mm512_reduce_add_epi32(EL_SUM12(_mm512_add_epi32));
    return (double)iters * EL_PEAK_CHAINS * 64 * 2;
#undef EL_I
#undef EL_OP
#elif EL_SIMDE && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
    const __m256i u = _mm256_set1_epi8(bv), s = _mm256_set1_epi8((char)(bv + 1));
#define EL_I(k) _mm256_set1_epi32(k)
#define EL_OP(a) _mm256_dpbusd_avx_epi32(a, u, s)
    EL_CHAIN_VARS(__m256i, EL_I);
    EL_CHAINS(EL_OP);
    const __m256i t = EL_SUM12(_mm256_add_epi32);
    *sink = (float)(_mm256_extract_epi32(t, 0) + _mm256_extract_epi32(t, 7));
    return (double)iters * EL_PEAK_CHAINS * 32 * 2;
#undef EL_I
#undef EL_OP
#elif EL_SIMDE && defined(__AVX2__)
    /* VPMADDUBSW, 32 MACs, as the AVX2 GEMM tiles issue it; the chain runs through its signed
     * operand (with loop-invariant operands the compiler would hoist it out of the loop) */
    const __m256i u = _mm256_set1_epi8(bv);
#define EL_I(k) _mm256_set1_epi16((short)(k))
#define EL_OP(a) _mm256_maddubs_epi16(u, a)
    EL_CHAIN_VARS(__m256i, EL_I);
    EL_CHAINS(EL_OP);
    *sink = (float)_mm256_extract_epi16(EL_SUM12(_mm256_add_epi16), 0);
    return (double)iters * EL_PEAK_CHAINS * 32 * 2;
#undef EL_I
#undef EL_OP
#elif EL_DOTPROD
    const int8x16_t u = vdupq_n_s8(bv), s = vdupq_n_s8((int8_t)(bv + 1));
#define EL_I(k) vdupq_n_s32(k)
#define EL_OP(a) vdotq_s32(a, u, s)
    EL_CHAIN_VARS(int32x4_t, EL_I);
    EL_CHAINS(EL_OP);
    *sink = (float)vaddvq_s32(EL_SUM12(vaddq_s32));
    return (double)iters * EL_PEAK_CHAINS * 16 * 2;
#undef EL_I
#undef EL_OP
#else
    /* Armv8.0: SMLAL, 8 widening MACs per instruction, as the base variant's kernels use it */
    const int8x8_t u = vdup_n_s8(bv), s = vdup_n_s8((int8_t)(bv + 1));
#define EL_I(k) vdupq_n_s16((int16_t)(k))
#define EL_OP(a) vmlal_s8(a, u, s)
    EL_CHAIN_VARS(int16x8_t, EL_I);
    EL_CHAINS(EL_OP);
    *sink = (float)vaddvq_s16(EL_SUM12(vaddq_s16));
    return (double)iters * EL_PEAK_CHAINS * 8 * 2;
#undef EL_I
#undef EL_OP
#endif
}

int el_peak_probe(int kind, long iters, double *ops) {
    /* the operands come through volatiles: constants would let the compiler fold the chains */
    static volatile float mul = 0.999f, add = 1e-3f, sink;
    static volatile int8_t b = 3;
    if (!ops || iters <= 0) return EL_EINVAL;
    switch (kind) {
    case EL_PEAK_FP32: *ops = el_peak_fp32(iters, &sink, mul, add); return EL_OK;
    case EL_PEAK_FP16:
#if EL_PEAK_HAS_FP16
        *ops = el_peak_fp16(iters, &sink, mul, add);
        return EL_OK;
#else
        return EL_EUNSUPPORTED;
#endif
    case EL_PEAK_INT8: *ops = el_peak_int8(iters, &sink, b); return EL_OK;
    default: return EL_EINVAL;
    }
}
