/* The epilogue shared by the two w8a8 kernels on AVX-512 (linear_int8.c's VNNI kernel and
   linear_amx_int8.c's AMX one): loading a row to quantize, PyTorch's rounding to bfloat16, and
   the store of a row's 16 int32 sums of a panel, scaled as the reference does, then plain or
   SwiGLU, float32 or bfloat16. Both kernels store through it, so their outputs share their bits. */
#ifndef MQINFER_INT8_EPILOGUE_H
#define MQINFER_INT8_EPILOGUE_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "dense_store.h"

/* Lanes m of x[k..k+15] (float32, or bfloat16 widened exactly), zero elsewhere. */
static inline __m512 load_row16(const void *x, int64_t k, __mmask16 m, int is_bf16) {
    if (!is_bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}


static inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* bfloat16 as PyTorch rounds float32 to it (nearest even; NaN to the quiet NaN 0x7fc0), in the
   low 16 bits of each lane; and that value back as float32. */
static inline __m512i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
static inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
static inline uint16_t bf16_of(float f) {
    return (uint16_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(bf16_bits(_mm512_set1_ps(f))));
}
static inline float bf16_round(float f) { return _mm512_cvtss_f32(round_bf16(_mm512_set1_ps(f))); }

/* silu of every bfloat16 gate value, as mqinfer_silu_mul's vector body computes it (the
   vectorised exponential, the division, rounded to bfloat16), indexed by the gate's 16 bits and
   held as bfloat16 bits: a gate is a bfloat16 value, so the SwiGLU epilogue looks its silu up
   instead of computing an exponential and a division per value, with the same bits. One gather
   reads 8 lanes of 32 bits at byte offset 2 x index, whose low half is the entry (hence one
   entry of padding at the end). 128 KiB, one table for both kernels (defined in linear_int8.c),
   filled by mq_silu_bf16_ready() before a bfloat16 SwiGLU call reads it. */
extern uint16_t mq_silu_bf16_table[(1 << 16) + 1];
void mq_silu_bf16_ready(void);

/* SwiGLU into bfloat16, bit for bit the projection rounded to bfloat16 followed by
   mqinfer_silu_mul on it: gate and up rounded, silu(gate) rounded (the table), the product
   rounded. */
static inline void store_swiglu_bf16(uint16_t *o, __m512 f, int mode) {
    if (mode == STORE_SWIGLU) {
        const __m512i bits16 = bf16_bits(f);
        const __m256 u = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm512_extracti64x4_epi64(bits16, 1), 16));
        const __m256 sl = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_i32gather_epi32(
            (const int *)mq_silu_bf16_table, _mm512_castsi512_si256(bits16), 2), 16));
        const __m512i bits = bf16_bits(_mm512_castps256_ps512(_mm256_mul_ps(sl, u)));
        _mm_storeu_si128((__m128i *)o, _mm256_cvtepi32_epi16(_mm512_castsi512_si256(bits)));
    } else {
        const __m512 r = round_bf16(f);
        const __m256 g = _mm512_castps512_ps256(r), u = high_half(r);
        float gs[8], us[8];
        _mm256_storeu_ps(gs, g);
        _mm256_storeu_ps(us, u);
        for (int i = 0; i < 8; i++) o[i] = bf16_of(bf16_round(gs[i] / (1.0f + expf(-gs[i]))) * us[i]);
    }
}


/* A row's 16 int32 sums of one panel to o: scaled as the reference does (sum x row scale x
   column scale, plus the bias), then plain or SwiGLU (dense_store.h), float32 or bfloat16. */
static inline void store_int32_sums(void *o, int out_bf16, __m512i sums, float row_scale, const float *scales,
                                    const float *bias, int mode) {
    __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(row_scale)),
                             _mm512_loadu_ps(scales));
    if (bias) f = _mm512_add_ps(f, _mm512_loadu_ps(bias));
    if (out_bf16) {
        if (mode == STORE_PLAIN) _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(bf16_bits(f)));
        else store_swiglu_bf16((uint16_t *)o, f, mode);
    } else if (mode == STORE_PLAIN) {
        _mm512_storeu_ps((float *)o, f);
    } else {
        store_row((float *)o, _mm512_castps512_ps256(f), high_half(f), mode);
    }
}

#endif
#endif
