/* Dealing a loop's items to an OpenMP team: each thread owns one contiguous run of them (what
 * schedule(static) gives it) and takes its run from the front, one item at a time; a thread whose run
 * is done takes the other runs' last items from the back. A memory-bound pass keeps one forward stream
 * per thread, as a static schedule does, but no thread idles at the closing barrier while another still
 * has items: with two threads on a shared memory bus their speeds differ from call to call, and under
 * schedule(static) each waited for the other 10-12% of a batch-1 decode step (perf, the 1B Q4_K_M file
 * on the AMD EPYC Zen 4). Which thread computes an item changes nothing in it: the results are the same
 * bits either way.
 *
 * Each run is one 64-bit word, its front in the low half and its end in the high half, changed by
 * compare-and-swap, on a cache line of its own. */
#ifndef QUILL_DEAL_H
#define QUILL_DEAL_H
#include <stdint.h>

typedef struct {
    uint64_t span; /* front | end << 32 */
    char pad[56];
} __attribute__((aligned(64))) Deal;

/* n items over nt runs, as schedule(static) splits them. */
static inline void deal_init(Deal *d, int nt, long n) {
    for (int t = 0; t < nt; t++) {
        const uint64_t lo = (uint64_t)(n * t / nt), hi = (uint64_t)(n * (t + 1) / nt);
        d[t].span = lo | hi << 32;
    }
}

/* One item off run t's front (back: its end), or -1 where the run is empty. */
static inline long deal_take(Deal *d, int t, int back) {
    uint64_t cur = __atomic_load_n(&d[t].span, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t lo = cur & 0xffffffffu, hi = cur >> 32;
        if (lo >= hi) return -1;
        const uint64_t next = back ? lo | (hi - 1) << 32 : (lo + 1) | hi << 32;
        if (__atomic_compare_exchange_n(&d[t].span, &cur, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (long)(back ? hi - 1 : lo);
    }
}

/* Thread `me`'s next item: its own run's front, then the other runs' ends, nearest run first; -1 when
 * every run is empty. */
static inline long deal_next(Deal *d, int me, int nt) {
    long i = deal_take(d, me, 0);
    for (int k = 1; i < 0 && k < nt; k++) i = deal_take(d, (me + k) % nt, 1);
    return i;
}
#endif
