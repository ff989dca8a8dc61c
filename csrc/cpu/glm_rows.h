// How the GLM row path reaches a pass's rows (included by glm_minibatch.h).
#pragma once
#include <cstdint>
#include <type_traits>

#include "pflcore/cpu_level.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace minibatch {

// The rows lo, lo + 1, ... of one client, in order (a full-batch pass). Its own type, not a
// lambda, so that the row path knows the rows ahead lie next in memory and can ask for them
// before it reads them (the row path's gather); a minibatch's rows go through a lambda.
struct ContiguousRows {
  int64_t lo;
  int64_t operator()(int64_t t) const { return lo + t; }
};

// How far ahead a full-batch pass asks for its rows: each block of 8 rows asks for the 8 rows
// kAheadRows on. A federation larger than the caches streams each client's rows from memory; the
// hardware prefetchers, restarting on every client's short run, left the first full-batch pass of
// ops.gradients at 38.6 ns a row against 26.5 for rows in cache (2,000 clients, 53 MB, 1 thread,
// AMD Zen 5), ops.evaluate at 22.9 against 17.6. With 16 rows ahead: 29-30 and 17.7 (8 to 64
// rows ahead measured alike within the noise). Past the client's last row the prefetches reach
// the next client's rows (after the data's last row, addresses nothing reads: a prefetch never
// faults).
constexpr int64_t kAheadRows = 16;

// The `rows` rows (of p values) kAheadRows after row0 into L2 (prefetcht1: into L1 it cost
// ops.gradients at 2,000 clients 13.1-13.5 ms against 11.9-12.2, AMD Zen 4): what a block of a
// full-batch pass asks for. Forced inline: a function whose only effect is prefetches counts as
// having none, and GCC drops the calls it leaves out of line (then no row is asked for: the pass
// ran at 39.9 ns a row, not 29).
template <typename T>
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline void prefetch_rows_ahead(const T* row0, int64_t p, int64_t rows) {
  const char* ahead = reinterpret_cast<const char*>(row0 + kAheadRows * p);
  const int64_t bytes = rows * p * int64_t(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(ahead + o, 0, 2);
}

template <typename RowAt>
constexpr bool is_contiguous_rows = std::is_same_v<std::decay_t<RowAt>, ContiguousRows>;

}  // namespace minibatch
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
