/* edgellm NEON kernel library: the public C API (loaded from Python through ctypes).
 *
 * One source tree, three ways to build it:
 *   - natively on aarch64 (real NEON; the "dotprod" variant adds -march=armv8.2-a+dotprod+fp16),
 *   - on x86 dev machines through SIMDe, which maps the same intrinsics onto SSE/AVX,
 *   - cross-compiled for a device (tools/cross_build.py, `edgellm build`).
 * Each build produces two variants of the library: "base" (Armv8.0 NEON) and "dotprod"
 * (SDOT/UDOT int8 dot products and fp16 vector arithmetic). The loader picks one at run time
 * from the CPU's HWCAP flags (asimddp, asimdhp).
 *
 * Conventions: row-major; "x (M, K)" means M rows of K floats, contiguous. Weight matrices keep
 * GGUF's (out, in) layout: row n holds the K inputs of output n. Every kernel has a plain C
 * `_generic` twin; el_use_generic(1) routes every call to the twins (tests, self-test).
 * Functions return 0 on success, a negative EL_E* code on bad arguments (never abort).
 */
#ifndef EDGELLM_NEON_H
#define EDGELLM_NEON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EL_API __attribute__((visibility("default")))

/* EL_ENONFINITE: logits a sampler cannot draw from (a NaN, or a maximum of +-inf) */
enum { EL_OK = 0, EL_EINVAL = -1, EL_ENOMEM = -2, EL_EUNSUPPORTED = -3, EL_ENONFINITE = -4 };

/* GGML type ids of the weight formats the quantized matmul reads (GGUF block layouts):
 * Q4_0: 32 weights = fp16 d + 16 bytes of 4-bit q (w = d * (q - 8)); 18 bytes.
 *       byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
 * Q4_1: fp16 d + fp16 m + 16 bytes (w = d * q + m); 20 bytes, same nibble order.
 * Q8_0: fp16 d + 32 int8 (w = d * q); 34 bytes.
 * F32 / F16: plain rows. */
enum { EL_F32 = 0, EL_F16 = 1, EL_Q4_0 = 2, EL_Q4_1 = 3, EL_Q8_0 = 8 };
/* KV storage type of an int8 pool (a kv_type, never a weight type): k and v then each point to
 * an el_kv_i8, the arena and its per (token, kv head) scales. An element is q * scale. */
enum { EL_KV_I8 = 16 };
typedef struct {
    void *q;        /* int8 (n_blocks, n_layers, block_tokens, KVH, hd) */
    float *scale;   /* (n_blocks, n_layers, block_tokens, KVH): scale = max |x| / 127 of the row */
} el_kv_i8;
/* rows (token, kv head) rows of hd values -> int8 q (rows, hd) and scale (rows,): each row as the
 * fused step stores it into an EL_KV_I8 pool (kv/pool.py quantize_int8, bit for bit). */
EL_API int el_kv_quantize_i8(const float *x, int8_t *q, float *scale, int rows, int hd);

/* ---- build and features ------------------------------------------------------------------ */
enum { EL_FEAT_NEON = 1, EL_FEAT_DOTPROD = 2, EL_FEAT_FP16 = 4, EL_FEAT_SIMDE = 8 };
EL_API unsigned el_features(void);          /* compiled-in paths of this variant */
EL_API const char *el_build_info(void);     /* "variant=dotprod simde=1 compiler=gcc 12.2.0 ..." */
/* x86 instruction-set extensions the compiler was allowed to use (bit i: EL_X86_ISA[i] of
 * edgellm/backends/neon_lib.py); 0 off x86 */
EL_API unsigned el_build_isa(void);
EL_API void el_use_generic(int on);         /* 1: every kernel runs its _generic twin */
/* x86 development builds only: which GEMVs run on 512-bit registers, bit 0 the Q4 GEMV, bit 1
 * the Q8_0 lm_head's; a clear bit runs the AVX2 kernel (same results to fp32 rounding). set >= 0
 * sets the mask (default 3). Returns the mask now in force, or -1 when this build has no AVX-512
 * GEMVs (Arm, or an x86 CPU without AVX-512 VNNI + VBMI): there is nothing to choose. */
EL_API int el_x86_gemv(int set);

/* The arithmetic peak of the calling core (peak_probe.c): iters rounds of 12 independent chains
 * of this build's widest multiply-accumulate for the kind; *ops = multiplies + adds done. The
 * caller times it. EL_EUNSUPPORTED: no such arithmetic here (fp16 without Arm fp16 vectors). */
enum { EL_PEAK_FP32 = 0, EL_PEAK_FP16 = 1, EL_PEAK_INT8 = 2 };
EL_API int el_peak_probe(int kind, long iters, double *ops);

/* ---- thread pool ------------------------------------------------------------------------- */
/* A persistent pool: n_threads - 1 workers plus the calling thread. Workers are pinned to
 * cores[] (round robin) when cores != NULL; they spin briefly, then sleep, between jobs. */
typedef struct el_pool el_pool;
typedef void (*el_task_fn)(void *ctx, int task, int n_tasks);
EL_API el_pool *el_pool_create(int n_threads, const int *cores, int n_cores);
EL_API void el_pool_destroy(el_pool *pool);
EL_API int el_pool_threads(const el_pool *pool);
/* Writes the CPUs worker `thread` (0 = the caller) may run on into cores_out; returns the count,
 * or a negative code. Lets Python read the pinning back. */
EL_API int el_pool_affinity(el_pool *pool, int thread, int *cores_out, int max_cores);
/* Runs fn(ctx, t, n_tasks) for t in 0..n_tasks-1 across the pool; returns when all are done.
 * pool may be NULL (runs on the caller). */
EL_API void el_parallel_for(el_pool *pool, int n_tasks, el_task_fn fn, void *ctx);

/* The memory read bandwidth (read_probe.c): the pool's threads stream buf (bytes a multiple of
 * 64, buf 8-byte aligned) once; *sum = its uint64 words summed (wrapping). The caller times it. */
EL_API int el_read_probe(el_pool *pool, const void *buf, size_t bytes, uint64_t *sum);

/* ---- matmul ------------------------------------------------------------------------------ */
/* y (M, N) = x (M, K) @ W^T (+ bias (N,)), W of type wtype given as n_seg row segments (fused
 * projections stay separate GGUF tensors): segment s has seg_rows[s] rows starting at
 * seg_ptr[s]; N = sum of seg_rows. K must be a multiple of 32 for the block types.
 * Quantized types quantize x to int8 blocks of 32 (one fp32 scale per block) and accumulate
 * int32 dot products, scaled in fp32. M == 1 runs a GEMV; M > 1 a tiled GEMM that reuses each
 * weight block across a tile of rows. scratch: NULL, or at least el_matmul_scratch(M, K) bytes. */
EL_API size_t el_matmul_scratch(int M, int K);
EL_API int el_matmul(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                     const float *x, float *y, int M, int K, const float *bias, void *scratch);
/* The same product with x kept in fp32 (no scratch): block weights are widened to fp32 in
 * registers (matmul_float.c) and FMA'd against x, accumulated in fp32, so the result differs
 * from x @ dequantized(W)^T only in rounding order. More arithmetic per weight than the int8
 * path (every quant converted, no SDOT): for outputs where x's int8 rounding matters, such as
 * the output head, whose near-tied logits decide the token, a GEMV bound by weight reads.
 * F32 / F16 weights run el_matmul's kernels (already fp32). Same arguments, segments, return
 * codes and threading as el_matmul. */
EL_API int el_matmul_f32act(el_pool *pool, int wtype, const void *const *seg_ptr, const int *seg_rows, int n_seg,
                            const float *x, float *y, int M, int K, const float *bias);

/* ---- elementwise (fp32 in and out; accumulation in fp32 everywhere) ---------------------- */
EL_API int el_rmsnorm(el_pool *pool, const float *x, const float *w, float *y, int T, int d, float eps);
/* x, y (T, heads, hd); cos, sin (T, rope_dim/2); neox = 0: rotate pairs (2i, 2i+1); 1: (i, i+half).
 * Dims past rope_dim are copied. y may equal x. */
EL_API int el_rope(const float *x, float *y, int T, int heads, int hd, int rope_dim,
                   const float *cos, const float *sin, int neox);
/* gate_up (T, 2*ff) = [gate | up] -> y (T, ff) = silu(gate) * up */
EL_API int el_swiglu(el_pool *pool, const float *gate_up, float *y, int T, int ff);
EL_API int el_softmax(float *x, int rows, int n);              /* in place, per row */
EL_API int el_add(const float *a, const float *b, float *y, size_t n);

/* ---- attention --------------------------------------------------------------------------- */
/* Causal GQA attention with online softmax (no n-by-n matrix): q (T, H, hd) at positions
 * start..start+T-1 sees keys 0..start+t; query head h reads kv head h / (H / KVH).
 * out (T, H * hd). Scale 1/sqrt(hd).
 *
 * el_attention_pool reads K/V straight from the KV pool's arena:
 *   k, v: (n_blocks, n_layers, block_tokens, KVH, hd), kv_type EL_F32 or EL_F16, or for EL_KV_I8
 *   each an el_kv_i8 (int8 arena + scales),
 *   position p of the sequence is block block_table[p / block_tokens], row p % block_tokens.
 * el_attention_dense reads gathered fp32 k, v of shape (KVH, n, hd), n = start + T. */
EL_API int el_attention_pool(el_pool *pool, const float *q, float *out, int T, int H, int KVH, int hd, int start,
                             const void *k, const void *v, int kv_type, const int32_t *block_table,
                             int block_tokens, int n_layers, int layer);
EL_API int el_attention_dense(el_pool *pool, const float *q, float *out, int T, int H, int KVH, int hd, int start,
                              const float *k, const float *v);

/* ---- fused layer steps ------------------------------------------------------------------- */
/* A decode token or a prefill chunk through every layer in one call (decode_step.c): per layer
 * the same kernels, in the same order, as the per-op path (rmsnorm, QKV matmul + bias, RoPE of q
 * and k, K/V written to the pool, attention from the pool, output projection + residual,
 * rmsnorm, gate|up matmul, SwiGLU, down matmul + residual), so its results equal the per-op
 * path's bit for bit. A Python step costs one ctypes call instead of ~12 per layer. */

/* A weight matrix as el_matmul takes it: n_seg row segments of type wtype (EL_*). */
typedef struct {
    int wtype;
    int n_seg;
    const void *const *seg_ptr;   /* (n_seg,) first byte of each segment */
    const int *seg_rows;          /* (n_seg,) output rows of each segment */
} el_matrix;

typedef struct {
    const float *attn_norm;       /* (d,) */
    const float *ffn_norm;        /* (d,) */
    const float *bqkv;            /* (H*hd + 2*KVH*hd,) or NULL */
    el_matrix qkv;                /* (H*hd + 2*KVH*hd, d): Q, K, V rows */
    el_matrix attn_out;           /* (d, H*hd) */
    el_matrix gate_up;            /* (2*ff, d): gate rows, then up rows */
    el_matrix down;               /* (d, ff) */
} el_layer;

typedef struct {
    int d;                        /* residual width */
    int H, KVH, hd;               /* query heads, kv heads, head width */
    int ff;                       /* FFN hidden width */
    int rope_dim;                 /* leading dims of each head rotated (even, <= hd) */
    int neox;                     /* 0: rotate pairs (2i, 2i+1); 1: (i, i + rope_dim/2) */
    float eps;                    /* RMSNorm epsilon */
} el_model_dims;

/* Bytes of scratch el_decode_step needs for these dims; 0 when the dims are invalid. */
EL_API size_t el_decode_scratch(const el_model_dims *dims);
/* Runs layers[0..n_layers) for the token at position pos. x (d,): the residual stream (the
 * token's embedding in, the last layer's output out), updated in place. cos_row, sin_row
 * (rope_dim/2,): the RoPE row of position pos. k_pool, v_pool: the pool arena
 * (n_blocks, n_layers, block_tokens, KVH, hd) of kv_type EL_F32 or EL_F16 (fp16 stored rounded
 * to nearest even), or EL_KV_I8 with k_pool and v_pool each an el_kv_i8 (each (token, kv head)
 * row quantized as the pool's Python writer does, bit for bit); position p lives in block block_table[p / block_tokens] (block_table holds
 * n_table entries, pos / block_tokens < n_table), row p % block_tokens. Writes this token's K
 * (rotated) and V into every layer, then attends over positions 0..pos. scratch: at least
 * el_decode_scratch(dims) bytes, any alignment, not overlapping x. Every argument, every block id
 * in the table up to pos and every layer's matrix shapes are checked before anything is written:
 * a negative code leaves x and the pool untouched. */
EL_API int el_decode_step(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x,
                          int pos, const float *cos_row, const float *sin_row, void *k_pool, void *v_pool,
                          int kv_type, const int32_t *block_table, int n_table, int block_tokens, int n_blocks,
                          void *scratch, size_t scratch_bytes);
/* A chunk of T tokens (positions pos..pos+T-1) through every layer: el_decode_step's contract
 * for T rows. x (T, d), cos and sin (T, rope_dim/2): the chunk's RoPE rows; every block id up to
 * position pos+T-1 must be in the table; scratch: el_chunk_scratch(dims, T) bytes (0: the dims
 * or T are invalid). el_decode_step is its T = 1 case. */
EL_API size_t el_chunk_scratch(const el_model_dims *dims, int T);
EL_API int el_chunk_step(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x,
                         int T, int pos, const float *cos, const float *sin, void *k_pool, void *v_pool,
                         int kv_type, const int32_t *block_table, int n_table, int block_tokens, int n_blocks,
                         void *scratch, size_t scratch_bytes);
/* el_chunk_step for a caller that reads only the chunk's last out_rows rows (0..T) of x: the
 * last layer stores every row's K/V, then computes its attention output and FFN for those rows
 * alone (a prompt's last chunk needs one row for its logits, the chunks before it none). x rows
 * before them are left holding the last layer's input. el_chunk_step is its out_rows = T case. */
EL_API int el_chunk_step_out(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                             float *x, int T, int pos, const float *cos, const float *sin, void *k_pool,
                             void *v_pool, int kv_type, const int32_t *block_table, int n_table,
                             int block_tokens, int n_blocks, void *scratch, size_t scratch_bytes, int out_rows);
/* el_chunk_step_out with out_rows = 1, then the model's tail on the chunk's last row: logits
 * (n_vocab,) = head . rmsnorm(x[T-1], out_norm (d,), dims->eps), head (n_vocab, d) of a block
 * or float type; f32act = 1 keeps the normed row in fp32 (el_matmul_f32act), 0 quantizes it
 * (el_matmul). The head's arguments are checked with the rest, before anything is written; x is
 * left as el_chunk_step_out leaves it. One call per decode token instead of three (step, norm,
 * head). */
EL_API int el_chunk_logits(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims, float *x,
                           int T, int pos, const float *cos, const float *sin, void *k_pool, void *v_pool,
                           int kv_type, const int32_t *block_table, int n_table, int block_tokens, int n_blocks,
                           void *scratch, size_t scratch_bytes, const float *out_norm, const el_matrix *head,
                           int n_vocab, int f32act, float *logits);
/* ---- embedding lookup (embedding.c) ------------------------------------------------------ */
/* A token table of n_rows rows of row_len values, type wtype (EL_F32, EL_F16, EL_Q8_0, EL_Q4_0 or
 * EL_Q4_1; row_len a multiple of 32 for the block types), as GGUF stores it. */
typedef struct {
    int wtype;
    int row_len;
    int64_t n_rows;
    const void *table;
} el_embedding;
/* out (T, row_len) = the rows ids[0..T) dequantized to fp32, bit-identical to the reference
 * backend's lookup (quant.dequantize). EINVAL for an id outside 0..n_rows-1 (every id is
 * checked before anything is written), EUNSUPPORTED for another wtype. */
EL_API int el_embed_rows(const el_embedding *emb, const int32_t *ids, int T, float *out);
/* A step from its token ids: x (T, d) = el_embed_rows(emb, ids), then el_chunk_logits (logits
 * not NULL; out_rows must be 1) or el_chunk_step_out (logits NULL). One call from token ids to
 * K/V and logits: a decode token's lookup costs no call of its own. Same arguments and codes as
 * those two; the ids are checked first (a bad one writes nothing); a step that refuses its
 * other arguments leaves the embeddings in x and the pool untouched. */
/* Up to n_max greedy decode tokens in one call (el_chunk_ids of one token, then the first
 * maximum of its logits, fed to the next step): returns how many it produced into out_ids, after
 * n_max, a stop id, or before logits with a NaN; cos, sin: rows of positions pos..pos+n_max-1. */
EL_API int el_decode_greedy(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                            const el_embedding *emb, int32_t first_id, float *x, int pos, int n_max,
                            const float *cos, const float *sin, void *k_pool, void *v_pool, int kv_type,
                            const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                            size_t scratch_bytes, const float *out_norm, const el_matrix *head, int n_vocab,
                            int f32act, float *logits, const int32_t *stop_ids, int n_stop, int32_t *out_ids);
/* A sampling chain (neon/sample.c): repetition penalty -> top-k -> top-p -> min-p ->
 * temperature -> draw (llama.cpp's order). */
typedef struct {
    /* doubles, as the Python twin's parameters are: the same target sums and float32 constants */
    int top_k;              /* keep the k highest logits; 0 = off */
    double top_p;           /* nucleus mass in [0, 1]; 1 = off, 0 = the top-ranked id alone */
    double min_p;           /* drop p < min_p * p_max, in [0, 1]; 0 = off */
    double temperature;     /* > 0; 0 = greedy: the first maximum (a decode run only) */
    double repeat_penalty;  /* > 0; 1 = off. Only a decode run applies it (el_sample has no history) */
    int repeat_last_n;      /* the recent tokens it covers; 0 = off, -1 = the whole history */
} el_sampling;
/* bytes of scratch el_sample needs for n_vocab logits */
EL_API size_t el_sample_scratch(int n_vocab);
/* The id the chain draws from x (n,) with the uniform u in [0, 1); EL_ENONFINITE when x holds a
 * NaN or its maximum is +-inf, EL_EINVAL for a bad argument (temperature 0 among them). */
EL_API int el_sample(const float *x, int n, const el_sampling *s, double u, void *scratch, size_t scratch_bytes);
/* el_decode_greedy with the chain's pick instead of the bare argmax: step i draws with u[i]
 * (n_max of them; unused with temperature 0, which picks the first maximum), after the
 * repetition penalty over the last repeat_last_n tokens of history[0..n_history) followed by
 * the tokens the run produced before it. It stops before picking from logits it cannot pick
 * from (a NaN; a draw: any non-finite maximum). sample_scratch: at least
 * el_decode_sample_scratch(n_vocab, n_history, n_max) bytes. A bad chain, uniform or history id
 * is refused up front. sampling NULL: el_decode_greedy. The returned logits are the last step's as computed (no penalty). */
EL_API size_t el_decode_sample_scratch(int n_vocab, int n_history, int n_max);
EL_API int el_decode_sample(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                            const el_embedding *emb, int32_t first_id, float *x, int pos, int n_max,
                            const float *cos, const float *sin, void *k_pool, void *v_pool, int kv_type,
                            const int32_t *block_table, int n_table, int block_tokens, int n_blocks, void *scratch,
                            size_t scratch_bytes, const float *out_norm, const el_matrix *head, int n_vocab,
                            int f32act, float *logits, const int32_t *stop_ids, int n_stop, int32_t *out_ids,
                            const el_sampling *sampling, const double *u, const int32_t *history, int n_history,
                            void *sample_scratch, size_t sample_scratch_bytes);
EL_API int el_chunk_ids(el_pool *pool, const el_layer *layers, int n_layers, const el_model_dims *dims,
                        const el_embedding *emb, const int32_t *ids, float *x, int T, int pos, const float *cos,
                        const float *sin, void *k_pool, void *v_pool, int kv_type, const int32_t *block_table,
                        int n_table, int block_tokens, int n_blocks, void *scratch, size_t scratch_bytes,
                        int out_rows, const float *out_norm, const el_matrix *head, int n_vocab, int f32act,
                        float *logits);
/* y (n,) = x rounded to fp16 bits (nearest even; overflow to inf; NaN stays NaN): the pool's
 * fp16 K/V conversion, exported so that tests can hold it against numpy's astype(float16). */
EL_API int el_f32_to_f16(const float *x, uint16_t *y, size_t n);

/* ---- tokenizer: byte-level BPE merges (bpe.c) ------------------------------------------- */
/* Strings are UTF-32 code points; string j is cp[start[j] .. start[j + 1]). Tokens are the
 * vocabulary in id order, merges "a b" in rank order (GGUF's tokenizer.ggml.tokens / .merges).
 * create returns NULL with *err_kind (EL_BPE_E*) and *err_index (the token or merge at fault). */
typedef struct el_bpe el_bpe;
enum { EL_BPE_EARG = 1, EL_BPE_ENOMEM = 2, EL_BPE_EDUP = 3, EL_BPE_ESPLIT = 4, EL_BPE_ELEFT = 5,
       EL_BPE_ERIGHT = 6, EL_BPE_EMERGED = 7 };
EL_API el_bpe *el_bpe_create(const uint32_t *tok_cp, const int32_t *tok_start, int n_tok, const uint32_t *mrg_cp,
                             const int32_t *mrg_start, int n_mrg, int ignore_merges, int *err_kind, int *err_index);
EL_API void el_bpe_destroy(el_bpe *bpe);
/* The id of the token whose text is cp[0 .. n), -1 if none (EL_EINVAL: bad arguments). */
EL_API int el_bpe_token_id(const el_bpe *bpe, const uint32_t *cp, int n);
/* Pieces (pre-tokenized, byte-mapped) -> token ids in out (cap >= their code points: a piece
 * yields at most one id per character). Returns the number of ids, or a negative EL_E* code. */
EL_API int el_bpe_encode(const el_bpe *bpe, const uint32_t *cp, const int32_t *piece_start, int n_pieces,
                         int32_t *out, int cap);
/* Text (code points, not yet pre-tokenized) -> token ids, pre-tokenized here (pretok.c) as
 * llama.cpp's 'gpt2', 'smollm', 'llama3', 'qwen2' or 'default' pre-tokenizer splits it, each piece's UTF-8 bytes mapped to
 * GPT-2's byte characters, then merged. cap >= 4 n (a piece yields at most one id per byte).
 * Returns the number of ids, or a negative EL_E* code (EL_EUNSUPPORTED: another family). */
enum { EL_PRE_GPT2 = 1, EL_PRE_SMOLLM = 2, EL_PRE_LLAMA3 = 3, EL_PRE_QWEN2 = 4, EL_PRE_DEFAULT = 5 };
EL_API int el_bpe_encode_text(const el_bpe *bpe, int family, const uint32_t *cp, int n, int32_t *out, int cap);
/* SentencePiece-style vocabularies (llama.cpp's SPM tokenizer): tokens and their scores, unk the
 * unknown token (-1: none); the byte tokens are found by their text "<0xNN>". encode takes the
 * text as llama.cpp hands it over (spaces already as U+2581); cap >= 4 n. */
EL_API el_bpe *el_spm_create(const uint32_t *tok_cp, const int32_t *tok_start, int n_tok, const float *scores,
                             int unk, int *err_kind, int *err_index);
EL_API int el_spm_encode(const el_bpe *bpe, const uint32_t *cp, int n, int32_t *out, int cap);

/* ---- GGUF parsing (gguf_walk.c) ---------------------------------------------------------- */
/* A GGUF string array of n strings at buf[pos..] (each a little-endian u64 length, then its
 * bytes): starts[j] = where string j's bytes begin, relative to pos; *end = the array's end.
 * Returns 0, 1 at a length past the buffer's end or over max_len (nothing more is said: the
 * caller names it), or EL_EINVAL. */
EL_API int el_gguf_string_walk(const uint8_t *buf, uint64_t size, uint64_t pos, int64_t n, uint64_t max_len,
                               int64_t *starts, uint64_t *end);

#ifdef __cplusplus
}
#endif
#endif
