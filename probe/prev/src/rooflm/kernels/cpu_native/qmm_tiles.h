/* The register tiles of the quantized matmul, one form per instruction set; included once, by qmm.c, whose
 * definitions (qmm_weight, BLK, GR, MT_MAX, QMM_PREFETCH, the activation scratch s_qx / s_d / s_c / s_off) they use.
 *
 * ---- one group of 16 output rows against a tile of mt activation rows: out[i * 16 + r] ----
 * Per block, each path forms the exact integer dot product, then acc = fma(dot, s_w * d_x, acc) and
 * acc_min = fma(min_w, c_x, acc_min); the result is acc + acc_min (two accumulators: two shorter chains of dependent
 * multiply-adds). */
#if QMM_ISA == 2
static inline __attribute__((always_inline)) __m512 vec16(const void *p, int64_t i, const int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
               : _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) void group_tile(const qmm_weight *w, int64_t g, int64_t m0, const int mt,
                                                             const int f16, float *out) {
    const int64_t nb = w->nb;
    __m512 acc[MT_MAX], accm[MT_MAX];
    for (int i = 0; i < mt; i++) acc[i] = accm[i] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8((char)0xF0);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t gb = g * nb + b;
        __m512i wq[8];
        if (w->bits == 4) {
            /* wq[t] holds columns 4t .. 4t + 3 of the 16 rows; for odd t (high nibbles) 16 times the codes: masked in
             * place, no shift; their sums (the a1 chain below) are divided by 16 exactly before they are added */
            const uint8_t *c = w->codes + gb * 256;
            _mm_prefetch((const char *)c + QMM_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)c + QMM_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)c + QMM_PREFETCH + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)c + QMM_PREFETCH + 192, _MM_HINT_T0);
            for (int o = 0; o < 4; o++) {
                __m512i v = _mm512_loadu_si512(c + 64 * o);
                wq[2 * o] = _mm512_and_si512(v, lo4);
                wq[2 * o + 1] = _mm512_and_si512(v, hi4);
            }
        } else {
            const uint8_t *c = w->codes + gb * 512;
            for (int t = 0; t < 8; t++) {
                _mm_prefetch((const char *)c + QMM_PREFETCH + 64 * t, _MM_HINT_T0);
                wq[t] = _mm512_loadu_si512(c + 64 * t);
            }
        }
        const __m512 sw = vec16(w->scales, gb * GR, f16);
        const __m512 mn = w->mins ? vec16(w->mins, gb * GR, f16) : _mm512_setzero_ps();
        for (int i = 0; i < mt; i++) {
            const int64_t xi = (m0 + i) * nb + b;
            const int8_t *x = s_qx + xi * BLK;
            /* two chains of four dependent vpdpbusd (even and odd t); integer sums, so the split does not change
             * the result (for 4 bits the odd chain's sum is 16 x the true one: at most 4 * 4 * 240 * 127 in a lane) */
            __m512i a0 = w->bits == 8 ? _mm512_set1_epi32(s_off[xi]) : _mm512_setzero_si512();
            __m512i a1 = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {
                a0 = _mm512_dpbusd_epi32(a0, wq[t], bcast4(x + 4 * t));
                a1 = _mm512_dpbusd_epi32(a1, wq[t + 1], bcast4(x + 4 * t + 4));
            }
            const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(s_d[xi]));
            if (w->bits == 4) a1 = _mm512_srai_epi32(a1, 4);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), s, acc[i]);
            if (w->mins) accm[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s_c[xi]), accm[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(out + i * GR, _mm512_add_ps(acc[i], accm[i]));
}
#elif QMM_ISA == 1
static inline __attribute__((always_inline)) __m256 vec8(const void *p, int64_t i, const int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* rows 8h .. 8h + 7 of the group, one half at a time (16 registers) */
static inline __attribute__((always_inline)) void half_tile(const qmm_weight *w, int64_t g, int h, int64_t m0,
                                                            const int mt, const int f16, float *out) {
    const int64_t nb = w->nb;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MT_MAX], accm[MT_MAX];
    for (int i = 0; i < mt; i++) acc[i] = accm[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t gb = g * nb + b;
        const __m256 sw = vec8(w->scales, gb * GR + 8 * h, f16);
        if (w->bits == 4) {
            const uint8_t *c = w->codes + gb * 256 + 32 * h;
            __m256i wq[8];
            for (int o = 0; o < 4; o++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * o));
                wq[2 * o] = _mm256_and_si256(v, lo4);
                wq[2 * o + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            }
            for (int i = 0; i < mt; i++) {
                const int64_t xi = (m0 + i) * nb + b;
                const int8_t *x = s_qx + xi * BLK;
                /* 16-bit pair sums of codes <= 15 times |x| <= 127: eight of them stay below 2^15 */
                __m256i p16 = _mm256_maddubs_epi16(wq[0], bcast4(x));
                for (int t = 1; t < 8; t++) p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wq[t], bcast4(x + 4 * t)));
                const __m256i dot = _mm256_madd_epi16(p16, ones);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(s_d[xi])), acc[i]);
            }
        } else {
            const uint8_t *c = w->codes + gb * 512 + 32 * h;
            for (int i = 0; i < mt; i++) {
                const int64_t xi = (m0 + i) * nb + b;
                const int8_t *x = s_qx + xi * BLK;
                __m256i dot = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    /* signed codes; |q| * sign(x, q): a pair sums to at most 2 * 128 * 127, no saturation */
                    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 64 * t)),
                                                       _mm256_set1_epi8((char)0x80));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(bcast4(x + 4 * t), q));
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
                }
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(s_d[xi])), acc[i]);
            }
        }
        if (w->mins) {
            const __m256 mn = vec8(w->mins, gb * GR + 8 * h, f16);
            for (int i = 0; i < mt; i++) accm[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(s_c[(m0 + i) * nb + b]), accm[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm256_storeu_ps(out + i * GR + 8 * h, _mm256_add_ps(acc[i], accm[i]));
}

/* One activation row (a decode step), both halves of the group in one pass over each block: every cache line of
 * codes and every broadcast activation quad is used once, where two calls of half_tile read each line twice (half
 * of it each time) and broadcast the activations twice; and a software prefetch, as in the AVX-512 path. Same
 * integer dot products and the same float operations in the same order as half_tile, so the same bits: a row's
 * result does not depend on whether it comes alone or in a tile of several. */
/* a block's exact dot products of rows 0-7 and 8-15 into the scale sums acc[0], acc[1] and its mins into acc[2],
 * acc[3], as half_tile does for each half */
static inline __attribute__((always_inline)) void row1_block(const qmm_weight *w, int64_t gb, const int f16,
                                                             __m256i dot0, __m256i dot1, float dx, float cx,
                                                             __m256 acc[4]) {
    const __m256 d = _mm256_set1_ps(dx);
    acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(vec8(w->scales, gb * GR, f16), d), acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(vec8(w->scales, gb * GR + 8, f16), d), acc[1]);
    if (w->mins) {
        const __m256 c = _mm256_set1_ps(cx);
        acc[2] = _mm256_fmadd_ps(vec8(w->mins, gb * GR, f16), c, acc[2]);
        acc[3] = _mm256_fmadd_ps(vec8(w->mins, gb * GR + 8, f16), c, acc[3]);
    }
}

static inline __attribute__((always_inline)) void row1_store(const __m256 acc[4], float *out) {
    _mm256_storeu_ps(out, _mm256_add_ps(acc[0], acc[2]));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(acc[1], acc[3]));
}

static inline __attribute__((always_inline)) void row1_q8(const qmm_weight *w, int64_t g, int64_t m0, const int f16,
                                                          float *out) {
    const int64_t nb = w->nb;
    const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi8((char)0x80);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int8_t *xq = s_qx + m0 * nb * BLK;
    const float *xd = s_d + m0 * nb, *xc = s_c + m0 * nb;
    const uint8_t *c = w->codes + g * nb * 512;
    for (int64_t b = 0; b < nb; b++, c += 512) {
        const int64_t gb = g * nb + b;
        for (int t = 0; t < 8; t++) _mm_prefetch((const char *)c + QMM_PREFETCH + 64 * t, _MM_HINT_T0);
        const int8_t *x = xq + b * BLK;
        __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i bx = bcast4(x + 4 * t);
            const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 64 * t)), off);
            const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 64 * t + 32)), off);
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(q0), _mm256_sign_epi8(bx, q0));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(q1), _mm256_sign_epi8(bx, q1));
            d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(p0, ones));
            d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(p1, ones));
        }
        row1_block(w, gb, f16, d0, d1, xd[b], xc[b], acc);
    }
    row1_store(acc, out);
}

static inline __attribute__((always_inline)) void row1_q4(const qmm_weight *w, int64_t g, int64_t m0, const int f16,
                                                          float *out) {
    const int64_t nb = w->nb;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int8_t *xq = s_qx + m0 * nb * BLK;
    const float *xd = s_d + m0 * nb, *xc = s_c + m0 * nb;
    const uint8_t *c = w->codes + g * nb * 256;
    for (int64_t b = 0; b < nb; b++, c += 256) {
        const int64_t gb = g * nb + b;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)c + QMM_PREFETCH + 64 * l, _MM_HINT_T0);
        const int8_t *x = xq + b * BLK;
        __m256i p0, p1;
        {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)c);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(c + 32));
            const __m256i xl = bcast4(x), xh = bcast4(x + 4);
            p0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, lo4), xl),
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4), xh));
            p1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, lo4), xl),
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4), xh));
        }
        for (int o = 1; o < 4; o++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(c + 64 * o));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(c + 64 * o + 32));
            const __m256i xl = bcast4(x + 8 * o), xh = bcast4(x + 8 * o + 4);
            p0 = _mm256_add_epi16(p0, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, lo4), xl),
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4), xh)));
            p1 = _mm256_add_epi16(p1, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, lo4), xl),
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4), xh)));
        }
        row1_block(w, gb, f16, _mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones), xd[b], xc[b], acc);
    }
    row1_store(acc, out);
}

static inline __attribute__((always_inline)) void group_tile(const qmm_weight *w, int64_t g, int64_t m0, const int mt,
                                                             const int f16, float *out) {
    if (mt == 1) {
        if (w->bits == 4)
            row1_q4(w, g, m0, f16, out);
        else
            row1_q8(w, g, m0, f16, out);
        return;
    }
    half_tile(w, g, 0, m0, mt, f16, out);
    half_tile(w, g, 1, m0, mt, f16, out);
}
#else
/* Not auto-vectorised: GCC 12 with VNNI enabled turned an 8-bit dot product loop of this shape into a wrong one. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static inline void group_tile(const qmm_weight *w, int64_t g, int64_t m0, const int mt, const int f16, float *out) {
    const int64_t nb = w->nb;
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < GR; r++) {
            float acc = 0.f, accm = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t gb = g * nb + b, xi = (m0 + i) * nb + b;
                const int8_t *x = s_qx + xi * BLK;
                int32_t dot = 0;
                for (int col = 0; col < BLK; col++) {
                    int q;
                    if (w->bits == 4) {
                        const uint8_t byte = w->codes[gb * 256 + 64 * (col / 8) + 4 * r + (col % 4)];
                        q = (col % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
                    } else {
                        q = (int)w->codes[gb * 512 + 64 * (col / 4) + 4 * r + (col % 4)] - 128;
                    }
                    dot += q * x[col];
                }
                const float s = ld(w->scales, gb * GR + r, f16) * s_d[xi];
                acc = fmaf((float)dot, s, acc);
                if (w->mins) accm = fmaf(ld(w->mins, gb * GR + r, f16), s_c[xi], accm);
            }
            out[i * GR + r] = acc + accm;
        }
}
#endif
