// Counter-based minibatch sampling (DESIGN.md §4); the hash lives in pflcore/hash.h.
#include "pflcore/hash.h"
#include "pflcore/ops_cpu.h"
#include "pflcore/parallel.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

void sample_batches(const int64_t* offsets, int64_t m, int64_t N, const int64_t* clients, int64_t first_id,
                    int64_t R, int64_t steps, int64_t B, uint32_t seed, uint32_t counter, int32_t* out,
                    Faults& faults) {
  // Small draws (a round's minibatches) are not worth waking the thread team.
  parallel_for(R * steps * B > 65536, 0, R, 1, [&](int64_t r) {
    int64_t i, lo, hi;
    if (!client_of_row(clients, offsets, m, N, r, &i, &lo, &hi, faults, "clients")) return;
    const int64_t n = hi - lo;
    const uint32_t id = static_cast<uint32_t>(first_id + i);
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t j = 0; j < B; ++j) {
        const uint32_t h = sample_hash(seed, counter, id, static_cast<uint32_t>(s),
                                       static_cast<uint32_t>(j));
        out[(r * steps + s) * B + j] = static_cast<int32_t>(lo + scale_to(h, n));
      }
  });
}

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
