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

enum { PREFETCH_PAGES = 4 };  /* how far ahead of the key being read its page's successor is fetched */

/* Asks for one head's vectors of the page `ahead` pages past page index `page` of the K (plane 0) or V
 * (plane 1) walk over `pages_used` pages: past K's last page, V's first ones. The page reads are
 * strided (one head of every token) and follow a page table, which the hardware prefetcher cannot
 * follow: without this a decode waits on the cache for each key (most of the attention's time). */
static inline __attribute__((always_inline)) void
prefetch_page_ahead(const Pool *pool, const int32_t *pages, int64_t page, int64_t pages_used, int head, int plane,
                    int64_t vector_bytes) {
    int64_t next = page + PREFETCH_PAGES;
    if (plane == 0 && next >= pages_used) next -= pages_used, plane = 1;
    if (next >= pages_used) return;
    const uint8_t *at = pool->base + plane * pool->plane_stride + pages[next] * pool->page_stride +
                        head * pool->head_stride;
    for (int32_t t = 0; t < pool->page_size; t++, at += pool->token_stride)
        for (int64_t b = 0; b < vector_bytes; b += 64) __builtin_prefetch(at + b, 0, 3);
}

/* Pointers to keys' (plane 0) or values' (plane 1) vectors from .. to - 1 of one head, as float32:
 * straight into the pages for float32 pages, else converted into `staging` (key j at row j - from).
 * `keys`: how many the walk reads in all (what is fetched ahead stays inside them). */
static inline __attribute__((always_inline)) void
vectors_of(const Pool *pool, const int32_t *pages, int32_t from, int32_t to, int32_t keys, int head, int plane,
           int kind, const float *table, int dim, float *staging, const float **rows) {
    const uint8_t *page = NULL;
    const int64_t pages_used = ((int64_t)keys + pool->page_size - 1) / pool->page_size;
    const int64_t vector_bytes = (int64_t)dim * (kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1);
    for (int32_t j = from, offset = from % pool->page_size; j < to; j++, offset++) {
        if (page == NULL || offset == pool->page_size) {  /* the next page (no division per key) */
            const int64_t index = j / pool->page_size;
            page = pool->base + plane * pool->plane_stride + pages[index] * pool->page_stride +
                   head * pool->head_stride;
            offset = j % pool->page_size;
            prefetch_page_ahead(pool, pages, index, pages_used, head, plane, vector_bytes);
        }
        const uint8_t *at = page + offset * pool->token_stride;
        if (kind == KV_F32) {
            rows[j] = (const float *)at;
            continue;
        }
        float *row = staging + (int64_t)(j - from) * dim;
        if (kind == KV_BF16) {
            const uint16_t *in = (const uint16_t *)at;
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(in[d]);
        } else {
            for (int d = 0; d < dim; d++) row[d] = table[at[d]];
        }
        rows[j] = row;
    }
}

/* Sixteen floats at any alignment; what follows runs on AVX-512 as one register and on AVX2 as two. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16x __attribute__((vector_size(64), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

static inline __attribute__((always_inline)) v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline __attribute__((always_inline)) v16 select16(i16x mask, v16 yes, v16 no) {
    return (v16)(((i16x)yes & mask) | ((i16x)no & ~mask));
}

/* exp_clamped on 16 lanes (n rounded half away from zero, as roundf: a conversion truncates) */
static inline __attribute__((always_inline)) v16 exp_clamped_v16(v16 x) {
    x = select16(x < splat16(-87.0f), splat16(-87.0f), x);
    x = select16(x > splat16(88.0f), splat16(88.0f), x);
    const v16 y = x * splat16(1.44269504088896341f);
    const i16x whole = __builtin_convertvector(y + select16(y < splat16(0.0f), splat16(-0.5f), splat16(0.5f)), i16x);
    const v16 n = __builtin_convertvector(whole, v16);
    const v16 r = (x - n * splat16(0.693145751953125f)) - n * splat16(1.42860682030941723e-6f);
    v16 p = splat16(1.0f / 720.0f);
    p = p * r + splat16(1.0f / 120.0f);
    p = p * r + splat16(1.0f / 24.0f);
    p = p * r + splat16(1.0f / 6.0f);
    p = p * r + splat16(0.5f);
    p = p * r + splat16(1.0f);
    p = p * r + splat16(1.0f);
    const i16x bits = (whole + 127) << 23;
    return p * (v16)bits;
}

/* The sum of 16 lanes in one fixed order (halves, then quarters, ...). */
static inline __attribute__((always_inline)) float sum16(v16 a) {
    const v16 h = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    const v16 q = h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    const v16 e = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return e[0] + e[1];
}

/* query . key over `dim` floats (a multiple of 16) for four keys at once, lane-wise in dimension order,
 * then each key's 16 lanes summed in sum16's order: a key's score is the same in any slot. */
static inline __attribute__((always_inline)) v4
dots4(const float *query, const float *k0, const float *k1, const float *k2, const float *k3, int dim) {
    v16 a0 = splat16(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < dim; d += 16) {
        const v16 qd = *(const v16 *)(query + d);
        a0 += qd * *(const v16 *)(k0 + d);
        a1 += qd * *(const v16 *)(k1 + d);
        a2 += qd * *(const v16 *)(k2 + d);
        a3 += qd * *(const v16 *)(k3 + d);
    }
    /* halves: x = [a0's 8 | a1's 8], y = [a2's | a3's] */
    const v16 x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16 y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* quarters: 4 lanes a key */
    const v16 z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    /* eighths: 2 lanes a key, then one */
    const v16 u = z + __builtin_shufflevector(z, z, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return (v4){u[0] + u[1], u[4] + u[5], u[8] + u[9], u[12] + u[13]};
}

/* The scores of one query vector against keys from .. to - 1 (from a multiple of 4), times `scale`,
 * four keys a pass (a short last pass repeats key to - 1 and drops it). */
static inline __attribute__((always_inline)) void
scores16(const float *query, const float *const *key_rows, int32_t from, int32_t to, int dim, float scale,
         float *scores) {
    const int32_t last = to - 1;
    for (int32_t j = from; j < to; j += 4) {
        const v4 s = dots4(query, key_rows[j], key_rows[j + 1 < to ? j + 1 : last],
                           key_rows[j + 2 < to ? j + 2 : last], key_rows[j + 3 < to ? j + 3 : last], dim);
        for (int i = 0; i < 4 && j + i < to; i++) scores[j + i] = s[i] * scale;
    }
}

/* scores[0 .. count - 1] → softmax weights in place: e^(s - the largest) / their sum, summed lane-wise
 * over whole vectors (the tail's lanes 0) then in sum16's order. `scores` has room for count rounded up
 * to 16. */
static inline __attribute__((always_inline)) void softmax16(float *scores, int32_t count) {
    const int32_t padded = (count + 15) & ~15;
    for (int32_t j = count; j < padded; j++) scores[j] = -INFINITY;
    v16 top = splat16(-INFINITY);
    for (int32_t j = 0; j < padded; j += 16) {
        const v16 s = *(const v16 *)(scores + j);
        top = select16(s > top, s, top);
    }
    float largest = top[0];
    for (int i = 1; i < 16; i++) largest = top[i] > largest ? top[i] : largest;
    v16 total = splat16(0.0f);
    for (int32_t j = 0; j < padded; j += 16) {
        const v16 s = *(const v16 *)(scores + j);
        const v16 e = select16(s == splat16(-INFINITY), splat16(0.0f), exp_clamped_v16(s - splat16(largest)));
        total += e;
        *(v16 *)(scores + j) = e;
    }
    const v16 inverse = splat16(1.0f / sum16(total));
    for (int32_t j = 0; j < padded; j += 16) *(v16 *)(scores + j) *= inverse;
}

/* out += sum_j p[j] * rows[j] over rows from .. to - 1 of `dim` floats (a multiple of 16), out
 * starting from 0 when from is 0; each element summed in key order, 64 dimensions at a time held in
 * registers. Summing a query vector's keys in consecutive ranges gives the bits of one range. */
static inline __attribute__((always_inline)) void
weighted_sum16(float *out, const float *p, const float *const *rows, int32_t from, int32_t to, int dim) {
    int d = 0;
    for (; d + 64 <= dim; d += 64) {
        v16 a0 = splat16(0.0f), a1 = a0, a2 = a0, a3 = a0;
        if (from > 0)
            a0 = *(v16 *)(out + d), a1 = *(v16 *)(out + d + 16), a2 = *(v16 *)(out + d + 32),
            a3 = *(v16 *)(out + d + 48);
        for (int32_t j = from; j < to; j++) {
            const v16 w = splat16(p[j]);
            const float *row = rows[j] + d;
            a0 += w * *(const v16 *)row;
            a1 += w * *(const v16 *)(row + 16);
            a2 += w * *(const v16 *)(row + 32);
            a3 += w * *(const v16 *)(row + 48);
        }
        *(v16 *)(out + d) = a0, *(v16 *)(out + d + 16) = a1, *(v16 *)(out + d + 32) = a2, *(v16 *)(out + d + 48) = a3;
    }
    for (; d < dim; d += 16) {
        v16 a = from > 0 ? *(v16 *)(out + d) : splat16(0.0f);
        for (int32_t j = from; j < to; j++) a += splat16(p[j]) * *(const v16 *)(rows[j] + d);
        *(v16 *)(out + d) = a;
    }
}

enum { QUERY_VECTORS = 16 };  /* query vectors sharing each pass over a chunk of keys */

/* Query vectors first .. first + count - 1 of the list (row r, head g: vector r * heads + g - g_first)
 * in key chunks that stay in L1 across the vectors: their scores (`scores`: QUERY_VECTORS rows of
 * `stride`), softmax, then their outputs. Chunking changes no bits (see scores16, weighted_sum16). */
static inline __attribute__((always_inline)) void
attend_vectors16(const float *q, float *out, const int32_t *keys, int64_t row_floats, int h, int group, int g_first,
                 int heads, int first, int count, int dim, float scale, float *scores, int64_t stride,
                 const Pool *pool, const int32_t *pages, int kind, const float *k_table, const float *v_table,
                 float *staging, const float **key_rows, const float **value_rows) {
    const float *query[QUERY_VECTORS];
    float *row_out[QUERY_VECTORS];
    int32_t seen[QUERY_VECTORS], most = 0;
    for (int i = 0; i < count; i++) {
        const int v = first + i, r = v / heads, g = g_first + v % heads;
        query[i] = q + r * row_floats + (h * group + g) * dim;
        row_out[i] = out + r * row_floats + (h * group + g) * dim;
        seen[i] = keys[r];
        most = seen[i] > most ? seen[i] : most;
    }
    /* 16 KB of float32 keys (or values), converted chunk by chunk into `staging` as they are used */
    const int32_t chunk = dim <= 1024 ? (4096 / dim) & ~3 : 4;
    for (int32_t from = 0; from < most; from += chunk) {
        const int32_t to = from + chunk < most ? from + chunk : most;
        vectors_of(pool, pages, from, to, most, h, 0, kind, k_table, dim, staging, key_rows);
        for (int i = 0; i < count; i++)
            if (from < seen[i])
                scores16(query[i], key_rows, from, to < seen[i] ? to : seen[i], dim, scale, scores + i * stride);
    }
    for (int i = 0; i < count; i++) softmax16(scores + i * stride, seen[i]);
    for (int32_t from = 0; from < most; from += chunk) {
        const int32_t to = from + chunk < most ? from + chunk : most;
        vectors_of(pool, pages, from, to, most, h, 1, kind, v_table, dim, staging, value_rows);
        for (int i = 0; i < count; i++)
            if (from < seen[i])
                weighted_sum16(row_out[i], scores + i * stride, value_rows, from, to < seen[i] ? to : seen[i], dim);
    }
}

/* One KV head of one sequence: its rows (q [R, Hq, D]), of which row r sees the sequence's first
 * keys[r] keys, for the query heads h * group + g, g in [g_first, g_end). Each key and value is
 * located (and converted) once per 16 query vectors, a chunk of keys at a time, into L1. A query
 * vector's output depends only on it and the keys it sees: the same bits whatever the batch and
 * however the heads are shared out. */
static inline __attribute__((always_inline)) void
attend_head(const float *q, float *out, int32_t rows, const int32_t *keys, int32_t longest, const Pool *pool,
            int kind, const float *k_table, const float *v_table, const int32_t *pages, int h, int g_first,
            int g_end, int q_heads, int kv_heads, int dim, float scale, float *scores, float *staging,
            const float **key_rows, const float **value_rows) {
    const int group = q_heads / kv_heads;
    const int64_t row_floats = (int64_t)q_heads * dim;
    if (dim % 16 == 0) {
        const int heads = g_end - g_first, vectors = rows * heads;
        const int64_t stride = ((int64_t)longest + 15) & ~(int64_t)15;
        for (int first = 0; first < vectors; first += QUERY_VECTORS)
            attend_vectors16(q, out, keys, row_floats, h, group, g_first, heads, first,
                             vectors - first < QUERY_VECTORS ? vectors - first : QUERY_VECTORS, dim, scale, scores,
                             stride, pool, pages, kind, k_table, v_table, staging, key_rows, value_rows);
        return;
    }
    vectors_of(pool, pages, 0, longest, longest, h, 0, kind, k_table, dim, staging, key_rows);
    vectors_of(pool, pages, 0, longest, longest, h, 1, kind, v_table, dim, staging + (int64_t)longest * dim, value_rows);
    for (int32_t r = 0; r < rows; r++) {
        for (int g = g_first; g < g_end; g++) {
            const float *query = q + r * row_floats + (h * group + g) * dim;
            float *row_out = out + r * row_floats + (h * group + g) * dim;
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
            weighted_sum(row_out, scores, value_rows, keys[r], dim);
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
    threads = threads > 0 ? threads : 1;
    /* (sequence, KV head) pairs; split into their query heads where too few to share out evenly */
    const int group = q_heads / kv_heads;
    const int parts = num_seqs * kv_heads >= 2 * (int64_t)threads ? 1 : group;
    const int64_t items = num_seqs * kv_heads * parts;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        /* two arrays of row pointers, then the scores of QUERY_VECTORS query vectors (each padded to 16) and the
         * staged K and V */
        const size_t score_floats = QUERY_VECTORS * (((size_t)most + 15) & ~(size_t)15);  /* attend_vectors16 */
        void *block = malloc(sizeof(float *) * 2 * (size_t)most + sizeof(float) * score_floats +
                             sizeof(float) * (size_t)most * 2 * (size_t)dim);
        if (block == NULL) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
        const float **key_rows = (const float **)block;
        const float **value_rows = key_rows + most;
        float *scores = (float *)(value_rows + most);
        float *staging = scores + score_floats;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (block == NULL) continue;
            const int64_t b = item / (kv_heads * parts);
            const int h = (int)(item / parts % kv_heads);
            const int part = (int)(item % parts);
            const int g_first = part * group / parts, g_end = (part + 1) * group / parts;
            const int32_t first = row_start[b], rows = row_start[b + 1] - row_start[b];
            if (rows == 0) continue;
            const int32_t *keys = row_keys + first, *pages = page_table + b * table_len;
            int32_t longest = 0;
            for (int32_t r = 0; r < rows; r++) longest = keys[r] > longest ? keys[r] : longest;
            const float *q_rows = q + (int64_t)first * q_heads * dim;
            float *out_rows = out + (int64_t)first * q_heads * dim;
            if (kind == KV_F32)
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_F32, k_table, v_table, pages, h, g_first,
                            g_end, q_heads, kv_heads, dim, scale, scores, staging, key_rows, value_rows);
            else if (kind == KV_BF16)
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_BF16, k_table, v_table, pages, h,
                            g_first, g_end, q_heads, kv_heads, dim, scale, scores, staging, key_rows, value_rows);
            else
                attend_head(q_rows, out_rows, rows, keys, longest, &pool, KV_BYTE_TABLE, k_table, v_table, pages, h,
                            g_first, g_end, q_heads, kv_heads, dim, scale, scores, staging, key_rows, value_rows);
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
