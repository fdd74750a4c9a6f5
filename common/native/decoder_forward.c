// A Qwen3 / Llama decoder stack's forward in one native call per step (common/native_forward.py):
// the products on AMX tiles, AVX512-BF16 or AVX2 (amx_linear.c), the paged attention and KV writes of
// paged_attention.c, and everything between them (RMSNorm, q/k norms, RoPE, SiLU, residuals) as
// row loops here. Each op is one OpenMP region over the step's rows or outputs; nothing goes
// back to Python between them.
//
// Activations are float32; a product's input is rounded to bfloat16 (the tile format) and its
// output accumulated in float32. Every op computes a row from that row alone, in a fixed order,
// so a row's bits are the same in a decode, a verify, a batch and a prefill chunk: the forward
// is batch-invariant by construction, what lossless speculation in bfloat16 needs.
#include "amx_linear.c"
#include "paged_attention.c"

#include <math.h>

// statuses: the attention's own (1-4), these, and a product's offset by PRODUCT_STATUS
enum { FWD_OK = 0, FWD_BAD_SLOT = 11, FWD_BAD_POSITION = 12, FWD_NO_MEMORY = 13, FWD_NO_PRODUCTS = 15, FWD_BAD_SHAPE = 16, FWD_BAD_TOKEN = 17,
       PRODUCT_STATUS = 20 };

#define PRODUCT(...)                              \
    do {                                          \
        const int product = splitspec_tiled_linear(__VA_ARGS__, d->product_kernel); \
        if (product != AMX_OK) status = PRODUCT_STATUS + product; \
    } while (0)

typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down;                // tile-packed bfloat16 weights
    const float *input_norm, *post_norm, *q_norm, *k_norm;  // float32; q/k norms NULL where the model has none
    uint8_t *kv;                                            // the layer's pool region
    void *capture;  // the hidden state after this layer, [T, hidden] rows `capture_stride` apart, or NULL
} DecoderLayer;

typedef struct {
    int64_t hidden, intermediate, q_heads, kv_heads, head_dim, layers;
    float eps, scale;
    const float *final_norm;
    // the pool regions' geometry (every layer's the same), in bytes; kind KV_F32 or KV_BF16
    int64_t page_stride, plane_stride, token_stride, head_stride, num_pages;
    int32_t page_size;
    int32_t kv_kind;
    int64_t capture_stride;  // elements from one captured row to the next
    int32_t capture_kind;    // KV_F32 or KV_BF16: the captures' element type
    int32_t product_kernel;  // KERNEL_AMX, KERNEL_DPBF16 or KERNEL_FMA256 (amx_linear.c), for every product
} Decoder;

// out[i] = round_to_bf16(x[i]), 16 at a time in integer lanes where the CPU has AVX-512 (the same
// bits: VCVTNEPS2BF16 would flush denormals, which torch's rounding keeps).
static inline void floats_to_bf16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_loadu_si512(x + i);
        const __m512i upper = _mm512_srli_epi32(bits, 16);
        __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(upper, one))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), infinity);
        rounded = _mm512_mask_or_epi32(rounded, nan, upper, quiet);  // a NaN stays NaN, quieted
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(rounded));
    }
#endif
    for (; i < n; i++) out[i] = round_to_bf16(x[i]);
}

// floats_to_bf16 as an entry point: tests hold it to torch's rounding.
void splitspec_floats_to_bf16(const float *x, uint16_t *out, int64_t n) { floats_to_bf16(x, out, n); }

#include "tile_attention.c"

static inline float rms_scale(const float *x, int64_t n, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

// Row t of a layer's hidden states into its capture rows (`capture_stride` elements apart), as float32
// or rounded to bfloat16 (as torch's copy rounds).
static inline void store_capture_row(const Decoder *d, void *capture, const float *row, int64_t t) {
    if (d->capture_kind == KV_F32)
        memcpy((float *)capture + t * d->capture_stride, row, sizeof(float) * (size_t)d->hidden);
    else
        floats_to_bf16(row, (uint16_t *)capture + t * d->capture_stride, d->hidden);
}

static void store_capture(const Decoder *d, void *capture, const float *x, int64_t rows) {
    for (int64_t t = 0; t < rows; t++) store_capture_row(d, capture, x + t * d->hidden, t);
}

// An op's rows run in one OpenMP region only when they hold at least this many elements: a region's
// fork and join cost about a microsecond, what one core takes for a few thousand elements of these
// row ops. A smaller op (a decode's one row, a verify's norms) runs on the calling thread without
// entering a region: even a region whose `if` is false costs a team set-up. Each row is computed
// whole by one thread either way, so the split changes no bits.
#define PARALLEL_GRAIN 4096
#define ROWS_LOOP(team, rows, t, ...)                                      \
    do {                                                                    \
        if ((team) > 1) {                                                   \
            _Pragma("omp parallel for num_threads(team) schedule(static)")  \
            for (int64_t t = 0; t < (rows); t++) __VA_ARGS__                \
        } else {                                                            \
            for (int64_t t = 0; t < (rows); t++) __VA_ARGS__                \
        }                                                                   \
    } while (0)

static inline int team_for(int64_t elements, int threads) { return elements >= PARALLEL_GRAIN ? threads : 1; }

// out = bf16(x * rsqrt(mean(x²) + eps) * weight), one row of n
static inline void norm_row_to_bf16(const float *x, const float *weight, uint16_t *out, int64_t n, float eps) {
    const float scale = rms_scale(x, n, eps);
    float normed[n];
    for (int64_t i = 0; i < n; i++) normed[i] = x[i] * scale * weight[i];
    floats_to_bf16(normed, out, n);
}

// out[t] = bf16(x[t] * rsqrt(mean(x[t]²) + eps) * weight)
static void norm_rows_to_bf16(const float *x, const float *weight, uint16_t *out, int64_t rows, int64_t n, float eps,
                              int threads) {
    const int team = team_for(rows * n, threads);
    ROWS_LOOP(team, rows, t, { norm_row_to_bf16(x + t * n, weight, out + t * n, n, eps); });
}

// x[t] += delta[t], then out[t] = bf16(norm(x[t]) * weight): a residual and the next op's RMSNorm in one
// pass over the rows; with `capture` (NULL: none), x[t] after the residual is stored there too.
static void residual_norm_rows_to_bf16(const Decoder *d, float *x, const float *delta, const float *weight,
                                       uint16_t *out, void *capture, int64_t rows, int threads) {
    const int64_t n = d->hidden;
    const int team = team_for(rows * n, threads);
    ROWS_LOOP(team, rows, t, {
        float *row = x + t * n;
        const float *add = delta + t * n;
        for (int64_t i = 0; i < n; i++) row[i] += add[i];
        if (capture != NULL) store_capture_row(d, capture, row, t);
        norm_row_to_bf16(row, weight, out + t * n, n, d->eps);
    });
}

static void rows_to_bf16(const float *x, uint16_t *out, int64_t count, int threads) {
    const int64_t chunk = 4096, chunks = (count + chunk - 1) / chunk;
    const int team = team_for(count, threads);
    ROWS_LOOP(team, chunks, c, {
        const int64_t left = count - c * chunk;
        floats_to_bf16(x + c * chunk, out + c * chunk, left < chunk ? left : chunk);
    });
}

static void add_rows(float *x, const float *delta, int64_t count, int threads) {
    const int team = team_for(count, threads);
    ROWS_LOOP(team, count, i, { x[i] += delta[i]; });
}

// bf16(silu(gate) * up), one row of `inter`
static inline void silu_mul_row(const float *gate, const float *up, uint16_t *out, int64_t inter) {
    float silu[inter];
    for (int64_t i = 0; i < inter; i++) silu[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
    floats_to_bf16(silu, out, inter);
}

// [T, 2I] float32 (gate | up) → bf16(silu(gate) * up) [T, I]
static void silu_mul_rows(const float *gate_up, uint16_t *out, int64_t rows, int64_t inter, int threads) {
    const int team = team_for(rows * inter, threads);
    ROWS_LOOP(team, rows, t, {
        const float *gate = gate_up + t * 2 * inter;
        silu_mul_row(gate, gate + inter, out + t * inter, inter);
    });
}

// One head vector: its RMSNorm (when weighted), then the neox rotation with the sign folded into
// sin: out[i] = v[i]·cos[i] + v[(i + D/2) mod D]·sin[i].
static void norm_and_rotate(const float *v, const float *norm, float eps, const float *cos, const float *sin,
                            float *out, int64_t dim) {
    float normed[dim];
    if (norm != NULL) {
        const float scale = rms_scale(v, dim, eps);
        for (int64_t i = 0; i < dim; i++) normed[i] = v[i] * scale * norm[i];
    } else {
        memcpy(normed, v, sizeof(float) * (size_t)dim);
    }
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = normed[i] * cos[i] + normed[i + half] * sin[i];
    for (int64_t i = half; i < dim; i++) out[i] = normed[i] * cos[i] + normed[i - half] * sin[i];
}

static void store_vector(uint8_t *at, const float *v, int64_t dim, int32_t kind) {
    if (kind == KV_F32) {
        memcpy(at, v, (size_t)dim * sizeof(float));
    } else {
        uint16_t *half = (uint16_t *)at;
        for (int64_t i = 0; i < dim; i++) half[i] = round_to_bf16(v[i]);
    }
}

// One (row, head) item of the qkv product row `row` [(Hq + 2 Hkv) D]: a q head normed and rotated
// into q_out [Hq, D], or a kv head's k normed, rotated and stored with its v at `slot` in the pages.
static inline void query_or_kv_item(const Decoder *d, const DecoderLayer *layer, const float *row, float *q_out,
                                    const float *row_rope, int64_t slot, int64_t h) {
    const int64_t dim = d->head_dim;
    const float *row_cos = row_rope, *row_sin = row_rope + dim;
    if (h < d->q_heads) {
        norm_and_rotate(row + h * dim, layer->q_norm, d->eps, row_cos, row_sin, q_out + h * dim, dim);
        return;
    }
    const int64_t kv_head = h - d->q_heads;
    float key[dim];
    norm_and_rotate(row + (d->q_heads + kv_head) * dim, layer->k_norm, d->eps, row_cos, row_sin, key, dim);
    uint8_t *at = layer->kv + (slot / d->page_size) * d->page_stride + (slot % d->page_size) * d->token_stride +
                  kv_head * d->head_stride;
    store_vector(at, key, dim, d->kv_kind);
    store_vector(at + d->plane_stride, row + (d->q_heads + d->kv_heads + kv_head) * dim, dim, d->kv_kind);
}

// From the qkv product [T, (Hq + 2 Hkv) D]: q normed and rotated into q_out [T, Hq, D]; k normed,
// rotated and v stored in the pages at each row's slot.
static void queries_and_kv(const Decoder *d, const DecoderLayer *layer, const float *qkv, float *q_out,
                           const float *rope, const int64_t *positions, const int64_t *slots, int64_t rows,
                           int threads) {
    const int64_t dim = d->head_dim, heads = d->q_heads + d->kv_heads;
    const int64_t width = (d->q_heads + 2 * d->kv_heads) * dim;
    const int team = team_for(rows * heads * dim, threads);
    ROWS_LOOP(team, rows * heads, item, {
        const int64_t t = item / heads;
        query_or_kv_item(d, layer, qkv + t * width, q_out + t * d->q_heads * dim, rope + positions[t] * 2 * dim,
                         slots[t], item % heads);
    });
}

// DFlash's context rows, K/V computed inside the block's forward (NULL: none) or alone
// (splitspec_context_kv): features [rows, width] bfloat16 (the target's hidden states side by side) →
// rms_norm(features · fcᵀ) · hidden_norm, whose K and V every layer writes at slots[t] (row t at
// positions[t]) before the block attends. The block's qkv product takes these rows too: one pass over
// each layer's weights instead of two calls' two.
typedef struct {
    const uint16_t *features;
    int64_t width;
    const uint16_t *fc;  // tile-packed [hidden, width]
    const float *hidden_norm;
    int64_t rows;
    const int64_t *positions, *slots;
} ContextRows;

// rms_norm(features · fcᵀ) · hidden_norm of the context rows into `normed` [rows, hidden] bfloat16,
// through `projected` [rows, hidden] float32; FWD_OK or a product's status.
static int project_context(const Decoder *d, const ContextRows *context, float *projected, uint16_t *normed,
                           int threads) {
    int status = FWD_OK;
    PRODUCT(context->features, context->rows, context->width, context->fc, d->hidden, projected, 1, threads);
    if (status == FWD_OK)
        norm_rows_to_bf16(projected, context->hidden_norm, normed, context->rows, d->hidden, d->eps, threads);
    return status;
}

// Context rows' K (normed, rotated) and V stored at their slots from the qkv product rows
// [T, (Hq + 2 Hkv) D]; their q part is dropped.
static void context_kv_rows(const Decoder *d, const DecoderLayer *layer, const float *qkv, const float *rope,
                            const int64_t *positions, const int64_t *slots, int64_t rows, int threads) {
    const int64_t dim = d->head_dim, width = (d->q_heads + 2 * d->kv_heads) * dim;
    const int team = team_for(rows * d->kv_heads * dim, threads);
    ROWS_LOOP(team, rows * d->kv_heads, item, {
        const int64_t t = item / d->kv_heads;
        query_or_kv_item(d, layer, qkv + t * width, NULL, rope + positions[t] * 2 * dim, slots[t],
                         d->q_heads + item % d->kv_heads);
    });
}


static void norm_rows(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float scale = rms_scale(x + t * n, n, eps);
        for (int64_t i = 0; i < n; i++) out[t * n + i] = x[t * n + i] * scale * weight[i];
    }
}

// Each row's KV slot inside the pool and its position inside the rotary table, checked before
// anything is written: FWD_OK, FWD_BAD_SLOT or FWD_BAD_POSITION.
static int checked_rows(const Decoder *d, const int64_t *slots, const int64_t *positions, int64_t rows,
                        int64_t rope_positions) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] / d->page_size >= d->num_pages) return FWD_BAD_SLOT;
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= rope_positions) return FWD_BAD_POSITION;
    return FWD_OK;
}

// x [T, hidden] float32: the embedded tokens in, the residual stream through the layers (changed
// in place); out [T, hidden]: after the final norm (also the last layer's capture, as Hugging
// Face reports it). rope [rope_positions, 2, head_dim]: each position's cos and signed sin (see
// norm_and_rotate); row t is at positions[t]. Sequence b owns rows
// row_start[b] .. row_start[b+1]-1 and pages page_table[b, :table_len]; row t sees its sequence's
// first row_keys[t] keys and writes its K/V at slots[t].
int splitspec_decoder_forward(const Decoder *d, const DecoderLayer *layers, float *x, float *out, int64_t rows,
                              const float *rope, int64_t rope_positions, const int64_t *positions,
                              const int32_t *page_table, int64_t table_len, int64_t num_seqs, const int32_t *row_start,
                              const int32_t *row_keys, const int64_t *slots, int threads,
                              const ContextRows *context) {
    if (!kernel_runs(d->product_kernel)) return FWD_NO_PRODUCTS;
    if (rows <= 0 || d->head_dim % 2 || d->head_dim > 512 || (d->kv_kind != KV_F32 && d->kv_kind != KV_BF16) ||
        d->kv_heads < 1 || d->q_heads % d->kv_heads || (d->capture_kind != KV_F32 && d->capture_kind != KV_BF16) ||
        d->capture_stride < d->hidden)
        return FWD_BAD_SHAPE;
    const int64_t ctx = context != NULL ? context->rows : 0;  // context rows ahead of the block's in each qkv product
    if (ctx < 0 || (ctx > 0 && (context->width <= 0 || d->layers < 1))) return FWD_BAD_SHAPE;
    const int rows_status = checked_rows(d, slots, positions, rows, rope_positions);
    if (rows_status != FWD_OK) return rows_status;
    if (ctx > 0) {
        const int context_status = checked_rows(d, context->slots, context->positions, ctx, rope_positions);
        if (context_status != FWD_OK) return context_status;
    }
    // every page the attention will read, checked before the first write: a refused step changes nothing
    const Pool pool = {NULL, 0, 0, 0, 0, d->num_pages, d->page_size};
    const int32_t most = checked_sequences(&pool, page_table, table_len, num_seqs, row_start, row_keys, rows);
    if (most < 0) return -most;
    if (row_start[num_seqs] != rows) return BAD_LENGTH;  // every row belongs to a sequence here
    threads = threads > 0 ? threads : 1;
    const int64_t hidden = d->hidden, inter = d->intermediate, dim = d->head_dim;
    const int64_t q_width = d->q_heads * dim, qkv_width = (d->q_heads + 2 * d->kv_heads) * dim;
    const int64_t narrow = hidden > q_width ? (hidden > inter ? hidden : inter) : (q_width > inter ? q_width : inter);
    const int64_t wide_products = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    const int64_t wide = wide_products > hidden ? wide_products : hidden;  // the context fc's output too
    // product_in: the context's rows (normed once), then the block's; product_out as many
    uint16_t *product_in = malloc(sizeof(uint16_t) * (size_t)((ctx + rows) * narrow));
    float *product_out = malloc(sizeof(float) * (size_t)((ctx + rows) * wide));
    uint16_t *context_normed = ctx > 0 ? malloc(sizeof(uint16_t) * (size_t)(ctx * hidden)) : NULL;
    float *queries = malloc(sizeof(float) * (size_t)(rows * q_width));
    float *attended = malloc(sizeof(float) * (size_t)(rows * q_width));
    float *delta = malloc(sizeof(float) * (size_t)(rows * hidden));
    const int tiles = d->product_kernel == KERNEL_AMX && tile_attention_fits(d);  // scores on AMX tiles
    const int64_t scratch_floats = tiles ? tile_attention_scratch(d, most) : 0;
    float *scratch = tiles ? malloc(sizeof(float) * (size_t)(threads * scratch_floats)) : NULL;
    int status = FWD_OK;
    if (!product_in || !product_out || !queries || !attended || !delta || (tiles && !scratch) ||
        (ctx > 0 && !context_normed))
        status = FWD_NO_MEMORY;
    uint16_t *block_in = product_in + ctx * hidden;  // the block rows' normed input to each qkv product
    if (status == FWD_OK && ctx > 0)  // after a failed allocation nothing is written
        status = project_context(d, context, product_out, context_normed, threads);
    if (status == FWD_OK && d->layers > 0)
        norm_rows_to_bf16(x, layers[0].input_norm, block_in, rows, hidden, d->eps, threads);
    for (int64_t i = 0; i < d->layers && status == FWD_OK; i++) {
        const DecoderLayer *layer = layers + i;  // block_in: x normed by its input norm
        if (ctx > 0) memcpy(product_in, context_normed, sizeof(uint16_t) * (size_t)(ctx * hidden));
        PRODUCT(product_in, ctx + rows, hidden, layer->qkv, qkv_width, product_out, 1, threads);
        if (status != FWD_OK) break;
        if (ctx > 0)  // the context's K/V in the pages before the block attends
            context_kv_rows(d, layer, product_out, rope, context->positions, context->slots, ctx, threads);
        queries_and_kv(d, layer, product_out + ctx * qkv_width, queries, rope, positions, slots, rows, threads);
        if (tiles)
            tile_attention(d, layer->kv, queries, attended, page_table, table_len, num_seqs, row_start, row_keys,
                           scratch, scratch_floats, threads);
        else
            status = splitspec_paged_attention(queries, attended, layer->kv, d->page_stride, d->plane_stride,
                                               d->token_stride, d->head_stride, d->num_pages, d->page_size,
                                               d->kv_kind, NULL, NULL, page_table, table_len, num_seqs, row_start,
                                               row_keys, rows, (int)d->q_heads, (int)d->kv_heads, (int)dim, d->scale,
                                               threads);
        if (status != FWD_OK) break;
        rows_to_bf16(attended, product_in, rows * q_width, threads);
        PRODUCT(product_in, rows, q_width, layer->o, hidden, delta, 1, threads);
        if (status != FWD_OK) break;
        residual_norm_rows_to_bf16(d, x, delta, layer->post_norm, product_in, NULL, rows, threads);
        PRODUCT(product_in, rows, hidden, layer->gate_up, 2 * inter, product_out, 1, threads);
        if (status != FWD_OK) break;
        silu_mul_rows(product_out, product_in, rows, inter, threads);
        PRODUCT(product_in, rows, inter, layer->down, hidden, delta, 1, threads);
        if (status != FWD_OK) break;
        if (i + 1 < d->layers)  // the residual, its capture, and the next layer's input norm in one pass
            residual_norm_rows_to_bf16(d, x, delta, layer[1].input_norm, block_in, layer->capture, rows, threads);
        else
            add_rows(x, delta, rows * hidden, threads);
    }
    if (status == FWD_OK) {
        norm_rows(x, d->final_norm, out, rows, hidden, d->eps);
        const DecoderLayer *last = layers + d->layers - 1;
        if (last->capture != NULL) store_capture(d, last->capture, out, rows);
    }
    free(product_in);
    free(product_out);
    free(queries);
    free(attended);
    free(delta);
    free(scratch);
    free(context_normed);
    return status;
}

// DFlash's context rows: features [T, F] bfloat16 (the target's hidden states, side by side) →
// rms_norm(features · fcᵀ) · hidden_norm, then every layer's K (k norm, RoPE) and V from that,
// written at slots[t]. (The q part of each stacked product is computed and dropped: on AMX tiles
// it costs next to nothing; its norm and rotation are skipped.)
int splitspec_context_kv(const Decoder *d, const DecoderLayer *layers, const uint16_t *features, int64_t width,
                         const uint16_t *fc, const float *hidden_norm, int64_t rows, const float *rope,
                         int64_t rope_positions, const int64_t *positions, const int64_t *slots, int threads) {
    if (!kernel_runs(d->product_kernel)) return FWD_NO_PRODUCTS;
    if (rows <= 0 || d->head_dim % 2 || d->head_dim > 512 || (d->kv_kind != KV_F32 && d->kv_kind != KV_BF16))
        return FWD_BAD_SHAPE;
    const int rows_status = checked_rows(d, slots, positions, rows, rope_positions);
    if (rows_status != FWD_OK) return rows_status;
    threads = threads > 0 ? threads : 1;
    const ContextRows context = {features, width, fc, hidden_norm, rows, positions, slots};
    const int64_t hidden = d->hidden, qkv_width = (d->q_heads + 2 * d->kv_heads) * d->head_dim;
    float *projected = malloc(sizeof(float) * (size_t)(rows * hidden));
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(rows * hidden));
    float *product_out = malloc(sizeof(float) * (size_t)(rows * qkv_width));
    int status = FWD_OK;
    if (!projected || !normed || !product_out) status = FWD_NO_MEMORY;
    if (status == FWD_OK) status = project_context(d, &context, projected, normed, threads);
    for (int64_t i = 0; i < d->layers && status == FWD_OK; i++) {
        PRODUCT(normed, rows, hidden, layers[i].qkv, qkv_width, product_out, 1, threads);
        if (status == FWD_OK) context_kv_rows(d, layers + i, product_out, rope, positions, slots, rows, threads);
    }
    free(projected);
    free(normed);
    free(product_out);
    return status;
}

// What DFlash's block needs besides its layers: the target's embedding and head, and the mask.
typedef struct {
    const uint16_t *embed;  // [vocab, hidden] bfloat16: the target's input embedding
    float embed_scale;      // the block's embedded rows are multiplied by this (1: left as they are)
    int64_t vocab;
    const uint16_t *head;  // tile-packed [vocab, hidden]: the target's lm_head
    int64_t mask_id;
    int32_t causal;  // block row i sees the keys up to its own (1), or the whole block (0: DFlash's)
} DraftBlock;

// The first index of the largest of n bfloat16 values, a NaN counting as largest (torch.argmax's
// and NumPy's choice, which the Python path takes over the same bfloat16 logits).
static int64_t argmax_bf16(const uint16_t *values, int64_t n) {
    int64_t best = 0;
    float largest = bf16_to_float(values[0]);
    if (isnan(largest)) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = bf16_to_float(values[i]);
        if (isnan(v)) return i;
        if (v > largest) largest = v, best = i;
    }
    return best;
}

// DFlash's Propose in one call. Sequence b's block [last_ids[b], mask × k] sits at positions p .. p + k
// (p = context_lens[b]), its K/V written at those positions' slots in page_table[b, :table_len], each
// row seeing the context and the whole block (or, causal, the block up to itself); the context rows
// (NULL: none) have their K/V written first, as in splitspec_decoder_forward. After the layers and the
// final norm, the head runs over block rows 1 .. drafts (rounded to bfloat16, as torch's cast would),
// into bfloat16 logits; drafts_out[b, i] = their argmax. Everything is checked before anything is written.
int splitspec_dflash_propose(const Decoder *d, const DecoderLayer *layers, const DraftBlock *block,
                             const int64_t *last_ids, const int64_t *context_lens, int64_t num_seqs, int64_t k,
                             int64_t drafts, const int32_t *page_table, int64_t table_len, const float *rope,
                             int64_t rope_positions, int threads, const ContextRows *context, int64_t *drafts_out) {
    if (num_seqs < 1 || k < 1 || drafts < 1 || drafts > k || table_len < 1 || block->vocab < 1 ||
        block->mask_id < 0 || block->mask_id >= block->vocab || d->page_size < 1)
        return FWD_BAD_SHAPE;
    const int64_t width = k + 1, rows = num_seqs * width, hidden = d->hidden;
    for (int64_t b = 0; b < num_seqs; b++) {
        if (last_ids[b] < 0 || last_ids[b] >= block->vocab) return FWD_BAD_TOKEN;
        if (context_lens[b] < 1 || context_lens[b] > table_len * d->page_size - width ||
            context_lens[b] > INT32_MAX - width)
            return FWD_BAD_SLOT;
    }
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)rows);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)rows);
    int32_t *row_start = malloc(sizeof(int32_t) * (size_t)(num_seqs + 1));
    int32_t *row_keys = malloc(sizeof(int32_t) * (size_t)rows);
    float *x = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *out = malloc(sizeof(float) * (size_t)(rows * hidden));
    uint16_t *head_in = malloc(sizeof(uint16_t) * (size_t)(num_seqs * drafts * hidden));
    uint16_t *logits = malloc(sizeof(uint16_t) * (size_t)(num_seqs * drafts * block->vocab));
    int status = FWD_OK;
    if (!positions || !slots || !row_start || !row_keys || !x || !out || !head_in || !logits) status = FWD_NO_MEMORY;
    for (int64_t b = 0; b < num_seqs && status == FWD_OK; b++) {
        const int64_t p = context_lens[b];
        row_start[b] = (int32_t)(b * width);
        for (int64_t i = 0; i < width; i++) {
            const int64_t t = b * width + i, position = p + i;
            const int32_t page = page_table[b * table_len + position / d->page_size];
            positions[t] = position;
            slots[t] = (int64_t)page * d->page_size + position % d->page_size;  // pages checked by the forward
            row_keys[t] = (int32_t)(block->causal ? position + 1 : p + width);
            const uint16_t *embedded = block->embed + (i == 0 ? last_ids[b] : block->mask_id) * hidden;
            float *row = x + t * hidden;
            for (int64_t j = 0; j < hidden; j++) row[j] = bf16_to_float(embedded[j]);
            if (block->embed_scale != 1.0f)
                for (int64_t j = 0; j < hidden; j++) row[j] *= block->embed_scale;
        }
    }
    if (status == FWD_OK) {
        row_start[num_seqs] = (int32_t)rows;
        status = splitspec_decoder_forward(d, layers, x, out, rows, rope, rope_positions, positions, page_table,
                                           table_len, num_seqs, row_start, row_keys, slots, threads, context);
    }
    if (status == FWD_OK) {
        for (int64_t b = 0; b < num_seqs; b++)  // block rows 1 .. drafts: the masks' predictions
            floats_to_bf16(out + (b * width + 1) * hidden, head_in + b * drafts * hidden, drafts * hidden);
        PRODUCT(head_in, num_seqs * drafts, hidden, block->head, block->vocab, logits, 0, threads);
    }
    if (status == FWD_OK)
        for (int64_t r = 0; r < num_seqs * drafts; r++) drafts_out[r] = argmax_bf16(logits + r * block->vocab, block->vocab);
    free(positions);
    free(slots);
    free(row_start);
    free(row_keys);
    free(x);
    free(out);
    free(head_in);
    free(logits);
    return status;
}
