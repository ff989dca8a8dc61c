// Definitions shared by the CPU (g++) and CUDA (nvcc) translation units.
#pragma once
#include <cmath>
#include <cstdint>

#include "pflcore/cpu_level.h"

#if defined(__CUDACC__)
#define PFL_HD __host__ __device__ __forceinline__
#else
#define PFL_HD inline
#endif

namespace pflcore {

// Model families of the native kernels (DESIGN.md §3). The integer values are
// part of the Python <-> C++ contract (pflcore/models/glm.py: FAMILY_CODE).
enum class Family : int { LeastSquares = 0, Logistic = 1, Softmax = 2 };

PFLCORE_LEVEL_BEGIN

// exp/log overloads that resolve to the single- or double-precision math
// function on both host and device.
PFL_HD float pfl_exp(float v) { return expf(v); }
PFL_HD double pfl_exp(double v) { return exp(v); }
PFL_HD float pfl_log(float v) { return logf(v); }
PFL_HD double pfl_log(double v) { return log(v); }
PFL_HD float pfl_log1p(float v) { return log1pf(v); }
PFL_HD double pfl_log1p(double v) { return log1p(v); }

PFLCORE_LEVEL_END

}  // namespace pflcore
