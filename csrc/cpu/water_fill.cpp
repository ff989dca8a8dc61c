// PERM's mixing weights (pflcore/algorithms/perm.py, DESIGN.md §5): for each row i of the costs,
//   α_i = argmin_{α ∈ simplex} Σ_j c_ij α_j + Σ_j α_j² / (2 w_j),
// whose KKT conditions give α_ij = w_j·max(0, τ_i − c_ij) with the level τ_i such that Σ_j α_ij = 1.
//
// The level by Michelot's active-set iteration (as in the simplex projection), from above: the
// level of any subset S of the columns, τ_S = (1 + Σ_S c_j w_j) / Σ_S w_j computed over the S
// whose entries are all below it, bounds τ from above; so does g(A) = (1 + Σ_A c w)/Σ_A w for any
// A ⊇ the active set (Σ_A w (g − c) = 1 and the entries of A outside the active set are ≥ τ).
// Start from the best single column, τ₀ = min_j (c_j + 1/w_j), keep A = {j : c_j < τ}, and
// repeat τ ← g(A), A ← {j ∈ A : c_j < τ}: τ decreases, A shrinks and still holds every active
// column, and when A stops shrinking, A = {j : c_j < g(A)}: g(A) is the level. A few passes over
// a shrinking list, where the torch reference sorts each row (or its top-k candidates).
//
// Rows are independent: one thread per row, sums in column order, so the bits do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

void water_fill(const double* costs, int64_t r, int64_t k, const double* w, double* alpha, Faults& faults) {
  for (int64_t j = 0; j < k; ++j)
    if (!(std::isfinite(w[j]) && w[j] > 0.0)) {
      faults.add(-1, std::isfinite(w[j]) ? FaultKind::Value : FaultKind::NonFinite,
                 "weights: expected finite positive weights, got weights[%lld] = %g", ll(j), w[j]);
      return;
    }
  std::vector<double> inv_w(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) inv_w[size_t(j)] = 1.0 / w[j];
#pragma omp parallel if (r * k > (1 << 15))
  {
    std::vector<int64_t> A(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r; ++i) {
      const double* c = costs + i * k;
      double* out = alpha + i * k;
      double tau = std::numeric_limits<double>::infinity();
      bool finite = true;
      for (int64_t j = 0; j < k; ++j) {
        finite = finite && std::isfinite(c[j]);
        tau = std::min(tau, c[j] + inv_w[size_t(j)]);
      }
      if (!finite) {
        faults.add(i, FaultKind::NonFinite, "costs: row %lld holds a NaN or infinite value", ll(i));
        continue;
      }
      int64_t n = 0;
      for (int64_t j = 0; j < k; ++j)
        if (c[j] < tau) A[size_t(n++)] = j;
      for (;;) {
        double sw = 0.0, scw = 0.0;
        for (int64_t q = 0; q < n; ++q) {
          const int64_t j = A[size_t(q)];
          sw += w[j];
          scw += c[j] * w[j];
        }
        const double next = (1.0 + scw) / sw;
        int64_t kept = 0;
        for (int64_t q = 0; q < n; ++q) {
          const int64_t j = A[size_t(q)];
          if (c[j] < next) A[size_t(kept++)] = j;
        }
        // no entry below the new level: only rounding does that (a set of one column, whose level
        // c_j + 1/w_j rounds to c_j): keep the last level, which has entries below it
        if (kept == 0) break;
        tau = next;
        if (kept == n) break;
        n = kept;
      }
      for (int64_t j = 0; j < k; ++j) out[j] = c[j] < tau ? w[j] * (tau - c[j]) : 0.0;
    }
  }
}

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
