/* The memory read bandwidth, for `edgellm profile` (the roofline's memory_read_bandwidth) and
 * the bench's decode floor: every pool thread streams its share of a buffer far larger than the
 * caches with 128-bit loads, as decode's GEMVs stream the weights. The caller times it.
 *
 * Why not numpy: the earlier probe was an sgemv through numpy, so it measured whatever BLAS the
 * numpy build has (on an Arm board without a tuned one, far less than the memory gives), and
 * even with OpenBLAS on Zen 4 it read 22-27 GB/s from run to run where the decode GEMVs
 * streamed faster than its floor said they could.
 *
 * The words are summed (uint64, wrapping) into *sum, so the loads cannot be dropped and a test
 * can check that every byte was read once. Tasks are claimed one at a time (4 per thread), so a
 * thread the OS holds up reads less instead of holding up the others. */
#include "el_common.h"

#include <stdlib.h>

#define EL_READ_TASKS_PER_THREAD 4
#define EL_READ_MAX_TASKS 1024

typedef struct {
    const uint8_t *buf;
    size_t lines;   /* 64-byte lines */
    uint64_t part[EL_READ_MAX_TASKS];
} el_read_job;

static void el_read_task(void *ctx, int t, int n) {
    el_read_job *J = ctx;
    const size_t l0 = J->lines * (size_t)t / (size_t)n, l1 = J->lines * (size_t)(t + 1) / (size_t)n;
    const uint64_t *p = (const uint64_t *)(J->buf + l0 * 64);
    /* 4 accumulators of 2 lanes: one line per turn, no add waiting on the previous one */
    uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
    for (size_t l = l0; l < l1; l++, p += 8) {
        a0 = vaddq_u64(a0, vld1q_u64(p));
        a1 = vaddq_u64(a1, vld1q_u64(p + 2));
        a2 = vaddq_u64(a2, vld1q_u64(p + 4));
        a3 = vaddq_u64(a3, vld1q_u64(p + 6));
    }
    const uint64x2_t s = vaddq_u64(vaddq_u64(a0, a1), vaddq_u64(a2, a3));
    J->part[t] = vgetq_lane_u64(s, 0) + vgetq_lane_u64(s, 1);
}

int el_read_probe(el_pool *pool, const void *buf, size_t bytes, uint64_t *sum) {
    if (!buf || !sum || bytes == 0 || bytes % 64 != 0 || (uintptr_t)buf % 8 != 0) return EL_EINVAL;
    el_read_job *J = malloc(sizeof *J);
    if (!J) return EL_ENOMEM;
    J->buf = buf;
    J->lines = bytes / 64;
    const size_t want = (size_t)el_pool_threads(pool) * EL_READ_TASKS_PER_THREAD;
    const int n = (int)EL_MIN(EL_MIN(want, (size_t)EL_READ_MAX_TASKS), J->lines);
    el_parallel_for(pool, n, el_read_task, J);
    uint64_t s = 0;
    for (int t = 0; t < n; t++) s += J->part[t];
    *sum = s;
    free(J);
    return EL_OK;
}
