/* Internal: the native pre-tokenizer (pretok.c) for bpe.c. */
#ifndef EL_PRETOK_H
#define EL_PRETOK_H
#include <stdint.h>

/* emit(ctx, a, b): the next piece is t[a .. b) */
typedef void (*el_piece_fn)(void *ctx, int a, int b);

/* Cuts t[0 .. n) into the pieces of pre-tokenizer `family` (EL_PRE_*), in order. */
void el_pretok_split(int family, const uint32_t *t, int n, el_piece_fn emit, void *ctx);

#endif
