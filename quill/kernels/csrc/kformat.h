/* Small readers of GGML block fields shared by kquant.c and kquant_i8.c (facts from ggml-common.h's
 * block_q4_K / block_q5_K; the code is written here). */
#ifndef QUILL_KFORMAT_H
#define QUILL_KFORMAT_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
#endif
