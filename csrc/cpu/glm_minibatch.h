// The row path of the softmax GLM kernels (included by glm.cpp; DESIGN.md §4).
//
// The column path of glm.cpp copies every row it reads, transposed, so that SIMD lanes run along
// rows: for a minibatch step (2·B·P·C multiply-adds, B = 20) that copy and the transposition of
// the parameters in and out cost more than the math, and even on whole clients the copy costs
// more than the lanes it fills. Here the rows are read where they are, and the parameters stay
// in theta's own layout [P, C], padded to CP classes (a whole number of SIMD registers, so every
// inner loop is a fixed number of full-width vector operations):
//
//   z_u   = b + Σ_k x_u[k] · W[k, :]          8 rows at a time, sharing each load of W[k, :]
//   dz_u  = softmax(z_u) − e_{y_u}           per row, over the CP lanes (padding masked out)
//   G     = Σ_u x_u ⊗ dz_u  (+ Σ_u dz_u in the intercept row)
//
// The padded lanes of W, G and the anchor are 0 and stay 0. Sums run in a fixed order (rows in
// batch order, 8 at a time), so results do not depend on the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "glm_minibatch_avx512.h"
#include "glm_rows.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace minibatch {

// Rows per block: each load of W[k, :] serves kRows rows, and kRows·CP accumulators keep both
// FMA pipes busy (4 rows of one 16-float register each left them waiting on FMA latency).
constexpr int kRows = 8;

// Classes padded to whole 64-byte registers: 16 floats or 8 doubles per register.
template <typename T>
constexpr int64_t lanes() {
  return 64 / static_cast<int64_t>(sizeof(T));
}
template <typename T>
inline int64_t padded_classes(int64_t C) {
  return (C + lanes<T>() - 1) / lanes<T>() * lanes<T>();
}

// True where glm_minibatch_avx512.h serves the row path: float with 16 padded classes.
template <typename T, int64_t CP>
constexpr bool on_avx512() {
#ifdef PFLCORE_ROWPATH_AVX512
  return std::is_same_v<T, float> && CP == 16;
#else
  return false;
#endif
}

// Per-thread buffers of the path (kept between calls, grown on demand).
template <typename T>
struct Buffers {
  std::vector<T> W, G, A;  // [P, CP] parameters, gradient, anchor
  std::vector<T> Z;        // [kRows, CP] one block's logits, then d loss / d logits (any number of rows)
  void prepare(int64_t P, int64_t CP) {
    if (static_cast<int64_t>(W.size()) < P * CP) {
      W.resize(P * CP);
      G.resize(P * CP);
      A.resize(P * CP);
    }
    if (static_cast<int64_t>(Z.size()) < kRows * CP) Z.resize(kRows * CP);
  }
  static Buffers& local() {
    static thread_local Buffers b;
    return b;
  }
};

// dst [P, CP] <- src [P, C], zero padding. (Loops, not memcpy: rows are a few dozen bytes,
// and a library call per row costs more than the copy.)
template <typename T, int64_t CP>
inline void load_padded(T* __restrict__ dst, const T* __restrict__ src, int64_t P, int64_t C) {
#ifdef PFLCORE_ROWPATH_AVX512
  if constexpr (on_avx512<T, CP>()) return avx512::load_padded(dst, src, P, C);
#endif
  for (int64_t k = 0; k < P; ++k) {
    T* __restrict__ d = dst + k * CP;
    const T* __restrict__ s = src + k * C;
    for (int64_t c = 0; c < C; ++c) d[c] = s[c];
    for (int64_t c = C; c < CP; ++c) d[c] = T(0);
  }
}

template <typename T, int64_t CP>
inline void store_unpadded(T* __restrict__ dst, const T* __restrict__ src, int64_t P, int64_t C) {
#ifdef PFLCORE_ROWPATH_AVX512
  if constexpr (on_avx512<T, CP>()) return avx512::store_unpadded(dst, src, P, C);
#endif
  for (int64_t k = 0; k < P; ++k) {
    T* __restrict__ d = dst + k * C;
    const T* __restrict__ s = src + k * CP;
    for (int64_t c = 0; c < C; ++c) d[c] = s[c];
  }
}

// z [kRows, CP] = b + x W for the rows x[0..kRows) (a short block repeats its last row).
template <typename T, int64_t CP>
inline void forward_block(const T* const* x, int64_t p, bool intercept, const T* __restrict__ W,
                          T* __restrict__ z) {
  T acc[kRows][CP];
  const T* bias = W + p * CP;
#pragma GCC unroll 8
  for (int q = 0; q < kRows; ++q)
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) acc[q][c] = intercept ? bias[c] : T(0);
  for (int64_t k = 0; k < p; ++k) {
    const T* __restrict__ wk = W + k * CP;
#pragma GCC unroll 8
    for (int q = 0; q < kRows; ++q) {
      const T a = x[q][k];
#pragma omp simd
      for (int64_t c = 0; c < CP; ++c) acc[q][c] += a * wk[c];
    }
  }
  std::memcpy(z, acc, sizeof acc);
}

// One row's logits z [CP] (C real) -> dz = softmax(z) − e_y, in place; returns the loss
// logsumexp(z) − z_y when `with_loss`. Padding lanes end at 0.
template <typename T, int64_t CP, typename Exp>
inline T softmax_row(T* __restrict__ z, int64_t C, int64_t y, bool with_loss, Exp exp_nonpositive) {
  T m = z[0];
  for (int64_t c = 1; c < C; ++c) m = z[c] > m ? z[c] : m;
  const T zy = z[y];
  T s = T(0);
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < CP; ++c) {
    const T e = c < C ? exp_nonpositive(z[c] - m) : T(0);
    z[c] = e;
    s += e;
  }
  const T inv = T(1) / s;
#pragma omp simd
  for (int64_t c = 0; c < CP; ++c) z[c] *= inv;
  z[y] -= T(1);
  return with_loss ? std::log(s) + m - zy : T(0);
}

// G [P, CP] += Σ_u x_u ⊗ dz_u over a block of kRows rows (the intercept row gets Σ_u dz_u).
// Rows past the end of the batch have dz = 0 (and finite x: they repeat a real row).
template <typename T, int64_t CP>
inline void backward_block(const T* const* x, int64_t p, bool intercept, const T* __restrict__ dz,
                           T* __restrict__ G) {
  for (int64_t k = 0; k < p; ++k) {
    T* __restrict__ gk = G + k * CP;
    T a[kRows];
#pragma GCC unroll 8
    for (int q = 0; q < kRows; ++q) a[q] = x[q][k];
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) {
      T g = gk[c];
#pragma GCC unroll 8
      for (int q = 0; q < kRows; ++q) g += a[q] * dz[q * CP + c];
      gk[c] = g;
    }
  }
  if (intercept) {
    T* __restrict__ gb = G + p * CP;
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) {
      T g = gb[c];
#pragma GCC unroll 8
      for (int q = 0; q < kRows; ++q) g += dz[q * CP + c];
      gb[c] = g;
    }
  }
}

// True when the logits of the first nb rows of a block are all finite. A NaN or inf among a
// row's features makes every one of its logits NaN or inf (NaN·w and inf·0 are NaN), so this
// also clears the features of the rows, at the cost of a few vector operations per row.
template <typename T, int64_t CP>
inline bool logits_finite(const T* __restrict__ z, int64_t nb) {
  // One reduction over the block's rows (contiguous in z): a reduction per row would end each
  // row with a horizontal sum.
  T acc = T(0);
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < nb * CP; ++i) acc += z[i] - z[i];
  return acc == T(0);
}

// The rows row_at(u0 .. u0 + nb) of one block and their labels; a short block (nb < kRows)
// repeats its last row.
template <typename T, typename RowAt>
inline void gather_block(const T* x, int64_t p, const int64_t* y, RowAt row_at, int64_t u0, int64_t nb,
                         const T** rows, int64_t* labels) {
  for (int64_t q = 0; q < kRows; ++q) {
    const int64_t r = row_at(u0 + std::min(q, nb - 1));
    rows[q] = x + r * p;
    labels[q] = y[r];
  }
  if constexpr (is_contiguous_rows<RowAt>) prefetch_rows_ahead(rows[0], p, kRows);
}

// Gradient sum G [P, CP] (zeroed here) of the softmax loss over the B rows rows[0..B) at W;
// returns the loss sum when `with_loss`. With `nonfinite` given, stops at the first block whose
// logits are not all finite and stores its first row's position there (else -1).
template <typename T, int64_t CP, typename RowAt, typename Exp>
T gradient(const T* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t B,
           const T* __restrict__ W, T* __restrict__ G, T* __restrict__ Z, bool with_loss, Exp exp_nonpositive,
           int64_t* nonfinite = nullptr) {
#ifdef PFLCORE_ROWPATH_AVX512
  if constexpr (on_avx512<T, CP>()) return avx512::gradient(x, p, y, intercept, C, row_at, B, W, G, with_loss, nonfinite);
#endif
  if (nonfinite) *nonfinite = -1;
  const int64_t P = p + (intercept ? 1 : 0);
  std::fill(G, G + P * CP, T(0));
  T loss = T(0);
  for (int64_t u0 = 0; u0 < B; u0 += kRows) {
    const int64_t nb = std::min<int64_t>(kRows, B - u0);
    const T* rows[kRows];
    int64_t labels[kRows];
    gather_block(x, p, y, row_at, u0, nb, rows, labels);
    T* z = Z;  // one block's logits at a time: any number of rows
    forward_block<T, CP>(rows, p, intercept, W, z);
    if (nonfinite && !logits_finite<T, CP>(z, nb)) {
      *nonfinite = u0;
      return loss;
    }
    for (int64_t q = 0; q < nb; ++q) loss += softmax_row<T, CP>(z + q * CP, C, labels[q], with_loss, exp_nonpositive);
    std::fill(z + nb * CP, z + kRows * CP, T(0));
    backward_block<T, CP>(rows, p, intercept, z, G);
  }
  return loss;
}

// Loss sum and correctly classified rows (first maximal logit) of the n rows row_at(0..n) at W.
// The block's four logarithms are taken in one vector call. `nonfinite`: as for gradient.
template <typename T, int64_t CP, typename RowAt, typename Exp>
T loss_and_hits(const T* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t n,
                const T* __restrict__ W, T* __restrict__ Z, int64_t* hits, Exp exp_nonpositive,
                int64_t* nonfinite = nullptr) {
#ifdef PFLCORE_ROWPATH_AVX512
  if constexpr (on_avx512<T, CP>()) return avx512::loss_and_hits(x, p, y, intercept, C, row_at, n, W, hits, nonfinite);
#endif
  if (nonfinite) *nonfinite = -1;
  T loss = T(0);
  int64_t good = 0;
  for (int64_t u0 = 0; u0 < n; u0 += kRows) {
    const int64_t nb = std::min<int64_t>(kRows, n - u0);
    const T* rows[kRows];
    int64_t labels[kRows];
    gather_block(x, p, y, row_at, u0, nb, rows, labels);
    forward_block<T, CP>(rows, p, intercept, W, Z);
    if (nonfinite && !logits_finite<T, CP>(Z, nb)) {
      *nonfinite = u0;
      *hits = good;
      return loss;
    }
    T sums[kRows], tails[kRows];  // loss = log(sum) + tail; padding rows: log 1 + 0
    for (int q = 0; q < kRows; ++q) {
      sums[q] = T(1);
      tails[q] = T(0);
    }
    for (int64_t q = 0; q < nb; ++q) {
      const T* zq = Z + q * CP;
      int64_t best = 0;
      for (int64_t c = 1; c < C; ++c)
        if (zq[c] > zq[best]) best = c;
      good += best == labels[q] ? 1 : 0;
      const T m = zq[best];
      T s = T(0);
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < CP; ++c) s += c < C ? exp_nonpositive(zq[c] - m) : T(0);
      sums[q] = s;
      tails[q] = m - zq[labels[q]];
    }
#pragma omp simd reduction(+ : loss)
    for (int64_t q = 0; q < kRows; ++q) loss += std::log(sums[q]) + tails[q];
  }
  *hits = good;
  return loss;
}

}  // namespace minibatch
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace minibatch {

// Calls fn(std::integral_constant<int64_t, CP>) for the padded class count CP of C classes;
// false (nothing called) when C needs more than 4 registers: the column path takes it.
template <typename T, typename Fn>
inline bool with_padded_classes(int64_t C, Fn fn) {
  constexpr int64_t L = lanes<T>();
  if (C <= L) {
    fn(std::integral_constant<int64_t, L>{});
  } else if (C <= 2 * L) {
    fn(std::integral_constant<int64_t, 2 * L>{});
  } else if (C <= 4 * L) {
    fn(std::integral_constant<int64_t, 4 * L>{});
  } else {
    return false;
  }
  return true;
}

}  // namespace minibatch
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
