/* The AVX-512 versions of the paged attention kernel (see paged_attention.c for the contract), as
   a macro that attention_avx512.c (1 to 4 query heads per KV head) and attention_avx512_wide.c (5
   to 8) instantiate for heads 64 and 128 wide: two sources, so that the build compiles them at
   the same time. Not exported.

   One (token, KV head) at a time: one K/V row is D/16 registers, the q rows and the output
   accumulators of the G query heads stay in registers (or, for the widest groups, in L1) for the
   whole context. Scores are taken 16 keys at a time and summed across lanes together
   (reduce16_add_ps), the same additions as one key at a time; the softmax has the portable
   version's arithmetic; the weighted sum of V rows is one multiply-add per element. */
#ifndef MQINFER_ATTENTION_AVX512_VERSIONS_H
#define MQINFER_ATTENTION_AVX512_VERSIONS_H

#if defined(__AVX512F__)
#include <float.h>

#include "attention_avx512.h"

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
#define AVX512_KINDS(DV, GV) \
    {attend_f32_##DV##_##GV, attend_bf16_##DV##_##GV, attend_f32_int8_##DV##_##GV, attend_bf16_int8_##DV##_##GV}
/* The versions for G query heads per KV head, [head_dim == 128][attention_kind], kinds 0 to 3. */
#define AVX512_ROW(GV) {AVX512_KINDS(64, GV), AVX512_KINDS(128, GV)}

#endif
#endif
