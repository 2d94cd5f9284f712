/* The persistent thread pool behind every parallel kernel.
 *
 * n_threads - 1 workers plus the calling thread (thread 0, which Python pins itself). Decode
 * calls el_parallel_for a few hundred times per token with jobs of a few microseconds, so the
 * dispatch is built for latency:
 *
 *   state      one 64-bit word, generation << 32 | next task index. Publishing a job is one
 *              store of (gen + 1) << 32; a task is claimed with a compare-and-swap that also
 *              checks the generation, so a worker that wakes late can never claim a task of a
 *              job it did not read (or a later job's index with an older job's bounds).
 *              Tasks are claimed one at a time, so a fast core takes more of them than a slow
 *              one (big.LITTLE, or a worker the OS has descheduled).
 *   slot[2]    the job (fn, ctx, n_tasks), double-buffered by generation parity: job g + 2 can
 *              only be written after job g + 1 has been published, which fails every stale CAS
 *              against generation g (the fields are seq_cst atomics for exactly that argument).
 *   remaining  tasks of the current job not yet finished; the caller returns when it is 0. The
 *              caller does not wait for idle workers to check in, only for the work.
 *   waiting    workers spin on `state` for EL_SPIN_NS, keep checking it with a sched_yield between
 *              checks until EL_SLEEP_NS, then sleep on a condition variable, so an idle pool
 *              costs no CPU; the caller broadcasts only when `sleepers` is non-zero
 *              (sleepers++ then re-check the generation in the worker, publish then read
 *              sleepers in the caller: both seq_cst, so one of the two always sees the other).
 *
 * Pinning uses sched_setaffinity / sched_getaffinity on each worker's kernel thread id rather
 * than pthread_{set,get}affinity_np: the same syscall, and Android's bionic has only the former.
 */
#define _GNU_SOURCE
#include "edgellm_neon.h"
#include "el_ranges.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#define EL_POOL_MAX_THREADS 256
/* How long an idle worker spins before it yields between checks: longer than the Python gap
 * between two ops of a decode step (a few us to tens of us). */
#define EL_SPIN_NS 100000L
/* How long an idle worker keeps checking (yielding its core) before it sleeps: longer than the
 * Python gap between two decode steps (sampling, the streamed piece, the next embedding: ~0.1 to
 * 0.5 ms on x86), short enough that a pool left idle between requests stops polling almost at
 * once. Sleeping after 100 us, a worker slept ~2 times per token (2267 sleeps in 1000 SmolLM2
 * tokens; 24 when it polled for 1 ms), and each next step's first ops waited for its wake-up. */
#define EL_SLEEP_NS 2000000L
/* Worker stack: the decode attention keeps ~80 KB of scratch on the stack (the prefill tiles'
 * ~325 KB and int8 decode's 256 KB are per thread on the heap); bionic's default thread stack is
 * 1 MB, glibc's follows ulimit -s, musl's is 128 KB. Pages are only committed when touched. */
#define EL_WORKER_STACK (2u << 20)
#define EL_LINE 128 /* covers the 64-byte lines of Cortex-A and the 128-byte ones of Apple cores */

typedef struct {
    _Atomic(el_task_fn) fn;
    _Atomic(void *) ctx;
    atomic_int n;
} el_job;

typedef struct {
    el_pool *pool;
    pthread_t thread;
    int cpu;          /* core it is pinned to, -1: not pinned */
    long tid;         /* kernel thread id, for sched_{set,get}affinity */
} el_worker;

struct el_pool {
    _Alignas(EL_LINE) _Atomic uint64_t state;  /* gen << 32 | next task */
    _Alignas(EL_LINE) atomic_int remaining;    /* tasks of the current job still running or unclaimed */
    _Alignas(EL_LINE) el_job slot[2];
    atomic_int sleepers;                       /* workers blocked (or about to block) on cv */
    atomic_int stop;
    atomic_int busy;                           /* a caller is inside el_parallel_for */
    pthread_mutex_t mu;
    pthread_cond_t cv;                         /* a new generation (or stop) was published */
    pthread_cond_t cv_started;                 /* a worker has started (create waits for all) */
    int started;                               /* under mu */
    int n_threads;
    el_worker *workers;                        /* n_threads - 1 */
};

static inline void el_cpu_relax(void) {
#if defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#elif defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static inline int64_t el_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint32_t el_gen(uint64_t state) { return (uint32_t)(state >> 32); }

/* Claims and runs tasks of generation g until none are left or the generation has moved on. */
static void el_run_tasks(el_pool *p, uint32_t g) {
    el_job *job = &p->slot[g & 1];
    for (;;) {
        uint64_t w = atomic_load(&p->state);
        if (el_gen(w) != g) return;
        uint32_t idx = (uint32_t)w;
        int n = atomic_load(&job->n);
        if ((int64_t)idx >= (int64_t)n) return;
        el_task_fn fn = atomic_load(&job->fn);
        void *ctx = atomic_load(&job->ctx);
        /* fails if another thread claimed idx, or if a new job was published since the load
         * (then fn, ctx, n may belong to another job and are discarded) */
        if (!atomic_compare_exchange_weak(&p->state, &w, w + 1)) continue;
        fn(ctx, (int)idx, n);
        atomic_fetch_sub_explicit(&p->remaining, 1, memory_order_release);
    }
}

/* Returns the first generation other than `seen`: spinning, then yielding between checks (a
 * thread that needs this core gets it), then sleeping. */
static uint32_t el_wait_job(el_pool *p, uint32_t seen) {
    int64_t t0 = 0;
    for (unsigned i = 1;; i++) {
        uint32_t g = el_gen(atomic_load_explicit(&p->state, memory_order_acquire));
        if (g != seen) return g;
        el_cpu_relax();
        if ((i & 63) == 0) {
            int64_t t = el_now_ns();
            if (t0 == 0) t0 = t;
            else if (t - t0 > EL_SLEEP_NS) break;
            else if (t - t0 > EL_SPIN_NS) sched_yield();
        }
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    uint32_t g;
    while ((g = el_gen(atomic_load(&p->state))) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->cv, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static long el_gettid(void) {
#if defined(__linux__)
    return (long)syscall(SYS_gettid);
#else
    return 0;
#endif
}

static void el_pin_self(int cpu) {
#if defined(__linux__)
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    /* A failure (the core is offline or outside the process's cpuset) leaves the worker
     * unpinned; el_pool_affinity shows it, and Python checks the read-back. */
    (void)sched_setaffinity(0, sizeof set, &set);
#else
    (void)cpu;
#endif
}

static void *el_worker_main(void *arg) {
    el_worker *w = arg;
    el_pool *p = w->pool;
    /* process signals (Ctrl-C's SIGINT, SIGTERM) go to the app's own threads: a worker that
     * took one left the main thread blocked in a read (a chat's prompt ignored 1 Ctrl-C in 4) */
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    w->tid = el_gettid();
    el_pin_self(w->cpu);
    pthread_mutex_lock(&p->mu);
    p->started++;
    pthread_cond_signal(&p->cv_started);
    pthread_mutex_unlock(&p->mu);

    uint32_t seen = 0; /* no job is published before el_pool_create returns */
    for (;;) {
        uint32_t g = el_wait_job(p, seen);
        if (atomic_load(&p->stop)) break;
        seen = g;
        el_run_tasks(p, g);
    }
    return NULL;
}

/* Stops and joins the first n_started workers, frees the pool. */
static void el_pool_free(el_pool *p, int n_started) {
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->state, (uint64_t)1 << 32); /* spinning workers see a new generation */
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < n_started; i++) pthread_join(p->workers[i].thread, NULL);
    pthread_cond_destroy(&p->cv_started);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

el_pool *el_pool_create(int n_threads, const int *cores, int n_cores) {
    if (n_threads < 1 || n_threads > EL_POOL_MAX_THREADS) return NULL;
    if (cores != NULL) {
        if (n_cores <= 0) return NULL;
        for (int i = 0; i < n_cores; i++)
#if defined(__linux__)
            if (cores[i] < 0 || cores[i] >= CPU_SETSIZE) return NULL;
#else
            if (cores[i] < 0) return NULL;
#endif
    }
    size_t size = (sizeof(el_pool) + EL_LINE - 1) / EL_LINE * EL_LINE;
    el_pool *p = aligned_alloc(EL_LINE, size);
    if (!p) return NULL;
    memset(p, 0, size);
    atomic_init(&p->state, 0);
    atomic_init(&p->remaining, 0);
    for (int s = 0; s < 2; s++) {
        atomic_init(&p->slot[s].fn, NULL);
        atomic_init(&p->slot[s].ctx, NULL);
        atomic_init(&p->slot[s].n, 0);
    }
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->busy, 0);
    p->n_threads = n_threads;
    p->workers = calloc((size_t)(n_threads > 1 ? n_threads - 1 : 1), sizeof(el_worker));
    if (!p->workers) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_cond_init(&p->cv_started, NULL);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, EL_WORKER_STACK);
    int created = 0;
    for (int i = 1; i < n_threads; i++) {
        el_worker *w = &p->workers[i - 1];
        w->pool = p;
        w->cpu = cores ? cores[i % n_cores] : -1;
        w->tid = -1;
        if (pthread_create(&w->thread, &attr, el_worker_main, w) != 0) break;
        created++;
    }
    pthread_attr_destroy(&attr);
    /* wait for every worker to be running and pinned, so el_pool_affinity can read it back */
    pthread_mutex_lock(&p->mu);
    while (p->started < created) pthread_cond_wait(&p->cv_started, &p->mu);
    pthread_mutex_unlock(&p->mu);
    if (created != n_threads - 1) {
        el_pool_free(p, created);
        return NULL;
    }
    return p;
}

void el_pool_destroy(el_pool *pool) {
    if (pool) el_pool_free(pool, pool->n_threads - 1);
}

int el_pool_threads(const el_pool *pool) { return pool ? pool->n_threads : 1; }

int el_pool_affinity(el_pool *pool, int thread, int *cores_out, int max_cores) {
    int n_threads = pool ? pool->n_threads : 1;
    if (thread < 0 || thread >= n_threads || cores_out == NULL || max_cores < 0) return EL_EINVAL;
#if defined(__linux__)
    /* thread 0 is whoever calls: the thread that runs as thread 0 in el_parallel_for */
    pid_t tid = thread == 0 ? 0 : (pid_t)pool->workers[thread - 1].tid;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(tid, sizeof set, &set) != 0) return EL_EUNSUPPORTED;
    int count = 0;
    for (int c = 0; c < CPU_SETSIZE && count < max_cores; c++)
        if (CPU_ISSET(c, &set)) cores_out[count++] = c;
    return count;
#else
    (void)pool;
    return EL_EUNSUPPORTED;
#endif
}

void el_parallel_for(el_pool *pool, int n_tasks, el_task_fn fn, void *ctx) {
    if (n_tasks <= 0 || fn == NULL) return;
    /* Inline when there is nothing to share, and when the pool is already running a job: a
     * task that calls el_parallel_for again, or a second thread on the same pool, gets a
     * correct serial run instead of a deadlock. */
    if (pool == NULL || pool->n_threads <= 1 || n_tasks == 1 || atomic_exchange(&pool->busy, 1)) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, n_tasks);
        return;
    }
    el_pool *p = pool;
    uint32_t g = el_gen(atomic_load(&p->state)) + 1;
    el_job *job = &p->slot[g & 1];
    atomic_store(&job->fn, fn);
    atomic_store(&job->ctx, ctx);
    atomic_store(&job->n, n_tasks);
    atomic_store_explicit(&p->remaining, n_tasks, memory_order_relaxed);
    atomic_store(&p->state, (uint64_t)g << 32); /* publish: releases the job fields above */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    el_run_tasks(p, g);
    /* the other threads' last tasks; yield after a while in case the caller's core is the one
     * a worker needs (more threads than cores) */
    int64_t t0 = 0;
    for (unsigned i = 1; atomic_load_explicit(&p->remaining, memory_order_acquire) > 0; i++) {
        el_cpu_relax();
        if ((i & 63) == 0) {
            int64_t t = el_now_ns();
            if (t0 == 0) t0 = t;
            else if (t - t0 > EL_SPIN_NS) sched_yield();
        }
    }
    atomic_store_explicit(&p->busy, 0, memory_order_release);
}

/* ---- ranges ----------------------------------------------------------------------------------- */
typedef struct {
    _Alignas(128) atomic_int next;   /* next item of this range to claim */
    int end;
} el_range;

typedef struct {
    el_item_fn fn;
    void *ctx;
    int n_ranges;
    el_range r[EL_RANGES_MAX];
} el_ranges_job;

static void el_ranges_task(void *vctx, int task, int n_tasks) {
    el_ranges_job *j = (el_ranges_job *)vctx;
    (void)n_tasks;
    int prev = -2;
    for (int k = 0; k < j->n_ranges; k++) {     /* own range first, then the others' */
        el_range *r = &j->r[(task + k) % j->n_ranges];
        for (int i; (i = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed)) < r->end; prev = i)
            j->fn(j->ctx, i, (i + 1 < r->end ? EL_ITEM_MORE : 0) | (i == prev + 1 ? EL_ITEM_AFTER : 0));
    }
}

void el_parallel_ranges(el_pool *pool, int n_items, el_item_fn fn, void *ctx) {
    if (n_items <= 0 || fn == NULL) return;
    int n = el_pool_threads(pool);   /* one range per thread (one in all: a serial walk) */
    if (n > n_items) n = n_items;
    if (n > EL_RANGES_MAX) n = EL_RANGES_MAX;
    el_ranges_job j;
    j.fn = fn;
    j.ctx = ctx;
    j.n_ranges = n;
    for (int t = 0; t < j.n_ranges; t++) {
        atomic_init(&j.r[t].next, (int)((long long)n_items * t / j.n_ranges));
        j.r[t].end = (int)((long long)n_items * (t + 1) / j.n_ranges);
    }
    el_parallel_for(pool, j.n_ranges, el_ranges_task, &j);
}
