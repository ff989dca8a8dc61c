// The water level of one row of PERM's costs and the helpers around it, shared by the kernels
// of water_fill.cpp (every cost given, or from a Gram block) and water_fill_screened.cpp (costs
// computed for a screen's candidates). The level by Michelot's iteration: see water_fill.cpp.
// Included inside nothing: it opens the level's namespace itself, so each level compiles its own
// copy (anonymous namespace: each file its own).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

// Keeps the entries of (c, w) [n] with c < tau, in order, at the front of (Ac, Aw), and their
// indices (idx[q], or q where idx is null) in Ai when kIdx; returns how many, and the sums of the
// kept w and c·w in *sw, *scw (the next level's sums: Michelot's iteration needs no separate pass
// over the set it keeps; fixed order: 8 partial sums by position mod 8, then the tail). Also in
// place (c, w, idx the destinations): an entry is written at or before where it was read. Every
// entry is written and the count advances where it is kept (no branch on the data: near half of
// the entries stay in the first passes, so a branch mispredicts often; with branches the kernel
// ran ~9 ns an entry at m = 2,000). 512-bit vectors compress 8 entries at a time (compress in
// registers, then a masked store: compress straight to memory is slow on Zen 4).
template <bool kIdx>
inline int64_t keep_below(const double* c, const double* w, const int64_t* idx, int64_t n, double tau, double* Ac,
                          double* Aw, int64_t* Ai, double* sw, double* scw) {
  int64_t kept = 0, q = 0;
  double s = 0.0, t = 0.0;
#if defined(__AVX512F__)
  const __m512d level = _mm512_set1_pd(tau);
  const __m512i iota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  __m512d sv = _mm512_setzero_pd(), tv = _mm512_setzero_pd();
  for (; q + 8 <= n; q += 8) {
    const __m512d cv = _mm512_loadu_pd(c + q), wv = _mm512_loadu_pd(w + q);
    const __mmask8 keep = _mm512_cmp_pd_mask(cv, level, _CMP_LT_OQ);
    const int count = __builtin_popcount(unsigned(keep));
    const __mmask8 front = __mmask8((1u << count) - 1u);
    if constexpr (kIdx) {
      const __m512i iv = idx ? _mm512_loadu_si512(idx + q) : _mm512_add_epi64(iota, _mm512_set1_epi64(q));
      _mm512_mask_storeu_epi64(Ai + kept, front, _mm512_maskz_compress_epi64(keep, iv));
    }
    _mm512_mask_storeu_pd(Ac + kept, front, _mm512_maskz_compress_pd(keep, cv));
    _mm512_mask_storeu_pd(Aw + kept, front, _mm512_maskz_compress_pd(keep, wv));
    sv = _mm512_mask_add_pd(sv, keep, sv, wv);
    tv = _mm512_mask_add_pd(tv, keep, tv, _mm512_mul_pd(cv, wv));
    kept += count;
  }
  alignas(64) double sl[8], tl[8];
  _mm512_store_pd(sl, sv);
  _mm512_store_pd(tl, tv);
  s = ((sl[0] + sl[1]) + (sl[2] + sl[3])) + ((sl[4] + sl[5]) + (sl[6] + sl[7]));
  t = ((tl[0] + tl[1]) + (tl[2] + tl[3])) + ((tl[4] + tl[5]) + (tl[6] + tl[7]));
#endif
  // (the portable path: four partial sums by position mod 4, each entry added as 0 where dropped)
  double s4[4] = {0.0, 0.0, 0.0, 0.0}, t4[4] = {0.0, 0.0, 0.0, 0.0};
  for (; q < n; ++q) {
    const double cq = c[q], wq = w[q];
    int64_t iq = 0;
    if constexpr (kIdx) iq = idx ? idx[q] : q;
    Ac[kept] = cq;
    Aw[kept] = wq;
    if constexpr (kIdx) Ai[kept] = iq;
    const bool in = cq < tau;
    s4[q & 3] += in ? wq : 0.0;
    t4[q & 3] += in ? cq * wq : 0.0;
    kept += in;
  }
  *sw = s + ((s4[0] + s4[1]) + (s4[2] + s4[3]));
  *scw = t + ((t4[0] + t4[1]) + (t4[2] + t4[3]));
  return kept;
}

// row_level from a start τ that bounds the level from above (a subset's level, or g of a
// superset of the active set): Michelot's passes from A = {j : c_j < τ}.
template <bool kIdx>
inline double row_level_from(const double* c, const double* w, int64_t k, double tau, double* Ac, double* Aw,
                             int64_t* Ai, int64_t* active) {
  double s = 0.0, t = 0.0;  // the kept entries' Σw and Σc·w
  int64_t n = keep_below<kIdx>(c, w, nullptr, k, tau, Ac, Aw, Ai, &s, &t);
  bool exact_set = true;
  for (;;) {
    const double next = (1.0 + t) / s;
    double s_kept = 0.0, t_kept = 0.0;
    const int64_t kept = keep_below<kIdx>(Ac, Aw, Ai, n, next, Ac, Aw, Ai, &s_kept, &t_kept);
    // no entry below the new level: only rounding does that (a set of one column, whose level
    // c_j + 1/w_j rounds to c_j): keep the last level, which has entries below it
    if (kept == 0) {
      exact_set = false;  // (the pass overwrote the set)
      break;
    }
    if (next > tau) exact_set = false;  // a column dropped at a higher level could be below this one
    tau = next;
    if (kept == n) break;
    n = kept, s = s_kept, t = t_kept;
  }
  if constexpr (kIdx) *active = exact_set ? n : -1;
  return tau;
}

// The level τ of one row of finite costs c [k] (Michelot's iteration, above); Ac, Aw and Ai:
// scratch of k entries each (Ai only with kIdx). With kIdx, *active is the number of columns with
// c_j < τ, held at the front of (Ac, Aw, Ai) with their indices, or −1 where the iteration ended
// otherwise (rounding: a level that rose, or a set emptied by the last pass) and the row's weights
// must be taken from every column.
template <bool kIdx>
inline double row_level(const double* c, const double* w, const double* inv_w, int64_t k, double* Ac, double* Aw,
                        int64_t* Ai, int64_t* active) {
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
  return row_level_from<kIdx>(c, w, k, tau, Ac, Aw, Ai, active);
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
inline bool inverse_weights(const double* w, int64_t k, std::vector<double>& inv_w, Faults& faults) {
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

// Rows of at least this many entries (an [m, m] output of 8 MB and more) are written by stream_row.
constexpr int64_t kStreamedRow = 1024;

// dst[0 .. n) = src[0 .. n) by non-temporal stores where dst is 64-byte aligned (plain stores for
// the unaligned head and the tail): an output row written once and read later by another pass
// does not evict the working set on its way out, and its lines are not read first.
inline void stream_row(const double* src, double* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j) dst[j] = src[j];
  for (; j + 8 <= n; j += 8) _mm512_stream_pd(dst + j, _mm512_loadu_pd(src + j));
#elif defined(__AVX__)
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 31) != 0; ++j) dst[j] = src[j];
  for (; j + 4 <= n; j += 4) _mm256_stream_pd(dst + j, _mm256_loadu_pd(src + j));
#endif
  for (; j < n; ++j) dst[j] = src[j];
}

// One output row o [m] written whole: w_a·max(0, τ − c_a) at column at(a) for a < n, 0 elsewhere.
// A row of kStreamedRow entries and more is composed in `scratch` (the thread's zeroed row of m
// entries, zeroed again after) and streamed out, so that its lines are neither read first nor
// left in the caches; a shorter one is cleared and written in place (`scratch` unused).
template <typename At>
inline void write_whole_row(double* o, int64_t m, double* scratch, int64_t n, const double* c, const double* w,
                            double tau, At at) {
  const bool streamed = m >= kStreamedRow;
  double* dst = streamed ? scratch : o;
  if (!streamed) std::fill(o, o + m, 0.0);
  for (int64_t a = 0; a < n; ++a) dst[at(a)] = w[a] * std::max(0.0, tau - c[a]);  // (no branch on the data)
  if (streamed) {
    stream_row(scratch, o, m);
    for (int64_t a = 0; a < n; ++a) scratch[at(a)] = 0.0;
  }
}

}  // namespace

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
