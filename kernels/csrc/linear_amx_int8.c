/* w8a8 dense layers by AMX int8 tiles (TDPBSSD), with the weight packed once: the same result as
   the AVX-512 VNNI kernel in linear_int8.c, bit for bit, on CPUs with AMX.

   What it computes. out = ((float)(x_q W_q^T) * x_scale) * w_scale (+ bias), float32 or bfloat16
   in and out; with SwiGLU, silu(gate) * up of that projection. x is quantized here per row, with
   linear_int8.c's rule (q = round-half-even(x * (127 / max|x|)), |q| <= 127, a row too small to
   scale is zeros with scale 0); W was quantized at load by the caller, per output feature.

   Why signed by signed. TDPBSSD multiplies signed bytes by signed bytes and adds each group of 4
   products into an int32 lane without saturating, so the tiles' sums are the exact int32 sums of
   q_x q_w (the order of integer additions does not matter): the VNNI kernel's (which gets them
   from vpdpbusd and an offset of 128 taken off again) and torch._int_mm's. No offset, no column
   sums. The scaling and the stores below are the VNNI kernel's, operation for operation.

   Layout. Panel p holds 16 output features (for SwiGLU 8 gate and the same 8 up features, as the
   VNNI packing does, so the callers' per-panel scales and bias serve both kernels); its K,
   zero-padded to a multiple of 64, is [K/4][16][4]: a run of 16 groups of 4 inputs is one B tile
   (16 rows of 16 features x 4 bytes, 1 KiB, the int8 VNNI-4 layout the tile unit reads). The
   quantized rows go to the scratch, their K zero-padded to 64 too and their count to 16, so
   every A tile is whole (zeros add nothing).

   Work. Threads split the panels by pairs; rows go in chunks of ROW_CHUNK, each chunk against
   every pair of the thread, 32 rows (two A tiles) by 32 features (two B tiles) at a time, four
   int32 C tiles, then the epilogue from the C tiles to the output. A row's result depends on
   that row only, not on the batch or the thread count. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "mqinfer_native.h"
#include "native_common.h"
#include "dense_store.h"

#define PANEL 16
#define KBLOCK 64
#define ROW_CHUNK 512

static int64_t padded_k(int64_t in_features) { return (in_features + KBLOCK - 1) / KBLOCK * KBLOCK; }
static int64_t padded_rows(int64_t rows) { return (rows + 15) / 16 * 16; }
static int64_t panel_width(int swiglu) { return swiglu ? PANEL / 2 : PANEL; }

int64_t mqinfer_amx_qlinear_packed_size(int64_t out_features, int64_t in_features, int swiglu) {
    const int64_t width = panel_width(swiglu);
    return (out_features + width - 1) / width * PANEL * padded_k(in_features);
}

void mqinfer_amx_qlinear_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                              int8_t *packed) {
    const int64_t width = panel_width(swiglu), panels = (out_features + width - 1) / width;
    const int64_t kp = padded_k(in_features);
    memset(packed, 0, (size_t)(panels * PANEL * kp));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < PANEL; c++) {
            /* Panel column c is output feature n; for SwiGLU columns 0-7 are gate rows and 8-15
               the up rows of the same features. */
            const int64_t n = p * width + (swiglu ? c % width : c);
            if (n >= out_features) continue;
            const int8_t *row = weight + (swiglu && c >= width ? out_features + n : n) * in_features;
            int8_t *col = packed + p * PANEL * kp + c * 4;
            for (int64_t k = 0; k < in_features; k++) col[(k / 4) * PANEL * 4 + k % 4] = row[k];
        }
}

int64_t mqinfer_amx_qlinear_scratch_size(int64_t rows, int64_t in_features) {
    /* q per row (rows padded to 16, zeros past the last), then the row scales. */
    return padded_rows(rows) * padded_k(in_features) + rows * (int64_t)sizeof(float);
}

/* AVX-512 VNNI too: the epilogue's silu table lives with the VNNI kernel (linear_int8.c). */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "int8_epilogue.h"

/* Whether the OS lets this process use the tiles (asked once; the grant is per process). */
int mqinfer_amx_qlinear_available(void) { return mq_amx_permitted(); }

/* 127 / max|x| (linear_int8.c's row_inverse): 0 for a zero row and where the quotient overflows. */
static inline float row_inverse(float amax) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    return inv <= 3.4028234663852886e38f ? inv : 0.0f;
}

/* One row: q into q (kp bytes, zeros past K), the row's scale into *scale; the VNNI kernel's
   maximum, quotient and rounding. */
static void quantize_row_s8(const void *x, int is_bf16, int64_t K, int64_t kp, int8_t *q, float *scale) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_and_ps(load_row16(x, k, m, is_bf16), abs_mask));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = row_inverse(amax);
    *scale = inv > 0.0f ? amax / 127.0f : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    int64_t k;
    for (k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        /* |q| <= 127 (a NaN converts to INT32_MIN, whose low byte is 0: the VNNI kernel's 0 too),
           so the truncating narrow keeps it. */
        _mm512_mask_cvtepi32_storeu_epi8(q + k, m, _mm512_cvtps_epi32(_mm512_mul_ps(load_row16(x, k, m, is_bf16), vinv)));
    }
    if (K < kp) memset(q + K, 0, (size_t)(kp - K));
}

typedef struct {
    const mqinfer_qlinear_args *a;
    int8_t *q;                /* the quantized rows, [padded rows][kp] */
    float *row_scales;
    int64_t kp, panels, pairs;
} amx_job;

/* One C tile (rows x panel p's columns, int32, row stride 16) through the epilogue into the output. */
static void write_tile(const amx_job *job, const int32_t *c, int64_t row0, int64_t rows, int64_t p) {
    const mqinfer_qlinear_args *a = job->a;
    const int swiglu = a->swiglu != 0;
    const int64_t N = a->out_features, width = panel_width(swiglu);
    const int64_t body = a->vector_chunk > 0 ? N / a->vector_chunk * a->vector_chunk : 0;
    const int mode = !swiglu ? STORE_PLAIN : (p + 1) * width <= body ? STORE_SWIGLU : STORE_SWIGLU_TAIL;
    const int64_t cols = N - p * width < width ? N - p * width : width, esize = a->is_bf16 ? 2 : 4;
    const float *scales = (const float *)a->scales + p * PANEL;
    const float *bias = a->bias ? (const float *)a->bias + p * PANEL : NULL;
    for (int64_t i = 0; i < rows; i++) {
        char *o = (char *)a->out + ((row0 + i) * a->out_stride + p * width) * esize;
        const __m512i acc = _mm512_loadu_si512((const void *)(c + i * PANEL));
        if (cols == width) {
            store_int32_sums(o, esize == 2, acc, job->row_scales[row0 + i], scales, bias, mode);
        } else {  /* a partial last panel through a buffer */
            float edge[PANEL];
            store_int32_sums(edge, esize == 2, acc, job->row_scales[row0 + i], scales, bias, mode);
            memcpy(o, edge, (size_t)(cols * esize));
        }
    }
}

/* 16 or 32 rows (two_rows) starting at row m against panel a, and panel b (two_panels), over the
   whole K, into the C tiles (numbered as below). Constant flags: the compiler makes one loop per
   combination. The sums stay in the tiles (store_sums takes them out), so that the tile unit works
   on them while the core writes the block before. */
static inline __attribute__((always_inline)) void block_sums(const int8_t *xq, int64_t kp, const int8_t *wa,
                                                             const int8_t *wb, const int two_rows,
                                                             const int two_panels) {
    const int64_t kblocks = kp / KBLOCK;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, xq + kb * KBLOCK, kp);
        if (two_rows) _tile_loadd(5, xq + 16 * kp + kb * KBLOCK, kp);
        _tile_loadd(6, wa + kb * PANEL * KBLOCK, 64);
        _tile_dpbssd(0, 4, 6);
        if (two_rows) _tile_dpbssd(2, 5, 6);
        if (two_panels) {
            _tile_loadd(7, wb + kb * PANEL * KBLOCK, 64);
            _tile_dpbssd(1, 4, 7);
            if (two_rows) _tile_dpbssd(3, 5, 7);
        }
    }
}

typedef void (*block_fn)(const int8_t *, int64_t, const int8_t *, const int8_t *);
static void block_sums_1_1(const int8_t *x, int64_t kp, const int8_t *wa, const int8_t *wb) {
    block_sums(x, kp, wa, wb, 0, 0);
}
static void block_sums_1_2(const int8_t *x, int64_t kp, const int8_t *wa, const int8_t *wb) {
    block_sums(x, kp, wa, wb, 0, 1);
}
static void block_sums_2_1(const int8_t *x, int64_t kp, const int8_t *wa, const int8_t *wb) {
    block_sums(x, kp, wa, wb, 1, 0);
}
static void block_sums_2_2(const int8_t *x, int64_t kp, const int8_t *wa, const int8_t *wb) {
    block_sums(x, kp, wa, wb, 1, 1);
}
/* [two_rows][two_panels] */
static const block_fn blocks[2][2] = {{block_sums_1_1, block_sums_1_2}, {block_sums_2_1, block_sums_2_2}};

/* The C tiles block_sums filled, into c[0..3] as the tiles are numbered. */
static void store_sums(int32_t c[4][256], int two_rows, int two_panels) {
    _tile_stored(0, c[0], 64);
    if (two_rows) _tile_stored(2, c[2], 64);
    if (two_panels) {
        _tile_stored(1, c[1], 64);
        if (two_rows) _tile_stored(3, c[3], 64);
    }
}

/* A block's sums (its first row m, rows, panel pair pp) through the epilogue into the output. */
static void write_block(const amx_job *job, int32_t c[4][256], int64_t m, int64_t rows, int64_t pp,
                        int two_panels) {
    for (int half = 0; half < 2; half++) {
        const int64_t hr = rows - 16 * half < 16 ? rows - 16 * half : 16;
        if (hr <= 0) continue;
        write_tile(job, c[2 * half], m + 16 * half, hr, 2 * pp);
        if (two_panels) write_tile(job, c[2 * half + 1], m + 16 * half, hr, 2 * pp + 1);
    }
}

/* Part `part` of the quantization: a contiguous range of rows. */
static int quantize_part(const void *ctx, int part, int num_parts) {
    const amx_job *job = (const amx_job *)ctx;
    const mqinfer_qlinear_args *a = job->a;
    const int64_t first = a->rows * part / num_parts, last = a->rows * (part + 1) / num_parts;
    for (int64_t r = first; r < last; r++)
        quantize_row_s8((const char *)a->x + r * a->x_stride * (a->is_bf16 ? 2 : 4), a->is_bf16 != 0,
                        a->in_features, job->kp, job->q + r * job->kp, job->row_scales + r);
    return 0;
}

/* Part `part` of the product: a contiguous range of panel pairs, every row. Tiles 0..3: C (rows
   0-15 x panel a, rows 0-15 x panel b, rows 16-31 x a, 16-31 x b), int32; 4, 5: A (rows 0-15,
   16-31); 6, 7: B (panels a, b): mq_amx_configure_tiles's 16 rows of 64 bytes each. */
static int product_part(const void *ctx, int part, int num_parts) {
    const amx_job *job = (const amx_job *)ctx;
    const int64_t M = job->a->rows, kp = job->kp;
    const int64_t first = job->pairs * part / num_parts, last = job->pairs * (part + 1) / num_parts;
    const int8_t *w = (const int8_t *)job->a->packed;
    int32_t c[2][4][256];  /* the block in the tiles' sums, and the one before it */
    int64_t prev_m = -1, prev_rows = 0, prev_pp = 0, cur = 0;
    int prev_two = 0;
    mq_amx_configure_tiles();
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t r1 = M - r0 < ROW_CHUNK ? M : r0 + ROW_CHUNK;
        for (int64_t pp = first; pp < last; pp++) {
            const int64_t pa = 2 * pp, pb = pa + 1;
            const int two_panels = pb < job->panels;
            const int8_t *wa = w + pa * PANEL * kp, *wb = two_panels ? w + pb * PANEL * kp : wa;
            for (int64_t m = r0; m < r1; m += 32) {
                const int64_t rows = r1 - m < 32 ? r1 - m : 32;
                blocks[rows > 16][two_panels](job->q + m * kp, kp, wa, wb);
                /* The block before is written while the tile unit sums this one. */
                if (prev_m >= 0) write_block(job, c[cur ^ 1], prev_m, prev_rows, prev_pp, prev_two);
                store_sums(c[cur], rows > 16, two_panels);
                prev_m = m, prev_rows = rows, prev_pp = pp, prev_two = two_panels, cur ^= 1;
            }
        }
    }
    if (prev_m >= 0) write_block(job, c[cur ^ 1], prev_m, prev_rows, prev_pp, prev_two);
    _tile_release();
    return 0;
}

/* Returns 0; -1 when a part failed; -2 no AMX int8 here (or the OS refused the tiles). The scratch
   holds mqinfer_amx_qlinear_scratch_size(rows, in_features) bytes. */
int mqinfer_amx_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    if (!mqinfer_amx_qlinear_available()) return -2;
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    if (args->swiglu && args->is_bf16) mq_silu_bf16_ready();
    const int64_t M = args->rows, kp = padded_k(args->in_features), mp = padded_rows(M);
    const int64_t panels = (args->out_features + panel_width(args->swiglu != 0) - 1) / panel_width(args->swiglu != 0);
    int8_t *q = (int8_t *)args->scratch;
    amx_job job = {args, q, (float *)(q + mp * kp), kp, panels, (panels + 1) / 2};
    if (mp > M) memset(q + M * kp, 0, (size_t)((mp - M) * kp));
    const int64_t threads = num_threads < 1 ? 1 : num_threads;
    /* Quantizing a row costs about as much as a few panels of its product: worth the pool only
       for many rows. */
    const int64_t qparts = M >= 64 ? (threads < M ? threads : M) : 1;
    if (mq_parallel(quantize_part, &job, (int)qparts, num_threads)) return -1;
    const int64_t parts = threads < job.pairs ? threads : job.pairs;
    return mq_parallel(product_part, &job, (int)parts, num_threads) ? -1 : 0;
}

#else

/* Without AMX int8 tiles the callers use the VNNI kernel (linear_int8.c) or PyTorch. */
int mqinfer_amx_qlinear_available(void) { return 0; }

int mqinfer_amx_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
