// The vector width of this CPU level and the loads and stores of its GCC vector types, shared by
// the kernels that use them (cnn_dense.cpp, sym_products.cpp, kmeans_screen.h), and a 16 x 16
// float transpose in registers. Included inside
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

// x in every lane of the GCC vector type V. Not `V{} + x`: 0 + x is not x where x = −0, so GCC
// kept a scalar add before each broadcast (a vaddss and a register broadcast per row in the inner
// loops of sym_products and cnn_dense's micro-kernel); x − 0 is x for every x, and compiles to one
// broadcast load.
template <typename V, typename T>
inline V splat(T x) {
  return x - V{};
}

#if defined(__AVX512F__)
// r[q] = row q of a 16 x 16 float block -> r[j] = its column j (lane q: row q's element j).
inline __attribute__((always_inline)) void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif

}  // namespace simd
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
