/* Gumbel-max sampling, one pass per row: the first index of the maximum of x[i] + g(i), where
   g(i) is the Gumbel noise of column i's 23-bit draw, read from the caller's table (so the
   noise is the caller's bit for bit).

   Most columns cannot win, and the kernel proves it without their noise: float addition rounds
   monotonically, so x[i] + g(i) <= x[i] + bound whenever g(i) <= bound, and a column whose
   x[i] + bound is below the best sum so far is skipped. Two bounds: the largest noise of any
   draw (skips the column before hashing it: masked -inf columns, logits far below the row's
   best), then the largest noise of the draw's bucket (its top 11 bits; after hashing, one read
   from a 2^11-entry table). The best sum starts at the row's largest logit plus its noise, so
   on a model's logits only a handful of columns per row get past both. The skips are exact:
   the result is the argmax of every column's sum, ties to the lower index. */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

#include "mqinfer_native.h"
#include "native_common.h"

#define DRAW_SHIFT 41   /* 64 - 23 bits per draw */
#define BUCKET_SHIFT 12 /* a draw's bucket: its top 11 bits */
#define BUCKETS (1 << 11)
#define GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Column i's draw in a row keyed `key`. */
static inline uint32_t draw(uint64_t key, int64_t i) {
    return (uint32_t)(mix64(key + (uint64_t)(i + 1) * GOLDEN) >> DRAW_SHIFT);
}

typedef struct {
    const mqinfer_gumbel_args *a;
    float noise_max; /* the largest bucket bound: no draw's noise exceeds it */
} gumbel_call;

/* The running best of a row: its sum and column. */
typedef struct { float sum; int64_t col; } best_sum;

/* Column i's exact sum, taken when it beats the best (a tie goes to the lower column). */
static inline void consider(best_sum *b, const float *x, const float *gumbel, uint64_t key, int64_t i) {
    const float v = x[i] + gumbel[draw(key, i)];
    if (v > b->sum || (v == b->sum && i < b->col)) { b->sum = v; b->col = i; }
}

/* The row's largest logit's column (any one of them), or -1 - (first NaN's column) when the
   row has a NaN. */
static int64_t row_top(const float *x, int64_t n) {
    float m = x[0];
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 best = _mm512_loadu_ps(x);
        __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_max_ps(best, v);
        }
        if (nan) i = 0;  /* the scalar loop below finds the first NaN */
        else m = _mm512_reduce_max_ps(best);
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) {
            int64_t first = 0;
            while (x[first] == x[first]) first++;
            return -1 - first;
        }
        if (x[i] > m) m = x[i];
    }
    int64_t top = 0;
    while (x[top] != m) top++;
    return top;
}

static int64_t gumbel_row(const float *x, int64_t n, uint64_t key, const float *gumbel,
                          const float *bucket_max, float noise_max) {
    const int64_t top = row_top(x, n);
    if (top < 0) return -1 - top;  /* x + g is NaN there: torch's argmax takes the first NaN */
    best_sum b = {x[top] + gumbel[draw(key, top)], top};
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    {
        /* 16 columns a step: their keyed counters in two vectors of 8, the bound tests on all
           16, the exact sums one column at a time for the few that pass. */
        const __m512 nmax = _mm512_set1_ps(noise_max);
        const __m512i step = _mm512_set1_epi64((long long)(16 * GOLDEN));
        const __m512i mul1 = _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ull);
        const __m512i mul2 = _mm512_set1_epi64((long long)0x94D049BB133111EBull);
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        {
            long long c[16];
            for (int l = 0; l < 16; l++) c[l] = (long long)(key + (uint64_t)(l + 1) * GOLDEN);
            lo = _mm512_loadu_si512(c);
            hi = _mm512_loadu_si512(c + 8);
        }
        for (; i + 16 <= n; i += 16, lo = _mm512_add_epi64(lo, step), hi = _mm512_add_epi64(hi, step)) {
            const __m512 xv = _mm512_loadu_ps(x + i);
            const __m512 best = _mm512_set1_ps(b.sum);
            if (!_mm512_cmp_ps_mask(_mm512_add_ps(xv, nmax), best, _CMP_GE_OQ)) continue;
            __m512i z[2] = {lo, hi};
            for (int h = 0; h < 2; h++) {
                z[h] = _mm512_mullo_epi64(_mm512_xor_si512(z[h], _mm512_srli_epi64(z[h], 30)), mul1);
                z[h] = _mm512_mullo_epi64(_mm512_xor_si512(z[h], _mm512_srli_epi64(z[h], 27)), mul2);
                z[h] = _mm512_srli_epi64(_mm512_xor_si512(z[h], _mm512_srli_epi64(z[h], 31)),
                                         DRAW_SHIFT + BUCKET_SHIFT);
            }
            const __m512i bucket = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(z[0])),
                                                      _mm512_cvtepi64_epi32(z[1]), 1);
            const __m512 bound = _mm512_i32gather_ps(bucket, bucket_max, 4);
            __mmask16 pass = _mm512_cmp_ps_mask(_mm512_add_ps(xv, bound), best, _CMP_GE_OQ);
            for (; pass; pass &= (__mmask16)(pass - 1))
                consider(&b, x, gumbel, key, i + __builtin_ctz(pass));
        }
    }
#endif
    for (; i < n; i++) {
        if (!(x[i] + noise_max >= b.sum)) continue;
        const uint32_t bits = draw(key, i);
        if (!(x[i] + bucket_max[bits >> BUCKET_SHIFT] >= b.sum)) continue;
        consider(&b, x, gumbel, key, i);
    }
    return b.col;
}

static int gumbel_range(const void *p, int64_t begin, int64_t end) {
    const gumbel_call *call = (const gumbel_call *)p;
    const mqinfer_gumbel_args *a = call->a;
    for (int64_t r = begin; r < end; r++)
        a->out[r] = gumbel_row(a->x + r * a->row_stride, a->cols, a->keys[r], a->gumbel, a->bucket_max,
                               call->noise_max);
    return 0;
}

void mqinfer_gumbel_argmax(const mqinfer_gumbel_args *args, int num_threads) {
    if (args->cols <= 0) return;
    gumbel_call call = {args, args->bucket_max[0]};
    for (int j = 1; j < BUCKETS; j++)
        if (args->bucket_max[j] > call.noise_max) call.noise_max = args->bucket_max[j];
    parallel_rows(gumbel_range, &call, args->rows, num_threads);
}
