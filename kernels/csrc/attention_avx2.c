/* AVX2 versions of the paged attention kernel (see paged_attention.c for the contract), for
   head sizes 64 and 128 and 1 to 8 query heads per KV head: CPUs without AVX-512 (and, on
   those with it, float8 caches, which its versions do not read) would otherwise run the
   portable loops, about ten times slower.

   One (token, KV head) at a time, as everywhere in this kernel: the g query heads' scores
   against every key of the sequence, their softmax, then the weighted sum of V rows.
   Scores are taken 8 keys at a time: one head's partial dot products with 8 keys (8
   accumulators, each key row read from L1 once per head) are summed across lanes together by
   a transpose-and-add (reduce8_add), which adds each key's lanes in the same tree as the
   one-key-at-a-time reduction (reduce1_add) used for a block's last keys, so a score does not
   depend on where its key falls in a block. The exponential is exp_nonpositive 8 lanes at a
   time, the same fused operations, hence the same bits. The weighted sum keeps half of one
   query head's output in two sets of registers (even and odd keys: two independent chains
   of multiply-adds) and walks the V rows once per query head and half. Decoding reads every
   sequence's cache from memory once per layer, so rows are prefetched two blocks ahead in
   the order they are read (attention_common.h); a prompt's later tokens find them in cache.
   8-bit caches (int8, float8 e4m3) have versions of their own, with float32 or bfloat16
   activations: rows are converted 8 lanes at a time as they are loaded and the rows' scales
   applied to the scores and the softmax weights, which stay float32. */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "attention_common.h"
#include "attention_avx2.h"

#if defined(__AVX2__) && defined(__FMA__)

#define DEFINE_FOR_D_G(DV, GV)                                                                              \
DEFINE_ATTEND_AVX2(attend2_f32_##DV##_##GV, float, float, v8_load_f32, v8_load_f32, v8_store_f32, keep_f32,      \
                   v8_keep_f32, 0, DV, GV)                                                                  \
DEFINE_ATTEND_AVX2(attend2_bf16_##DV##_##GV, uint16_t, uint16_t, v8_load_bf16, v8_load_bf16, v8_store_bf16,     \
                   round_to_bf16, v8_round_to_bf16, 0, DV, GV)
#define DEFINE_FOR_G(GV) DEFINE_FOR_D_G(64, GV) DEFINE_FOR_D_G(128, GV)
DEFINE_FOR_G(1)
DEFINE_FOR_G(2)
DEFINE_FOR_G(3)
DEFINE_FOR_G(4)
DEFINE_FOR_G(5)
DEFINE_FOR_G(6)
DEFINE_FOR_G(7)
DEFINE_FOR_G(8)

#define KINDS_FOR(DV, GV)                                                                        \
    {attend2_f32_##DV##_##GV, attend2_bf16_##DV##_##GV, attend2_f32_int8_##DV##_##GV,                \
     attend2_bf16_int8_##DV##_##GV, attend2_f32_fp8_##DV##_##GV, attend2_bf16_fp8_##DV##_##GV}
#define ROW_FOR_G(GV) {KINDS_FOR(64, GV), KINDS_FOR(128, GV)}
/* [g - 1][head_dim == 128][attention_kind]. */
static const attend_fn versions[8][2][6] = {
    ROW_FOR_G(1), ROW_FOR_G(2), ROW_FOR_G(3), ROW_FOR_G(4),
    ROW_FOR_G(5), ROW_FOR_G(6), ROW_FOR_G(7), ROW_FOR_G(8),
};

int mq_attend_avx2(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    const int64_t g = j->num_heads / j->num_kv_heads, D = j->head_dim;
    if (g < 1 || g > 8 || (D != 64 && D != 128)) return 0;
    versions[g - 1][D == 128][attention_kind(j)](j, token_begin, token_end, buf);
    return 1;
}

int mq_attention_selftest_avx2(const float *x, int64_t n, float *exp_one, float *exp_vec,
                               float *sum_one, float *sum_vec) {
    for (int64_t i = 0; i < n; i++) exp_one[i] = exp_nonpositive(x[i]);
    for (int64_t i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(exp_vec + i, exp_nonpositive8(_mm256_loadu_ps(x + i)));
    for (int64_t g = 0; g + 64 <= n; g += 64) {
        __m256 v[8];
        for (int r = 0; r < 8; r++) {
            v[r] = _mm256_loadu_ps(x + g + 8 * r);
            sum_one[g / 8 + r] = reduce1_add(v[r]);
        }
        _mm256_storeu_ps(sum_vec + g / 8, reduce8_add(v));
    }
    return 8;
}

#else

int mq_attend_avx2(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    (void)j; (void)token_begin; (void)token_end; (void)buf;
    return 0;
}

int mq_attention_selftest_avx2(const float *x, int64_t n, float *exp_one, float *exp_vec,
                               float *sum_one, float *sum_vec) {
    (void)x; (void)n; (void)exp_one; (void)exp_vec; (void)sum_one; (void)sum_vec;
    return 0;
}

#endif
