// bfloat16 products y = x · Wᵀ for the small row counts a decode, a verify and a batch run at
// (common/native_linear.py), on AMX tiles where the CPU has them, else with AVX512-BF16's
// VDPBF16PS on the same packed weight, else (any x86-64 with AVX2 and FMA) with float32 FMAs on
// it, each bfloat16 widened as it is read.
//
// The weight is packed once at load into the tile layout TDPBF16PS reads (VNNI pairs):
//   packed[n_block][k_block][k_pair (16)][n (16)][2] = W[n_block*16 + n][k_block*32 + 2*k_pair + j]
// so each 16-output block streams its tiles in order, 1 KiB each. One 64-byte row of a tile is
// one input pair for 16 outputs: what VDPBF16PS multiplies by a broadcast pair of one row's
// inputs. Either way every output element is one chain over k in the same order whatever the
// row count and whatever rows sit beside it, and rows are stored one by one: a row's bits do not
// depend on the batch (the lossless bfloat16 mode needs exactly that). The caller names the
// kernel per call (its default is the CPU's, not a timing: the two chains round differently, and
// a choice that flipped between starts would change a deployment's outputs).
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_FMA256 1
#else
#define HAVE_FMA256 0
#endif

enum { AMX_OK = 0, AMX_MISSING = 1, AMX_BAD_SHAPE = 2, AMX_NO_MEMORY = 3 };
// the products' kernels (bits of splitspec_bf16_kernels)
enum { KERNEL_NONE = 0, KERNEL_AMX = 1, KERNEL_DPBF16 = 2, KERNEL_FMA256 = 4 };
enum { TILE_ROWS = 16, TILE_K = 32, TILE_N = 16, N_PER_STEP = 2 };

// float32 → bfloat16, nearest even, as torch rounds (denormals kept); NaN stays NaN, quieted.
// decoder_forward.c, which includes this file, rounds its stores with it too.
static inline uint16_t round_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Ask the kernel for the AMX register state (Linux gives it per process, on request).
int splitspec_amx_init(void) {
#if HAVE_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? AMX_OK : AMX_MISSING;
#else
    return AMX_MISSING;
#endif
}

// The kernels that run here, as bits: AMX where this build has it and Linux grants the tile state
// (requested here, for the process), VDPBF16PS where the build has AVX512-BF16, float32 FMAs
// where it has AVX2 and FMA.
int splitspec_bf16_kernels(void) {
    return (splitspec_amx_init() == AMX_OK ? KERNEL_AMX : 0) | (HAVE_DPBF16 ? KERNEL_DPBF16 : 0) |
           (HAVE_FMA256 ? KERNEL_FMA256 : 0);
}

static inline int kernel_runs(int kernel) {
    return (kernel == KERNEL_AMX && HAVE_AMX) || (kernel == KERNEL_DPBF16 && HAVE_DPBF16) ||
           (kernel == KERNEL_FMA256 && HAVE_FMA256);
}

#if HAVE_AMX
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

// Tiles 0-1 accumulate two 16-output blocks of `rows` rows, tile 2 holds the rows' 32 inputs,
// tiles 3-4 the two weight blocks.
static void configure_tiles(int rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 3; t++) {
        config.rows[t] = (uint8_t)rows;
        config.colsb[t] = 64;
    }
    for (int t = 3; t < 5; t++) {
        config.rows[t] = TILE_ROWS;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

// Round the float32 accumulators of `rows` rows × 16 outputs to bfloat16 (nearest even) or copy them.
static void store_block(const float *acc, int rows, void *y, int64_t row_stride, int64_t column, int out_f32) {
    for (int r = 0; r < rows; r++) {
        __m512 values = _mm512_loadu_ps(acc + r * TILE_N);
        if (out_f32) {
            _mm512_storeu_ps((float *)y + r * row_stride + column, values);
        } else {
            __m256bh rounded = _mm512_cvtneps_pbh(values);
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * row_stride + column), (__m256i)rounded);
        }
    }
}

// One block of up to 16 rows against output blocks [first, last) of the packed weight.
static void rows_against_blocks(const uint16_t *x, int rows, int64_t k, const uint16_t *packed, int64_t first,
                                int64_t last, void *y, int64_t n, int out_f32) {
    const int64_t k_blocks = k / TILE_K, block_elems = (int64_t)TILE_ROWS * TILE_N * 2;
    const int64_t x_stride = k * (int64_t)sizeof(uint16_t);
    float acc[2][TILE_ROWS * TILE_N] __attribute__((aligned(64)));
    int64_t nb = first;
    for (; nb + 1 < last; nb += N_PER_STEP) {
        const uint16_t *w0 = packed + nb * k_blocks * block_elems, *w1 = w0 + k_blocks * block_elems;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(2, x + kb * TILE_K, x_stride);
            _tile_loadd(3, w0 + kb * block_elems, 64);
            _tile_loadd(4, w1 + kb * block_elems, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        store_block(acc[0], rows, y, n, nb * TILE_N, out_f32);
        store_block(acc[1], rows, y, n, (nb + 1) * TILE_N, out_f32);
    }
    if (nb < last) {  // an odd block out: the same chain, on tile 0 alone
        const uint16_t *w0 = packed + nb * k_blocks * block_elems;
        _tile_zero(0);
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(2, x + kb * TILE_K, x_stride);
            _tile_loadd(3, w0 + kb * block_elems, 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        _tile_stored(0, acc[0], 64);
        store_block(acc[0], rows, y, n, nb * TILE_N, out_f32);
    }
}
#endif

#if HAVE_DPBF16
enum { DP_MAX_ROWS = 12, DP_MAX_ACC = 24 };  // accumulators kept in the 32 vector registers

// `rows` rows × `blocks` 16-output blocks over all of k: for each input pair, each block's 64-byte
// weight row once, against each row's pair broadcast. ROWS and BLOCKS are constants where this
// is inlined, so the accumulators stay in registers. An output's chain over the pairs is the
// same whatever ROWS and BLOCKS are: they only decide how many independent chains run side by
// side (a lone row takes 8 blocks, else one VDPBF16PS chain would wait on the last's latency).
static inline __attribute__((always_inline)) void dp_tile(const uint16_t *x, int64_t k, const uint16_t *w,
                                                          int64_t block_elems, void *y, int64_t n, int64_t column,
                                                          const int ROWS, const int BLOCKS, int out_f32) {
    __m512 acc[DP_MAX_ACC];
    for (int a = 0; a < ROWS * BLOCKS; a++) acc[a] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        // pair p is k_block p/16, k_pair p%16: 64 bytes at element 32 * p of each block's run
        __m512bh b[8];
        for (int j = 0; j < BLOCKS; j++) b[j] = (__m512bh)_mm512_loadu_si512(w + j * block_elems + 32 * p);
        for (int r = 0; r < ROWS; r++) {
            int32_t pair;
            memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < BLOCKS; j++) acc[r * BLOCKS + j] = _mm512_dpbf16_ps(acc[r * BLOCKS + j], a, b[j]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int j = 0; j < BLOCKS; j++) {
            const int64_t at = r * n + column + j * TILE_N;
            if (out_f32) {
                _mm512_storeu_ps((float *)y + at, acc[r * BLOCKS + j]);
            } else {
                __m256bh rounded = _mm512_cvtneps_pbh(acc[r * BLOCKS + j]);
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), (__m256i)rounded);
            }
        }
    }
}

// Blocks [first, last) for `ROWS` rows: as many blocks side by side as `wide` allows, then halves.
static inline __attribute__((always_inline)) void dp_rows(const uint16_t *x, int64_t k, const uint16_t *packed,
                                                          int64_t first, int64_t last, void *y, int64_t n,
                                                          const int ROWS, const int wide, int out_f32) {
    const int64_t block_elems = (int64_t)TILE_N * k;  // one 16-output block over all of k
    int64_t nb = first;
    for (; wide >= 8 && nb + 8 <= last; nb += 8)
        dp_tile(x, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 8, out_f32);
    for (; wide >= 4 && nb + 4 <= last; nb += 4)
        dp_tile(x, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 4, out_f32);
    for (; nb + 2 <= last; nb += 2)
        dp_tile(x, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 2, out_f32);
    if (nb < last) dp_tile(x, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 1, out_f32);
}

#define DP_CASE(R, WIDE) \
    case R: dp_rows(x, k, packed, first, last, y, n, R, WIDE, out_f32); break;

// Output blocks [first, last) of the packed weight for all m rows, DP_MAX_ROWS rows at a time.
static void dp_rows_against_blocks(const uint16_t *x_all, int64_t m, int64_t k, const uint16_t *packed,
                                   int64_t first, int64_t last, void *y_any, int64_t n, int out_f32) {
    for (int64_t r0 = 0; r0 < m; r0 += DP_MAX_ROWS) {
        const int rows = (int)(m - r0 < DP_MAX_ROWS ? m - r0 : DP_MAX_ROWS);
        void *y = out_f32 ? (void *)((float *)y_any + r0 * n) : (void *)((uint16_t *)y_any + r0 * n);
        const uint16_t *x = x_all + r0 * k;
        switch (rows) {
            DP_CASE(1, 8) DP_CASE(2, 8) DP_CASE(3, 4) DP_CASE(4, 4) DP_CASE(5, 4) DP_CASE(6, 4)
            DP_CASE(7, 2) DP_CASE(8, 2) DP_CASE(9, 2) DP_CASE(10, 2) DP_CASE(11, 2) DP_CASE(12, 2)
            default: break;
        }
    }
}
#endif

#if HAVE_FMA256
// Rows per pass over the weight: 2 accumulators a row (16 outputs), so 5 rows hold 10 of the 16
// ymm registers, leaving room for the widened weight halves, the mask and the broadcast input
// (6 rows spilled accumulators to the stack and ran 9-20% slower at 16 rows on an AMD EPYC, Zen 3).
enum { FMA_MAX_ROWS = 5 };

// `rows` rows × `blocks` 16-output blocks over all of k in float32 FMAs. `xf` holds the rows'
// inputs already widened to float32 (k apart), so an input is one broadcast load. For each input
// pair, each block's 64-byte weight row is widened into its even inputs' 16 floats and every row
// gets acc += x_even · w_even; then the same for the odd inputs. Every accumulator thus sees
// x_even then x_odd for each pair in turn, whatever ROWS and BLOCKS are (a row's bits do not
// depend on its neighbours). Measured on an AMD EPYC (Zen 3) against the kernel before, which
// broadcast each input from a scalar per row, 4 rows a pass: 5-15% faster at 4-16 rows, the same
// at one; it runs the FMAs at about 55% of their peak.
static inline __attribute__((always_inline)) void fma_tile(const float *xf, int64_t k, const uint16_t *w,
                                                           int64_t block_elems, void *y, int64_t n, int64_t column,
                                                           const int ROWS, const int BLOCKS, int out_f32) {
    __m256 acc[2 * FMA_MAX_ROWS];  // ROWS x BLOCKS <= FMA_MAX_ROWS
#pragma GCC unroll 16
    for (int a = 0; a < 2 * ROWS * BLOCKS; a++) acc[a] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
#pragma GCC unroll 8
        for (int j = 0; j < BLOCKS; j++) {
            // 16 outputs x (even, odd), read once for each half: a widening instruction takes its
            // operand from memory, so no register holds the raw row (they are all the accumulators')
            const __m256i *row = (const __m256i *)(w + j * block_elems + 32 * p);
            const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row), 16));
            const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row + 1), 16));
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const __m256 x_even = _mm256_broadcast_ss(xf + r * k + 2 * p);
                __m256 *a = acc + 2 * (r * BLOCKS + j);
                a[0] = _mm256_fmadd_ps(x_even, even_lo, a[0]);
                a[1] = _mm256_fmadd_ps(x_even, even_hi, a[1]);
            }
            const __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(row), high));
            const __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(row + 1), high));
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const __m256 x_odd = _mm256_broadcast_ss(xf + r * k + 2 * p + 1);
                __m256 *a = acc + 2 * (r * BLOCKS + j);
                a[0] = _mm256_fmadd_ps(x_odd, odd_lo, a[0]);
                a[1] = _mm256_fmadd_ps(x_odd, odd_hi, a[1]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int j = 0; j < BLOCKS; j++) {
            const int64_t at = r * n + column + j * TILE_N;
            float out[TILE_N];
            _mm256_storeu_ps(out, acc[2 * (r * BLOCKS + j)]);
            _mm256_storeu_ps(out + 8, acc[2 * (r * BLOCKS + j) + 1]);
            if (out_f32) {
                memcpy((float *)y + at, out, sizeof out);
            } else {
                for (int i = 0; i < TILE_N; i++) ((uint16_t *)y)[at + i] = round_to_bf16(out[i]);
            }
        }
    }
}

// One row group against blocks [first, last): as many blocks a pass as registers allow (a decode's
// one row takes 5, so 10 chains run side by side as in a 5-row pass).
static inline __attribute__((always_inline)) void fma_rows(const float *xf, int64_t k, const uint16_t *packed,
                                                           int64_t first, int64_t last, void *y, int64_t n,
                                                           const int ROWS, const int WIDE, int out_f32) {
    const int64_t block_elems = (int64_t)TILE_N * k;
    int64_t nb = first;
    for (; WIDE >= 5 && nb + 5 <= last; nb += 5)
        fma_tile(xf, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 5, out_f32);
    for (; WIDE >= 4 && nb + 4 <= last; nb += 4)
        fma_tile(xf, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 4, out_f32);
    for (; WIDE >= 2 && nb + 2 <= last; nb += 2)
        fma_tile(xf, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 2, out_f32);
    for (; nb < last; nb++) fma_tile(xf, k, packed + nb * block_elems, block_elems, y, n, nb * TILE_N, ROWS, 1, out_f32);
}

#define FMA_CASE(R, WIDE) \
    case R: fma_rows(xf, k, packed, first, last, y, n, R, WIDE, out_f32); break;

// bfloat16 → float32 is exact (the bits shifted up), so widening the inputs once changes no product.
static inline void widen_rows(const uint16_t *x, int64_t count, float *out) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < count; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(out + i, &bits, sizeof bits);
    }
}

// Row groups of FMA_MAX_ROWS, split so that no group is much shorter than the others (9 rows: 5 + 4,
// 11: 4 + 4 + 3, not 5 + 5 + 1: a short group re-reads the whole weight for few rows).
static int fma_group_rows(int64_t remaining) {
    const int64_t groups = (remaining + FMA_MAX_ROWS - 1) / FMA_MAX_ROWS;
    return (int)((remaining + groups - 1) / groups);
}

// `xf_all`: the m rows of x widened to float32 (widen_rows).
static void fma_rows_against_blocks(const float *xf_all, int64_t m, int64_t k, const uint16_t *packed,
                                    int64_t first, int64_t last, void *y_any, int64_t n, int out_f32) {
    for (int64_t r0 = 0; r0 < m;) {
        const int rows = fma_group_rows(m - r0);
        void *y = out_f32 ? (void *)((float *)y_any + r0 * n) : (void *)((uint16_t *)y_any + r0 * n);
        const float *xf = xf_all + r0 * k;
        switch (rows) {
            FMA_CASE(1, 5) FMA_CASE(2, 2) FMA_CASE(3, 1) FMA_CASE(4, 1) FMA_CASE(5, 1)
            default: break;
        }
        r0 += rows;
    }
}
#endif

// y[m, n] = x[m, k] · W[n, k]ᵀ, x bfloat16 (rows contiguous), W packed as above, y bfloat16 or
// float32. k a multiple of 32, n of 16. Output blocks are split between the OpenMP threads in
// pairs; each thread runs every row against its own, on `kernel` (KERNEL_AMX only once
// splitspec_bf16_kernels has reported it: the tile state is requested there).
int splitspec_tiled_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, void *y,
                           int out_f32, int max_threads, int kernel) {
    if (!kernel_runs(kernel)) return AMX_MISSING;
    if (m < 0 || k <= 0 || n <= 0 || k % TILE_K || n % TILE_N) return AMX_BAD_SHAPE;
    if (m == 0) return AMX_OK;
    const int64_t n_blocks = n / TILE_N, pairs = (n_blocks + 1) / 2;
    int threads = max_threads > 0 ? max_threads : 1;
    if (threads > pairs) threads = (int)pairs;
    // the FMA kernel reads x widened to float32, once for every thread (a decode's row: on the stack)
    float *xf = NULL;
#if HAVE_FMA256
    float xf_stack[2048];
    if (kernel == KERNEL_FMA256) {
        xf = m * k <= 2048 ? xf_stack : malloc(sizeof(float) * (size_t)(m * k));
        if (xf == NULL) return AMX_NO_MEMORY;
        widen_rows(x, m * k, xf);
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = 2 * (pairs * me / team), last_pair = pairs * (me + 1) / team;
        const int64_t last = 2 * last_pair < n_blocks ? 2 * last_pair : n_blocks;
#if HAVE_AMX
        if (kernel == KERNEL_AMX) {
            int configured = -1;
            for (int64_t r0 = 0; r0 < m && first < last; r0 += TILE_ROWS) {
                const int rows = (int)(m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS);
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                void *y_rows = out_f32 ? (void *)((float *)y + r0 * n) : (void *)((uint16_t *)y + r0 * n);
                rows_against_blocks(x + r0 * k, rows, k, packed, first, last, y_rows, n, out_f32);
            }
            if (configured >= 0) _tile_release();
        }
#endif
#if HAVE_DPBF16
        if (kernel == KERNEL_DPBF16 && first < last) dp_rows_against_blocks(x, m, k, packed, first, last, y, n, out_f32);
#endif
#if HAVE_FMA256
        if (kernel == KERNEL_FMA256 && first < last)
            fma_rows_against_blocks(xf, m, k, packed, first, last, y, n, out_f32);
#endif
        (void)kernel, (void)first, (void)last;
    }
#if HAVE_FMA256
    if (xf != xf_stack) free(xf);  // free(NULL) where another kernel ran
#endif
    (void)xf;
    return AMX_OK;
}
