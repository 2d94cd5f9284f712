/* Internal: el_parallel_ranges (threadpool.c), for the kernel files. */
#ifndef EL_RANGES_H
#define EL_RANGES_H

#include "edgellm_neon.h"

/* Items 0..n_items-1 as contiguous ranges, one per pool thread: each thread takes its own range's
 * items in order, then the items left in the others' ranges, so a thread that starts late or
 * runs slower has its share taken over. Where consecutive items read consecutive memory (W
 * chunks of a GEMV, key splits of decode attention) each thread reads one stream, not every other
 * chunk. fn(ctx, item, more): more = 1 when item + 1 is in the same range, the item this thread
 * most likely takes next (worth prefetching into). */
typedef void (*el_item_fn)(void *ctx, int item, int more);
#define EL_RANGES_MAX 16   /* ranges at most: more threads than this share them */
void el_parallel_ranges(el_pool *pool, int n_items, el_item_fn fn, void *ctx);

#endif
