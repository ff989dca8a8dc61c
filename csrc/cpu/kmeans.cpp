// k-means on the CPU (DESIGN.md §4): the assignment pass and the Lloyd update.
// Distances are direct sums of squared differences, not ‖x‖²+‖c‖²−2x·c, so a point
// equidistant from two identical centroids sees exactly equal distances and the tie goes
// to the lowest index, as in the torch reference.
#include <algorithm>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
namespace {

// Centroids are visited in blocks that fit in L2 next to the current points.
constexpr int64_t kCentroidBlockBytes = 256 * 1024;
constexpr int64_t kPointTileBytes = 64 * 1024;

// Squared distances of one point to 4 centroids, sharing each load of the point.
// Every centroid goes through this same code path (short groups repeat a centroid), so
// identical centroids always get identical distances.
template <typename T>
inline void sqdist4(const T* __restrict__ x, const T* __restrict__ c0, const T* __restrict__ c1,
                    const T* __restrict__ c2, const T* __restrict__ c3, int64_t d, T out[4]) {
  T a0 = T(0), a1 = T(0), a2 = T(0), a3 = T(0);
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t j = 0; j < d; ++j) {
    const T v = x[j];
    const T e0 = v - c0[j], e1 = v - c1[j], e2 = v - c2[j], e3 = v - c3[j];
    a0 += e0 * e0;
    a1 += e1 * e1;
    a2 += e2 * e2;
    a3 += e3 * e3;
  }
  out[0] = a0;
  out[1] = a1;
  out[2] = a2;
  out[3] = a3;
}

}  // namespace

template <typename T>
void kmeans_assign(const T* points, const T* centroids, int64_t N, int64_t K, int64_t d,
                   int64_t* labels, T* sqdist) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  const int64_t kb = std::max<int64_t>(4, kCentroidBlockBytes / row_bytes / 4 * 4);
  const int64_t pt = std::clamp<int64_t>(kPointTileBytes / row_bytes, 1, 64);
#pragma omp parallel for schedule(static)
  for (int64_t t0 = 0; t0 < N; t0 += pt) {
    const int64_t t1 = std::min(N, t0 + pt);
    T best[64];
    int64_t arg[64];
    for (int64_t i = t0; i < t1; ++i) {
      best[i - t0] = std::numeric_limits<T>::infinity();
      arg[i - t0] = 0;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t k1 = std::min(K, k0 + kb);
      for (int64_t i = t0; i < t1; ++i) {
        const T* x = points + i * d;
        for (int64_t k = k0; k < k1; k += 4) {
          const T* c[4];
          for (int u = 0; u < 4; ++u) c[u] = centroids + std::min(k + u, k1 - 1) * d;
          T dist[4];
          sqdist4(x, c[0], c[1], c[2], c[3], d, dist);
          for (int u = 0; u < 4 && k + u < k1; ++u) {
            if (dist[u] < best[i - t0]) {
              best[i - t0] = dist[u];
              arg[i - t0] = k + u;
            }
          }
        }
      }
    }
    for (int64_t i = t0; i < t1; ++i) {
      labels[i] = arg[i - t0];
      sqdist[i] = best[i - t0];
    }
  }
}

template <typename T>
void kmeans_update(const T* points, const int64_t* labels, const T* weights, int64_t N, int64_t K,
                   int64_t d, T* centroids, double* weight_sum) {
  std::fill(weight_sum, weight_sum + K, 0.0);
  for (int64_t i = 0; i < N; ++i) weight_sum[labels[i]] += weights ? double(weights[i]) : 1.0;
  // Each thread owns a slice of the columns and walks the points in order, so every sum
  // has a fixed order whatever the thread count.
  constexpr int64_t kCols = 64;
#pragma omp parallel
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

template void kmeans_assign<float>(const float*, const float*, int64_t, int64_t, int64_t,
                                   int64_t*, float*);
template void kmeans_assign<double>(const double*, const double*, int64_t, int64_t, int64_t,
                                    int64_t*, double*);
template void kmeans_update<float>(const float*, const int64_t*, const float*, int64_t, int64_t,
                                   int64_t, float*, double*);
template void kmeans_update<double>(const double*, const int64_t*, const double*, int64_t,
                                    int64_t, int64_t, double*, double*);

}  // namespace pflcore::cpu
