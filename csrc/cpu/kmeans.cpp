// k-means on the CPU (DESIGN.md §4): the assignment pass, the Lloyd update, and the whole
// Lloyd loop in one call (one pass over the points per iteration: assignment, the clusters'
// sums and counts, the inertia and the label changes together).
//
// The assignment (kmeans_screen.h) screens with ‖c‖² − 2x·c in register-blocked tiles, then
// computes the direct Σ(x − c)² of the candidates the screen cannot rule out, so labels and
// distances are those of the direct computation: a point equidistant from two identical
// centroids sees exactly equal distances, as in the torch reference.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kmeans_screen.h"
#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace {

using namespace kmeans_detail;

template <typename T>
bool centroids_finite(const T* centroids, int64_t K, int64_t d, Faults& faults, const char* name = "centroids") {
  for (int64_t k = 0; k < K; ++k)
    if (!all_finite(centroids + k * d, d)) {
      faults.add(-1, FaultKind::NonFinite, "%s: row %lld holds a NaN or infinite value", name, ll(k));
      return false;
    }
  return true;
}

// The Lloyd pass's per-point callbacks: GCC kept on_point out of line (a call, spills and reloads
// per point: ~33 instructions of ~500 at K = 10, d = 60, callgrind).
#if defined(__GNUC__)
#define PFLCORE_INLINE_LAMBDA __attribute__((always_inline))
#else
#define PFLCORE_INLINE_LAMBDA
#endif

// Points per block of the assignment's parallel loop: several tiles, few enough blocks for a
// small call.
constexpr int64_t kAssignBlock = 240;  // a multiple of every tile height (6, 8, 12)

#if defined(_OPENMP)
int omp_threads() { return omp_get_max_threads(); }
#else
int omp_threads() { return 1; }
#endif

}  // namespace

template <typename T>
void kmeans_assign(const T* points, const T* centroids, int64_t N, int64_t K, int64_t d,
                   int64_t* labels, T* sqdist, Faults& faults) {
  if (!centroids_finite(centroids, K, d, faults)) return;
  // the calling thread's packing buffers, kept between calls (a small call, 200 points, paid
  // ~0.1 µs of malloc and free for them); a reference, so that the team's threads below read this
  // thread's copy, not their own (a thread_local named inside the parallel region is per thread)
  static thread_local Packed<T> packed;
  Packed<T>& pk = packed;
  pk.pack(centroids, K, d);
  // Each point's label and distance are its own: any split of the points gives the same bits.
  // Two threads pay the other thread's wake-up from libgomp's sleep, ~3 µs (AMD Zen 5, a tight
  // loop of calls), against ~0.03 ns a multiply-add on one thread: splitting gains from ~2·10^5
  // multiply-adds on. At 200 x 60, K = 10 (1.2·10^5): one thread 4.5 µs a kernel call, two
  // threads 7.3 µs; in the peer benchmark's loop of ops.kmeans_assign calls, one thread 7.9 µs and
  // two 7.5–11.3 µs. Hence a threshold of 2^18 (kKmeansSerialWork).
  const int threads = omp_threads();
  const bool parallel = threads > 1 && N >= 96 && N * K * d > kKmeansSerialWork;
  const int64_t block =
      parallel ? std::clamp<int64_t>((N + 2 * threads - 1) / (2 * threads) / 48 * 48, 48, kAssignBlock) : kAssignBlock;
  auto range = [&](int64_t b, std::vector<T>& dots) {
    assign_range(points, b, std::min(N, b + block), pk, nullptr, false, dots, faults,
                 [d](int64_t, int64_t, const T* x, const T* c) { return sqdist_direct(x, c, d); },
                 [&](int64_t i, int64_t k, T dist, bool) {
                   labels[i] = k;
                   sqdist[i] = dist;
                 });
  };
  if (parallel) {
#pragma omp parallel
    {
      std::vector<T> dots;
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < N; b += block) range(b, dots);
    }
  } else {
    // no parallel region at all: even a one-thread `omp parallel if (false)` costs libgomp a
    // futex syscall per call (a 1-point call: 1.7 µs with it, 1.05 without)
    std::vector<T> dots;
    for (int64_t b = 0; b < N; b += block) range(b, dots);
  }
}

template <typename T>
void kmeans_update(const T* points, const int64_t* labels, const T* weights, int64_t N, int64_t K,
                   int64_t d, T* centroids, double* weight_sum, Faults& faults) {
  for (int64_t i = 0; i < N; ++i) {
    if (labels[i] < 0 || labels[i] >= K) {
      faults.add(i, FaultKind::Value, "labels: expected cluster indices in [0, %lld), got labels[%lld] = %lld", ll(K),
                 ll(i), ll(labels[i]));
      return;
    }
    if (weights && !(std::isfinite(weights[i]) && weights[i] >= T(0))) {
      faults.add(i, std::isfinite(weights[i]) ? FaultKind::Value : FaultKind::NonFinite,
                 "weights: expected finite weights >= 0, got weights[%lld] = %g", ll(i), double(weights[i]));
      return;
    }
  }
  std::fill(weight_sum, weight_sum + K, 0.0);
  for (int64_t i = 0; i < N; ++i) weight_sum[labels[i]] += weights ? double(weights[i]) : 1.0;
  // Each thread owns a slice of the columns and walks the points in order, so every sum
  // has a fixed order whatever the thread count.
  constexpr int64_t kCols = 64;
#pragma omp parallel if (N * d > (1 << 16))
  {
    std::vector<double> acc(K * kCols);
#pragma omp for schedule(static)
    for (int64_t j0 = 0; j0 < d; j0 += kCols) {
      const int64_t w = std::min(kCols, d - j0);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < N; ++i) {
        const double wi = weights ? double(weights[i]) : 1.0;
        const T* row = points + i * d + j0;
        double* a = acc.data() + labels[i] * kCols;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) a[j] += wi * double(row[j]);
      }
      for (int64_t k = 0; k < K; ++k) {
        if (!(weight_sum[k] > 0.0)) continue;  // empty cluster: keep its centroid
        const double inv = 1.0 / weight_sum[k];
        for (int64_t j = 0; j < w; ++j) centroids[k * d + j0 + j] = T(acc[k * kCols + j] * inv);
      }
    }
  }
}

// ---- the Lloyd loop ------------------------------------------------------------------------------
namespace {

// The points are cut into chunks that depend only on N, K and d (never on the thread count);
// each chunk sums its points into its own float64 buffer, and the buffers are added in chunk
// order: the sums, hence the centroids, are bitwise the same on any number of threads.
struct Chunking {
  int64_t size = 1, count = 0;
  Chunking(int64_t N, int64_t K, int64_t d) {
    size = std::max<int64_t>(1024, (N + 63) / 64);
    // the chunks' buffers stay within ~32 MiB (they are added up once per iteration)
    while (size < N && ((N + size - 1) / size) * (K * d + K) * int64_t(sizeof(double)) > (int64_t(32) << 20))
      size *= 2;
    count = (N + size - 1) / size;
  }
};

// Σ_i ‖x_i − mean‖² / N (the unweighted total variance of the points: the scale of the stopping
// rule), float64, in chunk order.
template <typename T>
double total_variance(const T* points, int64_t N, int64_t d, const Chunking& ch, bool parallel) {
  std::vector<double> part(size_t(ch.count * d)), mean(size_t(d), 0.0), ss(size_t(ch.count), 0.0);
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < ch.count; ++c) {
      double* acc = part.data() + c * d;
      std::fill(acc, acc + d, 0.0);
      for (int64_t i = c * ch.size; i < std::min(N, (c + 1) * ch.size); ++i)
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) acc[j] += double(points[i * d + j]);
    }
#pragma omp single
    for (int64_t c = 0; c < ch.count; ++c)
      for (int64_t j = 0; j < d; ++j) mean[size_t(j)] += part[size_t(c * d + j)];
#pragma omp single
    for (int64_t j = 0; j < d; ++j) mean[size_t(j)] /= double(N);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < ch.count; ++c) {
      double acc = 0.0;
      for (int64_t i = c * ch.size; i < std::min(N, (c + 1) * ch.size); ++i)
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < d; ++j) {
          const double e = double(points[i * d + j]) - mean[size_t(j)];
          acc += e * e;
        }
      ss[size_t(c)] = acc;
    }
  }
  double total = 0.0;
  for (int64_t c = 0; c < ch.count; ++c) total += ss[size_t(c)];
  return total / double(N);
}

}  // namespace

template <typename T>
void kmeans_lloyd(const T* points, const T* weights, int64_t N, int64_t K, int64_t d, T* centroids, int64_t iters,
                  double tol, int64_t* labels, double* history, int64_t* iterations, Faults& faults) {
  *iterations = 0;
  if (!centroids_finite(centroids, K, d, faults)) return;
  if (weights)
    for (int64_t i = 0; i < N; ++i)
      if (!(std::isfinite(weights[i]) && weights[i] >= T(0))) {
        faults.add(i, std::isfinite(weights[i]) ? FaultKind::Value : FaultKind::NonFinite,
                   "weights: expected finite weights >= 0, got weights[%lld] = %g", ll(i), double(weights[i]));
        return;
      }
  const Chunking ch(N, K, d);
  const bool parallel = N * K * d > kKmeansSerialWork;
  // a chunk's buffer: sums [K, dp], then weights [K]; each cluster's row padded to whole cache
  // lines and the buffers cache-line aligned, so that the sums' vector adds never straddle two
  // lines (the padding stays 0 and is never read)
  const int64_t dp = (d + 7) / 8 * 8;
  const int64_t stride = (K * dp + K + 7) / 8 * 8;
  aligned_vector<double> part(static_cast<size_t>(ch.count * stride)), total(static_cast<size_t>(stride));
  std::vector<double> inertia_of(static_cast<size_t>(ch.count)), xnorm(static_cast<size_t>(N));
  std::vector<int64_t> changed_of(size_t(ch.count));
  const double scale = tol > 0 && N > 1 ? total_variance(points, N, d, ch, parallel) : 0.0;
  Packed<T> pk;

  // One pass: labels (counting the changes) and inertia for the current centroids, and, when
  // `sums`, each cluster's weighted float64 sum and weight, into `total`.
  auto pass = [&](bool first, bool sums) {
    pk.pack(centroids, K, d);
#pragma omp parallel if (parallel)
    {
      std::vector<T> dots;
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < ch.count; ++c) {
        double* acc = part.data() + c * stride;
        double* wacc = acc + K * dp;
        if (sums) std::fill(acc, acc + stride, 0.0);
        double inertia = 0.0;
        int64_t changed = 0;
        auto single = [&](int64_t i, int64_t k, const T* x, const T* cen) PFLCORE_INLINE_LAMBDA {
          // unweighted sums: the distance and the sum in one pass over x
          return sums && !weights ? sqdist_direct_and_add(x, cen, d, acc + k * dp) : sqdist_direct(x, cen, d);
        };
        assign_range(points, c * ch.size, std::min(N, (c + 1) * ch.size), pk, xnorm.data(), !first, dots, faults,
                     single, [&](int64_t i, int64_t k, T dist, bool via_single) PFLCORE_INLINE_LAMBDA {
                       const double w = weights ? double(weights[i]) : 1.0;
                       changed += labels[i] != k;
                       labels[i] = k;
                       inertia += w * double(dist);
                       if (!sums) return;
                       wacc[k] += w;
                       if (via_single && !weights) return;  // summed by `single`
                       const T* x = points + i * d;
                       double* a = acc + k * dp;
                       if (weights) {
#pragma omp simd
                         for (int64_t j = 0; j < d; ++j) a[j] += w * double(x[j]);
                       } else {
#pragma omp simd
                         for (int64_t j = 0; j < d; ++j) a[j] += double(x[j]);
                       }
                     });
        inertia_of[size_t(c)] = inertia;
        changed_of[size_t(c)] = changed;
      }
      if (sums) {
        // the chunks' buffers added in chunk order, each column by one thread
#pragma omp for schedule(static)
        for (int64_t q = 0; q < stride; ++q) {
          double t = 0.0;
          for (int64_t c = 0; c < ch.count; ++c) t += part[size_t(c * stride + q)];
          total[size_t(q)] = t;
        }
      }
    }
    double inertia = 0.0;
    int64_t changed = 0;
    for (int64_t c = 0; c < ch.count; ++c) inertia += inertia_of[size_t(c)], changed += changed_of[size_t(c)];
    return std::make_pair(inertia, changed);
  };

  if (N == 0) {  // no points: every cluster is empty and keeps its centroid
    history[0] = 0.0;
    return;
  }
  std::fill(labels, labels + N, int64_t(-1));
  history[0] = pass(true, iters > 0).first;
  if (faults.any()) return;
  for (int64_t it = 1; it <= iters; ++it) {
    // centroids ← the clusters' weighted means (an empty cluster keeps its centroid); the squared
    // shift as the reference measures it (the difference in T, squared in float64)
    double shift = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double w = total[size_t(K * dp + k)];
      if (!(w > 0.0)) continue;
      const double inv = 1.0 / w;
      T* c = centroids + k * d;
      for (int64_t j = 0; j < d; ++j) {
        const T next = T(total[size_t(k * dp + j)] * inv);
        const double e = double(T(next - c[j]));
        shift += e * e;
        c[j] = next;
      }
    }
    const auto [inertia, changed] = pass(false, it < iters);
    history[it] = inertia;
    *iterations = it;
    if (changed == 0 || shift <= tol * scale) break;
  }
}

template void kmeans_assign<float>(const float*, const float*, int64_t, int64_t, int64_t, int64_t*, float*,
                                   Faults&);
template void kmeans_assign<double>(const double*, const double*, int64_t, int64_t, int64_t, int64_t*, double*,
                                    Faults&);
template void kmeans_update<float>(const float*, const int64_t*, const float*, int64_t, int64_t, int64_t, float*,
                                   double*, Faults&);
template void kmeans_update<double>(const double*, const int64_t*, const double*, int64_t, int64_t, int64_t,
                                    double*, double*, Faults&);

template void kmeans_lloyd<float>(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t, double,
                                  int64_t*, double*, int64_t*, Faults&);
template void kmeans_lloyd<double>(const double*, const double*, int64_t, int64_t, int64_t, double*, int64_t, double,
                                   int64_t*, double*, int64_t*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
