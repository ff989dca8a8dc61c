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
// the pixels the tap read (col2im).
//
// Register blocks: shifted_gemm keeps RB output rows × VB vectors of positions in registers
// (4 × 3 at most: 12 of AVX2's 16 registers), shifted_corr RB gradient rows × TB taps (3 × 4);
// the remainders take smaller instances of the same templates. Vectors are GCC/Clang vector
// types of 32 bytes (one AVX2 register; two SSE registers on the baseline level).
//
// Models (groups) are independent, sums run in a fixed order, and nothing is threaded here: the
// caller runs one chunk of models per thread, so the bits do not depend on the thread count.
#include <cstring>
#include <limits>
#include <vector>

#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
  static constexpr int lanes = 32 / sizeof(T);
  static type load(const T* p) {
    type v;
    std::memcpy(&v, p, sizeof(v));  // unaligned
    return v;
  }
  static void store(T* p, type v) { std::memcpy(p, &v, sizeof(v)); }
  // (vector op scalar broadcasts the scalar: one vbroadcastss from memory, where `type{} + s`
  // would first add to a zero register)
  static type splat(T s) {
    type v = type{};
    return v + s;
  }
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
  for (int64_t t = 0; t < Tn; ++t) {
    const T* s = s0 + off[t];
    v_t x[VB];
    for (int v = 0; v < VB; ++v) x[v] = V::load(s + v * V::lanes);
    for (int r = 0; r < RB; ++r) {
      const T wr = w[r * Tn + t];
      for (int v = 0; v < VB; ++v) acc[r][v] += wr * x[v];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < VB; ++v) V::store(out + r * out_row + q0 + v * V::lanes, acc[r][v]);
}

// Rows [r0, r0 + RB) of one image, every position (P a multiple of the lanes).
template <typename T, int RB>
inline void gemm_rows(const T* src, const int64_t* off, int64_t Tn, const T* w, const T* bias, int64_t P, T* out,
                      int64_t out_row) {
  constexpr int L = Vec<T>::lanes;
  int64_t q = 0;
  for (; q + 3 * L <= P; q += 3 * L) gemm_block<T, RB, 3>(src, off, Tn, w, bias, q, out, out_row);
  if (P - q == 2 * L) gemm_block<T, RB, 2>(src, off, Tn, w, bias, q, out, out_row);
  else if (P - q == L) gemm_block<T, RB, 1>(src, off, Tn, w, bias, q, out, out_row);
}

// dw[r][t] (r < RB, t < TB) += Σ over the group's n images and P positions of a[r][q]·src[q + off[t]].
template <typename T, int RB, int TB>
inline void corr_block(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                       int64_t n, int64_t P, T* dw, int64_t Tn) {
  using V = Vec<T>;
  using v_t = typename V::type;
  v_t acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = v_t{};
  for (int64_t i = 0; i < n; ++i) {
    const T* ai = a + i * a_img;
    const T* si = src + i * src_img;
    for (int64_t q = 0; q < P; q += V::lanes) {
      v_t av[RB];
      for (int r = 0; r < RB; ++r) av[r] = V::load(ai + r * a_row + q);
      for (int t = 0; t < TB; ++t) {
        const v_t x = V::load(si + off[t] + q);
        for (int r = 0; r < RB; ++r) acc[r][t] += av[r] * x;
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) dw[r * Tn + t] = V::sum(acc[r][t]);
}

template <typename T, int RB>
inline void corr_rows(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                      int64_t Tn, int64_t n, int64_t P, T* dw) {
  int64_t t = 0;
  for (; t + 4 <= Tn; t += 4) corr_block<T, RB, 4>(a, a_img, a_row, src, src_img, off + t, n, P, dw + t, Tn);
  switch (Tn - t) {
    case 3: corr_block<T, RB, 3>(a, a_img, a_row, src, src_img, off + t, n, P, dw + t, Tn); break;
    case 2: corr_block<T, RB, 2>(a, a_img, a_row, src, src_img, off + t, n, P, dw + t, Tn); break;
    case 1: corr_block<T, RB, 1>(a, a_img, a_row, src, src_img, off + t, n, P, dw + t, Tn); break;
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
      int64_t r = 0;
      for (; r + 4 <= R; r += 4)
        gemm_rows<T, 4>(s, off, Tn, wg + r * Tn, bg ? bg + r : nullptr, P, o + r * out_row, out_row);
      const T* wr = wg + r * Tn;
      const T* br = bg ? bg + r : nullptr;
      T* orow = o + r * out_row;
      switch (R - r) {
        case 3: gemm_rows<T, 3>(s, off, Tn, wr, br, P, orow, out_row); break;
        case 2: gemm_rows<T, 2>(s, off, Tn, wr, br, P, orow, out_row); break;
        case 1: gemm_rows<T, 1>(s, off, Tn, wr, br, P, orow, out_row); break;
        default: break;
      }
    }
  }
}

// The input gradient in scatter form: for each image and input channel ci,
//   cols[t][q] = Σ_co wt[g][ci][t][co] · dz[i][co][q]       (a shifted GEMM whose taps are the Cout planes)
//   dx[i][ci][q + i_t·Wp + j_t] += cols[t][q]               (t = (i_t, j_t), q < Qv: col2im)
// cols (k²·P values) stays in L1/L2 between the two. The gather form (a full correlation of the
// front-padded dz with the flipped kernel) multiplied zeros for the taps that reach past dz's
// borders: twice the work on the CIFAR net's 10x10 second layer. The tap loop is outside the
// position loop in col2im, so no load reads a vector that the store before it partly wrote.
template <typename T>
void cnn_input_grad(const T* dz, int64_t dz_img, int64_t dz_row, const T* wt, int64_t G, int64_t n, int64_t Cout,
                    int64_t Cin, int64_t k, int64_t Wp, int64_t P, int64_t Qv, T* dx, int64_t dx_img, int64_t dx_row) {
  constexpr int L = Vec<T>::lanes;
  const int64_t K2 = k * k;
  std::vector<int64_t> off(Cout);  // the taps of the GEMM: the output-gradient planes
  for (int64_t co = 0; co < Cout; ++co) off[co] = co * dz_row;
  std::vector<T> cols(K2 * P);
  const int64_t Qvec = Qv - Qv % L;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = g * n; i < (g + 1) * n; ++i) {
      const T* s = dz + i * dz_img;
      for (int64_t ci = 0; ci < Cin; ++ci) {
        const T* w = wt + (g * Cin + ci) * K2 * Cout;  // [k², Cout]
        int64_t r = 0;
        for (; r + 4 <= K2; r += 4) gemm_rows<T, 4>(s, off.data(), Cout, w + r * Cout, nullptr, P, cols.data() + r * P, P);
        switch (K2 - r) {
          case 3: gemm_rows<T, 3>(s, off.data(), Cout, w + r * Cout, nullptr, P, cols.data() + r * P, P); break;
          case 2: gemm_rows<T, 2>(s, off.data(), Cout, w + r * Cout, nullptr, P, cols.data() + r * P, P); break;
          case 1: gemm_rows<T, 1>(s, off.data(), Cout, w + r * Cout, nullptr, P, cols.data() + r * P, P); break;
          default: break;
        }
        T* d = dx + i * dx_img + ci * dx_row;
        std::memset(d, 0, sizeof(T) * dx_row);
        for (int64_t t = 0; t < K2; ++t) {
          T* dt = d + (t / k) * Wp + t % k;
          const T* ct = cols.data() + t * P;
          int64_t q = 0;
          for (; q < Qvec; q += L) Vec<T>::store(dt + q, Vec<T>::load(dt + q) + Vec<T>::load(ct + q));
          for (; q < Qv; ++q) dt[q] += ct[q];
        }
      }
    }
}

template <typename T>
void cnn_shifted_corr(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img, const int64_t* off,
                      int64_t Tn, int64_t G, int64_t n, int64_t R, int64_t P, T* dw, T* db) {
  constexpr int L = Vec<T>::lanes;
  for (int64_t g = 0; g < G; ++g) {
    const T* ag = a + g * n * a_img;
    const T* sg = src + g * n * src_img;
    T* dwg = dw + g * R * Tn;
    int64_t r = 0;
    for (; r + 3 <= R; r += 3) corr_rows<T, 3>(ag + r * a_row, a_img, a_row, sg, src_img, off, Tn, n, P, dwg + r * Tn);
    switch (R - r) {
      case 2: corr_rows<T, 2>(ag + r * a_row, a_img, a_row, sg, src_img, off, Tn, n, P, dwg + r * Tn); break;
      case 1: corr_rows<T, 1>(ag + r * a_row, a_img, a_row, sg, src_img, off, Tn, n, P, dwg + r * Tn); break;
      default: break;
    }
    if (!db) continue;
    for (r = 0; r < R; ++r) {  // the bias gradient: Σ of the row's vectors, then its lanes
      typename Vec<T>::type acc{};
      for (int64_t i = 0; i < n; ++i)
        for (int64_t q = 0; q < P; q += L) acc += Vec<T>::load(ag + i * a_img + r * a_row + q);
      db[g * R + r] = Vec<T>::sum(acc);
    }
  }
}

// One pooled plane: the first maximal input of each window in row-major order (a NaN wins), as
// torch's, and its ReLU. Branch-free selects: the comparisons follow the data, so branches on them
// mispredicted about once a window (~4x the time of the selects on the CIFAR net's first layer).
// POOL > 0: the window size at compile time (the loops unroll); 0: the run-time `pool`.
template <typename T, int POOL>
inline void pool_plane(const T* zc, int64_t Wz, int64_t H2, int64_t W2, int64_t pool_rt, T* oc, int64_t s_y,
                       int64_t s_x, int32_t* ic) {
  const int64_t pool = POOL > 0 ? POOL : pool_rt;
  for (int64_t y = 0; y < H2; ++y)
    for (int64_t x = 0; x < W2; ++x) {
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

template <typename T>
void cnn_pool_relu(const T* z, int64_t N, int64_t C, int64_t z_row, int64_t Wz, int64_t H2, int64_t W2, int64_t pool,
                   int64_t n, T* out, int64_t out_group, int64_t out_img, int64_t s_c, int64_t s_y, int64_t s_x,
                   int32_t* idx) {
  for (int64_t i = 0; i < N; ++i) {
    T* oi = out + (i / n) * out_group + (i % n) * out_img;
    for (int64_t c = 0; c < C; ++c) {
      const T* zc = z + (i * C + c) * z_row;
      int32_t* ic = idx + ((i * C + c) * H2) * W2;
      if (pool == 2) pool_plane<T, 2>(zc, Wz, H2, W2, 2, oi + c * s_c, s_y, s_x, ic);
      else pool_plane<T, 0>(zc, Wz, H2, W2, pool, oi + c * s_c, s_y, s_x, ic);
    }
  }
}

// Every plane of dz (N·C planes of dz_row values from dz) is overwritten: zeros, but the gradient
// at its windows' maxima (front + idx). Zeroing here, a plane at a time while it is in L1, instead
// of a zero-filled buffer from the caller: the buffers are a few MB (past L2), written twice before.
template <typename T>
void cnn_pool_relu_backward(const T* da, const T* h, int64_t N, int64_t C, int64_t H2, int64_t W2, int64_t n,
                            int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x,
                            const int32_t* idx, T* dz, int64_t dz_row, int64_t front) {
  for (int64_t i = 0; i < N; ++i) {
    const int64_t base = (i / n) * in_group + (i % n) * in_img;
    for (int64_t c = 0; c < C; ++c) {
      T* plane = dz + (i * C + c) * dz_row;
      std::memset(plane, 0, sizeof(T) * dz_row);
      T* dc = plane + front;
      const int32_t* ic = idx + ((i * C + c) * H2) * W2;
      for (int64_t y = 0; y < H2; ++y)
        for (int64_t x = 0; x < W2; ++x) {
          const int64_t o = base + c * s_c + y * s_y + x * s_x;
          // the ReLU's gradient, to the window's maximum (windows do not overlap: a store of 0
          // where h <= 0 keeps the zero, without a branch on the data)
          dc[ic[y * W2 + x]] = h[o] > T(0) ? da[o] : T(0);
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
  template void cnn_pool_relu_backward<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                          int64_t, int64_t, int64_t, int64_t, const int32_t*, T*, int64_t, int64_t);
PFLCORE_LEVEL_BEGIN
PFLCORE_CNN_INSTANTIATE(float)
PFLCORE_CNN_INSTANTIATE(double)
PFLCORE_LEVEL_END

}  // namespace pflcore::cpu
