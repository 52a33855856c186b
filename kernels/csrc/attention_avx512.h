/* AVX-512 pieces shared by the attention kernel's vectorised versions (paged_attention.c) and
   its AMX tiles (attention_amx.c), not exported: bfloat16 and int8 rows as float32 lanes, bfloat16
   stores and rounding, and the softmax's exponential 16 lanes at a time. */
#ifndef MQINFER_ATTENTION_AVX512_H
#define MQINFER_ATTENTION_AVX512_H

#if defined(__AVX512F__)
#include <immintrin.h>

#include "attention_common.h"

static inline __m512 vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
/* 16 int8 values of an 8-bit cache row as floats (its scale applies later). */
static inline __m512 vload_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void vstore_bf16(uint16_t *p, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
static inline void vstore_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 keep_f32x16(__m512 v) { return v; }
/* round_to_bf16 on 16 lanes, the same integer arithmetic. */
static inline __m512 round_to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(u, 16), 16));
}
/* exp_nonpositive on 16 lanes: the scalar version's operations with the same multiply-adds
   fused (x * log2e + 0.5, x * log2e - n and each polynomial step; AVX-512 implies FMA, so
   the scalar MUL_ADDs are fused too), hence the same bits (mqinfer_attention_selftest lets
   the tests check it). */
static inline __m512 exp_nonpositive16(__m512 x) {
    /* At and below the clamp (and for NaN): the scalar version's constant. */
    const __mmask16 inside = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    const __m512 at_clamp = _mm512_set1_ps(EXP_AT_CLAMP);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_fmsub_ps(x, log2e, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_mov_ps(at_clamp, inside, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

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

#endif
#endif
