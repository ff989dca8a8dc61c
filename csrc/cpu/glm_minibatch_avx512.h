// The row path for float softmax with at most 16 classes (the papers' setting: C = 10), written
// with AVX-512 intrinsics (included by glm_minibatch.h; the portable templates there serve
// every other case and every machine without AVX-512).
//
// A block of NR rows (8, then 4, 2, 1 for the tail: B = 20 runs as 8 + 8 + 4, no padding rows)
// keeps its NR logit rows in registers from the forward to the backward:
//
//   z_q  = b + Σ_k x_q[k] · W[k, :]          one 16-lane register per row; each load of W[k, :]
//                                           serves the NR rows (a broadcast operand per FMA)
//   dz_q = softmax(z_q) − e_{y_q}            max and sum by a shuffle tree, inside the register
//   G[k, :] += Σ_q x_q[k] · dz_q             rows in batch order, then the next block
//
// Why: the portable code runs on 256-bit registers (GCC's default width for -march=native),
// sums each row's softmax lane by lane (an in-order reduction: 8 dependent adds per row) and
// passes the logits through memory. Here every step of a row is a full-width vector operation
// and nothing leaves the registers between the forward and the backward.
//
// Sums run in a fixed order (blocks in batch order, a fixed tree inside a row), so results do
// not depend on the thread count. They differ in the last bits from the portable code's.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "glm_rows.h"
#include "pflcore/cpu_level.h"

#define PFLCORE_ROWPATH_AVX512 1

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace minibatch::avx512 {

#define PFLCORE_ALWAYS_INLINE inline __attribute__((always_inline))

// The mask of the first n lanes of a register (all 16 for n >= 16, none for n <= 0).
PFLCORE_ALWAYS_INLINE __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << n) - 1u);
}

// e^x for x <= 0: the polynomial of glm.cpp's exp_nonpositive, 16 lanes at a time.
PFLCORE_ALWAYS_INLINE __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);  // 1.5·2^23: rounds to an integer
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x − n·ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.0f / 5040.0f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 720.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 120.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 24.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 6.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(q, _mm512_castsi512_ps(bits));
}

// log x for finite x >= 1 (a softmax denominator), 16 lanes at a time: x = m·2^e with m in
// [√½, √2), log x = e·ln2 + log m, log(1 + f) = f − f²/2 + f³·poly(f) (the classic minimax
// polynomial for float; within ~1 ulp of logf on [1, 2^16]). log 1 is exactly 0.
PFLCORE_ALWAYS_INLINE __m512 log_at_least_one(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);                                     // floor(log2 x)
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 f2 = _mm512_mul_ps(f, f);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), f2);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), f2, y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

// Every lane <- the max (the sum) of the 16 lanes, by a fixed tree of shuffles.
PFLCORE_ALWAYS_INLINE __m512 all_max(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_max_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}
PFLCORE_ALWAYS_INLINE __m512 all_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}

// One block's rows: x rows [NR] of p features, their labels, the first row's batch position.
template <int NR>
struct Block {
  const float* row[NR];
  int64_t label[NR];
};

template <int NR, typename RowAt>
PFLCORE_ALWAYS_INLINE void gather(const float* x, int64_t p, const int64_t* y, RowAt row_at, int64_t u0,
                                  Block<NR>& b) {
  for (int q = 0; q < NR; ++q) {
    const int64_t r = row_at(u0 + q);
    b.row[q] = x + r * p;
    b.label[q] = y[r];
  }
  if constexpr (NR == 8 && is_contiguous_rows<RowAt>) prefetch_rows_ahead(b.row[0], p, NR);
}

// z[q] = b + x_q W for the block's rows (W [p(+1), 16], the intercept in row p).
template <int NR>
PFLCORE_ALWAYS_INLINE void forward(const Block<NR>& b, int64_t p, bool intercept, const float* __restrict__ W,
                                   __m512 (&z)[NR]) {
  const __m512 bias = intercept ? _mm512_loadu_ps(W + p * 16) : _mm512_setzero_ps();
  for (int q = 0; q < NR; ++q) z[q] = bias;
  for (int64_t k = 0; k < p; ++k) {
    const __m512 w = _mm512_loadu_ps(W + k * 16);
    for (int q = 0; q < NR; ++q) z[q] = _mm512_fmadd_ps(_mm512_set1_ps(b.row[q][k]), w, z[q]);
  }
}

// A NaN or inf among a row's features makes every one of its logits NaN or inf (NaN·w and
// inf·0 are NaN), so finite logits also clear the block's features.
template <int NR>
PFLCORE_ALWAYS_INLINE bool all_finite(const __m512 (&z)[NR]) {
  __mmask16 bad = 0;
  for (int q = 0; q < NR; ++q) bad |= _mm512_fpclass_ps_mask(z[q], 0x99);  // QNaN, SNaN, ±inf
  return bad == 0;
}

// G[k, :] (=, first block; += after) Σ_q x_q[k] · dz[q], and the intercept row Σ_q dz[q].
template <int NR>
PFLCORE_ALWAYS_INLINE void backward(const Block<NR>& b, int64_t p, bool intercept, const __m512 (&dz)[NR],
                                    bool first, float* __restrict__ G) {
  for (int64_t k = 0; k < p; ++k) {
    __m512 g = first ? _mm512_setzero_ps() : _mm512_loadu_ps(G + k * 16);
    for (int q = 0; q < NR; ++q) g = _mm512_fmadd_ps(_mm512_set1_ps(b.row[q][k]), dz[q], g);
    _mm512_storeu_ps(G + k * 16, g);
  }
  if (intercept) {
    __m512 g = first ? _mm512_setzero_ps() : _mm512_loadu_ps(G + p * 16);
    for (int q = 0; q < NR; ++q) g = _mm512_add_ps(g, dz[q]);
    _mm512_storeu_ps(G + p * 16, g);
  }
}

// dz = softmax(z) − e_y for a block of 8 (or 4) rows, in place, with lanes along rows: the rows'
// logits are transposed within 128-bit lanes (two 4x4 transposes per lane), so that register j of
// a group of 4 rows holds classes j, 4+j, 8+j, 12+j of those rows. Max, exp and sum then take
// plain vertical operations over 4 registers and two cross-lane steps, where the row form pays a
// shuffle tree per row for each of max and sum; 8 rows cost about 240 vector operations, not 330.
PFLCORE_ALWAYS_INLINE void transpose_4x4_lanes(__m512& a, __m512& b, __m512& c, __m512& d) {
  const __m512 t0 = _mm512_unpacklo_ps(a, b), t1 = _mm512_unpackhi_ps(a, b);
  const __m512 t2 = _mm512_unpacklo_ps(c, d), t3 = _mm512_unpackhi_ps(c, d);
  a = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  b = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  c = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  d = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
}

// Every 128-bit lane <- the max (sum) over the four lanes, lane by lane of 4 rows.
PFLCORE_ALWAYS_INLINE __m512 lanes_max(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}
PFLCORE_ALWAYS_INLINE __m512 lanes_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}

// The class of every lane of transposed register j (class 4l + j in 128-bit lane l), and which
// lanes hold one of the C classes.
PFLCORE_ALWAYS_INLINE void transposed_classes(int64_t C, __m512i (&cls)[4], __mmask16 (&valid)[4]) {
  const __m512i lane_class = _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
  for (int j = 0; j < 4; ++j) {
    cls[j] = _mm512_add_epi32(lane_class, _mm512_set1_epi32(j));
    valid[j] = _mm512_cmplt_epi32_mask(cls[j], _mm512_set1_epi32(static_cast<int>(C)));
  }
}

// The labels of rows 4g..4g+4 of a block in the transposed lanes (element i of every 128-bit
// lane: row 4g + i).
template <int NR>
PFLCORE_ALWAYS_INLINE __m512i group_labels(const Block<NR>& b, int g) {
  return _mm512_broadcast_i32x4(_mm_set_epi32(static_cast<int>(b.label[4 * g + 3]), static_cast<int>(b.label[4 * g + 2]),
                                              static_cast<int>(b.label[4 * g + 1]), static_cast<int>(b.label[4 * g])));
}

// Every lane of a transposed group of 4 rows (registers u[0..4)) <- its row's max over the C
// classes.
PFLCORE_ALWAYS_INLINE __m512 group_max(const __m512* u, const __mmask16 (&valid)[4]) {
  __m512 m = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[0], u[0]);
  for (int j = 1; j < 4; ++j) m = _mm512_mask_max_ps(m, valid[j], m, u[j]);
  return lanes_max(m);
}

template <int NR>  // 4 or 8 rows: one or two groups of 4
PFLCORE_ALWAYS_INLINE void softmax_rows_transposed(__m512 (&z)[NR], const Block<NR>& b, int64_t C) {
  constexpr int groups = NR / 4;
  static_assert(NR == 4 || NR == 8, "groups of 4 rows");
  const __m512 one = _mm512_set1_ps(1.0f);
  // Lane 4l + i of register j (of either group) holds class 4l + j of row i of the group.
  for (int g = 0; g < groups; ++g) transpose_4x4_lanes(z[4 * g], z[4 * g + 1], z[4 * g + 2], z[4 * g + 3]);
  __m512i cls[4];
  __mmask16 valid[4];
  transposed_classes(C, cls, valid);
  __m512 inv[2];
  __m512 sums[2] = {one, one};
  for (int g = 0; g < groups; ++g) {
    __m512* u = z + 4 * g;
    const __m512 m = group_max(u, valid);
    __m512 s = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      u[j] = _mm512_maskz_mov_ps(valid[j], exp_nonpositive(_mm512_maskz_sub_ps(valid[j], u[j], m)));
      s = _mm512_add_ps(s, u[j]);
    }
    sums[g] = lanes_sum(s);
  }
  // One division for both groups: group 0's sums in the low half, group 1's in the high half.
  const __m512 both = _mm512_div_ps(one, _mm512_mask_blend_ps(0xFF00, sums[0], sums[1]));
  inv[0] = _mm512_shuffle_f32x4(both, both, _MM_SHUFFLE(0, 0, 0, 0));
  inv[1] = _mm512_shuffle_f32x4(both, both, _MM_SHUFFLE(2, 2, 2, 2));
  for (int g = 0; g < groups; ++g) {
    const __m512i label = group_labels(b, g);
    __m512* u = z + 4 * g;
    for (int j = 0; j < 4; ++j) {
      const __m512 dz = _mm512_mul_ps(u[j], inv[g]);
      u[j] = _mm512_mask_sub_ps(dz, _mm512_cmpeq_epi32_mask(label, cls[j]), dz, one);
    }
  }
  // A 4x4 transpose undoes itself.
  for (int g = 0; g < groups; ++g) transpose_4x4_lanes(z[4 * g], z[4 * g + 1], z[4 * g + 2], z[4 * g + 3]);
}

// Per-row loss terms and hits of a block of 8 (or 4) rows, transposed as in
// softmax_rows_transposed: returns the rows' correctly classified count; their losses
// log Σ e^(z − m) + m − z_y land in elements 0..NR of `loss` (row q in element q).
template <int NR>
PFLCORE_ALWAYS_INLINE int64_t eval_rows_transposed(__m512 (&z)[NR], const Block<NR>& b, int64_t C, __m512& loss) {
  constexpr int groups = NR / 4;
  static_assert(NR == 4 || NR == 8, "groups of 4 rows");
  __m512i cls[4];
  __mmask16 valid[4];
  transposed_classes(C, cls, valid);
  int64_t good = 0;
  __m512 sums[2], tails[2];
  for (int g = 0; g < groups; ++g) {
    __m512* u = z + 4 * g;
    transpose_4x4_lanes(u[0], u[1], u[2], u[3]);
    const __m512i label = group_labels(b, g);
    const __m512 m = group_max(u, valid);
    // The first maximal class: the smallest class whose logit equals the max.
    __m512i best = _mm512_set1_epi32(1 << 30);
    __m512 s = _mm512_setzero_ps(), zy = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __mmask16 at_max = _mm512_mask_cmp_ps_mask(valid[j], u[j], m, _CMP_EQ_OQ);
      best = _mm512_mask_min_epi32(best, at_max, best, cls[j]);
      s = _mm512_add_ps(s, _mm512_maskz_mov_ps(valid[j], exp_nonpositive(_mm512_maskz_sub_ps(valid[j], u[j], m))));
      zy = _mm512_add_ps(zy, _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(label, cls[j]), u[j]));  // exact: one term
    }
    best = _mm512_min_epi32(best, _mm512_shuffle_i32x4(best, best, _MM_SHUFFLE(1, 0, 3, 2)));
    best = _mm512_min_epi32(best, _mm512_shuffle_i32x4(best, best, _MM_SHUFFLE(2, 3, 0, 1)));
    good += __builtin_popcount(_mm512_cmpeq_epi32_mask(best, label) & 0xFu);
    sums[g] = lanes_sum(s);
    tails[g] = _mm512_sub_ps(m, lanes_sum(zy));
  }
  // Rows 0..4 from group 0's elements 0..4, rows 4..8 from group 1's elements 4..8 (each 128-bit
  // lane of a group holds the same four rows).
  const __m512 S = groups == 2 ? _mm512_mask_blend_ps(0x00F0, sums[0], sums[1]) : sums[0];
  const __m512 T = groups == 2 ? _mm512_mask_blend_ps(0x00F0, tails[0], tails[1]) : tails[0];
  const __mmask16 rows = groups == 2 ? 0x00FF : 0x000F;
  loss = _mm512_mask_add_ps(loss, rows, loss, _mm512_add_ps(log_at_least_one(S), T));
  return good;
}

// The rows row_at(u0 ..) of a block and their logits z; false (the block's first position in
// `nonfinite`, when given) where a logit is not finite.
template <int NR, typename RowAt>
PFLCORE_ALWAYS_INLINE bool block_logits(const float* x, int64_t p, const int64_t* y, bool intercept,
                                        const float* __restrict__ W, RowAt row_at, int64_t u0, Block<NR>& b,
                                        __m512 (&z)[NR], int64_t* nonfinite) {
  gather(x, p, y, row_at, u0, b);
  forward(b, p, intercept, W, z);
  if (nonfinite && !all_finite(z)) {
    *nonfinite = u0;
    return false;
  }
  return true;
}

// Runs block(NR, u0) over positions 0..n in blocks of 8, then 4, 2, 1; stops (false) when a
// block does.
template <typename Fn>
PFLCORE_ALWAYS_INLINE bool for_blocks(int64_t n, Fn block) {
  int64_t u0 = 0;
  for (; u0 + 8 <= n; u0 += 8)
    if (!block(std::integral_constant<int, 8>{}, u0)) return false;
  if (u0 + 4 <= n) {
    if (!block(std::integral_constant<int, 4>{}, u0)) return false;
    u0 += 4;
  }
  if (u0 + 2 <= n) {
    if (!block(std::integral_constant<int, 2>{}, u0)) return false;
    u0 += 2;
  }
  if (u0 < n && !block(std::integral_constant<int, 1>{}, u0)) return false;
  return true;
}

// minibatch::gradient for float and 16 padded classes (same contract).
template <typename RowAt>
float gradient(const float* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t B,
               const float* __restrict__ W, float* __restrict__ G, bool with_loss, int64_t* nonfinite) {
  if (nonfinite) *nonfinite = -1;
  const int64_t P = p + (intercept ? 1 : 0);
  if (B <= 0) {
    for (int64_t i = 0; i < P * 16; ++i) G[i] = 0.0f;
    return 0.0f;
  }
  const __mmask16 classes = first_lanes(C);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
  float loss = 0.0f;
  bool first = true;
  for_blocks(B, [&](auto nr, int64_t u0) {
    constexpr int NR = decltype(nr)::value;
    Block<NR> b;
    __m512 z[NR];
    if (!block_logits(x, p, y, intercept, W, row_at, u0, b, z, nonfinite)) return false;
    if constexpr (NR == 8 || NR == 4) {
      if (!with_loss) {
        softmax_rows_transposed(z, b, C);
        backward(b, p, intercept, z, first, G);
        first = false;
        return true;
      }
    }
    for (int q = 0; q < NR; ++q) {
      const __m512 m = all_max(_mm512_mask_mov_ps(minus_inf, classes, z[q]));
      const __m512 e = _mm512_maskz_mov_ps(classes, exp_nonpositive(_mm512_maskz_sub_ps(classes, z[q], m)));
      const __m512 s = all_sum(e);
      if (with_loss) {
        const float zy = _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(b.label[q])), z[q]));
        loss += std::log(_mm512_cvtss_f32(s)) + _mm512_cvtss_f32(m) - zy;
      }
      const __m512 dz = _mm512_mul_ps(e, _mm512_div_ps(one, s));
      z[q] = _mm512_mask_sub_ps(dz, static_cast<__mmask16>(1u << b.label[q]), dz, one);
    }
    backward(b, p, intercept, z, first, G);
    first = false;
    return true;
  });
  return loss;
}

// minibatch::loss_and_hits for float and 16 padded classes (same contract). The loss terms
// collect in 16 lanes (blocks of 8 and 4 rows: row q of a block in lane q; the 1 to 3 rows of
// the last blocks of 2 and 1 in lanes of their own) and are summed by a fixed tree at the end.
template <typename RowAt>
float loss_and_hits(const float* x, int64_t p, const int64_t* y, bool intercept, int64_t C, RowAt row_at, int64_t n,
                    const float* __restrict__ W, int64_t* hits, int64_t* nonfinite) {
  if (nonfinite) *nonfinite = -1;
  const __mmask16 classes = first_lanes(C);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  // The rows of the last blocks of 2 and 1 (at most 3): a row's loss = log(sum) + tail, with
  // log 1 + 0 = 0 exactly in the lanes left over.
  alignas(64) float sums[16], tails[16];
  std::fill(sums, sums + 16, 1.0f);
  std::fill(tails, tails + 16, 0.0f);
  int filled = 0;
  int64_t good = 0;
  __m512 block_loss = _mm512_setzero_ps();  // row q of a block of 8 or 4 in element q
  for_blocks(n, [&](auto nr, int64_t u0) {
    constexpr int NR = decltype(nr)::value;
    Block<NR> b;
    __m512 z[NR];
    if (!block_logits(x, p, y, intercept, W, row_at, u0, b, z, nonfinite)) return false;
    if constexpr (NR == 8 || NR == 4) {
      good += eval_rows_transposed(z, b, C, block_loss);
      return true;
    }
    for (int q = 0; q < NR; ++q) {
      const __m512 m = all_max(_mm512_mask_mov_ps(minus_inf, classes, z[q]));
      const unsigned at_max = _mm512_mask_cmp_ps_mask(classes, z[q], m, _CMP_EQ_OQ);
      const int64_t best = __builtin_ctz(at_max);  // the first maximal logit
      good += best == b.label[q] ? 1 : 0;
      const __m512 e = _mm512_maskz_mov_ps(classes, exp_nonpositive(_mm512_maskz_sub_ps(classes, z[q], m)));
      const float zy = _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(b.label[q])), z[q]));
      sums[filled] = _mm512_cvtss_f32(all_sum(e));
      tails[filled] = _mm512_cvtss_f32(m) - zy;
      ++filled;
    }
    return true;
  });
  *hits = good;
  const __m512 tail_loss = _mm512_add_ps(log_at_least_one(_mm512_load_ps(sums)), _mm512_load_ps(tails));
  return _mm512_cvtss_f32(all_sum(_mm512_add_ps(block_loss, tail_loss)));
}

// w ← w − lr·(scale·g + l2·w + prox·(w − a)) elementwise over n floats; a = 0 when null.
inline void apply_step(float* __restrict__ w, const float* __restrict__ g, const float* __restrict__ a, int64_t n,
                       float lr, float scale, float l2, float prox) {
  const __m512 vlr = _mm512_set1_ps(lr), vscale = _mm512_set1_ps(scale), vl2 = _mm512_set1_ps(l2),
               vprox = _mm512_set1_ps(prox);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = first_lanes(n - i);
    const __m512 wi = _mm512_maskz_loadu_ps(live, w + i);
    const __m512 ai = a ? _mm512_maskz_loadu_ps(live, a + i) : _mm512_setzero_ps();
    __m512 t = _mm512_mul_ps(vscale, _mm512_maskz_loadu_ps(live, g + i));
    t = _mm512_fmadd_ps(vl2, wi, t);
    t = _mm512_fmadd_ps(vprox, _mm512_sub_ps(wi, ai), t);
    _mm512_mask_storeu_ps(w + i, live, _mm512_fnmadd_ps(vlr, t, wi));
  }
}

// dst [P, 16] <- src [P, C], zero padding; and back.
inline void load_padded(float* __restrict__ dst, const float* __restrict__ src, int64_t P, int64_t C) {
  const __mmask16 classes = first_lanes(C);
  for (int64_t k = 0; k < P; ++k) _mm512_storeu_ps(dst + k * 16, _mm512_maskz_loadu_ps(classes, src + k * C));
}
inline void store_unpadded(float* __restrict__ dst, const float* __restrict__ src, int64_t P, int64_t C) {
  const __mmask16 classes = first_lanes(C);
  for (int64_t k = 0; k < P; ++k) _mm512_mask_storeu_ps(dst + k * C, classes, _mm512_loadu_ps(src + k * 16));
}

#undef PFLCORE_ALWAYS_INLINE

}  // namespace minibatch::avx512
PFLCORE_LEVEL_END
}  // namespace pflcore::cpu

#endif
