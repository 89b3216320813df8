/* Weight-only quantized matmul on the CPU with 8-bit activations: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * The scheme of llama.cpp's CPU kernels (Q4_1 / Q8_0 weights times Q8_1 activations): the activations are quantized
 * once per call to int8 per block of 32 columns (d = max|x| / 127, q = round(x / d), and the block's code sum), and
 * every block's product is an integer dot product of weight codes with activation codes, scaled once:
 *
 *     y[m, n] = sum_b  s_w[n, b] * d_x[m, b] * dot(q_w[n, b], q_x[m, b])  +  min_w[n, b] * d_x[m, b] * sum(q_x[m, b])
 *
 * for W = q_w * s_w + min_w. Every path (AVX512-VNNI, AVX2, portable C) evaluates this in the same order, with one
 * fused multiply-add per term (the scale terms and the min terms summed apart, then added), so their results are the same bits, and a row's result never depends on the other
 * rows of the call: a speculative verify step of M rows scores each row exactly as a one-row decode step would.
 *
 * Weight layout (built by rooflm.kernels.cpu_native.matmul.pack_native): output rows in groups of 16 (N padded with
 * zero rows), and for each group its 32-column blocks in order; within a (group, block) the 16 rows' codes are
 * interleaved four columns at a time, so that one 512-bit vpdpbusd multiplies four columns of all 16 rows by the
 * same four activation codes (broadcast) and leaves each row's partial sum in its own 32-bit lane: no horizontal
 * reduction, and the unpacked weights of a block serve every activation row of the call. This is what makes a few-row
 * product (a verify step) cost about what a one-row product does: the weights' bytes bound both.
 *   4 bits: 256 bytes per (group, block): 4 x 64 bytes, octet o (columns 8o .. 8o + 7), byte 4r + j holds column
 *           8o + j of row r in its low nibble and column 8o + 4 + j in its high nibble; unsigned codes in [0, 15].
 *   8 bits: 512 bytes per (group, block): 8 x 64 bytes, quad t (columns 4t .. 4t + 3), byte 4r + j holds column
 *           4t + j of row r as u = q + 128 (vpdpbusd multiplies unsigned by signed bytes; the offset is removed in
 *           integer arithmetic by starting the sum at -128 * the activation codes' sum, so it stays exact).
 *   scales, mins: [groups, blocks, 16] float32 or float16 (mins may be NULL).
 *
 * Instruction sets, chosen at compile time from -march: AVX512-VNNI, AVX2 (vpmaddubsw + vpmaddwd) and portable C.
 * Groups of rows are spread over threads: compiled with -fopenmp (the loader does so when torch's own runtime is GNU
 * libgomp, which this library then shares), on torch's OpenMP threads; else on a small persistent pthread pool whose
 * workers spin briefly after a call (a decode step makes about a hundred calls a few microseconds apart), yielding
 * their core, and then sleep on a condition variable. A second set of spinning threads beside torch's would take
 * turns with them for the two cores of a small machine.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QMM_PAUSE() _mm_pause()
#else
#define QMM_PAUSE() ((void)0)
#endif

#if !defined(QMM_FORCE_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMM_ISA 2
#elif !defined(QMM_FORCE_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_ISA 1
#else
#define QMM_ISA 0
#endif

#ifdef _OPENMP
#define USE_OPENMP 1
#else
#define USE_OPENMP 0
#endif

#define BLK 32
#define GR 16         /* output rows interleaved in a group */
#if QMM_ISA == 1
#define MT_MAX 4      /* activation rows per register tile: AVX2 has 16 vector registers */
#else
#define MT_MAX 8
#endif
#define MAX_THREADS 256
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 2
#endif
#ifndef QMM_PREFETCH
#define QMM_PREFETCH 4096 /* bytes ahead of the codes being read (a software prefetch: +20% at 2 threads) */
#endif

typedef struct qmm_weight {
    const uint8_t *codes;
    const void *scales; /* float32, or float16 when f16 */
    const void *mins;   /* as scales; NULL: no min term */
    int64_t n, k;       /* output rows, input columns (k % 32 == 0) */
    int64_t nb;         /* blocks per row */
    int64_t bits;       /* 4 or 8 */
    int64_t f16;        /* scales and mins stored as IEEE half (exact for GGUF's fp16 block scales) */
} qmm_weight;

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* scale or min i, either storage */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int f16) {
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

int qmm_isa(void) { return QMM_ISA; }

/* ---- activation scratch (one call at a time: guarded by call_mu) ---- */
static int8_t *s_qx;    /* [M, nb * 32] codes */
static float *s_d;      /* [M, nb] block scales */
static float *s_c;      /* [M, nb] d * sum(codes): the min term's factor */
static int32_t *s_off;  /* [M, nb] -128 * sum(codes): the 8-bit codes' offset */
static size_t s_cap;    /* elements of s_qx allocated */

static int grow(size_t nq) {
    if (nq <= s_cap) return 0;
    free(s_qx); free(s_d); free(s_c); free(s_off);
    s_qx = NULL; s_d = s_c = NULL; s_off = NULL; s_cap = 0;
    size_t nblk = nq / BLK;
    if (posix_memalign((void **)&s_qx, 64, nq) || posix_memalign((void **)&s_d, 64, nblk * 4) ||
        posix_memalign((void **)&s_c, 64, nblk * 4) || posix_memalign((void **)&s_off, 64, nblk * 4))
        return -1;
    s_cap = nq;
    return 0;
}

static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t nb) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * nb + b;
            const float *xb = x + r * k + b * BLK;
            int8_t *q = s_qx + i * BLK;
            float amax = 0.f;
            for (int j = 0; j < BLK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < BLK; j++) {
                const int v = (int)nearbyintf(xb[j] * id);
                q[j] = (int8_t)v;
                sum += v;
            }
            s_d[i] = amax / 127.f;
            s_c[i] = s_d[i] * (float)sum;
            s_off[i] = -128 * sum;
        }
}

/* ---- one group of 16 output rows against a tile of mt activation rows: out[i * 16 + r] ----
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

static inline __attribute__((always_inline)) void group_tile(const qmm_weight *w, int64_t g, int64_t m0, const int mt,
                                                             const int f16, float *out) {
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

/* output rows n0 .. n1 - 1 (n0 a multiple of 16) for all m activation rows */
static void rows(const qmm_weight *w, int64_t m, float *y, int64_t n0, int64_t n1) {
    float out[MT_MAX * GR] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n += GR) {
        const int64_t g = n / GR, nr = n1 - n < GR ? n1 - n : GR;
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            int64_t mt = m - m0 < MT_MAX ? m - m0 : MT_MAX;
            /* constant tile sizes and scale storage: the compiler keeps the accumulators in registers */
#define QMM_TILE(MT, F16) case MT: group_tile(w, g, m0, MT, F16, out); break;
#if MT_MAX == 8
#define QMM_TILES(F16) switch (mt) { QMM_TILE(1, F16) QMM_TILE(2, F16) QMM_TILE(3, F16) QMM_TILE(4, F16) \
                                     QMM_TILE(5, F16) QMM_TILE(6, F16) QMM_TILE(7, F16) default: \
                                     group_tile(w, g, m0, 8, F16, out); break; }
#else
#define QMM_TILES(F16) switch (mt) { QMM_TILE(1, F16) QMM_TILE(2, F16) QMM_TILE(3, F16) default: \
                                     group_tile(w, g, m0, 4, F16, out); break; }
#endif
            if (w->f16) {
                QMM_TILES(1)
            } else {
                QMM_TILES(0)
            }
            for (int64_t i = 0; i < mt; i++) memcpy(y + (m0 + i) * w->n + n, out + i * GR, nr * sizeof(float));
        }
    }
}

/* ---- thread pool ----
 * A call publishes its rows as chunks and opens the job; workers that wake while it is open take chunks, and the
 * caller takes them too. When every chunk is taken the caller closes the job and waits only for the workers still
 * inside it: a worker that did not get a core in time (two cores shared with torch's threads) is never waited for. */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static int pool_size;           /* worker threads started */
static atomic_uint gen;         /* bumped once per parallel call */
static atomic_int sleepers;     /* workers waiting on sleep_cv */
static atomic_int open_job;     /* 1 while the current call's chunks may be taken */
static atomic_int inside;       /* workers inside the current call */
static atomic_long next_chunk;  /* next chunk of output rows to take */
static int spin_iters = 4000;   /* polls a worker makes before sleeping; it yields its core every 16 */
static struct {
    const qmm_weight *w;
    int64_t m;
    float *y;
    int64_t nchunks;
    int64_t chunk_rows;
    int active; /* workers that may take rows in this call */
} job;

static void take_chunks(void) {
    for (;;) {
        int64_t c = atomic_fetch_add(&next_chunk, 1);
        if (c >= job.nchunks) break;
        int64_t n0 = c * job.chunk_rows, n1 = n0 + job.chunk_rows < job.w->n ? n0 + job.chunk_rows : job.w->n;
        rows(job.w, job.m, job.y, n0, n1);
    }
}

static unsigned start_gen[MAX_THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seen = start_gen[id]; /* the generation when it was created: a call made since is still run */
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load(&gen)) == seen) {
            if (spins++ < spin_iters) {
                if (spins % 16)
                    QMM_PAUSE();
                else
                    sched_yield(); /* let a runnable thread (torch's) have this core */
                continue;
            }
            pthread_mutex_lock(&sleep_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&gen) == seen) pthread_cond_wait(&sleep_cv, &sleep_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&sleep_mu);
        }
        seen = g;
        atomic_fetch_add(&inside, 1);
        if (atomic_load(&open_job) && id < job.active) take_chunks();
        atomic_fetch_sub(&inside, 1);
    }
    return NULL;
}

static void reset_after_fork(void) { /* the child has none of the parent's workers */
    pool_size = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&sleep_mu, NULL);
    pthread_cond_init(&sleep_cv, NULL);
    atomic_store(&sleepers, 0);
    atomic_store(&inside, 0);
    atomic_store(&open_job, 0);
}

static void grow_pool(int want) {
    static int fork_hook;
    if (!fork_hook) fork_hook = !pthread_atfork(NULL, NULL, reset_after_fork);
    while (pool_size < want && pool_size < MAX_THREADS) {
        pthread_t t;
        pthread_attr_t attr;
        start_gen[pool_size] = atomic_load(&gen);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)pool_size);
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool_size++;
    }
}

void qmm_set_spin(int iters) { spin_iters = iters < 0 ? 0 : iters; }

/* y[m, w->n] = x[m, w->k] @ W^T, both float32 and contiguous. 0 on success, -1 when out of memory, -2 on bad
 * arguments. */
int qmm_matmul(const qmm_weight *w, const float *x, float *y, int64_t m, int nthreads) {
    if (m <= 0 || w->n <= 0) return 0;
    if (w->k <= 0 || w->k % BLK || w->nb * BLK != w->k || (w->bits != 4 && w->bits != 8)) return -2;
    pthread_mutex_lock(&call_mu);
    if (grow((size_t)(m * w->nb * BLK))) {
        pthread_mutex_unlock(&call_mu);
        return -1;
    }
    quantize_rows(x, m, w->k, w->nb);
    /* chunks of whole groups, about CHUNKS_PER_THREAD per thread: long runs of consecutive rows, which the
     * prefetchers stream (chunks of one group, handed out one at a time, ran at half the speed on 2 cores), and
     * still several per thread, so a thread that loses its core for a while leaves its chunks to the others */
    const int64_t ng = (w->n + GR - 1) / GR;
    int64_t per = ng / (CHUNKS_PER_THREAD * (nthreads > 1 ? nthreads : 1));
    if (per < 1) per = 1;
    const int64_t chunk_rows = per * GR, nchunks = (ng + per - 1) / per;
    int workers = nthreads - 1;
    if (workers > nchunks - 1) workers = (int)(nchunks - 1);
    if (workers > 0 && !USE_OPENMP) grow_pool(workers);
    if (!USE_OPENMP && workers > pool_size) workers = pool_size;
    if (workers <= 0) {
        rows(w, m, y, 0, w->n);
    } else if (USE_OPENMP) {
#ifdef _OPENMP
        /* built against the OpenMP runtime torch already loaded: its threads, no second pool */
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers + 1)
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t n0 = c * chunk_rows, n1 = n0 + chunk_rows < w->n ? n0 + chunk_rows : w->n;
            rows(w, m, y, n0, n1);
        }
#endif
    } else {
        job.w = w; job.m = m; job.y = y; job.nchunks = nchunks; job.chunk_rows = chunk_rows; job.active = workers;
        atomic_store(&next_chunk, 0);
        atomic_store(&open_job, 1);
        atomic_fetch_add(&gen, 1);
        if (atomic_load(&sleepers) > 0) {
            pthread_mutex_lock(&sleep_mu);
            pthread_cond_broadcast(&sleep_cv);
            pthread_mutex_unlock(&sleep_mu);
        }
        take_chunks();
        atomic_store(&open_job, 0);
        while (atomic_load(&inside) > 0) QMM_PAUSE(); /* only workers that are taking rows of this call */
    }
    pthread_mutex_unlock(&call_mu);
    return 0;
}
