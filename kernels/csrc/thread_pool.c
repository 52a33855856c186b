/* The kernels' persistent thread pool: worker threads started once per process and thread
   count, asleep on a condition variable between calls (so they take no CPU from PyTorch's own
   threads while the model's matmuls run), woken for each parallel call.

   Waking a sleeping thread costs tens of microseconds on a virtual machine (the idle vCPU is
   halted and the host must deliver the wake-up), which is the whole of a small call: a
   decoding step at batch 1 makes about four dense calls per layer of 0.1-0.8 ms each, and with
   two threads and sleeping workers the 1152 x 896 projection took longer than on one thread.
   So after each call a worker first watches the generation for a short while (SPIN_US, or
   MQINFER_POOL_SPIN_US; 0 turns it off) before it sleeps, and the caller likewise watches for
   the last part to finish before it waits on done_cv: the next call of the same step finds
   the workers awake, and between steps (a millisecond or more of Python) they sleep. A watching
   thread yields its core every microsecond or so, so that a thread that wants it (PyTorch's
   OpenMP threads between the native calls, another worker's where the threads outnumber the
   cores) is not kept waiting for the watch to end.

   A call publishes (fn, ctx, num_parts) under the pool's mutex and bumps the generation; the
   caller and the woken workers then claim parts one at a time until none is left, and the
   caller waits until every part is done. Parts are claimed, not assigned, so a worker that
   wakes late costs nothing but its share, and a pool with fewer workers than asked for (a
   thread that could not start) still finishes every part.

   One call at a time: a second caller that finds the pool busy (another Python thread in a
   kernel) runs its parts itself rather than wait. After fork() the child has none of the
   parent's workers: a pthread_atfork handler forgets them, and the child starts its own on
   its first parallel call. */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "mqinfer_native.h"
#include "native_common.h"

/* More threads than this gain nothing for these kernels; the caller's count is capped. */
#define MAX_THREADS 256
/* How long a worker watches for the next call, and the caller for its call's last part,
   before sleeping (microseconds). */
#define SPIN_US 200

typedef struct {
    pthread_mutex_t run_lock; /* held by the one caller that owns the pool for a call */
    pthread_mutex_t mu;       /* guards everything below */
    pthread_cond_t work_cv;   /* workers wait here for a new generation or stop */
    pthread_cond_t done_cv;   /* the caller waits here for parts_done == num_parts */
    pthread_t *threads;
    int num_workers;          /* workers running */
    int size;                 /* the thread count the workers were started for */
    int stop;
    uint64_t generation;      /* stored atomically: spinning workers read it without mu */
    uint64_t parts_left;      /* parts of the current call not yet finished; likewise */
    mq_part_fn fn;
    const void *ctx;
    int num_parts, next_part, parts_done, failed;
    int64_t starts;
} pool_t;

static pool_t pool = {
    .run_lock = PTHREAD_MUTEX_INITIALIZER,
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .work_cv = PTHREAD_COND_INITIALIZER,
    .done_cv = PTHREAD_COND_INITIALIZER,
};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static int64_t spin_ns; /* stored atomically: the workers read it while the caller may set it */

/* Read by the caller at every call (so that a process can switch it, as the A/B runs do). */
static void read_spin(void) {
    const char *v = getenv("MQINFER_POOL_SPIN_US");
    const long us = v && *v ? strtol(v, NULL, 10) : SPIN_US;
    __atomic_store_n(&spin_ns, us > 0 ? (int64_t)us * 1000 : 0, __ATOMIC_RELAXED);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spins for at most spin_ns while (*word == value) == equal, that is until *word changes from
   value (equal = 1) or becomes value (equal = 0); the callers check again under the mutex
   either way. Reads without the mutex: the writers store these words atomically under it, and
   a spinner that sees the change takes the mutex before it touches anything else. */
static void spin_while(const uint64_t *word, uint64_t value, int equal) {
    const int64_t ns = __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
    if (ns <= 0) return;
    const int64_t deadline = now_ns() + ns;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if ((__atomic_load_n(word, __ATOMIC_ACQUIRE) == value) != equal) return;
            CPU_RELAX();
        }
        if (now_ns() >= deadline) return;
        sched_yield(); /* a thread that wants this core (PyTorch's, another worker's) gets it */
    }
}

/* Claims and runs parts of the current call until none is left. Called with mu held; returns
   with mu held. */
static void work_on_parts(void) {
    while (pool.next_part < pool.num_parts) {
        const int part = pool.next_part++;
        const mq_part_fn fn = pool.fn;
        const void *ctx = pool.ctx;
        const int num_parts = pool.num_parts;
        pthread_mutex_unlock(&pool.mu);
        const int failed = fn(ctx, part, num_parts);
        pthread_mutex_lock(&pool.mu);
        pool.failed |= failed != 0;
        __atomic_store_n(&pool.parts_left, (uint64_t)(pool.num_parts - ++pool.parts_done), __ATOMIC_RELEASE);
        if (pool.parts_done == pool.num_parts) pthread_cond_signal(&pool.done_cv);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    uint64_t seen = pool.generation;
    for (;;) {
        if (!pool.stop && pool.generation == seen) {
            pthread_mutex_unlock(&pool.mu);
            spin_while(&pool.generation, seen, 1);
            pthread_mutex_lock(&pool.mu);
        }
        while (!pool.stop && pool.generation == seen) pthread_cond_wait(&pool.work_cv, &pool.mu);
        if (pool.stop) break;
        seen = pool.generation;
        work_on_parts();
    }
    pthread_mutex_unlock(&pool.mu);
    return NULL;
}

/* In a forked child the workers do not exist and the locks may be held by threads that do
   not exist either: start from an empty pool with fresh locks. */
static void forget_pool_after_fork(void) {
    pthread_mutex_init(&pool.run_lock, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work_cv, NULL);
    pthread_cond_init(&pool.done_cv, NULL);
    free(pool.threads);
    pool.threads = NULL;
    pool.num_workers = pool.size = pool.stop = 0;
    pool.num_parts = pool.next_part = pool.parts_done = pool.failed = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, forget_pool_after_fork); }

static void stop_workers(void) {
    pthread_mutex_lock(&pool.mu);
    pool.stop = 1;
    __atomic_store_n(&pool.generation, pool.generation + 1, __ATOMIC_RELEASE); /* ends their spins */
    pthread_cond_broadcast(&pool.work_cv);
    pthread_mutex_unlock(&pool.mu);
    for (int w = 0; w < pool.num_workers; w++) pthread_join(pool.threads[w], NULL);
    free(pool.threads);
    pool.threads = NULL;
    pthread_mutex_lock(&pool.mu);
    pool.num_workers = 0;
    pool.stop = 0;
    pthread_mutex_unlock(&pool.mu);
}

/* Makes the pool hold size - 1 workers (the caller is the size-th thread). Called with
   run_lock held. A worker that cannot start is simply missing: the others, and the caller,
   do its share. */
static void ensure_size(int size) {
    if (size == pool.size) return;
    stop_workers();
    pool.size = size;
    pool.threads = (pthread_t *)calloc((size_t)(size - 1), sizeof(pthread_t));
    int started = 0;
    while (pool.threads && started < size - 1 &&
           pthread_create(&pool.threads[started], NULL, worker_main, NULL) == 0)
        started++;
    pthread_mutex_lock(&pool.mu);
    pool.num_workers = started;
    pool.starts++;
    pthread_mutex_unlock(&pool.mu);
}

static int run_inline(mq_part_fn fn, const void *ctx, int num_parts) {
    int failed = 0;
    for (int part = 0; part < num_parts; part++) failed |= fn(ctx, part, num_parts) != 0;
    return failed;
}

int mq_parallel(mq_part_fn fn, const void *ctx, int num_parts, int num_threads) {
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_parts <= 1 || num_threads <= 1) return run_inline(fn, ctx, num_parts);
    pthread_once(&atfork_once, register_atfork);
    read_spin();
    if (pthread_mutex_trylock(&pool.run_lock) != 0) return run_inline(fn, ctx, num_parts);
    ensure_size(num_threads);
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.num_parts = num_parts;
    pool.next_part = pool.parts_done = pool.failed = 0;
    __atomic_store_n(&pool.parts_left, (uint64_t)num_parts, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, pool.generation + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.work_cv);
    work_on_parts();
    if (pool.parts_done < pool.num_parts) {
        pthread_mutex_unlock(&pool.mu);
        spin_while(&pool.parts_left, 0, 0);
        pthread_mutex_lock(&pool.mu);
    }
    while (pool.parts_done < pool.num_parts) pthread_cond_wait(&pool.done_cv, &pool.mu);
    const int failed = pool.failed;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.run_lock);
    return failed;
}

int64_t mqinfer_pool_starts(void) {
    pthread_mutex_lock(&pool.mu);
    const int64_t starts = pool.starts;
    pthread_mutex_unlock(&pool.mu);
    return starts;
}

int mqinfer_pool_workers(void) {
    pthread_mutex_lock(&pool.mu);
    const int workers = pool.num_workers;
    pthread_mutex_unlock(&pool.mu);
    return workers;
}
