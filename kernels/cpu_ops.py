"""Fused elementwise CPU kernels of the decoder and the greedy argmax, in C, with PyTorch
fallbacks that are also their reference.

Owns ``add_rms_norm`` (residual add + RMSNorm in one pass), ``silu_mul`` (SwiGLU's
``silu(gate) * up`` from the fused gate/up projection), ``rotary_store_kv`` (rotary embedding
of q and k, written in place for q and straight into the paged cache for k, with v copied to
its cache slot) and ``greedy_argmax`` (first index of each row's maximum).

Why. On one CPU thread the PyTorch versions of these ops run as 4-8 separate passes over the
activations each (upcast, square, mean, rsqrt, multiply, downcast, weight; neg, cat, two
multiplies and an add for rotary), and ``max(dim=-1)`` over a ``[256, 32000]`` bfloat16 logits
tensor costs ~7 ms a step where a vectorised pass costs well under 1 ms.

Numerics follow the PyTorch path rounding step by rounding step: every intermediate that
PyTorch rounds to the activation dtype is rounded here too (bfloat16: round to nearest even),
and the library is built with ``-ffp-contract=off`` so no multiply-add is fused behind our
back. RMSNorm's sum of squares follows PyTorch's summation order and SiLU uses the
exponential PyTorch's vectorised SiLU uses, so on this PyTorch every kernel here gives the
PyTorch results bit for bit (the tests hold them to that); a PyTorch that sums or
exponentiates differently would make a last-place difference, nothing worse.

Built with the same machinery as the native attention kernel (``build_native_library``: the
system C compiler, cached per machine, no ``-ffast-math``). ``MQINFER_CPU_OPS=torch`` forces
the PyTorch path; ``=native`` makes a missing kernel an error; the default ``auto`` uses the
kernels for contiguous float32 / bfloat16 CPU tensors when they build.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading

import torch
import torch.nn.functional as F

from mqinfer.kernels.attention import build_native_library

log = logging.getLogger(__name__)

# Below this many elements a call stays on one thread: starting threads costs more.
_PARALLEL_MIN_ELEMENTS = 1 << 16

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

/* ------------------------------------------------------------------ threads */
typedef void (*range_fn)(const void *args, int64_t begin, int64_t end);
typedef struct { range_fn fn; const void *args; int64_t begin, end; } range_job;

static void *run_range(void *p) {
    range_job *j = (range_job *)p;
    j->fn(j->args, j->begin, j->end);
    return NULL;
}

/* fn over rows 0..rows-1, cut into num_threads equal runs; a run whose thread could not start
   is done on this thread, so the result is complete either way. */
static void parallel_rows(range_fn fn, const void *args, int64_t rows, int num_threads) {
    if (num_threads > 64) num_threads = 64;
    if (num_threads > rows) num_threads = (int)rows;
    if (num_threads <= 1) { fn(args, 0, rows); return; }
    range_job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int n = 0; n < num_threads; n++) {
        jobs[n].fn = fn; jobs[n].args = args;
        jobs[n].begin = rows * n / num_threads; jobs[n].end = rows * (n + 1) / num_threads;
    }
    for (int n = 1; n < num_threads; n++)
        started[n] = pthread_create(&threads[n], NULL, run_range, &jobs[n]) == 0;
    run_range(&jobs[0]);
    for (int n = 1; n < num_threads; n++) {
        if (started[n]) pthread_join(threads[n], NULL); else run_range(&jobs[n]);
    }
}

/* ------------------------------------------------------------------ greedy argmax */
typedef struct {
    const void *x; int64_t cols, row_stride; int is_bf16; int64_t *out;
} argmax_args;

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

static void argmax_range(const void *p, int64_t begin, int64_t end) {
    const argmax_args *a = (const argmax_args *)p;
    const int64_t elem = a->is_bf16 ? 2 : 4;
    for (int64_t r = begin; r < end; r++)
        a->out[r] = argmax_row((const char *)a->x + r * a->row_stride * elem, a->cols, a->is_bf16);
}

void mqinfer_argmax(const void *x, int64_t rows, int64_t cols, int64_t row_stride, int is_bf16,
                    int64_t *out, int num_threads) {
    argmax_args a = {x, cols, row_stride, is_bf16, out};
    parallel_rows(argmax_range, &a, rows, num_threads);
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

/* ------------------------------------------------------------------ residual add + RMSNorm */
typedef struct {
    void *residual; const void *delta; const void *weight; void *out;
    int64_t hidden, residual_stride, delta_stride; float eps; int failed;
} norm_args;

/* Sum of squares in the order of PyTorch's sum over a contiguous float row (SumKernel's
   cascade_sum, which this PyTorch runs on 8-float vectors): four interleaved vector
   accumulators with a cascade every 16 steps, leftover vectors into the first, the four folded
   together, then the scalar tail and the 8 lanes added one by one; rows shorter than a vector
   use four interleaved scalars. x.pow(2).mean(-1) then agrees with PyTorch bit for bit. */
#define SUM_LANES 8
static float sum_squares(const float *x, int64_t n) {
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

/* residual <- residual + delta (when delta is given), out <- rms_norm(residual) * weight, with
   PyTorch's roundings: the sum rounded to T, the normalised row rounded to T before the
   weight multiplies it, the product rounded to T. */
#define DEFINE_ADD_RMS_NORM(TY)                                                              \
static void add_rms_norm_##TY(const void *p, int64_t begin, int64_t end) {                   \
    norm_args *a = (norm_args *)p;                                                           \
    const int64_t H = a->hidden;                                                             \
    float *buf = (float *)malloc(sizeof(float) * 2 * H);                                     \
    if (!buf) { a->failed = 1; return; }                                                     \
    float *w = buf + H;                                                                      \
    const T_##TY *weight = (const T_##TY *)a->weight;                                        \
    for (int64_t i = 0; i < H; i++) w[i] = LD_##TY(weight, i);                               \
    for (int64_t t = begin; t < end; t++) {                                                  \
        T_##TY *res = (T_##TY *)a->residual + t * a->residual_stride;                        \
        T_##TY *o = (T_##TY *)a->out + t * H;                                                \
        if (a->delta) {                                                                      \
            const T_##TY *d = (const T_##TY *)a->delta + t * a->delta_stride;                \
            for (int64_t i = 0; i < H; i++) {                                                \
                const float h = RD_##TY(LD_##TY(res, i) + LD_##TY(d, i));                    \
                buf[i] = h;                                                                  \
                ST_##TY(res, i, h);                                                          \
            }                                                                                \
        } else {                                                                             \
            for (int64_t i = 0; i < H; i++) buf[i] = LD_##TY(res, i);                        \
        }                                                                                    \
        const float var = sum_squares(buf, H) / (float)H;                                    \
        const float r = 1.0f / sqrtf(var + a->eps);                                          \
        for (int64_t i = 0; i < H; i++) {                                                    \
            const float y = RD_##TY(buf[i] * r);                                             \
            ST_##TY(o, i, w[i] * y);                                                         \
        }                                                                                    \
    }                                                                                        \
    free(buf);                                                                               \
}
DEFINE_ADD_RMS_NORM(f32)
DEFINE_ADD_RMS_NORM(bf16)

int mqinfer_add_rms_norm(void *residual, const void *delta, const void *weight, void *out,
                         int64_t rows, int64_t hidden, int64_t residual_stride, int64_t delta_stride,
                         float eps, int is_bf16, int num_threads) {
    norm_args a = {residual, delta, weight, out, hidden, residual_stride, delta_stride, eps, 0};
    parallel_rows(is_bf16 ? add_rms_norm_bf16 : add_rms_norm_f32, &a, rows, num_threads);
    return a.failed ? -1 : 0;
}

/* ------------------------------------------------------------------ SiLU(gate) * up */
/* e^x as PyTorch's vectorised SiLU computes it (SLEEF's expf_u10: reduction by ln 2 in two
   fused multiply-adds, a degree-6 polynomial in fused multiply-adds, scaling by 2^q in two
   halves), so that silu agrees with F.silu bit for bit. */
static inline float pow2i_f32(int32_t q) {
    const int32_t bits = (q + 127) << 23; float f; memcpy(&f, &bits, 4); return f;
}
static inline float exp_f32(float d) {
    const float x = d < -104.0f ? -104.0f : (d > 104.0f ? 104.0f : d);
    const float q = rintf(x * 1.442695040888963407359924681001892137f);
    float s = fmaf(q, -0.693145751953125f, x);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int32_t qi = (int32_t)q, half = qi >> 1;
    u = u * pow2i_f32(half) * pow2i_f32(qi - half);
    if (d < -104.0f) u = 0.0f;
    if (d > 104.0f) u = INFINITY;
    return u;
}

typedef struct { const void *x; void *out; int64_t inter, stride; } silu_args;

#ifdef __AVX512F__
/* 16-lane versions of the helpers above, the same operations in the same order (so a row's
   vector body and its scalar tail agree bit for bit). */
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
#define LDV_f32(p) load_f32x16(p)
#define STV_f32(p, v) store_f32x16(p, v)
#define RDV_f32(v) keep_f32x16(v)
#define LDV_bf16(p) load_bf16x16(p)
#define STV_bf16(p, v) store_bf16x16(p, v)
#define RDV_bf16(v) round_bf16x16(v)

static inline __m512 pow2i_f32x16(__m512i q) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 23));
}
static inline __m512 exp_f32x16(__m512 d) {
    const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(104.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(d, lo, _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(d, hi, _CMP_GT_OQ);
    const __m512 x = _mm512_mask_mov_ps(_mm512_mask_mov_ps(d, under, lo), over, hi);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963407359924681001892137f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), x);
    s = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i qi = _mm512_cvtps_epi32(q), half = _mm512_srai_epi32(qi, 1);
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i_f32x16(half)), pow2i_f32x16(_mm512_sub_epi32(qi, half)));
    u = _mm512_mask_mov_ps(u, under, _mm512_setzero_ps());
    return _mm512_mask_mov_ps(u, over, _mm512_set1_ps(INFINITY));
}
#define SILU_MUL_BODY(TY, g, u, o, I, i)                                                     \
    for (; i + 16 <= I; i += 16) {                                                           \
        const __m512 x = LDV_##TY(g + i);                                                    \
        const __m512 e = exp_f32x16(_mm512_xor_ps(x, _mm512_set1_ps(-0.0f)));                  \
        const __m512 s = RDV_##TY(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e))); \
        STV_##TY(o + i, _mm512_mul_ps(s, LDV_##TY(u + i)));                                  \
    }
#else
#define SILU_MUL_BODY(TY, g, u, o, I, i)
#endif

/* PyTorch runs SiLU's vector code on whole pairs of vectors (32 float or 64 bfloat16 values)
   of each row and std::exp on the rest; so do we. */
#define DEFINE_SILU_MUL(TY, CHUNK)                                                           \
static void silu_mul_##TY(const void *p, int64_t begin, int64_t end) {                       \
    const silu_args *a = (const silu_args *)p;                                               \
    const int64_t I = a->inter, body = I / CHUNK * CHUNK;                                    \
    for (int64_t t = begin; t < end; t++) {                                                  \
        const T_##TY *g = (const T_##TY *)a->x + t * a->stride;                              \
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
}
DEFINE_SILU_MUL(f32, 32)
DEFINE_SILU_MUL(bf16, 64)

void mqinfer_silu_mul(const void *x, void *out, int64_t rows, int64_t inter, int64_t stride,
                      int is_bf16, int num_threads) {
    silu_args a = {x, out, inter, stride};
    parallel_rows(is_bf16 ? silu_mul_bf16 : silu_mul_f32, &a, rows, num_threads);
}

/* ------------------------------------------------------------------ rotary + KV store */
typedef struct {
    void *qk; const void *v; void *k_cache; void *v_cache;
    const float *cos, *sin; const int64_t *positions, *slots;
    int64_t qk_stride, v_stride, num_q_heads, num_kv_heads, head_dim; int failed;
} rotary_args;

/* x*cos + rotate_half(x)*sin with each product and the sum rounded to T (PyTorch's order);
   q heads are rotated in place, k heads go to their cache slot, v is copied to its slot. */
#define DEFINE_ROTARY(TY)                                                                    \
static void rotary_##TY(const void *p, int64_t begin, int64_t end) {                         \
    rotary_args *a = (rotary_args *)p;                                                       \
    const int64_t D = a->head_dim, half = D / 2, hq = a->num_q_heads, hkv = a->num_kv_heads; \
    float *buf = (float *)malloc(sizeof(float) * 3 * D);                                     \
    if (!buf) { a->failed = 1; return; }                                                     \
    float *c = buf, *s = buf + D, *x = buf + 2 * D;                                          \
    for (int64_t t = begin; t < end; t++) {                                                  \
        const int64_t pos = a->positions[t], slot = a->slots[t];                             \
        for (int64_t d = 0; d < D; d++) {                                                    \
            c[d] = RD_##TY(a->cos[pos * D + d]);                                             \
            s[d] = RD_##TY(a->sin[pos * D + d]);                                             \
        }                                                                                    \
        for (int64_t h = 0; h < hq + hkv; h++) {                                             \
            T_##TY *src = (T_##TY *)a->qk + t * a->qk_stride + h * D;                        \
            T_##TY *dst = h < hq ? src : (T_##TY *)a->k_cache + (slot * hkv + h - hq) * D;   \
            for (int64_t d = 0; d < D; d++) x[d] = LD_##TY(src, d);                          \
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
        memcpy((T_##TY *)a->v_cache + slot * hkv * D, (const T_##TY *)a->v + t * a->v_stride, \
               sizeof(T_##TY) * hkv * D);                                                    \
    }                                                                                        \
    free(buf);                                                                               \
}
DEFINE_ROTARY(f32)
DEFINE_ROTARY(bf16)

int mqinfer_rotary_store_kv(void *qk, const void *v, void *k_cache, void *v_cache,
                            const float *cos, const float *sin, const int64_t *positions,
                            const int64_t *slots, int64_t rows, int64_t qk_stride, int64_t v_stride,
                            int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int is_bf16,
                            int num_threads) {
    rotary_args a = {qk, v, k_cache, v_cache, cos, sin, positions, slots, qk_stride, v_stride,
                     num_q_heads, num_kv_heads, head_dim, 0};
    parallel_rows(is_bf16 ? rotary_bf16 : rotary_f32, &a, rows, num_threads);
    return a.failed ? -1 : 0;
}
"""

_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off",
          "-Werror=implicit-function-declaration")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _build() -> ctypes.CDLL:
    lib = build_native_library("cpu_ops", _SOURCE, _FLAGS)
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.mqinfer_argmax.argtypes = [ptr, i64, i64, i64, c_int, ptr, c_int]
    lib.mqinfer_argmax.restype = None
    lib.mqinfer_add_rms_norm.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_float, c_int, c_int]
    lib.mqinfer_add_rms_norm.restype = c_int
    lib.mqinfer_silu_mul.argtypes = [ptr, ptr, i64, i64, i64, c_int, c_int]
    lib.mqinfer_silu_mul.restype = None
    lib.mqinfer_rotary_store_kv.argtypes = [ptr] * 8 + [i64] * 6 + [c_int, c_int]
    lib.mqinfer_rotary_store_kv.restype = c_int
    return lib


def _mode() -> str:
    mode = os.environ.get("MQINFER_CPU_OPS", "auto")
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"MQINFER_CPU_OPS must be auto, native or torch, got {mode!r}")
    return mode


def _library() -> ctypes.CDLL | None:
    """The native library, or None when disabled or unbuildable (built on first call)."""
    mode = _mode()
    if mode == "torch":
        return None
    lib = _state.get("lib", False)
    if lib is False:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    _state["lib"] = None
                    _state["error"] = str(exc)
                    log.warning("native CPU ops unavailable, using the PyTorch path: %s", exc)
            lib = _state["lib"]
    if lib is None and mode == "native":
        raise RuntimeError(f"MQINFER_CPU_OPS=native but the kernels could not be built: {_state['error']}")
    return lib


def cpu_ops_available() -> bool:
    """Whether the native kernels are in use (False when disabled or no compiler)."""
    return _library() is not None


def native_for(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these tensors: CPU, one dtype, float32 or bfloat16."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype:
            return False
    return _library() is not None


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D with unit stride along the last dimension (rows may be strided)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]


# ------------------------------------------------------------------ greedy argmax
def reference_greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's largest value (the first NaN if a row has one), ``[B]`` int64:
    ``logits.max(dim=-1).indices``."""
    if not (logits.dim() == 2 and logits.shape[1] > 0 and _rows_ok(logits) and native_for(logits)):
        return reference_greedy_argmax(logits)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _state["lib"].mqinfer_argmax(
            logits.data_ptr(), rows, cols, logits.stride(0), int(logits.dtype == torch.bfloat16),
            out.data_ptr(), _threads(logits.numel()),
        )
    return out


# ------------------------------------------------------------------ residual add + RMSNorm
def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        residual = residual + delta
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return residual, weight * xf.to(residual.dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rms_norm(residual + delta) * weight)`` over the last dimension of
    ``[T, H]`` rows (``delta`` None: no add).

    The native kernel writes the sum into ``residual`` in place and returns it; use the
    returned tensor either way.
    """
    tensors = (residual, weight) if delta is None else (residual, delta, weight)
    if not (
        _rows_ok(residual) and (delta is None or (_rows_ok(delta) and delta.shape == residual.shape))
        and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == residual.shape[1]
        and native_for(*tensors)
    ):
        return reference_add_rms_norm(residual, delta, weight, eps)
    rows, hidden = residual.shape
    out = torch.empty(rows, hidden, dtype=residual.dtype)
    status = _state["lib"].mqinfer_add_rms_norm(
        residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        out.data_ptr(), rows, hidden, residual.stride(0), 0 if delta is None else delta.stride(0),
        eps, int(residual.dtype == torch.bfloat16), _threads(residual.numel()),
    )
    if status != 0:
        raise MemoryError("the native RMSNorm kernel could not allocate its buffer")
    return residual, out


# ------------------------------------------------------------------ SwiGLU
def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[T, 2 * I]``, gate first: ``[T, I]``."""
    if not (_rows_ok(gate_up) and gate_up.shape[1] % 2 == 0 and native_for(gate_up)):
        return reference_silu_mul(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _state["lib"].mqinfer_silu_mul(
        gate_up.data_ptr(), out.data_ptr(), rows, inter, gate_up.stride(0),
        int(gate_up.dtype == torch.bfloat16), _threads(gate_up.numel()),
    )
    return out


# ------------------------------------------------------------------ rotary + KV store
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary_store_kv(
    qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    from mqinfer.kernels.attention import store_kv

    cos = cos_table.index_select(0, positions).to(qk.dtype)[:, None, :]
    sin = sin_table.index_select(0, positions).to(qk.dtype)[:, None, :]
    qk = qk * cos + _rotate_half(qk) * sin
    store_kv(qk[:, num_q_heads:], v, k_cache, v_cache, slot_mapping)
    return qk[:, :num_q_heads]


def _heads_ok(t: torch.Tensor) -> bool:
    """[T, heads, D] with heads and elements contiguous (tokens may be strided)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


def rotary_store_kv(
    qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, trusted: bool = False,
) -> torch.Tensor:
    """Rotary embedding of ``qk`` (``[T, Hq + Hkv, D]``, q heads first) at ``positions`` from
    the float32 ``cos_table`` / ``sin_table`` (``[max_len, D]``); the rotated k and ``v``
    (``[T, Hkv, D]``) are written to the caches at ``slot_mapping``; returns the rotated q
    ``[T, Hq, D]``. The native kernel rotates q in place (the result is a view of ``qk``).

    ``trusted``: the caller has checked that ``positions`` fall inside the tables and
    ``slot_mapping`` inside the caches (the model does it once per step, not per layer)."""
    num_tokens, heads, head_dim = qk.shape
    ok = (
        _heads_ok(qk) and _heads_ok(v) and v.shape == (num_tokens, heads - num_q_heads, head_dim)
        and head_dim % 2 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape[-2:] == v.shape[1:] and v_cache.shape == k_cache.shape
        and cos_table.dtype == sin_table.dtype == torch.float32
        and cos_table.is_contiguous() and sin_table.is_contiguous()
        and cos_table.shape[1] == head_dim and sin_table.shape == cos_table.shape
        and positions.dtype == slot_mapping.dtype == torch.int64
        and positions.is_contiguous() and slot_mapping.is_contiguous()
        and positions.device.type == slot_mapping.device.type == cos_table.device.type == "cpu"
        and native_for(qk, v, k_cache, v_cache)
    )
    if not ok:
        return reference_rotary_store_kv(qk, v, num_q_heads, cos_table, sin_table, positions,
                                         k_cache, v_cache, slot_mapping)
    if num_tokens:
        num_slots = k_cache.numel() // (v.shape[1] * head_dim)
        if not trusted:  # the kernel trusts its indices
            if int(positions.min()) < 0 or int(positions.max()) >= cos_table.shape[0]:
                raise ValueError(f"positions fall outside the rotary table (0..{cos_table.shape[0] - 1})")
            if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots:
                raise ValueError(f"slot mapping names slots outside the cache (0..{num_slots - 1})")
        status = _state["lib"].mqinfer_rotary_store_kv(
            qk.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
            num_tokens, qk.stride(0), v.stride(0), num_q_heads, heads - num_q_heads, head_dim,
            int(qk.dtype == torch.bfloat16), _threads(qk.numel()),
        )
        if status != 0:
            raise MemoryError("the native rotary kernel could not allocate its buffer")
    return qk[:, :num_q_heads]


__all__ = [
    "add_rms_norm",
    "cpu_ops_available",
    "greedy_argmax",
    "native_for",
    "reference_add_rms_norm",
    "reference_greedy_argmax",
    "reference_rotary_store_kv",
    "reference_silu_mul",
    "rotary_store_kv",
    "silu_mul",
]
