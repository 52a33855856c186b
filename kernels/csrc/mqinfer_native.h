/* The native CPU kernels' interface: every function the shared library exports, and the
   argument records they take. kernels/native.py builds the library from the .c files beside
   this header, declares each function's ctypes signature and mirrors each record as a
   ctypes.Structure; it checks the records' layouts (mqinfer_layout_*, abi.c) when it loads
   the library, so a field added here and not there fails loudly instead of reading
   garbage.

   Floating point rule, one for every source: the library is built with -ffp-contract=off, so
   the compiler never fuses a multiply and an add. A fused multiply-add happens only where the
   source writes one: fmaf(), the MUL_ADD macro of native_common.h, or an FMA intrinsic. The
   bit-exact kernels depend on it (they reproduce PyTorch's roundings one by one), and the
   attention kernel's vectorised exponential agrees bit for bit with its scalar one because
   both write the same fused operations out.

   Conventions: tensors are passed as raw data pointers with element strides; is_bf16 selects
   bfloat16 (else float32) for every activation tensor of a call; num_threads is the caller's
   thread budget (torch.get_num_threads(), or 1 for small work), served by one persistent
   thread pool (thread_pool.c). Functions that allocate return 0, or -1 when memory ran out
   (the caller raises; nothing half-written is used). */
#ifndef MQINFER_NATIVE_H
#define MQINFER_NATIVE_H

#include <stdint.h>

/* ------------------------------------------------------------------ paged attention */
/* Causal attention of packed queries over a paged KV cache.
   q [num_tokens, num_heads, head_dim] (token stride q_token_stride, heads contiguous);
   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
   out [num_tokens, num_heads, head_dim], contiguous;
   block_tables [num_seqs, max_blocks]; seq_of_token, positions [num_tokens].
   Token t attends to positions 0..positions[t] of sequence seq_of_token[t]; max_len bounds
   positions[t] + 1. Indices are trusted: the caller checks them.
   kv_quant: 0, the caches hold the activations' type (is_bf16); 1, int8, or 2, float8 e4m3
   (finite values only), each row of head_dim values scaled by its bfloat16 k_scale / v_scale
   [num_blocks, block_size, num_kv_heads] (value = stored * scale); q and out are float32 or
   bfloat16 (is_bf16), the arithmetic float32 either way, a bfloat16 out rounded once from it.
   k_scale and v_scale are NULL when kv_quant is 0. */
typedef struct {
    const void *q;
    const void *k_cache;
    const void *v_cache;
    void *out;
    const int64_t *block_tables;
    const int64_t *seq_of_token;
    const int64_t *positions;
    int64_t num_tokens;
    int64_t q_token_stride;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    int64_t max_blocks;
    int64_t max_len;
    float scale;
    int32_t is_bf16;
    const uint16_t *k_scale;  /* bfloat16 bits */
    const uint16_t *v_scale;
    int32_t kv_quant;
} mqinfer_attention_args;

int mqinfer_paged_attention(const mqinfer_attention_args *args, int num_threads);

/* Tests only: the attention kernel's vectorised softmax pieces against their one-at-a-time
   versions, for its widest vectors (W lanes: 16 with AVX-512, 8 with AVX2). x holds n floats,
   n a multiple of 256; writes e^x one at a time and W at a time, and lane sums one vector at a
   time and W vectors at a time (n / W each; the sum buffers hold n / 8). Returns W, or 0
   (writing nothing) where the library has no vectorised version to compare. */
int mqinfer_attention_selftest(const float *x, int64_t n, float *exp_one, float *exp_vec,
                               float *sum_one, float *sum_vec);

/* Tests only: whether bfloat16 prompt runs take the AMX tiles where the CPU has them (enable 1)
   or the per-token versions (0); -1 only asks. Returns the setting before the call, or -1 where
   there is no AMX path (a library built without it, or an OS that refuses the tile state). */
int mqinfer_attention_use_amx(int enable);

/* ------------------------------------------------------------------ greedy argmax */
/* out[r] = first index of row r's maximum (the first NaN if the row has one).
   x [rows, cols], row stride row_stride elements, unit column stride. */
typedef struct {
    const void *x;
    int64_t *out;
    int64_t rows;
    int64_t cols;
    int64_t row_stride;
    int32_t is_bf16;
} mqinfer_argmax_args;

void mqinfer_argmax(const mqinfer_argmax_args *args, int num_threads);

/* ------------------------------------------------------------------ Gumbel-max draw */
/* out[r] = argmax over i of x[r, i] + gumbel[bits(r, i)] (float32 sum; the first index of the
   maximum; the first NaN of a row that has one), where bits(r, i) = mix64(keys[r] + (i + 1) *
   0x9E3779B97F4A7C15) >> 41 with splitmix64's finaliser mix64 (uint64 arithmetic).
   x [rows, cols] float32, row stride row_stride elements, unit column stride; keys [rows];
   gumbel [2^23], the noise of every draw; bucket_max [2^11], bucket_max[j] >= gumbel[b] for
   every b with b >> 12 == j (the kernel skips the columns these bounds rule out). */
typedef struct {
    const float *x;
    const uint64_t *keys;
    const float *gumbel;
    const float *bucket_max;
    int64_t *out;
    int64_t rows;
    int64_t cols;
    int64_t row_stride;
} mqinfer_gumbel_args;

void mqinfer_gumbel_argmax(const mqinfer_gumbel_args *args, int num_threads);

/* ------------------------------------------------------------------ token bitmask */
/* Structured output's token masks, in place: for each i < n, row rows[i] of x becomes -inf at
   every column j whose bit is 0 in row i of bitmask (word j / 32, bit j % 32, least significant
   first); columns past words * 32 are -inf too. x [*, cols] float32 or bfloat16, row stride
   row_stride elements, unit column stride; bitmask [n, words] contiguous. */
typedef struct {
    void *x;
    const int32_t *bitmask;
    const int64_t *rows;
    int64_t n;
    int64_t cols;
    int64_t row_stride;
    int64_t words;
    int32_t is_bf16;
} mqinfer_bitmask_args;

void mqinfer_apply_bitmask(const mqinfer_bitmask_args *args, int num_threads);

/* ------------------------------------------------------------------ residual add + RMSNorm */
/* residual <- residual + delta (delta NULL: no add), out <- rms_norm(residual) * weight.
   residual, delta [rows, hidden] with row strides; weight [hidden]; out [rows, hidden],
   contiguous. */
typedef struct {
    void *residual;
    const void *delta;
    const void *weight;
    void *out;
    int64_t rows;
    int64_t hidden;
    int64_t residual_stride;
    int64_t delta_stride;
    float eps;
    int32_t is_bf16;
} mqinfer_rms_norm_args;

int mqinfer_add_rms_norm(const mqinfer_rms_norm_args *args, int num_threads);

/* ------------------------------------------------------------------ SiLU(gate) * up */
/* out <- silu(gate) * up, gate_up [rows, 2 * inter] (gate first, row stride stride),
   out [rows, inter] contiguous. vector_chunk: how many leading elements of each row PyTorch's
   SiLU takes through its vectorised exponential, in whole chunks of this many (0: none, every
   element through std::exp). The caller derives it from PyTorch's CPU capability. */
typedef struct {
    const void *gate_up;
    void *out;
    int64_t rows;
    int64_t inter;
    int64_t stride;
    int64_t vector_chunk;
    int32_t is_bf16;
} mqinfer_silu_mul_args;

void mqinfer_silu_mul(const mqinfer_silu_mul_args *args, int num_threads);

/* ------------------------------------------------------------------ rotary + KV store */
/* Rotary embedding of qk [rows, num_q_heads + num_kv_heads, head_dim] (token stride
   qk_stride) at positions, from float32 cos / sin tables [*, head_dim]: q heads rotated in
   place, k heads written to k_cache slot slots[t], v [rows, num_kv_heads, head_dim] (token
   stride v_stride) copied to v_cache slot slots[t]. Caches [num_slots, num_kv_heads,
   head_dim], contiguous. Indices are trusted: the caller checks them.
   kv_quant: 0, the caches hold the activations' type (is_bf16) and k_scale / v_scale are
   NULL; 1, int8, or 2, float8 e4m3 caches (bytes), with bfloat16 k_scale / v_scale
   [num_slots, num_kv_heads]: each rotated k row and each v row is quantized as
   kv_quant.quantize_kv does it, its scale written to the same (slot, head). */
typedef struct {
    void *qk;
    const void *v;
    void *k_cache;
    void *v_cache;
    const float *cos;
    const float *sin;
    const int64_t *positions;
    const int64_t *slots;
    int64_t rows;
    int64_t qk_stride;
    int64_t v_stride;
    int64_t num_q_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int32_t is_bf16;
    uint16_t *k_scale;  /* bfloat16 bits */
    uint16_t *v_scale;
    int32_t kv_quant;
} mqinfer_rotary_args;

int mqinfer_rotary_store_kv(const mqinfer_rotary_args *args, int num_threads);

/* ------------------------------------------------------------------ dense layer */
/* out = x W^T (+ bias) in float32 with W packed by mqinfer_linear_pack (linear.c).
   x [rows, in_features] (row stride x_stride), out [rows, out_features] (row stride
   out_stride), bias [out_features] or NULL.
   swiglu != 0: W is SwiGLU's gate/up projection [2 * out_features, in_features] packed by
   mqinfer_linear_pack_swiglu, bias (or NULL) the projection's bias laid out as that packing
   lays out the rows (gate 8p..8p+7 then up 8p..8p+7 for each p, zero-padded to a whole p),
   and out = silu(gate) * up; vector_chunk as in mqinfer_silu_mul_args.
   mqinfer_linear returns 0, or -2 when the library has no kernel for this CPU
   (mqinfer_linear_available() == 0). */
typedef struct {
    const void *x;
    const void *packed;
    const void *bias;
    void *out;
    int64_t rows;
    int64_t in_features;
    int64_t out_features;
    int64_t x_stride;
    int64_t out_stride;
    int64_t swiglu;
    int64_t vector_chunk;
} mqinfer_linear_args;

int mqinfer_linear_available(void);
/* Floats of the packed form of an [out_features, in_features] weight. */
int64_t mqinfer_linear_packed_size(int64_t out_features, int64_t in_features);
void mqinfer_linear_pack(const float *weight, int64_t out_features, int64_t in_features, float *packed);
/* The same for a gate/up weight [2 * inter, in_features] used with swiglu. */
int64_t mqinfer_linear_swiglu_packed_size(int64_t inter, int64_t in_features);
void mqinfer_linear_pack_swiglu(const float *weight, int64_t inter, int64_t in_features, float *packed);
int mqinfer_linear(const mqinfer_linear_args *args, int num_threads);

/* w8a8: out = (x_q W_q^T) * x_scale * w_scale (+ bias) with int8 W packed by
   mqinfer_qlinear_pack and x quantized per row inside the call (linear_int8.c).
   x float32 [rows, in_features] (row stride x_stride), out float32 [rows, out_features] (row
   stride out_stride). scales and bias (or NULL) float32, one per packed panel column
   (panels x 16: the output features in panel order, zero past the last). scratch holds
   mqinfer_qlinear_scratch_size(rows, in_features) bytes, 4-byte aligned. swiglu and
   vector_chunk as in mqinfer_linear_args. Returns 0, or -2 when the library has no kernel
   for this CPU (mqinfer_qlinear_available() == 0). With is_bf16, x and out are bfloat16 (x
   widened exactly; out rounded to nearest even from the float32 result, and for SwiGLU the
   projection rounded to bfloat16 before silu_mul's bfloat16 arithmetic) where
   mqinfer_qlinear_takes_bf16() says so; elsewhere the call returns -2. */
typedef struct {
    const void *x;
    const void *packed;
    const void *scales;
    const void *bias;
    void *out;
    void *scratch;
    int64_t rows;
    int64_t in_features;
    int64_t out_features;
    int64_t x_stride;
    int64_t out_stride;
    int64_t swiglu;
    int64_t vector_chunk;
    int64_t is_bf16;
} mqinfer_qlinear_args;

int mqinfer_qlinear_available(void);
/* Whether mqinfer_qlinear takes is_bf16 = 1 (the AVX-512 VNNI kernel only). */
int mqinfer_qlinear_takes_bf16(void);
/* Bytes of the packed form of an int8 [out_features, in_features] weight ([2 * out_features,
   in_features], gate rows first, with swiglu). */
int64_t mqinfer_qlinear_packed_size(int64_t out_features, int64_t in_features, int swiglu);
void mqinfer_qlinear_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                          int8_t *packed);
int64_t mqinfer_qlinear_scratch_size(int64_t rows, int64_t in_features);
int mqinfer_qlinear(const mqinfer_qlinear_args *args, int num_threads);

/* w8a16: out = x (W_q * w_scale)^T (+ bias) with int8 W packed by mqinfer_w8a16_pack, float32
   x and out (linear_w8a16.c): bit for bit mqinfer_linear on the float32 weight
   (float)W_q * w_scale. x [rows, in_features] (row stride x_stride), out [rows, out_features]
   (row stride out_stride). scales and bias (or NULL) float32, one per packed panel column, as
   in mqinfer_qlinear_args. swiglu and vector_chunk as in mqinfer_linear_args. Returns 0, -1
   when out of memory, or -2 when the library has no kernel for this CPU
   (mqinfer_w8a16_available() == 0). */
typedef struct {
    const void *x;
    const void *packed;
    const void *scales;
    const void *bias;
    void *out;
    int64_t rows;
    int64_t in_features;
    int64_t out_features;
    int64_t x_stride;
    int64_t out_stride;
    int64_t swiglu;
    int64_t vector_chunk;
} mqinfer_w8a16_args;

int mqinfer_w8a16_available(void);
/* Bytes of the packed form of an int8 [out_features, in_features] weight ([2 * out_features,
   in_features], gate rows first, with swiglu): the float32 kernel's panels, a byte a weight. */
int64_t mqinfer_w8a16_packed_size(int64_t out_features, int64_t in_features, int swiglu);
void mqinfer_w8a16_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                        int8_t *packed);
int mqinfer_w8a16(const mqinfer_w8a16_args *args, int num_threads);

/* ------------------------------------------------------------------ AMX dense layers */
/* bfloat16: out = x W^T (+ bias) by AMX tiles (linear_amx.c), W packed once by
   mqinfer_amx_linear_pack: the tile unit's float32 sums of exact bfloat16 products, the bias
   added in float32, one rounding to bfloat16. x [rows, in_features] bfloat16 (row stride
   x_stride elements, unit column stride), out [rows, out_features] bfloat16 (row stride
   out_stride), bias [out_features] bfloat16 or NULL. in_features is a multiple of 32.
   mqinfer_amx_linear returns 0, -1 when out of memory, or -2 when the library has no AMX
   kernel here (mqinfer_amx_linear_available() == 0) or in_features is not a multiple of 32. */
typedef struct {
    const void *x;
    const void *packed;
    const void *bias;
    void *out;
    int64_t rows;
    int64_t in_features;
    int64_t out_features;
    int64_t x_stride;
    int64_t out_stride;
} mqinfer_amx_linear_args;

/* silu(gate) * up [rows, inter] bfloat16 of x's gate/up projection, its weight [2 * inter,
   in_features] (gate rows first) packed by mqinfer_amx_linear_pack with the gate's and the up
   projection's panels of 16 features alternating, each half zero-padded to a whole panel
   (2 * ceil(inter / 16) panels): the bits of mqinfer_amx_linear on that weight followed by
   mqinfer_silu_mul. x and x_stride as in mqinfer_amx_linear_args; out [rows, inter] (row stride
   out_stride); vector_chunk as in mqinfer_silu_mul_args, a multiple of 16. Returns as
   mqinfer_amx_linear (-2 also for a vector_chunk that is not a multiple of 16). */
typedef struct {
    const void *x;
    const void *packed;
    void *out;
    int64_t rows;
    int64_t in_features;
    int64_t inter;
    int64_t x_stride;
    int64_t out_stride;
    int64_t vector_chunk;
} mqinfer_amx_swiglu_args;

int mqinfer_amx_linear_available(void);
/* bfloat16 elements of the packed form of an [out_features, in_features] weight. */
int64_t mqinfer_amx_linear_packed_size(int64_t out_features, int64_t in_features);
void mqinfer_amx_linear_pack(const uint16_t *weight, int64_t out_features, int64_t in_features, uint16_t *packed);
int mqinfer_amx_linear(const mqinfer_amx_linear_args *args, int num_threads);
int mqinfer_amx_swiglu(const mqinfer_amx_swiglu_args *args, int num_threads);

/* w8a8 by AMX int8 tiles (linear_amx_int8.c): mqinfer_qlinear's result bit for bit, on the
   same record, with the weight packed by mqinfer_amx_qlinear_pack (the same panels of features,
   so the same scales and bias; K zero-padded to a multiple of 64) and a scratch of
   mqinfer_amx_qlinear_scratch_size(rows, in_features) bytes. Returns 0, -1 when a part failed,
   or -2 when the library has no AMX int8 kernel here (mqinfer_amx_qlinear_available() == 0). */
int mqinfer_amx_qlinear_available(void);
int64_t mqinfer_amx_qlinear_packed_size(int64_t out_features, int64_t in_features, int swiglu);
void mqinfer_amx_qlinear_pack(const int8_t *weight, int64_t out_features, int64_t in_features, int swiglu,
                              int8_t *packed);
int64_t mqinfer_amx_qlinear_scratch_size(int64_t rows, int64_t in_features);
int mqinfer_amx_qlinear(const mqinfer_qlinear_args *args, int num_threads);

/* ------------------------------------------------------------------ thread pool */
/* How many times the pool has (re)started its worker threads in this process, and how many
   workers it holds now (tests and diagnostics: the pool is started once per thread count,
   not once per call). */
int64_t mqinfer_pool_starts(void);
int mqinfer_pool_workers(void);

/* ------------------------------------------------------------------ decoder layers */
/* A run of a Llama decoder's layers over one step's rows in bfloat16 on AMX tiles, each op the
   library's own kernel called as the model's Python forward calls it (decoder_layers.c): the
   same bits, one call instead of eight per layer. h [rows, hidden] is the residual stream (updated
   in place); x [rows, hidden] holds the normalised input of layer `first` on entry (or is made
   from h when first == 0) and of layer `last` on return, except that after the model's last
   layer the final norm's output goes to final_out. qkv, attn, o, act and down are the
   intermediates' buffers ([rows, q + 2 kv], [rows, q], [rows, hidden], [rows, inter],
   [rows, hidden]). The per-layer arrays hold num_layers pointers each: RMSNorm weights, packed
   AMX weights (gate_up packed for SwiGLU), and the bfloat16 K and V caches. rotary and attention
   are the step's records with the per-layer fields (qk, v, caches; q, caches, out) left to fill.
   qkv_bias: NULL, or num_layers pointers to the q/k/v projections' bfloat16 biases (Qwen2). */
typedef struct {
    void *h;
    void *x;
    void *qkv;
    void *attn;
    void *o;
    void *act;
    void *down;
    void *final_out;
    const void *const *input_norm;
    const void *const *post_norm;
    const void *final_norm;
    const void *const *qkv_packed;
    const void *const *qkv_bias;
    const void *const *o_packed;
    const void *const *gate_up_packed;
    const void *const *down_packed;
    void *const *k_cache;
    void *const *v_cache;
    mqinfer_rotary_args rotary;
    mqinfer_attention_args attention;
    int64_t num_layers;
    int64_t rows;
    int64_t hidden;
    int64_t q_size;
    int64_t kv_size;
    int64_t inter;
    int64_t vector_chunk;
    int64_t norm_threads;
    int64_t rotary_threads;
    float eps;
} mqinfer_decoder_args;

/* Layers [first, last). Returns 0; the first failing kernel's status otherwise. */
int mqinfer_decoder_layers(const mqinfer_decoder_args *args, int64_t first, int64_t last, int num_threads);

/* ------------------------------------------------------------------ record layouts */
/* For each argument record mqinfer_X: mqinfer_layout_X holds its size, its number of fields,
   then the offset and size of every field in declaration order (abi.c). The loader compares them with
   its ctypes mirrors when it loads the library. */
extern const int64_t mqinfer_layout_attention_args[];
extern const int64_t mqinfer_layout_argmax_args[];
extern const int64_t mqinfer_layout_gumbel_args[];
extern const int64_t mqinfer_layout_bitmask_args[];
extern const int64_t mqinfer_layout_rms_norm_args[];
extern const int64_t mqinfer_layout_silu_mul_args[];
extern const int64_t mqinfer_layout_rotary_args[];
extern const int64_t mqinfer_layout_linear_args[];
extern const int64_t mqinfer_layout_qlinear_args[];
extern const int64_t mqinfer_layout_w8a16_args[];
extern const int64_t mqinfer_layout_decoder_args[];
extern const int64_t mqinfer_layout_amx_linear_args[];
extern const int64_t mqinfer_layout_amx_swiglu_args[];

#endif
