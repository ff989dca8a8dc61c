// PERM's mixing weights (pflcore/algorithms/perm.py, DESIGN.md §5): for each row i of the costs,
//   α_i = argmin_{α ∈ simplex} Σ_j c_ij α_j + Σ_j α_j² / (2 w_j),
// whose KKT conditions give α_ij = w_j·max(0, τ_i − c_ij) with the level τ_i such that Σ_j α_ij = 1.
//
// The level by Michelot's active-set iteration (as in the simplex projection), from above: the
// level of any subset S of the columns, τ_S = (1 + Σ_S c_j w_j) / Σ_S w_j computed over the S
// whose entries are all below it, bounds τ from above; so does g(A) = (1 + Σ_A c w)/Σ_A w for any
// A ⊇ the active set (Σ_A w (g − c) = 1 and the entries of A outside the active set are ≥ τ).
// Start from the smaller of the best single column's level, min_j (c_j + 1/w_j), and g(every
// column), keep A = {j : c_j < τ}, and
// repeat τ ← g(A), A ← {j ∈ A : c_j < τ}: τ decreases, A shrinks and still holds every active
// column, and when A stops shrinking, A = {j : c_j < g(A)}: g(A) is the level. A few passes over
// a shrinking list, where the torch reference sorts each row (or its top-k candidates).
//
// Rows are independent: one thread per row, sums in a fixed order, so the bits do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"
#include "water_level.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN


void water_fill(const double* costs, int64_t r, int64_t k, const double* w, const double* w_own, double* alpha,
                Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, k, inv_w, faults)) return;
  if (w_own) {  // each row's own weight for the last column (a pooled α's own client): checked first
    for (int64_t i = 0; i < r; ++i)
      if (!(std::isfinite(w_own[i]) && w_own[i] > 0.0)) {
        faults.add(i, std::isfinite(w_own[i]) ? FaultKind::Value : FaultKind::NonFinite,
                   "w_own: expected finite positive weights, got w_own[%lld] = %g", ll(i), w_own[i]);
        return;
      }
  }
#pragma omp parallel if (r * k > (1 << 15))
  {
    std::vector<double> Ac(static_cast<size_t>(k)), Aw(static_cast<size_t>(k));
    // with w_own: the thread's copy of the weights and their inverses, the last entry set per row
    std::vector<double> wl(w_own ? w : w + k, w + k), il(w_own ? inv_w.begin() : inv_w.end(), inv_w.end());
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r; ++i) {
      const double* c = costs + i * k;
      double* out = alpha + i * k;
      if (!(finite_probe(c, k) == 0.0)) {
        faults.add(i, FaultKind::NonFinite, "costs: row %lld holds a NaN or infinite value", ll(i));
        continue;
      }
      const double* wi = w;
      const double* ii = inv_w.data();
      if (w_own) {
        wl[size_t(k - 1)] = w_own[i];
        il[size_t(k - 1)] = 1.0 / w_own[i];
        wi = wl.data();
        ii = il.data();
      }
      const double tau = row_level<false>(c, wi, ii, k, Ac.data(), Aw.data(), nullptr, nullptr);
      // w·max(0, τ − c): 0 exactly where c ≥ τ, without a branch on the data
#pragma omp simd
      for (int64_t j = 0; j < k; ++j) out[j] = wi[j] * std::max(0.0, tau - c[j]);
    }
  }
}

template <typename T>
void water_fill_gram(const T* gram, const double* sq_r, const double* sq_c, const int64_t* own, int64_t r, int64_t k,
                     const double* w, double* out, int64_t out_stride, const int64_t* out_rows, const int64_t* cols,
                     int fill, double* levels, Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, k, inv_w, faults)) return;
  const bool streamed = fill == 2 && out_stride >= kStreamedRow;
#pragma omp parallel if (r * k > (1 << 15))
  {
    std::vector<double> c(static_cast<size_t>(k)), Ac(static_cast<size_t>(k)), Aw(static_cast<size_t>(k));
    std::vector<int64_t> Ai(static_cast<size_t>(k));
    std::vector<double> row(streamed ? static_cast<size_t>(out_stride) : 0, 0.0);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r; ++i) {
      const T* g = gram + i * k;
      const double si = sq_r[i];
      double* ci = c.data();
      // the costs as perm.py's float64 path forms them: (‖y_i‖² + ‖y_j‖²) − 2·y_i·y_j, at least 0
      // in one vector pass with the finiteness probe (taken before the clamp, which would turn −inf
      // and NaN into 0; the clamp as a select: std::max's branch kept this loop scalar)
      double probe = 0.0;
#pragma omp simd reduction(+ : probe)
      for (int64_t j = 0; j < k; ++j) {
        const double v = (si + sq_c[j]) - 2.0 * double(g[j]);
        probe += v * 0.0;
        ci[j] = v > 0.0 ? v : 0.0;
      }
      if (!(probe == 0.0)) {
        faults.add(i, FaultKind::NonFinite, "gram: row %lld gives a NaN or infinite cost", ll(i));
        continue;
      }
      ci[own[i]] = 0.0;  // the row's own client: exactly 0
      int64_t active = -1;
      const double tau = row_level<true>(ci, w, inv_w.data(), k, Ac.data(), Aw.data(), Ai.data(), &active);
      double* o = out + out_rows[i] * out_stride;
      if (fill == 2) {  // the whole row, by this row's thread (the positive weights where the set is exact)
        if (active >= 0)
          write_whole_row(o, out_stride, row.data(), active, Ac.data(), Aw.data(), tau,
                          [&](int64_t q) { return cols[Ai[size_t(q)]]; });
        else
          write_whole_row(o, out_stride, row.data(), k, ci, w, tau, [&](int64_t j) { return cols[j]; });
      } else if (fill == 1 && active >= 0) {  // the positive weights only, w_j·(τ − c_j) as below (the same bits)
        for (int64_t q = 0; q < active; ++q) o[cols[Ai[size_t(q)]]] = Aw[size_t(q)] * (tau - Ac[size_t(q)]);
      } else {
        for (int64_t j = 0; j < k; ++j) o[cols[j]] = w[j] * std::max(0.0, tau - ci[j]);  // (no branch on the data)
      }
      levels[i] = tau;
    }
#if defined(__AVX__)
    if (streamed) _mm_sfence();  // the streamed rows visible before the threads join
#endif
  }
}

template void water_fill_gram<float>(const float*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                     const double*, double*, int64_t, const int64_t*, const int64_t*, int, double*,
                                     Faults&);
template void water_fill_gram<double>(const double*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                      const double*, double*, int64_t, const int64_t*, const int64_t*, int, double*,
                                      Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
