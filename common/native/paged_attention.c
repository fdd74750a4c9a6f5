/* Paged attention over the shared KV pool on a CPU: one query row at a time.
 *
 * Built at load by common/native_attention.py (the machine's C compiler, -march=native) and
 * called through ctypes. Every row is computed alone, in the same order whatever else is in
 * the step, so a row's output has the same bits in a decode, a verify or any batch.
 *
 * The pool region of one layer: [num_pages, 2 (K, V), ...] with byte strides given per call,
 * so both page orders (NHD: [ps, H, D], HND: [H, ps, D]) read through the same code. Page
 * values are float32, bfloat16, or one byte read through a 256-entry table (fp8 e4m3/e5m2,
 * the table already multiplied by the plane's scale). Every page id is checked against the
 * pool before it is read: the tables may come from another process.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_BYTE_TABLE = 2 };
enum { OK = 0, BAD_PAGE = 1, BAD_LENGTH = 2, NO_MEMORY = 3, BAD_KIND = 4 };

typedef struct {
    const uint8_t *base;   /* the layer's region */
    int64_t page_stride;   /* bytes */
    int64_t plane_stride;  /* bytes from K to V */
    int64_t token_stride;  /* bytes */
    int64_t head_stride;   /* bytes */
    int64_t num_pages;
    int32_t page_size;
} Pool;

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* e^x for x in [-87, 88] (clamped there), within 2 ulp of expf, in straight-line code the
 * compiler vectorizes (glibc's expf is a call per element): x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its degree-6 Taylor polynomial, times 2^n built in the exponent bits. The softmax takes
 * it of scores minus their row's largest (x <= 0), the forward's SiLU of any gate. */
static inline __attribute__((always_inline)) float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* 8 floats, any alignment */

static inline __attribute__((always_inline)) float sum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* a . b over `dim` floats: whole vectors of 8 when dim allows (64 and 128 unrolled by the compiler). */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int dim) {
    if (dim % 8 != 0) {
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += a[d] * b[d];
        return sum;
    }
    v8 acc0 = {0}, acc1 = {0};
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        acc0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
        acc1 += *(const v8 *)(a + d + 8) * *(const v8 *)(b + d + 8);
    }
    if (d < dim) acc0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
    return sum8(acc0 + acc1);
}

/* out += sum_j p[j] * rows[j] over `count` rows of `dim` floats, the output held in registers
 * across the rows when dim is 64. */
static inline __attribute__((always_inline)) void
weighted_sum(float *out, const float *p, const float *const *rows, int32_t count, int dim) {
    if (dim == 64) {
        v8 acc[8] = {{0}};
        for (int32_t j = 0; j < count; j++) {
            const float w = p[j];
            for (int c = 0; c < 8; c++) acc[c] += w * *(const v8 *)(rows[j] + 8 * c);
        }
        for (int c = 0; c < 8; c++) *(v8 *)(out + 8 * c) = acc[c];
        return;
    }
    memset(out, 0, sizeof(float) * dim);
    for (int32_t j = 0; j < count; j++)
        for (int d = 0; d < dim; d++) out[d] += p[j] * rows[j][d];
}

/* Pointers to the first `count` keys' (plane 0) or values' (plane 1) vectors of one head, as
 * float32: straight into the pages for float32 pages, else converted into `staging`. */
static inline __attribute__((always_inline)) void
vectors_of(const Pool *pool, const int32_t *pages, int32_t count, int head, int plane, int kind,
           const float *table, int dim, float *staging, const float **rows) {
    for (int32_t j = 0; j < count; j++) {
        const uint8_t *at = pool->base + plane * pool->plane_stride +
                            pages[j / pool->page_size] * pool->page_stride +
                            (j % pool->page_size) * pool->token_stride + head * pool->head_stride;
        if (kind == KV_F32) {
            rows[j] = (const float *)at;
            continue;
        }
        float *row = staging + (int64_t)j * dim;
        if (kind == KV_BF16) {
            const uint16_t *in = (const uint16_t *)at;
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(in[d]);
        } else {
            for (int d = 0; d < dim; d++) row[d] = table[at[d]];
        }
        rows[j] = row;
    }
}

/* One KV head of one sequence: its rows (q [R, Hq, D]), of which row r sees the sequence's first
 * keys[r] keys. Each key and value is located (and converted) once for all the rows. */
static inline __attribute__((always_inline)) void
attend_head(const float *q, float *out, int32_t rows, const int32_t *keys, int32_t longest, const Pool *pool,
            int kind, const float *k_table, const float *v_table, const int32_t *pages, int h, int q_heads,
            int kv_heads, int dim, float scale, float *scores, float *staging, const float **key_rows,
            const float **value_rows) {
    const int group = q_heads / kv_heads;
    const int64_t row_floats = (int64_t)q_heads * dim;
    vectors_of(pool, pages, longest, h, 0, kind, k_table, dim, staging, key_rows);
    vectors_of(pool, pages, longest, h, 1, kind, v_table, dim, staging + (int64_t)longest * dim, value_rows);
    for (int32_t r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            const float *query = q + r * row_floats + (h * group + g) * dim;
            float top = -INFINITY;
            for (int32_t j = 0; j < keys[r]; j++) {
                scores[j] = dot(query, key_rows[j], dim) * scale;
                top = scores[j] > top ? scores[j] : top;
            }
            float total = 0.0f;
            for (int32_t j = 0; j < keys[r]; j++) {
                scores[j] = exp_clamped(scores[j] - top);
                total += scores[j];
            }
            const float inverse = 1.0f / total;
            for (int32_t j = 0; j < keys[r]; j++) scores[j] *= inverse;
            weighted_sum(out + r * row_floats + (h * group + g) * dim, scores, value_rows, keys[r], dim);
        }
    }
}

/* The longest key count of sequence b's rows, after checking every count and page id it needs;
 * negative: the error. */
static int32_t checked_longest(const Pool *pool, const int32_t *keys, int32_t rows, const int32_t *pages,
                               int64_t table_len) {
    int32_t longest = 0;
    for (int32_t r = 0; r < rows; r++) {
        if (keys[r] < 1 || keys[r] > table_len * pool->page_size) return -BAD_LENGTH;
        longest = keys[r] > longest ? keys[r] : longest;
    }
    for (int64_t p = 0; p < (longest + pool->page_size - 1) / pool->page_size; p++)
        if (pages[p] < 0 || pages[p] >= pool->num_pages) return -BAD_PAGE;
    return longest;
}

/* Every sequence's row range, key counts and the page ids they need (sequence b owns rows
 * row_start[b] .. row_start[b + 1] - 1 of total_rows); the most keys any row sees, at least 1;
 * negative: the error. */
static int32_t checked_sequences(const Pool *pool, const int32_t *page_table, int64_t table_len, int64_t num_seqs,
                                 const int32_t *row_start, const int32_t *row_keys, int64_t total_rows) {
    if (num_seqs < 0 || row_start[0] != 0 || row_start[num_seqs] > total_rows) return -BAD_LENGTH;
    int32_t most = 1;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int32_t rows = row_start[b + 1] - row_start[b];
        if (rows < 0) return -BAD_LENGTH;
        const int32_t longest = checked_longest(pool, row_keys + row_start[b], rows, page_table + b * table_len,
                                                table_len);
        if (longest < 0) return longest;
        most = longest > most ? longest : most;
    }
    return most;
}

/* Attention of every query row (q, out: float32 [T, Hq, D]) over its sequence's pages. Sequence
 * b owns rows row_start[b] .. row_start[b + 1] - 1 and the pages page_table[b, :table_len]; row t
 * sees that sequence's first row_keys[t] keys. The (sequence, KV head) pairs are shared out over
 * `threads` OpenMP threads (the caller's runtime: torch's, when torch loaded libgomp first). */
int splitspec_paged_attention(const float *q, float *out, const uint8_t *base, int64_t page_stride,
                              int64_t plane_stride, int64_t token_stride, int64_t head_stride,
                              int64_t num_pages, int32_t page_size, int kind, const float *k_table,
                              const float *v_table, const int32_t *page_table, int64_t table_len,
                              int64_t num_seqs, const int32_t *row_start, const int32_t *row_keys,
                              int64_t total_rows, int q_heads, int kv_heads, int dim, float scale, int threads) {
    if (kind != KV_F32 && kind != KV_BF16 && kind != KV_BYTE_TABLE) return BAD_KIND;
    if (kv_heads < 1 || q_heads % kv_heads != 0 || dim < 1 || page_size < 1) return BAD_LENGTH;
    const Pool pool = {base, page_stride, plane_stride, token_stride, head_stride, num_pages, page_size};
    const int32_t most = checked_sequences(&pool, page_table, table_len, num_seqs, row_start, row_keys, total_rows);
    if (most < 0) return -most;
    int status = OK;
    const int64_t items = num_seqs * kv_heads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (items > 1)
    {
        /* two arrays of row pointers, then the scores of one query row and the staged K and V */
        void *block = malloc(sizeof(float *) * 2 * (size_t)most + sizeof(float) * (size_t)most * (1 + 2 * (size_t)dim));
        if (block == NULL) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
        const float **key_rows = (const float **)block;
        const float **value_rows = key_rows + most;
        float *scores = (float *)(value_rows + most);
        float *staging = scores + most;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (block == NULL) continue;
            const int64_t b = item / kv_heads;
            const int h = (int)(item % kv_heads);
            const int32_t first = row_start[b], rows = row_start[b + 1] - row_start[b];
            if (rows == 0) continue;
            const int32_t *keys = row_keys + first, *pages = page_table + b * table_len;
            int32_t longest = 0;
            for (int32_t r = 0; r < rows; r++) longest = keys[r] > longest ? keys[r] : longest;
            const float *q_rows = q + (int64_t)first * q_heads * dim;
            float *out_rows = out + (int64_t)first * q_heads * dim;
            if (kind == KV_F32)
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_F32, k_table, v_table, pages, h, q_heads,
                            kv_heads, dim, scale, scores, staging, key_rows, value_rows);
            else if (kind == KV_BF16)
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_BF16, k_table, v_table, pages, h,
                            q_heads, kv_heads, dim, scale, scores, staging, key_rows, value_rows);
            else
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_BYTE_TABLE, k_table, v_table, pages, h,
                            q_heads, kv_heads, dim, scale, scores, staging, key_rows, value_rows);
        }
        free(block);
    }
    return status;
}

/* Store this step's K and V (already in the page dtype, [T, H, D] contiguous, `vector_bytes`
 * per head) at their slots (page * page_size + offset). */
int splitspec_write_kv(const uint8_t *k, const uint8_t *v, const int64_t *slots, int64_t rows, uint8_t *base,
                       int64_t page_stride, int64_t plane_stride, int64_t token_stride, int64_t head_stride,
                       int64_t num_pages, int32_t page_size, int kv_heads, int64_t vector_bytes) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] / page_size >= num_pages) return BAD_PAGE;
    for (int64_t t = 0; t < rows; t++) {
        uint8_t *at = base + (slots[t] / page_size) * page_stride + (slots[t] % page_size) * token_stride;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t from = (t * kv_heads + h) * vector_bytes;
            memcpy(at + h * head_stride, k + from, vector_bytes);
            memcpy(at + plane_stride + h * head_stride, v + from, vector_bytes);
        }
    }
    return OK;
}
