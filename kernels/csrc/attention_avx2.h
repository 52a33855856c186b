/* The AVX2 paged attention kernel's building blocks, shared by attention_avx2.c (float32 and
   bfloat16 caches, the dispatch) and attention_avx2_8bit.c (int8 and float8 caches): two
   translation units, so that the library's build compiles them in parallel. See
   attention_avx2.c for how the kernel works. */
#ifndef MQINFER_ATTENTION_AVX2_H
#define MQINFER_ATTENTION_AVX2_H

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "attention_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 v8_load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 v8_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* float_to_bf16 on 8 lanes, in the low 16 bits of each lane. */
static inline __m256i v8_bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
}
static inline void v8_store_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void v8_store_bf16(uint16_t *p, __m256 v) {
    const __m256i b = v8_bf16_bits(v);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
static inline __m256 v8_keep_f32(__m256 v) { return v; }
/* 8 stored values of an 8-bit cache as floats (before their row's scale): int8_to_float and
   fp8e4m3_to_float on 8 lanes, the same exact conversions. */
static inline __m256 v8_load_int8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 v8_load_fp8(const uint8_t *p) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f)), 20);
    const __m256 mag = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}
static inline __m256 v8_round_to_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v8_bf16_bits(v), 16));
}

/* exp_nonpositive on 8 lanes: the scalar version's operations with the same multiply-adds
   fused (FMA is present, so the scalar MUL_ADDs are fused too). */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 inside = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
    const __m256 log2e = _mm256_set1_ps(LOG2E);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)));
    const __m256 f = _mm256_mul_ps(_mm256_fmsub_ps(x, log2e, n), _mm256_set1_ps(LN2));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_set1_ps(EXP_AT_CLAMP), _mm256_mul_ps(p, _mm256_castsi256_ps(bits)), inside);
}

/* The sum of a vector's 8 lanes: lane i plus lane i + 4, then pairs, then the two halves. */
static inline float reduce1_add(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Lane r of the result is reduce1_add(a[r]), the same additions for all 8 at once. */
static inline __m256 reduce8_add(const __m256 *a) {
    __m256 b[4];
    for (int p = 0; p < 4; p++)  /* b[p]: a[2p]'s lane sums i + (i + 4) in lanes 0-3, a[2p + 1]'s in 4-7 */
        b[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    const __m256 c0 = _mm256_hadd_ps(b[0], b[1]), c1 = _mm256_hadd_ps(b[2], b[3]);
    /* lanes of d: the sums of a0, a2, a4, a6, a1, a3, a5, a7 */
    const __m256 d = _mm256_hadd_ps(c0, c1);
    return _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The weighted sum's accumulators: two sets of CW vectors of one query head's output. */
#define CHUNK_VECTORS(G, NV) ((NV) < 4 ? (NV) : 4)

/* T: the activations' type (q, out), TKV: the cache's, VLOADKV its 8-lane load. SCALED (an
   8-bit cache): a score is the dot product with the stored key times the key's scale, and each
   softmax weight is multiplied by its value row's scale before the weighted sum, so the rows
   themselves are only converted, never scaled. */
#define DEFINE_ATTEND_AVX2(NAME, T, TKV, VLOAD, VLOADKV, VSTORE, ROUNDW, ROUNDW8, SCALED, DV, GV) \
void NAME(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf) { \
    enum { D = DV, G = GV, NV = DV / 8, CW = CHUNK_VECTORS(GV, DV / 8) };                        \
    const int64_t hkv = j->num_kv_heads, bs = j->block_size, rs = hkv * D;                     \
    const int64_t row_bytes = rs * (int64_t)sizeof(TKV), head_bytes = D * (int64_t)sizeof(TKV); \
    float *scores = buf;                                                                        \
    const T *q = (const T *)j->q;                                                               \
    const TKV *kc = (const TKV *)j->k_cache, *vc = (const TKV *)j->v_cache;                    \
    T *out = (T *)j->out;                                                                       \
    const __m256 scale = _mm256_set1_ps(j->scale);                                              \
    for (int64_t t = token_begin; t < token_end; t++) {                                         \
        const int64_t len = j->positions[t] + 1;                                                \
        const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;            \
        for (int64_t h = 0; h < hkv; h++) {                                                     \
            __m256 qv[G][NV];                                                                   \
            float inv_sum[G];                                                                   \
            for (int i = 0; i < G; i++)                                                         \
                for (int v = 0; v < NV; v++)                                                    \
                    qv[i][v] = _mm256_mul_ps(VLOAD(q + t * j->q_token_stride + (h * G + i) * D + 8 * v), scale); \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                 \
                const int64_t n = len - first < bs ? len - first : bs;                          \
                const TKV *kb = kc + (table[blk] * bs * hkv + h) * D;                           \
                /* An 8-bit cache's key scales of this block and KV head, one per slot. */     \
                const uint16_t *ksb = SCALED ? j->k_scale + table[blk] * bs * hkv + h : NULL;      \
                /* Prefetching: attention_common.h. */                                         \
                const char *ahead = prefetch_target(j, t, token_end, h, 0, blk, sizeof(TKV));       \
                int64_t o = 0;                                                                  \
                for (; o + 8 <= n; o += 8) {                                                    \
                    const TKV *k8 = kb + o * rs;                                                \
                    if (ahead)                                                                  \
                        for (int r = 0; r < 8; r++) prefetch_row(ahead + (o + r) * row_bytes, head_bytes); \
                    __m256 ks8 = _mm256_setzero_ps();                                           \
                    if (SCALED) {                                                               \
                        const uint16_t *p_ = ksb + o * hkv;                                     \
                        ks8 = _mm256_setr_ps(bf16_to_float(p_[0]), bf16_to_float(p_[hkv]),      \
                                             bf16_to_float(p_[2 * hkv]), bf16_to_float(p_[3 * hkv]), \
                                             bf16_to_float(p_[4 * hkv]), bf16_to_float(p_[5 * hkv]), \
                                             bf16_to_float(p_[6 * hkv]), bf16_to_float(p_[7 * hkv])); \
                    }                                                                           \
                    for (int i = 0; i < G; i++) {                                               \
                        __m256 part[8];                                                         \
                        for (int r = 0; r < 8; r++) part[r] = _mm256_mul_ps(qv[i][0], VLOADKV(k8 + r * rs)); \
                        for (int v = 1; v < NV; v++)                                            \
                            for (int r = 0; r < 8; r++)                                         \
                                part[r] = _mm256_fmadd_ps(qv[i][v], VLOADKV(k8 + r * rs + 8 * v), part[r]); \
                        __m256 s8 = reduce8_add(part);                                          \
                        if (SCALED) s8 = _mm256_mul_ps(s8, ks8);                                \
                        _mm256_storeu_ps(scores + i * len + first + o, s8);                     \
                    }                                                                           \
                }                                                                               \
                for (; o < n; o++) {                                                            \
                    const TKV *k = kb + o * rs;                                                 \
                    if (ahead) prefetch_row(ahead + o * row_bytes, head_bytes);                 \
                    for (int i = 0; i < G; i++) {                                               \
                        __m256 acc = _mm256_mul_ps(qv[i][0], VLOADKV(k));                       \
                        for (int v = 1; v < NV; v++) acc = _mm256_fmadd_ps(qv[i][v], VLOADKV(k + 8 * v), acc); \
                        float s1 = reduce1_add(acc);                                            \
                        if (SCALED) s1 *= bf16_to_float(ksb[o * hkv]);                                         \
                        scores[i * len + first + o] = s1;                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            /* Softmax with the portable version's arithmetic per element; each head's sum in  \
               position order, the G heads' chains interleaved. */                             \
            for (int i = 0; i < G; i++) {                                                       \
                float *s = scores + i * len;                                                    \
                __m256 mv = _mm256_set1_ps(-FLT_MAX);                                           \
                int64_t p = 0;                                                                  \
                for (; p + 8 <= len; p += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + p), mv);    \
                float lanes[8], m = -FLT_MAX;                                                   \
                _mm256_storeu_ps(lanes, mv);                                                    \
                for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;                    \
                for (; p < len; p++) m = s[p] > m ? s[p] : m;                                   \
                const __m256 mb = _mm256_set1_ps(m);                                            \
                for (p = 0; p + 8 <= len; p += 8)                                               \
                    _mm256_storeu_ps(s + p, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + p), mb))); \
                for (; p < len; p++) s[p] = exp_nonpositive(s[p] - m);                         \
            }                                                                                   \
            {                                                                                   \
                float sum[G];                                                                   \
                for (int i = 0; i < G; i++) sum[i] = 0.0f;                                      \
                for (int64_t p = 0; p < len; p++)                                               \
                    for (int i = 0; i < G; i++) sum[i] += scores[i * len + p];                  \
                for (int i = 0; i < G; i++) inv_sum[i] = 1.0f / sum[i];                         \
            }                                                                                   \
            for (int i = 0; i < G; i++) {                                                       \
                float *s = scores + i * len;                                                    \
                int64_t p = 0;                                                                  \
                for (; p + 8 <= len; p += 8) _mm256_storeu_ps(s + p, ROUNDW8(_mm256_loadu_ps(s + p))); \
                for (; p < len; p++) s[p] = ROUNDW(s[p]);                                       \
            }                                                                                   \
            if (SCALED) weights_times_value_scales(j, table, h, G, len, scores);                \
            for (int c = 0; c < NV; c += CW)                                                    \
                for (int i = 0; i < G; i++) {                                                   \
                    /* Even and odd keys in two sets of accumulators: two independent chains  \
                       of multiply-adds per output vector, added at the end. */               \
                    __m256 even[CW], odd[CW];                                                   \
                    for (int v = 0; v < CW; v++) even[v] = odd[v] = _mm256_setzero_ps();        \
                    for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {         \
                        const int64_t n = len - first < bs ? len - first : bs;                  \
                        const TKV *vb = vc + (table[blk] * bs * hkv + h) * D + 8 * c;           \
                        const float *w = scores + i * len + first;                              \
                        /* The first sweep over the values reads them from memory. */          \
                        const char *ahead = c == 0 && i == 0                                    \
                            ? prefetch_target(j, t, token_end, h, 1, blk, sizeof(TKV)) : NULL;  \
                        int64_t o = 0;                                                          \
                        for (; o + 2 <= n; o += 2) {                                            \
                            if (ahead) {                                                        \
                                prefetch_row(ahead + o * row_bytes, head_bytes);                \
                                prefetch_row(ahead + (o + 1) * row_bytes, head_bytes);          \
                            }                                                                   \
                            const __m256 w0 = _mm256_broadcast_ss(w + o), w1 = _mm256_broadcast_ss(w + o + 1); \
                            for (int v = 0; v < CW; v++) {                                      \
                                even[v] = _mm256_fmadd_ps(w0, VLOADKV(vb + o * rs + 8 * v), even[v]); \
                                odd[v] = _mm256_fmadd_ps(w1, VLOADKV(vb + (o + 1) * rs + 8 * v), odd[v]); \
                            }                                                                   \
                        }                                                                       \
                        if (o < n) {                                                            \
                            const __m256 w0 = _mm256_broadcast_ss(w + o);                       \
                            for (int v = 0; v < CW; v++)                                        \
                                even[v] = _mm256_fmadd_ps(w0, VLOADKV(vb + o * rs + 8 * v), even[v]); \
                        }                                                                       \
                    }                                                                           \
                    const __m256 inv = _mm256_set1_ps(inv_sum[i]);                              \
                    for (int v = 0; v < CW; v++)                                                \
                        VSTORE(out + (t * j->num_heads + h * G + i) * D + 8 * (c + v),          \
                               _mm256_mul_ps(_mm256_add_ps(even[v], odd[v]), inv));             \
                }                                                                               \
        }                                                                                       \
    }                                                                                           \
}

#define ATTEND_AVX2_ARGS const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf
#define DECLARE_8BIT_FOR_D_G(DV, GV)                                                              \
    void attend2_f32_int8_##DV##_##GV(ATTEND_AVX2_ARGS); void attend2_f32_fp8_##DV##_##GV(ATTEND_AVX2_ARGS); \
    void attend2_bf16_int8_##DV##_##GV(ATTEND_AVX2_ARGS); void attend2_bf16_fp8_##DV##_##GV(ATTEND_AVX2_ARGS);
#define DECLARE_8BIT_FOR_G(GV) DECLARE_8BIT_FOR_D_G(64, GV) DECLARE_8BIT_FOR_D_G(128, GV)
DECLARE_8BIT_FOR_G(1) DECLARE_8BIT_FOR_G(2) DECLARE_8BIT_FOR_G(3) DECLARE_8BIT_FOR_G(4)
DECLARE_8BIT_FOR_G(5) DECLARE_8BIT_FOR_G(6) DECLARE_8BIT_FOR_G(7) DECLARE_8BIT_FOR_G(8)

#endif
#endif
