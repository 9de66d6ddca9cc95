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

/* Sum of the 32 floats at p, always in the same order: a 32-weight group's sum of x for the K-quant mins,
 * which kquant.c's rows and both tiled kernels take from here so that they agree bit for bit. */
static inline float sum32(const float *p) {
    return hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24))));
}

/* A kernel's weight stream, asked for ahead of where it reads (rows are read one after another, so this
 * runs on into the next rows; a prefetch past the end faults on nothing), in two steps: into L2 twice
 * `ahead` bytes ahead, then into L1 half `ahead` ahead. The hardware prefetcher alone left these kernels
 * short of the bandwidth: Q8_0 rows at batch 1, 8192 x 2048 from memory on the Intel Xeon, read 14-16
 * GB/s without and 24-27 GB/s with one T0 prefetch 4096 bytes ahead (1024: 22, 2048: 24, 8192 and 12288:
 * 26). A T0 prefetch holds one of the core's few L1 fill buffers until its line arrives, which caps the
 * misses in flight; into L2 the requests queue deeper. The two steps, against that one T0 prefetch, from
 * memory at batch 1 with AVX-512: the AMX tiles (16384 x 2048 x 22 copies) Q4_K 0.88x the time, Q8_0
 * 0.92x, Q6_K 0.93x (far 16384 or near 512-2048, or T2 for the far step: the same within 2%); Q8_0 rows
 * 0.89-0.90x, F16 rows 0.87x, the VNNI tiles of a whole 1B Q4_K_M model 0.95x; Q4_0, Q3_K and Q5_0 rows
 * and, on AVX2, Q8_0 rows and the K-quant tiles within noise (0.99-1.03x). Scales and mins, when a format
 * keeps them apart, are their own stream, asked for the same number of rows ahead. */
#define STREAM_AHEAD 4096
/* A macro: as a static inline function GCC may leave it uninlined, mark it const (a prefetch has no
 * effect it models) and delete every call as dead code. */
#define prefetch_ahead(p, ahead)                                                                    \
    do {                                                                                            \
        _mm_prefetch((const char *)(p) + 2 * (ahead), _MM_HINT_T1);                                 \
        _mm_prefetch((const char *)(p) + (ahead) / 2, _MM_HINT_T0);                                 \
    } while (0)
/* The n bytes at p, STREAM_AHEAD ahead: one request per 64 bytes (a block of a row read at once). */
#define prefetch_block(p, n)                                                                        \
    do {                                                                                            \
        for (long o_ = 0; o_ < (long)(n); o_ += 64) prefetch_ahead((const char *)(p) + o_, STREAM_AHEAD); \
    } while (0)

/* The n bytes at p asked for into L2 only, 2 * ahead bytes ahead: the far step of prefetch_ahead without the
 * near one into L1 (kquant_i8.c's tiled_ahead says where this is the better form). */
#define prefetch_block_l2(p, n, ahead)                                                              \
    do {                                                                                            \
        for (long o_ = 0; o_ < (long)(n); o_ += 64) _mm_prefetch((const char *)(p) + o_ + 2 * (ahead), _MM_HINT_T1); \
    } while (0)

/* The start of a stream (a thread's first rows in a call), asked for at once: what prefetch_ahead would
 * have asked for by then, so the first lines do not wait a memory latency each (a 1B Q4_K_M model's AMX
 * GEMVs at batch 1: 0.98-0.99x the time in five runs; the VNNI tiles' within noise, so they go without). */
#define prefetch_start(p)                                                                           \
    do { /* (the hint a constant in each loop: at -Og, as the emulation builds are, GCC folds no other) */ \
        for (long o_ = 0; o_ < STREAM_AHEAD / 2; o_ += 64) _mm_prefetch((const char *)(p) + o_, _MM_HINT_T0); \
        for (long o_ = STREAM_AHEAD / 2; o_ < 2 * STREAM_AHEAD; o_ += 64)                           \
            _mm_prefetch((const char *)(p) + o_, _MM_HINT_T1);                                      \
    } while (0)

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
