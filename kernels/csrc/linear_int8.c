/* Dense layers with int8 weights and int8 activations (w8a8) on CPUs with AVX2 but no AVX-512,
   and on CPUs with AVX-512 VNNI (its own kernel, further down):
   out = (x_q W_q^T) * x_scale * w_scale (+ bias), float32 in and out (or bfloat16, with the VNNI
   kernel), int32 sums.

   Quantization. W is quantized once, at load, per output feature (symmetric, [-127, 127], by
   the caller). x is quantized here, per row: scale = max|x| / 127, q = round-half-even(x *
   (127 / max|x|)), so q is in [-127, 127] too; a zero row, and a row so small that 127 / max|x|
   overflows (max|x| below about 4e-37), has scale 0 and q = 0.

   Why these instructions. Without VNNI the fastest int8 product on AVX2 is vpmaddubsw
   (unsigned 8-bit times signed 8-bit, adjacent pairs summed into 16 bits, saturating) followed
   by vpmaddwd against ones (pairs of those into 32 bits): 32 multiply-adds in two
   instructions, where one float32 FMA does 8. An unsigned operand made by adding 128 to one
   side would let a pair reach 2 * 255 * 127 and saturate; instead the unsigned operand is
   |x_q| and the sign of x_q moves onto the weight (vpsignb), so a pair is at most 2 * 127 * 127
   = 32258 < 32767 and every int32 sum is exact. With VNNI, vpdpbusd sums into 32 bits without
   saturating, and the unsigned operand is x_q + 128 (see the VNNI kernel).

   Layout. W is packed into panels of 16 output features, like the float32 kernel's; within a
   panel, each group of 4 input features holds the 16 features' 4 bytes feature-major
   ([K/4][16][4], K zero-padded to a multiple of 4), so one 32-byte load is 8 features x 4
   inputs, the shape vpmaddubsw and vpmaddwd reduce. For SwiGLU a panel holds 8 gate and the
   same 8 up features (as the float32 packing does), and the tile writes silu(gate) * up.

   Numerics. Each sum is exact (int32), then converted to float32 and scaled in a fixed order:
   ((float)sum * x_scale) * w_scale, then + bias. The result of a row does not depend on the
   other rows or on the thread count, and the tests hold it bit for bit to the same arithmetic
   in PyTorch. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "mqinfer_native.h"
#include "native_common.h"
#include "dense_store.h"
#include "int8_epilogue.h"

#define PANEL 16
#define GROUP 4

/* AVX-512 with VNNI: the kernel further down multiplies with vpdpbusd, and the packed weight
   carries each panel column's sum (times 128) after the panels. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QLINEAR_VNNI 1
#else
#define QLINEAR_VNNI 0
#endif

/* 127 / max|x|, the row's quantization multiplier; 0 for a zero row and for a row so small
   (max|x| below about 4e-37) that the quotient overflows: such a row quantizes to zeros with a
   zero scale. */
static inline float row_inverse(float amax) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    return inv <= 3.4028234663852886e38f ? inv : 0.0f;
}

static int64_t padded_k(int64_t in_features) { return (in_features + GROUP - 1) / GROUP * GROUP; }

static int64_t panel_width(int swiglu) { return swiglu ? PANEL / 2 : PANEL; }

int64_t mqinfer_qlinear_packed_size(int64_t out_features, int64_t in_features, int swiglu) {
    const int64_t width = panel_width(swiglu), panels = (out_features + width - 1) / width;
    return panels * PANEL * padded_k(in_features) + (QLINEAR_VNNI ? panels * PANEL * (int64_t)sizeof(int32_t) : 0);
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
#if QLINEAR_VNNI
    /* 128 x each panel column's sum over k, panel after panel: what the +128 offset of the
       activations adds to each sum (see the VNNI kernel). */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < PANEL; c++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < kp; k++) sum += packed[(p * kp + (k - k % GROUP)) * PANEL + c * GROUP + k % GROUP];
            const int32_t scaled = sum * 128;
            memcpy(packed + panels * PANEL * kp + (p * PANEL + c) * (int64_t)sizeof(int32_t), &scaled, sizeof(scaled));
        }
#endif
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
    const float inv = row_inverse(amax);
    *scale = inv > 0.0f ? amax / 127.0f : 0.0f;
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

int mqinfer_qlinear_takes_bf16(void) { return 0; }

int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    if (args->is_bf16) return -2;
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

#elif QLINEAR_VNNI
#include <immintrin.h>

/* AVX-512 with VNNI. vpdpbusd multiplies unsigned by signed bytes and adds each group of 4
   products into a 32-bit lane (no intermediate saturation): 64 multiply-adds in one
   instruction. The unsigned operand is the activation plus 128 (q + 128 in [1, 255]), so each
   lane sums (q + 128) w = q w + 128 w, and the packed weight's 128 x column sums take the second
   term off again. Both are int32 arithmetic modulo 2^32 and the true sum of q w fits in int32,
   so the result is exact: the same int32 as the AVX2 kernel's and torch._int_mm's.

   One 64-byte vector of a panel is its 16 features x 4 inputs (the packing's [K/4][16][4]), so
   the packing is the AVX2 kernel's; a tile is up to 6 rows x 4 panels (24 accumulators of the
   32 registers), each step 4 weight loads and 6 broadcasts for 24 vpdpbusd. */

int mqinfer_qlinear_available(void) { return 1; }
int mqinfer_qlinear_takes_bf16(void) { return 1; }

#define VNNI_ROWS 6
#define VNNI_PANELS 4

/* One row: q + 128 into qu (kp bytes, 128 past K), the row's scale into *scale. The rounding
   is the AVX2 kernel's (round-half-even of x * (127 / max|x|)). */
static void quantize_row_u8(const void *x, int is_bf16, int64_t K, int64_t kp, uint8_t *qu, float *scale) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_and_ps(load_row16(x, k, m, is_bf16), abs_mask));
    }
    int64_t k;
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = row_inverse(amax);
    *scale = inv > 0.0f ? amax / 127.0f : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i offset = _mm512_set1_epi32(128);
    for (k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_row16(x, k, m, is_bf16), vinv));
        /* |q| <= 127, so q + 128 is a byte and the truncating narrow keeps it. */
        _mm512_mask_cvtepi32_storeu_epi8(qu + k, m, _mm512_add_epi32(q, offset));
    }
    for (k = K; k < kp; k++) qu[k] = 128;
}

uint16_t mq_silu_bf16_table[(1 << 16) + 1];
static pthread_once_t silu_bf16_once = PTHREAD_ONCE_INIT;
static void fill_silu_bf16_table(void) {
    for (int32_t b = 0; b < (1 << 16); b += 8) {
        const __m256 g = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_set1_epi32(b), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), 16));
        const __m256 e = exp_f32x8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
        const __m512i sl = bf16_bits(_mm512_castps256_ps512(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e))));
        _mm_storeu_si128((__m128i *)(mq_silu_bf16_table + b), _mm256_cvtepi32_epi16(_mm512_castsi512_si256(sl)));
    }
}
void mq_silu_bf16_ready(void) { pthread_once(&silu_bf16_once, fill_silu_bf16_table); }

/* One accumulator (a row's 16 panel columns) to out: sum - 128 x column sums, then the shared
   epilogue (int8_epilogue.h). */
static inline void vnni_store(void *o, int out_bf16, __m512i acc, __m512i sums128, float row_scale,
                              const float *scales, const float *bias, int mode) {
    store_int32_sums(o, out_bf16, _mm512_sub_epi32(acc, sums128), row_scale, scales, bias, mode);
}

typedef struct {
    const uint8_t *qu;       /* the tile's first row of q + 128 (row stride kp) */
    const float *row_scales; /* and its scale */
    const int8_t *panel;     /* the first panel of the tile (panels kp * PANEL bytes apart) */
    const int32_t *sums128;  /* its 128 x column sums (PANEL per panel) */
    const float *scales, *bias; /* its first column's scale and bias (bias NULL: none) */
    char *out;               /* where the tile's first row and column go */
    int64_t esize;           /* bytes per output value: 4 (float32) or 2 (bfloat16) */
    int64_t kp, ldo;
    int64_t width;           /* output columns per panel: 16, or 8 for SwiGLU */
    int64_t last_cols;       /* output columns of the tile's last panel (less than width at the edge) */
    int mode_of[VNNI_PANELS];
    const char *ahead;       /* weight bytes to prefetch while this tile runs (NULL: none), */
    int64_t ahead_lines;     /* how many 64-byte lines of them, */
    int64_t lines_per_step;  /* and how many per step of k */
} vnni_tile;

/* Row i of panel j's accumulator to the output (a partial last panel through a buffer). */
static inline void vnni_put(const vnni_tile *t, int i, int j, int last, __m512i acc) {
    const __m512i sums = _mm512_loadu_si512((const void *)(t->sums128 + j * PANEL));
    const float *sc = t->scales + j * PANEL, *bi = t->bias ? t->bias + j * PANEL : NULL;
    char *o = t->out + (i * t->ldo + j * t->width) * t->esize;
    const int out_bf16 = t->esize == 2;
    if (!last || t->last_cols == t->width) {
        vnni_store(o, out_bf16, acc, sums, t->row_scales[i], sc, bi, t->mode_of[j]);
    } else {
        float edge[PANEL];
        vnni_store(edge, out_bf16, acc, sums, t->row_scales[i], sc, bi, t->mode_of[j]);
        memcpy(o, edge, (size_t)(t->esize * t->last_cols));
    }
}

/* The accumulators are named variables, not an array, so that the compiler keeps all of them
   in registers. */
#define VNNI_ACC(i) __m512i a##i##0 = _mm512_setzero_si512(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0;
#define VNNI_STEP(i)                                                                             \
    if (MR > i) {                                                                                \
        int32_t v;                                                                               \
        memcpy(&v, qu + i * kp + k, sizeof(v));                                                  \
        const __m512i xv = _mm512_set1_epi32(v);                                                 \
        a##i##0 = _mm512_dpbusd_epi32(a##i##0, xv, w0);                                         \
        if (NR > 1) a##i##1 = _mm512_dpbusd_epi32(a##i##1, xv, w1);                              \
        if (NR > 2) a##i##2 = _mm512_dpbusd_epi32(a##i##2, xv, w2);                              \
        if (NR > 3) a##i##3 = _mm512_dpbusd_epi32(a##i##3, xv, w3);                              \
    }
#define VNNI_PUT(i, j) if (MR > i && NR > j) vnni_put(t, i, j, j == NR - 1, a##i##j);
#define VNNI_PUT_PANEL(j) VNNI_PUT(0, j) VNNI_PUT(1, j) VNNI_PUT(2, j) VNNI_PUT(3, j) VNNI_PUT(4, j) VNNI_PUT(5, j)

static inline __attribute__((always_inline)) void vnni_tile_run(const vnni_tile *t, const int MR, const int NR) {
    VNNI_ACC(0) VNNI_ACC(1) VNNI_ACC(2) VNNI_ACC(3) VNNI_ACC(4) VNNI_ACC(5)
    const int64_t kp = t->kp, stride = kp * PANEL;
    const uint8_t *qu = t->qu;
    const int8_t *w = t->panel;
    const char *ahead = t->ahead;
    int64_t ahead_left = ahead ? t->ahead_lines : 0;
    for (int64_t k = 0; k < kp; k += GROUP) {
        if (ahead_left > 0) {
            for (int64_t i = 0; i < t->lines_per_step; i++) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
            ahead += 64 * t->lines_per_step;
            ahead_left -= t->lines_per_step;
        }
        const __m512i w0 = _mm512_loadu_si512((const void *)(w + k * PANEL));
        const __m512i w1 = NR > 1 ? _mm512_loadu_si512((const void *)(w + stride + k * PANEL)) : w0;
        const __m512i w2 = NR > 2 ? _mm512_loadu_si512((const void *)(w + 2 * stride + k * PANEL)) : w0;
        const __m512i w3 = NR > 3 ? _mm512_loadu_si512((const void *)(w + 3 * stride + k * PANEL)) : w0;
        VNNI_STEP(0) VNNI_STEP(1) VNNI_STEP(2) VNNI_STEP(3) VNNI_STEP(4) VNNI_STEP(5)
    }
    VNNI_PUT_PANEL(0) VNNI_PUT_PANEL(1) VNNI_PUT_PANEL(2) VNNI_PUT_PANEL(3)
}

#define VNNI_TILE(MR, NR) static void vnni_tile_##MR##_##NR(const vnni_tile *t) { vnni_tile_run(t, MR, NR); }
#define VNNI_TILES(MR) VNNI_TILE(MR, 1) VNNI_TILE(MR, 2) VNNI_TILE(MR, 3) VNNI_TILE(MR, 4)
VNNI_TILES(1) VNNI_TILES(2) VNNI_TILES(3) VNNI_TILES(4) VNNI_TILES(5) VNNI_TILES(6)
#define VNNI_ROW(MR) {vnni_tile_##MR##_1, vnni_tile_##MR##_2, vnni_tile_##MR##_3, vnni_tile_##MR##_4}
typedef void (*vnni_tile_fn)(const vnni_tile *);
static const vnni_tile_fn vnni_tiles[VNNI_ROWS][VNNI_PANELS] = {
    VNNI_ROW(1), VNNI_ROW(2), VNNI_ROW(3), VNNI_ROW(4), VNNI_ROW(5), VNNI_ROW(6)};

typedef struct {
    const mqinfer_qlinear_args *a;
    uint8_t *qu;
    float *row_scales;
    int64_t kp;
} vnni_job;

/* Rows per block: the block's q + 128 rows (rows x kp bytes) about 96 KiB, in L2 while every
   panel of the part passes over them. */
static int64_t vnni_block_rows(int64_t kp) {
    int64_t rows = ((int64_t)96 * 1024 / (kp > 0 ? kp : 1)) / VNNI_ROWS * VNNI_ROWS;
    return rows < VNNI_ROWS ? VNNI_ROWS : rows;
}

/* Part `part` of the activations' quantization: a contiguous range of rows. */
static int vnni_quantize_part(const void *ctx, int part, int num_parts) {
    const vnni_job *job = (const vnni_job *)ctx;
    const mqinfer_qlinear_args *a = job->a;
    const int64_t first = a->rows * part / num_parts, last = a->rows * (part + 1) / num_parts;
    for (int64_t r = first; r < last; r++)
        quantize_row_u8((const char *)a->x + r * a->x_stride * (a->is_bf16 ? 2 : 4), a->is_bf16 != 0,
                        a->in_features, job->kp, job->qu + r * job->kp, job->row_scales + r);
    return 0;
}

/* Part `part` of the product: a contiguous range of whole tiles' panels, every row. */
static int vnni_part(const void *ctx, int part, int num_parts) {
    const vnni_job *job = (const vnni_job *)ctx;
    const mqinfer_qlinear_args *a = job->a;
    const int64_t M = a->rows, N = a->out_features, kp = job->kp;
    const int swiglu = a->swiglu != 0;
    const int64_t width = panel_width(swiglu), panels = (N + width - 1) / width;
    const int64_t groups = (panels + VNNI_PANELS - 1) / VNNI_PANELS;
    const int64_t first = groups * part / num_parts * VNNI_PANELS;
    int64_t last = groups * (part + 1) / num_parts * VNNI_PANELS;
    if (last > panels) last = panels;
    const int64_t body = a->vector_chunk > 0 ? N / a->vector_chunk * a->vector_chunk : 0;
    const int64_t mb = vnni_block_rows(kp);
    const int8_t *packed = (const int8_t *)a->packed;
    const int32_t *sums128 = (const int32_t *)(packed + panels * PANEL * kp);
    const float *scales = (const float *)a->scales, *bias = (const float *)a->bias;
    const int64_t esize = a->is_bf16 ? 2 : 4;
    char *out = (char *)a->out;
    for (int64_t r0 = 0; r0 < M; r0 += mb) {
        const int64_t rows = M - r0 < mb ? M - r0 : mb;
        for (int64_t p = first; p < last; p += VNNI_PANELS) {
            const int nr = (int)(last - p < VNNI_PANELS ? last - p : VNNI_PANELS);
            vnni_tile t;
            t.panel = packed + p * kp * PANEL;
            t.sums128 = sums128 + p * PANEL;
            t.scales = scales + p * PANEL;
            t.bias = bias ? bias + p * PANEL : NULL;
            t.kp = kp;
            t.ldo = a->out_stride;
            t.esize = esize;
            t.width = width;
            t.last_cols = N - (p + nr - 1) * width < width ? N - (p + nr - 1) * width : width;
            for (int j = 0; j < nr; j++)
                t.mode_of[j] = !swiglu ? STORE_PLAIN : (p + j + 1) * width <= body ? STORE_SWIGLU : STORE_SWIGLU_TAIL;
            /* The part's next panels (the next group, or its first one again for the next block
               of rows) come from memory while this group's tiles run: their lines are asked for
               a few per step of k, spread over the tiles. A whole group asked for at once would
               fill the queue of outstanding misses and stall. */
            const int64_t next = p + VNNI_PANELS < last ? p + VNNI_PANELS : r0 + rows < M ? first : -1;
            const int64_t tiles = (rows + VNNI_ROWS - 1) / VNNI_ROWS;
            int64_t ahead_bytes = 0, tile_lines = 0;
            if (next >= 0) {
                const int64_t next_panels = last - next < VNNI_PANELS ? last - next : VNNI_PANELS;
                ahead_bytes = next_panels * kp * PANEL;
                tile_lines = (ahead_bytes / 64 + tiles - 1) / tiles;
                t.lines_per_step = (tile_lines + kp / GROUP - 1) / (kp / GROUP);
            }
            for (int64_t r = r0, tile = 0; r < r0 + rows; r += VNNI_ROWS, tile++) {
                const int mr = (int)(r0 + rows - r < VNNI_ROWS ? r0 + rows - r : VNNI_ROWS);
                t.ahead = NULL;
                if (next >= 0 && tile * tile_lines * 64 < ahead_bytes) {
                    t.ahead = (const char *)(packed + next * kp * PANEL) + tile * tile_lines * 64;
                    const int64_t left = (ahead_bytes - tile * tile_lines * 64 + 63) / 64;
                    t.ahead_lines = left < tile_lines ? left : tile_lines;
                }
                t.qu = job->qu + r * kp;
                t.row_scales = job->row_scales + r;
                t.out = out + (r * a->out_stride + p * width) * esize;
                vnni_tiles[mr - 1][nr - 1](&t);
            }
        }
    }
    return 0;
}

int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    if (args->rows <= 0 || args->out_features <= 0) return 0;
    if (args->swiglu && args->is_bf16) mq_silu_bf16_ready();
    const int64_t M = args->rows, kp = padded_k(args->in_features);
    /* The scratch (mqinfer_qlinear_scratch_size) holds 2 x kp bytes per row; this kernel uses
       one row of q + 128 and the scale. */
    vnni_job job = {args, (uint8_t *)args->scratch, NULL, kp};
    job.row_scales = (float *)(job.qu + 2 * M * kp);
    const int64_t width = panel_width(args->swiglu != 0);
    const int64_t groups = ((args->out_features + width - 1) / width + VNNI_PANELS - 1) / VNNI_PANELS;
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    /* Quantizing a row costs about as much as a few panels of its product: worth the pool
       only for many rows. */
    const int64_t qparts = M >= 64 ? (threads < M ? threads : M) : 1;
    if (mq_parallel(vnni_quantize_part, &job, (int)qparts, num_threads)) return -1;
    const int64_t parts = threads < groups ? threads : groups;
    return mq_parallel(vnni_part, &job, (int)parts, num_threads) ? -1 : 0;
}

#else

/* Without AVX2, or with AVX-512 but no VNNI, the callers use the PyTorch path. */
int mqinfer_qlinear_available(void) { return 0; }
int mqinfer_qlinear_takes_bf16(void) { return 0; }

int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads) {
    (void)args; (void)num_threads;
    return -2;
}

#endif
