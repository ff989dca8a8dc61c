// The table of the CPU kernels of one capability level (DESIGN.md §9), and the choice of the
// level in use. Each level's copy of the kernel sources fills one table (level_table.cpp,
// compiled once per level); dispatch.cpp keeps the best one the CPU supports and forwards the
// entry points of ops_cpu.h to it.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "pflcore/checks.h"
#include "pflcore/ops_cpu.h"

namespace pflcore::cpu {

// One entry per dtype: .of<T>() is the float or the double kernel.
template <template <typename> class Fn>
struct Typed {
  Fn<float> f32;
  Fn<double> f64;
  template <typename T>
  Fn<T> of() const {
    if constexpr (std::is_same_v<T, float>) return f32; else return f64;
  }
};

template <typename T>
using LocalStepsFn = void (*)(const GlmProblem<T>&, const LocalStepsArgs<T>&, Faults&);
template <typename T>
using GradientsFn = void (*)(const GlmProblem<T>&, const T*, int64_t, const int32_t*, int64_t, T*, Faults&);
template <typename T>
using EvaluateFn = void (*)(const GlmProblem<T>&, const T*, int64_t, const int32_t*, int64_t, T*, int64_t*, int64_t*,
                            Faults&);
template <typename T>
using KmeansAssignFn = void (*)(const T*, const T*, int64_t, int64_t, int64_t, int64_t*, T*, Faults&);
template <typename T>
using KmeansUpdateFn = void (*)(const T*, const int64_t*, const T*, int64_t, int64_t, int64_t, T*, double*, Faults&);
template <typename T>
using KmeansLloydFn = void (*)(const T*, const T*, int64_t, int64_t, int64_t, T*, int64_t, double, int64_t*, double*,
                               int64_t*, Faults&);
template <typename T>
using AndersonPushFn = void (*)(const T*, const T*, T*, T*, int64_t, int64_t, const int64_t*, int64_t, double*);
template <typename T>
using AndersonMixFn = void (*)(const T*, int64_t, const int64_t*, const double*, int64_t, T*);
template <typename T>
using GramFn = void (*)(const T*, int64_t, int64_t, double*);
template <typename T>
using AverageFn = void (*)(const T*, int64_t, const T*, const int64_t*, int64_t, int64_t, T*, Faults&);

template <typename T>
using ClipAndSumFn = void (*)(const T*, int64_t, int64_t, const T*, double, double, uint64_t, uint64_t, double*,
                              int64_t*, Faults&);

template <typename T>
using CnnGemmFn = void (*)(const T*, int64_t, const int64_t*, int64_t, const T*, const T*, int64_t, int64_t, int64_t,
                           int64_t, T*, int64_t, int64_t);
template <typename T>
using CnnInputGradFn = void (*)(const T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, T*, int64_t, int64_t);
template <typename T>
using CnnCorrFn = void (*)(const T*, int64_t, int64_t, const T*, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, T*, T*);
template <typename T>
using CnnPooledBackwardFn = void (*)(const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, int64_t, const int32_t*, const T*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, T*, int64_t, T*, int64_t, const T*, T*, int64_t,
                                     int64_t);
template <typename T>
using CnnPoolFn = void (*)(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, T*,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int32_t*);
template <typename T>
using CnnConvPoolFn = void (*)(const T*, int64_t, const int64_t*, int64_t, const T*, const T*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, int64_t, int64_t, T*, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int32_t*);
template <typename T>
using CnnPoolBackFn = void (*)(const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, const int32_t*, T*, int64_t);

template <typename T>
using CnnDenseGradFn = void (*)(const T*, int64_t, int64_t, int64_t, const int64_t*, const T* const*, const T* const*,
                                const int64_t*, const int64_t*, const T*, T* const*, T* const*, const int64_t*, T*);

template <typename T>
using CnnDenseLogitsFn = void (*)(const T*, int64_t, int64_t, int64_t, const int64_t*, const T* const*,
                                  const T* const*, const int64_t*, T*);

template <typename T>
using PermScreenStatsFn = int64_t (*)(const T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t*, double*, T*,
                                      double*, double*);

template <typename T>
using SymProductsFn = void (*)(const T*, int64_t, int64_t, T*);

template <typename T>
using WaterFillGramFn = void (*)(const T*, const double*, const double*, const int64_t*, int64_t, int64_t,
                                 const double*, double*, int64_t, const int64_t*, const int64_t*, int, double*,
                                 Faults&);

template <typename T>
using WaterFillScreenedFn = bool (*)(const T*, int64_t, int64_t, const float*, int64_t, const float*, const float*,
                                     const float*, double, double, double, double, const double*, int64_t, int64_t,
                                     bool, int64_t, double*, double*, int64_t*, Faults&);

struct KernelTable {
  const char* level;  // "baseline", "avx2", "avx512" or "native"
  Typed<LocalStepsFn> local_steps;
  Typed<GradientsFn> gradients;
  Typed<EvaluateFn> evaluate;
  Typed<KmeansAssignFn> kmeans_assign;
  Typed<KmeansUpdateFn> kmeans_update;
  Typed<KmeansLloydFn> kmeans_lloyd;
  Typed<AndersonPushFn> anderson_push;
  Typed<AndersonMixFn> anderson_mix;
  Typed<GramFn> gram;
  Typed<AverageFn> average;
  Typed<ClipAndSumFn> clip_and_sum;
  Typed<CnnGemmFn> cnn_shifted_gemm;
  Typed<CnnInputGradFn> cnn_input_grad;
  Typed<CnnCorrFn> cnn_shifted_corr;
  Typed<CnnPoolFn> cnn_pool_relu;
  Typed<CnnConvPoolFn> cnn_conv_pool_relu;
  Typed<CnnPoolBackFn> cnn_pool_relu_backward;
  Typed<CnnPooledBackwardFn> cnn_pooled_backward;
  Typed<CnnDenseGradFn> cnn_dense_grad;
  Typed<CnnDenseLogitsFn> cnn_dense_logits;
  Typed<SymProductsFn> sym_products;
  Typed<PermScreenStatsFn> perm_screen_stats;
  void (*dp_normals)(uint64_t, uint64_t, int64_t, double*);
  void (*anderson_solve)(const double*, int64_t, double, double*);
  void (*water_fill)(const double*, int64_t, int64_t, const double*, const double*, double*, Faults&);
  Typed<WaterFillGramFn> water_fill_gram;
  Typed<WaterFillScreenedFn> water_fill_screened;
  void (*sample_batches)(const int64_t*, int64_t, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                         uint32_t, uint32_t, int32_t*, Faults&);
  bool (*mlp_local_steps_supported)(int64_t, int64_t);
  void (*mlp_local_steps)(float*, int64_t, int64_t, int64_t, int64_t, float, const float*, const int64_t*,
                          const int32_t*, int64_t, int64_t, const float*, bool, const float*, float, float);
};

// The table of the level in use. A caller that makes several calls that must agree (a
// "supported?" test, then the call) reads it once: another thread may switch the level between.
const KernelTable& active();
// The levels this binary holds, lowest first.
std::vector<std::string> levels_built();
// The built levels this CPU can run, lowest first.
std::vector<std::string> levels_supported();
// The level in use: the best supported one, or PFLCORE_CPU_CAPABILITY's at load.
std::string level_in_use();
// Switches the level in use; an error message (empty on success) when `name` is not built or
// not supported here. Calls already running finish on the table they started with.
std::string set_level(const std::string& name);
// Why PFLCORE_CPU_CAPABILITY could not be followed (empty when it was, or is unset).
std::string level_error();

}  // namespace pflcore::cpu
