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
 * bit 4 = q6 codes (16-weight groups: these take a GEMV of their own, q6_levels_gemv below, which puts
 * the scales into the weights' bytes), bit 5 = q5 codes.
 *
 * Activations become three signed bytes per element (digits.h): per item and 32-element group, a
 * unit 2^(e-22) from the group's largest |x| and balanced digits d0 + 2^8 d1 + 2^16 d2 of x / unit
 * rounded. The tile unit computes every digit's dot product with the codes exactly in int32; the
 * digits are recombined (in int32 where that is exact) and scaled in fp32. (q6 takes its digits per
 * 256-element super-block instead: q6_levels_gemv.)
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

#include "amx_tiles.h"
#include "digits.h"
#include "kformat.h"
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <omp.h>
#include <unistd.h>

int quill_gemv_kq_tiled(int, const uint8_t *, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                        const float *, float *, float *, int, int, int, int, int, int); /* kquant.c */
long quill_gemv_kq_scratch_bytes(int B, int K);
int quill_gemv_tiled_i8(int, const uint8_t *, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                        const float *, uint8_t *, float *, int, int, int, int, int); /* kquant_i8.c */
int quill_gemv_tiled_i8_avx2(int, const uint8_t *, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                             const float *, uint8_t *, float *, int, int, int, int, int); /* tiled_avx2.c */
int quill_hw_vnni(void);
void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                    const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                    int threads);
long quill_amx_scratch_bytes(int B, int K);

/* The VNNI tiles' kind (kquant.c's block kind; LAYOUT_Q8 for Q8_0) of a tiled kind. */
static inline int block_kind(int kind) {
    return kind & KIND_Q8 ? LAYOUT_Q8 : kind & KIND_Q6 ? 1 : kind & KIND_IQ4 ? 4 : kind & KIND_Q5 ? 5 : kind & KIND_Q3 ? 9 : kind & KIND_Q2 ? 8 : 0;
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T for a tiled weight: on the AMX tiles (quill_amx_gemv), or, with
 * kind bit 6 (KIND_VNNI, a K-quant or Q8_0 weight tiled on a CPU or for an engine without AMX), on the VNNI tiles
 * (kquant.c's quill_gemv_kq_tiled). scratch: quill_tiled_scratch_bytes(kind, B, K). */
void quill_tiled_gemv(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                      const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                      int threads) {
    if (!(kind & KIND_VNNI)) {
        quill_amx_gemv(kind, codes, scale, mins, scale_d, mins_d, x, out, N, K, B, ld, scratch, threads);
        return;
    }
    if (quill_gemv_kq_tiled(block_kind(kind), codes, scale, mins, scale_d, mins_d, x, scratch, out, N, K, B, ld,
                            (kind & KIND_AVX2) != 0, threads))
        abort(); /* tiled.py tiles a weight for the digit tiles only where they run and the kind and shape fit */
}

/* 1 where a tiled weight of this kind has a kernel for int8 activations (the opt-in, kquant_i8.c's header): one
 * tiled for the digit tiles, of a kind whose blocks have one (not Q3_K, Q2_K): the VNNI tiles' on a CPU with
 * VNNI, or (KIND_AVX2: Q4_K, Q5_K) the AVX2 tiles'; not the AMX tiles. The one definition, for tiled.py
 * (packed.int8_kind) and decode_layer.c. */
int quill_tiled_i8_supported(int kind) {
    return (kind & KIND_VNNI) && !(kind & (KIND_Q3 | KIND_Q2)) && ((kind & KIND_AVX2) || quill_hw_vnni());
}

/* quill_tiled_gemv with x rounded to int8 per 32 inputs (quill_gemv_i8's activations; scratch: quill_act8_bytes(B,
 * K)), the bits quill_gemv_i8 gives on the weight's blocks. Returns 0, or -1 (nothing written) where
 * quill_tiled_i8_supported(kind) is 0. */
int quill_tiled_gemv_i8(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                        const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                        int threads) {
    if (!quill_tiled_i8_supported(kind)) return -1;
    return (kind & KIND_AVX2 ? quill_gemv_tiled_i8_avx2 : quill_gemv_tiled_i8)(block_kind(kind), codes, scale, mins, scale_d,
                                                                              mins_d, x, scratch, out, N, K, B, ld, threads);
}

long quill_tiled_scratch_bytes(int kind, int B, int K) {
    return kind & KIND_VNNI ? quill_gemv_kq_scratch_bytes(B, K) : quill_amx_scratch_bytes(B, K);
}

/* Without AMX intrinsics (amx_tiles.h's AMX_COMPILER) the stubs at the end build, so the other kernels
 * still build and the loader keeps the packed layout (the dequantization, AVX2 code, builds everywhere). The
 * AVX-512 emulation builds (isa.h) build the layout's AVX-512 parts (the tile unpacking, the scratch size), and
 * the tile GEMV only where isa.h emulates the tile unit too (QUILL_EMULATE_AMX). */
#define ROWS_PER_ITEM 6 /* A tile rows per item: 2 halves x 3 digits */
#define SIGNED_CODES(kind) ((kind) & (KIND_Q8 | KIND_IQ4 | KIND_Q6 | KIND_Q3)) /* signed bytes */
#define PER16(kind) ((kind) & (KIND_Q6 | KIND_Q3 | KIND_Q2)) /* a scale per 16 weights */
#define WIDE_CODES(kind) ((kind) & (KIND_Q8 | KIND_IQ4 | KIND_Q5)) /* the top digit joins in fp32 (q6: its own GEMV) */
static inline int scale_groups(int kind, int K) { return PER16(kind) ? K / 16 : K / 32; } /* per row */
/* Bytes of one stored tile: q4 and iq4 pack a 1024-byte tile into 512, q5 into 640, q6 into 768. */
static inline long tile_bytes(int kind) {
    return kind & KIND_Q8 ? 1024 : kind & KIND_Q6 ? 768 : kind & KIND_Q5 ? 640 : kind & KIND_Q3 ? 384 : kind & KIND_Q2 ? 256 : 512;
}

/* One weight's scales or mins: where they are and how they are stored (kind's bits 1 and 2). */
typedef struct {
    const void *v;     /* (N/16, G, 16): fp32, fp16 or int8 (q6: G16 groups) */
    const uint16_t *d; /* K-quant scales: (N/16, groups / 2^shift, 16) fp16 factors, else NULL */
    int fmt;           /* 0 fp32, 1 fp16, 2 int8 x fp16, 3 / 4 q2's low / high nibble x fp16 */
    int shift;         /* groups per fp16 factor: 2^3 groups of 32, or (q6) 2^4 of 16 */
} Scales;

static inline Scales scales_of(int kind, const void *v, const void *d) {
    Scales s = {v, (const uint16_t *)d, kind & KIND_Q2 ? 3 : kind & KIND_KSCALES ? 2 : kind & KIND_F16 ? 1 : 0,
                PER16(kind) ? 4 : 3};
    return s;
}

/* A weight's mins as Scales (v NULL: none): q2's are its scale bytes' high nibbles times mins_d. */
static inline Scales mins_of(int kind, const void *scale, const void *mins, const void *mins_d) {
    Scales s = scales_of(kind, kind & KIND_Q2 ? scale : mins, mins_d);
    if (kind & KIND_Q2) s.fmt = 4;
    return s;
}

/* Tile `tile`'s 1024 codes in the tile unit's byte order, unpacked with AVX2, 32 bytes at a time, for the
 * dequantization on every CPU the kernels run on: the bytes tile_codes (below) gives the AMX kernels, and q3's
 * (q - 4) and q2's, which only the digit tiles hold. */
static inline __m256i srl16(__m256i v, int n) { return n ? _mm256_srli_epi16(v, n) : v; }
static const uint8_t *tile_codes_256(int kind, const void *codes, long tile, uint8_t *staged) {
    const uint8_t *src = (const uint8_t *)codes + tile * tile_bytes(kind);
    const __m256i m = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
#define LD(off) _mm256_loadu_si256((const __m256i *)(src + (off)))
#define ST(off, v) _mm256_storeu_si256((__m256i *)(staged + (off)), (v))
    if (kind & KIND_Q8) return src;
    if (kind & (KIND_Q6 | KIND_Q5)) { /* nibbles, then a plane of the top w bits (q6 - 32, as unpack_tile_q6) */
        const int w = kind & KIND_Q6 ? 2 : 1, parts = 8 / w, span = 1024 / parts;
        const __m256i top = kind & KIND_Q6 ? three : one, off = _mm256_set1_epi8(kind & KIND_Q6 ? 32 : 0);
        for (int i = 0; i < span; i += 32)
            for (int k = 0; k < parts; k++) {
                const __m256i v = LD((span * k + i) % 512), h = LD(512 + i);
                const __m256i lo = k < parts / 2 ? _mm256_and_si256(v, m) : _mm256_and_si256(srl16(v, 4), m);
                const __m256i hi = _mm256_and_si256(srl16(h, w * k), top);
                ST(span * k + i, _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off));
            }
    } else if (kind & (KIND_Q3 | KIND_Q2)) { /* 2-bit plane (q3: and its top bit, - 4, as unpack_tile_q3) */
        for (int i = 0; i < 256; i += 32)
            for (int k = 0; k < 4; k++) {
                __m256i c = _mm256_and_si256(srl16(LD(i), 2 * k), three);
                if (kind & KIND_Q3)
                    c = _mm256_sub_epi8(_mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(srl16(LD(256 + i % 128), (256 * k + i) / 128), one), 2)),
                                        _mm256_set1_epi8(4));
                ST(256 * k + i, c);
            }
    } else { /* q4, iq4 (its table's values) */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
        for (int i = 0; i < 512; i += 32) {
            const __m256i v = LD(i), lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(srl16(v, 4), m);
            ST(i, kind & KIND_IQ4 ? _mm256_shuffle_epi8(table, lo) : lo);
            ST(512 + i, kind & KIND_IQ4 ? _mm256_shuffle_epi8(table, hi) : hi);
        }
    }
#undef LD
#undef ST
    return staged;
}

/* Row j's 64 codes of a tile (as tile_codes and tile_codes_256 give it: dword 16 kk + j holds codes 4 kk .. 4 kk + 3) in
 * column order. */
static inline void tile_row(const uint32_t *quads, int j, uint32_t row[16]) {
    for (int kk = 0; kk < 16; kk++) row[kk] = quads[kk * 16 + j];
}

/* Tiled weight -> (N, K) fp32 rows, for prefill's GEMM tile. i = 16 * group + row in block. */
static inline float group_value(const Scales *s, long i) {
    if (s->fmt >= 2) {
        const int q = s->fmt == 2 ? ((const int8_t *)s->v)[i] : s->fmt == 3 ? ((const uint8_t *)s->v)[i] & 15
                                                                            : ((const uint8_t *)s->v)[i] >> 4;
        return _cvtsh_ss(s->d[(i >> (4 + s->shift)) * 16 + (i & 15)]) * (float)q;
    }
    return s->fmt ? _cvtsh_ss(((const uint16_t *)s->v)[i]) : ((const float *)s->v)[i];
}

/* Tiled weight -> (N, K) fp32 rows (prefill's GEMM tile, TiledWeight.dequantize): each value fmaf(code, scale,
 * min). AVX2 code, so it serves every tiled weight on every CPU (the AVX2 digit tiles' among them). */
void quill_tiled_dequant(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                         const void *mins_d, float *out, int N, int K, int threads) {
    const int C = K / 64, RB = N / 16, G = scale_groups(kind, K), n = G / C; /* n: scale groups per chunk */
    const Scales sv = scales_of(kind, scale, scale_d), mv = mins_of(kind, scale, mins, mins_d);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int rb = 0; rb < RB; rb++) {
        _Alignas(64) uint8_t staged[1024];
        for (int c = 0; c < C; c++) {
            const uint32_t *quads = (const uint32_t *)tile_codes_256(kind, codes, (long)rb * C + c, staged);
            for (int j = 0; j < 16; j++) {
                _Alignas(64) uint32_t row[16];
                tile_row(quads, j, row);
                float *o = out + ((long)rb * 16 + j) * K + (long)c * 64;
                for (int u = 0; u < 8; u++) { /* 8 at a time: value = fmaf(code, scale, min) */
                    const long gi = ((long)rb * G + n * c + u * n / 8) * 16 + j; /* the group of codes 8u.. */
                    const __m256 sc = _mm256_set1_ps(group_value(&sv, gi));
                    const __m256 mn = _mm256_set1_ps(mv.v ? group_value(&mv, gi) : 0.f);
                    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)row + 8 * u));
                    const __m256i code = SIGNED_CODES(kind) ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
                    _mm256_storeu_ps(o + 8 * u, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), sc, mn));
                }
            }
        }
    }
}

#if AMX_COMPILER || defined(QUILL_EMULATE_AVX512)
/* A tile rows: item b, half h, digit p -> row 6b + 3h + p, packed 16 to a tile (m rows when they fit one). */
static inline int a_rows(int B) { return ROWS_PER_ITEM * B <= 16 ? ROWS_PER_ITEM * B : (ROWS_PER_ITEM * B + 15) & ~15; }

/* A rows of one parity per chunk in q6_levels_gemv: 4 per item (whole tiles of 4 items when they take
 * more than one). */
#define Q6_LEVELS 4
static inline int q6_rows(int B) { return Q6_LEVELS * (B <= 4 ? B : (B + 3) & ~3); }

/* Enough for quill_amx_gemv's layout and for q6_levels_gemv's. */
long quill_amx_scratch_bytes(int B, int K) {
    const long rows = (long)B * (K / 32) * 8 + (long)(K / 64) * a_rows(B) * 64;
    const long levels = (long)B * (K / 256) * 20 + (long)(K / 64) * 2 * q6_rows(B) * 64;
    return (rows > levels ? rows : levels) + 128;
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

/* Tile `tile`'s 1024 codes in the tile unit's byte order: a q8 tile where it lies, the others (q4, iq4, q5, q6:
 * the AMX kernels' kinds) unpacked into `staged` (64-byte aligned). */
AVX512 static inline const uint8_t *tile_codes(int kind, const void *codes, long tile, uint8_t *staged) {
    const uint8_t *src = (const uint8_t *)codes + tile * tile_bytes(kind);
    if (kind & KIND_Q8) return src;
    if (kind & KIND_Q6) unpack_tile_q6(src, staged);
    else if (kind & KIND_Q5) unpack_tile_q5(src, staged);
    else if (kind & KIND_IQ4) unpack_tile_iq4(src, staged);
    else unpack_tile_q4(src, staged);
    return staged;
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
#define MAX_TILES (ITEMS * ROWS_PER_ITEM / 16) /* A tiles per pass */

static int cpu_has_amx(void) {
#ifdef QUILL_EMULATE_AMX
    return 1;
#endif
    const unsigned d = cpuid7_edx();
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
    const uint8_t rows[8] = {m, m, m, m, 16, 16, 0, 0};
    const TileConfig cfg = tile_config(rows);
    _tile_loadconfig(&cfg);
}

/* Item b's chunk c of x (B, K) -> its 6 rows of digits in a (K/64, a_rows(B), 64) int8, the two
 * groups' 2^(e-22) in xscale (B, G) and sums in xs (B, G). Chunks are independent, so the threads
 * split them; the item's padding rows (past the last item) are zeroed with the last item's chunk. */
AMX static void split_chunk(const float *x, int B, int b, int c, int K, int8_t *a, float *xscale, float *xs) {
    const int G = K / 32, R = a_rows(B);
    int8_t *rows = a + ((long)c * R + ROWS_PER_ITEM * b) * 64;
    memset(rows, 0, (size_t)(b == B - 1 ? R - ROWS_PER_ITEM * b : ROWS_PER_ITEM) * 64);
    for (int h = 0; h < 2; h++) {
        const int g = 2 * c + h;
        const float *p = x + (long)b * K + (long)g * 32;
        xs[(long)b * G + g] = sum32(p);
        __m512i dg[2][3];
        if (!((xscale[(long)b * G + g] = group_digits(p, dg)) > 0.f)) continue; /* NaN or all zero: its digits stay zero */
        int8_t *row = rows + 3 * h * 64 + h * 32, *row1 = row + 16;
        for (int d = 0; d < 3; d++, row += 64, row1 += 64) {
            _mm_storeu_si128((__m128i *)row, _mm512_cvtepi32_epi8(dg[0][d]));
            _mm_storeu_si128((__m128i *)row1, _mm512_cvtepi32_epi8(dg[1][d]));
        }
    }
}

/* 16 rows' scales (or mins) of one group. */
AMX static inline __m512 load_group(const Scales *s, long group) {
    if (s->fmt == 2) return kscale_group((const int8_t *)s->v, s->d, group, s->shift); /* d * sc */
    return s->fmt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s->v + group * 16)))
                  : _mm512_loadu_ps((const float *)s->v + group * 16);
}

/* Bytes of one group's 16 values, for the prefetch. */
static inline long group_bytes(const Scales *s) { return s->fmt == 2 ? 16 : s->fmt ? 32 : 64; }

/* acc += one item's digits recombined (its rows of the C tiles' copy, 3 per group) times each of the
 * chunk's two groups' xscales and scales, then (m: NULL without mins) the group's min times the item's
 * group sum (xs). q4: |C| <= 32 * 128 * 15 per digit (the top digit's 64 halves that), so C0 + 2^8 C1 +
 * 2^16 C2 is exact in int32; the wide codes (q8's and iq4's 8x wider, q5's 2x) add their top digit in
 * fp32, which rounds the same sum the same way (C0 + 2^8 C1 is exact in fp32). These are the operations,
 * in the order, of the VNNI tiles' tile_items (kquant_i8.c) on the same integers, so a tiled K-quant weight
 * other than Q6_K gives the same bits on either (tests/test_vnni_tiled.py). The mins group by group, rather
 * than all after the last chunk, also took 0.93-0.97x the time at batch 1 and 0.84-0.89x at 16 (Q4_K,
 * Q5_K, Q4_1 in cache on the Intel Xeon; a 1B Q4_K_M model's GEMVs 0.99x and 0.92x). */
AMX static inline __m512 combine(__m512 acc, const int32_t *r, int wide, const __m512 *s, const __m512 *m,
                                 const float *xsc, const float *xs) {
    for (int u = 0; u < 2; u++, r += 48) {
        const __m512i c2 = _mm512_load_si512(r + 32);
        const __m512i lo = _mm512_add_epi32(_mm512_load_si512(r), _mm512_slli_epi32(_mm512_load_si512(r + 16), 8));
        const __m512 f = wide ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(lo))
                              : _mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_slli_epi32(c2, 16)));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(xsc[u])), s[u], acc); /* (dot * unit) * scale */
        if (m) acc = _mm512_fmadd_ps(m[u], _mm512_set1_ps(xs[u]), acc);
    }
    return acc;
}

/* One product: C tile c = A tile a (digits at `src`) x B tile w (weights). Tile register numbers must be
 * literals, hence a macro. */
#define TILE_DOT(c, a, w, kind) do { if (SIGNED_CODES(kind)) _tile_dpbssd(c, a, w); else _tile_dpbsud(c, a, w); } while (0)
#define TILE_PRODUCT(c, a, w, kind, src)                                       \
    do {                                                                       \
        _tile_zero(c);                                                         \
        _tile_loadd(a, (src), 64);                                             \
        TILE_DOT(c, a, w, kind);                                               \
    } while (0)

/* C tile `c` (0 or 1) copied out to dst. */
#define TILE_OUT(c, dst) do { if (c) _tile_stored(1, (dst), 64); else _tile_stored(0, (dst), 64); } while (0)

/* ---- Q6_K by levels. Q6_K's scales are per 16 weights, so an exact integer sum over a chunk's 64 columns
 * would have to keep its four quarters apart (12 A rows per item, 12 C rows read out per 64 columns). Here
 * the scale goes into the weight instead: W = sc * (q - 32), an integer with |W| <= 4096, made
 * non-negative, W + 4096 in [32, 8192], is two unsigned bytes 256 hi + lo (hi <= 32), so one integer sum
 * runs over a whole super-block (256 columns), whose fp16 factor d then scales it once. The activations'
 * digits are taken per super-block (2^(e-1) <= its max|x| < 2^e, v = round(x * 2^(22-e)) = d0 + 2^8 d1 +
 * 2^16 d2, balanced as in split_chunk), and the sums of equal weight ("levels") share C rows:
 *   L0 = d0.lo,  L1 = d0.hi + d1.lo,  L2 = d1.hi + d2.lo,  L3 = d2.hi,
 *   v.(W + 4096) = L0 + 2^8 L1 + 2^16 L2 + 2^24 L3,
 * and 4096 v.1 = 2^8 (16 sum d0) + 2^16 (16 sum d1) + 2^24 (16 sum d2) comes off levels 1-3 in int32.
 * A 16-bit lane of vpmaddubsw's q * sc holds a column's W + 4096 as the tile wants it, lo then hi, for the
 * columns 4kk + 0 and 4kk + 2 of a row's dword (the "even" tile) or 4kk + 1 and 4kk + 3 (the "odd" one).
 * So an item's A rows are, per level L and tile, the bytes d_L, d_(L-1) of those columns in turn (d_-1 =
 * d_3 = 0): 4 even rows, then (after every item's) 4 odd rows. |L| <= 256 * 128 * (255 + 32): int32.
 * An item's levels are exact integers whatever tile row they sit in, and each super-block adds
 * (L0 + 2^8 L1 + 2^16 (L2 + 2^8 L3)) * (d * 2^(e-22)) to the item's sum in fp32, in order: batch-invariant. */

/* Item b's super-block s of x -> its A rows in chunks 4s .. 4s + 3 (even rows 4b .., odd rows E + 4b ..),
 * its 2^(e-22) in xscale (B, K/256) and 16 * its digits' sums in dsum (B, K/256, 4). */
AMX static void split_super(const float *x, int B, int b, int s, int K, int8_t *a, float *xscale, int32_t *dsum) {
    const int E = q6_rows(B), S = K / 256;
    const float *p = x + (long)b * K + 256L * s;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int i = 0; i < 256; i += 16) {
        const __m512 v = _mm512_loadu_ps(p + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    const float m = _mm512_reduce_max_ps(mx);
    int e;
    const int live = (xscale[(long)b * S + s] = digit_unit(m, nan != 0, &e)) > 0.f; /* else every digit is zero */
    const __m512 up = _mm512_set1_ps((float)(22 - e)); /* |v| <= 2^22 */
    __m512i sum[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const __m512i lowb = _mm512_set1_epi16(0x00ff);
    for (int cc = 0; cc < 4; cc++) {
        _Alignas(64) int8_t dg[4][64]; /* digit p of the chunk's 64 columns; dg[3] = 0 */
        for (int i = 0; i < 64; i += 16) {
            __m512i t[3];
            digits3(live ? _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_loadu_ps(p + 64 * cc + i), up)) : _mm512_setzero_si512(), t);
            for (int d = 0; d < 3; d++) {
                _mm_store_si128((__m128i *)(dg[d] + i), _mm512_cvtepi32_epi8(t[d]));
                sum[d] = _mm512_add_epi32(sum[d], t[d]);
            }
        }
        memset(dg[3], 0, 64);
        int8_t *rows = a + ((long)(4 * s + cc) * 2 * E + Q6_LEVELS * b) * 64;
        for (int L = 0; L < Q6_LEVELS; L++) {
            const __m512i cur = _mm512_load_si512(dg[L]), prev = L ? _mm512_load_si512(dg[L - 1]) : _mm512_setzero_si512();
            /* even: (d_L, d_L-1) of columns 2m; odd: of columns 2m + 1 */
            _mm512_store_si512(rows + 64 * L, _mm512_ternarylogic_epi32(cur, _mm512_slli_epi16(prev, 8), lowb, 0xE4));
            _mm512_store_si512(rows + 64 * (E + L), _mm512_ternarylogic_epi32(_mm512_srli_epi16(cur, 8), prev, lowb, 0xE4));
        }
    }
    int32_t *ds = dsum + ((long)b * S + s) * 4;
    for (int d = 0; d < 3; d++) { /* (SIMDe has no _mm512_reduce_add_epi32) */
        _Alignas(64) int32_t lane[16];
        _mm512_store_si512(lane, sum[d]);
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += lane[i];
        ds[d] = 16 * t;
    }
    ds[3] = 0;
}

/* The q6 tile of (rb, c) (its layout as unpack_tile_q6 reads it) and its 16 rows' four quarter scales
 * (sc: 4 x 16 int8) -> W + 4096 = sc * (q - 32) + 4096 as the even and odd tiles (1024 bytes each, the
 * tile unit's order, each dword two columns' lo, hi). Tile line kk (64 bytes: the rows' dwords of
 * columns 4kk .. 4kk + 3) lies in quarter kk / 4, whose scale each row's dword takes. */
AMX static inline void unpack_q6_levels(const uint8_t *src, const int8_t *sc, uint8_t *ev, uint8_t *od) {
    const __m512i m = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
    for (int u = 0; u < 4; u++) { /* quarter u: tile bytes 256 u .. 256 u + 255 */
        const __m512i s32 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * u))); /* dword j: row j */
        const __m512i s8 = _mm512_and_si512(s32, _mm512_set1_epi32(0xff));
        const __m512i se = _mm512_or_si512(s8, _mm512_slli_epi32(s8, 16)), so = _mm512_slli_epi16(se, 8); /* sc, 0, sc, 0 */
        const __m512i off = _mm512_sub_epi16(_mm512_set1_epi16(4096), _mm512_slli_epi16(_mm512_srai_epi16(so, 8), 5));
        for (int i = 0; i < 256; i += 64) {
            const __m512i v = _mm512_loadu_si512(src + (256 * u + i) % 512), h = _mm512_loadu_si512(src + 512 + i);
            const __m512i low = u < 2 ? _mm512_and_si512(v, m) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
            const __m512i top = u < 2 ? _mm512_slli_epi16(h, 4 - 2 * u) : _mm512_srli_epi16(h, 2 * u - 4);
            const __m512i q = _mm512_ternarylogic_epi32(low, top, hi2, 0xF8); /* low | (top & 0x30): codes 0..63 */
            _mm512_store_si512(ev + 256 * u + i, _mm512_add_epi16(_mm512_maddubs_epi16(q, se), off));
            _mm512_store_si512(od + 256 * u + i, _mm512_add_epi16(_mm512_maddubs_epi16(q, so), off));
        }
    }
}

/* C tile q (or, with h != q, the odd products into their own tile h) += the even and odd products of
 * A tiles at src and src + E rows; tile numbers must be literals. */
#define Q6_PRODUCTS(q, h, src, E)                                                               \
    do {                                                                                        \
        _tile_loadd(6, (src), 64);                                                              \
        _tile_loadd(7, (src) + 64L * (E), 64);                                                  \
        _tile_dpbsud(q, 6, 4);                                                                  \
        _tile_dpbsud(h, 7, 5);                                                                  \
    } while (0)

/* Batch 1's two weight streams (q6_b1_two_streams, b1_two_streams): the calling thread's share of the RB row
 * blocks, split in two halves whose blocks i go side by side. Pair i's blocks into rbs; returns how many (1 for
 * the odd share's last), or 0 past the last pair. (Pairing blocks i and i + RB/2 across the threads instead read
 * 0.95x as fast.) */
static inline int stream_pair(int RB, int i, int rbs[2]) {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    const int lo = (int)((long)RB * t / T), n = (int)((long)RB * (t + 1) / T) - lo, H = (n + 1) / 2;
    if (i >= H) return 0;
    rbs[0] = lo + i, rbs[1] = lo + H + i;
    return H + i < n ? 2 : 1;
}

/* acc += one item's super-block: its four levels (C rows r, plus the odd products' rows r2 where they have
 * tiles of their own, else NULL), the 4096 offset taken off levels 1-3 in int32 (ds: 16 x its digits' sums),
 * recombined in fp32 and scaled by the rows' fp16 factors d times the item's 2^(e-22). The one definition for
 * both Q6_K loops, so an item's bits do not depend on which ran it. */
AMX static inline __m512 q6_combine(__m512 acc, const int32_t *r, const int32_t *r2, const int32_t *ds, __m512 d, float xsc) {
    __m512i L[4];
    for (int l = 0; l < 4; l++) {
        L[l] = _mm512_load_si512(r + 16 * l);
        if (r2) L[l] = _mm512_add_epi32(L[l], _mm512_load_si512(r2 + 16 * l));
        if (l) L[l] = _mm512_sub_epi32(L[l], _mm512_set1_epi32(ds[l - 1])); /* the 4096 offset */
    }
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(L[1]), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(L[0]));
    const __m512i hi = _mm512_add_epi32(L[2], _mm512_slli_epi32(L[3], 8));
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.f), lo);
    return _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(xsc)), acc);
}

/* Batch 1 of Q6_K: each thread's share of the row blocks in two halves, block i of each side by side (C tiles 0
 * and 2 for the first, 1 and 3 for the second; the digit tiles shared), as b1_two_streams (below) does for the
 * other kinds and for the same reason. The same products and q6_combine in the same order as q6_levels_gemv's
 * loop at batch 1 (one item: the odd products in tiles of their own), so the same bits. */
AMX static void q6_b1_two_streams(const uint8_t *codes, const int8_t *sc8, const uint16_t *dv, const int8_t *a,
                                  const float *xscale, const int32_t *dsum, float *out, int RB, int C, int S, int G16) {
    const int E = q6_rows(1);
    _Alignas(64) uint8_t staged[2][2][2][1024]; /* [stream][chunk parity][even, odd] */
    _Alignas(64) int32_t ctile[2][2][4 * 16];   /* [stream][even, odd] */
    int rbs[2], ns;
    for (int i = 0; (ns = stream_pair(RB, i, rbs)); i++) {
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < ns; k++)
            unpack_q6_levels(codes + (long)rbs[k] * C * 768, sc8 + (long)rbs[k] * G16 * 16, staged[k][0][0], staged[k][0][1]);
        for (int s = 0; s < S; s++) {
            _tile_zero(0); _tile_zero(2);
            if (ns == 2) { _tile_zero(1); _tile_zero(3); }
            for (int c = 4 * s; c < 4 * s + 4; c++) {
                const int p = c & 1;
                const int8_t *ac = a + (long)c * 2 * E * 64;
                _tile_loadd(6, ac, 64);
                _tile_loadd(7, ac + 64L * E, 64);
                _tile_loadd(4, staged[0][p][0], 64);
                _tile_loadd(5, staged[0][p][1], 64);
                _tile_dpbsud(0, 6, 4);
                _tile_dpbsud(2, 7, 5);
                if (ns == 2) {
                    _tile_loadd(4, staged[1][p][0], 64);
                    _tile_loadd(5, staged[1][p][1], 64);
                    _tile_dpbsud(1, 6, 4);
                    _tile_dpbsud(3, 7, 5);
                }
                if (c + 1 < C)
                    for (int k = 0; k < ns; k++) {
                        const uint8_t *blk = codes + (long)rbs[k] * C * 768;
                        prefetch_block(blk + (c + 1) * 768L, 768);
                        unpack_q6_levels(blk + (c + 1) * 768L, sc8 + (long)rbs[k] * G16 * 16 + (c + 1) * 64L,
                                         staged[k][p ^ 1][0], staged[k][p ^ 1][1]);
                    }
            }
            _tile_stored(0, ctile[0][0], 64);
            _tile_stored(2, ctile[0][1], 64);
            if (ns == 2) { _tile_stored(1, ctile[1][0], 64); _tile_stored(3, ctile[1][1], 64); }
            for (int k = 0; k < ns; k++) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dv + ((long)rbs[k] * S + s) * 16)));
                acc[k] = q6_combine(acc[k], ctile[k][0], ctile[k][1], dsum + (long)s * 4, d, xscale[s]);
            }
        }
        for (int k = 0; k < ns; k++) _mm512_storeu_ps(out + (long)rbs[k] * 16, acc[k]);
    }
}

AMX static void q6_levels_gemv(const void *codes, const void *scale, const void *scale_d, const float *x, float *out,
                               int N, int K, int B, int ld, void *scratch, int threads) {
    const int C = K / 64, S = K / 256, G16 = K / 16, RB = N / 16, E = q6_rows(B);
    float *xscale = (float *)scratch;
    int32_t *dsum = (int32_t *)(xscale + (long)B * S);
    int8_t *a = (int8_t *)(((uintptr_t)(dsum + (long)B * S * 4) + 63) & ~(uintptr_t)63);
    const int8_t *sc8 = (const int8_t *)scale;
    const uint16_t *dv = (const uint16_t *)scale_d;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++) split_super(x, B, b, s, K, a, xscale, dsum);
        { /* C in tmm0-3 (m rows), the even and odd weight tiles in tmm4 / 5, A in tmm6 / 7 (m rows) */
            const uint8_t m = E < 16 ? E : 16, rows[8] = {m, m, m, m, 16, 16, m, m};
            const TileConfig cfg = tile_config(rows);
            _tile_loadconfig(&cfg);
        }
        if (B == 1) {
            q6_b1_two_streams((const uint8_t *)codes, sc8, dv, a, xscale, dsum, out, RB, C, S, G16);
        } else {
            _Alignas(64) uint8_t staged[2][2][1024];
            _Alignas(64) int32_t ctile[2][4 * 256];
            int first = 1;
#pragma omp for schedule(static)
            for (int rb = 0; rb < RB; rb++) {
                const uint8_t *blk = (const uint8_t *)codes + (long)rb * C * 768;
                if (first) { prefetch_start(blk); first = 0; }
                const int8_t *scb = sc8 + (long)rb * G16 * 16;
                for (int b0 = 0; b0 < B; b0 += ITEMS) {
                    const int nb = B - b0 < ITEMS ? B - b0 : ITEMS, tiles = (nb + 3) / 4, two = tiles <= 2;
                    const int use2 = tiles > 2 || two, use3 = tiles > 3 || (two && tiles > 1); /* C tiles 2, 3 in use */
                    __m512 acc[ITEMS];
                    for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
                    /* each chunk's weight tiles are written one chunk ahead, so their tile loads do not wait on
                     * the stores that made them */
                    unpack_q6_levels(blk, scb, staged[0][0], staged[0][1]);
                    for (int s = 0; s < S; s++) {
                        _tile_zero(0);
                        if (tiles > 1) _tile_zero(1);
                        if (use2) _tile_zero(2);
                        if (use3) _tile_zero(3);
                        for (int c = 4 * s; c < 4 * s + 4; c++) {
                            _tile_loadd(4, staged[c & 1][0], 64);
                            _tile_loadd(5, staged[c & 1][1], 64);
                            const int8_t *ac = a + ((long)c * 2 * E + Q6_LEVELS * b0) * 64;
                            if (two) { /* the odd products into tiles of their own: two chains per C row */
                                Q6_PRODUCTS(0, 2, ac, E);
                                if (tiles > 1) Q6_PRODUCTS(1, 3, ac + 1024, E);
                            } else {
                                Q6_PRODUCTS(0, 0, ac, E);
                                Q6_PRODUCTS(1, 1, ac + 1024, E);
                                Q6_PRODUCTS(2, 2, ac + 2048, E);
                                if (tiles > 3) Q6_PRODUCTS(3, 3, ac + 3072, E);
                            }
                            if (c + 1 < C) {
                                prefetch_block(blk + (c + 1) * 768L, 768);
                                unpack_q6_levels(blk + (c + 1) * 768L, scb + (c + 1) * 64L, staged[(c + 1) & 1][0],
                                                 staged[(c + 1) & 1][1]);
                            }
                        }
                        _tile_stored(0, ctile[0], 64);
                        if (tiles > 1) _tile_stored(1, ctile[0] + 256, 64);
                        if (use2) _tile_stored(2, two ? ctile[1] : ctile[0] + 512, 64);
                        if (use3) _tile_stored(3, two ? ctile[1] + 256 : ctile[0] + 768, 64);
                        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dv + ((long)rb * S + s) * 16)));
                        for (int t = 0; t < nb; t++)
                            acc[t] = q6_combine(acc[t], ctile[0] + 4 * t * 16, two ? ctile[1] + 4 * t * 16 : NULL,
                                                dsum + ((long)(b0 + t) * S + s) * 4, d, xscale[(long)(b0 + t) * S + s]);
                    }
                    for (int t = 0; t < nb; t++) _mm512_storeu_ps(out + (long)(b0 + t) * ld + (long)rb * 16, acc[t]);
                }
            }
        }
    }
}

/* Batch 1 of every kind but q6 (q6_b1_two_streams; quill_amx_gemv's general loop otherwise): each thread splits
 * its share of the row blocks in two halves and takes block i of each side by side, chunk by chunk, so it reads
 * two weight streams at once. Each block's chunk is the same tile product and the same combine, in the same order,
 * as in the general loop, so the output is the same bits (batch invariance holds). On the Intel Xeon with AMX (2
 * vCPUs, 480 MiB L3; 2026-12-08), the 1B files' weights from memory, both loops alternating in one process: Q4_K
 * 19.0-19.5 -> 20.8-21.0 GB/s, IQ4_XS 18.8-18.9 -> 21.0-21.4, Q8_0 (its tiles loaded where they lie) 25.7-26.3 ->
 * 26.9-27.3; the default model's weights (in L3) 0.92x the time. With one stream per thread the two threads read
 * about 21 GB/s of Q4_K whatever their arithmetic (without the unpacking, the tile products or the combine: within
 * 6%) and whatever the prefetch's form (T0, T1 or T2, other distances, every other line); this host's read probe
 * reads 27 GB/s with one stream per thread and 30-31 with two to four. Three or four streams here read less than
 * two, and two streams of whole row blocks one after the other (not side by side) gained nothing. */
AMX static void b1_two_streams(int kind, const void *codes, const Scales *sv, const Scales *mv, int wide, const float *x,
                               int K, int8_t *a, float *xscale, float *xs, float *out, int RB, int C, int G, int threads) {
    const long tb = tile_bytes(kind);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < C; c++) split_chunk(x, 1, 0, c, K, a, xscale, xs);
        config_tiles(ROWS_PER_ITEM);
        _Alignas(64) uint8_t staged[2][2][1024]; /* [stream][chunk parity] */
        _Alignas(64) int32_t ctile[2][256];
        int rbs[2], ns;
        for (int i = 0; (ns = stream_pair(RB, i, rbs)); i++) {
            __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            const uint8_t *src[2][2]; /* [stream][chunk parity]: q8's codes where they lie, the others' staged */
            for (int k = 0; k < ns; k++) src[k][0] = tile_codes(kind, codes, (long)rbs[k] * C, staged[k][0]);
            for (int c = 0; c < C; c++) {
                const int p = c & 1;
                for (int k = 0; k < ns; k++) prefetch_block((const uint8_t *)codes + ((long)rbs[k] * C + c) * tb, tb);
                _tile_loadd(4, src[0][p], 64);
                TILE_PRODUCT(0, 2, 4, kind, a + (long)c * ROWS_PER_ITEM * 64); /* the item's 6 rows of digits */
                TILE_OUT(0, ctile[0]);
                if (ns == 2) { /* (each C copied out right after its product: 1.09x faster than after both) */
                    _tile_loadd(5, src[1][p], 64);
                    _tile_zero(1);
                    TILE_DOT(1, 2, 5, kind); /* the same digits (tile 2) */
                    TILE_OUT(1, ctile[1]);
                }
                if (c + 1 < C) /* the next chunk's codes, unpacked while these products run */
                    for (int k = 0; k < ns; k++) src[k][p ^ 1] = tile_codes(kind, codes, (long)rbs[k] * C + c + 1, staged[k][p ^ 1]);
                for (int k = 0; k < ns; k++) {
                    const long g0 = (long)rbs[k] * G;
                    const __m512 s[2] = {load_group(sv, g0 + 2L * c), load_group(sv, g0 + 2L * c + 1)};
                    __m512 m[2];
                    if (mv->v) m[0] = load_group(mv, g0 + 2L * c), m[1] = load_group(mv, g0 + 2L * c + 1);
                    acc[k] = combine(acc[k], ctile[k], wide, s, mv->v ? m : NULL, xscale + 2 * c, xs + 2 * c);
                }
            }
            for (int k = 0; k < ns; k++) _mm512_storeu_ps(out + (long)rbs[k] * 16, acc[k]);
        }
    }
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T for a tiled weight (kind as above); mins may be NULL (all
 * zero); scale_d and mins_d are the K-quant factors (NULL without bit 2). scratch: at least
 * quill_amx_scratch_bytes(B, K) bytes. Items go through in passes of 16: 96 A rows, 6 tiles, or one
 * tile of fewer rows when they fit. q6 weights go to q6_levels_gemv. */
AMX void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                        const void *mins_d, const float *x, float *out, int N, int K, int B, int ld, void *scratch,
                        int threads) {
    if (!quill_amx_enable()) abort(); /* callers check first; this also requests the tile permission */
    if (kind & KIND_Q6) {
        q6_levels_gemv(codes, scale, scale_d, x, out, N, K, B, ld, scratch, threads);
        return;
    }
    const int G = K / 32, C = K / 64, RB = N / 16, wide = WIDE_CODES(kind) != 0, R = a_rows(B);
    const Scales sv = scales_of(kind, scale, scale_d), mv = scales_of(kind, mins, mins_d);
    float *xs = (float *)scratch, *xscale = xs + (long)B * G;
    int8_t *a = (int8_t *)(((uintptr_t)(xscale + (long)B * G) + 63) & ~(uintptr_t)63);
    if (B == 1) {
        b1_two_streams(kind, codes, &sv, &mv, wide, x, K, a, xscale, xs, out, RB, C, G, threads);
        return;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int c = 0; c < C; c++) split_chunk(x, B, b, c, K, a, xscale, xs);
        /* (the loop's barrier: every digit is written before any product) */
        config_tiles(R < 16 ? R : 16);
        _Alignas(64) uint8_t staged[2][1024];
        _Alignas(64) int32_t ctile[2][MAX_TILES * 16 * 16];
        int first = 1; /* this thread's first row block (simd.h's prefetch_start) */
#pragma omp for schedule(static)
        for (int rb = 0; rb < RB; rb++) {
            const long g0 = (long)rb * G; /* this block's first group */
            if (first) { prefetch_start((const uint8_t *)codes + (long)rb * C * tile_bytes(kind)); first = 0; }
            for (int b0 = 0; b0 < B; b0 += ITEMS) {
                const int nb = B - b0 < ITEMS ? B - b0 : ITEMS, tiles = (ROWS_PER_ITEM * nb + 15) / 16;
                __m512 acc[ITEMS];
                for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
                long op = 0; /* products issued: alternates the tile sets */
                for (int c = 0; c <= C; c++) {
                    const int p = c & 1;
                    if (c < C) {
                        /* the hardware prefetcher alone leaves the weight stream short of bandwidth (simd.h;
                         * STREAM_AHEAD rather than the 4 tiles before: Q4_K from memory at batch 1 took
                         * 0.86-0.93x the time with one T0 prefetch) */
                        prefetch_block((const uint8_t *)codes + ((long)rb * C + c) * tile_bytes(kind), tile_bytes(kind));
                        if (c == 0 && b0 == 0 && rb + 1 < RB) { /* and the next block's scales and mins */
                            const long gbytes = group_bytes(&sv);
                            for (long i = 0; i < (long)G * gbytes; i += 64) {
                                _mm_prefetch((const char *)scale + (g0 + G) * gbytes + i, _MM_HINT_T0);
                                if (mins) _mm_prefetch((const char *)mins + (g0 + G) * gbytes + i, _MM_HINT_T0);
                            }
                            for (long i = 0; sv.d && i < (long)K / 256 * 32; i += 64) { /* the fp16 factors */
                                _mm_prefetch((const char *)(sv.d + (long)(rb + 1) * (K / 256) * 16) + i, _MM_HINT_T0);
                                if (mins) _mm_prefetch((const char *)(mv.d + (long)(rb + 1) * (K / 256) * 16) + i, _MM_HINT_T0);
                            }
                        }
                        { /* chunk c's codes: q8's where they lie, the others unpacked a chunk ahead (below), so
                           * the tile load does not wait on the stores that made them (kernel alone, Q4_K in
                           * cache: 0.65-0.77x the time at batch 1) */
                            const uint8_t *src = c == 0 || kind & KIND_Q8 ? tile_codes(kind, codes, (long)rb * C + c, staged[p])
                                                                           : staged[p];
                            if (p) _tile_loadd(5, src, 64); else _tile_loadd(4, src, 64);
                        }
                        const int8_t *ac = a + ((long)c * R + (long)ROWS_PER_ITEM * b0) * 64;
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
                            else if (c > 0 && tiles > 1) TILE_OUT((op - 1) & 1, ctile[p ^ 1] + (tiles - 1) * 256);
                        }
                        if (c + 1 < C && !(kind & KIND_Q8)) tile_codes(kind, codes, (long)rb * C + c + 1, staged[p ^ 1]);
                        /* the chunk's last C: with one tile, copied out now; with several, after the next chunk's
                         * first product is issued, as the others are after the next one (batch 16: 0.91-0.95x the
                         * time; batch 1 that way took 1.07-1.09x) */
                        if (tiles == 1) TILE_OUT((op - 1) & 1, ctile[p]);
                    } else if (tiles > 1)
                        TILE_OUT((op - 1) & 1, ctile[p ^ 1] + (tiles - 1) * 256);
                    if (c > 0) { /* read out the previous chunk while this one multiplies */
                        const int pc = c - 1;
                        const __m512 s[2] = {load_group(&sv, g0 + 2L * pc), load_group(&sv, g0 + 2L * pc + 1)};
                        __m512 m[2]; /* the groups' mins (loaded once for all items) */
                        if (mins) m[0] = load_group(&mv, g0 + 2L * pc), m[1] = load_group(&mv, g0 + 2L * pc + 1);
                        for (int t = 0; t < nb; t++)
                            acc[t] = combine(acc[t], ctile[pc & 1] + t * ROWS_PER_ITEM * 16, wide, s, mins ? m : NULL,
                                             xscale + (long)(b0 + t) * G + 2 * pc, xs + (long)(b0 + t) * G + 2 * pc);
                    }
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
void quill_amx_kq_rows(int kind, const void *codes, const void *scale, int K, int rb, int c0, int cn,
                       uint16_t *dst) { abort(); }
#endif

#endif
