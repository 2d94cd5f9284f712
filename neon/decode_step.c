/* el_chunk_step / el_decode_step: a chunk of tokens (a prefill chunk, or one decode token)
 * through every layer in one native call.
 *
 * Why: a Python step makes ~12 ctypes calls per layer (~365 for a 30-layer model), each ~10-20 us
 * of interpreter and ctypes work, plus the K/V store through numpy: milliseconds per step spent
 * outside any kernel (a decode token costs ~7 ms in all; a 32-token turn after a cached prefix
 * ~90 ms, of which ~10 ms was this). Here the layer loop runs in C and calls the kernels' public
 * entry points directly (el_rmsnorm, el_matmul, el_rope, el_attention_pool, el_swiglu, el_add), in
 * the order and with the arguments of the per-op path (engine.py ModelRunner._layers), so the
 * results are the same bit for bit: same kernels, same task splits, same pool (a residual add
 * and the RMSNorm after it run row by row in one pass: the same kernels on the same rows). el_use_generic
 * routes those kernels to their twins, and the fp16 K/V store below to its scalar twin.
 *
 * The last layer's output is read only for the rows that need logits: one for a prompt's last
 * chunk, none for the chunks before it or a warm-up (the per-op path's out_rows too). Its K/V
 * are stored for every row, then its attention output, o-projection and FFN run on those rows
 * alone: ~1/n_layers of a prefill's work that nothing reads (llama.cpp skips it the same way).
 *
 * The only new arithmetic is the fp32 -> fp16 rounding of the K/V store, which must equal
 * numpy's astype(float16) (what PoolSequence.write stores): round to nearest even, overflow to
 * inf, subnormal halves rounded the same way. Arm: FCVTN (vcvt_f16_f32) in the default rounding
 * mode. x86 (SIMDe): F16C's VCVTPS2PH with imm 0 (nearest even); SIMDe's own vcvt_f16_f32 is a
 * scalar loop whose rounding we would have to trust, so without F16C the scalar twin runs.
 */
#include "el_common.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* mirrors attention.c's EL_ATTN_MAX_HD: checked here, up front, so that an unsupported head
 * width fails before any K/V row is written */
#define EL_DECODE_MAX_HD 512
#define EL_DECODE_MAX_DIM (1 << 24)
/* tokens of one chunk (the engine's prefill chunk is at most 2048) */
#define EL_CHUNK_MAX_TOKENS (1 << 16)

/* ---- fp32 -> fp16, round to nearest even ---------------------------------------------------- */

/* numpy's npy_floatbits_to_halfbits, step for step: its results are the reference */
static uint16_t el_f32_to_f16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sgn = (uint16_t)((u & 0x80000000u) >> 16);
    const uint32_t exp = u & 0x7f800000u;
    uint32_t sig;
    if (exp >= 0x47800000u) {                       /* overflow, inf, NaN */
        sig = u & 0x007fffffu;
        if (exp == 0x7f800000u && sig != 0) {
            uint16_t h = (uint16_t)(0x7c00u + (sig >> 13));
            return (uint16_t)(sgn + (h == 0x7c00u ? h + 1 : h));  /* keep it a NaN */
        }
        return (uint16_t)(sgn + 0x7c00u);
    }
    if (exp <= 0x38000000u) {                       /* a subnormal half, or zero */
        if (exp < 0x33000000u) return sgn;
        const uint32_t e = exp >> 23;
        sig = 0x00800000u + (u & 0x007fffffu);
        sig >>= (113 - e);
        /* the shift may have dropped up to 11 set bits: a tie only if none was set */
        if ((sig & 0x00003fffu) != 0x00001000u || (u & 0x000007ffu)) sig += 0x00001000u;
        return (uint16_t)(sgn + (uint16_t)(sig >> 13));
    }
    const uint16_t hexp = (uint16_t)((exp - 0x38000000u) >> 13);
    sig = u & 0x007fffffu;
    if ((sig & 0x00003fffu) != 0x00001000u) sig += 0x00001000u;
    /* a carry out of the significand bumps the exponent (up to inf): correct */
    return (uint16_t)(sgn + (uint16_t)(sig >> 13) + hexp);
}

static void el_store_f16_generic(uint16_t *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = el_f32_to_f16_bits(x[i]);
}

static void el_store_f16(uint16_t *y, const float *x, size_t n) {
    size_t i = 0;
#if EL_SIMDE && defined(__F16C__)
    for (; i + 4 <= n; i += 4)
        _mm_storel_epi64((__m128i *)(y + i), _mm_cvtps_ph(_mm_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#elif !EL_SIMDE
    for (; i + 4 <= n; i += 4) vst1_u16(y + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
#endif
    el_store_f16_generic(y + i, x + i, n - i);
}

int el_f32_to_f16(const float *x, uint16_t *y, size_t n) {
    if (n > 0 && (!x || !y)) return EL_EINVAL;
    (el_generic_flag ? el_store_f16_generic : el_store_f16)(y, x, n);
    return EL_OK;
}

/* ---- scratch -------------------------------------------------------------------------------- */

static size_t el_a64(size_t n) { return (n + 63) & ~(size_t)63; }

/* A layer runs over a chunk in slices of S = min(T, EL_CHUNK_SLICE) rows, so every buffer but
 * h and xq_h holds one slice: a chunk's scratch grows little with T (SmolLM2: 24.4 KiB a token, 14.5
 * MiB at 608 tokens before slices, 6.9 MiB with them, 4.4 MiB with the FFN pieces below). A
 * slice's attention reads the K/V rows earlier slices of the same layer stored. Why 256 and
 * not 128 (4.1 MiB before the FFN pieces): each slice reads the layer's weights
 * again, and in slow-memory stretches 128-row slices cost 3-5% of a 433-512 token prefill,
 * 256-row ones ~1%; a chunk of up to 256 tokens runs as before.
 *
 * Inside a slice the FFN runs in pieces of EL_CHUNK_FFN_ROWS rows: gate|up and the SwiGLU
 * output are 3 * ff floats a row, the widest buffers of a layer (SmolLM2: 4.7 MiB for 256 rows,
 * 2.4 for 128). A piece re-reads the FFN weights, which the piece before it has just brought
 * into the caches, and a GEMM of 128 rows runs as fast per row as one of 256 (x86 host,
 * 3072 x 576 and 576 x 1536 Q4_1). Every row of a chunk of 2+ rows runs the GEMM tile, whose
 * rows do not depend on their neighbours, and the prefill attention tile: no slice, FFN piece
 * or el_matmul x chunk (128 rows, K up to 4096) is left with one row, which would run the GEMV
 * and the decode attention (257 rows: slices of 255 and 2). A prompt row's result is then the
 * same whatever chunk it came in (ModelRunner.forward keeps prompt chunks of one row out too). */
#define EL_CHUNK_SLICE 256
#define EL_CHUNK_FFN_ROWS 128

typedef struct {
    float *h;      /* (T, d) normed input of a projection: the next layer's, for every row (fp32
                    * projections; block-quantized ones read xq_h); el_chunk_logits' normed row */
    float *o;      /* (S, d) attn_out / down output, added to x */
    /* the attention half of a layer; dead once attn_out has read att */
    float *qkv;    /* (S, H*hd + 2*KVH*hd) q | k | v per row; q and k rotated in place, q read
                    * there by attention (el_attention_pool_ld) */
    float *att;    /* (S, H*hd) attention output */
    /* the FFN half, in the same bytes as the attention half */
    float *gu;     /* (F, 2*ff) gate | up, F = min(S, EL_CHUNK_FFN_ROWS): one FFN piece */
    float *act;    /* (F, ff) swiglu output */
    void *mm;      /* el_matmul's scratch for attn_out (S rows of H*hd) and the head (1 row of d);
                    * the SwiGLU output quantized for down (el_matmul_xq layout, F rows of ff) */
    void *xq_h;    /* h quantized for block-type projections: el_matmul_xq layout, T rows of d */
} el_chunk_bufs;

#define EL_CHUNK_NBUF 8

/* Region sizes in bytes, in el_chunk_bufs order; the layout starts 64-byte aligned.
 *
 * The slice-sized regions are sized for EL_CHUNK_SLICE rows whatever T (> 1), so they lie at the
 * same offsets for every chunk, and a chunk touches only their first rows: the pages ever touched
 * are those of the largest chunk, where a layout per T touched the union of every chunk size's
 * (a 512-token prompt run as 384 + 128 rows touched 3.5 MiB of its 4.2 MiB scratch, h's pages
 * among them). The T-sized regions come last, h at the end: with block-type projections h is
 * written only by el_chunk_logits (one row). (With fp32 projections h is written, and it moves
 * with xq_h's size: a smaller chunk then touches some pages of its own.) */
static void el_chunk_sizes(const el_model_dims *m, int T, size_t sz[EL_CHUNK_NBUF]) {
    const size_t q = (size_t)m->H * m->hd, kv = (size_t)m->KVH * m->hd, t = (size_t)T;
    const int S = T > 1 ? EL_CHUNK_SLICE : 1, F = EL_MIN(S, EL_CHUNK_FFN_ROWS);
    const size_t s = (size_t)S, f = (size_t)F;
    sz[0] = el_a64(t * m->d * 4);
    sz[1] = el_a64(s * m->d * 4);
    sz[2] = el_a64(s * (q + 2 * kv) * 4);
    sz[3] = el_a64(s * q * 4);
    sz[4] = el_a64(f * m->ff * 2 * 4);
    sz[5] = el_a64(f * m->ff * 4);
    /* attn_out quantizes q-wide rows here, the head one d-wide row; down's ff-wide rows come
     * quantized from the SwiGLU (qkv and gate|up read xq_h, or fp32 h, never this) */
    sz[6] = el_a64(EL_MAX(EL_MAX(el_matmul_scratch(S, (int)q), el_matmul_scratch(F, m->ff)),
                          el_matmul_scratch(1, m->d)));
    sz[7] = el_a64(el_matmul_scratch(T, m->d));
}

/* bytes of the shared region: the larger of the two halves */
static size_t el_chunk_shared(const size_t sz[EL_CHUNK_NBUF]) {
    return EL_MAX(sz[2] + sz[3], sz[4] + sz[5]);
}

static int el_dims_check(const el_model_dims *m) {
    if (!m) return EL_EINVAL;
    if (m->d <= 0 || m->H <= 0 || m->KVH <= 0 || m->hd <= 0 || m->ff <= 0) return EL_EINVAL;
    if (m->d > EL_DECODE_MAX_DIM || m->H > EL_DECODE_MAX_DIM || m->hd > EL_DECODE_MAX_DIM ||
        m->ff > EL_DECODE_MAX_DIM / 2)
        return EL_EINVAL;
    if (m->H % m->KVH != 0) return EL_EINVAL;
    if ((int64_t)(m->H + 2 * (int64_t)m->KVH) * m->hd > EL_DECODE_MAX_DIM) return EL_EINVAL;
    if (m->rope_dim <= 0 || m->rope_dim > m->hd || m->rope_dim % 2 != 0) return EL_EINVAL;
    if (m->neox != 0 && m->neox != 1) return EL_EINVAL;
    if (!(m->eps >= 0.0f) || !isfinite(m->eps)) return EL_EINVAL;
    if (m->hd > EL_DECODE_MAX_HD) return EL_EUNSUPPORTED;
    return EL_OK;
}

/* every buffer of T rows stays below 2^31 elements (the kernels index rows with int) */
static int el_tokens_check(const el_model_dims *m, int T) {
    if (T <= 0 || T > EL_CHUNK_MAX_TOKENS) return EL_EINVAL;
    const int64_t widest = EL_MAX((int64_t)2 * m->ff, (int64_t)(m->H + 2 * m->KVH) * m->hd);
    return (int64_t)T * widest < ((int64_t)1 << 31) ? EL_OK : EL_EINVAL;
}

size_t el_chunk_scratch(const el_model_dims *dims, int T) {
    if (el_dims_check(dims) != EL_OK || el_tokens_check(dims, T) != EL_OK) return 0;
    size_t sz[EL_CHUNK_NBUF];
    el_chunk_sizes(dims, T, sz);
    return 64 + sz[0] + sz[1] + el_chunk_shared(sz) + sz[6] + sz[7];   /* + 64: the caller's buffer may start unaligned */
}

size_t el_decode_scratch(const el_model_dims *dims) { return el_chunk_scratch(dims, 1); }

static el_chunk_bufs el_chunk_layout(const el_model_dims *m, int T, void *scratch) {
    size_t sz[EL_CHUNK_NBUF];
    el_chunk_sizes(m, T, sz);
    uint8_t *p = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    el_chunk_bufs b;
    b.o = (float *)p, p += sz[1];
    uint8_t *shared = p;
    b.qkv = (float *)p, p += sz[2];
    b.att = (float *)p;
    p = shared;
    b.gu = (float *)p, p += sz[4];
    b.act = (float *)p;
    b.mm = shared + el_chunk_shared(sz);
    b.xq_h = (uint8_t *)b.mm + sz[6];
    b.h = (float *)((uint8_t *)b.xq_h + sz[7]);
    return b;
}

/* ---- argument checks ------------------------------------------------------------------------ */

/* The matrix has N output rows of K inputs, in a format el_matmul reads. */
static int el_matrix_check(const el_matrix *w, long long N, int K) {
    const int quantized = w->wtype == EL_Q4_0 || w->wtype == EL_Q4_1 || w->wtype == EL_Q8_0;
    if (!quantized && w->wtype != EL_F32 && w->wtype != EL_F16) return EL_EUNSUPPORTED;
    if (!w->seg_ptr || !w->seg_rows || w->n_seg <= 0) return EL_EINVAL;
    if (quantized && K % 32 != 0) return EL_EINVAL;
    long long n = 0;
    for (int s = 0; s < w->n_seg; s++) {
        if (w->seg_rows[s] < 0 || (w->seg_rows[s] > 0 && !w->seg_ptr[s])) return EL_EINVAL;
        n += w->seg_rows[s];
    }
    return n == N ? EL_OK : EL_EINVAL;
}

static int el_layers_check(const el_layer *layers, int n_layers, const el_model_dims *m) {
    const int q = m->H * m->hd, kv = m->KVH * m->hd;
    for (int l = 0; l < n_layers; l++) {
        const el_layer *L = &layers[l];
        if (!L->attn_norm || !L->ffn_norm) return EL_EINVAL;
        int rc;
        if ((rc = el_matrix_check(&L->qkv, (long long)q + 2LL * kv, m->d)) != EL_OK) return rc;
        if ((rc = el_matrix_check(&L->attn_out, m->d, q)) != EL_OK) return rc;
        if ((rc = el_matrix_check(&L->gate_up, 2LL * m->ff, m->d)) != EL_OK) return rc;
        if ((rc = el_matrix_check(&L->down, m->d, m->ff)) != EL_OK) return rc;
    }
    return EL_OK;
}

static int el_overlaps(const void *a, size_t na, const void *b, size_t nb) {
    const uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + nb && pb < pa + na;
}

/* ---- the step ------------------------------------------------------------------------------- */

/* el_matmul of M rows with the matrix's own segments (validated up front: cannot fail) */
static int el_mm(el_pool *pool, const el_matrix *w, const float *x, float *y, int M, int K, const float *bias,
                 void *mm) {
    return el_matmul(pool, w->wtype, w->seg_ptr, w->seg_rows, w->n_seg, x, y, M, K, bias, mm);
}

/* el_matmul_xq of rows [row0, row0 + rows) of xq (a layout for M rows of K) */
static int el_mm_xq(el_pool *pool, const el_matrix *w, const void *xq, int M, int row0, int rows, int K, float *y,
                    const float *bias) {
    return el_matmul_xq(pool, w->wtype, w->seg_ptr, w->seg_rows, w->n_seg, xq, M, row0, rows, K, y, bias);
}

/* an EL_KV_I8 pool's two descriptors name an arena and scales each */
static int el_kv_i8_ok(const void *k_pool, const void *v_pool) {
    const el_kv_i8 *k8 = k_pool, *v8 = v_pool;
    return k8->q && k8->scale && v8->q && v8->scale;
}

/* Per-token work between the projections: RoPE on the token's q and k heads and its K/V rows
 * into the arena; the residual adds and norms. Each token (row) is
 * independent, so with enough of them el_for_rows splits them over the pool: serial, they left
 * the other thread spinning (~3% of a 32-token chunk). Same kernels per row: the same results. */
typedef struct {
    const el_model_dims *m;
    const el_chunk_bufs *b;
    float *x;                   /* residual adds: x += b->o */
    const float *norm_w;        /* el_add_norm_rows: the RMSNorm after the add, into b->h */
    int h_q;                    /* ... or (its projection has block weights) quantized into b->xq_h */
    int h_row;                  /* b->xq_h's row of the slice's row 0 (b->h is offset instead) */
    int nf;                     /* el_swiglu_q_rows: rows of the FFN piece (b->mm's layout) */
    float eps;
    int T, pos, layer, n_layers, kv_type, block_tokens;
    const float *cos, *sin;
    void *k_pool, *v_pool;
    const int32_t *block_table;
} el_tok_ctx;

/* One (token, kv head) row of an int8 pool: scale = max |x| / 127, q = x / scale rounded to
 * nearest even and clipped to +-127; a row whose max is 0 or NaN stores q = 0 (its scale as
 * computed). The same operations, in fp32, as the pool's Python writer (quantize_int8), so the
 * stored bytes are the same whichever path wrote them: a division, not a multiplication by
 * 1 / scale, which would round differently. */
static void el_quant_kv_row(const float *x, int8_t *q, float *scale, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (a != a || a > amax) amax = a;
        if (amax != amax) break;
    }
    const float s = amax / 127.0f;
    *scale = s;
    int i = 0;
    if (s > 0.0f) {
        if (el_generic_flag) goto tail;   /* the generic twin: every element the scalar way */
        const float32x4_t vs = vdupq_n_f32(s), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
        for (; i + 8 <= n; i += 8) {
            int32x4_t r[2];
            for (int h = 0; h < 2; h++) {
                const float32x4_t v = vrndnq_f32(vdivq_f32(vld1q_f32(x + i + 4 * h), vs));
                r[h] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(v, lo), hi));   /* integral: exact */
            }
            vst1_s8(q + i, vmovn_s16(vcombine_s16(vmovn_s32(r[0]), vmovn_s32(r[1]))));
        }
    tail:
        for (; i < n; i++) {
            const float v = rintf(x[i] / s);
            q[i] = (int8_t)(v != v ? 0 : v < -127.0f ? -127 : v > 127.0f ? 127 : (int)v);
        }
    } else {
        memset(q, 0, (size_t)n);
    }
}

int el_kv_quantize_i8(const float *x, int8_t *q, float *scale, int rows, int hd) {
    if (rows < 0 || hd <= 0 || (rows > 0 && (!x || !q || !scale))) return EL_EINVAL;
    for (int r = 0; r < rows; r++) el_quant_kv_row(x + (size_t)r * hd, q + (size_t)r * hd, scale + r, hd);
    return EL_OK;
}

static void el_rope_store_rows(const void *args, int t0, int t1) {
    const el_tok_ctx *c = args;
    const el_model_dims *m = c->m;
    const int q_dim = m->H * m->hd, kv_dim = m->KVH * m->hd, w = q_dim + 2 * kv_dim, half = m->rope_dim / 2;
    const size_t layer_sz = (size_t)c->block_tokens * kv_dim;
    for (int t = t0; t < t1; t++) {
        float *row = c->b->qkv + (size_t)t * w;
        /* q and k heads are adjacent in a row: one pass rotates both (per head, as two calls
         * would); the arguments were validated with the dims, so it cannot fail */
        el_rope(row, row, 1, m->H + m->KVH, m->hd, m->rope_dim, c->cos + (size_t)t * half, c->sin + (size_t)t * half,
                m->neox);
        const int p = c->pos + t;
        const size_t off = (size_t)c->block_table[p / c->block_tokens] * c->n_layers * layer_sz +
                           (size_t)c->layer * layer_sz + (size_t)(p % c->block_tokens) * kv_dim;
        const float *kr = row + q_dim, *vr = row + q_dim + kv_dim;
        if (c->kv_type == EL_KV_I8) {
            const el_kv_i8 *k8 = c->k_pool, *v8 = c->v_pool;
            const size_t srow = off / (size_t)m->hd;   /* the row's first scale: (token, kv head 0) */
            for (int h = 0; h < m->KVH; h++) {
                const size_t o = (size_t)h * m->hd;
                el_quant_kv_row(kr + o, (int8_t *)k8->q + off + o, k8->scale + srow + h, m->hd);
                el_quant_kv_row(vr + o, (int8_t *)v8->q + off + o, v8->scale + srow + h, m->hd);
            }
        } else if (c->kv_type == EL_F16) {
            el_f32_to_f16(kr, (uint16_t *)c->k_pool + off, (size_t)kv_dim);
            el_f32_to_f16(vr, (uint16_t *)c->v_pool + off, (size_t)kv_dim);
        } else {
            memcpy((float *)c->k_pool + off, kr, (size_t)kv_dim * sizeof(float));
            memcpy((float *)c->v_pool + off, vr, (size_t)kv_dim * sizeof(float));
        }
    }
}

static void el_add_rows(const void *args, int t0, int t1) {
    const el_tok_ctx *c = args;
    const size_t d = (size_t)c->m->d;
    el_add(c->x + t0 * d, c->b->o + t0 * d, c->x + t0 * d, (size_t)(t1 - t0) * d);
}

/* fp32 rows up to this width are staged on the stack before they are quantized (the RMSNorm or
 * SwiGLU output of one row: 32 KiB); wider ones go through their row of b->h / b->act */
#define EL_ROW_STAGE 8192

/* Row t's RMSNorm into what its projection reads: fp32 into b->h, or, for block weights, the
 * int8 blocks el_matmul would make of it (el_quant_row_xq) while the row is in L1. The fp32 rows
 * then need no buffer of their own (RSS: the chunk scratch's h and act pages stay unwritten).
 * Speed: no measurable change (a cached 32-token turn, 8 alternations: 23.97 vs 23.87 ms). */
static void el_norm_row(const el_tok_ctx *c, const float *x, int t) {
    const int d = c->m->d;
    float stage[EL_ROW_STAGE];
    float *h = c->h_q && d <= EL_ROW_STAGE ? stage : c->b->h + (size_t)t * d;
    (void)el_rmsnorm(NULL, x, c->norm_w, h, 1, d, c->eps);   /* checked up front */
    if (c->h_q) el_quant_row_xq(h, c->b->xq_h, c->T, d, c->h_row + t);
}

static void el_norm_rows(const void *args, int t0, int t1) {
    const el_tok_ctx *c = args;
    for (int t = t0; t < t1; t++) el_norm_row(c, c->x + (size_t)t * c->m->d, t);
}

/* The residual add and the RMSNorm that follows it, row by row: the row is still in L1 for the
 * norm, where the two passes over all T rows read x twice and cost two trips through the pool.
 * The same kernels on the same rows: the same results. */
static void el_add_norm_rows(const void *args, int t0, int t1) {
    const el_tok_ctx *c = args;
    const size_t d = (size_t)c->m->d;
    for (int t = t0; t < t1; t++) {
        float *x = c->x + t * d;
        el_add(x, c->b->o + t * d, x, d);
        el_norm_row(c, x, t);
    }
}

/* SwiGLU of an FFN piece's rows, each quantized for down (block weights) into b->mm as it is
 * made; el_swiglu's kernel row by row, so the same fp32 values as its own pass */
static void el_swiglu_q_rows(const void *args, int t0, int t1) {
    const el_tok_ctx *c = args;
    const int ff = c->m->ff;
    float stage[EL_ROW_STAGE];
    for (int t = t0; t < t1; t++) {
        float *a = ff <= EL_ROW_STAGE ? stage : c->b->act + (size_t)t * ff;
        (void)el_swiglu(NULL, c->b->gu + (size_t)t * 2 * ff, a, 1, ff);   /* checked up front */
        el_quant_row_xq(a, c->b->mm, c->nf, ff, t);
    }
}

static int el_is_blocks(const el_matrix *w) {
    return w->wtype == EL_Q4_0 || w->wtype == EL_Q4_1 || w->wtype == EL_Q8_0;
}

int el_chunk_step_out(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x,
                      int T, int pos, const float *cos, const float *sin, void *k_pool, void *v_pool, int kv_type,
                      const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                      size_t scratch_bytes, int out_rows) {
    int rc = el_dims_check(dims);
    if (rc != EL_OK) return rc;
    if ((rc = el_tokens_check(dims, T)) != EL_OK) return rc;
    if (out_rows < 0 || out_rows > T) return EL_EINVAL;
    if (!layers || n_layers <= 0 || !x || !cos || !sin || !k_pool || !v_pool || !block_table || !scratch)
        return EL_EINVAL;
    if (kv_type != EL_F32 && kv_type != EL_F16 && kv_type != EL_KV_I8) return EL_EUNSUPPORTED;
    if (kv_type == EL_KV_I8 && !el_kv_i8_ok(k_pool, v_pool)) return EL_EINVAL;
    if (pos < 0 || pos > INT_MAX - T || block_tokens <= 0 || n_blocks <= 0 || n_table <= 0) return EL_EINVAL;
    const el_model_dims m = *dims;
    const size_t need = el_chunk_scratch(&m, T);
    if (scratch_bytes < need || el_overlaps(x, (size_t)T * m.d * sizeof(float), scratch, scratch_bytes))
        return EL_EINVAL;
    /* every block attention will read, and those written, must exist in the arena */
    const int last = (pos + T - 1) / block_tokens;
    if (last >= n_table) return EL_EINVAL;
    for (int i = 0; i <= last; i++)
        if (block_table[i] < 0 || block_table[i] >= n_blocks) return EL_EINVAL;
    if ((rc = el_layers_check(layers, n_layers, &m)) != EL_OK) return rc;

    const el_chunk_bufs b = el_chunk_layout(&m, T, scratch);
    const int q_dim = m.H * m.hd, half = m.rope_dim / 2;
    const int row_w = q_dim + 2 * m.KVH * m.hd;    /* a token's qkv row: its RoPE and K/V store work */
    el_chunk_bufs bs = b;                          /* the current slice's view: h at its first row */
    el_tok_ctx tok = {.m = &m, .b = &bs, .eps = m.eps, .T = T, .n_layers = n_layers, .kv_type = kv_type,
                      .block_tokens = block_tokens, .k_pool = k_pool, .v_pool = v_pool, .block_table = block_table};

    /* each layer's attn_norm runs with the residual add before it (the previous layer's FFN);
     * the first layer's has no add */
    tok.x = x, tok.norm_w = layers[0].attn_norm, tok.h_q = el_is_blocks(&layers[0].qkv), tok.h_row = 0;
    el_for_rows(pool, el_norm_rows, &tok, T, m.d);
    for (int l = 0; l < n_layers; l++) {
        const el_layer *L = &layers[l];
        tok.layer = l;
        for (int t0 = 0, n; t0 < T; t0 += n) {
            /* no slice of one row after another one (T = 257: 255 + 2): alone, its row would run
             * the GEMVs and the decode attention, and its result would depend on the chunking */
            n = EL_MIN(EL_CHUNK_SLICE, T - t0);
            if (T - t0 - n == 1) n--;
            const int p0 = pos + t0;
            bs.h = b.h + (size_t)t0 * m.d;
            tok.x = x + (size_t)t0 * m.d, tok.pos = p0;
            tok.cos = cos + (size_t)t0 * half, tok.sin = sin + (size_t)t0 * half;
            if ((rc = el_is_blocks(&L->qkv) ? el_mm_xq(pool, &L->qkv, b.xq_h, T, t0, n, m.d, b.qkv, L->bqkv)
                                            : el_mm(pool, &L->qkv, bs.h, b.qkv, n, m.d, L->bqkv, b.mm)) != EL_OK)
                return rc;
            el_for_rows(pool, el_rope_store_rows, &tok, n, row_w);
            /* past the K/V store, the last layer runs only the rows the caller reads (the
             * chunk's last out_rows): a slice before them stops here */
            const int a = l + 1 < n_layers ? 0 : EL_MIN(n, EL_MAX(0, T - out_rows - t0)), k = n - a;
            if (k == 0) continue;
            if (a > 0) {
                bs.h += (size_t)a * m.d;
                tok.x += (size_t)a * m.d;
            }
            if ((rc = el_attention_pool_ld(pool, b.qkv + (size_t)a * row_w, (size_t)row_w, b.att, k, m.H, m.KVH,
                                           m.hd, p0 + a, k_pool, v_pool, kv_type, block_table, block_tokens,
                                           n_layers, l)) != EL_OK)
                return rc;
            if ((rc = el_mm(pool, &L->attn_out, b.att, b.o, k, q_dim, NULL, b.mm)) != EL_OK) return rc;
            tok.norm_w = L->ffn_norm, tok.h_q = el_is_blocks(&L->gate_up), tok.h_row = t0 + a;
            el_for_rows(pool, el_add_norm_rows, &tok, k, 2 * m.d);
            for (int f0 = 0, nf; f0 < k; f0 += nf) {
                nf = EL_MIN(EL_CHUNK_FFN_ROWS, k - f0);
                if (k - f0 - nf == 1) nf--;   /* (no one-row piece: the GEMVs, as above) */
                if ((rc = tok.h_q ? el_mm_xq(pool, &L->gate_up, b.xq_h, T, t0 + a + f0, nf, m.d, b.gu, NULL)
                                  : el_mm(pool, &L->gate_up, bs.h + (size_t)f0 * m.d, b.gu, nf, m.d, NULL, b.mm)) !=
                    EL_OK)
                    return rc;
                float *o = b.o + (size_t)f0 * m.d;
                if (el_is_blocks(&L->down)) {
                    tok.nf = nf;
                    el_for_rows(pool, el_swiglu_q_rows, &tok, nf, 2 * m.ff);
                    rc = el_mm_xq(pool, &L->down, b.mm, nf, 0, nf, m.ff, o, NULL);
                } else if ((rc = el_swiglu(pool, b.gu, b.act, nf, m.ff)) == EL_OK) {
                    rc = el_mm(pool, &L->down, b.act, o, nf, m.ff, NULL, b.mm);
                }
                if (rc != EL_OK) return rc;
            }
            if (l + 1 < n_layers) {
                tok.norm_w = layers[l + 1].attn_norm, tok.h_q = el_is_blocks(&layers[l + 1].qkv);
                el_for_rows(pool, el_add_norm_rows, &tok, k, 2 * m.d);
            } else {
                el_for_rows(pool, el_add_rows, &tok, k, m.d);
            }
        }
    }
    return EL_OK;
}

int el_chunk_logits(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x, int T,
                    int pos, const float *cos, const float *sin, void *k_pool, void *v_pool, int kv_type,
                    const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                    size_t scratch_bytes, const float *out_norm, const el_matrix *head, int n_vocab, int f32act,
                    float *logits) {
    int rc = el_dims_check(dims);
    if (rc != EL_OK) return rc;
    if (!out_norm || !head || !logits || n_vocab <= 0 || (f32act != 0 && f32act != 1)) return EL_EINVAL;
    if ((rc = el_matrix_check(head, n_vocab, dims->d)) != EL_OK) return rc;
    if ((rc = el_tokens_check(dims, T)) != EL_OK) return rc;
    /* logits must not alias the buffers the step writes (x, scratch) */
    const size_t lb = (size_t)n_vocab * sizeof(float);
    if (!x || el_overlaps(logits, lb, x, (size_t)T * dims->d * sizeof(float)) ||
        (scratch && el_overlaps(logits, lb, scratch, scratch_bytes)))
        return EL_EINVAL;
    rc = el_chunk_step_out(pool, layers, n_layers, dims, x, T, pos, cos, sin, k_pool, v_pool, kv_type, block_table,
                           n_table, block_tokens, n_blocks, scratch, scratch_bytes, 1);
    if (rc != EL_OK) return rc;
    /* the step is done with its scratch: the normed row goes where its rows went (b.h), the
     * head's int8 x into the matmul region */
    const el_chunk_bufs b = el_chunk_layout(dims, T, scratch);
    const float *last = x + (size_t)(T - 1) * dims->d;
    if ((rc = el_rmsnorm(pool, last, out_norm, b.h, 1, dims->d, dims->eps)) != EL_OK) return rc;
    return f32act ? el_matmul_f32act(pool, head->wtype, head->seg_ptr, head->seg_rows, head->n_seg, b.h, logits, 1,
                                     dims->d, NULL)
                  : el_matmul(pool, head->wtype, head->seg_ptr, head->seg_rows, head->n_seg, b.h, logits, 1, dims->d,
                              NULL, b.mm);
}

int el_chunk_step(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x, int T,
                  int pos, const float *cos, const float *sin, void *k_pool, void *v_pool, int kv_type,
                  const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                  size_t scratch_bytes) {
    return el_chunk_step_out(pool, layers, n_layers, dims, x, T, pos, cos, sin, k_pool, v_pool, kv_type, block_table,
                             n_table, block_tokens, n_blocks, scratch, scratch_bytes, T);
}

int el_decode_step(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x,
                   int pos, const float *cos_row, const float *sin_row, void *k_pool, void *v_pool, int kv_type,
                   const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                   size_t scratch_bytes) {
    return el_chunk_step(pool, layers, n_layers, dims, x, 1, pos, cos_row, sin_row, k_pool, v_pool, kv_type,
                         block_table, n_table, block_tokens, n_blocks, scratch, scratch_bytes);
}

int el_chunk_ids(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                 const el_embedding *emb, const int32_t *ids, float *x, int T, int pos, const float *cos,
                 const float *sin, void *k_pool, void *v_pool, int kv_type, const int32_t *block_table, int n_table,
                 int block_tokens, int n_blocks, void *scratch, size_t scratch_bytes, int out_rows,
                 const float *out_norm, const el_matrix *head, int n_vocab, int f32act, float *logits) {
    int rc = el_dims_check(dims);
    if (rc != EL_OK) return rc;
    if (!emb || emb->row_len != dims->d || !x || !k_pool || !v_pool || T <= 0 || n_layers <= 0 || block_tokens <= 0 ||
        n_blocks <= 0)
        return EL_EINVAL;
    if (logits && out_rows != 1) return EL_EINVAL;
    if (kv_type != EL_F32 && kv_type != EL_F16 && kv_type != EL_KV_I8) return EL_EUNSUPPORTED;
    if (kv_type == EL_KV_I8 && !el_kv_i8_ok(k_pool, v_pool)) return EL_EINVAL;
    /* x is written before the step checks the rest: it must not lie in the K/V arena (or an
     * int8 arena's scales), whose live rows a refused call leaves untouched */
    const size_t xb = (size_t)T * dims->d * sizeof(float);
    const size_t rows = (size_t)n_blocks * n_layers * block_tokens * dims->KVH;
    if (kv_type == EL_KV_I8) {
        const el_kv_i8 *k8 = k_pool, *v8 = v_pool;
        const size_t qb = rows * dims->hd, sb = rows * sizeof(float);
        if (el_overlaps(x, xb, k8->q, qb) || el_overlaps(x, xb, v8->q, qb) || el_overlaps(x, xb, k8->scale, sb) ||
            el_overlaps(x, xb, v8->scale, sb))
            return EL_EINVAL;
    } else {
        const size_t arena = rows * dims->hd * (kv_type == EL_F16 ? 2 : 4);
        if (el_overlaps(x, xb, k_pool, arena) || el_overlaps(x, xb, v_pool, arena)) return EL_EINVAL;
    }
    if ((rc = el_embed_rows(emb, ids, T, x)) != EL_OK) return rc;
    if (logits)
        return el_chunk_logits(pool, layers, n_layers, dims, x, T, pos, cos, sin, k_pool, v_pool, kv_type,
                               block_table, n_table, block_tokens, n_blocks, scratch, scratch_bytes, out_norm, head,
                               n_vocab, f32act, logits);
    return el_chunk_step_out(pool, layers, n_layers, dims, x, T, pos, cos, sin, k_pool, v_pool, kv_type, block_table,
                             n_table, block_tokens, n_blocks, scratch, scratch_bytes, out_rows);
}

/* The first maximum of logits (numpy's argmax), or -1 when they hold a NaN (numpy's argmax
 * would pick the NaN: the caller's own step then reports it) */
static int el_argmax_first(const float *logits, int n) {
    int best = 0;
    float bv = logits[0];
    if (bv != bv) return -1;
    for (int j = 1; j < n; j++) {
        const float v = logits[j];
        if (v != v) return -1;
        if (v > bv) bv = v, best = j;
    }
    return best;
}

size_t el_decode_sample_scratch(int n_vocab, int n_history, int n_max) {
    if (n_vocab <= 0 || n_history < 0 || n_max < 0) return 0;
    /* el_sample's, then the penalized logits' originals: one per token of the longest window */
    return el_sample_scratch(n_vocab) + ((size_t)n_history + (size_t)n_max) * sizeof(float);
}

/* The repetition penalty's sequence: history, then the run's own tokens */
static inline int32_t el_seq_tok(const int32_t *history, int n_history, const int32_t *out_ids, int j) {
    return j < n_history ? history[j] : out_ids[j - n_history];
}

/* Decode tokens in one call: each step is el_chunk_ids of one token (the previous step's pick,
 * first_id for the first), then the pick from its logits: the first maximum (sampling NULL, or
 * temperature 0), or el_sample's draw with u[i], after the repetition penalty (llama.cpp's: a
 * recent token's logit > 0 divided by it, <= 0 multiplied, each distinct token once; as
 * sampling.py's Sampler, in float32). The penalty works on the logits in place and puts them
 * back after the pick: each covered position saves its original first, so a token that appears
 * twice is penalized once and restored to its original. Stops after n_max tokens, after
 * producing one of stop_ids, or before picking from logits it cannot pick from (a NaN; for a
 * draw, any non-finite maximum): the caller's own step then reports them. cos, sin: the RoPE
 * rows of positions pos..pos+n_max-1; the table must cover them. Returns the count produced
 * into out_ids (the logits buffer holds the last step's), or a negative code when the first
 * step was refused (a later refusal ends the run: its count is returned). */
int el_decode_sample(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                     const el_embedding *emb, int32_t first_id, float *x, int pos, int n_max, const float *cos,
                     const float *sin, void *k_pool, void *v_pool, int kv_type, const int32_t *block_table,
                     int n_table, int block_tokens, int n_blocks, void *scratch, size_t scratch_bytes,
                     const float *out_norm, const el_matrix *head, int n_vocab, int f32act, float *logits,
                     const int32_t *stop_ids, int n_stop, int32_t *out_ids, const el_sampling *sampling,
                     const double *u, const int32_t *history, int n_history, void *sample_scratch,
                     size_t sample_scratch_bytes) {
    if (!dims || n_max <= 0 || !out_ids || !logits || !cos || !sin || n_vocab <= 0 || n_stop < 0 ||
        (n_stop > 0 && !stop_ids))
        return EL_EINVAL;
    const el_sampling *s = sampling;
    const int draw = s && s->temperature > 0.0;
    const int pen = s && s->repeat_penalty != 1.0 && s->repeat_last_n != 0;
    if (s) {
        if (el_sampling_check(s) != EL_OK || n_history < 0 || (n_history > 0 && !history) || !sample_scratch ||
            sample_scratch_bytes < el_decode_sample_scratch(n_vocab, n_history, n_max))
            return EL_EINVAL;
        for (int j = 0; j < n_history; j++)
            if (history[j] < 0 || history[j] >= n_vocab) return EL_EINVAL;
        if (draw) {
            if (!u) return EL_EINVAL;
            for (int i = 0; i < n_max; i++)
                if (!(u[i] >= 0.0 && u[i] < 1.0)) return EL_EINVAL;
        }
    }
    float *saved = s ? (float *)((char *)sample_scratch + el_sample_scratch(n_vocab)) : NULL;
    const float pf = s ? (float)s->repeat_penalty : 1.0f;
    const int half = dims->rope_dim / 2;
    int32_t id = first_id;
    for (int i = 0; i < n_max; i++) {
        const int rc = el_chunk_ids(pool, layers, n_layers, dims, emb, &id, x, 1, pos + i, cos + (size_t)i * half,
                                    sin + (size_t)i * half, k_pool, v_pool, kv_type, block_table, n_table,
                                    block_tokens, n_blocks, scratch, scratch_bytes, 1, out_norm, head, n_vocab,
                                    f32act, logits);
        if (rc != EL_OK) return i > 0 ? i : rc;
        const int total = n_history + i, lo = pen && s->repeat_last_n > 0 ? EL_MAX(0, total - s->repeat_last_n) : 0;
        const int hi = pen ? total : 0;
        for (int j = lo; j < hi; j++) saved[j - lo] = logits[el_seq_tok(history, n_history, out_ids, j)];
        for (int j = lo; j < hi; j++) {
            const float v = saved[j - lo];
            logits[el_seq_tok(history, n_history, out_ids, j)] = v <= 0.0f ? v * pf : v / pf;
        }
        const int best = draw ? el_sample(logits, n_vocab, s, u[i], sample_scratch, el_sample_scratch(n_vocab))
                              : el_argmax_first(logits, n_vocab);
        for (int j = lo; j < hi; j++) logits[el_seq_tok(history, n_history, out_ids, j)] = saved[j - lo];
        if (best < 0) return i;   /* checked up front: only logits it cannot pick from */
        out_ids[i] = id = best;
        for (int k = 0; k < n_stop; k++)
            if (stop_ids[k] == best) return i + 1;
    }
    return n_max;
}

int el_decode_greedy(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                     const el_embedding *emb, int32_t first_id, float *x, int pos, int n_max, const float *cos,
                     const float *sin, void *k_pool, void *v_pool, int kv_type, const int32_t *block_table,
                     int n_table, int block_tokens, int n_blocks, void *scratch, size_t scratch_bytes,
                     const float *out_norm, const el_matrix *head, int n_vocab, int f32act, float *logits,
                     const int32_t *stop_ids, int n_stop, int32_t *out_ids) {
    return el_decode_sample(pool, layers, n_layers, dims, emb, first_id, x, pos, n_max, cos, sin, k_pool, v_pool,
                            kv_type, block_table, n_table, block_tokens, n_blocks, scratch, scratch_bytes, out_norm,
                            head, n_vocab, f32act, logits, stop_ids, n_stop, out_ids, NULL, NULL, NULL, 0, NULL, 0);
}

