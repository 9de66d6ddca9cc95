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
#endif
