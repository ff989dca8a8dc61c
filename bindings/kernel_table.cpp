// The CPU kernels as the C function table of pflcore/include/pflcore_kernels.h, for native
// callers that must not go through Python (the JAX FFI shim, pflcore/jax/ffi.cpp). The same
// kernels and argument checks as the pybind11 functions of core.cpp; faults come back as a
// status and a message instead of a Python exception. No Python here: these run on XLA's
// threads, without the GIL.
#include <cstdio>
#include <cstring>
#include <exception>

#include "pflcore/ops_cpu.h"
#include "pflcore_kernels.h"

using namespace pflcore;

namespace {

int fail(int status, char* err, size_t err_size, const char* op, const char* what) {
  if (err && err_size) std::snprintf(err, err_size, "%s: %s", op, what);
  return status;
}

int report(const Faults& faults, char* err, size_t err_size) {
  if (!faults.any()) return PFLCORE_OK;
  if (err && err_size) std::snprintf(err, err_size, "%s", faults.message().c_str());
  return faults.kind() == FaultKind::NonFinite ? PFLCORE_NON_FINITE : PFLCORE_BAD_VALUE;
}

// The checks of core.cpp's glm_problem, as a status; the problem in `prob` when it is OK.
template <typename T>
const char* glm_problem(const pflcore_glm& g, cpu::GlmProblem<T>* prob) {
  if (g.family < 0 || g.family > 2) return "family must be 0, 1 or 2";
  if (!(g.p >= 1 && g.C >= 1 && (g.family == 2 || g.C == 1)))
    return "expected p >= 1, C >= 1 (C = 1 unless softmax)";
  if (!(g.N >= 0 && g.m >= 1 && g.R >= 0)) return "expected N >= 0, m >= 1, R >= 0";
  if (!(g.x && g.y && g.offsets)) return "x, y and offsets must not be null";
  prob->family = static_cast<Family>(g.family);
  prob->p = g.p;
  prob->C = g.C;
  prob->intercept = g.intercept != 0;
  prob->l2 = static_cast<T>(g.l2);
  prob->x = static_cast<const T*>(g.x);
  prob->N = g.N;
  prob->y = g.y;
  prob->offsets = g.offsets;
  prob->m = g.m;
  prob->rows = g.rows;
  prob->R = g.R;
  prob->check_batches = g.check_batches != 0;
  return nullptr;
}

template <typename T>
int local_steps_t(const pflcore_glm& g, void* theta, const int32_t* batches, int64_t B, const void* anchor,
                  int32_t anchor_shared, const void* grad_scale, int64_t steps, double lr, double prox, char* err,
                  size_t err_size) {
  const char* op = "local_steps";
  cpu::GlmProblem<T> prob;
  if (const char* why = glm_problem<T>(g, &prob)) return fail(PFLCORE_BAD_CALL, err, err_size, op, why);
  if (!(theta || g.R == 0)) return fail(PFLCORE_BAD_CALL, err, err_size, op, "theta must not be null");
  if (!(steps >= 0 && (!batches || B >= 1)))
    return fail(PFLCORE_BAD_CALL, err, err_size, op, "expected steps >= 0 and B >= 1 with batches");
  if (g.R == 0 || steps == 0) return PFLCORE_OK;
  cpu::LocalStepsArgs<T> args;
  args.theta = static_cast<T*>(theta);
  args.batches = batches;
  args.batch_size = batches ? B : 0;
  args.anchor = static_cast<const T*>(anchor);
  args.anchor_shared = anchor && anchor_shared;
  args.grad_scale = static_cast<const T*>(grad_scale);
  args.steps = steps;
  args.lr = static_cast<T>(lr);
  args.prox = static_cast<T>(prox);
  Faults faults;
  cpu::local_steps<T>(prob, args, faults);
  return report(faults, err, err_size);
}

template <typename T>
int gradients_t(const pflcore_glm& g, const void* theta, int32_t theta_shared, const int32_t* batches, int64_t B,
                void* out, char* err, size_t err_size) {
  const char* op = "gradients";
  cpu::GlmProblem<T> prob;
  if (const char* why = glm_problem<T>(g, &prob)) return fail(PFLCORE_BAD_CALL, err, err_size, op, why);
  if (!((theta && out) || g.R == 0)) return fail(PFLCORE_BAD_CALL, err, err_size, op, "theta and out must not be null");
  if (!(!batches || B >= 1)) return fail(PFLCORE_BAD_CALL, err, err_size, op, "expected B >= 1 with batches");
  if (g.R == 0) return PFLCORE_OK;
  Faults faults;
  cpu::gradients<T>(prob, static_cast<const T*>(theta), theta_shared ? 0 : prob.d(), batches, batches ? B : 0,
                    static_cast<T*>(out), faults);
  return report(faults, err, err_size);
}

template <typename T>
int evaluate_t(const pflcore_glm& g, const void* theta, int32_t theta_shared, const int32_t* batches, int64_t B,
               void* loss_sum, int64_t* correct, int64_t* count, char* err, size_t err_size) {
  const char* op = "evaluate";
  cpu::GlmProblem<T> prob;
  if (const char* why = glm_problem<T>(g, &prob)) return fail(PFLCORE_BAD_CALL, err, err_size, op, why);
  if (!(!batches || B >= 1)) return fail(PFLCORE_BAD_CALL, err, err_size, op, "expected B >= 1 with batches");
  if (!((theta && loss_sum && correct && count) || g.R == 0))
    return fail(PFLCORE_BAD_CALL, err, err_size, op, "theta and the outputs must not be null");
  if (g.R == 0) return PFLCORE_OK;
  Faults faults;
  cpu::evaluate<T>(prob, static_cast<const T*>(theta), theta_shared ? 0 : prob.d(), batches, batches ? B : 0,
                   static_cast<T*>(loss_sum), correct, count, faults);
  return report(faults, err, err_size);
}

template <typename T>
int kmeans_assign_t(const void* points, int64_t N, int64_t d, const void* centroids, int64_t K, int64_t* labels,
                    void* sqdist, char* err, size_t err_size) {
  if (!(N >= 0 && d >= 1 && K >= 1 && centroids && (N == 0 || (points && labels && sqdist))))
    return fail(PFLCORE_BAD_CALL, err, err_size, "kmeans_assign",
                "expected N >= 0, d >= 1, K >= 1 and non-null buffers");
  if (N == 0) return PFLCORE_OK;
  Faults faults;
  cpu::kmeans_assign<T>(static_cast<const T*>(points), static_cast<const T*>(centroids), N, K, d, labels,
                        static_cast<T*>(sqdist), faults);
  return report(faults, err, err_size);
}

// The C entry points: the dtype's instantiation, and nothing may escape as a C++ exception
// (std::bad_alloc from a kernel's scratch vectors) across the C boundary.
#define PFL_C_ENTRY(f64, call, err, err_size, op)                                 \
  try {                                                                           \
    return (f64) ? call(double) : call(float);                                    \
  } catch (const std::exception& e) {                                             \
    return fail(PFLCORE_BAD_CALL, err, err_size, op, e.what());                   \
  } catch (...) {                                                                 \
    return fail(PFLCORE_BAD_CALL, err, err_size, op, "unknown C++ exception");    \
  }

int c_local_steps(const pflcore_glm* g, void* theta, const int32_t* batches, int64_t B, const void* anchor,
                  int32_t anchor_shared, const void* grad_scale, int64_t steps, double lr, double prox, char* err,
                  size_t err_size) {
  if (!g) return fail(PFLCORE_BAD_CALL, err, err_size, "local_steps", "glm must not be null");
#define CALL(T) \
  local_steps_t<T>(*g, theta, batches, B, anchor, anchor_shared, grad_scale, steps, lr, prox, err, err_size)
  PFL_C_ENTRY(g->f64, CALL, err, err_size, "local_steps")
#undef CALL
}

int c_gradients(const pflcore_glm* g, const void* theta, int32_t theta_shared, const int32_t* batches, int64_t B,
                void* out, char* err, size_t err_size) {
  if (!g) return fail(PFLCORE_BAD_CALL, err, err_size, "gradients", "glm must not be null");
#define CALL(T) gradients_t<T>(*g, theta, theta_shared, batches, B, out, err, err_size)
  PFL_C_ENTRY(g->f64, CALL, err, err_size, "gradients")
#undef CALL
}

int c_evaluate(const pflcore_glm* g, const void* theta, int32_t theta_shared, const int32_t* batches, int64_t B,
               void* loss_sum, int64_t* correct, int64_t* count, char* err, size_t err_size) {
  if (!g) return fail(PFLCORE_BAD_CALL, err, err_size, "evaluate", "glm must not be null");
#define CALL(T) evaluate_t<T>(*g, theta, theta_shared, batches, B, loss_sum, correct, count, err, err_size)
  PFL_C_ENTRY(g->f64, CALL, err, err_size, "evaluate")
#undef CALL
}

int c_kmeans_assign(int32_t f64, const void* points, int64_t N, int64_t d, const void* centroids, int64_t K,
                    int64_t* labels, void* sqdist, char* err, size_t err_size) {
#define CALL(T) kmeans_assign_t<T>(points, N, d, centroids, K, labels, sqdist, err, err_size)
  PFL_C_ENTRY(f64, CALL, err, err_size, "kmeans_assign")
#undef CALL
}

#ifndef PFLCORE_VERSION
#define PFLCORE_VERSION "unknown"
#endif

const pflcore_kernel_table kTable = {
    PFLCORE_KERNELS_ABI, sizeof(pflcore_kernel_table), PFLCORE_VERSION,
    c_local_steps,       c_gradients,                  c_evaluate,      c_kmeans_assign,
};

}  // namespace

namespace pflcore {
const pflcore_kernel_table* kernel_table() { return &kTable; }
}  // namespace pflcore
