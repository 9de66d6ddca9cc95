/* GGML block facts shared by kquant.c, kquant_i8.c and decode_layer.c: block sizes, IQ4's value table,
 * small field readers (facts from ggml-common.h; the code is written here), and the kind numbers of
 * kquant_i8.c's two non-block layouts. */
#ifndef QUILL_KFORMAT_H
#define QUILL_KFORMAT_H
#include "isa.h"
#include <stdint.h>
#include <string.h>

/* Bytes per block: 256-weight super-blocks, then 32-weight blocks. */
#define Q2K_BYTES 84
#define Q3K_BYTES 110
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210
#define IQ4XS_BYTES 136
#define Q5_0_BYTES 22
#define IQ4NL_BYTES 18

/* IQ4_NL / IQ4_XS: the signed value of each 4-bit index (kvalues_iq4nl). */
static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* kquant_i8.c's kinds for quant_gemv.c's q4 / q8 layouts, next to kquant.c's block kinds 0..9. */
#define LAYOUT_Q4 100
#define LAYOUT_Q8 101

static inline float f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

/* Q4_K / Q5_K's twelve bytes of 6-bit scales and mins (at blk + 4) as 16 bytes: 8 scales, then 8 mins.
 * As three little-endian words u0 u1 u2: scales 0-3 = u0 & 0x3f.., mins 0-3 = u1 & 0x3f..,
 * scales 4-7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4, mins 4-7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4. */
static inline __m128i k4_scales_mins(const uint8_t *blk) {
    uint32_t u[3], v[4];
    memcpy(u, blk + 4, 12);
    v[0] = u[0] & 0x3f3f3f3fu;
    v[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    v[2] = u[1] & 0x3f3f3f3fu;
    v[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    return _mm_loadu_si128((const __m128i *)v);
}

/* 16 bytes of nibbles -> 32 bytes: byte j's low nibble is element j, its high nibble element j + 16
 * (Q4_0, Q5_0, IQ4's order within a 32-weight group). */
static inline __m256i nibbles32(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
}
#endif
