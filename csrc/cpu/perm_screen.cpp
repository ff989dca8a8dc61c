// The statistics of the screen of PERM's mixing weights (pflcore/algorithms/perm.py,
// _screened_weights): what its torch code computes in ~12 ops over G and [m, k] tensors (1.8 ms
// at m = 2,000, d = 610, one thread), in four passes over the gradients' rows: their mean, the
// norms and projections, the clusters' centres, the distances to them (1.5 ms on one thread,
// 0.8 on two).
//
// With the rows shifted by their mean in T, s_i = fl_T(g_i − mean) (never stored):
//   sq[i]      = Σ_j s_ij²                         (T sums in vector lanes, as torch's)
//   y_i        = s_i Ω                             (the projection the clustering reads)
//   labels     farthest-point traversal of the y_i (Gonzalez): centre 0 is row 0, each next centre
//              the row farthest from the centres so far (ties: the lowest index), stopping early
//              when every row lies on a centre; each row labelled by its nearest centre (the first
//              one at that distance)
//   mu[b]      = fl_T(mean of the s_i of cluster b),  mu_sq[b] = Σ_j mu_bj²  (T sums)
//   t[i][b]    = sq[i] + mu_sq[b] − 2 s_i·mu_b      (the dot in T, lane sums)
// Every sum of T products here is bounded by γ_d·Σ|terms| whatever its order, which is the bound
// the screen's error terms assume (perm.py: E = (d + 3)·2u·(‖s‖² + ‖μ‖²)). Rows are independent and
// every sum has a fixed order, so nothing depends on the thread count.
#include <algorithm>
#include <vector>

#include "lane_sums.h"
#include "pflcore/ops_cpu.h"
#include "simd.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

template <typename T>
using Vt = simd::Vec<T>;

// Σ_j a_j·b_j over n values: lane sums, then the lanes in order.
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using V = typename Vt<T>::V;
  constexpr int L = Vt<T>::L;
  V acc0{}, acc1{};
  int64_t j = 0;
  for (; j + 2 * L <= n; j += 2 * L) {
    acc0 += Vt<T>::load(a + j) * Vt<T>::load(b + j);
    acc1 += Vt<T>::load(a + j + L) * Vt<T>::load(b + j + L);
  }
  for (; j + L <= n; j += L) acc0 += Vt<T>::load(a + j) * Vt<T>::load(b + j);
  acc0 += acc1;
  T s = T(0);
  for (int l = 0; l < L; ++l) s += acc0[l];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// n rows of d values laid out for dots_all: blocks of NC rows, each block's vectors of coordinates
// interleaved ([full vectors][NC][L], rows past n repeating the last), so that one pointer and
// constant offsets reach the NC vectors of a coordinate block; the last d − full·L coordinates of
// every row apart ([n][d − full·L]).
template <typename T>
struct DotRows {
  static constexpr int NC = simd::kRegs >= 32 ? 16 : 8;  // accumulators in the registers
  static constexpr int L = Vt<T>::L;
  int64_t n = 0, d = 0, full = 0;
  std::vector<T> v, tail;
  void pack(const T* rows, int64_t n_, int64_t d_) {
    n = n_, d = d_, full = d / L;
    const int64_t blocks = (n + NC - 1) / NC;
    v.assign(size_t(blocks * full * NC * L), T(0));
    tail.assign(size_t(n * (d - full * L)), T(0));
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t jv = 0; jv < full; ++jv)
        for (int c = 0; c < NC; ++c) {
          const T* r = rows + std::min<int64_t>(b * NC + c, n - 1) * d + jv * L;
          std::copy(r, r + L, v.begin() + ((b * full + jv) * NC + c) * L);
        }
    for (int64_t c = 0; c < n; ++c)
      std::copy(rows + c * d + full * L, rows + (c + 1) * d, tail.begin() + c * (d - full * L));
  }
};

// out[c] = Σ_j s_j·rows[c][j] for every row c of `rows` (DotRows): NC accumulators in the registers
// and one load of s per vector of coordinates (separate dots reloaded s and reduced each sum's
// lanes alone: ~2x the time), then their lanes (lane_sums_each) and each sum's last coordinates.
template <typename T>
inline void dots_all(const T* s, const DotRows<T>& rows, double* out) {
  using V = typename Vt<T>::V;
  constexpr int NC = DotRows<T>::NC, L = DotRows<T>::L;
  const int64_t full = rows.full, rest = rows.d - full * L;
  for (int64_t c0 = 0, b = 0; c0 < rows.n; c0 += NC, ++b) {
    V acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = V{};
    const T* pb = rows.v.data() + b * full * NC * L;
    for (int64_t jv = 0; jv < full; ++jv, pb += NC * L) {
      const V sv = Vt<T>::load(s + jv * L);
      for (int c = 0; c < NC; ++c) acc[c] += sv * Vt<T>::load(pb + c * L);
    }
    const int64_t nb = std::min<int64_t>(NC, rows.n - c0);
    T sums[NC];
    lane_sums_each<T>(acc, NC, sums);
    for (int c = 0; c < nb; ++c) {
      T sum = sums[c];
      const T* tr = rows.tail.data() + (c0 + c) * rest;
      for (int64_t j = 0; j < rest; ++j) sum += s[full * L + j] * tr[j];
      out[c0 + c] = double(sum);
    }
  }
}

}  // namespace

template <typename T>
int64_t perm_screen_stats(const T* G, int64_t m, int64_t d, const T* omega, int64_t q, int64_t k, int64_t* labels,
                          double* sq, T* mu, double* mu_sq, double* t) {
  // the mean in double (any shift keeps the distances; the rounding of the shifted rows is the
  // screen's `moved` term), then the shift in T
  // (columns in strips of 64, one strip per task, the rows in order: the same sums on any team)
  std::vector<T> mean(d);
  constexpr int64_t kStrip = 64;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < d; j0 += kStrip) {
    const int64_t w = std::min(kStrip, d - j0);
    double acc[kStrip] = {};
    for (int64_t i = 0; i < m; ++i) {
      const T* g = G + i * d + j0;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) acc[j] += double(g[j]);
    }
    for (int64_t j = 0; j < w; ++j) mean[j0 + j] = T(acc[j] / double(m));
  }
  // omega transposed [q, d] (each projection a row of dots), laid out for dots_all
  DotRows<T> om_rows;
  {
    std::vector<T> om_t(q * d);
    for (int64_t j = 0; j < d; ++j)
      for (int64_t c = 0; c < q; ++c) om_t[c * d + j] = omega[j * q + c];
    om_rows.pack(om_t.data(), q, d);
  }
  std::vector<double> Y(m * q);
#pragma omp parallel
  {
    std::vector<T> s(d);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      const T* g = G + i * d;
      for (int64_t j = 0; j < d; ++j) s[j] = g[j] - mean[j];
      sq[i] = double(dot(s.data(), s.data(), d));
      dots_all(s.data(), om_rows, Y.data() + i * q);
    }
  }
  // farthest-point traversal on Y
  std::vector<double> best(m);
  auto dist_to = [&](int64_t r, int64_t i) {
    double acc = 0.0;
    for (int64_t c = 0; c < q; ++c) {
      const double e = Y[i * q + c] - Y[r * q + c];
      acc += e * e;
    }
    return acc;
  };
  for (int64_t i = 0; i < m; ++i) {
    best[i] = dist_to(0, i);
    labels[i] = 0;
  }
  int64_t found = 1;
  for (int64_t c = 1; c < k; ++c) {
    int64_t far = 0;
    for (int64_t i = 1; i < m; ++i)
      if (best[i] > best[far]) far = i;
    if (!(best[far] > 0.0)) break;  // fewer distinct points than clusters
    for (int64_t i = 0; i < m; ++i) {
      const double e = dist_to(far, i);
      if (e < best[i]) {
        best[i] = e;
        labels[i] = c;
      }
    }
    found = c + 1;
  }
  // the clusters' means: each cluster's rows summed in ascending order (in double), one cluster
  // per task
  std::vector<int64_t> count(found, 0), start(found + 1, 0), order(m);
  for (int64_t i = 0; i < m; ++i) ++count[labels[i]];
  for (int64_t b = 0; b < found; ++b) start[b + 1] = start[b] + count[b];
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < m; ++i) order[at[labels[i]]++] = i;
  }
#pragma omp parallel
  {
    std::vector<double> acc(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < found; ++b) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t u = start[b]; u < start[b + 1]; ++u) {
        const T* g = G + order[u] * d;
        for (int64_t j = 0; j < d; ++j) acc[j] += double(T(g[j] - mean[j]));
      }
      T* mb = mu + b * d;
      for (int64_t j = 0; j < d; ++j) mb[j] = T(acc[j] / double(count[b]));
      mu_sq[b] = double(dot(mb, mb, d));
    }
  }
  // t = ‖s_i − μ_b‖² by the Gram formula
  DotRows<T> mu_rows;
  mu_rows.pack(mu, found, d);
#pragma omp parallel
  {
    std::vector<T> s(d);
    std::vector<double> sm(found);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      const T* g = G + i * d;
      for (int64_t j = 0; j < d; ++j) s[j] = g[j] - mean[j];
      dots_all(s.data(), mu_rows, sm.data());
      for (int64_t b = 0; b < found; ++b) t[i * found + b] = sq[i] + mu_sq[b] - 2.0 * sm[b];
    }
  }
  return found;
}

template int64_t perm_screen_stats<float>(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t*,
                                          double*, float*, double*, double*);
template int64_t perm_screen_stats<double>(const double*, int64_t, int64_t, const double*, int64_t, int64_t, int64_t*,
                                           double*, double*, double*, double*);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
