/* The exponential of PyTorch's vectorised SiLU, one value at a time and (with AVX2 and FMA, or
   AVX-512) 8 or 16 at a time, the same operations in the same order: shared by the SwiGLU
   kernel (cpu_ops.c) and the dense kernel's fused SwiGLU (linear.c), so both agree with F.silu
   bit for bit. Not exported. */
#ifndef MQINFER_SILU_EXP_H
#define MQINFER_SILU_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x as PyTorch's vectorised SiLU computes it (SLEEF's expf_u10: reduction by ln 2 in two
   fused multiply-adds, a degree-6 polynomial in fused multiply-adds, scaling by 2^q in two
   halves), so that silu agrees with F.silu bit for bit. */
static inline float pow2i_f32(int32_t q) {
    const uint32_t bits = (uint32_t)(q + 127) << 23; float f; memcpy(&f, &bits, 4); return f;
}
static inline float exp_f32(float d) {
    const float x = d < -104.0f ? -104.0f : (d > 104.0f ? 104.0f : d);
    const float q = rintf(x * 1.442695040888963407359924681001892137f);
    float s = fmaf(q, -0.693145751953125f, x);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int32_t qi = (int32_t)q, half = qi >> 1;
    u = u * pow2i_f32(half) * pow2i_f32(qi - half);
    if (d < -104.0f) u = 0.0f;
    if (d > 104.0f) u = INFINITY;
    return u;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_f32 on 8 lanes. */
static inline __m256 pow2i_f32x8(__m256i q) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(127)), 23));
}
static inline __m256 exp_f32x8(__m256 d) {
    const __m256 lo = _mm256_set1_ps(-104.0f), hi = _mm256_set1_ps(104.0f);
    const __m256 under = _mm256_cmp_ps(d, lo, _CMP_LT_OQ);
    const __m256 over = _mm256_cmp_ps(d, hi, _CMP_GT_OQ);
    const __m256 x = _mm256_blendv_ps(_mm256_blendv_ps(d, lo, under), hi, over);
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.442695040888963407359924681001892137f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 s = _mm256_fmadd_ps(q, _mm256_set1_ps(-0.693145751953125f), x);
    s = _mm256_fmadd_ps(q, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i qi = _mm256_cvtps_epi32(q), half = _mm256_srai_epi32(qi, 1);
    u = _mm256_mul_ps(_mm256_mul_ps(u, pow2i_f32x8(half)), pow2i_f32x8(_mm256_sub_epi32(qi, half)));
    u = _mm256_blendv_ps(u, _mm256_setzero_ps(), under);
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), over);
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>

/* exp_f32 on 16 lanes. */
static inline __m512 pow2i_f32x16(__m512i q) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 23));
}
static inline __m512 exp_f32x16(__m512 d) {
    const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(104.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(d, lo, _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(d, hi, _CMP_GT_OQ);
    const __m512 x = _mm512_mask_mov_ps(_mm512_mask_mov_ps(d, under, lo), over, hi);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963407359924681001892137f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), x);
    s = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i qi = _mm512_cvtps_epi32(q), half = _mm512_srai_epi32(qi, 1);
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i_f32x16(half)), pow2i_f32x16(_mm512_sub_epi32(qi, half)));
    u = _mm512_mask_mov_ps(u, under, _mm512_setzero_ps());
    return _mm512_mask_mov_ps(u, over, _mm512_set1_ps(INFINITY));
}
#endif

#endif
