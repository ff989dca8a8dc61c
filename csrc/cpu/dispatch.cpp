// The level in use and the entry points of ops_cpu.h that forward to it (DESIGN.md §9).
// Compiled once, with the compiler's default flags: it runs on every CPU, before anything
// knows which instructions the CPU has.
#include "dispatch.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace pflcore {

void Faults::add(int64_t key, FaultKind kind, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lock(mu_);
  if (!any_.load(std::memory_order_relaxed) || key < key_) {
    key_ = key;
    kind_ = kind;
    message_ = buf;
  }
  any_.store(true, std::memory_order_relaxed);
}

namespace cpu {

// Each level's table (level_table.cpp in that level's namespace).
#if defined(PFLCORE_LEVEL_NATIVE)
namespace cpu_native { const KernelTable& level_table(); }
#else
namespace cpu_baseline { const KernelTable& level_table(); }
#if defined(PFLCORE_LEVEL_AVX2)
namespace cpu_avx2 { const KernelTable& level_table(); }
#endif
#if defined(PFLCORE_LEVEL_AVX512)
namespace cpu_avx512 { const KernelTable& level_table(); }
#endif
#endif

namespace {

struct Level {
  const KernelTable& (*table)();
  bool (*supported)();
  const char* needs;  // what the CPU must have, for messages
};

bool always() { return true; }

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
// __builtin_cpu_supports also checks that the OS saves the wider registers (XGETBV).
[[maybe_unused]] bool has_avx2() {  // unused when the avx2 level is not built (PFLCORE_X86_LEVELS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
[[maybe_unused]] bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

// Lowest first.
const std::vector<Level>& levels() {
  static const std::vector<Level> all = {
#if defined(PFLCORE_LEVEL_NATIVE)
      {cpu_native::level_table, always, "the CPU of the machine that built it (-march=native)"},
#else
      {cpu_baseline::level_table, always, ""},
#if defined(PFLCORE_LEVEL_AVX2)
      {cpu_avx2::level_table, has_avx2, "AVX2 and FMA"},
#endif
#if defined(PFLCORE_LEVEL_AVX512)
      {cpu_avx512::level_table, has_avx512, "AVX-512 F, BW, DQ and VL"},
#endif
#endif
  };
  return all;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

const KernelTable* find(const std::string& name, std::string* error) {
  for (const Level& l : levels()) {
    if (name != l.table().level) continue;
    if (l.supported()) return &l.table();
    *error = "'" + name + "' (it needs " + l.needs + ", which this CPU lacks)";
    return nullptr;
  }
  *error = "'" + name + "' (not a level of this build: " + join(levels_built()) + ")";
  return nullptr;
}

// The best supported level, or PFLCORE_CPU_CAPABILITY's; the reason when that cannot be used.
struct Choice {
  const KernelTable* table = nullptr;
  std::string error;
};

const Choice& initial() {
  static const Choice choice = [] {
    Choice c;
    for (const Level& l : levels())
      if (l.supported()) c.table = &l.table();
    const char* forced = std::getenv("PFLCORE_CPU_CAPABILITY");
    if (forced && *forced) {
      std::string why;
      if (const KernelTable* t = find(forced, &why)) {
        c.table = t;
      } else {
        c.error = "PFLCORE_CPU_CAPABILITY: expected one of " + join(levels_supported()) +
                  " (the levels built and supported here), got " + why;
      }
    }
    return c;
  }();
  return choice;
}

std::atomic<const KernelTable*> in_use{nullptr};

}  // namespace

const KernelTable& active() {
  const KernelTable* t = in_use.load(std::memory_order_acquire);
  if (t) return *t;
  t = initial().table;  // a bad PFLCORE_CPU_CAPABILITY is reported by level_error()
  in_use.store(t, std::memory_order_release);
  return *t;
}

std::vector<std::string> levels_built() {
  std::vector<std::string> out;
  for (const Level& l : levels()) out.push_back(l.table().level);
  return out;
}

std::vector<std::string> levels_supported() {
  std::vector<std::string> out;
  for (const Level& l : levels())
    if (l.supported()) out.push_back(l.table().level);
  return out;
}

std::string level_in_use() { return active().level; }

std::string level_error() { return initial().error; }

std::string set_level(const std::string& name) {
  std::string why;
  const KernelTable* t = find(name, &why);
  if (!t) return "expected one of " + join(levels_supported()) + " (the levels built and supported here), got " + why;
  in_use.store(t, std::memory_order_release);
  return "";
}

// ---- the entry points of ops_cpu.h ------------------------------------------------------------

template <typename T>
void local_steps(const GlmProblem<T>& prob, const LocalStepsArgs<T>& args, Faults& faults) {
  active().local_steps.of<T>()(prob, args, faults);
}

template <typename T>
void gradients(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
               int64_t batch_size, T* out, Faults& faults) {
  active().gradients.of<T>()(prob, theta, theta_stride, batches, batch_size, out, faults);
}

template <typename T>
void evaluate(const GlmProblem<T>& prob, const T* theta, int64_t theta_stride, const int32_t* batches,
              int64_t batch_size, T* loss_sum, int64_t* correct, int64_t* count, Faults& faults) {
  active().evaluate.of<T>()(prob, theta, theta_stride, batches, batch_size, loss_sum, correct, count, faults);
}

template <typename T>
void kmeans_assign(const T* points, const T* centroids, int64_t N, int64_t K, int64_t d, int64_t* labels, T* sqdist,
                   Faults& faults) {
  active().kmeans_assign.of<T>()(points, centroids, N, K, d, labels, sqdist, faults);
}

template <typename T>
void kmeans_update(const T* points, const int64_t* labels, const T* weights, int64_t N, int64_t K, int64_t d,
                   T* centroids, double* weight_sum, Faults& faults) {
  active().kmeans_update.of<T>()(points, labels, weights, N, K, d, centroids, weight_sum, faults);
}

template <typename T>
void kmeans_lloyd(const T* points, const T* weights, int64_t N, int64_t K, int64_t d, T* centroids, int64_t iters,
                  double tol, int64_t* labels, double* history, int64_t* iterations, Faults& faults) {
  active().kmeans_lloyd.of<T>()(points, weights, N, K, d, centroids, iters, tol, labels, history, iterations, faults);
}

template <typename T>
void anderson_push(const T* u, const T* tu, T* R_hist, T* TU_hist, int64_t D, int64_t slot, const int64_t* slots,
                   int64_t k, double* dots) {
  active().anderson_push.of<T>()(u, tu, R_hist, TU_hist, D, slot, slots, k, dots);
}

template <typename T>
void anderson_mix(const T* TU_hist, int64_t D, const int64_t* slots, const double* pi, int64_t k, T* out) {
  active().anderson_mix.of<T>()(TU_hist, D, slots, pi, k, out);
}

template <typename T>
void gram(const T* vecs, int64_t k, int64_t D, double* G) {
  active().gram.of<T>()(vecs, k, D, G);
}

template <typename T>
void average(const T* theta, int64_t M, const T* weights, const int64_t* rows, int64_t R, int64_t d, T* out,
             Faults& faults) {
  active().average.of<T>()(theta, M, weights, rows, R, d, out, faults);
}

template <typename T>
void clip_and_sum(const T* updates, int64_t R, int64_t d, const T* weights, double clip_norm, double noise_std,
                  uint64_t seed, uint64_t counter, double* out, int64_t* clipped, Faults& faults) {
  active().clip_and_sum.of<T>()(updates, R, d, weights, clip_norm, noise_std, seed, counter, out, clipped, faults);
}

void dp_normals(uint64_t seed, uint64_t counter, int64_t n, double* out) { active().dp_normals(seed, counter, n, out); }

void anderson_solve(const double* G, int64_t k, double reg, double* pi) { active().anderson_solve(G, k, reg, pi); }

void water_fill(const double* costs, int64_t r, int64_t k, const double* w, const double* w_own, double* alpha,
                Faults& faults) {
  active().water_fill(costs, r, k, w, w_own, alpha, faults);
}

template <typename T>
void water_fill_gram(const T* gram, const double* sq_r, const double* sq_c, const int64_t* own, int64_t r, int64_t k,
                     const double* w, double* out, int64_t out_stride, const int64_t* out_rows, const int64_t* cols,
                     int fill, double* levels, Faults& faults) {
  active().water_fill_gram.of<T>()(gram, sq_r, sq_c, own, r, k, w, out, out_stride, out_rows, cols, fill, levels,
                                   faults);
}

void sample_batches(const int64_t* offsets, int64_t m, int64_t N, const int64_t* clients, int64_t first_id,
                    int64_t R, int64_t steps, int64_t B, uint32_t seed, uint32_t counter, int32_t* out,
                    Faults& faults) {
  active().sample_batches(offsets, m, N, clients, first_id, R, steps, B, seed, counter, out, faults);
}

bool mlp_local_steps_supported(int64_t H, int64_t C) { return active().mlp_local_steps_supported(H, C); }
// mlp_local_steps: the binding calls active().mlp_local_steps, with the same table as its test.


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
template void kmeans_assign<float>(const float*, const float*, int64_t, int64_t, int64_t, int64_t*, float*, Faults&);
template void kmeans_assign<double>(const double*, const double*, int64_t, int64_t, int64_t, int64_t*, double*,
                                    Faults&);
template void kmeans_update<float>(const float*, const int64_t*, const float*, int64_t, int64_t, int64_t, float*,
                                   double*, Faults&);
template void kmeans_update<double>(const double*, const int64_t*, const double*, int64_t, int64_t, int64_t, double*,
                                    double*, Faults&);
template void kmeans_lloyd<float>(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t, double,
                                  int64_t*, double*, int64_t*, Faults&);
template void kmeans_lloyd<double>(const double*, const double*, int64_t, int64_t, int64_t, double*, int64_t, double,
                                   int64_t*, double*, int64_t*, Faults&);
template void anderson_push<float>(const float*, const float*, float*, float*, int64_t, int64_t, const int64_t*,
                                   int64_t, double*);
template void anderson_push<double>(const double*, const double*, double*, double*, int64_t, int64_t,
                                    const int64_t*, int64_t, double*);
template void anderson_mix<float>(const float*, int64_t, const int64_t*, const double*, int64_t, float*);
template void anderson_mix<double>(const double*, int64_t, const int64_t*, const double*, int64_t, double*);
template void gram<float>(const float*, int64_t, int64_t, double*);
template void gram<double>(const double*, int64_t, int64_t, double*);
template void average<float>(const float*, int64_t, const float*, const int64_t*, int64_t, int64_t, float*, Faults&);
template void average<double>(const double*, int64_t, const double*, const int64_t*, int64_t, int64_t, double*,
                              Faults&);
template void clip_and_sum<float>(const float*, int64_t, int64_t, const float*, double, double, uint64_t, uint64_t,
                                  double*, int64_t*, Faults&);
template void clip_and_sum<double>(const double*, int64_t, int64_t, const double*, double, double, uint64_t,
                                   uint64_t, double*, int64_t*, Faults&);
template void water_fill_gram<float>(const float*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                     const double*, double*, int64_t, const int64_t*, const int64_t*, int, double*,
                                     Faults&);
template void water_fill_gram<double>(const double*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                      const double*, double*, int64_t, const int64_t*, const int64_t*, int, double*,
                                      Faults&);

}  // namespace cpu
}  // namespace pflcore
