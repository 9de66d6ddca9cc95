/* Small SIMD helpers shared by the kernels. */
#ifndef QUILL_SIMD_H
#define QUILL_SIMD_H
#include <immintrin.h>

/* Sum of the eight lanes, always in the same order. */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif
