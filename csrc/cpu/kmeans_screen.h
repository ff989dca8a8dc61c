// The k-means assignment of a range of points, shared by kmeans_assign and the Lloyd loop
// (kmeans.cpp; included there only, inside the level's namespace, so each level compiles its
// own copy with its own vector width).
//
// Two stages, exact in the end:
//  1. a screen with ‖c‖² − 2x·c (‖x‖² is the same for every centroid of a point), the dot products
//     of a tile of P points with every centroid in a register-blocked micro-kernel: the
//     centroids packed transposed ([d][Kpad], Kpad a multiple of the vector width), one vector
//     of centroids times one broadcast coordinate of a point per FMA, P × NV accumulators held
//     in registers (the GEMM micro-kernel pattern);
//  2. the direct Σ(x − c)² (sqdist_direct, the one function through which every returned
//     distance goes) for each centroid the screen cannot rule out: usually one. The bound is
//     rigorous for both the screen's rounding and the direct sums', so the label is the first
//     minimum of the direct distances over all K: that of the direct computation, ties to the
//     lowest index, as in the torch reference.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "pflcore/aligned.h"
#include "pflcore/checks.h"
#include "lane_sums.h"
#include "simd.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace kmeans_detail {

// The vector width of this level (bytes) and how many vector registers the micro-kernel may
// fill (simd.h). The avx512 level compiles the k-means sources with 512-bit vectors (CMakeLists.txt).
constexpr int kVecBytes = simd::kBytes, kVecRegs = simd::kRegs;

// The per-point helpers are forced inline: GCC kept sqdist_direct out of line in the assignment
// (a call per point; 18% of kmeans_assign's samples at K = 10, d = 60 on the avx512 level).
#if defined(__GNUC__)
#define PFLCORE_KM_INLINE inline __attribute__((always_inline))
#else
#define PFLCORE_KM_INLINE inline
#endif

template <typename T>
struct VecOf {
  typedef T type __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int kLanes = kVecBytes / int(sizeof(T));

// Largest centroid block (vectors) of a tile, and the points of a tile for a block of NV
// vectors: P·NV accumulators + NV centroid vectors + 1 broadcast fit the registers, and P·NV
// >= 8 keeps two FMA pipes of latency 4 busy. Each of a tile's P rows is read through its own
// pointer: at P = 12 GCC kept some of them in vector registers and on the stack and moved one
// back before each FMA; 8 pointers stay in general registers (AMD Zen 4, one thread, float32:
// kmeans_assign at 10,000 x 610, K = 16, 3.8-4.2 -> 3.3-3.9 ms; K = 32 5.8-6.0 -> 5.4-5.6 ms;
// Lloyd x10 at 10,000 x 610, K = 16, 46.7-47.4 -> 41.9-43.7 ms).
constexpr int kMaxNV = kVecRegs >= 32 ? 4 : 2;
// The single-candidate test looks at up to this many vectors of screens (K up to 4 vectors).
constexpr int kMaxCandidateWords = 4;
constexpr int points_for(int nv) {
  return kVecRegs >= 32 ? (nv <= 3 ? 8 : 6) : (nv == 1 ? 8 : 6);
}

template <typename T>
inline Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes [Off, Off + N) of v as an N-lane vector, in registers (__builtin_shufflevector): the
// memcpy of halves this replaces kept its argument in memory (GCC spilled ‖x‖²'s accumulator to
// the stack inside the dot-product loop, and every reduction went through a store and reloads).
template <int Off, typename V, std::size_t... I>
inline auto lanes_of(const V& v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (Off + int(I))...);
}

// v folded by halves down to 16 bytes, each step op(lower half, upper half), in registers.
template <typename T, typename Op>
inline auto fold_to_16(const Vec<T>& v, Op op) {
  constexpr int L = kLanes<T>, L16 = int(16 / sizeof(T));
  if constexpr (kVecBytes == 64) {
    const auto q = op(lanes_of<0>(v, std::make_index_sequence<L / 2>{}), lanes_of<L / 2>(v, std::make_index_sequence<L / 2>{}));
    return op(lanes_of<0>(q, std::make_index_sequence<L16>{}), lanes_of<L16>(q, std::make_index_sequence<L16>{}));
  } else if constexpr (kVecBytes == 32) {
    return op(lanes_of<0>(v, std::make_index_sequence<L16>{}), lanes_of<L16>(v, std::make_index_sequence<L16>{}));
  } else {
    return v;
  }
}

// Σ of the lanes, by halves (the upper half added onto the lower) down to 16 bytes, then in order.
template <typename T>
inline T hsum(const Vec<T>& v) {
  const auto h = fold_to_16<T>(v, [](auto lo, auto hi) { return lo + hi; });
  T s = h[0];
  for (int l = 1; l < int(16 / sizeof(T)); ++l) s += h[l];
  return s;
}

// The smallest lane, by halves down to 16 bytes, then in order (a chain of log2 steps: the
// lane-by-lane loop was a chain of 15 dependent compares at 16 floats). A NaN lane may or may
// not win here; the callers treat a non-finite minimum, and every overflow that could make one,
// by computing every distance directly.
template <typename T>
inline T hmin(const Vec<T>& v) {
  const auto h = fold_to_16<T>(v, [](auto lo, auto hi) { return hi < lo ? hi : lo; });
  T s = h[0];
  for (int l = 1; l < int(16 / sizeof(T)); ++l) s = h[l] < s ? h[l] : s;
  return s;
}

// Bit l set where v[l] <= lim.
template <typename T>
inline uint32_t lanes_at_most(const Vec<T>& v, T lim) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    __m512 a;
    std::memcpy(&a, &v, sizeof a);
    return _mm512_cmp_ps_mask(a, _mm512_set1_ps(lim), _CMP_LE_OQ);
  } else {
    __m512d a;
    std::memcpy(&a, &v, sizeof a);
    return _mm512_cmp_pd_mask(a, _mm512_set1_pd(lim), _CMP_LE_OQ);
  }
#elif defined(__AVX__)
  if constexpr (sizeof(T) == 4) {
    __m256 a;
    std::memcpy(&a, &v, sizeof a);
    return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(lim), _CMP_LE_OQ)));
  } else {
    __m256d a;
    std::memcpy(&a, &v, sizeof a);
    return uint32_t(_mm256_movemask_pd(_mm256_cmp_pd(a, _mm256_set1_pd(lim), _CMP_LE_OQ)));
  }
#elif defined(__SSE2__)
  if constexpr (sizeof(T) == 4) {
    __m128 a;
    std::memcpy(&a, &v, sizeof a);
    return uint32_t(_mm_movemask_ps(_mm_cmple_ps(a, _mm_set1_ps(lim))));
  } else {
    __m128d a;
    std::memcpy(&a, &v, sizeof a);
    return uint32_t(_mm_movemask_pd(_mm_cmple_pd(a, _mm_set1_pd(lim))));
  }
#else
  uint32_t bits = 0;
  for (int l = 0; l < kLanes<T>; ++l) bits |= uint32_t(v[l] <= lim) << l;
  return bits;
#endif
}

// values + r, loaded as a vector: lanes l >= L − r are 1, the others 0 (the last r of L values).
template <typename T>
struct TailMask {
  static constexpr int L = kLanes<T>;
  static constexpr auto make = [](auto one) {
    std::array<decltype(one), 2 * L> v{};
    for (int i = L; i < 2 * L; ++i) v[size_t(i)] = one;
    return v;
  };
  alignas(64) static inline const std::array<T, 2 * L> values_ = make(T(1));
  static inline const T* const values = values_.data();
};

// The direct squared distance; every exact distance goes through this one function (two
// vector accumulators, then the tail in order).
template <typename T>
PFLCORE_KM_INLINE T sqdist_direct(const T* __restrict__ x, const T* __restrict__ c, int64_t d) {
  constexpr int L = kLanes<T>;
  Vec<T> a0{}, a1{};
  int64_t j = 0;
  for (; j + 2 * L <= d; j += 2 * L) {
    const Vec<T> e0 = load(x + j) - load(c + j), e1 = load(x + j + L) - load(c + j + L);
    a0 += e0 * e0;
    a1 += e1 * e1;
  }
  if (j + L <= d) {
    const Vec<T> e0 = load(x + j) - load(c + j);
    a0 += e0 * e0;
    j += L;
  }
  if (j < d && d >= L) {  // the tail: the last L values, those already counted masked out
    const int64_t t = d - L;
    const Vec<T> e1 = (load(x + t) - load(c + t)) * load(TailMask<T>::values + (d - j));
    a1 += e1 * e1;
    j = d;
  }
  T acc = hsum<T>(a0 + a1);
  for (; j < d; ++j) {  // d < L
    const T e = x[j] - c[j];
    acc += e * e;
  }
  return acc;
}

template <typename T>
PFLCORE_KM_INLINE T sumsq(const T* __restrict__ v, int64_t d) {
  constexpr int L = kLanes<T>;
  Vec<T> a0{}, a1{};
  int64_t j = 0;
  for (; j + 2 * L <= d; j += 2 * L) {
    const Vec<T> e0 = load(v + j), e1 = load(v + j + L);
    a0 += e0 * e0;
    a1 += e1 * e1;
  }
  if (j + L <= d) {
    const Vec<T> e0 = load(v + j);
    a0 += e0 * e0;
    j += L;
  }
  T acc = hsum<T>(a0 + a1);
  for (; j < d; ++j) acc += v[j] * v[j];
  return acc;
}

// sqdist_direct(x, c, d) (the same operations in the same order: the same bits), and a[j] +=
// x[j] in float64 in the same pass over x (the Lloyd loop's cluster sums).
template <typename T>
PFLCORE_KM_INLINE T sqdist_direct_and_add(const T* __restrict__ x, const T* __restrict__ c, int64_t d, double* __restrict__ a) {
  constexpr int L = kLanes<T>, LD = kLanes<double>;
  typedef T Part __attribute__((vector_size(LD * sizeof(T))));  // LD values of T
  auto add_part = [&](int64_t j) {  // a[j .. j + LD) += x[j .. j + LD)
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) {
      // as below for AVX2: GCC lowered the generic conversion to two 128-bit conversions, an
      // extract and an insert per 8 floats; one vcvtps2pd ymm -> zmm does it
      _mm512_storeu_pd(a + j, _mm512_add_pd(_mm512_loadu_pd(a + j), _mm512_cvtps_pd(_mm256_loadu_ps(x + j))));
      return;
    }
#elif defined(__AVX__)
    if constexpr (sizeof(T) == 4) {
      // GCC lowers the generic conversion below to two 128-bit halves and an insert per 4 floats
      // (callgrind: ~25 instructions a point at d = 60); one vcvtps2pd from memory does it
      _mm256_storeu_pd(a + j, _mm256_add_pd(_mm256_loadu_pd(a + j), _mm256_cvtps_pd(_mm_loadu_ps(x + j))));
      return;
    }
#endif
    Part xp;
    std::memcpy(&xp, x + j, sizeof xp);
    const Vec<double> sum = load(a + j) + __builtin_convertvector(xp, Vec<double>);
    std::memcpy(a + j, &sum, sizeof sum);
  };
  auto add = [&](int64_t j) {  // a[j .. j + L) += x[j .. j + L)
    for (int h = 0; h < L; h += LD) add_part(j + h);
  };
  Vec<T> a0{}, a1{};
  int64_t j = 0;
  for (; j + 2 * L <= d; j += 2 * L) {
    const Vec<T> e0 = load(x + j) - load(c + j), e1 = load(x + j + L) - load(c + j + L);
    a0 += e0 * e0;
    a1 += e1 * e1;
    add(j);
    add(j + L);
  }
  if (j + L <= d) {
    const Vec<T> e0 = load(x + j) - load(c + j);
    a0 += e0 * e0;
    add(j);
    j += L;
  }
  if (j < d && d >= L) {  // the distance's tail as in sqdist_direct
    const int64_t t = d - L, r = d - j;
    const Vec<T> e1 = (load(x + t) - load(c + t)) * load(TailMask<T>::values + r);
    a1 += e1 * e1;
    // the sums of the r new values: whole parts of LD, then one by one (each a[j] gets one add,
    // so the order of the adds does not change the bits)
    for (; j + LD <= d; j += LD) add_part(j);
    for (; j < d; ++j) a[j] += double(x[j]);
  }
  T acc = hsum<T>(a0 + a1);
  for (; j < d; ++j) {  // d < L
    const T e = x[j] - c[j];
    acc += e * e;
    a[j] += double(x[j]);
  }
  return acc;
}

// The centroids as the screen reads them.
template <typename T>
struct Packed {
  const T* rows = nullptr;     // [K, d] the caller's centroids (the direct distances read them)
  int64_t K = 0, d = 0, nv = 0, Kpad = 0;
  // (cache-line aligned: the screens load whole vectors from these at multiples of the vector
  // width; see pflcore/aligned.h)
  aligned_vector<T> ct;        // [d, Kpad] transposed, zero-padded
  aligned_vector<T> cn2;       // [Kpad] ‖c_k‖² in T; +inf in the padding (never the minimum)
  double cnmax = 0;            // max_k ‖c_k‖
  // |fl(x·c) − x·c| ≤ γ_d Σ|x_j c_j| for any summation order (FMA or not), γ_d ≈ d·u; the
  // direct sums' error is as small relative to (‖x‖ + ‖c‖)²; 10% and 4 roundings of slack.
  double gamma = 0;

  // Few centroids (assign_range_dots): KB (K rounded up to even) centroid vectors per block of
  // L coordinates, interleaved [ceil(d/L)][KB][L] (the last block holds coordinates d − L .. d),
  // so that one pointer and constant offsets reach all of them; ct is then left empty.
  int64_t KB = 0;
  aligned_vector<T> cv;

  void pack(const T* c, int64_t K_, int64_t d_) {
    constexpr int L = kLanes<T>;
    rows = c, K = K_, d = d_;
    nv = (K + L - 1) / L;
    Kpad = nv * L;
    KB = uses_dots(K, d) ? (K + 1) / 2 * 2 : 0;
    if (KB) {
      const int64_t blocks = (d + L - 1) / L;
      cv.resize(size_t(blocks * KB * L));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = std::min(b * L, d - L);
        for (int64_t k = 0; k < KB; ++k)  // the padding centroid repeats the last one (its screen is never read)
          std::memcpy(cv.data() + (b * KB + k) * L, c + std::min(k, K - 1) * d + j0, L * sizeof(T));
      }
      ct.clear();
    } else {
      ct.assign(size_t(d * Kpad), T(0));
    }
    cn2.assign(size_t(Kpad), std::numeric_limits<T>::infinity());
    cnmax = 0;
    for (int64_t k = 0; k < K; ++k) {
      const T* row = c + k * d;
      double acc = 0;
      for (int64_t j = 0; j < d; ++j) {
        if (!KB) ct[size_t(j * Kpad + k)] = row[j];
        acc += double(row[j]) * double(row[j]);
      }
      cn2[size_t(k)] = T(acc);
      cnmax = std::max(cnmax, std::sqrt(acc));
    }
    gamma = 1.1 * double(d + 4) * double(std::numeric_limits<T>::epsilon()) / 2;
  }

  // The dots path: at most kDotsMaxK centroids (K accumulators, ‖x‖², a point vector and a
  // centroid vector in 16 registers), at least one vector of coordinates, and centroids that
  // stay in L1 (half of a 32 KiB L1: the points stream through the other half).
  static constexpr int64_t kDotsMaxK = 12;
  static bool uses_dots(int64_t K, int64_t d) {
    return K <= kDotsMaxK && d >= kLanes<T> && K * d * int64_t(sizeof(T)) <= (int64_t(16) << 10);
  }
};

// out[p][k] = ‖c_k‖² − 2x_p·c_k (the screen less ‖x_p‖²) for the P rows xr and the NV centroid
// vectors from v0 (k from v0·L).
template <typename T, int P, int NV>
inline void tile_screen(const T* const* xr, int64_t d, const T* __restrict__ ct, const T* __restrict__ cn2,
                        int64_t Kpad, int64_t v0, T* __restrict__ out) {
  using V = Vec<T>;
  constexpr int L = kLanes<T>;
  V acc[P][NV];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[p][v] = V{};
  const T* c = ct + v0 * L;
  for (int64_t j = 0; j < d; ++j, c += Kpad) {
    V cv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&cv[v], c + v * L, sizeof(V));
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const T xv = xr[p][j];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[p][v] += xv * cv[v];
    }
  }
  V norm[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) std::memcpy(&norm[v], cn2 + (v0 + v) * L, sizeof(V));
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const V sv = norm[v] - T(2) * acc[p][v];
      std::memcpy(out + p * Kpad + (v0 + v) * L, &sv, sizeof(V));
    }
}

// The Kpad screens of a tile of P rows, in blocks of up to kMaxNV vectors.
template <typename T, int P>
inline void tile_all_screens(const T* const* xr, const Packed<T>& pk, T* out) {
  const T *ct = pk.ct.data(), *cn2 = pk.cn2.data();
  int64_t v0 = 0;
  for (; v0 + kMaxNV <= pk.nv; v0 += kMaxNV) tile_screen<T, P, kMaxNV>(xr, pk.d, ct, cn2, pk.Kpad, v0, out);
  switch (pk.nv - v0) {  // the remainder block (fewer accumulators)
    case 1: tile_screen<T, P, 1>(xr, pk.d, ct, cn2, pk.Kpad, v0, out); break;
    case 2: if constexpr (kMaxNV > 2) tile_screen<T, P, 2>(xr, pk.d, ct, cn2, pk.Kpad, v0, out); break;
    case 3: if constexpr (kMaxNV > 3) tile_screen<T, P, 3>(xr, pk.d, ct, cn2, pk.Kpad, v0, out); break;
    default: break;
  }
}

// ‖x‖ rounded up: the computed Σx² in T has relative error at most (d + 1)·u.
template <typename T>
inline double norm_bound(T xn2, int64_t d) {
  return std::sqrt(double(xn2)) * (1.0 + double(d + 2) * double(std::numeric_limits<T>::epsilon()));
}

// Assigns points [i0, i1): calls on_point(i, label, sqdist, via_single) for each finite point,
// in order. When the screen leaves one candidate, its distance is single(i, k, x, c) (which must
// return sqdist_direct(x, c, d), and may do more in the same pass over x: via_single is then
// true); otherwise every candidate's sqdist_direct is compared. xnorm: a cache of norm_bound per point (read when `cached`, written
// otherwise), or null to compute them here. A point with a NaN/inf is a fault and is skipped.
template <typename T, int P, typename Single, typename OnPoint>
void assign_range_p(const T* points, int64_t i0, int64_t i1, const Packed<T>& pk, double* xnorm, bool cached,
                    std::vector<T>& dots, Faults& faults, Single&& single, OnPoint&& on_point) {
  const int64_t d = pk.d, K = pk.K, Kpad = pk.Kpad;
  dots.resize(size_t(P * Kpad));
  double xnb[P];
  for (int64_t t0 = i0; t0 < i1; t0 += P) {
    const int np = int(std::min<int64_t>(P, i1 - t0));
    const T* xr[P];
    for (int p = 0; p < P; ++p) xr[p] = points + (t0 + std::min(p, np - 1)) * d;  // a short tile repeats its last row
    bool ok[P];
    for (int p = 0; p < np; ++p) {
      ok[p] = true;
      if (xnorm && cached) {
        xnb[p] = xnorm[t0 + p];
        continue;
      }
      const T xn2 = sumsq(xr[p], d);
      // A NaN/inf coordinate makes the sum non-finite (so does a huge finite one: confirm)
      if (!std::isfinite(xn2) && !all_finite(xr[p], d)) {
        faults.add(t0 + p, FaultKind::NonFinite, "points: row %lld holds a NaN or infinite value", ll(t0 + p));
        ok[p] = false;
      }
      xnb[p] = norm_bound(xn2, d);  // inf for a huge finite row: every centroid is rechecked
      if (xnorm) xnorm[t0 + p] = xnb[p];
    }
    tile_all_screens<T, P>(xr, pk, dots.data());
    for (int p = 0; p < np; ++p) {
      if (!ok[p]) continue;
      const T* sp = dots.data() + p * Kpad;
      Vec<T> lo = load(sp);
      for (int64_t v = 1; v < pk.nv; ++v) {
        const Vec<T> sv = load(sp + v * kLanes<T>);
        lo = sv < lo ? sv : lo;
      }
      const T smin = hmin<T>(lo);
      // E = γ(‖x‖ + max‖c‖)² bounds the screen's error (the dot products' rounding, and that of
      // ‖c‖² and of the subtraction in T) and the direct sums' error for every centroid. A
      // centroid whose screen exceeds the smallest by more than 4E has a direct distance larger
      // than that of the smallest's centroid: never the first minimum.
      const double reach = xnb[p] + pk.cnmax;
      const double limit = double(smin) + 4.0 * pk.gamma * reach * reach;
      T lim = T(limit);
      if (double(lim) < limit) lim = std::nextafter(lim, std::numeric_limits<T>::infinity());
      // Where the screen could overflow in T (or a norm did), or its minimum is not finite,
      // every centroid is computed directly (+inf: the padding's lanes are then candidates too).
      if (!(reach * reach < 0.25 * double(std::numeric_limits<T>::max())) || !std::isfinite(limit))
        lim = std::numeric_limits<T>::infinity();
      uint32_t bits[kMaxCandidateWords];
      int candidates = 0;
      for (int64_t v = 0; v < pk.nv; ++v) {
        bits[v % kMaxCandidateWords] = lanes_at_most<T>(load(sp + v * kLanes<T>), lim);
        candidates += __builtin_popcount(bits[v % kMaxCandidateWords]);
        if (candidates > 1 || v + 1 >= kMaxCandidateWords) break;
      }
      if (candidates == 1 && pk.nv <= kMaxCandidateWords) {  // the usual case: the screen decides
        int64_t k = 0;
        for (int64_t v = 0; v < pk.nv; ++v)
          if (bits[v]) k = v * kLanes<T> + __builtin_ctz(bits[v]);
        if (k < K) {
          on_point(t0 + p, k, single(t0 + p, k, xr[p], pk.rows + k * d), true);
          continue;
        }
      }
      T best = std::numeric_limits<T>::infinity();
      int64_t arg = -1;
      for (int64_t v = 0; v < pk.nv; ++v)
        for (uint32_t b = lanes_at_most<T>(load(sp + v * kLanes<T>), lim); b; b &= b - 1) {
          const int64_t k = v * kLanes<T> + __builtin_ctz(b);
          if (k >= K) break;  // the padding
          const T dist = sqdist_direct(xr[p], pk.rows + k * d, d);
          if (arg < 0 || dist < best) {
            best = dist;
            arg = k;
          }
        }
      on_point(t0 + p, arg, best, false);
    }
  }
}

// out[k] = the sum of the lanes of acc[k], k < KB (out has room for KB rounded up to a whole
// vector). With 256-bit vectors a block of them is reduced together, transposed by horizontal
// adds (9 instructions for 8 float sums, where one hsum takes 6); elsewhere one by one.
template <typename T, int KB>
inline void lane_sums(const Vec<T>* acc, T* out) {
  int k = 0;
#if defined(__AVX512F__)
  // 512-bit vectors: blocks of 16 floats (8 doubles) of accumulators reduced together
  // (lane_sums.h); a short block is padded with zeros (out has room for KB rounded up to a whole
  // vector)
  constexpr int L = 64 / int(sizeof(T));
  for (; k < KB; k += L) {
    Vec<T> a[L];
    for (int q = 0; q < L; ++q) a[q] = k + q < KB ? acc[k + q] : Vec<T>{};
    lane_sums_512<T>(a, out + k);
  }
#elif defined(__AVX__)
  if constexpr (sizeof(T) == 4) {
    for (; k + 8 <= KB; k += 8) {
      __m256 a[8];
      std::memcpy(a, acc + k, sizeof a);
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      // u0: [lanes 0-3 of a0..a3 summed, lanes 4-7 of a0..a3 summed]; likewise u1 for a4..a7
      _mm256_storeu_ps(out + k, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                              _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
  } else {
    for (; k + 4 <= KB; k += 4) {
      __m256d a[4];
      std::memcpy(a, acc + k, sizeof a);
      const __m256d u0 = _mm256_hadd_pd(a[0], a[1]), u1 = _mm256_hadd_pd(a[2], a[3]);
      // u0: [a0 lanes 0+1, a1 lanes 0+1, a0 lanes 2+3, a1 lanes 2+3]
      _mm256_storeu_pd(out + k, _mm256_add_pd(_mm256_permute2f128_pd(u0, u1, 0x20),
                                              _mm256_permute2f128_pd(u0, u1, 0x31)));
    }
  }
#endif
  for (; k < KB; ++k) out[k] = hsum<T>(acc[k]);
}

// How many points ahead assign_range_dots asks for a point's row: the first load of each row is
// the hottest instruction of the Lloyd loop; this took 5-12% off its time at 100,000 x 60, K = 10.
constexpr int64_t kPointsAhead = 24;

// The row kPointsAhead points after x (rows of d values) into L2, not L1 (prefetcht1; forced
// inline: see glm_rows.h's prefetch_rows_ahead). Into L1 (prefetcht0) the same requests cost
// more than they saved once the points outgrow the caches: at 100,000 x 60, K = 10, one thread,
// assignment 4.3-4.6 -> 3.3-3.6 ms and Lloyd x10 66-72 -> 50-52 ms (AMD Zen 4, alternating
// builds); 12 or 48 points ahead, or prefetcht2, were no better.
template <typename T>
PFLCORE_KM_INLINE void prefetch_point_ahead(const T* x, int64_t d) {
  const char* ahead = reinterpret_cast<const char*>(x + kPointsAhead * d);
  for (int64_t off = 0; off < d * int64_t(sizeof(T)); off += 64) __builtin_prefetch(ahead + off, 0, 2);
}

// Emits point i (row x) of assign_range_dots, in either of its forms: with one candidate, `from`,
// its distance from single (which may do more in the same pass over x); otherwise the first
// minimum of the direct distances over the centroids k in [from, K) that is_candidate(k) admits.
template <typename T, typename IsCandidate, typename Single, typename OnPoint>
PFLCORE_KM_INLINE void emit_dots_point(int64_t i, const T* x, const Packed<T>& pk, int64_t candidates, int64_t from,
                                       IsCandidate is_candidate, Single& single, OnPoint& on_point) {
  const int64_t d = pk.d, K = pk.K;
  if (candidates == 1) {  // the usual case
    on_point(i, from, single(i, from, x, pk.rows + from * d), true);
    return;
  }
  T best = std::numeric_limits<T>::infinity();
  int64_t arg = -1;
  for (int64_t k = from; k < K; ++k) {
    if (!is_candidate(k)) continue;
    const T dist = sqdist_direct(x, pk.rows + k * d, d);
    if (arg < 0 || dist < best) {
      best = dist;
      arg = k;
    }
  }
  on_point(i, arg, best, false);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
using simd::transpose16;  // (simd.h)

// assign_range_dots' work for 16 float points b0 .. b0 + 16 with the points in the lanes: each
// chunk of 16 coordinates of the 16 rows is transposed in registers, and every centroid's dot
// products run as FMAs of a coordinate vector (16 points) by the centroid's broadcast coordinate.
// The screens, the bound and the candidates are then vector operations over the 16 points, and
// only the direct distances go point by point. The row form pays, per point, a reduction of its
// KB dot accumulators and of ‖x‖², a minimum across lanes and ~20 scalar steps of the bound:
// at K = 10, d = 60, 19 ns a point, 14 of them at K = 2, where the dots themselves cost little
// (AMD Zen 5, one thread). Same contract, same bound (4E of slack over the screens' rounding, in
// any summation order), the same candidates' direct sums: labels and distances are those of the
// row form. False (nothing emitted) where a point's ‖x‖² is not finite: the row form then
// takes the block and reports it.
template <int KB, bool kCached, typename Single, typename OnPoint>
PFLCORE_KM_INLINE bool dots_block_lanes(const float* points, int64_t b0, const Packed<float>& pk, double* xnorm,
                                        Single& single, OnPoint& on_point) {
  const int64_t d = pk.d, K = pk.K;
  const float* x0 = points + b0 * d;
  for (int p = 0; p < 16; ++p) prefetch_point_ahead(x0 + p * d, d);  // (as the row form asks for them)
  __m512 acc[KB];
  for (int k = 0; k < KB; ++k) acc[k] = _mm512_setzero_ps();
  __m512 xx = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < d; j0 += 16) {
    const int64_t js = std::min<int64_t>(j0, d - 16);  // the last chunk overlaps: j0 - js coordinates counted
    __m512 r[16];
    for (int p = 0; p < 16; ++p) r[p] = _mm512_loadu_ps(x0 + p * d + js);
    transpose16(r);
    for (int q = int(j0 - js); q < 16; ++q) {
      if constexpr (!kCached) xx = _mm512_fmadd_ps(r[q], r[q], xx);
      const float* c = pk.rows + js + q;
      for (int k = 0; k < KB; ++k)  // (KB may be K + 1: the padding repeats the last centroid)
        acc[k] = _mm512_fmadd_ps(r[q], _mm512_set1_ps(c[std::min<int64_t>(k, K - 1) * d]), acc[k]);
    }
  }
  __m512d xnb[2];
  if constexpr (kCached) {
    xnb[0] = _mm512_loadu_pd(xnorm + b0);
    xnb[1] = _mm512_loadu_pd(xnorm + b0 + 8);
  } else {
    if (_mm512_fpclass_ps_mask(xx, 0x99) != 0) return false;  // NaN or ±inf
    // norm_bound, lane by lane
    const __m512d grow = _mm512_set1_pd(1.0 + double(d + 2) * double(std::numeric_limits<float>::epsilon()));
    xnb[0] = _mm512_mul_pd(_mm512_sqrt_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(xx))), grow);
    xnb[1] = _mm512_mul_pd(_mm512_sqrt_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(xx, 1))), grow);
    if (xnorm) {
      _mm512_storeu_pd(xnorm + b0, xnb[0]);
      _mm512_storeu_pd(xnorm + b0 + 8, xnb[1]);
    }
  }
  // the screens ‖c_k‖² − 2x·c_k, their smallest, and the window of assign_range_dots' row form
  alignas(64) float screen[KB][16];
  const __m512 two = _mm512_set1_ps(2.0f);
  __m512 smin = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int k = 0; k < K; ++k) {
    acc[k] = _mm512_sub_ps(_mm512_set1_ps(pk.cn2[size_t(k)]), _mm512_mul_ps(two, acc[k]));
    _mm512_store_ps(screen[k], acc[k]);
    smin = _mm512_min_ps(acc[k], smin);
  }
  const __m512d cnmax = _mm512_set1_pd(pk.cnmax), g4 = _mm512_set1_pd(4.0 * pk.gamma);
  const __m512d big = _mm512_set1_pd(0.25 * double(std::numeric_limits<float>::max()));
  const __m512d up = _mm512_set1_pd(2.0 * double(std::numeric_limits<float>::epsilon()));
  const __m512d tiny = _mm512_set1_pd(double(std::numeric_limits<float>::min()));
  __m256 lim_half[2];
  __mmask8 every_half[2];
  for (int h = 0; h < 2; ++h) {
    const __m512d s = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(smin, 1) : _mm512_castps512_ps256(smin));
    const __m512d reach = _mm512_add_pd(xnb[h], cnmax);
    const __m512d limit = _mm512_add_pd(s, _mm512_mul_pd(_mm512_mul_pd(g4, reach), reach));
    // every: reach² not below FLT_MAX / 4, or a limit that is not finite
    every_half[h] = __mmask8(_mm512_cmp_pd_mask(_mm512_mul_pd(reach, reach), big, _CMP_NLT_UQ) |
                             _mm512_fpclass_pd_mask(limit, 0x99));
    const __m512d absl = _mm512_abs_pd(limit);
    const __m512d rounded = _mm512_add_pd(_mm512_add_pd(limit, _mm512_mul_pd(absl, up)), tiny);
    lim_half[h] = _mm512_cvtpd_ps(rounded);
  }
  const __mmask16 every = __mmask16(every_half[0] | (unsigned(every_half[1]) << 8));
  __m512 lim = _mm512_insertf32x8(_mm512_castps256_ps512(lim_half[0]), lim_half[1], 1);
  lim = _mm512_mask_mov_ps(lim, every, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  __m512i count = _mm512_setzero_si512(), first = _mm512_set1_epi32(int(K));
  const __m512i one = _mm512_set1_epi32(1);
  for (int k = 0; k < K; ++k) {
    const __mmask16 in = _mm512_cmp_ps_mask(acc[k], lim, _CMP_LE_OQ);
    count = _mm512_mask_add_epi32(count, in, count, one);
    first = _mm512_mask_min_epi32(first, in, first, _mm512_set1_epi32(k));
  }
  alignas(64) float limv[16];
  alignas(64) int32_t countv[16], firstv[16];
  _mm512_store_ps(limv, lim);
  _mm512_store_si512(countv, count);
  _mm512_store_si512(firstv, first);
  for (int p = 0; p < 16; ++p) {
    const bool all = (every >> p) & 1u;
    const int64_t candidates = all ? K : countv[p];
    emit_dots_point(b0 + p, x0 + p * d, pk, candidates, all ? 0 : candidates ? firstv[p] : K,
                    [&](int64_t k) { return all || screen[k][p] <= limv[p]; }, single, on_point);
  }
  return true;
}
#endif

// assign_range for few centroids (Packed::uses_dots): point by point, the K dot products x·c_k as
// KB vector accumulators over x's coordinates, ‖x‖² in one more, the centroids from the
// interleaved pk.cv (L1). Where K is small the tile screen above wastes the padding lanes of
// Kpad (K = 10: 6 of 16) and reads Kpad screens per point: at K = 10, d = 60 (float32, avx2) it
// ran 573 instructions a point (callgrind), this path 389 with the direct distance. The screens are the same
// ‖c‖² − 2x·c in T with the same error bound (any summation order), and the candidates go
// through the same exact recheck, so labels and distances are those of assign_range_p.
template <typename T, int KB, bool kCached, typename Single, typename OnPoint>
void assign_range_dots(const T* points, int64_t i0, int64_t i1, const Packed<T>& pk, double* xnorm,
                       Faults& faults, Single&& single, OnPoint&& on_point) {
  using V = Vec<T>;
  constexpr int L = kLanes<T>;
  constexpr T inf = std::numeric_limits<T>::infinity();
  const int64_t d = pk.d, K = pk.K, full = d / L;
  const int r = int(d - full * L);  // coordinates in the last, overlapping block (d − L .. d): its new ones
  const V tail_mask = load(TailMask<T>::values + r);
  constexpr int KV = (KB + L - 1) / L;  // vectors of screens (pk.cn2 has Kpad >= KV·L entries)
  // Points in blocks of kBlock, in two passes: the dot products of every point of the block, then
  // each point's screens, candidates and direct distance. One point's work is a long chain of
  // dependent steps (the sums, their reduction, the minimum, the bound, the recheck); apart,
  // the points' chains are independent, so the CPU overlaps them.
  constexpr int kBlock = 16;
  alignas(64) T sums[kBlock][KV * L];  // x·c_k of the block's points (0 past KB)
  T norms[kBlock];                     // ‖x‖² in T
  for (int64_t b0 = i0; b0 < i1; b0 += kBlock) {
  const int nb = int(std::min<int64_t>(kBlock, i1 - b0));
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (std::is_same_v<T, float>) {
    if (nb == kBlock && dots_block_lanes<KB, kCached>(points, b0, pk, xnorm, single, on_point)) continue;
  }
#endif
  for (int p = 0; p < nb; ++p) {
    const T* x = points + (b0 + p) * d;
    prefetch_point_ahead(x, d);
    const T* cb = pk.cv.data();  // [blocks][KB][L]
    V acc[KB];
#pragma GCC unroll 24
    for (int k = 0; k < KB; ++k) acc[k] = V{};
    V xx{};  // ‖x‖², unless the norms are cached (the Lloyd loop's later passes)
    // pointers bumped: the loop's own instructions were 6 of a block's 18 with an index
    const T* xb = x;
    for (const T* const xend = x + full * L; xb < xend; xb += L, cb += KB * L) {
      const V xv = load(xb);
      if constexpr (!kCached) xx += xv * xv;
#pragma GCC unroll 24
      for (int k = 0; k < KB; ++k) acc[k] += xv * load(cb + k * L);
    }
    if (r) {  // the lanes already counted are zeroed in x
      const V xv = load(x + d - L) * tail_mask;
      if constexpr (!kCached) xx += xv * xv;
#pragma GCC unroll 24
      for (int k = 0; k < KB; ++k) acc[k] += xv * load(cb + k * L);
    }
    for (int k = KB; k < KV * L; ++k) sums[p][k] = T(0);
    lane_sums<T, KB>(acc, sums[p]);
    if constexpr (!kCached) norms[p] = hsum<T>(xx);
  }
  for (int p = 0; p < nb; ++p) {
    const int64_t i = b0 + p;
    const T* x = points + i * d;
    double xnb;
    if constexpr (kCached) {
      xnb = xnorm[i];
    } else {
      const T xn2 = norms[p];
      if (!std::isfinite(xn2) && !all_finite(x, d)) {  // as in assign_range_p
        faults.add(i, FaultKind::NonFinite, "points: row %lld holds a NaN or infinite value", ll(i));
        continue;
      }
      xnb = norm_bound(xn2, d);
      if (xnorm) xnorm[i] = xnb;
    }
    T* screen = sums[p];
    V lo = load(pk.cn2.data()) - T(2) * load(screen);  // ‖c‖² − 2x·c; the padding's cn2 is +inf
    std::memcpy(screen, &lo, sizeof lo);
#pragma GCC unroll 4
    for (int v = 1; v < KV; ++v) {
      const V sv = load(pk.cn2.data() + v * L) - T(2) * load(screen + v * L);
      std::memcpy(screen + v * L, &sv, sizeof sv);
      lo = sv < lo ? sv : lo;
    }
    const T smin = hmin<T>(lo);
    // the window of assign_range_p: a centroid whose screen exceeds the smallest by more than 4E
    // is never the first minimum of the direct distances
    const double reach = xnb + pk.cnmax;
    const double limit = double(smin) + 4.0 * pk.gamma * reach * reach;
    const bool every = !(reach * reach < 0.25 * double(std::numeric_limits<T>::max())) || !std::isfinite(limit);
    // the limit in T, rounded up: T(y) is within 2^-p·|y| of y (p: T's precision), so adding
    // 2·eps·|limit| first lands at or above the limit (no nextafter call)
    const T lim = every ? inf
                        : sizeof(T) == sizeof(double)
                              ? T(limit)
                              : T(limit + std::fabs(limit) * 2.0 * double(std::numeric_limits<T>::epsilon()) +
                                  double(std::numeric_limits<T>::min()));
    int candidates = 0;
    int64_t first = -1;
    if (every) {
      candidates = int(K), first = 0;
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < KV; ++v) {
        const uint32_t bits = lanes_at_most<T>(load(screen + v * L), lim);  // the padding is +inf: never
        if (bits && first < 0) first = v * L + __builtin_ctz(bits);
        candidates += __builtin_popcount(bits);
      }
    }
    emit_dots_point(i, x, pk, candidates, first < 0 ? K : first,
                    [&](int64_t k) { return every || screen[k] <= lim; }, single, on_point);
  }
  }
}

// The tile height for these centroids (the register blocking of their widest block), or the
// dots path for few centroids.
template <typename T, typename Single, typename OnPoint>
void assign_range(const T* points, int64_t i0, int64_t i1, const Packed<T>& pk, double* xnorm, bool cached,
                  std::vector<T>& dots, Faults& faults, Single&& single, OnPoint&& on_point) {
  switch (pk.KB) {
    case 0: break;
#define PFLCORE_DOTS(KB)                                                                          \
  case KB:                                                                                        \
    if (xnorm && cached) return assign_range_dots<T, KB, true>(points, i0, i1, pk, xnorm, faults, single, on_point); \
    return assign_range_dots<T, KB, false>(points, i0, i1, pk, xnorm, faults, single, on_point);
    PFLCORE_DOTS(2) PFLCORE_DOTS(4) PFLCORE_DOTS(6) PFLCORE_DOTS(8) PFLCORE_DOTS(10) PFLCORE_DOTS(12)
#undef PFLCORE_DOTS
    default: break;
  }
  const int P = points_for(int(std::min<int64_t>(pk.nv, kMaxNV)));
  if (P == 8) return assign_range_p<T, 8>(points, i0, i1, pk, xnorm, cached, dots, faults, single, on_point);
  assign_range_p<T, 6>(points, i0, i1, pk, xnorm, cached, dots, faults, single, on_point);
}

}  // namespace kmeans_detail
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
