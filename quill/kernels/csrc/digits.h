/* Exact activations as integer digits: what amx_gemv.c (the AMX tile GEMV) and kquant_i8.c (the VNNI
 * tiles' exact path) share. A span of x (a 32-element group; Q6_K's AMX GEMV: a 256-element super-block)
 * whose largest |x| has 2^(e-1) <= max|x| < 2^e takes the unit 2^(e-22): v = round(x / unit) is an
 * integer with |v| <= 2^22 (an error of at most half a unit per element, 2^(e-23) <= 2^-22 max|x|:
 * two units in the last place of the span's largest, the size of fp32's own rounding in a sum), split
 * into balanced digits
 * v = d0 + 2^8 d1 + 2^16 d2, d0 and d1 in [-128, 127], d2 in [-64, 64]. An integer dot-product
 * instruction then multiplies each digit by the weights' integer codes exactly, and the three sums are
 * recombined and scaled by the unit in fp32. */
#ifndef QUILL_DIGITS_H
#define QUILL_DIGITS_H
#include "isa.h"

#include <math.h>

/* The unit for a span whose largest |x| is mx, and e; NaN where a NaN or an infinity is in it (the output
 * is then NaN, as in fp32), 0 when it is all zero (no digits). */
static inline float digit_unit(float mx, int nan, int *e) {
    *e = 0;
    if (nan || isinf(mx)) return NAN;
    if (!(mx > 0.f)) return 0.f;
    frexpf(mx, e);
    return ldexpf(1.f, *e - 22);
}

/* 16 integers |v| <= 2^22 -> their balanced digits d[0], d[1], d[2]. */
AVX512 static inline void digits3(__m512i v, __m512i d[3]) {
    for (int p = 0; p < 3; p++) {
        d[p] = p == 2 ? v : _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
        v = _mm512_srai_epi32(_mm512_sub_epi32(v, d[p]), 8);
    }
}

/* The 32 values at p (one group): their unit (digit_unit's) and, where it is positive, their digits,
 * d[h][k] digit k of values 16h .. 16h + 15; zeros for a NaN or an infinity (the unit carries it) or an
 * all-zero group. */
AVX512 static inline float group_digits(const float *p, __m512i d[2][3]) {
    const __m512 v[2] = {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)};
    const __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[1], _CMP_UNORD_Q); /* a NaN in either half */
    int e;
    const float unit = digit_unit(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))), nan != 0, &e);
    for (int h = 0; h < 2; h++)
        if (unit > 0.f) /* |v| <= 2^22 */
            digits3(_mm512_cvtps_epi32(_mm512_scalef_ps(v[h], _mm512_set1_ps((float)(22 - e)))), d[h]);
        else
            d[h][0] = d[h][1] = d[h][2] = _mm512_setzero_si512();
    return unit;
}
#endif
