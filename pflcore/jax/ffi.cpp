// XLA FFI handlers that run pflcore's CPU kernels on XLA's own buffers (pflcore.jax).
//
// Built on first use by pflcore/jax/_shim.py against the XLA FFI headers that ship with
// jaxlib (jax.ffi.include_dir()), so that jax is not a build requirement of pflcore. This file
// only decodes buffers and attributes and calls the kernel table of pflcore._core
// (pflcore/include/pflcore_kernels.h), which pflcore_jax_init hands over: no kernel code and no
// link dependency here. Python checked every shape and dtype when it traced the call; the
// checks below repeat what guards memory (sizes, dtypes), for a caller that reaches these
// targets through jax.ffi.ffi_call directly.
//
// int64 arrays (labels, offsets, rows, counts) come as S64 buffers, or, when JAX runs without
// x64 and cannot hold int64, as S32 [..., 2] buffers holding the same bytes (little-endian
// int64s viewed as pairs of int32s).
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "pflcore_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

const pflcore_kernel_table* g_table = nullptr;

// ---- the test hook: the data addresses of the last call's buffers -------------------------
std::atomic<bool> g_record{false};
std::mutex g_record_mu;
std::vector<uint64_t> g_recorded;

void record(std::initializer_list<const void*> ptrs) {
  if (!g_record.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_record_mu);
  g_recorded.clear();
  for (const void* p : ptrs) g_recorded.push_back(reinterpret_cast<uint64_t>(p));
}

// ---- decoding -------------------------------------------------------------------------------
ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("pflcore.jax.") + op + ": " + what);
}

ffi::Error from_status(const char* op, int status, const char* msg) {
  if (status == PFLCORE_OK) return ffi::Error::Success();
  const char* kind = status == PFLCORE_NON_FINITE ? "NonFiniteError: "
                     : status == PFLCORE_BAD_VALUE  ? "ValueError: "
                                                    : "";
  return invalid(op, std::string(kind) + msg);
}

bool is_float(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F32 || b.element_type() == ffi::DataType::F64;
}

// The buffer as int64 storage of n values: S64 [.. n ..] or S32 [.. n .., 2]; null if not.
const int64_t* int64_data(const ffi::AnyBuffer& b, int64_t n) {
  const auto dims = b.dimensions();
  if (b.element_type() == ffi::DataType::S64 && int64_t(b.element_count()) == n)
    return static_cast<int64_t*>(b.untyped_data());
  if (b.element_type() == ffi::DataType::S32 && dims.size() >= 1 && dims.back() == 2 &&
      int64_t(b.element_count()) == 2 * n)
    return static_cast<int64_t*>(b.untyped_data());
  return nullptr;
}

int64_t int64_count(const ffi::AnyBuffer& b) {
  if (b.element_type() == ffi::DataType::S64) return b.element_count();
  if (b.element_type() == ffi::DataType::S32 && b.dimensions().size() >= 1 && b.dimensions().back() == 2)
    return b.element_count() / 2;
  return -1;
}

double scalar(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F64 ? *static_cast<const double*>(b.untyped_data())
                                                : double(*static_cast<const float*>(b.untyped_data()));
}

// Optional operands follow the fixed ones in a fixed order; bit k of `has` says whether the
// k-th optional one is present.
struct Optionals {
  const ffi::RemainingArgs& args;
  size_t next;
  int64_t has;
  bool bad = false;
  ffi::AnyBuffer* get(int bit, ffi::AnyBuffer* slot) {
    if (!(has & (int64_t(1) << bit))) return nullptr;
    auto b = args.get<ffi::AnyBuffer>(next++);
    if (b.has_error()) {
      bad = true;
      return nullptr;
    }
    *slot = *b;
    return slot;
  }
};

enum : int { kRows = 0, kBatches = 1, kAnchor = 2, kGradScale = 3 };

// The problem of x, y, offsets (args 1..3) and the model attributes; theta is arg 0.
// `R` is filled from rows (when present) or m. Returns an empty string when well formed.
std::string glm_of(const ffi::AnyBuffer& theta, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                   const ffi::AnyBuffer& offsets, const ffi::AnyBuffer* rows, int64_t family, int64_t C,
                   bool intercept, double l2, bool check_batches, pflcore_glm* g) {
  if (!is_float(x) || x.dimensions().size() != 2) return "x: expected a float32 or float64 [N, p] buffer";
  if (theta.element_type() != x.element_type()) return "theta: expected the dtype of x";
  g->f64 = x.element_type() == ffi::DataType::F64;
  g->family = int32_t(family);
  g->N = x.dimensions()[0];
  g->p = x.dimensions()[1];
  g->C = C;
  g->intercept = intercept;
  g->check_batches = check_batches;
  g->l2 = l2;
  g->x = x.untyped_data();
  if (family == 0) {
    if (y.element_type() != x.element_type() || int64_t(y.element_count()) != g->N)
      return "y: expected [N] floats of x's dtype";
    g->y = y.untyped_data();
  } else {
    g->y = int64_data(y, g->N);
    if (!g->y) return "y: expected int64 [N] labels";
  }
  g->m = int64_count(offsets) - 1;
  if (g->m < 1) return "offsets: expected int64 [m + 1], m >= 1";
  g->offsets = int64_data(offsets, g->m + 1);
  g->R = g->m;
  g->rows = nullptr;
  if (rows) {
    g->R = int64_count(*rows);
    g->rows = int64_data(*rows, g->R);
    if (!g->rows) return "rows: expected int64 [R]";
  }
  return "";
}

int64_t model_size(const pflcore_glm& g) { return (g.p + (g.intercept ? 1 : 0)) * g.C; }

// ---- local_steps: theta [R, d] (aliased to the result) -----------------------------------
ffi::Error LocalSteps(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out, int64_t family, int64_t C,
                      bool intercept, double l2, int64_t steps, bool check_batches, int64_t has) {
  const char* op = "local_steps";
  if (!g_table) return invalid(op, "pflcore_jax_init was not called");
  if (args.size() < 6) return invalid(op, "expected theta, x, y, offsets, lr, prox and the optional operands");
  auto theta = *args.get<ffi::AnyBuffer>(0), x = *args.get<ffi::AnyBuffer>(1), y = *args.get<ffi::AnyBuffer>(2),
       offsets = *args.get<ffi::AnyBuffer>(3), lr = *args.get<ffi::AnyBuffer>(4), prox = *args.get<ffi::AnyBuffer>(5);
  Optionals opt{args, 6, has};
  ffi::AnyBuffer s0 = theta, s1 = theta, s2 = theta, s3 = theta;
  ffi::AnyBuffer *rows = opt.get(kRows, &s0), *batches = opt.get(kBatches, &s1), *anchor = opt.get(kAnchor, &s2),
                 *scale = opt.get(kGradScale, &s3);
  if (opt.bad || args.size() != opt.next) return invalid(op, "the operands do not match the `has` attribute");
  pflcore_glm g;
  std::string why = glm_of(theta, x, y, offsets, rows, family, C, intercept, l2, check_batches, &g);
  if (!why.empty()) return invalid(op, why);
  const int64_t d = model_size(g);
  if (theta.dimensions().size() != 2 || theta.dimensions()[0] != g.R || theta.dimensions()[1] != d)
    return invalid(op, "theta: expected [R, d]");
  if (out->element_type() != theta.element_type() || out->element_count() != theta.element_count())
    return invalid(op, "the result must have theta's shape and dtype");
  if (lr.element_type() != x.element_type() || lr.element_count() != 1 || prox.element_type() != x.element_type() ||
      prox.element_count() != 1)
    return invalid(op, "lr, prox: expected scalars of x's dtype");
  int64_t B = 0;
  if (batches) {
    const auto bd = batches->dimensions();
    if (batches->element_type() != ffi::DataType::S32 || bd.size() != 3 || bd[0] != g.R || bd[1] != steps || bd[2] < 1)
      return invalid(op, "batches: expected int32 [R, steps, B]");
    B = bd[2];
  }
  if (anchor && (anchor->element_type() != x.element_type() ||
                 (int64_t(anchor->element_count()) != d && int64_t(anchor->element_count()) != g.R * d)))
    return invalid(op, "anchor: expected [R, d] or [d] of x's dtype");
  if (scale && (scale->element_type() != x.element_type() || int64_t(scale->element_count()) != g.R))
    return invalid(op, "grad_scale: expected [R] of x's dtype");
  const double lr_v = scalar(lr), prox_v = scalar(prox);
  // the checks of pflcore._checks.check_real, for a traced lr or prox
  char msg[512];
  if (!(lr_v - lr_v == 0.0) || !(lr_v > 0.0)) {
    std::snprintf(msg, sizeof msg, "ValueError: lr: expected a finite number > 0.0, got %g", lr_v);
    return invalid(op, msg);
  }
  if (!(prox_v - prox_v == 0.0) || !(prox_v >= 0.0)) {
    std::snprintf(msg, sizeof msg, "ValueError: prox: expected a finite number >= 0.0, got %g", prox_v);
    return invalid(op, msg);
  }
  void* theta_out = out->untyped_data();
  record({theta.untyped_data(), x.untyped_data(), y.untyped_data(), offsets.untyped_data(),
          rows ? rows->untyped_data() : nullptr, batches ? batches->untyped_data() : nullptr,
          anchor ? anchor->untyped_data() : nullptr, scale ? scale->untyped_data() : nullptr, theta_out});
  // XLA aliases the result with theta (input_output_aliases); were it ever not to, start from theta
  if (theta_out != theta.untyped_data()) std::memcpy(theta_out, theta.untyped_data(), theta.size_bytes());
  const int32_t* batch_rows = batches ? static_cast<const int32_t*>(batches->untyped_data()) : nullptr;
  const int status = g_table->local_steps(&g, theta_out, batch_rows, B, anchor ? anchor->untyped_data() : nullptr,
                                          anchor && anchor->dimensions().size() == 1,
                                          scale ? scale->untyped_data() : nullptr, steps, lr_v, prox_v, msg,
                                          sizeof msg);
  return from_status(op, status, msg);
}

// ---- gradients / evaluate: theta [R, d] or [d] (one model for every row) -----------------
struct ModelRows {
  pflcore_glm g;
  bool shared;
  const int32_t* batches;
  int64_t B;
};

std::string model_rows(const ffi::RemainingArgs& args, int64_t family, int64_t C, bool intercept, double l2,
                       bool check_batches, int64_t has, ModelRows* mr, ffi::AnyBuffer* theta_out) {
  if (args.size() < 4) return "expected theta, x, y, offsets and the optional operands";
  auto theta = *args.get<ffi::AnyBuffer>(0), x = *args.get<ffi::AnyBuffer>(1), y = *args.get<ffi::AnyBuffer>(2),
       offsets = *args.get<ffi::AnyBuffer>(3);
  Optionals opt{args, 4, has};
  ffi::AnyBuffer s0 = theta, s1 = theta;
  ffi::AnyBuffer *rows = opt.get(kRows, &s0), *batches = opt.get(kBatches, &s1);
  if (opt.bad || args.size() != opt.next) return "the operands do not match the `has` attribute";
  std::string why = glm_of(theta, x, y, offsets, rows, family, C, intercept, l2, check_batches, &mr->g);
  if (!why.empty()) return why;
  const int64_t d = model_size(mr->g);
  const auto td = theta.dimensions();
  mr->shared = td.size() == 1;
  if (!((td.size() == 1 && td[0] == d) || (td.size() == 2 && td[0] == mr->g.R && td[1] == d)))
    return "theta: expected [R, d] or [d]";
  mr->batches = nullptr;
  mr->B = 0;
  if (batches) {
    const auto bd = batches->dimensions();
    if (batches->element_type() != ffi::DataType::S32 || bd.size() != 2 || bd[0] != mr->g.R || bd[1] < 1)
      return "batches: expected int32 [R, B]";
    mr->batches = static_cast<const int32_t*>(batches->untyped_data());
    mr->B = bd[1];
  }
  *theta_out = theta;
  record({theta.untyped_data(), x.untyped_data(), y.untyped_data(), offsets.untyped_data(),
          rows ? rows->untyped_data() : nullptr, batches ? batches->untyped_data() : nullptr});
  return "";
}

ffi::Error Gradients(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out, int64_t family, int64_t C,
                     bool intercept, double l2, bool check_batches, int64_t has) {
  const char* op = "gradients";
  if (!g_table) return invalid(op, "pflcore_jax_init was not called");
  ModelRows mr;
  ffi::AnyBuffer theta = *out;
  std::string why = model_rows(args, family, C, intercept, l2, check_batches, has, &mr, &theta);
  if (!why.empty()) return invalid(op, why);
  if (out->element_type() != theta.element_type() || int64_t(out->element_count()) != mr.g.R * model_size(mr.g))
    return invalid(op, "the result must be [R, d] of theta's dtype");
  char msg[512];
  return from_status(op, g_table->gradients(&mr.g, theta.untyped_data(), mr.shared, mr.batches, mr.B,
                                            out->untyped_data(), msg, sizeof msg), msg);
}

ffi::Error Evaluate(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> correct,
                    ffi::Result<ffi::AnyBuffer> count, int64_t family, int64_t C, bool intercept, double l2,
                    bool check_batches, int64_t has) {
  const char* op = "evaluate";
  if (!g_table) return invalid(op, "pflcore_jax_init was not called");
  ModelRows mr;
  ffi::AnyBuffer theta = *loss;
  std::string why = model_rows(args, family, C, intercept, l2, check_batches, has, &mr, &theta);
  if (!why.empty()) return invalid(op, why);
  int64_t* correct_p = const_cast<int64_t*>(int64_data(*correct, mr.g.R));
  int64_t* count_p = const_cast<int64_t*>(int64_data(*count, mr.g.R));
  if (loss->element_type() != theta.element_type() || int64_t(loss->element_count()) != mr.g.R || !correct_p ||
      !count_p)
    return invalid(op, "the results must be [R] of theta's dtype, int64 [R] and int64 [R]");
  char msg[512];
  return from_status(op, g_table->evaluate(&mr.g, theta.untyped_data(), mr.shared, mr.batches, mr.B,
                                           loss->untyped_data(), correct_p, count_p, msg, sizeof msg), msg);
}

// ---- kmeans_assign ----------------------------------------------------------------------
ffi::Error KmeansAssign(ffi::AnyBuffer points, ffi::AnyBuffer centroids, ffi::Result<ffi::AnyBuffer> labels,
                        ffi::Result<ffi::AnyBuffer> sqdist) {
  const char* op = "kmeans_assign";
  if (!g_table) return invalid(op, "pflcore_jax_init was not called");
  const auto pd = points.dimensions(), cd = centroids.dimensions();
  if (!is_float(points) || pd.size() != 2 || centroids.element_type() != points.element_type() || cd.size() != 2 ||
      cd[1] != pd[1] || cd[0] < 1)
    return invalid(op, "expected points [N, d] and centroids [K, d] (K >= 1) of one float dtype");
  const int64_t N = pd[0];
  int64_t* labels_p = const_cast<int64_t*>(int64_data(*labels, N));
  if (!labels_p || sqdist->element_type() != points.element_type() || int64_t(sqdist->element_count()) != N)
    return invalid(op, "the results must be int64 [N] and [N] of the points' dtype");
  record({points.untyped_data(), centroids.untyped_data(), labels_p, sqdist->untyped_data()});
  char msg[512];
  return from_status(op, g_table->kmeans_assign(points.element_type() == ffi::DataType::F64, points.untyped_data(), N,
                                                pd[1], centroids.untyped_data(), cd[0], labels_p,
                                                sqdist->untyped_data(), msg, sizeof msg), msg);
}

}  // namespace

// ---- the exported symbols (ctypes) ---------------------------------------------------------
extern "C" {

// Hands over pflcore._core's kernel table; 0 when it is usable, else the reason in err.
int pflcore_jax_init(const void* table, char* err, size_t err_size) {
  auto t = static_cast<const pflcore_kernel_table*>(table);
  if (!t || t->abi_version != PFLCORE_KERNELS_ABI || t->size < sizeof(pflcore_kernel_table)) {
    std::snprintf(err, err_size, "kernel table ABI %u (%u bytes), this shim was built for ABI %d (%zu bytes)",
                  t ? t->abi_version : 0u, t ? t->size : 0u, PFLCORE_KERNELS_ABI, sizeof(pflcore_kernel_table));
    return 1;
  }
  g_table = t;
  return 0;
}

// Test hook: record (on = 1) the data addresses of the buffers each call receives.
void pflcore_jax_record(int on) {
  std::lock_guard<std::mutex> lock(g_record_mu);
  g_recorded.clear();
  g_record.store(on != 0);
}

// The addresses the last recorded call received (operands in order, then the results; 0 for
// an absent optional operand); returns how many there are, writing at most cap.
int pflcore_jax_recorded(uint64_t* out, int cap) {
  std::lock_guard<std::mutex> lock(g_record_mu);
  for (int i = 0; i < cap && i < int(g_recorded.size()); ++i) out[i] = g_recorded[i];
  return int(g_recorded.size());
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(pflcore_jax_local_steps, LocalSteps,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("family")
                                  .Attr<int64_t>("C")
                                  .Attr<bool>("intercept")
                                  .Attr<double>("l2")
                                  .Attr<int64_t>("steps")
                                  .Attr<bool>("check_batches")
                                  .Attr<int64_t>("has"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pflcore_jax_gradients, Gradients,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("family")
                                  .Attr<int64_t>("C")
                                  .Attr<bool>("intercept")
                                  .Attr<double>("l2")
                                  .Attr<bool>("check_batches")
                                  .Attr<int64_t>("has"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pflcore_jax_evaluate, Evaluate,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("family")
                                  .Attr<int64_t>("C")
                                  .Attr<bool>("intercept")
                                  .Attr<double>("l2")
                                  .Attr<bool>("check_batches")
                                  .Attr<int64_t>("has"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pflcore_jax_kmeans_assign, KmeansAssign,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
