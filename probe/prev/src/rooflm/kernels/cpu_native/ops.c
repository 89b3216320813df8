/* The small float32 operators of a CPU decode step, beside the quantized matmul of qmm.c.
 *
 * A decode step of a small model (SmolLM2-135M: 30 layers of 576 features) spends much of its time in torch's small
 * operators: each is a few microseconds of dispatch for well under a microsecond of work, and torch's CPU flash
 * attention is tuned for long queries, not for one. Here each is one call with a fixed order of operations:
 *
 * - ops_rms_norm: y = x / sqrt(mean(x^2) + eps) * w per row (Zhang & Sennrich 2019), the sum of squares in 16
 *   float lanes added pairwise at the end;
 * - ops_argmax: the index of each row's largest value, as torch's max(dim=-1).indices gives it;
 * - ops_attend: softmax(q K^T * scale) V for each of T query tokens over the keys it reads (a prefix of the context,
 *   or an explicit list of positions: a token tree's token reads the context and its ancestors), grouped-query
 *   attention (Ainslie et al. 2023: query head h uses KV head h / (hq / hkv)). Each token is computed on its own, by
 *   the same code, whatever the other tokens of the call: a speculative verify step's token gets the floats its
 *   decode step would (greedy speculation then keeps the plain path's tokens exactly). On this project's 2-core
 *   machine it runs at the machine's multiply-add rate (about 13 us for 250 keys of SmolLM2's 9 heads of 64 when
 *   they are in cache); the keys come 16 at a time (8 with AVX2), every head of a KV head's group reading them
 *   from L1.
 *
 * exp is a Cephes-style polynomial (range reduction by ln 2, degree-6 polynomial; relative error ~1e-7). The AVX512,
 * AVX2 and portable forms of the attention sum in different orders: results agree to float rounding across builds,
 * and bit for bit within one. (The rotary embedding and cache write are in decode.c.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(QMM_FORCE_SCALAR) && defined(__AVX512F__)
#include <immintrin.h>
#define OPS_AVX512 1
#else
#define OPS_AVX512 0
#endif
#if !OPS_AVX512 && !defined(QMM_FORCE_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OPS_AVX2 1 /* 8 lanes: the dot products, softmax and attention below */
#else
#define OPS_AVX2 0
#endif

#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365478515625f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

static inline float exp_scalar(float x) {
    x = x < EXP_LO ? EXP_LO : x > EXP_HI ? EXP_HI : x; /* plain compares: fmaxf is a libm call */
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.f);
    return ldexpf(p, (int)n);
}

#if OPS_AVX512
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#if OPS_AVX2
/* exp_scalar in 8 lanes, bit for bit: AVX2 has no scalef, so p * 2^n is two exact products by powers of two (n in
 * [-126, 128] splits into halves that are normal exponents) and one rounding, as ldexpf's */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT |
                                     _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
#endif

/* sum of a[i] * b[i], i < n, in 16 lanes (lane i % 16), the lanes added pairwise at the end: one fixed order */
static inline float dot(const float *a, const float *b, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
#if OPS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    _mm512_storeu_ps(lane, acc);
#elif OPS_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* lanes 0-7 and 8-15: the portable order */
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    _mm256_storeu_ps(lane, acc0);
    _mm256_storeu_ps(lane + 8, acc1);
#else
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
#endif
    for (int l = 0; i < n; i++, l++) lane[l] = fmaf(a[i], b[i], lane[l]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

void ops_rms_norm(const float *x, const float *w, float eps, float *out, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = out + r * dim;
        const float inv = 1.f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* out[r]: the index of the largest of the n floats of row r (rows rs floats apart): the first of equal maxima, or
 * the first NaN where there is one (a NaN counts as the largest). torch's max(dim=-1).indices gives the same, so a
 * greedy choice does not depend on which of the two made it; this one reads a vocabulary-wide row twice in 16
 * lanes (the maximum, then where it first is) and takes ~5 instead of ~45 us for 49,152 floats. */
void ops_argmax(const float *x, int64_t rows, int64_t n, int64_t rs, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * rs;
        int64_t j = 0, nan_at = -1;
        float mx = -INFINITY;
#if OPS_AVX512
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 v = _mm512_loadu_ps(xr + j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, v);
        }
        mx = _mm512_reduce_max_ps(mv);
        if (nan) j = 0; /* find the first NaN below */
#endif
        for (int64_t i = j; i < n; i++) {
            if (xr[i] != xr[i]) {
                nan_at = i;
                break;
            }
            mx = xr[i] > mx ? xr[i] : mx;
        }
        if (nan_at < 0) {
            j = 0;
#if OPS_AVX512
            const __m512 m16 = _mm512_set1_ps(mx);
            for (; j + 16 <= n; j += 16) {
                const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(xr + j), m16, _CMP_EQ_OQ);
                if (eq) break;
            }
#endif
            while (j < n && !(xr[j] == mx)) j++;
        }
        out[r] = nan_at >= 0 ? nan_at : (j < n ? j : 0);
    }
}

/* the softmax of s[0:n] in place (exp of s - max, then divided by the sum) */
static void softmax(float *s, int64_t n) {
    float mx = -INFINITY;
    int64_t j = 0;
#if OPS_AVX512
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    mx = _mm512_reduce_max_ps(mv);
#elif OPS_AVX2
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float m8[8];
    _mm256_storeu_ps(m8, mv);
    for (int l = 0; l < 8; l++) mx = m8[l] > mx ? m8[l] : mx;
#endif
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    j = 0;
#if OPS_AVX512
    const __m512 m16 = _mm512_set1_ps(mx);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16)));
#elif OPS_AVX2
    const __m256 m8v = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8v)));
#endif
    for (; j < n; j++) s[j] = exp_scalar(s[j] - mx);
    float lane[16] = {0}; /* the sum in 16 lanes (j mod 16), added pairwise: one fixed order, and no serial chain */
    j = 0;
#if OPS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(s + j));
    _mm512_storeu_ps(lane, acc);
#elif OPS_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* lanes 0-7 and 8-15: the portable order */
    for (; j + 16 <= n; j += 16) {
        acc0 = _mm256_add_ps(acc0, _mm256_loadu_ps(s + j));
        acc1 = _mm256_add_ps(acc1, _mm256_loadu_ps(s + j + 8));
    }
    _mm256_storeu_ps(lane, acc0);
    _mm256_storeu_ps(lane + 8, acc1);
#else
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lane[l] += s[j + l];
#endif
    for (int l = 0; j < n; j++, l++) lane[l] += s[j];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    const float inv = 1.f / lane[0];
    j = 0;
#if OPS_AVX512
    const __m512 iv = _mm512_set1_ps(inv);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), iv));
#elif OPS_AVX2
    const __m256 iv = _mm256_set1_ps(inv);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), iv));
#endif
    for (; j < n; j++) s[j] *= inv;
}

#if OPS_AVX512
/* lane u of the result: the sum of the 16 lanes of v[u] (a transpose by shuffles: 45 operations for 16 sums) */
static inline __attribute__((always_inline)) __m512 sum16x16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* the dot products of q with 16 keys, lane u for key u: the features outermost, so 16 independent multiply-adds
 * are in flight */
static inline __attribute__((always_inline)) __m512 qk16(const float *q, const float *const *kj, const int64_t c16) {
    __m512 acc[16];
    const __m512 q0 = _mm512_loadu_ps(q);
    for (int u = 0; u < 16; u++) acc[u] = _mm512_mul_ps(q0, _mm512_loadu_ps(kj[u]));
    for (int64_t c = 1; c < c16; c++) {
        const __m512 qc = _mm512_loadu_ps(q + 16 * c);
        for (int u = 0; u < 16; u++) acc[u] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kj[u] + 16 * c), acc[u]);
    }
    return sum16x16(acc);
}

/* out[0:16 c16] += sum over the block's m keys (m <= 16) of p[u] * v_u, in two partial sums (even and odd keys)
 * added at the end, so twice as many multiply-adds are in flight */
static inline __attribute__((always_inline)) void pv_block(const float *p, float *out, const int64_t c16,
                                                           const float *const *vj, int m) {
    __m512 a0[16], a1[16];
    for (int64_t c = 0; c < c16; c++) {
        a0[c] = _mm512_loadu_ps(out + 16 * c);
        a1[c] = _mm512_setzero_ps();
    }
    int u = 0;
    for (; u + 2 <= m; u += 2) {
        const __m512 p0 = _mm512_set1_ps(p[u]), p1 = _mm512_set1_ps(p[u + 1]);
        for (int64_t c = 0; c < c16; c++) {
            a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vj[u] + 16 * c), a0[c]);
            a1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vj[u + 1] + 16 * c), a1[c]);
        }
    }
    if (u < m) {
        const __m512 p0 = _mm512_set1_ps(p[u]);
        for (int64_t c = 0; c < c16; c++) a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vj[u] + 16 * c), a0[c]);
    }
    for (int64_t c = 0; c < c16; c++) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(a0[c], a1[c]));
}
#endif

#if OPS_AVX2
/* lane u of the result: the sum of the 8 lanes of v[u] (horizontal adds, then the two 128-bit halves) */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* qk16 with 8 keys of 8 lanes (c8 = d / 8 vectors a key) */
static inline __attribute__((always_inline)) __m256 qk8(const float *q, const float *const *kj, const int64_t c8) {
    __m256 acc[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int u = 0; u < 8; u++) acc[u] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[u]));
    for (int64_t c = 1; c < c8; c++) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj[u] + 8 * c), acc[u]);
    }
    return sum8x8(acc);
}

/* pv_block with 8 lanes: out[0:8 c8] += sum over the block's m keys (m <= 8) of p[u] * v_u, even and odd keys apart */
static inline __attribute__((always_inline)) void pv_block8(const float *p, float *out, const int64_t c8,
                                                            const float *const *vj, int m) {
    __m256 a0[32], a1[32];
    for (int64_t c = 0; c < c8; c++) {
        a0[c] = _mm256_loadu_ps(out + 8 * c);
        a1[c] = _mm256_setzero_ps();
    }
    int u = 0;
    for (; u + 2 <= m; u += 2) {
        const __m256 p0 = _mm256_set1_ps(p[u]), p1 = _mm256_set1_ps(p[u + 1]);
        for (int64_t c = 0; c < c8; c++) {
            a0[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vj[u] + 8 * c), a0[c]);
            a1[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vj[u + 1] + 8 * c), a1[c]);
        }
    }
    if (u < m) {
        const __m256 p0 = _mm256_set1_ps(p[u]);
        for (int64_t c = 0; c < c8; c++) a0[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vj[u] + 8 * c), a0[c]);
    }
    for (int64_t c = 0; c < c8; c++) _mm256_storeu_ps(out + 8 * c, _mm256_add_ps(a0[c], a1[c]));
}
#endif

/* the query heads h0 .. h0 + gs - 1 (one KV head's group) of one token over n keys (key j at row pos ? pos[j] : j);
 * s: scratch of gs * n floats */
static inline int64_t row_of(int64_t p, const int64_t *blocks, int64_t bs) {
    return blocks ? blocks[p / bs] * bs + p % bs : p;
}

static void attend_group(const float *q, float *out, int64_t gs, int64_t d, float scale, const float *k,
                         const float *v, int64_t rs, int64_t n, const int64_t *pos, const int64_t *blocks, int64_t bs,
                         float *s) {
    /* the row of key j: its position (j, or pos[j]) through the block table when there is one */
#define ROW(j) row_of(pos ? pos[(j)] : (j), blocks, bs)
#if OPS_AVX512
    if (d % 16 == 0 && d <= 256) {
        /* keys in blocks of 16, every head of the group per block: a block's K and V rows come from L2 once and
         * serve the group's heads from L1 */
        const int64_t c16 = d / 16;
        const float *rows[16];
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            for (int u = 0; u < 16; u++) rows[u] = k + ROW(j + u) * rs;
            for (int64_t h = 0; h < gs; h++) {
                __m512 sc;
                if (c16 == 4)
                    sc = qk16(q + h * d, rows, 4);
                else if (c16 == 8)
                    sc = qk16(q + h * d, rows, 8);
                else
                    sc = qk16(q + h * d, rows, c16);
                _mm512_storeu_ps(s + h * n + j, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
            }
        }
        for (; j < n; j++) {
            const float *kj = k + ROW(j) * rs;
            for (int64_t h = 0; h < gs; h++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * d), _mm512_loadu_ps(kj));
                for (int64_t c = 1; c < c16; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + 16 * c), _mm512_loadu_ps(kj + 16 * c), acc);
                s[h * n + j] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
        for (int64_t h = 0; h < gs; h++) softmax(s + h * n, n);
        memset(out, 0, (size_t)(gs * d) * sizeof(float));
        for (j = 0; j < n; j += 16) {
            const int m = n - j < 16 ? (int)(n - j) : 16;
            for (int u = 0; u < m; u++) rows[u] = v + ROW(j + u) * rs;
            for (int64_t h = 0; h < gs; h++) {
                if (c16 == 4)
                    pv_block(s + h * n + j, out + h * d, 4, rows, m);
                else if (c16 == 8)
                    pv_block(s + h * n + j, out + h * d, 8, rows, m);
                else
                    pv_block(s + h * n + j, out + h * d, c16, rows, m);
            }
        }
        return;
    }
#elif OPS_AVX2
    if (d % 8 == 0 && d <= 256) { /* the loop above with 8 keys a block */
        const int64_t c8 = d / 8;
        const float *rows[8];
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            for (int u = 0; u < 8; u++) rows[u] = k + ROW(j + u) * rs;
            for (int64_t h = 0; h < gs; h++) {
                __m256 sc;
                if (c8 == 8)
                    sc = qk8(q + h * d, rows, 8);
                else if (c8 == 16)
                    sc = qk8(q + h * d, rows, 16);
                else
                    sc = qk8(q + h * d, rows, c8);
                _mm256_storeu_ps(s + h * n + j, _mm256_mul_ps(sc, _mm256_set1_ps(scale)));
            }
        }
        for (; j < n; j++)
            for (int64_t h = 0; h < gs; h++) s[h * n + j] = dot(q + h * d, k + ROW(j) * rs, d) * scale;
        for (int64_t h = 0; h < gs; h++) softmax(s + h * n, n);
        memset(out, 0, (size_t)(gs * d) * sizeof(float));
        for (j = 0; j < n; j += 8) {
            const int m = n - j < 8 ? (int)(n - j) : 8;
            for (int u = 0; u < m; u++) rows[u] = v + ROW(j + u) * rs;
            for (int64_t h = 0; h < gs; h++) {
                if (c8 == 8)
                    pv_block8(s + h * n + j, out + h * d, 8, rows, m);
                else if (c8 == 16)
                    pv_block8(s + h * n + j, out + h * d, 16, rows, m);
                else
                    pv_block8(s + h * n + j, out + h * d, c8, rows, m);
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        const float *kj = k + ROW(j) * rs;
        for (int64_t h = 0; h < gs; h++) s[h * n + j] = dot(q + h * d, kj, d) * scale;
    }
    for (int64_t h = 0; h < gs; h++) softmax(s + h * n, n);
    memset(out, 0, (size_t)(gs * d) * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        const float *vj = v + ROW(j) * rs;
        for (int64_t h = 0; h < gs; h++)
            for (int64_t i = 0; i < d; i++) out[h * d + i] = fmaf(s[h * n + j], vj[i], out[h * d + i]);
    }
#undef ROW
}

/* q, out [T, hq, d]; k, v: position-major rows of hkv * d floats, rs floats apart; token t reads nkeys[t] keys:
 * positions 0 .. nkeys[t] - 1, or (pos not NULL) the next nkeys[t] entries of pos; position p is row p, or with a
 * block table (blocks not NULL, bs positions a block) row blocks[p / bs] * bs + p % bs of the paged cache, read
 * in place (no gather); token t's table starts at blocks + t * table_stride (0: one table for every token, one
 * sequence; a decode step of several sequences passes one row per token). The (token, KV head) pairs are
 * spread over up to nthreads threads (OpenMP builds), each pair computed whole by one thread: the result does not
 * depend on the thread count. 0 on success, -1 when out of memory. */
int ops_attend(const float *q, float *out, int64_t T, int64_t hq, int64_t hkv, int64_t d, float scale, const float *k,
               const float *v, int64_t rs, const int64_t *nkeys, const int64_t *pos, const int64_t *blocks, int64_t bs,
               int64_t table_stride, int nthreads) {
    const int64_t group = hq / hkv;
    int64_t most = 1, total = 0;
    for (int64_t t = 0; t < T; t++) {
        most = nkeys[t] > most ? nkeys[t] : most;
        total += nkeys[t];
    }
    int64_t *first = malloc((size_t)T * sizeof(int64_t)); /* where token t's positions start in pos */
    if (!first) return -1;
    for (int64_t t = 0, o = 0; t < T; o += nkeys[t], t++) first[t] = o;
    int failed = 0;
    const int64_t pairs = T * hkv;
    /* threads only where the work outweighs waking them: about 4k multiply-adds per microsecond and thread */
    const int par = nthreads > 1 && pairs > 1 && total * hq * d > (1 << 16);
    (void)par;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (par)
#endif
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t t = i / hkv, g = i % hkv;
        float stack[4096];
        float *s = group * most <= 4096 ? stack : malloc((size_t)(group * most) * sizeof(float));
        if (!s) {
            failed = 1;
            continue;
        }
        attend_group(q + (t * hq + g * group) * d, out + (t * hq + g * group) * d, group, d, scale, k + g * d,
                     v + g * d, rs, nkeys[t], pos ? pos + first[t] : NULL,
                     blocks ? blocks + t * table_stride : NULL, bs, s);
        if (s != stack) free(s);
    }
    free(first);
    return failed ? -1 : 0;
}
