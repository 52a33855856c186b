/* Dense layers with int8 weights and int8 activations (w8a8) on CPUs with AVX2 but no AVX-512:
   out = (x_q W_q^T) * x_scale * w_scale (+ bias), float32 in and out, int32 sums.

   Quantization. W is quantized once, at load, per output feature (symmetric, [-127, 127], by
   the caller). x is quantized here, per row: scale = max|x| / 127, q = round-half-even(x *
   (127 / max|x|)), so q is in [-127, 127] too; a zero row has scale 0 and q = 0.

   Why these instructions. Without VNNI the fastest int8 product on AVX2 is vpmaddubsw
   (unsigned 8-bit times signed 8-bit, adjacent pairs summed into 16 bits, saturating) followed
   by vpmaddwd against ones (pairs of those into 32 bits): 32 multiply-adds in two
   instructions, where one float32 FMA does 8. An unsigned operand made by adding 128 to one
   side would let a pair reach 2 * 255 * 127 and saturate; instead the unsigned operand is
   |x_q| and the sign of x_q moves onto the weight (vpsignb), so a pair is at most 2 * 127 * 127
   = 32258 < 32767 and every int32 sum is exact.

   Layout. W is packed into panels of 16 output features, like the float32 kernel's; within a
   panel, each group of 4 input features holds the 16 features' 4 bytes feature-major
   ([K/4][16][4], K zero-padded to a multiple of 4), so one 32-byte load is 8 features x 4
   inputs, the shape vpmaddubsw and vpmaddwd reduce. For SwiGLU a panel holds 8 gate and the
   same 8 up features (as the float32 packing does), and the tile writes silu(gate) * up.

   Numerics. Each sum is exact (int32), then converted to float32 and scaled in a fixed order:
   ((float)sum * x_scale) * w_scale, then + bias. The result of a row does not depend on the
   other rows or on the thread count, and the tests hold it bit for bit to the same arithmetic
   in PyTorch. */
#include <stdint.h>
#include <string.h>

#include "mqinfer_native.h"
#include "native_common.h"
#include "dense_store.h"

#define PANEL 16
#define GROUP 4

static int64_t padded_k(int64_t in_features) { return (in_features + GROUP - 1) / GROUP * GROUP; }

static int64_t panel_width(int swiglu) { return swiglu ? PANEL / 2 : PANEL; }

int64_t mqinfer_qlinear_packed_size(int64_t out_features, int64_t in_features, int swiglu) {
    const int64_t width = panel_width(swiglu);
    return (out_features + width - 1) / width * PANEL * padded_k(in_features);
}

void mqinfer_qlinear_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                          int8_t *packed) {
    const int64_t width = panel_width(swiglu), panels = (out_features + width - 1) / width;
    const int64_t kp = padded_k(in_features);
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < kp / GROUP; g++)
            for (int64_t c = 0; c < PANEL; c++) {
                /* Panel column c is output feature n; for SwiGLU columns 0-7 are gate rows and
                   8-15 the up rows of the same features. */
                const int64_t n = p * width + (swiglu ? c % width : c);
                const int64_t row = swiglu && c >= width ? out_features + n : n;
                for (int64_t j = 0; j < GROUP; j++) {
                    const int64_t k = g * GROUP + j;
                    packed[((p * (kp / GROUP) + g) * PANEL + c) * GROUP + j] =
                        n < out_features && k < in_features ? weight[row * in_features + k] : 0;
                }
            }
}

int64_t mqinfer_qlinear_scratch_size(int64_t rows, int64_t in_features) {
    /* |q| and q per row, then the row scales. */
    return rows * padded_k(in_features) * 2 + rows * (int64_t)sizeof(float);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

int mqinfer_qlinear_available(void) { return 1; }

/* One row: q (signed) and |q| into qs and qa (kp bytes each, zero past K), its scale into
   *scale. */
static void quantize_row(const float *x, int64_t K, int64_t kp, int8_t *qs, uint8_t *qa, float *scale) {
    __m256 vmax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
    float lanes[8], amax;
    _mm256_storeu_ps(lanes, vmax);
    amax = lanes[0];
    for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    for (; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    /* packs interleave the 128-bit lanes; this puts the 8 dwords back in order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (k = 0; k + 32 <= K; k += 32) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), vinv));
        const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), vinv));
        __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        q = _mm256_permutevar8x32_epi32(q, order);
        /* round(x * 127 / max|x|) can reach 127 only; -128 never occurs, so |q| fits a byte. */
        _mm256_storeu_si256((__m256i *)(qs + k), q);
        _mm256_storeu_si256((__m256i *)(qa + k), _mm256_abs_epi8(q));
    }
    for (; k < K; k++) {
        const int v = (int)nearbyintf(x[k] * inv);
        qs[k] = (int8_t)v;
        qa[k] = (uint8_t)(v < 0 ? -v : v);
    }
    for (; k < kp; k++) qs[k] = 0, qa[k] = 0;
}

static inline __m256i dot4(__m256i acc, __m256i xa, __m256i xs, __m256i w, __m256i ones) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xs)), ones));
}

static inline __m256i broadcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi32(v);
}

static inline void store_scaled(float *o, __m256i s0, __m256i s1, float row_scale, const float *scales,
                                const float *bias, int mode) {
    const __m256 rs = _mm256_set1_ps(row_scale);
    __m256 f0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s0), rs), _mm256_loadu_ps(scales));
    __m256 f1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s1), rs), _mm256_loadu_ps(scales + 8));
    if (bias) {
        f0 = _mm256_add_ps(f0, _mm256_loadu_ps(bias));
        f1 = _mm256_add_ps(f1, _mm256_loadu_ps(bias + 8));
    }
    store_row(o, f0, f1, mode);
}

/* Rows 0..MR-1 (|q| rows qa, signed rows qs, row stride kp) times one panel into out (row
   stride ldo). Four rows x 16 features: 8 accumulators, two weight vectors, the broadcasts,
   the ones and the temporaries fit AVX2's 16 registers. */
#define TILE_ROWS 4
#define DEFINE_QTILE(MR)                                                                          \
static void qtile_##MR(const uint8_t *qa, const int8_t *qs, int64_t kp, const float *row_scales, \
                       const int8_t *panel, const float *scales, const float *bias, float *out,   \
                       int64_t ldo, int mode) {                                                  \
    const __m256i ones = _mm256_set1_epi16(1);                                                   \
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;                       \
    __m256i a20 = a00, a21 = a00, a30 = a00, a31 = a00;                                          \
    for (int64_t k = 0; k < kp; k += GROUP) {                                                    \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(panel + k * PANEL));           \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(panel + k * PANEL + 32));      \
        __m256i xa, xs;                                                                          \
        xa = broadcast4(qa + k); xs = broadcast4(qs + k);                                        \
        a00 = dot4(a00, xa, xs, w0, ones); a01 = dot4(a01, xa, xs, w1, ones);                   \
        if (MR > 1) { xa = broadcast4(qa + kp + k); xs = broadcast4(qs + kp + k);               \
            a10 = dot4(a10, xa, xs, w0, ones); a11 = dot4(a11, xa, xs, w1, ones); }             \
        if (MR > 2) { xa = broadcast4(qa + 2 * kp + k); xs = broadcast4(qs + 2 * kp + k);       \
            a20 = dot4(a20, xa, xs, w0, ones); a21 = dot4(a21, xa, xs, w1, ones); }             \
        if (MR > 3) { xa = broadcast4(qa + 3 * kp + k); xs = broadcast4(qs + 3 * kp + k);       \
            a30 = dot4(a30, xa, xs, w0, ones); a31 = dot4(a31, xa, xs, w1, ones); }             \
    }                                                                                            \
    store_scaled(out, a00, a01, row_scales[0], scales, bias, mode);                             \
    if (MR > 1) store_scaled(out + ldo, a10, a11, row_scales[1], scales, bias, mode);          \
    if (MR > 2) store_scaled(out + 2 * ldo, a20, a21, row_scales[2], scales, bias, mode);      \
    if (MR > 3) store_scaled(out + 3 * ldo, a30, a31, row_scales[3], scales, bias, mode);      \
}
DEFINE_QTILE(1)
DEFINE_QTILE(2)
DEFINE_QTILE(3)
DEFINE_QTILE(4)

typedef void (*qtile_fn)(const uint8_t *, const int8_t *, int64_t, const float *, const int8_t *,
                         const float *, const float *, float *, int64_t, int);
static const qtile_fn qtiles[TILE_ROWS + 1] = {NULL, qtile_1, qtile_2, qtile_3, qtile_4};

typedef struct {
    const mqinfer_qlinear_args *a;
    const uint8_t *qa;
    const int8_t *qs;
    const float *row_scales;
    int64_t kp;
} qlinear_job;

/* Rows per block: a block of quantized x (rows x K bytes, twice) about 128 KiB. */
static int64_t block_rows(int64_t kp) {
    int64_t rows = ((int64_t)64 * 1024 / (kp > 0 ? kp : 1)) / TILE_ROWS * TILE_ROWS;
    return rows < TILE_ROWS ? TILE_ROWS : rows;
}

static int qlinear_part(const void *ctx, int part, int num_parts) {
    const qlinear_job *job = (const qlinear_job *)ctx;
    const mqinfer_qlinear_args *a = job->a;
    const int64_t M = a->rows, N = a->out_features, kp = job->kp;
    const int swiglu = a->swiglu != 0;
    const int64_t width = panel_width(swiglu), panels = (N + width - 1) / width;
    const int64_t body = a->vector_chunk > 0 ? N / a->vector_chunk * a->vector_chunk : 0;
    const int64_t first = panels * part / num_parts, last = panels * (part + 1) / num_parts;
    const int64_t mb = block_rows(kp);
    const int8_t *packed = (const int8_t *)a->packed;
    const float *scales = (const float *)a->scales, *bias = (const float *)a->bias;
    float *out = (float *)a->out;
    float edge[TILE_ROWS * PANEL];
    for (int64_t r0 = 0; r0 < M; r0 += mb) {
        const int64_t rows = M - r0 < mb ? M - r0 : mb;
        for (int64_t p = first; p < last; p++) {
            const int8_t *panel = packed + p * kp * PANEL;
            const int64_t cols = N - p * width < width ? N - p * width : width;
            const int mode = !swiglu ? STORE_PLAIN : (p + 1) * width <= body ? STORE_SWIGLU : STORE_SWIGLU_TAIL;
            const float *ps = scales + p * PANEL, *pb = bias ? bias + p * PANEL : NULL;
            for (int64_t r = r0; r < r0 + rows; r += TILE_ROWS) {
                const int mr = (int)(r0 + rows - r < TILE_ROWS ? r0 + rows - r : TILE_ROWS);
                float *o = out + r * a->out_stride + p * width;
                if (cols == width) {
                    qtiles[mr](job->qa + r * kp, job->qs + r * kp, kp, job->row_scales + r, panel, ps, pb, o,
                               a->out_stride, mode);
                } else {  /* a partial panel goes through a tile of its own */
                    qtiles[mr](job->qa + r * kp, job->qs + r * kp, kp, job->row_scales + r, panel, ps, pb, edge,
                               PANEL, mode);
                    for (int i = 0; i < mr; i++) memcpy(o + i * a->out_stride, edge + i * PANEL, sizeof(float) * cols);
                }
            }
        }
    }
    return 0;
}

int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    const int64_t M = args->rows, K = args->in_features, kp = padded_k(K);
    uint8_t *qa = (uint8_t *)args->scratch;
    int8_t *qs = (int8_t *)(qa + M * kp);
    float *row_scales = (float *)(qs + M * kp);
    const float *x = (const float *)args->x;
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * args->x_stride, K, kp, qs + r * kp, qa + r * kp, row_scales + r);
    const qlinear_job job = {args, qa, qs, row_scales, kp};
    const int64_t width = panel_width(args->swiglu != 0);
    const int64_t panels = (args->out_features + width - 1) / width;
    int64_t parts = num_threads < 1 ? 1 : num_threads;
    if (parts > panels) parts = panels;
    return mq_parallel(qlinear_part, &job, (int)parts, num_threads) ? -1 : 0;
}

#else

/* Without AVX2, or with AVX-512, the callers use the PyTorch path. */
int mqinfer_qlinear_available(void) { return 0; }

int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
