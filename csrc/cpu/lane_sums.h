// The sums of the lanes of one vector's lanes' worth of 512-bit accumulators at once, shared by
// the k-means screen (kmeans_screen.h), the CNN weight gradient (cnn.cpp) and PERM's screen
// (perm_screen.cpp). Included inside
// nothing: it opens the level's namespace itself, so each level compiles its own copy.
#pragma once
#include <cstdint>
#include <cstring>

#include "pflcore/cpu_level.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

#if defined(__AVX512F__)
// out[q] = the sum of the lanes of a[q], q < L, for L vectors V of L lanes of T (16 floats or 8
// doubles): reduced together, first by 128-bit quarters across pairs of vectors, then lane by
// lane inside the quarters (~3 instructions a sum, where one horizontal sum takes ~10; the same
// fixed order every call). Vector-extension shuffles: GCC 12's shuffle intrinsics draw a false
// -Wmaybe-uninitialized from its own header.
template <typename T, typename V>
inline void lane_sums_512(const V* a, T* out) {
  static_assert(sizeof(V) == 64, "lane_sums_512: 512-bit vectors");
  if constexpr (sizeof(T) == 4) {
    V pair[8], quad[4];
    for (int q = 0; q < 8; ++q) {  // [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3]
      const V x = a[2 * q], y = a[2 * q + 1];
      pair[q] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int q = 0; q < 4; ++q) {  // quarter i: the 4 partial sums of accumulator 4q + i
      const V x = pair[2 * q], y = pair[2 * q + 1];
      quad[q] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    // inside each quarter: [q0[0] + q0[2], q1[0] + q1[2], q0[1] + q0[3], q1[1] + q1[3]]
    const V s01 = __builtin_shufflevector(quad[0], quad[1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                  __builtin_shufflevector(quad[0], quad[1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
    const V s23 = __builtin_shufflevector(quad[2], quad[3], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                  __builtin_shufflevector(quad[2], quad[3], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
    // lane 4i + j: the sum of accumulator 4j + i
    const V r = __builtin_shufflevector(s01, s23, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                __builtin_shufflevector(s01, s23, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const V sums = __builtin_shufflevector(r, r, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    std::memcpy(out, &sums, sizeof sums);
  } else {
    V pair[4], quad[2];
    for (int q = 0; q < 4; ++q) {  // [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3]
      const V x = a[2 * q], y = a[2 * q + 1];
      pair[q] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int q = 0; q < 2; ++q) {  // quarter i: the 2 partial sums of accumulator 4q + i
      const V x = pair[2 * q], y = pair[2 * q + 1];
      quad[q] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
    }
    // lane 2i + j: the sum of accumulator 4j + i
    const V r = __builtin_shufflevector(quad[0], quad[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                __builtin_shufflevector(quad[0], quad[1], 1, 9, 3, 11, 5, 13, 7, 15);
    const V sums = __builtin_shufflevector(r, r, 0, 2, 4, 6, 1, 3, 5, 7);
    std::memcpy(out, &sums, sizeof sums);
  }
}
#endif

// out[j] = the sum of the lanes of acc[j], j < M, for any vector type V of T: on AVX-512 a
// vector's lanes' worth of them at a time (lane_sums_512: ~3 instructions a sum where a
// lane-by-lane sum takes 15 dependent adds), the rest and every other level lane by lane from
// lane 0. Either way a fixed order.
template <typename T, typename V>
inline void lane_sums_each(const V* acc, int64_t M, T* out) {
  constexpr int L = int(sizeof(V) / sizeof(T));
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64)
    for (; j + L <= M; j += L) lane_sums_512<T>(acc + j, out + j);
#endif
  for (; j < M; ++j) {
    T s = acc[j][0];
    for (int l = 1; l < L; ++l) s += acc[j][l];
    out[j] = s;
  }
}

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
