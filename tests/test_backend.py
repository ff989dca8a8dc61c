"""Backend selection (DESIGN.md §1): use(), PFLCORE_BACKEND, explicit requests that cannot
be served, lazy loading, and the `pflcore info` command."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pflcore import backend, ops


def test_automatic_choice_on_cpu_is_native_and_use_overrides_it():
    assert backend.select("local_steps", torch.device("cpu"))[0] == "native"
    with backend.use("reference"):
        assert backend.select("local_steps", torch.device("cpu"))[0] == "reference"
        with backend.use("native"):
            assert backend.select("kmeans_assign", torch.device("cpu"))[0] == "native"
        assert backend.requested() == "reference"
    assert backend.requested() is None


def test_reference_backend_really_runs_the_reference(monkeypatch):
    calls = []
    import importlib

    km = importlib.import_module("pflcore.ops.kmeans")  # the module, not the function of that name

    real = km.kmeans_assign_ref
    monkeypatch.setattr(km, "kmeans_assign_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    pts = torch.randn(6, 2)
    ops.kmeans_assign(pts, pts[:2])
    assert calls == []
    with backend.use("reference"):
        ops.kmeans_assign(pts, pts[:2])
    assert calls == [1]


def test_requested_backend_that_cannot_serve_raises():
    with pytest.raises(ValueError, match="expected one of native, cuda, triton, reference"):
        with backend.use("fast"):
            pass
    if not backend.status()["triton"][0]:  # usable where installed and (GPU or interpreter)
        with pytest.raises(backend.BackendUnavailable, match="triton"):
            with backend.use("triton"):
                pass
    if not torch.cuda.is_available():
        with pytest.raises(backend.BackendUnavailable, match="cuda"):
            with backend.use("cuda"):
                pass


def test_environment_variable_selects_and_validates(monkeypatch):
    monkeypatch.setenv("PFLCORE_BACKEND", "reference")
    assert backend.select("average", torch.device("cpu"))[0] == "reference"
    monkeypatch.setenv("PFLCORE_BACKEND", "triton")
    if backend.status()["triton"][0] and "average" not in backend.ops_of("triton"):  # the reference runs it
        assert backend.select("average", torch.device("cpu"))[0] == "reference"
        assert torch.equal(ops.average(torch.ones(2, 3), torch.ones(2)), torch.ones(3))
    monkeypatch.setenv("PFLCORE_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="PFLCORE_BACKEND: expected one of"):
        backend.requested()


def test_import_is_lazy_and_info_reports_every_backend():
    code = "import sys, pflcore; print('pflcore._core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    exe = shutil.which("pflcore")
    cmd = [exe, "info"] if exe else [sys.executable, "-m", "pflcore", "info"]
    info = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for name in ("native", "cuda", "triton", "reference"):
        assert f"  {name}" in info
    assert "native     yes" in info


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("PFLCORE_CUDA") == "OFF",
                    reason="the CUDA module is built only where nvcc is found at install time")
def test_cuda_module_was_built_where_nvcc_exists():
    """With nvcc on the machine the install compiles pflcore._core_cuda; without a GPU it
    imports but reports no device."""
    import importlib

    mod = importlib.import_module("pflcore._core_cuda")
    info = mod.build_info()
    assert "kmeans_assign" in info["ops"]
    assert info["architectures"] == "80,90"
    if not torch.cuda.is_available():
        assert mod.device_count() == 0
        ok, why = backend.status()["cuda"]
        assert not ok and why.startswith("built, but"), why
