"""Ahead-of-time compile of every Triton kernel variant the adapters choose, for GPU targets,
without a GPU: ``python -m pflcore.triton.aot [--targets sm_80,sm_90] [--json out.json]``.

A variant is a kernel with the dtypes of its pointer arguments and its constexprs. The
constexprs come from the same functions the launchers call (``glm.plan``,
``kmeans.assign_blocks``, ``kmeans.update_blocks``, ``anderson.BLOCK_D``), so a new constexpr
or block rule reaches this list by itself. Flags and hyperparameters are runtime arguments;
the block sizes depend on the problem's shape, so the shapes compiled are the project's
(``GLM_MODELS``, ``KMEANS_SHAPES``: the shipped experiments and the GPU benchmark). Each
variant goes through ``triton.compile`` with a ``GPUTarget`` (no device needed); ptxas's
report gives the registers and spills of each. One line per variant; the exit status is 1
when any compile fails.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List, NamedTuple

# The shapes whose variants are compiled: synthetic p = 60 with one output or C = 10 classes
# (one register tile) and MNIST's 784 x 10 (the tiled path) for the GLM kernels; the k-means
# shapes of CGPFL on the synthetic data (K = 4, d = 61 x 10 parameters) and of bench/gpu.py
# (K = 64, d = 7,850).
GLM_MODELS = [("least_squares", 60, 1), ("logistic", 60, 1), ("softmax", 60, 10), ("softmax", 784, 10)]
KMEANS_SHAPES = [(4, 610), (64, 7850)]  # (K, d)
TARGETS = {"sm_80": 80, "sm_90": 90}

# Pointer arguments that are not in the kernel's float dtype (torch allocations are 16-byte
# aligned, as the runtime specializes them).
_INT64_PTRS = {"offsets_ptr", "rows_ptr", "correct_ptr", "count_ptr", "order_ptr", "labels_ptr", "seg_ptr",
               "slots_ptr"}
_FLOAT64_PTRS = {"wsum_ptr", "partial_ptr", "wpartial_ptr", "pi_ptr"}


class Variant(NamedTuple):
    module: str                   # pflcore.triton.<module>
    kernel: str                   # the @triton.jit function's name in it
    dtype: str                    # "fp32" / "fp64": the float pointers
    constexprs: Dict[str, object]
    label_y: str = "i64"          # y_ptr: "i64" labels, or the float dtype (least squares)

    def name(self) -> str:
        const = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs.items())
        return f"{self.module}.{self.kernel} {self.dtype} {const}"


def variants() -> List[Variant]:
    """Every distinct variant the launchers produce on the shapes above, both dtypes."""
    import torch

    from pflcore import models
    from pflcore.triton import anderson, glm, kmeans

    out: List[Variant] = []
    for dtype, tag in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        for family, p, C in GLM_MODELS:
            model = {"least_squares": lambda: models.LeastSquares(p), "logistic": lambda: models.Logistic(p),
                     "softmax": lambda: models.Softmax(p, C)}[family]()
            for mode in (glm._LOCAL_STEPS, glm._GRADIENTS, glm._EVALUATE):
                kernel, const = glm.plan(mode, model, dtype)
                out.append(Variant(kernel.fn.__module__.rsplit(".", 1)[-1], kernel.fn.__name__, tag, const,
                                   tag if family == "least_squares" else "i64"))
        for K, d in KMEANS_SHAPES:
            out.append(Variant("kmeans", "_assign_kernel", tag, kmeans.assign_blocks(K, d)))
            block_t, block_d, _ = kmeans.update_blocks(d)
            for weighted in (False, True):
                out.append(Variant("kmeans", "_partial_kernel", tag,
                                   dict(HAS_WEIGHTS=weighted, BLOCK_T=block_t, BLOCK_D=block_d)))
            out.append(Variant("kmeans", "_combine_kernel", tag, dict(BLOCK_D=block_d)))
        for store in (True, False):
            out.append(Variant("anderson", "_dots_kernel", tag, dict(STORE=store, BLOCK_D=anderson.BLOCK_D)))
        out.append(Variant("anderson", "_mix_kernel", tag, dict(BLOCK_D=anderson.BLOCK_D)))
    unique, seen = [], set()
    for v in out:
        key = (v.module, v.kernel, v.dtype, tuple(sorted(v.constexprs.items())), v.label_y)
        if key not in seen:
            seen.add(key)
            unique.append(v)
    return unique


def signature(fn, v: Variant):
    """(signature, attrs) of ``fn`` for ``triton.compiler.ASTSource``: pointer element types by
    argument name, int64 for the ``*_bits`` hyperparameters, int32 for the other scalars."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in v.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name == "y_ptr":
                sig[name] = "*" + v.label_y
            elif name == "batches_ptr":
                sig[name] = "*i32"
            else:
                sig[name] = "*i64" if name in _INT64_PTRS else "*fp64" if name in _FLOAT64_PTRS else "*" + v.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i64" if name.endswith("_bits") else "i32"
    return sig, attrs


_PTXAS = (re.compile(r"Used (\d+) registers"), re.compile(r"(\d+) bytes spill stores"))


def compile_variant(v: Variant, target: str) -> dict:
    """Compile one variant for ``target`` ("sm_80"); the result's fields: target, variant,
    regs, spills, seconds, error (None when it compiled)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    row = dict(target=target, variant=v.name(), regs=None, spills=None, seconds=0.0, error=None)
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(f"pflcore.triton.{v.module}"), v.kernel)
        sig, attrs = signature(fn, v)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=dict(v.constexprs), attrs=attrs)
        triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed to stdout
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            triton.compile(src, target=GPUTarget("cuda", TARGETS[target], 32))
        regs, spills = (p.search(log.getvalue()) for p in _PTXAS)
        if regs is None or spills is None:
            raise RuntimeError("no ptxas report (a cached kernel? run with an empty TRITON_CACHE_DIR)")
        row.update(regs=int(regs.group(1)), spills=int(spills.group(1)))
    except Exception as exc:  # noqa: BLE001 - every failure is reported, and fails the run
        row["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _job(args):
    return compile_variant(*args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pflcore.triton.aot", description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sm_80,sm_90", help="comma-separated, of: " + ", ".join(TARGETS))
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--only", help="compile only the variants whose name contains this")
    args = ap.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        ap.error(f"--targets: expected some of {sorted(TARGETS)}, got {bad}")
    from pflcore.triton._util import interpreting

    if interpreting():  # the kernels were decorated for the interpreter: compile in a fresh process
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "pflcore.triton.aot", *(argv or sys.argv[1:])], env)
    todo = [v for v in variants() if args.only is None or args.only in v.name()]
    jobs = [(v, t) for t in targets for v in todo]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pflcore-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # empty: every variant runs ptxas and reports
        if args.jobs > 1 and len(jobs) > 1:
            import multiprocessing

            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                rows = list(pool.map(_job, jobs))
        else:
            rows = [compile_variant(v, t) for v, t in jobs]
    failed = 0
    for r in rows:
        if r["error"]:
            failed += 1
            print(f"{r['target']}  FAILED  {r['variant']}  ({r['seconds']:.1f} s): {r['error']}")
        else:
            print(f"{r['target']}  regs {r['regs']:3d}  spills {r['spills']:4d}  {r['variant']}  ({r['seconds']:.1f} s)")
    total = time.perf_counter() - t0
    print(f"{len(rows)} compiles ({len(todo)} variants x {len(targets)} targets), {failed} failed, {total:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, seconds=round(total, 2), failed=failed), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
