/* How a dense kernel's tile writes one row of 16 float32 sums (linear.c, linear_int8.c): as
   they are (16 outputs), or as SwiGLU's 8 outputs silu(gate) * up with the vectorised
   exponential, or with std::exp (for the columns where PyTorch's SiLU uses it: past the last
   whole vector_chunk of a row). Shared so that the float32 and the int8 kernels round SwiGLU
   the same way as mqinfer_silu_mul. For sources built for AVX2 (or AVX-512, which has it). */
#ifndef MQINFER_DENSE_STORE_H
#define MQINFER_DENSE_STORE_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

#include "silu_exp.h"

enum { STORE_PLAIN, STORE_SWIGLU, STORE_SWIGLU_TAIL };

static inline void store_row(float *o, __m256 g, __m256 u, int mode) {
    if (mode == STORE_PLAIN) {
        _mm256_storeu_ps(o, g);
        _mm256_storeu_ps(o + 8, u);
    } else if (mode == STORE_SWIGLU) {
        const __m256 e = exp_f32x8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u));
    } else {
        float gs[8], us[8];
        _mm256_storeu_ps(gs, g);
        _mm256_storeu_ps(us, u);
        for (int i = 0; i < 8; i++) o[i] = gs[i] / (1.0f + expf(-gs[i])) * us[i];
    }
}

#endif
#endif
