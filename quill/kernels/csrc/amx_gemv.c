/* Decode GEMV on Intel AMX tiles (TMUL int8), for CPUs that have it (Sapphire Rapids and later).
 *
 * Tiled layout (quill/kernels/tiled.py): rows in blocks of 16, columns in chunks of 64.
 * One (row block, chunk) is one 16 x 64 AMX "B" tile in VNNI order: tile byte
 * [kk][j][r] is the code of row 16*rb + j, column 64*c + 4*kk + r.
 *   q8: the 1024 codes as signed bytes -- the tile is loaded straight from the weights.
 *   q4: 512 bytes; byte b holds tile byte b (low nibble) and tile byte b + 512 (high).
 * scale and mins are (N/16, G, 16): the 16 rows of a block side by side, one vector per group,
 * in fp16 where every value is exactly an fp16 (Q4_0, Q4_1, Q8_0 store them so), else fp32.
 * value = scale * code + min, exactly the packed layout's values.
 * kind: bit 0 set = q8 (else q4), bit 1 set = fp16 scales and mins.
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
#define ROWS_PER_ITEM 6 /* A tile rows per item: 2 halves x 3 digits */

#if AMX_COMPILER || defined(QUILL_EMULATE_AVX512)
/* A tile rows: item b, half h, digit p -> row 6b + 3h + p, packed 16 to a tile (m rows when B <= 2). */
static inline int a_rows(int B) { return B <= 2 ? ROWS_PER_ITEM * B : (ROWS_PER_ITEM * B + 15) & ~15; }

long quill_amx_scratch_bytes(int B, int K) { return (long)B * (K / 32) * 8 + (long)(K / 64) * a_rows(B) * 64 + 128; }

/* The q4 tile of (rb, c) unpacked to 1024 bytes. */
AVX512 static inline void unpack_tile_q4(const uint8_t *src, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15);
    for (int i = 0; i < 512; i += 64) {
        __m512i v = _mm512_loadu_si512(src + i);
        _mm512_store_si512(dst + i, _mm512_and_si512(v, m));
        _mm512_store_si512(dst + 512 + i, _mm512_and_si512(_mm512_srli_epi16(v, 4), m));
    }
}

/* Tiled weight -> (N, K) fp32 rows, for prefill's GEMM tile. */
static inline float group_value(const void *p, long i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

AVX512 void quill_amx_dequant(int kind, const void *codes, const void *scale, const void *mins, float *out, int N,
                              int K, int threads) {
    const int G = K / 32, C = K / 64, RB = N / 16, half = (kind >> 1) & 1;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int rb = 0; rb < RB; rb++) {
        _Alignas(64) uint8_t staged[1024];
        for (int c = 0; c < C; c++) {
            const int8_t *tile;
            if (!(kind & 1)) {
                unpack_tile_q4((const uint8_t *)codes + ((long)rb * C + c) * 512, staged);
                tile = (const int8_t *)staged;
            } else {
                tile = (const int8_t *)codes + ((long)rb * C + c) * 1024;
            }
            const uint32_t *quads = (const uint32_t *)tile; /* dword 16 kk + j: row j's codes 4 kk .. 4 kk + 3 */
            for (int j = 0; j < 16; j++) {
                _Alignas(64) uint32_t row[16]; /* row j's 64 codes in column order */
                for (int kk = 0; kk < 16; kk++) row[kk] = quads[kk * 16 + j];
                float *o = out + ((long)rb * 16 + j) * K + (long)c * 64;
                for (int h = 0; h < 2; h++) {
                    const long gi = ((long)rb * G + 2 * c + h) * 16 + j;
                    const __m512 s = _mm512_set1_ps(group_value(scale, gi, half));
                    const __m512 m = _mm512_set1_ps(mins ? group_value(mins, gi, half) : 0.f);
                    for (int q = 0; q < 2; q++) { /* value = fmaf(code, scale, min), 16 at a time */
                        const __m128i b = _mm_load_si128((const __m128i *)((const uint8_t *)row + 32 * h + 16 * q));
                        const __m512i code = (kind & 1) ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
                        _mm512_storeu_ps(o + 32 * h + 16 * q, _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), s, m));
                    }
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
        int8_t *row = rows + 3 * h * 64 + h * 32;
        for (int d = 0; d < 3; d++, row += 64) { /* balanced digits; the last is in [-64, 64] */
            __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(i0, 24), 24);
            __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(i1, 24), 24);
            if (d == 2) { d0 = i0; d1 = i1; }
            _mm_storeu_si128((__m128i *)row, _mm512_cvtepi32_epi8(d0));
            _mm_storeu_si128((__m128i *)(row + 16), _mm512_cvtepi32_epi8(d1));
            i0 = _mm512_srai_epi32(_mm512_sub_epi32(i0, d0), 8);
            i1 = _mm512_srai_epi32(_mm512_sub_epi32(i1, d1), 8);
        }
    }
}

/* 16 rows' scales (or mins) of one group. */
AMX static inline __m512 load_group(const void *p, long group, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + group * 16)))
                : _mm512_loadu_ps((const float *)p + group * 16);
}

/* acc += one item's digits recombined (its 6 rows of the C tiles' copy) times the two groups'
 * scales and xscales. q4: |C| <= 32 * 128 * 15 per digit (the top digit's 64 halves that), so
 * C0 + 2^8 C1 + 2^16 C2 is exact in int32; q8's codes are 8x wider, so its top digit joins in fp32. */
AMX static inline __m512 combine(__m512 acc, const int32_t *r, int q8, __m512 s0, __m512 s1, float xs0, float xs1) {
    __m512 f[2];
    for (int h = 0; h < 2; h++, r += 48) {
        const __m512i c2 = _mm512_load_si512(r + 32);
        __m512i lo = _mm512_add_epi32(_mm512_load_si512(r), _mm512_slli_epi32(_mm512_load_si512(r + 16), 8));
        f[h] = q8 ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(lo))
                  : _mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_slli_epi32(c2, 16)));
    }
    acc = _mm512_fmadd_ps(f[0], _mm512_mul_ps(s0, _mm512_set1_ps(xs0)), acc);
    return _mm512_fmadd_ps(f[1], _mm512_mul_ps(s1, _mm512_set1_ps(xs1)), acc);
}

/* One product: C tile c = A tile a (digits at `src`) x B tile w (weights), copied out to `dst`.
 * Tile register numbers must be literals, hence a macro. */
#define TILE_PRODUCT(c, a, w, kind, src, dst)                                  \
    do {                                                                       \
        _tile_zero(c);                                                         \
        _tile_loadd(a, (src), 64);                                             \
        if ((kind) & 1) _tile_dpbssd(c, a, w); else _tile_dpbsud(c, a, w);    \
        _tile_stored(c, (dst), 64);                                            \
    } while (0)

/* Tile bytes: q4 packs a 1024-byte tile into 512. */
static inline long tile_bytes(int kind) { return kind & 1 ? 1024 : 512; }

AMX static inline void load_weight_tile(int kind, const void *codes, long tile, int p, uint8_t *staged) {
    if (!(kind & 1)) {
        unpack_tile_q4((const uint8_t *)codes + tile * 512, staged);
        if (p) _tile_loadd(5, staged, 64); else _tile_loadd(4, staged, 64);
    } else {
        const int8_t *src = (const int8_t *)codes + tile * 1024;
        if (p) _tile_loadd(5, src, 64); else _tile_loadd(4, src, 64);
    }
}

/* out (B, N) = x (B, K) @ W.T for a tiled weight (kind as above); mins may be NULL (all zero).
 * scratch: at least quill_amx_scratch_bytes(B, K) bytes. Items go through in passes of 16:
 * 96 A rows, 6 tiles (one tile of 6 or 12 rows when B is 1 or 2). */
AMX void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const float *x,
                        float *out, int N, int K, int B, void *scratch, int threads) {
    if (!quill_amx_enable()) abort(); /* callers check first; this also requests the tile permission */
    const int G = K / 32, C = K / 64, RB = N / 16, half = (kind >> 1) & 1, q8 = kind & 1, R = a_rows(B);
    float *xs = (float *)scratch, *xscale = xs + (long)B * G;
    int8_t *a = (int8_t *)(((uintptr_t)(xscale + (long)B * G) + 63) & ~(uintptr_t)63);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int c = 0; c < C; c++) split_chunk(x, B, b, c, K, a, xscale, xs);
        /* (the loop's barrier: every digit is written before any product) */
        config_tiles(R < 16 ? R : 16);
        _Alignas(64) uint8_t staged[2][1024];
        _Alignas(64) int32_t ctile[2][MAX_TILES * 16 * 16];
#pragma omp for schedule(static)
        for (int rb = 0; rb < RB; rb++) {
            const long g0 = (long)rb * G; /* this block's first group in scale and mins */
            for (int b0 = 0; b0 < B; b0 += ITEMS) {
                const int nb = B - b0 < ITEMS ? B - b0 : ITEMS, tiles = (ROWS_PER_ITEM * nb + 15) / 16;
                __m512 acc[ITEMS];
                for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
                long op = 0; /* products issued: alternates the tile sets */
                for (int c = 0; c <= C; c++) {
                    const int p = c & 1;
                    if (c < C) {
                        /* the hardware prefetcher alone leaves the weight stream short of bandwidth */
                        const char *ahead = (const char *)codes + ((long)rb * C + c + PREFETCH) * tile_bytes(kind);
                        for (long i = 0; i < tile_bytes(kind); i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                        if (c == 0 && b0 == 0) { /* and the next block's scales and mins */
                            const long gbytes = half ? 32 : 64;
                            for (long i = 0; i < (long)G * gbytes; i += 64) {
                                _mm_prefetch((const char *)scale + (g0 + G) * gbytes + i, _MM_HINT_T0);
                                if (mins) _mm_prefetch((const char *)mins + (g0 + G) * gbytes + i, _MM_HINT_T0);
                            }
                        }
                        load_weight_tile(kind, codes, (long)rb * C + c, p, staged[p]);
                        const int8_t *ac = a + ((long)c * R + (long)ROWS_PER_ITEM * b0) * 64;
                        for (int q = 0; q < tiles; q++, op++) {
                            const int8_t *src = ac + (long)q * 1024;
                            int32_t *dst = ctile[p] + q * 256;
                            switch ((int)(op & 1) * 2 + p) {
                            case 0: TILE_PRODUCT(0, 2, 4, kind, src, dst); break;
                            case 1: TILE_PRODUCT(0, 2, 5, kind, src, dst); break;
                            case 2: TILE_PRODUCT(1, 3, 4, kind, src, dst); break;
                            default: TILE_PRODUCT(1, 3, 5, kind, src, dst); break;
                            }
                        }
                    }
                    if (c > 0) { /* read out the previous chunk while this one multiplies */
                        const int pc = c - 1;
                        const __m512 s0 = load_group(scale, g0 + 2 * pc, half), s1 = load_group(scale, g0 + 2 * pc + 1, half);
                        for (int t = 0; t < nb; t++) {
                            const float *xsc = xscale + (long)(b0 + t) * G + 2 * pc;
                            acc[t] = combine(acc[t], ctile[pc & 1] + t * ROWS_PER_ITEM * 16, q8, s0, s1, xsc[0], xsc[1]);
                        }
                    }
                }
                if (mins) /* each group's mins times the item's group sum, loaded once for all items */
                    for (int g = 0; g < G; g++) {
                        const __m512 mg = load_group(mins, g0 + g, half);
                        for (int t = 0; t < nb; t++) acc[t] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[(long)(b0 + t) * G + g]), acc[t]);
                    }
                for (int t = 0; t < nb; t++) _mm512_storeu_ps(out + (long)(b0 + t) * N + (long)rb * 16, acc[t]);
            }
        }
    }
}

#else /* no AMX support in this compiler, or the AVX-512 emulation build (isa.h) */

int quill_amx_hw(void) { return 0; }
int quill_amx_enable(void) { return 0; }
void quill_amx_gemv(int kind, const void *codes, const void *scale, const void *mins, const float *x, float *out,
                    int N, int K, int B, void *scratch, int threads) { abort(); }
#if !AMX_COMPILER && !defined(QUILL_EMULATE_AVX512)
long quill_amx_scratch_bytes(int B, int K) { return 0; }
void quill_amx_dequant(int kind, const void *codes, const void *scale, const void *mins, float *out, int N, int K,
                       int threads) { abort(); }
#endif

#endif
