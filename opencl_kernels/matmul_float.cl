// y = x @ W^T (+ bias) with W in F32 or F16, repacked at load time
// (edgellm/backends/opencl_matmul.py, pack()); the float twin of matmul_quant.cl, with the
// same GEMV / GEMM structure and knobs. The numpy reference is backends/reference.py matmul().
//
// Build-time defines:
//   FTYPE          F32 | F16                                weight storage
//   ROWS, SPLIT    GEMV (el_mmf_gemv): output rows per work-item; work-items sharing one row's K
//   WG             GEMV with SPLIT > 1: the work-group size (the local reduction array's size)
//   TM, TN         GEMM (el_mmf_gemm): tokens x output rows computed by one work-item
//
// Packed weights, KP = K rounded up to 8, KC = KP / 8 chunks, NP = N rounded up to 32 (padding
// rows and columns are zero):
//   w   (KC, NP, 8)   float (F32) | half (F16, read with vload_half8: no cl_khr_fp16 needed)
// Chunk-major: at one chunk the rows are adjacent, so neighbouring work-items read neighbouring
// 16-byte (F16) or 32-byte (F32) pieces.
// Activations and output:
//   x   (T, KP)  float (the host pads x with zero columns when K is not a multiple of 8)
//   y   (T, N)   float, + bias (N,) when has_bias
// Arithmetic: fp32 multiply-add throughout; F16 values widen exactly to fp32.

// As in matmul_quant.cl: fp32 dot products written as arithmetic and loads through vector
// pointers (aligned: 8-value chunks, x rows of KP, a multiple of 8, floats), because PoCL's
// library calls are not inlined here; the same code on Mali.
#define DOT4(a, b) (((a).x * (b).x + (a).y * (b).y) + ((a).z * (b).z + (a).w * (b).w))
#define LOAD_VEC(type, p, i) (((const __global type *)(p))[i])

#define F32 1
#define F16 2

#ifndef FTYPE
#error "FTYPE must be defined (F32 or F16)"
#endif
#if FTYPE == F16
#define WTYPE half
#define LOAD_W(i) vload_half8((i), w)
#else
#define WTYPE float
#define LOAD_W(i) LOAD_VEC(float8, w, i)
#endif

#if defined(ROWS)
// -- GEMV (decode): ROWS output rows per work-item, SPLIT work-items per row ----------------
// See el_mm_gemv in matmul_quant.cl: lid = s * RG + rg, partials summed once after the loop.
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
__kernel void el_mmf_gemv(const __global float *restrict x,     // (T, KP)
                          const __global WTYPE *restrict w,     // (KC, NP, 8)
                          const __global float *restrict bias,  // (N,) when has_bias
                          const int has_bias,
                          __global float *restrict y,           // (T, N)
                          const int T, const int KP, const int N, const int NP)
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
    const int KC = KP / 8;
    const int rl = min(r0, NP - ROWS);     // past the last row: read padding, drop the result
    const __global float *xr = x + (size_t)t * KP;
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;

    for (int c = s; c < KC; c += SPLIT) {
        const float8 xv = LOAD_VEC(float8, xr, c);
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float8 wv = LOAD_W(c * NP + rl + r);
            acc[r] += DOT4(wv.lo, xv.lo) + DOT4(wv.hi, xv.hi);
        }
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
// Each chunk of 8 weights of the TN rows is loaded (and for F16 widened) once and reused
// against TM tokens. No local memory, no barrier.
__kernel void el_mmf_gemm(const __global float *restrict x,     // (T, KP)
                          const __global WTYPE *restrict w,     // (KC, NP, 8)
                          const __global float *restrict bias,  // (N,) when has_bias
                          const int has_bias,
                          __global float *restrict y,           // (T, N)
                          const int T, const int KP, const int N, const int NP)
{
    const int n0 = get_global_id(0) * TN;
    const int t0 = get_global_id(1) * TM;
    if (n0 >= N) return;
    const int KC = KP / 8;
    // rows n0..n0+TN-1 exist (NP is a multiple of 32, TN divides 32); tokens past T recompute
    // token T-1 and are not stored
    const __global float *xr[TM];
    #pragma unroll
    for (int t = 0; t < TM; ++t) xr[t] = x + (size_t)min(t0 + t, T - 1) * KP;

    float acc[TM][TN];
    #pragma unroll
    for (int t = 0; t < TM; ++t) {
        #pragma unroll
        for (int n = 0; n < TN; ++n) acc[t][n] = 0.0f;
    }

    for (int c = 0; c < KC; ++c) {
        float8 wv[TN];
        #pragma unroll
        for (int n = 0; n < TN; ++n) wv[n] = LOAD_W(c * NP + n0 + n);
        #pragma unroll
        for (int t = 0; t < TM; ++t) {
            const float8 xv = LOAD_VEC(float8, xr[t], c);
            #pragma unroll
            for (int n = 0; n < TN; ++n) acc[t][n] += DOT4(wv[n].lo, xv.lo) + DOT4(wv[n].hi, xv.hi);
        }
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
