// The decoder forward's paged attention over bfloat16 pages with the scores on AMX tiles
// (decoder_forward.c; the general kernel is paged_attention.c).
//
// Scores S = K · Qᵀ for 16 keys at a time: the A tile is 16 keys' rows read straight from a
// page (a page's keys lie `token_stride` bytes apart, so no copy or transpose), the B tiles
// are up to 16 query vectors rounded to bfloat16 (as a bfloat16 model's q is) in VNNI pairs,
// built once per item. One TDPBF16PS per 32 dimensions scores 16 keys against 16 query
// vectors, where the vector code took a dot and a horizontal sum per key and query. The
// softmax runs on the 16 query vectors side by side (a lane each, over its own keys), and the
// weighted sum of values in float32 vectors, values converted as read.
//
// Batch invariance holds as in the products: a score is one chain over its query's and key's
// dimensions whatever else shares the tiles, and every query vector then runs its softmax and
// sum alone in key order, so a row has the same bits in a decode, a verify, a batch and a
// prefill chunk. Keys past a row's count in its last block of 16 are read (the page holds
// them) and their scores never used.
#if HAVE_AMX

enum { KEY_BLOCK = 16, QUERY_BLOCK = 16 };

static inline int tile_attention_fits(const Decoder *d) {
    return d->kv_kind == KV_BF16 && d->head_dim % 32 == 0 && d->head_dim <= 128 && d->page_size % KEY_BLOCK == 0;
}

// Floats of scratch one thread needs for sequences of up to `most` keys.
static int64_t tile_attention_scratch(const Decoder *d, int32_t most) {
    const int64_t padded = (most + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    const int64_t query_tiles = d->head_dim / 32 * 256;  // the B tiles' 32-bit words
    return padded * QUERY_BLOCK + query_tiles + 16;
}

// Tile 0: the scores of 16 keys × 16 query vectors; tile 1: those keys' next 32 dimensions;
// tiles 2..5: the query vectors' dimensions, 32 a tile.
static void configure_score_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

static inline __m512 bf16x16_to_f32(const uint16_t *at) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp_clamped (paged_attention.c) on 16 lanes.
static inline __m512 exp_clamped16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// The scores [keys, 16 query vectors] → e^(score - the lane's top) in place, every query vector
// (lane) over its own first limit[c] keys, later keys exactly 0 (summing them changes nothing);
// the lanes' 1 / Σ e into `inverse`.
static void softmax_columns(float *scores, int32_t longest, const int32_t *limit, float scale, float *inverse) {
    const __m512i limits = _mm512_loadu_si512(limit);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int32_t j = 0; j < longest; j++) {
        const __mmask16 seen = _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32(j));
        const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(scores + (int64_t)j * QUERY_BLOCK), _mm512_set1_ps(scale));
        top = _mm512_mask_max_ps(top, seen, top, value);
        _mm512_storeu_ps(scores + (int64_t)j * QUERY_BLOCK, value);
    }
    __m512 total = _mm512_setzero_ps();
    for (int32_t j = 0; j < longest; j++) {
        const __mmask16 seen = _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32(j));
        float *at = scores + (int64_t)j * QUERY_BLOCK;
        const __m512 e = _mm512_maskz_mov_ps(seen, exp_clamped16(_mm512_sub_ps(_mm512_loadu_ps(at), top)));
        total = _mm512_add_ps(total, e);
        _mm512_storeu_ps(at, e);
    }
    // lanes without a query vector (limit 0) divide by 1
    const __mmask16 used = _mm512_cmpgt_epi32_mask(limits, _mm512_setzero_si512());
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f),
                                            _mm512_mask_blend_ps(used, _mm512_set1_ps(1.0f), total)));
}

// out[c] = inverse[c] · Σ_j e[j, c] · V[j] for `count` (≤ 4) query vectors from column `first`
// on, over `longest` keys; `blocks` vectors of 16 dimensions. Both are constants where inlined.
// Each value row is converted once for the chunk; every lane sums in key order.
static inline __attribute__((always_inline)) void
weighted_values(const Decoder *d, const uint8_t *values, const int32_t *pages, int h, int32_t longest,
                const float *e, const float *inverse, int first, int count, float *const *out, int blocks) {
    __m512 acc[4][8];
    for (int c = 0; c < count; c++)
        for (int b = 0; b < blocks; b++) acc[c][b] = _mm512_setzero_ps();
    for (int32_t j = 0; j < longest; j++) {
        const uint16_t *row = (const uint16_t *)(values + pages[j / d->page_size] * d->page_stride +
                                                 (j % d->page_size) * d->token_stride + h * d->head_stride);
        const float *weights = e + (int64_t)j * QUERY_BLOCK + first;
        for (int b = 0; b < blocks; b++) {
            const __m512 v = bf16x16_to_f32(row + 16 * b);
            for (int c = 0; c < count; c++) acc[c][b] = _mm512_fmadd_ps(_mm512_set1_ps(weights[c]), v, acc[c][b]);
        }
    }
    for (int c = 0; c < count; c++)
        for (int b = 0; b < blocks; b++)
            _mm512_storeu_ps(out[c] + 16 * b, _mm512_mul_ps(acc[c][b], _mm512_set1_ps(inverse[first + c])));
}

// The chunk's count and the head's blocks as constants, so the accumulators stay in registers.
static void weighted_values_chunk(const Decoder *d, const uint8_t *values, const int32_t *pages, int h,
                                  int32_t longest, const float *e, const float *inverse, int first, int count,
                                  float *const *out) {
    const int blocks = (int)(d->head_dim / 16);
#define CHUNK(n)                                                                                    \
    if (blocks == 4)                                                                                \
        weighted_values(d, values, pages, h, longest, e, inverse, first, n, out, 4);                \
    else                                                                                            \
        weighted_values(d, values, pages, h, longest, e, inverse, first, n, out, blocks);           \
    break;
    switch (count) {
        case 1: CHUNK(1)
        case 2: CHUNK(2)
        case 3: CHUNK(3)
        default: CHUNK(4)
    }
#undef CHUNK
}

// Query vectors [count, dim] float32 → the B tiles: [dim / 32][16 pairs][16 vectors] 32-bit words,
// each a pair of dimensions rounded to bfloat16; absent vectors 0.
static void query_tiles_of(const float *const *vectors, int count, int64_t dim, uint32_t *tiles) {
    memset(tiles, 0, sizeof(uint32_t) * (size_t)(dim / 32 * 256));
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int c = 0; c < count; c++)
        for (int64_t i = 0; i < dim; i += 32) {  // 32 dimensions: 16 pairs, to words c, c + 16, ... of a tile
            const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(vectors[c] + i + 16),
                                                       _mm512_loadu_ps(vectors[c] + i));
            _mm512_i32scatter_epi32(tiles + i / 32 * 256 + c, column, (__m512i)pairs, 4);
        }
}

// The rows of keys kb·16 .. kb·16 + 15 of head h: one page's (page_size % 16 == 0), token_stride apart.
static inline const uint8_t *key_block(const Decoder *d, const uint8_t *kv, const int32_t *pages, int h, int32_t kb) {
    const int64_t j0 = (int64_t)kb * KEY_BLOCK;
    return kv + pages[j0 / d->page_size] * d->page_stride + (j0 % d->page_size) * d->token_stride + h * d->head_stride;
}

// One (sequence, KV head): its `rows` query rows (q, out: [rows, Hq, D]), row r seeing the first
// keys[r] keys of `pages`. Its query vectors (row, group member) go 16 at a time through the tiles.
static void tile_attend_head(const Decoder *d, const uint8_t *kv, const float *q, float *out, int32_t rows,
                             const int32_t *keys, int32_t longest, const int32_t *pages, int h, float *scratch) {
    const int64_t dim = d->head_dim, group = d->q_heads / d->kv_heads, row_floats = d->q_heads * dim;
    const int dim_blocks = (int)(dim / 32);
    const int32_t key_blocks = (longest + KEY_BLOCK - 1) / KEY_BLOCK;
    float *scores = scratch;  // [key_blocks * 16 keys, 16 query vectors]
    uint32_t *query_tiles =
        (uint32_t *)(((uintptr_t)(scores + (int64_t)key_blocks * KEY_BLOCK * QUERY_BLOCK) + 63) & ~(uintptr_t)63);
    const int64_t vectors = rows * group;
    for (int64_t first = 0; first < vectors; first += QUERY_BLOCK) {
        const int count = (int)(vectors - first < QUERY_BLOCK ? vectors - first : QUERY_BLOCK);
        int32_t limit[QUERY_BLOCK] = {0};
        const float *queries[QUERY_BLOCK];
        float *outs[QUERY_BLOCK];
        for (int c = 0; c < count; c++) {
            const int64_t r = (first + c) / group, at = r * row_floats + (h * group + (first + c) % group) * dim;
            limit[c] = keys[r];
            queries[c] = q + at;
            outs[c] = out + at;
        }
        query_tiles_of(queries, count, dim, query_tiles);
        // (tile numbers must be constants)
        _tile_loadd(2, query_tiles, 64);
        if (dim_blocks > 1) _tile_loadd(3, query_tiles + 256, 64);
        if (dim_blocks > 2) _tile_loadd(4, query_tiles + 2 * 256, 64);
        if (dim_blocks > 3) _tile_loadd(5, query_tiles + 3 * 256, 64);
        for (int32_t kb = 0; kb < key_blocks; kb++) {
            const uint8_t *key_rows = key_block(d, kv, pages, h, kb);
#define SCORE_DIMS(b, query_tile)                                 \
    do {                                                          \
        _tile_loadd(1, key_rows + (b) * 64, d->token_stride);     \
        _tile_dpbf16ps(0, 1, query_tile);                         \
    } while (0)
            _tile_zero(0);
            SCORE_DIMS(0, 2);
            if (dim_blocks > 1) SCORE_DIMS(1, 3);
            if (dim_blocks > 2) SCORE_DIMS(2, 4);
            if (dim_blocks > 3) SCORE_DIMS(3, 5);
#undef SCORE_DIMS
            _tile_stored(0, scores + (int64_t)kb * KEY_BLOCK * QUERY_BLOCK, QUERY_BLOCK * sizeof(float));
        }
        float inverse[QUERY_BLOCK];
        softmax_columns(scores, longest, limit, d->scale, inverse);
        const int chunk = dim <= 64 ? 4 : 2;  // accumulators: chunk × dim / 16 vectors
        for (int c = 0; c < count; c += chunk)
            weighted_values_chunk(d, kv + d->plane_stride, pages, h, longest, scores, inverse, c,
                                  count - c < chunk ? count - c : chunk, outs + c);
    }
}

// Every sequence's rows against their pages, (sequence, KV head) items shared out over the
// threads; `scratch` holds `tile_attention_scratch` floats per thread.
static void tile_attention(const Decoder *d, const uint8_t *kv, const float *q, float *out, const int32_t *page_table,
                           int64_t table_len, int64_t num_seqs, const int32_t *row_start, const int32_t *row_keys,
                           float *scratch, int64_t scratch_floats, int threads) {
    const int64_t items = num_seqs * d->kv_heads;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        float *mine = scratch + omp_get_thread_num() * scratch_floats;
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / d->kv_heads;
            const int h = (int)(item % d->kv_heads);
            const int32_t first = row_start[b], rows = row_start[b + 1] - first;
            if (rows == 0) continue;
            int32_t longest = 0;
            for (int32_t r = 0; r < rows; r++) longest = row_keys[first + r] > longest ? row_keys[first + r] : longest;
            if (!configured) {
                configure_score_tiles();
                configured = 1;
            }
            tile_attend_head(d, kv, q + (int64_t)first * d->q_heads * d->head_dim,
                             out + (int64_t)first * d->q_heads * d->head_dim, rows, row_keys + first, longest,
                             page_table + b * table_len, h, mine);
        }
        if (configured) _tile_release();
    }
}
#else
static inline int tile_attention_fits(const Decoder *d) {
    (void)d;
    return 0;
}
static int64_t tile_attention_scratch(const Decoder *d, int32_t most) {
    (void)d, (void)most;
    return 0;
}
static void tile_attention(const Decoder *d, const uint8_t *kv, const float *q, float *out, const int32_t *page_table,
                           int64_t table_len, int64_t num_seqs, const int32_t *row_start, const int32_t *row_keys,
                           float *scratch, int64_t scratch_floats, int threads) {
    (void)d, (void)kv, (void)q, (void)out, (void)page_table, (void)table_len, (void)num_seqs, (void)row_start;
    (void)row_keys, (void)scratch, (void)scratch_floats, (void)threads;
}
#endif
