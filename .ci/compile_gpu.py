#!/usr/bin/env python3
"""CI compile checks of the GPU code, on a machine without a GPU (issue 25, item 5).

1. Each ``csrc/cuda/*.cu`` is compiled by nvcc to a cubin for every target architecture (sm_80,
   sm_90) with ptxas's resource report; the registers and spill bytes of every kernel are printed
   and the check fails when a kernel spills more (stores or loads) than ``.ci/gpu_spills.json``
   records for it: a change that makes a kernel spill is seen in review, not on the next GPU
   session. ``--update`` writes the current numbers as the new baseline.
2. ``python -m pflcore.triton.aot --targets sm_80,sm_90`` compiles the Triton kernels ahead of
   time (skipped, saying so, when the checkout has no ``pflcore/triton/aot.py``).

Run from anywhere: ``python .ci/compile_gpu.py [--update] [--jobs N] [--cuda-only]``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "gpu_spills.json"
ARCHS = ("sm_80", "sm_90")

# Kernel name -> {"registers", "spill_stores", "spill_loads"}.
Report = Dict[str, Dict[str, int]]

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> Report:
    """Registers and spill bytes of each entry function (kernel) in ptxas ``-v`` output, by
    mangled name. Non-entry functions (device functions that were not inlined) have properties
    too; their spills show in the entries that call them, so only entries are kept."""
    out: Report = {}
    entry: Optional[str] = None
    props: Optional[str] = None
    for line in text.splitlines():
        if "ptxas warning" in line:  # -warn-spills repeats the spills, before any properties
            continue
        m = _ENTRY.search(line)
        if m:
            entry = m.group(1)
            out[entry] = {"registers": 0, "spill_stores": 0, "spill_loads": 0}
            continue
        m = _PROPS.search(line)
        if m:
            props = m.group(1)
            continue
        m = _SPILL.search(line)
        if m and props is not None and props in out:
            out[props]["spill_stores"], out[props]["spill_loads"] = int(m.group(1)), int(m.group(2))
            continue
        m = _REGS.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
    return out


def readable(names: List[str]) -> Dict[str, str]:
    """Mangled -> demangled names without the namespaces, the keys of the baseline: the mangled
    name of a kernel in an anonymous namespace holds a hash of its file that changes with the
    build, the demangled one does not."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    out = {}
    for mangled, plain in zip(names, res.stdout.splitlines()):
        plain = plain.replace("(anonymous namespace)::", "").replace("pflcore::cuda::", "").replace("pflcore::", "")
        out[mangled] = _without_parameters(plain[5:] if plain.startswith("void ") else plain)
    return out


def _without_parameters(name: str) -> str:
    """``k<float, 2>(Args<float>)`` -> ``k<float, 2>``: the template arguments tell the
    instances apart; the parameter list only repeats them."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def build_flags() -> List[str]:
    """The flags the CMake build gives the CUDA sources (CMakeLists.txt: the _core_cuda target's
    include directories and plain definitions; Release: -O3 -DNDEBUG; C++17)."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    flags = ["-std=c++17", "-O3", "-DNDEBUG"]
    for m in re.finditer(r"target_include_directories\(_core_cuda\s+PRIVATE\s+([^)]*)\)", cmake):
        flags += [f"-I{ROOT / d}" for d in m.group(1).split()]
    for m in re.finditer(r"target_compile_definitions\(_core_cuda\s+PRIVATE\s+([^)]*)\)", cmake):
        # definitions built from CMake variables (${...}) are the bindings', not the kernels'
        flags += [f"-D{d}" for d in m.group(1).split() if "${" not in d and not d.startswith("$<")]
    return flags


def compile_one(nvcc: str, src: Path, arch: str, flags: List[str], out_dir: Path) -> tuple:
    cmd = [nvcc, "-cubin", f"-arch={arch}", *flags, "-Xptxas", "-v,-warn-spills",
           "-o", str(out_dir / f"{src.stem}.{arch}.cubin"), str(src)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src.name} for {arch}:\n{' '.join(cmd)}\n{res.stderr}")
    return src, arch, parse_ptxas(res.stderr + res.stdout), time.perf_counter() - t0


def compare(current: Dict[str, Report], baseline: Dict[str, Report]) -> List[str]:
    """The failures: kernels that spill more than their baseline, kernels it lacks."""
    problems = []
    for arch, kernels in sorted(current.items()):
        base = baseline.get(arch, {})
        for name, now in sorted(kernels.items()):
            was = base.get(name)
            if was is None:
                problems.append(f"{arch} {name}: not in {BASELINE.name}; run `python .ci/compile_gpu.py --update` "
                                f"and commit the file if its spills are acceptable")
                continue
            for what in ("spill_stores", "spill_loads"):
                if now[what] > was.get(what, 0):
                    problems.append(f"{arch} {name}: {now[what]} bytes of {what.replace('_', ' ')}, "
                                    f"baseline {was.get(what, 0)}")
    return problems


def table(current: Dict[str, Report]) -> str:
    rows = [("arch", "kernel", "regs", "spill st", "spill ld")]
    for arch, kernels in sorted(current.items()):
        for name, r in sorted(kernels.items()):
            rows.append((arch, name, str(r["registers"]), str(r["spill_stores"]), str(r["spill_loads"])))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(f"{a:<{w[0]}}  {k:<{w[1]}}  {g:>{w[2]}}  {s:>{w[3]}}  {l:>{w[4]}}" for a, k, g, s, l in rows)


def cuda_check(update: bool, jobs: int) -> int:
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc:
        print("compile_gpu: nvcc not found (PATH or CUDACXX): the CUDA compile check is skipped")
        return 0
    sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"), key=lambda p: -p.stat().st_size)  # longest first
    flags = build_flags()
    t0 = time.perf_counter()
    current: Dict[str, Report] = {a: {} for a in ARCHS}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_one, nvcc, src, arch, flags, Path(tmp)) for src in sources for arch in ARCHS]
        for f in futures:
            src, arch, report, secs = f.result()
            names = readable(list(report))
            for mangled, r in report.items():
                current[arch][f"{src.stem}: {names[mangled]}"] = r
            print(f"compile_gpu: {src.name} for {arch}: {len(report)} kernels, {secs:.1f} s")
    print(table(current))
    print(f"compile_gpu: CUDA sources compiled in {time.perf_counter() - t0:.1f} s ({jobs} at a time)")
    if update:
        BASELINE.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"compile_gpu: wrote {BASELINE.relative_to(ROOT)}")
        return 0
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    problems = compare(current, baseline)
    for p in problems:
        print(f"compile_gpu: FAIL {p}")
    return 1 if problems else 0


def triton_check() -> int:
    if not (ROOT / "pflcore" / "triton" / "aot.py").exists():
        print("compile_gpu: pflcore/triton/aot.py is not in this checkout: the Triton AOT check is skipped")
        return 0
    cmd = [sys.executable, "-m", "pflcore.triton.aot", "--targets", ",".join(ARCHS)]
    print(f"compile_gpu: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc:
        print(f"compile_gpu: FAIL the Triton AOT compile exited with {rc}")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help=f"write the spills found to {BASELINE.name}")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="nvcc runs at a time")
    ap.add_argument("--cuda-only", action="store_true", help="skip the Triton AOT compile")
    args = ap.parse_args(argv)
    rc = cuda_check(args.update, max(1, args.jobs))
    if not args.cuda_only:
        rc = triton_check() or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
