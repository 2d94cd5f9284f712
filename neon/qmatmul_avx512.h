/* x86 AVX-512 (BW) GEMM tile for Q4_0 / Q4_1 weights, development builds on AVX-512 CPUs:
 * el_g_gemm_avx2 (qmatmul_avx2.h) on 16-lane registers. Included by quant_matmul.c after the
 * AVX2 header, whose repack it reuses.
 *
 * The AVX2 tile is bound by its SIMD ports, not by memory (about a quarter of the int8 peak that
 * el_peak_probe measures on a Zen 5 core); a Zen 5 core issues its 512-bit integer and FP
 * operations at the 256-bit rate, so the same work in registers twice as wide takes about half
 * the instructions. Layout: 16 weight rows per register (lane r = row r; per block, register j
 * holds dword j of the 16 rows: the two 8-row halves of el_g_repack8_block side by side), then
 * the 16 rows' d and m. Tile: 1 or 2 groups of 16 rows x up to 4 x rows, 32 zmm registers being
 * enough for 8 fp32 and 8 int16 accumulators. Per lane the operations are the AVX2 tile's, in
 * the same order (exact int16 / int32 block sums, one FMA by d_w d_x, one by m_w s_x), so the
 * results are bit-identical to it.
 * Q8_0 (with AVX512-VNNI + VBMI; without them it stays on the AVX2 tile): the repack stores
 * u = q_w XOR 0x80 = q_w + 128 (unsigned), so one VPDPBUSD takes u x q_x as the Q4 tile takes the
 * nibbles, and its accumulator starts at -128 sum(q_x) (el_q8_xcorr, once per task and x
 * block, shared by every weight row): sum(u q_x) - 128 sum(q_x) = sum(q_w q_x), the same exact
 * int32 block sum as the AVX2 tile's sign trick (AVX-512 has no VPSIGNB), then its one FMA by
 * d_w d_x: bit-identical. The 8-row tile needs a sign and a VPSIGNB'd x per product (or, without
 * VNNI, a VPMADDWD per pair) because Q8_0's products overflow int16 pairs. Zen 5, 2 threads,
 * SmolLM2's four shapes (K x N 576 x 960, 576 x 576, 576 x 3072, 1536 x 576), against that tile:
 * M = 256 409-430 -> 941-1054 GFLOPS, M = 64 1.75-2.4x, M = 16 1.45-1.77x, M = 4 1.09-1.22x. */
#if EL_SIMDE && defined(__AVX512F__) && defined(__AVX512BW__)
#define EL_G5 1
#define EL_G5_ROWS 16
/* With at most this many x rows the next panel is prefetched into L2 (el_prefetch_ahead): a
 * panel's few tiles then end before its L1 prefetches do, and the GEMM waits on memory. Paired
 * runs, 30 layers' Q4_1 GEMMs (Zen 4, 2 threads): 2 rows 0.78x, 8 rows 0.93x; at 12-32 rows
 * into L2 was no better (1.00x) or worse (32: 1.03-1.05x), so those keep L1. */
#define EL_G5_PF_L2_ROWS 8
/* a repacked block of 16 rows: 8 registers of 16 rows x 4 bytes, then d of the 16 rows, then m */
#define EL_G5_QBYTES (EL_G5_ROWS * QK)
#define EL_G5_BLOCK (EL_G5_QBYTES + 2 * EL_G5_ROWS * (int)sizeof(float))
/* repack buffers (32 rows) up to this size live on the stack: K <= 2048 */
#define EL_G5_STACK (2 * 64 * EL_G5_BLOCK)
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define EL_G5_Q8 1
#endif

/* nb blocks of 16 rows (w[r] = row r's first block) -> out, block b at out + b * stride */
static inline __attribute__((always_inline)) void el_g5_repack16(const int wt, const uint8_t *const w[16], int nb,
                                                                 uint8_t *out, size_t stride) {
#if defined(__AVX512VBMI__)
    /* The same bytes as two el_g_repack8_block halves, gathered 16 rows at a time: a[k] holds the
     * 16 quant bytes of rows 4k..4k+3 (one per 128-bit lane); byte 4r + t of G_j = quant byte
     * 4j + t of row r, two VPERMT2B (rows 0-7 from a[0] | a[1], rows 8-15 from a[2] | a[3], the
     * same index pattern) and a blend; register j = G_j's low nibbles, register j + 4 its high
     * ones (x's order: weights 0..15, then 16..31). The 8-row halves' 8 x 8 dword transposes
     * took ~20% of a 32-row GEMM's time (Zen 5, 3072 x 576, one thread). */
    const int bs = el_qblock_bytes(wt), off = el_qoff(wt);
    uint8_t base[64];
    for (int p = 0; p < 64; p++) {
        const int r = (p / 4) % 8, t = p % 4;
        base[p] = (uint8_t)((r >= 4 ? 64 : 0) + 16 * (r % 4) + t);
    }
    __m512i idx[4];
    for (int j = 0; j < 4; j++) idx[j] = _mm512_add_epi8(_mm512_loadu_si512(base), _mm512_set1_epi8((char)(4 * j)));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (wt == EL_Q8_0) {
        /* 32 quant bytes a row: a[k] the low 16 of rows 4k..4k+3, h[k] the high 16; G_j of the
         * low ones is register j, of the high ones register j + 4, each XOR 0x80 (see above) */
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int b = 0; b < nb; b++, out += stride) {
            __m512i a[4], h[4];
            for (int k = 0; k < 4; k++) {
                const uint8_t *const *wk = w + 4 * k;
                const uint8_t *p0 = wk[0] + (size_t)b * bs + off;
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p0));
                __m512i u = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p0 + 16)));
                for (int i = 1; i < 4; i++) {
                    const uint8_t *pi = wk[i] + (size_t)b * bs + off;
                    const __m128i q = _mm_loadu_si128((const __m128i *)pi), r = _mm_loadu_si128((const __m128i *)(pi + 16));
                    v = i == 1 ? _mm512_inserti32x4(v, q, 1) : i == 2 ? _mm512_inserti32x4(v, q, 2) : _mm512_inserti32x4(v, q, 3);
                    u = i == 1 ? _mm512_inserti32x4(u, r, 1) : i == 2 ? _mm512_inserti32x4(u, r, 2) : _mm512_inserti32x4(u, r, 3);
                }
                a[k] = v, h[k] = u;
            }
            for (int j = 0; j < 4; j++) {
                const __mmask64 top = (__mmask64)0xFFFFFFFF00000000ull;
                const __m512i gl = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(a[0], idx[j], a[1]),
                                                          _mm512_permutex2var_epi8(a[2], idx[j], a[3]));
                const __m512i gh = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(h[0], idx[j], h[1]),
                                                          _mm512_permutex2var_epi8(h[2], idx[j], h[3]));
                _mm512_storeu_si512((void *)(out + 64 * j), _mm512_xor_si512(gl, flip));
                _mm512_storeu_si512((void *)(out + 64 * (j + 4)), _mm512_xor_si512(gh, flip));
            }
            float *d = (float *)(out + EL_G5_QBYTES);
            for (int hh = 0; hh < 2; hh++) el_g_repack8_dm(wt, w + 8 * hh, b, d + 8 * hh, d + EL_G5_ROWS + 8 * hh);
        }
        return;
    }
    for (int b = 0; b < nb; b++, out += stride) {
        __m512i a[4];
        for (int k = 0; k < 4; k++) {
            const uint8_t *const *wk = w + 4 * k;
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(wk[0] + (size_t)b * bs + off)));
            for (int i = 1; i < 4; i++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(wk[i] + (size_t)b * bs + off));
                v = i == 1 ? _mm512_inserti32x4(v, q, 1) : i == 2 ? _mm512_inserti32x4(v, q, 2) : _mm512_inserti32x4(v, q, 3);
            }
            a[k] = v;
        }
        for (int j = 0; j < 4; j++) {
            const __m512i g = _mm512_mask_blend_epi8((__mmask64)0xFFFFFFFF00000000ull,
                                                     _mm512_permutex2var_epi8(a[0], idx[j], a[1]),
                                                     _mm512_permutex2var_epi8(a[2], idx[j], a[3]));
            _mm512_storeu_si512((void *)(out + 64 * j), _mm512_and_si512(g, m4));
            _mm512_storeu_si512((void *)(out + 64 * (j + 4)), _mm512_and_si512(_mm512_srli_epi16(g, 4), m4));
        }
        float *d = (float *)(out + EL_G5_QBYTES);
        for (int h = 0; h < 2; h++) el_g_repack8_dm(wt, w + 8 * h, b, d + 8 * h, d + EL_G5_ROWS + 8 * h);
    }
#else
    for (int b = 0; b < nb; b++, out += stride) {
        float *d = (float *)(out + EL_G5_QBYTES);
        for (int h = 0; h < 2; h++)
            el_g_repack8_block(wt, w + 8 * h, b, out + 32 * h, 64, d + 8 * h, d + EL_G5_ROWS + 8 * h);
    }
#endif
}

/* ng (1, 2) groups of 16 repacked rows (group g of block b at wp + (b * ng + g) * EL_G5_BLOCK)
 * x nx (1..4) x rows: acc[g * nx + c] lane r = y[c][row 16g + r]. With AVX512-VNNI one VPDPBUSD
 * (u8 nibbles x s8 x, in fours into int32) does VPMADDUBSW + VPADDW's work and the block's end
 * needs no VPMADDWD: the same exact int32 block sums, bit-identical results. Zen 5, Q4_1 at
 * M = 256: 961-1089 -> 1011-1146 GFLOPS (weights in cache), +3-5% from DRAM, cold 433-token
 * prompt 131-133 -> 127-128 ms. (The 8-row AVX2 tile lost 10% with VNNI: see qmatmul_avx2.h.) */
/* q8: Q8_0 (a compile-time constant at every call, so the Q4 code has no branch): xc = the x
 * rows' -128 sum(q_x) per block (el_q8_xcorr), and no m term. */
static inline __attribute__((always_inline)) void el_g5_tile(const int q8, const int wt, const int ng, const int nx,
                                                             const uint8_t *wp, const int8_t *xq, const float *xd,
                                                             const float *xs, const int32_t *xc, int nb,
                                                             const uint8_t *pf, int pf_lines, int pf_l2,
                                                             __m512 acc[8]) {
#if !defined(__AVX512VNNI__)
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    /* the tile's share of the next panel's lines, a few with each block (see el_g5_panel) */
    const int pf_per = (pf_lines + nb - 1) / (nb > 0 ? nb : 1);
    int pf_k = 0;
    for (int i = 0; i < ng * nx; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, wp += ng * EL_G5_BLOCK) {
        for (int i = 0; i < pf_per && pf_k < pf_lines; i++, pf_k++) {
            if (pf_l2) el_prefetch_ahead(pf + 64 * (size_t)pf_k);
            else __builtin_prefetch(pf + 64 * (size_t)pf_k);
        }
        __m512i s[8];
        for (int j = 0; j < 8; j++) {
            __m512i w[2];
            for (int g = 0; g < ng; g++) w[g] = _mm512_loadu_si512((const void *)(wp + g * EL_G5_BLOCK + 64 * j));
            for (int c = 0; c < nx; c++) {
                const __m512i x = _mm512_set1_epi32(el_ld32((const uint8_t *)xq + ((size_t)c * nb + b) * QK + 4 * j));
                for (int g = 0; g < ng; g++) {
                    const int i = g * nx + c;
#if defined(__AVX512VNNI__)
                    const __m512i s0 = q8 ? _mm512_set1_epi32(xc[(size_t)c * nb + b]) : _mm512_setzero_si512();
                    s[i] = _mm512_dpbusd_epi32(j ? s[i] : s0, w[g], x);
#else
                    const __m512i p = _mm512_maddubs_epi16(w[g], x);
                    s[i] = j ? _mm512_add_epi16(s[i], p) : p;
                    __asm__("" : "+v"(s[i]));   /* the add chain stays a chain (see el_g_tile_avx2) */
#endif
                }
            }
        }
        for (int g = 0; g < ng; g++) {
            const float *sc = (const float *)(wp + g * EL_G5_BLOCK + EL_G5_QBYTES);
            const __m512 dw = _mm512_loadu_ps(sc);
            for (int c = 0; c < nx; c++) {
                const int i = g * nx + c;
#if defined(__AVX512VNNI__)
                const __m512 t = _mm512_cvtepi32_ps(s[i]);
#else
                const __m512 t = _mm512_cvtepi32_ps(_mm512_madd_epi16(s[i], ones));
#endif
                acc[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(size_t)c * nb + b])), acc[i]);
                if (!q8)
                    acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(sc + EL_G5_ROWS), _mm512_set1_ps(xs[(size_t)c * nb + b]),
                                             acc[i]);
            }
        }
    }
    (void)wt, (void)xc;
}

/* acc[c] lanes 0..nr-1 (+ bias) -> y row c */
static inline void el_g5_store(const __m512 *acc, int nx, int nr, float *y, size_t ldy, const float *bias) {
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int c = 0; c < nx; c++) _mm512_mask_storeu_ps(y + c * ldy, keep, _mm512_add_ps(acc[c], bv));
}

/* One panel of ng * 16 rows (nr real) against all nx_all x rows, in tiles of 4 x rows. pf,
 * pf_bytes: the next panel's weights, prefetched a share before each tile. */
static inline __attribute__((always_inline)) void el_g5_panel_(const int q8, const int wt, const int ng,
                                                               const uint8_t *buf, int nr,
                                                              const el_xq *xq, int x0, int nx_all, float *y,
                                                              size_t ldy, const float *bias, const uint8_t *pf,
                                                              size_t pf_bytes) {
    const int nb = xq->nb;
    const int tiles = (nx_all + 3) / 4;
    /* Each tile prefetches its share of the next panel spread over its blocks. Issued at once
     * before the tile (el_g_pf_share), ~23 lines at K = 576 filled the core's miss buffers: perf
     * put 6-7% of a cached 32-token chat turn's GEMM samples on that loop (Zen 4, weights from
     * DRAM). Spread, the turn (400 tokens cached) went 24 -> 23 ms, bench --shared-prefix 400
     * ratio 0.110-0.112 -> 0.106-0.107 in 4 alternations; the cold 433-token TTFT stayed. */
    const size_t pf_step = el_g_pf_step(pf_bytes, tiles);
    const int pf_l2 = nx_all <= EL_G5_PF_L2_ROWS;
    for (int c0 = 0; c0 < nx_all; c0 += 4) {
        const int nx = EL_MIN(4, nx_all - c0);
        const uint8_t *pft = pf;
        const int pf_lines = (int)((el_g_pf_take(&pf, &pf_bytes, pf_step) + 63) / 64);
        const size_t xr = (size_t)(x0 + c0);
        const int8_t *q = xq->q + xr * nb * QK;
        const float *d = xq->d + xr * nb, *s = xq->s + xr * nb;
        const int32_t *xc = q8 ? xq->qc + xr * nb : NULL;
        __m512 acc[8];
        float *yt = y + (size_t)c0 * ldy;
        switch (ng * 8 + nx) {
        case 9: el_g5_tile(q8, wt, 1, 1, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 10: el_g5_tile(q8, wt, 1, 2, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 11: el_g5_tile(q8, wt, 1, 3, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 12: el_g5_tile(q8, wt, 1, 4, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 17: el_g5_tile(q8, wt, 2, 1, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 18: el_g5_tile(q8, wt, 2, 2, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        case 19: el_g5_tile(q8, wt, 2, 3, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        default: el_g5_tile(q8, wt, 2, 4, buf, q, d, s, xc, nb, pft, pf_lines, pf_l2, acc); break;
        }
        for (int g = 0; g < ng && EL_G5_ROWS * g < nr; g++)
            el_g5_store(acc + g * nx, nx, EL_MIN(EL_G5_ROWS, nr - EL_G5_ROWS * g), yt + EL_G5_ROWS * g, ldy,
                        bias ? bias + EL_G5_ROWS * g : NULL);
    }
}

static inline __attribute__((always_inline)) void el_g5_panel(const int wt, const int ng, const uint8_t *buf, int nr,
                                                              const el_xq *xq, int x0, int nx_all, float *y,
                                                              size_t ldy, const float *bias, const uint8_t *pf,
                                                              size_t pf_bytes) {
    el_g5_panel_(0, wt, ng, buf, nr, xq, x0, nx_all, y, ldy, bias, pf, pf_bytes);
}

/* Q4_0 / Q4_1 (Q8_0: el_g5_gemm_q8) */
EL_G_GEMM_FN(el_g5_gemm, EL_G5_ROWS, EL_G5_BLOCK, EL_G5_STACK, el_g5_repack16, el_g5_panel)

#if defined(EL_G5_Q8)
static inline __attribute__((always_inline)) void el_g5_panel_q8(const int wt, const int ng, const uint8_t *buf,
                                                                 int nr, const el_xq *xq, int x0, int nx_all,
                                                                 float *y, size_t ldy, const float *bias,
                                                                 const uint8_t *pf, size_t pf_bytes) {
    (void)wt;
    el_g5_panel_(1, EL_Q8_0, ng, buf, nr, xq, x0, nx_all, y, ldy, bias, pf, pf_bytes);
}

EL_G_GEMM_FN(el_g5_gemm_q8_rows, EL_G5_ROWS, EL_G5_BLOCK, EL_G5_STACK, el_g5_repack16, el_g5_panel_q8)

/* n blocks of x (q) -> c[b] = -scale sum(q of block b) (the tiles' u = q_w + 128 correction,
 * spread over `128 / scale` int32 lanes): VPSADBW of q XOR 0x80 against 0 sums each 8 bytes
 * + 8 * 128, two blocks at a time */
static void el_q8_xcorr(const int8_t *q, int n, int scale, int32_t *c) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int b = 0;
    for (; b + 2 <= n; b += 2) {
        const __m512i t = _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(q + (size_t)b * QK), flip),
                                          _mm512_setzero_si512());
        const __m256i lo = _mm512_castsi512_si256(t), hi = _mm512_extracti64x4_epi64(t, 1);
        const long long s0 = _mm256_extract_epi64(lo, 0) + _mm256_extract_epi64(lo, 1) + _mm256_extract_epi64(lo, 2)
                             + _mm256_extract_epi64(lo, 3);
        const long long s1 = _mm256_extract_epi64(hi, 0) + _mm256_extract_epi64(hi, 1) + _mm256_extract_epi64(hi, 2)
                             + _mm256_extract_epi64(hi, 3);
        c[b] = -scale * (int32_t)(s0 - QK * 128);
        c[b + 1] = -scale * (int32_t)(s1 - QK * 128);
    }
    for (; b < n; b++) {
        int32_t s = 0;
        for (int i = 0; i < QK; i++) s += q[(size_t)b * QK + i];
        c[b] = -scale * s;
    }
}

/* Q8_0 rows: the x rows' corrections once for the task, then the 16-row tile. 0 (the caller runs
 * the AVX2 tile) when a large task's buffers cannot be allocated. */
static __attribute__((noinline)) int el_g5_gemm_q8(const uint8_t *w, size_t rb, int rows, int rows_after,
                                                   const el_xq *xq, int x0, int nx_all, float *y, size_t ldy,
                                                   const float *bias) {
    const int nb = xq->nb;
    int32_t stack_c[4096], *c = stack_c, *owned = NULL;
    if ((size_t)nx_all * nb > sizeof stack_c / sizeof stack_c[0]) {
        c = owned = (int32_t *)malloc((size_t)nx_all * nb * sizeof(int32_t));
        if (!owned) return 0;
    }
    /* the task's x rows as rows 0.. of a view that carries their corrections */
    el_xq v = *xq;
    v.q += (size_t)x0 * nb * QK, v.d += (size_t)x0 * nb, v.s += (size_t)x0 * nb, v.qc = c;
    el_q8_xcorr(v.q, nx_all * nb, 128, c);
    const int ok = el_g5_gemm_q8_rows(EL_Q8_0, w, rb, rows, rows_after, &v, 0, nx_all, y, ldy, bias);
    free(owned);
    return ok;
}
#endif
#endif
