// pybind11 definitions of pflcore._core (the CPU kernels). Bindings only: the math is in
// csrc/cpu. Python (pflcore/ops) validates every argument first and passes C-contiguous
// numpy views of CPU tensors; the checks here are a second line of defence that turns a
// contract violation into a ValueError instead of a crash.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

#include <string>

#include "pflcore/ops_cpu.h"

namespace py = pybind11;
using namespace pflcore;

namespace {

std::string shape_of(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// Checks dtype, rank and C-contiguity; returns the array for chaining.
template <typename T>
const py::array& expect(const py::array& a, const char* name, int ndim, bool writable = false) {
  if (!py::isinstance<py::array_t<T>>(a) || !a.dtype().is(py::dtype::of<T>()))
    throw py::value_error(std::string(name) + ": expected dtype " +
                          std::string(py::str(py::dtype::of<T>())) + ", got " +
                          std::string(py::str(a.dtype())));
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) +
                          " dimensions, got shape " + shape_of(a));
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(name) + ": expected a C-contiguous array");
  if (writable && !a.writeable()) throw py::value_error(std::string(name) + ": array is read-only");
  return a;
}

template <typename T>
const T* cptr(const py::array& a, const char* name, int ndim) {
  return static_cast<const T*>(expect<T>(a, name, ndim).data());
}
template <typename T>
T* mptr(py::array& a, const char* name, int ndim) {
  expect<T>(a, name, ndim, true);
  return static_cast<T*>(a.mutable_data());
}
template <typename T>
const T* optional_cptr(const py::object& o, const char* name, int ndim) {
  if (o.is_none()) return nullptr;
  return cptr<T>(o.cast<py::array>(), name, ndim);
}

bool is_f64(const py::array& a) { return a.dtype().is(py::dtype::of<double>()); }

template <typename T>
cpu::GlmProblem<T> make_problem(int family, int64_t p, int64_t C, bool intercept, double l2,
                                const py::array& x, const py::array& y, const py::array& offsets,
                                const py::array& rows) {
  if (family < 0 || family > 2) throw py::value_error("family: expected 0, 1 or 2");
  cpu::GlmProblem<T> prob;
  prob.family = static_cast<Family>(family);
  prob.p = p;
  prob.C = C;
  prob.intercept = intercept;
  prob.l2 = static_cast<T>(l2);
  prob.x = cptr<T>(x, "x", 2);
  if (x.shape(1) != p) throw py::value_error("x: expected " + std::to_string(p) + " columns");
  prob.y = prob.family == Family::LeastSquares ? static_cast<const void*>(cptr<T>(y, "y", 1))
                                               : static_cast<const void*>(cptr<int64_t>(y, "y", 1));
  prob.offsets = cptr<int64_t>(offsets, "offsets", 1);
  prob.m = offsets.shape(0) - 1;
  prob.rows = cptr<int64_t>(rows, "rows", 1);
  prob.R = rows.shape(0);
  return prob;
}

template <typename T>
void local_steps_t(int family, int64_t p, int64_t C, bool intercept, double l2, py::array theta,
                   const py::array& x, const py::array& y, const py::array& offsets,
                   const py::array& rows, const py::object& batches, const py::object& anchor,
                   const py::object& grad_scale, int64_t steps, double lr, double prox) {
  auto prob = make_problem<T>(family, p, C, intercept, l2, x, y, offsets, rows);
  cpu::LocalStepsArgs<T> args;
  args.theta = mptr<T>(theta, "theta", 2);
  args.batches = optional_cptr<int32_t>(batches, "batches", 3);
  args.batch_size = batches.is_none() ? 0 : batches.cast<py::array>().shape(2);
  args.anchor_shared = !anchor.is_none() && anchor.cast<py::array>().ndim() == 1;
  args.anchor = optional_cptr<T>(anchor, "anchor", args.anchor_shared ? 1 : 2);
  args.grad_scale = optional_cptr<T>(grad_scale, "grad_scale", 1);
  args.steps = steps;
  args.lr = static_cast<T>(lr);
  args.prox = static_cast<T>(prox);
  py::gil_scoped_release nogil;
  cpu::local_steps<T>(prob, args);
}

template <typename T>
void gradients_t(int family, int64_t p, int64_t C, bool intercept, double l2,
                 const py::array& theta, const py::array& x, const py::array& y,
                 const py::array& offsets, const py::array& rows, const py::object& batches,
                 py::array out) {
  auto prob = make_problem<T>(family, p, C, intercept, l2, x, y, offsets, rows);
  const T* th = cptr<T>(theta, "theta", 2);
  const int32_t* b = optional_cptr<int32_t>(batches, "batches", 2);
  const int64_t B = batches.is_none() ? 0 : batches.cast<py::array>().shape(1);
  T* o = mptr<T>(out, "out", 2);
  py::gil_scoped_release nogil;
  cpu::gradients<T>(prob, th, b, B, o);
}

template <typename T>
void evaluate_t(int family, int64_t p, int64_t C, bool intercept, double l2,
                const py::array& theta, const py::array& x, const py::array& y,
                const py::array& offsets, const py::array& rows, py::array loss_sum,
                py::array correct, py::array count) {
  auto prob = make_problem<T>(family, p, C, intercept, l2, x, y, offsets, rows);
  const T* th = cptr<T>(theta, "theta", 2);
  T* ls = mptr<T>(loss_sum, "loss_sum", 1);
  int64_t* cr = mptr<int64_t>(correct, "correct", 1);
  int64_t* ct = mptr<int64_t>(count, "count", 1);
  py::gil_scoped_release nogil;
  cpu::evaluate<T>(prob, th, ls, cr, ct);
}

template <typename T>
void kmeans_assign_t(const py::array& points, const py::array& centroids, py::array labels,
                     py::array sqdist) {
  const T* x = cptr<T>(points, "points", 2);
  const T* c = cptr<T>(centroids, "centroids", 2);
  const int64_t N = points.shape(0), d = points.shape(1), K = centroids.shape(0);
  if (centroids.shape(1) != d) throw py::value_error("centroids: expected " + std::to_string(d) + " columns");
  int64_t* lab = mptr<int64_t>(labels, "labels", 1);
  T* sq = mptr<T>(sqdist, "sqdist", 1);
  py::gil_scoped_release nogil;
  cpu::kmeans_assign<T>(x, c, N, K, d, lab, sq);
}

template <typename T>
void kmeans_update_t(const py::array& points, const py::array& labels, const py::object& weights,
                     py::array centroids, py::array weight_sum) {
  const T* x = cptr<T>(points, "points", 2);
  const int64_t* lab = cptr<int64_t>(labels, "labels", 1);
  const T* w = optional_cptr<T>(weights, "weights", 1);
  T* c = mptr<T>(centroids, "centroids", 2);
  double* ws = mptr<double>(weight_sum, "weight_sum", 1);
  const int64_t N = points.shape(0), d = points.shape(1), K = centroids.shape(0);
  py::gil_scoped_release nogil;
  cpu::kmeans_update<T>(x, lab, w, N, K, d, c, ws);
}

template <typename T>
void anderson_push_t(const py::array& u, const py::array& tu, py::array R_hist, py::array TU_hist,
                     int64_t slot, const py::array& slots, py::array dots) {
  const T* pu = cptr<T>(u, "u", 1);
  const T* ptu = cptr<T>(tu, "tu", 1);
  T* R = mptr<T>(R_hist, "R_hist", 2);
  T* TU = mptr<T>(TU_hist, "TU_hist", 2);
  const int64_t* s = cptr<int64_t>(slots, "slots", 1);
  double* out = mptr<double>(dots, "dots", 1);
  const int64_t D = u.shape(0), k = slots.shape(0);
  py::gil_scoped_release nogil;
  cpu::anderson_push<T>(pu, ptu, R, TU, D, slot, s, k, out);
}

template <typename T>
void anderson_mix_t(const py::array& TU_hist, const py::array& slots, const py::array& pi,
                    py::array out) {
  const T* TU = cptr<T>(TU_hist, "TU_hist", 2);
  const int64_t* s = cptr<int64_t>(slots, "slots", 1);
  const double* w = cptr<double>(pi, "pi", 1);
  T* o = mptr<T>(out, "out", 1);
  const int64_t D = TU_hist.shape(1), k = slots.shape(0);
  py::gil_scoped_release nogil;
  cpu::anderson_mix<T>(TU, D, s, w, k, o);
}

template <typename T>
void gram_t(const py::array& vecs, py::array G) {
  const T* v = cptr<T>(vecs, "vecs", 2);
  double* g = mptr<double>(G, "G", 2);
  const int64_t k = vecs.shape(0), D = vecs.shape(1);
  py::gil_scoped_release nogil;
  cpu::gram<T>(v, k, D, g);
}

template <typename T>
void average_t(const py::array& theta, const py::array& weights, const py::array& rows,
               py::array out) {
  const T* th = cptr<T>(theta, "theta", 2);
  const T* w = cptr<T>(weights, "weights", 1);
  const int64_t* r = cptr<int64_t>(rows, "rows", 1);
  T* o = mptr<T>(out, "out", 1);
  const int64_t R = rows.shape(0), d = theta.shape(1);
  py::gil_scoped_release nogil;
  cpu::average<T>(th, w, r, R, d, o);
}

// Picks the float or double instantiation from the dtype of `key`.
#define PFL_DISPATCH(key, fn, ...) \
  (is_f64(key) ? fn<double>(__VA_ARGS__) : fn<float>(__VA_ARGS__))

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pflcore CPU kernels (C++17/OpenMP). Called through pflcore.ops, which validates inputs.";

  m.def("local_steps",
        [](int family, int64_t p, int64_t C, bool intercept, double l2, py::array theta,
           py::array x, py::array y, py::array offsets, py::array rows, py::object batches,
           py::object anchor, py::object grad_scale, int64_t steps, double lr, double prox) {
          PFL_DISPATCH(x, local_steps_t, family, p, C, intercept, l2, theta, x, y, offsets, rows,
                       batches, anchor, grad_scale, steps, lr, prox);
        },
        "theta [R, d] <- K fused gradient steps per model row (in place)");
  m.def("gradients",
        [](int family, int64_t p, int64_t C, bool intercept, double l2, py::array theta,
           py::array x, py::array y, py::array offsets, py::array rows, py::object batches,
           py::array out) {
          PFL_DISPATCH(x, gradients_t, family, p, C, intercept, l2, theta, x, y, offsets, rows,
                       batches, out);
        });
  m.def("evaluate",
        [](int family, int64_t p, int64_t C, bool intercept, double l2, py::array theta,
           py::array x, py::array y, py::array offsets, py::array rows, py::array loss_sum,
           py::array correct, py::array count) {
          PFL_DISPATCH(x, evaluate_t, family, p, C, intercept, l2, theta, x, y, offsets, rows,
                       loss_sum, correct, count);
        });
  m.def("kmeans_assign", [](py::array points, py::array centroids, py::array labels,
                            py::array sqdist) {
    PFL_DISPATCH(points, kmeans_assign_t, points, centroids, labels, sqdist);
  });
  m.def("kmeans_update", [](py::array points, py::array labels, py::object weights,
                            py::array centroids, py::array weight_sum) {
    PFL_DISPATCH(points, kmeans_update_t, points, labels, weights, centroids, weight_sum);
  });
  m.def("anderson_push", [](py::array u, py::array tu, py::array R_hist, py::array TU_hist,
                            int64_t slot, py::array slots, py::array dots) {
    PFL_DISPATCH(u, anderson_push_t, u, tu, R_hist, TU_hist, slot, slots, dots);
  });
  m.def("anderson_mix", [](py::array TU_hist, py::array slots, py::array pi, py::array out) {
    PFL_DISPATCH(TU_hist, anderson_mix_t, TU_hist, slots, pi, out);
  });
  m.def("gram", [](py::array vecs, py::array G) { PFL_DISPATCH(vecs, gram_t, vecs, G); });
  m.def("anderson_solve", [](py::array G, double reg, py::array pi) {
    const double* g = cptr<double>(G, "G", 2);
    double* out = mptr<double>(pi, "pi", 1);
    const int64_t k = G.shape(0);
    if (G.shape(1) != k || pi.shape(0) != k) throw py::value_error("G: expected a square [k, k] matrix and pi [k]");
    cpu::anderson_solve(g, k, reg, out);
  });
  m.def("sample_batches", [](py::array offsets, py::array clients, py::array client_ids,
                             int64_t steps, int64_t B, uint32_t seed, uint32_t counter,
                             py::array out) {
    const int64_t* off = cptr<int64_t>(offsets, "offsets", 1);
    const int64_t* cl = cptr<int64_t>(clients, "clients", 1);
    const int64_t* ids = cptr<int64_t>(client_ids, "client_ids", 1);
    int32_t* o = mptr<int32_t>(out, "out", 3);
    const int64_t R = clients.shape(0);
    py::gil_scoped_release nogil;
    cpu::sample_batches(off, cl, ids, R, steps, B, seed, counter, o);
  });
  m.def("average", [](py::array theta, py::array weights, py::array rows, py::array out) {
    PFL_DISPATCH(theta, average_t, theta, weights, rows, out);
  });
  m.def("build_info", []() {
    py::dict info;
    info["version"] = PFLCORE_VERSION;
    info["openmp_max_threads"] = omp_get_max_threads();
    info["openmp_version"] = _OPENMP;
    info["arch_flags"] = PFLCORE_ARCH_FLAGS;
#if defined(__clang__)
    info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    py::list ops;
    // Op names as pflcore.backend.select() asks for them.
    for (const char* op : {"local_steps", "gradients", "evaluate", "kmeans_assign", "kmeans_update",
                           "anderson", "sample_batches", "average"})
      ops.append(op);
    info["ops"] = ops;
    return info;
  });
}
