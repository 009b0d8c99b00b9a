// The helper threads a native kernel may use: XLA's intra-op pool, capped by HETERO_JAX_NATIVE_THREADS.
// Each source that includes this gets its own copy (an anonymous namespace), as with simd.h.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

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

// A call's work items [0, n), taken one at a time from a shared counter by the caller and its helpers.
struct WorkItems {
  int64_t n = 0;  // set before any helper starts
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// take(i) for each item i this thread takes, until none is left; the thread that finishes the last item wakes the
// caller. A helper that starts after the call returned takes none and touches no operand.
template <typename Take>
void TakeItems(WorkItems& items, Take&& take) {
  for (int64_t i; (i = items.next.fetch_add(1, std::memory_order_relaxed)) < items.n;) {
    take(i);
    if (items.done.fetch_add(1, std::memory_order_acq_rel) + 1 == items.n) {
      std::lock_guard<std::mutex> lock(items.mu);
      items.cv.notify_all();
    }
  }
}

// work(*job) on `helpers` threads of XLA's pool and on the caller, then waits for every one of `items` (the job's,
// which work takes with TakeItems). The caller waits only for items a helper took, so a late helper costs
// nothing; each helper holds the job until it is done with it.
template <typename Job>
void RunOnHelpers(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, WorkItems& items, int64_t helpers,
                  void (*work)(Job&)) {
  for (int64_t i = 0; i < helpers; ++i) {
    std::shared_ptr<Job> keep = job;
    pool.Schedule([keep, work]() { work(*keep); });
  }
  work(*job);
  if (items.done.load(std::memory_order_acquire) != items.n) {
    std::unique_lock<std::mutex> lock(items.mu);
    items.cv.wait(lock, [&] { return items.done.load(std::memory_order_acquire) == items.n; });
  }
}

}  // namespace
