/* Paged attention on CPU: reads the paged KV cache in place, one (query token, KV head) at a
   time, with no gather, no padding and float32 accumulation; the KV head's g query heads share
   every K/V row it loads. For heads 64 or 128 wide with 1 to 8 query heads per KV head (SmolLM2,
   the Llama 3 and Qwen2.5 families): AVX-512 versions (attention_avx512.c) and, on CPUs without
   AVX-512, AVX2 versions (attention_avx2.c); the portable loops here for every other shape and
   CPU. 8-bit caches (int8, float8 e4m3, with a bfloat16 scale per row) are read with float32 or
   bfloat16 activations and float32 arithmetic: int8 ones by the AVX-512 versions, float8 ones
   by the AVX2 versions, and the portable loops for other shapes.

   Work is cut into runs of consecutive tokens of about equal cost (a token's cost grows with
   its context), one run per thread; each token is computed by one thread in one fixed order,
   so results do not depend on the thread count. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_common.h"

/* The portable version, for any head size and grouping: tokens token_begin..token_end - 1.
   A score's dot product is a chain of separate multiplies and adds (a chain of fused ones
   waits on the multiply-add's longer latency at every step); the weighted sum of V rows, one
   independent multiply-add per element, is fused. T is the activations' type, TKV the
   cache's; SCALED (an 8-bit cache) dequantizes each K/V row as it is loaded (stored value
   times its row's scale, one rounding, as kv_quant.dequantize_kv does). */
#define DEFINE_ATTEND(NAME, T, TKV, LOAD, LOADKV, STORE, ROUNDW, SCALED)                          \
static void NAME(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) { \
    const int64_t D = j->head_dim, hkv = j->num_kv_heads, g = j->num_heads / hkv, bs = j->block_size; \
    float *scores = buf, *qf = scores + g * j->max_len, *acc = qf + g * D, *row = acc + g * D;    \
    float *inv_sum = row + D;                                                                     \
    const T *q = (const T *)j->q;                                                                 \
    const TKV *kc = (const TKV *)j->k_cache, *vc = (const TKV *)j->v_cache;                      \
    T *out = (T *)j->out;                                                                         \
    for (int64_t t = token_begin; t < token_end; t++) {                                           \
        const int64_t len = j->positions[t] + 1;                                                  \
        const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;              \
        for (int64_t h = 0; h < hkv; h++) {                                                       \
            for (int64_t i = 0; i < g; i++)                                                       \
                for (int64_t d = 0; d < D; d++)                                                   \
                    qf[i * D + d] = LOAD(q[t * j->q_token_stride + (h * g + i) * D + d]) * j->scale; \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const TKV *kb = kc + (table[blk] * bs * hkv + h) * D;                             \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    const TKV *k = kb + o * hkv * D;                                              \
                    if (SCALED) {                                                                 \
                        const float ks = bf16_to_float(j->k_scale[(table[blk] * bs + o) * hkv + h]); \
                        for (int64_t d = 0; d < D; d++) row[d] = LOADKV(k[d]) * ks;               \
                    } else {                                                                      \
                        for (int64_t d = 0; d < D; d++) row[d] = LOADKV(k[d]);                    \
                    }                                                                             \
                    for (int64_t i = 0; i < g; i++) {                                             \
                        float s = 0.0f;                                                           \
                        for (int64_t d = 0; d < D; d++) s += qf[i * D + d] * row[d];              \
                        scores[i * len + first + o] = s;                                          \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t i = 0; i < g; i++) {                                                     \
                float *s = scores + i * len, m = -FLT_MAX, sum = 0.0f;                            \
                for (int64_t p = 0; p < len; p++) m = s[p] > m ? s[p] : m;                        \
                for (int64_t p = 0; p < len; p++) { s[p] = exp_nonpositive(s[p] - m); sum += s[p]; } \
                inv_sum[i] = 1.0f / sum;                                                          \
                for (int64_t p = 0; p < len; p++) s[p] = ROUNDW(s[p]);                            \
            }                                                                                     \
            memset(acc, 0, sizeof(float) * g * D);                                                \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const TKV *vb = vc + (table[blk] * bs * hkv + h) * D;                             \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    const TKV *v = vb + o * hkv * D;                                              \
                    if (SCALED) {                                                                 \
                        const float vs = bf16_to_float(j->v_scale[(table[blk] * bs + o) * hkv + h]); \
                        for (int64_t d = 0; d < D; d++) row[d] = LOADKV(v[d]) * vs;               \
                    } else {                                                                      \
                        for (int64_t d = 0; d < D; d++) row[d] = LOADKV(v[d]);                    \
                    }                                                                             \
                    for (int64_t i = 0; i < g; i++) {                                             \
                        const float w = scores[i * len + first + o];                              \
                        for (int64_t d = 0; d < D; d++) acc[i * D + d] = MUL_ADD(w, row[d], acc[i * D + d]); \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t i = 0; i < g; i++)                                                       \
                for (int64_t d = 0; d < D; d++)                                                   \
                    out[(t * j->num_heads + h * g + i) * D + d] = STORE(acc[i * D + d] * inv_sum[i]); \
        }                                                                                         \
    }                                                                                             \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ATTEND(attend_f32, float, float, LOAD_F32, LOAD_F32, STORE_F32, keep_f32, 0)
DEFINE_ATTEND(attend_bf16, uint16_t, uint16_t, bf16_to_float, bf16_to_float, float_to_bf16, round_to_bf16, 0)
/* 8-bit caches, float32 or bfloat16 activations; either way the softmax weights stay float32
   and a bfloat16 output is rounded once, from the float32 result. */
DEFINE_ATTEND(attend_f32_int8, float, int8_t, LOAD_F32, int8_to_float, STORE_F32, keep_f32, 1)
DEFINE_ATTEND(attend_f32_fp8, float, uint8_t, LOAD_F32, fp8e4m3_to_float, STORE_F32, keep_f32, 1)
DEFINE_ATTEND(attend_bf16_int8, uint16_t, int8_t, bf16_to_float, int8_to_float, float_to_bf16, keep_f32, 1)
DEFINE_ATTEND(attend_bf16_fp8, uint16_t, uint8_t, bf16_to_float, fp8e4m3_to_float, float_to_bf16, keep_f32, 1)

#if defined(__AVX512F__)
#include "attention_avx512.h"
#define HAVE_SPECIALISED 1
#endif

/* Tests only: the vectorised softmax pieces against their one-at-a-time originals, which the
   portable kernel uses, for the widest vectors the library has (AVX-512, else AVX2). x holds n
   floats, n a multiple of 256. Returns the vector width (16 or 8; sum_one and sum_vec get
   n / width values), or 0 (and writes nothing) where there is no vectorised version. */
int mqinfer_attention_selftest(const float *x, int64_t n, float *exp_one, float *exp_vec,
                               float *sum_one, float *sum_vec) {
#ifdef HAVE_SPECIALISED
    for (int64_t i = 0; i < n; i++) exp_one[i] = exp_nonpositive(x[i]);
    for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(exp_vec + i, exp_nonpositive16(_mm512_loadu_ps(x + i)));
    for (int64_t g = 0; g + 256 <= n; g += 256) {
        __m512 v[16];
        for (int r = 0; r < 16; r++) {
            v[r] = _mm512_loadu_ps(x + g + 16 * r);
            sum_one[g / 16 + r] = _mm512_reduce_add_ps(v[r]);
        }
        _mm512_storeu_ps(sum_vec + g / 16, reduce16_add_ps(v));
    }
    return 16;
#else
    return mq_attention_selftest_avx2(x, n, exp_one, exp_vec, sum_one, sum_vec);
#endif
}

/* Tokens token_begin..token_end - 1, each on its own: the AVX-512 version for the call's shape,
   else the AVX2 one, else the portable loops. */
static void attend_per_token(const mqinfer_attention_args *j, int64_t begin, int64_t end, float *buf) {
    /* The AVX-512 versions read caches in the activations' type or int8 caches; float8 caches
       go to the AVX2 versions (every AVX-512 CPU has AVX2 and FMA) or the portable loops. */
    if (mq_attend_avx512(j, begin, end, buf)) return;
    if (mq_attend_avx2(j, begin, end, buf)) return;
    static const attend_fn portable[6] = {attend_f32, attend_bf16, attend_f32_int8, attend_bf16_int8,
                                          attend_f32_fp8, attend_bf16_fp8};
    portable[attention_kind(j)](j, begin, end, buf);
}

/* Parts of one call: part n computes tokens bounds[n]..bounds[n + 1] - 1. */
#define MAX_PARTS 256
typedef struct {
    const mqinfer_attention_args *args;
    int64_t bounds[MAX_PARTS + 1];
} attention_call;

static int attention_part(const void *ctx, int part, int num_parts) {
    (void)num_parts;
    const attention_call *call = (const attention_call *)ctx;
    const mqinfer_attention_args *j = call->args;
    const int64_t g = j->num_heads / j->num_kv_heads, D = j->head_dim;
    const int64_t begin = call->bounds[part], end = call->bounds[part + 1];
    float *buf = (float *)malloc(sizeof(float) * (g * j->max_len + 2 * g * D + D + g));
    if (!buf) return -1;
    int status = 0;
    if (mq_amx_attention_usable(j))
        status = mq_attend_with_amx(j, begin, end, attend_per_token, buf);
    else
        attend_per_token(j, begin, end, buf);
    free(buf);
    return status;
}

int mqinfer_paged_attention(const mqinfer_attention_args *args, int num_threads) {
    const int64_t num_tokens = args->num_tokens;
    if (num_tokens <= 0) return 0;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    if (parts > num_tokens) parts = num_tokens;
    attention_call call;
    call.args = args;
    /* Runs of consecutive tokens of about equal work (mq_attention_token_weights). */
    int64_t *weights = (int64_t *)malloc(sizeof(int64_t) * num_tokens);
    if (!weights) return -1;
    mq_attention_token_weights(args, mq_amx_attention_usable(args), weights);
    int64_t total = 0;
    for (int64_t t = 0; t < num_tokens; t++) total += weights[t];
    int64_t t = 0, done = 0;
    call.bounds[0] = 0;
    for (int64_t n = 0; n < parts; n++) {
        const int64_t target = total * (n + 1) / parts;
        while (t < num_tokens && (done < target || n == parts - 1)) { done += weights[t]; t++; }
        call.bounds[n + 1] = t;
    }
    free(weights);
    return mq_parallel(attention_part, &call, (int)parts, num_threads) ? -1 : 0;
}
