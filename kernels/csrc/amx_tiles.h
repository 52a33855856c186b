/* The AMX tile setup shared by the kernels that use the tile unit: asking Linux for the tile
   state, and the one tile configuration they all use. Everything here exists only in a build
   for a CPU with AMX tiles; each kernel adds the checks for the tile instructions it uses. */
#ifndef MQINFER_AMX_TILES_H
#define MQINFER_AMX_TILES_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile unit. Linux hands a process the (large) tile register
   state only when asked (arch_prctl); the answer is asked for once per including source and
   kept: 1 granted, -1 refused, 0 not asked yet. */
static inline int mq_amx_permitted(void) {
    static int state = 0;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* The 64-byte tile configuration that _tile_loadconfig reads (palette 1). */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) mq_tile_config;

/* Configures tiles 0..7 as 16 rows of 64 bytes each (16 float32 or int32, 16 pairs of bfloat16,
   16 quads of int8), on the calling thread; what each kernel keeps in which tile is written
   beside its call. */
static inline void mq_amx_configure_tiles(void) {
    mq_tile_config c;
    memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}
#endif

#endif
