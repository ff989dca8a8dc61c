"""Metadata checks of the ops' arguments (DESIGN.md §8, first tier): O(1) per argument, on
every call, nothing cached. Shapes, dtypes, devices, contiguity, writability of an in-place
output and its overlap with the inputs. The values are the adapters' to check.

Written for speed: a small op call's whole Python side is a few microseconds, so the common
case (torch tensors of the right kind) takes the shortest path and the messages are built only
on failure.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from pflcore._arrays import TORCH, Kind, to_tensor
from pflcore._checks import byte_range, check_device, check_float, check_shape, dtype_str, overlaps, shape_str
from pflcore.client_data import ClientData
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet

_F32, _F64, _I64, _I32 = torch.float32, torch.float64, torch.int64, torch.int32
_MODELS = (GLM, TorchNet)
_NARROW_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)


def check_model(model) -> None:
    if not isinstance(model, _MODELS):
        raise ValueError(f"model: expected a GLM from pflcore.models (LeastSquares, Logistic, Softmax) or a "
                         f"torch net (MLP, CNN), got {type(model).__name__}")


def check_data(model, data) -> Tuple[torch.Tensor, int, int]:
    """(x, N, m) after checking ``data``'s arrays against the model. They are re-read on every
    call: the caller may have changed them since the ClientData was built."""
    if type(data) is not ClientData and not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    x, y, off = data.x, data.y, data.offsets
    dt = x.dtype
    if (dt is not _F32 and dt is not _F64) or x.dim() != 2 or not x.is_contiguous():
        check_float(x, "x")
        raise ValueError(f"x: expected a contiguous [N, p] array, got shape {shape_str(x)}")
    N, p = x.shape
    if p != model.p:
        raise ValueError(f"data: x has {p} features but the model expects p = {model.p}")
    if model.is_classifier:
        if y.dtype is not _I64:
            raise ValueError(f"y: {type(model).__name__} needs int64 class labels, got {dtype_str(y.dtype)}")
    elif y.dtype is not dt:
        raise ValueError(f"y: {type(model).__name__} needs float targets of dtype {dtype_str(dt)}, "
                         f"got {dtype_str(y.dtype)}")
    if y.dim() != 1 or y.shape[0] != N or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [N] = [{N}] array, got shape {shape_str(y)}")
    if off.dtype is not _I64 or off.dim() != 1 or off.shape[0] < 2 or not off.is_contiguous():
        raise ValueError(f"offsets: expected a contiguous int64 [m + 1] array with m >= 1, "
                         f"got {dtype_str(off.dtype)} {shape_str(off)}")
    if not (x.is_cpu and y.is_cpu and off.is_cpu):
        check_device(y, "y", x.device)
        check_device(off, "offsets", x.device)
    return x, N, off.shape[0] - 1


def same_device(t: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if t.is_cpu and x.is_cpu:
        return
    if t.device != x.device:
        raise ValueError(f"{name}: expected a tensor on {x.device} (where the data is), got {t.device}")


def theta_arg(theta, model, x: torch.Tensor, m: int, rows_given: bool, *, inplace: bool,
              name: str = "theta") -> Tuple[torch.Tensor, Kind]:
    """The parameters [R, d] as a tensor and how to return results. ``inplace``: the op writes
    into it, so it must be contiguous and writable; an immutable foreign array (JAX) is copied
    and a new one is returned."""
    t, kind = to_tensor(theta, name)
    if t.dtype is not x.dtype:
        check_float(t, name, x.dtype)
    same_device(t, x, name)
    d = model.d
    if t.dim() != 2 or t.shape[1] != d or (not rows_given and t.shape[0] != m):
        check_shape(t, name, (None if rows_given else m, d), "[R, d]" if rows_given else "[m, d]")
    if inplace:
        if not kind.writable:
            if kind.name == "numpy":
                raise ValueError(f"{name}: the array is read-only (e.g. np.load(..., mmap_mode='r')), and this op "
                                 f"updates it in place: pass a writable copy (np.array(a))")
            t = t.clone()  # immutable (JAX): work on a copy, return a new array
        elif not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous array (it is updated in place); "
                             f"call .contiguous() (numpy: np.ascontiguousarray) first")
        if t.requires_grad:
            raise ValueError(f"{name}: requires grad, and this op updates it in place outside autograd; "
                             f"pass {name}.detach()")
    elif not t.is_contiguous():
        t = t.contiguous()
    return t, kind


def rows_arg(rows, x: torch.Tensor, name: str = "rows") -> Optional[torch.Tensor]:
    """Client indices int64 [R] (their range is checked where they are read); a narrower
    integer dtype (JAX's default int32) or a Python sequence is converted, a copy of R numbers."""
    if rows is None:
        return None
    if isinstance(rows, (list, tuple, range)):
        t = torch.as_tensor(list(rows), dtype=_I64, device=x.device)
    else:
        t, _ = to_tensor(rows, name)
        if t.dtype in _NARROW_INTS:
            t = t.to(_I64)
    if t.dtype is not _I64 or t.dim() != 1:
        raise ValueError(f"{name}: expected int64 indices of shape [R], got {dtype_str(t.dtype)} {shape_str(t)}")
    same_device(t, x, name)
    return t if t.is_contiguous() else t.contiguous()


def batches_arg(batches, x: torch.Tensor, shape, what: str) -> Optional[torch.Tensor]:
    """int32 absolute row indices of ``shape`` (None = any size); at least one per batch."""
    if batches is None:
        return None
    t, _ = to_tensor(batches, "batches")
    if t.dtype is not _I32:
        raise ValueError(f"batches: expected dtype int32 (ops.sample_batches), got {dtype_str(t.dtype)}")
    if t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape)):
        check_shape(t, "batches", shape, what)
    if t.shape[-1] < 1:
        raise ValueError(f"batches: expected at least one row per batch, got shape {shape_str(t)}")
    same_device(t, x, "batches")
    return t if t.is_contiguous() else t.contiguous()


def vector_arg(value, name: str, like: torch.Tensor, length: int) -> Optional[torch.Tensor]:
    """A float vector [length] of the data's dtype (grad_scale)."""
    if value is None:
        return None
    t, _ = to_tensor(value, name)
    if t.dtype is not like.dtype:
        check_float(t, name, like.dtype)
    if t.dim() != 1 or t.shape[0] != length:
        check_shape(t, name, (length,), f"[R] = [{length}]")
    same_device(t, like, name)
    return t if t.is_contiguous() else t.contiguous()


def apart_from(out: torch.Tensor, *inputs):
    """The inputs, each copied first if it shares memory with the in-place output ``out``: the
    op then reads the values they had when it was called, whatever order it writes in (a view
    of the row being updated, e.g. ``anchor=theta[0]``, gave thread-dependent results)."""
    lo, hi = byte_range(out)
    return tuple(None if t is None else t.clone() if overlaps(t, lo, hi) else t for t in inputs)


def data_apart_from(out: torch.Tensor, data: ClientData) -> ClientData:
    """``data`` itself, or a copy of it when one of its arrays shares memory with ``out``."""
    lo, hi = byte_range(out)
    if not any(overlaps(t, lo, hi) for t in (data.x, data.y, data.offsets)):
        return data
    copy = object.__new__(ClientData)
    copy.__dict__.update(data.__dict__)
    copy.x, copy.y, copy.offsets = data.x.clone(), data.y.clone(), data.offsets.clone()
    return copy


__all__ = ["TORCH", "apart_from", "batches_arg", "check_data", "check_model", "data_apart_from", "rows_arg",
           "same_device", "theta_arg", "vector_arg"]
