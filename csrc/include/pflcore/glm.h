// Loss and d(loss)/d(logits) of each GLM family, for one row (DESIGN.md §3).
// Shared by the CPU kernels and (later) the CUDA kernels.
//
// Parameters theta of one model are laid out row-major as [P, C], P = p + intercept;
// the logits of a row x are z_c = sum_k x_k theta[k, c] (+ theta[p, c] with an intercept).
#pragma once
#include "pflcore/common.h"

namespace pflcore {
PFLCORE_LEVEL_BEGIN

// Label type of a family: float targets for least squares, int64 classes otherwise.
template <Family F, typename T>
struct LabelOf { using type = int64_t; };
template <typename T>
struct LabelOf<Family::LeastSquares, T> { using type = T; };
template <Family F, typename T>
using label_t = typename LabelOf<F, T>::type;

// LeastSquares (C = 1): loss = ½(z − y)², dz = z − y.
template <typename T>
PFL_HD T least_squares_loss_grad(T z, T y, T* dz) {
  const T r = z - y;
  *dz = r;
  return T(0.5) * r * r;
}

// Logistic (C = 1), y ∈ {0, 1}: loss = log(1 + e^z) − y·z, dz = σ(z) − y.
// The loss is evaluated as max(s, 0) + log(1 + e^{−|s|}) with s = z for y = 0 and s = −z for
// y = 1, which neither overflows nor cancels when the row is well classified.
template <typename T>
PFL_HD T logistic_loss_grad(T z, int64_t y, T* dz) {
  const T e = pfl_exp(-(z < T(0) ? -z : z));
  const T sigma = z >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
  *dz = sigma - static_cast<T>(y);
  const T s = y ? -z : z;
  return (s > T(0) ? s : T(0)) + pfl_log1p(e);
}

// Softmax over C classes: loss = logsumexp(z) − z_y, dz = softmax(z) − e_y.
template <typename T>
PFL_HD T softmax_loss_grad(const T* z, int64_t C, int64_t y, T* dz) {
  T zmax = z[0];
  for (int64_t c = 1; c < C; ++c) zmax = z[c] > zmax ? z[c] : zmax;
  T sum = T(0);
  for (int64_t c = 0; c < C; ++c) {
    dz[c] = pfl_exp(z[c] - zmax);
    sum += dz[c];
  }
  const T inv = T(1) / sum;
  for (int64_t c = 0; c < C; ++c) dz[c] *= inv;
  dz[y] -= T(1);
  return pfl_log(sum) + zmax - z[y];
}

// Loss of one row and its gradient with respect to the logits z [C] -> dz [C].
template <Family F, typename T>
PFL_HD T loss_grad(const T* z, int64_t C, label_t<F, T> y, T* dz) {
  if constexpr (F == Family::LeastSquares) {
    return least_squares_loss_grad<T>(z[0], y, dz);
  } else if constexpr (F == Family::Logistic) {
    return logistic_loss_grad<T>(z[0], y, dz);
  } else {
    return softmax_loss_grad<T>(z, C, y, dz);
  }
}

// 1 when the row is classified correctly. Least squares has no classes: 0.
// Logistic predicts 1 when z > 0; softmax predicts the first maximal logit.
template <Family F, typename T>
PFL_HD int64_t is_correct(const T* z, int64_t C, label_t<F, T> y) {
  if constexpr (F == Family::LeastSquares) {
    return 0;
  } else if constexpr (F == Family::Logistic) {
    return static_cast<int64_t>(z[0] > T(0)) == y ? 1 : 0;
  } else {
    int64_t best = 0;
    for (int64_t c = 1; c < C; ++c)
      if (z[c] > z[best]) best = c;
    return best == y ? 1 : 0;
  }
}

PFLCORE_LEVEL_END
}  // namespace pflcore
