// Batched per-client gradient steps, full-batch gradients and evaluation for the GLM
// families (DESIGN.md §3, §4). One OpenMP task per model row: a client's K steps run back
// to back on its own rows while they sit in cache, and a row's result never depends on
// which thread ran it (bitwise equal for any thread count).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pflcore/glm.h"
#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
namespace {

// Rows are processed in tiles of kTile so that each weight and gradient entry is loaded
// once per tile instead of once per row.
constexpr int kTile = 4;

// One model in the kernel's layout: Wt [C, p] (transposed from theta's [P, C] so that dot
// products and gradient updates run along contiguous features) and the intercept b [C].
template <typename T>
struct Model {
  std::vector<T> Wt, b;
  void resize(int64_t p, int64_t C) {
    Wt.assign(p * C, T(0));
    b.assign(C, T(0));
  }
  void zero() {
    std::fill(Wt.begin(), Wt.end(), T(0));
    std::fill(b.begin(), b.end(), T(0));
  }
  void load(const T* theta /*[P, C]*/, int64_t p, int64_t C, bool intercept) {
    for (int64_t k = 0; k < p; ++k)
      for (int64_t c = 0; c < C; ++c) Wt[c * p + k] = theta[k * C + c];
    if (intercept)
      for (int64_t c = 0; c < C; ++c) b[c] = theta[p * C + c];
  }
  void store(T* theta /*[P, C]*/, int64_t p, int64_t C, bool intercept) const {
    for (int64_t k = 0; k < p; ++k)
      for (int64_t c = 0; c < C; ++c) theta[k * C + c] = Wt[c * p + k];
    if (intercept)
      for (int64_t c = 0; c < C; ++c) theta[p * C + c] = b[c];
  }
};

// Per-thread buffers.
template <typename T>
struct Workspace {
  Model<T> w, g, a;   // parameters, gradient accumulator, anchor
  std::vector<T> z;   // [kTile, C] logits
  std::vector<T> dz;  // [kTile, C] d(loss)/d(logits)
  std::vector<T> zmax;  // [kTile, C] logits minus their row maximum (softmax scratch)
  Workspace(int64_t p, int64_t C) : z(kTile * C), dz(kTile * C), zmax(kTile * C) {
    w.resize(p, C);
    g.resize(p, C);
    a.resize(p, C);
  }
};

// e^x for x <= 0, written so that `omp simd` loops vectorize it (the libm call does not
// vectorize without -ffast-math). x = n·ln2 + r with |r| <= ln2/2, e^r by its Taylor series
// (degree 7 for float: truncation < 2e-8 relative; degree 13 for double: < 2e-17), 2^n built in
// the exponent bits. Inputs below the smallest normal's log are clamped: their e^x (< 1e-37 or
// < 1e-307) only ever adds to a sum that holds a 1.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 split in two parts
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return q * scale;
}

inline double exp_nonpositive(double x) {
  x = x < -708.0 ? -708.0 : x;
  const double n = std::floor(x * 1.4426950408889634074 + 0.5);
  const double r = (x - n * 6.93145751953125e-1) - n * 1.42860682030941723212e-6;
  double q = 1.0 / 6227020800.0;  // 1/13!
  const double inv_fact[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                             1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,     1.0 / 120.0,
                             1.0 / 24.0,        1.0 / 6.0,        0.5,             1.0,
                             1.0};
  for (double coef : inv_fact) q = q * r + coef;
  const int64_t bits = (static_cast<int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return q * scale;
}

// Softmax loss and dz = softmax(z) − e_y of the nt rows of a tile: the same math as
// softmax_loss_grad (glm.h), arranged so the exponentials of the whole tile run as one
// vectorizable loop (libmvec) instead of nt·C scalar calls.
template <typename T>
T softmax_tile(const T* z /*[kTile, C]*/, T* dz /*[kTile, C]*/, int nt, int64_t C,
               const int64_t* y /*[N]*/, const int64_t* idx /*[kTile]*/, T* shifted /*[kTile, C]*/) {
  for (int u = 0; u < nt; ++u) {
    T zmax = z[u * C];
    for (int64_t c = 1; c < C; ++c) zmax = z[u * C + c] > zmax ? z[u * C + c] : zmax;
    for (int64_t c = 0; c < C; ++c) shifted[u * C + c] = z[u * C + c] - zmax;
  }
  const int64_t n = nt * C;
#pragma omp simd
  for (int64_t q = 0; q < n; ++q) dz[q] = exp_nonpositive(shifted[q]);
  T loss = T(0);
  for (int u = 0; u < nt; ++u) {
    T sum = T(0);
    for (int64_t c = 0; c < C; ++c) sum += dz[u * C + c];
    const T inv = T(1) / sum;
    for (int64_t c = 0; c < C; ++c) dz[u * C + c] *= inv;
    const int64_t label = y[idx[u]];
    dz[u * C + label] -= T(1);
    loss += std::log(sum) - shifted[u * C + label];
  }
  return loss;
}

// Sum of the losses of n rows (row_at(t) gives the absolute index of the t-th row).
// With `grad`, adds Σ_rows x ⊗ dloss/dz into ws.g; with `correct`, counts hits.
template <Family F, typename T, typename RowAt>
T pass_rows(const GlmProblem<T>& prob, Workspace<T>& ws, RowAt row_at, int64_t n, bool grad,
            int64_t* correct) {
  using Y = label_t<F, T>;
  const Y* y = static_cast<const Y*>(prob.y);
  const int64_t p = prob.p, C = prob.C;
  const bool icpt = prob.intercept;
  const T* Wt = ws.w.Wt.data();
  const T* b = ws.w.b.data();
  T* Gt = ws.g.Wt.data();
  T* gb = ws.g.b.data();
  T* z = ws.z.data();
  T* dz = ws.dz.data();
  T loss = T(0);
  for (int64_t t = 0; t < n; t += kTile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - t));
    int64_t idx[kTile];
    // A short tile repeats its last row; the extra results are ignored (dz = 0).
    for (int u = 0; u < kTile; ++u) idx[u] = row_at(t + std::min(u, nt - 1));
    const T* __restrict__ x0 = prob.x + idx[0] * p;
    const T* __restrict__ x1 = prob.x + idx[1] * p;
    const T* __restrict__ x2 = prob.x + idx[2] * p;
    const T* __restrict__ x3 = prob.x + idx[3] * p;
    for (int64_t c = 0; c < C; ++c) {
      const T* __restrict__ wc = Wt + c * p;
      T a0 = T(0), a1 = T(0), a2 = T(0), a3 = T(0);
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < p; ++k) {
        a0 += wc[k] * x0[k];
        a1 += wc[k] * x1[k];
        a2 += wc[k] * x2[k];
        a3 += wc[k] * x3[k];
      }
      const T bc = icpt ? b[c] : T(0);
      z[0 * C + c] = a0 + bc;
      z[1 * C + c] = a1 + bc;
      z[2 * C + c] = a2 + bc;
      z[3 * C + c] = a3 + bc;
    }
    if constexpr (F == Family::Softmax) {
      loss += softmax_tile(z, dz, nt, C, y, idx, ws.zmax.data());
    } else {
      for (int u = 0; u < nt; ++u) loss += loss_grad<F, T>(z + u * C, C, y[idx[u]], dz + u * C);
    }
    if (correct)
      for (int u = 0; u < nt; ++u) *correct += is_correct<F, T>(z + u * C, C, y[idx[u]]);
    if (!grad) continue;
    for (int u = nt; u < kTile; ++u)
      for (int64_t c = 0; c < C; ++c) dz[u * C + c] = T(0);
    for (int64_t c = 0; c < C; ++c) {
      const T g0 = dz[0 * C + c], g1 = dz[1 * C + c], g2 = dz[2 * C + c], g3 = dz[3 * C + c];
      T* __restrict__ gc = Gt + c * p;
#pragma omp simd
      for (int64_t k = 0; k < p; ++k) gc[k] += g0 * x0[k] + g1 * x1[k] + g2 * x2[k] + g3 * x3[k];
      if (icpt) gb[c] += g0 + g1 + g2 + g3;
    }
  }
  return loss;
}

template <typename T, typename Fn>
void for_each_model_row(const GlmProblem<T>& prob, Fn fn) {
#pragma omp parallel
  {
    Workspace<T> ws(prob.p, prob.C);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < prob.R; ++r) fn(r, ws);
  }
}

// w ← w − lr·(scale·g + l2·w + prox·(w − a)) elementwise; a = 0 when has_anchor is false.
template <typename T>
void apply_step(T* __restrict__ w, const T* __restrict__ g, const T* __restrict__ a, int64_t n,
                T lr, T scale, T l2, T prox, bool has_anchor) {
  if (has_anchor) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) w[k] -= lr * (scale * g[k] + l2 * w[k] + prox * (w[k] - a[k]));
  } else {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) w[k] -= lr * (scale * g[k] + l2 * w[k] + prox * w[k]);
  }
}

template <Family F, typename T>
void local_steps_family(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args) {
  const int64_t p = prob.p, C = prob.C, d = prob.d();
  const bool icpt = prob.intercept;
  for_each_model_row(prob, [&](int64_t r, Workspace<T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    T* theta_r = args.theta + r * d;
    ws.w.load(theta_r, p, C, icpt);
    const bool has_anchor = args.anchor != nullptr;
    if (has_anchor) ws.a.load(args.anchor_shared ? args.anchor : args.anchor + r * d, p, C, icpt);
    const T gs = args.grad_scale ? args.grad_scale[r] : T(1);
    for (int64_t s = 0; s < args.steps; ++s) {
      ws.g.zero();
      int64_t nb;
      if (args.batches) {
        const int32_t* batch = args.batches + (r * args.steps + s) * args.batch_size;
        nb = args.batch_size;
        pass_rows<F, T>(prob, ws, [batch](int64_t t) { return static_cast<int64_t>(batch[t]); },
                        nb, true, nullptr);
      } else {
        nb = n;
        pass_rows<F, T>(prob, ws, [lo](int64_t t) { return lo + t; }, nb, true, nullptr);
      }
      const T scale = gs / static_cast<T>(nb);
      apply_step(ws.w.Wt.data(), ws.g.Wt.data(), ws.a.Wt.data(), p * C, args.lr, scale, prob.l2,
                 args.prox, has_anchor);
      if (icpt)
        apply_step(ws.w.b.data(), ws.g.b.data(), ws.a.b.data(), C, args.lr, scale, prob.l2,
                   args.prox, has_anchor);
    }
    ws.w.store(theta_r, p, C, icpt);
  });
}

template <Family F, typename T>
void gradients_family(const GlmProblem<T>& prob, const T* theta, T* out) {
  const int64_t p = prob.p, C = prob.C, d = prob.d();
  const bool icpt = prob.intercept;
  for_each_model_row(prob, [&](int64_t r, Workspace<T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    ws.w.load(theta + r * d, p, C, icpt);
    ws.g.zero();
    pass_rows<F, T>(prob, ws, [lo](int64_t t) { return lo + t; }, n, true, nullptr);
    ws.g.store(out + r * d, p, C, icpt);
    const T inv_n = T(1) / static_cast<T>(n);
    T* o = out + r * d;
    const T* th = theta + r * d;
    for (int64_t k = 0; k < d; ++k) o[k] = o[k] * inv_n + prob.l2 * th[k];
  });
}

template <Family F, typename T>
void evaluate_family(const GlmProblem<T>& prob, const T* theta, T* loss_sum, int64_t* correct,
                     int64_t* count) {
  const int64_t p = prob.p, C = prob.C, d = prob.d();
  const bool icpt = prob.intercept;
  for_each_model_row(prob, [&](int64_t r, Workspace<T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    ws.w.load(theta + r * d, p, C, icpt);
    int64_t hits = 0;
    loss_sum[r] = pass_rows<F, T>(prob, ws, [lo](int64_t t) { return lo + t; }, n, false, &hits);
    correct[r] = hits;
    count[r] = n;
  });
}

// Calls fn with the family as a compile-time constant.
template <typename Fn>
void dispatch_family(Family f, Fn fn) {
  switch (f) {
    case Family::LeastSquares: fn(std::integral_constant<Family, Family::LeastSquares>{}); break;
    case Family::Logistic: fn(std::integral_constant<Family, Family::Logistic>{}); break;
    case Family::Softmax: fn(std::integral_constant<Family, Family::Softmax>{}); break;
  }
}

}  // namespace

template <typename T>
void local_steps(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args) {
  dispatch_family(prob.family, [&](auto F) { local_steps_family<decltype(F)::value, T>(prob, args); });
}

template <typename T>
void gradients(const GlmProblem<T>& prob, const T* theta, T* out) {
  dispatch_family(prob.family, [&](auto F) { gradients_family<decltype(F)::value, T>(prob, theta, out); });
}

template <typename T>
void evaluate(const GlmProblem<T>& prob, const T* theta, T* loss_sum, int64_t* correct,
              int64_t* count) {
  dispatch_family(prob.family, [&](auto F) {
    evaluate_family<decltype(F)::value, T>(prob, theta, loss_sum, correct, count);
  });
}

template void local_steps<float>(const GlmProblem<float>&, const LocalStepsArgs<float>&);
template void local_steps<double>(const GlmProblem<double>&, const LocalStepsArgs<double>&);
template void gradients<float>(const GlmProblem<float>&, const float*, float*);
template void gradients<double>(const GlmProblem<double>&, const double*, double*);
template void evaluate<float>(const GlmProblem<float>&, const float*, float*, int64_t*, int64_t*);
template void evaluate<double>(const GlmProblem<double>&, const double*, double*, int64_t*,
                               int64_t*);

}  // namespace pflcore::cpu
