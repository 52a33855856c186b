/* The AVX-512 versions of the attention kernel for 1 to 4 query heads per KV head
   (attention_avx512_versions.h), and the entry point of all of them. */
#include <stdint.h>

#include "attention_common.h"
#include "attention_avx512_versions.h"

#if defined(__AVX512F__)

DEFINE_AVX512_FOR(64, 1) DEFINE_AVX512_FOR(128, 1)
DEFINE_AVX512_FOR(64, 2) DEFINE_AVX512_FOR(128, 2)
DEFINE_AVX512_FOR(64, 3) DEFINE_AVX512_FOR(128, 3)
DEFINE_AVX512_FOR(64, 4) DEFINE_AVX512_FOR(128, 4)

/* [g - 1][head_dim == 128][attention_kind]. */
static const attend_fn versions[4][2][4] = {AVX512_ROW(1), AVX512_ROW(2), AVX512_ROW(3), AVX512_ROW(4)};

int mq_attend_avx512(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    const int64_t g = j->num_heads / j->num_kv_heads, D = j->head_dim;
    const int kind = attention_kind(j);
    if (kind >= 4 || (D != 64 && D != 128) || g < 1 || g > 8) return 0;
    if (g > 4) return mq_attend_avx512_wide(j, token_begin, token_end, buf);
    versions[g - 1][D == 128][kind](j, token_begin, token_end, buf);
    return 1;
}

#else

int mq_attend_avx512(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) {
    (void)j; (void)token_begin; (void)token_end; (void)buf;
    return 0;
}

#endif
