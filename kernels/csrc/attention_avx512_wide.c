/* The AVX-512 versions of the attention kernel for 5 to 8 query heads per KV head
   (attention_avx512_versions.h), as in Qwen2.5's models (6 and 7); attention_avx512.c calls
   them. */
#include <stdint.h>

#include "attention_common.h"
#include "attention_avx512_versions.h"

#if defined(__AVX512F__)

DEFINE_AVX512_FOR(64, 5) DEFINE_AVX512_FOR(128, 5)
DEFINE_AVX512_FOR(64, 6) DEFINE_AVX512_FOR(128, 6)
DEFINE_AVX512_FOR(64, 7) DEFINE_AVX512_FOR(128, 7)
DEFINE_AVX512_FOR(64, 8) DEFINE_AVX512_FOR(128, 8)

/* [g - 5][head_dim == 128][attention_kind]. */
static const attend_fn versions[4][2][4] = {AVX512_ROW(5), AVX512_ROW(6), AVX512_ROW(7), AVX512_ROW(8)};

int mq_attend_avx512_wide(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    const int64_t g = j->num_heads / j->num_kv_heads;
    versions[g - 5][j->head_dim == 128][attention_kind(j)](j, token_begin, token_end, buf);
    return 1;
}

#else

int mq_attend_avx512_wide(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    (void)j; (void)token_begin; (void)token_end; (void)buf;
    return 0;
}

#endif
