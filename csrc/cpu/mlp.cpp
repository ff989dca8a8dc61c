// Minibatch SGD steps of a one-hidden-layer MLP (p → H → C, ReLU, cross-entropy), float,
// C <= 16 and H <= 128: the native part of the nets backend's hand-written MLP path
// (pflcore/backends/nets.py). Its caller has validated every index and value (the torch value
// pre-pass), so nothing here checks them again.
//
// One model row at a time per thread (rows never share a sum: results do not depend on the
// thread count). A row's parameters move once into layouts whose inner loops are whole 16-lane
// registers, and back after its steps:
//   A1 [p + 1, HP]   A1[k, h] = W1[h, k], the bias in row p (HP = H rounded up to 16)
//   A2 [H + 1, 16]   A2[h, c] = W2[c, h], the bias in row H
//   A2T [C, HP]      W2 itself, for the hidden layer's gradient (rebuilt from A2 every step)
// A step runs over blocks of 4 rows (the last block repeats its last row with zero loss
// gradient): hidden h = relu(x A1), logits z = h A2, dz = softmax(z) − e_y (the transposed
// softmax of the GLM row path), G2 += hᵀ dz, dh = (dz A2T) ∘ [h > 0], G1 += xᵀ dh; then
// W ← W − lr·(scale·G + l2·W + prox·(W − anchor)) on both layers.
#include "pflcore/ops_cpu.h"
#include "glm_minibatch.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#include "pflcore/aligned.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

#ifdef PFLCORE_ROWPATH_AVX512
namespace {

using minibatch::avx512::Block;
using minibatch::avx512::first_lanes;

constexpr int kRows = 4;  // rows per block

struct MlpWorkspace {
  aligned_vector<float> A1, G1, N1, A2, G2, N2, A2T, hidden, dh;  // cache-line aligned (pflcore/aligned.h)
  void prepare(int64_t p, int64_t HP, int64_t H) {
    grow(A1, (p + 1) * HP);
    grow(G1, (p + 1) * HP);
    grow(N1, (p + 1) * HP);
    grow(A2, (H + 1) * 16);
    grow(G2, (H + 1) * 16);
    grow(N2, (H + 1) * 16);
    grow(A2T, 16 * HP);
    grow(hidden, kRows * HP);
    grow(dh, kRows * HP);
  }
  static void grow(aligned_vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
  static MlpWorkspace& local() {
    static thread_local MlpWorkspace ws;
    return ws;
  }
};

// theta's row [W1 (H×p), b1 (H), W2 (C×H), b2 (C)] -> A1 [p + 1, HP], A2 [H + 1, 16] (zero padding).
// W1's transpose by gathers: 16 hidden units of one feature per instruction.
void to_kernel_layout(const float* th, int64_t p, int64_t H, int64_t C, int64_t HP, float* A1, float* A2) {
  const float *W1 = th, *b1 = th + H * p, *W2 = b1 + H, *b2 = W2 + C * H;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i stride = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(p)));
  for (int64_t h0 = 0; h0 < HP; h0 += 16) {
    const __mmask16 live = first_lanes(H - h0);
    const float* base = W1 + h0 * p;
    for (int64_t k = 0; k < p; ++k)
      _mm512_storeu_ps(A1 + k * HP + h0,
                       _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, stride, base + k, 4));
    _mm512_storeu_ps(A1 + p * HP + h0, _mm512_maskz_loadu_ps(live, b1 + h0));
  }
  std::fill(A2, A2 + (H + 1) * 16, 0.0f);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < H; ++h) A2[h * 16 + c] = W2[c * H + h];
  for (int64_t c = 0; c < C; ++c) A2[H * 16 + c] = b2[c];
}

void from_kernel_layout(float* th, int64_t p, int64_t H, int64_t C, int64_t HP, const float* A1, const float* A2) {
  float *W1 = th, *b1 = th + H * p, *W2 = b1 + H, *b2 = W2 + C * H;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i stride = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(HP)));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k0 = 0; k0 < p; k0 += 16) {
      const __mmask16 live = first_lanes(p - k0);
      _mm512_mask_storeu_ps(W1 + h * p + k0, live,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, stride, A1 + k0 * HP + h, 4));
    }
  for (int64_t h = 0; h < H; ++h) b1[h] = A1[p * HP + h];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < H; ++h) W2[c * H + h] = A2[h * 16 + c];
  for (int64_t c = 0; c < C; ++c) b2[c] = A2[H * 16 + c];
}

// hidden[q, v0·16 ..] = relu(b1 + x_q A1) for the block's rows over NVC registers of hidden
// units (4 rows × NVC registers of sums; a compile-time width, so the loops unroll).
template <int NVC>
void hidden_forward_chunk(const float* const* rows, int64_t p, int64_t HP, int64_t v0, const float* A1,
                          float* hidden) {
  __m512 acc[kRows][NVC];
  for (int q = 0; q < kRows; ++q)
    for (int v = 0; v < NVC; ++v) acc[q][v] = _mm512_loadu_ps(A1 + p * HP + (v0 + v) * 16);
  for (int64_t k = 0; k < p; ++k) {
    const float* a = A1 + k * HP + v0 * 16;
    __m512 xb[kRows];
    for (int q = 0; q < kRows; ++q) xb[q] = _mm512_set1_ps(rows[q][k]);
    for (int v = 0; v < NVC; ++v) {
      const __m512 w = _mm512_loadu_ps(a + v * 16);
      for (int q = 0; q < kRows; ++q) acc[q][v] = _mm512_fmadd_ps(xb[q], w, acc[q][v]);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int q = 0; q < kRows; ++q)
    for (int v = 0; v < NVC; ++v) _mm512_storeu_ps(hidden + q * HP + (v0 + v) * 16, _mm512_max_ps(acc[q][v], zero));
}

// G1[k, v0·16 ..] += Σ_q x_q[k] dh[q, ..] over NVC registers (and the bias row += Σ_q dh[q, ..]),
// the rows' dh held in registers.
template <int NVC>
void hidden_backward_chunk(const float* const* rows, int64_t p, int64_t HP, int64_t v0, const float* dh, float* G1) {
  __m512 d[kRows][NVC];
  for (int q = 0; q < kRows; ++q)
    for (int v = 0; v < NVC; ++v) d[q][v] = _mm512_loadu_ps(dh + q * HP + (v0 + v) * 16);
  for (int64_t k = 0; k < p; ++k) {
    float* g = G1 + k * HP + v0 * 16;
    __m512 xb[kRows];
    for (int q = 0; q < kRows; ++q) xb[q] = _mm512_set1_ps(rows[q][k]);
    for (int v = 0; v < NVC; ++v) {
      __m512 s = _mm512_loadu_ps(g + v * 16);
      for (int q = 0; q < kRows; ++q) s = _mm512_fmadd_ps(xb[q], d[q][v], s);
      _mm512_storeu_ps(g + v * 16, s);
    }
  }
  float* gb = G1 + p * HP + v0 * 16;
  for (int v = 0; v < NVC; ++v) {
    __m512 s = _mm512_loadu_ps(gb + v * 16);
    for (int q = 0; q < kRows; ++q) s = _mm512_add_ps(s, d[q][v]);
    _mm512_storeu_ps(gb + v * 16, s);
  }
}

// fn(std::integral_constant<int, w>{}, v0) over the NV registers of hidden units in chunks of
// at most 4.
template <typename Fn>
void for_hidden_chunks(int64_t NV, Fn fn) {
  for (int64_t v0 = 0; v0 < NV; v0 += 4) {
    switch (std::min<int64_t>(4, NV - v0)) {
      case 4: fn(std::integral_constant<int, 4>{}, v0); break;
      case 3: fn(std::integral_constant<int, 3>{}, v0); break;
      case 2: fn(std::integral_constant<int, 2>{}, v0); break;
      default: fn(std::integral_constant<int, 1>{}, v0); break;
    }
  }
}

// One model row's steps.
void mlp_row(float* th, int64_t p, int64_t H, int64_t C, float l2, const float* x, const int64_t* y,
             const int32_t* batches, int64_t steps, int64_t B, const float* anchor, float scale, float lr, float prox) {
  const int64_t HP = (H + 15) / 16 * 16, NV = HP / 16;
  auto& ws = MlpWorkspace::local();
  ws.prepare(p, HP, H);
  float *A1 = ws.A1.data(), *G1 = ws.G1.data(), *A2 = ws.A2.data(), *G2 = ws.G2.data(), *A2T = ws.A2T.data();
  float *hidden = ws.hidden.data(), *dh = ws.dh.data();
  to_kernel_layout(th, p, H, C, HP, A1, A2);
  const float *N1 = nullptr, *N2 = nullptr;
  if (anchor) {
    to_kernel_layout(anchor, p, H, C, HP, ws.N1.data(), ws.N2.data());
    N1 = ws.N1.data();
    N2 = ws.N2.data();
  }
  std::fill(A2T, A2T + 16 * HP, 0.0f);  // its padding stays 0; the C rows are rewritten every step
  const __m512i by16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  for (int64_t s = 0; s < steps; ++s) {
    const int32_t* batch = batches + s * B;
    std::fill(G1, G1 + (p + 1) * HP, 0.0f);
    std::fill(G2, G2 + (H + 1) * 16, 0.0f);
    for (int64_t c = 0; c < C; ++c)  // A2T[c, h0 + i] = A2[h0 + i, c], 16 hidden units a gather
      for (int64_t h0 = 0; h0 < H; h0 += 16) {
        const __mmask16 live = first_lanes(H - h0);
        _mm512_mask_storeu_ps(A2T + c * HP + h0, live,
                              _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, by16, A2 + h0 * 16 + c, 4));
      }
    for (int64_t u0 = 0; u0 < B; u0 += kRows) {
      const int64_t live = std::min<int64_t>(kRows, B - u0);
      Block<kRows> b;
      for (int q = 0; q < kRows; ++q) {
        const int64_t r = batch[u0 + std::min<int64_t>(q, live - 1)];
        b.row[q] = x + r * p;
        b.label[q] = y[r];
      }
      for_hidden_chunks(NV, [&](auto w, int64_t v0) {
        hidden_forward_chunk<decltype(w)::value>(b.row, p, HP, v0, A1, hidden);
      });
      // logits z_q = b2 + h_q A2 and G2 += hᵀ dz: the GLM row path's forward and backward with the
      // hidden units as the features
      Block<kRows> hb;
      for (int q = 0; q < kRows; ++q) hb.row[q] = hidden + q * HP;
      __m512 z[kRows];
      minibatch::avx512::forward(hb, H, true, A2, z);
      minibatch::avx512::softmax_rows_transposed(z, b, C);
      for (int q = static_cast<int>(live); q < kRows; ++q) z[q] = _mm512_setzero_ps();  // repeated rows
      minibatch::avx512::backward(hb, H, true, z, false, G2);
      // dh = (dz A2T) ∘ [h > 0]
      alignas(64) float dz[kRows][16];
      for (int q = 0; q < kRows; ++q) _mm512_store_ps(dz[q], z[q]);
      for (int q = 0; q < kRows; ++q) {
        for (int64_t v = 0; v < NV; ++v) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < C; ++c)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(dz[q][c]), _mm512_loadu_ps(A2T + c * HP + v * 16), acc);
          const __mmask16 on = _mm512_cmp_ps_mask(_mm512_loadu_ps(hidden + q * HP + v * 16), _mm512_setzero_ps(),
                                                  _CMP_GT_OQ);
          _mm512_storeu_ps(dh + q * HP + v * 16, _mm512_maskz_mov_ps(on, acc));
        }
      }
      for_hidden_chunks(NV, [&](auto w, int64_t v0) {
        hidden_backward_chunk<decltype(w)::value>(b.row, p, HP, v0, dh, G1);
      });
    }
    minibatch::avx512::apply_step(A1, G1, N1, (p + 1) * HP, lr, scale, l2, prox);
    minibatch::avx512::apply_step(A2, G2, N2, (H + 1) * 16, lr, scale, l2, prox);
  }
  from_kernel_layout(th, p, H, C, HP, A1, A2);
}

}  // namespace

bool mlp_local_steps_supported(int64_t H, int64_t C) { return H >= 1 && H <= 128 && C >= 2 && C <= 16; }

void mlp_local_steps(float* theta, int64_t R, int64_t p, int64_t H, int64_t C, float l2, const float* x,
                     const int64_t* y, const int32_t* batches, int64_t steps, int64_t B, const float* anchor,
                     bool anchor_shared, const float* grad_scale, float lr, float prox) {
  const int64_t d = H * p + H + C * H + C;
  const int64_t work = R * steps * B * (p + C) * H;
#pragma omp parallel for schedule(dynamic, 1) if (R > 1 && work >= (1 << 20))
  for (int64_t r = 0; r < R; ++r) {
    const float* a = anchor ? (anchor_shared ? anchor : anchor + r * d) : nullptr;
    const float scale = (grad_scale ? grad_scale[r] : 1.0f) / static_cast<float>(B);
    mlp_row(theta + r * d, p, H, C, l2, x, y, batches + r * steps * B, steps, B, a, scale, lr, prox);
  }
}

#else  // no AVX-512 at build time: the torch path serves every MLP

bool mlp_local_steps_supported(int64_t, int64_t) { return false; }

void mlp_local_steps(float*, int64_t, int64_t, int64_t, int64_t, float, const float*, const int64_t*, const int32_t*,
                     int64_t, int64_t, const float*, bool, const float*, float, float) {}

#endif

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
