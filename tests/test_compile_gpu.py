"""The CI compile check of the GPU code (.ci/compile_gpu.py, issue 25 item 5): its ptxas parser
and baseline comparison on captured output (fast, no nvcc), and the whole CUDA part where nvcc
is installed."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compile_gpu", ROOT / ".ci" / "compile_gpu.py")
cg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cg)

# ptxas -v,-warn-spills output of nvcc 13.0 on csrc/cuda/glm.cu (two kernels, shortened), with a
# non-entry function's properties between them and the spill warning ptxas prints first
CAPTURED = """\
ptxas warning : Registers are spilled to local memory in function '_ZN7pflcore4cuda10glm_kernelILi2EdEEvv', 40 bytes spill stores, 56 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7pflcore4cuda10glm_kernelILi2EdEEvv' for 'sm_90'
ptxas info    : Function properties for _ZN7pflcore4cuda10glm_kernelILi2EdEEvv
    40 bytes stack frame, 40 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 40 bytes cumulative stack size
ptxas info    : Compile time = 1014.796 ms
ptxas info    : Function properties for _ZN7pflcore4cuda6helperEv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_ZN7pflcore4cuda10glm_kernelILi0EfEEvv' for 'sm_90'
ptxas info    : Function properties for _ZN7pflcore4cuda10glm_kernelILi0EfEEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 61 registers, used 1 barriers, 384 bytes smem, 400 bytes cmem[0]
"""


def test_parser_reads_registers_and_spills_of_each_kernel():
    got = cg.parse_ptxas(CAPTURED)
    assert got == {
        "_ZN7pflcore4cuda10glm_kernelILi2EdEEvv": {"registers": 80, "spill_stores": 40, "spill_loads": 56},
        "_ZN7pflcore4cuda10glm_kernelILi0EfEEvv": {"registers": 61, "spill_stores": 0, "spill_loads": 0},
    }  # the helper (not an entry) is left out


def test_names_lose_namespaces_and_parameters():
    assert cg._without_parameters("glm_kernel<(Family)2, double, 1>(GlmArgs<double>)") == \
        "glm_kernel<(Family)2, double, 1>"
    assert cg._without_parameters("f(int (*)(int))") == "f"
    assert cg._without_parameters("plain") == "plain"


def test_more_spills_or_an_unknown_kernel_fail():
    base = {"sm_90": {"k": {"registers": 80, "spill_stores": 40, "spill_loads": 56}}}
    same = {"sm_90": {"k": {"registers": 96, "spill_stores": 40, "spill_loads": 56}}}
    assert cg.compare(same, base) == []  # registers are reported, not gated
    fewer = {"sm_90": {"k": {"registers": 80, "spill_stores": 0, "spill_loads": 8}}}
    assert cg.compare(fewer, base) == []
    more = {"sm_90": {"k": {"registers": 80, "spill_stores": 40, "spill_loads": 60}}}
    assert cg.compare(more, base) == ["sm_90 k: 60 bytes of spill loads, baseline 56"]
    new = {"sm_80": {"k": {"registers": 80, "spill_stores": 0, "spill_loads": 0}}}
    (msg,) = cg.compare(new, base)
    assert msg.startswith("sm_80 k: not in gpu_spills.json") and "--update" in msg


def test_table_lists_every_kernel():
    rows = cg.table({"sm_80": {"a": {"registers": 32, "spill_stores": 0, "spill_loads": 0}},
                     "sm_90": {"b": {"registers": 64, "spill_stores": 4, "spill_loads": 8}}}).splitlines()
    assert len(rows) == 3 and rows[1].split() == ["sm_80", "a", "32", "0", "0"]
    assert rows[2].split() == ["sm_90", "b", "64", "4", "8"]


def test_the_baseline_covers_every_cuda_source():
    base = json.loads((ROOT / ".ci" / "gpu_spills.json").read_text())
    assert set(base) == set(cg.ARCHS)
    for arch in cg.ARCHS:
        files = {name.split(":")[0] for name in base[arch]}
        assert files == {p.stem for p in (ROOT / "csrc" / "cuda").glob("*.cu")}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the CUDA compile check needs it")
@pytest.mark.skipif(os.environ.get("PFLCORE_CI_COMPILES_GPU") == "1",
                    reason=".ci/run runs .ci/compile_gpu.py itself right after the suite (~1 minute of nvcc, once)")
def test_cuda_sources_compile_within_their_spill_baseline():
    res = subprocess.run([sys.executable, str(ROOT / ".ci" / "compile_gpu.py"), "--cuda-only"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "glm_kernel<" in res.stdout and "kmeans_assign_kernel<" in res.stdout
