// y = x @ W^T (+ bias) with W in a GGUF block format (Q4_0, Q4_1, Q8_0), repacked at load time
// (edgellm/backends/opencl_matmul.py, pack()). Written for Mali Valhall (Mali-G78: 16-wide
// warps, a 128-bit load path, registers shared by the threads of a core) and compiled
// unchanged on PoCL's CPU device, where the tests run it. The numpy reference is
// backends/reference.py matmul() on the dequantized weights.
//
// Build-time defines (one program per combination; the host caches them):
//   QTYPE          Q4_0 | Q4_1 | Q8_0                      weight format
//   XQ             0: fp32 activations
//                  1: activations quantized to int8 per 32-block by el_mm_quantize_x, int32
//                     dot products with arm_dot (cl_arm_integer_dot_product_int8); with
//                     neither ROWS nor TM, only el_mm_quantize_x is built
//   EL_DOT_GENERIC 1: arm_dot in plain C (the generic twin), for devices without the extension
//   ROWS, SPLIT    GEMV (el_mm_gemv): output rows per work-item; work-items sharing one row's K
//   WG             GEMV with SPLIT > 1: the work-group size (the local reduction array's size)
//   TM, TN         GEMM (el_mm_gemm): tokens x output rows computed by one work-item
//
// Packed weights, NB = K / 32 blocks per row, NP = N rounded up to 32 (padding rows are zero):
//   wd  (NB, NP)       half    block scale d
//   wm  (NB, NP)       half    block minimum m (Q4_1; a one-element dummy otherwise)
//   wq  (NB, NP, 16)   uchar   Q4_*: byte i = element i (low nibble) | element 16+i (high nibble)
//       (NB, NP, 32)   char    Q8_0
// Block-major, not GGUF's row-major: at one block the rows are adjacent, so neighbouring
// work-items (neighbouring rows) read neighbouring 16-byte pieces, and a row's quants start on
// a 16-byte boundary (GGUF's 18/20/34-byte blocks put them anywhere).
// Activations and output:
//   x   (T, K)   float                      XQ = 0
//   xq  (T, K)   char, xd (T, NB) float     XQ = 1: x ~= xd * xq per block; xs (T, NB) int is
//   xs  (T, NB)  int                        the block's sum of xq (for Q4's offset / minimum)
//   y   (T, N)   float, + bias (N,) when has_bias
//
// Arithmetic: fp32 accumulation everywhere (no fp16 arithmetic; half is only a storage format
// read with vload_half, which is core OpenCL). The GEMM dequantizes each weight once per tile
// (and uses it TM times); the GEMV, which uses each weight once, sums the block's quants times
// x first and scales once per block:
//   Q4_0  sum_i d (q_i - 8) x_i = d (sum q_i x_i - 8 sum x_i)
//   Q4_1  sum_i (d q_i + m) x_i = d sum q_i x_i + m sum x_i
//   Q8_0  sum_i d q_i x_i       = d sum q_i x_i

// Two portability choices, neutral on Mali and worth ~3x on PoCL (whose kernel library is not
// inlined in the build here: each dot() or vloadN() is a call, which also blocks vectorization):
// fp32 dot products written as arithmetic (the same FMAs a GPU compiler emits for dot()), and
// loads through vector pointers. The latter needs the vector's alignment, which the packed
// layout and x's rows (K a multiple of 32) guarantee; vload_half stays (no cl_khr_fp16).
#define DOT4(a, b) (((a).x * (b).x + (a).y * (b).y) + ((a).z * (b).z + (a).w * (b).w))
#define LOAD_VEC(type, p, i) (((const __global type *)(p))[i])

#define Q4_0 1
#define Q4_1 2
#define Q8_0 3
#define QK 32

#ifndef QTYPE
#error "QTYPE must be defined (Q4_0, Q4_1 or Q8_0)"
#endif
#ifndef XQ
#define XQ 0
#endif

#if QTYPE == Q8_0
#define QW 2        // uchar16 words of quants per block
#else
#define QW 1
#endif
#define Q4 (QTYPE == Q4_0 || QTYPE == Q4_1)

#if XQ
#if defined(EL_DOT_GENERIC) && EL_DOT_GENERIC
// The generic twin: what arm_dot computes (4 int8 products summed in int32), in plain C.
inline int el_arm_dot(char4 a, char4 b) {
    return ((int)a.x * b.x + (int)a.y * b.y) + ((int)a.z * b.z + (int)a.w * b.w);
}
#define arm_dot(a, b) el_arm_dot(a, b)
#elif defined(cl_arm_integer_dot_product_int8)
#pragma OPENCL EXTENSION cl_arm_integer_dot_product_int8 : enable
#elif defined(__opencl_c_integer_dot_product_input_4x8bit)
#define arm_dot(a, b) dot(a, b)      // cl_khr_integer_dot_product: the same operation
#else
#error "no int8 dot product on this device: build with -DEL_DOT_GENERIC=1"
#endif

inline int dot16(char16 a, char16 b) {
    return (arm_dot(a.s0123, b.s0123) + arm_dot(a.s4567, b.s4567))
         + (arm_dot(a.s89ab, b.s89ab) + arm_dot(a.scdef, b.scdef));
}
#endif

// -- the weights of one (block, row): scales and quants ------------------------------------
// wi = b * NP + n indexes (block, row). Quants are held as uchar16 words: one per Q4 block
// (32 nibbles), two per Q8_0 block.
#define LOAD_Q(q, wi) do {                                                       \
        (q)[0] = LOAD_VEC(uchar16, wq, (wi) * QW);                               \
        if (QW == 2) (q)[QW - 1] = LOAD_VEC(uchar16, wq, (wi) * QW + QW - 1);    \
    } while (0)

#if QTYPE == Q4_1
#define LOAD_M(m, wi) ((m) = vload_half((wi), wm))
#else
#define LOAD_M(m, wi) ((m) = 0.0f)
#endif

// Chunk j (0..3) of a block as 8 floats of q, and the float4 indices (into the block's 8
// float4 of x) that pair with its two halves. Q4: bytes 4j..4j+3 hold elements 4j..4j+3 (low
// nibbles) and 16+4j..16+4j+3 (high). Q8_0: elements 8j..8j+7.
#define SEL_0(v) (v).s0123
#define SEL_1(v) (v).s4567
#define SEL_2(v) (v).s89ab
#define SEL_3(v) (v).scdef
#if Q4
#define WCHUNK(q, j) (float8)(convert_float4(SEL_##j((q)[0]) & (uchar4)0x0F), \
                              convert_float4(SEL_##j((q)[0]) >> (uchar4)4))
#define XA(j) (j)
#define XB(j) (4 + (j))
#else
#define Q8W_0(q) (q)[0].lo
#define Q8W_1(q) (q)[0].hi
#define Q8W_2(q) (q)[1].lo
#define Q8W_3(q) (q)[1].hi
#define WCHUNK(q, j) convert_float8(as_char8(Q8W_##j(q)))
#define XA(j) (2 * (j))
#define XB(j) (2 * (j) + 1)
#endif

// GEMV: acc += the block's contribution; qx = sum q_i x_i, xsum = sum x_i
#if QTYPE == Q4_0
#define SCALE(acc, d, m, qx, xsum) ((acc) = fma((d), (qx) - 8.0f * (xsum), (acc)))
#elif QTYPE == Q4_1
#define SCALE(acc, d, m, qx, xsum) ((acc) = fma((d), (qx), fma((m), (xsum), (acc))))
#else
#define SCALE(acc, d, m, qx, xsum) ((acc) = fma((d), (qx), (acc)))
#endif

// Dequantized weights (GEMM): q (float8 of quants) -> d (q - 8) | d q + m | d q
#if QTYPE == Q4_0
#define DEQ(q, d, m) fma((float8)(d), (q), (float8)(-8.0f * (d)))
#elif QTYPE == Q4_1
#define DEQ(q, d, m) fma((float8)(d), (q), (float8)(m))
#else
#define DEQ(q, d, m) ((float8)(d) * (q))
#endif

// The same with int8 activations: qx, xs are int32 sums of quants, dx the x block's scale.
// Integers are exact; the int32 sums stay below 32 * 15 * 127 in magnitude.
#if QTYPE == Q4_0
#define SCALE_I8(acc, d, m, qx, dx, xs) ((acc) = fma((d) * (dx), (float)((qx) - 8 * (xs)), (acc)))
#elif QTYPE == Q4_1
#define SCALE_I8(acc, d, m, qx, dx, xs) \
    ((acc) = fma((d) * (dx), (float)(qx), fma((m) * (dx), (float)(xs), (acc))))
#else
#define SCALE_I8(acc, d, m, qx, dx, xs) ((acc) = fma((d) * (dx), (float)(qx), (acc)))
#endif

// Q4: nibbles to int8 (0..15); Q8_0: the quants as they are. wa pairs with x elements 0..15,
// wb with 16..31.
#if Q4
#define WA_I8(q) as_char16((q)[0] & (uchar16)0x0F)
#define WB_I8(q) as_char16((q)[0] >> (uchar16)4)
#else
#define WA_I8(q) as_char16((q)[0])
#define WB_I8(q) as_char16((q)[1])
#endif

#if XQ && !defined(ROWS) && !defined(TM)
// -- activations to int8, per 32-block: one work-item per (block, token) --------------------
// Built alone (XQ=1 with neither ROWS nor TM), one program for every weight type and tile.
// Round to nearest with saturation; scale = max|x| / 127 (ggml's Q8_0 for activations).
__kernel void el_mm_quantize_x(const __global float *restrict x,   // (T, K)
                               __global char *restrict xq,         // (T, K)
                               __global float *restrict xd,        // (T, NB)
                               __global int *restrict xs,          // (T, NB)
                               const int T, const int K)
{
    const int b = get_global_id(0), t = get_global_id(1);
    const int NB = K / QK;
    if (b >= NB || t >= T) return;
    const __global float *p = x + (size_t)t * K + b * QK;
    float4 v[8];
    float4 amax = (float4)0.0f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = vload4(i, p);
        amax = fmax(amax, fabs(v[i]));
    }
    const float mx = fmax(fmax(amax.x, amax.y), fmax(amax.z, amax.w));
    const float d = mx / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int4 sum = (int4)0;
    __global char *o = xq + (size_t)t * K + b * QK;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const char4 c = convert_char4_sat_rte(v[i] * id);
        sum += convert_int4(c);
        vstore4(c, i, o);
    }
    xd[t * NB + b] = d;
    xs[t * NB + b] = (sum.x + sum.y) + (sum.z + sum.w);
}
#endif

#if defined(ROWS)
// -- GEMV (decode): ROWS output rows per work-item, SPLIT work-items per row ----------------
// Memory-bound: every weight byte is read once per token, so the aim is many 16-byte loads in
// flight. SPLIT > 1 spreads one row's blocks over several work-items (more threads when N is
// small) and sums their partials through local memory once, after the loop. Work-item lid =
// s * RG + rg: at one block the RG row groups of a work-group read adjacent memory.
#ifndef SPLIT
#define SPLIT 1
#endif
#if SPLIT > 1
#ifndef WG
#error "GEMV with SPLIT > 1 needs WG (the work-group size)"
#endif
#define RG (WG / SPLIT)
__attribute__((reqd_work_group_size(WG, 1, 1)))
#endif
__kernel void el_mm_gemv(
#if XQ
    const __global char *restrict xq,    // (T, K)
    const __global float *restrict xd,   // (T, NB)
    const __global int *restrict xs,     // (T, NB)
#else
    const __global float *restrict x,    // (T, K)
#endif
    const __global half *restrict wd,    // (NB, NP)
    const __global half *restrict wm,    // (NB, NP) or dummy
    const __global uchar *restrict wq,   // (NB, NP, 16 * QW)
    const __global float *restrict bias, // (N,) when has_bias
    const int has_bias,
    __global float *restrict y,          // (T, N)
    const int T, const int K, const int N, const int NP)
{
#if SPLIT > 1
    const int lid = get_local_id(0);
    const int rg = lid % RG, s = lid / RG;
    const int r0 = (get_group_id(0) * RG + rg) * ROWS;
#else
    const int s = 0;
    const int r0 = get_global_id(0) * ROWS;
    if (r0 >= N) return;
#endif
    const int t = get_global_id(1);
    const int NB = K / QK;
    // a work-item past the last row (only with SPLIT > 1: it must reach the barrier) reads
    // padding rows; its result is dropped
    const int rl = min(r0, NP - ROWS);
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;

    for (int b = s; b < NB; b += SPLIT) {
#if XQ
        const char16 xa = LOAD_VEC(char16, xq + (size_t)t * K + b * QK, 0);
        const char16 xb = LOAD_VEC(char16, xq + (size_t)t * K + b * QK, 1);
        const float dx = xd[t * NB + b];
        const int xsum = xs[t * NB + b];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int wi = b * NP + rl + r;
            uchar16 q[QW];
            LOAD_Q(q, wi);
            float m;
            LOAD_M(m, wi);
            const int qx = dot16(WA_I8(q), xa) + dot16(WB_I8(q), xb);
            SCALE_I8(acc[r], vload_half(wi, wd), m, qx, dx, xsum);
        }
#else
        const __global float *xp = x + (size_t)t * K + b * QK;
        float4 xv[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) xv[i] = LOAD_VEC(float4, xp, i);
#if Q4
        const float4 x4 = ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7]));
        const float xsum = (x4.x + x4.y) + (x4.z + x4.w);
#else
        const float xsum = 0.0f;
#endif
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int wi = b * NP + rl + r;
            uchar16 q[QW];
            LOAD_Q(q, wi);
            float m;
            LOAD_M(m, wi);
            float8 w;
            float qx = 0.0f;
            w = WCHUNK(q, 0); qx += DOT4(w.lo, xv[XA(0)]) + DOT4(w.hi, xv[XB(0)]);
            w = WCHUNK(q, 1); qx += DOT4(w.lo, xv[XA(1)]) + DOT4(w.hi, xv[XB(1)]);
            w = WCHUNK(q, 2); qx += DOT4(w.lo, xv[XA(2)]) + DOT4(w.hi, xv[XB(2)]);
            w = WCHUNK(q, 3); qx += DOT4(w.lo, xv[XA(3)]) + DOT4(w.hi, xv[XB(3)]);
            SCALE(acc[r], vload_half(wi, wd), m, qx, xsum);
        }
#endif
    }

#if SPLIT > 1
    __local float red[WG * ROWS];    // (SPLIT, RG, ROWS)
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) red[lid * ROWS + r] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (s != 0) return;
    for (int s2 = 1; s2 < SPLIT; ++s2) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] += red[(s2 * RG + rg) * ROWS + r];
    }
#endif
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = r0 + r;
        if (n < N) y[(size_t)t * N + n] = acc[r] + (has_bias ? bias[n] : 0.0f);
    }
}
#endif  // ROWS

#if defined(TM) && defined(TN)
// -- GEMM (prefill): a TM x TN tile of y per work-item ----------------------------------------
// Each weight block is loaded once per tile and dequantized once (XQ = 0: to fp32, 8 weights
// at a time; XQ = 1: quants to int8, scales applied per block), then reused against TM
// tokens: weight loads per FMA fall by TM, x loads by TN (x is shared by the work-group's
// work-items and stays in L1). No local memory and no barrier: on Mali local memory is the
// same cache as global, and a barrier only costs here.
__kernel void el_mm_gemm(
#if XQ
    const __global char *restrict xq,    // (T, K)
    const __global float *restrict xd,   // (T, NB)
    const __global int *restrict xs,     // (T, NB)
#else
    const __global float *restrict x,    // (T, K)
#endif
    const __global half *restrict wd,    // (NB, NP)
    const __global half *restrict wm,    // (NB, NP) or dummy
    const __global uchar *restrict wq,   // (NB, NP, 16 * QW)
    const __global float *restrict bias, // (N,) when has_bias
    const int has_bias,
    __global float *restrict y,          // (T, N)
    const int T, const int K, const int N, const int NP)
{
    const int n0 = get_global_id(0) * TN;
    const int t0 = get_global_id(1) * TM;
    if (n0 >= N) return;
    const int NB = K / QK;
    // NP is a multiple of 32 and TN divides 32, so rows n0..n0+TN-1 exist (padding past N).
    // Tokens past T (the last tile) recompute token T-1: loads stay in bounds with no branch
    // in the loop; the stores are dropped.
    int tr[TM];
    #pragma unroll
    for (int t = 0; t < TM; ++t) tr[t] = min(t0 + t, T - 1);

    float acc[TM][TN];
    #pragma unroll
    for (int t = 0; t < TM; ++t) {
        #pragma unroll
        for (int n = 0; n < TN; ++n) acc[t][n] = 0.0f;
    }

    for (int b = 0; b < NB; ++b) {
        float d[TN], m[TN];
        uchar16 q[TN][QW];
        #pragma unroll
        for (int n = 0; n < TN; ++n) {
            const int wi = b * NP + n0 + n;
            d[n] = vload_half(wi, wd);
            LOAD_M(m[n], wi);
            LOAD_Q(q[n], wi);
        }
#if XQ
        char16 wa[TN], wb[TN];
        #pragma unroll
        for (int n = 0; n < TN; ++n) {
            wa[n] = WA_I8(q[n]);
            wb[n] = WB_I8(q[n]);
        }
        #pragma unroll
        for (int t = 0; t < TM; ++t) {
            const __global char *xp = xq + (size_t)tr[t] * K + b * QK;
            const char16 xa = LOAD_VEC(char16, xp, 0), xb = LOAD_VEC(char16, xp, 1);
            const float dx = xd[tr[t] * NB + b];
            const int xsum = xs[tr[t] * NB + b];
            #pragma unroll
            for (int n = 0; n < TN; ++n) {
                const int qx = dot16(wa[n], xa) + dot16(wb[n], xb);
                SCALE_I8(acc[t][n], d[n], m[n], qx, dx, xsum);
            }
        }
#else
        // chunk j: 8 weights of each of the TN rows dequantized once, against 8 values of each
        // token. d * q (+ m) is exact in fp32 where ggml's dequantization is exact, and rounds
        // once where it rounds once (Q4_1's + m): the same weights as quant.dequantize().
#define GEMM_CHUNK(j) {                                                                   \
            float8 w[TN];                                                                 \
            _Pragma("unroll")                                                             \
            for (int n = 0; n < TN; ++n) w[n] = DEQ(WCHUNK(q[n], j), d[n], m[n]);         \
            _Pragma("unroll")                                                             \
            for (int t = 0; t < TM; ++t) {                                                \
                const __global float *xp = x + (size_t)tr[t] * K + b * QK;                \
                const float4 xa = LOAD_VEC(float4, xp, XA(j));                            \
                const float4 xb = LOAD_VEC(float4, xp, XB(j));                            \
                _Pragma("unroll")                                                         \
                for (int n = 0; n < TN; ++n)                                              \
                    acc[t][n] += DOT4(w[n].lo, xa) + DOT4(w[n].hi, xb);                   \
            }                                                                             \
        }
        GEMM_CHUNK(0)
        GEMM_CHUNK(1)
        GEMM_CHUNK(2)
        GEMM_CHUNK(3)
#undef GEMM_CHUNK
#endif
    }

    #pragma unroll
    for (int t = 0; t < TM; ++t) {
        if (t0 + t >= T) break;
        #pragma unroll
        for (int n = 0; n < TN; ++n) {
            const int col = n0 + n;
            if (col < N) y[(size_t)(t0 + t) * N + col] = acc[t][n] + (has_bias ? bias[col] : 0.0f);
        }
    }
}
#endif  // TM && TN
