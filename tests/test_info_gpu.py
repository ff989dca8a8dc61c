"""`pflcore info`'s GPU section (issue 25, item 2): the driver the CUDA module needs, and for
each GPU backend whether CUDA tensors use it, or why not. The CUDA module and the device are
stand-ins, so this runs on any machine."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from pflcore import backend, cli


def _module(min_driver=580, runtime=13000, driver=12020, devices=1):
    info = {"max_classes": (2048, 1024), "architectures": "80,90", "cuda_runtime_version": runtime}
    if min_driver is not None:
        info["min_driver"] = min_driver
    return types.SimpleNamespace(
        build_info=lambda: dict(info),
        runtime_status=lambda: {"device_count": devices, "error": "", "driver_version": driver,
                                "runtime_version": runtime})


@pytest.fixture
def gpu_side(monkeypatch):
    """Installs a stand-in CUDA module; returns a function that sets the adapters' states and
    whether torch sees a device."""
    def set_up(module, cuda_state, triton_state, has_gpu, triton_auto=True):
        monkeypatch.setitem(sys.modules, "pflcore._core_cuda", module)
        monkeypatch.setattr(backend.ADAPTERS["cuda"], "_state", cuda_state)
        monkeypatch.setattr(backend.ADAPTERS["triton"], "_state", triton_state)
        monkeypatch.setattr(type(backend.ADAPTERS["triton"]), "auto", property(lambda self: triton_auto))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
        monkeypatch.delenv("PFLCORE_BACKEND", raising=False)
    return set_up


def test_an_old_driver_is_named_with_the_way_out(gpu_side):
    mod = _module(driver=12020)
    gpu_side(mod, (None, "built, but the CUDA runtime finds no usable device: cudaErrorInsufficientDriver"),
             (object(), "Triton 3.9.0"), has_gpu=True)
    first, cuda, triton = cli._gpu_lines()
    assert first.startswith("CUDA module: built with CUDA 13.0; needs an NVIDIA driver >= 580; "
                            "this machine's driver supports CUDA 12.2; rebuild with a toolkit")
    assert "PFLCORE_CUDA=OFF" in first
    assert cuda == "cuda: not in use: built, but the CUDA runtime finds no usable device: cudaErrorInsufficientDriver"
    assert triton == "triton: in use for CUDA tensors"


def test_the_backend_that_comes_second_says_why_it_is_not_used(gpu_side):
    gpu_side(_module(driver=13000), (object(), ""), (object(), "Triton 3.9.0"), has_gpu=True)
    first, cuda, triton = cli._gpu_lines()
    assert first == ("CUDA module: built with CUDA 13.0; needs an NVIDIA driver >= 580; "
                     "this machine's driver supports CUDA 13.0")
    assert cuda == "cuda: in use for CUDA tensors"
    assert triton.startswith("triton: not in use: cuda comes first (automatic order") and \
        triton.endswith("PFLCORE_BACKEND=triton selects it")


def test_without_a_device_or_a_recorded_minimum(gpu_side):
    gpu_side(_module(min_driver=None, driver=0), (None, "built, but no NVIDIA driver is installed on this machine"),
             (object(), "interpreter"), has_gpu=False, triton_auto=False)
    first, cuda, triton = cli._gpu_lines()
    assert "does not record the minimum driver" in first and first.endswith("no NVIDIA driver here")
    assert cuda == "cuda: not in use: built, but no NVIDIA driver is installed on this machine"
    assert triton.startswith("triton: not in use automatically: under TRITON_INTERPRET=1")


def test_info_prints_the_gpu_section(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    section = out.split("GPU:\n", 1)[1].splitlines()
    assert section[0].startswith("  ") and any(line.startswith("  cuda: ") for line in section)
    assert any(line.startswith("  triton: ") for line in section)


def test_the_built_module_records_the_driver_it_needs():
    core_cuda = pytest.importorskip("pflcore._core_cuda", reason="the CUDA module is not built here")
    info = core_cuda.build_info()
    major = info["cuda_runtime_version"] // 1000
    # CMakeLists.txt's table: the oldest driver branch of each toolkit major
    assert info["min_driver"] == {11: 450, 12: 525, 13: 580}.get(major, 0), info
