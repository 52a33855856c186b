/* Paged attention of prompt runs by AMX tiles (CPUs with AMX, bfloat16 activations and cache,
   heads 64 or 128 wide, any number of query heads per KV head).

   Why. A prompt's tokens all attend to the same keys: the per-token kernel (paged_attention.c)
   runs each (token, KV head) alone, at 40-50 GFLOP/s on one core of a Xeon with AMX, where one
   AMX instruction multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one. Here 16 consecutive
   tokens of one query head are the rows of a tile: scores S = Q K^T and the output O = P V
   are tile products, and only the softmax between them is vector code.

   Which tokens. A run is a maximal stretch of packed tokens of one sequence at consecutive
   positions (a prompt or a chunk of one); tokens of runs of at least AMX_MIN_RUN go here, the
   rest (decoding tokens, speculative checks) to the per-token versions. Every row of a tile
   product depends only on its own row of the left operand, and the keys are always taken in
   the same blocks from position 0, so a token's result does not depend on which other tokens
   share its tile, on where a thread's share of the call begins, or on the thread count.

   Numerics, against the per-token bfloat16 version: the same products (bfloat16 times
   bfloat16 is exact in float32), summed in the tile unit's order instead of one chain; the
   scale applied to the float32 dot product rather than to q; the same max, exponential and
   weights rounded to bfloat16 before they multiply V; the sum of weights taken before that
   rounding, as there. Results agree to float32 rounding of the sums, not bit for bit.

   Layout. Per (segment of a run, KV head) the keys 0..len-1 are copied once into the tile
   unit's operand layouts: K transposed in pairs of dimensions (kt: per block of 16 keys and
   group of 32 dimensions, 16 rows of 16 (d, d+1) pairs) and V in pairs of keys (vv: per group
   of 32 keys and 16 dimensions, 16 rows of 16 (key, key+1) pairs), zero past len. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "attention_common.h"
#include "attention_avx512.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
/* Runs shorter than this go to the per-token versions (decoding tokens, speculative checks). */
#define AMX_MIN_RUN 16

/* Tests switch the AMX path off to compare with the per-token versions. */
static int amx_enabled = 1;

/* MQINFER_ATTENTION_AMX=off (read at every call, so a process can switch it) sends prompt runs to
   the per-token versions too. */
static int switched_off(void) {
    const char *v = getenv("MQINFER_ATTENTION_AMX");
    return v && (!strcmp(v, "off") || !strcmp(v, "0"));
}

int mq_amx_attention_usable(const mqinfer_attention_args *j) {
    return amx_enabled && j->kv_quant == 0 && j->is_bf16 && (j->head_dim == 64 || j->head_dim == 128)
        && !switched_off() && mq_amx_permitted();
}

int mqinfer_attention_use_amx(int enable) {
    if (!mq_amx_permitted()) return -1;
    const int before = amx_enabled;
    if (enable >= 0) amx_enabled = enable != 0;
    return before;
}

typedef struct {
    uint32_t *kt;   /* K^T pairs: [len_pad / 16][D / 32][16][16] dwords */
    uint32_t *vv;   /* V pairs: [len_pad / 32][D / 16][16][16] dwords */
    float *scores;  /* [16][len_pad] */
    uint16_t *p;    /* weights, bfloat16: [16][len_pad] */
    uint16_t *q;    /* the tile's q rows: [16][D] */
    float *o;       /* one output tile: [16][16] */
    int64_t len_pad;
} amx_scratch;

static int scratch_for(amx_scratch *w, int64_t len_pad, int64_t D) {
    if (w->len_pad >= len_pad) return 0;
    free(w->kt); free(w->vv); free(w->scores); free(w->p);
    w->kt = aligned_alloc(64, len_pad * D * 2);
    w->vv = aligned_alloc(64, len_pad * D * 2);
    w->scores = aligned_alloc(64, 16 * len_pad * 4);
    w->p = aligned_alloc(64, 16 * len_pad * 2);
    w->len_pad = (w->kt && w->vv && w->scores && w->p) ? len_pad : 0;
    return w->len_pad ? 0 : -1;
}

/* Keys 0..len-1 of KV head h of a sequence (block table `table`) into the tile layouts. */
static void layout_kv(const mqinfer_attention_args *j, const int64_t *table, int64_t h, int64_t len,
                      int64_t len_pad, amx_scratch *w) {
    const int64_t D = j->head_dim, hkv = j->num_kv_heads, bs = j->block_size, DG = D / 32, DC = D / 16;
    const uint16_t *kc = (const uint16_t *)j->k_cache, *vc = (const uint16_t *)j->v_cache;
    static const uint16_t zeros[128];
    for (int64_t key = 0; key < len_pad; key++) {
        const int64_t slot = key < len ? (table[key / bs] * bs + key % bs) * hkv + h : -1;
        const uint32_t *krow = (const uint32_t *)(slot >= 0 ? kc + slot * D : zeros);
        const int64_t kb = key / 16, n = key % 16;
        for (int64_t dg = 0; dg < DG; dg++) {
            uint32_t *tile = w->kt + (kb * DG + dg) * 256;
            for (int r = 0; r < 16; r++) tile[r * 16 + n] = krow[dg * 16 + r];
        }
    }
    for (int64_t k0 = 0; k0 < len_pad; k0 += 2) {
        const int64_t s0 = k0 < len ? (table[k0 / bs] * bs + k0 % bs) * hkv + h : -1;
        const int64_t s1 = k0 + 1 < len ? (table[(k0 + 1) / bs] * bs + (k0 + 1) % bs) * hkv + h : -1;
        const uint16_t *v0 = s0 >= 0 ? vc + s0 * D : zeros, *v1 = s1 >= 0 ? vc + s1 * D : zeros;
        const int64_t kp = k0 / 32, r = (k0 % 32) / 2;
        for (int64_t c = 0; c < DC; c++) {
            uint16_t *row = (uint16_t *)(w->vv + ((kp * DC + c) * 16 + r) * 16);
            for (int n = 0; n < 16; n++) {
                row[2 * n] = v0[c * 16 + n];
                row[2 * n + 1] = v1[c * 16 + n];
            }
        }
    }
}

/* Softmax of tile row r over its first len scores (scaled), into bfloat16 weights zero up to
   `width`; returns 1 / (sum of the weights before rounding). */
static float softmax_row(const float *s, uint16_t *p, int64_t len, int64_t width, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mv = _mm512_set1_ps(-FLT_MAX);
    for (int64_t k = 0; k < len; k += 16) {
        const __mmask16 m = len - k >= 16 ? 0xffff : (__mmask16)((1u << (len - k)) - 1);
        mv = _mm512_mask_max_ps(mv, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + k), sc), mv);
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < width; k += 16) {
        if (k >= len) {
            _mm256_storeu_si256((__m256i *)(p + k), _mm256_setzero_si256());
            continue;
        }
        const __mmask16 m = len - k >= 16 ? 0xffff : (__mmask16)((1u << (len - k)) - 1);
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + k), sc), mx);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive16(x));
        sum = _mm512_add_ps(sum, e);
        vstore_bf16(p + k, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Tokens s..e-1, one sequence at consecutive positions, KV head h: every query head of h,
   16 tokens a tile. Tiles (mq_amx_configure_tiles: every tile 16 rows of 64 bytes): scores,
   tile 0 = S, 1..4 = Q (one per 32 dimensions), 5 = K^T; output, tiles 0..3 = O (16 dimensions
   each), 4 = P, 5 = V. */
static void attend_segment(const mqinfer_attention_args *j, int64_t s, int64_t e, int64_t h, amx_scratch *w) {
    const int64_t D = j->head_dim, DG = D / 32, DC = D / 16, g = j->num_heads / j->num_kv_heads;
    const int64_t len_pad = w->len_pad;
    const uint16_t *q = (const uint16_t *)j->q;
    uint16_t *out = (uint16_t *)j->out;
    for (int64_t i = 0; i < g; i++) {
        const int64_t head = h * g + i;
        for (int64_t t0 = s; t0 < e; t0 += 16) {
            const int64_t rows = e - t0 < 16 ? e - t0 : 16;
            const int64_t len = j->positions[t0 + rows - 1] + 1, nkb = (len + 15) / 16, width = (len + 31) / 32 * 32;
            memset(w->q, 0, 16 * D * 2);
            for (int64_t r = 0; r < rows; r++) memcpy(w->q + r * D, q + (t0 + r) * j->q_token_stride + head * D, D * 2);
            for (int64_t dg = 0; dg < DG; dg++) {
                switch (dg) {  /* tile numbers are immediates */
                    case 0: _tile_loadd(1, w->q + 0, D * 2); break;
                    case 1: _tile_loadd(2, w->q + 32, D * 2); break;
                    case 2: _tile_loadd(3, w->q + 64, D * 2); break;
                    default: _tile_loadd(4, w->q + 96, D * 2); break;
                }
            }
            for (int64_t kb = 0; kb < nkb; kb++) {
                const uint32_t *kt = w->kt + kb * DG * 256;
                _tile_zero(0);
                _tile_loadd(5, kt, 64); _tile_dpbf16ps(0, 1, 5);
                _tile_loadd(5, kt + 256, 64); _tile_dpbf16ps(0, 2, 5);
                if (DG > 2) {
                    _tile_loadd(5, kt + 512, 64); _tile_dpbf16ps(0, 3, 5);
                    _tile_loadd(5, kt + 768, 64); _tile_dpbf16ps(0, 4, 5);
                }
                _tile_stored(0, w->scores + kb * 16, len_pad * 4);
            }
            float inv[16];
            for (int64_t r = 0; r < rows; r++)
                inv[r] = softmax_row(w->scores + r * len_pad, w->p + r * len_pad, j->positions[t0 + r] + 1, width,
                                     j->scale);
            for (int64_t r = rows; r < 16; r++) memset(w->p + r * len_pad, 0, width * 2);
            for (int64_t c0 = 0; c0 < DC; c0 += 4) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kp = 0; kp < width / 32; kp++) {
                    const uint32_t *vv = w->vv + (kp * DC + c0) * 256;
                    _tile_loadd(4, w->p + kp * 32, len_pad * 2);
                    _tile_loadd(5, vv, 64); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, vv + 256, 64); _tile_dpbf16ps(1, 4, 5);
                    _tile_loadd(5, vv + 512, 64); _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(5, vv + 768, 64); _tile_dpbf16ps(3, 4, 5);
                }
                for (int c = 0; c < 4; c++) {
                    switch (c) {
                        case 0: _tile_stored(0, w->o, 64); break;
                        case 1: _tile_stored(1, w->o, 64); break;
                        case 2: _tile_stored(2, w->o, 64); break;
                        default: _tile_stored(3, w->o, 64); break;
                    }
                    for (int64_t r = 0; r < rows; r++)
                        vstore_bf16(out + ((t0 + r) * j->num_heads + head) * D + (c0 + c) * 16,
                                    _mm512_mul_ps(_mm512_loadu_ps(w->o + r * 16), _mm512_set1_ps(inv[r])));
                }
            }
        }
    }
}

/* The end of the run that token t belongs to (see the top of the file), within the call. */
static int64_t run_end(const mqinfer_attention_args *j, int64_t t) {
    int64_t e = t + 1;
    while (e < j->num_tokens && j->seq_of_token[e] == j->seq_of_token[t] && j->positions[e] == j->positions[e - 1] + 1)
        e++;
    return e;
}

static int64_t run_start(const mqinfer_attention_args *j, int64_t t) {
    while (t > 0 && j->seq_of_token[t - 1] == j->seq_of_token[t] && j->positions[t - 1] + 1 == j->positions[t]) t--;
    return t;
}

/* A token's context plus a fixed cost; tokens of prompt runs go through the tiles at about a
   fifth of the per-token versions' time per key (a 2-vCPU Xeon, SmolLM2's heads: 384 prompt
   tokens' attention 8 ms a step for 30 layers against 43 ms for 192 decoding tokens at context
   160), so they weigh a quarter: with equal weights, a step of decodes and prompt chunks gave one
   thread the decodes and the other the prompts, which finished long before. */
void mq_attention_token_weights(const mqinfer_attention_args *j, int usable, int64_t *weights) {
    for (int64_t s = 0; s < j->num_tokens;) {
        const int64_t e = run_end(j, s);
        const int tiles = usable && e - s >= AMX_MIN_RUN;
        for (int64_t t = s; t < e; t++) weights[t] = tiles ? (j->positions[t] + 8) / 4 + 1 : j->positions[t] + 8;
        s = e;
    }
}

int mq_attend_with_amx(const mqinfer_attention_args *j, int64_t begin, int64_t end, attend_fn per_token,
                       float *buf) {
    amx_scratch w;
    memset(&w, 0, sizeof(w));
    const int64_t D = j->head_dim;
    w.q = aligned_alloc(64, 16 * D * 2);
    w.o = aligned_alloc(64, 16 * 16 * 4);
    int status = (w.q && w.o) ? 0 : -1;
    int configured = 0;
    for (int64_t t = begin; t < end && status == 0;) {
        const int64_t rs = run_start(j, t), re = run_end(j, t), stop = re < end ? re : end;
        if (re - rs < AMX_MIN_RUN) {
            per_token(j, t, stop, buf);
        } else {
            const int64_t len_pad = (j->positions[stop - 1] + 1 + 31) / 32 * 32;
            if (scratch_for(&w, len_pad, D)) {
                status = -1;
                break;
            }
            if (!configured) {
                mq_amx_configure_tiles();
                configured = 1;
            }
            const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;
            for (int64_t h = 0; h < j->num_kv_heads; h++) {
                layout_kv(j, table, h, j->positions[stop - 1] + 1, len_pad, &w);
                attend_segment(j, t, stop, h, &w);
            }
        }
        t = stop;
    }
    if (configured) _tile_release();
    free(w.kt); free(w.vv); free(w.scores); free(w.p); free(w.q); free(w.o);
    return status;
}

#else

int mq_amx_attention_usable(const mqinfer_attention_args *j) {
    (void)j;
    return 0;
}

int mqinfer_attention_use_amx(int enable) {
    (void)enable;
    return -1;
}

int mq_attend_with_amx(const mqinfer_attention_args *j, int64_t begin, int64_t end, attend_fn per_token,
                       float *buf) {
    per_token(j, begin, end, buf);
    return 0;
}

void mq_attention_token_weights(const mqinfer_attention_args *j, int usable, int64_t *weights) {
    (void)usable;
    for (int64_t t = 0; t < j->num_tokens; t++) weights[t] = j->positions[t] + 8;
}

#endif
