// Batched per-client gradient steps, full-batch gradients and evaluation for the GLM
// families (DESIGN.md §3, §4). One OpenMP task per model row: a client's K steps run back
// to back on its own rows while they sit in cache, and a row's result never depends on
// which thread ran it (bitwise equal for any thread count).
//
// A client's rows are copied, transposed, into a chunk xt [p, ld] (ld = rows rounded up to
// kLanes, zero-padded). Then every loop runs along rows, which SIMD lanes fill whatever p and
// C are: logits z [C, ld] = W xt + b, the loss and dz column by column, and the gradient
// G += dz xtᵀ. For a full-batch call on a client that fits one chunk, the copy is made once
// and reused by all K steps.
#include <algorithm>
#include <cmath>
#include <vector>

#include "pflcore/glm.h"
#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {
namespace {

constexpr int64_t kLanes = 16;               // chunk widths are multiples of this
constexpr int64_t kChunkBytes = 256 * 1024;  // xt of one chunk stays in L2
constexpr int64_t kMaxChunkRows = 4096;
constexpr int64_t kSmallChunk = 64;          // up to this many columns, gradients go row by row

// One model in the kernel's layout: Wt [C, p] (transposed from theta's [P, C], so that the
// gradient of class c is a contiguous row) and the intercept b [C].
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

// e^x for x <= 0, written so that `omp simd` loops vectorize it (neither the libm call nor
// std::floor vectorizes without -ffast-math). x = n·ln2 + r with n = round(x/ln2) by the
// 1.5·2^mantissa-bits trick and |r| <= ln2/2; e^r by its Taylor series (degree 7 for float:
// truncation < 2e-8 relative; degree 13 for double: < 2e-17); 2^n built in the exponent bits.
// Inputs below the smallest normal's log are clamped: their e^x (< 1e-37 or < 1e-307) only
// ever adds to a sum that holds a 1.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5·2^23
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 split in two parts
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  union { int32_t i; float f; } scale;
  scale.i = (static_cast<int32_t>(n) + 127) << 23;
  return q * scale.f;
}

inline double exp_nonpositive(double x) {
  x = x < -708.0 ? -708.0 : x;
  const double shifter = 6755399441055744.0;  // 1.5·2^52
  const double n = (x * 1.4426950408889634074 + shifter) - shifter;
  const double r = (x - n * 6.93145751953125e-1) - n * 1.42860682030941723212e-6;
  double q = 1.0 / 6227020800.0;  // 1/13!, then Horner down to 1/0!
  q = q * r + 1.0 / 479001600.0;
  q = q * r + 1.0 / 39916800.0;
  q = q * r + 1.0 / 3628800.0;
  q = q * r + 1.0 / 362880.0;
  q = q * r + 1.0 / 40320.0;
  q = q * r + 1.0 / 5040.0;
  q = q * r + 1.0 / 720.0;
  q = q * r + 1.0 / 120.0;
  q = q * r + 1.0 / 24.0;
  q = q * r + 1.0 / 6.0;
  q = q * r + 0.5;
  q = q * r + 1.0;
  q = q * r + 1.0;
  union { int64_t i; double f; } scale;
  scale.i = (static_cast<int64_t>(n) + 1023) << 52;
  return q * scale.f;
}

// Per-thread buffers.
template <Family F, typename T>
struct Workspace {
  using Y = label_t<F, T>;
  int64_t cap;               // rows per chunk
  Model<T> w, g, a;          // parameters, gradient accumulator, anchor
  std::vector<T> xt;         // [p, cap] the chunk's rows as columns, zero-padded
  std::vector<Y> label;      // [cap] their labels (0 on padding)
  std::vector<T> z;          // [C, cap] logits, then d loss / d logits (0 on padding)
  std::vector<T> colmax, colsum, zlabel;  // [cap] softmax scratch
  std::vector<T> zeros;      // [p] the source of padding columns
  std::vector<const T*> row;  // [cap] the chunk's rows in x (row-major, for small chunks)
  Workspace(int64_t p, int64_t C) {
    const int64_t fit = kChunkBytes / (p * static_cast<int64_t>(sizeof(T)));
    cap = std::clamp<int64_t>(fit / kLanes * kLanes, kLanes, kMaxChunkRows);
    w.resize(p, C);
    g.resize(p, C);
    a.resize(p, C);
    xt.resize(p * cap);
    label.resize(cap);
    z.resize(C * cap);
    colmax.resize(cap);
    colsum.resize(cap);
    zlabel.resize(cap);
    zeros.assign(p, T(0));
    row.resize(cap);
  }
};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Copies rows row_at(t0 + u), u < nt, into ws.xt as columns; returns the padded width ld.
template <Family F, typename T, typename RowAt>
int64_t load_chunk(const GlmProblem<T>& prob, Workspace<F, T>& ws, RowAt row_at, int64_t t0,
                   int64_t nt) {
  using Y = label_t<F, T>;
  const Y* y = static_cast<const Y*>(prob.y);
  const int64_t p = prob.p, ld = round_up(nt, kLanes);
  T* xt = ws.xt.data();
  for (int64_t u0 = 0; u0 < ld; u0 += kLanes) {
    const T* src[kLanes];
    for (int64_t u = 0; u < kLanes; ++u) {
      if (u0 + u < nt) {
        const int64_t r = row_at(t0 + u0 + u);
        src[u] = prob.x + r * p;
        ws.row[u0 + u] = src[u];
        ws.label[u0 + u] = y[r];
      } else {
        src[u] = ws.zeros.data();
        ws.label[u0 + u] = Y(0);
      }
    }
    for (int64_t k = 0; k < p; ++k)
      for (int64_t u = 0; u < kLanes; ++u) xt[k * ld + u0 + u] = src[u][k];
  }
  return ld;
}

// Softmax over the columns of z [C, ld]: returns Σ_{u<nt} (logsumexp z[:, u] − z[y_u, u]);
// with `grad`, leaves dz = softmax − e_y in z (0 on padding). With `correct`, counts the
// columns whose first maximal logit is the label.
template <typename T>
T softmax_columns(Workspace<Family::Softmax, T>& ws, int64_t C, int64_t nt, int64_t ld, bool grad,
                  int64_t* correct) {
  T* __restrict__ z = ws.z.data();
  T* __restrict__ zmax = ws.colmax.data();
  T* __restrict__ sum = ws.colsum.data();
  T* __restrict__ zl = ws.zlabel.data();
  const int64_t* label = ws.label.data();
  for (int64_t u = 0; u < ld; ++u) zmax[u] = z[u];
  for (int64_t c = 1; c < C; ++c)
#pragma omp simd
    for (int64_t u = 0; u < ld; ++u) zmax[u] = z[c * ld + u] > zmax[u] ? z[c * ld + u] : zmax[u];
  if (correct) {
    for (int64_t u = 0; u < nt; ++u) {
      int64_t best = 0;
      for (int64_t c = 1; c < C; ++c)
        if (z[c * ld + u] > z[best * ld + u]) best = c;
      *correct += best == label[u] ? 1 : 0;
    }
  }
  for (int64_t u = 0; u < ld; ++u) zl[u] = z[label[u] * ld + u] - zmax[u];
  for (int64_t u = 0; u < ld; ++u) sum[u] = T(0);
  for (int64_t c = 0; c < C; ++c) {
    T* __restrict__ zc = z + c * ld;
#pragma omp simd
    for (int64_t u = 0; u < ld; ++u) {
      zc[u] = exp_nonpositive(zc[u] - zmax[u]);
      sum[u] += zc[u];
    }
  }
  T loss = T(0);
  for (int64_t u = 0; u < nt; ++u) loss += std::log(sum[u]) - zl[u];
  if (grad) {
    for (int64_t u = 0; u < ld; ++u) sum[u] = u < nt ? T(1) / sum[u] : T(0);  // 0 clears padding
    for (int64_t c = 0; c < C; ++c)
#pragma omp simd
      for (int64_t u = 0; u < ld; ++u) z[c * ld + u] *= sum[u];
    for (int64_t u = 0; u < nt; ++u) z[label[u] * ld + u] -= T(1);
  }
  return loss;
}

// Loss sum of the chunk in ws.xt (nt real columns of ld); with `grad`, adds Σ x ⊗ dz into ws.g.
template <Family F, typename T>
T chunk_pass(const GlmProblem<T>& prob, Workspace<F, T>& ws, int64_t nt, int64_t ld, bool grad,
             int64_t* correct) {
  const int64_t p = prob.p, C = prob.C;
  const T* __restrict__ Wt = ws.w.Wt.data();
  const T* __restrict__ xt = ws.xt.data();
  T* __restrict__ z = ws.z.data();
  // z[c, :] = b[c] + Σ_k Wt[c, k]·xt[k, :], four features per pass over z[c, :].
  for (int64_t c = 0; c < C; ++c) {
    T* __restrict__ zc = z + c * ld;
    const T* wc = Wt + c * p;
    const T bc = prob.intercept ? ws.w.b[c] : T(0);
    for (int64_t u = 0; u < ld; ++u) zc[u] = bc;
    int64_t k = 0;
    for (; k + 4 <= p; k += 4) {
      const T w0 = wc[k], w1 = wc[k + 1], w2 = wc[k + 2], w3 = wc[k + 3];
      const T *__restrict__ x0 = xt + k * ld, *__restrict__ x1 = x0 + ld, *__restrict__ x2 = x1 + ld,
              *__restrict__ x3 = x2 + ld;
#pragma omp simd
      for (int64_t u = 0; u < ld; ++u) zc[u] += w0 * x0[u] + w1 * x1[u] + w2 * x2[u] + w3 * x3[u];
    }
    for (; k < p; ++k) {
      const T w0 = wc[k];
      const T* __restrict__ x0 = xt + k * ld;
#pragma omp simd
      for (int64_t u = 0; u < ld; ++u) zc[u] += w0 * x0[u];
    }
  }
  T loss = T(0);
  if constexpr (F == Family::Softmax) {
    loss = softmax_columns(ws, C, nt, ld, grad, correct);
  } else {  // C == 1: the per-row math of glm.h
    for (int64_t u = 0; u < nt; ++u) {
      T dz;
      const T zu = z[u];
      loss += loss_grad<F, T>(&zu, 1, ws.label[u], &dz);
      if (correct) *correct += is_correct<F, T>(&zu, 1, ws.label[u]);
      z[u] = dz;
    }
    for (int64_t u = nt; u < ld; ++u) z[u] = T(0);
  }
  if (!grad) return loss;
  T* __restrict__ Gt = ws.g.Wt.data();
  if (ld <= kSmallChunk) {
    // Few rows (a minibatch): G[c, :] += dz[c, u]·x_u along the features of each row, which
    // avoids one horizontal sum per (c, k) that the column form below pays per chunk.
    for (int64_t u = 0; u < nt; ++u) {
      const T* __restrict__ xu = ws.row[u];
      for (int64_t c = 0; c < C; ++c) {
        const T g = z[c * ld + u];
        T* __restrict__ gc = Gt + c * p;
#pragma omp simd
        for (int64_t k = 0; k < p; ++k) gc[k] += g * xu[k];
        if (prob.intercept) ws.g.b[c] += g;
      }
    }
    return loss;
  }
  // G[c, k] += Σ_u dz[c, u]·xt[k, u], four features per pass over dz[c, :].
  for (int64_t c = 0; c < C; ++c) {
    const T* __restrict__ dc = z + c * ld;
    T* gc = Gt + c * p;
    int64_t k = 0;
    for (; k + 4 <= p; k += 4) {
      const T *__restrict__ x0 = xt + k * ld, *__restrict__ x1 = x0 + ld, *__restrict__ x2 = x1 + ld,
              *__restrict__ x3 = x2 + ld;
      T a0 = T(0), a1 = T(0), a2 = T(0), a3 = T(0);
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t u = 0; u < ld; ++u) {
        a0 += dc[u] * x0[u];
        a1 += dc[u] * x1[u];
        a2 += dc[u] * x2[u];
        a3 += dc[u] * x3[u];
      }
      gc[k] += a0;
      gc[k + 1] += a1;
      gc[k + 2] += a2;
      gc[k + 3] += a3;
    }
    for (; k < p; ++k) {
      const T* __restrict__ x0 = xt + k * ld;
      T a0 = T(0);
#pragma omp simd reduction(+ : a0)
      for (int64_t u = 0; u < ld; ++u) a0 += dc[u] * x0[u];
      gc[k] += a0;
    }
    if (prob.intercept) {
      T s = T(0);
#pragma omp simd reduction(+ : s)
      for (int64_t u = 0; u < ld; ++u) s += dc[u];
      ws.g.b[c] += s;
    }
  }
  return loss;
}

// Loss sum of n rows (row_at(t) gives the absolute index of the t-th), chunk by chunk.
template <Family F, typename T, typename RowAt>
T pass_rows(const GlmProblem<T>& prob, Workspace<F, T>& ws, RowAt row_at, int64_t n, bool grad,
            int64_t* correct) {
  T loss = T(0);
  for (int64_t t0 = 0; t0 < n; t0 += ws.cap) {
    const int64_t nt = std::min(ws.cap, n - t0);
    const int64_t ld = load_chunk(prob, ws, row_at, t0, nt);
    loss += chunk_pass(prob, ws, nt, ld, grad, correct);
  }
  return loss;
}

template <Family F, typename T, typename Fn>
void for_each_model_row(const GlmProblem<T>& prob, Fn fn) {
#pragma omp parallel
  {
    Workspace<F, T> ws(prob.p, prob.C);
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
  for_each_model_row<F>(prob, [&](int64_t r, Workspace<F, T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    T* theta_r = args.theta + r * d;
    ws.w.load(theta_r, p, C, icpt);
    const bool has_anchor = args.anchor != nullptr;
    if (has_anchor) ws.a.load(args.anchor_shared ? args.anchor : args.anchor + r * d, p, C, icpt);
    const T gs = args.grad_scale ? args.grad_scale[r] : T(1);
    const auto full = [lo](int64_t t) { return lo + t; };
    // A full-batch client that fits one chunk is transposed once for all its steps.
    const bool resident = !args.batches && n <= ws.cap;
    const int64_t ld = resident ? load_chunk(prob, ws, full, 0, n) : 0;
    for (int64_t s = 0; s < args.steps; ++s) {
      ws.g.zero();
      int64_t nb;
      if (args.batches) {
        const int32_t* batch = args.batches + (r * args.steps + s) * args.batch_size;
        nb = args.batch_size;
        pass_rows(prob, ws, [batch](int64_t t) { return static_cast<int64_t>(batch[t]); }, nb,
                  true, nullptr);
      } else if (resident) {
        nb = n;
        chunk_pass(prob, ws, n, ld, true, nullptr);
      } else {
        nb = n;
        pass_rows(prob, ws, full, nb, true, nullptr);
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
void gradients_family(const GlmProblem<T>& prob, const T* theta, const int32_t* batches,
                      int64_t batch_size, T* out) {
  const int64_t p = prob.p, C = prob.C, d = prob.d();
  const bool icpt = prob.intercept;
  for_each_model_row<F>(prob, [&](int64_t r, Workspace<F, T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    ws.w.load(theta + r * d, p, C, icpt);
    ws.g.zero();
    int64_t nb = n;
    if (batches) {
      const int32_t* batch = batches + r * batch_size;
      nb = batch_size;
      pass_rows(prob, ws, [batch](int64_t t) { return static_cast<int64_t>(batch[t]); }, nb, true,
                nullptr);
    } else {
      pass_rows(prob, ws, [lo](int64_t t) { return lo + t; }, n, true, nullptr);
    }
    ws.g.store(out + r * d, p, C, icpt);
    const T inv_n = T(1) / static_cast<T>(nb);
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
  for_each_model_row<F>(prob, [&](int64_t r, Workspace<F, T>& ws) {
    const int64_t i = prob.rows[r];
    const int64_t lo = prob.offsets[i], n = prob.offsets[i + 1] - lo;
    ws.w.load(theta + r * d, p, C, icpt);
    int64_t hits = 0;
    loss_sum[r] = pass_rows(prob, ws, [lo](int64_t t) { return lo + t; }, n, false, &hits);
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
void gradients(const GlmProblem<T>& prob, const T* theta, const int32_t* batches, int64_t batch_size,
               T* out) {
  dispatch_family(prob.family, [&](auto F) {
    gradients_family<decltype(F)::value, T>(prob, theta, batches, batch_size, out);
  });
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
template void gradients<float>(const GlmProblem<float>&, const float*, const int32_t*, int64_t,
                               float*);
template void gradients<double>(const GlmProblem<double>&, const double*, const int32_t*, int64_t,
                                double*);
template void evaluate<float>(const GlmProblem<float>&, const float*, float*, int64_t*, int64_t*);
template void evaluate<double>(const GlmProblem<double>&, const double*, double*, int64_t*,
                               int64_t*);

}  // namespace pflcore::cpu
