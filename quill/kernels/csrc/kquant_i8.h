/* What kquant_i8.c (the activations' rounding, the AVX-512 VNNI tiles) and kquant_i8_avx2.c (the AVX2
 * tiles) share: one item's rounded-activation buffer and the block kinds' sizes. The buffer's layout is
 * stated in kquant_i8.c's header. */
#ifndef QUILL_KQUANT_I8_H
#define QUILL_KQUANT_I8_H
#include <stdint.h>

#include "kformat.h"

static inline long act_bytes(long K) { return K + K / 8 + K / 8 + K / 4 + K / 8; }

typedef struct {
    const int8_t *q;
    const float *dx, *xs;
    const int32_t *o16, *o32; /* the offset terms: -32 x each 16 codes' sum (Q6_K), -128 x each group's (IQ4_XS, Q8_0) */
} Act;

static inline Act act_at(const uint8_t *buf, long K, int b) {
    const uint8_t *p = buf + (long)b * act_bytes(K);
    return (Act){(const int8_t *)p, (const float *)(p + K), (const float *)(p + K + K / 8), (const int32_t *)(p + K + K / 4),
                 (const int32_t *)(p + K + K / 2)};
}

/* 1 for the block kinds the tiles take (both paths, both ISAs): 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K. */
static inline int tile_block_kind(int kind) { return kind == 0 || kind == 1 || kind == 4 || kind == 5; }

/* Bytes per super-block of the block kinds with an int8 kernel: 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K. */
static inline int super_bytes(int kind) {
    return kind == 0 ? Q4K_BYTES : kind == 5 ? Q5K_BYTES : kind == 1 ? Q6K_BYTES : IQ4XS_BYTES;
}

/* F(k, ...) with a block kind a constant k (0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K), so the inlined loops keep
 * no kind test. */
#define BLOCK_CONST(F, kind, ...)                                                                    \
    do {                                                                                             \
        if ((kind) == 0) { F(0, __VA_ARGS__); }                                                      \
        else if ((kind) == 1) { F(1, __VA_ARGS__); }                                                 \
        else if ((kind) == 4) { F(4, __VA_ARGS__); }                                                 \
        else { F(5, __VA_ARGS__); }                                                                  \
    } while (0)

/* Part b of nblk of the n bytes at p, into L2 (the tiles' prefetch of the next tile's rows). */
static inline void prefetch_part(const char *p, long n, long b, long nblk) {
    const long per = (n + nblk - 1) / nblk;
    for (long o = b * per; o < (b + 1) * per && o < n; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/* out (B, ld) columns [0, N) with int8 activations on AVX2 (kquant_i8_avx2.c: tiles for the block kinds,
 * rows for the q4 / q8 layouts), for every kind quill_i8_supported accepts; act holds the B items'
 * rounded activations. */
void quill_i8_tiles_avx2(int kind, const uint8_t *codes, const float *scale, const float *mins, const uint8_t *act,
                         long K, int N, int B, float *out, int ld, int threads);
#endif
