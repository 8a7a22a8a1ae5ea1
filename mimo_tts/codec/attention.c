/* Fused attention for the audio tokenizer's transformer stacks on the CPU (attention.py).

   out[b, i, h, :] = sum_j softmax_j(scale * q[b, i, h, :] . k[b, j, h, :]) v[b, j, h, :]
   over the keys j that query i sees: lo(i) <= j <= hi(i) with
     lo(i) = left  < 0 ? 0          : max(0, offset + i - left)
     hi(i) = right < 0 ? klen[b] - 1 : min(klen[b] - 1, offset + i + right)
   (causal: right = 0; a key-padding mask: klen; a sliding window: left). The masked part of
   the square is never computed.

   Written with GCC vector extensions, one register a vector (16 floats with AVX-512, 8 with
   AVX2 or plain x86-64), so one source serves every CPU kind. float32 runs float32 throughout.
   bfloat16 takes the CPU's bfloat16 dot instruction where the build has it (head_bf16) and is
   widened to float32 as it is packed elsewhere; softmax and sums are float32 either way and
   bfloat16 outputs round to nearest even.

   Each (batch, head) is one task: its keys are packed once (transposed in blocks of a vector's
   width), its values widened into rows, then its queries go in blocks of ROWS: scores for the
   block's key range, an exact softmax per row (max, exp, sum), values weighted in CHUNK
   dimensions at a time. What a query gets depends only on its own row and key range, never on
   the block it shares, the thread or the thread count. Every key block starts at a multiple of
   LANES keys, so sums run in the same order whatever the query range (on one kind of CPU: the
   vector width sets the order). */

#pragma GCC diagnostic ignored "-Wpsabi"  /* wide vectors where the build lacks AVX: inlined */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A vector is one register: 16 floats with AVX-512, else 8 (AVX2; two SSE registers on a
   plain x86-64 build). Keys go in blocks of LANES. */
#if defined(__AVX512F__)  /* 32 registers */
#define LANES 16
#define ROWS 8  /* queries per block */
#define CHUNK_VECS 4  /* output vectors per pass over the keys */
#else  /* 16 registers */
#define LANES 8
#define ROWS 4
#define CHUNK_VECS 2
#endif
#define CHUNK (CHUNK_VECS * LANES)

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));  /* unaligned access */

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf x) { *(vfu *)p = x; }
#if LANES == 16
#define EACH(f) {f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), \
                 f(8), f(9), f(10), f(11), f(12), f(13), f(14), f(15)}
#else
#define EACH(f) {f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7)}
#endif
#define SAME(l) x
#define INDEX(l) l
static inline vf splat(float x) { return (vf)EACH(SAME); }
static inline vi lanes(void) { return (vi)EACH(INDEX); }  /* 0, 1, ..., LANES - 1 */
static inline vf pick(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint16_t vhu __attribute__((vector_size(2 * LANES), aligned(2)));

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A vector to bfloat16 at dst, each lane rounded to nearest even (a NaN stays a quiet NaN). */
static inline void store_bf16(uint16_t *dst, vf x) {
    vu u = (vu)x;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    r = (nan & ((u >> 16) | 0x40u)) | (~nan & r);
    *(vhu *)dst = __builtin_convertvector(r, vh);
}

/* e^x for x <= 0 (scores minus their row's maximum): 2^n * e^r with |r| <= ln 2 / 2, e^r by
   its Taylor series to r^7 (relative error < 1e-8 before rounding); below -87 it is 0. */
static inline vf exp_le0(vf x) {
    const vf big = splat(12582912.0f);  /* 1.5 * 2^23: adding it rounds to an integer */
    vi tiny = x < splat(-87.0f);
    x = pick(tiny, splat(-87.0f), x);
    vf n = (x * splat(1.44269504088896341f) + big) - big;
    vf r = x - n * splat(0.693145751953125f);  /* ln 2 in two parts (Cody and Waite) */
    r = r - n * splat(1.428606765330187e-06f);
    vf p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf y = p * (vf)e;
    return pick(tiny, splat(0.0f), y);
}

static inline float lane_max(vf x) {
    float m = x[0];
    for (int l = 1; l < LANES; ++l) m = x[l] > m ? x[l] : m;
    return m;
}

static inline float lane_sum(vf x) {
    float s = 0.0f;
    for (int l = 0; l < LANES; ++l) s += x[l];
    return s;
}

typedef struct {
    long lo, hi;  /* the keys a query sees, lo > hi when none */
} Range;

static inline Range keys_of(long i, long klen, long offset, long left, long right) {
    Range r;
    r.lo = left < 0 ? 0 : offset + i - left;
    if (r.lo < 0) r.lo = 0;
    r.hi = right < 0 ? klen - 1 : offset + i + right;
    if (r.hi > klen - 1) r.hi = klen - 1;
    return r;
}

/* Element `index` of a row of `dtype` (0 float32, 1 bfloat16) as float32. */
static inline float element(const void *base, long index, int dtype) {
    return dtype ? from_bf16(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

/* A row of `d` elements of `dtype` as float32 into dst (zeros for a NULL row). */
static void widen(const void *row, int dtype, long d, float *dst) {
    if (!row)
        memset(dst, 0, d * sizeof(float));
    else if (dtype)
        for (long c = 0; c < d; ++c) dst[c] = from_bf16(((const uint16_t *)row)[c]);
    else
        memcpy(dst, row, d * sizeof(float));
}

/* Keys [k0, k0 + blocks * LANES) of one head transposed into blocks of [d][LANES] (keys past
   `kend` are zeros); values of the same keys widened into rows of `d` floats. */
static void pack_head(const char *k, const char *v, long kstride, long vstride, int dtype,
                      long d, long k0, long kend, long blocks, float *kt, float *vp) {
    long esize = dtype ? 2 : 4;
    for (long b = 0; b < blocks; ++b) {
        float *block = kt + b * d * LANES;
        for (long l = 0; l < LANES; ++l) {
            long j = k0 + b * LANES + l;
            const char *row = k + j * kstride * esize;
            for (long c = 0; c < d; ++c)
                block[c * LANES + l] = j < kend ? element(row, c, dtype) : 0.0f;
        }
    }
    for (long j = k0; j < kend; ++j) widen(v + j * vstride * esize, dtype, d, vp + (j - k0) * d);
}

/* The two products of a head, for float32 (one multiply-add a lane: T float, V vf) and for
   bfloat16 pairs where the CPU has the bfloat16 dot instruction (T a word of two bfloat16, V vi;
   DOT_BF16 below); MAC(acc, x, v) adds the T x times the vector v to acc.

   scores_SFX: `rows` queries (rows of n T: n = d, or d / 2 pairs) against key blocks [b0, b1)
   packed as [n][LANES] T into s (rows of `sstride` floats, block b at column (b - b0) * LANES),
   times `scale`.
   weigh_SFX: out rows = weights (rows of `wstride` T) x values (rows of d T), entries [p0, p1)
   of both (keys, or pairs of keys), dims [c0, c0 + width): width / LANES vectors of each of 4
   rows in registers (a constant where weigh_at_SFX is inlined; at most CHUNK). */
#define DEFINE_PRODUCTS(SFX, T, V, LOADT, MAC)                                                \
static void scores_##SFX(const T *q, long rows, long n, const T *kt, long b0, long b1,        \
                         float *s, long sstride, float scale) {                              \
    for (long b = b0; b < b1; b += 2) {                                                      \
        int two = b + 1 < b1;                                                                \
        const T *t0 = kt + b * n * LANES, *t1 = two ? t0 + n * LANES : t0;                   \
        vf acc[ROWS][2];                                                                     \
        for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = splat(0.0f);                  \
        for (long c = 0; c < n; ++c) {                                                       \
            V k0 = LOADT(t0 + c * LANES), k1 = LOADT(t1 + c * LANES);                        \
            for (int r = 0; r < ROWS; ++r) {                                                 \
                T x = q[r * n + c];                                                          \
                acc[r][0] = MAC(acc[r][0], x, k0);                                           \
                acc[r][1] = MAC(acc[r][1], x, k1);                                           \
            }                                                                                \
        }                                                                                    \
        for (long r = 0; r < rows; ++r) {                                                    \
            store(s + r * sstride + (b - b0) * LANES, acc[r][0] * splat(scale));             \
            if (two) store(s + r * sstride + (b + 1 - b0) * LANES, acc[r][1] * splat(scale)); \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) void weigh_at_##SFX(                           \
        const T *w, long wstride, long p0, long p1, const T *vp, long d, long c0,            \
        const int nv, long rows, float *o) {                                                 \
    vf acc[4][CHUNK_VECS];                                                                   \
    for (long r0 = 0; r0 < rows; r0 += 4) {                                                  \
        long n = rows - r0 < 4 ? rows - r0 : 4;                                              \
        for (int r = 0; r < 4; ++r)                                                          \
            for (int c = 0; c < nv; ++c) acc[r][c] = splat(0.0f);                            \
        for (long p = p0; p < p1; ++p) {                                                     \
            const T *row = vp + p * d + c0;                                                  \
            V v[CHUNK_VECS];                                                                 \
            for (int c = 0; c < nv; ++c) v[c] = LOADT(row + c * LANES);                      \
            for (int r = 0; r < 4; ++r) {                                                    \
                T x = r < n ? w[(r0 + r) * wstride + p] : (T)0;                              \
                for (int c = 0; c < nv; ++c) acc[r][c] = MAC(acc[r][c], x, v[c]);            \
            }                                                                                \
        }                                                                                    \
        for (long r = 0; r < n; ++r)                                                         \
            for (int c = 0; c < nv; ++c) store(o + (r0 + r) * d + c0 + c * LANES, acc[r][c]); \
    }                                                                                        \
}                                                                                            \
                                                                                             \
static void weigh_##SFX(const T *w, long wstride, long p0, long p1, const T *vp, long d,    \
                        long c0, long width, long rows, float *o) {                          \
    switch (width / LANES) {                                                                 \
    case 1: weigh_at_##SFX(w, wstride, p0, p1, vp, d, c0, 1, rows, o); break;               \
    WIDER_CASES(weigh_at_##SFX)                                                              \
    default: weigh_at_##SFX(w, wstride, p0, p1, vp, d, c0, 2, rows, o); break;              \
    }                                                                                        \
}

#if CHUNK_VECS > 2
#define WIDER_CASES(F)                                                                       \
    case 3: F(w, wstride, p0, p1, vp, d, c0, 3, rows, o); break;                             \
    case 4: F(w, wstride, p0, p1, vp, d, c0, 4, rows, o); break;
#else
#define WIDER_CASES(F)
#endif

static inline vf fma_splat(vf acc, float x, vf v) { return acc + splat(x) * v; }

/* One row of scores over key blocks [b0, b1) (keys from b0 * LANES) to weights: e^(s - max)
   where lo <= key <= hi, 0 elsewhere; returns their sum. Only the blocks that hold lo or hi
   need a mask: every key of the blocks between them is seen. */
static float softmax_row(float *s, long b0, long b1, long lo, long hi) {
    const vi lane = lanes();
    long first = lo / LANES, last = hi / LANES;  /* b0 <= first <= last < b1 */
    for (long b = b0; b < first; ++b) store(s + (b - b0) * LANES, splat(0.0f));
    for (long b = last + 1; b < b1; ++b) store(s + (b - b0) * LANES, splat(0.0f));
    vf top = splat(-INFINITY);
    for (long b = first; b <= last; ++b) {
        vf x = load(s + (b - b0) * LANES);
        if (b == first || b == last) {
            vi key = lane + (int)(b * LANES);
            x = pick((key >= (int)lo) & (key <= (int)hi), x, splat(-INFINITY));
        }
        top = pick(x > top, x, top);
    }
    vf m = splat(lane_max(top)), sum = splat(0.0f);
    for (long b = first; b <= last; ++b) {
        vf w = exp_le0(load(s + (b - b0) * LANES) - m);
        if (b == first || b == last) {
            vi key = lane + (int)(b * LANES);
            w = pick((key >= (int)lo) & (key <= (int)hi), w, splat(0.0f));
        }
        store(s + (b - b0) * LANES, w);
        sum += w;
    }
    return lane_sum(sum);
}

DEFINE_PRODUCTS(f32, float, vf, load, fma_splat)

#if LANES == 16 && defined(__AVX512BF16__)
/* bfloat16 on a CPU with the bfloat16 dot instruction (vdpbf16ps: a lane adds two products of
   bfloat16 pairs to its float32 sum): q.k over pairs of dimensions, and the weights (rounded
   to bfloat16, as PyTorch's bfloat16 attention rounds them) times the values over pairs of
   keys, half the instructions of the float32 path. Pairs of keys start at even key numbers
   and a key a query does not see weighs +0, so a query's bytes still depend only on its own
   row and key range. Scores, softmax and sums stay float32. */
#include <immintrin.h>
#define DOT_BF16 1

static inline vf dot2(vf acc, uint32_t a, vi b) {
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)b);
}

typedef int32_t viu __attribute__((vector_size(4 * LANES), aligned(4)));
static inline vi load_words(const uint32_t *p) { return *(const viu *)p; }

static inline uint32_t word_at(const uint16_t *p) {  /* two bfloat16, any alignment */
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* Keys [k0, k0 + blocks * LANES) as blocks of [d / 2][LANES] pairs of dimensions (zeros past
   kend); values of the same keys as [keys / 2][d] pairs of keys (zeros past kend). */
static void pack_head_bf16(const uint16_t *k, const uint16_t *v, long kstride, long vstride,
                           long d, long k0, long kend, long blocks, uint32_t *kt,
                           uint32_t *vp) {
    long half = d / 2;
    for (long b = 0; b < blocks; ++b) {
        uint32_t *block = kt + b * half * LANES;
        for (long l = 0; l < LANES; ++l) {
            long j = k0 + b * LANES + l;
            for (long c = 0; c < half; ++c)
                block[c * LANES + l] = j < kend ? word_at(k + j * kstride + 2 * c) : 0;
        }
    }
    const vh none = {0};
    for (long p = 0; p < blocks * LANES / 2; ++p) {
        long j = k0 + 2 * p;
        const uint16_t *a = j < kend ? v + j * vstride : NULL;
        const uint16_t *b = j + 1 < kend ? v + (j + 1) * vstride : NULL;
        for (long c = 0; c < d; c += LANES) {
            vu lo = __builtin_convertvector(a ? *(const vhu *)(a + c) : none, vu);
            vu hi = __builtin_convertvector(b ? *(const vhu *)(b + c) : none, vu);
            *(vu *)(vp + p * d + c) = lo | hi << 16;
        }
    }
}

/* A row of weights over `blocks` key blocks to bfloat16, two keys a word (rounded to nearest
   even). */
static void round_row(const float *s, long blocks, uint32_t *w) {
    for (long b = 0; b < blocks; b += 2) {
        __m512 lo = (__m512)load(s + b * LANES);
        __m512 hi = b + 1 < blocks ? (__m512)load(s + (b + 1) * LANES) : _mm512_setzero_ps();
        __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
        memcpy(w + b * LANES / 2, &both, b + 1 < blocks ? LANES * 4 : LANES * 2);
    }
}

DEFINE_PRODUCTS(bf16, uint32_t, vi, load_words, dot2)
#else
#define DOT_BF16 0
#endif

/* Output rows (of `ostride` bytes) = the weighted sums of, divided by their weights' sums (zeros
   where a row saw no key). */
static void finish(const float *of, const float *sums, long rows, int any, long d, int dtype,
                   char *out, long ostride) {
    for (long r = 0; r < rows; ++r) {
        char *orow = out + r * ostride;
        int none = !any || !(sums[r] > 0.0f);  /* no key seen: zeros */
        vf sum = splat(none ? 1.0f : sums[r]);
        for (long c = 0; c < d; c += LANES) {
            vf y = none ? splat(0.0f) : load(of + r * d + c) / sum;
            if (dtype)
                store_bf16((uint16_t *)orow + c, y);
            else
                store((float *)orow + c, y);
        }
    }
}

#if DOT_BF16
/* One (batch, head) of bfloat16 attention through the dot instruction; scratch as attend's. */
static void head_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, char *out,
                      long lq, long kl, long d, const long *qs, const long *ks, const long *vs,
                      const long *os, long offset, long left, long right, float scale,
                      long padded, float *scratch) {
    long half = d / 2;
    uint32_t *kt = (uint32_t *)scratch, *vp = kt + padded * half;
    uint32_t *w = vp + padded * half;  /* ROWS rows of padded / 2 words */
    float *s = (float *)(w + ROWS * padded / 2);
    uint32_t *qw = (uint32_t *)(s + ROWS * padded);
    float *of = (float *)(qw + ROWS * half);
    Range first = keys_of(0, kl, offset, left, right);
    Range last = keys_of(lq - 1, kl, offset, left, right);
    long kb0 = first.lo / LANES, kend = last.hi + 1;
    if (kend > kb0 * LANES)
        pack_head_bf16(k, v, ks[1], vs[1], d, kb0 * LANES, kend,
                       (kend - kb0 * LANES + LANES - 1) / LANES, kt, vp);
    for (long i0 = 0; i0 < lq; i0 += ROWS) {
        long rows = lq - i0 < ROWS ? lq - i0 : ROWS;
        Range top = keys_of(i0, kl, offset, left, right);
        Range bottom = keys_of(i0 + rows - 1, kl, offset, left, right);
        for (long r = 0; r < ROWS; ++r) {
            if (r < rows)
                memcpy(qw + r * half, q + (i0 + r) * qs[1], d * 2);
            else
                memset(qw + r * half, 0, d * 2);
        }
        float sums[ROWS];
        long j0 = top.lo, j1 = bottom.hi + 1;
        if (j1 > j0) {
            long b0 = j0 / LANES, b1 = (j1 + LANES - 1) / LANES, base = b0 * LANES;
            scores_bf16(qw, rows, half, kt + (b0 - kb0) * half * LANES, 0, b1 - b0, s, padded,
                        scale);
            for (long r = 0; r < rows; ++r) {
                Range own = keys_of(i0 + r, kl, offset, left, right);
                sums[r] = own.hi >= own.lo
                    ? softmax_row(s + r * padded, b0, b1, own.lo, own.hi) : 0.0f;
                round_row(s + r * padded, b1 - b0, w + r * padded / 2);
            }
            for (long c0 = 0; c0 < d; c0 += CHUNK)
                weigh_bf16(w, padded / 2, (j0 - base) / 2, (j1 - base + 1) / 2,
                           vp + (base - kb0 * LANES) / 2 * d, d, c0,
                           d - c0 < CHUNK ? d - c0 : CHUNK, rows, of);
        }
        finish(of, sums, rows, j1 > j0, d, 1, out + i0 * os[1] * 2, os[1] * 2);
    }
}
#endif

long scratch_floats(long lk, long d) {
    long padded = (lk + 2 * LANES) / LANES * LANES;
    return padded * d * 2 + ROWS * padded + 2 * ROWS * d;
}

/* q, k, v, out: element strides {batch, position, head} (the last dimension is contiguous);
   klen: valid keys of each batch row (NULL: all lk). d must be a multiple of LANES. */
int attend(const void *q, const void *k, const void *v, void *out, int dtype, long batch,
           long heads, long lq, long lk, long d, const long *qs, const long *ks, const long *vs,
           const long *os, const long *klen, long offset, long left, long right, float scale,
           int threads) {
    if (d % LANES || d <= 0) return -1;
    long esize = dtype ? 2 : 4, tasks = batch * heads, need = scratch_floats(lk, d);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, ((need * sizeof(float)) + 63) / 64 * 64);
        if (!scratch) failed = 1;
        long padded = (lk + 2 * LANES) / LANES * LANES;
#pragma omp for schedule(static)
        for (long task = 0; task < tasks; ++task) {
            if (!scratch) continue;
            long b = task / heads, h = task % heads, kl = klen ? klen[b] : lk;
            if (kl > lk) kl = lk;
            float *kt = scratch, *vp = kt + padded * d, *s = vp + padded * d;
            float *qf = s + ROWS * padded, *of = qf + ROWS * d;
            const char *qb = (const char *)q + (b * qs[0] + h * qs[2]) * esize;
            const char *kb = (const char *)k + (b * ks[0] + h * ks[2]) * esize;
            const char *vb = (const char *)v + (b * vs[0] + h * vs[2]) * esize;
            char *ob = (char *)out + (b * os[0] + h * os[2]) * esize;
#if DOT_BF16
            if (dtype) {
                head_bf16((const uint16_t *)qb, (const uint16_t *)kb, (const uint16_t *)vb, ob,
                          lq, kl, d, qs, ks, vs, os, offset, left, right, scale, padded,
                          scratch);
                continue;
            }
#endif
            /* Keys any query of this head sees: lo and hi grow with the query. */
            Range first = keys_of(0, kl, offset, left, right);
            Range last = keys_of(lq - 1, kl, offset, left, right);
            long kb0 = first.lo / LANES, kend = last.hi + 1;
            if (kend > kb0 * LANES)
                pack_head(kb, vb, ks[1], vs[1], dtype, d, kb0 * LANES, kend,
                          (kend - kb0 * LANES + LANES - 1) / LANES, kt, vp);
            for (long i0 = 0; i0 < lq; i0 += ROWS) {
                long rows = lq - i0 < ROWS ? lq - i0 : ROWS;
                Range top = keys_of(i0, kl, offset, left, right);
                Range bottom = keys_of(i0 + rows - 1, kl, offset, left, right);
                for (long r = 0; r < ROWS; ++r)
                    widen(r < rows ? qb + (i0 + r) * qs[1] * esize : NULL, dtype, d,
                          qf + r * d);
                float sums[ROWS];
                long j0 = top.lo, j1 = bottom.hi + 1;
                if (j1 > j0) {
                    long b0 = j0 / LANES, b1 = (j1 + LANES - 1) / LANES;
                    scores_f32(qf, rows, d, kt + (b0 - kb0) * d * LANES, 0, b1 - b0, s,
                               padded, scale);
                    for (long r = 0; r < rows; ++r) {
                        Range own = keys_of(i0 + r, kl, offset, left, right);
                        sums[r] = own.hi >= own.lo
                            ? softmax_row(s + r * padded, b0, b1, own.lo, own.hi) : 0.0f;
                    }
                    for (long c0 = 0; c0 < d; c0 += CHUNK)
                        weigh_f32(s, padded, j0 - b0 * LANES, j1 - b0 * LANES,
                                  vp + (b0 * LANES - kb0 * LANES) * d, d, c0,
                                  d - c0 < CHUNK ? d - c0 : CHUNK, rows, of);
                }
                finish(of, sums, rows, j1 > j0, d, dtype, ob + i0 * os[1] * esize,
                       os[1] * esize);
            }
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
