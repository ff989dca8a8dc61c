// Counter-based sampling hash of DESIGN.md §4, shared by every backend.
// Row index j of step s of client i is drawn from
//   h = murmur3_32(words = [seed, counter, client, step, j], seed 0)  (fmix32 finaliser)
//   index = offsets[i] + (h * n_i) >> 32
// so a draw depends only on its five keys: not on thread count, backend or sharding.
// pflcore/ops/sample_batches.py:_murmur3_words implements the same function in torch.
#pragma once
#include "pflcore/common.h"

namespace pflcore {
PFLCORE_LEVEL_BEGIN

PFL_HD uint32_t rotl32(uint32_t v, int r) { return (v << r) | (v >> (32 - r)); }

PFL_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// One 32-bit block of the murmur3 body.
PFL_HD uint32_t murmur3_mix(uint32_t h, uint32_t k) {
  k *= 0xcc9e2d51u;
  k = rotl32(k, 15);
  k *= 0x1b873593u;
  h ^= k;
  h = rotl32(h, 13);
  return h * 5u + 0xe6546b64u;
}

PFL_HD uint32_t sample_hash(uint32_t seed, uint32_t counter, uint32_t client, uint32_t step,
                            uint32_t j) {
  uint32_t h = 0u;
  h = murmur3_mix(h, seed);
  h = murmur3_mix(h, counter);
  h = murmur3_mix(h, client);
  h = murmur3_mix(h, step);
  h = murmur3_mix(h, j);
  return fmix32(h ^ 20u);  // 20 = message length in bytes, as in murmur3
}

// Maps a hash to [0, n) without modulo bias beyond 2^-32 (Lemire's multiply-shift).
PFL_HD int64_t scale_to(uint32_t h, int64_t n) {
  return static_cast<int64_t>((static_cast<uint64_t>(h) * static_cast<uint64_t>(n)) >> 32);
}

PFLCORE_LEVEL_END
}  // namespace pflcore
