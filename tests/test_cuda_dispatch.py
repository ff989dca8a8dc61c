"""The CUDA backend's Python side, checked without a GPU (DESIGN.md §1, §4): the pointer checks
before pflcore._core_cuda reads raw memory, the fallback when a call exceeds what its kernels
take, the reasons the backend reports when it cannot load or launch, and `pflcore info`.
A stand-in module replaces pflcore._core_cuda where a test needs the backend to be usable;
tests/gpu/ runs the real kernels."""
from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest
import torch

from pflcore import backend, models
from pflcore.backends import cuda as _cuda
from pflcore.errors import BackendUnavailable, CudaKernelError

CUDA = torch.device("cuda", 0)


# ---- pointers ---------------------------------------------------------------------------------

def test_ptr_names_the_argument_for_a_wrong_dtype_layout_or_device():
    assert _cuda.ptr(None, "anchor", CUDA, torch.float32) == 0
    with pytest.raises(ValueError, match=r"^batches: expected dtype int32 for the CUDA kernel, got int64"):
        _cuda.ptr(torch.zeros(2, 3, dtype=torch.int64), "batches", CUDA, torch.int32)
    with pytest.raises(ValueError, match=r"^theta: expected a contiguous tensor .* strides \(1, 2\) for shape \[2, 3\]"):
        _cuda.ptr(torch.zeros(3, 2).T, "theta", CUDA, torch.float32)
    with pytest.raises(ValueError, match=r"^x: expected a tensor on cuda:0 \(the device of the CUDA call\), got cpu"):
        _cuda.ptr(torch.zeros(4), "x", CUDA, torch.float32)
    with pytest.raises(ValueError, match=r"^x: the CUDA kernels take CUDA tensors, got one on cpu"):
        _cuda.ptr(torch.zeros(4), "x", torch.device("cpu"))  # never a CPU address


@pytest.mark.parametrize("family,C", [("softmax", 4), ("least_squares", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_glm_args_check_every_pointer(monkeypatch, family, C, dtype):
    """Every array the GLM kernels read goes through ptr with the dtype the kernel assumes:
    parameters and features in the data's dtype, labels int64 (targets: the data's dtype),
    offsets and rows int64."""
    from conftest import make_data, make_model

    model = make_model(family, 3, C)
    data = make_data(model, [2, 3], dtype)
    theta = torch.zeros(2, model.d, dtype=dtype)
    seen = {}

    def spy(t, name, device, dt=None):
        seen[name] = (t, device, dt)
        return 1
    monkeypatch.setattr(_cuda, "ptr", spy)
    args = _cuda.glm_args(model, theta, data, None)
    label = torch.int64 if family == "softmax" else dtype
    assert {k: v[2] for k, v in seen.items()} == {"theta": dtype, "x": dtype, "y": label, "offsets": torch.int64,
                                                  "rows": torch.int64}
    assert seen["x"][0] is data.x and seen["y"][0] is data.y and all(v[1] == theta.device for v in seen.values())
    assert args[-1] == 2
    monkeypatch.undo()
    with pytest.raises(ValueError, match="^theta: the CUDA kernels take CUDA tensors"):
        _cuda.glm_args(model, theta, data, torch.arange(2))


# ---- a stand-in for a usable pflcore._core_cuda ----------------------------------------------

def _fake_cuda(max_classes=(2048, 1024), runtime=None, archs="80,90"):
    runtime = runtime or {"device_count": 1, "error": "", "driver_version": 13000, "runtime_version": 13000}
    return types.SimpleNamespace(
        build_info=lambda: {"max_classes": max_classes, "architectures": archs, "cuda_runtime_version": 13000},
        runtime_status=lambda: dict(runtime), device_count=lambda: runtime["device_count"])


@pytest.fixture
def fake_cuda(monkeypatch):
    """The cuda adapter with a stand-in module, as if it had loaded on a GPU machine."""
    mod = _fake_cuda()
    monkeypatch.setattr(backend.ADAPTERS["cuda"], "_state", (mod, ""))
    backend._reset_cache()
    yield mod
    backend._reset_cache()


class _Tensor:
    """Enough of a CUDA tensor for select(): its device type and dtype."""

    def __init__(self, dtype):
        self.dtype, self.is_cpu, self.is_cuda = dtype, False, True


@pytest.mark.parametrize("dtype,C,cuda_takes", [(torch.float32, 2048, True), (torch.float32, 2049, False),
                                               (torch.float64, 1024, True), (torch.float64, 1025, False)])
def test_too_many_classes_for_the_cuda_kernels_falls_back(fake_cuda, dtype, C, cuda_takes):
    """The GLM kernels keep one row's logits in a fixed shared-memory scratch: beyond the
    module's max_classes the automatic choice goes on (to triton on a GPU; to the reference
    here, where Triton is only the interpreter) and a request by name says why it cannot."""
    model, t = models.Softmax(2, C), _Tensor(dtype)
    for op in ("local_steps", "gradients", "evaluate"):
        name = backend.select(op, model, t).name
        assert name == ("cuda" if cuda_takes else "reference"), (op, name)
    with backend.use("cuda"):
        if cuda_takes:
            assert backend.select("local_steps", model, t).name == "cuda"
        else:
            with pytest.raises(BackendUnavailable, match=rf"local_steps: backend 'cuda' .* at most C = {C - 1} classes"):
                backend.select("local_steps", model, t)
    assert backend.select("kmeans_assign", None, t).name == "cuda", "other ops are not limited"


def test_the_cuda_adapter_serves_what_its_methods_say(fake_cuda):
    """No list of op names: the adapter's methods are its ops; an op it lacks (hvp, the host's
    small solve) goes to the reference even when cuda is requested."""
    ops_ = backend.ADAPTERS["cuda"].ops()
    assert {"local_steps", "gradients", "evaluate", "kmeans_assign", "kmeans_update", "anderson_push",
            "anderson_mix", "gram", "average", "sample_batches"} == set(ops_)
    t = _Tensor(torch.float32)
    with backend.use("cuda"):
        assert backend.select("average", None, t).name == "cuda"
        assert backend.select("sample_batches", None, t).name == "cuda"
        for op in ("hvp", "anderson_solve"):
            assert backend.select(op, None, t).name == "reference"


# ---- load and launch failures -------------------------------------------------------------------

def _status_with(monkeypatch, importer):
    adapter = backend.ADAPTERS["cuda"]
    monkeypatch.setattr(adapter, "_state", None)
    real = importlib.import_module
    monkeypatch.setattr(_cuda.importlib, "import_module",
                        lambda name, *a: importer(name) if name == "pflcore._core_cuda" else real(name, *a))
    out = backend.status()["cuda"]
    return out


def test_a_module_that_is_missing_or_does_not_load_says_which(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    ok, why = _status_with(monkeypatch, missing)
    assert not ok and why.startswith("not built: the CUDA module is compiled only when nvcc is found")

    def broken(name):
        raise ImportError("libcudart.so.13: cannot open shared object file")
    ok, why = _status_with(monkeypatch, broken)
    assert not ok and why.startswith("built, but pflcore._core_cuda failed to load (ImportError: libcudart.so.13")
    with pytest.raises(BackendUnavailable, match="failed to load"):
        with backend.use("cuda"):
            pass


@pytest.mark.parametrize("runtime,expect", [
    ({"device_count": 0, "error": "cudaErrorNoDevice: no CUDA-capable device is detected", "driver_version": 13000},
     "finds no usable device: cudaErrorNoDevice"),
    ({"device_count": 0, "error": "cudaErrorInsufficientDriver: CUDA driver version is insufficient",
      "driver_version": 12020, "runtime_version": 13000}, "driver 12020 is older than the CUDA runtime 13000"),
    ({"device_count": 0, "error": "cudaErrorInsufficientDriver: x", "driver_version": 0},
     "no NVIDIA driver is installed"),
])
def test_no_usable_device_reports_the_runtime_reason(monkeypatch, runtime, expect):
    ok, why = _status_with(monkeypatch, lambda name: _fake_cuda(runtime=runtime))
    assert not ok and expect in why, why


def test_devices_older_than_the_built_architectures_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    ok, why = _status_with(monkeypatch, lambda name: _fake_cuda())
    assert not ok and "devices have 7.5 (below 8.0)" in why and "CMAKE_CUDA_ARCHITECTURES" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 6))  # runs the sm_80 code
    ok, why = _status_with(monkeypatch, lambda name: _fake_cuda())
    assert ok, why


def test_a_failed_launch_names_the_op_and_the_way_around():
    def launch_fails(*args):
        raise RuntimeError("kmeans_assign: CUDA error cudaErrorNoKernelImageForDevice: no kernel image")
    with pytest.raises(CudaKernelError, match=r"^kmeans_assign: the CUDA backend failed to launch its kernel \(kmeans_assign: "
                                                    r"CUDA error cudaErrorNoKernelImageForDevice.*"
                                                    r"PFLCORE_BACKEND=triton or =reference"):
        _cuda.launch("kmeans_assign", launch_fails, 1, 2)
    calls = []
    _cuda.launch("gram", lambda *a: calls.append(a), 1, 2)
    assert calls == [(1, 2)]


def test_pflcore_cuda_sync_reports_a_failure_while_the_kernel_ran(monkeypatch):
    syncs = []

    def sync_fails():
        syncs.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "synchronize", sync_fails)
    _cuda.launch("local_steps", lambda *a: None)  # off by default: no synchronize
    assert syncs == []
    monkeypatch.setenv("PFLCORE_CUDA_SYNC", "1")
    with pytest.raises(CudaKernelError, match=r"^local_steps: the CUDA kernel failed while it ran "
                                                    r"\(CUDA error: an illegal memory access"):
        _cuda.launch("local_steps", lambda *a: None)
    assert syncs == [1]


def test_info_lists_the_devices():
    out = subprocess.run([sys.executable, "-m", "pflcore", "info"], capture_output=True, text=True, check=True).stdout
    assert "devices:" in out
    lines = out.split("devices:\n", 1)[1].splitlines()
    if torch.cuda.is_available():
        assert lines[0].startswith("  cuda:0 ") and "compute capability" in lines[0]
    else:
        assert lines[0].startswith("  no CUDA device: ")
