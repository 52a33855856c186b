/* Pieces shared by the attention kernel's sources (paged_attention.c: the portable and AVX-512
   versions and the entry point; attention_avx2.c: the AVX2 versions), not exported: bfloat16
   conversions, the softmax's exponential, and the AVX2 versions' entry points. */
#ifndef MQINFER_ATTENTION_COMMON_H
#define MQINFER_ATTENTION_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mqinfer_native.h"
#include "native_common.h"

/* One version of the kernel: tokens token_begin..token_end - 1 of a call, buf its scratch. */
typedef void (*attend_fn)(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf);

/* The versions a call needs: 0 float32 and 1 bfloat16 activations over a cache of their own
   type; 2 and 3 float32 and bfloat16 activations over an int8 cache; 4 and 5 over a float8 one. */
static inline int attention_kind(const mqinfer_attention_args *j) {
    return j->kv_quant == 0 ? (j->is_bf16 != 0) : 2 * j->kv_quant + (j->is_bf16 != 0);
}

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 8-bit caches (mqinfer_attention_args.kv_quant): the stored value as a float, before its
   row's scale. float8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no
   infinities): the 7 low bits shifted to a float's exponent and mantissa give the value times
   2^-120 (subnormals included, as float subnormals: the library never turns on
   flush-to-zero), so one exact multiply puts it right. */
static inline float int8_to_float(int8_t x) { return (float)x; }
static inline float fp8e4m3_to_float(uint8_t x) {
    const uint32_t u = (uint32_t)(x & 0x7fu) << 20;
    float f; memcpy(&f, &u, 4);
    f *= 0x1p120f;
    return (x & 0x80u) ? -f : f;
}

/* Attention weights are rounded to the cache dtype before they multiply V, as PyTorch's own
   CPU attention does for reduced precision: bfloat16 results then agree with it (and so with
   transformers) down to near-ties. */
static inline float keep_f32(float x) { return x; }
static inline float round_to_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

#define LOG2E 1.44269504088896341f
#define LN2 0.69314718055994531f

/* e^x for x <= 0 (softmax after subtracting the max), relative error about 2e-7: plain
   arithmetic that the compiler vectorises, unlike a call to expf. The reduction
   (x * log2e + 0.5, x * log2e - n) and every polynomial step are multiply-adds, fused where
   the CPU has the instruction (the AVX-512 version, exp_nonpositive16, fuses the same ones).
   At and below the clamp (and for NaN) the result is EXP_AT_CLAMP: the same arithmetic at
   -87 without fused operations, the constant this kernel has always returned there. */
#define EXP_AT_CLAMP 0x1.666d4p-126f
static inline float exp_nonpositive(float x) {
    if (!(x > -87.0f)) return EXP_AT_CLAMP;
    const float n = floorf(MUL_ADD(x, LOG2E, 0.5f));
    const float f = MUL_ADD(x, LOG2E, -n) * LN2;  /* |f| <= ln2 / 2 */
    float p = 1.0f / 720.0f;
    p = MUL_ADD(p, f, 1.0f / 120.0f);
    p = MUL_ADD(p, f, 1.0f / 24.0f);
    p = MUL_ADD(p, f, 1.0f / 6.0f);
    p = MUL_ADD(p, f, 0.5f);
    p = MUL_ADD(p, f, 1.0f);
    p = MUL_ADD(p, f, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* unsigned: no overflow for large n */
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}

/* Prefetching. A block is one 4 KiB page for common shapes and blocks lie anywhere in the
   cache, so the hardware prefetchers, which stop at page ends, cannot run ahead of the reads;
   when decoding, every block comes from memory. So while a block is read, the block
   PREFETCH_BLOCKS further along the kernel's reading order is asked for: keys of KV head 0 block
   by block, then its values, then head 1's keys, ..., then the next token's keys. One row of
   that block per row read: asking for a whole block at once fills the CPU's queue of
   outstanding misses and stalls it, where spread out the requests overlap the arithmetic
   (measured on an AMD EPYC: decoding's attention about a quarter faster, prompts unchanged).
   Used by the AVX-512 and AVX2 versions. */
#define PREFETCH_BLOCKS 2

/* The start of KV head h's first row in the block PREFETCH_BLOCKS past block blk of token t's
   keys (kind 0) or values (kind 1), in that order; NULL past the call's last token. */
static inline const char *prefetch_target(const mqinfer_attention_args *j, int64_t t, int64_t token_end,
                                          int64_t h, int kind, int64_t blk, int64_t elem) {
    const int64_t bs = j->block_size;
    int64_t blocks = (j->positions[t] + bs) / bs, b = blk + PREFETCH_BLOCKS;
    while (b >= blocks) {
        b -= blocks;
        if (kind == 0) {
            kind = 1;
        } else {
            kind = 0;
            if (++h == j->num_kv_heads) {
                if (++t >= token_end) return NULL;
                h = 0;
                blocks = (j->positions[t] + bs) / bs;
            }
        }
    }
    const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;
    const char *cache = (const char *)(kind ? j->v_cache : j->k_cache);
    return cache + (table[b] * bs * j->num_kv_heads + h) * j->head_dim * elem;
}
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 3);
}

/* An 8-bit cache: each softmax weight of KV head h's g query heads (scores: g rows of len, the
   weights of token positions 0..len - 1) times its value row's scale, before the weighted sum. */
static inline void weights_times_value_scales(const mqinfer_attention_args *j, const int64_t *table, int64_t h,
                                              int64_t g, int64_t len, float *scores) {
    const int64_t bs = j->block_size, hkv = j->num_kv_heads;
    for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {
        const int64_t n = len - first < bs ? len - first : bs;
        const uint16_t *vsb = j->v_scale + table[blk] * bs * hkv + h;
        for (int64_t o = 0; o < n; o++) {
            const float vs = bf16_to_float(vsb[o * hkv]);
            for (int64_t i = 0; i < g; i++) scores[i * len + first + o] *= vs;
        }
    }
}

/* Tokens token_begin..token_end - 1 of a call by an AVX-512 version (attention_avx512.c: heads 64
   or 128 wide, 1 to 8 query heads per KV head, caches in the activations' type or int8), with buf
   holding at least (num_heads / num_kv_heads) * max_len floats. Returns 1, or 0 (doing nothing)
   where there is none for the call (or the library was built without AVX-512).
   mq_attend_avx512_wide: the same for 5 to 8 query heads per KV head, called by the first. */
int mq_attend_avx512(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf);
int mq_attend_avx512_wide(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf);

/* Tokens token_begin..token_end - 1 of a call by an AVX2 version, with buf holding at least
   (num_heads / num_kv_heads) * max_len floats. Returns 1, or 0 (doing nothing) where the
   library has no AVX2 version for the call's shape (or was built without AVX2 and FMA). */
int mq_attend_avx2(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, float *buf);

/* The AMX path (attention_amx.c): whether a call can take it (AMX tiles granted by the kernel,
   bfloat16 activations and cache, heads 64 or 128 wide, not switched off), and tokens
   token_begin..token_end - 1 of such a call: those in prompt runs by tiles, the rest by
   per_token. Returns 0, or -1 when out of memory. */
int mq_amx_attention_usable(const mqinfer_attention_args *j);
int mq_attend_with_amx(const mqinfer_attention_args *j, int64_t token_begin, int64_t token_end, attend_fn per_token,
                       float *buf);
/* Each token's share of a call's work, for splitting the call between threads: its context plus
   a fixed cost, a quarter of that for a token the AMX path takes (usable: mq_amx_attention_usable). */
void mq_attention_token_weights(const mqinfer_attention_args *j, int usable, int64_t *weights);

/* Tests only (mqinfer_attention_selftest): the AVX2 versions' exponential 8 at a time and
   lane sums 8 vectors at a time beside their one-at-a-time forms; returns 8, or 0 without AVX2. */
int mq_attention_selftest_avx2(const float *x, int64_t n, float *exp_one, float *exp_vec,
                               float *sum_one, float *sum_vec);

#endif
