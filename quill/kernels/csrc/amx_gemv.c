/* Decode GEMV on Intel AMX tiles (TMUL int8), for CPUs that have it (Sapphire Rapids and later).
 *
 * Tiled layout (quill/kernels/tiled.py): rows in blocks of 16, columns in chunks of 64.
 * One (row block, chunk) is one 16 x 64 AMX "B" tile in VNNI order: tile byte
 * [kk][j][r] is the code of row 16*rb + j, column 64*c + 4*kk + r.
 *   q8: the 1024 codes as signed bytes -- the tile is loaded straight from the weights.
 *   q4: 512 bytes; byte b holds tile byte b (low nibble) and tile byte b + 512 (high).
 *   iq4: as q4, each nibble an index into IQ4_NL's table of 16 signed values (IQ4_XS).
 *   q6: 768 bytes: the low 4 bits of the 6-bit codes as q4's 512, then 256 bytes whose byte b holds
 *       the top 2 bits of tile bytes b, b + 256, b + 512, b + 768 (bits 0-1, 2-3, 4-5, 6-7); the
 *       tile holds code - 32 (Q6_K). Its scales are per 16 weights (G16 = K/16 groups, 16 per 256).
 *   q5: 640 bytes: the low 4 bits as q4's 512, then 128 bytes whose byte b holds bit 4 of tile bytes
 *       b + 128 k in its bit k; unsigned codes 0..31 (Q5_K).
 * scale and mins are (N/16, G, 16): the 16 rows of a block side by side, one vector per group,
 * in fp16 where every value is exactly an fp16 (Q4_0, Q4_1, Q8_0 store them so), else fp32, or
 * (K-quant scales) int8 with a per-256-weight fp16 factor in scale_d / mins_d, (N/16, K/256, 16):
 * the group's value is scale_d * scale, one fp32 product of an fp16 and a small integer, so
 * exact (Q4_K: d * sc and -dmin * m; IQ4_XS: d * (ls - 32)), and the layout as small as the file's.
 * value = scale * code + min, exactly GGUF's values (code * scale is exact in fp32 for every type).
 * kind: bit 0 = q8 (else q4), bit 1 = fp16 scales and mins, bit 2 = K-quant scales, bit 3 = iq4 codes,
 * bit 4 = q6 codes (with 16-weight groups: an item's A rows are 4 quarters x 3 digits, quarter u's
 * digits in bytes [16u, 16u + 16) of its rows), bit 5 = q5 codes.
 *
 * Activations become three signed bytes per element. Per item and 32-element group, with
 * 2^(e-1) <= max|x| < 2^e, v = round(x * 2^(22-e)) is an integer with |v| <= 2^22 (an error of
 * at most 2^-22 max|x| per element: two units in the last place of the group's largest, the
 * size of fp32's own rounding in the sum), and v = d0 + 2^8 d1 + 2^16 d2 with balanced digits
 * d0, d1 in [-128, 127] and d2 in [-64, 64]. The tile unit computes every digit's dot product
 * with the codes exactly in int32; the digits are recombined (in int32 where that is exact) and
 * scaled in fp32.
 *
 * "A" tile rows per item are (half h, digit p) -> row 6 item + 3h + p, 64 bytes: the digits of
 * group 2c + h in bytes [32h, 32h + 32), zero elsewhere, so one tile product keeps the two
 * groups of a chunk apart. The rows of all items are packed 16 to a tile, an item's rows
 * possibly straddling two tiles.
 *
 * Batch invariance: an item's digits, its tile products (exact integers, whichever tile row
 * they sit in) and its fp32 recombination are the same operations whatever the batch holds, so
 * its output row is bit-identical alone or among others.
 */
#define _GNU_SOURCE /* syscall() */
#include "isa.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX intrinsics need GCC 11 or clang 12; an older compiler builds the stubs at the end, so
 * the other kernels still build and the loader keeps the packed layout. The AVX-512 emulation builds
 * (isa.h) build the layout's AVX-512 parts (the q4 unpack, the dequantization, the scratch size),
 * and the tile GEMV only where isa.h emulates the tile unit too (QUILL_EMULATE_AMX). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define AMX_COMPILER 1
#else
#define AMX_COMPILER 0
#endif
#define ROWS_PER_ITEM 6 /* A tile rows per item: 2 halves x 3 digits (q6: 12, 4 quarters x 3 digits) */
#define MAX_ROWS_PER_ITEM 12
#define KIND_Q8 1
#define KIND_F16 2
#define KIND_KSCALES 4
#define KIND_IQ4 8
#define KIND_Q6 16
#define KIND_Q5 32
#define SIGNED_CODES(kind) ((kind) & (KIND_Q8 | KIND_IQ4 | KIND_Q6)) /* signed bytes */
#define WIDE_CODES(kind) ((kind) & (KIND_Q8 | KIND_IQ4 | KIND_Q6 | KIND_Q5)) /* the top digit joins in fp32 */
static inline int rows_per_item(int kind) { return kind & KIND_Q6 ? MAX_ROWS_PER_ITEM : ROWS_PER_ITEM; }
static inline int scale_groups(int kind, int K) { return kind & KIND_Q6 ? K / 16 : K / 32; } /* per row */
/* Bytes of one stored tile: q4 and iq4 pack a 1024-byte tile into 512, q5 into 640, q6 into 768. */
static inline long tile_bytes(int kind) { return kind & KIND_Q8 ? 1024 : kind & KIND_Q6 ? 768 : kind & KIND_Q5 ? 640 : 512; }

/* One weight's scales or mins: where they are and how they are stored (kind's bits 1 and 2). */
typedef struct {
    const void *v;     /* (N/16, G, 16): fp32, fp16 or int8 (q6: G16 groups) */
    const uint16_t *d; /* K-quant scales: (N/16, groups / 2^shift, 16) fp16 factors, else NULL */
    int fmt;           /* 0 fp32, 1 fp16, 2 int8 x fp16 */
    int shift;         /* groups per fp16 factor: 2^3 groups of 32, or (q6) 2^4 of 16 */
} Scales;

static inline Scales scales_of(int kind, const void *v, const void *d) {
    Scales s = {v, (const uint16_t *)d, kind & KIND_KSCALES ? 2 : kind & KIND_F16 ? 1 : 0, kind & KIND_Q6 ? 4 : 3};
    return s;
}

#if AMX_COMPILER || defined(QUILL_EMULATE_AVX512)
/* A tile rows: item b, half h, digit p -> row 6b + 3h + p (q6: item b, quarter u -> 12b + 3u + p), packed
 * 16 to a tile (m rows when they fit one). */
static inline int a_rows(int B, int rpi) { return rpi * B <= 16 ? rpi * B : (rpi * B + 15) & ~15; }

/* Enough for either row count per item. */
long quill_amx_scratch_bytes(int B, int K) {
    return (long)B * (K / 32) * 8 + (long)(K / 64) * a_rows(B, MAX_ROWS_PER_ITEM) * 64 + 128;
}

/* The q4 tile of (rb, c) unpacked to 1024 bytes. */
AVX512 static inline void unpack_tile_q4(const uint8_t *src, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15);
    for (int i = 0; i < 512; i += 64) {
        __m512i v = _mm512_loadu_si512(src + i);
        _mm512_store_si512(dst + i, _mm512_and_si512(v, m));
        _mm512_store_si512(dst + 512 + i, _mm512_and_si512(_mm512_srli_epi16(v, 4), m));
    }
}

/* IQ4_NL's 16 values (GGML's kvalues_iq4nl, a fact of the format), in each 128-bit lane. */
AVX512 static inline __m512i iq4_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
}

/* The iq4 tile of (rb, c) unpacked to 1024 signed bytes: each nibble looked up in the table. */
AVX512 static inline void unpack_tile_iq4(const uint8_t *src, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15), table = iq4_table();
    for (int i = 0; i < 512; i += 64) {
        __m512i v = _mm512_loadu_si512(src + i);
        _mm512_store_si512(dst + i, _mm512_shuffle_epi8(table, _mm512_and_si512(v, m)));
        _mm512_store_si512(dst + 512 + i, _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m)));
    }
}

/* The q6 tile of (rb, c) unpacked to 1024 signed bytes, code - 32. */
AVX512 static inline void unpack_tile_q6(const uint8_t *src, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3), off = _mm512_set1_epi8(32);
    for (int i = 0; i < 256; i += 64) {
        const __m512i h = _mm512_loadu_si512(src + 512 + i);
        for (int k = 0; k < 4; k++) { /* tile bytes 256 k + i ..: the low nibbles of bytes (256 k + i) % 512 */
            const __m512i v = _mm512_loadu_si512(src + (256 * k + i) % 512);
            const __m512i lo = k < 2 ? _mm512_and_si512(v, m) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(h, 2 * k), three);
            _mm512_store_si512(dst + 256 * k + i, _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), off));
        }
    }
}

/* The q5 tile of (rb, c) unpacked to 1024 bytes, codes 0..31. */
AVX512 static inline void unpack_tile_q5(const uint8_t *src, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    for (int i = 0; i < 128; i += 64) {
        const __m512i h = _mm512_loadu_si512(src + 512 + i);
        for (int k = 0; k < 8; k++) { /* tile bytes 128 k + i ..: the low nibbles of bytes (128 k + i) % 512 */
            const __m512i v = _mm512_loadu_si512(src + (128 * k + i) % 512);
            const __m512i lo = k < 4 ? _mm512_and_si512(v, m) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(h, k), one);
            _mm512_store_si512(dst + 128 * k + i, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
        }
    }
}

/* Tile `tile`'s 1024 codes in the tile unit's byte order: a q8 tile where it lies, the others unpacked
 * into `staged` (64-byte aligned). */
AVX512 static inline const uint8_t *tile_codes(int kind, const void *codes, long tile, uint8_t *staged) {
    const uint8_t *src = (const uint8_t *)codes + tile * tile_bytes(kind);
    if (kind & KIND_Q8) return src;
    if (kind & KIND_Q6) unpack_tile_q6(src, staged);
    else if (kind & KIND_Q5) unpack_tile_q5(src, staged);
    else if (kind & KIND_IQ4) unpack_tile_iq4(src, staged);
    else unpack_tile_q4(src, staged);
    return staged;
}

/* Row j's 64 codes of a tile (as tile_codes gives it: dword 16 kk + j holds codes 4 kk .. 4 kk + 3) in
 * column order. */
static inline void tile_row(const uint32_t *quads, int j, uint32_t row[16]) {
    for (int kk = 0; kk < 16; kk++) row[kk] = quads[kk * 16 + j];
}

/* Tiled weight -> (N, K) fp32 rows, for prefill's GEMM tile. i = 16 * group + row in block. */
static inline float group_value(const Scales *s, long i) {
    if (s->fmt == 2) return _cvtsh_ss(s->d[(i >> (4 + s->shift)) * 16 + (i & 15)]) * (float)((const int8_t *)s->v)[i];
    return s->fmt ? _cvtsh_ss(((const uint16_t *)s->v)[i]) : ((const float *)s->v)[i];
}

AVX512 void quill_amx_dequant(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                              const void *mins_d, float *out, int N, int K, int threads) {
    const int C = K / 64, RB = N / 16, G = scale_groups(kind, K), n = G / C; /* n: scale groups per chunk */
    const Scales sv = scales_of(kind, scale, scale_d), mv = scales_of(kind, mins, mins_d);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int rb = 0; rb < RB; rb++) {
        _Alignas(64) uint8_t staged[1024];
        for (int c = 0; c < C; c++) {
            const int8_t *tile = (const int8_t *)tile_codes(kind, codes, (long)rb * C + c, staged);
            const uint32_t *quads = (const uint32_t *)tile;
            for (int j = 0; j < 16; j++) {
                _Alignas(64) uint32_t row[16];
                tile_row(quads, j, row);
                float *o = out + ((long)rb * 16 + j) * K + (long)c * 64;
                for (int u = 0; u < 4; u++) { /* 16 at a time: value = fmaf(code, scale, min) */
                    const long gi = ((long)rb * G + n * c + u * n / 4) * 16 + j; /* the group of codes 16u.. */
                    const __m512 s = _mm512_set1_ps(group_value(&sv, gi));
                    const __m512 m = _mm512_set1_ps(mins ? group_value(&mv, gi) : 0.f);
                    const __m128i b = _mm_load_si128((const __m128i *)((const uint8_t *)row + 16 * u));
                    const __m512i code = SIGNED_CODES(kind) ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
                    _mm512_storeu_ps(o + 16 * u, _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), s, m));
                }
            }
        }
    }
}

/* Rows 16 rb .. 16 rb + 15 of a K-quant tiled weight (kind bit 2), 64-column chunks [c0, c0 + cn), as the
 * prefill GEMM's (amx_gemm.c) A tiles: per 32 columns s (s = 0 .. 2 cn - 1), two 16 x 32 bf16 tiles, row
 * j's 32 values in 64 bytes, at dst + (2 s + p) * 512, whose sum is code * (the group's int8 scale). That
 * product is an integer of at most 13 significant bits (|code * scale| <= 4096 for every K-quant kind), so
 * part 0, its top 16 bits as an fp32 (a bf16), and part 1, the rest, hold it exactly: the weight is
 * (part 0 + part 1) * scale_d, the per-256 fp16 factor the GEMM applies (and the mins it adds) itself. */
AVX512 void quill_amx_kq_rows(int kind, const void *codes, const void *scale, int K, int rb, int c0, int cn,
                              uint16_t *dst) {
    const int C = K / 64, G = scale_groups(kind, K), per = G / C; /* scale groups per chunk: 2, or q6's 4 */
    const int8_t *sc = (const int8_t *)scale + (long)rb * G * 16;
    _Alignas(64) uint8_t staged[1024];
    for (int c = 0; c < cn; c++) {
        const uint32_t *quads = (const uint32_t *)tile_codes(kind, codes, (long)rb * C + c0 + c, staged);
        for (int j = 0; j < 16; j++) {
            _Alignas(64) uint32_t row[16];
            tile_row(quads, j, row);
            for (int h = 0; h < 2; h++) {
                const __m256i b = _mm256_load_si256((const __m256i *)row + h);
                const __m512i code = _mm512_cvtepi8_epi16(b); /* the unsigned kinds' codes are below 32 */
                const long g = (long)(c0 + c) * per + h * per / 2; /* the group of codes 32 h .. */
                const int lo = sc[g * 16 + j], hi = per == 4 ? sc[(g + 1) * 16 + j] : lo; /* q6: 16 each */
                const __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)lo)),
                                                     _mm256_set1_epi16((short)hi), 1);
                const __m512i w = _mm512_mullo_epi16(code, s);
                uint16_t *o = dst + (long)(2 * (2 * c + h)) * 512 + j * 32;
                for (int q = 0; q < 2; q++) { /* 16 products as fp32 -> the two parts' bf16 */
                    const __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                        q ? _mm512_extracti64x4_epi64(w, 1) : _mm512_castsi512_si256(w))));
                    const __m512i top = _mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u));
                    const __m512 rest = _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(top));
                    _mm256_store_si256((__m256i *)(o + 16 * q), _mm512_cvtepi32_epi16(_mm512_srli_epi32(top, 16)));
                    _mm256_store_si256((__m256i *)(o + 512 + 16 * q),
                                       _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rest), 16)));
                }
            }
        }
    }
}
#endif

#if AMX_COMPILER && (!defined(QUILL_EMULATE_AVX512) || defined(QUILL_EMULATE_AMX))

#ifdef QUILL_EMULATE_AMX /* isa.h's tile unit */
#define AMX
#else
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#endif
#define ITEMS 16   /* items per pass over a row block */
#define MAX_TILES (ITEMS * MAX_ROWS_PER_ITEM / 16) /* A tiles per pass */
#define PREFETCH 4 /* weight tiles read ahead */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static int cpu_has_amx(void) {
#ifdef QUILL_EMULATE_AMX
    return 1;
#endif
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return ((d >> 24) & 1) && ((d >> 25) & 1) && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi");
}

/* What the CPU can run (a fact): the AMX-INT8 tile unit and the AVX-512 parts the kernel uses. */
int quill_amx_hw(void) {
    static int cached = -1;
    if (cached < 0) cached = cpu_has_amx();
    return cached;
}

/* Asks Linux for the tile state (once per process: the permission is the OS's, not a choice of
 * ours); 1 when the tiled kernels can run. Whether a caller uses them is its own decision. */
int quill_amx_enable(void) {
    static int granted = -1;
    if (granted < 0)
#ifdef QUILL_EMULATE_AMX
        granted = 1; /* emulated tiles: nothing to ask the OS for */
#else
        granted = quill_amx_hw() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
    return granted;
}

/* Two sets of tiles, used alternately so one product can run while the last is read out:
 * C in tmm0/1, A in tmm2/3 (m rows: 6 per item up to 16), B (weights) in tmm4/5. */
AMX static void config_tiles(int m) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) { cfg.rows[t] = t < 4 ? m : 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* Item b's chunk c of x (B, K) -> its rpi rows of digits in a (K/64, a_rows(B, rpi), 64) int8, the two
 * groups' 2^(e-22) in xscale (B, G) and sums in xs (B, G). Chunks are independent, so the threads
 * split them; the item's padding rows (past the last item) are zeroed with the last item's chunk.
 * rpi 12 (q6) puts each 16 elements in rows of their own (quarter u: rows 3u .. 3u + 2). */
AMX static void split_chunk(const float *x, int B, int b, int c, int K, int8_t *a, float *xscale, float *xs, int rpi) {
    const int G = K / 32, R = a_rows(B, rpi), quarters = rpi == MAX_ROWS_PER_ITEM;
    int8_t *rows = a + ((long)c * R + rpi * b) * 64;
    memset(rows, 0, (size_t)(b == B - 1 ? R - rpi * b : rpi) * 64);
    for (int h = 0; h < 2; h++) {
        const int g = 2 * c + h;
        const float *p = x + (long)b * K + (long)g * 32;
        __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
        xs[(long)b * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        const __mmask16 nan = _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q); /* a NaN in either half */
        float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        if (nan || isinf(mx)) { xscale[(long)b * G + g] = NAN; continue; } /* the output is NaN, as in fp32 */
        if (!(mx > 0.f)) { xscale[(long)b * G + g] = 0.f; continue; }
        int e;
        frexpf(mx, &e);
        xscale[(long)b * G + g] = ldexpf(1.f, e - 22);
        const __m512 up = _mm512_set1_ps((float)(22 - e)); /* |v| <= 2^22 */
        __m512i i0 = _mm512_cvtps_epi32(_mm512_scalef_ps(v0, up)), i1 = _mm512_cvtps_epi32(_mm512_scalef_ps(v1, up));
        int8_t *row = rows + (quarters ? 6 : 3) * h * 64 + h * 32, *row1 = row + (quarters ? 3 * 64 : 0) + 16;
        for (int d = 0; d < 3; d++, row += 64, row1 += 64) { /* balanced digits; the last is in [-64, 64] */
            __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(i0, 24), 24);
            __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(i1, 24), 24);
            if (d == 2) { d0 = i0; d1 = i1; }
            _mm_storeu_si128((__m128i *)row, _mm512_cvtepi32_epi8(d0));
            _mm_storeu_si128((__m128i *)row1, _mm512_cvtepi32_epi8(d1));
            i0 = _mm512_srai_epi32(_mm512_sub_epi32(i0, d0), 8);
            i1 = _mm512_srai_epi32(_mm512_sub_epi32(i1, d1), 8);
        }
    }
}

/* 16 rows' scales (or mins) of one group. */
AMX static inline __m512 load_group(const Scales *s, long group) {
    if (s->fmt == 2) /* d * sc: an fp16 times a small integer, exact in fp32 */
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s->d + (group >> s->shift) * 16))),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)s->v + group * 16)))));
    return s->fmt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s->v + group * 16)))
                  : _mm512_loadu_ps((const float *)s->v + group * 16);
}

/* Bytes of one group's 16 values, for the prefetch. */
static inline long group_bytes(const Scales *s) { return s->fmt == 2 ? 16 : s->fmt ? 32 : 64; }

/* acc += one item's digits recombined (its rows of the C tiles' copy, 3 per group) times each of the
 * chunk's n groups' scales (2 halves; q6: 4 quarters) and its 32-group's xscale (the first half of the
 * groups have the chunk's first). q4: |C| <= 32 * 128 * 15 per digit (the top digit's 64 halves that),
 * so C0 + 2^8 C1 + 2^16 C2 is exact in int32; the wide codes (q8's and iq4's 8x wider, q5's 2x, q6's
 * 16 weights of 6 bits) add their top digit in fp32. */
AMX static inline __m512 combine(__m512 acc, const int32_t *r, int wide, const __m512 *s, int n, float xs0, float xs1) {
    for (int u = 0; u < n; u++, r += 48) {
        const __m512i c2 = _mm512_load_si512(r + 32);
        const __m512i lo = _mm512_add_epi32(_mm512_load_si512(r), _mm512_slli_epi32(_mm512_load_si512(r + 16), 8));
        const __m512 f = wide ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(lo))
                              : _mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_slli_epi32(c2, 16)));
        acc = _mm512_fmadd_ps(f, _mm512_mul_ps(s[u], _mm512_set1_ps(2 * u < n ? xs0 : xs1)), acc);
    }
    return acc;
}

/* One product: C tile c = A tile a (digits at `src`) x B tile w (weights). Tile register numbers must be
 * literals, hence a macro. */
#define TILE_PRODUCT(c, a, w, kind, src)                                       \
    do {                                                                       \
        _tile_zero(c);                                                         \
        _tile_loadd(a, (src), 64);                                             \
        if (SIGNED_CODES(kind)) _tile_dpbssd(c, a, w); else _tile_dpbsud(c, a, w); \
    } while (0)

/* C tile `c` (0 or 1) copied out to dst. */
#define TILE_OUT(c, dst) do { if (c) _tile_stored(1, (dst), 64); else _tile_stored(0, (dst), 64); } while (0)

AMX static inline void load_weight_tile(int kind, const void *codes, long tile, int p, uint8_t *staged) {
    const uint8_t *src = tile_codes(kind, codes, tile, staged);
    if (p) _tile_loadd(5, src, 64); else _tile_loadd(4, src, 64);
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T for a tiled weight (kind as above); mins may be NULL (all
 * zero); scale_d and mins_d are the K-quant factors (NULL without bit 2). scratch: at least
 * quill_amx_scratch_bytes(B, K) bytes. Items go through in passes of 16: 96 A rows, 6 tiles (q6: 192
 * rows, 12 tiles), or one tile of fewer rows when they fit. */
AMX void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                        const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                        int threads) {
    if (!quill_amx_enable()) abort(); /* callers check first; this also requests the tile permission */
    const int G = K / 32, C = K / 64, RB = N / 16, wide = WIDE_CODES(kind) != 0, rpi = rows_per_item(kind);
    const int R = a_rows(B, rpi), Gs = scale_groups(kind, K), n = Gs / C; /* n: scale groups per chunk */
    const Scales sv = scales_of(kind, scale, scale_d), mv = scales_of(kind, mins, mins_d);
    float *xs = (float *)scratch, *xscale = xs + (long)B * G;
    int8_t *a = (int8_t *)(((uintptr_t)(xscale + (long)B * G) + 63) & ~(uintptr_t)63);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int c = 0; c < C; c++) split_chunk(x, B, b, c, K, a, xscale, xs, rpi);
        /* (the loop's barrier: every digit is written before any product) */
        config_tiles(R < 16 ? R : 16);
        _Alignas(64) uint8_t staged[2][1024];
        _Alignas(64) int32_t ctile[2][MAX_TILES * 16 * 16];
#pragma omp for schedule(static)
        for (int rb = 0; rb < RB; rb++) {
            const long g0 = (long)rb * G, gs0 = (long)rb * Gs; /* this block's first group in mins and scale */
            for (int b0 = 0; b0 < B; b0 += ITEMS) {
                const int nb = B - b0 < ITEMS ? B - b0 : ITEMS, tiles = (rpi * nb + 15) / 16;
                __m512 acc[ITEMS];
                for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
                long op = 0; /* products issued: alternates the tile sets */
                for (int c = 0; c <= C; c++) {
                    const int p = c & 1;
                    if (c < C) {
                        /* the hardware prefetcher alone leaves the weight stream short of bandwidth */
                        const char *ahead = (const char *)codes + ((long)rb * C + c + PREFETCH) * tile_bytes(kind);
                        for (long i = 0; i < tile_bytes(kind); i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                        if (c == 0 && b0 == 0 && rb + 1 < RB) { /* and the next block's scales and mins */
                            const long gbytes = group_bytes(&sv);
                            for (long i = 0; i < (long)Gs * gbytes; i += 64) {
                                _mm_prefetch((const char *)scale + (gs0 + Gs) * gbytes + i, _MM_HINT_T0);
                                if (mins) _mm_prefetch((const char *)mins + (g0 + G) * gbytes + i, _MM_HINT_T0);
                            }
                            for (long i = 0; sv.d && i < (long)K / 256 * 32; i += 64) { /* the fp16 factors */
                                _mm_prefetch((const char *)(sv.d + (long)(rb + 1) * (K / 256) * 16) + i, _MM_HINT_T0);
                                if (mins) _mm_prefetch((const char *)(mv.d + (long)(rb + 1) * (K / 256) * 16) + i, _MM_HINT_T0);
                            }
                        }
                        load_weight_tile(kind, codes, (long)rb * C + c, p, staged[p]);
                        const int8_t *ac = a + ((long)c * R + (long)rpi * b0) * 64;
                        /* each product's C is copied out after the next product is issued, so the copy
                         * (which waits for its product) does not hold back the next one */
                        for (int q = 0; q < tiles; q++, op++) {
                            const int8_t *src = ac + (long)q * 1024;
                            switch ((int)(op & 1) * 2 + p) {
                            case 0: TILE_PRODUCT(0, 2, 4, kind, src); break;
                            case 1: TILE_PRODUCT(0, 2, 5, kind, src); break;
                            case 2: TILE_PRODUCT(1, 3, 4, kind, src); break;
                            default: TILE_PRODUCT(1, 3, 5, kind, src); break;
                            }
                            if (q > 0) TILE_OUT((op - 1) & 1, ctile[p] + (q - 1) * 256);
                        }
                        TILE_OUT((op - 1) & 1, ctile[p] + (tiles - 1) * 256);
                    }
                    if (c > 0) { /* read out the previous chunk while this one multiplies */
                        const int pc = c - 1;
                        __m512 s[4];
                        for (int u = 0; u < n; u++) s[u] = load_group(&sv, gs0 + (long)n * pc + u);
                        for (int t = 0; t < nb; t++) {
                            const float *xsc = xscale + (long)(b0 + t) * G + 2 * pc;
                            acc[t] = combine(acc[t], ctile[pc & 1] + t * rpi * 16, wide, s, n, xsc[0], xsc[1]);
                        }
                    }
                }
                if (mins) /* each group's mins times the item's group sum, loaded once for all items */
                    for (int g = 0; g < G; g++) {
                        const __m512 mg = load_group(&mv, g0 + g);
                        for (int t = 0; t < nb; t++) acc[t] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[(long)(b0 + t) * G + g]), acc[t]);
                    }
                for (int t = 0; t < nb; t++) _mm512_storeu_ps(out + (long)(b0 + t) * ld + (long)rb * 16, acc[t]);
            }
        }
    }
}

#else /* no AMX support in this compiler, or the AVX-512 emulation build (isa.h) */

int quill_amx_hw(void) { return 0; }
int quill_amx_enable(void) { return 0; }
void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                    const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                    int threads) { abort(); }
#if !AMX_COMPILER && !defined(QUILL_EMULATE_AVX512)
long quill_amx_scratch_bytes(int B, int K) { return 0; }
void quill_amx_dequant(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                       const void *mins_d, float *out, int N, int K, int threads) { abort(); }
void quill_amx_kq_rows(int kind, const void *codes, const void *scale, int K, int rb, int c0, int cn,
                       uint16_t *dst) { abort(); }
#endif

#endif
