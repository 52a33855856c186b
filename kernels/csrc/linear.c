/* Dense layers in float32 on CPUs with AVX2 and FMA but no AVX-512: out = x W^T (+ bias), with
   W packed once, at load, into panels of 16 output features (panel p holds features
   16p..16p+15, feature-minor: [K][16], zero-padded past the last feature).

   Why. On one AVX2 core MKL's sgemm reaches about 75 GFLOP/s on the model's prefill shapes but
   50-60 on decode steps (64 rows) and on the LM head: it packs the weight operand again on
   every call, reading it cold from memory. A packed panel is one sequential stream, and the
   6 x 16 register tile (dense_panels.h: 12 accumulators, two panel loads and six broadcasts per step of
   K) keeps both FMA units busy: 70-80 GFLOP/s at 64 rows and as fast as MKL at 4096.

   Numerics. Every output is one chain of fused multiply-adds over k = 0..K-1 in order,
   starting from zero, then the bias added (one rounding): the result of a row does not depend
   on the other rows of the call, on where the row falls in a tile, or on the thread count. It
   is not MKL's summation order, so results differ from torch's in the last bits (the tests
   hold them to a tolerance).

   With swiglu set, the weight is SwiGLU's fused gate/up projection packed by
   mqinfer_linear_pack_swiglu and the output is silu(gate) * up, computed from the tile's
   registers (the same bits as the projection followed by mqinfer_silu_mul).

   Work is split across threads by panels (each thread streams its own share of the weights);
   rows go in blocks sized so that a block of x stays in the L2 cache while the panels stream
   past it. */
#include <stdint.h>
#include <string.h>

#include "mqinfer_native.h"
#include "native_common.h"
#include "dense_store.h"
#include "dense_panels.h"

#define PANEL MQ_DENSE_PANEL
#define TILE_ROWS MQ_DENSE_TILE_ROWS

int64_t mqinfer_linear_packed_size(int64_t out_features, int64_t in_features) {
    return (out_features + PANEL - 1) / PANEL * PANEL * in_features;
}

void mqinfer_linear_pack(const float *weight, int64_t out_features, int64_t in_features, float *packed) {
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < in_features; k++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t n = p * PANEL + c;
                packed[(p * in_features + k) * PANEL + c] = n < out_features ? weight[n * in_features + k] : 0.0f;
            }
}

/* The fused gate/up weight [2 * inter, K] (gate rows first) for SwiGLU: panel p holds gate
   features 8p..8p+7 then up features 8p..8p+7, so one tile has both halves of 8 outputs. */
int64_t mqinfer_linear_swiglu_packed_size(int64_t inter, int64_t in_features) {
    return (inter + PANEL / 2 - 1) / (PANEL / 2) * PANEL * in_features;
}

void mqinfer_linear_pack_swiglu(const float *weight, int64_t inter, int64_t in_features, float *packed) {
    const int64_t half = PANEL / 2, panels = (inter + half - 1) / half;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < in_features; k++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t n = p * half + c % half, row = c < half ? n : inter + n;
                packed[(p * in_features + k) * PANEL + c] = n < inter ? weight[row * in_features + k] : 0.0f;
            }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

int mqinfer_linear_available(void) { return 1; }

/* The float32 tiles: the panel is float32 [K][16], read as it is. */
#define F32_SETUP const float *panel = (const float *)panel_data; (void)scales;
#define F32_WEIGHTS(k, w0, w1) \
    w0 = _mm256_loadu_ps(panel + (k) * PANEL); w1 = _mm256_loadu_ps(panel + (k) * PANEL + 8);
MQ_DEFINE_DENSE_TILE(tile_1, 1, F32_SETUP, F32_WEIGHTS)
MQ_DEFINE_DENSE_TILE(tile_2, 2, F32_SETUP, F32_WEIGHTS)
MQ_DEFINE_DENSE_TILE(tile_3, 3, F32_SETUP, F32_WEIGHTS)
MQ_DEFINE_DENSE_TILE(tile_4, 4, F32_SETUP, F32_WEIGHTS)
MQ_DEFINE_DENSE_TILE(tile_5, 5, F32_SETUP, F32_WEIGHTS)
MQ_DEFINE_DENSE_TILE(tile_6, 6, F32_SETUP, F32_WEIGHTS)

const mq_tile_fn mq_dense_f32_tiles[TILE_ROWS + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* Rows per block: x's block (rows x K floats) about 256 KiB, a whole number of tiles. */
static int64_t block_rows(int64_t K) {
    int64_t rows = ((int64_t)256 * 1024 / 4 / (K > 0 ? K : 1)) / TILE_ROWS * TILE_ROWS;
    return rows < TILE_ROWS ? TILE_ROWS : rows;
}

int mq_dense_part(const mqinfer_linear_args *a, int part, int num_parts, const mq_tile_fn *tiles,
                  mq_panel_source source, void *state, const float *scales) {
    const int64_t M = a->rows, K = a->in_features, N = a->out_features;
    /* Output columns per panel: 16, or 8 for SwiGLU (a panel holds their gate and up halves). */
    const int swiglu = a->swiglu != 0;
    const int64_t width = swiglu ? PANEL / 2 : PANEL, panels = (N + width - 1) / width;
    const int64_t body = a->vector_chunk > 0 ? N / a->vector_chunk * a->vector_chunk : 0;
    const int64_t first = panels * part / num_parts, last = panels * (part + 1) / num_parts;
    const int64_t mb = block_rows(K);
    const float *x = (const float *)a->x, *bias = (const float *)a->bias;
    float *out = (float *)a->out;
    float edge[TILE_ROWS * PANEL], edge_bias[PANEL];
    for (int64_t r0 = 0; r0 < M; r0 += mb) {
        const int64_t rows = M - r0 < mb ? M - r0 : mb;
        for (int64_t p = first; p < last; p++) {
            const void *panel = source ? source(state, p) : (const float *)a->packed + p * K * PANEL;
            const float *ps = scales ? scales + p * PANEL : NULL;
            const int64_t cols = N - p * width < width ? N - p * width : width;
            const int mode = !swiglu ? STORE_PLAIN : (p + 1) * width <= body ? STORE_SWIGLU : STORE_SWIGLU_TAIL;
            const float *pb = bias ? bias + p * PANEL : NULL;
            if (bias && !swiglu && cols < PANEL) {  /* the last panel's bias, zero-padded */
                memset(edge_bias, 0, sizeof(edge_bias));
                memcpy(edge_bias, pb, sizeof(float) * cols);
                pb = edge_bias;
            }
            for (int64_t r = r0; r < r0 + rows; r += TILE_ROWS) {
                const int mr = (int)(r0 + rows - r < TILE_ROWS ? r0 + rows - r : TILE_ROWS);
                const float *xr = x + r * a->x_stride;
                float *o = out + r * a->out_stride + p * width;
                if (cols == width) {
                    tiles[mr](xr, a->x_stride, panel, ps, K, pb, o, a->out_stride, mode);
                } else {  /* a partial panel goes through a tile of its own */
                    tiles[mr](xr, a->x_stride, panel, ps, K, pb, edge, PANEL, mode);
                    for (int i = 0; i < mr; i++) memcpy(o + i * a->out_stride, edge + i * PANEL, sizeof(float) * cols);
                }
            }
        }
    }
    return 0;
}

static int linear_part(const void *ctx, int part, int num_parts) {
    return mq_dense_part((const mqinfer_linear_args *)ctx, part, num_parts, mq_dense_f32_tiles, NULL, NULL, NULL);
}

int mqinfer_linear(const mqinfer_linear_args *args, int num_threads) {
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    const int64_t width = args->swiglu ? PANEL / 2 : PANEL;
    const int64_t panels = (args->out_features + width - 1) / width;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > panels) parts = panels;
    return mq_parallel(linear_part, args, (int)parts, num_threads) ? -1 : 0;
}

#else

/* Without AVX2 and FMA, or with AVX-512 (where MKL's own kernels are twice as wide), the
   callers use PyTorch's matmul. */
int mqinfer_linear_available(void) { return 0; }

int mqinfer_linear(const mqinfer_linear_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
