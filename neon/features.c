/* Build information and the generic-twin switch. */
#include "el_common.h"

int el_generic_flag = 0;

void el_use_generic(int on) { el_generic_flag = on ? 1 : 0; }

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
