// The statistics of the screen of PERM's mixing weights (pflcore/algorithms/perm.py,
// _screened_weights): what its torch code computes in ~12 ops over G and [m, k] tensors (1.8 ms
// at m = 2,000, d = 610, one thread), in four passes over the gradients' rows: their mean, the
// norms and projections, the clusters' centres, the distances to them.
//
// With the rows shifted by their mean in T, s_i = fl_T(g_i − mean) (never stored):
//   sq[i]      = Σ_j s_ij²                         (T sums in vector lanes, as torch's)
//   y_i        = s_i Ω                             (the projection the clustering reads; T sums in
//                                                   order of the coordinates, as t's dots)
//   labels     farthest-point traversal of the y_i (Gonzalez): centre 0 is row 0, each next centre
//              the row farthest from the centres so far (ties: the lowest index), stopping early
//              when every row lies on a centre; each row labelled by its nearest centre (the first
//              one at that distance)
//   mu[b]      = fl_T(mean of the s_i of cluster b),  mu_sq[b] = Σ_j mu_bj²  (T sums)
//   t[i][b]    = sq[i] + mu_sq[b] − 2 s_i·mu_b      (the dot in T, in order of the coordinates)
// Every sum of T products here is bounded by γ_d·Σ|terms| whatever its order, which is the bound
// the screen's error terms assume (perm.py: E = (d + 3)·2u·(‖s‖² + ‖μ‖²)). Rows are independent and
// every sum has a fixed order, so nothing depends on the thread count.
#include <algorithm>
#include <vector>

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

// q columns of d values (rows of `cols` [q, d]) packed for row_products: [d][Q], Q = q rounded
// up to whole vectors, zero past q (one coordinate of every column is then nv vector loads).
template <typename T>
struct ColPanel {
  static constexpr int L = Vt<T>::L;
  int64_t q = 0, d = 0, nv = 0, Q = 0;
  std::vector<T> p;
  void pack(const T* cols, int64_t q_, int64_t d_) {
    q = q_, d = d_, nv = (q + L - 1) / L, Q = nv * L;
    p.assign(size_t(d * Q), T(0));
    for (int64_t c = 0; c < q; ++c)
      for (int64_t j = 0; j < d; ++j) p[size_t(j * Q + c)] = cols[c * d + j];
  }
};

// Rows of a block of row_products, and vectors of columns per pass over the coordinates: R·NB
// accumulators, NB column vectors and a broadcast fit the registers.
constexpr int kRowsR = simd::kRegs >= 32 ? 8 : 4;
constexpr int kColsNB = 2;

// out[r][c] = Σ_j s[r][j]·cols[c][j] for the rows s[0 .. R) (pointers; rows of d values) and the
// columns of `panel`, as a GEMM micro-kernel: each coordinate's column vectors are loaded once for
// R rows, one broadcast of s[r][j] per row (dots of one row against the packed columns had loaded
// every column vector per row, from L2 once q·d outgrew L1, and reduced each sum's lanes: ~55% of
// the statistics' time at m = 2,000, d = 610). Each row's sums run in order of j in its own
// accumulators, so a row's result does not depend on the block it is in (copies of a row get the
// same sums). Rows r >= nr are not written.
template <typename T, int R>
inline void row_products(const T* const* s, int nr, const ColPanel<T>& panel, double* out, int64_t ldo) {
  using V = typename Vt<T>::V;
  constexpr int L = ColPanel<T>::L;
  const int64_t d = panel.d, Q = panel.Q;
  for (int64_t v0 = 0; v0 < panel.nv; v0 += kColsNB) {
    const int nb = int(std::min<int64_t>(kColsNB, panel.nv - v0));
    V acc[R][kColsNB];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kColsNB; ++v) acc[r][v] = V{};
    const T* pc = panel.p.data() + v0 * L;
    if (nb == kColsNB) {
      for (int64_t j = 0; j < d; ++j, pc += Q) {
        const V b0 = Vt<T>::load(pc), b1 = Vt<T>::load(pc + L);
        for (int r = 0; r < R; ++r) {
          const V a = simd::splat<V>(s[r][j]);
          acc[r][0] += a * b0;
          acc[r][1] += a * b1;
        }
      }
    } else {
      for (int64_t j = 0; j < d; ++j, pc += Q) {
        const V b0 = Vt<T>::load(pc);
        for (int r = 0; r < R; ++r) acc[r][0] += simd::splat<V>(s[r][j]) * b0;
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int v = 0; v < nb; ++v)
        for (int l = 0; l < L; ++l) {
          const int64_t c = (v0 + v) * L + l;
          if (c < panel.q) out[r * ldo + c] = double(acc[r][v][l]);
        }
  }
}

// For the rows i0 .. i0 + nr (nr <= kRowsR) of G: s_i = fl_T(g_i − mean) into buf [kRowsR][d],
// then each(r, s_r) and row_products of them against `panel` into out (rows of ldo).
template <typename T, typename Each>
inline void shifted_block(const T* G, int64_t d, const T* mean, int64_t i0, int nr, T* buf, const ColPanel<T>& panel,
                          double* out, int64_t ldo, Each&& each) {
  const T* rows[kRowsR];
  for (int r = 0; r < kRowsR; ++r) {
    T* sr = buf + r * d;
    rows[r] = buf + std::min(r, nr - 1) * d;  // a short block repeats its last row (not written)
    if (r >= nr) continue;
    const T* g = G + (i0 + r) * d;
    for (int64_t j = 0; j < d; ++j) sr[j] = g[j] - mean[j];
    each(r, sr);
  }
  row_products<T, kRowsR>(rows, nr, panel, out, ldo);
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
  // the projections y_i = s_i Ω: omega [d, q] is already the panel's layout, padded to whole vectors
  ColPanel<T> om_panel;
  {
    std::vector<T> om_t(q * d);
    for (int64_t j = 0; j < d; ++j)
      for (int64_t c = 0; c < q; ++c) om_t[c * d + j] = omega[j * q + c];
    om_panel.pack(om_t.data(), q, d);
  }
  std::vector<double> Y(m * q);
  const int64_t row_blocks = (m + kRowsR - 1) / kRowsR;
#pragma omp parallel
  {
    std::vector<T> buf(kRowsR * d);
#pragma omp for schedule(static)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t i0 = rb * kRowsR;
      shifted_block(G, d, mean.data(), i0, int(std::min<int64_t>(kRowsR, m - i0)), buf.data(), om_panel,
                    Y.data() + i0 * q, q, [&](int r, const T* sr) { sq[i0 + r] = double(dot(sr, sr, d)); });
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
  ColPanel<T> mu_panel;
  mu_panel.pack(mu, found, d);
#pragma omp parallel
  {
    std::vector<T> buf(kRowsR * d);
#pragma omp for schedule(static)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t i0 = rb * kRowsR;
      const int nr = int(std::min<int64_t>(kRowsR, m - i0));
      double* ti = t + i0 * found;  // s_i·μ_b first, then t in place
      shifted_block(G, d, mean.data(), i0, nr, buf.data(), mu_panel, ti, found, [](int, const T*) {});
      for (int r = 0; r < nr; ++r)
        for (int64_t b = 0; b < found; ++b)
          ti[r * found + b] = sq[i0 + r] + mu_sq[b] - 2.0 * ti[r * found + b];
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
