"""Helpers of tests/gpu/: the GPU backends (cuda, triton) and whole runs on a CUDA device
against the CPU (DESIGN.md §1, §4). Every test module there starts with ``pytestmark = SKIP``:
skipped on a machine where torch sees no CUDA device. (Not a conftest.py: the test modules
import tests/conftest.py as ``conftest``.)"""
from __future__ import annotations

import os

import pytest
import torch

from pflcore import backend

# PFLCORE_GPU_TESTS_ON_CPU=1 on a machine without a GPU runs these tests on CPU tensors (the
# "GPU" is the CPU, triton runs under the interpreter, cuda is skipped): a check of the tests'
# own logic, not of the GPU kernels.
ON_CPU = os.environ.get("PFLCORE_GPU_TESTS_ON_CPU") == "1" and not torch.cuda.is_available()
HAS_GPU = torch.cuda.is_available() or ON_CPU
GPU = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu") if ON_CPU else None


SKIP = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device: tests/gpu runs the CUDA and Triton kernels on a GPU")


def require(name: str) -> None:
    """Skip when ``name`` was not installed (the CUDA module without nvcc, Triton without its
    extra); fail when it was but does not load on this GPU machine."""
    ok, why = backend.status()[name]
    if ok:
        return
    if ON_CPU:
        pytest.skip(f"backend {name!r} on the CPU check of tests/gpu: {why}")
    if why.startswith("not built") or "is not installed" in why:
        pytest.skip(f"backend {name!r}: {why}")
    pytest.fail(f"backend {name!r} is installed but unusable on this GPU machine: {why}")
