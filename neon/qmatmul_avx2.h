/* x86 AVX2 tiles for development builds (EL_SIMDE on x86): the Q4 GEMV (8 rows x 2 blocks), the
 * 4-row tile that el_qtile hands x86 builds, and the GEMM on weights repacked per task. Included
 * by quant_matmul.c, which owns the helpers and layouts they use (el_xq, el_qblock_bytes, ...).
 * ARM builds never see this code; the NEON tiles stay in quant_matmul.c. */

#if EL_SIMDE && defined(__AVX2__)
/* x86 AVX2: even with the shims above a GEMV ran at ~1/3 of DRAM bandwidth, so this tile gets
 * the same int32 block sums from llama.cpp's x86 scheme: one 32-byte VPMADDUBSW per row and block
 * (u8 x s8 -> s16 pair sums), then VPMADDWD by 1. The sums are exact and the fp32 scaling below
 * is the NEON tile's own code, so results are bit-identical to it.
 * Q4: the nibbles 0..15 are the unsigned operand. Q8_0: |w| = VPSIGNB(w, w) is (-128 reads as
 * 128), and x takes w's sign; pair sums <= 2 * 128 * 127 < 32767, so VPMADDUBSW never saturates.
 * Negating x cannot wrap: its scale keeps |q_x| <= 127 for finite x. */
static inline __m256i el_dot32_avx2(const int wt, __m256i w, __m256i x) {
    const __m256i p = wt == EL_Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                    : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline int el_ld32(const uint8_t *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4 only: s16 lanes of 4 rows' VPMADDUBSW results -> int32 lane r of each 128-bit half = row r's
 * total over that half (el_sum4_q4_avx2 adds the halves). The tree adds 4 s16 lanes into one:
 * with 2 products per input lane (the 4-row tile) that is 8 * 15 * 128, with 4 (the GEMV tile,
 * which adds its two nibble halves first) 16 * 15 * 128 = 30720, both < 32767, so the int16 adds
 * are exact and one VPMADDWD finishes all 4 rows (Q8_0's sums would overflow int16). Shifts and
 * blends, not VPHADD: a few % faster for Q4 on Zen 3, where VPHADDD stayed ~5% faster for Q8_0. */
static inline __m256i el_sum4_q4_halves_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i q01 = _mm256_add_epi16(_mm256_blend_epi32(p0, _mm256_slli_epi64(p1, 32), 0xAA),
                                         _mm256_blend_epi32(_mm256_srli_epi64(p0, 32), p1, 0xAA));
    const __m256i q23 = _mm256_add_epi16(_mm256_blend_epi32(p2, _mm256_slli_epi64(p3, 32), 0xAA),
                                         _mm256_blend_epi32(_mm256_srli_epi64(p2, 32), p3, 0xAA));
    return _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_blend_epi32(q01, q23, 0xCC),
                         _mm256_shuffle_epi32(_mm256_blend_epi32(q23, q01, 0xCC), 0x4E)),
        _mm256_set1_epi16(1));
}

static inline __m128i el_sum4_q4_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i r = el_sum4_q4_halves_avx2(p0, p1, p2, p3);
    return _mm_add_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* x86 GEMV, Q4: 8 rows x 2 blocks per step. The 4-row tile above ran a Q4_1 GEMV at ~14 GB/s
 * per thread with the weights in cache, under the ~26 GB/s of DRAM for 2 threads: ~17 instructions
 * per row and block, a quarter of them folding 4 rows' lanes (el_sum4_q4_avx2). Here one register
 * holds a row's blocks b (low half) and b + 1 (high half), so the same fold yields 8 row-block
 * sums instead of 4, and the fp32 scaling runs 8 rows wide: ~10 instructions per row and block,
 * 1.3-1.5x the 4-row tile's speed from cache. The arithmetic per row is unchanged: exact int32
 * block sums, then for b, then b + 1, the same FMA by d_w d_x (the product rounded first) and
 * the same FMA by m_w s_x, so results are bit-identical to the 4-row tile.
 * Prefetch: one linear stream through the 8 rows' bytes, 8 rows (one step of tiles) ahead; the
 * per-row streams EL_PF_BYTES ahead that the 4-row tile uses made this faster tile 10-30% slower
 * than the 4-row tile on DRAM-resident weights (at K = 1536 the 8 rows span 7.5 KiB, so a row's
 * prefetch 4 KiB ahead landed in the same tile, just before its use), the linear stream 10-20%
 * faster. step: blocks b and b + 1 (two = 0: block b alone, the odd tail). */
static inline __attribute__((always_inline)) __m256
el_qgemv8_step(const int wt, const int two, const uint8_t *const w[8], size_t pfd, int b, const int8_t *xq,
               const float *xd, const float *xs, __m256 acc) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt), b1 = two ? bs : 0;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i dm_order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const uint8_t *blk[8];
    for (int r = 0; r < 8; r++) blk[r] = w[r] + (size_t)b * bs;
    for (int j = 0; j < 8 * 2 * bs; j += 64) __builtin_prefetch(w[0] + pfd + (size_t)b * 8 * bs + j);
    const int8_t *xb = xq + (size_t)b * QK;
    const int xo = two ? QK : 0;
    const __m256i xl = _mm256_loadu2_m128i((const __m128i *)(xb + xo), (const __m128i *)xb);
    const __m256i xh = _mm256_loadu2_m128i((const __m128i *)(xb + xo + 16), (const __m128i *)(xb + 16));
    __m256i p[8];
    for (int r = 0; r < 8; r++) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i *)(blk[r] + b1 + off), (const __m128i *)(blk[r] + off));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        p[r] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    }
    const __m256i s03 = el_sum4_q4_halves_avx2(p[0], p[1], p[2], p[3]);
    const __m256i s47 = el_sum4_q4_halves_avx2(p[4], p[5], p[6], p[7]);
    /* lanes: s03 = rows 0..3 of block b | of b + 1, s47 rows 4..7 */
    for (int k = 0; k <= two; k++) {
        const int o = k ? bs : 0;
        /* the 8 blocks' first 4 bytes (d, then m or 2 quants) -> d of rows 0..7 | m of rows 0..7 */
        const __m256i h = _mm256_setr_epi32(el_ld32(blk[0] + o), el_ld32(blk[1] + o), el_ld32(blk[2] + o),
                                            el_ld32(blk[3] + o), el_ld32(blk[4] + o), el_ld32(blk[5] + o),
                                            el_ld32(blk[6] + o), el_ld32(blk[7] + o));
        const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, dm_order), 0xD8);
        const __m256 dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
        const __m256 mw = wt == EL_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1))
                                        : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
        const __m256 t = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(s03, s47, k ? 0x31 : 0x20));
        acc = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + b + k)), acc);
        acc = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs + b + k), acc);
    }
    return acc;
}

/* 8 rows (w[r] = row r's first block; rows past the matrix repeat the last real one and are
 * never stored), pfd: prefetch distance, lane r of the result = row r */
static inline __attribute__((always_inline)) __m256
el_qgemv8_q4_avx2(const int wt, const uint8_t *const w[8], size_t pfd, const int8_t *xq, const float *xd,
                  const float *xs, int nb) {
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) acc = el_qgemv8_step(wt, 1, w, pfd, b, xq, xd, xs, acc);
    if (b < nb) acc = el_qgemv8_step(wt, 0, w, pfd, b, xq, xd, xs, acc);
    return acc;
}

/* int32 lanes of p0..p3 summed per row -> lane r = row r's total */
static inline __m128i el_sum4_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

static inline __attribute__((always_inline)) void
el_qtile_avx2(const int wt, const int nx, const uint8_t *const w[4], const int8_t *xq, const float *xd,
              const float *xs, int nb, float32x4_t acc[4]) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    const __m256i m4 = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    for (int c = 0; c < nx; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        __m256i wv[4];
        const uint8_t *blk4[4];
        for (int r = 0; r < 4; r++) blk4[r] = w[r] + (size_t)b * bs;
        if (nx == 1)
            for (int r = 0; r < 4; r++) __builtin_prefetch(blk4[r] + EL_PF_BYTES);
        /* the 4 blocks' first 4 bytes (d, then m or 2 quants) -> d of rows 0..3 | m of rows 0..3:
         * one F16C conversion, and 4 loads instead of 8 word inserts */
        const __m128i dm16 = _mm_shuffle_epi8(
            _mm_setr_epi32(el_ld32(blk4[0]), el_ld32(blk4[1]), el_ld32(blk4[2]), el_ld32(blk4[3])),
            _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        const __m256 dm = _mm256_cvtph_ps(dm16);
        const float32x4_t dw = simde_float32x4_from_m128(_mm256_castps256_ps128(dm));
        const float32x4_t mw = wt == EL_Q4_1 ? simde_float32x4_from_m128(_mm256_extractf128_ps(dm, 1))
                                             : vmulq_n_f32(dw, -8.0f);
        for (int r = 0; r < 4; r++) {
            if (wt == EL_Q8_0) {
                wv[r] = _mm256_loadu_si256((const __m256i *)(blk4[r] + off));
            } else {   /* low 128 bits: low nibbles (x[0..15]); high: high nibbles (x[16..31]) */
                const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk4[r] + off)));
                wv[r] = _mm256_and_si256(_mm256_srlv_epi64(v, nib_shift), m4);
            }
        }
        for (int c = 0; c < nx; c++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + ((size_t)c * nb + b) * QK));
            /* lane r of the result = row r's block total, as vpaddq gives on the NEON tile */
            const int32x4_t t = simde_int32x4_from_m128i(
                wt == EL_Q8_0 ? el_sum4_avx2(el_dot32_avx2(wt, wv[0], x), el_dot32_avx2(wt, wv[1], x),
                                             el_dot32_avx2(wt, wv[2], x), el_dot32_avx2(wt, wv[3], x))
                              : el_sum4_q4_avx2(_mm256_maddubs_epi16(wv[0], x), _mm256_maddubs_epi16(wv[1], x),
                                                _mm256_maddubs_epi16(wv[2], x), _mm256_maddubs_epi16(wv[3], x)));
            acc[c] = vfmaq_f32(acc[c], vcvtq_f32_s32(t), vmulq_n_f32(dw, xd[(size_t)c * nb + b]));
            if (wt != EL_Q8_0) acc[c] = vfmaq_f32(acc[c], mw, vdupq_n_f32(xs[(size_t)c * nb + b]));
        }
    }
}
#endif

/* ---- x86 AVX2 GEMM tile (M > 1) -------------------------------------------------------------- */
/* The 4-row tile (el_qtile_avx2) spends most of its instructions folding each row's VPMADDUBSW lanes into
 * one int32 (el_sum4_q4_avx2: ~17 shuffles, blends and adds per x row and block) and scaling 4
 * fp32 lanes of an 8-lane machine. For a GEMM the weights are reused by every x row, so they are
 * worth rearranging once per task: 8 rows (Q4: unpacked to bytes 0..15) are interleaved so that
 * dword j of row r sits in lane r of register j (el_g_repack8). x's dword j, broadcast from
 * memory, then feeds one VPMADDUBSW that serves all 8 rows, Q4's products add up in int16 across
 * the whole block with plain VPADDW, and one VPMADDWD leaves row r's block sum in int32 lane r:
 * no horizontal reduction at all, and the fp32 scaling runs 8 rows wide.
 * int16 bound: a lane holds 8 pair sums of 2 products each, 16 * 15 * 128 = 30720 < 32767, so
 * the int32 block sums are exact (Q8_0: see el_g_tile_avx2); the fp32 scaling is the 4-row tile's
 * own sequence (one FMA by d_w d_x, then Q4's one by m_w s_x): results are bit-identical to it.
 * Zen 3, one thread, SmolLM2-135M's shapes at M = 256: Q4_1 2.4-2.6x the 4-row tile (with
 * el_quant_row_avx2), already 1.2x at M = 2; Q8_0 1.5x. The GEMV does not repack: there each
 * weight is used once and repacking would only add traffic (Q4: el_qgemv8_q4_avx2). */
#if EL_SIMDE && defined(__AVX2__)
#define EL_G_ROWS 8
/* a repacked block of 8 rows: 8 registers of 8 rows x 4 bytes, then d of the 8 rows, then m */
#define EL_G_QBYTES (EL_G_ROWS * QK)
#define EL_G_BLOCK (EL_G_QBYTES + 2 * EL_G_ROWS * (int)sizeof(float))
/* repack buffers (16 rows) up to this size live on the stack: K <= 2048 */
#define EL_G_STACK (2 * 64 * EL_G_BLOCK)
/* x rows in a task from which the repack pays off (1.2x the 4-row tile at 2) */
#define EL_G_MIN_NX 2

/* Block b of 8 rows (w[r] = row r's first block): the rows' d as fp32 at d_out, their m (Q4_1;
 * Q4_0: -8 d) at m_out */
static inline __attribute__((always_inline)) void el_g_repack8_dm(const int wt, const uint8_t *const w[8], int b,
                                                                  float *d_out, float *m_out) {
    const int bs = el_qblock_bytes(wt);
    const __m128i dm_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    /* each block's first 4 bytes: d, then m (Q4_1) or 2 quant bytes (Q4_0, Q8_0: unused) */
    __m128i dm[2];
    for (int h = 0; h < 2; h++) {
        const uint8_t *const *wh = w + 4 * h;
        dm[h] = _mm_shuffle_epi8(_mm_setr_epi32(el_ld32(wh[0] + (size_t)b * bs), el_ld32(wh[1] + (size_t)b * bs),
                                                el_ld32(wh[2] + (size_t)b * bs), el_ld32(wh[3] + (size_t)b * bs)),
                                 dm_order);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_unpacklo_epi64(dm[0], dm[1]));
    const __m256 m = wt == EL_Q4_1 ? _mm256_cvtph_ps(_mm_unpackhi_epi64(dm[0], dm[1]))
                                   : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    _mm256_storeu_ps(d_out, d);
    _mm256_storeu_ps(m_out, m);
}

/* Block b of 8 rows (w[r] = row r's first block) repacked: register j (8 rows x 4 bytes: dword j
 * of each row) at q + j * q_step, the rows' d at d_out, their m (Q4_0: -8 d) at m_out. The
 * AVX-512 GEMM (qmatmul_avx512.h) repacks 16 rows as two such halves. */
static inline __attribute__((always_inline)) void el_g_repack8_block(const int wt, const uint8_t *const w[8], int b,
                                                                     uint8_t *q, size_t q_step, float *d_out,
                                                                     float *m_out) {
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    const __m256i m4 = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    __m256i u[8];
    for (int r = 0; r < 8; r++) {
        const uint8_t *qs = w[r] + (size_t)b * bs + off;
        if (wt == EL_Q8_0) {
            u[r] = _mm256_loadu_si256((const __m256i *)qs);
        } else {   /* bytes 0..15: low nibbles, 16..31: high (x's order) */
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
            u[r] = _mm256_and_si256(_mm256_srlv_epi64(v, nib_shift), m4);
        }
    }
    /* 8 x 8 dword transpose: per 128-bit half, s[h + j] holds dword j (half 0) or j + 4
     * (half 1) of rows h..h+3; the permutes then gather rows 0..7 of one dword */
    __m256i s[8];
    for (int h = 0; h < 8; h += 4) {
        const __m256i t0 = _mm256_unpacklo_epi32(u[h], u[h + 1]), t1 = _mm256_unpackhi_epi32(u[h], u[h + 1]);
        const __m256i t2 = _mm256_unpacklo_epi32(u[h + 2], u[h + 3]),
                      t3 = _mm256_unpackhi_epi32(u[h + 2], u[h + 3]);
        s[h] = _mm256_unpacklo_epi64(t0, t2);
        s[h + 1] = _mm256_unpackhi_epi64(t0, t2);
        s[h + 2] = _mm256_unpacklo_epi64(t1, t3);
        s[h + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)(q + q_step * j), _mm256_permute2x128_si256(s[j], s[j + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(q + q_step * (j + 4)), _mm256_permute2x128_si256(s[j], s[j + 4], 0x31));
    }
    el_g_repack8_dm(wt, w, b, d_out, m_out);
}

/* nb blocks of 8 rows (w[r] = row r's first block) -> out, block b at out + b * stride */
static inline __attribute__((always_inline)) void el_g_repack8(const int wt, const uint8_t *const w[8], int nb,
                                                               uint8_t *out, size_t stride) {
    for (int b = 0; b < nb; b++, out += stride)
        el_g_repack8_block(wt, w, b, out, 32, (float *)(out + EL_G_QBYTES), (float *)(out + EL_G_QBYTES) + EL_G_ROWS);
}

/* Q8_0 with VPDPBUSD (AVX-VNNI, or AVX512-VNNI on 256-bit registers): |w| x (x signed like w)
 * summed in fours straight into int32 lanes, one instruction for VPMADDUBSW + VPMADDWD + VPADDD;
 * the int32 block sums are the same exact integers, so results stay bit-identical. Each
 * accumulator runs two 4-long chains (even, odd dwords). Zen 5, 2 threads, Q8_0 3072 x 576 and
 * 576 x 1536 at M = 256: 345-350 -> 440-455 GFLOPS (M = 32: 320-330 -> 395-415). Q4 keeps
 * VPMADDUBSW: its int16 sums need one VPMADDWD per block only, and with VPDPBUSD its GEMM went
 * 545-565 -> 485-490. This is a tile of its own, not a branch in el_g_tile_avx2, because the
 * branch there alone cost the Q4 code gcc generates 8% (563 -> 517 GFLOPS at M = 256). */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define EL_G_VNNI 1
static inline __m256i el_dpbusd256(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}

static inline __attribute__((always_inline)) void el_g_tile_q8_vnni(const int ng, const int nx, const uint8_t *wp,
                                                                    const int8_t *xq, const float *xd, int nb,
                                                                    __m256 acc[4]) {
    for (int i = 0; i < ng * nx; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, wp += ng * EL_G_BLOCK) {
        __m256i s[2][4];
        for (int j = 0; j < 8; j++) {
            __m256i w[2], wa[2];
            for (int g = 0; g < ng; g++) {
                w[g] = _mm256_loadu_si256((const __m256i *)(wp + g * EL_G_BLOCK + 32 * j));
                wa[g] = _mm256_sign_epi8(w[g], w[g]);
            }
            for (int c = 0; c < nx; c++) {
                const __m256i x = _mm256_set1_epi32(el_ld32((const uint8_t *)xq + ((size_t)c * nb + b) * QK + 4 * j));
                for (int g = 0; g < ng; g++) {
                    __m256i *si = &s[j & 1][g * nx + c];
                    *si = el_dpbusd256(j > 1 ? *si : _mm256_setzero_si256(), wa[g], _mm256_sign_epi8(x, w[g]));
                }
            }
        }
        for (int g = 0; g < ng; g++) {
            const __m256 dw = _mm256_loadu_ps((const float *)(wp + g * EL_G_BLOCK + EL_G_QBYTES));
            for (int c = 0; c < nx; c++) {
                const int i = g * nx + c;
                const __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(s[0][i], s[1][i]));
                acc[i] = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(size_t)c * nb + b])), acc[i]);
            }
        }
    }
}
#endif

/* ng (1, 2) groups of 8 repacked rows, their blocks interleaved (group g of block b at
 * wp + (b * ng + g) * EL_G_BLOCK), x nx x rows: acc[g * nx + c] lane r = y[c][row 8g + r]. Every
 * x broadcast feeds ng VPMADDUBSW: 16 x 2 needs 16 broadcasts per block where 8 x 4 needs 32,
 * and the FP pipes, not the multiplier, were the limit (~5% faster at M = 256).
 * Q8_0: signed weights take el_dot32_avx2's sign trick, VPMADDUBSW(|w|, x signed like w); its pair
 * sums (<= 2 * 128 * 127) leave no int16 headroom, so each goes to int32 (VPMADDWD) at once. */
static inline __attribute__((always_inline)) void el_g_tile_avx2(const int wt, const int ng, const int nx,
                                                                 const uint8_t *wp, const int8_t *xq, const float *xd,
                                                                 const float *xs, int nb, __m256 acc[4]) {
#if defined(EL_G_VNNI)
    if (wt == EL_Q8_0) {
        el_g_tile_q8_vnni(ng, nx, wp, xq, xd, nb, acc);
        return;
    }
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < ng * nx; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, wp += ng * EL_G_BLOCK) {
        __m256i s[4];
        for (int j = 0; j < 8; j++) {
            __m256i w[2], wa[2];
            for (int g = 0; g < ng; g++) {
                w[g] = _mm256_loadu_si256((const __m256i *)(wp + g * EL_G_BLOCK + 32 * j));
                if (wt == EL_Q8_0) wa[g] = _mm256_sign_epi8(w[g], w[g]);
            }
            for (int c = 0; c < nx; c++) {
                const __m256i x = _mm256_set1_epi32(el_ld32((const uint8_t *)xq + ((size_t)c * nb + b) * QK + 4 * j));
                for (int g = 0; g < ng; g++) {
                    const int i = g * nx + c;
                    if (wt == EL_Q8_0) {
                        const __m256i p =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(x, w[g])), ones);
                        s[i] = j ? _mm256_add_epi32(s[i], p) : p;
                    } else {
                        const __m256i p = _mm256_maddubs_epi16(w[g], x);
                        s[i] = j ? _mm256_add_epi16(s[i], p) : p;
                    }
                    /* an empty asm pins the add chain: otherwise gcc 12 rebalances the 8 adds
                     * into a tree, hoists all the VPMADDUBSW and spills them (-25% at M = 256);
                     * a rolled j loop instead is front-end bound (-15%) */
                    __asm__("" : "+x"(s[i]));
                }
            }
        }
        for (int g = 0; g < ng; g++) {
            const float *sc = (const float *)(wp + g * EL_G_BLOCK + EL_G_QBYTES);
            const __m256 dw = _mm256_loadu_ps(sc);
            for (int c = 0; c < nx; c++) {
                const int i = g * nx + c;
                const __m256 t = _mm256_cvtepi32_ps(wt == EL_Q8_0 ? s[i] : _mm256_madd_epi16(s[i], ones));
                acc[i] = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(size_t)c * nb + b])), acc[i]);
                if (wt != EL_Q8_0)
                    acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(sc + EL_G_ROWS), _mm256_set1_ps(xs[(size_t)c * nb + b]),
                                             acc[i]);
            }
        }
    }
}

/* acc[c] lanes 0..nr-1 (+ bias) -> y row c */
static inline void el_store_tile8(const __m256 *acc, int nx, int nr, float *y, size_t ldy, const float *bias) {
    __m256 bv = _mm256_setzero_ps();
    if (bias) {
        float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tmp, bias, (size_t)nr * sizeof(float));
        bv = _mm256_loadu_ps(tmp);
    }
    for (int c = 0; c < nx; c++) {
        const __m256 v = _mm256_add_ps(acc[c], bv);
        if (nr == 8) {
            _mm256_storeu_ps(y + c * ldy, v);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, v);
            memcpy(y + c * ldy, tmp, (size_t)nr * sizeof(float));
        }
    }
}

/* The next panel's weights (pf, pf_bytes) are prefetched in equal shares, one before each of a
 * panel's `tiles` tiles: el_g_pf_step gives the share, el_g_pf_share issues one and moves on. */
static inline __attribute__((always_inline)) size_t el_g_pf_step(size_t pf_bytes, int tiles) {
    return (pf_bytes / 64 + (size_t)tiles) / (size_t)tiles * 64;
}

/* the next share's bytes (at most pf_step), *pf moved past them */
static inline __attribute__((always_inline)) size_t el_g_pf_take(const uint8_t **pf, size_t *pf_bytes, size_t pf_step) {
    const size_t n = EL_MIN(pf_step, *pf_bytes);
    if (*pf_bytes > pf_step) *pf += pf_step, *pf_bytes -= pf_step;
    else *pf_bytes = 0;
    return n;
}

static inline __attribute__((always_inline)) void el_g_pf_share(const uint8_t **pf, size_t *pf_bytes, size_t pf_step) {
    const uint8_t *p = *pf;
    const size_t n = el_g_pf_take(pf, pf_bytes, pf_step);
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o);
}

/* One panel of ng * 8 rows (nr real) against all nx_all x rows: 8 x 4 tiles for a single group,
 * 16 x 2 for two. pf, pf_bytes: the next panel's weights, prefetched a share before each tile. */
static inline __attribute__((always_inline)) void el_g_panel_avx2(const int wt, const int ng, const uint8_t *buf,
                                                                  int nr, const el_xq *xq, int x0, int nx_all,
                                                                  float *y, size_t ldy, const float *bias,
                                                                  const uint8_t *pf, size_t pf_bytes) {
    const int nb = xq->nb, cmax = ng == 1 ? 4 : 2;
    const int tiles = (nx_all + cmax - 1) / cmax;
    const size_t pf_step = el_g_pf_step(pf_bytes, tiles);
    for (int c0 = 0; c0 < nx_all; c0 += cmax) {
        const int nx = EL_MIN(cmax, nx_all - c0);
        el_g_pf_share(&pf, &pf_bytes, pf_step);
        const size_t xr = (size_t)(x0 + c0);
        const int8_t *q = xq->q + xr * nb * QK;
        const float *d = xq->d + xr * nb, *s = xq->s + xr * nb;
        __m256 acc[4];
        float *yt = y + (size_t)c0 * ldy;
        switch (ng * 8 + nx) {
        case 9: el_g_tile_avx2(wt, 1, 1, buf, q, d, s, nb, acc); break;
        case 10: el_g_tile_avx2(wt, 1, 2, buf, q, d, s, nb, acc); break;
        case 11: el_g_tile_avx2(wt, 1, 3, buf, q, d, s, nb, acc); break;
        case 12: el_g_tile_avx2(wt, 1, 4, buf, q, d, s, nb, acc); break;
        case 17: el_g_tile_avx2(wt, 2, 1, buf, q, d, s, nb, acc); break;
        default: el_g_tile_avx2(wt, 2, 2, buf, q, d, s, nb, acc); break;
        }
        for (int g = 0; g < ng && 8 * g < nr; g++)
            el_store_tile8(acc + g * nx, nx, EL_MIN(8, nr - 8 * g), yt + 8 * g, ldy, bias ? bias + 8 * g : NULL);
    }
}

/* The panel loop of an x86 GEMM tile family (this 8-row one, qmatmul_avx512.h's 16-row one):
 * panels of 2 groups of ROWS rows (a last 1..ROWS rows take one group; ROWS+1..2 ROWS-1 pad the
 * second), each repacked into buf, then run against all nx_all x rows. Returns 0 (the caller runs
 * other tiles) only when a large K's buffer cannot be allocated. noinline: keeps the repack buffer
 * out of the GEMV's stack frame (its code shares the caller).
 * The repack's loads were the tile's stall at small M: a panel's weights (16 rows, 5.6 KiB at
 * K = 576) come from L3 or DRAM, and its 8 row streams kept few misses in flight (~20% of the
 * GEMM's cycles at M = 32, ~2% at M = 256). The first panel is prefetched all at once; each next
 * one a share per tile while the tiles of the current one run; after the last one, the first
 * rows of the chunk that follows (rows_after of them), the chunk a thread walking its range
 * takes next: with one-panel chunks (576 rows at M = 32) every panel used to start cold. */
#define EL_G_GEMM_FN(name, ROWS, BLOCK, STACK, repack, panel)                                                        \
    static __attribute__((noinline)) int name(const int wt, const uint8_t *w, size_t rb, int rows, int rows_after,  \
                                              const el_xq *xq, int x0, int nx_all, float *y, size_t ldy,            \
                                              const float *bias) {                                                  \
        const int nb = xq->nb;                                                                                       \
        _Alignas(64) uint8_t stack_buf[STACK];                                                                       \
        uint8_t *buf = stack_buf, *owned = NULL;                                                                     \
        if ((size_t)nb * 2 * (BLOCK) > sizeof stack_buf) {                                                           \
            buf = owned = (uint8_t *)malloc((size_t)nb * 2 * (BLOCK));                                               \
            if (!owned) return 0;                                                                                    \
        }                                                                                                            \
        for (size_t o = 0; o < (size_t)EL_MIN(rows, 2 * (ROWS)) * rb; o += 64) __builtin_prefetch(w + o);            \
        for (int r0 = 0; r0 < rows;) {                                                                               \
            const int ng = rows - r0 > (ROWS) ? 2 : 1, nr = EL_MIN(ng * (ROWS), rows - r0);                          \
            const uint8_t *pf = w + (size_t)(r0 + nr) * rb;                                                          \
            const size_t pf_bytes = (size_t)EL_MIN(r0 + nr < rows ? rows - r0 - nr : rows_after, 2 * (ROWS)) * rb;   \
            for (int g = 0; g < ng; g++) {                                                                           \
                const uint8_t *wr[ROWS];                                                                             \
                for (int r = 0; r < (ROWS); r++) wr[r] = w + (size_t)(r0 + EL_MIN(g * (ROWS) + r, nr - 1)) * rb;     \
                repack(wt, wr, nb, buf + g * (BLOCK), (size_t)ng * (BLOCK));                                         \
            }                                                                                                        \
            float *yr = y + r0;                                                                                      \
            const float *br = bias ? bias + r0 : NULL;                                                               \
            if (ng == 1) panel(wt, 1, buf, nr, xq, x0, nx_all, yr, ldy, br, pf, pf_bytes);                           \
            else panel(wt, 2, buf, nr, xq, x0, nx_all, yr, ldy, br, pf, pf_bytes);                                   \
            r0 += nr;                                                                                                \
        }                                                                                                            \
        free(owned);                                                                                                 \
        return 1;                                                                                                    \
    }

EL_G_GEMM_FN(el_g_gemm_avx2, EL_G_ROWS, EL_G_BLOCK, EL_G_STACK, el_g_repack8, el_g_panel_avx2)
#endif
