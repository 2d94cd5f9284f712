// Causal GQA attention of the opencl unit. Host code: edgellm/backends/opencl_attention.py.
// Ground truth: reference.attention (q (T, H, hd) at positions start..start+T-1; query t sees keys
// 0..start+t; head h reads kv head h / (H / KVH)).
//
// Two K/V layouts, same arithmetic:
//   dense  k, v (KVH, n, hd)                                  the engine's gathered path
//   pool   k, v (n_blocks, n_layers, bt, KVH, hd)             kv/pool.py's arena, read in place:
//          position p of the sequence is row p % bt of block table[p / bt]
//
// Compile-time defines (one program per model shape):
//   HEAD_DIM  1..256: the per-item accumulator and query are HEAD_DIM floats in private memory,
//             loops over them fully unrolled so they can live in registers. (On Mali-G78 a thread
//             has at most 64 registers; at head_dim >= 64 q + acc exceed that and the compiler
//             spills part of them to the L1-backed stack: correct, slower. Not measured here.)
//   KV_F16    1: K/V stored as half, read with vload_half4 (OpenCL 1.2 core, no cl_khr_fp16
//             needed) and converted exactly to float; 0: float.
//
// Softmax is online (a running max m, running sum l, and acc rescaled when m grows): no n-sized
// score row per query, no n-by-n matrix, fp32 throughout. The scale 1/sqrt(hd) is folded into q,
// as the reference does, and passed in from the host so both round it the same way.
//
// Two launch shapes per layout:
//   *_rows   one work-item per (t, h) row, 1-D, groups of 64 (prefill: T * H rows fill the GPU).
//            Rows are ordered h fastest, so the G heads sharing a kv head are neighbours in a warp
//            and read the same K/V lines.
//   *_split  work-group (S, R): S items split one row's keys (item s takes keys s, s+S, ...:
//            interleaved, so causal rows of different length stay balanced), R rows per group,
//            S * R a multiple of 16. Each item keeps its own (m, l, acc); they are merged through
//            local memory at the end (one barrier, no per-key synchronisation). For decode, where
//            T * H rows alone would occupy a few dozen threads of the GPU.

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined (-D HEAD_DIM=<head_dim>)"
#endif
#ifndef KV_F16
#define KV_F16 0
#endif

#define NV (HEAD_DIM / 4)          // float4 groups of a head row
#define NT (HEAD_DIM % 4)          // scalar tail

#if KV_F16
typedef half kv_t;
#define LOAD4(p) vload_half4(0, (p))
#define LOAD1(p) vload_half(0, (p))
#else
typedef float kv_t;
#define LOAD4(p) vload4(0, (p))
#define LOAD1(p) (*(p))
#endif

// The running state of one item's softmax over the keys it has seen.
typedef struct {
    float m;                       // max score so far (-inf before the first key)
    float l;                       // sum of exp(score - m)
    float4 a[NV > 0 ? NV : 1];     // sum of exp(score - m) * v, float4 part
    float at[4];                   // scalar tail (NT used)
} attn_state;

inline void state_init(attn_state *st) {
    st->m = -INFINITY;
    st->l = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) st->a[i] = (float4)(0.0f);
#pragma unroll
    for (int i = 0; i < 4; ++i) st->at[i] = 0.0f;
}

// One key: score = q . k, then the online softmax update with v.
inline void state_key(attn_state *st, const float4 *q4, const float *qt, __global const kv_t *kp,
                      __global const kv_t *vp) {
    float4 d4 = (float4)(0.0f);
#pragma unroll
    for (int i = 0; i < NV; ++i) d4 = fma(q4[i], LOAD4(kp + 4 * i), d4);
    float s = (d4.x + d4.y) + (d4.z + d4.w);
#pragma unroll
    for (int i = 0; i < NT; ++i) s = fma(qt[i], LOAD1(kp + 4 * NV + i), s);
    if (s > st->m) {               // first key: exp(-inf) = 0 clears nothing that is not 0 already
        const float c = exp(st->m - s);
        st->l *= c;
#pragma unroll
        for (int i = 0; i < NV; ++i) st->a[i] *= c;
#pragma unroll
        for (int i = 0; i < NT; ++i) st->at[i] *= c;
        st->m = s;
    }
    const float p = exp(s - st->m);
    st->l += p;
#pragma unroll
    for (int i = 0; i < NV; ++i) st->a[i] = fma((float4)(p), LOAD4(vp + 4 * i), st->a[i]);
#pragma unroll
    for (int i = 0; i < NT; ++i) st->at[i] = fma(p, LOAD1(vp + 4 * NV + i), st->at[i]);
}

inline void load_q(__global const float *q, const float scale, float4 *q4, float *qt) {
#pragma unroll
    for (int i = 0; i < NV; ++i) q4[i] = vload4(i, q) * scale;
#pragma unroll
    for (int i = 0; i < 4; ++i) qt[i] = i < NT ? q[4 * NV + i] * scale : 0.0f;
}

// Element offset of (position j, kv head kvh) in the dense layout (KVH, n, hd).
inline size_t dense_off(const int j, const int kvh, const int n) {
    return ((size_t)kvh * n + j) * HEAD_DIM;
}

// Element offset of (position j, kv head kvh) of `layer` in the pool arena
// (n_blocks, n_layers, bt, KVH, hd), through the block table.
inline size_t pool_off(const int j, const int kvh, __global const int *table, const int bt, const int n_layers,
                       const int layer, const int kvh_n) {
    const int blk = j / bt;
    return ((((size_t)table[blk] * n_layers + layer) * bt + (j - blk * bt)) * kvh_n + kvh) * HEAD_DIM;
}

inline void store_row(__global float *o, const attn_state *st) {
#pragma unroll
    for (int i = 0; i < NV; ++i) vstore4(st->a[i] / st->l, i, o);
#pragma unroll
    for (int i = 0; i < NT; ++i) o[4 * NV + i] = st->at[i] / st->l;
}

// Merge the S partial states of each of the group's R rows (layout of scr: m[R*S], l[R*S],
// acc[R*S][HEAD_DIM]) and write the row. Every item of the group must call it (barriers).
inline void merge_store(const attn_state *st, __local float *scr, __global float *o, const int valid) {
    const int s = get_local_id(0), S = get_local_size(0);
    const int r = get_local_id(1), RS = S * get_local_size(1);
    const int slot = r * S + s;
    __local float *lm = scr, *ll = scr + RS, *la = scr + 2 * RS;
    lm[slot] = st->m;
    ll[slot] = st->l;
    barrier(CLK_LOCAL_MEM_FENCE);
    float M = -INFINITY;
    for (int i = 0; i < S; ++i) M = fmax(M, lm[r * S + i]);
    // an item that saw no key (fewer visible keys than S) has m = -inf and contributes 0
    const float own = st->m > -INFINITY ? exp(st->m - M) : 0.0f;
    __local float *mine = la + (size_t)slot * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < NV; ++i) vstore4(st->a[i] * own, i, mine);
#pragma unroll
    for (int i = 0; i < NT; ++i) mine[4 * NV + i] = st->at[i] * own;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!valid) return;
    float L = 0.0f;
    for (int i = 0; i < S; ++i) {
        const float mi = lm[r * S + i];
        if (mi > -INFINITY) L += ll[r * S + i] * exp(mi - M);
    }
    __local const float *rowacc = la + (size_t)(r * S) * HEAD_DIM;
    for (int d = s; d < HEAD_DIM; d += S) {
        float acc = 0.0f;
        for (int i = 0; i < S; ++i) acc += rowacc[(size_t)i * HEAD_DIM + d];
        o[d] = acc / L;
    }
}

// ---- dense (KVH, n, hd) -------------------------------------------------------------------------

__kernel void attn_dense_rows(__global const float *q, __global const kv_t *k, __global const kv_t *v,
                              __global float *out, const int T, const int H, const int KVH, const int n,
                              const int start, const float scale) {
    const int row = get_global_id(0);
    if (row >= T * H) return;
    const int t = row / H, h = row - t * H, kvh = h / (H / KVH);
    float4 q4[NV > 0 ? NV : 1];
    float qt[4];
    load_q(q + (size_t)row * HEAD_DIM, scale, q4, qt);
    attn_state st;
    state_init(&st);
    const int n_vis = start + t + 1;
    for (int j = 0; j < n_vis; ++j) {
        const size_t off = dense_off(j, kvh, n);
        state_key(&st, q4, qt, k + off, v + off);
    }
    store_row(out + (size_t)row * HEAD_DIM, &st);
}

__kernel void attn_dense_split(__global const float *q, __global const kv_t *k, __global const kv_t *v,
                               __global float *out, const int T, const int H, const int KVH, const int n,
                               const int start, const float scale, __local float *scr) {
    const int row = get_global_id(1), s = get_local_id(0), S = get_local_size(0);
    const int valid = row < T * H;
    const int r = valid ? row : 0;               // padding rows see no key, only join the barriers
    const int t = r / H, h = r - t * H, kvh = h / (H / KVH);
    float4 q4[NV > 0 ? NV : 1];
    float qt[4];
    load_q(q + (size_t)r * HEAD_DIM, scale, q4, qt);
    attn_state st;
    state_init(&st);
    const int n_vis = valid ? start + t + 1 : 0;
    for (int j = s; j < n_vis; j += S) {
        const size_t off = dense_off(j, kvh, n);
        state_key(&st, q4, qt, k + off, v + off);
    }
    merge_store(&st, scr, out + (size_t)r * HEAD_DIM, valid);
}

// ---- pool arena (n_blocks, n_layers, bt, KVH, hd) -------------------------------------------------

__kernel void attn_pool_rows(__global const float *q, __global const kv_t *k, __global const kv_t *v,
                             __global float *out, const int T, const int H, const int KVH,
                             __global const int *table, const int bt, const int n_layers, const int layer,
                             const int start, const float scale) {
    const int row = get_global_id(0);
    if (row >= T * H) return;
    const int t = row / H, h = row - t * H, kvh = h / (H / KVH);
    float4 q4[NV > 0 ? NV : 1];
    float qt[4];
    load_q(q + (size_t)row * HEAD_DIM, scale, q4, qt);
    attn_state st;
    state_init(&st);
    const int n_vis = start + t + 1;
    for (int j = 0; j < n_vis; ++j) {
        const size_t off = pool_off(j, kvh, table, bt, n_layers, layer, KVH);
        state_key(&st, q4, qt, k + off, v + off);
    }
    store_row(out + (size_t)row * HEAD_DIM, &st);
}

__kernel void attn_pool_split(__global const float *q, __global const kv_t *k, __global const kv_t *v,
                              __global float *out, const int T, const int H, const int KVH,
                              __global const int *table, const int bt, const int n_layers, const int layer,
                              const int start, const float scale, __local float *scr) {
    const int row = get_global_id(1), s = get_local_id(0), S = get_local_size(0);
    const int valid = row < T * H;
    const int r = valid ? row : 0;
    const int t = r / H, h = r - t * H, kvh = h / (H / KVH);
    float4 q4[NV > 0 ? NV : 1];
    float qt[4];
    load_q(q + (size_t)r * HEAD_DIM, scale, q4, qt);
    attn_state st;
    state_init(&st);
    const int n_vis = valid ? start + t + 1 : 0;
    for (int j = s; j < n_vis; j += S) {
        const size_t off = pool_off(j, kvh, table, bt, n_layers, layer, KVH);
        state_key(&st, q4, qt, k + off, v + off);
    }
    merge_store(&st, scr, out + (size_t)r * HEAD_DIM, valid);
}
