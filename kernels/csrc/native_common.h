/* Helpers shared by the kernels' sources, not exported: the persistent thread pool's entry
   point, row-parallel calls on it and the one explicit multiply-add macro. */
#ifndef MQINFER_NATIVE_COMMON_H
#define MQINFER_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>

/* a * b + c, fused (one rounding) where the CPU has a multiply-add instruction, two roundings
   where it has not (a software fmaf there would cost a library call per element). With
   -ffp-contract=off this is the only place a portable loop gets a fused operation. */
#if defined(FP_FAST_FMAF)
#define MUL_ADD(a, b, c) fmaf((a), (b), (c))
#else
#define MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

/* One part of a parallel call: does the work of part `part` of `num_parts` and returns 0, or
   non-zero when it failed (ran out of memory). Which thread runs a part is not fixed: a part's
   result must depend only on its index. */
typedef int (*mq_part_fn)(const void *ctx, int part, int num_parts);

/* Runs fn for parts 0..num_parts-1 on the calling thread and the pool's workers, and returns
   once every part is done: 0, or non-zero when some part failed. num_threads is the caller's
   thread budget; the pool keeps num_threads - 1 workers across calls and restarts them only
   when that number changes. One part, one thread, or a pool busy with another caller's work:
   the parts run on the calling thread, one after another. */
int mq_parallel(mq_part_fn fn, const void *ctx, int num_parts, int num_threads);

/* A kernel's work on rows begin..end-1; returns 0, or -1 when it ran out of memory. */
typedef int (*range_fn)(const void *args, int64_t begin, int64_t end);
typedef struct { range_fn fn; const void *args; int64_t rows; } rows_call;

static inline int rows_part(const void *ctx, int part, int num_parts) {
    const rows_call *call = (const rows_call *)ctx;
    return call->fn(call->args, call->rows * part / num_parts, call->rows * (part + 1) / num_parts);
}

/* fn over rows 0..rows-1, cut into up to num_threads runs of equal length. */
static inline int parallel_rows(range_fn fn, const void *args, int64_t rows, int num_threads) {
    if (rows <= 0) return 0;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > rows) parts = rows;
    const rows_call call = {fn, args, rows};
    return mq_parallel(rows_part, &call, (int)parts, num_threads);
}

#endif
