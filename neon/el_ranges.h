/* Internal: el_parallel_ranges (threadpool.c), for the kernel files. */
#ifndef EL_RANGES_H
#define EL_RANGES_H

#include "edgellm_neon.h"

/* Items 0..n_items-1 as contiguous ranges, one per pool thread: each thread takes its own range's
 * items in order, then the items left in the others' ranges, so a thread that starts late or
 * runs slower has its share taken over. Where consecutive items read consecutive memory (W
 * chunks of a GEMV, key splits of decode attention) each thread reads one stream, not every other
 * chunk. fn(ctx, item, flags), flags of:
 *   EL_ITEM_MORE   item + 1 is in the same range: the item this thread most likely takes next
 *                  (worth prefetching into)
 *   EL_ITEM_AFTER  this thread's previous item was item - 1: what it prefetched ahead of that
 *                  one covers this one's start */
#define EL_ITEM_MORE 1
#define EL_ITEM_AFTER 2
typedef void (*el_item_fn)(void *ctx, int item, int flags);
#define EL_RANGES_MAX 16   /* ranges at most: more threads than this share them */
void el_parallel_ranges(el_pool *pool, int n_items, el_item_fn fn, void *ctx);

#endif
