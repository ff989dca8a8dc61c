// Entry points of the CPU kernels (csrc/cpu/*.cpp), called by bindings/core.cpp.
// All pointers are to C-contiguous buffers whose shapes and dtypes Python checked
// (pflcore/_checks.py); shapes are in the comment beside each argument. T is float or double.
// The VALUES are the kernels' to check, as they read them (pflcore/checks.h): every function
// taking `Faults&` records there what it could not use, and works on no row that is bad.
#pragma once
#include <cstdint>

#include "pflcore/checks.h"
#include "pflcore/common.h"

namespace pflcore::cpu {

// The federation's data and the model family, shared by local_steps/gradients/evaluate.
template <typename T>
struct GlmProblem {
  Family family;
  int64_t p;               // features
  int64_t C;               // outputs
  bool intercept;          // parameter row p multiplies an implicit 1
  T l2;                    // l2/2·‖θ‖² in every client objective
  const T* x;              // [N, p]
  int64_t N;               // rows of x
  const void* y;           // [N] T for LeastSquares, int64 otherwise
  const int64_t* offsets;  // [m + 1]
  int64_t m;               // clients
  const int64_t* rows;     // [R] client of each model row, or null: row r is client r (R = m)
  int64_t R;               // model rows
  bool check_batches = true;  // false: the batch indices were drawn by the caller's run context
  int64_t d() const { return (p + (intercept ? 1 : 0)) * C; }
};

template <typename T>
struct LocalStepsArgs {
  T* theta;                  // [R, d] updated in place
  const int32_t* batches;    // [R, steps, B] absolute row indices, or null = full batch
  int64_t batch_size;        // B (0 when batches is null)
  const T* anchor;           // [R, d], [d] or null
  bool anchor_shared;        // anchor is one [d] vector for every row
  const T* grad_scale;       // [R] or null (= 1)
  int64_t steps;
  T lr;
  T prox;
};

// The kernels: in a kernel source, those of its level; elsewhere the dispatcher's
// (csrc/cpu/dispatch.cpp), which calls the level in use.
PFLCORE_LEVEL_BEGIN

template <typename T>
void local_steps(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, Faults& faults);

// Gradient of f_i at each row: the mean loss over client i's rows, or over batch[r] when
// batches is given, plus l2·θ.
// theta_stride: d (one model per row) or 0 (one model [d] for every row).
template <typename T>
void gradients(const GlmProblem<T>& prob, const T* theta /*[R, d] or [d]*/, int64_t theta_stride,
               const int32_t* batches /*[R, B] or null*/, int64_t batch_size, T* out /*[R, d]*/, Faults& faults);

// Loss sum, correctly classified rows and rows of each model row on its client's rows, or on
// batches[r] (a sample of them) when batches is given.
template <typename T>
void evaluate(const GlmProblem<T>& prob, const T* theta /*[R, d] or [d]*/, int64_t theta_stride,
              const int32_t* batches /*[R, B] or null*/, int64_t batch_size, T* loss_sum /*[R]*/,
              int64_t* correct /*[R]*/, int64_t* count /*[R]*/, Faults& faults);

// The multiply-adds (N·K·d) up to which a k-means call (kmeans_assign, kmeans_lloyd) runs on the
// calling thread: waking a second thread costs more below it (csrc/cpu/kmeans.cpp); the binding
// also keeps the GIL for such a call (a few µs).
constexpr int64_t kKmeansSerialWork = int64_t(1) << 18;

// Checks that the centroids, then the points, are finite (NaN/inf would never be chosen, or
// always: a silently wrong label).
template <typename T>
void kmeans_assign(const T* points /*[N, d]*/, const T* centroids /*[K, d]*/, int64_t N,
                   int64_t K, int64_t d, int64_t* labels /*[N]*/, T* sqdist /*[N]*/, Faults& faults);

// centroids[k] <- weighted mean of the points labelled k; clusters with zero weight keep
// their centroid. weight_sum [K] receives each cluster's total weight. Labels must lie in
// [0, K) and weights be finite and >= 0 (checked before anything is written).
template <typename T>
void kmeans_update(const T* points /*[N, d]*/, const int64_t* labels /*[N]*/,
                   const T* weights /*[N] or null*/, int64_t N, int64_t K, int64_t d,
                   T* centroids /*[K, d]*/, double* weight_sum /*[K]*/, Faults& faults);

// Lloyd's k-means from the given centroids, one pass over the points per iteration (assignment
// as kmeans_assign, with each cluster's float64 sum and weight in the same pass): after the first
// assignment, up to `iters` times: centroids ← the clusters' weighted means (an empty cluster
// keeps its centroid), assign again; stop when no label changes or when the squared centroid shift
// is at most tol × the points' total variance. history[t] = Σ_i w_i·sqdist_i after assignment t
// (history[0..*iterations]); labels are the last assignment's. Bitwise the same on any thread
// count. Checks the centroids, the weights, then the points (as it reads them).
template <typename T>
void kmeans_lloyd(const T* points /*[N, d]*/, const T* weights /*[N] or null*/, int64_t N, int64_t K, int64_t d,
                  T* centroids /*[K, d] in place*/, int64_t iters, double tol, int64_t* labels /*[N]*/,
                  double* history /*[iters + 1]*/, int64_t* iterations, Faults& faults);

// Stores r = tu − u in R_hist[slot] and tu in TU_hist[slot], and returns in dots[j] the
// inner products <R_hist[slots[j]], r> (float64, fixed block order: deterministic).
template <typename T>
void anderson_push(const T* u /*[D]*/, const T* tu /*[D]*/, T* R_hist /*[H, D]*/,
                   T* TU_hist /*[H, D]*/, int64_t D, int64_t slot, const int64_t* slots /*[k]*/,
                   int64_t k, double* dots /*[k]*/);

// out = Σ_j pi[j] · TU_hist[slots[j]].
template <typename T>
void anderson_mix(const T* TU_hist /*[H, D]*/, int64_t D, const int64_t* slots /*[k]*/,
                  const double* pi /*[k]*/, int64_t k, T* out /*[D]*/);

// Gram matrix of k vectors of length D, float64 accumulation, fixed block order.
template <typename T>
void gram(const T* vecs /*[k, D]*/, int64_t k, int64_t D, double* G /*[k, k]*/);

// pi = argmin πᵀ(G + λI)π s.t. Σπ = 1, λ = reg·trace(G): pi = (G+λI)⁻¹1 / 1ᵀ(G+λI)⁻¹1.
void anderson_solve(const double* G /*[k, k]*/, int64_t k, double reg, double* pi /*[k]*/);

// Thin convolutions of many CNN models at once (csrc/cpu/cnn.cpp; the nets backend's CPU CNN path,
// pflcore/backends/cnn_native.py). Images are runs of "wide" planes; G models (groups) of n
// images each, image i = g·n + r uses model g's weights. P (positions per plane) is a multiple
// of 8, and every src read (q + off[t], q < P) lies inside the caller's buffers. Trusted inputs:
// the caller built every buffer and offset.
//   out[i][r][q] = bias[g][r] + Σ_t w[g][r][t] · src[i·src_img + q + off[t]]        (bias may be null)
template <typename T>
void cnn_shifted_gemm(const T* src, int64_t src_img, const int64_t* off /*[Tn]*/, int64_t Tn,
                      const T* w /*[G, R, Tn]*/, const T* bias /*[G, R]*/, int64_t G, int64_t n, int64_t R,
                      int64_t P, T* out /*out[i·out_img + r·out_row + q]*/, int64_t out_img, int64_t out_row);
// The input gradient (scatter form; dz's columns x >= Wo must be zero): planes of dx_row values,
//   dx[i][ci][q + a·Wp + b] = Σ_{(a, b), q < Qv} Σ_co wt[g][ci][a·k + b][co] · dz[i·dz_img + co·dz_row + q]
// P (a multiple of 8, <= dz_row) positions are read from each dz plane; Qv <= P and
// Qv + (k − 1)·(Wp + 1) <= dx_row (every write inside the plane; values after it set to 0).
template <typename T>
void cnn_input_grad(const T* dz, int64_t dz_img, int64_t dz_row, const T* wt /*[G, Cin, k·k, Cout]*/, int64_t G,
                    int64_t n, int64_t Cout, int64_t Cin, int64_t k, int64_t Wp, int64_t P, int64_t Qv, T* dx,
                    int64_t dx_img, int64_t dx_row);
//   dw[g][r][t] = Σ_{i in g} Σ_{q<P} a[i·a_img + r·a_row + q] · src[i·src_img + q + off[t]];
//   db[g][r] = Σ_{i in g} Σ_{q<P} a[i·a_img + r·a_row + q]                              (db may be null)
template <typename T>
void cnn_shifted_corr(const T* a, int64_t a_img, int64_t a_row, const T* src, int64_t src_img,
                      const int64_t* off /*[Tn]*/, int64_t Tn, int64_t G, int64_t n, int64_t R, int64_t P,
                      T* dw /*[G, R, Tn]*/, T* db /*[G, R]*/);
// Max-pooling (window = stride = pool) of the planes z [N, C, z_row] (rows of Wz values), then the
// ReLU: h[(i / n)·out_group + (i % n)·out_img + c·s_c + y·s_y + x·s_x] for y < H2, x < W2, and
// idx [N, C, H2, W2] the position in z's plane of each window's first maximal value.
template <typename T>
void cnn_pool_relu(const T* z, int64_t N, int64_t C, int64_t z_row, int64_t Wz, int64_t H2, int64_t W2,
                   int64_t pool, int64_t n, T* out, int64_t out_group, int64_t out_img, int64_t s_c, int64_t s_y,
                   int64_t s_x, int32_t* idx);
// cnn_shifted_gemm into planes of P values (out_row = P) then cnn_pool_relu (z_row = P, N = G·n,
// C = R), one image at a time: the same values, without a buffer of every image's planes.
template <typename T>
void cnn_conv_pool_relu(const T* src, int64_t src_img, const int64_t* off /*[Tn]*/, int64_t Tn,
                        const T* w /*[G, R, Tn]*/, const T* bias /*[G, R] or null*/, int64_t G, int64_t n, int64_t R,
                        int64_t P, int64_t Wz, int64_t H2, int64_t W2, int64_t pool, T* out, int64_t out_group,
                        int64_t out_img, int64_t s_c, int64_t s_y, int64_t s_x, int32_t* idx);
// Its gradient: each of the N·C planes of dz_row values from dz is overwritten with zeros but
// dz[i·C·dz_row + c·dz_row + idx] = da[same place as h] where h > 0.
template <typename T>
void cnn_pool_relu_backward(const T* da, const T* h, int64_t N, int64_t C, int64_t H2, int64_t W2, int64_t n,
                            int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x,
                            const int32_t* idx, T* dz, int64_t dz_row);
// A conv layer's backward from its pooled gradient, without dz: the same values as
// cnn_pool_relu_backward then cnn_shifted_corr and cnn_input_grad (summed in another order), from the
// windows whose gradient (da where h > 0) is not 0, each at its maximum idx: per window and input
// channel, k kernel rows of k taps (k <= 8)
//   dw[g·dw_model + r·Cin·k² + t] = Σ_{i in g} Σ_{windows} grad · src[(g·n + i)·src_img + idx + ci·L + ti·Wp + tj],
//   db[g·db_model + r] = Σ_{i in g} Σ_{windows} grad,
//   dx[(g·n + i)·dx_img + ci·dx_row + idx + ti·Wp + tj] = Σ_r Σ_{windows} grad · wt[g][ci][ti·k + tj][r]
//                                                         (where dx is not null; every other value of
//                                                          the Cin planes of dx_row values: 0)
// for t = (ci·k + ti)·k + tj; da and h at g·in_group + i·in_img + r·s_c + y·s_y + x·s_x, idx at
// ((g·n + i)·C + r)·H2·W2 + y·W2 + x. Reads up to 7 values past each kernel row of src (the
// input's slack); dx: idx + (k − 1)·(Wp + 1) < dx_row for every window.
template <typename T>
void cnn_pooled_backward(const T* da, const T* h, int64_t G, int64_t n, int64_t C, int64_t H2, int64_t W2,
                         int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x, const int32_t* idx,
                         const T* src, int64_t src_img, int64_t L, int64_t Wp, int64_t Cin, int64_t k,
                         T* dw /*[G, C, Cin·k·k] models dw_model apart*/, int64_t dw_model, T* db /*[G, C]*/,
                         int64_t db_model, const T* wt /*[G, Cin, k·k, C] or null*/, T* dx /*or null*/,
                         int64_t dx_img, int64_t dx_row);
// The dense layers of G CNN models on their n rows each (csrc/cpu/cnn_dense.cpp): forward from
// the features, the gradient of Σ_r w_r·ce_r into each layer's weight and bias gradient (model g's
// layer l at gW[l] + g·grad_model[2l], gb[l] + g·grad_model[2l + 1]) and the gradient at the
// features. Layer l maps dims[l] → dims[l + 1] with W[l] [dims[l + 1], dims[l]] (model g's at
// W[l] + g·theta_model[2l], its bias at b[l] + g·theta_model[2l + 1]),
// ReLU after every layer but the last. Labels are trusted (the caller checked them).
template <typename T>
void cnn_dense_grad(const T* feats /*[G, n, dims[0]]*/, int64_t G, int64_t n, int64_t layers,
                    const int64_t* dims /*[layers + 1]*/, const T* const* W /*[layers]*/,
                    const T* const* b /*[layers]*/, const int64_t* theta_model /*[2·layers]*/,
                    const int64_t* y /*[G, n]*/, const T* w /*[G, n]*/, T* const* gW /*[layers]*/,
                    T* const* gb /*[layers]*/, const int64_t* grad_model /*[2·layers]*/,
                    T* dfeats /*[G, n, dims[0]]*/);
// Its forward alone: the logits [G, n, dims[layers]] of every model's rows.
template <typename T>
void cnn_dense_logits(const T* feats /*[G, n, dims[0]]*/, int64_t G, int64_t n, int64_t layers,
                      const int64_t* dims /*[layers + 1]*/, const T* const* W /*[layers]*/,
                      const T* const* b /*[layers]*/, const int64_t* theta_model /*[2·layers]*/,
                      T* logits /*[G, n, dims[layers]]*/);

// The statistics of the screen of PERM's mixing weights (csrc/cpu/perm_screen.cpp): for the rows
// of G shifted by their mean, s_i, the squared norms sq [m], the farthest-point labels [m] of the
// projections s_i Ω (omega [d, q]) into at most k clusters, the clusters' means mu [k, d] and their
// squared norms mu_sq [k], and t [m, found] = ‖s_i − mu_b‖² by the Gram formula. Returns found,
// the clusters made (<= k; fewer where the rows have fewer distinct projections).
template <typename T>
int64_t perm_screen_stats(const T* G /*[m, d]*/, int64_t m, int64_t d, const T* omega /*[d, q]*/, int64_t q,
                          int64_t k, int64_t* labels, double* sq, T* mu, double* mu_sq, double* t);
// out = Y Yᵀ (csrc/cpu/sym_products.cpp): the upper block triangle computed, the rest mirrored
// (exactly symmetric). OpenMP threads split the panels; the bits do not depend on their number.
template <typename T>
void sym_products(const T* Y /*[n, d]*/, int64_t n, int64_t d, T* out /*[n, n]*/);

// PERM's water-filling (csrc/cpu/water_fill.cpp): alpha[i, j] = w[j]·max(0, τ_i − costs[i, j]), the
// level τ_i such that the row sums to 1. w_own (or null): row i's weight of the last column,
// w_own[i] in place of w[k − 1] (a pooled α's own-client column, perm._perm_pool). Checks w and
// w_own (finite, > 0) and each row of costs (finite).
void water_fill(const double* costs /*[r, k]*/, int64_t r, int64_t k, const double* w /*[k]*/,
                const double* w_own /*[r] or null*/, double* alpha /*[r, k]*/, Faults& faults);
// The same from a block of a Gram matrix (perm.screened_weights): the costs of row i are
// c_ij = max(0, sq_r[i] + sq_c[j] − 2·gram[i, j]) with c_{i, own[i]} = 0; α_ij is written to
// out[out_rows[i]·out_stride + cols[j]] (the other entries of out untouched) and τ_i to levels[i].
// fill: 0 writes every entry of the block; 1: those entries of out hold 0 already, so only the
// positive α_ij are written (a row's active columns, ~1 in 5 at m = 2,000: the scattered writes of
// its zeros were a third of the kernel); 2: the whole output row (out_stride entries) is cleared
// first, then the positive α_ij written (out need not be zeroed beforehand). Checks w and each
// row's costs (finite).
template <typename T>
void water_fill_gram(const T* gram /*[r, k]*/, const double* sq_r /*[r]*/, const double* sq_c /*[k]*/,
                     const int64_t* own /*[r], in [0, k)*/, int64_t r, int64_t k, const double* w /*[k]*/,
                     double* out /*rows of out_stride*/, int64_t out_stride, const int64_t* out_rows /*[r]*/,
                     const int64_t* cols /*[k], in [0, out_stride)*/, int fill, double* levels /*[r]*/,
                     Faults& faults);

// PERM's weights of rows first..stop of the costs c_ij = ‖g_i − g_j‖² (the differences of the rows
// of G in float64, or in float32 for float32 G unless f64_costs), computing only the costs the
// caller's bounds cannot rule out (perm.py's principal screen; the bounds' formulas in
// csrc/cpu/water_fill_screened.cpp). PT, rho_lo, rho_hi, slack: float32, scaled (coordinates by
// 2^-k, slacks and costs by cost_scale = 2^-2k). Every output row is written whole; counts[i − first]: the
// row's candidates (−1: bounds that failed, the row computed from every column). Returns false,
// having written only counts, where the rows' candidates add up to more than max_candidates.
template <typename T>
bool water_fill_screened(const T* G /*[m, d]*/, int64_t m, int64_t d, const float* PT /*[r, m]*/, int64_t r,
                         const float* rho_lo /*[m]*/, const float* rho_hi /*[m]*/, const float* slack /*[m]*/,
                         double k_lo, double k_hi, double eta, double cost_scale, const double* w /*[m]*/,
                         int64_t first, int64_t stop, bool f64_costs, int64_t max_candidates,
                         double* out /*[stop − first, m]*/, double* levels /*[stop − first]*/,
                         int64_t* counts /*[stop − first]*/, Faults& faults);

// Checks each client index and its offsets (as the GLM kernels do) before drawing its rows.
void sample_batches(const int64_t* offsets /*[m + 1]*/, int64_t m, int64_t N, const int64_t* clients /*[R] or null*/,
                    int64_t first_id /*global id of client 0*/, int64_t R, int64_t steps, int64_t B,
                    uint32_t seed, uint32_t counter, int32_t* out /*[R, steps, B]*/, Faults& faults);

// out = Σ_r w[rows[r]]·theta[rows[r]] / Σ_r w[rows[r]], float64 accumulation in row order.
// Checks rows in [0, M), the weights read (finite, >= 0, positive sum) and the rows of theta
// read (finite).
template <typename T>
void average(const T* theta /*[M, d]*/, int64_t M, const T* weights /*[M]*/, const int64_t* rows /*[R] or null*/,
             int64_t R, int64_t d, T* out /*[d]*/, Faults& faults);

// The Gaussian mechanism on clipped rows (csrc/cpu/dp.cpp): out = Σ_r w_r·min(1, C/‖u_r‖)·u_r + σ·n
// summed in float64 along the fixed binary tree over r (bitwise the same at any thread count and
// for any split into aligned blocks), n_j ~ N(0, 1) from Philox4x64-10 keyed by (seed, counter).
// `clipped` gets the number of rows with ‖u_r‖ > C. Checks the rows (finite norm) and the weights
// (in [0, 1]); C > 0 and σ >= 0 are the caller's.
template <typename T>
void clip_and_sum(const T* updates /*[R, d]*/, int64_t R, int64_t d, const T* weights /*[R] or null (= 1)*/,
                  double clip_norm, double noise_std, uint64_t seed, uint64_t counter, double* out /*[d]*/,
                  int64_t* clipped /*[1]*/, Faults& faults);
// The mechanism's standard normals n_0 .. n_{n-1} for (seed, counter) alone (tests, the ranks).
void dp_normals(uint64_t seed, uint64_t counter, int64_t n, double* out /*[n]*/);

// Minibatch SGD steps of the one-hidden-layer MLP p → H → C (ReLU, cross-entropy), float, in
// place on theta [R, d] (rows [W1 (H×p), b1 (H), W2 (C×H), b2 (C)]): for s < steps,
// θ_r ← θ_r − lr·(grad_scale[r]·∇_mean(θ_r; batches[r, s]) + l2·θ_r + prox·(θ_r − anchor_r)).
// Trusted inputs: the caller (the nets backend) has validated every index and value.
// Supported where the build has AVX-512, 1 <= H <= 128 and 2 <= C <= 16.
bool mlp_local_steps_supported(int64_t H, int64_t C);
void mlp_local_steps(float* theta /*[R, d]*/, int64_t R, int64_t p, int64_t H, int64_t C, float l2,
                     const float* x /*[N, p]*/, const int64_t* y /*[N]*/, const int32_t* batches /*[R, steps, B]*/,
                     int64_t steps, int64_t B, const float* anchor /*[R, d], [d] or null*/, bool anchor_shared,
                     const float* grad_scale /*[R] or null*/, float lr, float prox);

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
