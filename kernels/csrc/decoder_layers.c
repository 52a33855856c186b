/* A run of decoder layers in one call (mqinfer_native.h, mqinfer_decoder_args).

   Why. A decoding step of a small model on two cores spends a third of its time in Python between
   the kernels: eight kernel calls per layer, each with its checks, argument record and ctypes
   crossing, about 200 microseconds a layer (SmolLM2 at one row: 20 ms a step, 10 of them the
   weights' reads). Here the layer loop runs in C, calling the very kernels the Python forward
   calls, in the same order, on the same buffers: the results are the same bits. The caller
   (workers/engine/models/decoder_chain.py) checks once per step what the Python wrappers check
   per call. */
#include <stddef.h>
#include <stdint.h>

#include "mqinfer_native.h"

/* out [rows, n] = x [rows, k] W^T (+ bias, or NULL) by the AMX kernel, x and out with unit-stride rows of k and n. */
static int linear(const void *x, const void *packed, const void *bias, void *out, int64_t rows, int64_t k,
                  int64_t n, int num_threads) {
    const mqinfer_amx_linear_args l = {
        .x = x, .packed = packed, .bias = bias, .out = out, .rows = rows, .in_features = k, .out_features = n,
        .x_stride = k, .out_stride = n,
    };
    return mqinfer_amx_linear(&l, num_threads);
}

/* h += delta (delta NULL: no add), out = rms_norm(h) * weight, as cpu_ops.add_rms_norm calls it. */
static int add_norm(const mqinfer_decoder_args *a, const void *delta, const void *weight, void *out) {
    mqinfer_rms_norm_args n = {
        .residual = a->h, .delta = delta, .weight = weight, .out = out, .rows = a->rows,
        .hidden = a->hidden, .residual_stride = a->hidden, .delta_stride = delta ? a->hidden : 0,
        .eps = a->eps, .is_bf16 = 1,
    };
    return mqinfer_add_rms_norm(&n, (int)a->norm_threads);
}

int mqinfer_decoder_layers(const mqinfer_decoder_args *a, int64_t first, int64_t last, int num_threads) {
    const int64_t rows = a->rows, hidden = a->hidden, q = a->q_size, kv = a->kv_size;
    const int64_t qkv_cols = q + 2 * kv;
    int status;
    if (rows <= 0) return 0;
    if (first < 0 || last > a->num_layers || first >= last) return -3;
    if (first == 0 && (status = add_norm(a, NULL, a->input_norm[0], a->x)) != 0) return status;
    for (int64_t i = first; i < last; i++) {
        /* Attention: the fused q/k/v projection, rotary (q in place, k and v into the cache),
           attention over the cache, the output projection. */
        if ((status = linear(a->x, a->qkv_packed[i], a->qkv_bias ? a->qkv_bias[i] : NULL, a->qkv, rows, hidden, qkv_cols, num_threads)) != 0)
            return status;
        mqinfer_rotary_args r = a->rotary;
        r.qk = a->qkv;
        r.v = (const uint16_t *)a->qkv + (q + kv);
        r.k_cache = a->k_cache[i];
        r.v_cache = a->v_cache[i];
        if ((status = mqinfer_rotary_store_kv(&r, (int)a->rotary_threads)) != 0) return status;
        mqinfer_attention_args t = a->attention;
        t.q = a->qkv;
        t.k_cache = a->k_cache[i];
        t.v_cache = a->v_cache[i];
        t.out = a->attn;
        if ((status = mqinfer_paged_attention(&t, num_threads)) != 0) return status;
        if ((status = linear(a->attn, a->o_packed[i], NULL, a->o, rows, q, hidden, num_threads)) != 0) return status;
        if ((status = add_norm(a, a->o, a->post_norm[i], a->x)) != 0) return status;
        /* MLP: silu(gate) * up straight from the tiles, then the down projection. */
        const mqinfer_amx_swiglu_args g = {
            .x = a->x, .packed = a->gate_up_packed[i], .out = a->act, .rows = rows, .in_features = hidden,
            .inter = a->inter, .x_stride = hidden, .out_stride = a->inter, .vector_chunk = a->vector_chunk,
        };
        if ((status = mqinfer_amx_swiglu(&g, num_threads)) != 0) return status;
        if ((status = linear(a->act, a->down_packed[i], NULL, a->down, rows, a->inter, hidden, num_threads)) != 0)
            return status;
        /* The residual add, fused into the next layer's input norm, or after the last layer the
           final norm (into its own tensor). */
        const int end = i + 1 == a->num_layers;
        if ((status = add_norm(a, a->down, end ? a->final_norm : a->input_norm[i + 1],
                               end ? a->final_out : a->x)) != 0)
            return status;
    }
    return 0;
}
