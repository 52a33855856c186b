
/* Fused elementwise kernels of the decoder, the greedy argmax and the token bitmask, row-parallel. Numerics
   follow PyTorch's CPU path rounding step by rounding step (see kernels/cpu_ops.py): every
   intermediate PyTorch rounds to the activation dtype is rounded here too, and the only fused
   multiply-adds are the fmaf calls and FMA intrinsics written out below. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mqinfer_native.h"
#include "native_common.h"
#include "silu_exp.h"

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
/* Round to nearest even, NaN to the canonical quiet NaN: what c10::BFloat16 does. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define LD_F32(p, i) (((const float *)(p))[i])
#define ST_F32(p, i, v) (((float *)(p))[i] = (v))
#define RD_F32(v) (v)
#define LD_BF16(p, i) bf16_to_float(((const uint16_t *)(p))[i])
#define ST_BF16(p, i, v) (((uint16_t *)(p))[i] = float_to_bf16(v))
#define RD_BF16(v) round_bf16(v)

/* ------------------------------------------------------------------ greedy argmax */
static int64_t argmax_row_scalar(const void *x, int64_t cols, int is_bf16) {
    int64_t best_i = 0;
    float best = is_bf16 ? LD_BF16(x, 0) : LD_F32(x, 0);
    if (best != best) return 0;
    for (int64_t i = 1; i < cols; i++) {
        const float v = is_bf16 ? LD_BF16(x, i) : LD_F32(x, i);
        if (v != v) return i;  /* torch: the first NaN is the maximum */
        if (v > best) { best = v; best_i = i; }
    }
    return best_i;
}

#ifdef __AVX512F__
static inline __m512 load16(const void *x, int64_t i, int is_bf16) {
    if (is_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

/* One pass: per lane the first index of its maximum, then the smallest index among the lanes
   holding the overall maximum; NaN anywhere sends the row to the scalar loop. */
static int64_t argmax_row(const void *x, int64_t cols, int is_bf16) {
    if (cols < 16 || cols >= ((int64_t)1 << 31)) return argmax_row_scalar(x, cols, is_bf16);
    const int64_t body = cols & ~(int64_t)15;
    __m512 best = load16(x, 0, is_bf16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i best_idx = idx;
    for (int64_t i = 16; i < body; i += 16) {
        const __m512 v = load16(x, i, is_bf16);
        idx = _mm512_add_epi32(idx, step);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    }
    if (nan) return argmax_row_scalar(x, cols, is_bf16);
    float m = _mm512_reduce_max_ps(best);
    const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    int64_t best_i = _mm512_mask_reduce_min_epi32(at_max, best_idx);
    for (int64_t i = body; i < cols; i++) {
        const float v = is_bf16 ? LD_BF16(x, i) : LD_F32(x, i);
        if (v != v) return argmax_row_scalar(x, cols, is_bf16);
        if (v > m) { m = v; best_i = i; }
    }
    return best_i;
}
#else
#define argmax_row argmax_row_scalar
#endif

static int argmax_range(const void *p, int64_t begin, int64_t end) {
    const mqinfer_argmax_args *a = (const mqinfer_argmax_args *)p;
    const int64_t elem = a->is_bf16 ? 2 : 4;
    for (int64_t r = begin; r < end; r++)
        a->out[r] = argmax_row((const char *)a->x + r * a->row_stride * elem, a->cols, a->is_bf16);
    return 0;
}

void mqinfer_argmax(const mqinfer_argmax_args *args, int num_threads) {
    parallel_rows(argmax_range, args, args->rows, num_threads);
}

/* ------------------------------------------------------------------ token bitmask */
/* One pass over the masked rows, a word (32 columns) at a time: an all-ones word (a string's
   body allows almost every token) is skipped, an all-zeros word is filled, only mixed words
   look at their bits. */
static void bitmask_row(char *x, const uint32_t *words, int64_t num_words, int64_t cols, int is_bf16) {
    const float ninf = -INFINITY;
    const uint16_t ninf_bf16 = 0xff80u;
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
        const int64_t w = c0 / 32;
        const uint32_t bits = w < num_words ? words[w] : 0u;
        if (bits == 0xffffffffu) continue;
        const int64_t lim = cols - c0 < 32 ? cols - c0 : 32;
        for (int64_t b = 0; b < lim; b++) {
            if ((bits >> b) & 1u) continue;
            if (is_bf16) ((uint16_t *)x)[c0 + b] = ninf_bf16;
            else ((float *)x)[c0 + b] = ninf;
        }
    }
}

static int bitmask_range(const void *p, int64_t begin, int64_t end) {
    const mqinfer_bitmask_args *a = (const mqinfer_bitmask_args *)p;
    const int64_t elem = a->is_bf16 ? 2 : 4;
    for (int64_t i = begin; i < end; i++)
        bitmask_row((char *)a->x + a->rows[i] * a->row_stride * elem,
                    (const uint32_t *)(a->bitmask + i * a->words), a->words, a->cols, a->is_bf16);
    return 0;
}

void mqinfer_apply_bitmask(const mqinfer_bitmask_args *args, int num_threads) {
    parallel_rows(bitmask_range, args, args->n, num_threads);
}

/* ------------------------------------------------------------------ typed helpers */
#define LD_f32(p, i) ((p)[i])
#define ST_f32(p, i, v) ((p)[i] = (v))
#define RD_f32(v) (v)
#define LD_bf16(p, i) bf16_to_float((p)[i])
#define ST_bf16(p, i, v) ((p)[i] = float_to_bf16(v))
#define RD_bf16(v) round_bf16(v)
typedef float T_f32;
typedef uint16_t T_bf16;

#ifdef __AVX512F__
/* 16-lane versions of the helpers above, the same operations in the same order (so a row's
   vector body and its scalar tail agree bit for bit); RMSNorm and SiLU use them. */
static inline __m512 load_f32x16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512i bf16_bits16(__m512 v) {  /* round to nearest even, in the low 16 bits */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
static inline void store_f32x16(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 keep_f32x16(__m512 v) { return v; }
#endif

/* ------------------------------------------------------------------ residual add + RMSNorm */
/* Sum of squares in the order of PyTorch's sum over a contiguous float row (SumKernel's
   cascade_sum, which this PyTorch runs on 8-float vectors): four interleaved vector
   accumulators with a cascade every 16 steps, leftover vectors into the first, the four folded
   together, then the scalar tail and the 8 lanes added one by one; rows shorter than a vector
   use four interleaved scalars. x.pow(2).mean(-1) then agrees with PyTorch bit for bit. */
#define SUM_LANES 8
static float sum_squares_scalar(const float *x, int64_t n) {
    if (n < SUM_LANES) {
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t i = 0;
        for (; i + 4 <= n; i += 4)
            for (int k = 0; k < 4; k++) { const float s = x[i + k] * x[i + k]; p[k] += s; }
        for (; i < n; i++) { const float s = x[i] * x[i]; p[0] += s; }
        return ((p[0] + p[1]) + p[2]) + p[3];
    }
    const int64_t vec_size = n / SUM_LANES, size_ilp = vec_size / 4;
    float acc[4][4][SUM_LANES];
    memset(acc, 0, sizeof(acc));
    const int64_t step = 16, mask = step - 1, power = 4;
    int64_t i = 0;
    for (; i + step <= size_ilp;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < SUM_LANES; l++) {
                    const float v = x[(i * 4 + k) * SUM_LANES + l];
                    const float s = v * v;
                    acc[0][k][l] += s;
                }
        for (int lev = 1; lev < 4; lev++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < SUM_LANES; l++) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (lev * power))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < SUM_LANES; l++) {
                const float v = x[(i * 4 + k) * SUM_LANES + l];
                const float s = v * v;
                acc[0][k][l] += s;
            }
    for (int lev = 1; lev < 4; lev++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < SUM_LANES; l++) acc[0][k][l] += acc[lev][k][l];
    for (int64_t v = size_ilp * 4; v < vec_size; v++)
        for (int l = 0; l < SUM_LANES; l++) {
            const float e = x[v * SUM_LANES + l];
            const float s = e * e;
            acc[0][0][l] += s;
        }
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vec_size * SUM_LANES; e < n; e++) { const float s = x[e] * x[e]; total += s; }
    for (int l = 0; l < SUM_LANES; l++) total += acc[0][0][l];
    return total;
}

#ifdef __AVX2__
/* sum_squares_scalar with each group of 8 lanes in one register: the same multiplies and adds,
   lane for lane, in the same order (the multiply and the add kept apart), hence the same sum. */
static float sum_squares(const float *x, int64_t n) {
    if (n < SUM_LANES) return sum_squares_scalar(x, n);
    const int64_t vec_size = n / SUM_LANES, size_ilp = vec_size / 4;
    __m256 acc[4][4];
    for (int lev = 0; lev < 4; lev++)
        for (int k = 0; k < 4; k++) acc[lev][k] = _mm256_setzero_ps();
    const int64_t step = 16, mask = step - 1, power = 4;
    int64_t i = 0;
    for (; i + step <= size_ilp;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_loadu_ps(x + (i * 4 + k) * SUM_LANES);
                acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_mul_ps(v, v));
            }
        for (int lev = 1; lev < 4; lev++) {
            for (int k = 0; k < 4; k++) {
                acc[lev][k] = _mm256_add_ps(acc[lev][k], acc[lev - 1][k]);
                acc[lev - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (lev * power))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++) {
            const __m256 v = _mm256_loadu_ps(x + (i * 4 + k) * SUM_LANES);
            acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_mul_ps(v, v));
        }
    for (int lev = 1; lev < 4; lev++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[lev][k]);
    for (int64_t v = size_ilp * 4; v < vec_size; v++) {
        const __m256 e = _mm256_loadu_ps(x + v * SUM_LANES);
        acc[0][0] = _mm256_add_ps(acc[0][0], _mm256_mul_ps(e, e));
    }
    for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float lanes[SUM_LANES];
    _mm256_storeu_ps(lanes, acc[0][0]);
    float total = 0.0f;
    for (int64_t e = vec_size * SUM_LANES; e < n; e++) { const float s = x[e] * x[e]; total += s; }
    for (int l = 0; l < SUM_LANES; l++) total += lanes[l];
    return total;
}
#else
#define sum_squares sum_squares_scalar
#endif

/* The elementwise loops of a bfloat16 row, 16 lanes at a time where AVX-512 is there (the
   same operations per element as the scalar loops that finish the row, hence the same bits):
   RMS_ADD_BODY is h = round(residual + delta) into buf and residual, RMS_SCALE_BODY is
   out = weight * round(buf * r). Nothing for float32 rows, whose loops the compiler vectorises. */
#ifdef __AVX512F__
#define RMS_ADD_BODY_bf16(res, d, buf, H, i)                                                 \
    for (; i + 16 <= H; i += 16) {                                                           \
        const __m512 sum = _mm512_add_ps(load_bf16x16(res + i), load_bf16x16(d + i));         \
        _mm512_storeu_ps(buf + i, round_bf16x16(sum));                                       \
        store_bf16x16(res + i, sum);                                                         \
    }
#define RMS_SCALE_BODY_bf16(buf, w, r, o, H, i)                                              \
    for (; i + 16 <= H; i += 16) {                                                           \
        const __m512 y = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), _mm512_set1_ps(r))); \
        store_bf16x16(o + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), y));                      \
    }
#else
#define RMS_ADD_BODY_bf16(res, d, buf, H, i)
#define RMS_SCALE_BODY_bf16(buf, w, r, o, H, i)
#endif
#define RMS_ADD_BODY_f32(res, d, buf, H, i)
#define RMS_SCALE_BODY_f32(buf, w, r, o, H, i)

/* residual <- residual + delta (when delta is given), out <- rms_norm(residual) * weight, with
   PyTorch's roundings: the sum rounded to T, the normalised row rounded to T before the
   weight multiplies it, the product rounded to T. */
#define DEFINE_ADD_RMS_NORM(TY)                                                              \
static int add_rms_norm_##TY(const void *p, int64_t begin, int64_t end) {                    \
    const mqinfer_rms_norm_args *a = (const mqinfer_rms_norm_args *)p;                       \
    const int64_t H = a->hidden;                                                             \
    float *buf = (float *)malloc(sizeof(float) * 2 * H);                                     \
    if (!buf) return -1;                                                                     \
    float *w = buf + H;                                                                      \
    const T_##TY *weight = (const T_##TY *)a->weight;                                        \
    for (int64_t i = 0; i < H; i++) w[i] = LD_##TY(weight, i);                               \
    for (int64_t t = begin; t < end; t++) {                                                  \
        T_##TY *res = (T_##TY *)a->residual + t * a->residual_stride;                        \
        T_##TY *o = (T_##TY *)a->out + t * H;                                                \
        if (a->delta) {                                                                      \
            const T_##TY *d = (const T_##TY *)a->delta + t * a->delta_stride;                \
            int64_t i = 0;                                                                   \
            RMS_ADD_BODY_##TY(res, d, buf, H, i)                                             \
            for (; i < H; i++) {                                                             \
                const float h = RD_##TY(LD_##TY(res, i) + LD_##TY(d, i));                    \
                buf[i] = h;                                                                  \
                ST_##TY(res, i, h);                                                          \
            }                                                                                \
        } else {                                                                             \
            for (int64_t i = 0; i < H; i++) buf[i] = LD_##TY(res, i);                        \
        }                                                                                    \
        const float var = sum_squares(buf, H) / (float)H;                                    \
        const float r = 1.0f / sqrtf(var + a->eps);                                          \
        int64_t i = 0;                                                                       \
        RMS_SCALE_BODY_##TY(buf, w, r, o, H, i)                                              \
        for (; i < H; i++) {                                                                 \
            const float y = RD_##TY(buf[i] * r);                                             \
            ST_##TY(o, i, w[i] * y);                                                         \
        }                                                                                    \
    }                                                                                        \
    free(buf);                                                                               \
    return 0;                                                                                \
}
DEFINE_ADD_RMS_NORM(f32)
DEFINE_ADD_RMS_NORM(bf16)

int mqinfer_add_rms_norm(const mqinfer_rms_norm_args *args, int num_threads) {
    return parallel_rows(args->is_bf16 ? add_rms_norm_bf16 : add_rms_norm_f32, args, args->rows,
                         num_threads) ? -1 : 0;
}

/* ------------------------------------------------------------------ SiLU(gate) * up */
/* exp_f32, and exp_f32x8 / exp_f32x16 with AVX2 / AVX-512: silu_exp.h. */
#ifdef __AVX512F__
#define LDV_f32(p) load_f32x16(p)
#define STV_f32(p, v) store_f32x16(p, v)
#define RDV_f32(v) keep_f32x16(v)
#define LDV_bf16(p) load_bf16x16(p)
#define STV_bf16(p, v) store_bf16x16(p, v)
#define RDV_bf16(v) round_bf16x16(v)

#define SILU_MUL_BODY(TY, g, u, o, I, i)                                                     \
    for (; i + 16 <= I; i += 16) {                                                           \
        const __m512 x = LDV_##TY(g + i);                                                    \
        const __m512 e = exp_f32x16(_mm512_xor_ps(x, _mm512_set1_ps(-0.0f)));                  \
        const __m512 s = RDV_##TY(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e))); \
        STV_##TY(o + i, _mm512_mul_ps(s, LDV_##TY(u + i)));                                  \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* 8-lane versions of the helpers above, the same operations in the same order (so a row's
   vector body and its scalar tail agree bit for bit). */
static inline __m256 load_f32x8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_bf16x8(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256i bf16_bits8(__m256 v) {  /* round to nearest even, in the low 16 bits */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
static inline __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
static inline void store_bf16x8(uint16_t *p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
static inline void store_f32x8(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 keep_f32x8(__m256 v) { return v; }
#define LDV_f32(p) load_f32x8(p)
#define STV_f32(p, v) store_f32x8(p, v)
#define RDV_f32(v) keep_f32x8(v)
#define LDV_bf16(p) load_bf16x8(p)
#define STV_bf16(p, v) store_bf16x8(p, v)
#define RDV_bf16(v) round_bf16x8(v)

#define SILU_MUL_BODY(TY, g, u, o, I, i)                                                     \
    for (; i + 8 <= I; i += 8) {                                                             \
        const __m256 x = LDV_##TY(g + i);                                                    \
        const __m256 e = exp_f32x8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));                  \
        const __m256 s = RDV_##TY(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e))); \
        STV_##TY(o + i, _mm256_mul_ps(s, LDV_##TY(u + i)));                                  \
    }
#else
#define SILU_MUL_BODY(TY, g, u, o, I, i)
#endif

/* PyTorch runs SiLU's vector code on whole pairs of vectors of each row (vector_chunk values:
   with AVX-512, 32 float or 64 bfloat16; with AVX2, half that) and std::exp on the rest; so
   do we. */
#define DEFINE_SILU_MUL(TY)                                                                  \
static int silu_mul_##TY(const void *p, int64_t begin, int64_t end) {                        \
    const mqinfer_silu_mul_args *a = (const mqinfer_silu_mul_args *)p;                       \
    const int64_t I = a->inter, chunk = a->vector_chunk;                                     \
    const int64_t body = chunk > 0 ? I / chunk * chunk : 0;                                  \
    for (int64_t t = begin; t < end; t++) {                                                  \
        const T_##TY *g = (const T_##TY *)a->gate_up + t * a->stride;                        \
        const T_##TY *u = g + I;                                                             \
        T_##TY *o = (T_##TY *)a->out + t * I;                                                \
        int64_t i = 0;                                                                       \
        SILU_MUL_BODY(TY, g, u, o, body, i)                                                  \
        for (; i < body; i++) {                                                              \
            const float x = LD_##TY(g, i);                                                   \
            const float s = RD_##TY(x / (1.0f + exp_f32(-x)));                               \
            ST_##TY(o, i, s * LD_##TY(u, i));                                                \
        }                                                                                    \
        for (; i < I; i++) {                                                                 \
            const float x = LD_##TY(g, i);                                                   \
            const float s = RD_##TY(x / (1.0f + expf(-x)));                                  \
            ST_##TY(o, i, s * LD_##TY(u, i));                                                \
        }                                                                                    \
    }                                                                                        \
    return 0;                                                                                \
}
DEFINE_SILU_MUL(f32)
DEFINE_SILU_MUL(bf16)

void mqinfer_silu_mul(const mqinfer_silu_mul_args *args, int num_threads) {
    parallel_rows(args->is_bf16 ? silu_mul_bf16 : silu_mul_f32, args, args->rows, num_threads);
}

/* ------------------------------------------------------------------ 8-bit KV rows */
/* The quantizing store of kv_quant.quantize_kv, operation for operation: scale = max|x| / QMAX
   (one float32 division, as PyTorch's tensor / scalar is) rounded up to the bfloat16 that is
   stored, divisor = that scale or 1 for an all-zero row, each value x / divisor (a true division: PyTorch divides, it does not
   multiply by a reciprocal), clamped to [-QMAX, QMAX], then rounded to nearest even into int8
   or converted to float8 e4m3. The maximum is exact in any order, so the vector and scalar
   versions agree bit for bit. Inputs are taken as finite (a NaN or infinity in a row is not
   held to PyTorch's result). */
#define KV_QUANT_INT8 1
#define KV_QUANT_FP8 2

static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> float8 e4m3fn, round to nearest even: c10's fp8e4m3fn_from_fp32_value, which
   PyTorch's float32 -> float8_e4m3fn conversion is. Magnitudes below 2^-6 (e4m3's subnormals)
   round through a float addition of 2^14, whose low bits are then the code; from 480 up (past
   448's rounding interval) and NaN give the NaN code 0x7f; the sign goes on last. */
#define E4M3_SUBNORMAL_BELOW (121u << 23)  /* 2^-6 */
#define E4M3_NAN_FROM (1087u << 20)        /* 480 */
#define E4M3_DENORM_ADD (141u << 23)       /* 2^14 */
#define E4M3_REBIAS ((uint32_t)(7 - 127) << 23)
static inline uint8_t float_to_e4m3(float f) {
    uint32_t u = float_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t code;
    if (u >= E4M3_NAN_FROM) {
        code = 0x7f;
    } else if (u < E4M3_SUBNORMAL_BELOW) {
        code = (uint8_t)(float_bits(bits_float(u) + bits_float(E4M3_DENORM_ADD)) - E4M3_DENORM_ADD);
    } else {
        const uint32_t mant_odd = (u >> 20) & 1u;
        code = (uint8_t)((u + E4M3_REBIAS + 0x7ffffu + mant_odd) >> 20);
    }
    return (uint8_t)(code | (sign >> 24));
}

#ifdef __AVX2__
/* float_to_e4m3 on 8 lanes, each code in the low byte of its 32-bit lane. */
static inline __m256i e4m3_codes8(__m256 y) {
    const __m256i u0 = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(u0, _mm256_set1_epi32((int)0x80000000u));
    const __m256i u = _mm256_xor_si256(u0, sign);
    const __m256i denorm = _mm256_set1_epi32((int)E4M3_DENORM_ADD);
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(denorm))), denorm);
    const __m256i mant_odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32((int)(E4M3_REBIAS + 0x7ffffu))), mant_odd), 20);
    /* u has no sign bit, so signed comparisons order it as unsigned. */
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)E4M3_SUBNORMAL_BELOW), u);
    const __m256i is_nan = _mm256_cmpgt_epi32(u, _mm256_set1_epi32((int)E4M3_NAN_FROM - 1));
    __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);
    code = _mm256_and_si256(code, _mm256_set1_epi32(0xff));
    return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

/* 8 int32 lanes (int8 values in -127..127, or e4m3 codes in 0..255) to 8 bytes in order. */
static inline void store_bytes8(uint8_t *dst, __m256i lanes, int is_signed) {
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    const __m128i bytes = is_signed ? _mm_packs_epi16(words, words) : _mm_packus_epi16(words, words);
    _mm_storel_epi64((__m128i *)dst, bytes);
}
#endif

/* A non-negative float32 rounded up (toward +infinity) to bfloat16, as kv_quant.scale_up_to_bfloat16. */
static inline uint16_t bf16_round_up(float f) {
    const uint32_t u = float_bits(f);
    return (uint16_t)((u >> 16) + ((u & 0xffffu) != 0));
}

/* Quantizes the D floats of x into dst (int8 or e4m3 bytes) and writes the row's scale. */
static void quantize_row(const float *x, int64_t D, int kv_quant, uint8_t *dst, uint16_t *scale_out) {
    const float qmax = kv_quant == KV_QUANT_INT8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    int64_t d = 0;
#ifdef __AVX2__
    if (D >= 8) {
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m = _mm256_setzero_ps();
        for (; d + 8 <= D; d += 8) m = _mm256_max_ps(m, _mm256_and_ps(abs_mask, _mm256_loadu_ps(x + d)));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    }
#endif
    for (; d < D; d++) { const float v = fabsf(x[d]); amax = v > amax ? v : amax; }
    const uint16_t scale_bits = bf16_round_up(amax / qmax);
    const float scale = bits_float((uint32_t)scale_bits << 16);
    const float divisor = scale > 0.0f ? scale : 1.0f;
    *scale_out = scale_bits;
    d = 0;
#ifdef __AVX2__
    {
        const __m256 div = _mm256_set1_ps(divisor), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
        for (; d + 8 <= D; d += 8) {
            /* min / max take their second operand when one is NaN: a NaN quotient stays NaN, as
               with PyTorch's clamp. */
            const __m256 y = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(_mm256_loadu_ps(x + d), div)));
            if (kv_quant == KV_QUANT_INT8)
                store_bytes8(dst + d, _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), 1);
            else
                store_bytes8(dst + d, e4m3_codes8(y), 0);
        }
    }
#endif
    for (; d < D; d++) {
        float y = x[d] / divisor;
        y = y < -qmax ? -qmax : y;
        y = y > qmax ? qmax : y;
        if (kv_quant == KV_QUANT_INT8) dst[d] = (uint8_t)(int8_t)nearbyintf(y);
        else dst[d] = float_to_e4m3(y);
    }
}

/* ------------------------------------------------------------------ rotary + KV store */
/* x*cos + rotate_half(x)*sin with each product and the sum rounded to T (PyTorch's order);
   q heads are rotated in place, k heads go to their cache slot, v is copied to its slot. An
   8-bit cache (kv_quant) gets each k row as rotated and rounded to T, and each v row, through
   quantize_row: the bytes and scale kv_quant.store_kv writes for those rows. */
#define DEFINE_ROTARY(TY)                                                                    \
static int rotary_##TY(const void *p, int64_t begin, int64_t end) {                          \
    const mqinfer_rotary_args *a = (const mqinfer_rotary_args *)p;                           \
    const int64_t D = a->head_dim, half = D / 2, hq = a->num_q_heads, hkv = a->num_kv_heads; \
    const int quant = a->kv_quant;                                                           \
    float *buf = (float *)malloc(sizeof(float) * 4 * D);                                     \
    if (!buf) return -1;                                                                     \
    float *c = buf, *s = buf + D, *x = buf + 2 * D, *y = buf + 3 * D;                        \
    for (int64_t t = begin; t < end; t++) {                                                  \
        const int64_t pos = a->positions[t], slot = a->slots[t];                             \
        for (int64_t d = 0; d < D; d++) {                                                    \
            c[d] = RD_##TY(a->cos[pos * D + d]);                                             \
            s[d] = RD_##TY(a->sin[pos * D + d]);                                             \
        }                                                                                    \
        for (int64_t h = 0; h < hq + hkv; h++) {                                             \
            T_##TY *src = (T_##TY *)a->qk + t * a->qk_stride + h * D;                        \
            for (int64_t d = 0; d < D; d++) x[d] = LD_##TY(src, d);                          \
            if (h >= hq && quant) {                                                          \
                for (int64_t d = 0; d < half; d++) {                                         \
                    const float xc = RD_##TY(x[d] * c[d]);                                   \
                    const float rs = RD_##TY(-x[d + half] * s[d]);                           \
                    y[d] = RD_##TY(xc + rs);                                                 \
                }                                                                            \
                for (int64_t d = half; d < D; d++) {                                         \
                    const float xc = RD_##TY(x[d] * c[d]);                                   \
                    const float rs = RD_##TY(x[d - half] * s[d]);                            \
                    y[d] = RD_##TY(xc + rs);                                                 \
                }                                                                            \
                const int64_t row = slot * hkv + h - hq;                                     \
                quantize_row(y, D, quant, (uint8_t *)a->k_cache + row * D, a->k_scale + row); \
                continue;                                                                    \
            }                                                                                \
            T_##TY *dst = h < hq ? src : (T_##TY *)a->k_cache + (slot * hkv + h - hq) * D;   \
            for (int64_t d = 0; d < half; d++) {                                             \
                const float xc = RD_##TY(x[d] * c[d]);                                       \
                const float rs = RD_##TY(-x[d + half] * s[d]);                               \
                ST_##TY(dst, d, xc + rs);                                                    \
            }                                                                                \
            for (int64_t d = half; d < D; d++) {                                             \
                const float xc = RD_##TY(x[d] * c[d]);                                       \
                const float rs = RD_##TY(x[d - half] * s[d]);                                \
                ST_##TY(dst, d, xc + rs);                                                    \
            }                                                                                \
        }                                                                                    \
        const T_##TY *v = (const T_##TY *)a->v + t * a->v_stride;                            \
        if (!quant) {                                                                        \
            memcpy((T_##TY *)a->v_cache + slot * hkv * D, v, sizeof(T_##TY) * hkv * D);       \
            continue;                                                                        \
        }                                                                                    \
        for (int64_t h = 0; h < hkv; h++) {                                                  \
            for (int64_t d = 0; d < D; d++) y[d] = LD_##TY(v, h * D + d);                    \
            const int64_t row = slot * hkv + h;                                              \
            quantize_row(y, D, quant, (uint8_t *)a->v_cache + row * D, a->v_scale + row);    \
        }                                                                                    \
    }                                                                                        \
    free(buf);                                                                               \
    return 0;                                                                                \
}
DEFINE_ROTARY(f32)
DEFINE_ROTARY(bf16)

int mqinfer_rotary_store_kv(const mqinfer_rotary_args *args, int num_threads) {
    return parallel_rows(args->is_bf16 ? rotary_bf16 : rotary_f32, args, args->rows,
                         num_threads) ? -1 : 0;
}
