// PERM's weights of rows first..stop (pflcore/algorithms/perm.py, _principal_weights) where the
// caller's bounds LB_ij ≤ c_ij ≤ UB_ij of every cost c_ij = ‖g_i − g_j‖² decide which costs are
// computed. The bounds come from the rows' coordinates p_i on a few principal directions and the
// norms ρ_i of their residuals (known to within [ρlo_i, ρhi_i]):
//   A_ij = ‖p_i − p_j‖²,  gap = max(0, ρlo_i − ρhi_j, ρlo_j − ρhi_i)
//   LB_ij = k_lo·A_ij + (1 − η)·gap² − (slack_i + slack_j)
//   UB_ij = k_hi·A_ij + (1 + η)·(ρhi_i + ρhi_j)² + (slack_i + slack_j),   UB_ii = 0
// (k_lo, k_hi, η and the slacks hold the basis' departure from orthonormality and the rounding of
// the coordinates; perm.py derives them).
//
// A. Per row: LB and UB against every column; τ_up = the level of the UB costs (costs at least the
//    true ones: a level at least τ_i), rounded up; the candidates j with LB_ij < τ_up, as a bit
//    set — every column with c_ij < τ_i is among them; and the row's nearest candidates.
// B. Blocks of up to kRows rows that are each other's near candidates (their candidate sets
//    overlap most), formed one after another in row order.
// C. Per block: the union of its rows' candidates, each union column's row of G read once for the
//    block's rows: c_ij = Σ_k (g_ik − g_jk)² in float64, from the gradients as given; each row's
//    level over the union (a superset of its candidates: the other columns hold 0 at τ_i).
//
// τ_i's sums are taken again over its active columns alone, in index order, and a cost's bits do
// not depend on the block it was computed in: the bounds, which come from BLAS products whose bits
// may depend on the thread count, decide only which columns are computed, not the weights. A row
// whose level exceeds its τ_up (bounds that did not hold: never, with perm.py's error terms) is
// computed from every column; its count is −1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "pflcore/ops_cpu.h"
#include "simd.h"
#include "water_level.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

using VD = simd::Vec<double>;
using V = VD::V;
constexpr int L = VD::L;

constexpr int kRows = 8;        // rows of a block (phase C): 8 float32 rows of G (d = 610: 19.5 KB) stay in L1
constexpr int kBoundRows = 4;   // rows of one pass of the bounds (phase A)
constexpr int kNeighbours = 16;  // nearest candidates kept per row, from which the blocks are formed
// vectors of columns per pass of the bounds: kRows × kBoundVecs accumulators in registers
constexpr int kBoundVecs = simd::kRegs >= 32 ? 4 : 2;

// L values of T, to be widened to float64 (a struct: see simd::Vec).
template <typename T>
struct Narrow {
  typedef T H __attribute__((vector_size(L * sizeof(T))));
};

// y[0 .. L) widened to float64.
template <typename T>
inline V widen(const T* y) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4 && L == 8) {  // one widening load (GCC's generic widening splits it in halves)
    const __m512d t = _mm512_cvtps_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(y)));
    V v;
    std::memcpy(&v, &t, sizeof v);
    return v;
  }
#endif
  typename Narrow<T>::H h;
  std::memcpy(&h, y, sizeof h);
  return __builtin_convertvector(h, V);
}

// out[q] = Σ_k (x_qk − y_k)² for the R rows x_q = x + q·d (float64), y as stored: each row two
// vector accumulators (its two chains of FMAs interleave with the other rows'), their lanes in
// order, then the tail. A row's sum is the same whatever R.
template <int R, typename T>
inline void sq_distances(const double* x, const T* y, int64_t d, double* out) {
  V a[R][2] = {};
  int64_t k = 0;
  for (; k + 2 * L <= d; k += 2 * L) {
    const V y0 = widen(y + k), y1 = widen(y + k + L);
    for (int q = 0; q < R; ++q) {
      const V t0 = VD::load(x + q * d + k) - y0, t1 = VD::load(x + q * d + k + L) - y1;
      a[q][0] += t0 * t0;
      a[q][1] += t1 * t1;
    }
  }
  if (k + L <= d) {
    const V y0 = widen(y + k);
    for (int q = 0; q < R; ++q) {
      const V t0 = VD::load(x + q * d + k) - y0;
      a[q][0] += t0 * t0;
    }
    k += L;
  }
  for (int q = 0; q < R; ++q) {
    const V v = a[q][0] + a[q][1];
    double s = 0.0;
    for (int l = 0; l < L; ++l) s += v[l];
    for (int64_t t = k; t < d; ++t) {
      const double e = x[q * d + t] - double(y[t]);
      s += e * e;
    }
    out[q] = s;
  }
}

// acc[0] += the lower lanes of a (float32) widened to float64, acc[1] += the upper ones.
template <typename F>
inline void add_widened(const F& a, V* acc) {
  constexpr int LF = simd::Vec<float>::L;
#if defined(__AVX512F__)
  if constexpr (LF == 16) {  // in registers
    __m512 t;
    std::memcpy(&t, &a, sizeof t);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(t)),
                  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
    V vl, vh;
    std::memcpy(&vl, &lo, sizeof vl);
    std::memcpy(&vh, &hi, sizeof vh);
    acc[0] += vl;
    acc[1] += vh;
    return;
  }
#endif
  alignas(64) float lanes[LF];
  simd::Vec<float>::store(lanes, a);
  acc[0] += widen(lanes);
  acc[1] += widen(lanes + L);
}

// out[c][q] = Σ_k (x_qk − y_ck)² for the R float32 rows x_q = x + q·d and the C rows y[c] of G:
// differences and squares in float32, summed in float32 over chunks of kChunk coordinates (each
// lane adds 16 squares) and in float64 across the chunks; then the lanes in order, then the tail
// in float64. The relative error of a sum is at most ~(16 + 3)·2⁻²⁴ (~1.1e-6), against the
// half-width vectors of the float64 path. A pair's sum is the same whatever R and C (C = 2 shares
// each load of a row of x between two columns).
template <int R, int C>
inline void sq_distances32(const float* x, const float* const* y, int64_t d, double (*out)[kRows]) {
  using VF = simd::Vec<float>;
  using F = VF::V;
  constexpr int LF = VF::L, kChunk = 16 * LF;
  static_assert(LF == 2 * L, "float lanes: twice the float64 lanes");
  V acc[C][R][2];
  int64_t k = 0;
  for (bool first = true; k + LF <= d; first = false) {
    const int64_t end = std::min<int64_t>(d - LF, k + kChunk - LF);  // last start of this chunk's vectors
    F a[C][R];
    for (int c = 0; c < C; ++c)
      for (int q = 0; q < R; ++q) a[c][q] = F{};
    for (; k <= end; k += LF) {
      F yv[C];
      for (int c = 0; c < C; ++c) yv[c] = VF::load(y[c] + k);
      for (int q = 0; q < R; ++q) {
        const F xv = VF::load(x + q * d + k);
        for (int c = 0; c < C; ++c) {
          const F t = xv - yv[c];
          a[c][q] += t * t;
        }
      }
    }
    for (int c = 0; c < C; ++c)
      for (int q = 0; q < R; ++q) {
        if (first) acc[c][q][0] = V{}, acc[c][q][1] = V{};
        add_widened(a[c][q], acc[c][q]);
      }
  }
  for (int c = 0; c < C; ++c)
    for (int q = 0; q < R; ++q) {
      double s = 0.0;
      if (d >= LF) {
        const V v = acc[c][q][0] + acc[c][q][1];
        for (int l = 0; l < L; ++l) s += v[l];
      }
      for (int64_t t = k; t < d; ++t) {
        const double e = double(x[q * d + t]) - double(y[c][t]);
        s += e * e;
      }
      out[c][q] = s;
    }
}

// The cache lines of n values of T from p, requested ahead of their reads (the next union
// column's row of G, ~2.4 KB somewhere in an L3-resident matrix: the hardware prefetcher starts
// each such row anew).
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  const char* e = reinterpret_cast<const char*>(p + n);
  for (; b < e; b += 64) __builtin_prefetch(b, 0, 3);
}

struct Screen {
  const double* PT;  // [r, m]
  int64_t r, m;
  const double *rho_lo, *rho_hi, *slack, *w, *inv_w;  // [m]
  double k_lo, k_hi, eta, sum_w;
};

// Phase A's bounds for the R rows i0.. : lb, ub [R][m]; start[q] = an upper bound of the level of
// row q's UB costs (the best single column's level and g(every column), from UB costs at least
// those of phase A: UB_ii is set to 0 after).
template <int R>
void bound_rows(const Screen& s, int64_t i0, double* lb, double* ub, double* start) {
  const int64_t m = s.m;
  constexpr int NB = kBoundVecs, C = NB * L;
  double lo[R], hi[R], sl[R];
  for (int q = 0; q < R; ++q) lo[q] = s.rho_lo[i0 + q], hi[q] = s.rho_hi[i0 + q], sl[q] = s.slack[i0 + q];
  V vmin[R], vscw[R];
  for (int q = 0; q < R; ++q) vmin[q] = simd::splat<V>(std::numeric_limits<double>::infinity()), vscw[q] = V{};
  double smin[R], sscw[R];
  for (int q = 0; q < R; ++q) smin[q] = std::numeric_limits<double>::infinity(), sscw[q] = 0.0;
  int64_t j0 = 0;
  for (; j0 + C <= m; j0 += C) {
    V acc[R][NB] = {};
    for (int64_t k = 0; k < s.r; ++k) {
      const double* pk = s.PT + k * m;
      V col[NB];
      for (int b = 0; b < NB; ++b) col[b] = VD::load(pk + j0 + b * L);
      for (int q = 0; q < R; ++q) {
        const V c = simd::splat<V>(pk[i0 + q]);
        for (int b = 0; b < NB; ++b) {
          const V t = col[b] - c;
          acc[q][b] += t * t;
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const int64_t j = j0 + b * L;
      const V hj = VD::load(s.rho_hi + j), lj = VD::load(s.rho_lo + j), sj = VD::load(s.slack + j);
      const V wj = VD::load(s.w + j), iwj = VD::load(s.inv_w + j);
      for (int q = 0; q < R; ++q) {
        const V g1 = lo[q] - hj, g2 = lj - hi[q];
        V gap = g1 > g2 ? g1 : g2;
        gap = gap > 0.0 ? gap : V{};
        const V sum = hi[q] + hj, e = sl[q] + sj;
        const V u = s.k_hi * acc[q][b] + (1.0 + s.eta) * (sum * sum) + e;
        VD::store(lb + q * m + j, s.k_lo * acc[q][b] + (1.0 - s.eta) * (gap * gap) - e);
        VD::store(ub + q * m + j, u);
        const V single = u + iwj;
        vmin[q] = single < vmin[q] ? single : vmin[q];
        vscw[q] += u * wj;
      }
    }
  }
  for (; j0 < m; ++j0) {  // the tail, column by column
    for (int q = 0; q < R; ++q) {
      double a = 0.0;
      for (int64_t k = 0; k < s.r; ++k) {
        const double t = s.PT[k * m + j0] - s.PT[k * m + i0 + q];
        a += t * t;
      }
      const double gap = std::max(0.0, std::max(lo[q] - s.rho_hi[j0], s.rho_lo[j0] - hi[q]));
      const double sum = hi[q] + s.rho_hi[j0], e = sl[q] + s.slack[j0];
      const double u = s.k_hi * a + (1.0 + s.eta) * (sum * sum) + e;
      lb[q * m + j0] = s.k_lo * a + (1.0 - s.eta) * (gap * gap) - e;
      ub[q * m + j0] = u;
      smin[q] = std::min(smin[q], u + s.inv_w[j0]);
      sscw[q] += u * s.w[j0];
    }
  }
  for (int q = 0; q < R; ++q) {
    double mn = smin[q], scw = sscw[q];
    for (int l = 0; l < L; ++l) mn = std::min(mn, vmin[q][l]), scw += vscw[q][l];
    start[q] = std::min(mn, (1.0 + scw) / s.sum_w);
  }
}

// Bits j of `bits` [ceil(m / 64)] set where lb[j] < level.
inline void below_bits(const double* lb, int64_t m, double level, uint64_t* bits) {
  const int64_t words = (m + 63) / 64;
  std::fill(bits, bits + words, uint64_t(0));
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512d lv = _mm512_set1_pd(level);
  for (; j + 8 <= m; j += 8) {
    const unsigned mask = _mm512_cmp_pd_mask(_mm512_loadu_pd(lb + j), lv, _CMP_LT_OQ);
    bits[j >> 6] |= uint64_t(mask) << (j & 63);
  }
#endif
  for (; j < m; ++j) bits[j >> 6] |= uint64_t(lb[j] < level) << (j & 63);
}

// The indices of the set bits of `bits` [words], ascending, into idx; returns how many.
inline int64_t bit_indices(const uint64_t* bits, int64_t words, int64_t* idx) {
  int64_t n = 0;
  for (int64_t wd = 0; wd < words; ++wd)
    for (uint64_t b = bits[wd]; b; b &= b - 1) idx[n++] = wd * 64 + __builtin_ctzll(b);
  return n;
}

// Phase A for the R rows i0.. (R ≤ kRows): each row's τ_up, candidate bits [words] and
// kNeighbours nearest candidates (by LB, nearest first; −1 past the last), candidate count.
// lb, ub: scratch [kBoundRows][m]; Ac, Aw: [m]; idx: [m].
template <int R>
__attribute__((noinline)) void screen_rows(const Screen& s, int64_t i0, int64_t first, int64_t words, double* lb,
                                           double* ub, double* Ac, double* Aw, int64_t* idx, double* tau_up,
                                           uint64_t* cand, int64_t* near, int64_t* counts) {
  const int64_t m = s.m;
  double start[R];
  bound_rows<R>(s, i0, lb, ub, start);
  for (int q = 0; q < R; ++q) {
    const int64_t i = i0 + q, row = i - first;
    double* u = ub + q * m;
    double* l = lb + q * m;
    u[i] = 0.0;  // the row's own client: cost exactly 0
    l[i] = -1.0;
    const double up = row_level_from<false>(u, s.w, m, start[q], Ac, Aw, nullptr, nullptr) * (1.0 + 1e-9);
    tau_up[row] = up;
    uint64_t* bits = cand + row * words;
    below_bits(l, m, up, bits);
    // the row's kNeighbours nearest candidates by their lower bounds (insertion into a short list)
    const int64_t nc = bit_indices(bits, words, idx);
    double best[kNeighbours];
    int64_t* nb = near + row * kNeighbours;
    int kept = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t j = idx[c];
      const double v = l[j];
      if (j == i || (kept == kNeighbours && !(v < best[kNeighbours - 1]))) continue;
      int at = kept < kNeighbours ? kept++ : kNeighbours - 1;
      while (at > 0 && v < best[at - 1]) {
        best[at] = best[at - 1], nb[at] = nb[at - 1];
        --at;
      }
      best[at] = v, nb[at] = j;
    }
    counts[row] = nc;
  }
}

// Phase B: blocks of up to kRows rows, each unplaced row in order with its nearest unplaced
// candidates (then theirs). Returns the rows in block order; block b is order[start[b] .. start[b + 1]).
inline void form_blocks(int64_t first, int64_t stop, const int64_t* near, std::vector<int64_t>& order,
                        std::vector<int64_t>& start) {
  const int64_t n = stop - first;
  std::vector<char> placed(size_t(n), 0);
  order.clear(), start.clear();
  order.reserve(size_t(n));
  for (int64_t i = first; i < stop; ++i) {
    if (placed[size_t(i - first)]) continue;
    start.push_back(int64_t(order.size()));
    const size_t b = order.size();
    order.push_back(i);
    placed[size_t(i - first)] = 1;
    for (size_t at = b; at < order.size() && order.size() - b < size_t(kRows); ++at) {
      const int64_t* nb = near + (order[at] - first) * kNeighbours;
      for (int q = 0; q < kNeighbours && order.size() - b < size_t(kRows); ++q) {
        const int64_t j = nb[q];
        if (j < first || j >= stop || placed[size_t(j - first)]) continue;
        order.push_back(j);
        placed[size_t(j - first)] = 1;
      }
    }
  }
  start.push_back(int64_t(order.size()));
}

// Phase C's scratch, one per thread.
struct BlockScratch {
  std::vector<float> x32;  // [kRows][d]: the block's rows (float32 costs)
  std::vector<double> x, cost, wc, iwc, Ac, Aw, one, row;
  std::vector<int64_t> U, Ai;
  std::vector<uint64_t> uni;
  BlockScratch(int64_t m, int64_t d, bool low, bool streamed)
      : x32(low ? size_t(kRows * d) : 0), x(low ? 0 : size_t(kRows * d)), cost(size_t(kRows * m)), wc(size_t(m)),
        iwc(size_t(m)), Ac(size_t(m)), Aw(size_t(m)), one(size_t(m)), row(streamed ? size_t(m) : 0, 0.0),
        U(size_t(m)), Ai(size_t(m)), uni(size_t((m + 63) / 64)) {}
};

// dist[c][0 .. R) = the costs of the block's R rows (in scratch) to the C rows y[c] of G.
template <int R, int C, typename T>
inline void block_distances(BlockScratch& b, bool low, const T* const* y, int64_t d, double (*dist)[kRows]) {
  if constexpr (std::is_same_v<T, float>) {
    if (low) return sq_distances32<R, C>(b.x32.data(), y, d, dist);
  }
  for (int c = 0; c < C; ++c) sq_distances<R>(b.x.data(), y[c], d, dist[c]);
}

// Phase C for one block: rows[0 .. R) (R ≤ kRows).
template <int R, typename T>
__attribute__((noinline)) void block_weights(const Screen& s, const T* G, int64_t d, const int64_t* rows,
                                             int64_t first, int64_t words, const uint64_t* cand,
                                             const double* tau_up, bool low, bool streamed, BlockScratch& b,
                                             double* out, double* levels, int64_t* counts) {
  const int64_t m = s.m;
  const size_t M = size_t(m);
  std::fill(b.uni.begin(), b.uni.end(), uint64_t(0));
  for (int q = 0; q < R; ++q) {
    const uint64_t* bits = cand + (rows[q] - first) * words;
    for (int64_t wd = 0; wd < words; ++wd) b.uni[size_t(wd)] |= bits[wd];
    const T* gi = G + rows[q] * d;
    if (low)
      std::memcpy(b.x32.data() + q * d, gi, size_t(d) * sizeof(float));
    else
      for (int64_t k = 0; k < d; ++k) b.x[size_t(q * d + k)] = double(gi[k]);
  }
  const int64_t nu = bit_indices(b.uni.data(), words, b.U.data());
  for (int64_t c = 0; c < nu; c += 2) {  // the union's columns two at a time
    const int C = c + 1 < nu ? 2 : 1;
    for (int e = 0; e < 2; ++e)  // the next pair's rows of G requested ahead
      if (c + 2 + e < nu) prefetch_row(G + b.U[size_t(c + 2 + e)] * d, d);
    const T* y[2] = {G + b.U[size_t(c)] * d, G + b.U[size_t(c + C - 1)] * d};
    double dist[2][kRows];
    if (C == 2)
      block_distances<R, 2>(b, low, y, d, dist);
    else
      block_distances<R, 1>(b, low, y, d, dist);
    for (int e = 0; e < C; ++e) {
      const int64_t j = b.U[size_t(c + e)];
      for (int q = 0; q < R; ++q) b.cost[size_t(q) * M + size_t(c + e)] = j == rows[q] ? 0.0 : dist[e][q];
      b.wc[size_t(c + e)] = s.w[j];
      b.iwc[size_t(c + e)] = s.inv_w[j];
    }
  }
  for (int q = 0; q < R; ++q) {
    const int64_t i = rows[q], ri = i - first;
    const double* cq = b.cost.data() + size_t(q) * M;
    const int64_t* cols = b.U.data();
    const double* wq = b.wc.data();
    int64_t nq = nu, active = -1;
    double tau = row_level<true>(cq, wq, b.iwc.data(), nq, b.Ac.data(), b.Aw.data(), b.Ai.data(), &active);
    if (!(tau <= tau_up[ri])) {  // the bounds did not hold: the row from every column
      for (int64_t j = 0; j < m; ++j) {
        double dj[1][kRows];
        if (low) {
          const float* yj = reinterpret_cast<const float*>(G + j * d);
          sq_distances32<1, 1>(b.x32.data() + q * d, &yj, d, dj);
        } else {
          sq_distances<1>(b.x.data() + q * d, G + j * d, d, dj[0]);
        }
        b.one[size_t(j)] = dj[0][0];
      }
      b.one[size_t(i)] = 0.0;
      cq = b.one.data(), wq = s.w, nq = m, cols = nullptr;
      tau = row_level<true>(cq, wq, s.inv_w, nq, b.Ac.data(), b.Aw.data(), b.Ai.data(), &active);
      counts[ri] = -1;
    }
    if (active > 0) {  // τ from the active columns alone, in index order (see above)
      double sw = 0.0, scw = 0.0;
      keep_below<false>(b.Ac.data(), b.Aw.data(), nullptr, active, std::numeric_limits<double>::infinity(),
                        b.Ac.data(), b.Aw.data(), nullptr, &sw, &scw);
      tau = (1.0 + scw) / sw;
    }
    double* o = out + ri * m;
    double* dst = streamed ? b.row.data() : o;
    if (!streamed) std::fill(o, o + m, 0.0);
    auto col = [&](int64_t c) { return cols ? cols[c] : c; };
    if (active > 0) {
      for (int64_t a = 0; a < active; ++a)
        dst[col(b.Ai[size_t(a)])] = b.Aw[size_t(a)] * std::max(0.0, tau - b.Ac[size_t(a)]);
    } else {
      for (int64_t c = 0; c < nq; ++c) dst[col(c)] = wq[c] * std::max(0.0, tau - cq[c]);
    }
    if (streamed) {
      stream_row(b.row.data(), o, m);
      if (active > 0)
        for (int64_t a = 0; a < active; ++a) b.row[size_t(col(b.Ai[size_t(a)]))] = 0.0;
      else
        for (int64_t c = 0; c < nq; ++c) b.row[size_t(col(c))] = 0.0;
    }
    levels[ri] = tau;
  }
}

}  // namespace

template <typename T>
bool water_fill_screened(const T* G, int64_t m, int64_t d, const double* PT, int64_t r, const double* rho_lo,
                         const double* rho_hi, const double* slack, double k_lo, double k_hi, double eta,
                         const double* w, int64_t first, int64_t stop, bool f64_costs, int64_t max_candidates,
                         double* out, double* levels, int64_t* counts, Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, m, inv_w, faults)) return true;
  const int64_t n = stop - first;
  if (n <= 0) return true;
  double sum_w = 0.0;
  for (int64_t j = 0; j < m; ++j) sum_w += w[j];
  const Screen s{PT, r, m, rho_lo, rho_hi, slack, w, inv_w.data(), k_lo, k_hi, eta, sum_w};
  const int64_t words = (m + 63) / 64;
  const size_t M = static_cast<size_t>(m);
  std::vector<uint64_t> cand(static_cast<size_t>(n * words));  // [n][words]: the rows' candidates
  std::vector<double> tau_up(static_cast<size_t>(n));
  std::vector<int64_t> near(static_cast<size_t>(n * kNeighbours), -1);  // [n][kNeighbours], nearest first
  const bool parallel = n * m > (1 << 15);

  // A. bounds, upper levels, candidates and nearest candidates, kBoundRows rows at a time
#pragma omp parallel if (parallel)
  {
    std::vector<double> lb(kBoundRows * M), ub(kBoundRows * M), Ac(M), Aw(M);
    std::vector<int64_t> idx(M);
#pragma omp for schedule(dynamic, 2)
    for (int64_t b0 = first; b0 < stop; b0 += kBoundRows) {
      const int R = int(std::min<int64_t>(kBoundRows, stop - b0));
      auto run = [&](auto rows) {
        screen_rows<decltype(rows)::value>(s, b0, first, words, lb.data(), ub.data(), Ac.data(), Aw.data(),
                                           idx.data(), tau_up.data(), cand.data(), near.data(), counts);
      };
      switch (R) {
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
    }
  }

  int64_t total = 0;
  for (int64_t q = 0; q < n; ++q) total += counts[q];
  if (total > max_candidates) return false;  // a screen this loose: the caller's other method
  // B. the blocks
  std::vector<int64_t> order, start;
  form_blocks(first, stop, near.data(), order, start);
  const int64_t blocks = int64_t(start.size()) - 1;

  // C. the blocks' costs and weights
  const bool streamed = m >= kStreamedRow;
  const bool low = std::is_same_v<T, float> && !f64_costs;  // float32 differences
#pragma omp parallel if (parallel)
  {
    BlockScratch b(m, d, low, streamed);
#pragma omp for schedule(dynamic, 1)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t* rows = order.data() + start[size_t(blk)];
      const int R = int(start[size_t(blk) + 1] - start[size_t(blk)]);
      auto run = [&](auto nr) {
        block_weights<decltype(nr)::value>(s, G, d, rows, first, words, cand.data(), tau_up.data(), low, streamed, b,
                                           out, levels, counts);
      };
      switch (R) {
        case 8: run(std::integral_constant<int, 8>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
    }
#if defined(__AVX__)
    if (streamed) _mm_sfence();  // the streamed rows visible before the threads join
#endif
  }
  return true;
}

template bool water_fill_screened<float>(const float*, int64_t, int64_t, const double*, int64_t, const double*,
                                         const double*, const double*, double, double, double, const double*, int64_t,
                                         int64_t, bool, int64_t, double*, double*, int64_t*, Faults&);
template bool water_fill_screened<double>(const double*, int64_t, int64_t, const double*, int64_t, const double*,
                                          const double*, const double*, double, double, double, const double*,
                                          int64_t, int64_t, bool, int64_t, double*, double*, int64_t*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
