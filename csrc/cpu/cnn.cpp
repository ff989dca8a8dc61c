// Direct convolutions of thin CNN layers (a few to a few tens of channels per model), many models
// at once: the CPU path of the batched CNN (pflcore/backends/cnn_native.py, DESIGN.md on nets).
// oneDNN's grouped convolution ran these layers at 4–25 GFLOP/s at one thread (its input
// gradient worst), far below the machine's GEMM rate.
//
// Layout: every image (one row of one model) is a set of "wide" planes, one per channel: H rows
// of Wp values (Wp: the padded input width) in one flat run. An output position q = y·Wp + x of
// a k×k convolution reads the input at q + i·Wp + j (tap (i, j)), so, over the flat runs, a
// convolution is a GEMM whose right-hand matrix's rows are shifted views of the same input:
//   out[r][q] = Σ_t w[r][t] · src[q + off[t]]          (shifted_gemm: forward)
//   dw[r][t]  = Σ_q a[r][q] · src[q + off[t]]          (shifted_corr: weight gradient)
// with one offset per tap t. Columns x >= Wo of an output row are garbage (they wrap into the
// next input row): never read by the pooling, and zero in every gradient, so they add nothing
// to dw. The input gradient (cnn_input_grad) is the scatter form: the same GEMM with the Cout
// gradient planes as its taps gives, per input channel, each tap's contribution, added back onto
// the pixels the tap read (col2im). After max-pooling, dz is zero but at each window's maximum:
// cnn_pooled_backward takes both gradients from those windows alone (a quarter of the positions
// at 2 x 2 pooling, fewer after the ReLU, and no garbage columns), the dense forms serving
// kernels wider than 8.
//
// Register blocks: 12 accumulators (of AVX2's 16 registers) in every block: shifted_gemm keeps
// RB output rows × VB vectors of positions (4 × 3; 3 × 4 where the rows are a multiple of 3; a
// remainder of 2 or 1 rows as 2 × 6 or 1 × 12), shifted_corr RB gradient rows × TB taps (the
// same shapes), the shorter side's operands live; vector and tap remainders take smaller
// instances of the same templates. On AVX-512 the weight gradient keeps 24 (4 × 6), and rows that
// 6 or 5 divide but 4 does not take 6 × 4 or 5 × 4 blocks in both. shifted_corr runs every block
// over all of a model's images with its accumulators in registers where the model's planes fit
// in L2, else image by image (the accumulators wait in memory between images): the same sums in
// the same order either way. cnn_conv_pool_relu pools each image's conv planes while they are in
// cache. Vectors are GCC/Clang vector types of 64 bytes on the avx512 level, else 32 (one AVX2
// register; two SSE registers on the baseline level).
//
// Models (groups) are independent, sums run in a fixed order, and nothing is threaded here: the
// caller runs one chunk of models per thread, so the bits do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "lane_sums.h"
#include "pflcore/ops_cpu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

// One register: 64 bytes where the level has AVX-512 (its 512-bit FMAs do twice the work of
// 256-bit ones on CPUs with full-width units, Zen 4/5 and Intel's servers), else 32 bytes (one
// AVX2 register; two SSE registers on the baseline level). The layout (pflcore/backends/
// cnn_native.py) rounds every position count up to 16 for either width.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#else
constexpr int kVecBytes = 32;
#endif
// Accumulators of a register block (rows × vectors of shifted_gemm, rows × taps of
// shifted_corr): 12, of AVX2's 16 registers. With AVX-512's 32, forward blocks of 24 measured no
// faster where the rows are a multiple of 4 (MNIST and CIFAR-shaped steps at 1 thread, AMD Zen 5);
// the weight gradient takes 24 (kCorrAccumulators), and rows that 6 or 5 divide but 4 does not
// take 6 × 4 or 5 × 4 blocks in both (gemm_all_rows, corr_images).
constexpr int kAccumulators = 12;
// The weight gradient's working set (a model's output-gradient and input planes) up to which its
// blocks run over every image at once (cnn_shifted_corr): within L2 on the CPUs this targets (AMD
// Zen 2–5: 512 KB–1 MB; Intel's cores since 2019: 512 KB–2 MB), the second layers of the MNIST and
// CIFAR nets (~270–290 KB at B = 20) included.
constexpr int64_t kCorrImagesBytes = 448 * 1024;
#if defined(__AVX512F__)
constexpr int kCorrAccumulators = 24;
#else
constexpr int kCorrAccumulators = kAccumulators;
#endif

template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
  static constexpr int lanes = kVecBytes / sizeof(T);
  static type load(const T* p) {
    type v;
    std::memcpy(&v, p, sizeof(v));  // unaligned
    return v;
  }
  static void store(T* p, type v) { std::memcpy(p, &v, sizeof(v)); }
  // s in every lane: one broadcast load (s − 0 is s for every s; `type{} + s` is not where s = −0,
  // so GCC added it to a zero register first, a vaddss before every broadcast: simd.h's splat)
  static type splat(T s) { return s - type{}; }
  static T sum(type v) {  // fixed order: lane 0 first
    T s = v[0];
    for (int l = 1; l < lanes; ++l) s += v[l];
    return s;
  }
};

// out[r][q] (r < RB, q in [q0, q0 + VB·lanes)) = bias[r] + Σ_t w[r·Tn + t] · src[q + off[t]].
template <typename T, int RB, int VB>
inline void gemm_block(const T* src, const int64_t* off, int64_t Tn, const T* w, const T* bias, int64_t q0, T* out,
                       int64_t out_row) {
  using V = Vec<T>;
  using v_t = typename V::type;
  v_t acc[RB][VB];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < VB; ++v) acc[r][v] = V::splat(bias ? bias[r] : T(0));
  const T* s0 = src + q0;
  // live registers: the RB·VB accumulators and the shorter side's operands (VB input vectors,
  // each row's weight broadcast in turn; or RB broadcasts, each input vector in turn) plus one:
  // 16 at most for every block used here (AVX2 has 16; a 3 × 4 block with 4 input vectors live
  // spilled and ran ~30% slower)
  for (int64_t t = 0; t < Tn; ++t) {
    const T* s = s0 + off[t];
    if constexpr (VB <= RB) {
      v_t x[VB];
      for (int v = 0; v < VB; ++v) x[v] = V::load(s + v * V::lanes);
      for (int r = 0; r < RB; ++r) {
        const T wr = w[r * Tn + t];
        for (int v = 0; v < VB; ++v) acc[r][v] += wr * x[v];
      }
    } else {
      v_t wb[RB];
      for (int r = 0; r < RB; ++r) wb[r] = V::splat(w[r * Tn + t]);
      for (int v = 0; v < VB; ++v) {
        const v_t x = V::load(s + v * V::lanes);
        for (int r = 0; r < RB; ++r) acc[r][v] += wb[r] * x;
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < VB; ++v) V::store(out + r * out_row + q0 + v * V::lanes, acc[r][v]);
}

// Rows [r0, r0 + RB) of one image, positions [q, P) (P − q a multiple of the lanes): blocks of VB
// vectors, then one block of the remaining vectors (fewer than VB).
template <typename T, int RB, int VB>
inline void gemm_rows_from(const T* src, const int64_t* off, int64_t Tn, const T* w, const T* bias, int64_t q,
                           int64_t P, T* out, int64_t out_row) {
  constexpr int L = Vec<T>::lanes;
  for (; q + VB * L <= P; q += VB * L) gemm_block<T, RB, VB>(src, off, Tn, w, bias, q, out, out_row);
  if constexpr (VB > 1) {
    if (q < P) gemm_rows_from<T, RB, VB - 1>(src, off, Tn, w, bias, q, P, out, out_row);
  }
}

// Every row r < R of one image, every position (P a multiple of the lanes). 12 accumulators in
// each block (FMA latency × ports on AVX2 machines: fewer leave the FMA units idle): 4 rows × 3
// vectors, 3 × 4 where R is a multiple of 3 but not of 4, and a remainder of 1 or 2 rows in
// blocks of 12 or 6 vectors (a 2-row remainder in 2 × 3 blocks ran at ~60% of the 4 × 3 rate).
template <typename T>
inline void gemm_all_rows(const T* src, const int64_t* off, int64_t Tn, const T* w, const T* bias, int64_t R,
                          int64_t P, T* out, int64_t out_row) {
  constexpr int A = kAccumulators;
  int64_t r = 0;
#if defined(__AVX512F__)
  // rows not a multiple of 4 that 6 or 5 divide: 6 × 4 or 5 × 4 blocks of AVX-512's registers
  // (each tap's 4 input vectors shared by more rows; no 2-row remainder)
  if (R % 4 != 0 && (R % 6 == 0 || R % 5 == 0)) {
    const int64_t step = R % 6 == 0 ? 6 : 5;
    for (; r < R; r += step) {
      const T* br = bias ? bias + r : nullptr;
      if (step == 6)
        gemm_rows_from<T, 6, 4>(src, off, Tn, w + r * Tn, br, 0, P, out + r * out_row, out_row);
      else
        gemm_rows_from<T, 5, 4>(src, off, Tn, w + r * Tn, br, 0, P, out + r * out_row, out_row);
    }
    return;
  }
#endif
  if (R % 4 != 0 && R % 3 == 0) {
    for (; r < R; r += 3)
      gemm_rows_from<T, 3, A / 3>(src, off, Tn, w + r * Tn, bias ? bias + r : nullptr, 0, P, out + r * out_row,
                                  out_row);
    return;
  }
  for (; r + 4 <= R; r += 4)
    gemm_rows_from<T, 4, A / 4>(src, off, Tn, w + r * Tn, bias ? bias + r : nullptr, 0, P, out + r * out_row,
                                out_row);
  const T* wr = w + r * Tn;
  const T* br = bias ? bias + r : nullptr;
  T* orow = out + r * out_row;
  switch (R - r) {
    case 3: gemm_rows_from<T, 3, A / 3>(src, off, Tn, wr, br, 0, P, orow, out_row); break;
    case 2: gemm_rows_from<T, 2, A / 2>(src, off, Tn, wr, br, 0, P, orow, out_row); break;
    case 1: gemm_rows_from<T, 1, A>(src, off, Tn, wr, br, 0, P, orow, out_row); break;
    default: break;
  }
}

// acc[r][t] (r < RB, t < TB: vectors of per-lane partial sums, rows of Tn) += Σ over the P
// positions of images [0, n) (strides a_img, src_img) of a[r][q]·src[q + off[t]]. The accumulators
// stay in registers across the images: a call per image (n = 1) loads and stores them once per
// image and block, which at the small planes of a second layer (P = 96: 6 vectors) was a third of
// the memory operations.
template <typename T, int RB, int TB>
inline void corr_block(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                       int64_t P, int64_t n, typename Vec<T>::type* acc_mem, int64_t Tn) {
  using V = Vec<T>;
  using v_t = typename V::type;
  v_t acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = acc_mem[r * Tn + t];
  for (int64_t i = 0; i < n; ++i) {
    const T* ai = a + i * a_img;
    const T* si = src + i * src_img;
    for (int64_t q = 0; q < P; q += V::lanes) {
      // the shorter side's vectors live (as in gemm_block)
      if constexpr (RB <= TB) {
        v_t av[RB];
        for (int r = 0; r < RB; ++r) av[r] = V::load(ai + r * a_row + q);
        for (int t = 0; t < TB; ++t) {
          const v_t x = V::load(si + off[t] + q);
          for (int r = 0; r < RB; ++r) acc[r][t] += av[r] * x;
        }
      } else {
        v_t x[TB];
        for (int t = 0; t < TB; ++t) x[t] = V::load(si + off[t] + q);
        for (int r = 0; r < RB; ++r) {
          const v_t ar = V::load(ai + r * a_row + q);
          for (int t = 0; t < TB; ++t) acc[r][t] += ar * x[t];
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc_mem[r * Tn + t] = acc[r][t];
}

// Taps [t, Tn) of rows [r0, r0 + RB): blocks of TB taps, then one of the remaining taps.
template <typename T, int RB, int TB>
inline void corr_taps_from(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img,
                           const int64_t* off, int64_t t, int64_t Tn, int64_t P, int64_t n,
                           typename Vec<T>::type* acc) {
  for (; t + TB <= Tn; t += TB) corr_block<T, RB, TB>(a, a_img, a_row, src, src_img, off + t, P, n, acc + t, Tn);
  if constexpr (TB > 1) {
    if (t < Tn) corr_taps_from<T, RB, TB - 1>(a, a_img, a_row, src, src_img, off, t, Tn, P, n, acc);
  }
}

// Images [0, n)'s contribution to every row and tap; blocks of kCorrAccumulators accumulators (24 on
// AVX-512, else 12), shaped as in gemm_all_rows.
template <typename T>
inline void corr_images(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                        int64_t Tn, int64_t R, int64_t P, int64_t n, typename Vec<T>::type* acc) {
  constexpr int A = kCorrAccumulators;
  int64_t r = 0;
  if constexpr (A >= 24) {
    // (AVX-512) rows not a multiple of 4: 6 rows × 4 taps or 5 × 4 where they divide so (the
    // CIFAR net's 6 channels: 2x; the MNIST net's 10: -25%, against 3 × 8, or 4 × 6 and 2 × 12)
    if (R % 4 != 0 && (R % 6 == 0 || R % 5 == 0)) {
      const int64_t step = R % 6 == 0 ? 6 : 5;
      for (; r < R; r += step) {
        if (step == 6)
          corr_taps_from<T, 6, 4>(a + r * a_row, a_img, a_row, src, src_img, off, 0, Tn, P, n, acc + r * Tn);
        else
          corr_taps_from<T, 5, 4>(a + r * a_row, a_img, a_row, src, src_img, off, 0, Tn, P, n, acc + r * Tn);
      }
      return;
    }
  }
  if (R % 4 != 0 && R % 3 == 0) {
    for (; r < R; r += 3)
      corr_taps_from<T, 3, A / 3>(a + r * a_row, a_img, a_row, src, src_img, off, 0, Tn, P, n, acc + r * Tn);
    return;
  }
  for (; r + 4 <= R; r += 4)
    corr_taps_from<T, 4, A / 4>(a + r * a_row, a_img, a_row, src, src_img, off, 0, Tn, P, n, acc + r * Tn);
  const T* ar = a + r * a_row;
  auto* accr = acc + r * Tn;
  switch (R - r) {
    case 3: corr_taps_from<T, 3, A / 3>(ar, a_img, a_row, src, src_img, off, 0, Tn, P, n, accr); break;
    case 2: corr_taps_from<T, 2, A / 2>(ar, a_img, a_row, src, src_img, off, 0, Tn, P, n, accr); break;
    case 1: corr_taps_from<T, 1, A>(ar, a_img, a_row, src, src_img, off, 0, Tn, P, n, accr); break;
    default: break;
  }
}

}  // namespace

template <typename T>
void cnn_shifted_gemm(const T* src, int64_t src_img, const int64_t* off, int64_t Tn, const T* w, const T* bias,
                      int64_t G, int64_t n, int64_t R, int64_t P, T* out, int64_t out_img, int64_t out_row) {
  for (int64_t g = 0; g < G; ++g) {
    const T* wg = w + g * R * Tn;
    const T* bg = bias ? bias + g * R : nullptr;
    for (int64_t i = g * n; i < (g + 1) * n; ++i) {
      const T* s = src + i * src_img;
      T* o = out + i * out_img;
      gemm_all_rows<T>(s, off, Tn, wg, bg, R, P, o, out_row);
    }
  }
}

template <typename T>
void cnn_input_grad(const T* dz, int64_t dz_img, int64_t dz_row, const T* wt, int64_t G, int64_t n, int64_t Cout,
                    int64_t Cin, int64_t k, int64_t Wp, int64_t P, int64_t Qv, T* dx, int64_t dx_img, int64_t dx_row) {
  using V = Vec<T>;
  const int64_t K2 = k * k;
  std::vector<int64_t> off(Cout);  // the taps of the GEMM: the output-gradient planes
  for (int64_t co = 0; co < Cout; ++co) off[co] = co * dz_row;
  // col2im as a gather: each vector of an input-gradient row sums, tap by tap, the tap planes at
  // its position minus the tap's offset (loads only, one store). Adding each tap plane onto the
  // row in turn (a load and a store per tap, at offsets one element apart) stalled on store-to-load
  // forwarding: 30% of the op. Every tap plane sits in a row of cols between zeros: `lead`
  // before it (the largest offset) and zeros after it to the row's end, so a position a tap does
  // not reach reads a zero (the planes' positions past Qv are zeros too: the output gradient is
  // zero there). Per element the taps add in the same order as before (t ascending) onto zero.
  const int64_t lead = (k - 1) * Wp + (k - 1);
  const int64_t stride = lead + std::max(dx_row, P);
  std::vector<T> cols(K2 * stride);  // zeros, and the GEMM writes [lead, lead + P) of each row
  std::vector<int64_t> from(K2);         // where tap t's plane is read for position 0
  for (int64_t t = 0; t < K2; ++t) from[t] = t * stride + lead - ((t / k) * Wp + t % k);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = g * n; i < (g + 1) * n; ++i) {
      const T* s = dz + i * dz_img;
      for (int64_t ci = 0; ci < Cin; ++ci) {
        const T* w = wt + (g * Cin + ci) * K2 * Cout;  // [k², Cout]
        gemm_all_rows<T>(s, off.data(), Cout, w, nullptr, K2, P, cols.data() + lead, stride);
        T* d = dx + i * dx_img + ci * dx_row;
        int64_t q = 0;
        // four vectors at a time: each vector's sum is a chain of K2 dependent adds, and four
        // independent chains keep the adder busy (one chain at a time was ~2/3 of this op's
        // own time on the CIFAR net's second layer, K2 = 25); each element's sum is unchanged
        constexpr int64_t L = V::lanes;
        for (; q + 4 * L <= dx_row; q += 4 * L) {
          typename V::type a0{}, a1{}, a2{}, a3{};
          for (int64_t t = 0; t < K2; ++t) {
            const T* c = cols.data() + from[t] + q;
            a0 += V::load(c);
            a1 += V::load(c + L);
            a2 += V::load(c + 2 * L);
            a3 += V::load(c + 3 * L);
          }
          V::store(d + q, a0);
          V::store(d + q + L, a1);
          V::store(d + q + 2 * L, a2);
          V::store(d + q + 3 * L, a3);
        }
        for (; q + V::lanes <= dx_row; q += V::lanes) {
          typename V::type acc{};
          for (int64_t t = 0; t < K2; ++t) acc += V::load(cols.data() + from[t] + q);
          V::store(d + q, acc);
        }
        for (; q < dx_row; ++q) {  // (a row that is not a whole number of vectors)
          T acc = T(0);
          for (int64_t t = 0; t < K2; ++t) acc += cols[from[t] + q];
          d[q] = acc;
        }
      }
    }
}

template <typename T>
void cnn_shifted_corr(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                      int64_t Tn, int64_t G, int64_t n, int64_t R, int64_t P, T* dw, T* db) {
  constexpr int L = Vec<T>::lanes;
  std::vector<typename Vec<T>::type> acc(R * Tn);
  for (int64_t g = 0; g < G; ++g) {
    const T* ag = a + g * n * a_img;
    const T* sg = src + g * n * src_img;
    T* dwg = dw + g * R * Tn;
    // Where the model's a and src planes fit in L2 (kCorrImagesBytes), every block runs over all
    // the images with its accumulators in registers; else image by image (its a and src rows stay
    // in L1/L2 across the blocks; the conv1 group of the CIFAR net, ~660 KB, streamed from L3
    // once per block when the images were the inner loop), the blocks' accumulators waiting in
    // acc between images. Either way the same per-lane sums in the same order: the same bits.
    std::fill(acc.begin(), acc.end(), typename Vec<T>::type{});
    if (n * (R * a_row + src_img) * int64_t(sizeof(T)) <= kCorrImagesBytes) {
      corr_images<T>(ag, a_img, a_row, sg, src_img, off, Tn, R, P, n, acc.data());
    } else {
      for (int64_t i = 0; i < n; ++i)
        corr_images<T>(ag + i * a_img, a_img, a_row, sg + i * src_img, src_img, off, Tn, R, P, 1, acc.data());
    }
    lane_sums_each<T>(acc.data(), R * Tn, dwg);  // (the MNIST net's second layer: 5,000 sums a model)
    if (!db) continue;
    for (int64_t r = 0; r < R; ++r) {  // the bias gradient: Σ of the row's vectors, then its lanes
      typename Vec<T>::type acc{};
      for (int64_t i = 0; i < n; ++i)
        for (int64_t q = 0; q < P; q += L) acc += Vec<T>::load(ag + i * a_img + r * a_row + q);
      db[g * R + r] = Vec<T>::sum(acc);
    }
  }
}

namespace {

// A row of up to 8 taps (one kernel row of one input channel): 8 lanes of T (32 bytes for float:
// one AVX2 register, half an AVX-512 one; 256-bit FMAs issue two a cycle on Zen 4, where 512-bit
// ones issue one). Lanes past the kernel width take values that are never used.
template <typename T>
struct Taps8 {
  typedef T V __attribute__((vector_size(8 * sizeof(T))));
  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
};

// A zeroed scratch array whose functions are this level's own (a std::vector<float> instantiated
// here may be the copy the linker keeps for every level: tests/test_cpu_levels.py).
template <typename E>
struct LevelArray {
  explicit LevelArray(size_t n) : p(static_cast<E*>(::operator new(std::max<size_t>(n, 1) * sizeof(E), std::align_val_t(64)))) {
    std::memset(static_cast<void*>(p), 0, std::max<size_t>(n, 1) * sizeof(E));
  }
  ~LevelArray() { ::operator delete(static_cast<void*>(p), std::align_val_t(64)); }
  LevelArray(const LevelArray&) = delete;
  LevelArray& operator=(const LevelArray&) = delete;
  E* data() { return p; }
  E& operator[](size_t i) { return p[i]; }
  E* p;
};

// Accumulators of one pooled_block (CB input channels × K kernel rows): the level's registers
// less four (the broadcast gradient, a loaded row, addresses), in units of its registers.
template <typename T>
constexpr int pooled_accumulators() {
  constexpr int per = int(8 * sizeof(T)) > kVecBytes ? int(8 * sizeof(T)) / kVecBytes : 1;
#if defined(__AVX512F__)
  constexpr int regs = 32;
#else
  constexpr int regs = 16;
#endif
  return std::min(24, (regs - 4) / per);
}

// tot[c·K + i] (taps (c, i, 0..K) of input channels [0, CB) of s) += Σ_e g[e]·s[q[e] + c·L + i·Wp + (0..8)].
// One chain per accumulator over the cnt windows of one image (≤ H2·W2 terms), added to the totals.
template <typename T, int K, int CB>
inline void pooled_block(const T* g, const int32_t* q, int64_t cnt, const T* s, int64_t L, int64_t Wp,
                         typename Taps8<T>::V* tot) {
  using V = typename Taps8<T>::V;
  V acc[CB][K];
  for (int c = 0; c < CB; ++c)
    for (int i = 0; i < K; ++i) acc[c][i] = V{};
  for (int64_t e = 0; e < cnt; ++e) {
    const T* b = s + q[e];
    const V gv = g[e] - V{};  // a broadcast (see Vec::splat)
    for (int c = 0; c < CB; ++c)
      for (int i = 0; i < K; ++i) acc[c][i] += gv * Taps8<T>::load(b + c * L + i * Wp);
  }
  for (int c = 0; c < CB; ++c)
    for (int i = 0; i < K; ++i) tot[c * K + i] += acc[c][i];
}

// Input channels [c, Cin) in blocks of CB, then one block of the rest.
template <typename T, int K, int CB>
inline void pooled_channels_from(const T* g, const int32_t* q, int64_t cnt, const T* s, int64_t L, int64_t Wp,
                                 int64_t c, int64_t Cin, typename Taps8<T>::V* tot) {
  for (; c + CB <= Cin; c += CB) pooled_block<T, K, CB>(g, q, cnt, s + c * L, L, Wp, tot + c * K);
  if constexpr (CB > 1) {
    if (c < Cin) pooled_channels_from<T, K, CB - 1>(g, q, cnt, s, L, Wp, c, Cin, tot);
  }
}

template <typename T, int K>
inline void pooled_taps(const T* g, const int32_t* q, int64_t cnt, const T* s, int64_t L, int64_t Wp, int64_t Cin,
                        typename Taps8<T>::V* tot) {
  constexpr int CB = std::max(1, pooled_accumulators<T>() / K);
  pooled_channels_from<T, K, CB>(g, q, cnt, s, L, Wp, 0, Cin, tot);
}

// dx[c·dx_row + q + i·Wp + (0..k)] += g·w[c][i][0..k] for the input channels c < Cin and kernel
// rows i < k of one window at its maximum q (w: [Cin][k][8], zero past k): 8-lane read-modify-writes
// whose lanes past k add exactly 0 (g finite; the caller takes the others), each up to 7 values
// past its row: those inside the image's planes (zeroed, or written by this thread's earlier windows)
// add 0 there; where the last could pass `end`, one value at a time. Successive windows of a
// channel overlap: their rows are Cin·k writes apart (30 on the CIFAR net's second layer), which
// keeps a read from waiting on the store of the window just before.
template <typename T>
inline void scatter_window(T* dx, int64_t dx_row, int64_t q, int64_t Wp, int64_t Cin, int64_t k, T g, const T* w,
                           const T* end) {
  using V = typename Taps8<T>::V;
  const V gv = g - V{};  // a broadcast (see Vec::splat)
  if (dx + (Cin - 1) * dx_row + q + (k - 1) * Wp + 8 <= end) {
    for (int64_t c = 0; c < Cin; ++c)
      for (int64_t i = 0; i < k; ++i) {
        T* d = dx + c * dx_row + q + i * Wp;
        const V v = Taps8<T>::load(d) + gv * Taps8<T>::load(w + (c * k + i) * 8);
        std::memcpy(d, &v, sizeof v);
      }
    return;
  }
  for (int64_t c = 0; c < Cin; ++c)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < k; ++j) dx[c * dx_row + q + i * Wp + j] += g * w[(c * k + i) * 8 + j];
}

// The lanes of an intrinsics register of this level (one Vec<T>: 16 floats on AVX-512, 8 on
// AVX2) summed in Vec<T>::sum's fixed order.
template <typename T, typename R>
inline T register_sum(const R& reg) {
  typename Vec<T>::type lanes;
  static_assert(sizeof lanes == sizeof reg, "one register of this level");
  std::memcpy(&lanes, &reg, sizeof lanes);
  return Vec<T>::sum(lanes);
}

// The windows of one channel of one image whose gradient (da where h > 0, the ReLU's gradient as in
// cnn_pool_relu_backward) is not 0, compacted into (g, q) in order: their gradients and maxima idx;
// returns how many; *db += the sum of every window's gradient. A NaN stays (it reaches the
// gradients, as in the dense sums). Without a branch on the data: every window is written and the
// count advances where it stays; on AVX-512, rows of windows 16 at a time (compressed in registers,
// a masked store: compress straight to memory is slow on Zen 4), on AVX2 8 at a time, with the bias
// in lanes.
template <typename T>
inline int64_t keep_windows(const T* da, const T* h, const int32_t* idx, int64_t H2, int64_t W2, int64_t s_y,
                            int64_t s_x, T* g, int32_t* q, T* db) {
  int64_t cnt = 0;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (s_x == 1) {
      __m512 bias = _mm512_setzero_ps();
      for (int64_t y = 0; y < H2; ++y)
        for (int64_t x = 0; x < W2; x += 16) {
          const int64_t left = W2 - x;
          const __mmask16 in = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
          const __m512 hv = _mm512_maskz_loadu_ps(in, h + y * s_y + x);
          const __m512 dv = _mm512_maskz_loadu_ps(in, da + y * s_y + x);
          const __m512i iv = _mm512_maskz_loadu_epi32(in, idx + y * W2 + x);
          const __m512 gv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(hv, _mm512_setzero_ps(), _CMP_GT_OQ), dv);
          const __mmask16 keep = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_NEQ_UQ) & in;
          const int count = __builtin_popcount(unsigned(keep));
          const __mmask16 front = __mmask16((1u << count) - 1u);
          _mm512_mask_storeu_ps(g + cnt, front, _mm512_maskz_compress_ps(keep, gv));
          _mm512_mask_storeu_epi32(q + cnt, front, _mm512_maskz_compress_epi32(keep, iv));
          bias = _mm512_add_ps(bias, gv);
          cnt += count;
        }
      *db += register_sum<T>(bias);
      return cnt;
    }
  }
#elif defined(__AVX2__)
  if constexpr (sizeof(T) == 4) {
    if (s_x == 1) {
      // AVX2 has no compress: the kept lanes gathered to the front by a permutation looked up by
      // the 8-bit mask (the whole 8 lanes stored: g and q hold 8 values past the windows)
      struct Front {
        alignas(32) int32_t lanes[256][8];
        Front() {
          for (int m = 0; m < 256; ++m) {
            int c = 0;
            for (int l = 0; l < 8; ++l)
              if (m >> l & 1) lanes[m][c++] = l;
            while (c < 8) lanes[m][c++] = 0;
          }
        }
      };
      static const Front front;
      const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 zero = _mm256_setzero_ps();
      __m256 bias = zero;
      for (int64_t y = 0; y < H2; ++y)
        for (int64_t x = 0; x < W2; x += 8) {
          const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(W2 - x, 8))), iota);
          const __m256 hv = _mm256_maskload_ps(h + y * s_y + x, in);
          const __m256 dv = _mm256_maskload_ps(da + y * s_y + x, in);
          const __m256i iv = _mm256_maskload_epi32(idx + y * W2 + x, in);
          const __m256 gv = _mm256_and_ps(_mm256_cmp_ps(hv, zero, _CMP_GT_OQ), dv);
          const int keep = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(gv, zero, _CMP_NEQ_UQ),
                                                            _mm256_castsi256_ps(in)));
          const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(front.lanes[keep]));
          _mm256_storeu_ps(g + cnt, _mm256_permutevar8x32_ps(gv, perm));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + cnt), _mm256_permutevar8x32_epi32(iv, perm));
          bias = _mm256_add_ps(bias, gv);
          cnt += __builtin_popcount(unsigned(keep));
        }
      *db += register_sum<T>(bias);
      return cnt;
    }
  }
#endif
  T bias = T(0);
  for (int64_t y = 0; y < H2; ++y)
    for (int64_t x = 0; x < W2; ++x) {
      const int64_t o = y * s_y + x * s_x;
      const T gv = h[o] > T(0) ? da[o] : T(0);
      g[cnt] = gv;
      q[cnt] = idx[y * W2 + x];
      cnt += !(gv == T(0));
      bias += gv;
    }
  *db += bias;
  return cnt;
}

}  // namespace

template <typename T>
void cnn_pooled_backward(const T* da, const T* h, int64_t G, int64_t n, int64_t C, int64_t H2, int64_t W2,
                         int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x, const int32_t* idx,
                         const T* src, int64_t src_img, int64_t L, int64_t Wp, int64_t Cin, int64_t k, T* dw,
                         int64_t dw_model, T* db, int64_t db_model, const T* wt, T* dx, int64_t dx_img,
                         int64_t dx_row) {
  using V = typename Taps8<T>::V;
  const int64_t W = H2 * W2, K2 = k * k, NA = Cin * k;
  LevelArray<T> gl(static_cast<size_t>(W + 8));  // (keep_windows' AVX2 form stores 8 lanes past its count)
  LevelArray<int32_t> ql(static_cast<size_t>(W + 8));
  LevelArray<V> tot(static_cast<size_t>(C * NA));
  // the input gradient's weights of one model, [C][Cin][k][8] (zero past k), from wt [Cin][k²][C]
  LevelArray<T> w8(static_cast<size_t>(dx ? C * NA * 8 : 0));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t a = 0; a < C * NA; ++a) tot[size_t(a)] = V{};
    T* dbg = db + g * db_model;
    for (int64_t r = 0; r < C; ++r) dbg[r] = T(0);
    if (dx) {
      const T* wg = wt + g * Cin * K2 * C;
      for (int64_t r = 0; r < C; ++r)
        for (int64_t a = 0; a < NA; ++a)  // a = ci·k + ti
          for (int64_t j = 0; j < 8; ++j)
            w8[size_t((r * NA + a) * 8 + j)] = j < k ? wg[((a / k) * K2 + (a % k) * k + j) * C + r] : T(0);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t img = g * n + i;
      const T* si = src + img * src_img;
      T* dxi = dx ? dx + img * dx_img : nullptr;
      if (dx)
        for (int64_t c = 0; c < Cin; ++c) std::memset(static_cast<void*>(dxi + c * dx_row), 0, sizeof(T) * dx_row);
      for (int64_t r = 0; r < C; ++r) {
        // the channel's windows whose gradient is not 0, then the taps they reach
        const int32_t* ir = idx + (img * C + r) * W;
        const T* dar = da + g * in_group + i * in_img + r * s_c;
        const T* hr = h + g * in_group + i * in_img + r * s_c;
        const int64_t cnt = keep_windows<T>(dar, hr, ir, H2, W2, s_y, s_x, gl.data(), ql.data(), dbg + r);
        V* tr = tot.data() + r * NA;
        switch (k) {
          case 1: pooled_taps<T, 1>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 2: pooled_taps<T, 2>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 3: pooled_taps<T, 3>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 4: pooled_taps<T, 4>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 5: pooled_taps<T, 5>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 6: pooled_taps<T, 6>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          case 7: pooled_taps<T, 7>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
          default: pooled_taps<T, 8>(gl.data(), ql.data(), cnt, si, L, Wp, Cin, tr); break;
        }
        if (!dx) continue;
        const T* wr = w8.data() + r * NA * 8;
        const T* end = dxi + Cin * dx_row;
        for (int64_t e = 0; e < cnt; ++e) {
          const T gv = gl[size_t(e)];
          // (a non-finite gradient: its k lanes alone, so that NaN·0 reaches no other position)
          scatter_window<T>(dxi, dx_row, ql[size_t(e)], Wp, Cin, k, gv, wr, std::isfinite(gv) ? end : dxi);
        }
      }
    }
    T* dwg = dw + g * dw_model;
    for (int64_t r = 0; r < C; ++r)
      for (int64_t a = 0; a < NA; ++a)  // a = ci·k + ti: taps (ci, ti, 0..k) = dw[r][ci][ti][..]
        for (int64_t j = 0; j < k; ++j) dwg[r * Cin * K2 + a * k + j] = tot[size_t(r * NA + a)][j];
  }
}

// One pooled plane: the first maximal input of each window in row-major order (a NaN wins), as
// torch's, and its ReLU. Branch-free selects: the comparisons follow the data, so branches on them
// mispredicted about once a window (~4x the time of the selects on the CIFAR net's first layer).
// POOL > 0: the window size at compile time (the loops unroll); 0: the run-time `pool`. Columns
// from x_from (those before: pool2_vec).
template <typename T, int POOL>
inline void pool_plane(const T* zc, int64_t Wz, int64_t H2, int64_t W2, int64_t pool_rt, T* oc, int64_t s_y,
                       int64_t s_x, int32_t* ic, int64_t x_from) {
  const int64_t pool = POOL > 0 ? POOL : pool_rt;
  for (int64_t y = 0; y < H2; ++y)
    for (int64_t x = x_from; x < W2; ++x) {
      const int64_t q0 = (y * pool) * Wz + x * pool;
      int64_t best = q0;
      T m = zc[q0];
      for (int64_t u = 0; u < pool; ++u)
        for (int64_t v = 0; v < pool; ++v) {
          const int64_t q = q0 + u * Wz + v;
          const T val = zc[q];
          const bool take = (val > m) | (val != val);
          m = take ? val : m;
          best = take ? q : best;
        }
      ic[y * W2 + x] = static_cast<int32_t>(best);
      oc[y * s_y + x * s_x] = m > T(0) ? m : (m != m ? m : T(0));  // relu
    }
}

// Lane types of the pooling's index vectors: as wide as T (the comparisons' masks), int32 in memory.
template <typename T> struct IdxOf;
template <> struct IdxOf<float> { typedef int32_t type; };
template <> struct IdxOf<double> { typedef int64_t type; };

// pool_plane<T, 2> for the windows [x0, x0 + lanes) of pooled row y, a window per lane: the rows'
// values split into even and odd columns, then the same selects in the same order (so the same
// first maximum, a NaN winning) over whole vectors.
template <typename T>
__attribute__((always_inline)) inline void pool2_vec(const T* zc, int64_t Wz, int64_t y, int64_t x0, int64_t W2, T* oc, int64_t s_y, int64_t s_x,
                      int32_t* ic, int count) {
  using V = Vec<T>;
  using v_t = typename V::type;
  constexpr int L = V::lanes;
  typedef typename IdxOf<T>::type I;
  typedef I i_t __attribute__((vector_size(kVecBytes)));
  i_t even_i, odd_i;
  for (int l = 0; l < L; ++l) {
    even_i[l] = 2 * l;
    odd_i[l] = 2 * l + 1;
  }
  const int64_t q0 = 2 * y * Wz + 2 * x0;
  const T* r0 = zc + q0;
  v_t m{}, vals[3];
  for (int u = 0; u < 2; ++u) {
    const v_t lo = V::load(r0 + u * Wz), hi = V::load(r0 + u * Wz + L);
    const v_t ev = __builtin_shuffle(lo, hi, even_i), od = __builtin_shuffle(lo, hi, odd_i);
    if (u == 0) {
      m = ev;
      vals[0] = od;
    } else {
      vals[1] = ev;
      vals[2] = od;
    }
  }
  i_t best = even_i + static_cast<I>(q0);  // the window's first position
  const I step[3] = {1, static_cast<I>(Wz), static_cast<I>(Wz + 1)};
  for (int k = 0; k < 3; ++k) {
    const v_t val = vals[k];
    const i_t take = (val > m) | (val != val);
    m = take ? val : m;
    best = take ? even_i + static_cast<I>(q0 + step[k]) : best;
  }
  const v_t zero{};
  const v_t out = (m > zero) | (m != m) ? m : zero;  // relu (a NaN stays)
  // the first `count` windows stored (a partial vector: the lanes past the row computed what the
  // reads past it held, and are dropped)
  // (AVX-512: masked stores; a memcpy of a run-time length was a libc call per row)
  T* o = oc + y * s_y + x0 * s_x;
  int32_t* io = ic + y * W2 + x0;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (s_x == 1) {
      const __mmask16 k = static_cast<__mmask16>((1u << count) - 1u);
      _mm512_mask_storeu_ps(o, k, reinterpret_cast<__m512>(out));
      _mm512_mask_storeu_epi32(io, k, reinterpret_cast<__m512i>(best));
      return;
    }
  }
#endif
  if (s_x == 1) {
    for (int l = 0; l < count; ++l) o[l] = out[l];
  } else {
    for (int l = 0; l < count; ++l) o[l * s_x] = out[l];
  }
  for (int l = 0; l < count; ++l) io[l] = static_cast<int32_t>(best[l]);
}

// The C planes of one image (z_row apart) pooled into oi (channels s_c apart), indices into ii.
// z_slack: 2·lanes readable values follow the last plane, so that a row's last, partial vector
// of windows may read past the row (the papers' nets' rows of 12, 14, 4 and 5 windows are all
// shorter than 16 lanes: one window at a time, the selects became branches that mispredicted).
template <typename T>
inline void pool_image(const T* z, int64_t C, int64_t z_row, int64_t Wz, int64_t H2, int64_t W2, int64_t pool, T* oi,
                       int64_t s_c, int64_t s_y, int64_t s_x, int32_t* ii, bool z_slack = false) {
    for (int64_t c = 0; c < C; ++c) {
      const T* zc = z + c * z_row;
      int32_t* ic = ii + c * H2 * W2;
      if (pool == 2) {
        // whole vectors of windows where their 2·lanes columns lie inside the row (2·W2 <= Wz), the
        // rest one partial vector (z_slack) or one window at a time
        constexpr int L = Vec<T>::lanes;
        const int64_t Wv = W2 - W2 % L;
        const bool partial = z_slack && Wv < W2;
        for (int64_t y = 0; y < H2; ++y) {
          for (int64_t x = 0; x < Wv; x += L) pool2_vec<T>(zc, Wz, y, x, W2, oi + c * s_c, s_y, s_x, ic, L);
          if (partial) pool2_vec<T>(zc, Wz, y, Wv, W2, oi + c * s_c, s_y, s_x, ic, int(W2 - Wv));
        }
        if (Wv < W2 && !partial) pool_plane<T, 2>(zc, Wz, H2, W2, 2, oi + c * s_c, s_y, s_x, ic, Wv);
      } else {
        pool_plane<T, 0>(zc, Wz, H2, W2, pool, oi + c * s_c, s_y, s_x, ic, 0);
      }
    }
}

template <typename T>
void cnn_pool_relu(const T* z, int64_t N, int64_t C, int64_t z_row, int64_t Wz, int64_t H2, int64_t W2, int64_t pool,
                   int64_t n, T* out, int64_t out_group, int64_t out_img, int64_t s_c, int64_t s_y, int64_t s_x,
                   int32_t* idx) {
  for (int64_t i = 0; i < N; ++i)
    pool_image<T>(z + i * C * z_row, C, z_row, Wz, H2, W2, pool, out + (i / n) * out_group + (i % n) * out_img, s_c,
                  s_y, s_x, idx + i * C * H2 * W2);
}

// cnn_shifted_gemm (the R output planes of P positions, bias added) then cnn_pool_relu, one image
// at a time: its output planes (R·P values, 21 KB on the CIFAR net's first layer) stay in L1/L2
// between the two instead of a buffer of every image's (MBs: written, then read back from L3).
template <typename T>
void cnn_conv_pool_relu(const T* src, int64_t src_img, const int64_t* off, int64_t Tn, const T* w, const T* bias,
                        int64_t G, int64_t n, int64_t R, int64_t P, int64_t Wz, int64_t H2, int64_t W2, int64_t pool,
                        T* out, int64_t out_group, int64_t out_img, int64_t s_c, int64_t s_y, int64_t s_x,
                        int32_t* idx) {
  std::vector<T> z(R * P + 2 * Vec<T>::lanes);  // (the slack: pool_image's partial vectors)
  for (int64_t g = 0; g < G; ++g) {
    const T* wg = w + g * R * Tn;
    const T* bg = bias ? bias + g * R : nullptr;
    for (int64_t i = g * n; i < (g + 1) * n; ++i) {
      gemm_all_rows<T>(src + i * src_img, off, Tn, wg, bg, R, P, z.data(), P);
      pool_image<T>(z.data(), R, P, Wz, H2, W2, pool, out + g * out_group + (i - g * n) * out_img, s_c, s_y, s_x,
                    idx + i * R * H2 * W2, true);
    }
  }
}

// Every plane of dz (N·C planes of dz_row values from dz) is overwritten: zeros, but the gradient
// at its windows' maxima (idx). Zeroing here, a plane at a time while it is in L1, instead
// of a zero-filled buffer from the caller: the buffers are a few MB (past L2), written twice before.
template <typename T>
void cnn_pool_relu_backward(const T* da, const T* h, int64_t N, int64_t C, int64_t H2, int64_t W2, int64_t n,
                            int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x,
                            const int32_t* idx, T* dz, int64_t dz_row) {
  for (int64_t i = 0; i < N; ++i) {
    const int64_t base = (i / n) * in_group + (i % n) * in_img;
    for (int64_t c = 0; c < C; ++c) {
      T* plane = dz + (i * C + c) * dz_row;
      std::memset(plane, 0, sizeof(T) * dz_row);
      const int32_t* ic = idx + ((i * C + c) * H2) * W2;
      for (int64_t y = 0; y < H2; ++y)
        for (int64_t x = 0; x < W2; ++x) {
          const int64_t o = base + c * s_c + y * s_y + x * s_x;
          // the ReLU's gradient, to the window's maximum (windows do not overlap: a store of 0
          // where h <= 0 keeps the zero, without a branch on the data)
          plane[ic[y * W2 + x]] = h[o] > T(0) ? da[o] : T(0);
        }
    }
  }
}

PFLCORE_LEVEL_END

#define PFLCORE_CNN_INSTANTIATE(T)                                                                                    \
  template void cnn_shifted_gemm<T>(const T*, int64_t, const int64_t*, int64_t, const T*, const T*, int64_t, int64_t, \
                                    int64_t, int64_t, T*, int64_t, int64_t);                                          \
  template void cnn_input_grad<T>(const T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                  int64_t, int64_t, int64_t, T*, int64_t, int64_t);                                   \
  template void cnn_shifted_corr<T>(const T*, int64_t, int64_t, const T*, int64_t, const int64_t*, int64_t, int64_t,  \
                                    int64_t, int64_t, int64_t, T*, T*);                                               \
  template void cnn_pool_relu<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                 T*, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t*);                          \
  template void cnn_conv_pool_relu<T>(const T*, int64_t, const int64_t*, int64_t, const T*, const T*, int64_t,        \
                                      int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, T*, int64_t,     \
                                      int64_t, int64_t, int64_t, int64_t, int32_t*);                                  \
  template void cnn_pool_relu_backward<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                          int64_t, int64_t, int64_t, int64_t, const int32_t*, T*, int64_t);            \
  template void cnn_pooled_backward<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,      \
                                       int64_t, int64_t, int64_t, int64_t, const int32_t*, const T*, int64_t, int64_t, \
                                       int64_t, int64_t, int64_t, T*, int64_t, T*, int64_t, const T*, T*, int64_t,     \
                                       int64_t);
PFLCORE_LEVEL_BEGIN
PFLCORE_CNN_INSTANTIATE(float)
PFLCORE_CNN_INSTANTIATE(double)
PFLCORE_LEVEL_END

}  // namespace pflcore::cpu
