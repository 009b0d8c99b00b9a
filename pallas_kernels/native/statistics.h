// HeteroCache's drift statistics of one pivot row (defined in pivot_statistics.cc), shared with the pool
// attention, which computes them for a scored head as soon as that head's attention is merged.

#pragma once

#include <cstdint>

namespace hetero_jax_native {

// From one pivot's logits [G, T] over its rows: scores[0, T) (softmax over the first clip(length, 0, T) rows,
// 5-tap average pooling, max over the group; MASK_VALUE after) and the normalised overlap of their top-L set
// with K_base (k_base[0, K), L its entries >= 0; the paper's Eq. 9). pivot_statistics.cc's header has the
// exact definition; per-thread scratch, so any thread may call it.
void pivot_row_statistics(const float* logits, int64_t G, int64_t T, int32_t length, const int32_t* k_base,
                          int64_t K, float* scores, float* overlap);

// The same from the pool attention's exponentials instead of logits: p [G, T] with p[g, t] = exp(x[g, t] -
// block_max[g, t / block]), block_max [G, ceil(T / block)] at least every logit x of its block (the attention's
// running max there; MASK_VALUE where no row was written, p 0). Scores within a few ulps of the logits' form,
// without a second exp per row; the overlap exact for the scores returned.
void pivot_row_statistics_from_exp(const float* p, const float* block_max, int64_t block, int64_t G, int64_t T,
                                   int32_t length, const int32_t* k_base, int64_t K, float* scores, float* overlap);

}  // namespace hetero_jax_native
