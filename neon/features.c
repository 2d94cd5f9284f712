/* Build information and the generic-twin switch. */
#include "el_common.h"

int el_generic_flag = 0;

void el_use_generic(int on) { el_generic_flag = on ? 1 : 0; }

int el_x86_wide_gemv = 3;

unsigned el_features(void) {
    unsigned f = EL_FEAT_NEON;
    if (EL_DOTPROD) f |= EL_FEAT_DOTPROD;
    if (EL_FP16) f |= EL_FEAT_FP16;
    if (EL_SIMDE) f |= EL_FEAT_SIMDE;
    return f;
}

#define EL_STR2(x) #x
#define EL_STR(x) EL_STR2(x)
#ifndef EL_VARIANT
#define EL_VARIANT unknown
#endif

const char *el_build_info(void) {
    return "variant=" EL_STR(EL_VARIANT) " simde=" EL_STR(EL_SIMDE) " dotprod=" EL_STR(EL_DOTPROD)
           " fp16=" EL_STR(EL_FP16) " compiler=" __VERSION__;
}

/* The x86 extensions this build may execute. A development or wheel build uses -march=native:
 * copied to an older x86 CPU (a shared wheel cache, a Docker image), its first kernel died of
 * SIGILL. The loader compares these with the running CPU's before calling anything else. The
 * order is neon_lib.py's EL_X86_ISA; only append. */
unsigned el_build_isa(void) {
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    static const unsigned char on[] = {
#ifdef __SSE4_2__
        0,
#endif
#ifdef __POPCNT__
        1,
#endif
#ifdef __AVX__
        2,
#endif
#ifdef __AVX2__
        3,
#endif
#ifdef __FMA__
        4,
#endif
#ifdef __F16C__
        5,
#endif
#ifdef __BMI__
        6,
#endif
#ifdef __BMI2__
        7,
#endif
#ifdef __LZCNT__
        8,
#endif
#ifdef __MOVBE__
        9,
#endif
#ifdef __AVX512F__
        10,
#endif
#ifdef __AVX512BW__
        11,
#endif
#ifdef __AVX512VL__
        12,
#endif
#ifdef __AVX512DQ__
        13,
#endif
#ifdef __AVX512CD__
        14,
#endif
#ifdef __AVX512VNNI__
        15,
#endif
#ifdef __AVX512VBMI__
        16,
#endif
#ifdef __AVX512VBMI2__
        17,
#endif
#ifdef __AVX512BF16__
        18,
#endif
#ifdef __AVX512IFMA__
        19,
#endif
#ifdef __AVX512BITALG__
        20,
#endif
#ifdef __AVX512VPOPCNTDQ__
        21,
#endif
#ifdef __AVXVNNI__
        22,
#endif
#ifdef __GFNI__
        23,
#endif
#ifdef __VAES__
        24,
#endif
#ifdef __VPCLMULQDQ__
        25,
#endif
#ifdef __AVX512FP16__
        26,
#endif
        31};   /* (a sentinel: no empty initializer) */
    for (unsigned i = 0; i + 1 < sizeof on; i++) f |= 1u << on[i];
#endif
    return f;
}
