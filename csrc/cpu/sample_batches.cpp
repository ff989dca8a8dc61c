// Counter-based minibatch sampling (DESIGN.md §4); the hash lives in pflcore/hash.h.
#include "pflcore/hash.h"
#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {

void sample_batches(const int64_t* offsets, const int64_t* clients, const int64_t* client_ids,
                    int64_t R, int64_t steps, int64_t B, uint32_t seed, uint32_t counter,
                    int32_t* out) {
  // Small draws (a round's minibatches) are not worth waking the thread team.
#pragma omp parallel for schedule(static) if (R * steps * B > 65536)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = clients[r];
    const int64_t lo = offsets[i], n = offsets[i + 1] - lo;
    const uint32_t id = static_cast<uint32_t>(client_ids[r]);
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t j = 0; j < B; ++j) {
        const uint32_t h = sample_hash(seed, counter, id, static_cast<uint32_t>(s),
                                       static_cast<uint32_t>(j));
        out[(r * steps + s) * B + j] = static_cast<int32_t>(lo + scale_to(h, n));
      }
  }
}

}  // namespace pflcore::cpu
