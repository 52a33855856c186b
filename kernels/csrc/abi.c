/* The argument records' layouts as this compiler lays them out, for the loader to check its
   ctypes mirrors against: size, number of fields, then each field's offset and size in
   order. */
#include <stddef.h>

#include "mqinfer_native.h"

#define AT(T, f) (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)

const int64_t mqinfer_layout_attention_args[] = {
    sizeof(mqinfer_attention_args), 20,
    AT(mqinfer_attention_args, q), AT(mqinfer_attention_args, k_cache),
    AT(mqinfer_attention_args, v_cache), AT(mqinfer_attention_args, out),
    AT(mqinfer_attention_args, block_tables), AT(mqinfer_attention_args, seq_of_token),
    AT(mqinfer_attention_args, positions), AT(mqinfer_attention_args, num_tokens),
    AT(mqinfer_attention_args, q_token_stride), AT(mqinfer_attention_args, num_heads),
    AT(mqinfer_attention_args, num_kv_heads), AT(mqinfer_attention_args, head_dim),
    AT(mqinfer_attention_args, block_size), AT(mqinfer_attention_args, max_blocks),
    AT(mqinfer_attention_args, max_len), AT(mqinfer_attention_args, scale),
    AT(mqinfer_attention_args, is_bf16), AT(mqinfer_attention_args, k_scale),
    AT(mqinfer_attention_args, v_scale), AT(mqinfer_attention_args, kv_quant),
};

const int64_t mqinfer_layout_argmax_args[] = {
    sizeof(mqinfer_argmax_args), 6,
    AT(mqinfer_argmax_args, x), AT(mqinfer_argmax_args, out), AT(mqinfer_argmax_args, rows),
    AT(mqinfer_argmax_args, cols), AT(mqinfer_argmax_args, row_stride),
    AT(mqinfer_argmax_args, is_bf16),
};

const int64_t mqinfer_layout_gumbel_args[] = {
    sizeof(mqinfer_gumbel_args), 8,
    AT(mqinfer_gumbel_args, x), AT(mqinfer_gumbel_args, keys), AT(mqinfer_gumbel_args, gumbel),
    AT(mqinfer_gumbel_args, bucket_max), AT(mqinfer_gumbel_args, out), AT(mqinfer_gumbel_args, rows),
    AT(mqinfer_gumbel_args, cols), AT(mqinfer_gumbel_args, row_stride),
};

const int64_t mqinfer_layout_bitmask_args[] = {
    sizeof(mqinfer_bitmask_args), 8,
    AT(mqinfer_bitmask_args, x), AT(mqinfer_bitmask_args, bitmask), AT(mqinfer_bitmask_args, rows),
    AT(mqinfer_bitmask_args, n), AT(mqinfer_bitmask_args, cols), AT(mqinfer_bitmask_args, row_stride),
    AT(mqinfer_bitmask_args, words), AT(mqinfer_bitmask_args, is_bf16),
};

const int64_t mqinfer_layout_rms_norm_args[] = {
    sizeof(mqinfer_rms_norm_args), 10,
    AT(mqinfer_rms_norm_args, residual), AT(mqinfer_rms_norm_args, delta),
    AT(mqinfer_rms_norm_args, weight), AT(mqinfer_rms_norm_args, out),
    AT(mqinfer_rms_norm_args, rows), AT(mqinfer_rms_norm_args, hidden),
    AT(mqinfer_rms_norm_args, residual_stride), AT(mqinfer_rms_norm_args, delta_stride),
    AT(mqinfer_rms_norm_args, eps), AT(mqinfer_rms_norm_args, is_bf16),
};

const int64_t mqinfer_layout_silu_mul_args[] = {
    sizeof(mqinfer_silu_mul_args), 7,
    AT(mqinfer_silu_mul_args, gate_up), AT(mqinfer_silu_mul_args, out),
    AT(mqinfer_silu_mul_args, rows), AT(mqinfer_silu_mul_args, inter),
    AT(mqinfer_silu_mul_args, stride), AT(mqinfer_silu_mul_args, vector_chunk),
    AT(mqinfer_silu_mul_args, is_bf16),
};

const int64_t mqinfer_layout_rotary_args[] = {
    sizeof(mqinfer_rotary_args), 18,
    AT(mqinfer_rotary_args, qk), AT(mqinfer_rotary_args, v), AT(mqinfer_rotary_args, k_cache),
    AT(mqinfer_rotary_args, v_cache), AT(mqinfer_rotary_args, cos), AT(mqinfer_rotary_args, sin),
    AT(mqinfer_rotary_args, positions), AT(mqinfer_rotary_args, slots),
    AT(mqinfer_rotary_args, rows), AT(mqinfer_rotary_args, qk_stride),
    AT(mqinfer_rotary_args, v_stride), AT(mqinfer_rotary_args, num_q_heads),
    AT(mqinfer_rotary_args, num_kv_heads), AT(mqinfer_rotary_args, head_dim),
    AT(mqinfer_rotary_args, is_bf16), AT(mqinfer_rotary_args, k_scale),
    AT(mqinfer_rotary_args, v_scale), AT(mqinfer_rotary_args, kv_quant),
};

const int64_t mqinfer_layout_linear_args[] = {
    sizeof(mqinfer_linear_args), 11,
    AT(mqinfer_linear_args, x), AT(mqinfer_linear_args, packed), AT(mqinfer_linear_args, bias),
    AT(mqinfer_linear_args, out), AT(mqinfer_linear_args, rows),
    AT(mqinfer_linear_args, in_features), AT(mqinfer_linear_args, out_features),
    AT(mqinfer_linear_args, x_stride), AT(mqinfer_linear_args, out_stride),
    AT(mqinfer_linear_args, swiglu), AT(mqinfer_linear_args, vector_chunk),
};

const int64_t mqinfer_layout_qlinear_args[] = {
    sizeof(mqinfer_qlinear_args), 14,
    AT(mqinfer_qlinear_args, x), AT(mqinfer_qlinear_args, packed), AT(mqinfer_qlinear_args, scales),
    AT(mqinfer_qlinear_args, bias), AT(mqinfer_qlinear_args, out), AT(mqinfer_qlinear_args, scratch),
    AT(mqinfer_qlinear_args, rows), AT(mqinfer_qlinear_args, in_features),
    AT(mqinfer_qlinear_args, out_features), AT(mqinfer_qlinear_args, x_stride),
    AT(mqinfer_qlinear_args, out_stride), AT(mqinfer_qlinear_args, swiglu),
    AT(mqinfer_qlinear_args, vector_chunk), AT(mqinfer_qlinear_args, is_bf16),
};

const int64_t mqinfer_layout_w8a16_args[] = {
    sizeof(mqinfer_w8a16_args), 12,
    AT(mqinfer_w8a16_args, x), AT(mqinfer_w8a16_args, packed), AT(mqinfer_w8a16_args, scales),
    AT(mqinfer_w8a16_args, bias), AT(mqinfer_w8a16_args, out), AT(mqinfer_w8a16_args, rows),
    AT(mqinfer_w8a16_args, in_features), AT(mqinfer_w8a16_args, out_features),
    AT(mqinfer_w8a16_args, x_stride), AT(mqinfer_w8a16_args, out_stride),
    AT(mqinfer_w8a16_args, swiglu), AT(mqinfer_w8a16_args, vector_chunk),
};

const int64_t mqinfer_layout_decoder_args[] = {
    sizeof(mqinfer_decoder_args), 30,
    AT(mqinfer_decoder_args, h), AT(mqinfer_decoder_args, x), AT(mqinfer_decoder_args, qkv),
    AT(mqinfer_decoder_args, attn), AT(mqinfer_decoder_args, o), AT(mqinfer_decoder_args, act),
    AT(mqinfer_decoder_args, down), AT(mqinfer_decoder_args, final_out),
    AT(mqinfer_decoder_args, input_norm), AT(mqinfer_decoder_args, post_norm),
    AT(mqinfer_decoder_args, final_norm), AT(mqinfer_decoder_args, qkv_packed), AT(mqinfer_decoder_args, qkv_bias),
    AT(mqinfer_decoder_args, o_packed), AT(mqinfer_decoder_args, gate_up_packed),
    AT(mqinfer_decoder_args, down_packed), AT(mqinfer_decoder_args, k_cache),
    AT(mqinfer_decoder_args, v_cache), AT(mqinfer_decoder_args, rotary),
    AT(mqinfer_decoder_args, attention), AT(mqinfer_decoder_args, num_layers),
    AT(mqinfer_decoder_args, rows), AT(mqinfer_decoder_args, hidden), AT(mqinfer_decoder_args, q_size),
    AT(mqinfer_decoder_args, kv_size), AT(mqinfer_decoder_args, inter),
    AT(mqinfer_decoder_args, vector_chunk), AT(mqinfer_decoder_args, norm_threads),
    AT(mqinfer_decoder_args, rotary_threads), AT(mqinfer_decoder_args, eps),
};

const int64_t mqinfer_layout_amx_linear_args[] = {
    sizeof(mqinfer_amx_linear_args), 9,
    AT(mqinfer_amx_linear_args, x), AT(mqinfer_amx_linear_args, packed), AT(mqinfer_amx_linear_args, bias),
    AT(mqinfer_amx_linear_args, out), AT(mqinfer_amx_linear_args, rows),
    AT(mqinfer_amx_linear_args, in_features), AT(mqinfer_amx_linear_args, out_features),
    AT(mqinfer_amx_linear_args, x_stride), AT(mqinfer_amx_linear_args, out_stride),
};

const int64_t mqinfer_layout_amx_swiglu_args[] = {
    sizeof(mqinfer_amx_swiglu_args), 9,
    AT(mqinfer_amx_swiglu_args, x), AT(mqinfer_amx_swiglu_args, packed), AT(mqinfer_amx_swiglu_args, out),
    AT(mqinfer_amx_swiglu_args, rows), AT(mqinfer_amx_swiglu_args, in_features),
    AT(mqinfer_amx_swiglu_args, inter), AT(mqinfer_amx_swiglu_args, x_stride),
    AT(mqinfer_amx_swiglu_args, out_stride), AT(mqinfer_amx_swiglu_args, vector_chunk),
};
