// Weighted mean of model rows (the projection P_H of DESIGN.md §4/§5). Each output column is
// summed over rows in row order in float64, so the result is independent of thread count.
#include <algorithm>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {

template <typename T>
void average(const T* theta, const T* weights, const int64_t* rows, int64_t R, int64_t d,
             T* out) {
  double wsum = 0.0;
  for (int64_t r = 0; r < R; ++r) wsum += double(weights[rows[r]]);
  const double inv = 1.0 / wsum;
  constexpr int64_t kCols = 256;
#pragma omp parallel for schedule(static) if (R * d > 262144)
  for (int64_t j0 = 0; j0 < d; j0 += kCols) {
    const int64_t j1 = std::min(d, j0 + kCols);
    double acc[kCols] = {0.0};
    for (int64_t r = 0; r < R; ++r) {
      const double w = double(weights[rows[r]]);
      const T* row = theta + rows[r] * d;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += w * double(row[j]);
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = T(acc[j - j0] * inv);
  }
}

template void average<float>(const float*, const float*, const int64_t*, int64_t, int64_t,
                             float*);
template void average<double>(const double*, const double*, const int64_t*, int64_t, int64_t,
                              double*);

}  // namespace pflcore::cpu
