"""``pflcore bench``: runs the microbenchmark suite of a source checkout (``bench/``, a
pytest-benchmark suite), prints its grouped tables and a summary of the ratios, and writes the
JSON and a PNG (bar chart of the ratios per group; the ``plot`` extra).

    pflcore bench                      # every op and size (minutes)
    pflcore bench --quick              # small and 1,000-client sizes, short timings (< 2 minutes)
    pflcore bench --only local_steps   # one op (repeatable), or groups / test ids containing NAME
    pflcore bench -- --benchmark-save=base      # anything after -- goes to pytest

A ratio is an implementation's best time over its group's baseline: pflcore's native backend,
or the torch matmul in the small-call group (the op boundary's yardstick).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

OPS = ("local_steps", "gradients", "evaluate", "sample_batches", "kmeans_assign", "kmeans", "anderson", "average",
       "water_fill", "small_calls", "reference_points", "cnn_step")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run the microbenchmark suite (bench/): tables, JSON and a PNG of the ratios",
                       description="Runs the pytest-benchmark suite in bench/ of a source checkout: grouped tables, "
                                   "a summary of the ratios, the JSON and a PNG.")
    p.add_argument("--quick", action="store_true",
                   help="small and 1,000-client sizes only, short timings (under 2 minutes)")
    p.add_argument("--only", action="append", metavar="NAME",
                   help=f"only op NAME ({', '.join(OPS)}) or the groups / test ids containing NAME (repeatable)")
    p.add_argument("--out", help="JSON path (default bench/results/suite.json; suite_quick.json with --quick, "
                                 "suite_only-NAME.json with --only); the PNG goes next to it")
    p.add_argument("--threads", type=int, metavar="N",
                   help="threads of torch, OpenMP (pflcore's native kernels, faiss) and BLAS (default: theirs)")
    p.add_argument("--suite", help="the suite's folder (default: bench/ of the current directory or of the "
                                   "checkout pflcore is installed from)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: options passed to pytest")
    p.set_defaults(func=run)


def find_suite(explicit: Optional[str] = None) -> str:
    """The folder of the suite: ``explicit``, ./bench, or bench/ beside the installed package (an
    editable install of a checkout). Raises SystemExit with what to do when there is none."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [explicit] if explicit else [os.path.join(os.getcwd(), "bench"), os.path.join(here, "bench")]
    for path in candidates:
        if path and os.path.isfile(os.path.join(path, "conftest.py")) and os.path.isfile(
                os.path.join(path, "_harness.py")):
            return os.path.abspath(path)
    where = explicit or " or ".join(candidates)
    raise SystemExit(f"pflcore bench: no benchmark suite at {where}; it lives in bench/ of a source checkout "
                     "(clone the repository, pip install '.[bench]', and run pflcore bench from its root, or pass "
                     "--suite PATH)")


def default_out(suite: str, quick: bool, only: Optional[List[str]]) -> str:
    name = "suite" + ("_quick" if quick else "")
    if only:
        name += "_only-" + "-".join("".join(c if c.isalnum() or c in "_-" else "_" for c in n) for n in only)
    return os.path.join(suite, "results", name + ".json")


def pytest_command(suite: str, out: str, quick: bool, only: Optional[List[str]], extra: List[str]) -> List[str]:
    cmd = [sys.executable, "-m", "pytest", suite, "--benchmark-only", f"--benchmark-json={out}",
           "--benchmark-columns=min,median,mean,stddev,rounds,iterations", "--benchmark-sort=min", "-q"]
    if quick:
        cmd += ["--bench-quick", "--benchmark-max-time=0.05", "--benchmark-min-rounds=3"]
    for name in only or ():
        cmd += ["--bench-only", name]
    return cmd + extra


def ratios(report: Dict) -> Dict[str, Dict[str, Dict]]:
    """{group: {implementation: {min_s, ratio, gflops_per_s, gbytes_per_s}}} from a
    pytest-benchmark JSON; the ratio is over the group's baseline (None without one)."""
    groups: Dict[str, Dict[str, Dict]] = {}
    for b in report.get("benchmarks", []):
        info, group = b.get("extra_info", {}), b.get("group") or b["name"]
        groups.setdefault(group, {})[info.get("impl", b["name"])] = {
            "min_s": b["stats"]["min"], "baseline": bool(info.get("baseline")),
            "gflops_per_s": info.get("gflops_per_s"), "gbytes_per_s": info.get("gbytes_per_s")}
    for rows in groups.values():
        base = next((r["min_s"] for r in rows.values() if r["baseline"]), None)
        for r in rows.values():
            r["ratio"] = r["min_s"] / base if base else None
    return groups


def print_summary(groups: Dict[str, Dict[str, Dict]]) -> None:
    print("\nratios: best time / the group's baseline (pflcore native; the matmul for small calls)")
    for group, rows in groups.items():
        print(f"\n{group}")
        for impl, r in sorted(rows.items(), key=lambda kv: kv[1]["min_s"]):
            rate = (f"{r['gflops_per_s']:8.2f} GFLOP/s" if r.get("gflops_per_s") else
                    f"{r['gbytes_per_s']:8.2f} GB/s   " if r.get("gbytes_per_s") else " " * 16)
            ratio = f"{r['ratio']:9.2f}x" if r["ratio"] is not None else " " * 10
            print(f"  {impl:<28} {_fmt_time(r['min_s']):>10} {ratio} {rate}")


def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _harness(suite: str):
    spec = importlib.util.spec_from_file_location("_pflcore_bench_harness", os.path.join(suite, "_harness.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def plot(groups: Dict[str, Dict[str, Dict]], suite: str, path: str) -> Optional[str]:
    data = {g: {impl: r["ratio"] for impl, r in sorted(rows.items(), key=lambda kv: kv[1]["min_s"])}
            for g, rows in groups.items() if any(r["ratio"] is not None for r in rows.values())}
    baseline_names = {impl for rows in groups.values() for impl, r in rows.items() if r["baseline"]}
    return _harness(suite).plot_ratio_groups(
        data, path, title="pflcore microbenchmarks: time / the group's baseline (pflcore native; matmul for small calls)",
        xlabel="time ratio (lower is faster; 1 = baseline)", baseline=next(iter(baseline_names), None))


def run(args) -> int:
    try:
        import pytest_benchmark  # noqa: F401
    except ImportError:
        raise SystemExit("pflcore bench: pytest-benchmark is not installed (pip install '.[bench]')") from None
    suite = find_suite(args.suite)
    out = os.path.abspath(args.out or default_out(suite, args.quick, args.only))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    extra = [a for a in (args.pytest_args or []) if a != "--"]
    cmd = pytest_command(suite, out, args.quick, args.only, extra)
    print("running:", " ".join(cmd[1:]), flush=True)
    # The child must import the installed pflcore, not a checkout's source tree (which has no
    # compiled _core after a plain `pip install .`): no working directory on its sys.path.
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if args.threads:  # read by torch, OpenMP and BLAS when they start in the pytest process
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(args.threads)
    code = subprocess.run(cmd, cwd=suite, env=env).returncode
    if code != 0 or not os.path.exists(out):
        print(f"pflcore bench: pytest exited with code {code}" + ("" if os.path.exists(out) else "; no results"))
        return code or 1
    with open(out) as f:
        groups = ratios(json.load(f))
    print_summary(groups)
    png = plot(groups, suite, os.path.splitext(out)[0] + ".png")
    if png:
        why = ""
    elif importlib.util.find_spec("matplotlib") is None:
        why = " (no PNG: pip install '.[plot]' for matplotlib)"
    else:
        why = " (no PNG: no group of this run has its baseline, pflcore native or the matmul)"
    print(f"\nwrote {out}" + (f" and {png}" if png else why))
    return 0
