/* Paged attention on CPU: reads the paged KV cache in place, one (query token, KV head) at a
   time, with no gather, no padding and float32 accumulation; the KV head's g query heads share
   every K/V row it loads. AVX-512 versions for the common head shapes (64 or 128 wide, 3 or 4
   query heads per KV head, as in SmolLM2 and the Llama 3 family), AVX2 versions
   (attention_avx2.c) for heads 64 or 128 wide with 1 to 8 query heads per KV head, the
   portable loops for every other shape and CPU. 8-bit caches (int8, float8 e4m3, with a
   bfloat16 scale per row) are read with float32 or bfloat16 activations and float32
   arithmetic: int8 ones by the AVX-512 versions where the shape has one, the rest by the AVX2
   versions and the portable loops.

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
/* Hand-vectorised versions for the common head shapes: one K/V row is D/16 registers, the
   q rows and the output accumulators of the G query heads stay in registers for the whole
   context. */
/* The horizontal sums of 16 vectors at once: lane r of the result is a[r]'s lanes added in
   exactly the tree _mm512_reduce_add_ps uses (256-bit halves, then 128-bit quarters, then
   pairs {0,1}+{2,3}, then the last two), so scores are bit for bit those of the one-at-a-time
   reduction, at two shuffles per addition instead of a dependent chain per score. */
static inline __m512 reduce16_add_ps(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int p = 0; p < 4; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int p = 0; p < 2; p++)
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* e's lane 4k + m holds the sum of a[4m + k]. */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

#define DEFINE_ATTEND_AVX512(NAME, T, TKV, VLOAD, VLOADKV, VSTORE, ROUNDW, ROUNDW16, SCALED, DV, GV)       \
static void NAME(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) { \
    float inv_sum[GV];                                                                            \
    enum { D = DV, G = GV, NV = DV / 16 };                                                        \
    const int64_t hkv = j->num_kv_heads, bs = j->block_size;                                      \
    float *scores = buf;                                                                          \
    const T *q = (const T *)j->q;                                                                 \
    const TKV *kc = (const TKV *)j->k_cache, *vc = (const TKV *)j->v_cache;                      \
    T *out = (T *)j->out;                                                                         \
    const __m512 scale = _mm512_set1_ps(j->scale);                                                \
    for (int64_t t = token_begin; t < token_end; t++) {                                           \
        const int64_t len = j->positions[t] + 1;                                                  \
        const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;              \
        for (int64_t h = 0; h < hkv; h++) {                                                       \
            __m512 qv[G][NV];                                                                     \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++)                                                      \
                    qv[i][v] = _mm512_mul_ps(VLOAD(q + t * j->q_token_stride + (h * G + i) * D + 16 * v), scale); \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const TKV *kb = kc + (table[blk] * bs * hkv + h) * D;                             \
                /* An 8-bit cache's key scales of this block and KV head, one per slot. */   \
                const uint16_t *ksb = SCALED ? j->k_scale + table[blk] * bs * hkv + h : NULL;    \
                const char *ahead = prefetch_target(j, t, token_end, h, 0, blk, sizeof(TKV));      \
                const int64_t row_bytes = hkv * D * sizeof(TKV), head_bytes = D * sizeof(TKV);      \
                int64_t o = 0;                                                                    \
                for (; o + 16 <= n; o += 16) {                                                    \
                    /* 16 keys at a time: their partial dot products are summed across lanes  \
                       together (reduce16_add_ps), the same additions as 16 reduce_add_ps. */ \
                    __m512 part[G][16];                                                           \
                    for (int r = 0; r < 16; r++) {                                                \
                        if (ahead) prefetch_row(ahead + (o + r) * row_bytes, head_bytes);         \
                        __m512 kv[NV];                                                            \
                        for (int v = 0; v < NV; v++) kv[v] = VLOADKV(kb + (o + r) * hkv * D + 16 * v); \
                        for (int i = 0; i < G; i++) {                                             \
                            __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);                          \
                            for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[i][v], kv[v], acc); \
                            part[i][r] = acc;                                                     \
                        }                                                                         \
                    }                                                                             \
                    __m512 ks16 = _mm512_setzero_ps();                                            \
                    if (SCALED) {  /* the 16 keys' scales */                                      \
                        float ks[16];                                                             \
                        for (int r = 0; r < 16; r++) ks[r] = bf16_to_float(ksb[(o + r) * hkv]);   \
                        ks16 = _mm512_loadu_ps(ks);                                               \
                    }                                                                             \
                    for (int i = 0; i < G; i++)                                                   \
                        _mm512_storeu_ps(scores + i * len + first + o,                            \
                                         SCALED ? _mm512_mul_ps(reduce16_add_ps(part[i]), ks16)   \
                                                : reduce16_add_ps(part[i]));                      \
                }                                                                                 \
                for (; o < n; o++) {                                                              \
                    if (ahead) prefetch_row(ahead + o * row_bytes, head_bytes);                   \
                    __m512 kv[NV];                                                                \
                    for (int v = 0; v < NV; v++) kv[v] = VLOADKV(kb + o * hkv * D + 16 * v);      \
                    for (int i = 0; i < G; i++) {                                                 \
                        __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);                              \
                        for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[i][v], kv[v], acc); \
                        const float s1 = _mm512_reduce_add_ps(acc);                               \
                        scores[i * len + first + o] = SCALED ? s1 * bf16_to_float(ksb[o * hkv]) : s1; \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            /* Softmax with the portable version's arithmetic: the max and the exponentials \
               16 at a time (the same operations per element), each head's sum still added  \
               in position order, the G heads' sums interleaved so their chains overlap. */  \
            for (int i = 0; i < G; i++) {                                                         \
                float *s = scores + i * len;                                                      \
                __m512 mv = _mm512_set1_ps(-FLT_MAX);                                             \
                int64_t p = 0;                                                                    \
                for (; p + 16 <= len; p += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + p), mv);    \
                float m = _mm512_reduce_max_ps(mv);                                               \
                for (; p < len; p++) m = s[p] > m ? s[p] : m;                                     \
                const __m512 mb = _mm512_set1_ps(m);                                              \
                for (p = 0; p + 16 <= len; p += 16)                                               \
                    _mm512_storeu_ps(s + p, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mb))); \
                for (; p < len; p++) s[p] = exp_nonpositive(s[p] - m);                           \
            }                                                                                     \
            {                                                                                     \
                float sum[G];                                                                     \
                for (int i = 0; i < G; i++) sum[i] = 0.0f;                                        \
                for (int64_t p = 0; p < len; p++)                                                 \
                    for (int i = 0; i < G; i++) sum[i] += scores[i * len + p];                    \
                for (int i = 0; i < G; i++) inv_sum[i] = 1.0f / sum[i];                           \
            }                                                                                     \
            for (int i = 0; i < G; i++) {                                                         \
                float *s = scores + i * len;                                                      \
                int64_t p = 0;                                                                    \
                for (; p + 16 <= len; p += 16) _mm512_storeu_ps(s + p, ROUNDW16(_mm512_loadu_ps(s + p))); \
                for (; p < len; p++) s[p] = ROUNDW(s[p]);                                         \
            }                                                                                     \
            if (SCALED) weights_times_value_scales(j, table, h, G, len, scores);                  \
            __m512 acc[G][NV];                                                                    \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();                     \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const TKV *vb = vc + (table[blk] * bs * hkv + h) * D;                             \
                const char *ahead = prefetch_target(j, t, token_end, h, 1, blk, sizeof(TKV));      \
                const int64_t row_bytes = hkv * D * sizeof(TKV), head_bytes = D * sizeof(TKV);      \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    if (ahead) prefetch_row(ahead + o * row_bytes, head_bytes);                   \
                    __m512 vv[NV];                                                                \
                    for (int v = 0; v < NV; v++) vv[v] = VLOADKV(vb + o * hkv * D + 16 * v);      \
                    for (int i = 0; i < G; i++) {                                                 \
                        const __m512 w = _mm512_set1_ps(scores[i * len + first + o]);            \
                        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(w, vv[v], acc[i][v]); \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++)                                                      \
                    VSTORE(out + (t * j->num_heads + h * G + i) * D + 16 * v,                     \
                           _mm512_mul_ps(acc[i][v], _mm512_set1_ps(inv_sum[i])));                 \
        }                                                                                         \
    }                                                                                             \
}
/* Each shape's four versions: float32 or bfloat16 activations over a cache of their own type,
   then over an int8 cache. */
#define DEFINE_AVX512_FOR(DV, GV)                                                                 \
DEFINE_ATTEND_AVX512(attend_f32_##DV##_##GV, float, float, vload_f32, vload_f32, vstore_f32, keep_f32,   \
                     keep_f32x16, 0, DV, GV)                                                      \
DEFINE_ATTEND_AVX512(attend_bf16_##DV##_##GV, uint16_t, uint16_t, vload_bf16, vload_bf16, vstore_bf16,  \
                     round_to_bf16, round_to_bf16x16, 0, DV, GV)                                  \
DEFINE_ATTEND_AVX512(attend_f32_int8_##DV##_##GV, float, int8_t, vload_f32, vload_int8, vstore_f32,     \
                     keep_f32, keep_f32x16, 1, DV, GV)                                            \
DEFINE_ATTEND_AVX512(attend_bf16_int8_##DV##_##GV, uint16_t, int8_t, vload_bf16, vload_int8, vstore_bf16, \
                     keep_f32, keep_f32x16, 1, DV, GV)
DEFINE_AVX512_FOR(64, 3)
DEFINE_AVX512_FOR(64, 4)
DEFINE_AVX512_FOR(128, 3)
DEFINE_AVX512_FOR(128, 4)
#define AVX512_KINDS(DV, GV) \
    {attend_f32_##DV##_##GV, attend_bf16_##DV##_##GV, attend_f32_int8_##DV##_##GV, attend_bf16_int8_##DV##_##GV}
/* [g == 4][head_dim == 128][attention_kind]: kinds 0 to 3 (no float8 caches). */
static const attend_fn avx512_versions[2][2][4] = {
    {AVX512_KINDS(64, 3), AVX512_KINDS(128, 3)},
    {AVX512_KINDS(64, 4), AVX512_KINDS(128, 4)},
};
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
    const int64_t g = j->num_heads / j->num_kv_heads, D = j->head_dim;
    (void)g; (void)D;
#ifdef HAVE_SPECIALISED
    /* The AVX-512 versions read caches in the activations' type or int8 caches; float8 caches
       go to the AVX2 versions (every AVX-512 CPU has AVX2 and FMA) or the portable loops. */
    const int kind = attention_kind(j);
    if (kind < 4 && (D == 64 || D == 128) && (g == 3 || g == 4)) {
        avx512_versions[g == 4][D == 128][kind](j, begin, end, buf);
        return;
    }
#endif
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
    const int64_t num_tokens = args->num_tokens, *positions = args->positions;
    if (num_tokens <= 0) return 0;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    if (parts > num_tokens) parts = num_tokens;
    attention_call call;
    call.args = args;
    /* Runs of consecutive tokens of about equal work, a token weighing its context plus a
       fixed cost. */
    int64_t total = 0;
    for (int64_t t = 0; t < num_tokens; t++) total += positions[t] + 8;
    int64_t t = 0, done = 0;
    call.bounds[0] = 0;
    for (int64_t n = 0; n < parts; n++) {
        const int64_t target = total * (n + 1) / parts;
        while (t < num_tokens && (done < target || n == parts - 1)) { done += positions[t] + 8; t++; }
        call.bounds[n + 1] = t;
    }
    return mq_parallel(attention_part, &call, (int)parts, num_threads) ? -1 : 0;
}
