// Weighted mean of model rows (the projection P_H of DESIGN.md §4/§5). Each output column is
// summed over rows in row order in float64, so the result is independent of thread count.
#include <algorithm>
#include <cmath>

#include "pflcore/ops_cpu.h"
#include "pflcore/parallel.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

template <typename T>
void average(const T* theta, int64_t M, const T* weights, const int64_t* rows, int64_t R, int64_t d, T* out,
             Faults& faults) {
  const auto row = [rows](int64_t r) { return rows ? rows[r] : r; };
  double wsum = 0.0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = row(r);
    if (i < 0 || i >= M) {
      faults.add(r, FaultKind::Value, "rows: expected indices in [0, %lld), got rows[%lld] = %lld", ll(M), ll(r),
                 ll(i));
      return;
    }
    const T w = weights[i];
    if (!(std::isfinite(w) && w >= T(0))) {
      faults.add(r, std::isfinite(w) ? FaultKind::Value : FaultKind::NonFinite,
                 "weights: expected finite weights >= 0, got weights[%lld] = %g", ll(i), double(w));
      return;
    }
    wsum += double(w);
  }
  if (!(wsum > 0.0)) {
    faults.add(R, FaultKind::Value, "weights: the weights of the averaged rows sum to 0");
    return;
  }
  const double inv = 1.0 / wsum;
  constexpr int64_t kCols = 256;
  parallel_for(R * d > 262144, 0, d, kCols, [&](int64_t j0) {
    const int64_t j1 = std::min(d, j0 + kCols);
    double acc[kCols] = {0.0};
    for (int64_t r = 0; r < R; ++r) {
      const double w = double(weights[row(r)]);
      const T* th = theta + row(r) * d;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += w * double(th[j]);
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = T(acc[j - j0] * inv);
  });
  // A NaN/inf in a row read makes the mean non-finite (finite rows cannot overflow a float64
  // sum): only then look for the row, in order.
  if (!all_finite(out, d)) {
    for (int64_t r = 0; r < R; ++r)
      if (!all_finite(theta + row(r) * d, d)) {
        faults.add(r, FaultKind::NonFinite, "theta: row %lld holds a NaN or infinite value", ll(row(r)));
        return;
      }
  }
}

template void average<float>(const float*, int64_t, const float*, const int64_t*, int64_t, int64_t, float*, Faults&);
template void average<double>(const double*, int64_t, const double*, const int64_t*, int64_t, int64_t, double*,
                              Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
