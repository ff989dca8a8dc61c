// PERM's screen: which clusters of clients each row of the mixing weights may need
// (csrc/cpu/perm_bounds.cpp; pflcore/algorithms/perm.py, _screened_weights).
#pragma once
#include <cstdint>

namespace pflcore::cpu {

// From the screen's statistics (perm_screen_stats: labels [m], sq [m], mu_sq [k], t [m, k]) and
// the clients' sizes [m]: for each row i in [first, stop), keys[i − first] holds bit (k − 1 − b)
// for every cluster b whose clients may carry weight for client i (its own cluster always).
// k <= 62. The bounds are those of perm.py's torch code, operation for operation.
void perm_screen_need(int64_t m, int64_t k, int64_t d, double unit, const int64_t* labels, const double* sq,
                      const double* mu_sq, const double* t, const double* sizes, double lam, int64_t first,
                      int64_t stop, int64_t* keys);

}  // namespace pflcore::cpu
