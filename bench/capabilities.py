"""The CPU kernels at each capability level, and the default build against a -march=native one.

One build carries the kernels for several instruction sets and picks the best one the CPU has at
load (DESIGN.md §9). This script times, in one process:

  * each level this CPU runs (baseline / avx2 / avx512), switched with
    ``pflcore._core.set_cpu_capability``, on three workloads:
      - ``local_steps`` B = 20: 1,000 clients (~50 rows each, Softmax 60 x 10), one minibatch step;
      - full batch: the same 1,000 clients, 5 full-batch steps, prox 0.1;
      - the MLP step: ``MLP(60, 100, 10)``, 1,000 clients, 5 SGD steps of B = 20 (the native MLP
        kernel where the level has it, AVX-512; the batched torch path otherwise);
  * with ``--native``: the same workloads on a ``-march=native`` build of this source tree
    (compiled into build/bench-native with CMake, then loaded beside the installed module), against
    the installed module's own choice: the figure "default build / native build" (target <= 1.10).

Each variant is timed round-robin (one run of each per repeat, the best run kept), so that the
machine's load drifts over all of them alike. Times go through ``ops.local_steps`` (with its value
checks), the way users call them.

    python bench/capabilities.py                 # levels only, ~30 s
    python bench/capabilities.py --native        # + the -march=native build (~2 min to compile once)

Writes ``--out`` (default bench/results/capabilities.json).
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import torch

import pflcore._core as core
from pflcore import backend, models, ops
from pflcore.backends import nets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, under PYTHONSAFEPATH too
from _harness import loadavg, time_runs, torch_threads, warn_if_busy, write_json  # noqa: E402
from _suite import batches, clients, models as client_models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the workloads --------------------------------------------------------------------------------

def workloads():
    """name -> (client-steps, a function of a fresh theta, a fresh theta maker)."""
    data, theta0 = clients("1k"), client_models("1k")
    m = theta0.shape[0]
    softmax = models.Softmax(60, 10)
    one = batches("1k")
    mlp = models.MLP(60, 100, 10)
    mlp0 = mlp.initial(m, seed=0)
    five = ops.sample_batches(data, steps=5, batch_size=20, seed=2, counter=0)
    anchor = theta0.mean(0)
    return {
        "local_steps B=20 (1,000 clients, 1 step)": (
            m, lambda th: ops.local_steps(softmax, th, data, steps=1, lr=0.1, batches=one), theta0.clone),
        "local_steps full batch (1,000 clients, 5 steps, prox)": (
            5 * m, lambda th: ops.local_steps(softmax, th, data, steps=5, lr=0.1, prox=0.1, anchor=anchor),
            theta0.clone),
        "MLP step (MLP(60, 100, 10), 1,000 clients, 5 steps of B=20)": (
            5 * m, lambda th: ops.local_steps(mlp, th, data, steps=5, lr=0.05, batches=five), mlp0.clone),
    }


# ---- the variants: a level of the installed module, or another build's module -------------------

@contextmanager
def level(name):
    before = core.cpu_capability()
    core.set_cpu_capability(name)
    try:
        yield
    finally:
        core.set_cpu_capability(before)


@contextmanager
def module(mod):
    """The native and nets adapters call `mod` instead of the installed pflcore._core."""
    adapter = backend.adapter("native")
    adapter.load()
    saved_core, saved_mlp = adapter._core, nets._native_mlp_module
    adapter._core, nets._native_mlp_module = mod, (lambda: mod if hasattr(mod, "mlp_local_steps") else None)
    try:
        yield
    finally:
        adapter._core, nets._native_mlp_module = saved_core, saved_mlp


def build_native(build_dir):
    """This source tree compiled with -march=native (CPU module only); the path of its module."""
    import pybind11
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("--native needs cmake on PATH")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", ROOT, "-B", build_dir, *gen, "-DCMAKE_BUILD_TYPE=Release",
                    "-DPFLCORE_MARCH_NATIVE=ON", "-DPFLCORE_CUDA=OFF", f"-DPython_EXECUTABLE={sys.executable}",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", build_dir, "--target", "_core"], check=True, stdout=subprocess.DEVNULL)
    found = [f for f in os.listdir(build_dir) if f.startswith("_core.") and f.endswith((".so", ".pyd"))]
    return os.path.join(build_dir, found[0])


def load_module(path, package="pflcore_native_build"):
    name = f"{package}._core"  # the init function is found by the last part of the name
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


# ---- main ------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--native", action="store_true", help="also time a -march=native build of this source tree")
    ap.add_argument("--native-module", help="a -march=native build's _core module to use instead of compiling one")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP and torch threads (default: as set)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "capabilities.json"))
    args = ap.parse_args(argv)
    if args.threads:
        core.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    warn_if_busy()

    variants = {lv: (lambda lv=lv: level(lv)) for lv in core.cpu_capabilities_supported()}
    default = core.cpu_capability()
    native_path = args.native_module
    if args.native and not native_path:
        print("[capabilities] compiling the -march=native build (build/bench-native) ...", flush=True)
        native_path = build_native(os.path.join(ROOT, "build", "bench-native"))
    if native_path:
        native = load_module(native_path)
        variants["native build"] = lambda: module(native)

    results = {"levels_built": core.cpu_capabilities_built(), "levels_supported": core.cpu_capabilities_supported(),
               "default_level": default, "threads": core.get_num_threads(), "repeats": args.repeats,
               "native_module": native_path, "workloads": {}}
    with torch_threads(args.threads or torch.get_num_threads()):
        for name, (client_steps, run, fresh) in workloads().items():
            best = {v: float("inf") for v in variants}
            for v, enter in variants.items():  # warm-up: buffers, thread pools
                with enter():
                    run(fresh())
            for _ in range(args.repeats):
                for v, enter in variants.items():
                    with enter():
                        best[v] = min(best[v], time_runs(run, 1, setup=fresh).min)
            entry = {v: {"seconds": t, "us_per_client_step": 1e6 * t / client_steps} for v, t in best.items()}
            if "native build" in best:
                entry["default_over_native"] = best[default] / best["native build"]
            results["workloads"][name] = entry
            cells = "  ".join(f"{v} {1e6 * t / client_steps:.3f}" for v, t in best.items())
            tail = (f"  default ({default}) / native build = {entry['default_over_native']:.3f}"
                    if "native build" in best else "")
            print(f"[capabilities] {name}: µs per client-step: {cells}{tail}", flush=True)
    results["loadavg_1min"] = loadavg()
    print(f"[capabilities] wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
