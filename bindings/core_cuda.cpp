// pybind11 bindings for pflcore._core_cuda: argument checks and dispatch only, the math lives
// in csrc/cuda/. Python passes raw device pointers (tensor.data_ptr()) and the CUDA stream
// handle (torch.cuda.current_stream().cuda_stream) as ints; pflcore/ops validates shapes,
// dtypes and devices first, so the checks here only turn a broken contract into a ValueError.
// Kernels are queued on that stream; a launch error raises RuntimeError, an error while a
// kernel runs surfaces at the next synchronizing call, as for any CUDA work.

#include <pybind11/pybind11.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#ifndef PFLCORE_CUDA_ARCHS
#define PFLCORE_CUDA_ARCHS "unknown"
#endif

namespace py = pybind11;

namespace pflcore::cuda {
// csrc/cuda/kmeans.cu
cudaError_t kmeans_assign(const float* points, const float* centroids, int64_t* labels,
                          float* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream);
cudaError_t kmeans_assign(const double* points, const double* centroids, int64_t* labels,
                          double* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream);
int64_t kmeans_update_scratch(int64_t N, int64_t K, int64_t d);
cudaError_t kmeans_update(const float* points, const int64_t* order, const int64_t* seg, const float* weights,
                          float* centroids, double* wsum, int64_t N, int64_t K, int64_t d, double* scratch,
                          cudaStream_t stream);
cudaError_t kmeans_update(const double* points, const int64_t* order, const int64_t* seg, const double* weights,
                          double* centroids, double* wsum, int64_t N, int64_t K, int64_t d, double* scratch,
                          cudaStream_t stream);
// csrc/cuda/glm.cu
int64_t glm_max_classes(bool f64);
template <typename T>
cudaError_t glm_scratch_rows(int family, int64_t p, int64_t C, bool intercept, int64_t* rows);
template <typename T>
cudaError_t glm_local_steps(int family, int64_t p, int64_t C, bool intercept, double l2, void* theta,
                            const void* x, const void* y, const int64_t* offsets, const int64_t* rows,
                            int64_t R, const int32_t* batches, int64_t B, const void* anchor,
                            bool anchor_shared, const void* grad_scale, int64_t steps, double lr, double prox,
                            void* scratch, int64_t scratch_rows, const int32_t* skip_if, cudaStream_t stream);
template <typename T>
cudaError_t glm_gradients(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                          bool theta_shared, const void* x, const void* y, const int64_t* offsets,
                          const int64_t* rows, int64_t R, const int32_t* batches, int64_t B, void* out,
                          cudaStream_t stream);
template <typename T>
cudaError_t glm_evaluate(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                         bool theta_shared, const void* x, const void* y, const int64_t* offsets,
                         const int64_t* rows, int64_t R, const int32_t* batches, int64_t B, void* loss_sum,
                         int64_t* correct, int64_t* count, cudaStream_t stream);
// csrc/cuda/anderson.cu
int64_t anderson_scratch(int64_t D, int64_t k);
template <typename T>
cudaError_t anderson_push(const void* u, const void* tu, void* R_hist, void* TU_hist, int64_t D, int64_t slot,
                          const int64_t* slots, int64_t k, double* dots, double* scratch, cudaStream_t stream);
template <typename T>
cudaError_t anderson_gram(const void* vecs, int64_t k, int64_t D, double* G, double* scratch, cudaStream_t stream);
template <typename T>
cudaError_t anderson_mix(const void* TU_hist, int64_t D, const int64_t* slots, const double* pi, int64_t k,
                         void* out, cudaStream_t stream);
int64_t gram_scratch(int64_t D, int64_t k);
// csrc/cuda/average.cu
int64_t average_scratch(int64_t R, int64_t d);
template <typename T>
cudaError_t average(const void* theta, const void* weights, const int64_t* rows, int64_t R, int64_t d,
                    const double* wsum, void* out, double* scratch, cudaStream_t stream);
int64_t average_fused_scratch(int64_t R, int64_t d);
template <typename T>
cudaError_t average_fused(const void* theta, const void* weights, const int64_t* rows, int64_t M, int64_t R,
                          int64_t d, void* out, double* scratch, int32_t* flag, int* host_flag, cudaStream_t stream);
// csrc/cuda/screen.cu
template <typename T>
cudaError_t glm_screen(const void* theta, int64_t n_theta, const void* anchor, int64_t n_anchor,
                       const void* grad_scale, int64_t n_grad_scale, const void* x, const void* y, bool classifier,
                       int64_t num_classes, int64_t N, int64_t p, const int64_t* offsets, int64_t m,
                       const int64_t* rows, int64_t R, const int32_t* batches, int64_t n_batches, int32_t* flag,
                       int* host_flag, cudaStream_t stream);
template <typename T>
cudaError_t glm_screen_queue(const void* theta, int64_t n_theta, const void* anchor, int64_t n_anchor,
                             const void* grad_scale, int64_t n_grad_scale, const void* x, const void* y,
                             bool classifier, int64_t num_classes, int64_t N, int64_t p, const int64_t* offsets,
                             int64_t m, const int64_t* rows, int64_t R, const int32_t* batches, int64_t n_batches,
                             int32_t* flag, int* decided, cudaStream_t stream);
cudaError_t read_flag(const int32_t* flag, int* host, cudaStream_t stream);
// csrc/cuda/sample_batches.cu
cudaError_t sample_batches(const int64_t* offsets, const int64_t* clients, int64_t first_id, int64_t R,
                           int64_t steps, int64_t B, uint32_t seed, uint32_t counter, int32_t* out,
                           cudaStream_t stream);
}  // namespace pflcore::cuda

namespace {

namespace pc = pflcore::cuda;
using ptr_t = std::uintptr_t;

template <typename T = void>
T* as(ptr_t p) { return reinterpret_cast<T*>(p); }
cudaStream_t as_stream(ptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void require(bool ok, const std::string& op, const std::string& what) {
    if (!ok) throw py::value_error(op + ": " + what);
}

void require_pointer(ptr_t p, const std::string& op, const char* name) {
    require(p != 0, op, std::string(name) + " is a null pointer");
}

// true for float64, false for float32; anything else is a ValueError.
bool is_f64(const std::string& dtype, const std::string& op) {
    require(dtype == "float32" || dtype == "float64", op,
            "dtype must be 'float32' or 'float64', got '" + dtype + "'");
    return dtype == "float64";
}

void check(cudaError_t err, const std::string& op) {
    if (err != cudaSuccess)
        throw std::runtime_error(op + ": CUDA error " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// ---- k-means ------------------------------------------------------------------------------

void kmeans_assign(ptr_t points, ptr_t centroids, ptr_t labels, ptr_t sqdist, int64_t N, int64_t K, int64_t d,
                   const std::string& dtype, ptr_t stream) {
    const std::string op = "kmeans_assign";
    require(N >= 0, op, "N must be >= 0, got " + std::to_string(N));
    require(K >= 1, op, "K must be >= 1, got " + std::to_string(K));
    require(d >= 1, op, "d must be >= 1, got " + std::to_string(d));
    const bool f64 = is_f64(dtype, op);
    if (N > 0) {
        require_pointer(points, op, "points");
        require_pointer(centroids, op, "centroids");
        require_pointer(labels, op, "labels");
        require_pointer(sqdist, op, "sqdist");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::kmeans_assign(as<const double>(points), as<const double>(centroids), as<int64_t>(labels),
                                      as<double>(sqdist), N, K, d, as_stream(stream))
                  : pc::kmeans_assign(as<const float>(points), as<const float>(centroids), as<int64_t>(labels),
                                      as<float>(sqdist), N, K, d, as_stream(stream));
    }
    check(err, op);
}

// float64 values of the scratch kmeans_update needs for this shape.
int64_t kmeans_update_scratch(int64_t N, int64_t K, int64_t d) {
    require(N >= 0 && K >= 1 && d >= 1, "kmeans_update_scratch",
            "expected N >= 0, K >= 1, d >= 1, got " + std::to_string(N) + ", " + std::to_string(K) + ", " +
                std::to_string(d));
    return pc::kmeans_update_scratch(N, K, d);
}

void kmeans_update(ptr_t points, ptr_t order, ptr_t seg, ptr_t weights, ptr_t centroids, ptr_t wsum, int64_t N,
                   int64_t K, int64_t d, ptr_t scratch, const std::string& dtype, ptr_t stream) {
    const std::string op = "kmeans_update";
    require(N >= 0 && K >= 1 && d >= 1, op,
            "expected N >= 0, K >= 1, d >= 1, got " + std::to_string(N) + ", " + std::to_string(K) + ", " +
                std::to_string(d));
    const bool f64 = is_f64(dtype, op);
    require_pointer(seg, op, "seg");
    require_pointer(scratch, op, "scratch");
    require_pointer(centroids, op, "centroids");
    require_pointer(wsum, op, "wsum");
    if (N > 0) {
        require_pointer(points, op, "points");
        require_pointer(order, op, "order");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::kmeans_update(as<const double>(points), as<const int64_t>(order), as<const int64_t>(seg),
                                      as<const double>(weights), as<double>(centroids), as<double>(wsum), N, K, d,
                                      as<double>(scratch), as_stream(stream))
                  : pc::kmeans_update(as<const float>(points), as<const int64_t>(order), as<const int64_t>(seg),
                                      as<const float>(weights), as<float>(centroids), as<double>(wsum), N, K, d,
                                      as<double>(scratch), as_stream(stream));
    }
    check(err, op);
}

// ---- GLM local steps, gradients, evaluate -------------------------------------------------

void check_glm(const std::string& op, int family, int64_t p, int64_t C, bool f64, ptr_t theta, ptr_t x, ptr_t y,
               ptr_t offsets, ptr_t rows, int64_t R) {
    require(family >= 0 && family <= 2, op, "family must be 0, 1 or 2, got " + std::to_string(family));
    require(p >= 1 && C >= 1, op, "expected p >= 1 and C >= 1");
    require(family == 2 || C == 1, op, "least squares and logistic regression have C = 1");
    require(R >= 0, op, "R must be >= 0");
    const int64_t max_c = pc::glm_max_classes(f64);
    require(C <= max_c, op,
            "the CUDA kernels take at most " + std::to_string(max_c) + " classes for this dtype, got C = " +
                std::to_string(C) + " (use the triton or reference backend)");
    if (R > 0) {
        require_pointer(theta, op, "theta");
        require_pointer(x, op, "x");
        require_pointer(y, op, "y");
        require_pointer(offsets, op, "offsets");
    }
    // rows may be null: model row r is client r (the adapter passes none when every client is a row)
}

// The arguments local_steps and local_steps_screened share: the GLM's, the minibatches', the scratch's.
void check_local_steps(const std::string& op, int family, int64_t p, int64_t C, bool f64, ptr_t theta, ptr_t x,
                       ptr_t y, ptr_t offsets, ptr_t rows, int64_t R, ptr_t batches, int64_t B, ptr_t scratch,
                       int64_t scratch_rows) {
    check_glm(op, family, p, C, f64, theta, x, y, offsets, rows, R);
    require(batches == 0 || B >= 1, op, "batches need B >= 1");
    require(scratch_rows >= 0, op, "scratch_rows must be >= 0, got " + std::to_string(scratch_rows));
    if (scratch_rows > 0) require_pointer(scratch, op, "scratch");
}

void local_steps(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, ptr_t x, ptr_t y,
                 ptr_t offsets, ptr_t rows, int64_t R, ptr_t batches, int64_t B, ptr_t anchor, bool anchor_shared,
                 ptr_t grad_scale, int64_t steps, double lr, double prox, ptr_t scratch, int64_t scratch_rows,
                 const std::string& dtype, ptr_t stream) {
    const std::string op = "local_steps";
    const bool f64 = is_f64(dtype, op);
    check_local_steps(op, family, p, C, f64, theta, x, y, offsets, rows, R, batches, B, scratch, scratch_rows);
    require(steps >= 0, op, "steps must be >= 0");
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        auto run = [&](auto tag) {
            using T = decltype(tag);
            return pc::glm_local_steps<T>(family, p, C, intercept, l2, as(theta), as(x), as(y),
                                          as<const int64_t>(offsets), as<const int64_t>(rows), R,
                                          as<const int32_t>(batches), B, as(anchor), anchor_shared, as(grad_scale),
                                          steps, lr, prox, as(scratch), scratch_rows, nullptr, as_stream(stream));
        };
        err = f64 ? run(double{}) : run(float{});
    }
    check(err, op);
}

// local_steps behind its value screen in one call (PFLCORE_CUDA_SCREEN=fused): the screen kernel,
// then the GLM kernel, which does nothing when the screen's flag is set (stream order: the screen
// has finished), then one read of the flag. Returns it: nonzero means theta was not touched and
// the exact checks must run. n_* and the screen's sizes as glm_screen takes them.
int local_steps_screened(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, ptr_t x, ptr_t y,
                         ptr_t offsets, ptr_t rows, int64_t R, ptr_t batches, int64_t B, ptr_t anchor,
                         bool anchor_shared, ptr_t grad_scale, int64_t steps, double lr, double prox, ptr_t scratch,
                         int64_t scratch_rows, int64_t n_theta, int64_t n_anchor, int64_t n_grad_scale,
                         int64_t num_classes, int64_t N, int64_t m, int64_t n_batches, ptr_t flag,
                         const std::string& dtype, ptr_t stream) {
    const std::string op = "local_steps";
    const bool f64 = is_f64(dtype, op);
    check_local_steps(op, family, p, C, f64, theta, x, y, offsets, rows, R, batches, B, scratch, scratch_rows);
    require(steps >= 1, op, "steps must be >= 1");
    require(n_theta >= 0 && n_anchor >= 0 && n_grad_scale >= 0 && N >= 0 && m >= 0 && n_batches >= 0, op,
            "sizes must be >= 0");
    require(n_batches == 0 || R == 0 || n_batches % R == 0, op, "n_batches must be a multiple of R");
    require_pointer(flag, op, "flag");
    const bool classifier = family != 0;
    int found = 0;
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        auto run = [&](auto tag) {
            using T = decltype(tag);
            int decided = 0;
            cudaError_t e = pc::glm_screen_queue<T>(as(theta), n_theta, as(anchor), n_anchor, as(grad_scale),
                                                    n_grad_scale, as(x), as(y), classifier, num_classes, N, p,
                                                    as<const int64_t>(offsets), m, as<const int64_t>(rows), R,
                                                    as<const int32_t>(batches), n_batches, as<int32_t>(flag),
                                                    &decided, as_stream(stream));
            if (e != cudaSuccess) return e;
            if (decided) {  // the exact checks decide; nothing was queued
                found = 1;
                return cudaSuccess;
            }
            e = pc::glm_local_steps<T>(family, p, C, intercept, l2, as(theta), as(x), as(y),
                                       as<const int64_t>(offsets), as<const int64_t>(rows), R,
                                       as<const int32_t>(batches), B, as(anchor), anchor_shared, as(grad_scale), steps,
                                       lr, prox, as(scratch), scratch_rows, as<const int32_t>(flag),
                                       as_stream(stream));
            if (e != cudaSuccess) return e;
            return pc::read_flag(as<const int32_t>(flag), &found, as_stream(stream));
        };
        err = f64 ? run(double{}) : run(float{});
    }
    check(err, op);
    return found;
}

// Rows of scratch (of d values) local_steps needs for this shape on the current device; 0 when
// the parameters fit shared memory.
int64_t glm_scratch_rows(int family, int64_t p, int64_t C, bool intercept, const std::string& dtype) {
    const std::string op = "glm_scratch_rows";
    const bool f64 = is_f64(dtype, op);
    require(family >= 0 && family <= 2, op, "family must be 0, 1 or 2, got " + std::to_string(family));
    require(p >= 1 && C >= 1 && C <= pc::glm_max_classes(f64), op, "expected p >= 1 and 1 <= C <= max_classes");
    int64_t rows = 0;
    const cudaError_t err = f64 ? pc::glm_scratch_rows<double>(family, p, C, intercept, &rows)
                                : pc::glm_scratch_rows<float>(family, p, C, intercept, &rows);
    check(err, op);
    return rows;
}

void gradients(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, ptr_t x, ptr_t y,
               ptr_t offsets, ptr_t rows, int64_t R, bool theta_shared, ptr_t batches, int64_t B, ptr_t out,
               const std::string& dtype, ptr_t stream) {
    const std::string op = "gradients";
    const bool f64 = is_f64(dtype, op);
    check_glm(op, family, p, C, f64, theta, x, y, offsets, rows, R);
    require(batches == 0 || B >= 1, op, "batches need B >= 1");
    if (R > 0) require_pointer(out, op, "out");
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        auto run = [&](auto tag) {
            using T = decltype(tag);
            return pc::glm_gradients<T>(family, p, C, intercept, l2, as(theta), theta_shared, as(x), as(y),
                                        as<const int64_t>(offsets), as<const int64_t>(rows), R,
                                        as<const int32_t>(batches), B, as(out), as_stream(stream));
        };
        err = f64 ? run(double{}) : run(float{});
    }
    check(err, op);
}

void evaluate(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, ptr_t x, ptr_t y,
              ptr_t offsets, ptr_t rows, int64_t R, bool theta_shared, ptr_t batches, int64_t B, ptr_t loss_sum,
              ptr_t correct, ptr_t count, const std::string& dtype, ptr_t stream) {
    const std::string op = "evaluate";
    const bool f64 = is_f64(dtype, op);
    check_glm(op, family, p, C, f64, theta, x, y, offsets, rows, R);
    require(batches == 0 || B >= 1, op, "batches need B >= 1");
    if (R > 0) {
        require_pointer(loss_sum, op, "loss_sum");
        require_pointer(correct, op, "correct");
        require_pointer(count, op, "count");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        auto run = [&](auto tag) {
            using T = decltype(tag);
            return pc::glm_evaluate<T>(family, p, C, intercept, l2, as(theta), theta_shared, as(x), as(y),
                                       as<const int64_t>(offsets), as<const int64_t>(rows), R,
                                       as<const int32_t>(batches), B, as(loss_sum), as<int64_t>(correct),
                                       as<int64_t>(count), as_stream(stream));
        };
        err = f64 ? run(double{}) : run(float{});
    }
    check(err, op);
}

// ---- Anderson ------------------------------------------------------------------------------

// float64 values of the scratch anderson_push needs for D entries and k dots.
int64_t anderson_scratch(int64_t D, int64_t k) {
    require(D >= 0 && k >= 0, "anderson_scratch", "expected D, k >= 0");
    return pc::anderson_scratch(D, k);
}

void anderson_push(ptr_t u, ptr_t tu, ptr_t R_hist, ptr_t TU_hist, int64_t D, int64_t slot, ptr_t slots, int64_t k,
                   ptr_t dots, ptr_t scratch, const std::string& dtype, ptr_t stream) {
    const std::string op = "anderson_push";
    const bool f64 = is_f64(dtype, op);
    require(D >= 0 && k >= 0 && slot >= 0, op, "expected D, k, slot >= 0");
    if (k > 0) {
        require_pointer(slots, op, "slots");
        require_pointer(dots, op, "dots");
    }
    if (k > 0 && D > 0) require_pointer(scratch, op, "scratch");
    if (D > 0) {
        require_pointer(u, op, "u");
        require_pointer(tu, op, "tu");
        require_pointer(R_hist, op, "R_hist");
        require_pointer(TU_hist, op, "TU_hist");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::anderson_push<double>(as(u), as(tu), as(R_hist), as(TU_hist), D, slot,
                                              as<const int64_t>(slots), k, as<double>(dots), as<double>(scratch),
                                              as_stream(stream))
                  : pc::anderson_push<float>(as(u), as(tu), as(R_hist), as(TU_hist), D, slot,
                                             as<const int64_t>(slots), k, as<double>(dots), as<double>(scratch),
                                             as_stream(stream));
    }
    check(err, op);
}

void anderson_mix(ptr_t TU_hist, int64_t D, ptr_t slots, ptr_t pi, int64_t k, ptr_t out, const std::string& dtype,
                  ptr_t stream) {
    const std::string op = "anderson_mix";
    const bool f64 = is_f64(dtype, op);
    require(D >= 0 && k >= 1, op, "expected D >= 0 and k >= 1");
    if (D > 0) {
        require_pointer(TU_hist, op, "TU_hist");
        require_pointer(slots, op, "slots");
        require_pointer(pi, op, "pi");
        require_pointer(out, op, "out");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::anderson_mix<double>(as(TU_hist), D, as<const int64_t>(slots), as<const double>(pi), k,
                                             as(out), as_stream(stream))
                  : pc::anderson_mix<float>(as(TU_hist), D, as<const int64_t>(slots), as<const double>(pi), k,
                                            as(out), as_stream(stream));
    }
    check(err, op);
}

void gram(ptr_t vecs, int64_t k, int64_t D, ptr_t G, ptr_t scratch, const std::string& dtype, ptr_t stream) {
    const std::string op = "gram";
    const bool f64 = is_f64(dtype, op);
    require(k >= 1 && D >= 0, op, "expected k >= 1 and D >= 0");
    require_pointer(G, op, "G");
    if (D > 0) {
        require_pointer(vecs, op, "vecs");
        require_pointer(scratch, op, "scratch");
    }
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::anderson_gram<double>(as(vecs), k, D, as<double>(G), as<double>(scratch), as_stream(stream))
                  : pc::anderson_gram<float>(as(vecs), k, D, as<double>(G), as<double>(scratch), as_stream(stream));
    }
    check(err, op);
}

// float64 values of the scratch gram needs for k rows of D entries.
int64_t gram_scratch(int64_t D, int64_t k) {
    require(D >= 0 && k >= 1, "gram_scratch", "expected D >= 0 and k >= 1");
    return pc::gram_scratch(D, k);
}

// ---- average -------------------------------------------------------------------------------

// float64 values of the scratch average needs for R rows of d columns.
void sample_batches(ptr_t offsets, ptr_t clients, int64_t first_id, int64_t R, int64_t steps, int64_t B,
                    uint32_t seed, uint32_t counter, ptr_t out, ptr_t stream) {
    const std::string op = "sample_batches";
    require(R >= 0 && steps >= 0 && B >= 1, op, "expected R >= 0, steps >= 0 and B >= 1");
    if (R * steps == 0) return;
    require_pointer(offsets, op, "offsets");
    require_pointer(out, op, "out");
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = pc::sample_batches(as<const int64_t>(offsets), as<const int64_t>(clients), first_id, R, steps, B, seed,
                                 counter, as<int32_t>(out), as_stream(stream));
    }
    check(err, op);
}

int64_t average_scratch(int64_t R, int64_t d) {
    require(R >= 1 && d >= 1, "average_scratch", "expected R >= 1 and d >= 1");
    return pc::average_scratch(R, d);
}

// The arguments average and average_fused share. R = 0 (no rows) has no mean: the adapter raises
// before it gets here.
void check_average(const std::string& op, ptr_t theta, ptr_t weights, ptr_t rows, int64_t M, int64_t d, int64_t R,
                   ptr_t out, ptr_t scratch) {
    require(M >= 1 && d >= 1 && R >= 1, op, "expected M, d, R >= 1");
    require(rows != 0 || R == M, op, "without rows, R must be M");
    require_pointer(theta, op, "theta");
    require_pointer(weights, op, "weights");
    require_pointer(out, op, "out");
    require_pointer(scratch, op, "scratch");
}

void average(ptr_t theta, ptr_t weights, ptr_t rows, int64_t M, int64_t d, int64_t R, ptr_t wsum, ptr_t out,
             ptr_t scratch, const std::string& dtype, ptr_t stream) {
    const std::string op = "average";
    const bool f64 = is_f64(dtype, op);
    check_average(op, theta, weights, rows, M, d, R, out, scratch);
    require_pointer(wsum, op, "wsum");
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::average<double>(as(theta), as(weights), as<const int64_t>(rows), R, d, as<const double>(wsum),
                                        as(out), as<double>(scratch), as_stream(stream))
                  : pc::average<float>(as(theta), as(weights), as<const int64_t>(rows), R, d, as<const double>(wsum),
                                       as(out), as<double>(scratch), as_stream(stream));
    }
    check(err, op);
}

int64_t average_fused_scratch(int64_t R, int64_t d) {
    require(R >= 1 && d >= 1, "average_fused_scratch", "expected R >= 1 and d >= 1");
    return pc::average_fused_scratch(R, d);
}

// The average with its value screen in the kernels (csrc/cuda/average.cu): nonzero when the call
// may hold a fault (a row out of [0, M), a negative or non-finite weight, a weight sum <= 0, a
// non-finite mean); synchronizes `stream`. rows: raw indices, or 0 with R = M.
int average_fused(ptr_t theta, ptr_t weights, ptr_t rows, int64_t M, int64_t d, int64_t R, ptr_t out, ptr_t scratch,
                  ptr_t flag, const std::string& dtype, ptr_t stream) {
    const std::string op = "average";
    const bool f64 = is_f64(dtype, op);
    check_average(op, theta, weights, rows, M, d, R, out, scratch);
    require_pointer(flag, op, "flag");
    int found = 0;
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::average_fused<double>(as(theta), as(weights), as<const int64_t>(rows), M, R, d, as(out),
                                              as<double>(scratch), as<int32_t>(flag), &found, as_stream(stream))
                  : pc::average_fused<float>(as(theta), as(weights), as<const int64_t>(rows), M, R, d, as(out),
                                             as<double>(scratch), as<int32_t>(flag), &found, as_stream(stream));
    }
    check(err, op);
    return found;
}

// ---- GLM value screen ----------------------------------------------------------------------

// Nonzero when a local_steps / gradients / evaluate call may hold a fault (csrc/cuda/screen.cu);
// synchronizes `stream`. Counts are element counts; 0 addresses are absent tensors.
int glm_screen(ptr_t theta, int64_t n_theta, ptr_t anchor, int64_t n_anchor, ptr_t grad_scale, int64_t n_grad_scale,
               ptr_t x, ptr_t y, bool classifier, int64_t num_classes, int64_t N, int64_t p, ptr_t offsets, int64_t m,
               ptr_t rows, int64_t R, ptr_t batches, int64_t n_batches, ptr_t flag, const std::string& dtype,
               ptr_t stream) {
    const std::string op = "glm_screen";
    const bool f64 = is_f64(dtype, op);
    require(n_theta >= 0 && n_anchor >= 0 && n_grad_scale >= 0 && N >= 0 && p >= 0 && m >= 0 && R >= 0 &&
                n_batches >= 0,
            op, "sizes must be >= 0");
    require(rows != 0 || R == m || R == 0, op, "without rows, R must be m");
    require(n_batches == 0 || R == 0 || n_batches % R == 0, op, "n_batches must be a multiple of R");
    if (n_theta) require_pointer(theta, op, "theta");
    if (n_anchor) require_pointer(anchor, op, "anchor");
    if (n_grad_scale) require_pointer(grad_scale, op, "grad_scale");
    if (N) {
        require_pointer(x, op, "x");
        require_pointer(y, op, "y");
    }
    if (n_batches) require_pointer(batches, op, "batches");
    require_pointer(offsets, op, "offsets");
    require_pointer(flag, op, "flag");
    int found = 0;
    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f64 ? pc::glm_screen<double>(as(theta), n_theta, as(anchor), n_anchor, as(grad_scale), n_grad_scale,
                                           as(x), as(y), classifier, num_classes, N, p, as<const int64_t>(offsets), m,
                                           as<const int64_t>(rows), R, as<const int32_t>(batches), n_batches,
                                           as<int32_t>(flag), &found, as_stream(stream))
                  : pc::glm_screen<float>(as(theta), n_theta, as(anchor), n_anchor, as(grad_scale), n_grad_scale,
                                          as(x), as(y), classifier, num_classes, N, p, as<const int64_t>(offsets), m,
                                          as<const int64_t>(rows), R, as<const int32_t>(batches), n_batches,
                                          as<int32_t>(flag), &found, as_stream(stream));
    }
    check(err, op);
    return found;
}

// ---- module info ---------------------------------------------------------------------------

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the error so it is not reported by a later call
        return 0;
    }
    return n;
}

// What the CUDA runtime says about the machine: the device count, or the reason there is none
// (no driver, a driver older than this module's runtime, ...), and the driver and runtime
// versions. pflcore.backend turns it into the cuda backend's status.
py::dict runtime_status() {
    py::dict out;
    int n = 0, driver = 0, runtime = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    out["device_count"] = err == cudaSuccess ? n : 0;
    out["error"] = err == cudaSuccess ? std::string() : std::string(cudaGetErrorName(err)) + ": " +
                                                           cudaGetErrorString(err);
    if (err != cudaSuccess) cudaGetLastError();  // not sticky: clear it for later calls
    if (cudaDriverGetVersion(&driver) != cudaSuccess) {
        cudaGetLastError();
        driver = -1;
    }
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) {
        cudaGetLastError();
        runtime = -1;
    }
    out["driver_version"] = driver;    // 0: no driver installed
    out["runtime_version"] = runtime;  // the (static) runtime this module was linked with
    return out;
}

py::dict build_info() {
    int version = 0;
    if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
        cudaGetLastError();
        version = -1;
    }
    py::dict info;
    info["cuda_runtime_version"] = version;
    info["architectures"] = std::string(PFLCORE_CUDA_ARCHS);
    info["max_classes"] = py::make_tuple(pc::glm_max_classes(false), pc::glm_max_classes(true));
#ifdef PFLCORE_CUDA_MIN_DRIVER
    // the oldest driver branch that runs this toolkit's statically linked runtime (0: unknown)
    info["min_driver"] = PFLCORE_CUDA_MIN_DRIVER;
#endif
    return info;
}

}  // namespace

PYBIND11_MODULE(_core_cuda, m) {
    m.doc() =
        "pflcore CUDA kernels (no libtorch). Tensors are passed as raw device pointers "
        "(tensor.data_ptr(), 0 for an absent optional tensor) with their sizes, a dtype name "
        "('float32' or 'float64') and the CUDA stream handle (torch.cuda.current_stream().cuda_stream); "
        "kernels are launched asynchronously on that stream. The caller (pflcore.ops) guarantees "
        "validated, contiguous tensors on the current device.";

    m.def("kmeans_assign", &kmeans_assign, py::arg("points"), py::arg("centroids"), py::arg("labels"),
          py::arg("sqdist"), py::arg("N"), py::arg("K"), py::arg("d"), py::arg("dtype"), py::arg("stream"),
          "k-means assignment: labels[i] = argmin_k sum_j (points[i,j] - centroids[k,j])^2 "
          "(ties to the lowest k) and sqdist[i] = that minimum.\n"
          "points [N, d] and centroids [K, d] are contiguous float32/float64 (dtype), labels "
          "[N] is int64, sqdist [N] has the dtype of points. N >= 0, K >= 1, d >= 1.");
    m.def("kmeans_update", &kmeans_update, py::arg("points"), py::arg("order"), py::arg("seg"), py::arg("weights"),
          py::arg("centroids"), py::arg("wsum"), py::arg("N"), py::arg("K"), py::arg("d"), py::arg("scratch"),
          py::arg("dtype"), py::arg("stream"),
          "Lloyd update: wsum[k] (float64 [K]) = sum of the weights [N] (0 = all 1) of cluster k, "
          "centroids[k] ([K, d], in place) = their weighted mean where wsum[k] > 0. order [N] int64 "
          "lists the points sorted by label (stable), seg [K + 1] int64 the start of each cluster's run; "
          "scratch: kmeans_update_scratch(N, K, d) float64 values.");
    m.def("kmeans_update_scratch", &kmeans_update_scratch, py::arg("N"), py::arg("K"), py::arg("d"),
          "float64 values of the scratch kmeans_update needs (chunk partial sums).");
    m.def("local_steps", &local_steps, py::arg("family"), py::arg("p"), py::arg("C"), py::arg("intercept"),
          py::arg("l2"), py::arg("theta"), py::arg("x"), py::arg("y"), py::arg("offsets"), py::arg("rows"),
          py::arg("R"), py::arg("batches"), py::arg("B"), py::arg("anchor"), py::arg("anchor_shared"),
          py::arg("grad_scale"), py::arg("steps"), py::arg("lr"), py::arg("prox"), py::arg("scratch"),
          py::arg("scratch_rows"), py::arg("dtype"), py::arg("stream"),
          "theta [R, d] <- `steps` fused gradient steps per model row, in place (see pflcore.ops.local_steps). "
          "x [N, p], y [N] (dtype or int64), offsets [m + 1] int64, rows [R] int64, batches [R, steps, B] int32 "
          "or 0, anchor [R, d] or [d] (anchor_shared) or 0, grad_scale [R] or 0, scratch [scratch_rows, d] of "
          "dtype (scratch_rows >= 1 when glm_scratch_rows says so; the grid is capped at it) or 0.");
    m.def("glm_scratch_rows", &glm_scratch_rows, py::arg("family"), py::arg("p"), py::arg("C"), py::arg("intercept"),
          py::arg("dtype"),
          "Rows of d values local_steps needs as scratch for this shape on the current device (one per "
          "resident block): 0 when the parameters fit shared memory.");
    m.def("gradients", &gradients, py::arg("family"), py::arg("p"), py::arg("C"), py::arg("intercept"),
          py::arg("l2"), py::arg("theta"), py::arg("x"), py::arg("y"), py::arg("offsets"), py::arg("rows"),
          py::arg("R"), py::arg("theta_shared"), py::arg("batches"), py::arg("B"), py::arg("out"), py::arg("dtype"),
          py::arg("stream"),
          "out [R, d] <- gradient of each row's client objective (full batch, or batches [R, B] int32) at theta "
          "[R, d], or at theta [d] for every row (theta_shared).");
    m.def("evaluate", &evaluate, py::arg("family"), py::arg("p"), py::arg("C"), py::arg("intercept"),
          py::arg("l2"), py::arg("theta"), py::arg("x"), py::arg("y"), py::arg("offsets"), py::arg("rows"),
          py::arg("R"), py::arg("theta_shared"), py::arg("batches"), py::arg("B"), py::arg("loss_sum"),
          py::arg("correct"), py::arg("count"), py::arg("dtype"), py::arg("stream"),
          "loss_sum [R] (dtype), correct [R] and count [R] (int64) of each model row (theta [R, d], or [d] for "
          "every row: theta_shared) on its client's rows, or on batches [R, B] int32 (count = B).");
    m.def("anderson_scratch", &anderson_scratch, py::arg("D"), py::arg("k"),
          "float64 values of the scratch anderson_push needs (per-block partial dots).");
    m.def("anderson_push", &anderson_push, py::arg("u"), py::arg("tu"), py::arg("R_hist"), py::arg("TU_hist"),
          py::arg("D"), py::arg("slot"), py::arg("slots"), py::arg("k"), py::arg("dots"), py::arg("scratch"),
          py::arg("dtype"), py::arg("stream"),
          "R_hist[slot] <- tu - u, TU_hist[slot] <- tu ([H, D]); dots [k] float64 <- <R_hist[slots[j]], tu - u> "
          "with slots [k] int64 (deterministic float64 sums).");
    m.def("anderson_mix", &anderson_mix, py::arg("TU_hist"), py::arg("D"), py::arg("slots"), py::arg("pi"),
          py::arg("k"), py::arg("out"), py::arg("dtype"), py::arg("stream"),
          "out [D] <- sum_j pi[j] * TU_hist[slots[j]] (pi [k] float64, float64 accumulation).");
    m.def("sample_batches", &sample_batches, py::arg("offsets"), py::arg("clients"), py::arg("first_id"),
          py::arg("R"), py::arg("steps"), py::arg("B"), py::arg("seed"), py::arg("counter"), py::arg("out"),
          py::arg("stream"), "int32 [R, steps, B] minibatch row indices (the counter-based hash of DESIGN.md §4)");
    m.def("gram", &gram, py::arg("vecs"), py::arg("k"), py::arg("D"), py::arg("G"), py::arg("scratch"),
          py::arg("dtype"), py::arg("stream"),
          "G [k, k] float64 <- Gram matrix of vecs [k, D] (deterministic float64 sums; one pass over vecs for "
          "k <= 8); scratch: gram_scratch(D, k) float64 values.");
    m.def("gram_scratch", &gram_scratch, py::arg("D"), py::arg("k"),
          "float64 values of the scratch gram needs (per-block partial sums).");
    m.def("average", &average, py::arg("theta"), py::arg("weights"), py::arg("rows"), py::arg("M"), py::arg("d"),
          py::arg("R"), py::arg("wsum"), py::arg("out"), py::arg("scratch"), py::arg("dtype"), py::arg("stream"),
          "out [d] <- sum_r weights[i_r] * theta[i_r] / wsum over i_r = rows[r] (rows [R] int64, every index in "
          "[0, M)) or r (rows 0: R = M); theta [M, d], weights [M] and out of dtype, wsum a float64 scalar (the "
          "sum of the selected weights), float64 sums in a fixed order; scratch: average_scratch(R, d) float64 "
          "values.");
    m.def("average_scratch", &average_scratch, py::arg("R"), py::arg("d"),
          "float64 values of the scratch average needs (per-chunk partial sums).");
    m.def("local_steps_screened", &local_steps_screened, py::arg("family"), py::arg("p"), py::arg("C"),
          py::arg("intercept"), py::arg("l2"), py::arg("theta"), py::arg("x"), py::arg("y"), py::arg("offsets"),
          py::arg("rows"), py::arg("R"), py::arg("batches"), py::arg("B"), py::arg("anchor"),
          py::arg("anchor_shared"), py::arg("grad_scale"), py::arg("steps"), py::arg("lr"), py::arg("prox"),
          py::arg("scratch"), py::arg("scratch_rows"), py::arg("n_theta"), py::arg("n_anchor"),
          py::arg("n_grad_scale"), py::arg("num_classes"), py::arg("N"), py::arg("m"), py::arg("n_batches"),
          py::arg("flag"), py::arg("dtype"), py::arg("stream"),
          "local_steps behind the value screen of glm_screen in one call: returns the screen's flag; nonzero "
          "means theta was not written and the exact checks must run. Synchronizes the stream.");
    m.def("average_fused", &average_fused, py::arg("theta"), py::arg("weights"), py::arg("rows"), py::arg("M"),
          py::arg("d"), py::arg("R"), py::arg("out"), py::arg("scratch"), py::arg("flag"), py::arg("dtype"),
          py::arg("stream"),
          "average with its value screen in the kernels: rows raw (any int64, clamped and flagged) or 0 (R = M); "
          "scratch: average_fused_scratch(R, d) float64 values; flag: [1] int32 device memory; returns nonzero when "
          "the call may hold a fault (then run the exact checks); synchronizes the stream.");
    m.def("average_fused_scratch", &average_fused_scratch, py::arg("R"), py::arg("d"),
          "float64 values of the scratch average_fused needs (per-chunk partial sums and weight sums).");
    m.def("glm_screen", &glm_screen, py::arg("theta"), py::arg("n_theta"), py::arg("anchor"), py::arg("n_anchor"),
          py::arg("grad_scale"), py::arg("n_grad_scale"), py::arg("x"), py::arg("y"), py::arg("classifier"),
          py::arg("num_classes"), py::arg("N"), py::arg("p"), py::arg("offsets"), py::arg("m"), py::arg("rows"),
          py::arg("R"), py::arg("batches"), py::arg("n_batches"), py::arg("flag"), py::arg("dtype"),
          py::arg("stream"),
          "Nonzero when a local_steps / gradients / evaluate call may hold a fault (a conservative screen: "
          "the exact checks decide): a NaN or inf in theta, anchor, grad_scale (n_* elements of dtype, 0 = "
          "none), a row (rows [R] int64, or 0: R = m) outside [0, m) or whose client (offsets [m + 1] int64) "
          "is not a non-empty range in [0, N), a batch index (batches int32, n_batches elements [R, ...], 0 = "
          "none) outside its row's client, and in the rows read (all of them without batches or with "
          "n_batches >= N, else the batch rows) a NaN or inf of x [N, p] or a label y [N] outside "
          "[0, num_classes) (int64, classifier) / a NaN or inf y (dtype). flag: [1] int32 device scratch. "
          "Synchronizes the stream (one host read).");
    m.def("device_count", &device_count,
          "Number of visible CUDA devices; 0 when there is none or no usable driver.");
    m.def("runtime_status", &runtime_status,
          "Dict with device_count, error (why cudaGetDeviceCount failed, '' if it did not), "
          "driver_version (0 = no driver) and runtime_version.");
    m.def("build_info", &build_info,
          "Dict with cuda_runtime_version (int, -1 on error), architectures (the CUDA "
          "architectures compiled for), max_classes "
          "(largest C of the GLM kernels for float32, float64) and min_driver (the oldest "
          "NVIDIA driver branch the module's CUDA runtime runs on, 0 if unknown).");
}
