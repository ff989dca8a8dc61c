// pybind11 definitions of pflcore._core (the CPU kernels). Bindings only: the math is in
// csrc/cpu, the value checks in the kernels (pflcore/checks.h).
//
// The contract with pflcore/backends/native.py, the only caller: arrays arrive as raw addresses
// of C-contiguous CPU buffers (tensor.data_ptr()) with their sizes, and the adapter has checked
// every shape, dtype and writability beforehand (DESIGN.md §8: metadata in Python, values in
// native code). Passing addresses instead of numpy views keeps a small call cheap (a numpy view
// of a tensor costs ~0.5 µs, an address ~0.05 µs). What the kernels find wrong in the values is
// raised here, after the parallel region, as ValueError or pflcore.errors.NonFiniteError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#if defined(PFLCORE_OPENMP)
#include <omp.h>
#endif
#if defined(PFLCORE_OPENMP) && !defined(_WIN32)
#include <pthread.h>
#define PFLCORE_FORK_GUARD 1
#endif

#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "../csrc/cpu/dispatch.h"
#include "../csrc/cpu/perm_bounds.h"
#include "pflcore/ops_cpu.h"
#include "pflcore_kernels.h"

namespace pflcore {
const pflcore_kernel_table* kernel_table();  // bindings/kernel_table.cpp
}

namespace py = pybind11;
using namespace pflcore;

namespace {

using ptr_t = std::uintptr_t;

template <typename T = void>
T* as(ptr_t p) {
  return reinterpret_cast<T*>(p);
}

// fork() keeps only the calling thread: GNU libgomp's pool workers are gone in the child, yet its
// bookkeeping still counts them, so the child's first parallel region waits for them forever. The
// child handler below runs every later parallel region of the child on one thread: ours, and
// torch's, which reads the same OpenMP setting (PyTorch marks its own pool after fork the same way).
// Results do not depend on the thread count, so a forked worker computes the same bits.
std::atomic<bool> g_forked_child{false};

#if defined(PFLCORE_FORK_GUARD)
void serial_after_fork() {
  g_forked_child.store(true);
  omp_set_num_threads(1);
}
#endif

void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw py::value_error(std::string(op) + ": " + what);
}

// Whether a conv layer's taps off [Tn] are k rows of k taps per input channel at
// ci·L + ti·Wp + tj with L = src_img / Cin (the layout of pflcore/backends/cnn_native.py), k <= 8:
// what cnn_pooled_backward reads.
bool pooled_taps_layout(const int64_t* off, int64_t Tn, int64_t Cin, int64_t k, int64_t Wp, int64_t src_img) {
  if (Cin < 1 || k < 1 || k > 8 || Wp < k || Tn != Cin * k * k || src_img % Cin != 0) return false;
  const int64_t L = src_img / Cin;
  for (int64_t t = 0; t < Tn; ++t) {
    const int64_t ci = t / (k * k), ti = (t / k) % k, tj = t % k;
    if (off[t] != ci * L + ti * Wp + tj) return false;
  }
  return true;
}

// Whether every window's maximum idx [count] is >= 0 with idx + reach < row: the pooled input
// gradient's writes inside their plane.
bool windows_fit(const int32_t* idx, int64_t count, int64_t reach, int64_t row) {
  int32_t lo = 0, hi = -1;
  for (int64_t i = 0; i < count; ++i) {
    lo = std::min(lo, idx[i]);
    hi = std::max(hi, idx[i]);
  }
  return lo >= 0 && int64_t(hi) + reach < row;
}

// Raises the call's first fault (if any) as the Python exception of its kind.
void raise_faults(const Faults& faults) {
  if (!faults.any()) return;
  if (faults.kind() == FaultKind::NonFinite) {
    static py::object non_finite = py::module_::import("pflcore.errors").attr("NonFiniteError");
    PyErr_SetString(non_finite.ptr(), faults.message().c_str());
    throw py::error_already_set();
  }
  throw py::value_error(faults.message());
}

template <typename T>
cpu::GlmProblem<T> glm_problem(const char* op, int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t x,
                               int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, int64_t R) {
  require(family >= 0 && family <= 2, op, "family must be 0, 1 or 2");
  require(p >= 1 && C >= 1 && (family == 2 || C == 1), op, "expected p >= 1, C >= 1 (C = 1 unless softmax)");
  require(N >= 0 && m >= 1 && R >= 0, op, "expected N >= 0, m >= 1, R >= 0");
  require(x && y && offsets, op, "x, y and offsets must not be null");
  cpu::GlmProblem<T> prob;
  prob.family = static_cast<Family>(family);
  prob.p = p;
  prob.C = C;
  prob.intercept = intercept;
  prob.l2 = static_cast<T>(l2);
  prob.x = as<const T>(x);
  prob.N = N;
  prob.y = as<const void>(y);
  prob.offsets = as<const int64_t>(offsets);
  prob.m = m;
  prob.rows = as<const int64_t>(rows);
  prob.R = R;
  return prob;
}

template <typename T>
void local_steps_t(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, int64_t R, ptr_t x,
                   int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B, ptr_t anchor,
                   bool anchor_shared, ptr_t grad_scale, int64_t steps, double lr, double prox, bool check_batches) {
  const char* op = "local_steps";
  auto prob = glm_problem<T>(op, family, p, C, intercept, l2, x, N, y, offsets, m, rows, R);
  prob.check_batches = check_batches;
  require(theta != 0 || R == 0, op, "theta must not be null");
  require(steps >= 0 && (batches == 0 || B >= 1), op, "expected steps >= 0 and B >= 1 with batches");
  cpu::LocalStepsArgs<T> args;
  args.theta = as<T>(theta);
  args.batches = as<const int32_t>(batches);
  args.batch_size = batches ? B : 0;
  args.anchor = as<const T>(anchor);
  args.anchor_shared = anchor != 0 && anchor_shared;
  args.grad_scale = as<const T>(grad_scale);
  args.steps = steps;
  args.lr = static_cast<T>(lr);
  args.prox = static_cast<T>(prox);
  Faults faults;
  {
    py::gil_scoped_release nogil;
    cpu::local_steps<T>(prob, args, faults);
  }
  raise_faults(faults);
}

template <typename T>
void gradients_t(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, bool theta_shared,
                 int64_t R, ptr_t x, int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B,
                 ptr_t out, bool check_batches) {
  const char* op = "gradients";
  auto prob = glm_problem<T>(op, family, p, C, intercept, l2, x, N, y, offsets, m, rows, R);
  prob.check_batches = check_batches;
  require((theta && out) || R == 0, op, "theta and out must not be null");
  require(batches == 0 || B >= 1, op, "expected B >= 1 with batches");
  Faults faults;
  {
    py::gil_scoped_release nogil;
    cpu::gradients<T>(prob, as<const T>(theta), theta_shared ? 0 : prob.d(), as<const int32_t>(batches),
                      batches ? B : 0, as<T>(out), faults);
  }
  raise_faults(faults);
}

template <typename T>
void evaluate_t(int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, bool theta_shared,
                int64_t R, ptr_t x, int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B,
                ptr_t loss_sum, ptr_t correct, ptr_t count, bool check_batches) {
  const char* op = "evaluate";
  auto prob = glm_problem<T>(op, family, p, C, intercept, l2, x, N, y, offsets, m, rows, R);
  prob.check_batches = check_batches;
  require(batches == 0 || B >= 1, op, "expected B >= 1 with batches");
  require((theta && loss_sum && correct && count) || R == 0, op, "theta and the outputs must not be null");
  Faults faults;
  {
    py::gil_scoped_release nogil;
    cpu::evaluate<T>(prob, as<const T>(theta), theta_shared ? 0 : prob.d(), as<const int32_t>(batches),
                     batches ? B : 0, as<T>(loss_sum), as<int64_t>(correct), as<int64_t>(count), faults);
  }
  raise_faults(faults);
}

template <typename T>
void kmeans_assign_t(ptr_t points, int64_t N, int64_t d, ptr_t centroids, int64_t K, ptr_t labels, ptr_t sqdist) {
  require(N >= 0 && d >= 1 && K >= 1 && centroids && (N == 0 || (points && labels && sqdist)), "kmeans_assign",
          "expected N >= 0, d >= 1, K >= 1 and non-null buffers");
  Faults faults;
  const auto run = [&] {
    cpu::kmeans_assign<T>(as<const T>(points), as<const T>(centroids), N, K, d, as<int64_t>(labels), as<T>(sqdist),
                          faults);
  };
  if (N * K * d <= cpu::kKmeansSerialWork) {
    run();  // a few µs: keeps the GIL (releasing and taking it back cost ~0.2 µs of a ~5 µs call)
  } else {
    py::gil_scoped_release nogil;
    run();
  }
  raise_faults(faults);
}

template <typename T>
void kmeans_update_t(ptr_t points, int64_t N, int64_t d, ptr_t labels, ptr_t weights, ptr_t centroids, int64_t K,
                     ptr_t weight_sum) {
  require(N >= 0 && d >= 1 && K >= 1 && centroids && weight_sum && (N == 0 || (points && labels)), "kmeans_update",
          "expected N >= 0, d >= 1, K >= 1 and non-null buffers");
  Faults faults;
  {
    py::gil_scoped_release nogil;
    cpu::kmeans_update<T>(as<const T>(points), as<const int64_t>(labels), as<const T>(weights), N, K, d,
                          as<T>(centroids), as<double>(weight_sum), faults);
  }
  raise_faults(faults);
}

template <typename T>
int64_t kmeans_lloyd_t(ptr_t points, int64_t N, int64_t d, ptr_t weights, ptr_t centroids, int64_t K, int64_t iters,
                       double tol, ptr_t labels, ptr_t history) {
  require(N >= 0 && d >= 1 && K >= 1 && iters >= 0 && tol >= 0 && centroids && history &&
              (N == 0 || (points && labels)),
          "kmeans_lloyd", "expected N >= 0, d >= 1, K >= 1, iters >= 0, tol >= 0 and non-null buffers");
  Faults faults;
  int64_t iterations = 0;
  {
    py::gil_scoped_release nogil;
    cpu::kmeans_lloyd<T>(as<const T>(points), as<const T>(weights), N, K, d, as<T>(centroids), iters, tol,
                         as<int64_t>(labels), as<double>(history), &iterations, faults);
  }
  raise_faults(faults);
  return iterations;
}

template <typename T>
void anderson_push_t(ptr_t u, ptr_t tu, ptr_t R_hist, ptr_t TU_hist, int64_t D, int64_t slot, ptr_t slots, int64_t k,
                     ptr_t dots) {
  require(D >= 0 && slot >= 0 && k >= 1 && u && tu && R_hist && TU_hist && slots && dots, "anderson_push",
          "expected D >= 0, slot >= 0, k >= 1 and non-null buffers");
  py::gil_scoped_release nogil;
  cpu::anderson_push<T>(as<const T>(u), as<const T>(tu), as<T>(R_hist), as<T>(TU_hist), D, slot,
                        as<const int64_t>(slots), k, as<double>(dots));
}

template <typename T>
void anderson_mix_t(ptr_t TU_hist, int64_t D, ptr_t slots, ptr_t pi, int64_t k, ptr_t out) {
  require(D >= 0 && k >= 1 && TU_hist && slots && pi && out, "anderson_mix",
          "expected D >= 0, k >= 1 and non-null buffers");
  py::gil_scoped_release nogil;
  cpu::anderson_mix<T>(as<const T>(TU_hist), D, as<const int64_t>(slots), as<const double>(pi), k, as<T>(out));
}

template <typename T>
void gram_t(ptr_t vecs, int64_t k, int64_t D, ptr_t G) {
  require(k >= 1 && D >= 0 && vecs && G, "gram", "expected k >= 1, D >= 0 and non-null buffers");
  py::gil_scoped_release nogil;
  cpu::gram<T>(as<const T>(vecs), k, D, as<double>(G));
}

template <typename T>
void average_t(ptr_t theta, int64_t M, int64_t d, ptr_t weights, ptr_t rows, int64_t R, ptr_t out) {
  require(M >= 1 && d >= 1 && R >= 0 && theta && weights && out, "average",
          "expected M >= 1, d >= 1, R >= 0 and non-null buffers");
  Faults faults;
  {
    py::gil_scoped_release nogil;
    cpu::average<T>(as<const T>(theta), M, as<const T>(weights), as<const int64_t>(rows), R, d, as<T>(out), faults);
  }
  raise_faults(faults);
}

template <typename T>
int64_t clip_and_sum_t(ptr_t updates, int64_t R, int64_t d, ptr_t weights, double clip_norm, double noise_std,
                       uint64_t seed, uint64_t counter, ptr_t out) {
  require(R >= 0 && d >= 1 && (updates || R == 0) && out && clip_norm > 0.0 && noise_std >= 0.0, "clip_and_sum",
          "expected R >= 0, d >= 1, clip_norm > 0, noise_std >= 0 and non-null buffers");
  Faults faults;
  int64_t clipped = 0;
  {
    py::gil_scoped_release nogil;
    cpu::clip_and_sum<T>(as<const T>(updates), R, d, as<const T>(weights), clip_norm, noise_std, seed, counter,
                         as<double>(out), &clipped, faults);
  }
  raise_faults(faults);
  return clipped;
}

// The float64 instantiation when `f64`, else the float32 one.
#define PFL_DISPATCH(f64, fn, ...) ((f64) ? fn<double>(__VA_ARGS__) : fn<float>(__VA_ARGS__))

}  // namespace

// The first k entries of torch.randperm(n, generator) for a CPU generator seeded with `seed`, in O(k)
// time and memory where torch.randperm takes O(n) (0.5 ms a round at 10^5 clients, 6.5 ms at 10^6:
// the cost of sampling a round's clients). torch's CPU randperm, for n < 2^32 / 20, runs the
// forward Fisher-Yates shuffle: for i = 0 .. n-2, z = gen.random() % (n - i), swap r[i] and r[i+z],
// where gen.random() is the next 32-bit output of the standard mt19937 seeded with seed mod 2^32.
// Position i is final after step i, so the first k steps give the first k entries; only the
// positions a swap touched differ from r[i] = i, and a map holds those. Equal to torch's result
// for every (n, k, seed) tests/test_sampling.py draws (a torch that changed its randperm would
// fail there, not change runs silently).
void randperm_prefix(int64_t n, int64_t k, uint64_t seed, ptr_t out_ptr) {
  require(n >= 1 && n < int64_t(0xFFFFFFFFu / 20) && k >= 0 && k <= n && (out_ptr || k == 0), "randperm_prefix",
          "expected 1 <= n < 2^32 / 20, 0 <= k <= n and an output of k values");
  int64_t* out = as<int64_t>(out_ptr);
  std::mt19937 gen(static_cast<uint32_t>(seed & 0xFFFFFFFFu));
  // position -> value where they differ: a plain array once a large share of n is drawn, else an
  // open-addressing table of at least 4k slots (a k-draw touches at most 2k positions)
  const bool dense = k >= n / 8;
  std::vector<int64_t> perm;
  std::vector<int64_t> keys, vals;
  uint64_t mask = 0;
  if (dense) {
    perm.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) perm[i] = i;
  } else {
    uint64_t slots = 16;
    while (slots < 4 * static_cast<uint64_t>(k)) slots <<= 1;
    mask = slots - 1;
    keys.assign(slots, -1);
    vals.resize(slots);
  }
  auto slot = [&](int64_t pos) {  // the slot of pos, or the empty one where it would go
    uint64_t h = (static_cast<uint64_t>(pos) * 0x9E3779B97F4A7C15ull) >> 17;
    while (keys[h & mask] != -1 && keys[h & mask] != pos) ++h;
    return h & mask;
  };
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = i < n - 1 ? i + static_cast<int64_t>(gen() % static_cast<uint64_t>(n - i)) : i;
    if (dense) {
      out[i] = perm[j];  // position i is final
      perm[j] = perm[i];
      continue;
    }
    const uint64_t si = slot(i);
    const int64_t vi = keys[si] == i ? vals[si] : i;
    const uint64_t sj = slot(j);
    out[i] = keys[sj] == j ? vals[sj] : j;
    keys[sj] = j;  // position i is never read again: no need to store it
    vals[sj] = vi;
  }
}

PYBIND11_MODULE(_core, m) {
  // A PFLCORE_CPU_CAPABILITY this build or CPU cannot follow: no silent fallback to another level.
  if (std::string why = cpu::level_error(); !why.empty()) throw py::value_error(why);
#if defined(PFLCORE_FORK_GUARD)
  pthread_atfork(nullptr, nullptr, &serial_after_fork);
#endif

  m.doc() = "pflcore CPU kernels (C++17/OpenMP). Called by pflcore.backends.native only: arguments are raw "
            "addresses of buffers whose shapes and dtypes it checked.";

  m.def("local_steps",
        [](bool f64, int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, int64_t R, ptr_t x,
           int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B, ptr_t anchor,
           bool anchor_shared, ptr_t grad_scale, int64_t steps, double lr, double prox, bool check_batches) {
          PFL_DISPATCH(f64, local_steps_t, family, p, C, intercept, l2, theta, R, x, N, y, offsets, m, rows, batches,
                       B, anchor, anchor_shared, grad_scale, steps, lr, prox, check_batches);
        },
        "theta [R, d] <- K fused gradient steps per model row (in place)");
  m.def("mlp_local_steps_supported", [](int64_t H, int64_t C) { return cpu::mlp_local_steps_supported(H, C); },
        "whether mlp_local_steps serves an MLP with one hidden layer of H units and C classes here");
  m.def("mlp_local_steps",
        [](ptr_t theta, int64_t R, int64_t p, int64_t H, int64_t C, double l2, ptr_t x, ptr_t y, ptr_t batches,
           int64_t steps, int64_t B, ptr_t anchor, bool anchor_shared, ptr_t grad_scale, double lr, double prox) {
          const char* op = "mlp_local_steps";
          const cpu::KernelTable& kernels = cpu::active();  // one level for the test and the call
          require(kernels.mlp_local_steps_supported(H, C), op, "unsupported hidden size or class count");
          require(R >= 0 && p >= 1 && steps >= 0 && B >= 1, op, "expected R >= 0, p >= 1, steps >= 0, B >= 1");
          require((theta && x && y && batches) || R == 0 || steps == 0, op, "theta, x, y, batches must not be null");
          py::gil_scoped_release nogil;
          kernels.mlp_local_steps(as<float>(theta), R, p, H, C, static_cast<float>(l2), as<const float>(x),
                                  as<const int64_t>(y), as<const int32_t>(batches), steps, B, as<const float>(anchor),
                                  anchor_shared, as<const float>(grad_scale), static_cast<float>(lr),
                                  static_cast<float>(prox));
        },
        "theta [R, d] <- minibatch SGD steps of a one-hidden-layer MLP (float, trusted inputs; the nets backend)");
  m.def("gradients",
        [](bool f64, int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, bool theta_shared,
           int64_t R, ptr_t x, int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B,
           ptr_t out, bool check_batches) {
          PFL_DISPATCH(f64, gradients_t, family, p, C, intercept, l2, theta, theta_shared, R, x, N, y, offsets, m, rows,
                       batches, B, out, check_batches);
        },
        "out [R, d] <- the gradient of each model row's client objective");
  m.def("evaluate",
        [](bool f64, int family, int64_t p, int64_t C, bool intercept, double l2, ptr_t theta, bool theta_shared,
           int64_t R, ptr_t x, int64_t N, ptr_t y, ptr_t offsets, int64_t m, ptr_t rows, ptr_t batches, int64_t B,
           ptr_t loss_sum, ptr_t correct, ptr_t count, bool check_batches) {
          PFL_DISPATCH(f64, evaluate_t, family, p, C, intercept, l2, theta, theta_shared, R, x, N, y, offsets, m, rows,
                       batches, B, loss_sum, correct, count, check_batches);
        },
        "loss sum, correct and row count [R] of each model row on its client's rows");
  m.def("kmeans_assign",
        [](bool f64, ptr_t points, int64_t N, int64_t d, ptr_t centroids, int64_t K, ptr_t labels, ptr_t sqdist) {
          PFL_DISPATCH(f64, kmeans_assign_t, points, N, d, centroids, K, labels, sqdist);
        });
  m.def("kmeans_update", [](bool f64, ptr_t points, int64_t N, int64_t d, ptr_t labels, ptr_t weights,
                            ptr_t centroids, int64_t K, ptr_t weight_sum) {
    PFL_DISPATCH(f64, kmeans_update_t, points, N, d, labels, weights, centroids, K, weight_sum);
  });
  m.def("kmeans_lloyd",
        [](bool f64, ptr_t points, int64_t N, int64_t d, ptr_t weights, ptr_t centroids, int64_t K, int64_t iters,
           double tol, ptr_t labels, ptr_t history) -> int64_t {
          return PFL_DISPATCH(f64, kmeans_lloyd_t, points, N, d, weights, centroids, K, iters, tol, labels, history);
        },
        "Lloyd's k-means from centroids [K, d] (in place): labels [N], history [iters + 1]; returns the iterations");
  m.def("anderson_push", [](bool f64, ptr_t u, ptr_t tu, ptr_t R_hist, ptr_t TU_hist, int64_t D, int64_t slot,
                            ptr_t slots, int64_t k, ptr_t dots) {
    PFL_DISPATCH(f64, anderson_push_t, u, tu, R_hist, TU_hist, D, slot, slots, k, dots);
  });
  m.def("anderson_mix", [](bool f64, ptr_t TU_hist, int64_t D, ptr_t slots, ptr_t pi, int64_t k, ptr_t out) {
    PFL_DISPATCH(f64, anderson_mix_t, TU_hist, D, slots, pi, k, out);
  });
  m.def("gram", [](bool f64, ptr_t vecs, int64_t k, int64_t D, ptr_t G) { PFL_DISPATCH(f64, gram_t, vecs, k, D, G); });
  m.def("anderson_solve", [](ptr_t G, int64_t k, double reg, ptr_t pi) {
    require(k >= 1 && G && pi, "anderson_solve", "expected k >= 1 and non-null buffers");
    cpu::anderson_solve(as<const double>(G), k, reg, as<double>(pi));
  });
  // The CNN kernels (csrc/cpu/cnn.cpp): trusted inputs (pflcore/backends/cnn_native.py builds every
  // buffer and offset); one chunk of models per call, on the calling thread, without the GIL.
  m.def("cnn_shifted_gemm", [](bool f64, ptr_t src, int64_t src_img, ptr_t off, int64_t Tn, ptr_t w,
                               ptr_t bias, int64_t G, int64_t n, int64_t R, int64_t P, ptr_t out, int64_t out_img,
                               int64_t out_row) {
    require(P % 16 == 0 && Tn >= 1 && G >= 0 && n >= 0 && R >= 0, "cnn_shifted_gemm", "expected P % 16 == 0, Tn >= 1");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& k = cpu::active();
    if (f64) k.cnn_shifted_gemm.f64(as<const double>(src), src_img, as<const int64_t>(off), Tn, as<const double>(w),
                                    as<const double>(bias), G, n, R, P, as<double>(out), out_img, out_row);
    else k.cnn_shifted_gemm.f32(as<const float>(src), src_img, as<const int64_t>(off), Tn, as<const float>(w),
                                as<const float>(bias), G, n, R, P, as<float>(out), out_img, out_row);
  });
  m.def("cnn_input_grad", [](bool f64, ptr_t dz, int64_t dz_img, int64_t dz_row, ptr_t wt, int64_t G, int64_t n,
                             int64_t Cout, int64_t Cin, int64_t k, int64_t Wp, int64_t P, int64_t Qv, ptr_t dx,
                             int64_t dx_img, int64_t dx_row) {
    require(P % 16 == 0 && P <= dz_row && Cout >= 1 && k >= 1 && G >= 0 && n >= 0 && Cin >= 0 && Qv >= 0 && Qv <= P &&
                Qv + (k - 1) * (Wp + 1) <= dx_row,
            "cnn_input_grad", "expected P % 16 == 0, P <= dz_row, Qv <= P, Qv + (k - 1)(Wp + 1) <= dx_row");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& kt = cpu::active();
    if (f64) kt.cnn_input_grad.f64(as<const double>(dz), dz_img, dz_row, as<const double>(wt), G, n, Cout, Cin, k, Wp,
                                   P, Qv, as<double>(dx), dx_img, dx_row);
    else kt.cnn_input_grad.f32(as<const float>(dz), dz_img, dz_row, as<const float>(wt), G, n, Cout, Cin, k, Wp, P, Qv,
                               as<float>(dx), dx_img, dx_row);
  });
  m.def("cnn_shifted_corr", [](bool f64, ptr_t a, int64_t a_img, int64_t a_row, ptr_t src, int64_t src_img, ptr_t off,
                               int64_t Tn, int64_t G, int64_t n, int64_t R, int64_t P, ptr_t dw, ptr_t db) {
    require(P % 16 == 0 && Tn >= 1 && G >= 0 && n >= 0 && R >= 0, "cnn_shifted_corr", "expected P % 16 == 0, Tn >= 1");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& k = cpu::active();
    if (f64) k.cnn_shifted_corr.f64(as<const double>(a), a_img, a_row, as<const double>(src), src_img,
                                    as<const int64_t>(off), Tn, G, n, R, P, as<double>(dw), as<double>(db));
    else k.cnn_shifted_corr.f32(as<const float>(a), a_img, a_row, as<const float>(src), src_img,
                                as<const int64_t>(off), Tn, G, n, R, P, as<float>(dw), as<float>(db));
  });
  m.def("cnn_pool_relu", [](bool f64, ptr_t z, int64_t N, int64_t C, int64_t z_row, int64_t Wz, int64_t H2, int64_t W2,
                            int64_t pool, int64_t n, ptr_t out, int64_t out_group, int64_t out_img, int64_t s_c,
                            int64_t s_y, int64_t s_x, ptr_t idx) {
    require(pool >= 1 && n >= 1 && N >= 0, "cnn_pool_relu", "expected pool >= 1, n >= 1");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& k = cpu::active();
    if (f64) k.cnn_pool_relu.f64(as<const double>(z), N, C, z_row, Wz, H2, W2, pool, n, as<double>(out), out_group,
                                 out_img, s_c, s_y, s_x, as<int32_t>(idx));
    else k.cnn_pool_relu.f32(as<const float>(z), N, C, z_row, Wz, H2, W2, pool, n, as<float>(out), out_group, out_img,
                             s_c, s_y, s_x, as<int32_t>(idx));
  });
  m.def("cnn_conv_pool_relu", [](bool f64, ptr_t src, int64_t src_img, ptr_t off, int64_t Tn, ptr_t w, ptr_t bias,
                                 int64_t G, int64_t n, int64_t R, int64_t P, int64_t Wz, int64_t H2, int64_t W2,
                                 int64_t pool, ptr_t out, int64_t out_group, int64_t out_img, int64_t s_c, int64_t s_y,
                                 int64_t s_x, ptr_t idx) {
    require(P % 16 == 0 && Tn >= 1 && G >= 0 && n >= 1 && R >= 0 && pool >= 1 && H2 >= 0 && W2 >= 0 &&
                W2 * pool <= Wz && (H2 == 0 || W2 == 0 || (H2 * pool - 1) * Wz + W2 * pool <= P),
            "cnn_conv_pool_relu", "expected P % 16 == 0, Tn >= 1, n >= 1, pool >= 1, every window inside the P positions");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& k = cpu::active();
    if (f64) k.cnn_conv_pool_relu.f64(as<const double>(src), src_img, as<const int64_t>(off), Tn, as<const double>(w),
                                      as<const double>(bias), G, n, R, P, Wz, H2, W2, pool, as<double>(out), out_group,
                                      out_img, s_c, s_y, s_x, as<int32_t>(idx));
    else k.cnn_conv_pool_relu.f32(as<const float>(src), src_img, as<const int64_t>(off), Tn, as<const float>(w),
                                  as<const float>(bias), G, n, R, P, Wz, H2, W2, pool, as<float>(out), out_group,
                                  out_img, s_c, s_y, s_x, as<int32_t>(idx));
  });
  m.def("cnn_pool_relu_backward", [](bool f64, ptr_t da, ptr_t h, int64_t N, int64_t C, int64_t H2, int64_t W2,
                                     int64_t n, int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x,
                                     ptr_t idx, ptr_t dz, int64_t dz_row) {
    require(n >= 1 && N >= 0 && dz_row >= 0, "cnn_pool_relu_backward", "expected n >= 1, N >= 0, dz_row >= 0");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& k = cpu::active();
    if (f64) k.cnn_pool_relu_backward.f64(as<const double>(da), as<const double>(h), N, C, H2, W2, n, in_group, in_img,
                                          s_c, s_y, s_x, as<const int32_t>(idx), as<double>(dz), dz_row);
    else k.cnn_pool_relu_backward.f32(as<const float>(da), as<const float>(h), N, C, H2, W2, n, in_group, in_img,
                                      s_c, s_y, s_x, as<const int32_t>(idx), as<float>(dz), dz_row);
  });
  // A conv layer's weight, bias and (where dx is given) input gradients from its pooled gradient's
  // nonzero windows (csrc/cpu/cnn.cpp); every window's writes checked to lie inside dx's planes.
  m.def("cnn_pooled_backward", [](bool f64, ptr_t da, ptr_t h, int64_t G, int64_t n, int64_t C, int64_t H2,
                                  int64_t W2, int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x,
                                  ptr_t idx, ptr_t src, int64_t src_img, int64_t L, int64_t Wp, int64_t Cin, int64_t k,
                                  ptr_t dw, int64_t dw_model, ptr_t db, int64_t db_model, ptr_t wt, ptr_t dx,
                                  int64_t dx_img, int64_t dx_row) {
    require(G >= 0 && n >= 1 && C >= 0 && H2 >= 0 && W2 >= 0 && Cin >= 1 && k >= 1 && k <= 8 && L >= 1 && Wp >= k &&
                dw_model >= C * Cin * k * k && db_model >= C,
            "cnn_pooled_backward", "expected n >= 1, Cin >= 1, 1 <= k <= 8, Wp >= k, dw_model >= C·Cin·k², db_model >= C");
    require(!dx || (wt && dx_row >= 1 && dx_img >= Cin * dx_row &&
                    windows_fit(as<const int32_t>(idx), G * n * C * H2 * W2, (k - 1) * (Wp + 1), dx_row)),
            "cnn_pooled_backward", "expected wt, dx_img >= Cin·dx_row and every window's idx + (k − 1)(Wp + 1) < dx_row with dx");
    py::gil_scoped_release nogil;
    const cpu::KernelTable& kt = cpu::active();
    auto run = [&](auto zero) {
      using T = decltype(zero);
      kt.cnn_pooled_backward.of<T>()(as<const T>(da), as<const T>(h), G, n, C, H2, W2, in_group, in_img, s_c, s_y, s_x,
                                     as<const int32_t>(idx), as<const T>(src), src_img, L, Wp, Cin, k, as<T>(dw),
                                     dw_model, as<T>(db), db_model, as<const T>(wt), as<T>(dx), dx_img, dx_row);
    };
    if (f64) run(double{}); else run(float{});
  });
  // One conv layer's backward, model by model (model g's weight and bias gradients at dw + g·dw_model
  // and db + g·db_model: straight into the rows of a [G, d] gradient): cnn_pooled_backward where it
  // serves the layer; else the pooling's gradient into a scratch of one model's output-gradient
  // planes (n·C planes of P values), its weight and bias gradients and, where dx is given, its
  // input gradient from that scratch, without a chunk-sized dz (3.8 MB for the MNIST net's first
  // layer at 7 models of 20 rows; a model's scratch stays in L2). The same values as the kernels'
  // calls above over the whole chunk.
  m.def("cnn_conv_backward", [](bool f64, ptr_t da, ptr_t h, int64_t C, int64_t H2, int64_t W2, int64_t n,
                                int64_t in_group, int64_t in_img, int64_t s_c, int64_t s_y, int64_t s_x, ptr_t idx,
                                int64_t P, ptr_t src, int64_t src_img, ptr_t off, int64_t Tn, int64_t G, ptr_t dw,
                                int64_t dw_model, ptr_t db, int64_t db_model, ptr_t wt, int64_t Cin, int64_t k, int64_t Wp, int64_t Qv, ptr_t dx,
                                int64_t dx_img, int64_t dx_row) {
    require(P % 16 == 0 && Tn >= 1 && G >= 0 && n >= 1 && C >= 1 && H2 >= 0 && W2 >= 0 && dw && db &&
                dw_model >= C * Tn && db_model >= C,
            "cnn_conv_backward", "expected P % 16 == 0, Tn >= 1, n >= 1, C >= 1, non-null dw, db and model strides "
            "dw_model >= C·Tn, db_model >= C");
    require(!dx || (wt && k >= 1 && Cin >= 0 && Qv >= 0 && Qv <= P && Qv + (k - 1) * (Wp + 1) <= dx_row),
            "cnn_conv_backward", "expected wt, k >= 1, Qv <= P, Qv + (k - 1)(Wp + 1) <= dx_row with dx");
    // The gradients from the pooled gradient's nonzero windows (cnn_pooled_backward: a quarter of the
    // positions at 2 x 2 pooling, fewer after the ReLU, no dz) where the taps are k rows of k <= 8 in
    // the layout it assumes (off[t] = ci·L + ti·Wp + tj, L = src_img / Cin) and every window's
    // writes lie inside dx's planes; else the dense sums over dz's positions.
    const bool pooled = pooled_taps_layout(as<const int64_t>(off), Tn, Cin, k, Wp, src_img) &&
                        (!dx || windows_fit(as<const int32_t>(idx), G * n * C * H2 * W2, (k - 1) * (Wp + 1), dx_row));
    py::gil_scoped_release nogil;
    const cpu::KernelTable& kt = cpu::active();
    auto run = [&](auto zero) {
      using T = decltype(zero);
      std::vector<T> dz(static_cast<size_t>(pooled ? 0 : n * C * P));
      const int64_t K2 = k * k;
      for (int64_t g = 0; g < G; ++g) {
        if (pooled) {
          kt.cnn_pooled_backward.of<T>()(as<const T>(da) + g * in_group, as<const T>(h) + g * in_group, 1, n, C, H2,
                                         W2, in_group, in_img, s_c, s_y, s_x,
                                         as<const int32_t>(idx) + g * n * C * H2 * W2,
                                         as<const T>(src) + g * n * src_img, src_img, src_img / Cin, Wp, Cin, k,
                                         as<T>(dw) + g * dw_model, dw_model, as<T>(db) + g * db_model, db_model,
                                         dx ? as<const T>(wt) + g * Cin * K2 * C : nullptr,
                                         dx ? as<T>(dx) + g * n * dx_img : nullptr, dx_img, dx_row);
          continue;
        }
        kt.cnn_pool_relu_backward.of<T>()(as<const T>(da) + g * in_group, as<const T>(h) + g * in_group, n, C, H2, W2,
                                          n, in_group, in_img, s_c, s_y, s_x,
                                          as<const int32_t>(idx) + g * n * C * H2 * W2, dz.data(), P);
        kt.cnn_shifted_corr.of<T>()(dz.data(), C * P, P, as<const T>(src) + g * n * src_img, src_img,
                                      as<const int64_t>(off), Tn, 1, n, C, P, as<T>(dw) + g * dw_model,
                                      as<T>(db) + g * db_model);
        if (dx)
          kt.cnn_input_grad.of<T>()(dz.data(), C * P, P, as<const T>(wt) + g * Cin * K2 * C, 1, n, C, Cin, k, Wp, P, Qv,
                                    as<T>(dx) + g * n * dx_img, dx_img, dx_row);
      }
    };
    if (f64) run(double{}); else run(float{});
  });
  // The dense layers' forward and backward of a chunk of CNN models (csrc/cpu/cnn_dense.cpp); the
  // layers' parameter and gradient pointers are model 0's; theta_model / grad_model: each tensor's
  // model stride (W then b per layer).
  m.def("cnn_dense_grad", [](bool f64, ptr_t feats, int64_t G, int64_t n, std::vector<int64_t> dims,
                             std::vector<ptr_t> W, std::vector<ptr_t> b, std::vector<int64_t> theta_model, ptr_t y,
                             ptr_t w, std::vector<ptr_t> gW, std::vector<ptr_t> gb, std::vector<int64_t> grad_model,
                             ptr_t dfeats) {
    const size_t L = W.size();
    require(L >= 1 && dims.size() == L + 1 && b.size() == L && gW.size() == L && gb.size() == L && G >= 0 && n >= 1 &&
                theta_model.size() == 2 * L && grad_model.size() == 2 * L,
            "cnn_dense_grad", "expected layers >= 1 with len(dims) = layers + 1 pointers per layer, G >= 0, n >= 1");
    for (int64_t v : dims) require(v >= 1, "cnn_dense_grad", "expected every layer width >= 1");
    {  // the labels index the logits: a bad one would write past them
      const int64_t* yl = as<const int64_t>(y);
      const int64_t C = dims.back();
      bool ok = true;
      for (int64_t i = 0; i < G * n; ++i) ok &= yl[i] >= 0 && yl[i] < C;
      require(ok, "cnn_dense_grad", "expected labels in [0, classes)");
    }
    py::gil_scoped_release nogil;
    auto run = [&](auto zero) {
      using T = decltype(zero);
      std::vector<const T*> Wp(L), bp(L);
      std::vector<T*> gWp(L), gbp(L);
      for (size_t l = 0; l < L; ++l) {
        Wp[l] = as<const T>(W[l]), bp[l] = as<const T>(b[l]);
        gWp[l] = as<T>(gW[l]), gbp[l] = as<T>(gb[l]);
      }
      cpu::active().cnn_dense_grad.of<T>()(as<const T>(feats), G, n, int64_t(L), dims.data(), Wp.data(), bp.data(),
                                           theta_model.data(), as<const int64_t>(y), as<const T>(w), gWp.data(),
                                           gbp.data(), grad_model.data(), as<T>(dfeats));
    };
    if (f64) run(double{}); else run(float{});
  });
  m.def("cnn_dense_logits", [](bool f64, ptr_t feats, int64_t G, int64_t n, std::vector<int64_t> dims,
                               std::vector<ptr_t> W, std::vector<ptr_t> b, std::vector<int64_t> theta_model,
                               ptr_t logits) {
    const size_t L = W.size();
    require(L >= 1 && dims.size() == L + 1 && b.size() == L && G >= 0 && n >= 1 && theta_model.size() == 2 * L,
            "cnn_dense_logits",
            "expected layers >= 1 with len(dims) = layers + 1 pointers per layer, G >= 0, n >= 1");
    for (int64_t v : dims) require(v >= 1, "cnn_dense_logits", "expected every layer width >= 1");
    py::gil_scoped_release nogil;
    auto run = [&](auto zero) {
      using T = decltype(zero);
      std::vector<const T*> Wp(L), bp(L);
      for (size_t l = 0; l < L; ++l) Wp[l] = as<const T>(W[l]), bp[l] = as<const T>(b[l]);
      cpu::active().cnn_dense_logits.of<T>()(as<const T>(feats), G, n, int64_t(L), dims.data(), Wp.data(), bp.data(),
                                             theta_model.data(), as<T>(logits));
    };
    if (f64) run(double{}); else run(float{});
  });
  m.def("sym_products", [](bool f64, ptr_t Y, int64_t n, int64_t d, ptr_t out) {
    require(n >= 0 && d >= 1 && (n == 0 || (Y && out)), "sym_products", "expected n >= 0, d >= 1, non-null buffers");
    py::gil_scoped_release nogil;
    if (f64) cpu::active().sym_products.f64(as<const double>(Y), n, d, as<double>(out));
    else cpu::active().sym_products.f32(as<const float>(Y), n, d, as<float>(out));
  });
  m.def("perm_screen_stats", [](bool f64, ptr_t G, int64_t m, int64_t d, ptr_t omega, int64_t q, int64_t k,
                                ptr_t labels, ptr_t sq, ptr_t mu, ptr_t mu_sq, ptr_t t) -> int64_t {
    require(m >= 1 && d >= 1 && q >= 1 && k >= 1 && G && omega && labels && sq && mu && mu_sq && t,
            "perm_screen_stats", "expected m, d, q, k >= 1 and non-null buffers");
    py::gil_scoped_release nogil;
    if (f64)
      return cpu::active().perm_screen_stats.f64(as<const double>(G), m, d, as<const double>(omega), q, k,
                                                 as<int64_t>(labels), as<double>(sq), as<double>(mu),
                                                 as<double>(mu_sq), as<double>(t));
    return cpu::active().perm_screen_stats.f32(as<const float>(G), m, d, as<const float>(omega), q, k,
                                               as<int64_t>(labels), as<double>(sq), as<float>(mu), as<double>(mu_sq),
                                               as<double>(t));
  }, "PERM's screen statistics (csrc/cpu/perm_screen.cpp); returns the clusters made");
  // labels: perm_screen_stats' (in [0, k)); sizes: float64 [m], positive
  m.def("perm_screen_need", [](int64_t m, int64_t k, int64_t d, double unit, ptr_t labels, ptr_t sq, ptr_t mu_sq,
                               ptr_t t, ptr_t sizes, double lam, int64_t first, int64_t stop, ptr_t keys) {
    require(m >= 1 && k >= 1 && k <= 62 && d >= 1 && 0 <= first && first <= stop && stop <= m && labels && sq &&
                mu_sq && t && sizes && (first == stop || keys),
            "perm_screen_need", "expected m, d >= 1, 1 <= k <= 62, 0 <= first <= stop <= m and non-null buffers");
    py::gil_scoped_release nogil;
    cpu::perm_screen_need(m, k, d, unit, as<const int64_t>(labels), as<const double>(sq), as<const double>(mu_sq),
                          as<const double>(t), as<const double>(sizes), lam, first, stop, as<int64_t>(keys));
  }, "PERM's screen: the clusters each row may need, as bit keys (csrc/cpu/perm_bounds.cpp)");
  m.def("water_fill", [](ptr_t costs, int64_t r, int64_t k, ptr_t w, ptr_t w_own, ptr_t alpha) {
    require(r >= 0 && k >= 1 && costs && w && alpha, "water_fill", "expected r >= 0, k >= 1 and non-null buffers");
    Faults faults;
    {
      py::gil_scoped_release nogil;
      cpu::water_fill(as<const double>(costs), r, k, as<const double>(w), as<const double>(w_own), as<double>(alpha),
                      faults);
    }
    raise_faults(faults);
  });
  m.def("water_fill_gram", [](bool f64, ptr_t gram, ptr_t sq_r, ptr_t sq_c, ptr_t own, int64_t r, int64_t k, ptr_t w,
                              ptr_t out, int64_t out_stride, ptr_t out_rows, ptr_t cols, int fill, ptr_t levels) {
    require(r >= 0 && k >= 1 && out_stride >= k && (r == 0 || (gram && sq_r && own && out && out_rows && levels)) &&
                sq_c && w && cols,
            "water_fill_gram", "expected r >= 0, 1 <= k <= out_stride and non-null buffers");
    require(fill >= 0 && fill <= 2, "water_fill_gram", "expected fill 0, 1 or 2");
    Faults faults;
    {
      py::gil_scoped_release nogil;
      if (f64)
        cpu::water_fill_gram(as<const double>(gram), as<const double>(sq_r), as<const double>(sq_c),
                             as<const int64_t>(own), r, k, as<const double>(w), as<double>(out), out_stride,
                             as<const int64_t>(out_rows), as<const int64_t>(cols), fill, as<double>(levels), faults);
      else
        cpu::water_fill_gram(as<const float>(gram), as<const double>(sq_r), as<const double>(sq_c),
                             as<const int64_t>(own), r, k, as<const double>(w), as<double>(out), out_stride,
                             as<const int64_t>(out_rows), as<const int64_t>(cols), fill, as<double>(levels), faults);
    }
    raise_faults(faults);
  });
  // PT [r, m], rho_lo, rho_hi, slack float32 [m] (scaled); w float64 [m]; out [stop − first, m], levels, counts
  m.def("water_fill_screened", [](bool f64, ptr_t G, int64_t m, int64_t d, ptr_t PT, int64_t r, ptr_t rho_lo,
                                  ptr_t rho_hi, ptr_t slack, double k_lo, double k_hi, double eta,
                                  double cost_scale, ptr_t w,
                                  int64_t first, int64_t stop, bool f64_costs, int64_t max_candidates, ptr_t out,
                                  ptr_t levels, ptr_t counts) -> bool {
    require(m >= 1 && d >= 1 && r >= 1 && 0 <= first && first <= stop && stop <= m && G && PT && rho_lo && rho_hi &&
                slack && w && (first == stop || (out && levels && counts)) && cost_scale > 0.0,
            "water_fill_screened", "expected m, d, r >= 1, 0 <= first <= stop <= m, cost_scale > 0 and non-null buffers");
    Faults faults;
    bool done;
    {
      py::gil_scoped_release nogil;
      if (f64)
        done = cpu::active().water_fill_screened.f64(
            as<const double>(G), m, d, as<const float>(PT), r, as<const float>(rho_lo), as<const float>(rho_hi),
            as<const float>(slack), k_lo, k_hi, eta, cost_scale, as<const double>(w), first, stop, f64_costs, max_candidates,
            as<double>(out), as<double>(levels), as<int64_t>(counts), faults);
      else
        done = cpu::active().water_fill_screened.f32(
            as<const float>(G), m, d, as<const float>(PT), r, as<const float>(rho_lo), as<const float>(rho_hi),
            as<const float>(slack), k_lo, k_hi, eta, cost_scale, as<const double>(w), first, stop, f64_costs, max_candidates,
            as<double>(out), as<double>(levels), as<int64_t>(counts), faults);
    }
    raise_faults(faults);
    return done;
  }, "PERM's weights from a screen in a few principal directions (csrc/cpu/water_fill_screened.cpp); false: declined");
  m.def("sample_batches", [](ptr_t offsets, int64_t m, int64_t N, ptr_t clients, int64_t first_id, int64_t R,
                             int64_t steps, int64_t B, uint32_t seed, uint32_t counter, ptr_t out) {
    require(offsets && m >= 1 && R >= 0 && steps >= 0 && B >= 1 && (out || R * steps == 0), "sample_batches",
            "expected m >= 1, R >= 0, steps >= 0, B >= 1 and non-null buffers");
    Faults faults;
    {
      py::gil_scoped_release nogil;
      cpu::sample_batches(as<const int64_t>(offsets), m, N, as<const int64_t>(clients), first_id, R, steps, B, seed,
                          counter, as<int32_t>(out), faults);
    }
    raise_faults(faults);
  });
  m.def("randperm_prefix", &randperm_prefix,
        "out[:k] = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k] for n < 2^32 / 20, in "
        "O(k) time and memory: the first k swaps of torch's Fisher-Yates shuffle on the same mt19937 stream");
  m.def("average", [](bool f64, ptr_t theta, int64_t M, int64_t d, ptr_t weights, ptr_t rows, int64_t R, ptr_t out) {
    PFL_DISPATCH(f64, average_t, theta, M, d, weights, rows, R, out);
  });
  m.def("clip_and_sum",
        [](bool f64, ptr_t updates, int64_t R, int64_t d, ptr_t weights, double clip_norm, double noise_std,
           uint64_t seed, uint64_t counter, ptr_t out) {
          return PFL_DISPATCH(f64, clip_and_sum_t, updates, R, d, weights, clip_norm, noise_std, seed, counter, out);
        },
        "out [d] (float64) <- the tree-ordered sum of the clipped rows plus Gaussian noise; returns the number "
        "of rows clipped");
  m.def("dp_normals",
        [](uint64_t seed, uint64_t counter, int64_t n, ptr_t out) {
          require(n >= 0 && (out || n == 0), "dp_normals", "expected n >= 0 and a non-null buffer");
          py::gil_scoped_release nogil;
          cpu::dp_normals(seed, counter, n, as<double>(out));
        },
        "out [n] (float64) <- the clip_and_sum noise's standard normals for (seed, counter)");
  m.def("kernel_table",
        []() {
          return py::capsule(static_cast<const void*>(pflcore::kernel_table()), PFLCORE_KERNEL_TABLE_CAPSULE);
        },
        "The CPU kernels as a C function table (pflcore/include/pflcore_kernels.h, ABI "
        "PFLCORE_KERNELS_ABI) in a PyCapsule named 'pflcore_kernel_table': for native code that calls them "
        "without Python, e.g. the JAX FFI shim");
  m.def("cpu_capability", &cpu::level_in_use, "the CPU capability level whose kernels run: baseline, avx2, avx512 "
        "(or native for a -march=native build)");
  m.def("cpu_capabilities_built", &cpu::levels_built, "the levels compiled into this module, lowest first");
  m.def("cpu_capabilities_supported", &cpu::levels_supported, "the built levels this CPU can run, lowest first");
  m.def("set_cpu_capability",
        [](const std::string& name) {
          const std::string why = cpu::set_level(name);
          if (!why.empty()) throw py::value_error("cpu capability: " + why);
        },
        "runs the kernels of another built level from the next call on (ValueError if the CPU lacks it)");
  m.def("set_num_threads",
        [](int n) {
          require(n >= 1, "set_num_threads", "expected n >= 1, got " + std::to_string(n));
          require(n == 1 || !g_forked_child.load(), "set_num_threads",
                  "expected 1 in a process started by fork() (the OpenMP thread pool does not survive fork: more "
                  "threads would wait forever), got " + std::to_string(n) +
                      "; start parallel workers with multiprocessing's 'spawn' or 'forkserver' method");
#if defined(PFLCORE_OPENMP)
          omp_set_num_threads(n);
#endif
        },
        "the number of OpenMP threads of the kernels' parallel regions (this thread's setting)");
  m.def("get_num_threads", []() {
#if defined(PFLCORE_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
  });
  m.def("forked_child", []() { return g_forked_child.load(); },
        "True in a process started by fork() after this module loaded: its kernels run on one thread");
  m.def("build_info", []() {
    py::dict info;
    info["version"] = PFLCORE_VERSION;
#if defined(PFLCORE_OPENMP)
    info["openmp_max_threads"] = omp_get_max_threads();
    info["openmp_version"] = _OPENMP;
#else
    info["openmp_max_threads"] = 1;
    info["openmp_version"] = py::none();
#endif
    info["cpu_capability"] = cpu::level_in_use();
    info["cpu_capabilities_built"] = cpu::levels_built();
    info["cpu_capabilities_supported"] = cpu::levels_supported();
    info["kernel_table_abi"] = PFLCORE_KERNELS_ABI;
#if defined(__clang__)
    info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return info;
  });
}
