// PERM's weights of rows first..stop (pflcore/algorithms/_perm_principal.py) where the caller's
// bounds LB_ij ≤ c_ij ≤ UB_ij of every cost c_ij = ‖g_i − g_j‖² decide which costs are computed.
// The bounds come from the rows' coordinates p_i on a few principal directions and the norms ρ_i
// of their residuals (known to within [ρlo_i, ρhi_i]):
//   A_ij = ‖p_i − p_j‖²,  gap = max(0, ρlo_i − ρhi_j, ρlo_j − ρhi_i)
//   LB_ij = k_lo·A_ij + (1 − η)·gap² − (slack_i + slack_j)
//   UB_ij = k_hi·A_ij + (1 + η)·(ρhi_i + ρhi_j)² + (slack_i + slack_j),   UB_ii = 0
// (k_lo, k_hi, η and the slacks hold the basis' departure from orthonormality and the rounding of
// the coordinates; _perm_principal.bounds derives them). The bounds are evaluated in float32 on
// inputs scaled by powers of 2 (coordinates at most ~1), with the coefficients moved toward safety
// by more than that arithmetic's rounding and a 2^-100 floor for what underflows.
//
// A. Per row: LB and UB against every column; τ_up = the level of the UB costs (costs at least the
//    true ones: a level at least τ_i), rounded up — from the level of a sample of the columns (at
//    least the level of all), then Michelot's iteration over the columns below it; the candidates
//    j with LB_ij < τ_up, as a bit set (every column with c_ij < τ_i is among them); and a few of
//    them, evenly spaced (any candidate is near the row).
// B. Blocks of up to kRows rows that are each other's candidates (their candidate sets overlap
//    most), formed one after another in row order.
// C. Per block: the union of its rows' candidates, each union column's row of G read once for the
//    block's rows, two columns at a time: c_ij = Σ_k (g_ik − g_jk)², float64 differences of the
//    gradients as given, or float32 ones for float32 gradients (unless f64_costs); each row's level
//    over the union (a superset of its candidates: the other columns hold 0 at τ_i).
//
// τ_i's sums are taken again over its active columns alone, in index order, and a cost's bits do
// not depend on the block it was computed in: the bounds, which come from BLAS products whose bits
// may depend on the thread count, decide only which columns are computed, not the weights. A row
// whose level exceeds its τ_up (bounds that did not hold: never, with the caller's error terms) is
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
constexpr int kNeighbours = 16;  // candidates kept per row, from which the blocks are formed
// vectors of columns per pass of the bounds: kBoundRows × kBoundVecs accumulators in registers
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

// Phase A's inputs, in float32 and scaled by the caller so that the coordinates are at most ~1
// (PT, ρ by 2^-k, the slacks and the costs of the bounds by 2^-2k): 16 lanes a vector, no
// overflow or underflow of squares that matter (a 2^-100 floor covers what underflows).
struct Screen {
  const float* PT;  // [r, m]
  int64_t r, m;
  const float *rho_lo, *rho_hi, *slack;  // [m]
  const double* w;                       // [m]: the weights in the bounds' units (w / cost_scale)
  const double *wr, *inv_wr;             // [m]: the weights and their inverses (phase C)
  float k_lo, k_hi, e_lo, e_hi;          // the coefficients, rounded toward safety (see water_fill_screened)
};

using VFs = simd::Vec<float>;
using Fv = VFs::V;
constexpr int LF = VFs::L;
constexpr float kFloor = 0x1p-100f;  // absolute margin of the float32 bounds (underflow)

// Phase A's bounds for the R rows i0.. against every column: lb, ub [R][m] (float32).
template <int R>
void bound_rows(const Screen& s, int64_t i0, float* lb, float* ub) {
  const int64_t m = s.m;
  constexpr int NB = kBoundVecs, C = NB * LF;
  float lo[R], hi[R], sl[R];
  for (int q = 0; q < R; ++q) lo[q] = s.rho_lo[i0 + q], hi[q] = s.rho_hi[i0 + q], sl[q] = s.slack[i0 + q];
  int64_t j0 = 0;
  for (; j0 + C <= m; j0 += C) {
    Fv acc[R][NB] = {};
    for (int64_t k = 0; k < s.r; ++k) {
      const float* pk = s.PT + k * m;
      Fv col[NB];
      for (int b = 0; b < NB; ++b) col[b] = VFs::load(pk + j0 + b * LF);
      for (int q = 0; q < R; ++q) {
        const Fv c = simd::splat<Fv>(pk[i0 + q]);
        for (int b = 0; b < NB; ++b) {
          const Fv t = col[b] - c;
          acc[q][b] += t * t;
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const int64_t j = j0 + b * LF;
      const Fv hj = VFs::load(s.rho_hi + j), lj = VFs::load(s.rho_lo + j), sj = VFs::load(s.slack + j);
      for (int q = 0; q < R; ++q) {
        const Fv g1 = lo[q] - hj, g2 = lj - hi[q];
        Fv gap = g1 > g2 ? g1 : g2;
        gap = gap > 0.0f ? gap : Fv{};
        const Fv sum = hi[q] + hj, e = sl[q] + sj;
        VFs::store(lb + q * m + j, (s.k_lo * acc[q][b] + s.e_lo * (gap * gap)) - (e + kFloor));
        VFs::store(ub + q * m + j, (s.k_hi * acc[q][b] + s.e_hi * (sum * sum)) + (e + kFloor));
      }
    }
  }
  for (; j0 < m; ++j0) {  // the tail, column by column
    for (int q = 0; q < R; ++q) {
      float a = 0.0f;
      for (int64_t k = 0; k < s.r; ++k) {
        const float t = s.PT[k * m + j0] - s.PT[k * m + i0 + q];
        a += t * t;
      }
      const float gap = std::max(0.0f, std::max(lo[q] - s.rho_hi[j0], s.rho_lo[j0] - hi[q]));
      const float sum = hi[q] + s.rho_hi[j0], e = sl[q] + s.slack[j0];
      lb[q * m + j0] = (s.k_lo * a + s.e_lo * (gap * gap)) - (e + kFloor);
      ub[q * m + j0] = (s.k_hi * a + s.e_hi * (sum * sum)) + (e + kFloor);
    }
  }
}

// The entries of (c [n] float32, w [n]) below tau, widened, at the front of (Ac, Aw); returns how
// many. (The start of Michelot's iteration over a row's upper bounds.)
inline int64_t below_f32(const float* c, const double* w, int64_t n, double tau, double* Ac, double* Aw) {
  int64_t kept = 0, j = 0;
#if defined(__AVX512F__)
  const __m512d level = _mm512_set1_pd(tau);
  for (; j + 8 <= n; j += 8) {
    const __m512d cv = _mm512_cvtps_pd(_mm256_loadu_ps(c + j));
    const __mmask8 keep = _mm512_cmp_pd_mask(cv, level, _CMP_LT_OQ);
    const int count = __builtin_popcount(unsigned(keep));
    const __mmask8 front = __mmask8((1u << count) - 1u);
    _mm512_mask_storeu_pd(Ac + kept, front, _mm512_maskz_compress_pd(keep, cv));
    _mm512_mask_storeu_pd(Aw + kept, front, _mm512_maskz_compress_pd(keep, _mm512_loadu_pd(w + j)));
    kept += count;
  }
#endif
  for (; j < n; ++j) {
    const double cj = c[j];
    Ac[kept] = cj;
    Aw[kept] = w[j];
    kept += cj < tau;
  }
  return kept;
}

// Bits j of `bits` [ceil(m / 64)] set where lb[j] < level.
inline void below_bits(const float* lb, int64_t m, float level, uint64_t* bits) {
  const int64_t words = (m + 63) / 64;
  std::fill(bits, bits + words, uint64_t(0));
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lv = _mm512_set1_ps(level);
  for (; j + 16 <= m; j += 16) {
    const unsigned mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(lb + j), lv, _CMP_LT_OQ);
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

// Phase A for the R rows i0.. (R ≤ kBoundRows): each row's τ_up (in the costs' units), candidate
// bits [words], kNeighbours of its candidates (−1 past the last) and
// candidate count. lb, ub: scratch [kBoundRows][m]; Sc, Sw, Ac, Aw: [m]; idx: [m].
// The level of a row's upper bounds: first that of a sample of its columns (every kSampleStride-th
// and its own), which is at least the level of all (a subset's level is); then Michelot's
// iteration from there over every column below it (~260 of 2,000 at m = 2,000 once FedAvg has run
// a while, where the best single column's level kept ~1,200).
constexpr int64_t kSampleStride = 8;

template <int R>
__attribute__((noinline)) void screen_rows(const Screen& s, double cost_scale, int64_t i0, int64_t first,
                                           int64_t words, float* lb, float* ub, double* Sc, double* Sw, double* Ac,
                                           double* Aw, int64_t* idx, double* tau_up, uint64_t* cand, int64_t* near,
                                           int64_t* counts) {
  const int64_t m = s.m;
  bound_rows<R>(s, i0, lb, ub);
  for (int q = 0; q < R; ++q) {
    const int64_t i = i0 + q, row = i - first;
    float* u = ub + q * m;
    float* l = lb + q * m;
    u[i] = 0.0f;  // the row's own client: cost exactly 0
    l[i] = -1.0f;
    // the sample's level (its own column first), then every column below it
    // (from the own column's level, 1/w_i at cost 0: the level of a subset of the sample)
    int64_t ns = 0;
    Sc[ns] = 0.0, Sw[ns] = s.w[i], ++ns;
    for (int64_t j = i % kSampleStride; j < m; j += kSampleStride)
      if (j != i) Sc[ns] = u[j], Sw[ns] = s.w[j], ++ns;
    double tau = row_level_from<false>(Sc, Sw, ns, 1.0 / s.w[i], Ac, Aw, nullptr, nullptr);
    const int64_t n0 = below_f32(u, s.w, m, tau, Sc, Sw);
    const double up = row_level_from<false>(Sc, Sw, n0, tau, Ac, Aw, nullptr, nullptr) * (1.0 + 1e-9);
    tau_up[row] = up / cost_scale;
    uint64_t* bits = cand + row * words;
    below_bits(l, m, std::nextafter(float(up), std::numeric_limits<float>::infinity()), bits);
    // kNeighbours of the row's candidates, evenly spaced in index order (any candidate is near: its
    // lower bound is below the row's level), for the blocks of phase B
    const int64_t nc = bit_indices(bits, words, idx);
    int64_t* nb = near + row * kNeighbours;
    int kept = 0;
    const int64_t step = std::max<int64_t>(1, nc / kNeighbours);
    for (int64_t c = 0; c < nc && kept < kNeighbours; c += step)
      if (idx[c] != i) nb[kept++] = idx[c];
    counts[row] = nc;
  }
}

// Phase B: blocks of up to kRows rows, each unplaced row in order with its unplaced kept
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
                                             const double* tau_up, bool low, BlockScratch& b,
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
    const T* y[2] = {G + b.U[size_t(c)] * d, G + b.U[size_t(c + C - 1)] * d};
    double dist[2][kRows];
    if (C == 2)
      block_distances<R, 2>(b, low, y, d, dist);
    else
      block_distances<R, 1>(b, low, y, d, dist);
    for (int e = 0; e < C; ++e) {
      const int64_t j = b.U[size_t(c + e)];
      for (int q = 0; q < R; ++q) b.cost[size_t(q) * M + size_t(c + e)] = j == rows[q] ? 0.0 : dist[e][q];
      b.wc[size_t(c + e)] = s.wr[j];
      b.iwc[size_t(c + e)] = s.inv_wr[j];
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
      cq = b.one.data(), wq = s.wr, nq = m, cols = nullptr;
      tau = row_level<true>(cq, wq, s.inv_wr, nq, b.Ac.data(), b.Aw.data(), b.Ai.data(), &active);
      counts[ri] = -1;
    }
    if (active > 0) {  // τ from the active columns alone, in index order (see above)
      double sw = 0.0, scw = 0.0;
      keep_below<false>(b.Ac.data(), b.Aw.data(), nullptr, active, std::numeric_limits<double>::infinity(),
                        b.Ac.data(), b.Aw.data(), nullptr, &sw, &scw);
      tau = (1.0 + scw) / sw;
    }
    double* o = out + ri * m;
    auto col = [&](int64_t c) { return cols ? cols[c] : c; };
    if (active > 0)
      write_whole_row(o, m, b.row.data(), active, b.Ac.data(), b.Aw.data(), tau,
                      [&](int64_t a) { return col(b.Ai[size_t(a)]); });
    else
      write_whole_row(o, m, b.row.data(), nq, cq, wq, tau, col);
    levels[ri] = tau;
  }
}

}  // namespace

template <typename T>
bool water_fill_screened(const T* G, int64_t m, int64_t d, const float* PT, int64_t r, const float* rho_lo,
                         const float* rho_hi, const float* slack, double k_lo, double k_hi, double eta,
                         double cost_scale, const double* w, int64_t first, int64_t stop, bool f64_costs,
                         int64_t max_candidates, double* out, double* levels, int64_t* counts, Faults& faults) {
  std::vector<double> inv_w;
  if (!inverse_weights(w, m, inv_w, faults)) return true;
  const int64_t n = stop - first;
  if (n <= 0) return true;
  // the weights in the bounds' units; the coefficients in float32, each moved toward safety by a
  // margin over the rounding of the float32 arithmetic of the bounds ((r + 16)·2^-23 relatively:
  // A's r squares and sums, the products and sums after it)
  std::vector<double> wb(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) wb[size_t(j)] = w[j] / cost_scale;
  const double margin = double(r + 16) * 0x1p-23;
  auto down = [](double x) { const float f = float(x); return double(f) <= x ? f : std::nextafter(f, -INFINITY); };
  auto up = [](double x) { const float f = float(x); return double(f) >= x ? f : std::nextafter(f, INFINITY); };
  const Screen s{PT, r, m, rho_lo, rho_hi, slack, wb.data(), w, inv_w.data(), down(k_lo * (1.0 - margin)),
                 up(k_hi * (1.0 + margin)), down((1.0 - eta) * (1.0 - margin)), up((1.0 + eta) * (1.0 + margin))};
  const int64_t words = (m + 63) / 64;
  const size_t M = static_cast<size_t>(m);
  std::vector<uint64_t> cand(static_cast<size_t>(n * words));  // [n][words]: the rows' candidates
  std::vector<double> tau_up(static_cast<size_t>(n));
  std::vector<int64_t> near(static_cast<size_t>(n * kNeighbours), -1);  // [n][kNeighbours]
  const bool parallel = n * m > (1 << 15);

  // A. bounds, upper levels, candidates and a few of them, kBoundRows rows at a time
#pragma omp parallel if (parallel)
  {
    std::vector<float> lb(kBoundRows * M), ub(kBoundRows * M);
    std::vector<double> Sc(M + 1), Sw(M + 1), Ac(M + 1), Aw(M + 1);
    std::vector<int64_t> idx(M);
#pragma omp for schedule(dynamic, 2)
    for (int64_t b0 = first; b0 < stop; b0 += kBoundRows) {
      const int R = int(std::min<int64_t>(kBoundRows, stop - b0));
      auto run = [&](auto rows) {
        screen_rows<decltype(rows)::value>(s, cost_scale, b0, first, words, lb.data(), ub.data(), Sc.data(),
                                           Sw.data(), Ac.data(), Aw.data(), idx.data(), tau_up.data(), cand.data(),
                                           near.data(), counts);
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
        block_weights<decltype(nr)::value>(s, G, d, rows, first, words, cand.data(), tau_up.data(), low, b, out,
                                           levels, counts);
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

template bool water_fill_screened<float>(const float*, int64_t, int64_t, const float*, int64_t, const float*,
                                         const float*, const float*, double, double, double, double, const double*,
                                         int64_t, int64_t, bool, int64_t, double*, double*, int64_t*, Faults&);
template bool water_fill_screened<double>(const double*, int64_t, int64_t, const float*, int64_t, const float*,
                                          const float*, const float*, double, double, double, double, const double*,
                                          int64_t, int64_t, bool, int64_t, double*, double*, int64_t*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
