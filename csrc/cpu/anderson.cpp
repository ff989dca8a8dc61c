// Anderson mixing on the CPU (DESIGN.md §4): the incremental Gram update fused with storing
// the new pair, the mixing pass, and the regularized solve of the small system.
// Reductions over the (long) state run in fixed blocks summed in block order, so results
// are bitwise independent of the thread count.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "pflcore/ops_cpu.h"
#include "pflcore/parallel.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace {
constexpr int64_t kBlock = 8192;
// One block (D <= kBlock) runs on the calling thread: waking the team for it costs more than
// the pass, and a team that must wait for a descheduled thread (a busy machine) costs far more.
inline int64_t num_blocks(int64_t D) { return (D + kBlock - 1) / kBlock; }
}  // namespace

template <typename T>
void anderson_push(const T* u, const T* tu, T* R_hist, T* TU_hist, int64_t D, int64_t slot,
                   const int64_t* slots, int64_t k, double* dots) {
  const int64_t nb = num_blocks(D);
  std::vector<double> partial(nb * k, 0.0);
  T* r_new = R_hist + slot * D;
  T* tu_new = TU_hist + slot * D;
  parallel_for(nb > 1, 0, nb, 1, [&](int64_t blk) {
    const int64_t e0 = blk * kBlock, e1 = std::min(D, e0 + kBlock);
#pragma omp simd
    for (int64_t e = e0; e < e1; ++e) {
      r_new[e] = tu[e] - u[e];
      tu_new[e] = tu[e];
    }
    for (int64_t j = 0; j < k; ++j) {
      const T* rj = R_hist + slots[j] * D;
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t e = e0; e < e1; ++e) acc += double(rj[e]) * double(r_new[e]);
      partial[blk * k + j] = acc;
    }
  });
  for (int64_t j = 0; j < k; ++j) {
    double s = 0.0;
    for (int64_t blk = 0; blk < nb; ++blk) s += partial[blk * k + j];
    dots[j] = s;
  }
}

template <typename T>
void anderson_mix(const T* TU_hist, int64_t D, const int64_t* slots, const double* pi, int64_t k,
                  T* out) {
  parallel_for(D > kBlock, 0, D, kBlock, [&](int64_t e0) {
    const int64_t e1 = std::min(D, e0 + kBlock);
    double acc[kBlock];
    std::fill(acc, acc + (e1 - e0), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const T* v = TU_hist + slots[j] * D;
      const double w = pi[j];
#pragma omp simd
      for (int64_t e = e0; e < e1; ++e) acc[e - e0] += w * double(v[e]);
    }
    for (int64_t e = e0; e < e1; ++e) out[e] = T(acc[e - e0]);
  });
}

template <typename T>
void gram(const T* vecs, int64_t k, int64_t D, double* G) {
  const int64_t nb = num_blocks(D);
  const int64_t pairs = k * (k + 1) / 2;
  std::vector<double> partial(nb * pairs, 0.0);
  parallel_for(nb > 1, 0, nb, 1, [&](int64_t blk) {
    const int64_t e0 = blk * kBlock, e1 = std::min(D, e0 + kBlock);
    int64_t q = 0;
    for (int64_t a = 0; a < k; ++a)
      for (int64_t b = a; b < k; ++b, ++q) {
        const T* va = vecs + a * D;
        const T* vb = vecs + b * D;
        double acc = 0.0;
#pragma omp simd reduction(+ : acc)
        for (int64_t e = e0; e < e1; ++e) acc += double(va[e]) * double(vb[e]);
        partial[blk * pairs + q] = acc;
      }
  });
  int64_t q = 0;
  for (int64_t a = 0; a < k; ++a)
    for (int64_t b = a; b < k; ++b, ++q) {
      double s = 0.0;
      for (int64_t blk = 0; blk < nb; ++blk) s += partial[blk * pairs + q];
      G[a * k + b] = G[b * k + a] = s;
    }
}

namespace {
// Cholesky solve of A x = b for a small symmetric A [k, k]; false when A is not
// numerically positive definite.
bool cholesky_solve(std::vector<double> A, int64_t k, const double* b, double* x) {
  for (int64_t j = 0; j < k; ++j) {
    double s = A[j * k + j];
    for (int64_t q = 0; q < j; ++q) s -= A[j * k + q] * A[j * k + q];
    if (!(s > 0.0) || !std::isfinite(s)) return false;
    const double ljj = std::sqrt(s);
    A[j * k + j] = ljj;
    for (int64_t i = j + 1; i < k; ++i) {
      double t = A[i * k + j];
      for (int64_t q = 0; q < j; ++q) t -= A[i * k + q] * A[j * k + q];
      A[i * k + j] = t / ljj;
    }
  }
  for (int64_t i = 0; i < k; ++i) {  // L y = b
    double t = b[i];
    for (int64_t q = 0; q < i; ++q) t -= A[i * k + q] * x[q];
    x[i] = t / A[i * k + i];
  }
  for (int64_t i = k - 1; i >= 0; --i) {  // Lᵀ x = y
    double t = x[i];
    for (int64_t q = i + 1; q < k; ++q) t -= A[q * k + i] * x[q];
    x[i] = t / A[i * k + i];
  }
  return true;
}
}  // namespace

void anderson_solve(const double* G, int64_t k, double reg, double* pi) {
  double trace = 0.0;
  for (int64_t j = 0; j < k; ++j) trace += G[j * k + j];
  // A zero residual is an exact fixed point: take it (the newest such pair).
  for (int64_t j = k - 1; j >= 0; --j) {
    if (G[j * k + j] == 0.0) {
      for (int64_t q = 0; q < k; ++q) pi[q] = q == j ? 1.0 : 0.0;
      return;
    }
  }
  // π = A⁻¹1 / 1ᵀA⁻¹1 with A = G + λI, λ = reg·‖R‖²_F. Residuals near convergence differ
  // in size by many orders, so A is equilibrated first: Â = S A S with S = diag(A)^{-1/2},
  // A⁻¹1 = S Â⁻¹ S 1. If rounding leaves Â indefinite, a jitter from 1e-14 upwards is added.
  double lam = reg * trace;
  std::vector<double> scale(k), rhs(k);
  for (int64_t j = 0; j < k; ++j) {
    scale[j] = 1.0 / std::sqrt(G[j * k + j] + lam);
    rhs[j] = scale[j];
  }
  double jitter = 0.0;
  for (int attempt = 0; attempt < 40; ++attempt) {
    std::vector<double> A(k * k);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < k; ++j)
        A[i * k + j] = ((i == j ? G[i * k + j] + lam : G[i * k + j]) * scale[i] * scale[j]) +
                       (i == j ? jitter : 0.0);
    if (cholesky_solve(std::move(A), k, rhs.data(), pi)) {
      double s = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        pi[j] *= scale[j];
        s += pi[j];
      }
      if (std::isfinite(s) && s != 0.0) {
        for (int64_t j = 0; j < k; ++j) pi[j] /= s;
        return;
      }
    }
    jitter = jitter == 0.0 ? 1e-14 : jitter * 10.0;
  }
  throw std::runtime_error("anderson_solve: the Gram matrix is not finite");
}

template void anderson_push<float>(const float*, const float*, float*, float*, int64_t, int64_t,
                                   const int64_t*, int64_t, double*);
template void anderson_push<double>(const double*, const double*, double*, double*, int64_t,
                                    int64_t, const int64_t*, int64_t, double*);
template void anderson_mix<float>(const float*, int64_t, const int64_t*, const double*, int64_t,
                                  float*);
template void anderson_mix<double>(const double*, int64_t, const int64_t*, const double*, int64_t,
                                   double*);
template void gram<float>(const float*, int64_t, int64_t, double*);
template void gram<double>(const double*, int64_t, int64_t, double*);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
