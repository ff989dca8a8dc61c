"""Backend selection (DESIGN.md §1): use(), PFLCORE_BACKEND, explicit requests that cannot
be served, lazy loading, and the `pflcore info` command."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pflcore import backend, models, ops
from pflcore.errors import BackendUnavailable


CPU = torch.zeros(1)
GLM = models.Softmax(3, 2)


def test_automatic_choice_on_cpu_is_native_and_use_overrides_it():
    assert backend.select("local_steps", GLM, CPU).name == "native"
    with backend.use("reference"):
        assert backend.select("local_steps", GLM, CPU).name == "reference"
        with backend.use("native"):
            assert backend.select("kmeans_assign", None, CPU).name == "native"
        assert backend.requested() == "reference"
    assert backend.requested() is None


def test_nets_take_the_nets_adapter_unless_the_reference_is_asked_for():
    net = models.MLP(3, 4, 2)
    assert backend.select("local_steps", net, CPU).name == "nets"
    with backend.use("native"):  # no native kernel for nets: the implementation chosen by type
        assert backend.select("gradients", net, CPU).name == "nets"
    with backend.use("reference"):
        assert backend.select("evaluate", net, CPU).name == "reference"


def test_each_adapter_serves_the_ops_it_defines():
    """The op lists come from the adapters' methods: the reference has every op, the others a
    subset of it; every public op of pflcore.ops that runs on a backend is one of them."""
    ref = backend.ADAPTERS["reference"].ops()
    for name, a in backend.ADAPTERS.items():
        assert a.ops() <= ref, name
    assert {"local_steps", "gradients", "evaluate", "hvp", "sample_batches", "kmeans_assign", "kmeans_update",
            "kmeans_lloyd", "anderson_push", "anderson_mix", "gram", "anderson_solve", "average", "clip_and_sum",
            "dp_normals", "water_fill", "water_fill_gram"} == set(ref)
    assert backend.ADAPTERS["native"].ops() == ref - {"hvp"}
    assert backend.ADAPTERS["nets"].ops() == {"local_steps", "gradients", "evaluate", "hvp"}


def test_reference_backend_really_runs_the_reference(monkeypatch):
    calls = []
    ref = backend.ADAPTERS["reference"]
    real = type(ref).kmeans_assign
    monkeypatch.setattr(type(ref), "kmeans_assign", lambda self, *a: calls.append(1) or real(self, *a))
    pts = torch.randn(6, 2)
    ops.kmeans_assign(pts, pts[:2])
    assert calls == []
    with backend.use("reference"):
        ops.kmeans_assign(pts, pts[:2])
    assert calls == [1]
    assert torch.equal(ops.kmeans_assign_ref(pts, pts[:2])[0], ops.kmeans_assign(pts, pts[:2])[0])
    assert calls == [1, 1]


def test_requested_backend_that_cannot_serve_raises():
    with pytest.raises(ValueError, match="expected one of native, cuda, triton, reference"):
        with backend.use("fast"):
            pass
    if not backend.status()["triton"][0]:  # usable where installed and (GPU or interpreter)
        with pytest.raises(BackendUnavailable, match="triton"):
            with backend.use("triton"):
                pass
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="cuda"):
            with backend.use("cuda"):
                pass


def test_environment_variable_selects_and_validates(monkeypatch):
    monkeypatch.setenv("PFLCORE_BACKEND", "reference")
    assert backend.select("average", None, CPU).name == "reference"
    monkeypatch.setenv("PFLCORE_BACKEND", "triton")
    if backend.status()["triton"][0] and "average" not in backend.ops_of("triton"):  # the reference runs it
        assert backend.select("average", None, CPU).name == "reference"
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
    assert hasattr(mod, "kmeans_assign") and hasattr(mod, "local_steps")
    assert info["architectures"] == "80,90"
    if not torch.cuda.is_available():
        assert mod.device_count() == 0
        ok, why = backend.status()["cuda"]
        assert not ok and why.startswith("built, but"), why


def test_child_processes_import_the_installed_package_not_the_checkout():
    # Many tests run `python -c` / `python -m pflcore` from the repository root; after a plain
    # `pip install .` the checkout's pflcore/ has no compiled _core, so a child that imported it
    # would silently run the reference fallback (conftest.py sets PYTHONSAFEPATH for this).
    import pflcore
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import pflcore; from pflcore import backend; print(pflcore.__file__); print(backend.status()['native'][0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    path, native = out.stdout.split()
    assert os.path.realpath(path) == os.path.realpath(pflcore.__file__)
    assert native == str(backend.status()["native"][0])
