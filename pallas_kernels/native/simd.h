// Vector helpers (GCC / clang vector extensions) and the mask value shared by the native CPU kernels; each
// source that includes this gets its own copies (an anonymous namespace), so the library exports nothing but
// the FFI handlers.

#pragma once

#include <cstdint>

namespace {

constexpr float kMask = -1.0e30f;  // pallas_kernels._util.MASK_VALUE

// Vectors (GCC / clang vector extensions): W float lanes, 16 where AVX-512 is compiled in (-march=native on
// such a CPU), else 8 (AVX registers on x86, two NEON registers on ARM).

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef float vfu __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef float f4 __attribute__((vector_size(16)));

inline vf loadv(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void storev(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float x) {  // a broadcast (`vf{} + x` would be a scalar add: 0 + x is not x for -0)
#if defined(__AVX512F__)
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}
inline void store8(float* p, f8 v) { *reinterpret_cast<f8u*>(p) = v; }

inline f8 fold8(vf v) {  // 8 lanes whose sum is the sum of v
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

inline float hsum(vf v) {
  f8 e = fold8(v);
  f4 s = __builtin_shufflevector(e, e, 0, 1, 2, 3) + __builtin_shufflevector(e, e, 4, 5, 6, 7);
  s = s + __builtin_shufflevector(s, s, 2, 3, 0, 1);
  return s[0] + s[1];
}

// The sums of eight vectors, as one 8-lane vector (a transposing reduction: 7 adds, 14 shuffles).
inline f8 reduce8(f8 a0, f8 a1, f8 a2, f8 a3, f8 a4, f8 a5, f8 a6, f8 a7) {
  f8 b01 = __builtin_shufflevector(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
  f8 b23 = __builtin_shufflevector(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
  f8 b45 = __builtin_shufflevector(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
  f8 b67 = __builtin_shufflevector(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
  f8 c0 = __builtin_shufflevector(b01, b23, 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(b01, b23, 2, 3, 10, 11, 6, 7, 14, 15);
  f8 c1 = __builtin_shufflevector(b45, b67, 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(b45, b67, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf v) {
#if defined(__AVX512F__)
  const f8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f8 e = lo > hi ? lo : hi;
#else
  const f8 e = v;
#endif
  const f4 a = __builtin_shufflevector(e, e, 0, 1, 2, 3), b = __builtin_shufflevector(e, e, 4, 5, 6, 7);
  f4 m = a > b ? a : b;
  const f4 c = __builtin_shufflevector(m, m, 2, 3, 0, 1);
  m = m > c ? m : c;
  return m[0] > m[1] ? m[0] : m[1];
}

// exp(x) for x <= 0 (the softmax's s - max), Cephes' expf polynomial (about 1 ulp). Below -87.3 the result is
// exactly 0 (MASK_VALUE differences included); a NaN stays NaN.
inline vf expv(vf x) {
  const vf lo = splat(-87.33654f), hi = splat(88.3762626647949f);
  const vi under = x < lo;
  x = x < lo ? lo : x;  // a NaN fails both compares and stays NaN
  x = x > hi ? hi : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi ti = __builtin_convertvector(fx, vi);  // truncation toward zero
  vf tf = __builtin_convertvector(ti, vf);
  tf = tf - (vf)((vi)splat(1.0f) & (vi)(tf > fx));  // floor
  ti = __builtin_convertvector(tf, vi);
  x = x - tf * 0.693359375f - tf * -2.12194440e-4f;
  vf z = x * x;
  vf y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  vf r = y * (vf)((ti + 127) << 23);
  return (vf)((vi)r & ~under);
}

}  // namespace
