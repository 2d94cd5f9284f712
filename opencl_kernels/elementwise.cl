// Elementwise kernels of the opencl unit: rmsnorm, rope, swiglu, add, softmax.
// Host code: edgellm/backends/opencl_elementwise.py. Ground truth: edgellm/backends/reference.py.
//
// Written for Mali Valhall (G78: 16-wide warps, no dedicated local memory: __local lives in the
// same L1/L2 as __global, so a work-group reduction costs cache traffic and barriers, not a
// scarce on-chip store). Every kernel accumulates in fp32; the program is built without
// -cl-fast-relaxed-math, so exp/rsqrt are the full-precision builtins (<= 3 / 2 ulp).
//
// Vector loads: vload4/vstore4 need only float alignment (4 bytes), so a row whose length is not a
// multiple of 4 still takes the float4 path for its body (rows then start at 4-byte but not 16-byte
// boundaries: slower on Mali, still correct) and a scalar tail for its last d % 4 elements.
//
// Work-group sizes: the reductions (rmsnorm, softmax) run one work-group of RED_WG work-items per
// row (RED_WG is a -D define set by the host, 64 = four Mali warps). The pure maps (rope, swiglu,
// add) are 1-D over (row, group of 4 elements) and the host launches them with the same 64-wide
// groups, global size padded up; items past the end return at once (no barrier in those kernels).

#ifndef RED_WG
#define RED_WG 64
#endif

// The sum of v over the work-group, returned to every item. part: __local float[RED_WG].
// RED_WG is a power of two (the host checks). The trailing barrier lets the caller reuse part.
inline float wg_sum(float v, __local float *part) {
    const int lid = get_local_id(0);
    part[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_WG / 2; s > 0; s >>= 1) {
        if (lid < s) part[lid] += part[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

inline float wg_max(float v, __local float *part) {
    const int lid = get_local_id(0);
    part[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_WG / 2; s > 0; s >>= 1) {
        if (lid < s) part[lid] = fmax(part[lid], part[lid + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// x, y (T, d); w (d,). One work-group per row: y = x / sqrt(mean(x^2) + eps) * w.
// Why a work-group per row rather than a work-item per row: the latency-critical call is decode,
// T = 1, where a work-item per row would leave one thread of the whole GPU reading d floats
// serially. 64 items per row read the row in parallel (coalesced float4s) and pay one 6-step
// tree reduction; for a prefill chunk T work-groups fill the cores anyway.
__kernel void el_rmsnorm(__global const float *x, __global const float *w, __global float *y,
                         const int d, const float eps) {
    __local float part[RED_WG];
    const int lid = get_local_id(0);
    const size_t row = get_group_id(0);
    __global const float *xr = x + row * d;
    __global float *yr = y + row * d;
    const int d4 = d >> 2;
    float4 acc4 = (float4)(0.0f);
    for (int i = lid; i < d4; i += RED_WG) {
        const float4 v = vload4(i, xr);
        acc4 = fma(v, v, acc4);
    }
    float acc = (acc4.x + acc4.y) + (acc4.z + acc4.w);
    for (int i = 4 * d4 + lid; i < d; i += RED_WG) acc = fma(xr[i], xr[i], acc);
    const float ms = wg_sum(acc, part) / (float)d;
    const float scale = rsqrt(ms + eps);
    for (int i = lid; i < d4; i += RED_WG) vstore4(vload4(i, xr) * scale * vload4(i, w), i, yr);
    for (int i = 4 * d4 + lid; i < d; i += RED_WG) yr[i] = xr[i] * scale * w[i];
}

// x, y (T, heads, hd); cs, sn (T, hr) with rope_dim = 2 * hr <= hd (hr, not `half`: a type name).
// neox = 0 rotates pairs (2i, 2i+1); neox = 1 pairs (i, i + hr). Elements rope_dim..hd-1 are copied.
// One work-item per (row = t * heads + h, group g): g < n_rot rotates pairs 4g..4g+3 (a float4 of
// cos and sin each), g >= n_rot copies 4 of the unrotated elements. n_groups = n_rot + n_copy.
__kernel void el_rope(__global const float *x, __global float *y, __global const float *cs,
                      __global const float *sn, const int heads, const int hd, const int hr,
                      const int n_rot, const int n_groups, const int neox, const int n_items) {
    const int gid = get_global_id(0);
    if (gid >= n_items) return;
    const int row = gid / n_groups;
    const int g = gid - row * n_groups;
    const int t = row / heads;
    __global const float *xr = x + (size_t)row * hd;
    __global float *yr = y + (size_t)row * hd;
    __global const float *c = cs + (size_t)t * hr;
    __global const float *s = sn + (size_t)t * hr;
    if (g < n_rot) {
        const int j = 4 * g;
        if (j + 4 <= hr) {
            const float4 cc = vload4(g, c), ss = vload4(g, s);
            if (neox) {
                const float4 a = vload4(0, xr + j), b = vload4(0, xr + hr + j);
                vstore4(a * cc - b * ss, 0, yr + j);
                vstore4(a * ss + b * cc, 0, yr + hr + j);
            } else {
                const float8 v = vload8(g, xr);               // elements 2j .. 2j+7
                const float4 a = v.even, b = v.odd;
                const float4 ra = a * cc - b * ss, rb = a * ss + b * cc;
                vstore8((float8)(ra.x, rb.x, ra.y, rb.y, ra.z, rb.z, ra.w, rb.w), g, yr);
            }
        } else {
            for (int i = j; i < hr; ++i) {
                const int i0 = neox ? i : 2 * i, i1 = neox ? i + hr : 2 * i + 1;
                const float a = xr[i0], b = xr[i1];
                yr[i0] = a * c[i] - b * s[i];
                yr[i1] = a * s[i] + b * c[i];
            }
        }
    } else {
        const int e = 2 * hr + 4 * (g - n_rot);
        if (e + 4 <= hd) {
            vstore4(vload4(0, xr + e), 0, yr + e);
        } else {
            for (int i = e; i < hd; ++i) yr[i] = xr[i];
        }
    }
}

// gu (T, 2*ff) = [gate | up]; y (T, ff) = silu(gate) * up = gate / (1 + exp(-gate)) * up.
// exp(-gate) overflows to +inf for gate < -88.7: gate / inf = -0, the right limit, no NaN.
// One work-item per (row, group of 4 columns); n_groups = ceil(ff / 4).
__kernel void el_swiglu(__global const float *gu, __global float *y, const int ff, const int n_groups,
                        const int n_items) {
    const int gid = get_global_id(0);
    if (gid >= n_items) return;
    const int row = gid / n_groups;
    const int j = 4 * (gid - row * n_groups);
    __global const float *gr = gu + (size_t)row * 2 * ff;
    __global const float *ur = gr + ff;
    __global float *yr = y + (size_t)row * ff;
    if (j + 4 <= ff) {
        const float4 g = vload4(0, gr + j);
        vstore4(g / (1.0f + exp(-g)) * vload4(0, ur + j), 0, yr + j);
    } else {
        for (int i = j; i < ff; ++i) yr[i] = gr[i] / (1.0f + exp(-gr[i])) * ur[i];
    }
}

// y = a + b over n elements; one work-item per 4 (n_items = ceil(n / 4)).
__kernel void el_add(__global const float *a, __global const float *b, __global float *y, const int n,
                     const int n_items) {
    const int gid = get_global_id(0);
    if (gid >= n_items) return;
    const int j = 4 * gid;
    if (j + 4 <= n) {
        vstore4(vload4(gid, a) + vload4(gid, b), gid, y);
    } else {
        for (int i = j; i < n; ++i) y[i] = a[i] + b[i];
    }
}

// x, y (rows, n): y = exp(x - max) / sum(exp(x - max)) per row, fp32. One work-group per row in
// three sweeps: max (fmax only), y = exp(x - max) with its sum, y *= 1/sum. That is one exp per
// element: an online max/sum in one sweep saves a read but needs a second exp per element to
// rescale, and an exp costs more ALU cycles than a cached float read. The third sweep rereads
// only the elements the same item wrote, so it needs no barrier. A -inf entry gives exactly 0;
// a row of only -inf gives NaN, as numpy's does.
__kernel void el_softmax(__global const float *x, __global float *y, const int n) {
    __local float part[RED_WG];
    const int lid = get_local_id(0);
    const size_t row = get_group_id(0);
    __global const float *xr = x + row * n;
    __global float *yr = y + row * n;
    const int n4 = n >> 2;
    float4 m4 = (float4)(-INFINITY);
    for (int i = lid; i < n4; i += RED_WG) m4 = fmax(m4, vload4(i, xr));
    float m = fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w));
    for (int i = 4 * n4 + lid; i < n; i += RED_WG) m = fmax(m, xr[i]);
    m = wg_max(m, part);
    float4 s4 = (float4)(0.0f);
    for (int i = lid; i < n4; i += RED_WG) {
        const float4 e = exp(vload4(i, xr) - m);
        vstore4(e, i, yr);
        s4 += e;
    }
    float s = (s4.x + s4.y) + (s4.z + s4.w);
    for (int i = 4 * n4 + lid; i < n; i += RED_WG) {
        const float e = exp(xr[i] - m);
        yr[i] = e;
        s += e;
    }
    const float inv = 1.0f / wg_sum(s, part);
    for (int i = lid; i < n4; i += RED_WG) vstore4(vload4(i, yr) * inv, i, yr);
    for (int i = 4 * n4 + lid; i < n; i += RED_WG) yr[i] *= inv;
}
