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

#include "pflcore/checks.h"
#include "pflcore/glm.h"
#include "glm_minibatch.h"
#include "pflcore/ops_cpu.h"
#include "pflcore/aligned.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN
namespace {

constexpr int64_t kLanes = 16;               // chunk widths are multiples of this
constexpr int64_t kChunkBytes = 256 * 1024;  // xt of one chunk stays in L2
constexpr int64_t kMaxChunkRows = 4096;
constexpr int64_t kSmallChunk = 64;          // up to this many columns, gradients go row by row
// Calls with less work than this (multiply-adds) run on the calling thread: waking the team
// costs more than it saves.
constexpr int64_t kParallelWork = 1 << 18;

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// One model in the kernel's layout: Wt [C, p] (transposed from theta's [P, C], so that the
// gradient of class c is a contiguous row) and the intercept b [C].
template <typename T>
struct Model {
  aligned_vector<T> Wt, b;
  void resize(int64_t p, int64_t C) {
    Wt.resize(p * C);
    b.resize(C);
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

// Per-thread buffers, kept between calls (thread_local, grown on demand): a small call pays
// no allocation and no zeroing. Cache-line aligned (pflcore/aligned.h): the kernels load whole
// vectors from them, and from malloc's 16-byte alignment 64-byte loads could straddle two lines
// (2,000 clients x 1 minibatch step: median 4.3-4.9 ms, aligned 3.2-3.3, AMD Zen 5, 1 thread). Every buffer is written before it is read, but `zeros`,
// which only ever holds zeros.
template <Family F, typename T>
struct Workspace {
  using Y = label_t<F, T>;
  int64_t cap = 0;           // rows per chunk
  Model<T> w, g, a;          // parameters, gradient accumulator, anchor
  aligned_vector<T> xt;         // [p, cap] the chunk's rows as columns, zero-padded
  aligned_vector<Y> label;      // [cap] their labels (0 on padding)
  aligned_vector<T> z;          // [C, cap] logits, then d loss / d logits (0 on padding)
  aligned_vector<T> colmax, colsum, zlabel;  // [cap] softmax scratch
  aligned_vector<T> zeros;      // [p] the source of padding columns
  std::vector<const T*> row;  // [cap] the chunk's rows in x (row-major, for small chunks)

  // Sizes the buffers for p features, C outputs and chunks of at most `rows` rows.
  void prepare(int64_t p, int64_t C, int64_t rows) {
    const int64_t fit = kChunkBytes / (p * static_cast<int64_t>(sizeof(T)));
    const int64_t most = std::clamp<int64_t>(fit / kLanes * kLanes, kLanes, kMaxChunkRows);
    cap = std::min(most, round_up(std::max<int64_t>(rows, 1), kLanes));
    w.resize(p, C);
    g.resize(p, C);
    a.resize(p, C);
    grow(xt, p * cap);
    grow(label, cap);
    grow(z, C * cap);
    grow(colmax, cap);
    grow(colsum, cap);
    grow(zlabel, cap);
    grow(zeros, p);
    grow(row, cap);
  }
  template <typename Buf>
  static void grow(Buf& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
  static Workspace& local() {
    static thread_local Workspace ws;
    return ws;
  }
};

// Why a row's label or features cannot be used (checks.h): false after recording the fault.
template <Family F, typename T>
bool check_row(const GlmProblem<T>& prob, int64_t key, int64_t row, Faults& faults) {
  using Y = label_t<F, T>;
  const Y yv = static_cast<const Y*>(prob.y)[row];
  if constexpr (F == Family::LeastSquares) {
    if (!std::isfinite(yv)) {
      faults.add(key, FaultKind::NonFinite, "y: y[%lld] = %g is not finite", ll(row), double(yv));
      return false;
    }
  } else {
    const int64_t classes = F == Family::Logistic ? 2 : prob.C;
    if (yv < 0 || yv >= classes) {
      faults.add(key, FaultKind::Value, "y: expected labels in [0, %lld), got y[%lld] = %lld", ll(classes), ll(row),
                 ll(yv));
      return false;
    }
  }
  if (!all_finite(prob.x + row * prob.p, prob.p)) {
    faults.add(key, FaultKind::NonFinite, "x: row %lld holds a NaN or infinite value", ll(row));
    return false;
  }
  return true;
}

// Copies rows row_at(t0 + u), u < nt, into ws.xt as columns and checks their labels and
// features on the way (labels must be valid before they index anything; NaN/inf detected by
// the sum of x − x over the copied block). Returns the padded width ld, or -1 after recording
// the first bad row (in row order) as a fault of model row `key`.
template <Family F, typename T, typename RowAt>
int64_t load_chunk(const GlmProblem<T>& prob, Workspace<F, T>& ws, RowAt row_at, int64_t t0, int64_t nt,
                   int64_t key, Faults& faults) {
  using Y = label_t<F, T>;
  const Y* y = static_cast<const Y*>(prob.y);
  const int64_t p = prob.p, ld = round_up(nt, kLanes);
  const int64_t classes = F == Family::Logistic ? 2 : prob.C;
  T* xt = ws.xt.data();
  for (int64_t u0 = 0; u0 < ld; u0 += kLanes) {
    const T* src[kLanes];
    bool labels_ok = true;
    for (int64_t u = 0; u < kLanes; ++u) {
      if (u0 + u < nt) {
        const int64_t r = row_at(t0 + u0 + u);
        src[u] = prob.x + r * p;
        ws.row[u0 + u] = src[u];
        const Y yv = y[r];
        if constexpr (F == Family::LeastSquares) {
          labels_ok &= std::isfinite(yv);
          ws.label[u0 + u] = yv;
        } else {
          const bool ok = yv >= 0 && yv < classes;
          labels_ok &= ok;
          ws.label[u0 + u] = ok ? yv : Y(0);  // never an index out of range, even before the fault is seen
        }
      } else {
        src[u] = ws.zeros.data();
        ws.label[u0 + u] = Y(0);
      }
    }
    T nonfinite = T(0);
    for (int64_t k = 0; k < p; ++k)
#pragma omp simd reduction(+ : nonfinite)
      for (int64_t u = 0; u < kLanes; ++u) {
        const T v = src[u][k];
        xt[k * ld + u0 + u] = v;
        nonfinite += v - v;
      }
    if (!labels_ok || nonfinite != T(0)) {  // rare: find the first bad row of the block, in order
      for (int64_t u = 0; u0 + u < nt && u < kLanes; ++u)
        if (!check_row<F, T>(prob, key, row_at(t0 + u0 + u), faults)) return -1;
    }
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

// Loss sum of n rows (row_at(t) gives the absolute index of the t-th), chunk by chunk; false
// (after recording a fault for model row `key`) if a row fails its checks.
template <Family F, typename T, typename RowAt>
bool pass_rows(const GlmProblem<T>& prob, Workspace<F, T>& ws, RowAt row_at, int64_t n, bool grad, int64_t* correct,
               int64_t key, Faults& faults, T* loss) {
  T total = T(0);
  for (int64_t t0 = 0; t0 < n; t0 += ws.cap) {
    const int64_t nt = std::min(ws.cap, n - t0);
    const int64_t ld = load_chunk(prob, ws, row_at, t0, nt, key, faults);
    if (ld < 0) return false;
    total += chunk_pass(prob, ws, nt, ld, grad, correct);
  }
  if (loss) *loss = total;
  return true;
}

// Runs fn(r, ws) for every model row, on the team when the call has enough work
// (`work` multiply-adds), else on the calling thread. Rows never share a sum, so the results
// do not depend on the thread count.
template <Family F, typename T, typename Fn>
void for_each_model_row(const GlmProblem<T>& prob, int64_t rows_per_chunk, int64_t work, Fn fn) {
  if (prob.R <= 1 || work < kParallelWork) {  // a small call: no team to wake
    Workspace<F, T>& ws = Workspace<F, T>::local();
    ws.prepare(prob.p, prob.C, rows_per_chunk);
    for (int64_t r = 0; r < prob.R; ++r) fn(r, ws);
    return;
  }
#pragma omp parallel
  {
    Workspace<F, T>& ws = Workspace<F, T>::local();
    ws.prepare(prob.p, prob.C, rows_per_chunk);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < prob.R; ++r) fn(r, ws);
  }
}

// Most rows one pass reads (for sizing chunks), and the multiply-adds of one pass over them.
template <typename T>
int64_t widest_client(const GlmProblem<T>& prob) {
  // Only for sizing: a bad offset is reported by client_of_row, and any width works here.
  int64_t most = 1;
  for (int64_t r = 0; r < prob.R; ++r) {
    const int64_t i = prob.rows ? prob.rows[r] : r;
    if (i < 0 || i >= prob.m) continue;
    most = std::max(most, prob.offsets[i + 1] - prob.offsets[i]);
  }
  return most;
}

// Checks row r's client, offsets and the batch indices it will read: [steps, B] absolute row
// indices that must lie in [lo, hi). `two_d` batches are indexed [r, j] in messages.
inline bool check_batches(const int32_t* batch, int64_t B, int64_t lo, int64_t hi, int64_t client, int64_t r,
                          int64_t s, bool two_d, Faults& faults) {
  for (int64_t j = 0; j < B; ++j) {
    const int64_t b = batch[j];
    if (b < lo || b >= hi) {
      if (two_d)
        faults.add(r, FaultKind::Value, "batches: index %lld at [%lld, %lld] is outside the rows [%lld, %lld) of client %lld",
                   ll(b), ll(r), ll(j), ll(lo), ll(hi), ll(client));
      else
        faults.add(r, FaultKind::Value,
                   "batches: index %lld at [%lld, %lld, %lld] is outside the rows [%lld, %lld) of client %lld", ll(b),
                   ll(r), ll(s), ll(j), ll(lo), ll(hi), ll(client));
      return false;
    }
  }
  return true;
}

template <typename T>
bool row_finite(const T* v, int64_t n, const char* name, int64_t r, Faults& faults) {
  if (all_finite(v, n)) return true;
  faults.add(r, FaultKind::NonFinite, "%s: row %lld holds a NaN or infinite value", name, ll(r));
  return false;
}

// One model [d] shared by every row (theta_stride 0) is checked once, before any row.
template <typename T>
bool shared_theta_finite(const T* theta, int64_t theta_stride, int64_t d, Faults& faults) {
  if (theta_stride || all_finite(theta, d)) return true;
  faults.add(0, FaultKind::NonFinite, "theta: holds a NaN or infinite value");
  return false;
}

// w ← w − lr·(scale·g + l2·w + prox·(w − a)) elementwise; a = 0 when has_anchor is false.
template <typename T>
void apply_step(T* __restrict__ w, const T* __restrict__ g, const T* __restrict__ a, int64_t n,
                T lr, T scale, T l2, T prox, bool has_anchor) {
#ifdef PFLCORE_ROWPATH_AVX512
  if constexpr (std::is_same_v<T, float>) {  // full-width registers (GCC's loops here use half)
    minibatch::avx512::apply_step(w, g, has_anchor ? a : nullptr, n, lr, scale, l2, prox);
    return;
  }
#endif
  if (has_anchor) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) w[k] -= lr * (scale * g[k] + l2 * w[k] + prox * (w[k] - a[k]));
  } else {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) w[k] -= lr * (scale * g[k] + l2 * w[k] + prox * w[k]);
  }
}

// The labels of the rows row_at(0..n) in order; at the first bad one, the rows before it are
// checked whole (features too), so that the fault reported is the first bad value in row
// order, as the reference reports it. The features of rows with good labels are checked through their
// logits by checked_pass.
template <typename T, typename RowAt>
bool check_labels(const GlmProblem<T>& prob, RowAt row_at, int64_t n, int64_t key, Faults& faults) {
  const int64_t* y = static_cast<const int64_t*>(prob.y);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t v = y[row_at(j)];
    if (v < 0 || v >= prob.C) {
      for (int64_t i = 0; i < j; ++i)
        if (!check_row<Family::Softmax, T>(prob, key, row_at(i), faults)) return false;
      return check_row<Family::Softmax, T>(prob, key, row_at(j), faults);
    }
  }
  return true;
}

// Runs a row-path pass, pass(&at), that stops at the first block of rows whose logits are not
// all finite (at = its first row's position). A NaN/inf feature always makes them so: the first
// such row from `at` on is then reported (rows before `at` had finite logits). Finite features
// whose logits overflowed are not a fault: once every row from `at` on is seen finite, the pass
// runs again unchecked, as it would have after an up-front scan of the rows. This replaces that
// scan, which read every row's features once more before the math.
template <typename T, typename RowAt, typename Pass>
bool checked_pass(const GlmProblem<T>& prob, RowAt row_at, int64_t n, int64_t key, Faults& faults, Pass pass) {
  int64_t at = -1;
  pass(&at);
  if (at < 0) return true;
  for (int64_t j = at; j < n; ++j) {
    const int64_t row = row_at(j);
    if (!all_finite(prob.x + row * prob.p, prob.p)) {
      faults.add(key, FaultKind::NonFinite, "x: row %lld holds a NaN or infinite value", ll(row));
      return false;
    }
  }
  pass(nullptr);
  return true;
}

// The row path (glm_minibatch.h) serves softmax with C <= 4 registers of classes, for every
// model row (minibatches and whole clients alike: measured faster than the column path at any
// size, 1.3-1.5x on 1,000 clients of ~350 rows). The choice depends only on the model, never on
// the rows of the call, so a client's result is the same whatever it is batched with (sharding).
// CP = 0: no row path (least squares and logistic, whose single logit fills no register, or
// too many classes): the column path.
template <int64_t CP>
inline bool on_row_path(int64_t /*rows_per_pass*/) {
  return CP > 0;
}

// The checks every model row starts with: its client, its parameters, anchor and grad_scale.
template <typename T>
bool row_args_ok(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, int64_t r, int64_t* i, int64_t* lo,
                 int64_t* hi, Faults& faults) {
  const int64_t d = prob.d();
  if (!client_of_row(prob.rows, prob.offsets, prob.m, prob.N, r, i, lo, hi, faults)) return false;
  if (!row_finite(args.theta + r * d, d, "theta", r, faults)) return false;
  if (args.anchor && !args.anchor_shared && !row_finite(args.anchor + r * d, d, "anchor", r, faults)) return false;
  const T gs = args.grad_scale ? args.grad_scale[r] : T(1);
  if (!std::isfinite(gs)) {
    faults.add(r, FaultKind::NonFinite, "grad_scale: grad_scale[%lld] = %g is not finite", ll(r), double(gs));
    return false;
  }
  return true;
}

// Asks for the minibatch's rows before they are read: they lie anywhere in the client's data,
// so each is a cache miss, and asking for all of them at once overlaps the misses. Into L2
// (prefetcht1), not L1: a 5-step B = 20 local_steps of 2,000 clients (53 MB of rows) went
// 15.9-16.2 -> 13.6-14.0 ms at 1 thread and 8.9-10.4 -> 7.8-7.9 at 2 (AMD Zen 4, alternating
// builds), as k-means' and the full-batch rows' prefetches gained from the same change.
template <typename T>
inline void prefetch_rows(const GlmProblem<T>& prob, const int32_t* batch, int64_t B, int64_t lo, int64_t hi) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t j = 0; j < B; ++j) {
    const int64_t row = batch[j];
    if (row < lo || row >= hi) continue;  // not read: the check reports it
    const T* xr = prob.x + row * prob.p;
    for (int64_t k = 0; k < prob.p; k += kLine) __builtin_prefetch(xr + k, 0, 2);
  }
}

// Asks for the first rows of the client two model rows on (the one this thread likely takes next:
// rows go to the team's threads one at a time, in order) while this one computes; the row path's
// pass asks for the rest itself, kAheadRows ahead. A full-batch pass
// reads each client's rows once; where the federation is larger than the caches they come from
// memory, and the hardware prefetchers, which follow one client's run at a time, left the first
// full-batch pass ~2x the time of a later one (2,000 clients, 53 MB of float32 rows, 2 threads, AMD
// Zen 5: ops.gradients 5.3 -> 4.1 ms, a 5-step local_steps 16.6 -> 15.6 ms). Data that fits in the
// caches gains nothing and pays the prefetch instructions (500 clients, 13 MB: gradients +11%),
// hence the size threshold. The prefetches change no result.
constexpr int64_t kPrefetchAhead = 2;
constexpr int64_t kPrefetchMinBytes = int64_t(32) << 20;
template <typename T>
inline void prefetch_next_client(const GlmProblem<T>& prob, int64_t r) {
  if (prob.N * prob.p * int64_t(sizeof(T)) < kPrefetchMinBytes || r + kPrefetchAhead >= prob.R) return;
  const int64_t i = prob.rows ? prob.rows[r + kPrefetchAhead] : r + kPrefetchAhead;
  if (i < 0 || i >= prob.m) return;  // (reported when that row runs)
  const int64_t lo = prob.offsets[i], hi = prob.offsets[i + 1];
  if (lo < 0 || hi > prob.N || lo >= hi) return;
  const char* first = reinterpret_cast<const char*>(prob.x + lo * prob.p);
  // its first rows only, up to where the pass's own prefetch (kAheadRows ahead of each block,
  // glm_rows.h) takes over: the whole client at once (~400 lines at 111 rows) flooded the queues
  // and cost more than it saved once the rows are asked for ahead (2,000 clients, 53 MB:
  // ops.gradients 7.2 -> 6.7 ms at 1 thread, 4.0 -> 3.5 at 2; a permuted 1-step round 8.1-8.9
  // -> 7.9-8.0 and 4.1-4.6 -> 3.9-4.3 ms)
  const int64_t rows = std::min<int64_t>(hi - lo, minibatch::kAheadRows + minibatch::kRows);
  const int64_t bytes = rows * prob.p * int64_t(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(first + o, 0, 2);
#if defined(__GNUC__)
  // A function whose only effect is prefetches counts as having none: GCC dropped its calls.
  __asm__ __volatile__("" ::: "memory");
#endif
}

// Row r's steps on the row path.
template <typename T, int64_t CP>
void local_steps_rowpath(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, int64_t r, int64_t i, int64_t lo,
                         int64_t hi, Faults& faults) {
  const int64_t p = prob.p, C = prob.C, d = prob.d(), P = p + (prob.intercept ? 1 : 0);
  const auto expf_ = [](T v) { return exp_nonpositive(v); };
  const int64_t* y = static_cast<const int64_t*>(prob.y);
  auto& mb = minibatch::Buffers<T>::local();
  mb.prepare(P, CP);
  T* theta_r = args.theta + r * d;
  const bool has_anchor = args.anchor != nullptr;
  const minibatch::ContiguousRows full{lo};
  if (!args.batches && !check_labels(prob, full, hi - lo, r, faults)) return;  // the same rows every step
  minibatch::load_padded<T, CP>(mb.W.data(), theta_r, P, C);
  if (has_anchor) minibatch::load_padded<T, CP>(mb.A.data(), args.anchor_shared ? args.anchor : args.anchor + r * d, P, C);
  const int64_t B = args.batches ? args.batch_size : hi - lo;
  const T scale = (args.grad_scale ? args.grad_scale[r] : T(1)) / static_cast<T>(B);
  const int32_t* checked = nullptr;  // the last minibatch checked (and prefetched) for this row
  for (int64_t s = 0; s < args.steps; ++s) {
    if (args.batches) {
      const int32_t* batch = args.batches + (r * args.steps + s) * B;
      const auto at = [batch](int64_t t) { return static_cast<int64_t>(batch[t]); };
      // pFedMe solves each inner problem on one minibatch repeated K times: a step on the rows
      // of the step before needs neither their checks again nor their prefetch.
      const auto step = [&](int64_t* nonfinite) {
        minibatch::gradient<T, CP>(prob.x, p, y, prob.intercept, C, at, B, mb.W.data(), mb.G.data(), mb.Z.data(),
                                   false, expf_, nonfinite);
      };
      if (!(checked && std::equal(batch, batch + B, checked))) {
        prefetch_rows(prob, batch, B, lo, hi);
        if ((prob.check_batches && !check_batches(batch, B, lo, hi, i, r, s, false, faults)) ||
            !check_labels(prob, at, B, r, faults) || !checked_pass(prob, at, B, r, faults, step))
          return;
        checked = batch;
      } else {
        step(nullptr);
      }
    } else {  // the client's rows, checked through the logits of the first step
      const auto step = [&](int64_t* nonfinite) {
        minibatch::gradient<T, CP>(prob.x, p, y, prob.intercept, C, full, B, mb.W.data(), mb.G.data(), mb.Z.data(),
                                   false, expf_, nonfinite);
      };
      if (s > 0)
        step(nullptr);
      else if (!checked_pass(prob, full, B, r, faults, step))
        return;
    }
    apply_step(mb.W.data(), mb.G.data(), mb.A.data(), P * CP, args.lr, scale, prob.l2, args.prox, has_anchor);
  }
  minibatch::store_unpadded<T, CP>(theta_r, mb.W.data(), P, C);  // only a row that passed every check
}

template <Family F, typename T, int64_t CP>
void local_steps_family(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, Faults& faults) {
  const int64_t p = prob.p, C = prob.C, d = prob.d();
  const bool icpt = prob.intercept;
  const int64_t per_pass = args.batches ? args.batch_size : widest_client(prob);
  const int64_t work = prob.R * args.steps * per_pass * (p + 1) * C;
  if (args.anchor_shared && !all_finite(args.anchor, d)) {
    faults.add(0, FaultKind::NonFinite, "anchor: holds a NaN or infinite value");
    return;  // before any row: every row would read it
  }
  for_each_model_row<F>(prob, per_pass, work, [&](int64_t r, Workspace<F, T>& ws) {
    int64_t i, lo, hi;
    if (!row_args_ok(prob, args, r, &i, &lo, &hi, faults)) return;
    const int64_t n = hi - lo;
    if (on_row_path<CP>(args.batches ? args.batch_size : n)) {
      if (!args.batches) prefetch_next_client(prob, r);
      if constexpr (CP > 0) local_steps_rowpath<T, CP>(prob, args, r, i, lo, hi, faults);
      return;
    }
    T* theta_r = args.theta + r * d;
    const bool has_anchor = args.anchor != nullptr;
    const T* anchor_r = args.anchor_shared ? args.anchor : args.anchor + r * d;
    const T gs = args.grad_scale ? args.grad_scale[r] : T(1);
    ws.w.load(theta_r, p, C, icpt);
    if (has_anchor) ws.a.load(anchor_r, p, C, icpt);
    const minibatch::ContiguousRows full{lo};
    // A full-batch client that fits one chunk is transposed (and checked) once for all its steps.
    const bool resident = !args.batches && n <= ws.cap;
    const int64_t ld = resident ? load_chunk(prob, ws, full, 0, n, r, faults) : 0;
    if (ld < 0) return;
    for (int64_t s = 0; s < args.steps; ++s) {
      ws.g.zero();
      int64_t nb = n;
      if (args.batches) {
        const int32_t* batch = args.batches + (r * args.steps + s) * args.batch_size;
        nb = args.batch_size;
        if (prob.check_batches && !check_batches(batch, nb, lo, hi, i, r, s, false, faults)) return;
        if (!pass_rows(prob, ws, [batch](int64_t t) { return static_cast<int64_t>(batch[t]); }, nb, true, nullptr,
                       r, faults, static_cast<T*>(nullptr)))
          return;
      } else if (resident) {
        chunk_pass(prob, ws, n, ld, true, nullptr);
      } else if (!pass_rows(prob, ws, full, n, true, nullptr, r, faults, static_cast<T*>(nullptr))) {
        return;
      }
      const T scale = gs / static_cast<T>(nb);
      apply_step(ws.w.Wt.data(), ws.g.Wt.data(), ws.a.Wt.data(), p * C, args.lr, scale, prob.l2,
                 args.prox, has_anchor);
      if (icpt)
        apply_step(ws.w.b.data(), ws.g.b.data(), ws.a.b.data(), C, args.lr, scale, prob.l2,
                   args.prox, has_anchor);
    }
    ws.w.store(theta_r, p, C, icpt);  // only a row that passed every check is written
  });
}

// What a gradients or evaluate pass of model row r reads: its model (checked, unless one model
// [d] serves every row), and its rows: the minibatch batches[r] (checked against the client's
// rows) or the whole client.
template <typename T>
struct RowPass {
  const T* theta;
  const int32_t* batch;  // [n] or null: rows lo..lo+n
  int64_t lo, n;
};

template <typename T>
bool start_row(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
               int64_t batch_size, int64_t r, RowPass<T>* out, Faults& faults) {
  int64_t i, lo, hi;
  if (!client_of_row(prob.rows, prob.offsets, prob.m, prob.N, r, &i, &lo, &hi, faults)) return false;
  out->theta = theta + r * theta_stride;
  if (theta_stride && !row_finite(out->theta, prob.d(), "theta", r, faults)) return false;
  out->batch = batches ? batches + r * batch_size : nullptr;
  out->lo = lo;
  out->n = batches ? batch_size : hi - lo;
  return !(out->batch && prob.check_batches && !check_batches(out->batch, out->n, lo, hi, i, r, 0, true, faults));
}

template <Family F, typename T, int64_t CP>
void gradients_family(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
                      int64_t batch_size, T* out, Faults& faults) {
  const int64_t p = prob.p, C = prob.C, d = prob.d(), P = p + (prob.intercept ? 1 : 0);
  const bool icpt = prob.intercept;
  const int64_t per_pass = batches ? batch_size : widest_client(prob);
  if (!shared_theta_finite(theta, theta_stride, d, faults)) return;
  for_each_model_row<F>(prob, per_pass, prob.R * per_pass * (p + 1) * C, [&](int64_t r, Workspace<F, T>& ws) {
    RowPass<T> rp;
    if (!start_row(prob, theta, theta_stride, batches, batch_size, r, &rp, faults)) return;
    if (!batches) prefetch_next_client(prob, r);
    {  // the output row, for writing, while this row's pass computes
      const char* orow = reinterpret_cast<const char*>(out + r * d);
      for (int64_t o = 0; o < d * int64_t(sizeof(T)); o += 64) __builtin_prefetch(orow + o, 1, 3);
    }
    const T* th = rp.theta;
    const int32_t* batch = rp.batch;
    const int64_t lo = rp.lo, nb = rp.n;
    T* o = out + r * d;
    const T inv_n = T(1) / static_cast<T>(nb);
    if (on_row_path<CP>(nb)) {
      if constexpr (CP > 0) {
        auto& mb = minibatch::Buffers<T>::local();
        mb.prepare(P, CP);
        const auto expf_ = [](T v) { return exp_nonpositive(v); };
        const int64_t* y = static_cast<const int64_t*>(prob.y);
        minibatch::load_padded<T, CP>(mb.W.data(), th, P, C);
        const auto run = [&](auto at) {
          return check_labels(prob, at, nb, r, faults) &&
                 checked_pass(prob, at, nb, r, faults, [&](int64_t* nonfinite) {
                   minibatch::gradient<T, CP>(prob.x, p, y, icpt, C, at, nb, mb.W.data(), mb.G.data(), mb.Z.data(),
                                              false, expf_, nonfinite);
                 });
        };
        const bool ok = batch ? run([batch](int64_t t) { return static_cast<int64_t>(batch[t]); })
                              : run(minibatch::ContiguousRows{lo});
        if (!ok) return;
        minibatch::store_unpadded<T, CP>(o, mb.G.data(), P, C);
      }
    } else {
      ws.w.load(th, p, C, icpt);
      ws.g.zero();
      if (batch) {
        if (!pass_rows(prob, ws, [batch](int64_t t) { return static_cast<int64_t>(batch[t]); }, nb, true, nullptr, r,
                       faults, static_cast<T*>(nullptr)))
          return;
      } else if (!pass_rows(prob, ws, [lo](int64_t t) { return lo + t; }, nb, true, nullptr, r, faults,
                            static_cast<T*>(nullptr))) {
        return;
      }
      ws.g.store(o, p, C, icpt);
    }
    for (int64_t k = 0; k < d; ++k) o[k] = o[k] * inv_n + prob.l2 * th[k];
  });
}

template <Family F, typename T, int64_t CP>
void evaluate_family(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
                     int64_t batch_size, T* loss_sum, int64_t* correct, int64_t* count, Faults& faults) {
  const int64_t p = prob.p, C = prob.C, d = prob.d(), P = p + (prob.intercept ? 1 : 0);
  const bool icpt = prob.intercept;
  const int64_t per_pass = batches ? batch_size : widest_client(prob);
  if (!shared_theta_finite(theta, theta_stride, d, faults)) return;
  for_each_model_row<F>(prob, per_pass, prob.R * per_pass * (p + 1) * C, [&](int64_t r, Workspace<F, T>& ws) {
    RowPass<T> rp;
    if (!start_row(prob, theta, theta_stride, batches, batch_size, r, &rp, faults)) return;
    const T* th = rp.theta;
    const int32_t* batch = rp.batch;
    const int64_t lo = rp.lo, n = rp.n;
    int64_t hits = 0;
    T loss = T(0);
    const auto evaluate_rows = [&](auto row_at) {
      if (on_row_path<CP>(n)) {
        if constexpr (CP > 0) {
          auto& mb = minibatch::Buffers<T>::local();
          mb.prepare(P, CP);
          if (!check_labels(prob, row_at, n, r, faults)) return false;
          minibatch::load_padded<T, CP>(mb.W.data(), th, P, C);
          return checked_pass(prob, row_at, n, r, faults, [&](int64_t* nonfinite) {
            loss = minibatch::loss_and_hits<T, CP>(prob.x, p, static_cast<const int64_t*>(prob.y), icpt, C, row_at, n,
                                                   mb.W.data(), mb.Z.data(), &hits,
                                                   [](T v) { return exp_nonpositive(v); }, nonfinite);
          });
        }
        return true;
      }
      ws.w.load(th, p, C, icpt);
      return pass_rows(prob, ws, row_at, n, false, &hits, r, faults, &loss);
    };
    const bool ok = batch ? evaluate_rows([batch](int64_t t) { return static_cast<int64_t>(batch[t]); })
                          : evaluate_rows(minibatch::ContiguousRows{lo});
    if (!ok) return;
    loss_sum[r] = loss;
    correct[r] = hits;
    count[r] = n;
  });
}

// fn(CP) with the padded class count of the row path for softmax (when C fits), else fn(0).
template <Family F, typename T, typename Fn>
void with_row_path(int64_t C, Fn fn) {
  if constexpr (F == Family::Softmax) {
    if (minibatch::with_padded_classes<T>(C, fn)) return;
  }
  fn(std::integral_constant<int64_t, 0>{});
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
void local_steps(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, Faults& faults) {
  if (args.steps == 0 || prob.R == 0) return;  // reads nothing
  dispatch_family(prob.family, [&](auto F) {
    constexpr Family f = decltype(F)::value;
    with_row_path<f, T>(prob.C, [&](auto CP) { local_steps_family<f, T, CP.value>(prob, args, faults); });
  });
}

template <typename T>
void gradients(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
               int64_t batch_size, T* out, Faults& faults) {
  dispatch_family(prob.family, [&](auto F) {
    constexpr Family f = decltype(F)::value;
    with_row_path<f, T>(prob.C, [&](auto CP) {
      gradients_family<f, T, CP.value>(prob, theta, theta_stride, batches, batch_size, out, faults);
    });
  });
}

template <typename T>
void evaluate(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
              int64_t batch_size, T* loss_sum, int64_t* correct, int64_t* count, Faults& faults) {
  dispatch_family(prob.family, [&](auto F) {
    constexpr Family f = decltype(F)::value;
    with_row_path<f, T>(prob.C, [&](auto CP) {
      evaluate_family<f, T, CP.value>(prob, theta, theta_stride, batches, batch_size, loss_sum, correct, count,
                                      faults);
    });
  });
}

template void local_steps<float>(const GlmProblem<float>&, const LocalStepsArgs<float>&, Faults&);
template void local_steps<double>(const GlmProblem<double>&, const LocalStepsArgs<double>&, Faults&);
template void gradients<float>(const GlmProblem<float>&, const float*, int64_t, const int32_t*, int64_t, float*,
                               Faults&);
template void gradients<double>(const GlmProblem<double>&, const double*, int64_t, const int32_t*, int64_t, double*,
                                Faults&);
template void evaluate<float>(const GlmProblem<float>&, const float*, int64_t, const int32_t*, int64_t, float*,
                              int64_t*, int64_t*, Faults&);
template void evaluate<double>(const GlmProblem<double>&, const double*, int64_t, const int32_t*, int64_t, double*,
                               int64_t*, int64_t*, Faults&);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
