/* Dense layers in bfloat16 by AMX tiles, with the weight packed once: out = x W^T (+ bias).

   Why. PyTorch's bfloat16 matmul on a CPU with AMX (oneDNN) lays the weight out for the tile unit
   again on every call: at a decoding step's 16-64 rows it reads and writes each weight once more
   before it multiplies, and on SmolLM2 and the 0.5B shape ran the layers at 200-600 GFLOP/s of
   one core's 1.2 TFLOP/s. Packed at load, each weight is read once per call (per 512 rows).

   Layout. Panel p holds output features 16p..16p+15; its K is cut into blocks of 32, each one
   B tile: 16 rows (pairs of inputs 2r, 2r+1) of 16 (w[n][2r], w[n][2r + 1]) pairs, 1 KiB, zero
   past the last feature. K must be a multiple of 32 (the callers fall back to PyTorch otherwise).

   Numerics. Each output is the tile unit's float32 sum of exact bfloat16 products, the bias
   added in float32, rounded once to bfloat16: a row's result depends only on that row (a row of
   a tile product depends only on its own row of x), not on the batch or the thread count. The
   summation order is not oneDNN's, so results differ from PyTorch's in the last bits.

   SwiGLU. For the MLP's fused gate/up projection the caller packs the weight with the gate's
   and the up projection's panels alternating (pair p: gate features 16p..16p+15, then the same
   up features) and asks for silu(gate) * up: each pair's two C tiles hold a row's gate and up
   sums side by side, rounded to bfloat16 as the plain store would write them, and the epilogue
   writes silu(gate) * up with cpu_ops.c's SwiGLU arithmetic (mqinfer_silu_mul): the same bits as
   the projection followed by that kernel, without the intermediate twice as wide.

   Work is split across threads by pairs of panels; rows go in chunks of ROW_CHUNK, each chunk's
   rows against every panel pair of the thread, 32 rows (two A tiles) against 32 features (two B
   tiles) at a time, 16 rows (one A tile) for a last block of 16 or fewer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "mqinfer_native.h"
#include "native_common.h"

#define PANEL 16
#define KBLOCK 32
#define ROW_CHUNK 512

int64_t mqinfer_amx_linear_packed_size(int64_t out_features, int64_t in_features) {
    return (out_features + PANEL - 1) / PANEL * PANEL * ((in_features + KBLOCK - 1) / KBLOCK * KBLOCK);
}

void mqinfer_amx_linear_pack(const uint16_t *weight, int64_t out_features, int64_t in_features, uint16_t *packed) {
    const int64_t panels = (out_features + PANEL - 1) / PANEL, kblocks = (in_features + KBLOCK - 1) / KBLOCK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint16_t *tile = packed + (p * kblocks + kb) * PANEL * KBLOCK;
            if ((p + 1) * PANEL <= out_features && (kb + 1) * KBLOCK <= in_features && in_features % 2 == 0) {
                /* A whole tile: row c's 16 pairs of inputs become column c (a 16 x 16 transpose
                   of 4-byte pairs, read and written in cache). */
                uint32_t *dst = (uint32_t *)tile;
                for (int64_t c = 0; c < PANEL; c++) {
                    const uint16_t *row = weight + (p * PANEL + c) * in_features + kb * KBLOCK;
                    for (int64_t r = 0; r < KBLOCK / 2; r++) {
                        uint32_t pair;
                        memcpy(&pair, row + 2 * r, 4);
                        dst[r * PANEL + c] = pair;
                    }
                }
                continue;
            }
            for (int64_t r = 0; r < KBLOCK / 2; r++)
                for (int64_t c = 0; c < PANEL; c++)
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t n = p * PANEL + c, k = kb * KBLOCK + 2 * r + e;
                        tile[(r * PANEL + c) * 2 + e] = n < out_features && k < in_features
                            ? weight[n * in_features + k] : 0;
                    }
        }
}

/* AVX-512 BW/VL/VNNI too: the SwiGLU epilogue shares the w8a8 kernels' bfloat16 rounding and silu
   table (int8_epilogue.h; the table lives with the VNNI kernel, linear_int8.c). Every CPU with
   AMX has them. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#include "int8_epilogue.h"

int mqinfer_amx_linear_available(void) { return mq_amx_permitted(); }

/* Tiles (mq_amx_configure_tiles: every tile 16 rows of 64 bytes). 0..3: C (rows 0-15 x panel a,
   rows 0-15 x panel b, rows 16-31 x a, 16-31 x b); 4, 5: A (rows 0-15, 16-31); 6, 7: B (panels
   a, b). */

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* One C tile (16 rows x 16 features, float32, row stride 64 bytes) plus bias into bfloat16 out. */
static void write_tile(const float *c, int64_t rows, int64_t cols, const uint16_t *bias, uint16_t *out,
                       int64_t out_stride) {
    const __mmask16 m = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias)), 16));
    for (int64_t r = 0; r < rows; r++)
        store_bf16(out + r * out_stride, _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b), m);
}

/* 16 sums as the plain store rounds them (store_bf16), in the low 16 bits of each lane. */
static inline __m512i stored_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
}

/* Rows of SwiGLU from a pair's C tiles: gate sums cg and up sums cu of `cols` features (row stride
   16 floats), each rounded as the plain store writes it. `vector`: silu(gate) from the table of
   mqinfer_silu_mul's vectorised arithmetic (one gather of the gates' bfloat16 bits), as that kernel
   computes the columns within a row's whole vector chunks; otherwise expf, as past them. Then the
   product rounded as mqinfer_silu_mul stores it. */
static void write_swiglu(const float *cg, const float *cu, int64_t rows, int64_t cols, int vector, uint16_t *out,
                         int64_t out_stride) {
    const __mmask16 m = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const __m512i g = stored_bits(_mm512_loadu_ps(cg + r * 16));
        const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(stored_bits(_mm512_loadu_ps(cu + r * 16)), 16));
        __m512 s;
        if (vector) {
            s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(g, (const int *)mq_silu_bf16_table, 2), 16));
        } else {
            float gs[16];
            _mm512_storeu_ps(gs, _mm512_castsi512_ps(_mm512_slli_epi32(g, 16)));
            for (int64_t i = 0; i < cols; i++) gs[i] = bf16_round(gs[i] / (1.0f + expf(-gs[i])));
            s = _mm512_loadu_ps(gs);
        }
        _mm256_mask_storeu_epi16(out + r * out_stride, m, _mm512_cvtepi32_epi16(bf16_bits(_mm512_mul_ps(s, u))));
    }
}

typedef struct {
    const mqinfer_amx_linear_args *a;
    int64_t pairs;  /* pairs of panels */
    int64_t inter;  /* SwiGLU: the intermediate size (pair p: gate then up features 16p..); 0 plain */
    int64_t body;   /* SwiGLU: output columns below this take the vectorised exponential */
} linear_call;

/* 16 or 32 rows (two_rows) at xa (row stride lda bytes) against panel a, and panel b (two_panels),
   over the whole K, into the C tiles (numbered as above). Constant flags: the compiler makes one
   loop per combination. The sums stay in the tiles (store_sums takes them out), so that the
   tile unit works on them while the core writes the block before. */
static inline __attribute__((always_inline)) void block_sums(const uint16_t *xa, int64_t lda, const uint16_t *wa,
                                                             const uint16_t *wb, int64_t kblocks,
                                                             const int two_rows, const int two_panels) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, xa + kb * KBLOCK, lda);
        if (two_rows) _tile_loadd(5, xa + 16 * (lda / 2) + kb * KBLOCK, lda);
        _tile_loadd(6, wa + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_rows) _tile_dpbf16ps(2, 5, 6);
        if (two_panels) {
            _tile_loadd(7, wb + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_rows) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

typedef void (*block_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, int64_t);
static void block_1_1(const uint16_t *x, int64_t lda, const uint16_t *wa, const uint16_t *wb, int64_t kb) {
    block_sums(x, lda, wa, wb, kb, 0, 0);
}
static void block_1_2(const uint16_t *x, int64_t lda, const uint16_t *wa, const uint16_t *wb, int64_t kb) {
    block_sums(x, lda, wa, wb, kb, 0, 1);
}
static void block_2_1(const uint16_t *x, int64_t lda, const uint16_t *wa, const uint16_t *wb, int64_t kb) {
    block_sums(x, lda, wa, wb, kb, 1, 0);
}
static void block_2_2(const uint16_t *x, int64_t lda, const uint16_t *wa, const uint16_t *wb, int64_t kb) {
    block_sums(x, lda, wa, wb, kb, 1, 1);
}
/* [two_rows][two_panels] */
static const block_fn blocks[2][2] = {{block_1_1, block_1_2}, {block_2_1, block_2_2}};

/* The C tiles block_sums filled, into c[0..3] as the tiles are numbered. */
static void store_sums(float c[4][256], int two_rows, int two_panels) {
    _tile_stored(0, c[0], 64);
    if (two_rows) _tile_stored(2, c[2], 64);
    if (two_panels) {
        _tile_stored(1, c[1], 64);
        if (two_rows) _tile_stored(3, c[3], 64);
    }
}

/* One 32-row block's results from its C tiles into the output: plain (with the bias) or SwiGLU. */
static void write_block(const linear_call *call, float c[4][256], int64_t m, int64_t rows, int64_t pp, int two) {
    const mqinfer_amx_linear_args *a = call->a;
    const uint16_t *bias = (const uint16_t *)a->bias;
    uint16_t *out = (uint16_t *)a->out;
    for (int half = 0; half < 2; half++) {
        const int64_t hr = rows - 16 * half < 16 ? rows - 16 * half : 16;
        if (hr <= 0) continue;
        if (call->inter) {
            const int64_t n0 = pp * PANEL, cols = call->inter - n0 < PANEL ? call->inter - n0 : PANEL;
            write_swiglu(c[2 * half], c[2 * half + 1], hr, cols, n0 + PANEL <= call->body,
                         out + (m + 16 * half) * a->out_stride + n0, a->out_stride);
            continue;
        }
        for (int side = 0; side < 1 + two; side++) {
            const int64_t n0 = (2 * pp + side) * PANEL, N = a->out_features;
            const int64_t cols = N - n0 < PANEL ? N - n0 : PANEL;
            write_tile(c[2 * half + side], hr, cols, bias ? bias + n0 : NULL,
                       out + (m + 16 * half) * a->out_stride + n0, a->out_stride);
        }
    }
}

static int linear_part(const void *ctx, int part, int num_parts) {
    const linear_call *call = (const linear_call *)ctx;
    const mqinfer_amx_linear_args *a = call->a;
    const int64_t M = a->rows, K = a->in_features, N = a->out_features, kblocks = K / KBLOCK;
    const int64_t first = call->pairs * part / num_parts, last = call->pairs * (part + 1) / num_parts;
    const uint16_t *x = (const uint16_t *)a->x, *w = (const uint16_t *)a->packed;
    float c[2][4][256];     /* the block in the tiles' sums, and the one before it */
    int64_t prev_m = -1, prev_rows = 0, prev_pp = 0, prev_two = 0, cur = 0;
    uint16_t *tail = NULL;  /* the last rows of x, padded to 32 with zeros */
    const int64_t full = M / 32 * 32;
    if (full < M) {
        tail = aligned_alloc(64, 32 * K * 2);
        if (!tail) return -1;
        memset(tail, 0, 32 * K * 2);
        for (int64_t r = full; r < M; r++) memcpy(tail + (r - full) * K, x + r * a->x_stride, K * 2);
    }
    mq_amx_configure_tiles();
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t r1 = M - r0 < ROW_CHUNK ? M : r0 + ROW_CHUNK;
        for (int64_t pp = first; pp < last; pp++) {
            const int64_t pa = 2 * pp, pb = pa + 1;
            const int two = pb * PANEL < N;
            const uint16_t *wa = w + pa * kblocks * 512, *wb = w + pb * kblocks * 512;
            for (int64_t m = r0; m < r1; m += 32) {
                const uint16_t *xa = m < full ? x + m * a->x_stride : tail;
                const int64_t lda = (m < full ? a->x_stride : K) * 2;
                const int64_t rows = M - m < 32 ? M - m : 32;
                blocks[rows > 16][two](xa, lda, wa, wb, kblocks);
                /* The block before is written while the tile unit sums this one. */
                if (prev_m >= 0) write_block(call, c[cur ^ 1], prev_m, prev_rows, prev_pp, (int)prev_two);
                store_sums(c[cur], rows > 16, two);
                prev_m = m, prev_rows = rows, prev_pp = pp, prev_two = two, cur ^= 1;
            }
        }
    }
    if (prev_m >= 0) write_block(call, c[cur ^ 1], prev_m, prev_rows, prev_pp, (int)prev_two);
    _tile_release();
    free(tail);
    return 0;
}

static int run_call(linear_call *call, int num_threads) {
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > call->pairs) parts = call->pairs;
    return mq_parallel(linear_part, call, (int)parts, num_threads) ? -1 : 0;
}

/* The plain projection: every pair of panels, no epilogue but the bias. */
int mqinfer_amx_linear(const mqinfer_amx_linear_args *args, int num_threads) {
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    if (args->in_features % KBLOCK || !mqinfer_amx_linear_available()) return -2;
    linear_call call = {args, ((args->out_features + PANEL - 1) / PANEL + 1) / 2, 0, 0};
    return run_call(&call, num_threads);
}

/* SwiGLU: the projection onto the alternating gate and up panels (2 * ceil(inter / 16) of them,
   no bias), each pair written by the SwiGLU epilogue. vector_chunk: PyTorch's SiLU takes its
   vectorised exponential on the whole chunks of this many values of a row
   (cpu_ops.silu_vector_chunk), std::exp past them. */
int mqinfer_amx_swiglu(const mqinfer_amx_swiglu_args *args, int num_threads) {
    const int64_t inter = args->inter, vector_chunk = args->vector_chunk;
    const int64_t pairs = (inter + PANEL - 1) / PANEL;
    const mqinfer_amx_linear_args projection = {args->x, args->packed, NULL, args->out, args->rows,
                                                args->in_features, 2 * pairs * PANEL, args->x_stride,
                                                args->out_stride};
    if (args->rows <= 0 || inter <= 0) return 0;
    if (args->in_features % KBLOCK || vector_chunk % PANEL || !mqinfer_amx_linear_available()) return -2;
    if (vector_chunk > 0) mq_silu_bf16_ready();
    linear_call call = {&projection, pairs, inter, vector_chunk > 0 ? inter / vector_chunk * vector_chunk : 0};
    return run_call(&call, num_threads);
}

#else

/* Without AMX bfloat16 tiles the callers use PyTorch. */
int mqinfer_amx_linear_available(void) { return 0; }

int mqinfer_amx_swiglu(const mqinfer_amx_swiglu_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

int mqinfer_amx_linear(const mqinfer_amx_linear_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
