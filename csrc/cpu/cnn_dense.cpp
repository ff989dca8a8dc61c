// The dense layers of a batched CNN (the classifier after the conv layers: features → hidden
// layers with ReLU → logits), model by model, forward and backward in one call: what
// pflcore/backends/cnn_native.py runs for a chunk's gradient. torch's bmm over the chunk ran these
// small per-model products (M = 120, K = 400, N = 20 rows for the CIFAR-shaped net) at ~55 GFLOP/s
// at one thread (MKL's 256-bit kernels on AMD Zen 5), a fifth of the CIFAR step; each product here
// keeps its whole register block in 512-bit registers where the level has them.
//
// Per model g (parameters and gradient rows any stride apart, every layout row-major):
//   h_0 = feats [n, F];  z_l = h_{l−1} W_lᵀ + b_l  [n, M_l];  h_l = relu(z_l) (l < L)
//   dz_L = w_r·(softmax(z_L) − e_{y_r}) per row r  (the gradient of Σ_r w_r·ce_r)
//   gW_l = dz_lᵀ h_{l−1},  gb_l = Σ_r dz_l[r],  dh_{l−1} = dz_l W_l,  dz_{l−1} = dh_{l−1} ∘ [h_{l−1} > 0]
//   dfeats = dh_0 (the conv layers' pooling backward applies their own ReLU).
// Three products, each a register-blocked kernel: dots (z: rows of h against rows of W, summed
// along K), and one outer-product kernel for gW and dh (a broadcast coefficient times a vector of a
// row). Sums run in a fixed order and nothing is threaded here (the caller runs one chunk per
// thread), so the bits do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "lane_sums.h"
#include "pflcore/ops_cpu.h"
#include "simd.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

namespace {

template <typename T>
struct Dense : simd::Vec<T> {
  using typename simd::Vec<T>::V;
  using simd::Vec<T>::L;
  using simd::Vec<T>::load;
  using simd::Vec<T>::store;
  // dots block without AVX-512 (16 registers): RO outputs × RR rows of accumulators (the AVX-512
  // dots take 4 × 4 below); outer block: RA rows of the output × NB vectors
  static constexpr int RO = 2, RR = 5;
  static constexpr int RA = simd::kRegs >= 32 ? 4 : 2, NB = simd::kRegs >= 32 ? 6 : 5;

  static T hsum(const V& v) {  // by halves
    T h[L];
    std::memcpy(h, &v, sizeof v);
    for (int w = L / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) h[l] += h[l + w];
    return h[0];
  }

  // out[r·M + o] = b[o] + Σ_k x[r·K + k]·W[o·K + k] (ReLU'd when relu), r < n, o < M. A short block
  // repeats its last row / output (computed, not stored).
  static void dots(const T* x, int64_t n, int64_t K, const T* W, const T* b, int64_t M, bool relu, T* out) {
#if defined(__AVX512F__)
    // 4 outputs × 4 rows: 16 accumulators, reduced together (lane_sums_512: ~3 instructions a sum
    // where one horizontal sum takes ~10; the lane-by-lane sum was half of this kernel); the last
    // K mod L values as one zero-masked vector
    constexpr int B4 = 4;
    const int64_t KV = K / L * L;
    const int tail = int(K - KV);
    alignas(64) T sums[B4 * B4];
    // outputs outside, rows inside: a block of W's rows is read from L2 once and reused from L1 by
    // every block of rows (x, n rows of K, stays in L1 at the nets' sizes; rows outside read all of
    // W, 192 KB for the CIFAR head's first layer, once per block of rows)
    for (int64_t o0 = 0; o0 < M; o0 += B4)
      for (int64_t r0 = 0; r0 < n; r0 += B4) {
        const T* xr[B4];
        const T* wr[B4];
        for (int p = 0; p < B4; ++p) xr[p] = x + std::min<int64_t>(r0 + p, n - 1) * K;
        for (int q = 0; q < B4; ++q) wr[q] = W + std::min<int64_t>(o0 + q, M - 1) * K;
        V acc[B4 * B4];
        for (int a = 0; a < B4 * B4; ++a) acc[a] = V{};
        for (int64_t k = 0; k < KV; k += L) {
          V wv[B4];
          for (int q = 0; q < B4; ++q) wv[q] = load(wr[q] + k);
          for (int p = 0; p < B4; ++p) {
            const V xv = load(xr[p] + k);
            for (int q = 0; q < B4; ++q) acc[q * B4 + p] += wv[q] * xv;
          }
        }
        if (tail) {
          V wv[B4];
          for (int q = 0; q < B4; ++q) wv[q] = Dense::load_first(wr[q] + KV, tail);
          for (int p = 0; p < B4; ++p) {
            const V xv = Dense::load_first(xr[p] + KV, tail);
            for (int q = 0; q < B4; ++q) acc[q * B4 + p] += wv[q] * xv;
          }
        }
        for (int h = 0; h < B4 * B4; h += L) lane_sums_512<T>(acc + h, sums + h);
        for (int q = 0; q < B4 && o0 + q < M; ++q)
          for (int p = 0; p < B4 && r0 + p < n; ++p) {
            const T s = sums[q * B4 + p] + b[o0 + q];
            out[(r0 + p) * M + o0 + q] = relu && s < T(0) ? T(0) : s;
          }
      }
#else
    const int64_t KV = K / L * L;
    for (int64_t r0 = 0; r0 < n; r0 += RR)
      for (int64_t o0 = 0; o0 < M; o0 += RO) {
        const T* xr[RR];
        const T* wr[RO];
        for (int p = 0; p < RR; ++p) xr[p] = x + std::min<int64_t>(r0 + p, n - 1) * K;
        for (int q = 0; q < RO; ++q) wr[q] = W + std::min<int64_t>(o0 + q, M - 1) * K;
        V acc[RO][RR];
        for (int q = 0; q < RO; ++q)
          for (int p = 0; p < RR; ++p) acc[q][p] = V{};
        for (int64_t k = 0; k < KV; k += L) {
          V wv[RO];
          for (int q = 0; q < RO; ++q) wv[q] = load(wr[q] + k);
          for (int p = 0; p < RR; ++p) {
            const V xv = load(xr[p] + k);
            for (int q = 0; q < RO; ++q) acc[q][p] += wv[q] * xv;
          }
        }
        for (int q = 0; q < RO && o0 + q < M; ++q)
          for (int p = 0; p < RR && r0 + p < n; ++p) {
            T s = hsum(acc[q][p]);
            for (int64_t k = KV; k < K; ++k) s += xr[p][k] * wr[q][k];
            s += b[o0 + q];
            out[(r0 + p) * M + o0 + q] = relu && s < T(0) ? T(0) : s;
          }
      }
#endif
  }

  // out[a·K + k] = Σ_j C[a·ca + j·cj]·R[j·K + k] for a < A, k < K (j < J in order), times
  // [mask[a·K + k] > 0] where mask is given. NV vectors of k from k0; kTail: one vector of the last
  // K − k0 < L values (zero-masked loads, a masked store; AVX-512 only).
  template <int NV, bool kTail = false>
  static void outer_block(const T* C, int64_t ca, int64_t cj, int64_t a0, int64_t A, int64_t J, const T* R, int64_t K,
                          int64_t k0, const T* mask, T* out) {
    auto get = [&](const T* p) {
#if defined(__AVX512F__)
      if constexpr (kTail) return Dense::load_first(p, int(K - k0));
#endif
      return load(p);
    };
    V acc[RA][NV];
    for (int p = 0; p < RA; ++p)
      for (int v = 0; v < NV; ++v) acc[p][v] = V{};
    const T* cr[RA];
    for (int p = 0; p < RA; ++p) cr[p] = C + std::min<int64_t>(a0 + p, A - 1) * ca;
    for (int64_t j = 0; j < J; ++j) {
      V rv[NV];
      for (int v = 0; v < NV; ++v) rv[v] = get(R + j * K + k0 + v * L);
      for (int p = 0; p < RA; ++p) {
        const V c = simd::splat<V>(cr[p][j * cj]);
        for (int v = 0; v < NV; ++v) acc[p][v] += c * rv[v];
      }
    }
    for (int p = 0; p < RA && a0 + p < A; ++p)
      for (int v = 0; v < NV; ++v) {
        T* o = out + (a0 + p) * K + k0 + v * L;
        V s = acc[p][v];
        if (mask) {
          const V m = get(mask + (a0 + p) * K + k0 + v * L);
          s = m > V{} ? s : V{};
        }
#if defined(__AVX512F__)
        if constexpr (kTail) {
          Dense::store_first(o, s, int(K - k0));
          continue;
        }
#endif
        store(o, s);
      }
  }

  static void outer(const T* C, int64_t ca, int64_t cj, int64_t A, int64_t J, const T* R, int64_t K, const T* mask,
                    T* out) {
    const int64_t KV = K / L * L;
    for (int64_t a0 = 0; a0 < A; a0 += RA) {
      int64_t k0 = 0;
      for (; k0 + NB * L <= KV; k0 += NB * L) outer_block<NB>(C, ca, cj, a0, A, J, R, K, k0, mask, out);
      for (; k0 < KV; k0 += L) outer_block<1>(C, ca, cj, a0, A, J, R, K, k0, mask, out);
      if (KV == K) continue;
#if defined(__AVX512F__)
      outer_block<1, true>(C, ca, cj, a0, A, J, R, K, KV, mask, out);  // the last K − KV columns
#else
      for (int64_t a = a0; a < std::min(A, a0 + RA); ++a)  // the last K − KV columns
        for (int64_t k = KV; k < K; ++k) {
          T s = T(0);
          for (int64_t j = 0; j < J; ++j) s += C[a * ca + j * cj] * R[j * K + k];
          out[a * K + k] = mask && !(mask[a * K + k] > T(0)) ? T(0) : s;
        }
#endif
    }
  }
};

}  // namespace

template <typename T>
void cnn_dense_grad(const T* feats, int64_t G, int64_t n, int64_t Lyr, const int64_t* dims, const T* const* W,
                    const T* const* b, const int64_t* theta_model, const int64_t* y, const T* wts,
                    T* const* gW, T* const* gb, const int64_t* grad_model, T* dfeats) {
  using D = Dense<T>;
  // a model's activations h_1 .. h_L (h_L: logits, then dz_L) and two gradient buffers
  int64_t act = 0, widest = 0;
  for (int64_t l = 1; l <= Lyr; ++l) act += n * dims[l];
  for (int64_t l = 0; l <= Lyr; ++l) widest = std::max(widest, dims[l]);
  std::vector<T> acts(static_cast<size_t>(act)), dz(static_cast<size_t>(n * widest)), dh(static_cast<size_t>(n * widest));
  std::vector<int64_t> at(static_cast<size_t>(Lyr + 1));
  at[0] = 0;
  for (int64_t l = 1; l <= Lyr; ++l) at[size_t(l)] = at[size_t(l - 1)] + (l > 1 ? n * dims[l - 1] : 0);
  const int64_t F = dims[0], C = dims[Lyr];
  for (int64_t g = 0; g < G; ++g) {
    const T* h0 = feats + g * n * F;
    auto h = [&](int64_t l) -> T* { return acts.data() + at[size_t(l)]; };  // h_l, l >= 1
    auto input = [&](int64_t l) -> const T* { return l == 1 ? h0 : h(l - 1); };  // h_{l−1}
    for (int64_t l = 1; l <= Lyr; ++l)
      D::dots(input(l), n, dims[l - 1], W[l - 1] + g * theta_model[2 * (l - 1)],
              b[l - 1] + g * theta_model[2 * (l - 1) + 1], dims[l], l < Lyr, h(l));
    // dz_L = w_r·(softmax(z_r) − e_{y_r})
    T* d = dz.data();
    const T* z = h(Lyr);
    for (int64_t r = 0; r < n; ++r) {
      const T* zr = z + r * C;
      T mx = zr[0];
      for (int64_t c = 1; c < C; ++c) mx = zr[c] > mx ? zr[c] : mx;
      T sum = T(0);
      for (int64_t c = 0; c < C; ++c) {
        d[r * C + c] = std::exp(zr[c] - mx);
        sum += d[r * C + c];
      }
      const T wr = wts[g * n + r], scale = wr / sum;
      for (int64_t c = 0; c < C; ++c) d[r * C + c] *= scale;
      d[r * C + y[g * n + r]] -= wr;
    }
    for (int64_t l = Lyr; l >= 1; --l) {
      const int64_t M = dims[l], K = dims[l - 1];
      const T* hin = input(l);
      // gW_l [M, K] = Σ_r dz[r, o]·h_{l−1}[r, k]; gb_l[o] = Σ_r dz[r, o]
      D::outer(d, 1, M, M, n, hin, K, nullptr, gW[l - 1] + g * grad_model[2 * (l - 1)]);
      T* gbl = gb[l - 1] + g * grad_model[2 * (l - 1) + 1];  // (rows in order for every o: vectorized over o)
      std::fill(gbl, gbl + M, T(0));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t o = 0; o < M; ++o) gbl[o] += d[r * M + o];
      // dh_{l−1} [n, K] = Σ_o dz[r, o]·W_l[o, k], through h_{l−1}'s ReLU below the first layer
      T* target = l == 1 ? dfeats + g * n * F : dh.data();
      D::outer(d, M, 1, n, M, W[l - 1] + g * theta_model[2 * (l - 1)], K, l == 1 ? nullptr : hin, target);
      if (l > 1) std::copy(dh.begin(), dh.begin() + n * K, dz.begin());
    }
  }
}

template <typename T>
void cnn_dense_logits(const T* feats, int64_t G, int64_t n, int64_t Lyr, const int64_t* dims, const T* const* W,
                      const T* const* b, const int64_t* theta_model, T* logits) {
  using D = Dense<T>;
  int64_t widest = 0;
  for (int64_t l = 1; l < Lyr; ++l) widest = std::max(widest, dims[l]);
  std::vector<T> h(static_cast<size_t>(2 * n * widest));  // two hidden layers' activations, in turn
  const int64_t F = dims[0], C = dims[Lyr];
  for (int64_t g = 0; g < G; ++g) {
    const T* in = feats + g * n * F;
    for (int64_t l = 1; l <= Lyr; ++l) {
      T* o = l == Lyr ? logits + g * n * C : h.data() + ((l - 1) % 2) * n * widest;
      D::dots(in, n, dims[l - 1], W[l - 1] + g * theta_model[2 * (l - 1)], b[l - 1] + g * theta_model[2 * (l - 1) + 1],
              dims[l], l < Lyr, o);
      in = o;
    }
  }
}

template void cnn_dense_logits<float>(const float*, int64_t, int64_t, int64_t, const int64_t*, const float* const*,
                                      const float* const*, const int64_t*, float*);
template void cnn_dense_logits<double>(const double*, int64_t, int64_t, int64_t, const int64_t*,
                                       const double* const*, const double* const*, const int64_t*, double*);
template void cnn_dense_grad<float>(const float*, int64_t, int64_t, int64_t, const int64_t*, const float* const*,
                                    const float* const*, const int64_t*, const int64_t*, const float*, float* const*,
                                    float* const*, const int64_t*, float*);
template void cnn_dense_grad<double>(const double*, int64_t, int64_t, int64_t, const int64_t*, const double* const*,
                                     const double* const*, const int64_t*, const int64_t*, const double*,
                                     double* const*, double* const*, const int64_t*, double*);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
