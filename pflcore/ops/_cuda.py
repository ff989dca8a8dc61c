"""Argument marshalling for pflcore._core_cuda: raw device pointers, sizes, a dtype name and
the current CUDA stream of the tensors' device (the module links no libtorch).

The module dereferences whatever address it gets, so every pointer passes ``ptr`` first: a
tensor that is not contiguous, not on the device of the call, or not of the dtype the kernel
reads is a ValueError naming the argument (never a silent wrong read). ``launch`` turns a
failed launch into a ``CudaKernelError`` that says which op failed and how to avoid it.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch


class CudaKernelError(RuntimeError):
    """A kernel of pflcore._core_cuda could not be launched (or a CUDA call around it failed)."""


def _dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def ptr(t: Optional[torch.Tensor], name: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> int:
    """Device address of ``t`` (0 for None) after checking that the kernel may read it as a
    dense array of ``dtype`` on ``device``."""
    if t is None:
        return 0
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {_dtype(dtype)} for the CUDA kernel, got {_dtype(t.dtype)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor for the CUDA kernel (it reads raw memory), "
                         f"got strides {tuple(t.stride())} for shape {list(t.shape)}")
    if device.type != "cuda":
        raise ValueError(f"{name}: the CUDA kernels take CUDA tensors, got one on {t.device}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the CUDA call), got {t.device}")
    return t.data_ptr()


def dtype_name(t: torch.Tensor) -> str:
    return _dtype(t.dtype)


def stream(t: torch.Tensor) -> int:
    """Handle of the current stream on ``t``'s device: kernels queue behind torch's work."""
    return torch.cuda.current_stream(t.device).cuda_stream


_HINT = ("Run `pflcore info` to see the device and the architectures the module was built for; "
         "PFLCORE_BACKEND=triton or =reference runs the op without it")


def launch(op: str, fn: Callable, *args) -> None:
    """``fn(*args)`` (a binding of pflcore._core_cuda) with its failure explained.

    Kernels run asynchronously: an error while one runs (not at its launch) surfaces at the
    next synchronizing call, wherever that is. With PFLCORE_CUDA_SYNC=1 every launch is
    followed by a synchronize, so such an error is reported here, naming the op (slow: for
    debugging)."""
    try:
        fn(*args)
    except RuntimeError as exc:
        raise CudaKernelError(f"{op}: the CUDA backend failed to launch its kernel ({exc}). {_HINT}") from exc
    if os.environ.get("PFLCORE_CUDA_SYNC", "") == "1":
        try:
            torch.cuda.synchronize()
        except RuntimeError as exc:
            raise CudaKernelError(f"{op}: the CUDA kernel failed while it ran ({exc}). {_HINT}") from exc


def max_classes(module, dtype: torch.dtype) -> int:
    """Largest number of classes C the module's GLM kernels take for ``dtype``."""
    f32, f64 = module.build_info()["max_classes"]
    return f64 if dtype == torch.float64 else f32


def glm_limit(model, dtype: torch.dtype) -> Callable[[str, object], Optional[str]]:
    """For ``backend.select(..., limit=...)``: why the cuda backend cannot take this model."""
    def limit(name: str, module) -> Optional[str]:
        if name != "cuda":
            return None
        most = max_classes(module, dtype)
        if model.C > most:
            return (f"its GLM kernels hold one row's {model.C} logits in shared memory and take at most "
                    f"C = {most} classes in {_dtype(dtype)}")
        return None
    return limit


def glm_args(model, theta: torch.Tensor, data, rows: torch.Tensor) -> tuple:
    """The leading arguments of _core_cuda.local_steps / gradients / evaluate."""
    dev, dt = theta.device, theta.dtype
    y_dtype = torch.int64 if model.is_classifier else dt
    return (model.code, model.p, model.C, model.fit_intercept, model.l2, ptr(theta, "theta", dev, dt),
            ptr(data.x, "x", dev, dt), ptr(data.y, "y", dev, y_dtype),
            ptr(data.offsets, "offsets", dev, torch.int64), ptr(rows, "rows", dev, torch.int64), theta.shape[0])
