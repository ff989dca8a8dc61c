// The vector width of this CPU level and the loads and stores of its GCC vector types, shared by
// the kernels that use them (cnn_dense.cpp, sym_products.cpp, kmeans_screen.h). Included inside
// nothing: it opens the level's namespace itself, so each level compiles its own copy.
#pragma once
#include <cstring>

#include "pflcore/cpu_level.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace simd {

// Bytes of one vector register, and how many registers a register block may fill.
#if defined(__AVX512F__)
inline constexpr int kBytes = 64, kRegs = 32;
#elif defined(__AVX__)
inline constexpr int kBytes = 32, kRegs = 16;
#else
inline constexpr int kBytes = 16, kRegs = 16;  // SSE2, NEON: 16 bytes (NEON has 32 registers; 16 is safe)
#endif

// One register of T (a class template: a vector_size typedef inside a function template whose size
// depends on a template argument loses the attribute in GCC).
template <typename T>
struct Vec {
  typedef T V __attribute__((vector_size(kBytes)));
  static constexpr int L = kBytes / int(sizeof(T));

  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(T* p, const V& v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX512F__)
  // The first `count` (< L) lanes from p, the others 0 (a masked load: nothing past them is read).
  static V load_first(const T* p, int count) {
    V v;
    if constexpr (sizeof(T) == 4) {
      const __m512 t = _mm512_maskz_loadu_ps(__mmask16((1u << count) - 1u), p);
      std::memcpy(&v, &t, sizeof v);
    } else {
      const __m512d t = _mm512_maskz_loadu_pd(__mmask8((1u << count) - 1u), p);
      std::memcpy(&v, &t, sizeof v);
    }
    return v;
  }
  // The first `count` (< L) lanes of v to p (a masked store: nothing past them is written).
  static void store_first(T* p, const V& v, int count) {
    if constexpr (sizeof(T) == 4) {
      __m512 t;
      std::memcpy(&t, &v, sizeof t);
      _mm512_mask_storeu_ps(p, __mmask16((1u << count) - 1u), t);
    } else {
      __m512d t;
      std::memcpy(&t, &v, sizeof t);
      _mm512_mask_storeu_pd(p, __mmask8((1u << count) - 1u), t);
    }
  }
#endif
};

}  // namespace simd
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
