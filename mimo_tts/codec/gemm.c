/* float32 products as three bfloat16 AMX products ("bf16x3"): x = xh + xl and w = wh + wl,
 * each half rounded to bfloat16 (hi = bf16(v), lo = bf16(v - hi)); y = xh.wh + xh.wl + xl.wh
 * accumulated in float32 tiles, then + bias (+ residual) in float32. About 16 mantissa bits of
 * each operand survive, so y is within ~1e-5 (relative) of the float32 product.
 * Shapes: M rows of x, K inputs, N outputs; weights packed once (`pack_weight`), x split per
 * call into a zero-padded scratch (`split_rows`). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

typedef uint16_t bf16;

static inline bf16 f2bf(float f) {  /* round to nearest even (no NaN inputs here) */
    union { float f; uint32_t u; } c = {f};
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float bf2f(bf16 v) {
    union { uint32_t u; float f; } c = {(uint32_t)v << 16};
    return c.f;
}

static inline long up(long v, long to) { return (v + to - 1) / to * to; }

/* Bytes of a packed [N, K] weight: 32-column blocks x 32-input chunks x (hi, lo) tiles. */
long packed_bytes(long n, long k) { return up(n, 32) * up(k, 32) * 4; }

/* Tile (column block c of 16, chunk q of 32 inputs, half h) at ((c * chunks + q) * 2 + h) * 512
 * bf16, in the VNNI layout of an AMX B operand: [16 input pairs][16 columns][2]. */
void pack_weight(const float *w, long n, long k, int threads, bf16 *out) {
    long chunks = up(k, 32) / 32, blocks = up(n, 32) / 16;
#pragma omp parallel for num_threads(threads) collapse(2)
    for (long c = 0; c < blocks; c++)
        for (long q = 0; q < chunks; q++) {
            bf16 *hi = out + (c * chunks + q) * 1024, *lo = hi + 512;
            for (int p = 0; p < 16; p++)
                for (int j = 0; j < 16; j++)
                    for (int e = 0; e < 2; e++) {
                        long row = c * 16 + j, col = q * 32 + 2 * p + e;
                        float v = row < n && col < k ? w[row * k + col] : 0.0f;
                        bf16 h = f2bf(v);
                        hi[p * 32 + j * 2 + e] = h;
                        lo[p * 32 + j * 2 + e] = f2bf(v - bf2f(h));
                    }
        }
}

/* x [m, k] (row stride ldx) -> hi and lo [up(m, 32), up(k, 32)] bf16, padding zero. */
void split_rows(const float *x, long m, long k, long ldx, int threads, bf16 *hi, bf16 *lo) {
    long rows = up(m, 32), cols = up(k, 32);
#pragma omp parallel for num_threads(threads)
    for (long r = 0; r < rows; r++) {
        bf16 *h = hi + r * cols, *l = lo + r * cols;
        if (r >= m) {
            memset(h, 0, cols * 2), memset(l, 0, cols * 2);
            continue;
        }
        const float *xr = x + r * ldx;
        for (long i = 0; i < k; i++) {
            bf16 v = f2bf(xr[i]);
            h[i] = v;
            l[i] = f2bf(xr[i] - bf2f(v));
        }
        for (long i = k; i < cols; i++) h[i] = l[i] = 0;
    }
}

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_state = -1;  /* -1 unknown, 0 unavailable, 1 granted to this process */

int amx_enable(void) {
    if (amx_state < 0)  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (Linux >= 5.16) */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

static void configure(void) {  /* eight 16 x 64-byte tiles: C 0-3, A 4-5, B 6-7 */
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* C[2i + j] += A[i] . B[j] for the 2 x 2 blocks (the tile intrinsics are statements). */
#define DP4() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); \
                   _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)

/* One 32 x 32 block of y at rows r, columns 32 * b, over input chunks q0..q1 of 32 (hi, lo:
 * `split_rows`; w: `pack_weight`). Partial sums of earlier chunks wait in acc [., ldacc]; the
 * last chunk adds bias (and res) and writes y. */
static void block(const bf16 *hi, const bf16 *lo, const bf16 *w, long m, long n, long k,
                  long r, long b, long q0, long q1, float *acc, long ldacc,
                  const float *bias, const float *res, float *y) {
    long cols = up(k, 32), chunks = cols / 32, stride = cols * 2;
    const bf16 *w0 = w + 2 * b * chunks * 1024, *w1 = w0 + chunks * 1024;
    const bf16 *h0 = hi + r * cols, *h1 = h0 + 16 * cols, *l0 = lo + r * cols, *l1 = l0 + 16 * cols;
    float *a = acc ? acc + r * ldacc + 32 * b : NULL;
    if (q0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, a, ldacc * 4);
        _tile_loadd(1, a + 16, ldacc * 4);
        _tile_loadd(2, a + 16 * ldacc, ldacc * 4);
        _tile_loadd(3, a + 16 * ldacc + 16, ldacc * 4);
    }
    for (long q = q0; q < q1; q++) {
        const bf16 *b0 = w0 + q * 1024, *b1 = w1 + q * 1024;
        _tile_loadd(4, h0 + q * 32, stride);
        _tile_loadd(5, h1 + q * 32, stride);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b1, 64);
        DP4();
        _tile_loadd(6, b0 + 512, 64);
        _tile_loadd(7, b1 + 512, 64);
        DP4();
        _tile_loadd(4, l0 + q * 32, stride);
        _tile_loadd(5, l1 + q * 32, stride);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b1, 64);
        DP4();
    }
    if (q1 < chunks) {
        _tile_stored(0, a, ldacc * 4);
        _tile_stored(1, a + 16, ldacc * 4);
        _tile_stored(2, a + 16 * ldacc, ldacc * 4);
        _tile_stored(3, a + 16 * ldacc + 16, ldacc * 4);
        return;
    }
    float tile[32][32];
    _tile_stored(0, &tile[0][0], 128);
    _tile_stored(1, &tile[0][16], 128);
    _tile_stored(2, &tile[16][0], 128);
    _tile_stored(3, &tile[16][16], 128);
    long c0 = 32 * b, width = n - c0 < 32 ? n - c0 : 32;
    for (int i = 0; i < 32 && r + i < m; i++) {
        float *out = y + (r + i) * n + c0;
        const float *add = res ? res + (r + i) * n + c0 : NULL;
        for (int j = 0; j < width; j++)
            out[j] = tile[i][j] + (bias ? bias[c0 + j] : 0.0f) + (add ? add[j] : 0.0f);
    }
}

#define K_CHUNKS 40  /* inputs per pass (x 32): a pass's weight panels and rows stay in L2 */
#define GROUP_BYTES (1L << 20)  /* weight bytes of the column blocks one row block passes */

/* y [m, n] = x . w^T + bias (+ res [m, n]); hi/lo from `split_rows`, w from `pack_weight`;
 * 0, or -1 where the partial sums found no memory. Inputs go in passes of K_CHUNKS chunks; in a pass each thread takes (column group, row
 * block) pairs in order, so a group's weight panels are reused from L2 by consecutive rows. */
int gemm(const bf16 *hi, const bf16 *lo, const bf16 *w, long m, long n, long k,
         const float *bias, const float *res, float *y, int threads) {
    long row_blocks = up(m, 32) / 32, col_blocks = up(n, 32) / 32, chunks = up(k, 32) / 32;
    long pass = chunks < K_CHUNKS ? chunks : K_CHUNKS;
    long group = GROUP_BYTES / (pass * 32 * 32 * 4);
    group = group < 1 ? 1 : group > col_blocks ? col_blocks : group;
    long groups = (col_blocks + group - 1) / group, ldacc = up(n, 32);
    float *acc = chunks > pass ? aligned_alloc(64, up(m, 32) * ldacc * 4) : NULL;
    if (chunks > pass && !acc) return -1;
#pragma omp parallel num_threads(threads)
    {
        configure();
        for (long q0 = 0; q0 < chunks; q0 += pass) {
            long q1 = q0 + pass < chunks ? q0 + pass : chunks;
#pragma omp for collapse(2) schedule(static)
            for (long g = 0; g < groups; g++)
                for (long r = 0; r < row_blocks; r++)
                    for (long b = g * group; b < (g + 1) * group && b < col_blocks; b++)
                        block(hi, lo, w, m, n, k, r * 32, b, q0, q1, acc, ldacc, bias, res, y);
        }
        _tile_release();
    }
    free(acc);
    return 0;
}
#else
int amx_enable(void) { return 0; }

int gemm(const bf16 *hi, const bf16 *lo, const bf16 *w, long m, long n, long k,
         const float *bias, const float *res, float *y, int threads) {
    (void)hi, (void)lo, (void)w, (void)m, (void)n, (void)k, (void)bias, (void)res, (void)y;
    (void)threads;
    return -1;
}
#endif

/* 1: AMX tiles compiled in and granted to this process. */
int features(void) {
#if HAVE_AMX
    return amx_state == 1;
#else
    return 0;
#endif
}
