// The host recall's row gather: a plain C entry point (ctypes, not an XLA custom call) that copies the rows a
// recall names from the host store into its staging rows. The rows of a recall are scattered over a store of
// hundreds of MiB, so one row is a cache and TLB miss; numpy's take waits on each in turn. Here the rows are
// split over threads by count, each thread prefetches the row kPrefetch rows ahead of the one it copies, so
// that several misses are in flight at once, and the staging rows are written with non-temporal stores where
// the CPU has them (x86-64) and the rows are 16-byte aligned: an ordinary store first reads the line it
// writes, a third more memory traffic than the copy itself (a memcpy of MiB uses such stores too).
//
// The helper threads are kept between calls: waking one costs less than starting one (RESULTS
// offload-cpu-aligned-staging). A call that finds them taken by another call copies on its own thread.
//
// HeteroJaxGatherRows: each of n_pieces pieces i: dst_i[j, :] = src_i[rows_i[j], :] for j < counts[i], rows of
// row_bytes[i] bytes, src_i holding src_rows[i] rows (C-contiguous). Returns -1 when every row was in range, else
// a piece holding a row out of range (the rows of the thread that met it are then left unfinished: the caller
// raises).
//
// HeteroJaxGatherRequests: a whole recall in one call, from the (b, h, position) indices of each request, so
// that the caller does no per-row work: the indices are checked first (nothing is written when one is out of
// range), then each row's K and V are copied into the staging parts and its (b, shard, pool row, position)
// written into the scatter's int32 index rows.

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPrefetch = 16;  // rows ahead; 4 reached about three quarters of 16's bandwidth on a 2-core EPYC

struct Piece {
  const char* src;
  int64_t src_rows;
  const int64_t* rows;
  char* dst;
  int64_t row_bytes;
};

// One row of n bytes from s to d; non-temporal where d and n allow it.
inline void CopyRow(char* d, const char* s, int64_t n) {
#if defined(__x86_64__)
  if ((reinterpret_cast<uintptr_t>(d) & 15) == 0 && n >= 64) {
    int64_t o = 0;
#if defined(__AVX__)
    if ((reinterpret_cast<uintptr_t>(d) & 31) == 0)
      for (; o + 32 <= n; o += 32)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + o), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + o)));
#endif
    for (; o + 16 <= n; o += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + o), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + o)));
    if (o < n) std::memcpy(d + o, s + o, n - o);
    return;
  }
#endif
  std::memcpy(d, s, n);
}

// Rows [lo, hi) of one piece; false when a row is out of range.
bool CopyRows(const Piece& p, int64_t lo, int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    if (j + kPrefetch < hi) {
      const int64_t ahead = p.rows[j + kPrefetch];
      if (ahead >= 0 && ahead < p.src_rows) {
        const char* a = p.src + ahead * p.row_bytes;
        for (int64_t o = 0; o < p.row_bytes; o += 64) __builtin_prefetch(a + o);
      }
    }
    const int64_t r = p.rows[j];
    if (r < 0 || r >= p.src_rows) return false;
    CopyRow(p.dst + j * p.row_bytes, p.src + r * p.row_bytes, p.row_bytes);
  }
  return true;
}

// One request of HeteroJaxGatherRequests: its K and V sources [B, H, T, row] (C-contiguous), and its m rows'
// indices: b, h, position, pool shard, pool row (int64, idx[f][j * step[f]], step 0 for one value for all).
struct Request {
  const char* k;
  const char* v;
  int64_t B, H, T, k_bytes, v_bytes, m;
  const int64_t* idx[5];
  int64_t step[5];
};

// The staging the rows go to: row g of the recall in part g / chunk at row g % chunk, and column g of the
// scatter's index rows ints [4, width] (b, shard, pool row, position).
struct Staged {
  char* const* k_parts;
  char* const* v_parts;
  int64_t chunk;
  int32_t* ints;
  int64_t width;
};

inline int64_t Index(const Request& q, int f, int64_t j) { return q.idx[f][j * q.step[f]]; }

// Rows [lo, hi) of request q, the recall's rows from `first` on: their flat store rows and index rows in one
// pass, then their K rows and their V rows by CopyRows (one source and one destination at a time, as a memcpy
// streams), cut where they cross a staging part's end.
void CopyRequestRows(const Request& q, int64_t first, int64_t lo, int64_t hi, const Staged& out,
                     std::vector<int64_t>& flat) {
  flat.resize(hi - lo);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t g = first + j, b = Index(q, 0, j), position = Index(q, 2, j);
    flat[j - lo] = (b * q.H + Index(q, 1, j)) * q.T + position;
    out.ints[g] = static_cast<int32_t>(b);
    out.ints[out.width + g] = static_cast<int32_t>(Index(q, 3, j));
    out.ints[2 * out.width + g] = static_cast<int32_t>(Index(q, 4, j));
    out.ints[3 * out.width + g] = static_cast<int32_t>(position);
  }
  const int64_t n_rows = q.B * q.H * q.T;
  for (int kv = 0; kv < 2; ++kv) {
    const int64_t bytes = kv ? q.v_bytes : q.k_bytes;
    for (int64_t j = lo; j < hi;) {
      const int64_t g = first + j, at = g % out.chunk, n = std::min(hi - j, out.chunk - at);
      const Piece piece{kv ? q.v : q.k, n_rows, flat.data() + (j - lo),
                        (kv ? out.v_parts : out.k_parts)[g / out.chunk] + at * bytes, bytes};
      CopyRows(piece, 0, n);  // in range: checked before any thread started
      j += n;
    }
  }
}

// Threads that run parts 1..n-1 of a call's work while the caller runs part 0. Never destroyed: its detached
// threads wait on its members for work until the process exits.
class Helpers {
 public:
  // work(t) for every t in [0, n), part 0 on the caller; returns when every part is done.
  void Run(int64_t n, const std::function<void(int64_t)>& work) {
    std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
    if (n <= 1 || !call.owns_lock()) {  // another call holds the helpers: every part on this thread
      for (int64_t t = 0; t < n; ++t) work(t);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (; started_ < n - 1; ++started_) {
        const int64_t index = started_ + 1;
        std::thread([this, index] { Loop(index); }).detach();
      }
      job_ = &work;
      parts_ = n;
      running_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return running_ == 0; });
    job_ = nullptr;
  }

 private:
  void Loop(int64_t index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= parts_) continue;  // this call wants fewer helpers
      const std::function<void(int64_t)>* job = job_;
      lock.unlock();
      (*job)(index);
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mu_;  // one call at a time on the helpers
  std::mutex mu_;       // guards what follows
  std::condition_variable wake_, done_;
  int64_t started_ = 0;  // helpers started: helper i (1-based) runs part i
  const std::function<void(int64_t)>* job_ = nullptr;
  uint64_t generation_ = 0;  // one more per call: a helper wakes for each new value
  int64_t parts_ = 0;        // the current call's parts (helpers 1..parts_-1 work)
  int64_t running_ = 0;      // helpers of the current call not yet done
};

std::atomic<Helpers*> g_helpers{nullptr};

// The process's helpers, made on first use. A forked child has none of its parent's threads: it makes its own.
Helpers& GetHelpers() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] { g_helpers.store(nullptr); });
  (void)registered;
  Helpers* helpers = g_helpers.load(std::memory_order_acquire);
  if (helpers != nullptr) return *helpers;
  Helpers* fresh = new Helpers;
  if (g_helpers.compare_exchange_strong(helpers, fresh)) return *fresh;
  delete fresh;
  return *helpers;
}

// The rows of pieces laid end to end (piece i's rows are [first[i], first[i + 1]) of the concatenation) split by
// count over up to `threads` threads, the caller one of them: part t runs copy(i, a, z) for the rows [a, z) of
// each piece i that its share [total * t / T, total * (t + 1) / T) crosses, until a call returns false, then
// fences its non-temporal stores so that they are visible before the part reports done.
template <typename Copy>
void SplitOverHelpers(const std::vector<int64_t>& first, int64_t threads, Copy copy) {
  const int64_t n = static_cast<int64_t>(first.size()) - 1, total = first[n];
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  const std::function<void(int64_t)> work = [&](int64_t t) {
    const int64_t lo = total * t / n_threads, hi = total * (t + 1) / n_threads;
    int64_t i = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
    for (; i < n && first[i] < hi; ++i) {
      const int64_t a = std::max(lo, first[i]) - first[i], z = std::min(hi, first[i + 1]) - first[i];
      if (a < z && !copy(i, a, z)) break;
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
  };
  GetHelpers().Run(n_threads, work);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int64_t HeteroJaxGatherRows(
    int64_t n_pieces, const void* const* srcs, const int64_t* src_rows, const int64_t* const* rows,
    const int64_t* counts, void* const* dsts, const int64_t* row_bytes, int64_t threads) {
  std::vector<Piece> pieces(n_pieces);
  std::vector<int64_t> first(n_pieces + 1, 0);  // each piece's first row in the concatenation of all pieces
  for (int64_t i = 0; i < n_pieces; ++i) {
    pieces[i] = {static_cast<const char*>(srcs[i]), src_rows[i], rows[i], static_cast<char*>(dsts[i]), row_bytes[i]};
    first[i + 1] = first[i] + counts[i];
  }
  std::atomic<int64_t> bad{-1};
  SplitOverHelpers(first, threads, [&](int64_t i, int64_t a, int64_t z) {
    if (CopyRows(pieces[i], a, z)) return true;
    int64_t expected = -1;
    bad.compare_exchange_strong(expected, i);
    return false;
  });
  return bad.load();
}

// fields: int64 [18, n_requests], per request: K source address, V source address, B, H, T, K row bytes, V row
// bytes, row count m, then for each of b, h, position, pool shard, pool row its address and step (0 or 1).
// Returns -1, or 3 * request + axis (0 batch, 1 head, 2 position) of the first index out of range, found before
// anything is written.
extern "C" __attribute__((visibility("default"))) int64_t HeteroJaxGatherRequests(
    int64_t n_requests, const int64_t* fields, char* const* k_parts, char* const* v_parts, int64_t chunk,
    int32_t* ints, int64_t width, int64_t threads) {
  std::vector<Request> requests(n_requests);
  std::vector<int64_t> first(n_requests + 1, 0);
  for (int64_t i = 0; i < n_requests; ++i) {
    const auto field = [&](int f) { return fields[f * n_requests + i]; };
    Request& q = requests[i];
    q.k = reinterpret_cast<const char*>(field(0));
    q.v = reinterpret_cast<const char*>(field(1));
    q.B = field(2), q.H = field(3), q.T = field(4), q.k_bytes = field(5), q.v_bytes = field(6), q.m = field(7);
    for (int f = 0; f < 5; ++f) {
      q.idx[f] = reinterpret_cast<const int64_t*>(field(8 + 2 * f));
      q.step[f] = field(9 + 2 * f);
    }
    const int64_t size[3] = {q.B, q.H, q.T};
    for (int axis = 0; axis < 3; ++axis)  // a negative index read as unsigned is above any size
      for (int64_t j = 0; j < (q.step[axis] ? q.m : std::min<int64_t>(q.m, 1)); ++j)
        if (static_cast<uint64_t>(Index(q, axis, j)) >= static_cast<uint64_t>(size[axis])) return 3 * i + axis;
    first[i + 1] = first[i] + q.m;
  }
  const Staged out{k_parts, v_parts, chunk, ints, width};
  SplitOverHelpers(first, threads, [&](int64_t i, int64_t a, int64_t z) {
    thread_local std::vector<int64_t> flat;
    CopyRequestRows(requests[i], first[i], a, z, out, flat);
    return true;
  });
  return -1;
}
