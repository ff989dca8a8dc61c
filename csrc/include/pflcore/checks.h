// Value checks the CPU kernels make as they read their inputs (DESIGN.md §8).
//
// Python checks only metadata (shapes, dtypes, contiguity); the values of the caller's arrays
// (indices, labels, NaN/inf) are checked here, where they are read, on every call: nothing is
// cached, so a caller may change an array between calls. A kernel that finds a bad value in
// model row r stops working on that row (an in-place output keeps that row as it was) and
// records a Fault; after the parallel region the binding raises the fault with the smallest
// key as a Python ValueError (or NonFiniteError). The key is the row, so which error is
// reported does not depend on the thread count.
//
// The messages are part of the contract: pflcore/backends/_values.py builds the same text for
// the other backends (the reference, CUDA and Triton check the same values in a torch pre-pass).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <string>

#include "pflcore/cpu_level.h"

namespace pflcore {

enum class FaultKind : int { None = 0, Value = 1, NonFinite = 2 };

// The first fault of a call, by key.
class Faults {
 public:
  bool any() const { return any_.load(std::memory_order_relaxed); }
  FaultKind kind() const { return kind_; }
  const std::string& message() const { return message_; }

  // Records a fault found while working on `key` (a model row, a point); keeps the smallest key.
  // Defined once, in the baseline code (csrc/cpu/dispatch.cpp), for every level.
  void add(int64_t key, FaultKind kind, const char* fmt, ...) __attribute__((format(printf, 4, 5)));

 private:
  std::atomic<bool> any_{false};
  std::mutex mu_;
  int64_t key_ = std::numeric_limits<int64_t>::max();
  FaultKind kind_ = FaultKind::None;
  std::string message_;
};

using ll = long long;  // for printf's %lld

PFLCORE_LEVEL_BEGIN

// True when every v[0..n) is finite: a NaN or ±inf has every exponent bit set. The test runs on
// the bits, OR-ed together: a floating-point sum (v − v summed, as before) chains one add's
// latency per register of values, four times the cost on a model row.
template <typename T>
inline bool all_finite(const T* __restrict__ v, int64_t n) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U kExponent = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  U bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t k = 0; k < n; ++k) {
    U bits;
    std::memcpy(&bits, v + k, sizeof bits);
    bad |= (bits & kExponent) == kExponent ? U(1) : U(0);
  }
  return bad == 0;
}

// Row r's client i and its rows [lo, hi): checks that i is a client and its offsets are
// ordered and inside x. `rows` (named `name` in messages) null means row r is client r.
inline bool client_of_row(const int64_t* rows, const int64_t* offsets, int64_t m, int64_t N, int64_t r,
                          int64_t* client, int64_t* lo, int64_t* hi, Faults& faults, const char* name = "rows") {
  const int64_t i = rows ? rows[r] : r;
  if (i < 0 || i >= m) {
    faults.add(r, FaultKind::Value, "%s: expected client indices in [0, %lld), got %s[%lld] = %lld", name, ll(m),
               name, ll(r), ll(i));
    return false;
  }
  const int64_t a = offsets[i], b = offsets[i + 1];
  if (!(0 <= a && a < b && b <= N)) {
    faults.add(r, FaultKind::Value,
               "offsets: client %lld needs 0 <= offsets[%lld] < offsets[%lld] <= N = %lld, got %lld and %lld", ll(i),
               ll(i), ll(i + 1), ll(N), ll(a), ll(b));
    return false;
  }
  *client = i;
  *lo = a;
  *hi = b;
  return true;
}

PFLCORE_LEVEL_END
}  // namespace pflcore
