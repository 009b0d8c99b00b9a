// Pivot statistics on the CPU: XLA FFI custom calls for HeteroCache's drift check (targets
// "hetero_jax_pivot_statistics" and "hetero_jax_topk_sets").
//
// What HeteroCache's drift check needs from one decode step of a pivot layer, from the logits the pool
// attention wrote over the pivots' prompt rows (pallas_kernels.pivot_statistics_reference documents it):
//   scores[b, h, t] = max_g avg_pool5(softmax_{t' < n}(logits[b, h, g, t']))[t] for t < n, MASK_VALUE after,
//   overlap[b, h]   = (o - c) / (1 - c), o = |top-L(scores[b, h]) & K_base| / L, c = L / lengths[b, h]
//                     (1 where c >= 1), the paper's Eq. 9 normalised,
// with n = clip(lengths[b, h], 0, T), L = the count of k_base[b, h, :] >= 0 (each row's own L_base), K_base
// those entries below lengths[b, h], and top-L the set lax.top_k picks (IEEE total order, ties to the lower
// position), taken over all T entries as the reference takes it.
//
// Operands (leading dims are flattened, so vmap_method="broadcast_all" works): logits [..., Hp, G, T] f32,
// lengths [..., Hp] s32, k_base [..., Hp, K] s32. Results: scores [..., Hp, T] f32, overlap [..., Hp] f32.
//
// On XLA:CPU these are dozens of small fusions per pivot layer (the softmax, five shifted slices of the
// pooling, the masks) and a 32-pass bisection for the top-L threshold, each pass a loop trip; here a row is
// one pass for the softmax and pooling and a radix select (11, 11 and 10 bits; each pass after the first
// reads only the entries whose higher bits matched) for the threshold; the top-L set (keys above the L-th
// largest, and of those equal to it the first L - n_greater positions) is the one the check's sets take
// (top_positions), and K_base's entries are counted in it: where the L-th key is unique, as the keys at or above
// it, without listing the set. The pool attention's fused call (statistics.h) takes each softmax from the
// attention's own exponentials instead of the logits (softmax_from_exp).
//
// hetero_jax_topk_sets (pallas_kernels.topk_sets): scores [..., T] f32, sizes [..., K] s32, attribute cap;
// result [..., K, cap] s32: for each size k, the positions lax.top_k(scores, k) picks, ascending, -1 past k
// (sizes are clipped to [0, min(cap, T)]). The largest size's set is found as above; each smaller one is the
// same selection among its members (lax.top_k's sets are nested: each is a prefix of one order).
//
// Numerics: float32 throughout; exp is the Cephes polynomial of simd.h (about 1 ulp from XLA's), so scores
// agree with the jnp reference to a few ulps, and the overlap is exact for the scores returned.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "statistics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPool = 5;                // pallas_kernels.POOL_KERNEL_SIZE
constexpr int kHalf = kPool / 2;

// lax.top_k's order as unsigned integers: non-negative floats get the sign bit set, negative ones all bits
// flipped (pallas_kernels.pooled_scores._sortable_bits).
inline uint32_t sortable(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b >> 31) ? ~b : (b | 0x80000000u);
}

struct Scratch {  // per thread, reused between calls: no page faults for fresh buffers every step
  std::vector<float> e, pooled;
  std::vector<uint32_t> key, cand;
  std::vector<int32_t> top_pos;
  std::vector<uint8_t> member;
};

// softmax over x[0, n) into e[kHalf, kHalf + n), zeros around it (the pooling's zero padding)
void softmax_padded(const float* x, int64_t n, float* e) {
  std::fill(e, e + kHalf, 0.f);
  std::fill(e + kHalf + n, e + kHalf + n + kHalf, 0.f);
  if (n == 0) return;
  float* out = e + kHalf;
  const int64_t nv = n / W * W;
  vf mv = splat(kMask);
  for (int64_t i = 0; i < nv; i += W) mv = vmax(mv, loadv(x + i));
  float m = hmax(mv);
  for (int64_t i = nv; i < n; ++i) m = std::max(m, x[i]);
  const vf mm = splat(m);
  vf sv = splat(0.f);
  for (int64_t i = 0; i < nv; i += W) {
    const vf v = expv(loadv(x + i) - mm);
    storev(out + i, v);
    sv += v;
  }
  float s = hsum(sv);
  if (nv < n) {  // the tail through one padded vector (exp of the padding is exactly 0)
    alignas(64) float t[W];
    for (int i = 0; i < W; ++i) t[i] = nv + i < n ? x[nv + i] - m : kMask;
    const vf v = expv(loadv(t));
    for (int64_t i = nv; i < n; ++i) {
      out[i] = v[i - nv];
      s += v[i - nv];
    }
  }
  const float d = std::max(s, 1e-30f);
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] / d;
}

// The k-th largest (k in [1, T]) of key[0, T): (the key, how many keys are above it, how many equal it).
struct Kth {
  uint32_t key;
  int64_t greater, equal;
};

Kth kth_largest(const uint32_t* key, int64_t T, int64_t k, std::vector<uint32_t>& cand) {
  static constexpr int kShift[3] = {21, 10, 0};
  static constexpr int kBits[3] = {11, 11, 10};
  uint32_t prefix = 0, mask = 0;
  int64_t greater = 0, equal = 0;
  const uint32_t* src = key;
  int64_t m = T;
  cand.resize(T);
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = kShift[pass];
    const uint32_t bins = 1u << kBits[pass];
    uint32_t cnt[2048] = {0};
    for (int64_t i = 0; i < m; ++i) cnt[(src[i] >> sh) & (bins - 1)]++;  // src holds only matching keys
    uint32_t b = bins - 1;
    int64_t above = 0;
    for (; b > 0 && above + cnt[b] < k; --b) above += cnt[b];
    k -= above;
    greater += above;
    equal = cnt[b];
    prefix |= b << sh;
    mask |= (bins - 1) << sh;
    if (pass < 2) {  // keep the keys in bin b (in place after the first pass: writes never pass reads)
      int64_t w = 0;
      for (int64_t i = 0; i < m; ++i)
        if ((src[i] & mask) == prefix) cand[w++] = src[i];
      src = cand.data();
      m = w;
    }
  }
  return Kth{prefix, greater, equal};
}

// The positions (ascending) of the top k of keys[i] at positions pos[i], i < n (pos ascending, so ties go to
// the lower position as in lax.top_k), written to out[0, k); their keys to out_key (may be null).
void top_positions(const uint32_t* key, const int32_t* pos, int64_t n, int64_t k, std::vector<uint32_t>& cand,
                   int32_t* out, uint32_t* out_key) {
  if (k <= 0) return;
  const Kth kth = kth_largest(key, n, k, cand);
  int64_t ties_left = k - kth.greater, w = 0;
  for (int64_t i = 0; i < n && w < k; ++i) {
    const bool take = key[i] > kth.key || (key[i] == kth.key && ties_left-- > 0);
    if (take) {
      out[w] = pos ? pos[i] : static_cast<int32_t>(i);
      if (out_key) out_key[w] = key[i];
      ++w;
    }
  }
}

// The softmax of one query's row from the pool attention's exponentials (the fused call): p[t] =
// exp(x[t] - m[t / block]) with m[i] the attention's running max at block i (at least every x of the block), so
// x's softmax over [0, n) is p[t] * exp(m[t / block] - M) / sum, M the largest m. Into e as softmax_padded
// writes it. A product below the smallest normal float is 0, as exp(x - M) underflows to 0 there; no row at all
// (every m MASK_VALUE: the logits were MASK_VALUE) is uniform, as the softmax of equal logits.
void softmax_from_exp(const float* p, const float* m, int64_t block, int64_t n, float* e) {
  std::fill(e, e + kHalf, 0.f);
  std::fill(e + kHalf + n, e + kHalf + n + kHalf, 0.f);
  if (n == 0) return;
  float* out = e + kHalf;
  const int64_t nb = (n + block - 1) / block;
  float M = kMask;
  for (int64_t i = 0; i < nb; ++i) M = std::max(M, m[i]);
  if (M <= kMask) {
    std::fill(out, out + n, 1.f / static_cast<float>(n));
    return;
  }
  const vf tiny = splat(1.17549435e-38f);  // FLT_MIN
  vf sv = splat(0.f);
  float s = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const float f = std::exp(m[i] - M);
    const int64_t t0 = i * block, t1 = std::min(n, t0 + block);
    const vf fv = splat(f);
    int64_t t = t0;
    for (; t + W <= t1; t += W) {
      vf u = loadv(p + t) * fv;
      u = u < tiny ? splat(0.f) : u;
      storev(out + t, u);
      sv += u;
    }
    for (; t < t1; ++t) {
      float u = p[t] * f;
      u = u < 1.17549435e-38f ? 0.f : u;
      out[t] = u;
      s += u;
    }
  }
  const float d = std::max(s + hsum(sv), 1e-30f);
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] / d;
}

// scores and overlap of one row (the header's definition), each query's softmax over [0, n) put into e by
// softmax(g, n, e).
template <typename Softmax>
void row(Softmax softmax, int64_t G, int64_t T, int32_t length, const int32_t* k_base, int64_t K, float* scores,
         float* overlap, Scratch& sc) {
  const int64_t n = std::clamp<int64_t>(length, 0, T);
  sc.e.resize(T + 2 * kHalf);
  sc.pooled.resize(T);
  float* e = sc.e.data();
  float* agg = sc.pooled.data();
  for (int64_t g = 0; g < G; ++g) {
    softmax(g, n, e);
    // ((((x[t-2] + x[t-1]) + x[t]) + x[t+1]) + x[t+2]) / 5, the reference's order; max over the group
    for (int64_t t = 0; t < n; ++t) {
      const float v = ((((e[t] + e[t + 1]) + e[t + 2]) + e[t + 3]) + e[t + 4]) / static_cast<float>(kPool);
      agg[t] = g == 0 ? v : std::max(agg[t], v);
    }
  }
  for (int64_t t = 0; t < n; ++t) scores[t] = G > 0 ? agg[t] : 0.f;
  for (int64_t t = n; t < T; ++t) scores[t] = kMask;

  int64_t L = 0;
  for (int64_t j = 0; j < K; ++j) L += k_base[j] >= 0;
  const int64_t k = std::min(L, T);
  int64_t inter = 0;
  if (k > 0) {  // K_base's entries in the top-k set, the set the check's sets take (top_positions)
    sc.key.resize(T);
    uint32_t* key = sc.key.data();
    for (int64_t t = 0; t < T; ++t) key[t] = sortable(scores[t]);
    const Kth kth = kth_largest(key, T, k, sc.cand);
    if (kth.equal == 1) {  // no tie at the cut: the set is exactly the keys at or above the k-th
      for (int64_t j = 0; j < K; ++j) {
        const int32_t p = k_base[j];
        if (p >= 0 && p < length && p < T) inter += key[p] >= kth.key;
      }
    } else {  // a tie at the cut: lax.top_k's rule (the lower positions first) decides, as top_positions applies it
      sc.top_pos.resize(k);
      top_positions(key, nullptr, T, k, sc.cand, sc.top_pos.data(), nullptr);
      sc.member.assign(T, 0);
      for (int64_t i = 0; i < k; ++i) sc.member[sc.top_pos[i]] = 1;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t p = k_base[j];
        if (p >= 0 && p < length && p < T) inter += sc.member[p];
      }
    }
  }
  // pallas_kernels.normalised_overlap in float32
  const float lb = static_cast<float>(L);
  const float c = lb / std::max(static_cast<float>(length), 1.f);
  const float o = static_cast<float>(inter) / std::max(lb, 1.f);
  *overlap = c < 1.f ? (o - c) / std::max(1.f - c, 1e-12f) : 1.f;
}

// row() from logits [G, T]
void logits_row(const float* logits, int64_t G, int64_t T, int32_t length, const int32_t* k_base, int64_t K,
                float* scores, float* overlap, Scratch& sc) {
  row([&](int64_t g, int64_t n, float* e) { softmax_padded(logits + g * T, n, e); }, G, T, length, k_base, K, scores,
      overlap, sc);
}

void topk_sets_row(const float* scores, int64_t T, const int32_t* sizes, int64_t K, int64_t cap, int32_t* out,
                   Scratch& sc) {
  std::fill(out, out + K * cap, -1);
  int64_t kmax = 0;
  for (int64_t i = 0; i < K; ++i) kmax = std::max<int64_t>(kmax, std::clamp<int64_t>(sizes[i], 0, std::min(cap, T)));
  if (kmax == 0) return;
  sc.key.resize(T + kmax);
  sc.top_pos.resize(kmax);
  uint32_t* key = sc.key.data();
  uint32_t* top_key = key + T;
  int32_t* top_pos = sc.top_pos.data();
  for (int64_t t = 0; t < T; ++t) key[t] = sortable(scores[t]);
  top_positions(key, nullptr, T, kmax, sc.cand, top_pos, top_key);
  for (int64_t i = 0; i < K; ++i) {
    const int64_t k = std::clamp<int64_t>(sizes[i], 0, std::min(cap, T));
    if (k == kmax)
      std::copy(top_pos, top_pos + kmax, out + i * cap);
    else
      top_positions(top_key, top_pos, kmax, k, sc.cand, out + i * cap, nullptr);
  }
}

template <typename Dims>
int64_t prod(const Dims& d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

ffi::Error PivotStatisticsImpl(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> lengths,
                               ffi::Buffer<ffi::S32> k_base, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                               ffi::Result<ffi::Buffer<ffi::F32>> overlap) {
  const auto ld = logits.dimensions();
  const auto kd = k_base.dimensions();
  if (ld.size() < 3 || kd.size() < 2)
    return ffi::Error::InvalidArgument("pivot_statistics: logits must be [..., Hp, G, T], k_base [..., Hp, K]");
  const int64_t R = prod(ld, 0, ld.size() - 2), G = ld[ld.size() - 2], T = ld[ld.size() - 1];
  const int64_t K = kd[kd.size() - 1];
  if (lengths.element_count() != static_cast<size_t>(R) || prod(kd, 0, kd.size() - 1) != R)
    return ffi::Error::InvalidArgument("pivot_statistics: lengths must be [..., Hp] and k_base [..., Hp, K]");
  if (scores->element_count() != static_cast<size_t>(R * T) || overlap->element_count() != static_cast<size_t>(R))
    return ffi::Error::InvalidArgument("pivot_statistics: output shapes");
  thread_local Scratch sc;
  for (int64_t r = 0; r < R; ++r)
    logits_row(logits.typed_data() + r * G * T, G, T, lengths.typed_data()[r], k_base.typed_data() + r * K, K,
               scores->typed_data() + r * T, overlap->typed_data() + r, sc);
  return ffi::Error::Success();
}

ffi::Error TopkSetsImpl(ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> sizes, int64_t cap,
                        ffi::Result<ffi::Buffer<ffi::S32>> sets) {
  const auto sd = scores.dimensions();
  const auto zd = sizes.dimensions();
  if (sd.size() < 1 || zd.size() != sd.size() || cap < 1)
    return ffi::Error::InvalidArgument("topk_sets: scores must be [..., T], sizes [..., K], cap >= 1");
  const int64_t R = prod(sd, 0, sd.size() - 1), T = sd[sd.size() - 1], K = zd[zd.size() - 1];
  if (prod(zd, 0, zd.size() - 1) != R || sets->element_count() != static_cast<size_t>(R * K * cap))
    return ffi::Error::InvalidArgument("topk_sets: sizes must be [..., K] and the result [..., K, cap]");
  thread_local Scratch sc;
  for (int64_t r = 0; r < R; ++r)
    topk_sets_row(scores.typed_data() + r * T, T, sizes.typed_data() + r * K, K, cap,
                  sets->typed_data() + r * K * cap, sc);
  return ffi::Error::Success();
}

}  // namespace

namespace hetero_jax_native {

void pivot_row_statistics(const float* logits, int64_t G, int64_t T, int32_t length, const int32_t* k_base,
                          int64_t K, float* scores, float* overlap) {
  thread_local Scratch sc;
  logits_row(logits, G, T, length, k_base, K, scores, overlap, sc);
}

void pivot_row_statistics_from_exp(const float* p, const float* block_max, int64_t block, int64_t G, int64_t T,
                                   int32_t length, const int32_t* k_base, int64_t K, float* scores, float* overlap) {
  thread_local Scratch sc;
  const int64_t nb = (T + block - 1) / block;
  row([&](int64_t g, int64_t n, float* e) { softmax_from_exp(p + g * T, block_max + g * nb, block, n, e); }, G, T,
      length, k_base, K, scores, overlap, sc);
}

}  // namespace hetero_jax_native

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxPivotStatistics(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxPivotStatistics, PivotStatisticsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // k_base
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scores
                                  .Ret<ffi::Buffer<ffi::F32>>()); // overlap

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxTopkSets(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxTopkSets, TopkSetsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scores
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sizes
                                  .Attr<int64_t>("cap")
                                  .Ret<ffi::Buffer<ffi::S32>>()); // sets
