/* Dense layers with int8 weights and float32 activations (w8a16) on CPUs with AVX2 and FMA but
   no AVX-512: out = x (W_q * w_scale)^T (+ bias), float32 in and out.

   Why. A decode step of a few rows reads every weight once and does two flops per weight, so
   the float32 kernel (linear.c) waits on memory there: int8 weights are a quarter of its
   bytes. Dequantizing the whole weight before a float matmul (PyTorch's path) writes and
   reads the float32 weight anyway, and is slower than float32.

   How. The weight is packed in the float32 kernel's panel order, one byte per weight: panels of
   16 output features, [K][16] bytes (for SwiGLU 8 gate then the same 8 up features), and goes
   through the float32 kernel's panel loop and register tiles (mq_dense_part, dense_panels.h)
   in one of two ways. Up to DIRECT_ROWS rows, tiles that widen each step's 16 bytes to
   float32 and multiply them by their features' scales in the register loop. Above, each panel
   is widened and scaled once per block of rows into a per-thread scratch panel (K x 64
   bytes: L1 or L2 resident) that the float32 tiles then read from cache.

   Numerics. The weight the tiles see is (float)q * scale, one rounding, which is exactly
   PyTorch's qweight.float() * scale[:, None]; every output is then the float32 kernel's chain
   of fused multiply-adds over it, so the result is bit for bit that of mqinfer_linear on the
   dequantized weight (bias, SwiGLU and thread count included). */
#include <stdint.h>
#include <stdlib.h>

#include "mqinfer_native.h"
#include "native_common.h"

#define PANEL 16

static int64_t panel_width(int swiglu) { return swiglu ? PANEL / 2 : PANEL; }

int64_t mqinfer_w8a16_packed_size(int64_t out_features, int64_t in_features, int swiglu) {
    const int64_t width = panel_width(swiglu);
    return (out_features + width - 1) / width * PANEL * in_features;
}

void mqinfer_w8a16_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                        int8_t *packed) {
    const int64_t width = panel_width(swiglu), panels = (out_features + width - 1) / width;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < in_features; k++)
            for (int64_t c = 0; c < PANEL; c++) {
                /* Panel column c is output feature n; for SwiGLU columns 0-7 are gate rows and
                   8-15 the up rows of the same features. */
                const int64_t n = p * width + (swiglu ? c % width : c);
                const int64_t row = swiglu && c >= width ? out_features + n : n;
                packed[(p * in_features + k) * PANEL + c] = n < out_features ? weight[row * in_features + k] : 0;
            }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include "dense_panels.h"

int mqinfer_w8a16_available(void) { return 1; }

/* 16 int8 weights widened to float32 and multiplied by their features' scales: (float)q * s,
   one rounding. */
static inline void widen(const int8_t *q, __m256 s0, __m256 s1, __m256 *w0, __m256 *w1) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s0);
    *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), s1);
}

/* Tiles that widen the int8 panel themselves, step by step: for calls of a few rows, where a
   scratch panel would be written once and read once or twice. */
#define I8_SETUP                                                                                  \
    const int8_t *panel = (const int8_t *)panel_data;                                             \
    const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
#define I8_WEIGHTS(k, w0, w1) widen(panel + (k) * PANEL, s0, s1, &w0, &w1);
MQ_DEFINE_DENSE_TILE(i8_tile_1, 1, I8_SETUP, I8_WEIGHTS)
MQ_DEFINE_DENSE_TILE(i8_tile_2, 2, I8_SETUP, I8_WEIGHTS)
MQ_DEFINE_DENSE_TILE(i8_tile_3, 3, I8_SETUP, I8_WEIGHTS)
MQ_DEFINE_DENSE_TILE(i8_tile_4, 4, I8_SETUP, I8_WEIGHTS)
MQ_DEFINE_DENSE_TILE(i8_tile_5, 5, I8_SETUP, I8_WEIGHTS)
MQ_DEFINE_DENSE_TILE(i8_tile_6, 6, I8_SETUP, I8_WEIGHTS)

static const mq_tile_fn i8_tiles[MQ_DENSE_TILE_ROWS + 1] = {
    NULL, i8_tile_1, i8_tile_2, i8_tile_3, i8_tile_4, i8_tile_5, i8_tile_6,
};

typedef struct {
    const int8_t *packed;
    const float *scales;
    int64_t K;
    float *scratch;  /* [K][16] floats, this part's own */
} panel_state;

/* Panel p widened to float32 and scaled into the scratch panel, for the float32 tiles. */
static const void *dequantize_panel(void *ctx, int64_t p) {
    const panel_state *s = (const panel_state *)ctx;
    const int8_t *q = s->packed + p * s->K * PANEL;
    const __m256 s0 = _mm256_loadu_ps(s->scales + p * PANEL), s1 = _mm256_loadu_ps(s->scales + p * PANEL + 8);
    float *w = s->scratch;
    for (int64_t k = 0; k < s->K; k++) {
        __m256 w0, w1;
        widen(q + k * PANEL, s0, s1, &w0, &w1);
        _mm256_store_ps(w + k * PANEL, w0);
        _mm256_store_ps(w + k * PANEL + 8, w1);
    }
    return w;
}

/* The int8 panel itself, for the widening tiles. */
static const void *int8_panel(void *ctx, int64_t p) {
    const panel_state *s = (const panel_state *)ctx;
    return s->packed + p * s->K * PANEL;
}

/* Up to this many rows a call goes through the widening tiles (at most two tiles per panel):
   the int8 stream from memory overlaps the arithmetic, and at 1-4 rows this runs about twice
   the scratch panel's rate (measured on an AVX2 EPYC, one thread); from 16 rows on the scratch
   panel, widened once per block of rows, is as fast or faster. */
#define DIRECT_ROWS (2 * MQ_DENSE_TILE_ROWS)

static int w8a16_part(const void *ctx, int part, int num_parts) {
    const mqinfer_w8a16_args *a = (const mqinfer_w8a16_args *)ctx;
    const int64_t K = a->in_features;
    panel_state state = {(const int8_t *)a->packed, (const float *)a->scales, K, NULL};
    /* The float32 kernel's arguments; its panels come from dequantize_panel or int8_panel. The
       bias is in panel order, zero-padded to whole panels, which is where mq_dense_part reads
       it. */
    const mqinfer_linear_args dense = {
        .x = a->x, .packed = NULL, .bias = a->bias, .out = a->out, .rows = a->rows,
        .in_features = K, .out_features = a->out_features, .x_stride = a->x_stride,
        .out_stride = a->out_stride, .swiglu = a->swiglu, .vector_chunk = a->vector_chunk,
    };
    if (a->rows <= DIRECT_ROWS)
        return mq_dense_part(&dense, part, num_parts, i8_tiles, int8_panel, &state, state.scales);
    /* 64-byte aligned, so each step of the scratch panel is one cache line. */
    state.scratch = (float *)aligned_alloc(64, (size_t)(K > 0 ? K : 1) * PANEL * sizeof(float));
    if (!state.scratch) return -1;
    const int status = mq_dense_part(&dense, part, num_parts, mq_dense_f32_tiles, dequantize_panel, &state, NULL);
    free(state.scratch);
    return status;
}

int mqinfer_w8a16(const mqinfer_w8a16_args *args, int num_threads) {
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    const int64_t width = panel_width(args->swiglu != 0);
    const int64_t panels = (args->out_features + width - 1) / width;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > panels) parts = panels;
    return mq_parallel(w8a16_part, args, (int)parts, num_threads) ? -1 : 0;
}

#else

/* Without AVX2 and FMA, or with AVX-512, the callers use the PyTorch path. */
int mqinfer_w8a16_available(void) { return 0; }

int mqinfer_w8a16(const mqinfer_w8a16_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
