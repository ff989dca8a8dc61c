// k-means on the CPU (DESIGN.md §4): the assignment pass and the Lloyd update.
//
// Assignment in two stages, exact in the end:
//  1. a screen with ‖x‖² + ‖c‖² − 2x·c, one FMA per point-centroid-feature (the dot products
//     in 2-point × 4-centroid register blocks), and a rigorous bound E_k on its rounding error;
//  2. the direct Σ(x − c)² for each centroid that the screen cannot rule out (usually one),
//     all through the same code path, ties to the lowest index.
// So labels and distances are those of the direct computation: a point equidistant from two
// identical centroids sees exactly equal distances, as in the torch reference.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace {

// Dot products of 2 points with 4 centroids, sharing every load.
template <typename T>
inline void dot2x4(const T* __restrict__ x0, const T* __restrict__ x1, const T* const* c, int64_t d,
                   T out[2][4]) {
  const T *__restrict__ c0 = c[0], *__restrict__ c1 = c[1], *__restrict__ c2 = c[2],
          *__restrict__ c3 = c[3];
  T a00 = T(0), a01 = T(0), a02 = T(0), a03 = T(0), a10 = T(0), a11 = T(0), a12 = T(0), a13 = T(0);
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13)
  for (int64_t j = 0; j < d; ++j) {
    a00 += x0[j] * c0[j];
    a01 += x0[j] * c1[j];
    a02 += x0[j] * c2[j];
    a03 += x0[j] * c3[j];
    a10 += x1[j] * c0[j];
    a11 += x1[j] * c1[j];
    a12 += x1[j] * c2[j];
    a13 += x1[j] * c3[j];
  }
  out[0][0] = a00, out[0][1] = a01, out[0][2] = a02, out[0][3] = a03;
  out[1][0] = a10, out[1][1] = a11, out[1][2] = a12, out[1][3] = a13;
}

// The direct squared distance; every exact distance goes through this one function.
template <typename T>
inline T sqdist_direct(const T* __restrict__ x, const T* __restrict__ c, int64_t d) {
  T acc = T(0);
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) {
    const T e = x[j] - c[j];
    acc += e * e;
  }
  return acc;
}

inline double norm2(const float* v, int64_t d) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += double(v[j]) * double(v[j]);
  return acc;
}
inline double norm2(const double* v, int64_t d) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += v[j] * v[j];
  return acc;
}

}  // namespace

template <typename T>
void kmeans_assign(const T* points, const T* centroids, int64_t N, int64_t K, int64_t d,
                   int64_t* labels, T* sqdist, Faults& faults) {
  for (int64_t k = 0; k < K; ++k)
    if (!all_finite(centroids + k * d, d)) {
      faults.add(-1, FaultKind::NonFinite, "centroids: row %lld holds a NaN or infinite value", ll(k));
      return;
    }
  // |fl(x·c) − x·c| ≤ γ_d Σ|x_j c_j| ≤ γ_d ‖x‖‖c‖ with γ_d ≈ d·u for any summation order, and
  // the float64 norms are exact to far less; 10% and 4 extra roundings of slack on top.
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const double gamma = 1.1 * double(d + 4) * u;
  std::vector<double> cnorm2(K), cnorm(K);
  for (int64_t k = 0; k < K; ++k) {
    cnorm2[k] = norm2(centroids + k * d, d);
    cnorm[k] = std::sqrt(cnorm2[k]);
  }
  // A small call (a few points: a round's clients) is not worth waking the thread team.
#pragma omp parallel if (N * K * d > (1 << 16))
  {
    std::vector<double> screen(2 * K);
#pragma omp for schedule(static)
    for (int64_t i0 = 0; i0 < N; i0 += 2) {
      const int np = i0 + 1 < N ? 2 : 1;
      const T* x[2] = {points + i0 * d, points + (i0 + np - 1) * d};  // a lone point pairs with itself
      double xnorm2[2], xnorm[2];
      bool finite = true;
      for (int q = 0; q < 2; ++q) {
        xnorm2[q] = norm2(x[q], d);
        xnorm[q] = std::sqrt(xnorm2[q]);
        // A NaN/inf coordinate makes the norm non-finite (so does a huge finite one: confirm)
        if (!std::isfinite(xnorm2[q]) && q < np && !all_finite(x[q], d)) {
          faults.add(i0 + q, FaultKind::NonFinite, "points: row %lld holds a NaN or infinite value", ll(i0 + q));
          finite = false;
        }
      }
      if (!finite) continue;
      for (int64_t k = 0; k < K; k += 4) {
        const T* c[4];
        for (int v = 0; v < 4; ++v) c[v] = centroids + std::min(k + v, K - 1) * d;
        T dots[2][4];
        dot2x4(x[0], x[1], c, d, dots);
        for (int q = 0; q < 2; ++q)
          for (int v = 0; v < 4 && k + v < K; ++v)
            screen[q * K + k + v] = xnorm2[q] + cnorm2[k + v] - 2.0 * double(dots[q][v]);
      }
      for (int q = 0; q < np; ++q) {
        const double* s = screen.data() + q * K;
        auto bound = [&](int64_t k) { return gamma * (xnorm[q] + cnorm[k]) * (xnorm[q] + cnorm[k]); };
        int64_t khat = 0;
        for (int64_t k = 1; k < K; ++k)
          if (s[k] < s[khat]) khat = k;
        // k can be the true nearest only if s[k] − E_k ≤ true(k) ≤ true(k̂) ≤ s[k̂] + E_k̂.
        const double limit = s[khat] + bound(khat);
        T best = std::numeric_limits<T>::infinity();
        int64_t arg = khat;
        for (int64_t k = 0; k < K; ++k) {
          if (s[k] - bound(k) > limit) continue;
          const T dist = sqdist_direct(x[q], centroids + k * d, d);
          if (dist < best) {
            best = dist;
            arg = k;
          }
        }
        labels[i0 + q] = arg;
        sqdist[i0 + q] = best;
      }
    }
  }
}

template <typename T>
void kmeans_update(const T* points, const int64_t* labels, const T* weights, int64_t N, int64_t K,
                   int64_t d, T* centroids, double* weight_sum, Faults& faults) {
  for (int64_t i = 0; i < N; ++i) {
    if (labels[i] < 0 || labels[i] >= K) {
      faults.add(i, FaultKind::Value, "labels: expected cluster indices in [0, %lld), got labels[%lld] = %lld", ll(K),
                 ll(i), ll(labels[i]));
      return;
    }
    if (weights && !(std::isfinite(weights[i]) && weights[i] >= T(0))) {
      faults.add(i, std::isfinite(weights[i]) ? FaultKind::Value : FaultKind::NonFinite,
                 "weights: expected finite weights >= 0, got weights[%lld] = %g", ll(i), double(weights[i]));
      return;
    }
  }
  std::fill(weight_sum, weight_sum + K, 0.0);
  for (int64_t i = 0; i < N; ++i) weight_sum[labels[i]] += weights ? double(weights[i]) : 1.0;
  // Each thread owns a slice of the columns and walks the points in order, so every sum
  // has a fixed order whatever the thread count.
  constexpr int64_t kCols = 64;
#pragma omp parallel if (N * d > (1 << 16))
  {
    std::vector<double> acc(K * kCols);
#pragma omp for schedule(static)
    for (int64_t j0 = 0; j0 < d; j0 += kCols) {
      const int64_t w = std::min(kCols, d - j0);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < N; ++i) {
        const double wi = weights ? double(weights[i]) : 1.0;
        const T* row = points + i * d + j0;
        double* a = acc.data() + labels[i] * kCols;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) a[j] += wi * double(row[j]);
      }
      for (int64_t k = 0; k < K; ++k) {
        if (!(weight_sum[k] > 0.0)) continue;  // empty cluster: keep its centroid
        const double inv = 1.0 / weight_sum[k];
        for (int64_t j = 0; j < w; ++j) centroids[k * d + j0 + j] = T(acc[k * kCols + j] * inv);
      }
    }
  }
}

template void kmeans_assign<float>(const float*, const float*, int64_t, int64_t, int64_t, int64_t*, float*,
                                   Faults&);
template void kmeans_assign<double>(const double*, const double*, int64_t, int64_t, int64_t, int64_t*, double*,
                                    Faults&);
template void kmeans_update<float>(const float*, const int64_t*, const float*, int64_t, int64_t, int64_t, float*,
                                   double*, Faults&);
template void kmeans_update<double>(const double*, const int64_t*, const double*, int64_t, int64_t, int64_t,
                                    double*, double*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
