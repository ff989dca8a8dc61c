// The minibatch path of the softmax GLM kernels (included by glm.cpp; DESIGN.md §4, issue 16).
//
// A step on a minibatch of B <= kMaxRows rows is 2·B·P·C multiply-adds: too few to amortize
// the column layout of the main path (a transposed copy of every row, padded to 16 columns,
// and the parameters transposed in and out). Here the rows are read where they are, and the
// parameters stay in theta's own layout [P, C], padded to CP classes (a whole number of SIMD
// registers, so every inner loop is a fixed number of full-width vector operations):
//
//   z_u   = b + Σ_k x_u[k] · W[k, :]          4 rows at a time, sharing each load of W[k, :]
//   dz_u  = softmax(z_u) − e_{y_u}           per row, over the CP lanes (padding masked out)
//   G     = Σ_u x_u ⊗ dz_u  (+ Σ_u dz_u in the intercept row)
//
// The padded lanes of W, G and the anchor are 0 and stay 0. Sums run in a fixed order (rows in
// batch order, 4 at a time), so results do not depend on the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pflcore::cpu::minibatch {

constexpr int64_t kMaxRows = 64;  // larger minibatches take the column path

// Classes padded to whole 64-byte registers: 16 floats or 8 doubles per register.
template <typename T>
constexpr int64_t lanes() {
  return 64 / static_cast<int64_t>(sizeof(T));
}
template <typename T>
inline int64_t padded_classes(int64_t C) {
  return (C + lanes<T>() - 1) / lanes<T>() * lanes<T>();
}

// Per-thread buffers of the path (kept between calls, grown on demand).
template <typename T>
struct Buffers {
  std::vector<T> W, G, A;  // [P, CP] parameters, gradient, anchor
  std::vector<T> Z;        // [kMaxRows, CP] logits, then d loss / d logits
  void prepare(int64_t P, int64_t CP) {
    if (static_cast<int64_t>(W.size()) < P * CP) {
      W.resize(P * CP);
      G.resize(P * CP);
      A.resize(P * CP);
    }
    if (static_cast<int64_t>(Z.size()) < kMaxRows * CP) Z.resize(kMaxRows * CP);
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
  for (int64_t k = 0; k < P; ++k) {
    T* __restrict__ d = dst + k * CP;
    const T* __restrict__ s = src + k * C;
    for (int64_t c = 0; c < C; ++c) d[c] = s[c];
    for (int64_t c = C; c < CP; ++c) d[c] = T(0);
  }
}

template <typename T, int64_t CP>
inline void store_unpadded(T* __restrict__ dst, const T* __restrict__ src, int64_t P, int64_t C) {
  for (int64_t k = 0; k < P; ++k) {
    T* __restrict__ d = dst + k * C;
    const T* __restrict__ s = src + k * CP;
    for (int64_t c = 0; c < C; ++c) d[c] = s[c];
  }
}

// z [nb <= 4 rows, CP] = b + x W for the rows x[0..nb) (a short block repeats its last row).
template <typename T, int64_t CP>
inline void forward4(const T* const* x, int64_t p, bool intercept, const T* __restrict__ W, T* __restrict__ z) {
  T z0[CP], z1[CP], z2[CP], z3[CP];
  const T* bias = W + p * CP;
#pragma omp simd
  for (int64_t c = 0; c < CP; ++c) {
    const T b0 = intercept ? bias[c] : T(0);
    z0[c] = b0;
    z1[c] = b0;
    z2[c] = b0;
    z3[c] = b0;
  }
  const T *__restrict__ x0 = x[0], *__restrict__ x1 = x[1], *__restrict__ x2 = x[2], *__restrict__ x3 = x[3];
  for (int64_t k = 0; k < p; ++k) {
    const T* __restrict__ wk = W + k * CP;
    const T a0 = x0[k], a1 = x1[k], a2 = x2[k], a3 = x3[k];
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) {
      z0[c] += a0 * wk[c];
      z1[c] += a1 * wk[c];
      z2[c] += a2 * wk[c];
      z3[c] += a3 * wk[c];
    }
  }
  std::memcpy(z, z0, sizeof z0);
  std::memcpy(z + CP, z1, sizeof z1);
  std::memcpy(z + 2 * CP, z2, sizeof z2);
  std::memcpy(z + 3 * CP, z3, sizeof z3);
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

// G [P, CP] += Σ_u x_u ⊗ dz_u over a block of 4 rows (the intercept row gets Σ_u dz_u). Rows
// past the end of the batch have dz = 0 (and finite x: they repeat a real row).
template <typename T, int64_t CP>
inline void backward4(const T* const* x, int64_t p, bool intercept, const T* __restrict__ dz, T* __restrict__ G) {
  const T *__restrict__ d0 = dz, *__restrict__ d1 = dz + CP, *__restrict__ d2 = dz + 2 * CP,
          *__restrict__ d3 = dz + 3 * CP;
  const T *__restrict__ x0 = x[0], *__restrict__ x1 = x[1], *__restrict__ x2 = x[2], *__restrict__ x3 = x[3];
  for (int64_t k = 0; k < p; ++k) {
    T* __restrict__ gk = G + k * CP;
    const T a0 = x0[k], a1 = x1[k], a2 = x2[k], a3 = x3[k];
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) gk[c] += a0 * d0[c] + a1 * d1[c] + a2 * d2[c] + a3 * d3[c];
  }
  if (intercept) {
    T* __restrict__ gb = G + p * CP;
#pragma omp simd
    for (int64_t c = 0; c < CP; ++c) gb[c] += d0[c] + d1[c] + d2[c] + d3[c];
  }
}

// Gradient sum G [P, CP] (zeroed here) of the softmax loss over the B rows rows[0..B) at W;
// returns the loss sum when `with_loss`.
template <typename T, int64_t CP, typename RowAt, typename Exp>
T gradient(const T* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t B,
           const T* __restrict__ W, T* __restrict__ G, T* __restrict__ Z, bool with_loss, Exp exp_nonpositive) {
  const int64_t P = p + (intercept ? 1 : 0);
  std::fill(G, G + P * CP, T(0));
  T loss = T(0);
  for (int64_t u0 = 0; u0 < B; u0 += 4) {
    const int64_t nb = std::min<int64_t>(4, B - u0);
    const T* rows[4];
    int64_t labels[4];
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t r = row_at(u0 + std::min(q, nb - 1));
      rows[q] = x + r * p;
      labels[q] = y[r];
    }
    T* z = Z + u0 * CP;
    forward4<T, CP>(rows, p, intercept, W, z);
    for (int64_t q = 0; q < nb; ++q) loss += softmax_row<T, CP>(z + q * CP, C, labels[q], with_loss, exp_nonpositive);
    std::fill(z + nb * CP, z + 4 * CP, T(0));
    backward4<T, CP>(rows, p, intercept, z, G);
  }
  return loss;
}

// Loss sum and correctly classified rows (first maximal logit) of the n rows row_at(0..n) at W.
template <typename T, int64_t CP, typename RowAt, typename Exp>
T loss_and_hits(const T* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t n,
                const T* __restrict__ W, T* __restrict__ Z, int64_t* hits, Exp exp_nonpositive) {
  T loss = T(0);
  int64_t good = 0;
  for (int64_t u0 = 0; u0 < n; u0 += 4) {
    const int64_t nb = std::min<int64_t>(4, n - u0);
    const T* rows[4];
    int64_t labels[4];
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t r = row_at(u0 + std::min(q, nb - 1));
      rows[q] = x + r * p;
      labels[q] = y[r];
    }
    T* z = Z + u0 * CP;
    forward4<T, CP>(rows, p, intercept, W, z);
    for (int64_t q = 0; q < nb; ++q) {
      const T* zq = z + q * CP;
      int64_t best = 0;
      for (int64_t c = 1; c < C; ++c)
        if (zq[c] > zq[best]) best = c;
      good += best == labels[q] ? 1 : 0;
      const T m = zq[best];
      T s = T(0);
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < CP; ++c) s += c < C ? exp_nonpositive(zq[c] - m) : T(0);
      loss += std::log(s) + m - zq[labels[q]];
    }
  }
  *hits = good;
  return loss;
}

}  // namespace pflcore::cpu::minibatch

namespace pflcore::cpu::minibatch {

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

}  // namespace pflcore::cpu::minibatch
