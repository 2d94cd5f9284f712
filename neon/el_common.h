/* Internal: intrinsics, feature macros and helpers shared by the kernel files. */
#ifndef EL_COMMON_H
#define EL_COMMON_H

#include "edgellm_neon.h"
#include "el_ranges.h"

#include <string.h>

#if defined(__aarch64__) || defined(__ARM_NEON)
#include <arm_neon.h>
#define EL_SIMDE 0
#else
/* x86 development builds: SIMDe implements the NEON intrinsics on SSE/AVX */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/arm/neon.h>
#define EL_SIMDE 1
#endif

/* The dotprod variant: real SDOT on Armv8.2+ (the compiler defines __ARM_FEATURE_DOTPROD for
 * -march=armv8.2-a+dotprod); on x86 the build defines EL_SIMDE_DOTPROD so the same code paths
 * are compiled and tested through SIMDe's emulation of vdotq_s32. */
#if defined(__ARM_FEATURE_DOTPROD) || defined(EL_SIMDE_DOTPROD)
#define EL_DOTPROD 1
#else
#define EL_DOTPROD 0
#endif
#if defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC) || defined(EL_SIMDE_FP16)
#define EL_FP16 1
#else
#define EL_FP16 0
#endif

extern int el_generic_flag;   /* set by el_use_generic */
/* x86 builds with the AVX-512 GEMVs (qgemv_avx512.h): which of them run (el_x86_gemv), bit 0 the
 * int8-activation GEMVs (Q4, Q8_0), bit 1 the Q8_0 lm_head GEMV; a clear bit runs the AVX2 kernel instead */
extern int el_x86_wide_gemv;
static inline int el_wide_gemv(int bit) { return __atomic_load_n(&el_x86_wide_gemv, __ATOMIC_RELAXED) & bit; }

/* fp16 <-> fp32 without relying on the compiler's _Float16 support (generic twins) */
static inline float el_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {                                   /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* 4 fp16 -> fp32x4, exact. Arm: LDR d + FCVTL (base Armv8.0). SIMDe turns vcvt_f32_f16 into 4
 * scalar conversions plus shuffles (F16 GEMV ran at 3.9 GB/s against 13 for F32; fp16 KV reads
 * made attention 4x slower than fp32), so x86 uses F16C's VCVTPH2PS, the same conversion in one
 * instruction. */
static inline float32x4_t el_f16x4_load(const uint16_t *p) {
#if EL_SIMDE && defined(__F16C__)
    return simde_float32x4_from_m128(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p)));
#else
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#endif
}

/* sum of exp(x[i] - m), x overwritten with the exps: the softmax core shared by el_softmax and
 * attention (elementwise.c) */
float el_exp_sub_sum(float *x, int n, float m);
float el_exp_sub_sum_generic(float *x, int n, float m);

/* Runs fn(args, r0, r1) over rows [0, rows) of about `cols` elements' work each: inline when
 * small, else split over the pool in tasks of a few thousand elements (elementwise.c) */
typedef void (*el_rows_fn)(const void *args, int r0, int r1);
void el_for_rows(el_pool *pool, el_rows_fn fn, const void *args, int rows, int cols);
/* x rows quantized ahead of el_matmul (quant_matmul.c), into the int8 blocks el_matmul makes of
 * them in its scratch, bit for bit. xq: a layout for M rows of K (el_matmul_scratch(M, K) bytes);
 * el_quant_row_xq writes its row r, el_matmul_xq multiplies its rows [row0, row0 + rows). A
 * producer (RMSNorm, SwiGLU) then quantizes each row while the row is in its core's L1, in its
 * own trip through the pool, and the fp32 row need not be stored. */
void el_quant_row_xq(const float *x, void *xq, int M, int K, int r);
int el_matmul_xq(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                 const void *xq, int M, int row0, int rows, int K, float *y, const float *bias);
/* el_attention_pool with token t's q at q + t * q_ld (attention.c): the fused step reads q in
 * place in its q | k | v rows */
int el_attention_pool_ld(el_pool *pool, const float *q, size_t q_ld, float *out, int T, int H, int KVH, int hd,
                         int start, const void *k, const void *v, int kv_type, const int32_t *block_table,
                         int block_tokens, int n_layers, int layer);
/* EL_OK when the chain's parameters are in range (sample.c) */
int el_sampling_check(const el_sampling *s);

/* Stores nr (1..4) lanes of each of nx accumulators into y rows, adding the bias. */
static inline void el_store_tile(const float32x4_t *acc, int nx, int nr, float *y, size_t ldy, const float *bias) {
    float32x4_t bv = vdupq_n_f32(0.0f);
    if (bias) {
        float tmp[4] = {0, 0, 0, 0};
        memcpy(tmp, bias, (size_t)nr * sizeof(float));
        bv = vld1q_f32(tmp);
    }
    for (int c = 0; c < nx; c++) {
        float32x4_t v = vaddq_f32(acc[c], bv);
        if (nr == 4) {
            vst1q_f32(y + c * ldy, v);
        } else {
            float tmp[4];
            vst1q_f32(tmp, v);
            memcpy(y + c * ldy, tmp, (size_t)nr * sizeof(float));
        }
    }
}

/* A software prefetch of lines a loop reads a chunk or a stream distance later. On x86 it goes
 * to L2 (PREFETCHT1): bursts of PREFETCHT0 (a chunk's K/V rows, 64 keys x 3 kv heads) ran the
 * core out of L1 miss slots, and the loads behind them waited (Zen 4, 2 threads, KV from DRAM,
 * paired runs in one process): decode attention at 1,024 keys over 30 layers 1.99 -> 1.31 ms
 * (512: 1.07 -> 0.75, 2,048: 3.77 -> 2.32), the AVX-512 decode GEMV over 30 layers' Q4_1 0.78x
 * (on Zen 4 the AVX2 GEMV runs, el_x86_gemv: it was as fast, 0.99x, and with L2 it went 1.16x,
 * so it keeps L1), a cached 32-token chat turn's tile rows 0.986x. Not everywhere: the AVX2
 * head's Q8_0 GEMV went 1.1 -> 1.4 ms with it and the GEMM tile's next panel lost 3-5% at 32
 * rows (it uses L2 up to EL_G5_PF_L2_ROWS rows only). Arm keeps L1 (PLDL1KEEP) until measured
 * on a device. */
static inline __attribute__((always_inline)) void el_prefetch_ahead(const void *p) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_prefetch(p, 0, 2);
#else
    __builtin_prefetch(p);
#endif
}

/* k per slice of matmul_bqpanel.c's fp32-x GEMM: its panel buffer is (panel width) x 256 fp32,
 * 32 KiB on AVX-512, 16 KiB on NEON, and a task's x rows are read 256 k at a time */
#define EL_BQP_KC 256
#define EL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define EL_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
