/* 16-lane helpers shared by the x86 AVX-512 kernels (qgemv_avx512.h, attention.c's blocks,
 * matmul_bqpanel.c). Development builds only: included where __AVX512F__ is defined. */
#ifndef EL_AVX512_H
#define EL_AVX512_H

/* (sum of a0, sum of a1, sum of a2, sum of a3), each over its 16 lanes */
static inline __m128 el_x5_sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    /* 128-bit lanes: a0 (2 partial), a0, a1, a1 | a2, a2, a3, a3 -> a0, a1, a2, a3 */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    const __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), t));
}

/* r[i] lane j -> r[j] lane i, for 16 registers of 16 floats */
static inline __attribute__((always_inline)) void el_x5_transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {            /* lane k: [a4k, b4k, a4k+1, b4k+1] | [a4k+2, ...] */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {            /* u[g + m] lane k: rows g..g+3 at dim 4k + m */
        const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
        const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int m = 0; m < 4; m++) {                /* 128-bit lanes: 4 x 4 transpose across groups */
        const __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_f32x4(v0, v2, 0x88);         /* dim m */
        r[4 + m] = _mm512_shuffle_f32x4(v0, v2, 0xDD);     /* dim 4 + m */
        r[8 + m] = _mm512_shuffle_f32x4(v1, v3, 0x88);     /* dim 8 + m */
        r[12 + m] = _mm512_shuffle_f32x4(v1, v3, 0xDD);    /* dim 12 + m */
    }
}

#endif
