// Page recall in place on the CPU: an XLA FFI custom call (target "hetero_jax_page_recall") for FreeKV's and
// offloaded Quest's decode steps on a CPU backend, pallas_kernels.page_recall_reference's computation. On a CPU
// the host store is the device's own memory, so a step can move the pages its slots should hold (the previous
// step's selection) from the store into the pool itself, before it attends them: only the pages that changed,
// the rows copied once, no host work between steps.
//
// Per sequence b and KV head h, over the first k_sel[b] slots:
//   new pages   = pending[j] not among resident[0:k_sel], in slot order j
//   freed slots = resident[i] not among pending[0:k_sel], in slot order i
//   the m-th new page goes to the m-th freed slot (what the host recall, speculative.PageRecallDecode, does):
//   pool row offsets[b, h] + start[b] + slot * ps + r  <-  store row start[b] + page * ps + r,  r < ps
//   (K, V and the position start[b] + page * ps + r).
//
// Operands: pool_k / pool_v [B, 1, R, D] (any float dtype), pool_pos [B, 1, R] s32, store_k / store_v [B, H, T, D]
// (the pool's dtype), offsets [B, H] s32, pending / resident [B, H, n] s32, start [B] s32, k_sel [B] s32.
// Attribute page_size. Results: pool_k, pool_v, pool_pos (aliased to operands 0-2: only the moved rows are
// written), resident' [B, H, n] s32, moved [B] s32 (pages that entered a slot, summed over heads).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error PageRecallImpl(ffi::AnyBuffer pool_k, ffi::AnyBuffer pool_v, ffi::Buffer<ffi::S32> pool_pos,
                          ffi::AnyBuffer store_k, ffi::AnyBuffer store_v, ffi::Buffer<ffi::S32> offsets,
                          ffi::Buffer<ffi::S32> pending, ffi::Buffer<ffi::S32> resident, ffi::Buffer<ffi::S32> start,
                          ffi::Buffer<ffi::S32> k_sel, int64_t page_size, ffi::Result<ffi::AnyBuffer> out_k,
                          ffi::Result<ffi::AnyBuffer> out_v, ffi::Result<ffi::Buffer<ffi::S32>> out_pos,
                          ffi::Result<ffi::Buffer<ffi::S32>> out_resident, ffi::Result<ffi::Buffer<ffi::S32>> moved) {
  const auto pd = pool_k.dimensions();
  const auto sd = store_k.dimensions();
  const auto nd = pending.dimensions();
  if (pd.size() != 4 || pd[1] != 1 || sd.size() != 4 || nd.size() != 3)
    return ffi::Error::InvalidArgument("page_recall: pool must be [B, 1, R, D], store [B, H, T, D], pending [B, H, n]");
  const int64_t B = pd[0], R = pd[2], D = pd[3], H = sd[1], T = sd[2], n = nd[2], ps = page_size;
  if (pool_k.element_type() != store_k.element_type() || pool_v.element_type() != pool_k.element_type() ||
      store_v.element_type() != pool_k.element_type())
    return ffi::Error::InvalidArgument("page_recall: the pool and the store must have one dtype");
  if (sd[0] != B || sd[3] != D || store_v.element_count() != store_k.element_count() ||
      pool_v.element_count() != pool_k.element_count() || pool_pos.element_count() != static_cast<size_t>(B * R))
    return ffi::Error::InvalidArgument("page_recall: pool [B, 1, R, D] and store [B, H, T, D] must agree on B and D");
  if (nd[0] != B || nd[1] != H || resident.element_count() != pending.element_count() ||
      offsets.element_count() != static_cast<size_t>(B * H) || start.element_count() != static_cast<size_t>(B) ||
      k_sel.element_count() != static_cast<size_t>(B))
    return ffi::Error::InvalidArgument("page_recall: pending / resident [B, H, n], offsets [B, H], start / k_sel [B]");
  if (ps < 1) return ffi::Error::InvalidArgument("page_recall: page_size must be >= 1");
  if (pool_k.untyped_data() != out_k->untyped_data() || pool_v.untyped_data() != out_v->untyped_data() ||
      pool_pos.typed_data() != out_pos->typed_data())
    return ffi::Error::InvalidArgument("page_recall: the pool results must alias the pool operands");

  const size_t row = D * ffi::ByteWidth(pool_k.element_type());
  auto* pk = static_cast<char*>(out_k->untyped_data());
  auto* pv = static_cast<char*>(out_v->untyped_data());
  int32_t* pos = out_pos->typed_data();
  const auto* sk = static_cast<const char*>(store_k.untyped_data());
  const auto* sv = static_cast<const char*>(store_v.untyped_data());
  const int32_t* pend = pending.typed_data();
  const int32_t* res = resident.typed_data();
  int32_t* res_out = out_resident->typed_data();
  std::copy(res, res + B * H * n, res_out);

  // slot + 1 of a page held (0: not held), one entry per page id; a page id beyond the store is an error
  const int64_t max_pages = T / ps + 1;
  std::vector<int32_t> held_at(max_pages, 0), chosen(max_pages, 0);
  std::vector<int32_t> fresh, freed;
  fresh.reserve(n);
  freed.reserve(n);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = start.typed_data()[b], ks = std::clamp<int64_t>(k_sel.typed_data()[b], 0, n);
    int32_t count = 0;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      const int32_t* p = pend + bh * n;
      const int32_t* r = res + bh * n;
      for (int64_t j = 0; j < ks; ++j) {
        if (p[j] < 0 || p[j] >= max_pages || r[j] < 0 || r[j] >= max_pages)
          return ffi::Error::InvalidArgument("page_recall: a page id outside the store");
        held_at[r[j]] = 1;
        chosen[p[j]] = 1;
      }
      fresh.clear();
      freed.clear();
      for (int64_t j = 0; j < ks; ++j) {
        if (!held_at[p[j]]) fresh.push_back(p[j]);
        if (!chosen[r[j]]) freed.push_back(static_cast<int32_t>(j));
      }
      for (int64_t j = 0; j < ks; ++j) held_at[r[j]] = chosen[p[j]] = 0;  // clear for the next head
      const size_t m = std::min(fresh.size(), freed.size());
      const int64_t off = offsets.typed_data()[bh];
      for (size_t i = 0; i < m; ++i) {
        const int64_t page = fresh[i], slot = freed[i];
        const int64_t src = s0 + page * ps, dst = off + s0 + slot * ps;
        if (src < 0 || src + ps > T || dst < 0 || dst + ps > R)
          return ffi::Error::InvalidArgument("page_recall: a page or slot outside the store or the pool");
        const size_t s_at = (bh * T + src) * row, d_at = (b * R + dst) * row;
        std::memcpy(pk + d_at, sk + s_at, ps * row);  // a page is ps consecutive rows on both sides
        std::memcpy(pv + d_at, sv + s_at, ps * row);
        for (int64_t i2 = 0; i2 < ps; ++i2) pos[b * R + dst + i2] = static_cast<int32_t>(src + i2);
        res_out[bh * n + slot] = static_cast<int32_t>(page);
      }
      count += static_cast<int32_t>(m);
    }
    moved->typed_data()[b] = count;
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxPageRecall(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxPageRecall, PageRecallImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool_k
                                  .Arg<ffi::AnyBuffer>()          // pool_v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pool_pos
                                  .Arg<ffi::AnyBuffer>()          // store_k
                                  .Arg<ffi::AnyBuffer>()          // store_v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pending
                                  .Arg<ffi::Buffer<ffi::S32>>()   // resident
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // k_sel
                                  .Attr<int64_t>("page_size")
                                  .Ret<ffi::AnyBuffer>()          // pool_k (aliased)
                                  .Ret<ffi::AnyBuffer>()          // pool_v (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // pool_pos (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // resident'
                                  .Ret<ffi::Buffer<ffi::S32>>());  // moved
