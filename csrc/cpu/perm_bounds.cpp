// PERM's screen bounds (see perm_bounds.h): the ~25 small torch ops on [m, k] tensors of
// perm.py's _screened_weights in two passes over the rows (0.5–0.7 ms of one thread at m = 2,000,
// k = 16, where the ops' own overhead was most of it). Compiled once, at the baseline level:
// scalar double arithmetic, each product rounded before it is added (no contraction into FMA,
// as torch's separate ops round them), so the keys equal those of the torch code.
#include "perm_bounds.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace pflcore::cpu {

void perm_screen_need(int64_t m, int64_t k, int64_t d, double unit, const int64_t* labels, const double* sq,
                      const double* mu_sq, const double* t, const double* sizes, double lam, int64_t first,
                      int64_t stop, int64_t* keys) {
  const double scale = double(d + 3) * unit;
  // far[i, b] = sqrt(max(t + E, 0)), near = sqrt(max(t − E, 0)), E = (sq_i + mu_sq_b)·scale + 1e-300;
  // own[i] = far[i, label_i]; radius[b] = max own over cluster b (from 0)
  const size_t M = static_cast<size_t>(m), Kc = static_cast<size_t>(k);
  std::vector<double> own(M), radius(Kc, 0.0), best(Kc, std::numeric_limits<double>::infinity()), inv_w(M), mu_norm(Kc);
  for (int64_t b = 0; b < k; ++b) mu_norm[size_t(b)] = std::sqrt(mu_sq[b]);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t a = labels[i];
    double e = sq[i] + mu_sq[a];
    e = e * scale;
    e = e + 1e-300;
    const double f = std::sqrt(std::max(t[i * k + a] + e, 0.0));
    own[size_t(i)] = f;
    radius[size_t(a)] = std::max(radius[size_t(a)], f);
    const double iw = 2.0 * lam / sizes[i];
    inv_w[size_t(i)] = iw;
    best[size_t(a)] = std::min(best[size_t(a)], iw);
  }
  for (int64_t i = first; i < stop; ++i) {
    const int64_t a = labels[i];
    const double root = std::sqrt(sq[i]);
    // moved[b] = u·(‖s_i‖ + ‖μ_b‖ + r_b); lower[b] = max(near − r_b − moved_b, 0)²
    const double moved_own = unit * ((root + mu_norm[size_t(a)]) + radius[size_t(a)]);
    double reach = own[size_t(i)] + radius[size_t(a)];
    reach = reach + moved_own;
    double rr = reach * reach;
    rr = rr + best[size_t(a)];
    const double level = std::min(inv_w[size_t(i)], rr) * (1.0 + 1e-9);
    int64_t key = int64_t(1) << (k - 1 - a);
    for (int64_t b = 0; b < k; ++b) {
      double e = sq[i] + mu_sq[b];
      e = e * scale;
      e = e + 1e-300;
      const double near = std::sqrt(std::max(t[i * k + b] - e, 0.0));
      const double moved = unit * ((root + mu_norm[size_t(b)]) + radius[size_t(b)]);
      double low = near - radius[size_t(b)];
      low = std::max(low - moved, 0.0);
      low = low * low;
      if (low < level) key |= int64_t(1) << (k - 1 - b);
    }
    keys[i - first] = key;
  }
}

}  // namespace pflcore::cpu
