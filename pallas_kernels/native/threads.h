// The helper threads a native kernel may use: XLA's intra-op pool, capped by HETERO_JAX_NATIVE_THREADS.
// Each source that includes this gets its own copy (an anonymous namespace), as with simd.h.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "xla/ffi/api/ffi.h"

namespace {

// Threads one call may use, the caller included: the pool's size, at most HETERO_JAX_NATIVE_THREADS (0 or
// unset: no cap).
inline int64_t native_workers(xla::ffi::ThreadPool& pool) {
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  if (const char* env = std::getenv("HETERO_JAX_NATIVE_THREADS")) {
    const long cap = std::strtol(env, nullptr, 10);
    if (cap > 0) workers = std::min<int64_t>(workers, cap);
  }
  return workers;
}

}  // namespace
