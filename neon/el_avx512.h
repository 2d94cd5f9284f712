/* 16-lane helpers shared by the x86 AVX-512 kernels (qgemv_avx512.h, attention.c's decode
 * blocks). Development builds only: included where __AVX512F__ is defined. */
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

#endif
