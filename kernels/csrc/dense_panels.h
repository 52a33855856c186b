/* The float32 dense kernel's register tiles and panel loop (linear.c), shared with kernels that
   keep their weights in another form and widen them to float32 on the way (linear_w8a16.c).
   Not exported. Only for sources built for AVX2 with FMA and without AVX-512. */
#ifndef MQINFER_DENSE_PANELS_H
#define MQINFER_DENSE_PANELS_H

#include <stdint.h>

#include "mqinfer_native.h"

/* Output features per panel, and rows per register tile. */
#define MQ_DENSE_PANEL 16
#define MQ_DENSE_TILE_ROWS 6

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include "dense_store.h"

/* A tile: rows 0..MR-1 of x (row stride ldx) times one panel (K steps) into out (row stride
   ldo), bias (16 values, or NULL) added at the end, written as `mode` (dense_store.h) says.
   scales: the panel's 16 per-feature scales for tiles whose panels are not float32, else
   unused. */
typedef void (*mq_tile_fn)(const float *x, int64_t ldx, const void *panel, const float *scales, int64_t K,
                           const float *bias, float *out, int64_t ldo, int mode);

/* The tile body, for tiles that differ only in how they read the panel: SETUP is a statement
   run once (it sees panel_data and scales), WEIGHTS(k, w0, w1) sets w0 and w1 to the 16
   float32 weights of step k. Every output is one chain of fused multiply-adds over k in order,
   from zero, then the bias added. One named accumulator pair per row: GCC keeps arrays of
   vectors in memory across the loop. */
#define MQ_DEFINE_DENSE_TILE(NAME, MR, SETUP, WEIGHTS)                                            \
static void NAME(const float *x, int64_t ldx, const void *panel_data, const float *scales, int64_t K, \
                 const float *bias, float *out, int64_t ldo, int mode) {                          \
    SETUP                                                                                         \
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;     \
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;                     \
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx;  \
    const float *x5 = x + 5 * ldx;                                                                \
    for (int64_t k = 0; k < K; k++) {                                                             \
        __m256 w0, w1, b;                                                                         \
        WEIGHTS(k, w0, w1)                                                                        \
        b = _mm256_broadcast_ss(x0 + k); a00 = _mm256_fmadd_ps(b, w0, a00); a01 = _mm256_fmadd_ps(b, w1, a01); \
        if (MR > 1) { b = _mm256_broadcast_ss(x1 + k); a10 = _mm256_fmadd_ps(b, w0, a10); a11 = _mm256_fmadd_ps(b, w1, a11); } \
        if (MR > 2) { b = _mm256_broadcast_ss(x2 + k); a20 = _mm256_fmadd_ps(b, w0, a20); a21 = _mm256_fmadd_ps(b, w1, a21); } \
        if (MR > 3) { b = _mm256_broadcast_ss(x3 + k); a30 = _mm256_fmadd_ps(b, w0, a30); a31 = _mm256_fmadd_ps(b, w1, a31); } \
        if (MR > 4) { b = _mm256_broadcast_ss(x4 + k); a40 = _mm256_fmadd_ps(b, w0, a40); a41 = _mm256_fmadd_ps(b, w1, a41); } \
        if (MR > 5) { b = _mm256_broadcast_ss(x5 + k); a50 = _mm256_fmadd_ps(b, w0, a50); a51 = _mm256_fmadd_ps(b, w1, a51); } \
    }                                                                                             \
    if (bias) {                                                                                   \
        const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);                  \
        a00 = _mm256_add_ps(a00, b0); a01 = _mm256_add_ps(a01, b1);                               \
        a10 = _mm256_add_ps(a10, b0); a11 = _mm256_add_ps(a11, b1);                               \
        a20 = _mm256_add_ps(a20, b0); a21 = _mm256_add_ps(a21, b1);                               \
        a30 = _mm256_add_ps(a30, b0); a31 = _mm256_add_ps(a31, b1);                               \
        a40 = _mm256_add_ps(a40, b0); a41 = _mm256_add_ps(a41, b1);                               \
        a50 = _mm256_add_ps(a50, b0); a51 = _mm256_add_ps(a51, b1);                               \
    }                                                                                             \
    store_row(out, a00, a01, mode);                                                               \
    if (MR > 1) store_row(out + ldo, a10, a11, mode);                                             \
    if (MR > 2) store_row(out + 2 * ldo, a20, a21, mode);                                         \
    if (MR > 3) store_row(out + 3 * ldo, a30, a31, mode);                                         \
    if (MR > 4) store_row(out + 4 * ldo, a40, a41, mode);                                         \
    if (MR > 5) store_row(out + 5 * ldo, a50, a51, mode);                                         \
}

/* The float32 tiles by row count (index 1..6), for float32 panels [K][16]. */
extern const mq_tile_fn mq_dense_f32_tiles[MQ_DENSE_TILE_ROWS + 1];

/* Panel p for the tiles, valid until the next call with the same state. */
typedef const void *(*mq_panel_source)(void *state, int64_t p);

/* Part `part` of `num_parts` of mqinfer_linear's work on a (the panels split evenly across
   parts): every block of rows times every panel of the part, through tiles[rows] (index 1..6),
   with bias, SwiGLU and partial panels as mqinfer_linear does them. The panels come from
   source(state, p) when source is set (called once per panel per block of rows, in increasing
   p within a block), else from a->packed as float32; scales (or NULL) has 16 values per panel
   and the tiles get panel p's. Returns 0. */
int mq_dense_part(const mqinfer_linear_args *a, int part, int num_parts, const mq_tile_fn *tiles,
                  mq_panel_source source, void *state, const float *scales);

#endif
#endif
