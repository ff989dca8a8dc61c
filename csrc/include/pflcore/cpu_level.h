// CPU capability levels (DESIGN.md §9): the kernel sources are compiled once per level, each
// copy with its own instruction-set flags and PFLCORE_CPU_LEVEL_NS set to its namespace
// (cpu_baseline, cpu_avx2, cpu_avx512; cpu_native for a -march=native build).
//
// Everything a kernel source defines, and every inline function of the headers it includes,
// lives in that inline namespace: the copies get different symbol names, so the linker never
// merges an AVX-512 copy of an inline function with the baseline one (which a baseline caller
// would then run: SIGILL on a CPU without AVX-512). What crosses the levels (Faults, the
// argument structs, the table of function pointers) stays outside.
//
// Outside the kernel sources (the bindings, the dispatcher, the CUDA module) the macros are
// empty: `pflcore::cpu::local_steps` there is the dispatcher's, which calls the level in use.
#pragma once

#if defined(PFLCORE_CPU_LEVEL_NS)
#define PFLCORE_LEVEL_BEGIN inline namespace PFLCORE_CPU_LEVEL_NS {
#define PFLCORE_LEVEL_END }
#else
#define PFLCORE_LEVEL_BEGIN
#define PFLCORE_LEVEL_END
#endif
