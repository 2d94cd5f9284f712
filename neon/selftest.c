/* edgellm NEON self-test: runs every kernel of the library, through the public API, on the cases
 * of a file written by Python (edgellm/toolchain.py, write_cases) and compares each output with
 * the expected one stored there (edgellm/backends/reference.py, numpy) by normalized MSE.
 *
 *     selftest [-t THREADS] [-k SUBSTRING] CASES_FILE
 *
 * Prints one line per case and path (the NEON path, then the plain-C twins, el_use_generic(1)):
 *     PASS|FAIL <name> nmse=<x> bound=<y>
 * where nmse = sum (y - e)^2 / sum e^2 (sum (y - e)^2 when e is all zero); a NaN or infinity in
 * y, an error code from the kernel, or a write past the end of an output or scratch buffer is a
 * FAIL whatever the nmse. The built-in checks (below) print `PASS|FAIL <name> <detail>`. Lines
 * starting with '#' are comments (build info, the summary).
 * Exit status: 0 every case passed, 1 some failed, 2 usage error or an unreadable, truncated or
 * malformed cases file (one message on stderr; nothing runs: the whole file is validated first).
 *
 * Cases file, version 1, little-endian, no padding:
 *   header   char magic[8] = "ELSTCASE"; u32 version = 1; u32 n_cases (1..100000)
 *   case     u32 op; u32 name_len (1..127); char name[name_len] (printable, no spaces);
 *            f32 bound (> 0); u32 n_int (<= 64); i32 ints[n_int]; u32 n_float (<= 16);
 *            f32 floats[n_float]; u32 n_arrays (<= 64); array[n_arrays]
 *   array    u32 kind (1 = f32, 2 = raw bytes); u32 reserved = 0; u64 count (elements for f32,
 *            bytes for raw); data[count * (kind == 1 ? 4 : 1)]
 *   The file ends right after the last case. Per op (ints; floats; arrays, in order):
 *   1 matmul     wtype M K n_seg has_bias use_scratch rows[n_seg] [f32act]; -;
 *                x f32 (M*K), seg raw (rows[s] * row_bytes(wtype, K)) x n_seg, [bias f32 (N)],
 *                expected f32 (M*N), N = sum rows. f32act (optional, 0 when absent): 1 runs
 *                el_matmul_f32act (fp32 x; no scratch, so use_scratch must be 0) instead of
 *                el_matmul
 *   2 rmsnorm    T d; eps; x f32 (T*d), w f32 (d), expected f32 (T*d)
 *   3 rope       T heads hd rope_dim neox inplace; -; x f32 (T*heads*hd), cos f32 (T*rope_dim/2),
 *                sin f32 (T*rope_dim/2), expected f32 (T*heads*hd)
 *   4 swiglu     T ff; -; gate_up f32 (T*2*ff), expected f32 (T*ff)
 *   5 softmax    rows n; -; x f32 (rows*n), expected f32 (rows*n)
 *   6 add        n; -; a f32 (n), b f32 (n), expected f32 (n)
 *   7 attn_dense T H KVH hd start; -; q f32 (T*H*hd), k f32 (KVH*(start+T)*hd), v (same),
 *                expected f32 (T*H*hd)
 *   8 attn_pool  T H KVH hd start kv_type block_tokens n_layers layer n_blocks; -;
 *                q f32 (T*H*hd), k raw, v raw (n_blocks*n_layers*block_tokens*KVH*hd elements of
 *                kv_type), block_table raw (int32 x n_table, n_table*block_tokens >= start+T,
 *                entries in 0..n_blocks-1), expected f32 (T*H*hd); kv_type EL_KV_I8 (16): k, v
 *                int8 raw, then k_scale, v_scale f32 (their element count / hd) before expected
 *   9 embed      wtype T row_len n_rows; -; table raw (n_rows * row_bytes(wtype, row_len)),
 *                ids raw (int32 x T, in 0..n_rows-1), expected f32 (T*row_len)
 *  10 kv_quant   rows hd; -; x f32 (rows*hd), expected f32 (rows*hd + rows): the int8 values as
 *                floats, then the rows' scales (el_kv_quantize_i8)
 *  11 sample     n top_k n_u; top_p min_p temperature; x f32 (n), u f32 (n_u), expected f32 (n_u):
 *                the id el_sample draws with each u, as a float
 *  12 step       n_layers (1..9) d H KVH hd ff rope_dim neox wtype head_wtype n_vocab T block_tokens
 *                mode; eps; per layer: attn_norm f32 (d), qkv raw ((H+2KVH)hd rows of d), attn_out
 *                raw (d rows of H*hd), ffn_norm f32 (d), gate_up raw (2ff rows of d), down raw (d
 *                rows of ff); then out_norm f32 (d), head raw (n_vocab rows of d, head_wtype: also
 *                the embedding table), x f32 (T*d: the ids' embeddings), cos, sin f32
 *                (T*rope_dim/2), ids raw (int32 x T), expected. The fused step over an fp16 pool
 *                whose block table runs backwards. mode 0: el_chunk_logits of the T rows,
 *                expected f32 (n_vocab) the last row's logits; 1: el_chunk_step of T-1 rows, then
 *                el_chunk_logits of the last one (the decode path), same expected; 2: el_chunk_step
 *                of T-1 rows, then el_decode_greedy from ids[T-1], expected f32 (1): the argmax id
 * Besides the file's cases, a few built-in checks run: the pool's thread count, el_parallel_for
 * running each task once, and bad arguments answered with a negative code (never an abort).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_neon.h"
#include "el_ranges.h"
#include "el_common.h"
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the cases file is little-endian; this reader assumes a little-endian host"
#endif

enum { OP_MATMUL = 1, OP_RMSNORM, OP_ROPE, OP_SWIGLU, OP_SOFTMAX, OP_ADD, OP_ATTN_DENSE, OP_ATTN_POOL, OP_EMBED,
       OP_KV_QUANT, OP_SAMPLE, OP_STEP };
enum { STEP_CHUNK, STEP_DECODE, STEP_GREEDY, STEP_MAX_LAYERS = 9 };
enum { KIND_F32 = 1, KIND_RAW = 2 };
enum { MAX_NAME = 127, MAX_INT = 64, MAX_FLOAT = 16, MAX_ARR = 64, MAX_CASES = 100000 };
#define MAX_FILE_BYTES ((uint64_t)1 << 30)
/* A dimension or element count above this is a corrupt file, not a test: it keeps every size
 * product below 2^62 and every int argument in range. */
#define MAX_DIM ((int64_t)1 << 24)
#define MAX_ELEMS ((int64_t)1 << 28)
#define GUARD 64   /* floats (or bytes x4) after each output and scratch buffer, checked after the call */

typedef struct { uint32_t kind; uint64_t count; void *data; } array_t;
typedef struct {
    uint32_t op;
    char name[MAX_NAME + 1];
    float bound;
    uint32_t n_int, n_float, n_arr;
    int32_t ints[MAX_INT];
    float floats[MAX_FLOAT];
    array_t arr[MAX_ARR];
} case_t;

static const char *g_path = "";

/* ---- reading: every length checked against what remains, before it is used ------------------ */

typedef struct { const uint8_t *p; uint64_t left; uint64_t off; } cursor_t;

static void die_format(const cursor_t *c, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "selftest: %s: malformed cases file at byte %llu: ", g_path, (unsigned long long)c->off);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(2);
}

static void take(cursor_t *c, void *out, uint64_t n, const char *what) {
    if (n > c->left)
        die_format(c, "truncated: %s needs %llu bytes, %llu left", what, (unsigned long long)n,
                   (unsigned long long)c->left);
    memcpy(out, c->p, (size_t)n);
    c->p += n;
    c->left -= n;
    c->off += n;
}

static uint32_t take_u32(cursor_t *c, const char *what) { uint32_t v; take(c, &v, 4, what); return v; }

static void *xalloc(uint64_t bytes) {
    void *p = NULL;
    /* 64-byte alignment: what the Python side's numpy buffers get in practice */
    if (posix_memalign(&p, 64, (size_t)(bytes ? bytes : 1)) != 0) {
        fprintf(stderr, "selftest: out of memory (%llu bytes)\n", (unsigned long long)bytes);
        exit(2);
    }
    return p;
}

static void read_case(cursor_t *c, case_t *k, uint32_t index) {
    memset(k, 0, sizeof *k);
    k->op = take_u32(c, "op");
    uint32_t name_len = take_u32(c, "name length");
    if (name_len < 1 || name_len > MAX_NAME)
        die_format(c, "case %u: name length %u not in 1..%d", index, name_len, MAX_NAME);
    take(c, k->name, name_len, "name");
    for (uint32_t i = 0; i < name_len; i++)
        if (k->name[i] <= ' ' || k->name[i] > '~')
            die_format(c, "case %u: name has a non-printable or space character", index);
    take(c, &k->bound, 4, "bound");
    if (!(k->bound > 0.0f) || !isfinite(k->bound))
        die_format(c, "case %s: bound %g is not a positive number", k->name, k->bound);
    k->n_int = take_u32(c, "int count");
    if (k->n_int > MAX_INT) die_format(c, "case %s: %u ints, at most %d", k->name, k->n_int, MAX_INT);
    take(c, k->ints, 4ull * k->n_int, "ints");
    k->n_float = take_u32(c, "float count");
    if (k->n_float > MAX_FLOAT) die_format(c, "case %s: %u floats, at most %d", k->name, k->n_float, MAX_FLOAT);
    take(c, k->floats, 4ull * k->n_float, "floats");
    k->n_arr = take_u32(c, "array count");
    if (k->n_arr > MAX_ARR) die_format(c, "case %s: %u arrays, at most %d", k->name, k->n_arr, MAX_ARR);
    for (uint32_t a = 0; a < k->n_arr; a++) {
        array_t *r = &k->arr[a];
        r->kind = take_u32(c, "array kind");
        if (r->kind != KIND_F32 && r->kind != KIND_RAW)
            die_format(c, "case %s: array %u has kind %u (1 = f32, 2 = raw)", k->name, a, r->kind);
        if (take_u32(c, "array reserved word") != 0)
            die_format(c, "case %s: array %u reserved word is not 0", k->name, a);
        take(c, &r->count, 8, "array count");
        uint64_t size = r->kind == KIND_F32 ? 4 : 1;
        /* checked against the bytes left before multiplying or allocating */
        if (r->count > c->left / size)
            die_format(c, "truncated: case %s array %u holds %llu elements, only %llu bytes left", k->name, a,
                       (unsigned long long)r->count, (unsigned long long)c->left);
        r->data = xalloc(r->count * size);
        take(c, r->data, r->count * size, "array data");
    }
}

static void free_case(case_t *k) {
    for (uint32_t a = 0; a < k->n_arr; a++) free(k->arr[a].data);
    k->n_arr = 0;
}

/* ---- per-op shape validation: a corrupt file must not make a kernel read past a buffer ------ */

static const case_t *g_case;
static cursor_t g_end;

#define BAD(...) die_format(&g_end, __VA_ARGS__)

static void need_counts(uint32_t n_int, uint32_t n_float, uint32_t n_arr) {
    const case_t *k = g_case;
    if (k->n_int < n_int || k->n_float != n_float || k->n_arr != n_arr)
        BAD("case %s (op %u): expected %u ints, %u floats, %u arrays; found %u, %u, %u", k->name, k->op, n_int,
            n_float, n_arr, k->n_int, k->n_float, k->n_arr);
}

static int64_t dim(int i, const char *what, int64_t lo) {
    int64_t v = g_case->ints[i];
    if (v < lo || v > MAX_DIM)
        BAD("case %s: %s = %lld not in %lld..%lld", g_case->name, what, (long long)v, (long long)lo,
            (long long)MAX_DIM);
    return v;
}

static int64_t prod(int64_t a, int64_t b) {
    if (a != 0 && b > MAX_ELEMS / a)
        BAD("case %s: size %lld x %lld is too large", g_case->name, (long long)a, (long long)b);
    return a * b;
}

static void need_array(int a, uint32_t kind, int64_t count, const char *what) {
    const array_t *r = &g_case->arr[a];
    if (r->kind != kind || r->count != (uint64_t)count)
        BAD("case %s: array %d (%s) should be %s x %lld, found %s x %llu", g_case->name, a, what,
            kind == KIND_F32 ? "f32" : "raw", (long long)count, r->kind == KIND_F32 ? "f32" : "raw",
            (unsigned long long)r->count);
}

static int64_t row_bytes(int wtype, int64_t K) {
    switch (wtype) {
    case EL_F32: return 4 * K;
    case EL_F16: return 2 * K;
    case EL_Q4_0: return K / 32 * 18;
    case EL_Q4_1: return K / 32 * 20;
    case EL_Q8_0: return K / 32 * 34;
    }
    return -1;
}

static void validate(const case_t *k) {
    g_case = k;
    switch (k->op) {
    case OP_MATMUL: {
        need_counts(6, 0, k->n_arr);
        int wtype = k->ints[0];
        int64_t M = dim(1, "M", 1), K = dim(2, "K", 1), n_seg = dim(3, "n_seg", 1);
        int has_bias = (int)dim(4, "has_bias", 0), N = 0;
        dim(5, "use_scratch", 0);
        if (row_bytes(wtype, K) < 0) BAD("case %s: unknown weight type %d", k->name, wtype);
        if (wtype != EL_F32 && wtype != EL_F16 && K % 32)
            BAD("case %s: K = %lld is not a multiple of 32", k->name, (long long)K);
        if (has_bias > 1 || k->ints[5] > 1 || n_seg > 16 || (k->n_int != 6 + n_seg && k->n_int != 7 + n_seg))
            BAD("case %s: matmul needs has_bias, use_scratch in 0..1, n_seg (<= 16) row counts and an optional "
                "f32act", k->name);
        if (k->n_int == 7 + n_seg && ((uint32_t)k->ints[6 + n_seg] > 1 || (k->ints[6 + n_seg] && k->ints[5])))
            BAD("case %s: f32act must be 0 or 1, and 1 only without use_scratch", k->name);
        need_counts(6 + (uint32_t)n_seg, 0, 2 + (uint32_t)n_seg + (uint32_t)has_bias);
        need_array(0, KIND_F32, prod(M, K), "x");
        for (int s = 0; s < n_seg; s++) {
            int64_t rows = dim(6 + s, "segment rows", 1);
            need_array(1 + s, KIND_RAW, prod(rows, row_bytes(wtype, K)), "segment");
            N += (int)rows;
            if (N > MAX_DIM) BAD("case %s: N too large", k->name);
        }
        if (has_bias) need_array(1 + (int)n_seg, KIND_F32, N, "bias");
        need_array((int)k->n_arr - 1, KIND_F32, prod(M, N), "expected");
        break;
    }
    case OP_RMSNORM: {
        need_counts(2, 1, 3);
        int64_t T = dim(0, "T", 1), d = dim(1, "d", 1);
        need_array(0, KIND_F32, prod(T, d), "x");
        need_array(1, KIND_F32, d, "w");
        need_array(2, KIND_F32, prod(T, d), "expected");
        break;
    }
    case OP_ROPE: {
        need_counts(6, 0, 4);
        int64_t T = dim(0, "T", 1), heads = dim(1, "heads", 1), hd = dim(2, "hd", 2), rd = dim(3, "rope_dim", 2);
        if (rd > hd || rd % 2 || (uint32_t)k->ints[4] > 1 || (uint32_t)k->ints[5] > 1)
            BAD("case %s: rope needs an even rope_dim <= hd and neox, inplace in 0..1", k->name);
        need_array(0, KIND_F32, prod(prod(T, heads), hd), "x");
        need_array(1, KIND_F32, prod(T, rd / 2), "cos");
        need_array(2, KIND_F32, prod(T, rd / 2), "sin");
        need_array(3, KIND_F32, prod(prod(T, heads), hd), "expected");
        break;
    }
    case OP_SWIGLU: {
        need_counts(2, 0, 2);
        int64_t T = dim(0, "T", 1), ff = dim(1, "ff", 1);
        need_array(0, KIND_F32, prod(T, 2 * ff), "gate_up");
        need_array(1, KIND_F32, prod(T, ff), "expected");
        break;
    }
    case OP_SOFTMAX: {
        need_counts(2, 0, 2);
        int64_t rows = dim(0, "rows", 1), n = dim(1, "n", 1);
        need_array(0, KIND_F32, prod(rows, n), "x");
        need_array(1, KIND_F32, prod(rows, n), "expected");
        break;
    }
    case OP_ADD: {
        need_counts(1, 0, 3);
        int64_t n = dim(0, "n", 1);
        need_array(0, KIND_F32, n, "a");
        need_array(1, KIND_F32, n, "b");
        need_array(2, KIND_F32, n, "expected");
        break;
    }
    case OP_EMBED: {
        need_counts(4, 0, 3);
        int wtype = k->ints[0];
        int64_t T = dim(1, "T", 1), row_len = dim(2, "row_len", 1), n_rows = dim(3, "n_rows", 1);
        if (row_bytes(wtype, row_len) <= 0 || (wtype != EL_F32 && wtype != EL_F16 && row_len % 32))
            BAD("case %s: weight type %d with rows of %lld", k->name, wtype, (long long)row_len);
        need_array(0, KIND_RAW, prod(n_rows, row_bytes(wtype, row_len)), "table");
        need_array(1, KIND_RAW, prod(T, 4), "ids");
        const int32_t *ids = k->arr[1].data;
        for (int64_t t = 0; t < T; t++)
            if (ids[t] < 0 || ids[t] >= n_rows) BAD("case %s: id %d of %lld rows", k->name, ids[t], (long long)n_rows);
        need_array(2, KIND_F32, prod(T, row_len), "expected");
        break;
    }
    case OP_ATTN_DENSE:
    case OP_ATTN_POOL: {
        int pool = k->op == OP_ATTN_POOL;
        int i8 = pool && k->n_int == 10 && k->ints[5] == EL_KV_I8;   /* + the two scale arrays */
        need_counts(pool ? 10 : 5, 0, pool ? (i8 ? 7 : 5) : 4);
        if (k->n_int != (pool ? 10u : 5u)) BAD("case %s: %u ints", k->name, k->n_int);
        int64_t T = dim(0, "T", 1), H = dim(1, "H", 1), KVH = dim(2, "KVH", 1), hd = dim(3, "hd", 1);
        int64_t start = dim(4, "start", 0), n = start + T;
        if (H % KVH) BAD("case %s: H = %lld is not a multiple of KVH = %lld", k->name, (long long)H, (long long)KVH);
        int64_t qn = prod(prod(T, H), hd);
        need_array(0, KIND_F32, qn, "q");
        if (!pool) {
            need_array(1, KIND_F32, prod(prod(KVH, n), hd), "k");
            need_array(2, KIND_F32, prod(prod(KVH, n), hd), "v");
        } else {
            int kv_type = k->ints[5];
            if (kv_type != EL_F32 && kv_type != EL_F16 && kv_type != EL_KV_I8)
                BAD("case %s: kv_type %d is not F32 (0), F16 (1) or KV_I8 (16)", k->name, kv_type);
            int64_t bt = dim(6, "block_tokens", 1), layers = dim(7, "n_layers", 1), layer = dim(8, "layer", 0);
            int64_t blocks = dim(9, "n_blocks", 1);
            if (layer >= layers) BAD("case %s: layer %lld of %lld", k->name, (long long)layer, (long long)layers);
            int64_t elems = prod(prod(prod(blocks, layers), prod(bt, KVH)), hd);
            const int esz = kv_type == EL_F32 ? 4 : kv_type == EL_F16 ? 2 : 1;
            need_array(1, KIND_RAW, prod(elems, esz), "k");
            need_array(2, KIND_RAW, prod(elems, esz), "v");
            if (i8) {
                need_array(4, KIND_F32, elems / hd, "k_scale");
                need_array(5, KIND_F32, elems / hd, "v_scale");
            }
            const array_t *tbl = &k->arr[3];
            if (tbl->kind != KIND_RAW || tbl->count % 4 || (int64_t)(tbl->count / 4) * bt < n)
                BAD("case %s: block_table must be raw int32 covering %lld positions", k->name, (long long)n);
            const int32_t *t = tbl->data;
            for (uint64_t i = 0; i < tbl->count / 4; i++)
                if (t[i] < 0 || t[i] >= blocks)
                    BAD("case %s: block_table[%llu] = %d not in 0..%lld", k->name, (unsigned long long)i, t[i],
                        (long long)blocks - 1);
        }
        need_array((int)k->n_arr - 1, KIND_F32, qn, "expected");
        break;
    }
    case OP_KV_QUANT: {
        need_counts(2, 0, 2);
        int64_t rows = dim(0, "rows", 1), hd = dim(1, "hd", 1);
        need_array(0, KIND_F32, prod(rows, hd), "x");
        need_array(1, KIND_F32, prod(rows, hd) + rows, "expected");
        break;
    }
    case OP_SAMPLE: {
        need_counts(3, 3, 3);
        int64_t n = dim(0, "n", 2), n_u = dim(2, "n_u", 1);
        dim(1, "top_k", 0);
        need_array(0, KIND_F32, n, "x");
        need_array(1, KIND_F32, n_u, "u");
        need_array(2, KIND_F32, n_u, "expected");
        break;
    }
    case OP_STEP: {
        need_counts(14, 1, k->n_arr);
        if (k->n_int != 14) BAD("case %s: %u ints", k->name, k->n_int);
        const int64_t L = dim(0, "n_layers", 1), d = dim(1, "d", 32), H = dim(2, "H", 1), KVH = dim(3, "KVH", 1);
        const int64_t hd = dim(4, "hd", 2), ff = dim(5, "ff", 32), rd = dim(6, "rope_dim", 2);
        dim(7, "neox", 0);
        const int wt = k->ints[8], hwt = k->ints[9];
        const int64_t nv = dim(10, "n_vocab", 2), T = dim(11, "T", 1), bt = dim(12, "block_tokens", 1);
        const int64_t mode = dim(13, "mode", 0);
        if (L > STEP_MAX_LAYERS || k->n_arr != 6 * L + 7)
            BAD("case %s: %lld layers and %u arrays (at most %d layers, 6 arrays each, and 7 more)", k->name,
                (long long)L, k->n_arr, STEP_MAX_LAYERS);
        if (H % KVH || rd > hd || rd % 2 || k->ints[7] > 1 || mode > STEP_GREEDY || (mode && T < 2))
            BAD("case %s: inconsistent step shapes", k->name);
        if ((wt != EL_Q4_0 && wt != EL_Q4_1 && wt != EL_Q8_0) || d % 32 || ff % 32 || (H * hd) % 32)
            BAD("case %s: weight type %d with widths d %lld, ff %lld, H*hd %lld", k->name, wt, (long long)d,
                (long long)ff, (long long)(H * hd));
        if (row_bytes(hwt, d) <= 0) BAD("case %s: head weight type %d", k->name, hwt);
        const int64_t qkv = (H + 2 * KVH) * hd;
        for (int64_t l = 0; l < L; l++) {
            const int a = (int)(6 * l);
            need_array(a, KIND_F32, d, "attn_norm");
            need_array(a + 1, KIND_RAW, prod(qkv, row_bytes(wt, d)), "qkv");
            need_array(a + 2, KIND_RAW, prod(d, row_bytes(wt, H * hd)), "attn_out");
            need_array(a + 3, KIND_F32, d, "ffn_norm");
            need_array(a + 4, KIND_RAW, prod(2 * ff, row_bytes(wt, d)), "gate_up");
            need_array(a + 5, KIND_RAW, prod(d, row_bytes(wt, ff)), "down");
        }
        const int t = (int)(6 * L);
        need_array(t, KIND_F32, d, "out_norm");
        need_array(t + 1, KIND_RAW, prod(nv, row_bytes(hwt, d)), "head");
        need_array(t + 2, KIND_F32, prod(T, d), "x");
        need_array(t + 3, KIND_F32, prod(T, rd / 2), "cos");
        need_array(t + 4, KIND_F32, prod(T, rd / 2), "sin");
        need_array(t + 5, KIND_RAW, prod(T, 4), "ids");
        const int32_t *ids = k->arr[t + 5].data;
        for (int64_t i = 0; i < T; i++)
            if (ids[i] < 0 || ids[i] >= nv) BAD("case %s: id %d of %lld", k->name, ids[i], (long long)nv);
        need_array(t + 6, KIND_F32, mode == STEP_GREEDY ? 1 : nv, "expected");
        break;
    }
    default:
        BAD("case %s: unknown op %u", k->name, k->op);
    }
}

/* ---- running ----------------------------------------------------------------------------- */

static el_pool *g_pool;
static int g_failed, g_passed;

/* An output buffer of n floats, pre-filled with NaN so that an element the kernel never writes
 * fails the comparison, followed by a guard that must survive the call. */
static float *out_alloc(int64_t n) {
    float *y = xalloc((uint64_t)(n + GUARD) * 4);
    for (int64_t i = 0; i < n + GUARD; i++) y[i] = NAN;
    return y;
}

static int guard_ok(const float *y, int64_t n) {
    uint32_t bits;
    for (int i = 0; i < GUARD; i++) {
        memcpy(&bits, &y[n + i], 4);
        if (bits != 0x7fc00000u) return 0;
    }
    return 1;
}

static void report(const char *name, const char *path, int ok, double nmse, float bound, const char *why) {
    printf("%s %s%s nmse=%.3e bound=%.1e%s%s\n", ok ? "PASS" : "FAIL", name, path, nmse, (double)bound,
           why ? " " : "", why ? why : "");
    if (ok) g_passed++; else g_failed++;
    fflush(stdout);
}

static void compare(const case_t *k, const char *path, int rc, const float *y, int64_t n, int guard) {
    const float *e = k->arr[k->n_arr - 1].data;
    double err = 0, ref = 0;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(y[i])) finite = 0;
        double d = (double)y[i] - (double)e[i];
        err += d * d;
        ref += (double)e[i] * (double)e[i];
    }
    double nmse = finite ? (ref > 0 ? err / ref : err) : INFINITY;
    char why[64];
    const char *reason = NULL;
    if (rc != 0) { snprintf(why, sizeof why, "(returned %d)", rc); reason = why; }
    else if (!guard) reason = "(wrote past the end of a buffer)";
    else if (!finite) reason = "(non-finite output)";
    report(k->name, path, reason == NULL && nmse <= k->bound, nmse, k->bound, reason);
}

/* OP_STEP: the fused step through the public API, over a zeroed fp16 pool (block table backwards) */
static int run_step(const case_t *k, float *y, int *guard) {
    const int32_t *p = k->ints;
    const array_t *a = k->arr;
    const int L = p[0], wt = p[8], hwt = p[9], nv = p[10], T = p[11], bt = p[12], mode = p[13];
    const el_model_dims dims = {.d = p[1], .H = p[2], .KVH = p[3], .hd = p[4], .ff = p[5], .rope_dim = p[6],
                                .neox = p[7], .eps = k->floats[0]};
    const int d = dims.d, half = dims.rope_dim / 2;
    el_layer layers[STEP_MAX_LAYERS];
    const void *ptr[STEP_MAX_LAYERS][4];
    int rows[STEP_MAX_LAYERS][4];
    for (int l = 0; l < L; l++) {
        const array_t *w = a + 6 * l;
        const int r[4] = {(dims.H + 2 * dims.KVH) * dims.hd, d, 2 * dims.ff, d}, src[4] = {1, 2, 4, 5};
        for (int j = 0; j < 4; j++) ptr[l][j] = w[src[j]].data, rows[l][j] = r[j];
        layers[l] = (el_layer){.attn_norm = w[0].data, .ffn_norm = w[3].data, .bqkv = NULL,
                               .qkv = {wt, 1, &ptr[l][0], &rows[l][0]}, .attn_out = {wt, 1, &ptr[l][1], &rows[l][1]},
                               .gate_up = {wt, 1, &ptr[l][2], &rows[l][2]}, .down = {wt, 1, &ptr[l][3], &rows[l][3]}};
    }
    const array_t *t = a + 6 * L;
    const float *out_norm = t[0].data, *cos = t[3].data, *sin = t[4].data;
    const int32_t *ids = t[5].data;
    const void *hptr[1] = {t[1].data};
    const int hrows[1] = {nv};
    const el_matrix head = {hwt, 1, hptr, hrows};
    const int n_blocks = (T + bt - 1) / bt;
    int32_t *table = xalloc(4ull * n_blocks);
    for (int i = 0; i < n_blocks; i++) table[i] = n_blocks - 1 - i;
    const size_t kv_elems = (size_t)n_blocks * L * bt * dims.KVH * dims.hd;
    uint16_t *kp = xalloc(2 * kv_elems), *vp = xalloc(2 * kv_elems);
    memset(kp, 0, 2 * kv_elems);
    memset(vp, 0, 2 * kv_elems);
    float *x = xalloc(4ull * T * d);
    memcpy(x, t[2].data, 4ull * T * d);
    const size_t ss = el_chunk_scratch(&dims, T);
    uint8_t *scratch = xalloc(ss + 4 * GUARD);
    memset(scratch + ss, 0xA5, 4 * GUARD);
    int rc;
    if (mode == STEP_CHUNK) {
        rc = el_chunk_logits(g_pool, layers, L, &dims, x, T, 0, cos, sin, kp, vp, EL_F16, table, n_blocks, bt,
                             n_blocks, scratch, ss, out_norm, &head, nv, 1, y);
    } else {
        rc = el_chunk_step(g_pool, layers, L, &dims, x, T - 1, 0, cos, sin, kp, vp, EL_F16, table, n_blocks, bt,
                           n_blocks, scratch, ss);
        const size_t o = (size_t)(T - 1) * half;
        if (rc == 0 && mode == STEP_DECODE) {
            rc = el_chunk_logits(g_pool, layers, L, &dims, x + (size_t)(T - 1) * d, 1, T - 1, cos + o, sin + o, kp, vp,
                                 EL_F16, table, n_blocks, bt, n_blocks, scratch, ss, out_norm, &head, nv, 1, y);
        } else if (rc == 0) {
            const el_embedding emb = {.wtype = hwt, .row_len = d, .n_rows = nv, .table = t[1].data};
            float *logits = xalloc(4ull * nv);
            int32_t id = -1;
            const int n = el_decode_greedy(g_pool, layers, L, &dims, &emb, ids[T - 1], x + (size_t)(T - 1) * d, T - 1,
                                           1, cos + o, sin + o, kp, vp, EL_F16, table, n_blocks, bt, n_blocks, scratch,
                                           ss, out_norm, &head, nv, 1, logits, NULL, 0, &id);
            rc = n < 0 ? n : n == 1 ? 0 : -100;   /* (-100: no token produced) */
            y[0] = (float)id;
            free(logits);
        }
    }
    for (size_t i = ss; i < ss + 4 * GUARD; i++) if (scratch[i] != 0xA5) *guard = 0;
    free(scratch);
    free(x);
    free(kp);
    free(vp);
    free(table);
    return rc;
}

static void run_case(const case_t *k, const char *path) {
    const int32_t *p = k->ints;
    const array_t *a = k->arr;
    int rc = 0, guard = 1;
    int64_t n_out = (int64_t)a[k->n_arr - 1].count;
    float *y = out_alloc(n_out);
    switch (k->op) {
    case OP_MATMUL: {
        int n_seg = p[3];
        const void *seg[16];
        int rows[16];
        for (int s = 0; s < n_seg; s++) { seg[s] = a[1 + s].data; rows[s] = p[6 + s]; }
        const float *bias = p[4] ? a[1 + n_seg].data : NULL;
        uint8_t *scratch = NULL;
        size_t ss = 0;
        if (p[5]) {
            ss = el_matmul_scratch(p[1], p[2]);
            scratch = xalloc(ss + 4 * GUARD);
            memset(scratch, 0xA5, ss + 4 * GUARD);
        }
        if (k->n_int == 7u + (uint32_t)n_seg && p[6 + n_seg])
            rc = el_matmul_f32act(g_pool, p[0], seg, rows, n_seg, a[0].data, y, p[1], p[2], bias);
        else
            rc = el_matmul(g_pool, p[0], seg, rows, n_seg, a[0].data, y, p[1], p[2], bias, scratch);
        if (scratch) {
            for (size_t i = ss; i < ss + 4 * GUARD; i++) if (scratch[i] != 0xA5) guard = 0;
            free(scratch);
        }
        break;
    }
    case OP_RMSNORM:
        rc = el_rmsnorm(g_pool, a[0].data, a[1].data, y, p[0], p[1], k->floats[0]);
        break;
    case OP_ROPE:
        if (p[5]) {   /* in place: y starts as a copy of x */
            memcpy(y, a[0].data, (size_t)n_out * 4);
            rc = el_rope(y, y, p[0], p[1], p[2], p[3], a[1].data, a[2].data, p[4]);
        } else {
            rc = el_rope(a[0].data, y, p[0], p[1], p[2], p[3], a[1].data, a[2].data, p[4]);
        }
        break;
    case OP_SWIGLU:
        rc = el_swiglu(g_pool, a[0].data, y, p[0], p[1]);
        break;
    case OP_SOFTMAX:
        memcpy(y, a[0].data, (size_t)n_out * 4);
        rc = el_softmax(y, p[0], p[1]);
        break;
    case OP_ADD:
        rc = el_add(a[0].data, a[1].data, y, (size_t)p[0]);
        break;
    case OP_ATTN_DENSE:
        rc = el_attention_dense(g_pool, a[0].data, y, p[0], p[1], p[2], p[3], p[4], a[1].data, a[2].data);
        break;
    case OP_ATTN_POOL: {
        const el_kv_i8 kd = {a[1].data, p[5] == EL_KV_I8 ? a[4].data : NULL},
                       vd = {a[2].data, p[5] == EL_KV_I8 ? a[5].data : NULL};
        const int i8 = p[5] == EL_KV_I8;
        rc = el_attention_pool(g_pool, a[0].data, y, p[0], p[1], p[2], p[3], p[4], i8 ? (const void *)&kd : a[1].data,
                               i8 ? (const void *)&vd : a[2].data, p[5], a[3].data, p[6], p[7], p[8]);
        break;
    }
    case OP_KV_QUANT: {
        const int64_t n = (int64_t)p[0] * p[1];
        int8_t *q = xalloc((uint64_t)n + 4 * GUARD);
        float *sc = out_alloc(p[0]);
        memset(q + n, 0xA5, 4 * GUARD);
        rc = el_kv_quantize_i8(a[0].data, q, sc, p[0], p[1]);
        for (int64_t i = 0; i < n; i++) y[i] = (float)q[i];
        for (int64_t r = 0; r < p[0]; r++) y[n + r] = sc[r];
        for (int i = 0; i < 4 * GUARD; i++) if ((uint8_t)q[n + i] != 0xA5) guard = 0;
        if (!guard_ok(sc, p[0])) guard = 0;
        free(q);
        free(sc);
        break;
    }
    case OP_SAMPLE: {
        const el_sampling s = {.top_k = p[1], .top_p = k->floats[0], .min_p = k->floats[1],
                               .temperature = k->floats[2], .repeat_penalty = 1.0, .repeat_last_n = 0};
        const size_t ss = el_sample_scratch(p[0]);
        uint8_t *scratch = xalloc(ss + 4 * GUARD);
        memset(scratch + ss, 0xA5, 4 * GUARD);
        const float *u = a[1].data;
        for (int i = 0; i < p[2]; i++) {
            const int id = el_sample(a[0].data, p[0], &s, (double)u[i], scratch, ss);
            y[i] = (float)id;
            if (id < 0) rc = id;
        }
        for (size_t i = ss; i < ss + 4 * GUARD; i++) if (scratch[i] != 0xA5) guard = 0;
        free(scratch);
        break;
    }
    case OP_EMBED: {
        const el_embedding emb = {.wtype = p[0], .row_len = p[2], .n_rows = p[3], .table = a[0].data};
        rc = el_embed_rows(&emb, a[1].data, p[1], y);
        break;
    }
    case OP_STEP:
        rc = run_step(k, y, &guard);
        break;
    }
    compare(k, path, rc, y, n_out, guard && guard_ok(y, n_out));
    free(y);
}

/* ---- built-in checks: the pool, and bad arguments ---------------------------------------- */

typedef struct { int hits[97]; } pf_ctx;

static void pf_task(void *ctx, int task, int n_tasks) {
    (void)n_tasks;
    __atomic_fetch_add(&((pf_ctx *)ctx)->hits[task], 1, __ATOMIC_RELAXED);
}

typedef struct { int hits[97], more[97], after[97]; } pr_ctx;

static void pr_item(void *ctx, int item, int flags) {
    pr_ctx *c = (pr_ctx *)ctx;
    __atomic_fetch_add(&c->hits[item], 1, __ATOMIC_RELAXED);
    c->more[item] = (flags & EL_ITEM_MORE) != 0;
    c->after[item] = (flags & EL_ITEM_AFTER) != 0;
}

static void check(const char *name, int ok, const char *detail) {
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, detail ? " " : "", detail ? detail : "");
    if (ok) g_passed++; else g_failed++;
}

static void builtin_checks(int threads, const char *path) {
    char buf[96], name[96];
    if (g_pool) {
        snprintf(buf, sizeof buf, "threads=%d expected=%d", el_pool_threads(g_pool), threads);
        snprintf(name, sizeof name, "pool/threads%s", path);
        check(name, el_pool_threads(g_pool) == threads, buf);
    }
    for (int round = 0; round < 3; round++) {   /* the pool is reused: each job must start clean */
        pf_ctx ctx;
        memset(&ctx, 0, sizeof ctx);
        int n = round == 0 ? 97 : round == 1 ? 1 : threads + 1, bad = 0;
        el_parallel_for(g_pool, n, pf_task, &ctx);
        for (int i = 0; i < 97; i++) bad |= ctx.hits[i] != (i < n);
        snprintf(buf, sizeof buf, "n_tasks=%d", n);
        snprintf(name, sizeof name, "pool/parallel_for%s", path);
        check(name, !bad, buf);
    }

    /* el_parallel_ranges: every item exactly once; `more` is 0 on the last item of each range
     * only, so there are as many such items as ranges (one per thread, at most one per item);
     * `after` is never on item 0 (no thread did item -1) and, with one range (a serial walk in
     * order), on every other item */
    for (int round = 0; round < 3; round++) {
        pr_ctx ctx;
        memset(&ctx, 0, sizeof ctx);
        const int n = round == 0 ? 97 : round == 1 ? 1 : threads + 1;
        const int pt = el_pool_threads(g_pool), cap = pt < EL_RANGES_MAX ? pt : EL_RANGES_MAX;
        const int ranges = cap < n ? cap : n;
        int bad = 0, last = 0, starts = 0;
        el_parallel_ranges(g_pool, n, pr_item, &ctx);
        for (int i = 0; i < 97; i++) bad |= ctx.hits[i] != (i < n);
        for (int i = 0; i < n; i++) last += !ctx.more[i];
        for (int i = 0; i < n; i++) starts += !ctx.after[i];
        snprintf(buf, sizeof buf, "n_items=%d range_ends=%d expected=%d walk_starts=%d", n, last, ranges, starts);
        snprintf(name, sizeof name, "pool/parallel_ranges%s", path);
        check(name, !bad && last == ranges && !ctx.more[n - 1] && !ctx.after[0] && (ranges > 1 || starts == 1), buf);
    }

    /* arguments the header rules out: the answer is a negative code, never an abort or a write */
    static float x[64 * 64], out[64 * 64], kv[64 * 64];
    static uint8_t w[64 * 34];
    const void *seg[1] = {w};
    int rows[1] = {2};
    int32_t table[1] = {0};
    struct { const char *name; int rc; } bad[8];
    bad[0].name = "args/matmul_unknown_wtype";
    bad[0].rc = el_matmul(g_pool, 99, seg, rows, 1, x, out, 1, 32, NULL, NULL);
    bad[1].name = "args/matmul_q4_0_K_not_multiple_of_32";
    bad[1].rc = el_matmul(g_pool, EL_Q4_0, seg, rows, 1, x, out, 1, 48, NULL, NULL);
    bad[2].name = "args/matmul_q8_0_K_not_multiple_of_32";
    bad[2].rc = el_matmul(g_pool, EL_Q8_0, seg, rows, 1, x, out, 1, 40, NULL, NULL);
    bad[3].name = "args/attention_dense_H_not_multiple_of_KVH";
    bad[3].rc = el_attention_dense(g_pool, x, out, 1, 5, 2, 8, 0, kv, kv);
    bad[4].name = "args/attention_pool_unknown_kv_type";
    bad[4].rc = el_attention_pool(g_pool, x, out, 1, 2, 1, 8, 0, kv, kv, 99, table, 16, 1, 0);
    bad[5].name = "args/matmul_f32act_unknown_wtype";
    bad[5].rc = el_matmul_f32act(g_pool, 99, seg, rows, 1, x, out, 1, 32, NULL);
    bad[6].name = "args/matmul_f32act_q8_0_K_not_multiple_of_32";
    bad[6].rc = el_matmul_f32act(g_pool, EL_Q8_0, seg, rows, 1, x, out, 1, 40, NULL);
    bad[7].name = "args/matmul_f32act_q4_1_M_zero";
    bad[7].rc = el_matmul_f32act(g_pool, EL_Q4_1, seg, rows, 1, x, out, 0, 32, NULL);
    for (int i = 0; i < 8; i++) {
        snprintf(buf, sizeof buf, "rc=%d expected=negative", bad[i].rc);
        snprintf(name, sizeof name, "%s%s", bad[i].name, path);
        check(name, bad[i].rc < 0, buf);
    }

    /* the peak probe (its figure is a timing, not checkable here): 12 chains of 2 ops per lane
     * and iteration, fp32 and int8 always, fp16 only with Arm fp16 vector arithmetic */
    static const char *const peak_names[3] = {"fp32", "fp16", "int8"};
    const unsigned feats = el_features();
    for (int kind = 0; kind < 3; kind++) {
        double ops = 0.0, ops2 = 0.0;
        const int rc = el_peak_probe(kind, 1000, &ops), rc2 = el_peak_probe(kind, 2000, &ops2);
        const double lanes = ops / (1000.0 * 12 * 2);
        const int native_fp16 = (feats & EL_FEAT_FP16) && !(feats & EL_FEAT_SIMDE);
        int ok;
        if (kind == EL_PEAK_FP16 && !native_fp16) ok = rc == EL_EUNSUPPORTED;
        else ok = rc == EL_OK && rc2 == EL_OK && ops2 == 2 * ops && lanes >= 4 && lanes == (double)(long)lanes;
        snprintf(buf, sizeof buf, "rc=%d ops=%.0f (%.2f lanes per chain step)", rc, ops, lanes);
        snprintf(name, sizeof name, "peak/%s%s", peak_names[kind], path);
        check(name, ok, buf);
    }
}

/* ---- main -------------------------------------------------------------------------------- */

static uint8_t *read_file(const char *path, uint64_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "selftest: cannot open %s\n", path); exit(2); }
    uint8_t *buf = NULL;
    uint64_t cap = 0, n = 0;
    for (;;) {   /* read in chunks: works for pipes too, and caps the size before it is trusted */
        if (n == cap) {
            cap = cap ? cap * 2 : 1 << 16;
            if (cap > MAX_FILE_BYTES + 1) cap = MAX_FILE_BYTES + 1;
            if (n == cap) {
                fprintf(stderr, "selftest: %s is larger than %llu bytes\n", path, (unsigned long long)MAX_FILE_BYTES);
                exit(2);
            }
            uint8_t *nb = realloc(buf, (size_t)cap);
            if (!nb) { fprintf(stderr, "selftest: out of memory reading %s\n", path); exit(2); }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, (size_t)(cap - n), f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) { fprintf(stderr, "selftest: error reading %s\n", path); exit(2); }
    fclose(f);
    *size = n;
    return buf;
}

static void usage(void) {
    fprintf(stderr, "usage: selftest [-t THREADS] [-k SUBSTRING] [-f] CASES_FILE\n"
                    "  -f  run even where the CPU lacks the instructions this build uses\n");
    exit(2);
}

/* A dotprod build on a core without dot products or fp16 arithmetic dies with SIGILL at its
 * first such instruction, which reads like a broken kernel; say what it is instead (exit 3).
 * Linux HWCAP bits: FPHP 9, ASIMDHP 10, ASIMDDP 20. Checked first, before any kernel runs. */
static void check_cpu(void) {
#if defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP);
    const int dot = (hw >> 20) & 1, fp16 = ((hw >> 9) & 1) && ((hw >> 10) & 1);
    if ((EL_DOTPROD && !dot) || (EL_FP16 && !fp16)) {
        fprintf(stderr, "selftest: this build (%s) needs dot product and fp16 arithmetic instructions, which "
                        "this CPU lacks (HWCAP dotprod=%d fp16=%d): run selftest_base, whose library is the "
                        "one for this CPU\n", el_build_info(), dot, fp16);
        exit(3);
    }
#endif
}

int main(int argc, char **argv) {
    int threads = 2, force = 0;
    const char *filter = NULL, *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-f")) {
            force = 1;
            continue;
        }
        if (!strcmp(argv[i], "-t") && i + 1 < argc) {
            char *end;
            long t = strtol(argv[++i], &end, 10);
            if (*end || t < 1 || t > 256) usage();
            threads = (int)t;
        } else if (!strcmp(argv[i], "-k") && i + 1 < argc) {
            filter = argv[++i];
        } else if (argv[i][0] == '-' || path) {
            usage();
        } else {
            path = argv[i];
        }
    }
    if (!path) usage();
    if (!force) check_cpu();
    g_path = path;
    /* line by line even into a pipe or file: if a kernel crashes, the last line names the case before */
    setvbuf(stdout, NULL, _IOLBF, 0);

    uint64_t size;
    uint8_t *file = read_file(path, &size);
    cursor_t c = {file, size, 0};
    char magic[8];
    take(&c, magic, 8, "magic");
    if (memcmp(magic, "ELSTCASE", 8)) die_format(&c, "bad magic (not an edgellm self-test cases file)");
    uint32_t version = take_u32(&c, "version"), n_cases = take_u32(&c, "case count");
    if (version != 1) die_format(&c, "version %u, this self-test reads version 1", version);
    if (n_cases < 1 || n_cases > MAX_CASES) die_format(&c, "case count %u not in 1..%d", n_cases, MAX_CASES);
    /* the smallest case takes 25 bytes: a count the file cannot hold is corrupt, not allocated */
    if (n_cases > c.left / 25)
        die_format(&c, "case count %u but only %llu bytes left", n_cases, (unsigned long long)c.left);
    case_t *cases = calloc(n_cases, sizeof *cases);
    if (!cases) { fprintf(stderr, "selftest: out of memory\n"); return 2; }
    for (uint32_t i = 0; i < n_cases; i++) {
        read_case(&c, &cases[i], i);
        g_end = c;
        validate(&cases[i]);
    }
    if (c.left) die_format(&c, "%llu bytes after the last case", (unsigned long long)c.left);
    free(file);
    if (filter) {   /* a filter that matches nothing ran only the built-in checks and said "passed" */
        uint32_t hits = 0;
        for (uint32_t i = 0; i < n_cases; i++) hits += strstr(cases[i].name, filter) != NULL;
        if (!hits) {
            fprintf(stderr, "selftest: -k %s matches none of the %u cases in %s\n", filter, n_cases, path);
            return 2;
        }
    }

    printf("# edgellm selftest: %s features=0x%x threads=%d cases=%u\n", el_build_info(), el_features(), threads,
           n_cases);
    g_pool = el_pool_create(threads, NULL, 0);
    if (!g_pool) check("pool/create", 0, "el_pool_create returned NULL; running on the caller");

    static const char *paths[2] = {"", "/generic"};
    for (int generic = 0; generic < 2; generic++) {
        el_use_generic(generic);
        builtin_checks(threads, paths[generic]);
        for (uint32_t i = 0; i < n_cases; i++)
            if (!filter || strstr(cases[i].name, filter)) run_case(&cases[i], paths[generic]);
    }
    el_use_generic(0);
    el_pool_destroy(g_pool);
    for (uint32_t i = 0; i < n_cases; i++) free_case(&cases[i]);
    free(cases);
    printf("# %d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
