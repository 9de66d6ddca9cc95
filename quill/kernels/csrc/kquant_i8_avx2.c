/* The int8 path's tiles for CPUs without AVX-512 VNNI (AVX2 only, as AMD Zen 1-3; and any CPU asked for
 * isa 256), for the block kinds (Q4_K, Q5_K, Q6_K, IQ4_XS): the idea of kquant_i8.c's VNNI tiles with
 * eight weight rows at a time, one row per 32-bit lane of a 256-bit register. The q4 / q8 layouts keep
 * rows (further below).
 *
 * The eight rows' bytes of a super-block are transposed in spans of 32 bytes (transpose8: dword j of
 * every row in one register), then decoded lane-wise into 64 registers of four codes per lane (c[j]:
 * weights 4j..4j+3 of the 256) and per-lane fp32 scales. An item's dot is vpmaddubsw of c[j] with four
 * of its int8 activations broadcast to every lane (unsigned codes times signed activations, pairs
 * summed to int16), so one decoded register serves every item of the batch. Without vpdpbusd the int16
 * pairs must be widened (vpmaddwd by ones); to widen less often, a run of RUN(kind) dwords is summed in
 * int16 first, as long as the sum cannot overflow: |pair| <= 2 * 127 * (largest code), so a run of R is
 * safe while 254 * cmax * R <= 32767:
 *   Q4_K (codes 0..15): R = 8 (30480);  Q5_K (0..31): R = 4 (31496);  Q6_K (0..63): R = 2 (32004).
 * IQ4_XS's signed table values keep |w| as the unsigned operand and give x w's sign (vpsignb):
 * |pair| <= 2 * 127 * 127, R = 1, and no offset is needed.
 *
 * Per (row, item), per scaled unit u of a super-block (a 32-weight group; Q6_K: a 16-weight chunk), in order:
 *   f = float(integer dot of unit u)                          (exact: every dot is below 2^24)
 *   Q6_K:            s += (f - 32 s16_u) * (sc_u * dx_(u/2))
 *   Q4_K, Q5_K:      s += f * (sc_u * dx_u);  s -= mn_u * xs_u
 *   IQ4_XS:          s += f * (sc_u * dx_u)
 * the same sequence at any batch. A pass with a single item (batch 1) does not store the decoded codes:
 * each goes straight into the item's vpmaddubsw (emit8 / Fuse8), and the integer dots are the same, so
 * the floats are too: a row is bit-identical alone and in a batch.
 *
 * The exact path (fp32 activations) of the same kinds reuses the tiles' decode: quill_gemv_tiles_f32_avx2,
 * further below.
 *
 * Block layouts: facts from GGML's format (ggml-common.h); the code is written here.
 */
#include "isa.h"

#include "kquant_i8.h"
#include "simd.h"
#include <stdint.h>
#include <string.h>

#define ALWAYS __attribute__((always_inline))
#define IT8 4     /* items per pass over a decoded tile or past a layout row: their accumulators stay in registers
                     (16 ymm); NB4 below makes each count 1..4 a constant */
#define CHUNK8 64 /* items per pass over the weights: their activations stay in L2 while each tile meets them */

#define RUN(kind) ((kind) == 0 ? 8 : (kind) == 5 ? 4 : (kind) == 1 ? 2 : 1)
#define UNIT(kind) ((kind) == 1 ? 4 : 8) /* dwords per scaled unit */
#define SIGNED(kind) ((kind) == 4)       /* IQ4_XS */

typedef struct {
    __m256i c[64]; /* c[j] lane r = row r's weights 4j..4j+3: unsigned codes (IQ4_XS: |w|) */
    __m256i w[64]; /* IQ4_XS: the signed codes (their signs) */
    __m256 sc[16]; /* per unit scale, lane r = row r (the exact path's: times 2^-24, see code_f32_8) */
    __m256 mn[8];  /* Q4_K, Q5_K: per group dmin m */
} Tile8;

/* One item meeting the codes as they are decoded: r16 the open int16 runs, d[u] the units' int32 dots;
 * with fp32 activations (fp 1, the exact path), fd[h][u] the units' fp32 dots over their even (h 0) and
 * odd (h 1) weights (two chains: see fpass8); or (fp 2) no item:
 * the codes as fp32 into F (the exact path's tile for a pass over several items). */
typedef struct {
    int fp;    /* a constant where made */
    __m256 *F; /* fp 2: F[k] lane r = row r's code k (code_f32_8) */
    union {
        struct {
            __m256i r16[64];
            __m256i d[16];
        };
        __m256 fd[2][16];
    };
    const int8_t *q; /* the item's 256 activations of this block (int8) */
    const float *x;  /* (fp32) */
} Fuse8;

/* Byte b of each lane of v (the format's own signed or unsigned code, signed_codes8) as fp32 times 2^24:
 * one byte shuffle moves it to the lane's top byte (zeros below), so the convert is exact and signed for
 * every kind, with no shift and mask per byte (one instruction where the shifts took two: 0.83-0.94x the
 * time at batch 1 on a Zen 1). The 2^24 is taken out of each unit's scale instead (decode8, on the exact
 * path); a power of two, so every rounding is the same as with the code itself, except where a product
 * code * x falls below fp32's normal range (|code * x| < 2^-126): there the scaled product keeps bits the
 * plain one would lose. Both passes (fused and tile) scale alike, so batch invariance holds either way. */
static inline ALWAYS __m256 code_f32_8(__m256i v, const int b) {
    if (b == 3) return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xff000000u)));
    const char z = (char)0x80;
    const __m256i m = _mm256_setr_epi8(z, z, z, (char)b, z, z, z, (char)(4 + b), z, z, z, (char)(8 + b), z, z, z, (char)(12 + b),
                                       z, z, z, (char)b, z, z, z, (char)(4 + b), z, z, z, (char)(8 + b), z, z, z, (char)(12 + b));
    return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, m));
}

/* The format's own codes of a dword: Q6_K q - 32 (a byte subtraction), IQ4_XS the table values. */
static inline ALWAYS __m256i signed_codes8(const int kind, __m256i c, __m256i w) {
    return kind == 4 ? w : kind == 1 ? _mm256_sub_epi8(c, _mm256_set1_epi8(32)) : c;
}

static inline __m256i bcast4(const int8_t *p) { /* four activations in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The codes of dword j: kept for a pass over the items, or (f) dotted at once with f's item. */
static inline ALWAYS void emit8(const int kind, Tile8 *t, Fuse8 *f, const int j, __m256i c, __m256i w) {
    if (!f) {
        t->c[j] = c;
        if (SIGNED(kind)) t->w[j] = w;
        return;
    }
    if (f->fp == 2) {
        const __m256i v = signed_codes8(kind, c, w);
        for (int b = 0; b < 4; b++) f->F[4 * j + b] = code_f32_8(v, b);
        return;
    }
    if (f->fp) { /* four FMAs into the unit's two chains, each in the order of its weights */
        const __m256i v = signed_codes8(kind, c, w);
        const int u = j / UNIT(kind);
        for (int b = 0; b < 4; b++)
            f->fd[b & 1][u] = _mm256_fmadd_ps(code_f32_8(v, b), _mm256_set1_ps(f->x[4 * j + b]), f->fd[b & 1][u]);
        return;
    }
    __m256i x = bcast4(f->q + 4 * j);
    if (SIGNED(kind)) x = _mm256_sign_epi8(x, w);
    const __m256i p = _mm256_maddubs_epi16(c, x);
    /* every decoder emits a run's first dword first and its last dword last */
    const int r = j / RUN(kind), pos = j % RUN(kind), u = j / UNIT(kind);
    f->r16[r] = pos ? _mm256_add_epi16(f->r16[r], p) : p;
    if (pos == RUN(kind) - 1) f->d[u] = _mm256_add_epi32(f->d[u], _mm256_madd_epi16(f->r16[r], _mm256_set1_epi16(1)));
}

/* T[j] lane r = dword j of the 32 bytes at rows[r] + off (an 8 x 8 transpose of 32-bit elements). */
static inline ALWAYS void transpose8(const uint8_t *const *rows, long off, __m256i T[8]) {
    __m256i r[8], a[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + off));
    for (int i = 0; i < 4; i++) { /* 128-bit lane L: rows 2i, 2i + 1's dwords 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi) */
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* r[4i + c] lane L: rows 4i..4i+3's dword 4L + c */
        r[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        r[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        T[c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x20);
        T[4 + c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x31);
    }
}

static inline __m256 lanes_f16(__m256i v, int high) { /* the fp16 in the low (high: upper) 16 bits of each lane */
    const __m256i w = _mm256_and_si256(high ? _mm256_srli_epi32(v, 16) : v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

static inline __m256 byte_u(__m256i v, int k) { /* byte k of each lane, zero-extended, as fp32 */
    return _mm256_cvtepi32_ps(k == 3 ? _mm256_srli_epi32(v, 24) : _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(255)));
}

/* Super-block b of a block kind (0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K) for 8 rows -> t (or f), a transposed
 * span of 32 bytes at a time (each span read whole: every offset + 32 <= the block's bytes). */
static inline ALWAYS void decode8(const int kind, const uint8_t *const *rows, long b, Tile8 *t, Fuse8 *f) {
    const long base = (long)b * super_bytes(kind);
    const __m256i n4 = _mm256_set1_epi8(15);
    __m256i H[8], T[8];
    if (kind == 0 || kind == 5) { /* d, dmin; 12 bytes of 6-bit scales and mins; Q5_K: 32 bytes of fifth bits */
        transpose8(rows, base, H);
        const __m256 d = lanes_f16(H[0], 0), dmin = lanes_f16(H[0], 1);
        /* kformat.h's k4_scales_mins lane-wise: scales 0-3, scales 4-7, mins 0-3, mins 4-7 */
        const __m256i u0 = H[1], u1 = H[2], u2 = H[3], lo6 = _mm256_set1_epi8(0x3f), top2 = _mm256_set1_epi8(0x30);
        const __m256i q[4] = {_mm256_and_si256(u0, lo6),
                              _mm256_or_si256(_mm256_and_si256(u2, n4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), top2)),
                              _mm256_and_si256(u1, lo6),
                              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), n4), _mm256_and_si256(_mm256_srli_epi32(u1, 2), top2))};
        for (int g = 0; g < 8; g++) {
            t->sc[g] = _mm256_mul_ps(d, byte_u(q[g / 4], g % 4));
            t->mn[g] = _mm256_mul_ps(dmin, byte_u(q[2 + g / 4], g % 4));
        }
        __m256i QH[8];
        if (kind == 5) transpose8(rows, base + 16, QH);
        const __m256i one = _mm256_set1_epi8(1);
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; jj++) { /* 32 bytes per 64 weights: low nibbles weights 64jj + l, high 64jj + 32 + l */
            transpose8(rows, base + (kind == 5 ? 48 : 16) + 32 * jj, T);
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) {
                __m256i lo = _mm256_and_si256(T[e], n4), hi = _mm256_and_si256(_mm256_srli_epi32(T[e], 4), n4);
                if (kind == 5) { /* bit 2jj (2jj + 1) of qh's byte l: weight 64jj + l's (64jj + 32 + l's) fifth bit */
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(QH[e], 2 * jj), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(QH[e], 2 * jj + 1), one), 4));
                }
                emit8(kind, t, f, 16 * jj + e, lo, lo);
                emit8(kind, t, f, 16 * jj + 8 + e, hi, hi);
            }
        }
    } else if (kind == 1) { /* Q6_K: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d */
        transpose8(rows, base + 176, H); /* dwords 4..7: the scales */
        uint16_t dh[8];
        for (int r = 0; r < 8; r++) memcpy(dh + r, rows[r] + base + 208, 2);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
        for (int c = 0; c < 16; c++) /* byte c of the scales, sign-extended */
            t->sc[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(H[4 + c / 4], 24 - 8 * (c % 4)), 24)));
        const __m256i top2 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i QH[8];
            transpose8(rows, base + 128 + 32 * h, QH);
#pragma GCC unroll 2
            for (int second = 0; second < 2; second++) { /* ql[l] (ql[l + 32]) with qh[l] -> weights 128h + l, + 64 (+ 32) */
                transpose8(rows, base + 64 * h + 32 * second, T);
#pragma GCC unroll 8
                for (int e = 0; e < 8; e++) { /* each code: 4 low bits from ql, bits 4-5 from its pair of qh moved there */
                    const __m256i lo_hi2 = second ? _mm256_slli_epi32(QH[e], 2) : _mm256_slli_epi32(QH[e], 4);
                    const __m256i hi_hi2 = second ? _mm256_srli_epi32(QH[e], 2) : QH[e];
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(T[e], n4), _mm256_and_si256(lo_hi2, top2));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(T[e], 4), n4), _mm256_and_si256(hi_hi2, top2));
                    emit8(kind, t, f, 32 * h + 8 * second + e, lo, lo);
                    emit8(kind, t, f, 32 * h + 16 + 8 * second + e, hi, hi);
                }
            }
        }
    } else { /* IQ4_XS: d, 16 bits of high scale bits, 4 bytes of low scale nibbles, 128 bytes of indices */
        transpose8(rows, base, H);
        const __m256 d = lanes_f16(H[0], 0);
        for (int g = 0; g < 8; g++) {
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(H[1], 8 * (g / 2) + 4 * (g % 2)), _mm256_set1_epi32(15));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(H[0], 16 + 2 * g), _mm256_set1_epi32(3));
            t->sc[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32))));
        }
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE)), abs = _mm256_abs_epi8(table);
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            transpose8(rows, base + 8 + 32 * s, T);
            /* groups 2s and 2s + 1, 16 bytes each: low nibbles weights 32g + l, high 32g + 16 + l. Each
             * group's dwords go out in the order of its weights (the exact path's dot), the two groups' in turn. */
#pragma GCC unroll 2
            for (int high = 0; high < 2; high++)
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const int h = k % 2, e = 4 * h + k / 2;
                    const __m256i n = high ? _mm256_and_si256(_mm256_srli_epi32(T[e], 4), n4) : _mm256_and_si256(T[e], n4);
                    emit8(kind, t, f, 8 * (2 * s + h) + 4 * high + k / 2, _mm256_shuffle_epi8(abs, n), _mm256_shuffle_epi8(table, n));
                }
        }
    }
    if (f && f->fp) /* the exact path: code_f32_8's 2^24 out of the scales (a power of two: exact) */
        for (int u = 0; u < 64 / UNIT(kind); u++) t->sc[u] = _mm256_mul_ps(t->sc[u], _mm256_set1_ps(0x1p-24f));
}

/* Item a's fp32 step for unit u of block b (the header's sequence), given the unit's integer dot. */
static inline ALWAYS __m256 unit_float(const int kind, __m256i dot, const Tile8 *t, const Act *a, long b, int u, __m256 s) {
    if (kind == 1) { /* the offset taken off in the integers (o16 = -32 s16_u): the same float as in fp32 */
        const __m256 g = _mm256_cvtepi32_ps(_mm256_add_epi32(dot, _mm256_set1_epi32(a->o16[16 * b + u])));
        return _mm256_fmadd_ps(g, _mm256_mul_ps(t->sc[u], _mm256_set1_ps(a->dx[8 * b + u / 2])), s);
    }
    const __m256 f = _mm256_cvtepi32_ps(dot);
    s = _mm256_fmadd_ps(f, _mm256_mul_ps(t->sc[u], _mm256_set1_ps(a->dx[8 * b + u])), s);
    return kind == 4 ? s : _mm256_fnmadd_ps(t->mn[u], _mm256_set1_ps(a->xs[8 * b + u]), s);
}

/* Items [i0, i0 + nb) meet the decoded tile of super-block b: acc[i] (8 rows of item i0 + i) += their
 * contribution. With fz (nb = 1) the units' integer dots are already made. */
static inline ALWAYS void items8(const int kind, const Tile8 *t, const Fuse8 *fz, const uint8_t *act, long K, long b,
                                 float *acc, int i0, const int nb) {
    const int R = RUN(kind), U = UNIT(kind);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 s[IT8];
    Act a[IT8];
    for (int i = 0; i < nb; i++) s[i] = _mm256_loadu_ps(acc + 8 * i), a[i] = act_at(act, K, i0 + i);
    for (int u = 0; u < 64 / U; u++) {
        __m256i dot[IT8];
        if (fz) {
            dot[0] = fz->d[u];
        } else {
            for (int i = 0; i < nb; i++) dot[i] = _mm256_setzero_si256();
            for (int j0 = U * u; j0 < U * u + U; j0 += R) {
                __m256i r16[IT8];
                for (int j = j0; j < j0 + R; j++)
                    for (int i = 0; i < nb; i++) {
                        __m256i x = bcast4(a[i].q + 256 * b + 4 * j);
                        if (SIGNED(kind)) x = _mm256_sign_epi8(x, t->w[j]);
                        const __m256i p = _mm256_maddubs_epi16(t->c[j], x);
                        r16[i] = j == j0 ? p : _mm256_add_epi16(r16[i], p);
                    }
                for (int i = 0; i < nb; i++) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(r16[i], ones));
            }
        }
        for (int i = 0; i < nb; i++) s[i] = unit_float(kind, dot[i], t, &a[i], b, u, s[i]);
    }
    for (int i = 0; i < nb; i++) _mm256_storeu_ps(acc + 8 * i, s[i]);
}

/* F(args..., nb) with nb a constant 1..4 (IT8 items per pass: the accumulators then stay in registers) */
#define NB4(F, ...)                                                                                  \
    do {                                                                                             \
        if (nb == 1) F(__VA_ARGS__, 1);                                                              \
        else if (nb == 2) F(__VA_ARGS__, 2);                                                         \
        else if (nb == 3) F(__VA_ARGS__, 3);                                                         \
        else F(__VA_ARGS__, 4);                                                                      \
    } while (0)
#define ITEMS8(k, ...) NB4(items8, k, __VA_ARGS__)
static void items_pass8(int kind, const Tile8 *t, const uint8_t *act, long K, long b, float *acc, int i0, int nb) {
    BLOCK_CONST(ITEMS8, kind, t, NULL, act, K, b, acc, i0);
}

static void decode_any8(int kind, const uint8_t *const *rows, long b, Tile8 *t) {
    BLOCK_CONST(decode8, kind, rows, b, t, NULL);
}

/* A pass with one item: the codes go straight into its dots, then its floats. One function per kind
 * (with every kind inlined into one function, batch 1 took 1.2x the time). */
static inline ALWAYS void one8_k(const int kind, const uint8_t *const *rows, long b, const uint8_t *act, long K,
                                 float *acc, int item) {
    Tile8 t;
    Fuse8 f;
    f.fp = 0;
    for (int u = 0; u < 16; u++) f.d[u] = _mm256_setzero_si256();
    f.q = act_at(act, K, item).q + 256 * b;
    decode8(kind, rows, b, &t, &f);
    items8(kind, &t, &f, act, K, b, acc, item, 1);
}
#define ONE8(k, name)                                                                                \
    static void name(const uint8_t *const *rows, long b, const uint8_t *act, long K, float *acc, int item) { \
        one8_k(k, rows, b, act, K, acc, item);                                                       \
    }
ONE8(0, one8_q4k)
ONE8(1, one8_q6k)
ONE8(4, one8_iq4xs)
ONE8(5, one8_q5k)

/* ---- Exact fp32 activations on the same tiles (kquant.c's GEMV of the block kinds with isa 256): the
 * decoded codes become fp32 lanes (the format's own codes, signed where its weights are), so weight =
 * scale * code - min is the file's own and x is never rounded. Per (row, item), per scaled unit u of a
 * super-block (a 32-weight group; Q6_K: a 16-weight chunk), the dot d_u = sum over the unit's weights in
 * order of code * x (FMAs from zero); then s += d_u * sc_u, and for Q4_K / Q5_K s -= mn_u * xs_u (xs: the
 * group's sum of x, made by kquant.c). (Every kind used to sum 16-weight chunks, then add a group's two
 * and take out the 2^24 per item: this takes 0.87-0.96x that time at batch 16 and the same at batch 1,
 * one thread on a Zen 1.) The same sequence at any batch: a
 * pass with one item fuses decode and FMAs, larger batches go through the tiles' codes as fp32, two
 * tiles (16 rows) at a time and FIT items per pass, so that each broadcast activation feeds two FMAs
 * and twelve independent sums hide the FMA latency (ftiles8). */

#define FCHUNK8 16 /* items per pass over the weights: their fp32 rows stay in L2 */
#define FIT 6      /* items per pass over two decoded tiles: 2 x 6 accumulators, two code registers and a
                      broadcast fill 15 of the 16 ymm registers */

/* s after super-block b's scales, given its units' dots d (one item; xs: its group sums of the block). */
static inline ALWAYS __m256 unit_floats(const int kind, const Tile8 *t, const __m256 *d, const float *xs, __m256 s) {
    for (int u = 0; u < 64 / UNIT(kind); u++) {
        s = _mm256_fmadd_ps(d[u], t->sc[u], s);
        if (kind == 0 || kind == 5) s = _mm256_fnmadd_ps(t->mn[u], _mm256_set1_ps(xs[u]), s);
    }
    return s;
}

/* One item (x: its K fp32 inputs; xs its K / 32 group sums) through super-block b, decoded as it goes. */
static inline ALWAYS void one8_f32_k(const int kind, const uint8_t *const *rows, long b, const float *x, const float *xs,
                                     float *acc) {
    Tile8 t;
    Fuse8 f;
    f.fp = 1;
    for (int u = 0; u < 16; u++) f.fd[0][u] = f.fd[1][u] = _mm256_setzero_ps();
    f.x = x + 256 * b;
    decode8(kind, rows, b, &t, &f);
    __m256 d[16];
    for (int u = 0; u < 64 / UNIT(kind); u++) d[u] = _mm256_add_ps(f.fd[0][u], f.fd[1][u]);
    _mm256_storeu_ps(acc, unit_floats(kind, &t, d, xs + 8 * b, _mm256_loadu_ps(acc)));
}
#define ONE8_F32(k, name)                                                                            \
    static void name(const uint8_t *const *rows, long b, const float *x, const float *xs, float *acc) { \
        one8_f32_k(k, rows, b, x, xs, acc);                                                          \
    }
ONE8_F32(0, one8_f32_q4k)
ONE8_F32(1, one8_f32_q6k)
ONE8_F32(4, one8_f32_iq4xs)
ONE8_F32(5, one8_f32_q5k)

/* Items [i0, i0 + nb) meet super-block b of nt decoded tiles (F[u][k] lane r = row r of tile u's code k):
 * per scaled unit, nt x nb sums in registers from zero over the unit's even codes in order, then over its
 * odd codes, added (the fused pass's two chains: one chain per unit made the single item wait on FMA
 * latency), then each (tile, item)'s unit_floats into acc[16 * item + 8 * u]. i0 counts from the pass's
 * first item (x, xs point at it). */
static inline ALWAYS void fpass8(const int kind, const int nt, const int nb, const Tile8 *t, __m256 (*F)[256],
                                 const float *x, const float *xs, long K, long b, float *acc, int i0) {
    __m256 D[FIT][2][16];
    const float *xi[FIT];
    for (int i = 0; i < nb; i++) xi[i] = x + (long)(i0 + i) * K + 256 * b;
    const int W = 4 * UNIT(kind); /* weights per unit */
    for (int c = 0; c < 256 / W; c++)
        for (int h = 0; h < 2; h++) { /* the unit's even weights' chain, then its odd weights' */
            __m256 a[2][FIT];
            for (int u = 0; u < nt; u++)
                for (int i = 0; i < nb; i++) a[u][i] = _mm256_setzero_ps();
#pragma GCC unroll 16
            for (int k = W * c + h; k < W * c + W; k += 2) {
                const __m256 f0 = F[0][k], f1 = F[nt - 1][k];
                for (int i = 0; i < nb; i++) {
                    const __m256 xb = _mm256_set1_ps(xi[i][k]);
                    a[0][i] = _mm256_fmadd_ps(f0, xb, a[0][i]);
                    if (nt == 2) a[1][i] = _mm256_fmadd_ps(f1, xb, a[1][i]);
                }
            }
            for (int u = 0; u < nt; u++)
                for (int i = 0; i < nb; i++) D[i][u][c] = h ? _mm256_add_ps(D[i][u][c], a[u][i]) : a[u][i];
        }
    for (int u = 0; u < nt; u++)
        for (int i = 0; i < nb; i++) {
            float *p = acc + 16 * (i0 + i) + 8 * u;
            _mm256_storeu_ps(p, unit_floats(kind, &t[u], D[i][u], xs + (long)(i0 + i) * (K / 32) + 8 * b, _mm256_loadu_ps(p)));
        }
}

/* fpass8 with nt (1, 2) and nb (1..FIT) constants, so its sums stay in registers */
#define FPASS_NB(k, nt, ...)                                                                         \
    do {                                                                                             \
        switch (nb) {                                                                                \
        case 1: fpass8(k, nt, 1, __VA_ARGS__); break;                                                \
        case 2: fpass8(k, nt, 2, __VA_ARGS__); break;                                                \
        case 3: fpass8(k, nt, 3, __VA_ARGS__); break;                                                \
        case 4: fpass8(k, nt, 4, __VA_ARGS__); break;                                                \
        case 5: fpass8(k, nt, 5, __VA_ARGS__); break;                                                \
        default: fpass8(k, nt, 6, __VA_ARGS__);                                                      \
        }                                                                                            \
    } while (0)
#define FPASS(k, ...)                                                                                \
    do {                                                                                             \
        if (nt == 2) FPASS_NB(k, 2, __VA_ARGS__);                                                    \
        else FPASS_NB(k, 1, __VA_ARGS__);                                                            \
    } while (0)
static void fpass_any8(int kind, int nt, int nb, const Tile8 *t, __m256 (*F)[256], const float *x, const float *xs, long K,
                       long b, float *acc, int i0) {
    BLOCK_CONST(FPASS, kind, t, F, x, xs, K, b, acc, i0);
}

/* Super-block b of 8 rows decoded: its scales into t, its codes as fp32 into F (F[k] lane r = row r's code k). */
static inline ALWAYS void decode_floats8_k(const int kind, const uint8_t *const *rows, long b, Tile8 *t, __m256 *F) {
    Fuse8 f;
    f.fp = 2;
    f.F = F;
    decode8(kind, rows, b, t, &f);
}
static void decode_floats8(int kind, const uint8_t *const *rows, long b, Tile8 *t, __m256 *F) {
    BLOCK_CONST(decode_floats8_k, kind, rows, b, t, F);
}

/* The last partial tile (N - 8 * tile < 8 real rows) repeats row N - 1; stores keep its real rows. */
static inline void tile_rows8(const uint8_t *codes, long row_bytes, int N, int tile, const uint8_t *rows[8]) {
    for (int r = 0; r < 8; r++) rows[r] = codes + (8L * tile + r < N ? 8L * tile + r : N - 1) * row_bytes;
}

/* Part b of nblk of rows [first, first + count) (those below N) into L2: the next tile's (pair's) rows
 * in address order while this one runs. */
static inline void prefetch_rows(const uint8_t *codes, long row_bytes, int N, long first, long count, long b, long nblk) {
    if (first >= N) return;
    const long n = first + count <= N ? count : N - first;
    prefetch_part((const char *)(codes + first * row_bytes), n * row_bytes, b, nblk);
}

static inline void store_tile8(float *out, int ld, int N, int tile, const float *acc, int stride, int nc) {
    const int real = N - 8 * tile < 8 ? N - 8 * tile : 8;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(real), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int i = 0; i < nc; i++) _mm256_maskstore_ps(out + (long)i * ld + 8L * tile, keep, _mm256_loadu_ps(acc + (long)stride * i));
}

/* The int8 path's driver, W in a block kind: items in chunks of CHUNK8, each chunk meeting every 8-row
 * tile (tiles split among threads); within a tile each super-block is decoded once and meets the chunk's
 * items IT8 at a time, or a chunk of one item takes the fused pass. */
static void tiles8(int kind, const uint8_t *codes, const uint8_t *act, long K, int N, int B, float *out, int ld, int threads) {
    const int nblk = (int)(K / 256), tiles = (N + 7) / 8;
    const long row_bytes = (long)nblk * super_bytes(kind);
    void (*const one)(const uint8_t *const *, long, const uint8_t *, long, float *, int) =
        kind == 0 ? one8_q4k : kind == 1 ? one8_q6k : kind == 4 ? one8_iq4xs : one8_q5k;
    for (int c0 = 0; c0 < B; c0 += CHUNK8) {
        const int nc = B - c0 < CHUNK8 ? B - c0 : CHUNK8;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
        for (int tile = 0; tile < tiles; tile++) {
            const uint8_t *rows[8];
            tile_rows8(codes, row_bytes, N, tile, rows);
            Tile8 t;
            float acc[CHUNK8 * 8] __attribute__((aligned(32)));
            memset(acc, 0, sizeof(float) * 8 * nc);
            for (long b = 0; b < nblk; b++) {
                prefetch_rows(codes, row_bytes, N, 8L * tile + 8, 8, b, nblk);
                if (nc == 1) {
                    one(rows, b, act, K, acc, c0);
                    continue;
                }
                decode_any8(kind, rows, b, &t);
                for (int i0 = 0; i0 < nc; i0 += IT8) {
                    const int nb = nc - i0 < IT8 ? nc - i0 : IT8;
                    items_pass8(kind, &t, act, K, b, acc + 8 * i0, c0 + i0, nb);
                }
            }
            store_tile8(out + (long)c0 * ld, ld, N, tile, acc, 8, nc);
        }
    }
}

/* The exact path's driver (x, xs fp32): items in chunks of FCHUNK8; one item takes the fused pass tile by
 * tile; more go through pairs of tiles (split among threads), each super-block's two tiles decoded to
 * fp32 codes once and met by the chunk's items FIT at a time (fpass8). */
static void ftiles8(int kind, const uint8_t *codes, const float *x, const float *xs, long K, int N, int B, float *out,
                    int ld, int threads) {
    const int nblk = (int)(K / 256), tiles = (N + 7) / 8, pairs = (tiles + 1) / 2;
    const long row_bytes = (long)nblk * super_bytes(kind);
    void (*const one)(const uint8_t *const *, long, const float *, const float *, float *) =
        kind == 0 ? one8_f32_q4k : kind == 1 ? one8_f32_q6k : kind == 4 ? one8_f32_iq4xs : one8_f32_q5k;
    for (int c0 = 0; c0 < B; c0 += FCHUNK8) {
        const int nc = B - c0 < FCHUNK8 ? B - c0 : FCHUNK8;
        const float *xc = x + (long)c0 * K, *xsc = xs + (long)c0 * (K / 32);
        if (nc == 1) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
            for (int tile = 0; tile < tiles; tile++) {
                const uint8_t *rows[8];
                tile_rows8(codes, row_bytes, N, tile, rows);
                float acc[8] __attribute__((aligned(32))) = {0};
                for (long b = 0; b < nblk; b++) {
                    prefetch_rows(codes, row_bytes, N, 8L * tile + 8, 8, b, nblk);
                    one(rows, b, xc, xsc, acc);
                }
                store_tile8(out + (long)c0 * ld, ld, N, tile, acc, 8, 1);
            }
            continue;
        }
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
        for (int pair = 0; pair < pairs; pair++) {
            const int nt = 2 * pair + 1 < tiles ? 2 : 1;
            const uint8_t *rows[2][8];
            for (int u = 0; u < nt; u++) tile_rows8(codes, row_bytes, N, 2 * pair + u, rows[u]);
            Tile8 t[2];
            __m256 F[2][256];
            float acc[FCHUNK8 * 16] __attribute__((aligned(32)));
            memset(acc, 0, sizeof acc);
            for (long b = 0; b < nblk; b++) {
                prefetch_rows(codes, row_bytes, N, 16L * pair + 16, 16, b, nblk);
                for (int u = 0; u < nt; u++) decode_floats8(kind, rows[u], b, &t[u], F[u]);
                for (int i0 = 0; i0 < nc; i0 += FIT) {
                    const int nb = nc - i0 < FIT ? nc - i0 : FIT;
                    fpass_any8(kind, nt, nb, t, F, xc, xsc, K, b, acc, i0);
                }
            }
            for (int u = 0; u < nt; u++) store_tile8(out + (long)c0 * ld, ld, N, 2 * pair + u, acc + 8 * u, 16, nc);
        }
    }
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T with x in fp32 (the exact path), W in a block kind (0 Q4_K,
 * 1 Q6_K, 4 IQ4_XS, 5 Q5_K; K a multiple of 256); xs: each item's K / 32 sums of x per 32 weights.
 * Returns 0, or -1 (nothing written) for other kinds, for kquant.c to run its rows. */
int quill_gemv_tiles_f32_avx2(int kind, const uint8_t *blocks, const float *x, const float *xs, float *out, int N, int K,
                              int B, int ld, int threads) {
    if (!tile_block_kind(kind) || K % 256) return -1;
    ftiles8(kind, blocks, x, xs, K, N, B, out, ld, threads);
    return 0;
}

/* ---- The q4 / q8 layouts (Q4_0, Q4_1; Q8_0, Q5_1) keep rows: their codes need little decoding, so the
 * tiles' transposes (the codes', and the per-group fp32 scales' and mins') cost more than the reuse
 * saves at batch 1 (1.12x the rows' time for q4, 1.09x for q8, at 2 threads with the weights coming
 * from memory). A row's 32 weights at a time: q4 codes . x, q8 |w| . (x with w's sign), per group to
 * eight int32 lanes; four groups' lanes are added horizontally so that each lane holds one group and one
 * convert and FMA scale all four (the last G % 4 groups one at a time). Items go IT8 at a time past
 * each row of a run of ROWS8 rows. */

#define ROWS8 16 /* rows per task: their weights and a tile of activations stay in L1 / L2 together */

static inline ALWAYS __m256i group_dot(const int q8, __m256i w, __m256i aw, __m256i x) {
    const __m256i p = q8 ? _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline ALWAYS __m256i layout_codes(const int q8, const uint8_t *row, int g) {
    return q8 ? _mm256_loadu_si256((const __m256i *)(row + 32L * g)) : nibbles32(row + 16L * g);
}

static inline ALWAYS void layout_row(const int q8, const uint8_t *codes, const float *scale, const float *mins, int G,
                                     const uint8_t *act, long K, float *out, int ld, int n, int b0, const int nb) {
    const uint8_t *row = codes + (long)n * G * (q8 ? 32 : 16);
    const float *sr = scale + (long)n * G, *mr = mins ? mins + (long)n * G : NULL;
    __m256 acc[IT8];
    float off[IT8];
    for (int t = 0; t < nb; t++) acc[t] = _mm256_setzero_ps(), off[t] = 0.0f;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        __m256i w[4], aw[4];
        for (int i = 0; i < 4; i++) w[i] = layout_codes(q8, row, g + i), aw[i] = q8 ? _mm256_abs_epi8(w[i]) : w[i];
        const __m128 s4 = _mm_loadu_ps(sr + g);
        const __m256 mn4 = mr ? _mm256_zextps128_ps256(_mm_loadu_ps(mr + g)) : _mm256_setzero_ps();
        for (int t = 0; t < nb; t++) {
            const Act a = act_at(act, K, b0 + t);
            __m256i d[4];
            for (int i = 0; i < 4; i++) d[i] = group_dot(q8, w[i], aw[i], _mm256_loadu_si256((const __m256i *)(a.q + 32L * (g + i))));
            const __m256i quad = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
            const __m128 p = _mm_mul_ps(s4, _mm_loadu_ps(a.dx + g)); /* lanes i and i + 4: group g + i's halves */
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad), _mm256_set_m128(p, p), acc[t]);
            if (mr) acc[t] = _mm256_fmadd_ps(mn4, _mm256_zextps128_ps256(_mm_loadu_ps(a.xs + g)), acc[t]);
        }
    }
    for (; g < G; g++) {
        const __m256i w = layout_codes(q8, row, g), aw = q8 ? _mm256_abs_epi8(w) : w;
        for (int t = 0; t < nb; t++) {
            const Act a = act_at(act, K, b0 + t);
            const __m256i d = group_dot(q8, w, aw, _mm256_loadu_si256((const __m256i *)(a.q + 32L * g)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sr[g] * a.dx[g]), acc[t]);
            if (mr) off[t] += mr[g] * a.xs[g];
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = hsum8(acc[t]) + off[t];
}

/* layout_row with q8 and the item count constants (the accumulators then stay in registers) */
#define LAYOUT_ROW(q8) NB4(layout_row, q8, codes, scale, mins, G, act, K, out, ld, n, b0)
static void layout_rows(int q8, const uint8_t *codes, const float *scale, const float *mins, long K, int N, int B,
                        const uint8_t *act, float *out, int ld, int threads) {
    const int runs = (N + ROWS8 - 1) / ROWS8, G = (int)(K / 32);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int r = 0; r < runs; r++) {
        const int n1 = (r + 1) * ROWS8 < N ? (r + 1) * ROWS8 : N;
        for (int b0 = 0; b0 < B; b0 += IT8)
            for (int n = r * ROWS8; n < n1; n++) {
                const int nb = B - b0 < IT8 ? B - b0 : IT8;
                if (q8) LAYOUT_ROW(1);
                else LAYOUT_ROW(0);
            }
    }
}

void quill_i8_tiles_avx2(int kind, const uint8_t *codes, const float *scale, const float *mins, const uint8_t *act,
                         long K, int N, int B, float *out, int ld, int threads) {
    if (kind >= LAYOUT_Q4) layout_rows(kind == LAYOUT_Q8, codes, scale, mins, K, N, B, act, out, ld, threads);
    else tiles8(kind, codes, act, K, N, B, out, ld, threads);
}
