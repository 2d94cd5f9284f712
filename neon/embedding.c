/* Embedding lookup: rows of a GGUF token table, dequantized to fp32.
 *
 * Why in C: in a decode step the lookup is one row, and numpy took ~65 us of Python and numpy
 * dispatch for it per token (the 96 MB weight stream of the step before leaves the interpreter's
 * code and data cold), against well under a microsecond here.
 *
 * Each value is computed as quant.dequantize does it, so the rows are bit-identical to the
 * reference backend's embedding. Every product here is exact in fp32 (an fp16 scale has an
 * 11-bit significand, a quant at most 8 bits), so the only rounding is Q4_1's "+ m", and a
 * compiler that contracts d * q + m into an FMA gets the same bits:
 *   Q8_0  d * q;  Q4_0  (q - 8) * d;  Q4_1  d * q + m;  F16 exact widening;  F32 a copy.
 * Plain C (a row is a few hundred values; the compiler vectorizes the loops): it is its own
 * generic twin. */
#include "el_common.h"

#include <string.h>

#define EL_QK 32

static size_t el_row_bytes(int wtype, int row_len) {
    switch (wtype) {
    case EL_F32: return (size_t)row_len * 4;
    case EL_F16: return (size_t)row_len * 2;
    case EL_Q8_0: return (size_t)(row_len / EL_QK) * 34;
    case EL_Q4_0: return (size_t)(row_len / EL_QK) * 18;
    case EL_Q4_1: return (size_t)(row_len / EL_QK) * 20;
    default: return 0;
    }
}

static inline float el_ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return el_f16_to_f32(h);
}

static void el_embed_row(int wtype, const uint8_t *src, int row_len, float *dst) {
    const int nb = row_len / EL_QK;
    switch (wtype) {
    case EL_F32:
        memcpy(dst, src, (size_t)row_len * 4);
        return;
    case EL_F16:
        for (int i = 0; i < row_len; i++) dst[i] = el_ld_f16(src + 2 * i);
        return;
    case EL_Q8_0:
        for (int b = 0; b < nb; b++, src += 34, dst += EL_QK) {
            const float d = el_ld_f16(src);
            const int8_t *q = (const int8_t *)(src + 2);
            for (int i = 0; i < EL_QK; i++) dst[i] = (float)q[i] * d;
        }
        return;
    case EL_Q4_0:
        for (int b = 0; b < nb; b++, src += 18, dst += EL_QK) {
            const float d = el_ld_f16(src);
            const uint8_t *q = src + 2;
            for (int i = 0; i < EL_QK / 2; i++) {
                dst[i] = ((float)(q[i] & 0x0F) - 8.0f) * d;
                dst[i + EL_QK / 2] = ((float)(q[i] >> 4) - 8.0f) * d;
            }
        }
        return;
    case EL_Q4_1:
        for (int b = 0; b < nb; b++, src += 20, dst += EL_QK) {
            const float d = el_ld_f16(src), m = el_ld_f16(src + 2);
            const uint8_t *q = src + 4;
            for (int i = 0; i < EL_QK / 2; i++) {
                dst[i] = (float)(q[i] & 0x0F) * d + m;
                dst[i + EL_QK / 2] = (float)(q[i] >> 4) * d + m;
            }
        }
        return;
    }
}

int el_embed_rows(const el_embedding *emb, const int32_t *ids, int T, float *out) {
    if (!emb || !emb->table || !ids || !out || T <= 0 || emb->n_rows <= 0 || emb->row_len <= 0) return EL_EINVAL;
    const size_t row = el_row_bytes(emb->wtype, emb->row_len);
    if (row == 0) return EL_EUNSUPPORTED;
    if (emb->wtype != EL_F32 && emb->wtype != EL_F16 && emb->row_len % EL_QK != 0) return EL_EINVAL;
    for (int t = 0; t < T; t++)    /* every id first: a bad one writes nothing */
        if (ids[t] < 0 || (int64_t)ids[t] >= emb->n_rows) return EL_EINVAL;
    for (int t = 0; t < T; t++)
        el_embed_row(emb->wtype, (const uint8_t *)emb->table + (size_t)ids[t] * row, emb->row_len,
                     out + (size_t)t * emb->row_len);
    return EL_OK;
}
