/* Small SIMD helpers shared by the kernels. */
#ifndef QUILL_SIMD_H
#define QUILL_SIMD_H
#include "isa.h"

/* Sum of the eight lanes, always in the same order. */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* F(args..., nb) with nb a constant 1..8 (the always-inline row kernels keep their accumulators in
 * registers only when nb is known at compile time). */
#define NB_SWITCH(F, ...)                                                                           \
    switch (nb) {                                                                                   \
    case 1: F(__VA_ARGS__, 1); break;                                                               \
    case 2: F(__VA_ARGS__, 2); break;                                                               \
    case 3: F(__VA_ARGS__, 3); break;                                                               \
    case 4: F(__VA_ARGS__, 4); break;                                                               \
    case 5: F(__VA_ARGS__, 5); break;                                                               \
    case 6: F(__VA_ARGS__, 6); break;                                                               \
    case 7: F(__VA_ARGS__, 7); break;                                                               \
    default: F(__VA_ARGS__, 8); break;                                                              \
    }
#endif
