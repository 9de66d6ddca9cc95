/* Decode attention over the paged KV cache for one element type, included by decode_layer.c once
 * per type with KV_T (float or uint16_t = fp16), KV_NAME(f) (the suffixed name), KV_LOAD8 and
 * KV_LOAD16 (8 or 16 elements as fp32) defined. The arithmetic is fp32 either way; fp16 elements
 * are widened on load (F16C), so the cache reads half the bytes. */

/* Lane j = dot(q, k_j) for eight key vectors (hd % 8 == 0): eight FMA chains, one transpose-add. */
static inline __m256 KV_NAME(dot8)(const float *q, const KV_T *const k[8], int hd) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, KV_LOAD8(k[j] + i), a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* acc[g][0..32) += sum_l p[g][l] * V[l][i0 .. i0+32) for NG (1..3) q heads: 4 x NG
 * accumulators in registers, every V vector read once. */
static inline __attribute__((always_inline)) void KV_NAME(v_block)(const KV_T *vc, const long *rows, long l0, long l1,
                                                          int hd, int i0, const float *p,
                                                          long pstride, const int NG, float *out) {
    __m256 a[3][4];
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm256_setzero_ps();
    for (long l = l0; l < l1; l++) {
        const KV_T *v = vc + rows[l - l0] + i0;
        const __m256 v0 = KV_LOAD8(v), v1 = KV_LOAD8(v + 8), v2 = KV_LOAD8(v + 16), v3 = KV_LOAD8(v + 24);
        for (int g = 0; g < NG; g++) {
            const __m256 w = _mm256_set1_ps(p[g * pstride + l]);
            a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm256_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm256_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(out + (long)g * hd + i0 + 8 * u, a[g][u]);
}

/* acc (group, hd) = sum over l in [l0, l1) of p[g][l] * V[l]. */
static void KV_NAME(v_accumulate)(const KV_T *vc, const long *rows, long l0, long l1, int hd,
                         const float *p, long pstride, int group, float *acc) {
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int ng = group - g0 < 3 ? group - g0 : 3;
        const float *pg = p + (long)g0 * pstride;
        float *ag = acc + (long)g0 * hd;
        int i0 = 0;
        for (; i0 + 32 <= hd; i0 += 32) {
            if (ng == 3) KV_NAME(v_block)(vc, rows, l0, l1, hd, i0, pg, pstride, 3, ag);
            else if (ng == 2) KV_NAME(v_block)(vc, rows, l0, l1, hd, i0, pg, pstride, 2, ag);
            else KV_NAME(v_block)(vc, rows, l0, l1, hd, i0, pg, pstride, 1, ag);
        }
        for (; i0 < hd; i0 += 8) /* hd % 32 tail, 8 floats at a time */
            for (int g = 0; g < ng; g++) {
                __m256 a = _mm256_setzero_ps();
                for (long l = l0; l < l1; l++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pg[g * pstride + l]),
                                        KV_LOAD8(vc + rows[l - l0] + i0), a);
                _mm256_storeu_ps(ag + (long)g * hd + i0, a);
            }
    }
}

/* One (row, KV head, split) task: max, exp-sum and unnormalized output of each q head of the group. */
static void KV_NAME(attend_split_256)(const Split *t, float *mx, float *total, float *acc) {
    const int hd = t->hd, group = t->group;
    const long l0 = t->l0, l1 = t->l1;
    const long *rows = t->rows; /* position l0 + j starts at element rows[j] */
    const float *q0 = t->q0;
    const KV_T *kc = t->k_cache;
    float *sc0 = t->sc0;
    for (int g = 0; g < group; g++) mx[g] = -INFINITY;
    long l = l0;
    __m256 vmx[MAX_GROUP];
    for (int g = 0; g < group; g++) vmx[g] = _mm256_set1_ps(-INFINITY);
    for (; l + 8 <= l1; l += 8) {
        const KV_T *k[8];
        for (int j = 0; j < 8; j++) k[j] = kc + rows[l - l0 + j];
        for (int g = 0; g < group; g++) {
            __m256 v = _mm256_mul_ps(KV_NAME(dot8)(q0 + g * hd, k, hd), _mm256_set1_ps(t->scale));
            _mm256_storeu_ps(sc0 + g * t->sstride + l, v);
            vmx[g] = _mm256_max_ps(vmx[g], v);
        }
    }
    for (int g = 0; g < group; g++) mx[g] = hmax8(vmx[g]);
    for (; l < l1; l++) {
        const KV_T *k = kc + rows[l - l0];
        for (int g = 0; g < group; g++) {
            __m256 d = _mm256_setzero_ps();
            for (int i = 0; i < hd; i += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + g * hd + i), KV_LOAD8(k + i), d);
            float v = hsum8(d) * t->scale;
            sc0[g * t->sstride + l] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    for (int g = 0; g < group; g++) total[g] = exp_shift_sum(sc0 + g * t->sstride + l0, l1 - l0, mx[g]);
    KV_NAME(v_accumulate)(t->v_cache, rows, l0, l1, hd, sc0, t->sstride, group, acc);
}

/* acc[g][i0 .. i0+64) += sum_l p[g][l] * V[l][i0 .. i0+64) for NG (1..3) heads, 4 x NG accumulators. */
AVX512 static inline __attribute__((always_inline)) void KV_NAME(v_block_512)(const Split *t, int i0, const float *p, const int NG,
                                                                     float *out) {
    __m512 a[3][4];
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm512_setzero_ps();
    for (long l = t->l0; l < t->l1; l++) {
        const KV_T *v = (const KV_T *)t->v_cache + t->rows[l - t->l0] + i0;
        const __m512 v0 = KV_LOAD16(v), v1 = KV_LOAD16(v + 16), v2 = KV_LOAD16(v + 32), v3 = KV_LOAD16(v + 48);
        for (int g = 0; g < NG; g++) {
            const __m512 w = _mm512_set1_ps(p[g * t->sstride + l]);
            a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(out + (long)g * t->hd + i0 + 16 * u, a[g][u]);
}

/* attend_split_256 16 lanes wide, for head_dim % 16 == 0. */
AVX512 static void KV_NAME(attend_split_512)(const Split *t, float *mx, float *total, float *acc) {
    const int hd = t->hd, group = t->group;
    const long l0 = t->l0, l1 = t->l1;
    const __m512 scale = _mm512_set1_ps(t->scale);
    const KV_T *kc = t->k_cache, *vc = t->v_cache;
    const int line = 64 / sizeof(KV_T); /* elements per cache line */
    long l = l0;
    __m512 vmx[MAX_GROUP];
    for (int g = 0; g < group; g++) vmx[g] = _mm512_set1_ps(-INFINITY);
    for (; l + 16 <= l1; l += 16) {
        const KV_T *k[16];
        for (int j = 0; j < 16; j++) k[j] = kc + t->rows[l - l0 + j];
        /* the cache rows sit where the block table puts them (contiguous within a block): fetch
           the next keys, and these positions' values for the second pass, ahead of use */
        for (long j = l + 16; j < l + 32 && j < l1; j++)
            for (int i = 0; i < hd; i += line) _mm_prefetch((const char *)(kc + t->rows[j - l0] + i), _MM_HINT_T0);
        for (long j = l; j < l + 16; j++)
            for (int i = 0; i < hd; i += line) _mm_prefetch((const char *)(vc + t->rows[j - l0] + i), _MM_HINT_T1);
        for (int g = 0; g < group; g++) {
            const float *q = t->q0 + g * hd;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) {
                const __m512 qv = _mm512_loadu_ps(q + i);
                for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(qv, KV_LOAD16(k[j] + i), a[j]);
            }
            const __m512 v = _mm512_mul_ps(reduce16(a), scale);
            _mm512_storeu_ps(t->sc0 + g * t->sstride + l, v);
            vmx[g] = _mm512_max_ps(vmx[g], v);
        }
    }
    for (int g = 0; g < group; g++) mx[g] = _mm512_reduce_max_ps(vmx[g]);
    for (; l < l1; l++) {
        const KV_T *k = kc + t->rows[l - l0];
        for (int g = 0; g < group; g++) {
            __m512 d = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) d = _mm512_fmadd_ps(_mm512_loadu_ps(t->q0 + g * hd + i), KV_LOAD16(k + i), d);
            const float v = _mm512_reduce_add_ps(d) * t->scale;
            t->sc0[g * t->sstride + l] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    for (int g = 0; g < group; g++) { /* exp in place and the sum, 16 lanes then the tail */
        float *p = t->sc0 + g * t->sstride;
        const __m512 shift = _mm512_set1_ps(mx[g]);
        __m512 sum = _mm512_setzero_ps();
        long i = l0;
        for (; i + 16 <= l1; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), shift));
            _mm512_storeu_ps(p + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        float tail = 0.f;
        for (; i < l1; i++) { p[i] = expf(p[i] - mx[g]); tail += p[i]; }
        total[g] = _mm512_reduce_add_ps(sum) + tail;
    }
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int ng = group - g0 < 3 ? group - g0 : 3;
        const float *pg = t->sc0 + (long)g0 * t->sstride;
        float *ag = acc + (long)g0 * hd;
        int i0 = 0;
        for (; i0 + 64 <= hd; i0 += 64) {
            if (ng == 3) KV_NAME(v_block_512)(t, i0, pg, 3, ag);
            else if (ng == 2) KV_NAME(v_block_512)(t, i0, pg, 2, ag);
            else KV_NAME(v_block_512)(t, i0, pg, 1, ag);
        }
        for (; i0 < hd; i0 += 16) /* hd % 64 tail, 16 floats at a time */
            for (int g = 0; g < ng; g++) {
                __m512 a = _mm512_setzero_ps();
                for (long j = l0; j < l1; j++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(pg[g * t->sstride + j]),
                                        KV_LOAD16(vc + t->rows[j - l0] + i0), a);
                _mm512_storeu_ps(ag + (long)g * hd + i0, a);
            }
    }
}


#undef KV_T
#undef KV_NAME
#undef KV_LOAD8
#undef KV_LOAD16
