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
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

// The level τ of one row of finite costs c [k] (Michelot's iteration, above); Ac and Aw: scratch of
// k entries each.
inline double row_level(const double* c, const double* w, const double* inv_w, int64_t k, double* Ac, double* Aw) {
  // Two upper bounds of τ, the better one first: the best single column's level, and g(every
  // column) (every column holds the active set). Where 1/w is large against the costs (PERM's
  // 2λ_α/n_j against its gradient distances) the second keeps about half as many columns.
  double tau = std::numeric_limits<double>::infinity(), sw = 0.0, scw = 0.0;
#pragma omp simd reduction(min : tau) reduction(+ : sw, scw)
  for (int64_t j = 0; j < k; ++j) {
    tau = std::min(tau, c[j] + inv_w[j]);
    sw += w[j];
    scw += c[j] * w[j];
  }
  tau = std::min(tau, (1.0 + scw) / sw);
  // Branch-free compaction (each entry is written, the count advances where it is kept): near
  // half of the entries stay in the first passes, so a branch there mispredicts often (with
  // branches the kernel ran ~9 ns an entry at m = 2,000). The level's sums run in four partial
  // sums (q mod 4) so that the additions do not wait on each other.
  int64_t n = 0;
  for (int64_t j = 0; j < k; ++j) {
    Ac[n] = c[j];
    Aw[n] = w[j];
    n += c[j] < tau;
  }
  for (;;) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, t0 = 0.0, t1 = 0.0, t2 = 0.0, t3 = 0.0;
    int64_t q = 0;
    for (; q + 4 <= n; q += 4) {
      s0 += Aw[q], s1 += Aw[q + 1], s2 += Aw[q + 2], s3 += Aw[q + 3];
      t0 += Ac[q] * Aw[q], t1 += Ac[q + 1] * Aw[q + 1], t2 += Ac[q + 2] * Aw[q + 2], t3 += Ac[q + 3] * Aw[q + 3];
    }
    for (; q < n; ++q) s0 += Aw[q], t0 += Ac[q] * Aw[q];
    const double next = (1.0 + ((t0 + t1) + (t2 + t3))) / ((s0 + s1) + (s2 + s3));
    int64_t kept = 0;
    for (q = 0; q < n; ++q) {
      const double cq = Ac[q];
      Ac[kept] = cq;
      Aw[kept] = Aw[q];
      kept += cq < next;
    }
    // no entry below the new level: only rounding does that (a set of one column, whose level
    // c_j + 1/w_j rounds to c_j): keep the last level, which has entries below it
    if (kept == 0) break;
    tau = next;
    if (kept == n) break;
    n = kept;
  }
  return tau;
}

// 0 where every c[j] is finite, NaN otherwise (c·0 is NaN exactly for NaN and ±inf), in one vector pass.
inline double finite_probe(const double* c, int64_t k) {
  double probe = 0.0;
#pragma omp simd reduction(+ : probe)
  for (int64_t j = 0; j < k; ++j) probe += c[j] * 0.0;
  return probe;
}

// The weights checked (finite, > 0) and their inverses 1/w_j into inv_w (row_level's
// single-column levels c_j + 1/w_j); false, with the fault recorded, for a bad weight.
bool inverse_weights(const double* w, int64_t k, std::vector<double>& inv_w, Faults& faults) {
  inv_w.resize(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) {
    if (!(std::isfinite(w[j]) && w[j] > 0.0)) {
      faults.add(-1, std::isfinite(w[j]) ? FaultKind::Value : FaultKind::NonFinite,
                 "weights: expected finite positive weights, got weights[%lld] = %g", ll(j), w[j]);
      return false;
    }
    inv_w[size_t(j)] = 1.0 / w[j];
  }
  return true;
}

}  // namespace

void water_fill(const double* costs, int64_t r, int64_t k, const double* w, double* alpha, Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, k, inv_w, faults)) return;
#pragma omp parallel if (r * k > (1 << 15))
  {
    std::vector<double> Ac(static_cast<size_t>(k)), Aw(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r; ++i) {
      const double* c = costs + i * k;
      double* out = alpha + i * k;
      if (!(finite_probe(c, k) == 0.0)) {
        faults.add(i, FaultKind::NonFinite, "costs: row %lld holds a NaN or infinite value", ll(i));
        continue;
      }
      const double tau = row_level(c, w, inv_w.data(), k, Ac.data(), Aw.data());
      // w·max(0, τ − c): 0 exactly where c ≥ τ, without a branch on the data
#pragma omp simd
      for (int64_t j = 0; j < k; ++j) out[j] = w[j] * std::max(0.0, tau - c[j]);
    }
  }
}

template <typename T>
void water_fill_gram(const T* gram, const double* sq_r, const double* sq_c, const int64_t* own, int64_t r, int64_t k,
                     const double* w, double* out, int64_t out_stride, const int64_t* out_rows, const int64_t* cols,
                     double* levels, Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, k, inv_w, faults)) return;
#pragma omp parallel if (r * k > (1 << 15))
  {
    std::vector<double> c(static_cast<size_t>(k)), Ac(static_cast<size_t>(k)), Aw(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r; ++i) {
      const T* g = gram + i * k;
      const double si = sq_r[i];
      double* ci = c.data();
      // the costs as perm.py's float64 path forms them: (‖y_i‖² + ‖y_j‖²) − 2·y_i·y_j, at least 0
#pragma omp simd
      for (int64_t j = 0; j < k; ++j) ci[j] = (si + sq_c[j]) - 2.0 * double(g[j]);
      if (!(finite_probe(ci, k) == 0.0)) {  // before the clamp, which would turn −inf (and NaN) into 0
        faults.add(i, FaultKind::NonFinite, "gram: row %lld gives a NaN or infinite cost", ll(i));
        continue;
      }
#pragma omp simd
      for (int64_t j = 0; j < k; ++j) ci[j] = std::max(0.0, ci[j]);
      ci[own[i]] = 0.0;  // the row's own client: exactly 0
      const double tau = row_level(ci, w, inv_w.data(), k, Ac.data(), Aw.data());
      double* o = out + out_rows[i] * out_stride;
      for (int64_t j = 0; j < k; ++j) o[cols[j]] = w[j] * std::max(0.0, tau - ci[j]);  // (no branch on the data)
      levels[i] = tau;
    }
  }
}

template void water_fill_gram<float>(const float*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                     const double*, double*, int64_t, const int64_t*, const int64_t*, double*, Faults&);
template void water_fill_gram<double>(const double*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                      const double*, double*, int64_t, const int64_t*, const int64_t*, double*,
                                      Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
