/* The AVX2 attention kernel's versions for 8-bit caches (int8, float8 e4m3) with float32 or
   bfloat16 activations: rows converted 8 lanes at a time as they are loaded, the rows' scales
   applied to the scores and the softmax weights, which stay float32 (attention_avx2.c
   dispatches to them). */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "attention_common.h"
#include "attention_avx2.h"

#if defined(__AVX2__) && defined(__FMA__)

#define DEFINE_8BIT_FOR_D_G(DV, GV)                                                                         \
DEFINE_ATTEND_AVX2(attend2_f32_int8_##DV##_##GV, float, int8_t, v8_load_f32, v8_load_int8, v8_store_f32,        \
                   keep_f32, v8_keep_f32, 1, DV, GV)                                                        \
DEFINE_ATTEND_AVX2(attend2_f32_fp8_##DV##_##GV, float, uint8_t, v8_load_f32, v8_load_fp8, v8_store_f32,         \
                   keep_f32, v8_keep_f32, 1, DV, GV)                                                        \
DEFINE_ATTEND_AVX2(attend2_bf16_int8_##DV##_##GV, uint16_t, int8_t, v8_load_bf16, v8_load_int8, v8_store_bf16,  \
                   keep_f32, v8_keep_f32, 1, DV, GV)                                                        \
DEFINE_ATTEND_AVX2(attend2_bf16_fp8_##DV##_##GV, uint16_t, uint8_t, v8_load_bf16, v8_load_fp8, v8_store_bf16,   \
                   keep_f32, v8_keep_f32, 1, DV, GV)
#define DEFINE_8BIT_FOR_G(GV) DEFINE_8BIT_FOR_D_G(64, GV) DEFINE_8BIT_FOR_D_G(128, GV)
DEFINE_8BIT_FOR_G(1)
DEFINE_8BIT_FOR_G(2)
DEFINE_8BIT_FOR_G(3)
DEFINE_8BIT_FOR_G(4)
DEFINE_8BIT_FOR_G(5)
DEFINE_8BIT_FOR_G(6)
DEFINE_8BIT_FOR_G(7)
DEFINE_8BIT_FOR_G(8)

#endif
