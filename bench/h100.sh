#!/usr/bin/env bash
# The checks of the GPU issue on a lent H100 (one command; see the device tool's README): build
# the CUDA module there, tests/gpu, compute-sanitizer (memcheck, racecheck, synccheck) on the
# CUDA op tests, bench/gpu.py, bench/gpu_federation.py, Nsight Compute on the hottest kernel.
# Logs and results go to $OUT (8 files at most come back). Each stage has its own time limit so
# that one hang leaves the others' results. Run from the repository root:
#   PFLCORE_GIT_COMMIT=$(git rev-parse HEAD) bash bench/h100.sh
# Stages: build (~1 minute), san + tests (side by side, ~2.5), over (~0.1), bench (~0.5), fed (~0.3),
# prof (~0.3), ncu (~0.5): about 5.5 minutes on 2026-11-27; STAGES picks some of them.
set -u
OUT=${OUT:-/tmp/h100-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
STAGES=${STAGES:-"build tests san bench over fed prof ncu"}
has() { [[ " $STAGES " == *" $1 "* ]]; }

{
  stamp "machine"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -2; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc
  if has build; then
    stamp "build (sm_90)"
    if ! PFLCORE_CUDA=ON PFLCORE_CUDA_ARCHITECTURES=90 CMAKE_BUILD_PARALLEL_LEVEL=16 \
         $PY -m pip install --no-build-isolation --no-deps --no-index -q . 2>&1 | tail -30; then
      echo "BUILD FAILED"
    fi
    if ! $PY -P -c "import pflcore._core_cuda" 2>/dev/null && ls .whl/pflcore-*.whl >/dev/null 2>&1; then
      stamp "the build did not give a CUDA module: installing the wheel built elsewhere (.whl)"
      $PY -m pip install --no-deps --no-index -q --force-reinstall .whl/pflcore-*.whl 2>&1 | tail -5
    fi
  fi
  stamp "pflcore info"; (cd /tmp && $PY -P -m pflcore info 2>&1 | head -60)
} > "$OUT/info.log" 2>&1
cat "$OUT/info.log" | tail -25

# Each xdist worker's torch and OpenMP use 2 threads: 8 test workers and 3 x 4 sanitizer workers with
# 16 threads each oversubscribed the 16 cores ~20 times, and the tests whose CPU reference is
# heavy ran past every limit. A test that still runs past PER_TEST seconds fails with its stack
# (pytest-timeout's thread method: it dumps every thread's stack and ends the worker, which xdist
# replaces; the signal method cannot interrupt a call blocked in C, e.g. a kernel that never
# ends) instead of holding the stage.
# Only the tests' and sanitizers' processes get 2 threads (the benchmarks after them run with the
# machine's threads: the CPU column of bench/gpu_federation.py is the 16 cores').
TEST_THREADS=${TEST_THREADS:-2}
PER_TEST=${PER_TEST:-150}
# tests/gpu (xdist workers) and the three sanitizers, each on its own pytest-xdist workers, side by
# side: the GPU runs them all at once (the sanitizers' slowness is per process, on the CPU), so
# the stage takes as long as the slowest of them. TESTS_LIMIT / SAN_LIMIT: each one's seconds.
if has san; then
  # only pflcore's kernels are instrumented (torch's run unchecked): when this sanitizer knows the filter
  FILTER=""; compute-sanitizer --help 2>&1 | grep -q -- "--kernel-name " && FILTER="--kernel-name kns=pflcore"
  echo "sanitizer filter: ${FILTER:-none}"
  # every CUDA op on the odd shapes of test_ops_gpu, both GLM kernels, the value screen, and the
  # paths only larger shapes take
  SAN_K=${SAN_K:-"(test_ops_gpu and cuda and not triton) or test_cuda_screen or (test_cuda_scale and (both_glm_kernels or odd_shapes or global_scratch or unpadded or larger_than_shared or grid_dimension))"}
  for tool in memcheck racecheck synccheck; do
    (
      extra=""; [ $tool = memcheck ] && extra="--leak-check no"
      # memcheck: every tensor its own cudaMalloc, so that a read past a scratch buffer is caught
      [ $tool = memcheck ] && export PYTORCH_NO_CUDA_MEMORY_CACHING=1
      export OMP_NUM_THREADS=$TEST_THREADS
      # the workers are child processes: compute-sanitizer follows them (--target-processes all)
      timeout ${SAN_LIMIT:-300} compute-sanitizer --tool $tool $extra $FILTER --target-processes all --print-limit 20 \
        $PY -P -m pytest $(ls tests/gpu/test_ops_gpu.py tests/gpu/test_cuda_scale.py tests/gpu/test_cuda_screen.py 2>/dev/null) \
        -v -rf -p no:cacheprovider -n ${SAN_WORKERS:-3} --timeout $((PER_TEST * 4)) --timeout-method thread -k "$SAN_K" > /tmp/san_$tool.log 2>&1
      echo "compute-sanitizer $tool rc=$?" >> /tmp/san_$tool.log
    ) &
  done
fi
if has tests; then
  stamp "tests/gpu"
  OMP_NUM_THREADS=$TEST_THREADS timeout ${TESTS_LIMIT:-300} $PY -P -m pytest tests/gpu -v -rfs -p no:cacheprovider -n ${TEST_WORKERS:-6} --durations=25 \
    --timeout $PER_TEST --timeout-method thread \
    --junitxml=/tmp/tests.xml > "$OUT/tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/tests.log"
  echo "tests/gpu: $(grep -c " PASSED" "$OUT/tests.log") passed, $(grep -c " SKIPPED" "$OUT/tests.log") skipped, $(grep -c " FAILED" "$OUT/tests.log") failed"
  grep -v "Benchmark\|warner\| PASSED" "$OUT/tests.log" | tail -40
fi
if has san; then
  stamp "waiting for the sanitizers"
  wait
  for tool in memcheck racecheck synccheck; do
    echo "===== $tool: the sanitizer's own lines (first 200)"; grep "^=========" /tmp/san_$tool.log | head -200
    echo "===== $tool: tests passed: $(grep -c " PASSED" /tmp/san_$tool.log); failed or errors (first 40):"
    grep " FAILED\|^FAILED\| ERROR" /tmp/san_$tool.log | head -40
    echo "===== $tool (last 20 lines)"; tail -20 /tmp/san_$tool.log
  done > /tmp/sanitize.log
  # appended to tests.log: 8 files at most come back from a call
  { echo; echo "######## compute-sanitizer"; cat /tmp/sanitize.log; } >> "$OUT/tests.log"
  for tool in memcheck racecheck synccheck; do
    echo "$tool: $(grep -c " PASSED" /tmp/san_$tool.log) passed, $(grep -c " FAILED" /tmp/san_$tool.log) failed;" \
      "$(grep -h "ERROR SUMMARY" /tmp/san_$tool.log | sort | uniq -c | tr '\n' ' ') $(grep -h "rc=" /tmp/san_$tool.log)"
  done
fi
# `timeout` ends compute-sanitizer and pytest, not their xdist workers: on 2026-11-27 orphaned
# sanitizer workers ran on through the benchmarks (load average 104 during bench/gpu.py). End
# every pytest process before anything is timed.
if has san || has tests; then
  pkill -9 -f "pytest" 2>/dev/null; pkill -9 -f "compute-sanitizer" 2>/dev/null; sleep 2
  echo "load average before the benchmarks: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

if has bench; then
  stamp "bench/gpu.py"
  timeout ${BENCH_LIMIT:-110} $PY -P bench/gpu.py ${BENCH_ARGS:-} --out "$OUT/gpu-h100.json" > "$OUT/bench.log" 2>&1; echo "gpu.py rc=$?" >> "$OUT/bench.log"
  tail -40 "$OUT/bench.log"
fi
if has over; then
  stamp "bench/gpu_overheads.py"
  timeout 60 $PY -P bench/gpu_overheads.py --out "$OUT/gpu_overheads.json" > /tmp/over.log 2>&1; echo "gpu_overheads.py rc=$?" >> /tmp/over.log
  cat /tmp/over.log >> "$OUT/bench.log"; tail -14 /tmp/over.log
fi
if has fed; then
  stamp "bench/gpu_federation.py"
  # its log goes after bench/gpu.py's (8 files at most come back from a call)
  timeout 50 $PY -P bench/gpu_federation.py --memory-clients 20000 --out "$OUT/gpu_federation.json" \
    > /tmp/federation.log 2>&1; echo "gpu_federation.py rc=$?" >> /tmp/federation.log
  cat /tmp/federation.log >> "$OUT/bench.log"; tail -16 /tmp/federation.log
fi
if has prof; then
  stamp "bench/gpu_round_profile.py"
  timeout ${PROF_LIMIT:-60} $PY -P bench/gpu_round_profile.py --out "$OUT/gpu_round_profile.json" > /tmp/prof.log 2>&1
  echo "gpu_round_profile.py rc=$?" >> /tmp/prof.log
  cat /tmp/prof.log >> "$OUT/bench.log"; tail -30 /tmp/prof.log
fi
if has ncu; then
  stamp "ncu"
  # the GLM kernels only (glm_kernel, glm_warp*: not glm_screen_kernel, which the untrusted calls
  # launch first), the full-batch and the B = 20 call; the stall reasons say what bounds them
  timeout ${NCU_LIMIT:-60} ncu --clock-control none --kernel-name "regex:glm_(warp|kernel)" --launch-skip 1 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --metrics launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum \
    $PY -P bench/gpu_ncu_target.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >> "$OUT/ncu.txt"
  grep -E "glm_|Throughput|Duration|registers|warps_active|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles|Issued Ipc|No Eligible|dram__bytes|ncu rc" "$OUT/ncu.txt" | head -70
  # the same two calls through each opt-in kernel (NCU_VARIANTS), the headline sections only
  for variant in ${NCU_VARIANTS:-warp_fast}; do
    echo "######## PFLCORE_CUDA_GLM=$variant" >> "$OUT/ncu.txt"
    PFLCORE_CUDA_GLM=$variant timeout ${NCU_LIMIT:-60} ncu --clock-control none --kernel-name "regex:glm_(warp|kernel)" \
      --launch-skip 1 --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --metrics launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum \
      $PY -P bench/gpu_ncu_target.py >> "$OUT/ncu.txt" 2>&1
    echo "ncu $variant rc=$?" >> "$OUT/ncu.txt"
  done
  # FedAvg's call in a round (1,000 sampled clients of 10^5, B = 20): where warp_fast lost to the
  # default on 2026-11-27 while it won every benchmark of its own (bench/gpu_ncu_target.py --sampled)
  for variant in default ${NCU_VARIANTS:-warp_fast}; do
    echo "######## sampled clients, PFLCORE_CUDA_GLM=$variant" >> "$OUT/ncu.txt"
    env $([ $variant = default ] || echo PFLCORE_CUDA_GLM=$variant) timeout ${NCU_LIMIT:-60} ncu --clock-control none \
      --kernel-name "regex:glm_(warp|kernel)" --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
      --metrics launch__registers_per_thread,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
      $PY -P bench/gpu_ncu_target.py --sampled >> "$OUT/ncu.txt" 2>&1
    echo "ncu sampled $variant rc=$?" >> "$OUT/ncu.txt"
  done
  sed -n '/######## PFLCORE_CUDA_GLM/,$p' "$OUT/ncu.txt" | grep -E "######|glm_|Throughput|Duration|registers|warps_active|Achieved Occupancy|Stall|hit_rate|rc=" | head -60
fi
stamp "done"
