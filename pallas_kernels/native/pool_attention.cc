// Pool attention on the CPU: an XLA FFI custom call (target "hetero_jax_pool_attention").
//
// Computes exactly what pallas_kernels/pool_attention.py documents (pool_attention_reference): every KV head
// h of sequence b attends the rows [offsets[b, h], offsets[b, h] + lengths[b, h] + t) of k_pool[b] / v_pool[b]
// for query position t, reading the pool in place (XLA on the CPU cannot read a sub-range of a buffer without
// copying it).
//
// Operands (leading batch dims are flattened into B, so vmap_method="broadcast_all" works):
//   q       [B, H, T, G, D]   float32 / bfloat16 / float16
//   k_pool  [B, P, D]         float32 / bfloat16 / float16 (v_pool the same dtype)
//   v_pool  [B, P, D]
//   offsets [B, H] int32, lengths [B, H] int32, flags [B, H] int32 (1: write this head's logits)
//   block_rows [B, H, NB] int32: with block_size > 0 a head is paged, its logical row j being region row
//     block_rows[b, h, j / block_size] + j % block_size (Quest's and FreeKV's pages, read in place)
// Attributes: sm_scale (f32), score_len (i64), chunk_rows (i64; 0 = automatic, > 0 forces that split: tests),
//   block_size (i64; 0 = contiguous heads, else a power of two: the rows of one block of block_rows),
//   max_len (i64 >= 0): query position t sees n = clip(lengths + t, 0, max_len) rows, as in the reference.
// Results: out [B, H, T, G, D] in q's dtype, lse [B, H, T, G] f32, logits [B, H, G, score_len] f32.
//
// "hetero_jax_pool_attention_statistics" (T == 1, score_len > 0): the same attention, but flags[b, h] is the
// row (0 .. Hs - 1, -1 for none) of a scored head among the Hs scored heads, and instead of their logits it
// returns HeteroCache's drift statistics of each scored head (statistics.h): two more operands,
// stat_lengths [B, Hs] s32 (the prompt rows a statistic is over) and k_base [B, Hs, K] s32, and the results
// out, lse, scores [B, Hs, score_len] f32, overlap [B, Hs] f32. A scored head's exponentials (the online
// softmax's exp(logit - running max), with the running max of each block) go to buffers of the calling thread,
// and the thread that merges a scored head's last chunk computes its statistics from them while the others go
// on with their items: no second call, no second read of logits from memory, and no second exp per row (the
// statistics' softmax rescales the blocks' exponentials; scores within a few ulps of the logits' form).
//
// Work split: items are (b, h, key chunk). A head is cut into chunks of about 256 rows (at most 16 of them)
// whatever the call, so its result is the same bits alone, in a batch or on any number of threads; the
// chunks of a head are merged by log-sum-exp, in chunk order, by whichever thread finishes the head's last
// chunk. Threads, for calls long enough to pay: the caller plus helpers scheduled on XLA's intra-op pool
// (ffi::ThreadPool) pull items (longest first) from an atomic counter; the caller waits only for items that
// were taken, so a helper that starts late (or never, on a saturated pool) cannot stall or deadlock the call.
//
// Inner loop: blocks of 64 rows (32 at D = 128, 16 above). Per block and query (t, g): the block's logits
// 8 rows at a time (a transposing reduction of 8 accumulators), one max / rescale, a vectorised exp, and
// P.V accumulated in registers. K and V stay in L1 across the T*G queries, so each row comes from memory
// once. float32 rows are read in place; bfloat16 / float16 rows are widened into a float32 block first.
//
// Masks: MASK_VALUE (-1e30, finite) is the running max before any row; exp() of a difference at or below
// about -87.3 returns exactly 0, never NaN. No row outside a head's range [o, o + lengths + T - 1) is read:
// a chunk ends at the last row any query of the head sees, and each query's logits stop at its own end.
// A head whose offset is outside [0, P) is empty, and a range past the pool's end is cut there, as in the
// reference and the Pallas kernel (callers keep ranges inside the pool, and the Python entry points refuse
// concrete ones that leave it; this keeps a bad traced call from reading out of bounds). A paged head's rows
// are clipped into [0, P) one by one, as the reference clips them.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "simd.h"
#include "threads.h"
#include "statistics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------
// Element types.

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__FLT16_MANT_DIG__)
typedef _Float16 half_t;
inline float f16_to_f32(uint16_t h) {
  half_t x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline uint16_t f32_to_f16(float f) {
  half_t x = static_cast<half_t>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
#else
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: a normal float
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    u = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (a < 0x38800000u) {                                                 // subnormal or zero half
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;
    uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((a - 0x38000000u) >> 13);
  uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
#endif

enum class Elem { kF32, kBF16, kF16 };

inline float load_elem(const void* p, int64_t i, Elem e) {
  switch (e) {
    case Elem::kF32: return static_cast<const float*>(p)[i];
    case Elem::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_elem(void* p, int64_t i, float x, Elem e) {
  switch (e) {
    case Elem::kF32: static_cast<float*>(p)[i] = x; break;
    case Elem::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(x); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(x); break;
  }
}

// Rows [r0, r0 + n) of a [*, D] array of KV elements, as float32 rows of stride Dp (zero padding).
template <typename KV>
void rows_to_f32(const KV* src, int64_t D, int64_t Dp, int64_t n, float* dst);

template <>
void rows_to_f32<float>(const float* src, int64_t D, int64_t Dp, int64_t n, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(dst + r * Dp, src + r * D, D * sizeof(float));
    for (int64_t d = D; d < Dp; ++d) dst[r * Dp + d] = 0.f;
  }
}

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

template <>
void rows_to_f32<BF16>(const BF16* src, int64_t D, int64_t Dp, int64_t n, float* dst) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t r = 0; r < n; ++r) {
    uint32_t* o = reinterpret_cast<uint32_t*>(dst + r * Dp);
    const uint16_t* sr = s + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(sr[d]) << 16;
    for (int64_t d = D; d < Dp; ++d) o[d] = 0u;
  }
}

template <>
void rows_to_f32<F16>(const F16* src, int64_t D, int64_t Dp, int64_t n, float* dst) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t r = 0; r < n; ++r) {
    float* o = dst + r * Dp;
    const uint16_t* sr = s + r * D;
#if defined(__FLT16_MANT_DIG__)
    const half_t* hr = reinterpret_cast<const half_t*>(sr);
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(hr[d]);
#else
    for (int64_t d = 0; d < D; ++d) o[d] = f16_to_f32(sr[d]);
#endif
    for (int64_t d = D; d < Dp; ++d) o[d] = 0.f;
  }
}

// ---------------------------------------------------------------------------------------------------------
// The problem and its work items.

struct Problem {
  int64_t B, H, T, G, D, Dp, P, S;  // S = score_len
  int64_t QG;                       // T * G queries per head
  const float* q;                   // [B, H, T, G, Dp] float32, already times sm_scale
  const void* k;                    // [B, P, D]
  const void* v;
  const int32_t* offsets;           // [B, H]
  const int32_t* lengths;
  void* out;                        // [B, H, T, G, D] in out_elem
  Elem out_elem;
  float* lse;                       // [B, H, T, G]
  float* logits;                    // [rows, G, S], a head's row at Head::logit_row (statistics: exponentials)
  float* block_max;                 // statistics: [rows, G, NBs] the running max each block's exponentials are from
  int64_t NBs;                      // blocks of S rows
  // statistics of the scored heads' rows (hetero_jax_pool_attention_statistics), or stat_lengths == nullptr
  const int32_t* stat_lengths;      // [rows]
  const int32_t* k_base;            // [rows, K]
  int64_t K;
  float* scores;                    // [rows, S]
  float* overlap;                   // [rows]
  int64_t block;                    // rows per block (divides `page` where heads are paged)
  const int32_t* block_rows;        // [B, H, NB] first region row of each logical block of `page` rows
  int64_t NB, page;                 // page = 0: contiguous heads
};

struct Head {
  int64_t start;     // first pool row (b * P + offset; a paged head: b * P)
  int64_t off;       // a paged head's offset in its sequence's pool (region row r is pool row off + r)
  int64_t n0;        // rows query position 0 sees (may be <= 0)
  int64_t rows;      // rows any query of the head sees (clamped to the pool)
  int64_t first_part;
  int32_t nparts;
  int64_t logit_row; // its row of logits (-1: none)
  bool scored;       // writes its logits (else its row is MASK_VALUE)
};

struct Item {
  int64_t bh;
  int64_t c0, c1;    // rows [c0, c1) of the head
  int64_t part;      // index of this item's partial result
};

// <qv, k_j> for 8 rows j0..j0+7 of a block (rows past cnt - 1 read row cnt - 1: never past the block).
template <int ND>
inline f8 logits8(const float* qv, const float* kb, int64_t Dp, int64_t nd_rt, int64_t j0, int64_t cnt) {
  const int64_t nd = ND > 0 ? ND : nd_rt;
  const int64_t stride = ND > 0 ? ND * W : Dp;  // a constant where ND is
  const float* kr[8];
  if (j0 + 8 <= cnt) {
    for (int r = 0; r < 8; ++r) kr[r] = kb + (j0 + r) * stride;
  } else {
    for (int r = 0; r < 8; ++r) kr[r] = kb + std::min<int64_t>(j0 + r, cnt - 1) * stride;
  }
  vf a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < nd; ++i) {
    const vf x = loadv(qv + W * i);
    a0 += x * loadv(kr[0] + W * i);
    a1 += x * loadv(kr[1] + W * i);
    a2 += x * loadv(kr[2] + W * i);
    a3 += x * loadv(kr[3] + W * i);
    a4 += x * loadv(kr[4] + W * i);
    a5 += x * loadv(kr[5] + W * i);
    a6 += x * loadv(kr[6] + W * i);
    a7 += x * loadv(kr[7] + W * i);
  }
  return reduce8(fold8(a0), fold8(a1), fold8(a2), fold8(a3), fold8(a4), fold8(a5), fold8(a6), fold8(a7));
}

// s[j] = <qv, k_j> for the rows [0, cnt) of a block (row stride Dp), MASK_VALUE on [cnt, round_up(cnt, W));
// returns max_j s[j]. Whole W-lane stores, so the loads that follow forward from them.
template <int ND>
inline float block_logits(const float* qv, const float* kb, int64_t Dp, int64_t nd_rt, int64_t cnt, float* s) {
  vi iota;
  for (int i = 0; i < W; ++i) iota[i] = i;
  vf mx = splat(kMask);
  for (int64_t j = 0; j < cnt; j += W) {
    const f8 lo = logits8<ND>(qv, kb, Dp, nd_rt, j, cnt);
#if defined(__AVX512F__)
    const f8 hi = j + 8 < cnt ? logits8<ND>(qv, kb, Dp, nd_rt, j + 8, cnt) : lo;
    vf sv = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf sv = lo;
#endif
    if (j + W > cnt) sv = (iota + static_cast<int32_t>(j)) < static_cast<int32_t>(cnt) ? sv : splat(kMask);
    storev(s + j, sv);
    mx = vmax(mx, sv);
  }
  return hmax(mx);
}

// acc[0, Dp) = alpha * acc + sum_{j < cnt} p[j] * v_j.
template <int ND>
inline void block_pv(float* acc, float alpha, const float* p, const float* vb, int64_t Dp, int64_t nd_rt,
                     int64_t cnt) {
  if (ND > 0) {
    // column tiles of at most 8 vectors (accumulators stay in registers); below 8 vectors two sets of
    // accumulators (even and odd rows), so at least 8 independent FMA chains run
    constexpr int CT = ND < 8 ? ND : 8;
    constexpr int R = CT >= 8 ? 1 : 2;
    constexpr int64_t stride = ND * W;
    (void)Dp;
    for (int c = 0; c < ND; c += CT) {
      float* a = acc + W * c;
      const float* vc = vb + W * c;
      vf r[R][CT];
      for (int i = 0; i < CT; ++i) {
        r[0][i] = loadv(a + W * i) * alpha;
        if (R > 1) r[R - 1][i] = splat(0.f);
      }
      int64_t j = 0;
      for (; j + R <= cnt; j += R) {
        for (int u = 0; u < R; ++u) {
          const vf pj = splat(p[j + u]);
          const float* vr = vc + (j + u) * stride;
          for (int i = 0; i < CT; ++i) r[u][i] += pj * loadv(vr + W * i);
        }
      }
      for (; j < cnt; ++j) {
        const vf pj = splat(p[j]);
        const float* vr = vc + j * stride;
        for (int i = 0; i < CT; ++i) r[0][i] += pj * loadv(vr + W * i);
      }
      for (int i = 0; i < CT; ++i) storev(a + W * i, R > 1 ? r[0][i] + r[R - 1][i] : r[0][i]);
    }
  } else {
    for (int64_t i = 0; i < nd_rt; ++i) storev(acc + W * i, loadv(acc + W * i) * alpha);
    for (int64_t j = 0; j < cnt; ++j) {
      const vf pj = splat(p[j]);
      const float* vr = vb + j * Dp;
      for (int64_t i = 0; i < nd_rt; ++i) storev(acc + W * i, loadv(acc + W * i) + pj * loadv(vr + W * i));
    }
  }
}

constexpr int kMaxBlock = 64;
constexpr int64_t kChunkRows = 256;  // rows of a head's work item (its rows cut evenly on blocks) ...
constexpr int64_t kMaxChunks = 16;   // ... into at most this many items (a long head's items grow instead)

// One chunk: running max m[QG], sum l[QG] and unnormalised accumulator acc[QG, Dp], written to part.
template <typename KV, int ND>
void run_chunk(const Problem& pb, const Head& hd, int64_t bh, int64_t c0, int64_t c1, float* part,
               float* kbuf, float* vbuf) {
  const int64_t QG = pb.QG, G = pb.G, D = pb.D, Dp = pb.Dp;
  const int64_t nd = Dp / W;
  float* m = part;
  float* l = part + QG;
  float* acc = part + 2 * QG;
  for (int64_t i = 0; i < QG; ++i) { m[i] = kMask; l[i] = 0.f; }
  std::memset(acc, 0, sizeof(float) * QG * Dp);

  const bool direct = std::is_same<KV, float>::value && Dp == D;
  const KV* kp = static_cast<const KV*>(pb.k) + hd.start * D;
  const KV* vp = static_cast<const KV*>(pb.v) + hd.start * D;
  const float* qh = pb.q + bh * QG * Dp;
  const bool write_logits = pb.S > 0 && hd.scored;  // S > 0 only with T == 1
  float* lg = pb.logits + hd.logit_row * G * pb.S;
  alignas(64) float s[kMaxBlock + W];

  for (int64_t j0 = c0; j0 < c1; j0 += pb.block) {
    const int64_t j1 = std::min(c1, j0 + pb.block);
    const int64_t nb = j1 - j0;
    // the block's first row after hd.start: the head's own row j0, or where a paged head's block lies (in one page)
    const int64_t row = pb.page > 0 ? hd.off + pb.block_rows[bh * pb.NB + j0 / pb.page] + j0 % pb.page : j0;
    const float *kb, *vb;
    if (pb.page > 0 && (row < 0 || row + nb > pb.P)) {
      // rows clipped into the pool one by one (the reference's rule; callers never ask for it)
      for (int64_t r = 0; r < nb; ++r) {
        const int64_t c = std::min<int64_t>(std::max<int64_t>(row + r, 0), pb.P - 1);
        rows_to_f32<KV>(kp + c * D, D, Dp, 1, kbuf + r * Dp);
        rows_to_f32<KV>(vp + c * D, D, Dp, 1, vbuf + r * Dp);
      }
      kb = kbuf;
      vb = vbuf;
    } else if (direct) {
      kb = reinterpret_cast<const float*>(kp) + row * D;
      vb = reinterpret_cast<const float*>(vp) + row * D;
    } else {
      rows_to_f32<KV>(kp + row * D, D, Dp, nb, kbuf);
      rows_to_f32<KV>(vp + row * D, D, Dp, nb, vbuf);
      kb = kbuf;
      vb = vbuf;
    }
    for (int64_t t = 0; t < pb.T; ++t) {
      const int64_t vis = std::min(hd.rows, hd.n0 + t);  // rows this position sees
      const int64_t cnt = std::min(j1, vis) - j0;         // of this block
      if (cnt <= 0) continue;
      const int64_t cntw = (cnt + W - 1) / W * W;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qi = t * G + g;
        const float bm = block_logits<ND>(qh + qi * Dp, kb, Dp, nd, cnt, s);
        const bool to_logits = write_logits && j0 < pb.S;
        if (to_logits && pb.block_max == nullptr)
          std::memcpy(lg + g * pb.S + j0, s, sizeof(float) * std::min(cnt, pb.S - j0));
        const float m_old = m[qi];
        const float m_new = bm > m_old ? bm : m_old;
        const float alpha = std::exp(m_old - m_new);  // 0 while m_old is MASK_VALUE
        vf lsum = splat(0.f);
        for (int64_t j = 0; j < cntw; j += W) {
          const vf p = expv(loadv(s + j) - m_new);
          storev(s + j, p);
          lsum += p;
        }
        if (to_logits && pb.block_max != nullptr) {  // the statistics' softmax from these exponentials
          std::memcpy(lg + g * pb.S + j0, s, sizeof(float) * std::min(cnt, pb.S - j0));
          pb.block_max[(hd.logit_row * G + g) * pb.NBs + j0 / pb.block] = m_new;
        }
        m[qi] = m_new;
        l[qi] = l[qi] * alpha + hsum(lsum);
        block_pv<ND>(acc + qi * Dp, alpha, s, vb, Dp, nd, cnt);
      }
    }
  }
}

// Merges a head's partials into out / lse, fills its logits past the written rows with MASK_VALUE, and
// computes a scored head's statistics where the call asks for them.
void finalize(const Problem& pb, const Head& hd, int64_t bh, const float* parts) {
  const int64_t QG = pb.QG, D = pb.D, Dp = pb.Dp, stride = 2 * QG + QG * Dp;
  std::vector<float> o(Dp);
  for (int64_t qi = 0; qi < QG; ++qi) {
    float M = kMask;
    for (int32_t c = 0; c < hd.nparts; ++c) M = std::max(M, parts[c * stride + qi]);
    float L = 0.f;
    std::fill(o.begin(), o.end(), 0.f);
    for (int32_t c = 0; c < hd.nparts; ++c) {
      const float* pc = parts + c * stride;
      const float l = pc[QG + qi];
      if (!(l > 0.f)) continue;  // no visible row in this chunk
      const float w = std::exp(pc[qi] - M);
      L += w * l;
      const float* a = pc + 2 * QG + qi * Dp;
      for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const int64_t oi = bh * QG + qi;
    if (L > 0.f) {
      const float inv = 1.f / L;
      for (int64_t d = 0; d < D; ++d) store_elem(pb.out, oi * D + d, o[d] * inv, pb.out_elem);
      pb.lse[oi] = M + std::log(L);
    } else {
      for (int64_t d = 0; d < D; ++d) store_elem(pb.out, oi * D + d, 0.f, pb.out_elem);
      pb.lse[oi] = kMask;
    }
  }
  if (pb.S > 0 && hd.logit_row >= 0) {
    const int64_t written = hd.scored ? std::max<int64_t>(0, std::min(pb.S, std::min(hd.rows, hd.n0))) : 0;
    float* lg = pb.logits + hd.logit_row * pb.G * pb.S;
    if (pb.stat_lengths == nullptr) {
      for (int64_t g = 0; g < pb.G; ++g) std::fill(lg + g * pb.S + written, lg + (g + 1) * pb.S, kMask);
    } else {  // exponentials: none past the written rows, and no block max for a block without one
      const int64_t r = hd.logit_row;
      float* bm = pb.block_max + r * pb.G * pb.NBs;
      const int64_t first_empty = (written + pb.block - 1) / pb.block;
      for (int64_t g = 0; g < pb.G; ++g) {
        std::fill(lg + g * pb.S + written, lg + (g + 1) * pb.S, 0.f);
        std::fill(bm + g * pb.NBs + first_empty, bm + (g + 1) * pb.NBs, kMask);
      }
      hetero_jax_native::pivot_row_statistics_from_exp(lg, bm, pb.block, pb.G, pb.S, pb.stat_lengths[r],
                                                       pb.k_base + r * pb.K, pb.K, pb.scores + r * pb.S,
                                                       pb.overlap + r);
    }
  }
}

struct Shared {
  Problem pb;
  std::vector<Head> heads;
  std::vector<Item> items;
  std::unique_ptr<float[]> parts;
  std::unique_ptr<std::atomic<int32_t>[]> left;  // chunks of each head not yet done
  WorkItems queue;                                // one item an element of `items`
  void (*chunk_fn)(const Problem&, const Head&, int64_t, int64_t, int64_t, float*, float*, float*);
};

void work(Shared& sh) {
  const int64_t stride = 2 * sh.pb.QG + sh.pb.QG * sh.pb.Dp;
  std::vector<float> kbuf, vbuf;
  TakeItems(sh.queue, [&](int64_t i) {
    if (kbuf.empty()) {
      kbuf.resize(sh.pb.block * sh.pb.Dp);
      vbuf.resize(sh.pb.block * sh.pb.Dp);
    }
    const Item& it = sh.items[i];
    const Head& hd = sh.heads[it.bh];
    sh.chunk_fn(sh.pb, hd, it.bh, it.c0, it.c1, sh.parts.get() + it.part * stride, kbuf.data(), vbuf.data());
    if (sh.left[it.bh].fetch_sub(1, std::memory_order_acq_rel) == 1)
      finalize(sh.pb, hd, it.bh, sh.parts.get() + hd.first_part * stride);
  });
}

template <typename KV>
void (*pick_chunk_fn(int64_t Dp))(const Problem&, const Head&, int64_t, int64_t, int64_t, float*, float*, float*) {
  switch (Dp / W) {
    case 2: return &run_chunk<KV, 2>;
    case 4: return &run_chunk<KV, 4>;
    case 8: return &run_chunk<KV, 8>;
    case 16: return &run_chunk<KV, 16>;
    default: return &run_chunk<KV, 0>;
  }
}

bool elem_of(ffi::DataType t, Elem* e) {
  switch (t) {
    case ffi::DataType::F32: *e = Elem::kF32; return true;
    case ffi::DataType::BF16: *e = Elem::kBF16; return true;
    case ffi::DataType::F16: *e = Elem::kF16; return true;
    default: return false;
  }
}

int64_t prod(ffi::AnyBuffer::Dimensions d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

// The scored heads' statistics asked of a call (hetero_jax_pool_attention_statistics); Hs rows per sequence.
struct StatisticsArgs {
  int64_t Hs, K;
  const int32_t* stat_lengths;  // [B, Hs]
  const int32_t* k_base;        // [B, Hs, K]
  float* scores;                // [B, Hs, S]
  float* overlap;               // [B, Hs]
};

// Both handlers: logits [B, H, G, S] (st == nullptr; flags 0 / 1) or the statistics of the heads whose
// flags give their row (st; flags -1 / row).
ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> flags,
               ffi::Buffer<ffi::S32> block_rows, float sm_scale, int64_t score_len, int64_t chunk_rows,
               int64_t block_size, int64_t max_len, ffi::Result<ffi::AnyBuffer> out,
               ffi::Result<ffi::Buffer<ffi::F32>> lse, float* logits, size_t logits_count, const StatisticsArgs* st) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() < 5 || kd.size() < 3 || v.dimensions().size() != kd.size())
    return ffi::Error::InvalidArgument("pool_attention: q must be [..., H, T, G, D], k/v [..., P, D]");
  const size_t r = qd.size();
  const int64_t B = prod(qd, 0, r - 4), H = qd[r - 4], T = qd[r - 3], G = qd[r - 2], D = qd[r - 1];
  const int64_t P = kd[kd.size() - 2];
  if (prod(kd, 0, kd.size() - 2) != B || kd[kd.size() - 1] != D)
    return ffi::Error::InvalidArgument("pool_attention: k_pool must be [B, P, D] matching q");
  for (size_t i = 0; i < kd.size(); ++i)
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("pool_attention: v_pool shape != k_pool");
  if (offsets.element_count() != static_cast<size_t>(B * H) || lengths.element_count() != static_cast<size_t>(B * H) ||
      flags.element_count() != static_cast<size_t>(B * H))
    return ffi::Error::InvalidArgument("pool_attention: offsets, lengths and flags must be [B, H]");
  if (score_len < 0 || (score_len > 0 && T != 1))
    return ffi::Error::InvalidArgument("pool_attention: score_len needs T == 1");
  if (max_len < 0) return ffi::Error::InvalidArgument("pool_attention: max_len must be >= 0");
  const auto bd = block_rows.dimensions();
  const int64_t NB = bd.size() ? bd[bd.size() - 1] : 0;
  if (block_size < 0 || (block_size & (block_size - 1)) != 0 || NB < 1 ||
      block_rows.element_count() != static_cast<size_t>(B * H * NB))
    return ffi::Error::InvalidArgument("pool_attention: block_rows must be [B, H, NB >= 1], block_size 0 or a power of two");
  if (st == nullptr && logits_count != static_cast<size_t>(B * H * G * score_len))
    return ffi::Error::InvalidArgument("pool_attention: logits must be [B, H, G, score_len]");
  if (st != nullptr) {
    if (score_len < 1) return ffi::Error::InvalidArgument("pool_attention_statistics: score_len must be >= 1");
    for (int64_t i = 0; i < B * H; ++i)
      if (flags.typed_data()[i] < -1 || flags.typed_data()[i] >= st->Hs)
        return ffi::Error::InvalidArgument("pool_attention_statistics: flags must be -1 or a row below Hs");
  }
  Elem qe, ke, ve, oe;
  if (!elem_of(q.element_type(), &qe) || !elem_of(k.element_type(), &ke) || !elem_of(v.element_type(), &ve) ||
      !elem_of(out->element_type(), &oe))
    return ffi::Error::InvalidArgument("pool_attention: dtypes must be float32, bfloat16 or float16");
  if (ke != ve) return ffi::Error::InvalidArgument("pool_attention: k_pool and v_pool dtypes differ");
  if (out->element_count() != q.element_count() || lse->element_count() != static_cast<size_t>(B * H * T * G))
    return ffi::Error::InvalidArgument("pool_attention: output shapes");
  if (B * H * T * G == 0) return ffi::Error::Success();

  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.B = B; pb.H = H; pb.T = T; pb.G = G; pb.D = D; pb.P = P; pb.S = score_len;
  pb.Dp = (D + W - 1) / W * W;
  pb.QG = T * G;
  pb.k = k.untyped_data();
  pb.v = v.untyped_data();
  pb.offsets = offsets.typed_data();
  pb.lengths = lengths.typed_data();
  pb.out = out->untyped_data();
  pb.out_elem = oe;
  pb.lse = lse->typed_data();
  // the scored heads' logits: the caller's result, or a buffer of this thread that the statistics read
  // (kept between calls: no page faults for a fresh one every step)
  thread_local std::vector<float> logit_buf, block_max_buf;
  pb.block = pb.Dp <= 64 ? kMaxBlock : (pb.Dp <= 128 ? 32 : 16);  // K and V blocks stay in L1
  if (block_size > 0) pb.block = std::min<int64_t>(pb.block, block_size);  // powers of two: a block in one page
  pb.block_max = nullptr;
  if (st != nullptr) {
    pb.NBs = (score_len + pb.block - 1) / pb.block;
    logit_buf.resize(std::max<size_t>(logit_buf.size(), B * st->Hs * G * score_len));
    block_max_buf.resize(std::max<size_t>(block_max_buf.size(), B * st->Hs * G * pb.NBs));
    pb.logits = logit_buf.data();
    pb.block_max = block_max_buf.data();
    pb.stat_lengths = st->stat_lengths;
    pb.k_base = st->k_base;
    pb.K = st->K;
    pb.scores = st->scores;
    pb.overlap = st->overlap;
  } else {
    pb.logits = logits;
    pb.stat_lengths = nullptr;
  }
  pb.block_rows = block_rows.typed_data();
  pb.NB = NB;
  pb.page = block_size;

  // q in float32, scaled, rows padded to Dp
  std::vector<float> qf(B * H * T * G * pb.Dp, 0.f);
  {
    const void* qp = q.untyped_data();
    for (int64_t i = 0; i < B * H * T * G; ++i)
      for (int64_t d = 0; d < D; ++d) qf[i * pb.Dp + d] = load_elem(qp, i * D + d, qe) * sm_scale;
  }
  pb.q = qf.data();

  // heads, and the chunk size that gives every thread a few items
  sh->heads.resize(B * H);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      Head& hd = sh->heads[b * H + h];
      const int32_t f = flags.typed_data()[b * H + h];
      hd.logit_row = st != nullptr ? (f >= 0 ? b * st->Hs + f : -1) : b * H + h;
      hd.scored = st != nullptr ? f >= 0 : f != 0;
      const int64_t o = pb.offsets[b * H + h];
      hd.n0 = pb.lengths[b * H + h];
      if (pb.page > 0) {  // paged: NB blocks of logical rows, each row clipped into the pool where it is read
        hd.rows = std::max<int64_t>(0, std::min({NB * pb.page, hd.n0 + T - 1, max_len}));
        hd.start = b * P;
        hd.off = o;
      } else {
        const int64_t avail = (o >= 0 && o < P) ? P - o : 0;
        hd.rows = std::max<int64_t>(0, std::min({avail, hd.n0 + T - 1, max_len}));
        hd.start = b * P + (avail > 0 ? o : 0);
        hd.off = 0;
      }
      total += hd.rows;
    }
  }
  const int64_t workers = native_workers(pool);
  // Threads only for calls of more than about 80 us on one core (work units: a row's QG dot products and
  // its K and V loads, per 64 lanes of Dp): waking a helper costs microseconds on a quiet machine and tens
  // when the cores are shared (the woken helper preempts the caller), and a cold call of a few thousand rows
  // is bound by what one core can read. RESULTS `native-attention-threads` and `native-attention-threads-8k`.
  // chunk_rows > 0 (tests) forces that split, and threads whenever there are several.
  const bool parallel = workers > 1 && (chunk_rows > 0 || total * (pb.QG + 2) * pb.Dp / 64 >= 8 * 1024);
  // A head's chunks depend on its own rows only (kChunkRows each, at most kMaxChunks of them, cut evenly
  // on blocks), not on the call's other heads or sequences nor on the threads: a sequence's result is the
  // same bit for bit alone or in a batch, on one thread or several.
  int64_t nparts = 0;
  for (int64_t bh = 0; bh < B * H; ++bh) {
    Head& hd = sh->heads[bh];
    hd.first_part = nparts;
    int64_t nc = chunk_rows > 0 ? (hd.rows + chunk_rows - 1) / chunk_rows
                                : std::min<int64_t>((hd.rows + kChunkRows - 1) / kChunkRows, kMaxChunks);
    nc = std::max<int64_t>(nc, 1);
    int64_t per = hd.rows;
    if (nc > 1) per = ((hd.rows + nc - 1) / nc + pb.block - 1) / pb.block * pb.block;
    int32_t made = 0;
    for (int64_t c0 = 0; made == 0 || c0 < hd.rows; c0 += per) {  // a head of no rows is one (empty) item
      sh->items.push_back(Item{bh, c0, std::min(hd.rows, c0 + per), nparts++});
      ++made;
      if (per == 0) break;
    }
    hd.nparts = made;
  }
  // longest items first, so the last ones to be taken are short
  std::stable_sort(sh->items.begin(), sh->items.end(),
                   [](const Item& a, const Item& b) { return a.c1 - a.c0 > b.c1 - b.c0; });
  sh->parts.reset(new float[nparts * (2 * pb.QG + pb.QG * pb.Dp)]);  // each item writes all of its part
  sh->left.reset(new std::atomic<int32_t>[B * H]);
  for (int64_t bh = 0; bh < B * H; ++bh) sh->left[bh].store(sh->heads[bh].nparts, std::memory_order_relaxed);
  switch (ke) {
    case Elem::kF32: sh->chunk_fn = pick_chunk_fn<float>(pb.Dp); break;
    case Elem::kBF16: sh->chunk_fn = pick_chunk_fn<BF16>(pb.Dp); break;
    default: sh->chunk_fn = pick_chunk_fn<F16>(pb.Dp); break;
  }

  const int64_t n_items = static_cast<int64_t>(sh->items.size());
  sh->queue.n = n_items;
  RunOnHelpers(pool, sh, sh->queue, parallel ? std::min(workers - 1, n_items - 1) : 0, work);
  return ffi::Error::Success();
}

ffi::Error PoolAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::S32> flags, ffi::Buffer<ffi::S32> block_rows, float sm_scale,
                             int64_t score_len, int64_t chunk_rows, int64_t block_size, int64_t max_len,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Result<ffi::Buffer<ffi::F32>> logits) {
  return Run(pool, q, k, v, offsets, lengths, flags, block_rows, sm_scale, score_len, chunk_rows, block_size, max_len,
             out, lse, logits->typed_data(), logits->element_count(), nullptr);
}

ffi::Error PoolAttentionStatisticsImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                       ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> lengths,
                                       ffi::Buffer<ffi::S32> flags, ffi::Buffer<ffi::S32> block_rows,
                                       ffi::Buffer<ffi::S32> stat_lengths, ffi::Buffer<ffi::S32> k_base,
                                       float sm_scale, int64_t score_len, int64_t chunk_rows, int64_t block_size,
                                       int64_t max_len, ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                       ffi::Result<ffi::Buffer<ffi::F32>> scores,
                                       ffi::Result<ffi::Buffer<ffi::F32>> overlap) {
  const auto qd = q.dimensions();
  const auto kd = k_base.dimensions();
  if (qd.size() < 5 || kd.size() < 2 || qd[qd.size() - 3] != 1)
    return ffi::Error::InvalidArgument("pool_attention_statistics: q must be [..., H, 1, G, D], k_base [..., Hs, K]");
  const int64_t B = prod(qd, 0, qd.size() - 4);
  const int64_t Hs = kd[kd.size() - 2], K = kd[kd.size() - 1];
  if (B * Hs == 0 || prod(kd, 0, kd.size() - 2) != B || stat_lengths.element_count() != static_cast<size_t>(B * Hs) ||
      scores->element_count() != static_cast<size_t>(B * Hs * score_len) ||
      overlap->element_count() != static_cast<size_t>(B * Hs))
    return ffi::Error::InvalidArgument("pool_attention_statistics: stat_lengths must be [B, Hs >= 1], k_base "
                                       "[B, Hs, K], scores [B, Hs, score_len], overlap [B, Hs]");
  const StatisticsArgs st{Hs, K, stat_lengths.typed_data(), k_base.typed_data(), scores->typed_data(),
                          overlap->typed_data()};
  return Run(pool, q, k, v, offsets, lengths, flags, block_rows, sm_scale, score_len, chunk_rows, block_size, max_len,
             out, lse, nullptr, 0, &st);
}

}  // namespace

// The exported symbols (the library is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxPoolAttention(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HeteroJaxPoolAttentionStatistics(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxPoolAttention, PoolAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_pool
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // flags
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_rows
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("score_len")
                                  .Attr<int64_t>("chunk_rows")    // 0: automatic
                                  .Attr<int64_t>("block_size")    // 0: contiguous heads
                                  .Attr<int64_t>("max_len")       // the most rows a query position sees
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::F32>>()); // logits

XLA_FFI_DEFINE_HANDLER_SYMBOL(HeteroJaxPoolAttentionStatistics, PoolAttentionStatisticsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_pool
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // flags (row of a scored head, -1 none)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()   // stat_lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // k_base
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("score_len")
                                  .Attr<int64_t>("chunk_rows")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("max_len")
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scores
                                  .Ret<ffi::Buffer<ffi::F32>>()); // overlap
