// The Gaussian mechanism on clipped client updates (issue 27; pflcore/ops/dp.py states the formula):
//   out = Σ_r w_r·min(1, C/‖u_r‖)·u_r  +  σ·n,   n_j ~ N(0, 1) from Philox4x64-10 keyed by (seed, counter).
//
// Why a tree: the sum must be bitwise the same at any thread count AND however a sharded run splits
// the rows over ranks. Rows are summed along the fixed binary tree over their positions 0..R-1
// (node [a, a+2^k) = its left half + its right half; a node with no right half is its left
// half, nothing is added). Any aligned block of 2^k rows is a node, so threads (chunks of 2^k
// rows) and ranks (pflcore/ops/dp.py cuts a rank's rows into aligned blocks) compute nodes of
// the same tree and combine them alike. This file is compiled with
// -ffp-contract=off: a fused multiply-add here would round differently from a leaf stored, then
// added (the path the ranks' blocks take).
#include <algorithm>
#include <cmath>
#include <vector>

#include "pflcore/ops_cpu.h"
#include "pflcore/parallel.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

// Counter word 2 of every draw of the mechanism's noise ("dp-noise"): other draws keyed by the
// same (seed, counter) use other words.
constexpr uint64_t kDpNoiseStream = 0x64702d6e6f697365ull;

// Philox4x64-10 (Salmon et al., SC'11; Random123's constants): 4 × 64 random bits per counter.
struct Philox4x64 {
  uint64_t v[4];
};

inline void mulhilo(uint64_t a, uint64_t b, uint64_t& hi, uint64_t& lo) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  hi = static_cast<uint64_t>(p >> 64);
  lo = static_cast<uint64_t>(p);
}

inline Philox4x64 philox4x64(uint64_t c0, uint64_t c1, uint64_t c2, uint64_t c3, uint64_t k0, uint64_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B97F4A7C15ull;
      k1 += 0xBB67AE8584CAA73Bull;
    }
    uint64_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2E7470EE14C6C93ull, c0, hi0, lo0);
    mulhilo(0xCA5A826395121157ull, c2, hi1, lo1);
    const uint64_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

// [0, 1) with 53 random bits.
inline double uniform53(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

// Normals 4b .. 4b+3: two Box–Muller pairs from block b (counter word 0 = b + 1, so that numpy's
// Philox, which steps its counter before drawing, reproduces it: pflcore/backends/reference.py).
inline void normals4(uint64_t b, uint64_t seed, uint64_t counter, double out[4]) {
  const Philox4x64 r = philox4x64(b + 1, counter, kDpNoiseStream, 0, seed, 0);
  for (int pair = 0; pair < 2; ++pair) {
    const double radius = std::sqrt(-2.0 * std::log1p(-uniform53(r.v[2 * pair])));
    const double angle = 6.283185307179586 * uniform53(r.v[2 * pair + 1]);
    out[2 * pair] = radius * std::cos(angle);
    out[2 * pair + 1] = radius * std::sin(angle);
  }
}

// A binary counter of tree nodes over consecutive rows: push leaves in order, `finish` merges
// what is left right to left (the missing rows of the last, partial node add nothing).
class TreeSum {
 public:
  TreeSum(int64_t d, int depth) : d_(d), slots_(static_cast<size_t>(depth + 1) * d) {}

  // The slot the next leaf goes to (the caller writes it, then calls `pushed`).
  double* next() { return slots_.data() + top_ * d_; }

  void pushed() {
    ++top_;
    for (uint64_t n = ++count_; (n & 1) == 0; n >>= 1) merge_top();
  }

  // The slot just written holds the node of the next 4 rows (the caller's `next()`, rows
  // 4k .. 4k+3 summed as ((r0 + r1) + (r2 + r3))): every node pushed so far spans 4 or more.
  void pushed4() {
    ++top_;
    count_ += 4;
    for (uint64_t n = count_ >> 2; (n & 1) == 0; n >>= 1) merge_top();
  }

  // The node of every row pushed (zeros when none was).
  const double* finish() {
    if (top_ == 0) {
      std::fill(slots_.begin(), slots_.begin() + d_, 0.0);
      return slots_.data();
    }
    while (top_ > 1) merge_top();
    return slots_.data();
  }

 private:
  void merge_top() {
    double* __restrict__ left = slots_.data() + (top_ - 2) * d_;
    const double* __restrict__ right = slots_.data() + (top_ - 1) * d_;
#pragma omp simd
    for (int64_t j = 0; j < d_; ++j) left[j] = left[j] + right[j];
    --top_;
  }

  int64_t d_;
  std::vector<double> slots_;
  int64_t top_ = 0;
  uint64_t count_ = 0;
};

int depth_of(int64_t n) {  // ceil(log2(n)), n >= 1
  int k = 0;
  while ((int64_t(1) << k) < n) ++k;
  return k;
}

}  // namespace

template <typename T>
void clip_and_sum(const T* updates, int64_t R, int64_t d, const T* weights, double clip_norm, double noise_std,
                  uint64_t seed, uint64_t counter, double* out, int64_t* clipped, Faults& faults) {
  // Rows per chunk: a power of two (a tree node), chosen from R alone; the value does not depend
  // on it, only the parallelism and the memory (chunks × d doubles) do.
  const int64_t chunk = std::max<int64_t>(64, int64_t(1) << depth_of(std::max<int64_t>(1, (R + 63) / 64)));
  const int64_t chunks = (R + chunk - 1) / chunk;
  std::vector<double> node(static_cast<size_t>(std::max<int64_t>(chunks, 1)) * d);
  int64_t n_clipped = 0;
  const int chunk_depth = depth_of(chunk);
#pragma omp parallel if (R * d > 65536) reduction(+ : n_clipped)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      TreeSum local(d, chunk_depth);
      const int64_t r0 = c * chunk, r1 = std::min(R, (c + 1) * chunk);
      // The scale of row r (0 for a faulty row: the call's result is discarded then).
      // A row's squared norm is summed over 16 lanes (lane l takes j ≡ l mod 16, in increasing j;
      // four independent vector chains, not one latency-bound chain), then the lanes in order:
      // the standalone pass and the pass fused into the previous group's give the same bits.
      constexpr int64_t kLanes = 16;
      const auto square_sum = [&](const double* part) {
        double sq = 0.0;
        for (int64_t l = 0; l < kLanes; ++l) sq += part[l];
        return sq;
      };
      const auto norm_parts = [&](int64_t r, double* part) {
        const T* __restrict__ u = updates + r * d;
        for (int64_t l = 0; l < kLanes; ++l) part[l] = 0.0;
        int64_t j = 0;
        for (; j + kLanes <= d; j += kLanes) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) part[l] += double(u[j + l]) * double(u[j + l]);
        }
        for (; j < d; ++j) part[j % kLanes] += double(u[j]) * double(u[j]);
      };
      // The scale of row r from its squared norm (0 for a faulty row: the result is discarded then).
      const auto scale_from = [&](int64_t r, double sq) {
        const double norm = std::sqrt(sq);
        const double w = weights ? double(weights[r]) : 1.0;
        if (!std::isfinite(norm)) {
          faults.add(r, FaultKind::NonFinite, "updates: row %lld holds a NaN or infinite value (or its norm "
                     "overflows)", ll(r));
          return 0.0;
        }
        if (!(std::isfinite(w) && w >= 0.0 && w <= 1.0)) {
          faults.add(r, std::isfinite(w) ? FaultKind::Value : FaultKind::NonFinite,
                     "weights: expected weights in [0, 1] (a client's contribution is bounded by clip_norm), "
                     "got weights[%lld] = %g", ll(r), w);
          return 0.0;
        }
        if (norm > clip_norm) ++n_clipped;
        return w * (norm > clip_norm ? clip_norm / norm : 1.0);
      };
      const auto scale_of = [&](int64_t r) {
        double part[kLanes];
        norm_parts(r, part);
        return scale_from(r, square_sum(part));
      };
      int64_t r = r0;
      // Four rows at a time: their level-2 node in one pass (the same additions as four leaves
      // pushed one by one), which also sums the squares of the next four rows (so the stream of
      // new rows from memory overlaps the arithmetic on the rows in cache).
      double next[4][kLanes];
      bool have_next = false;
      for (; r + 4 <= r1; r += 4) {
        double s[4];
        for (int k = 0; k < 4; ++k) {
          if (!have_next) norm_parts(r + k, next[k]);
          s[k] = scale_from(r + k, square_sum(next[k]));
        }
        const bool fuse = r + 8 <= r1;
        const T* __restrict__ u0 = updates + r * d;
        const T* __restrict__ u1 = u0 + d;
        const T* __restrict__ u2 = u1 + d;
        const T* __restrict__ u3 = u2 + d;
        double* __restrict__ node4 = local.next();
        const double s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
        if (fuse) {
          const T* __restrict__ v0 = u3 + d;
          const T* __restrict__ v1 = v0 + d;
          const T* __restrict__ v2 = v1 + d;
          const T* __restrict__ v3 = v2 + d;
          double p0[kLanes] = {0.0}, p1[kLanes] = {0.0}, p2[kLanes] = {0.0}, p3[kLanes] = {0.0};
          // the group after next, ahead of the hardware prefetchers (its rows are short streams),
          // into L2 (prefetcht1; into L1 it cost 100,000 x 610 rows 20.0-23.1 ms against
          // 17.4-18.7, one thread, AMD Zen 4); a prefetch is a hint and never faults, past the
          // last row included
          const T* w0 = v3 + d;
          int64_t j = 0;
          for (; j + kLanes <= d; j += kLanes) {
            for (int k = 0; k < 4; ++k)
              for (int64_t b = 0; b < int64_t(kLanes * sizeof(T)); b += 64)
                __builtin_prefetch(reinterpret_cast<const char*>(w0 + k * d + j) + b, 0, 2);
#pragma omp simd
            for (int64_t l = 0; l < kLanes; ++l) {
              const int64_t i = j + l;
              node4[i] = (s0 * double(u0[i]) + s1 * double(u1[i])) + (s2 * double(u2[i]) + s3 * double(u3[i]));
              p0[l] += double(v0[i]) * double(v0[i]);
              p1[l] += double(v1[i]) * double(v1[i]);
              p2[l] += double(v2[i]) * double(v2[i]);
              p3[l] += double(v3[i]) * double(v3[i]);
            }
          }
          for (; j < d; ++j) {
            node4[j] = (s0 * double(u0[j]) + s1 * double(u1[j])) + (s2 * double(u2[j]) + s3 * double(u3[j]));
            p0[j % kLanes] += double(v0[j]) * double(v0[j]);
            p1[j % kLanes] += double(v1[j]) * double(v1[j]);
            p2[j % kLanes] += double(v2[j]) * double(v2[j]);
            p3[j % kLanes] += double(v3[j]) * double(v3[j]);
          }
          for (int64_t l = 0; l < kLanes; ++l) {
            next[0][l] = p0[l];
            next[1][l] = p1[l];
            next[2][l] = p2[l];
            next[3][l] = p3[l];
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j)
            node4[j] = (s0 * double(u0[j]) + s1 * double(u1[j])) + (s2 * double(u2[j]) + s3 * double(u3[j]));
        }
        have_next = fuse;
        local.pushed4();
      }
      for (; r < r1; ++r) {  // the last chunk's last rows, leaf by leaf
        const double scale = scale_of(r);
        const T* __restrict__ u = updates + r * d;
        double* __restrict__ leaf = local.next();
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) leaf[j] = scale * double(u[j]);
        local.pushed();
      }
      const double* total = local.finish();
      std::copy(total, total + d, node.data() + c * d);
    }
  }
  *clipped = n_clipped;
  if (faults.any()) return;
  // The chunks' nodes, combined along the same tree (in order, one thread: chunks × d adds).
  TreeSum top(d, depth_of(std::max<int64_t>(chunks, 1)));
  for (int64_t c = 0; c < chunks; ++c) {
    std::copy(node.data() + c * d, node.data() + (c + 1) * d, top.next());
    top.pushed();
  }
  const double* sum = top.finish();
  const int64_t blocks = (d + 3) / 4;
  parallel_for(d > 16384 && noise_std > 0.0, 0, blocks, 1, [&](int64_t b) {
    double n[4] = {0.0, 0.0, 0.0, 0.0};
    if (noise_std > 0.0) normals4(uint64_t(b), seed, counter, n);
    for (int64_t j = 4 * b; j < std::min(d, 4 * b + 4); ++j) out[j] = sum[j] + noise_std * n[j - 4 * b];
  });
}

void dp_normals(uint64_t seed, uint64_t counter, int64_t n, double* out) {
  for (int64_t b = 0; 4 * b < n; ++b) {
    double v[4];
    normals4(uint64_t(b), seed, counter, v);
    for (int64_t j = 4 * b; j < std::min(n, 4 * b + 4); ++j) out[j] = v[j - 4 * b];
  }
}

template void clip_and_sum<float>(const float*, int64_t, int64_t, const float*, double, double, uint64_t, uint64_t,
                                  double*, int64_t*, Faults&);
template void clip_and_sum<double>(const double*, int64_t, int64_t, const double*, double, double, uint64_t,
                                   uint64_t, double*, int64_t*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
