// The symmetric products Y Yᵀ of the rows of one matrix (PERM's screened mixing weights:
// pflcore/algorithms/perm.py, one Gram block per group of clients). torch has no SYRK, and on AMD
// Zen 4/5 MKL's sgemm runs its 256-bit kernels (~113 GFLOP/s at one thread on a core whose 512-bit
// FMAs reach ~270): this computes the upper block triangle only, with a 512-bit register block
// where the level has one, and mirrors it.
//
// out[i, j] = Σ_k Y[i, k]·Y[j, k] in order of k: panels of NR columns j (NV vectors) are packed
// transposed ([d][NR], zero past n) and multiplied by blocks of rows i (broadcast), their
// accumulators in registers; only the rows and vectors that reach the diagonal or above are
// computed (Sym::panel_triangle), then out[i, j] = out[j, i] below the diagonal (so the result is
// exactly symmetric).
// OpenMP threads split the panels, then the mirror; every entry is one thread's fixed-order sum, so
// nothing depends on the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "pflcore/ops_cpu.h"
#include "simd.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

template <typename T>
struct Sym : simd::Vec<T> {
  using typename simd::Vec<T>::V;
  using simd::Vec<T>::L;
  using simd::Vec<T>::load;
  static constexpr int NV = 2, NR = NV * L;
  static constexpr int MR = simd::kRegs >= 32 ? 12 : 6;  // MR·NV accumulators + NV + 1 in the registers
  static constexpr int RD = simd::kRegs >= 32 ? 8 : 4;   // rows of the blocks on and next to the diagonal

  // out[i0 + r, j0 + OFF·L + c] for r < R (rows below n), c < nc, from the panel [d][NR]'s
  // vectors OFF .. OFF + NB
  template <int R, int NB, int OFF>
  static void block(const T* Y, int64_t n, int64_t d, const T* panel, int64_t i0, int64_t j0, int64_t nc, T* out) {
    const T* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = Y + std::min<int64_t>(i0 + r, n - 1) * d;
    // the sums in runs of kRun terms added into totals: the rounding of a sum of d products then
    // grows like kRun + d/kRun instead of d (a single running sum over d = 610 left α 4x further
    // from the float64 solve than MKL's blocked sums did, bench/server_steps.py)
    constexpr int64_t kRun = 64;
    V tot[R][NB];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NB; ++v) tot[r][v] = V{};
    const T* p = panel + OFF * L;
    for (int64_t k0 = 0; k0 < d; k0 += kRun) {
      V acc[R][NB];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NB; ++v) acc[r][v] = V{};
      const int64_t k1 = std::min(d, k0 + kRun);
      for (int64_t k = k0; k < k1; ++k, p += NR) {
        V b[NB];
        for (int v = 0; v < NB; ++v) b[v] = load(p + v * L);
        for (int r = 0; r < R; ++r) {
          const V a = simd::splat<V>(xr[r][k]);
          for (int v = 0; v < NB; ++v) acc[r][v] += a * b[v];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NB; ++v) tot[r][v] += acc[r][v];
    }
    for (int r = 0; r < R && i0 + r < n; ++r) {
      T* o = out + (i0 + r) * n + j0 + OFF * L;
      if (nc == NB * L) {
        std::memcpy(o, &tot[r][0], sizeof tot[r]);
      } else {
        T tmp[NB * L];
        std::memcpy(tmp, &tot[r][0], sizeof tmp);
        std::copy(tmp, tmp + nc, o);
      }
    }
  }

  // The upper block triangle of the panel of columns j0 .. j0 + nj: every row above the panel
  // (blocks of MR rows, then of RD up to j0), then the panel's own rows, each from its first
  // vector that reaches the diagonal: rows j0 .. j0 + L need both vectors, rows j0 + L .. j0 + nj
  // only the second. (Blocks of MR rows straight through the diagonal had computed a 32 x 32
  // square and up to 11 rows past it: ~14% more multiply-adds at 500 x 610.) Every entry is the
  // same sum whatever block computes it; those below the diagonal are mirrored afterwards.
  static void panel_triangle(const T* Y, int64_t n, int64_t d, const T* panel, int64_t j0, int64_t nj, T* out) {
    int64_t i0 = 0;
    for (; i0 + MR <= j0; i0 += MR) block<MR, NV, 0>(Y, n, d, panel, i0, j0, nj, out);
    for (; i0 + RD <= j0; i0 += RD) block<RD, NV, 0>(Y, n, d, panel, i0, j0, nj, out);
    for (; i0 < j0; i0 += 4) block<4, NV, 0>(Y, n, d, panel, i0, j0, nj, out);  // (may run into the panel's rows)
    const int64_t top = std::min<int64_t>(nj, L);
    for (i0 = j0; i0 < j0 + top; i0 += RD) {
      if (nj > L) block<RD, NV, 0>(Y, n, d, panel, i0, j0, nj, out);
      else block<RD, 1, 0>(Y, n, d, panel, i0, j0, nj, out);
    }
    for (i0 = j0 + L; i0 < j0 + nj; i0 += RD) block<RD, 1, 1>(Y, n, d, panel, i0, j0, nj - L, out);
  }
};

// panel[k][c] = Y[j0 + c, k] for c < nj, 0 for nj <= c < NR (the panel of columns j0 .. j0 + nj).
template <typename T, int NR>
void pack_panel(const T* Y, int64_t d, int64_t j0, int64_t nj, T* panel) {
  int64_t k0 = 0;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4 && NR % 16 == 0) {
    // 16 x 16 blocks transposed in registers: the scalar copy below wrote one float per store,
    // ~10% of a 500 x 610 product's time together with the mirror's (AMD Zen 4, perf)
    for (; k0 + 16 <= d; k0 += 16)
      for (int g = 0; g < NR; g += 16) {
        __m512 r[16];
        for (int q = 0; q < 16; ++q)
          r[q] = g + q < nj ? _mm512_loadu_ps(Y + (j0 + g + q) * d + k0) : _mm512_setzero_ps();
        simd::transpose16(r);
        for (int t = 0; t < 16; ++t) _mm512_storeu_ps(panel + (k0 + t) * NR + g, r[t]);
      }
  }
#endif
  for (int64_t c = 0; c < NR; ++c) {  // the rest of the coordinates, one column at a time
    T* col = panel + c;
    if (c < nj) {
      const T* row = Y + (j0 + c) * d;
      for (int64_t k = k0; k < d; ++k) col[k * NR] = row[k];
    } else {
      for (int64_t k = k0; k < d; ++k) col[k * NR] = T(0);
    }
  }
}

// out[i, j] = out[j, i] for j < i, rows ib .. ib + 16 (their entries above the diagonal are computed).
template <typename T>
void mirror_rows(T* out, int64_t n, int64_t ib) {
  const int64_t ie = std::min(n, ib + 16);
  int64_t j0 = 0;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (ie == ib + 16)  // whole 16 x 16 blocks left of the diagonal block, transposed in registers
      for (; j0 + 16 <= ib; j0 += 16) {
        __m512 r[16];
        for (int q = 0; q < 16; ++q) r[q] = _mm512_loadu_ps(out + (j0 + q) * n + ib);
        simd::transpose16(r);
        for (int t = 0; t < 16; ++t) _mm512_storeu_ps(out + (ib + t) * n + j0, r[t]);
      }
  }
#endif
  for (int64_t i = ib; i < ie; ++i)
    for (int64_t j = j0; j < i; ++j) out[i * n + j] = out[j * n + i];
}

}  // namespace

template <typename T>
void sym_products(const T* Y, int64_t n, int64_t d, T* out) {
  using S = Sym<T>;
  constexpr int NR = S::NR;
  if (n <= 0) return;
  const int64_t panels = (n + NR - 1) / NR;
  // panels split between the threads, the last (largest: panel pj holds ~pj + 1 row blocks)
  // first, so that the small ones fill in at the end (dynamic); then the mirror by strips of 16
  // rows. An entry is computed by one thread in a fixed order either way.
#pragma omp parallel if (n * n * d > (int64_t(1) << 22))
  {
    std::vector<T> panel(static_cast<size_t>(d * NR));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < panels; ++task) {
      const int64_t pj = panels - 1 - task;
      const int64_t j0 = pj * NR, nj = std::min<int64_t>(NR, n - j0);
      pack_panel<T, NR>(Y, d, j0, nj, panel.data());
      S::panel_triangle(Y, n, d, panel.data(), j0, nj, out);
    }
    // below the diagonal: the transposes, 16 rows at a time (every entry read there was computed:
    // row j's block starts at or before j < i, within the panel of column i)
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < n; ib += 16) mirror_rows(out, n, ib);
  }
}

template void sym_products<float>(const float*, int64_t, int64_t, float*);
template void sym_products<double>(const double*, int64_t, int64_t, double*);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
