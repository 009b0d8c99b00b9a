// Page selection on the CPU: an XLA FFI custom call (target "hetero_jax_page_select") for Quest's and FreeKV's
// decode steps, pallas_kernels.page_select_reference's computation:
//   u[g, p]  = sum_d max(q[g, d] * kmin[p, d], q[g, d] * kmax[p, d])        (Quest's bound, float32)
//   s[p]     = max_g u[g, p]                                  (rule 0, "max": group-consistent Quest)
//            = mean_g softmax_p(u[g, :])[p]                   (rule 1, "mean_softmax": FreeKV's MeanS)
//   s[p]     = MASK_VALUE for p >= n_pages[b]
//   pages    = the n best pages, best first, ties to the lower page (lax.top_k); valid = score above MASK_VALUE
//              and slot below counts[b]; an invalid slot holds the head's best page (page 0 when it has none).
//
// Operands: q [B, H, G, D] f32, kmin / kmax [B, H, P, D] f32, n_pages [B] s32, counts [B] s32. Attribute rule.
// Results: pages [B, H, n] s32, valid [B, H, n] pred (n <= P).
//
// On XLA:CPU the reference is a handful of small fusions and a top_k per layer, each costing more than its data
// (hundreds of pages); here one call per layer, its heads shared with helper threads where the call is long
// enough (a head's result does not depend on which thread computes it). Sums run in another order than XLA's,
// so scores may differ in their last ulps and a near tie may go the other way (tests compare the selection
// against the reference's scores with a tolerance).

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Quest's bound of query qv over page rows lo / hi [D].
inline float bound(const float* qv, const float* lo, const float* hi, int64_t D) {
  vf acc = splat(0.f);
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    const vf x = loadv(qv + d);
    const vf a = x * loadv(lo + d), b = x * loadv(hi + d);
    acc += a > b ? a : b;
  }
  float s = hsum(acc);
  for (; d < D; ++d) s += std::max(qv[d] * lo[d], qv[d] * hi[d]);
  return s;
}

// Bounds of query qv over pages [p0, p0 + 8) into out[0:8]: the page rows read once per query, the eight sums
// reduced together (one transposing reduction instead of eight horizontal sums). D a multiple of W.
inline void bound8(const float* qv, const float* lo, const float* hi, int64_t D, float* out) {
  vf acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = splat(0.f);
  for (int64_t d = 0; d < D; d += W) {
    const vf x = loadv(qv + d);
    for (int k = 0; k < 8; ++k) {
      const vf a = x * loadv(lo + k * D + d), b = x * loadv(hi + k * D + d);
      acc[k] += a > b ? a : b;
    }
  }
  store8(out, reduce8(fold8(acc[0]), fold8(acc[1]), fold8(acc[2]), fold8(acc[3]), fold8(acc[4]), fold8(acc[5]),
                      fold8(acc[6]), fold8(acc[7])));
}

constexpr int64_t kHelperUnits = 1536;  // see PageSelectImpl

struct SelectJob {
  WorkItems queue;         // one item a head (b * H + h)
  const float* q;          // [B, H, G, D]
  const float* kmin;       // [B, H, P, D]
  const float* kmax;       // [B, H, P, D]
  const int32_t* n_pages;  // [B]
  const int32_t* counts;   // [B]
  int32_t* pages;          // [B, H, n]
  bool* valid;             // [B, H, n]
  int64_t B, H, G, D, P, n, rule;
};

// Head bh = b * H + h: its pages' scores and its n best pages, into the job's results.
void SelectHead(const SelectJob& j, int64_t bh, std::vector<float>& u, std::vector<float>& s,
                std::vector<int32_t>& order) {
  const int64_t G = j.G, D = j.D, P = j.P, n = j.n, b = bh / j.H;
  u.resize(G * P);
  s.resize(P);
  order.resize(P);
  const int64_t np = std::clamp<int64_t>(j.n_pages[b], 0, P);
  const int64_t keep = j.counts[b];
  const float* qh = j.q + bh * G * D;
  const float* lo = j.kmin + bh * P * D;
  const float* hi = j.kmax + bh * P * D;
  // pages in blocks of 8 (the block's rows stay in L1 across the group's queries), the rest one by one
  const int64_t blocked = D % W == 0 ? np / 8 * 8 : 0;
  for (int64_t p0 = 0; p0 < blocked; p0 += 8)
    for (int64_t g = 0; g < G; ++g) bound8(qh + g * D, lo + p0 * D, hi + p0 * D, D, u.data() + g * P + p0);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t p = blocked; p < np; ++p) u[g * P + p] = bound(qh + g * D, lo + p * D, hi + p * D, D);
    std::fill(u.begin() + g * P + np, u.begin() + (g + 1) * P, kMask);
  }
  if (j.rule == 0) {
    for (int64_t p = 0; p < P; ++p) {
      float m = u[p];
      for (int64_t g = 1; g < G; ++g) m = std::max(m, u[g * P + p]);
      s[p] = m;
    }
  } else {
    std::fill(s.begin(), s.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {  // softmax over all P entries (MASK_VALUE ones get 0), then the mean
      float* ug = u.data() + g * P;
      const float m = *std::max_element(ug, ug + P);
      float z = 0.f;
      int64_t p = 0;
      if (P >= W) {
        vf zv = splat(0.f);
        for (; p + W <= P; p += W) {
          const vf e = expv(loadv(ug + p) - m);
          storev(ug + p, e);
          zv += e;
        }
        z = hsum(zv);
      }
      for (; p < P; ++p) z += (ug[p] = std::exp(ug[p] - m));
      for (int64_t p = 0; p < P; ++p) s[p] += ug[p] / z;
    }
    for (int64_t p = 0; p < P; ++p) s[p] /= static_cast<float>(G);
  }
  for (int64_t p = np; p < P; ++p) s[p] = kMask;
  // the n best, best first, ties to the lower page
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t c) { return s[a] > s[c] || (s[a] == s[c] && a < c); };
  if (n < P) std::nth_element(order.begin(), order.begin() + n, order.end(), better);
  std::sort(order.begin(), order.begin() + n, better);
  int32_t* out = j.pages + bh * n;
  bool* ok = j.valid + bh * n;
  for (int64_t i = 0; i < n; ++i) ok[i] = s[order[i]] > kMask && i < keep;
  const int32_t filler = ok[0] ? order[0] : 0;
  for (int64_t i = 0; i < n; ++i) out[i] = ok[i] ? order[i] : filler;
}

// Takes heads from the job until none is left.
void SelectWork(SelectJob& j) {
  thread_local std::vector<float> u, s;
  thread_local std::vector<int32_t> order;
  TakeItems(j.queue, [&](int64_t bh) { SelectHead(j, bh, u, s, order); });
}

ffi::Error PageSelectImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kmin, ffi::Buffer<ffi::F32> kmax,
                          ffi::Buffer<ffi::S32> n_pages, ffi::Buffer<ffi::S32> counts, int64_t rule,
                          ffi::Result<ffi::Buffer<ffi::S32>> pages, ffi::Result<ffi::Buffer<ffi::PRED>> valid) {
  const auto qd = q.dimensions();
  const auto kd = kmin.dimensions();
  const auto pd = pages->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || pd.size() != 3)
    return ffi::Error::InvalidArgument("page_select: q must be [B, H, G, D], kmin/kmax [B, H, P, D], pages [B, H, n]");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3], P = kd[2], n = pd[2];
  if (kd[0] != B || kd[1] != H || kd[3] != D || kmax.element_count() != kmin.element_count())
    return ffi::Error::InvalidArgument("page_select: kmin and kmax must be [B, H, P, D] matching q");
  if (n_pages.element_count() != static_cast<size_t>(B) || counts.element_count() != static_cast<size_t>(B))
    return ffi::Error::InvalidArgument("page_select: n_pages and counts must be [B]");
  if (pd[0] != B || pd[1] != H || n < 1 || n > P || valid->element_count() != pages->element_count())
    return ffi::Error::InvalidArgument("page_select: pages and valid must be [B, H, n], 1 <= n <= P");
  if (rule != 0 && rule != 1) return ffi::Error::InvalidArgument("page_select: rule must be 0 (max) or 1 (mean_softmax)");

  auto job = std::make_shared<SelectJob>();
  job->queue.n = B * H;
  job->q = q.typed_data(); job->kmin = kmin.typed_data(); job->kmax = kmax.typed_data();
  job->n_pages = n_pages.typed_data(); job->counts = counts.typed_data();
  job->pages = pages->typed_data(); job->valid = valid->typed_data();
  job->B = B; job->H = H; job->G = G; job->D = D; job->P = P; job->n = n; job->rule = rule;
  // Helpers (XLA's intra-op pool) for calls with several heads and enough pages to pay for a wake-up (work
  // units: a page's G bounds and its two summary rows, per 64 lanes of D; FreeKV's 4K layers are 1,920, its 2K
  // layers half, where a helper lost: RESULTS `page-select-threads`). The caller works too and waits only for
  // heads a helper took, so a late helper costs nothing. HETERO_JAX_NATIVE_THREADS caps the threads.
  const int64_t workers = native_workers(pool);
  const bool parallel = workers > 1 && B * H > 1 && B * H * P * (G + 2) * D / 64 >= kHelperUnits;
  RunOnHelpers(pool, job, job->queue, parallel ? std::min(workers - 1, B * H - 1) : 0, SelectWork);
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxPageSelect(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxPageSelect, PageSelectImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kmin
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kmax
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // counts
                                  .Attr<int64_t>("rule")
                                  .Ret<ffi::Buffer<ffi::S32>>()   // pages
                                  .Ret<ffi::Buffer<ffi::PRED>>());  // valid
