// Cache-line-aligned std::vector storage for the kernels' own buffers.
//
// In the level's namespace (cpu_level.h), like every inline function the kernels use: an
// aligned_vector<float> of the avx512 copy and one of the avx2 copy are different types, so
// std::vector's member functions (inline, instantiated in every level's units) get one symbol per
// level, and the linker cannot keep an AVX-512-compiled copy for the avx2 level's callers.
#pragma once
#include <cstddef>
#include <new>
#include <vector>

#include "pflcore/cpu_level.h"

namespace pflcore {
PFLCORE_LEVEL_BEGIN

// An allocator whose blocks start on a 64-byte boundary (a cache line; one AVX-512 register).
// The kernels load whole vectors from their buffers; glibc's malloc aligns to 16 bytes (a large
// block from mmap sits at 16 past a page), so with 64-byte loads 3 in 4 loads from such a buffer
// straddled two cache lines. The k-means screen's packed centroids, placed by the heap call by
// call, made the Lloyd loop at 100,000 × 60, K = 10 take ~48 ms or ~33 ms from one call to the
// next (AMD Zen 5, avx512 level); aligned, ~34 every call.
template <typename T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const noexcept { return false; }
};

template <typename T>
using aligned_vector = std::vector<T, CacheAligned<T>>;

PFLCORE_LEVEL_END
}  // namespace pflcore
