/* One decode position through a Qwen2 stack (the patch decoder), every layer in one call.
 * Rounds where the PyTorch modules produce a tensor of the model dtype, so bfloat16 tracks
 * the eager path; float32 is plain float math. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define LDBH(p) ((__m512bh)_mm512_loadu_si512(p))
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

typedef uint16_t bf16;

#define MAX_HEAD_DIM 256  /* per-head scratch of attend_*; Python asks max_head_dim() */

static inline float bf2f(bf16 v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

static inline bf16 f2bf(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (bf16)(c.u >> 16);
}

typedef struct {
    const void *in_norm, *qkv_w, *qkv_b, *o_w, *post_norm, *gate_up_w, *down_w;
    const float *qkv_s, *o_s, *gate_up_s, *down_s;  /* int8 weights' row scales, else NULL */
} Layer;

typedef struct {
    int layers, dim, heads, head_dim, ffn, rows, slot, threads;
    int packed;                           /* the layers' four matrices are packed (below) */
    float eps;
    const Layer *layer;
    const void *final_norm, *cos, *sin;   /* cos/sin: the rows of this position [head_dim] */
    void *k, *v;                          /* caches [layers, B, heads, S, head_dim] */
    long cache_rows, cache_len;           /* B and S of the caches */
    const void *x;                        /* input [rows, dim] */
    void *out;                            /* normed hidden [rows, dim] */
    float *work;
} Step;

/* The calling thread's share [r0, r1) of `rows`, cut at multiples of 16. */
static void share(long rows, long *r0, long *r1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    long blocks = (rows + 15) / 16;
    long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    *r0 = b0 * 16 < rows ? b0 * 16 : rows;
    *r1 = b1 * 16 < rows ? b1 * 16 : rows;
}

/* ---- bfloat16 rounding on 16 lanes, exactly f2bf's ----------------------------------
 * The conversion instruction flushes denormal inputs and outputs to zero, which f2bf (and
 * PyTorch) do not: a value below 2^-126 would round one way in a vector and another in a
 * tail or on a CPU without the instruction. These do f2bf's integer arithmetic instead. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 bf16x16(const bf16 *p) {  /* 16 bfloat16 -> 16 floats, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f2bf of each lane, widened back: its bits in the high half of the lane, zeros below. */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
        _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  /* quieted, as f2bf */
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* f2bf of 16 floats stored as 16 bfloat16. */
static inline void store_bf16x16(bf16 *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(
        _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
}
#endif

/* ---- matrix-vector products: y[j * ldy + r] = round(W[r] . x[j] + b[r]), j < n -------- */
static inline float bias_at(const bf16 *b, long r) { return b ? bf2f(b[r]) : 0.f; }

/* Row r against vectors j < n from column `from` on, scalar (tails, CPUs without BF16). */
static void row_bf16(const bf16 *w, const bf16 *b, long in, long r, long from, const bf16 *x,
                     int n, float *y, long ldy, const float *partial) {
    const bf16 *row = w + r * in;
    for (int j = 0; j < n; j++) {
        float s = partial ? partial[j] : 0.f;
        for (long i = from; i < in; i++) s += bf2f(row[i]) * bf2f(x[(long)j * in + i]);
        y[(long)j * ldy + r] = bf2f(f2bf(s + bias_at(b, r)));
    }
}

#if defined(__AVX512BF16__)
/* Rows r..r+3 against vectors j0..j0+m-1 (m constant after inlining): each weight cache line
 * is loaded once for all m vectors; the next four rows are prefetched meanwhile. */
static inline __attribute__((always_inline)) void block_bf16(
        const bf16 *w, const bf16 *b, long in, long r, const bf16 *x, int j0, const int m,
        float *y, long ldy, int prefetch) {
    const bf16 *w0 = w + r * in;
    long vin = in & ~31L;
    __m512 acc[4][4];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) acc[k][j] = _mm512_setzero_ps();
    for (long i = 0; i < vin; i += 32) {
        if (prefetch)
            for (int k = 4; k < 8; k++) _mm_prefetch((const char *)(w0 + k * in + i), _MM_HINT_T0);
        __m512bh wv[4];
        for (int k = 0; k < 4; k++) wv[k] = LDBH(w0 + k * in + i);
        for (int j = 0; j < m; j++) {
            __m512bh xv = LDBH(x + (long)(j0 + j) * in + i);
            for (int k = 0; k < 4; k++) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], wv[k], xv);
        }
    }
    for (int k = 0; k < 4; k++) {
        float part[4];
        for (int j = 0; j < m; j++) part[j] = _mm512_reduce_add_ps(acc[k][j]);
        row_bf16(w, b, in, r + k, vin, x + (long)j0 * in, m, y + (long)j0 * ldy, ldy, part);
    }
}
#endif

static void rows_bf16(const bf16 *w, const bf16 *b, long in, long r0, long r1, const bf16 *x,
                      int n, float *y, long ldy) {
    long r = r0;
#if defined(__AVX512BF16__)
    for (; r + 4 <= r1; r += 4) {
        int prefetch = r + 8 <= r1;
        for (int j0 = 0; j0 < n; j0 += 4) {
            switch (n - j0 < 4 ? n - j0 : 4) {
            case 1: block_bf16(w, b, in, r, x, j0, 1, y, ldy, prefetch && !j0); break;
            case 2: block_bf16(w, b, in, r, x, j0, 2, y, ldy, prefetch && !j0); break;
            case 3: block_bf16(w, b, in, r, x, j0, 3, y, ldy, prefetch && !j0); break;
            default: block_bf16(w, b, in, r, x, j0, 4, y, ldy, prefetch && !j0); break;
            }
        }
    }
#endif
    for (; r < r1; r++) row_bf16(w, b, in, r, 0, x, n, y, ldy, NULL);
}

#if HAVE_AMX
/* AMX tiles for 1-16 vectors: C (tile 0) [16 rows, n] fp32 += A (tile 1) [16 rows, 32]
 * weights . B (tile 2) [16 pairs, n] vectors in pair-interleaved (VNNI) layout. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_state = -1;  /* -1 unknown, 0 unavailable, 1 granted to this process */
static int amx_from = 1;  /* fewest rows that use the tiles (17: never; set by Python) */
static inline int use_amx(int n) { return amx_state == 1 && n >= amx_from && n <= 16; }
/* Packed weights take any number of vectors on the tiles (16 at a time). */
static inline int use_amx_pk(int n) { return amx_state == 1 && n >= amx_from; }

int amx_enable(void) {
    if (amx_state < 0)  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (Linux >= 5.16) */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

static void amx_configure(int n) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = (uint16_t)(4 * n);
    c.rows[1] = 16, c.colsb[1] = 64;
    c.rows[2] = 16, c.colsb[2] = (uint16_t)(4 * n);
    _tile_loadconfig(&c);
}

/* xp[(i / 2) * 2n + 2j + i % 2] = x[j * in + i]: the B operand of every column block, one
 * 32-bit pair a (p, j). Shared by the team (an orphaned `omp for`: ends in a barrier). */
static void amx_pack(const bf16 *x, int n, long in, bf16 *xp) {
    const uint32_t *pairs = (const uint32_t *)x;
    uint32_t *out = (uint32_t *)xp;
    long half = in / 2;
    #pragma omp for schedule(static)
    for (long p = 0; p < half; p++)
        for (int j = 0; j < n; j++) out[p * n + j] = pairs[(long)j * half + p];
}

static void amx_rows(const bf16 *w, const bf16 *b, long in, long r0, long r1, const bf16 *xp,
                     int n, float *y, long ldy) {
    float tile[16 * 16];
    const __m512i column = _mm512_mullo_epi32(  /* k * n: row k of a tile column */
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(n));
    for (long r = r0; r < r1; r += 16) {
        const bf16 *w0 = w + r * in;
        /* The next block's 16 rows are contiguous: each k step brings 16 of its lines into
         * L2 as it consumes 16 lines of this one (the tile loads alone stall on memory). */
        const char *next = (const char *)(w0 + 16 * in);
        _tile_zero(0);
        for (long i = 0, line = 0; i < in; i += 32, line += 16) {
            if (r + 16 < r1)
                for (int k = 0; k < 16; k++) _mm_prefetch(next + (line + k) * 64, _MM_HINT_T1);
            _tile_loadd(1, w0 + i, in * 2);
            _tile_loadd(2, xp + i * n, 4 * n);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, 4 * n);
        /* Column j of the tile is rows r..r+15 of vector j: gathered, biased, rounded. */
        __m512 bias = b ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(b + r)))
                        : _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(j));
            __m512 v = _mm512_add_ps(_mm512_i32gather_ps(at, tile, 4), bias);
            _mm512_storeu_ps(y + (long)j * ldy + r, round_bf16(v));
        }
    }
}
static void amx_release(void) { _tile_release(); }
#else
static int amx_state = 0;
static int amx_from = 17;
static inline int use_amx(int n) { (void)n; return 0; }
static inline int use_amx_pk(int n) { (void)n; return 0; }
int amx_enable(void) { return 0; }
static void amx_configure(int n) { (void)n; }
static void amx_release(void) {}
#endif

/* ---- packed bfloat16 weights: 16-row blocks, column pairs interleaved -------------------
 * A packed matrix W [out, in] (out % 16 == 0, in even) is out / 16 blocks one after another;
 * block b holds, for each column pair p < in / 2, the pairs (W[16b + l, 2p], W[16b + l, 2p + 1])
 * of its 16 rows l: 64 bytes, one cache line. A thread whose share is blocks [b0, b1) reads
 * one linear region, and one 512-bit load is a column pair of 16 rows: a dot-product
 * instruction against the broadcast pair of one vector adds into the 16 row sums at once (no
 * horizontal sum). A tile of R blocks by m vectors (m * R accumulators in registers) reads
 * each weight line once for all m vectors. Every output sums its pairs in the order
 * p = 0, 1, ... in one lane, whatever the vector count, tile or thread count: a row's result
 * is the same alone, in a batch of any width and on any number of threads. */
enum { ISA_SCALAR, ISA_AVX2, ISA_AVX512_BF16 };
static int isa_cap = ISA_AVX512_BF16;   /* the widest path packed products may use (tests) */
#define PK_CHUNK 128                    /* pairs per pass when vectors take several passes */
/* the AVX2 tile's (4 vectors a pass, so 8 rows take two): 512 pairs (32 KiB a block, re-read
 * from L2) gave 8 rows 15-20% and 58 rows 3-5% over 128 (AMD EPYC, its AVX2 build) */
#define PK_CHUNK_AVX2 512

typedef void (*TileFn)(const uint32_t *w, long P, const uint32_t *x, long xs, int m, int R,
                       long p0, long p1, float *y, long ldy, int first);

/* Blocks [b0, b1) of a packed W (P column pairs) against n vectors x (xs pairs apart) into
 * y [n, ldy] (float sums, no bias): tiles of R blocks by up to `mmax` vectors; with more
 * vectors than that the pairs go in chunks (partial sums kept in y), each chunk's weight
 * lines read from cache by every group of vectors. */
static void pk_blocks(TileFn tile, int mmax, int R, long pairs, const uint32_t *w, long P,
                      long b0, long b1, const uint32_t *x, long xs, int n, float *y, long ldy) {
    long chunk = n <= mmax ? P : pairs;
    for (long b = b0; b < b1; b += R) {
        int r = b1 - b < R ? (int)(b1 - b) : R;
        for (long p0 = 0; p0 < P; p0 += chunk) {
            long p1 = p0 + chunk < P ? p0 + chunk : P;
            for (int j0 = 0; j0 < n; j0 += mmax) {
                int m = n - j0 < mmax ? n - j0 : mmax;
                tile(w + b * P * 16, P, x + (long)j0 * xs, xs, m, r, p0, p1,
                     y + (long)j0 * ldy + b * 16, ldy, p0 == 0);
            }
        }
    }
}

/* Any CPU: one block at a time, 16 lanes of float sums. */
static void pk_tile_c(const uint32_t *w, long P, const uint32_t *x, long xs, int m, int R,
                      long p0, long p1, float *y, long ldy, int first) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < m; j++) {
            float acc[16];
            float *yj = y + (long)j * ldy + 16 * r;
            for (int l = 0; l < 16; l++) acc[l] = first ? 0.f : yj[l];
            for (long p = p0; p < p1; p++) {
                const bf16 *wp = (const bf16 *)(w + ((long)r * P + p) * 16);
                uint32_t pair = x[(long)j * xs + p];
                float lo = bf2f((bf16)(pair & 0xffff)), hi = bf2f((bf16)(pair >> 16));
                for (int l = 0; l < 16; l++) {
                    acc[l] += bf2f(wp[2 * l]) * lo;
                    acc[l] += bf2f(wp[2 * l + 1]) * hi;
                }
            }
            for (int l = 0; l < 16; l++) yj[l] = acc[l];
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2: bfloat16 widened to float in registers (a pair's low half shifted up, its high half
 * masked), two FMAs per pair and 8 rows; R blocks by m <= 4 vectors, m * 2R accumulators.
 * A vector's pair is broadcast and split the same way, in vector registers. The sums are
 * named variables (as in the int8 tile below: with arrays GCC 12 copied them between
 * registers every iteration); m and R are constants in each copy, so unused names fold away.
 * Each sum adds the low half's product, then the high half's, pair by pair, as pk_tile_c. */
#define PK2_INIT(J, RR, H) __m256 s##J##RR##H = _mm256_setzero_ps();                          \
    if ((J) < m && (RR) < R && !first)                                                       \
        s##J##RR##H = _mm256_loadu_ps(y + (long)(J) * ldy + 16 * (RR) + 8 * (H));
#define PK2_INIT_ROW(J) PK2_INIT(J, 0, 0) PK2_INIT(J, 0, 1) PK2_INIT(J, 1, 0) PK2_INIT(J, 1, 1)
#define PK2_W(RR, H) __m256 lo##RR##H = _mm256_setzero_ps(), hi##RR##H = lo##RR##H;            \
    if ((RR) < R) {                                                                          \
        __m256i v = _mm256_loadu_si256(                                                      \
            (const __m256i *)(w + ((long)(RR) * P + p) * 16 + 8 * (H)));                     \
        lo##RR##H = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                           \
        hi##RR##H = _mm256_castsi256_ps(_mm256_and_si256(v, high));                          \
    }
#define PK2_FMA(J, RR, H) if ((J) < m && (RR) < R) {                                         \
        s##J##RR##H = _mm256_fmadd_ps(lo##RR##H, xl##J, s##J##RR##H);                        \
        s##J##RR##H = _mm256_fmadd_ps(hi##RR##H, xh##J, s##J##RR##H); }
#define PK2_ROW(J) if ((J) < m) {                                                            \
        __m256i xp##J = _mm256_set1_epi32((int)x[(long)(J) * xs + p]);                       \
        __m256 xl##J = _mm256_castsi256_ps(_mm256_slli_epi32(xp##J, 16));                    \
        __m256 xh##J = _mm256_castsi256_ps(_mm256_and_si256(xp##J, high));                   \
        PK2_FMA(J, 0, 0) PK2_FMA(J, 0, 1) PK2_FMA(J, 1, 0) PK2_FMA(J, 1, 1) }
#define PK2_STORE(J, RR, H) if ((J) < m && (RR) < R)                                         \
        _mm256_storeu_ps(y + (long)(J) * ldy + 16 * (RR) + 8 * (H), s##J##RR##H);
#define PK2_STORE_ROW(J) PK2_STORE(J, 0, 0) PK2_STORE(J, 0, 1) PK2_STORE(J, 1, 0)            \
    PK2_STORE(J, 1, 1)
#define PK2_ROWS(X) X(0) X(1) X(2) X(3)
static inline __attribute__((always_inline)) void pk_tile256_at(
        const uint32_t *w, long P, const uint32_t *x, long xs, const int m, const int R,
        long p0, long p1, float *y, long ldy, int first) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    PK2_ROWS(PK2_INIT_ROW)
    for (long p = p0; p < p1; p++) {
        PK2_W(0, 0) PK2_W(0, 1) PK2_W(1, 0) PK2_W(1, 1)
        PK2_ROWS(PK2_ROW)
    }
    PK2_ROWS(PK2_STORE_ROW)
}
#undef PK2_INIT
#undef PK2_INIT_ROW
#undef PK2_W
#undef PK2_FMA
#undef PK2_ROW
#undef PK2_STORE
#undef PK2_STORE_ROW
#undef PK2_ROWS

/* One function per tile shape, as for the int8 tiles. */
#define PK256_FN(M, RR)                                                                      \
static __attribute__((noinline)) void pk256_##M##_##RR(                                     \
        const uint32_t *w, long P, const uint32_t *x, long xs, long p0, long p1, float *y,   \
        long ldy, int first) {                                                               \
    pk_tile256_at(w, P, x, xs, M, RR, p0, p1, y, ldy, first);                               \
}
#define PK256_SHAPES(X) X(1, 1) X(1, 2) X(2, 1) X(3, 1) X(4, 1)
PK256_SHAPES(PK256_FN)
#undef PK256_FN

static void pk_tile256(const uint32_t *w, long P, const uint32_t *x, long xs, int m, int R,
                       long p0, long p1, float *y, long ldy, int first) {
#define PK256_CASE(M, RR) case (M) * 8 + (RR): \
    pk256_##M##_##RR(w, P, x, xs, p0, p1, y, ldy, first); break;
    switch (m * 8 + R) {
    PK256_SHAPES(PK256_CASE)
    default: pk_tile_c(w, P, x, xs, m, R, p0, p1, y, ldy, first);
    }
#undef PK256_CASE
}
#undef PK256_SHAPES
#endif

#if defined(__AVX512BF16__)
/* AVX512-BF16: R blocks by m <= 8 vectors, m * R zmm accumulators (8 x 3 = 24 at most). */
static inline __attribute__((always_inline)) void pk_tile512_at(
        const uint32_t *w, long P, const uint32_t *x, long xs, const int m, const int R,
        long p0, long p1, float *y, long ldy, int first) {
    __m512 acc[8][4];
    for (int j = 0; j < m; j++)
        for (int r = 0; r < R; r++)
            acc[j][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (long)j * ldy + 16 * r);
    for (long p = p0; p < p1; p++) {
        __m512bh wv[4];
        for (int r = 0; r < R; r++) wv[r] = LDBH(w + ((long)r * P + p) * 16);
        for (int j = 0; j < m; j++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[(long)j * xs + p]);
            for (int r = 0; r < R; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv[r], xb);
        }
    }
    for (int j = 0; j < m; j++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (long)j * ldy + 16 * r, acc[j][r]);
}

static void pk_tile512(const uint32_t *w, long P, const uint32_t *x, long xs, int m, int R,
                       long p0, long p1, float *y, long ldy, int first) {
#define PK512(M, RR) case (M) * 8 + (RR): \
    pk_tile512_at(w, P, x, xs, M, RR, p0, p1, y, ldy, first); break;
#define PK512_R(M) PK512(M, 1) PK512(M, 2) PK512(M, 3) PK512(M, 4)
    switch (m * 8 + R) {
    PK512_R(1) PK512_R(2) PK512_R(3) PK512_R(4) PK512_R(5) PK512_R(6)
    PK512(7, 1) PK512(7, 2) PK512(7, 3) PK512(8, 1) PK512(8, 2) PK512(8, 3)
    default: pk_tile_c(w, P, x, xs, m, R, p0, p1, y, ldy, first);
    }
#undef PK512_R
#undef PK512
}
#endif

#if HAVE_AMX
/* AMX on packed weights: C (tile 0) [m vectors, 16 rows] += A (tile 1) [m vectors, 32
 * columns] of x as it lies . B (tile 2) [16 pairs, 16 rows]: 1 KiB of a block, contiguous.
 * Tiles hold min(n, 16) vectors (`amx_configure_pk`); a last group of fewer vectors reads a
 * zero-padded copy (`xpad`, 16 rows) and keeps its rows of the result. */
static void amx_configure_pk(int n) {
    TileConfig c;
    int m = n < 16 ? n : 16;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)m, c.colsb[0] = 64;
    c.rows[1] = (uint8_t)m, c.colsb[1] = 64;
    c.rows[2] = 16, c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

static void pk_amx(const uint32_t *w, long P, long b0, long b1, const bf16 *x, long in, int n,
                   const bf16 *xpad, float *y, long ldy) {
    float tile[16 * 16];
    int rows = n < 16 ? n : 16;
    for (long b = b0; b < b1; b++) {
        const uint32_t *wb = w + b * P * 16;
        for (int j0 = 0; j0 < n; j0 += 16) {
            int m = n - j0 < 16 ? n - j0 : 16;
            const bf16 *a = m == rows ? x + (long)j0 * in : xpad;
            _tile_zero(0);
            for (long p = 0; p < P; p += 16) {
                if (p + 128 < P)  /* 8 KiB ahead into L2: the tile loads alone stall */
                    for (int k = 0; k < 16; k++)
                        _mm_prefetch((const char *)(wb + (p + 128 + k) * 16), _MM_HINT_T1);
                _tile_loadd(1, a + 2 * p, in * 2);
                _tile_loadd(2, wb + p * 16, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            if (m == rows) {
                _tile_stored(0, y + (long)j0 * ldy + b * 16, ldy * 4);
            } else {
                _tile_stored(0, tile, 64);
                for (int j = 0; j < m; j++)
                    memcpy(y + (long)(j0 + j) * ldy + b * 16, tile + 16 * j, 64);
            }
        }
    }
}
#else
static void amx_configure_pk(int n) { (void)n; }
#endif

/* y[j * ldy + r] = W[r] . x[j] + b[r] for this thread's share of a packed W's rows, rounded
 * to bfloat16 when `round`; called by every thread of the team. `xpad`: scratch of 16 * in
 * bfloat16 (AMX with more than 16 vectors). The threads share no output: no barrier. */
static void pk_gemv(int n, const void *w, const bf16 *b, long in, long out, const bf16 *x,
                    float *y, long ldy, bf16 *xpad, int round) {
    long r0, r1, P = in / 2;
    share(out, &r0, &r1);
#if HAVE_AMX
    int amx = use_amx_pk(n) && in % 32 == 0;
    if (amx && n > 16 && n % 16) {
        #pragma omp single
        {
            memset(xpad, 0, (size_t)16 * in * sizeof(bf16));
            memcpy(xpad, x + (long)(n - n % 16) * in, (size_t)(n % 16) * in * sizeof(bf16));
        }
    }
#else
    (void)xpad;
#endif
    if (r1 <= r0) return;
    const uint32_t *wp = (const uint32_t *)w, *xp = (const uint32_t *)x;
#if HAVE_AMX
    if (amx)
        pk_amx(wp, P, r0 / 16, r1 / 16, x, in, n, xpad, y, ldy);
    else
#endif
#if defined(__AVX512BF16__)
    if (isa_cap >= ISA_AVX512_BF16)
        pk_blocks(pk_tile512, 8, n >= 7 ? 3 : 4, PK_CHUNK, wp, P, r0 / 16, r1 / 16, xp, P, n,
                  y, ldy);
    else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa_cap >= ISA_AVX2)
        pk_blocks(pk_tile256, 4, n == 1 ? 2 : 1, PK_CHUNK_AVX2, wp, P, r0 / 16, r1 / 16, xp, P,
                  n, y, ldy);
    else
#endif
        pk_blocks(pk_tile_c, 4, 1, PK_CHUNK, wp, P, r0 / 16, r1 / 16, xp, P, n, y, ldy);
    for (int j = 0; j < n; j++) {
        float *yj = y + (long)j * ldy;
        long r = r0;
#if defined(__AVX512BF16__)
        for (; r + 16 <= r1; r += 16) {
            __m512 v = _mm512_loadu_ps(yj + r);
            if (b) v = _mm512_add_ps(v, _mm512_cvtpbh_ps(
                (__m256bh)_mm256_loadu_si256((const __m256i *)(b + r))));
            _mm512_storeu_ps(yj + r, round ? round_bf16(v) : v);
        }
#endif
        for (; r < r1; r++) {
            float v = yj[r] + bias_at(b, r);
            yj[r] = round ? bf2f(f2bf(v)) : v;
        }
    }
}

/* ---- packed int8 weights by int8 activations (--lm-quant w8a8) ---------------------------
 * A packed int8 W [out, in] (out % 16 == 0, in % 4 == 0) is laid out as the bfloat16 one with
 * column quads for pairs: block b holds, for each quad q < in / 4, the 4 bytes
 * W[16b + l, 4q .. 4q + 3] of its 16 rows l: 64 bytes, one cache line (`pack_bf16` on 32-bit
 * units writes it). W[r] = s[r] * Wq[r] (symmetric, per row); beside the scales s [out] lie the
 * row sums z[r] = sum of Wq[r] (int32 [out]): the `rowdata` of such a weight is s then z.
 * Each vector x[j] is quantized when the product starts (`quant_rows`, once, on one thread):
 * a[j] = clamp(nearbyint(x / sa[j]) + za[j], 0, 255) as unsigned bytes, sa[j] its range / 255
 * and za[j] the byte that 0 maps to. Then
 *   y[j, r] = fma((float)(sum_k a[j, k] Wq[r, k] - za[j] z[r]), sa[j] * s[r], b[r]):
 * the sum is exact in int32 (|a| <= 255, |Wq| <= 127: in < 66 000 columns), so a row's result
 * does not depend on the tiles, the vector count, the threads or the instruction set. */
typedef struct { float scale; int32_t zero; } QuantRow;


/* x [n, in] bfloat16 -> a [n, in] bytes and one QuantRow per vector. The AVX-512 loops do
 * each element's arithmetic as the scalar ones do (min/max keep the running value for a NaN
 * or an equal zero, as the comparisons do; round to nearest even; the same clamp), so the
 * bytes are the same on every path. */
static void quant_rows(int n, long in, const bf16 *x, uint8_t *a, QuantRow *q) {
    for (int j = 0; j < n; j++) {
        const bf16 *xj = x + (long)j * in;
        uint8_t *aj = a + (long)j * in;
        float lo = 0.f, hi = 0.f;  /* the range always holds 0, so 0 has an exact byte */
        long k = 0;
#if defined(__AVX512F__)
        int wide = isa_cap >= ISA_AVX512_BF16;
        if (wide) {
            __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
            for (; k + 16 <= in; k += 16) {
                __m512 v = bf16x16(xj + k);
                vlo = _mm512_min_ps(v, vlo);  /* NaN or equal: the second, the running one */
                vhi = _mm512_max_ps(v, vhi);
            }
            lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
        }
#endif
        for (; k < in; k++) {
            float v = bf2f(xj[k]);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        float scale = (hi - lo) / 255.f;
        if (!(scale > 0.f)) scale = 1.f;  /* all zeros (or not finite: garbage either way) */
        float inv = 1.f / scale;
        int32_t zero = (int32_t)nearbyintf(-lo * inv);
        zero = zero < 0 ? 0 : zero > 255 ? 255 : zero;
        k = 0;
#if defined(__AVX512F__)
        if (wide) {
            const __m512 vinv = _mm512_set1_ps(inv), vzero = _mm512_set1_ps((float)zero);
            const __m512 top = _mm512_set1_ps(255.f), none = _mm512_setzero_ps();
            for (; k + 16 <= in; k += 16) {
                __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(bf16x16(xj + k), vinv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, vzero), none), top);
                _mm_storeu_si128((__m128i *)(aj + k),
                                 _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(v)));
            }
        }
#endif
        for (; k < in; k++) {
            float v = nearbyintf(bf2f(xj[k]) * inv) + (float)zero;
            aj[k] = (uint8_t)(v >= 0.f ? (v <= 255.f ? v : 255.f) : 0.f);
        }
        q[j].scale = scale, q[j].zero = zero;
    }
}

typedef void (*TileI8)(const uint32_t *w, long Q, const uint32_t *a, long as, int m, int R,
                       long q0, long q1, int32_t *acc, long lda, int first,
                       const uint32_t *ahead);

/* Any CPU: one block at a time. */
static void pq_tile_c(const uint32_t *w, long Q, const uint32_t *a, long as, int m, int R,
                      long q0, long q1, int32_t *acc, long lda, int first,
                      const uint32_t *ahead) {
    (void)ahead;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < m; j++) {
            int32_t s[16];
            int32_t *out = acc + (long)j * lda + 16 * r;
            for (int l = 0; l < 16; l++) s[l] = first ? 0 : out[l];
            for (long q = q0; q < q1; q++) {
                const int8_t *wq = (const int8_t *)(w + ((long)r * Q + q) * 16);
                const uint8_t *aq = (const uint8_t *)(a + (long)j * as + q);
                for (int l = 0; l < 16; l++)
                    for (int i = 0; i < 4; i++) s[l] += (int32_t)aq[i] * wq[4 * l + i];
            }
            for (int l = 0; l < 16; l++) out[l] = s[l];
        }
}

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 (no VNNI): 4 rows' quads widened to 16-bit, multiplied by the vector's quad and
 * summed in pairs (vpmaddwd): each 8-lane accumulator holds 4 rows' two half sums, added
 * together at the end. R = 1 block by m <= 2 vectors: 8 accumulators, named variables as in
 * the tiles above (with an array GCC 12 copied them between registers every iteration). */
#define PQ2_INIT(J, H) __m256i s##J##H = _mm256_setzero_si256();
#define PQ2_A(J) const __m256i a##J = (J) < m                                                \
    ? _mm256_cvtepu8_epi16(_mm_set1_epi32((int)a[(long)(J) * as + q])) : _mm256_setzero_si256();
#define PQ2_H(H) {  /* one row quarter at a time: 16 registers hold 8 sums, 2 vectors, 2 more */ \
        const __m256i wh = _mm256_cvtepi8_epi16(                                             \
            _mm_loadu_si128((const __m128i *)(w + q * 16 + 4 * (H))));                       \
        s0##H = _mm256_add_epi32(_mm256_madd_epi16(wh, a0), s0##H);                          \
        if (m > 1) s1##H = _mm256_add_epi32(_mm256_madd_epi16(wh, a1), s1##H); }
#define PQ2_HALF(J, H, X, Y) if ((J) < m) {  /* rows 8H .. 8H + 7: pairs of lanes added */    \
        int32_t *out = acc + (long)(J) * lda + 8 * (H);                                      \
        __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(X, Y), 0xd8);               \
        if (!first) sum = _mm256_add_epi32(sum, _mm256_loadu_si256((const __m256i *)out));   \
        _mm256_storeu_si256((__m256i *)out, sum); }
static inline __attribute__((always_inline)) void pq_tile256_at(
        const uint32_t *w, const uint32_t *a, long as, const int m, long q0, long q1,
        int32_t *acc, long lda, int first) {
    PQ2_INIT(0, 0) PQ2_INIT(0, 1) PQ2_INIT(0, 2) PQ2_INIT(0, 3)
    PQ2_INIT(1, 0) PQ2_INIT(1, 1) PQ2_INIT(1, 2) PQ2_INIT(1, 3)
    for (long q = q0; q < q1; q++) {
        PQ2_A(0) PQ2_A(1)
        PQ2_H(0) PQ2_H(1) PQ2_H(2) PQ2_H(3)
    }
    PQ2_HALF(0, 0, s00, s01) PQ2_HALF(0, 1, s02, s03)
    PQ2_HALF(1, 0, s10, s11) PQ2_HALF(1, 1, s12, s13)
}
#undef PQ2_INIT
#undef PQ2_A
#undef PQ2_H
#undef PQ2_HALF

static __attribute__((noinline)) void pq256_1(const uint32_t *w, const uint32_t *a, long as,
                                              long q0, long q1, int32_t *acc, long lda,
                                              int first) {
    pq_tile256_at(w, a, as, 1, q0, q1, acc, lda, first);
}

static __attribute__((noinline)) void pq256_2(const uint32_t *w, const uint32_t *a, long as,
                                              long q0, long q1, int32_t *acc, long lda,
                                              int first) {
    pq_tile256_at(w, a, as, 2, q0, q1, acc, lda, first);
}

static void pq_tile256(const uint32_t *w, long Q, const uint32_t *a, long as, int m, int R,
                       long q0, long q1, int32_t *acc, long lda, int first,
                       const uint32_t *ahead) {
    (void)ahead;
    for (int r = 0; r < R; r++) {
        const uint32_t *wr = w + (long)r * Q * 16;
        if (m == 2) pq256_2(wr, a, as, q0, q1, acc + 16 * r, lda, first);
        else if (m == 1) pq256_1(wr, a, as, q0, q1, acc + 16 * r, lda, first);
        else pq_tile_c(wr, Q, a, as, m, 1, q0, q1, acc + 16 * r, lda, first, NULL);
    }
}
#endif

#if defined(__AVX512VNNI__)
/* AVX512-VNNI: one vpdpbusd adds a vector's quad times a block's 16 row quads into 16 sums;
 * R blocks by m <= 8 vectors, m * R accumulators (8 x 3 = 24 at most). The sums are named
 * variables, not an array: with an array GCC 12 kept them in other registers (or on the
 * stack) and copied each back every iteration. m, R and `prefetch` are constants in each
 * copy, so the unused names and the branches fold away. */
#define PQ_INIT(J, RR) __m512i s##J##RR = _mm512_setzero_si512();                            \
    if ((J) < m && (RR) < R && !first)                                                       \
        s##J##RR = _mm512_loadu_si512(acc + (long)(J) * lda + 16 * (RR));
#define PQ_INIT_ROW(J) PQ_INIT(J, 0) PQ_INIT(J, 1) PQ_INIT(J, 2) PQ_INIT(J, 3)
#define PQ_W(RR) __m512i w##RR = _mm512_setzero_si512();                                     \
    if ((RR) < R) w##RR = _mm512_loadu_si512(w + ((long)(RR) * Q + q) * 16);
#define PQ_DOT(J, RR) if ((J) < m && (RR) < R)                                              \
        s##J##RR = _mm512_dpbusd_epi32(s##J##RR, a##J, w##RR);
#define PQ_ROW(J) if ((J) < m) {                                                             \
        __m512i a##J = _mm512_set1_epi32((int)a[(long)(J) * as + q]);                        \
        PQ_DOT(J, 0) PQ_DOT(J, 1) PQ_DOT(J, 2) PQ_DOT(J, 3) }
#define PQ_STORE(J, RR) if ((J) < m && (RR) < R)                                             \
        _mm512_storeu_si512(acc + (long)(J) * lda + 16 * (RR), s##J##RR);
#define PQ_STORE_ROW(J) PQ_STORE(J, 0) PQ_STORE(J, 1) PQ_STORE(J, 2) PQ_STORE(J, 3)
#define PQ_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
static inline __attribute__((always_inline)) void pq_tile512_at(
        const uint32_t *w, long Q, const uint32_t *a, long as, const int m, const int R,
        long q0, long q1, int32_t *acc, long lda, int first, const uint32_t *ahead,
        const int prefetch) {
    PQ_ROWS(PQ_INIT_ROW)
    for (long q = q0; q < q1; q++) {
        PQ_W(0) PQ_W(1) PQ_W(2) PQ_W(3)
        if (prefetch)
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(ahead + ((long)r * Q + q) * 16), _MM_HINT_T1);
        PQ_ROWS(PQ_ROW)
    }
    PQ_ROWS(PQ_STORE_ROW)
}
#undef PQ_INIT
#undef PQ_INIT_ROW
#undef PQ_W
#undef PQ_DOT
#undef PQ_ROW
#undef PQ_STORE
#undef PQ_STORE_ROW
#undef PQ_ROWS

/* One function per tile shape (all of them inlined into the switch made GCC 12 keep some
 * sums on the stack). */
#define PQ512_FN(M, RR)                                                                      \
static __attribute__((noinline)) void pq512_##M##_##RR(                                     \
        const uint32_t *w, long Q, const uint32_t *a, long as, long q0, long q1,             \
        int32_t *acc, long lda, int first, const uint32_t *ahead) {                          \
    if (ahead) pq_tile512_at(w, Q, a, as, M, RR, q0, q1, acc, lda, first, ahead, 1);        \
    else pq_tile512_at(w, Q, a, as, M, RR, q0, q1, acc, lda, first, NULL, 0);               \
}
#define PQ512_SHAPES(X)                                                                      \
    X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(2, 1) X(2, 2) X(2, 3) X(2, 4) X(3, 1) X(3, 2) X(3, 3)  \
    X(3, 4) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(5, 1) X(5, 2) X(5, 3) X(5, 4) X(6, 1) X(6, 2)  \
    X(6, 3) X(6, 4) X(7, 1) X(7, 2) X(7, 3) X(8, 1) X(8, 2) X(8, 3)
PQ512_SHAPES(PQ512_FN)
#undef PQ512_FN

static void pq_tile512(const uint32_t *w, long Q, const uint32_t *a, long as, int m, int R,
                       long q0, long q1, int32_t *acc, long lda, int first,
                       const uint32_t *ahead) {
#define PQ512_CASE(M, RR) case (M) * 8 + (RR): \
    pq512_##M##_##RR(w, Q, a, as, q0, q1, acc, lda, first, ahead); break;
    switch (m * 8 + R) {
    PQ512_SHAPES(PQ512_CASE)
    default: pq_tile_c(w, Q, a, as, m, R, q0, q1, acc, lda, first, NULL);
    }
#undef PQ512_CASE
}
#undef PQ512_SHAPES
#endif

/* Blocks [b0, b1) against n byte vectors a (as quads apart) into acc [n, lda] (int32 sums);
 * with more vectors than a tile holds, the quads go in chunks (sums kept in acc). */
static void pq_blocks(TileI8 tile, int mmax, int R, const uint32_t *w, long Q, long b0, long b1,
                      const uint32_t *a, long as, int n, int32_t *acc, long lda) {
    long chunk = n <= mmax ? Q : PK_CHUNK;
    for (long b = b0; b < b1; b += R) {
        int r = b1 - b < R ? (int)(b1 - b) : R;
        for (long q0 = 0; q0 < Q; q0 += chunk) {
            long q1 = q0 + chunk < Q ? q0 + chunk : Q;
            for (int j0 = 0; j0 < n; j0 += mmax) {
                int m = n - j0 < mmax ? n - j0 : mmax;
                /* short block streams (<= 32 KiB: the patch decoder's) start cold: the
                 * first vectors fetch the next tile's lines into L2 as they go (measured:
                 * +45% GB/s there; on the backbone's long streams it costs some 8%) */
                const uint32_t *ahead = j0 == 0 && Q <= 512 && b + 2 * R <= b1
                                        ? w + (b + R) * Q * 16 : NULL;
                tile(w + b * Q * 16, Q, a + (long)j0 * as, as, m, r, q0, q1,
                     acc + (long)j0 * lda + b * 16, lda, q0 == 0, ahead);
            }
        }
    }
}

/* y[j * ldy + r] = the w8a8 product (above) + b[r] for this thread's share of W's rows,
 * rounded to bfloat16 when `round`, from the quantized vectors `a`/`q` (`quant_rows`). y is
 * float; its memory holds the int32 sums first. No barrier. */
static void pq_gemv(int n, const void *w, const float *rowdata, const bf16 *b, long in, long out,
                    const uint8_t *a, const QuantRow *q, float *y, long ldy, int round) {
    long r0, r1, Q = in / 4;
    share(out, &r0, &r1);
    if (r1 <= r0) return;
    const uint32_t *wp = (const uint32_t *)w, *ap = (const uint32_t *)a;
    int32_t *acc = (int32_t *)y;
#if defined(__AVX512VNNI__)
    if (isa_cap >= ISA_AVX512_BF16)
        /* blocks per tile by vectors, measured (AMD EPYC, AVX512-VNNI, GCC 12): 3 blocks
         * (fewer broadcasts per vpdpbusd) where the weights are reused over more than 8
         * vectors (a prefill), 2 at 6-8 vectors, where they stream from memory once */
        pq_blocks(pq_tile512, 8, n <= 4 ? 4 : n == 5 || n > 8 ? 3 : 2, wp, Q, r0 / 16,
                  r1 / 16, ap, Q, n, acc, ldy);
    else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa_cap >= ISA_AVX2)
        pq_blocks(pq_tile256, 2, 1, wp, Q, r0 / 16, r1 / 16, ap, Q, n, acc, ldy);
    else
#endif
        pq_blocks(pq_tile_c, 4, 1, wp, Q, r0 / 16, r1 / 16, ap, Q, n, acc, ldy);
    const float *s = rowdata;
    const int32_t *z = (const int32_t *)(rowdata + out);
    for (int j = 0; j < n; j++) {
        int32_t *aj = acc + (long)j * ldy;
        float *yj = y + (long)j * ldy;
        for (long r = r0; r < r1; r++) {
            float v = fmaf((float)(aj[r] - q[j].zero * z[r]), q[j].scale * s[r], bias_at(b, r));
            yj[r] = round ? bf2f(f2bf(v)) : v;
        }
    }
}

/* Bytes of scratch the quantized vectors take: n * in bytes (aligned), then n QuantRows
 * (w8a8), or the group sums of 32 columns and n scales (w4a8, below): room for either. */
static long quant_bytes(int n, long in) {
    return ((long)n * in + 63) / 64 * 64 + (long)n * 8 + (long)n * (in / 32) * 4;
}

/* The calling thread quantizes x into its own part of `scratch` (thread t's at t *
 * quant_bytes): every thread computes the same bytes, so no thread waits for another. */
static void quant_own(int n, long in, const bf16 *x, void *scratch, uint8_t **a, QuantRow **q) {
    long bytes = quant_bytes(n, in);
    *a = (uint8_t *)scratch + omp_get_thread_num() * bytes;
    *q = (QuantRow *)(*a + bytes - (long)n * 8);
    quant_rows(n, in, x, *a, *q);
}

/* ---- packed 4-bit weights in groups by int8 activations (--lm-quant w4a8) ---------------
 * A packed 4-bit W [out, in] (out % 16 == 0, in % 32 == 0): block b holds, for each column
 * octet o < in / 8, one 64-byte line whose byte 4l + i holds W[16b + l, 8o + i] in its low
 * nibble and W[16b + l, 8o + 4 + i] in its high one (i < 4), each as u = Wq + 8 (0..15).
 * Four lines are a group of 32 columns with one scale per row: W[r, k] = s[r, g] Wq[r, k]
 * (symmetric, max |w| / 7 rounded to float16, |Wq| <= 8). The scales lie apart, float16
 * [out / 16, in / 32, 16]: a block's group's 16 rows in one 32-byte run. Each vector is
 * quantized when the product starts (`quant_sym`, every thread its own copy):
 * a[j] = clamp(nearbyint(x / sa[j]), -127, 127) as signed bytes, sa[j] = max |x[j]| / 127,
 * A[j, g] = the sum of group g's bytes. One vpdpbusd multiplies 4 unsigned nibbles of 16 rows
 * by 4 of those bytes, so for each group
 *   D[j, r, g] = sum_k u[r, k] a[j, k] = sum_k Wq[r, k] a[j, k] + 8 A[j, g]   (int32, exact)
 *   f[j, r] = fma((float)(D - 8 A[j, g]), s[r, g], f[j, r])   (g = 0, 1, ... in order; f = 0)
 *   y[j, r] = fma(f[j, r], sa[j], b[r]),
 * so a row's result does not depend on the tiles, the vector count, the threads or the
 * instruction set. */
#define W4_GROUP 32
#define W4_CHUNK 32  /* groups per pass when vectors take several passes (128 lines a block) */

static inline float h2f(uint16_t h) {  /* float16 -> float, exactly */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (e == 0) {
        float v = ldexpf((float)mant, -24);
        return sign ? -v : v;
    }
    c.u = sign | (e == 31 ? 0x7f800000u | (mant << 13) : ((e + 112) << 23) | (mant << 13));
    return c.f;
}

static inline uint16_t f2h(float f) {  /* float -> float16, nearest even, denormals kept */
    union { float f; uint32_t u; } c;
    c.f = f;
    uint16_t sign = (uint16_t)((c.u >> 16) & 0x8000u);
    uint32_t a = c.u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;                /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;               /* 65520 and up: infinity */
    if (a < 0x38800000u) {                                     /* below 2^-14: denormal */
        c.u = a;
        return sign | (uint16_t)nearbyintf(c.f * 16777216.f);  /* units of 2^-24, exact */
    }
    uint32_t r = a - 0x38000000u;                              /* exponent 127 -> 15 */
    r += 0x0fffu + ((r >> 13) & 1u);
    return sign | (uint16_t)(r >> 13);
}

/* x [n, in] bfloat16 -> a [n, in] signed bytes, sa [n], A [n, in / 32]. The AVX-512 loops do
 * each element's arithmetic as the scalar ones do (as `quant_rows`), so the bytes are the
 * same on every path. */
static void quant_sym(int n, long in, const bf16 *x, int8_t *a, float *sa, int32_t *A) {
    for (int j = 0; j < n; j++) {
        const bf16 *xj = x + (long)j * in;
        int8_t *aj = a + (long)j * in;
        float top = 0.f;
        long k = 0;
#if defined(__AVX512F__)
        int wide = isa_cap >= ISA_AVX512_BF16;
        if (wide) {
            __m512 vtop = _mm512_setzero_ps();
            for (; k + 16 <= in; k += 16)  /* NaN: the second, the running one */
                vtop = _mm512_max_ps(_mm512_abs_ps(bf16x16(xj + k)), vtop);
            top = _mm512_reduce_max_ps(vtop);
        }
#endif
        for (; k < in; k++) {
            float v = fabsf(bf2f(xj[k]));
            top = v > top ? v : top;
        }
        float scale = top / 127.f;
        if (!(scale > 0.f)) scale = 1.f;  /* all zeros (or not finite: garbage either way) */
        float inv = 1.f / scale;
        k = 0;
#if defined(__AVX512F__)
        if (wide) {
            const __m512 vinv = _mm512_set1_ps(inv);
            const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
            for (; k + 16 <= in; k += 16) {
                __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(bf16x16(xj + k), vinv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
                _mm_storeu_si128((__m128i *)(aj + k),
                                 _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
            }
        }
#endif
        for (; k < in; k++) {
            float v = nearbyintf(bf2f(xj[k]) * inv);
            aj[k] = (int8_t)(v >= -127.f ? (v <= 127.f ? v : 127.f) : -127.f);
        }
        for (long g = 0; g < in / W4_GROUP; g++) {
            int32_t sum = 0;
            for (int i = 0; i < W4_GROUP; i++) sum += aj[g * W4_GROUP + i];
            A[(long)j * (in / W4_GROUP) + g] = sum;
        }
        sa[j] = scale;
    }
}

/* A tile: R blocks of W (O lines each, `s` their scales, G groups each) by m vectors (a, as
 * bytes apart; their group sums A, G apart) over groups [g0, g1), into f [m, ldf] (float). */
typedef void (*TileW4)(const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a,
                       long as, const int32_t *A, int m, int R, long g0, long g1, float *f,
                       long ldf);

/* Any CPU: one block at a time. */
static void pw_tile_c(const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a,
                      long as, const int32_t *A, int m, int R, long g0, long g1, float *f,
                      long ldf) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < m; j++) {
            float *fj = f + (long)j * ldf + 16 * r;
            const int8_t *aj = a + (long)j * as;
            for (long g = g0; g < g1; g++) {
                int32_t d[16] = {0};
                for (long o = 4 * g; o < 4 * g + 4; o++) {
                    const uint8_t *line = w + ((long)r * O + o) * 64;
                    for (int l = 0; l < 16; l++)
                        for (int i = 0; i < 4; i++)
                            d[l] += (int32_t)(line[4 * l + i] & 15) * aj[8 * o + i]
                                    + (int32_t)(line[4 * l + i] >> 4) * aj[8 * o + 4 + i];
                }
                const uint16_t *sg = s + ((long)r * G + g) * 16;
                int32_t corr = 8 * A[(long)j * G + g];
                for (int l = 0; l < 16; l++)
                    fj[l] = fmaf((float)(d[l] - corr), h2f(sg[l]), g == 0 ? 0.f : fj[l]);
            }
        }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (no VNNI): vpmaddubsw multiplies the unsigned nibbles by the signed bytes and adds
 * pairs into 16-bit lanes; a group's 16 such products per lane stay within 16 bits
 * (|sum| <= 16 * 15 * 127 = 30480), so the lanes add in 16 bits over the group's 4 lines and
 * vpmaddwd by ones makes each row's int32 sum once a group. One block by m <= 2 vectors. */
#define PW2_LINE(J) if ((J) < m) {                                                           \
        const int32_t *aq = (const int32_t *)(a + (long)(J) * as + 8 * o);                  \
        const __m256i al = _mm256_set1_epi32(aq[0]), ah = _mm256_set1_epi32(aq[1]);        \
        t##J##0 = _mm256_add_epi16(t##J##0, _mm256_add_epi16(                               \
            _mm256_maddubs_epi16(lo0, al), _mm256_maddubs_epi16(hi0, ah)));                 \
        t##J##1 = _mm256_add_epi16(t##J##1, _mm256_add_epi16(                               \
            _mm256_maddubs_epi16(lo1, al), _mm256_maddubs_epi16(hi1, ah))); }
#define PW2_FLUSH(J, H) if ((J) < m) {                                                       \
        float *fj = f + (long)(J) * ldf + 8 * (H);                                           \
        __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(t##J##H, ones),                       \
                                     _mm256_set1_epi32(8 * A[(long)(J) * G + g]));           \
        __m256 acc = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(fj);                    \
        _mm256_storeu_ps(fj, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc##H, acc)); }
static inline __attribute__((always_inline)) void pw_tile256_at(
        const uint8_t *w, const uint16_t *s, long G, const int8_t *a, long as,
        const int32_t *A, const int m, long g0, long g1, float *f, long ldf) {
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (long g = g0; g < g1; g++) {
        __m256i t00 = _mm256_setzero_si256(), t01 = t00, t10 = t00, t11 = t00;
        for (long o = 4 * g; o < 4 * g + 4; o++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + o * 64));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + o * 64 + 32));
            const __m256i lo0 = _mm256_and_si256(v0, nib);
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
            const __m256i lo1 = _mm256_and_si256(v1, nib);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
            PW2_LINE(0) PW2_LINE(1)
        }
        const __m256 sc0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g * 16)));
        const __m256 sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g * 16 + 8)));
        PW2_FLUSH(0, 0) PW2_FLUSH(0, 1) PW2_FLUSH(1, 0) PW2_FLUSH(1, 1)
    }
}
#undef PW2_LINE
#undef PW2_FLUSH

static __attribute__((noinline)) void pw256_1(const uint8_t *w, const uint16_t *s, long G,
                                              const int8_t *a, long as, const int32_t *A,
                                              long g0, long g1, float *f, long ldf) {
    pw_tile256_at(w, s, G, a, as, A, 1, g0, g1, f, ldf);
}

static __attribute__((noinline)) void pw256_2(const uint8_t *w, const uint16_t *s, long G,
                                              const int8_t *a, long as, const int32_t *A,
                                              long g0, long g1, float *f, long ldf) {
    pw_tile256_at(w, s, G, a, as, A, 2, g0, g1, f, ldf);
}

static void pw_tile256(const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a,
                       long as, const int32_t *A, int m, int R, long g0, long g1, float *f,
                       long ldf) {
    for (int r = 0; r < R; r++) {
        const uint8_t *wr = w + (long)r * O * 64;
        const uint16_t *sr = s + (long)r * G * 16;
        if (m == 2) pw256_2(wr, sr, G, a, as, A, g0, g1, f + 16 * r, ldf);
        else if (m == 1) pw256_1(wr, sr, G, a, as, A, g0, g1, f + 16 * r, ldf);
        else pw_tile_c(wr, O, sr, G, a, as, A, m, 1, g0, g1, f + 16 * r, ldf);
    }
}
#endif

#if defined(__AVX512VNNI__)
/* AVX512-VNNI: per line and block, the low and high nibbles (two ands and a shift) by the
 * broadcast quads of each vector, two vpdpbusd; at a group's end each int32 sum becomes a
 * float term of f (in memory, L1). R blocks by m vectors as named sums (as `pq_tile512_at`). */
#define PW_INIT(J, RR) __m512i s##J##RR = _mm512_setzero_si512();
#define PW_INIT_ROW(J) PW_INIT(J, 0) PW_INIT(J, 1) PW_INIT(J, 2) PW_INIT(J, 3)
#define PW_W(RR) __m512i lo##RR = _mm512_setzero_si512(), hi##RR = lo##RR;                    \
    if ((RR) < R) {                                                                          \
        const __m512i v = _mm512_loadu_si512(w + ((long)(RR) * O + o) * 64);                \
        lo##RR = _mm512_and_si512(v, nib);                                                   \
        hi##RR = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib); }
#define PW_DOT(J, RR) if ((J) < m && (RR) < R) {                                             \
        s##J##RR = _mm512_dpbusd_epi32(s##J##RR, lo##RR, al);                                \
        s##J##RR = _mm512_dpbusd_epi32(s##J##RR, hi##RR, ah); }
#define PW_ROW(J) if ((J) < m) {                                                             \
        const int32_t *aq = (const int32_t *)(a + (long)(J) * as + 8 * o);                  \
        const __m512i al = _mm512_set1_epi32(aq[0]), ah = _mm512_set1_epi32(aq[1]);        \
        PW_DOT(J, 0) PW_DOT(J, 1) PW_DOT(J, 2) PW_DOT(J, 3) }
#define PW_SC(RR) __m512 sc##RR = _mm512_setzero_ps();                                       \
    if ((RR) < R) sc##RR = _mm512_cvtph_ps(                                                  \
        _mm256_loadu_si256((const __m256i *)(s + ((long)(RR) * G + g) * 16)));
#define PW_FLUSH(J, RR) if ((J) < m && (RR) < R) {                                           \
        float *fj = f + (long)(J) * ldf + 16 * (RR);                                         \
        const __m512i d = _mm512_sub_epi32(s##J##RR,                                         \
                                           _mm512_set1_epi32(8 * A[(long)(J) * G + g]));     \
        const __m512 acc = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(fj);              \
        _mm512_storeu_ps(fj, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc##RR, acc)); }
#define PW_FLUSH_ROW(J) PW_FLUSH(J, 0) PW_FLUSH(J, 1) PW_FLUSH(J, 2) PW_FLUSH(J, 3)
#define PW_LINE(I) { const long o = 4 * g + (I);                                             \
        PW_W(0) PW_W(1) PW_W(2) PW_W(3)                                                      \
        PW_ROWS(PW_ROW) }
#define PW_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
static inline __attribute__((always_inline)) void pw_tile512_at(
        const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a, long as,
        const int32_t *A, const int m, const int R, long g0, long g1, float *f, long ldf) {
    const __m512i nib = _mm512_set1_epi8(15);
    for (long g = g0; g < g1; g++) {  /* the sums live one group (GCC 12 copied loop-carried */
        PW_ROWS(PW_INIT_ROW)          /* ones between registers), its 4 lines written out */
        PW_LINE(0) PW_LINE(1) PW_LINE(2) PW_LINE(3)
        PW_SC(0) PW_SC(1) PW_SC(2) PW_SC(3)
        PW_ROWS(PW_FLUSH_ROW)
    }
}
#undef PW_INIT
#undef PW_INIT_ROW
#undef PW_W
#undef PW_DOT
#undef PW_ROW
#undef PW_SC
#undef PW_FLUSH
#undef PW_FLUSH_ROW
#undef PW_LINE
#undef PW_ROWS

#define PW512_FN(M, RR)                                                                      \
static __attribute__((noinline)) void pw512_##M##_##RR(                                     \
        const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a, long as,       \
        const int32_t *A, long g0, long g1, float *f, long ldf) {                            \
    pw_tile512_at(w, O, s, G, a, as, A, M, RR, g0, g1, f, ldf);                              \
}
#define PW512_SHAPES(X)                                                                      \
    X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(2, 1) X(2, 2) X(2, 3) X(2, 4) X(3, 1) X(3, 2) X(3, 3)  \
    X(3, 4) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(5, 1) X(5, 2) X(6, 1) X(6, 2) X(7, 1) X(7, 2)  \
    X(8, 1) X(8, 2)
PW512_SHAPES(PW512_FN)
#undef PW512_FN

static void pw_tile512(const uint8_t *w, long O, const uint16_t *s, long G, const int8_t *a,
                       long as, const int32_t *A, int m, int R, long g0, long g1, float *f,
                       long ldf) {
#define PW512_CASE(M, RR) case (M) * 8 + (RR): \
    pw512_##M##_##RR(w, O, s, G, a, as, A, g0, g1, f, ldf); break;
    switch (m * 8 + R) {
    PW512_SHAPES(PW512_CASE)
    default: pw_tile_c(w, O, s, G, a, as, A, m, R, g0, g1, f, ldf);
    }
#undef PW512_CASE
}
#undef PW512_SHAPES
#endif

/* Blocks [b0, b1) against n vectors into f [n, ldf]; with more vectors than a tile holds,
 * the groups go in chunks (partial sums kept in f), each chunk's lines re-read from cache. */
static void pw_blocks(TileW4 tile, int mmax, int R, const uint8_t *w, long O, const uint16_t *s,
                      long G, long b0, long b1, const int8_t *a, long as, const int32_t *A,
                      int n, float *f, long ldf) {
    long chunk = n <= mmax ? G : W4_CHUNK;
    for (long b = b0; b < b1; b += R) {
        int r = b1 - b < R ? (int)(b1 - b) : R;
        for (long g0 = 0; g0 < G; g0 += chunk) {
            long g1 = g0 + chunk < G ? g0 + chunk : G;
            for (int j0 = 0; j0 < n; j0 += mmax) {
                int m = n - j0 < mmax ? n - j0 : mmax;
                tile(w + b * O * 64, O, s + b * G * 16, G, a + (long)j0 * as, as,
                     A + (long)j0 * G, m, r, g0, g1, f + (long)j0 * ldf + b * 16, ldf);
            }
        }
    }
}

/* y[j * ldy + r] = the w4a8 product (above) + b[r] for this thread's share of W's rows,
 * rounded to bfloat16 when `round`, from the quantized vectors (`quant_sym`). No barrier. */
static void pw_gemv(int n, const void *w, const void *scales, const bf16 *b, long in, long out,
                    const int8_t *a, const float *sa, const int32_t *A, float *y, long ldy,
                    int round) {
    long r0, r1, O = in / 8, G = in / W4_GROUP;
    share(out, &r0, &r1);
    if (r1 <= r0) return;
    const uint8_t *wp = (const uint8_t *)w;
    const uint16_t *sp = (const uint16_t *)scales;
#if defined(__AVX512VNNI__)
    if (isa_cap >= ISA_AVX512_BF16)
        pw_blocks(pw_tile512, n <= 4 ? 4 : 8, n <= 4 ? 4 : 2, wp, O, sp, G, r0 / 16, r1 / 16,
                  a, in, A, n, y, ldy);
    else
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (isa_cap >= ISA_AVX2)
        pw_blocks(pw_tile256, 2, 1, wp, O, sp, G, r0 / 16, r1 / 16, a, in, A, n, y, ldy);
    else
#endif
        pw_blocks(pw_tile_c, 4, 1, wp, O, sp, G, r0 / 16, r1 / 16, a, in, A, n, y, ldy);
    for (int j = 0; j < n; j++) {
        float *yj = y + (long)j * ldy;
        for (long r = r0; r < r1; r++) {
            float v = fmaf(yj[r], sa[j], bias_at(b, r));
            yj[r] = round ? bf2f(f2bf(v)) : v;
        }
    }
}

/* The calling thread quantizes x (`quant_sym`) into its own part of `scratch` (thread t's at
 * t * quant_bytes: bytes, then the group sums, then the scales). */
static void quant_own_w4(int n, long in, const bf16 *x, void *scratch, int8_t **a, float **sa,
                         int32_t **A) {
    long bytes = quant_bytes(n, in);
    *a = (int8_t *)scratch + omp_get_thread_num() * bytes;
    *A = (int32_t *)(*a + ((long)n * in + 63) / 64 * 64);
    *sa = (float *)(*A + (long)n * (in / W4_GROUP));
    quant_sym(n, in, x, *a, *sa, *A);
}

/* ---- int8 weights with one float scale per row (weight-only quantization) --------------
 * y[j * ldy + r] = scale[r] * (W[r] . x[j]) + b[r], rounded to bfloat16 when `bf` (then the
 * bias is bfloat16, else float); x is float. Each (row, vector) pair keeps one 16-lane
 * accumulator over the columns, then a scalar tail, whatever the blocking. */
static inline void finish_i8(const int8_t *row, float s, float scale, float bias, int bf,
                             long from, long in, const float *xj, float *yr) {
    for (long t = from; t < in; t++) s += row[t] * xj[t];
    s = s * scale + bias;
    *yr = bf ? bf2f(f2bf(s)) : s;
}

static inline float bias_i8(const void *b, int bf, long r) {
    return b ? (bf ? bf2f(((const bf16 *)b)[r]) : ((const float *)b)[r]) : 0.f;
}

#if defined(__AVX512F__)
/* Rows r..r+3 against vectors j0..j0+m-1 (m constant after inlining): 4 * m independent
 * accumulators, so the FMA latency is hidden even for one vector; the next rows are
 * prefetched meanwhile. */
static inline __attribute__((always_inline)) void block_i8(
        const int8_t *w, const float *scale, const void *b, int bf, long in, long r,
        const float *x, int j0, const int m, float *y, long ldy, int prefetch) {
    const int8_t *w0 = w + r * in;
    long vin = in & ~15L;
    __m512 acc[4][4];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) acc[k][j] = _mm512_setzero_ps();
    for (long i = 0; i < vin; i += 16) {
        if (prefetch && (i & 63) == 0)
            for (int k = 4; k < 8; k++) _mm_prefetch((const char *)(w0 + k * in + i), _MM_HINT_T0);
        __m512 wv[4];
        for (int k = 0; k < 4; k++)
            wv[k] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w0 + k * in + i))));
        for (int j = 0; j < m; j++) {
            __m512 xv = _mm512_loadu_ps(x + (long)(j0 + j) * in + i);
            for (int k = 0; k < 4; k++) acc[k][j] = _mm512_fmadd_ps(wv[k], xv, acc[k][j]);
        }
    }
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < m; j++)
            finish_i8(w0 + k * in, _mm512_reduce_add_ps(acc[k][j]), scale[r + k],
                      bias_i8(b, bf, r + k), bf, vin, in, x + (long)(j0 + j) * in,
                      y + (long)(j0 + j) * ldy + r + k);
}
#endif

static void rows_i8(const int8_t *w, const float *scale, const void *b, int bf, long in,
                    long r0, long r1, const float *x, int n, float *y, long ldy) {
    long r = r0;
#if defined(__AVX512F__)
    for (; r + 4 <= r1; r += 4) {
        int prefetch = r + 8 <= r1;
        for (int j0 = 0; j0 < n; j0 += 4) {
            switch (n - j0 < 4 ? n - j0 : 4) {
            case 1: block_i8(w, scale, b, bf, in, r, x, j0, 1, y, ldy, prefetch && !j0); break;
            case 2: block_i8(w, scale, b, bf, in, r, x, j0, 2, y, ldy, prefetch && !j0); break;
            case 3: block_i8(w, scale, b, bf, in, r, x, j0, 3, y, ldy, prefetch && !j0); break;
            default: block_i8(w, scale, b, bf, in, r, x, j0, 4, y, ldy, prefetch && !j0); break;
            }
        }
    }
#endif
    for (; r < r1; r++)
        for (int j = 0; j < n; j++) {
            const int8_t *row = w + r * in;
            const float *xj = x + (long)j * in;
            float s = 0.f;
            long i = 0;
#if defined(__AVX512F__)
            __m512 acc = _mm512_setzero_ps();
            for (; i + 16 <= in; i += 16)
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(row + i)))), _mm512_loadu_ps(xj + i), acc);
            s = _mm512_reduce_add_ps(acc);
#endif
            finish_i8(row, s, scale[r], bias_i8(b, bf, r), bf, i, in, xj, y + (long)j * ldy + r);
        }
}

/* Called by every thread of the team; ends in a barrier. `xp` scratch holds n * in floats.
 * `scale`: W is int8 with these row scales (NULL: W is bfloat16). */
static void gemv_bf16(int n, const void *w, const float *scale, const void *b, long in,
                      long out, const bf16 *x, float *y, bf16 *xp, int packed) {
    long r0, r1;
    if (packed == 3) {  /* w4a8: `scale` is the weight's float16 group scales */
        int8_t *a;
        float *sa;
        int32_t *A;
        quant_own_w4(n, in, x, xp, &a, &sa, &A);
        pw_gemv(n, w, scale, (const bf16 *)b, in, out, a, sa, A, y, out, 1);
        #pragma omp barrier
        return;
    }
    if (packed == 2) {  /* w8a8: `scale` is the weight's rowdata */
        uint8_t *a;
        QuantRow *q;
        quant_own(n, in, x, xp, &a, &q);
        pq_gemv(n, w, scale, (const bf16 *)b, in, out, a, q, y, out, 1);
        #pragma omp barrier
        return;
    }
    if (packed && !scale) {
        pk_gemv(n, w, (const bf16 *)b, in, out, x, y, out, xp, 1);
        #pragma omp barrier
        return;
    }
    share(out, &r0, &r1);
    if (scale) {
        float *xf = (float *)xp;
        #pragma omp single
        for (long i = 0; i < (long)n * in; i++) xf[i] = bf2f(x[i]);
        rows_i8((const int8_t *)w, scale, b, 1, in, r0, r1, xf, n, y, out);
        #pragma omp barrier
        return;
    }
#if HAVE_AMX
    if (use_amx(n) && in % 32 == 0 && out % 16 == 0) {
        amx_pack(x, n, in, xp);
        amx_rows((const bf16 *)w, (const bf16 *)b, in, r0, r1, xp, n, y, out);
        #pragma omp barrier
        return;
    }
#endif
    (void)xp;
    rows_bf16((const bf16 *)w, (const bf16 *)b, in, r0, r1, x, n, y, out);
    #pragma omp barrier
}

static void gemv_f32(int n, const void *w, const float *scale, const void *b, long in,
                     long out, const float *x, float *y, float *xp, int packed) {
    long r0, r1;
    (void)xp, (void)packed;  /* float32 weights are never packed */
    share(out, &r0, &r1);
    if (scale) {
        rows_i8((const int8_t *)w, scale, b, 0, in, r0, r1, x, n, y, out);
        #pragma omp barrier
        return;
    }
    for (long r = r0; r < r1; r++) {
        const float *row = (const float *)w + r * in;
        for (int j = 0; j < n; j++) {
            float acc = 0.f;
            for (long i = 0; i < in; i++) acc += row[i] * x[(long)j * in + i];
            y[(long)j * out + r] = acc + (b ? ((const float *)b)[r] : 0.f);
        }
    }
    #pragma omp barrier
}

/* ---- SwiGLU: h[j, c] = round(round(silu(g)) * u) for g, u the gate/up outputs ----------- */
static void act_f32(const float *gu, float *h, long n, long F, long i0, long i1) {
    (void)n;
    for (long i = i0; i < i1; i++) {
        long j = i / F, c = i % F;
        float g = gu[j * 2 * F + c];
        h[i] = g / (1.0f + expf(-g)) * gu[j * 2 * F + F + c];
    }
}

#if defined(__AVX512BF16__)
/* e^x for x <= 0 (silu's argument is -|g|), relative error < 2e-7: 2^(x log2 e) split into
 * an integer power and a degree-6 polynomial of the fraction. */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

#endif

static void act_bf16(const float *gu, bf16 *h, long n, long F, long i0, long i1) {
    (void)n;
    long i = i0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= i1 && (i % F) + 16 <= F; i += 16) {
        long j = i / F, c = i % F;
        __m512 g = _mm512_loadu_ps(gu + j * 2 * F + c);
        __m512 u = _mm512_loadu_ps(gu + j * 2 * F + F + c);
        /* silu(g) = g / (1 + e^-g) = g * e^g / (1 + e^g) below 0: both from e^-|g| */
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        __m512 one = _mm512_set1_ps(1.0f);
        __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
        __m512 silu = round_bf16(_mm512_div_ps(num, _mm512_add_ps(one, e)));
        store_bf16x16(h + i, _mm512_mul_ps(silu, u));
    }
#endif
    for (; i < i1; i++) {
        long j = i / F, c = i % F;
        float g = gu[j * 2 * F + c];
        h[i] = f2bf(bf2f(f2bf(g / (1.0f + expf(-g)))) * gu[j * 2 * F + F + c]);
    }
}

/* ---- per-dtype element access, norms, attention and the step --------------------------- */
#define LOAD_bf16(p, i) bf2f(((const bf16 *)(p))[i])
#define LOAD_f32(p, i) (((const float *)(p))[i])
#define STORE_bf16(p, i, v) (((bf16 *)(p))[i] = f2bf(v))
#define STORE_f32(p, i, v) (((float *)(p))[i] = (v))
#define ROUND_bf16(v) bf2f(f2bf(v))
#define ROUND_f32(v) (v)

/* A query's dot product with one cached key: 8 lanes of float sums (a whole head of 8 or 16
 * in one or two vector multiply-adds instead of a serial chain of hd scalar ones), summed by
 * a fixed tree, the odd tail after them; the same order for every row, batch and thread. */
typedef float f8v __attribute__((vector_size(32)));
typedef uint16_t h8v __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u8v __attribute__((vector_size(32)));
static inline float sum8(f8v a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
static inline f8v load8_f32(const float *p) { f8v v; memcpy(&v, p, sizeof v); return v; }
static inline f8v load8_bf16(const bf16 *p) {  /* 8 bfloat16 -> 8 floats, exactly */
    h8v h;
    memcpy(&h, p, sizeof h);
    return (f8v)(__builtin_convertvector(h, u8v) << 16);
}
#define DEFINE_DOT(T, SFX)                                                                   \
static inline float dot_##SFX(const float *q, const T *k, int hd) {                          \
    f8v acc = {0};                                                                           \
    int d = 0;                                                                               \
    for (; d + 8 <= hd; d += 8) acc += load8_f32(q + d) * load8_##SFX(k + d);                \
    float dot = sum8(acc);                                                                   \
    for (; d < hd; d++) dot += q[d] * LOAD_##SFX(k, d);                                      \
    return dot;                                                                              \
}
DEFINE_DOT(bf16, bf16)
DEFINE_DOT(float, f32)
#undef DEFINE_DOT

#define DEFINE_STEP(T, SFX)                                                                  \
/* RMSNorm of n rows of float x into T h: w * round(x * rsqrt(mean(x^2) + eps)). */          \
static void norm_##SFX(const float *x, const void *w, T *h, int n, int dim, float eps) {     \
    for (int j = 0; j < n; j++) {                                                            \
        const float *xj = x + (long)j * dim;                                                 \
        float ss = 0.f;                                                                      \
        for (int i = 0; i < dim; i++) ss += xj[i] * xj[i];                                   \
        float scale = 1.0f / sqrtf(ss / dim + eps);                                          \
        for (int i = 0; i < dim; i++)                                                        \
            STORE_##SFX(h, (long)j * dim + i,                                                \
                        LOAD_##SFX(w, i) * ROUND_##SFX(xj[i] * scale));                      \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* RoPE, cache write and attention of one (row, head) over positions 0..slot. */             \
static void attend_##SFX(const Step *s, int layer, int j, int h, const float *qkv, T *att,   \
                         float *scores) {                                                    \
    int hd = s->head_dim, half = hd / 2, D = s->heads * hd;                                  \
    const float *q = qkv + (long)j * 3 * D + h * hd;                                         \
    const float *k = q + D, *v = q + 2 * D;                                                  \
    long base = (((long)layer * s->cache_rows + j) * s->heads + h) * s->cache_len * hd;      \
    T *kc = (T *)s->k + base, *vc = (T *)s->v + base;                                        \
    float qr[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                                               \
    for (int d = 0; d < hd; d++) {                                                           \
        float c = LOAD_##SFX(s->cos, d), sn = LOAD_##SFX(s->sin, d);                         \
        float qo = d < half ? -q[d + half] : q[d - half];                                    \
        float ko = d < half ? -k[d + half] : k[d - half];                                    \
        qr[d] = ROUND_##SFX(ROUND_##SFX(q[d] * c) + ROUND_##SFX(qo * sn));                   \
        STORE_##SFX(kc, (long)s->slot * hd + d,                                              \
                    ROUND_##SFX(k[d] * c) + ROUND_##SFX(ko * sn));                           \
        STORE_##SFX(vc, (long)s->slot * hd + d, v[d]);                                       \
        acc[d] = 0.f;                                                                        \
    }                                                                                        \
    float scale = 1.0f / sqrtf((float)hd), top = -INFINITY, total = 0.f;                     \
    for (int t = 0; t <= s->slot; t++) {                                                     \
        scores[t] = dot_##SFX(qr, kc + (long)t * hd, hd) * scale;                            \
        top = scores[t] > top ? scores[t] : top;                                             \
    }                                                                                        \
    for (int t = 0; t <= s->slot; t++) {                                                     \
        float e = expf(scores[t] - top);                                                     \
        total += e;                                                                          \
        float p = ROUND_##SFX(e);                                                            \
        for (int d = 0; d < hd; d++) acc[d] += p * LOAD_##SFX(vc, (long)t * hd + d);         \
    }                                                                                        \
    for (int d = 0; d < hd; d++) STORE_##SFX(att, (long)j * D + h * hd + d, acc[d] / total); \
}                                                                                            \
                                                                                             \
int step_##SFX(const Step *s) {                                                              \
    int n = s->rows, D = s->dim, F = s->ffn, H = s->heads;                                   \
    long wide = D > F ? D : F;                                                               \
    float *qkv = s->work;                    /* [n, 3D] */                                   \
    float *o = qkv + (long)n * 3 * D;        /* [n, D]; reused for down */                   \
    float *gu = o + (long)n * D;             /* [n, 2F] */                                   \
    float *scores = gu + (long)n * 2 * F;    /* [threads, S] */                              \
    float *xs = scores + (long)s->threads * s->cache_len;  /* [threads, n, D] residuals */   \
    T *att = (T *)(xs + (long)s->threads * n * D);         /* [n, D] */                      \
    T *hs = att + (long)n * D;               /* [threads, n, wide]: normed / SwiGLU rows */  \
    T *xp = hs + (long)s->threads * n * wide;  /* [n, wide] floats: matmul scratch (last) */ \
    _Pragma("omp parallel num_threads(s->threads)")                                          \
    {                                                                                        \
        /* Each thread keeps its own copy of the residual stream and of the normed rows,   \
         * computed alike by all: the products start without waiting for one thread's     \
         * norm; the threads meet only where a product's outputs are read (5 barriers a    \
         * layer). */                                                                       \
        int t = omp_get_thread_num();                                                        \
        float *sc = scores + (long)t * s->cache_len, *x = xs + (long)t * n * D;              \
        T *h = hs + (long)t * n * wide;                                                      \
        for (long i = 0; i < (long)n * D; i++) x[i] = LOAD_##SFX(s->x, i);                   \
        int amx = sizeof(T) == 2 && (s->packed == 1 ? use_amx_pk(n)                         \
                                     : s->packed == 0 && use_amx(n));                        \
        if (amx && s->packed) amx_configure_pk(n);                                           \
        else if (amx) amx_configure(n);                                                      \
        for (int l = 0; l < s->layers; l++) {                                                \
            const Layer *L = s->layer + l;                                                   \
            norm_##SFX(x, L->in_norm, h, n, D, s->eps);                                      \
            gemv_##SFX(n, L->qkv_w, L->qkv_s, L->qkv_b, D, 3 * D, h, qkv, xp, s->packed);    \
            _Pragma("omp for schedule(static)")                                              \
            for (int jh = 0; jh < n * H; jh++)                                               \
                attend_##SFX(s, l, jh / H, jh % H, qkv, att, sc);                            \
            gemv_##SFX(n, L->o_w, L->o_s, NULL, D, D, att, o, xp, s->packed);                \
            for (long i = 0; i < (long)n * D; i++) x[i] = ROUND_##SFX(x[i] + o[i]);          \
            norm_##SFX(x, L->post_norm, h, n, D, s->eps);                                    \
            gemv_##SFX(n, L->gate_up_w, L->gate_up_s, NULL, D, 2 * F, h, gu, xp, s->packed); \
            act_##SFX(gu, h, n, F, 0, (long)n * F);                                          \
            gemv_##SFX(n, L->down_w, L->down_s, NULL, F, D, h, o, xp, s->packed);            \
            for (long i = 0; i < (long)n * D; i++) x[i] = ROUND_##SFX(x[i] + o[i]);          \
        }                                                                                    \
        if (amx) amx_release();                                                              \
        if (t == 0) norm_##SFX(x, s->final_norm, (T *)s->out, n, D, s->eps);                 \
    }                                                                                        \
    return 0;                                                                                \
}

DEFINE_STEP(bf16, bf16)
DEFINE_STEP(float, f32)

/* Floats of scratch a step needs (Step.work): float32 buffers, then three of the model dtype
 * (sized as floats, so either dtype fits). Python allocates what this says. */
long step_work_floats(const Step *s) {
    long n = s->rows, D = s->dim, F = s->ffn, wide = D > F ? D : F, t = s->threads;
    long xp = n * wide, xq = (t * quant_bytes((int)n, wide) + 3) / 4;  /* w8a8: each thread's */
    return n * (4 * D + 2 * F) + t * s->cache_len + t * n * D + n * D + (xp > xq ? xp : xq)
           + t * n * wide;
}

int max_head_dim(void) { return MAX_HEAD_DIM; }

/* AMX tiles for `rows` >= this (1-16); 17 turns them off (the AVX512-BF16 path runs). */
void set_amx_min_rows(int rows) { amx_from = rows; }
int amx_min_rows(void) { return amx_from; }

/* ---- one matrix product y [rows, out] = x [rows, in] . W[out, in]^T (+ b), model dtype -- */
typedef struct {
    const void *w, *b, *x;   /* W [out, in], bias [out] or NULL, x [rows, in] */
    const float *scale;      /* int8 W's row scales [out], or NULL */
    void *y;                 /* [rows, out] */
    float *work;             /* gemv_work_floats() floats */
    long in, out;
    int rows, threads;
    int packed;              /* W is packed (16-row blocks, above): 1 bfloat16, 2 int8 (w8a8;
                                `scale` is then its rowdata), 3 4-bit (w4a8; `scale` is then
                                its float16 group scales) */
} Gemv;

long gemv_work_floats(const Gemv *g) {
    long xq = (g->threads * quant_bytes(g->rows, g->in) + 3) / 4;  /* w8a8: each thread's */
    long x = (long)g->rows * g->in;
    return (long)g->rows * g->out + (x > xq ? x : xq);
}

/* This thread's share of the rows of y [n, out] (float) rounded into o (bfloat16): converted
 * without waiting for the other threads, whose rows they are not. */
static void to_bf16_rows(int n, const float *y, bf16 *o, long out) {
    long r0, r1;
    share(out, &r0, &r1);
    for (int j = 0; j < n; j++) {
        long r = r0;
        const float *yj = y + (long)j * out;
        bf16 *oj = o + (long)j * out;
#if defined(__AVX512BF16__)
        for (; r + 16 <= r1; r += 16)
            store_bf16x16(oj + r, _mm512_loadu_ps(yj + r));
#endif
        for (; r < r1; r++) oj[r] = f2bf(yj[r]);
    }
}

int gemv_bf16_call(const Gemv *g) {
    int n = g->rows;
    float *y = g->work;
    bf16 *xp = (bf16 *)(y + (long)n * g->out), *out = (bf16 *)g->y;
    long total = (long)n * g->out;
    if (g->packed == 3) {
        _Pragma("omp parallel num_threads(g->threads)")
        {
            int8_t *a;
            float *sa;
            int32_t *A;
            quant_own_w4(n, g->in, (const bf16 *)g->x, xp, &a, &sa, &A);
            pw_gemv(n, g->w, g->scale, (const bf16 *)g->b, g->in, g->out, a, sa, A, y, g->out,
                    0);
            to_bf16_rows(n, y, out, g->out);
        }
        return 0;
    }
    if (g->packed == 2) {
        _Pragma("omp parallel num_threads(g->threads)")
        {
            uint8_t *a;
            QuantRow *q;
            quant_own(n, g->in, (const bf16 *)g->x, xp, &a, &q);
            pq_gemv(n, g->w, g->scale, (const bf16 *)g->b, g->in, g->out, a, q, y, g->out, 0);
            to_bf16_rows(n, y, out, g->out);
        }
        return 0;
    }
    if (g->packed == 1) {
        _Pragma("omp parallel num_threads(g->threads)")
        {
            int amx = use_amx_pk(n) && g->in % 32 == 0;
            if (amx) amx_configure_pk(n);
            pk_gemv(n, g->w, (const bf16 *)g->b, g->in, g->out, (const bf16 *)g->x, y, g->out,
                    xp, 0);
            if (amx) amx_release();
            to_bf16_rows(n, y, out, g->out);
        }
        return 0;
    }
    _Pragma("omp parallel num_threads(g->threads)")
    {
        int amx = use_amx(n);
        if (amx) amx_configure(n);
        gemv_bf16(n, g->w, g->scale, g->b, g->in, g->out, (const bf16 *)g->x, y, xp, 0);
        if (amx) amx_release();
        long i0, i1;
        share(total, &i0, &i1);
        long i = i0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= i1; i += 16)
            store_bf16x16(out + i, _mm512_loadu_ps(y + i));
#endif
        for (; i < i1; i++) out[i] = f2bf(y[i]);
    }
    return 0;
}

int gemv_f32_call(const Gemv *g) {
    _Pragma("omp parallel num_threads(g->threads)")
    gemv_f32(g->rows, g->w, g->scale, g->b, g->in, g->out, (const float *)g->x,
             (float *)g->y, NULL, 0);
    return 0;
}

/* 1: AVX512-BF16 dot products compiled in; 2: AMX tiles compiled in and granted; 4: AVX2
 * with FMA compiled in. */
int features(void) {
    int bits = 0;
#if defined(__AVX512BF16__)
    bits |= 1;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    bits |= 4;
#endif
    return bits | (amx_state == 1 ? 2 : 0);
}

/* The widest path packed products may take below AMX: 2 AVX512-BF16, 1 AVX2, 0 plain C
 * (where compiled in; tests run each path of other CPUs with it). */
void set_isa_cap(int isa) { isa_cap = isa; }
int isa_in_use(void) {
#if defined(__AVX512BF16__)
    if (isa_cap >= ISA_AVX512_BF16) return ISA_AVX512_BF16;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa_cap >= ISA_AVX2) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* ---- packing: W [out, in] bfloat16 (rows of `pairs` 32-bit column pairs) into 16-row blocks
 * (above), blocks [b0, b1) of it, on `threads` threads. */
int pack_bf16(const uint32_t *w, uint32_t *packed, long pairs, long b0, long b1, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long b = b0; b < b1; b++) {
        const uint32_t *src = w + b * 16 * pairs;
        uint32_t *dst = packed + b * 16 * pairs;
        for (long p0 = 0; p0 < pairs; p0 += 64) {  /* 16 rows x 256 bytes in, 4 KiB out */
            long p1 = p0 + 64 < pairs ? p0 + 64 : pairs;
            for (long p = p0; p < p1; p++)
                for (int l = 0; l < 16; l++) dst[p * 16 + l] = src[l * pairs + p];
        }
    }
    return 0;
}

/* ---- packing as int8 (w8a8, above): W [out, in] bfloat16, blocks [b0, b1), on `threads`
 * threads, into `packed` and `rowdata` (scales [out], then the rows' sums as int32 [out]).
 * Each row: s = max(max |w| / 127, FLT_MIN) (float), q = nearbyint(w / s) clamped to
 * -127..127, as `mimo_tts.lm.int8.quantize_rows` defines it. */
int pack_w8(const bf16 *w, int8_t *packed, float *rowdata, long in, long out, long b0, long b1,
            int threads) {
    long quads = in / 4;
    int32_t *sums = (int32_t *)(rowdata + out);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long b = b0; b < b1; b++)
        for (int l = 0; l < 16; l++) {
            long r = 16 * b + l;
            const bf16 *row = w + r * in;
            float top = 0.f;
            for (long k = 0; k < in; k++) {
                float m = fabsf(bf2f(row[k]));
                top = m > top ? m : top;
            }
            float scale = top / 127.f;
            scale = scale >= FLT_MIN ? scale : FLT_MIN;
            int32_t sum = 0;
            for (long k = 0; k < in; k++) {
                float q = nearbyintf(bf2f(row[k]) / scale);
                q = q >= -127.f ? (q <= 127.f ? q : 127.f) : -127.f;
                packed[((b * quads + k / 4) * 16 + l) * 4 + k % 4] = (int8_t)q;
                sum += (int32_t)q;
            }
            rowdata[r] = scale;
            sums[r] = sum;
        }
    return 0;
}

/* ---- packing as 4-bit groups (w4a8, above): W [out, in] bfloat16, blocks [b0, b1), on
 * `threads` threads, into `packed` (lines) and `scales` (float16). Each group of 32 columns of
 * a row: s = max |w| / 7 (float) rounded to float16 (`f2h`), q = nearbyint(w / s) clamped to
 * -8..7 (0 where s rounds to 0), stored q + 8. */
int pack_w4(const bf16 *w, uint8_t *packed, uint16_t *scales, long in, long b0, long b1,
            int threads) {
    long lines = in / 8, groups = in / W4_GROUP;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long b = b0; b < b1; b++)
        for (long g = 0; g < groups; g++)
            for (int l = 0; l < 16; l++) {
                const bf16 *row = w + (16 * b + l) * in + g * W4_GROUP;
                float top = 0.f, v[W4_GROUP];
                for (int k = 0; k < W4_GROUP; k++) {
                    v[k] = bf2f(row[k]);
                    float m = fabsf(v[k]);
                    top = m > top ? m : top;
                }
                uint16_t h = f2h(top / 7.f);
                float sf = h2f(h);
                scales[(b * groups + g) * 16 + l] = h;
                uint8_t u[W4_GROUP];
                for (int k = 0; k < W4_GROUP; k++) {
                    float q = sf > 0.f ? nearbyintf(v[k] / sf) : 0.f;
                    q = q >= -8.f ? (q <= 7.f ? q : 7.f) : -8.f;  /* NaN: -8 */
                    u[k] = (uint8_t)((int)q + 8);
                }
                for (int o = 0; o < W4_GROUP / 8; o++) {
                    uint8_t *line = packed + (b * lines + g * (W4_GROUP / 8) + o) * 64;
                    for (int i = 0; i < 4; i++)
                        line[4 * l + i] = (uint8_t)(u[8 * o + i] | (u[8 * o + 4 + i] << 4));
                }
            }
    return 0;
}

/* ---- attention of one query position, bfloat16 (the backbone's decode step) --------------
 * q [B, h, D] and the caches' keys and values [B, kv, S, D] as they lie (strides in
 * elements; D contiguous), each kv head serving h / kv query heads (GQA); `mask` [B, S] bytes
 * (row stride mb, 0 for one row shared by all; NULL: every key) says which keys a row sees.
 * As PyTorch's bfloat16 attention: scores and softmax in float32, the softmax weights rounded
 * to bfloat16 for the values, the weighted sum divided by the unrounded weights' total, the
 * output rounded once. Each (row, kv head) is one thread's, its sums in a fixed order over
 * the keys it sees: a row's bytes do not depend on the batch, the padding or the threads. */
typedef struct {
    const void *q, *k, *v;
    const uint8_t *mask;
    void *out;                               /* [B, h, D] contiguous */
    float *work;                             /* threads * attend_one_floats */
    long qb, qh, kb, kh, ks, vb, vh, vs, mb;
    int batch, heads, kv_heads, dim, keys, threads;
    float scale;
} AttendOne;

long attend_one_floats(const AttendOne *a) {  /* per thread: queries, scores, sums */
    long group = a->heads / a->kv_heads;
    return group * (2L * a->dim + a->keys);
}

#pragma GCC diagnostic ignored "-Wpsabi"  /* wide vectors where the build lacks AVX-512: inlined */
#define VL 16
typedef float vl __attribute__((vector_size(4 * VL)));
typedef float vlu __attribute__((vector_size(4 * VL), aligned(4)));

typedef uint16_t vlh __attribute__((vector_size(2 * VL), aligned(2)));
typedef uint32_t vlw __attribute__((vector_size(4 * VL)));

static inline vl widen_bf16(const bf16 *p) {  /* 16 bfloat16 -> 16 floats, exactly */
    return (vl)(__builtin_convertvector(*(const vlh *)p, vlw) << 16);
}

typedef float vl8 __attribute__((vector_size(32)));
typedef float vl4 __attribute__((vector_size(16)));

static inline float lanes_sum(vl x) {  /* a fixed tree over the lanes, in registers */
    vl8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    vl4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (f[0] + f[2]) + (f[1] + f[3]);
}

#define MAX_GROUP 64  /* query heads per kv head (Python's MAX_GROUP) */

int attend_one_bf16(const AttendOne *a) {
    if (a->kv_heads <= 0 || a->heads % a->kv_heads || a->heads / a->kv_heads > MAX_GROUP
            || a->dim % VL)
        return -1;
    const int group = a->heads / a->kv_heads, D = a->dim, S = a->keys;
    const int items = a->batch * a->kv_heads;
    const long per = attend_one_floats(a);
    _Pragma("omp parallel for schedule(static) num_threads(a->threads)")
    for (int it = 0; it < items; it++) {
        int b = it / a->kv_heads, g = it % a->kv_heads;
        float *qf = a->work + (long)omp_get_thread_num() * per;  /* [group, D] */
        float *acc = qf + (long)group * D;                       /* [group, D] */
        float *sc = acc + (long)group * D;                       /* [group, S] */
        const uint8_t *seen = a->mask ? a->mask + (long)b * a->mb : NULL;
        const bf16 *kr = (const bf16 *)a->k + (long)b * a->kb + (long)g * a->kh;
        const bf16 *vr = (const bf16 *)a->v + (long)b * a->vb + (long)g * a->vh;
        for (int i = 0; i < group; i++) {
            const bf16 *qi = (const bf16 *)a->q + (long)b * a->qb + (long)(g * group + i) * a->qh;
            for (int d = 0; d < D; d++) qf[(long)i * D + d] = bf2f(qi[d]), acc[(long)i * D + d] = 0.f;
        }
        float top[MAX_GROUP], total[MAX_GROUP];
        for (int i = 0; i < group; i++) top[i] = -INFINITY, total[i] = 0.f;
        for (int t = 0; t < S; t++) {
            if (seen && !seen[t]) continue;
            const bf16 *kt = kr + (long)t * a->ks;
            vl s[MAX_GROUP];
            for (int i = 0; i < group; i++) s[i] = (vl){0};
            for (int d = 0; d < D; d += VL) {
                vl kv = widen_bf16(kt + d);
                for (int i = 0; i < group; i++) s[i] += *(const vlu *)(qf + (long)i * D + d) * kv;
            }
            for (int i = 0; i < group; i++) {
                float x = lanes_sum(s[i]) * a->scale;
                sc[(long)i * S + t] = x;
                top[i] = x > top[i] ? x : top[i];
            }
        }
        for (int t = 0; t < S; t++) {
            if (seen && !seen[t]) continue;
            const bf16 *vt = vr + (long)t * a->vs;
            float p[MAX_GROUP];
            for (int i = 0; i < group; i++) {
                float e = expf(sc[(long)i * S + t] - top[i]);
                total[i] += e;
                p[i] = bf2f(f2bf(e));
            }
            for (int d = 0; d < D; d += VL) {
                vl vv = widen_bf16(vt + d);
                for (int i = 0; i < group; i++) {
                    vlu *o = (vlu *)(acc + (long)i * D + d);
                    *o += p[i] * vv;
                }
            }
        }
        bf16 *out = (bf16 *)a->out + ((long)b * a->heads + (long)g * group) * D;
        for (int i = 0; i < group; i++)
            for (int d = 0; d < D; d++)
                out[(long)i * D + d] = f2bf(acc[(long)i * D + d] / total[i]);
    }
    return 0;
}
#undef MAX_GROUP
#undef VL
