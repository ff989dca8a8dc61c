"""Metadata checks of the ops' arguments (DESIGN.md §8, first tier): O(1) per argument, on
every call, nothing cached. Shapes, dtypes, devices, contiguity, writability of an in-place
output and its overlap with the inputs. The values are the adapters' to check.

Written for speed: a small op call's whole Python side is a few microseconds, so the common
case (torch tensors of the right kind) takes the shortest path and the messages are built only
on failure.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Tuple

import torch

from pflcore._arrays import TORCH, Kind, to_tensor
from pflcore._checks import check_device, check_float, check_shape, dtype_str, shape_str
from pflcore.client_data import ClientData
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet

_F32, _F64, _I64, _I32 = torch.float32, torch.float64, torch.int64, torch.int32

# The algorithm whose init or round is running (``pflcore.run`` sets it), else None. Inside one,
# the plain ops refuse to run: an algorithm calls them through its context (``ctx.local_steps``
# ...), which binds the run's model and data, counts client-steps, and is what is correct when
# the clients are sharded over ranks.
IN_ALGORITHM: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pflcore_in_algorithm", default=None)


@contextlib.contextmanager
def inside(algorithm: str) -> Iterator[None]:
    token = IN_ALGORITHM.set(algorithm)
    try:
        yield
    finally:
        IN_ALGORITHM.reset(token)


def refuse_inside_algorithm(op: str) -> None:
    name = IN_ALGORITHM.get()
    raise RuntimeError(f"ops.{op} called inside {name}: an algorithm calls ctx.{op} (bound to the run's model, data "
                       f"and device, counted as client-steps, and correct when the clients are sharded over ranks)")
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
    dt, xs = x.dtype, x.shape
    if len(xs) != 2 or (dt is not _F32 and dt is not _F64) or not x.is_contiguous():
        check_float(x, "x")
        raise ValueError(f"x: expected a contiguous [N, p] array, got shape {shape_str(x)}")
    N, p = xs
    if p != model.p:
        raise ValueError(f"data: x has {p} features but the model expects p = {model.p}")
    yd = y.dtype
    if yd is not (_I64 if model.is_classifier else dt):
        if model.is_classifier:
            raise ValueError(f"y: {type(model).__name__} needs int64 class labels, got {dtype_str(yd)}")
        raise ValueError(f"y: {type(model).__name__} needs float targets of dtype {dtype_str(dt)}, "
                         f"got {dtype_str(yd)}")
    if y.dim() != 1 or y.numel() != N or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [N] = [{N}] array, got shape {shape_str(y)}")
    m = off.numel() - 1
    if off.dtype is not _I64 or off.dim() != 1 or m < 1 or not off.is_contiguous():
        raise ValueError(f"offsets: expected a contiguous int64 [m + 1] array with m >= 1, "
                         f"got {dtype_str(off.dtype)} {shape_str(off)}")
    if not (x.is_cpu and y.is_cpu and off.is_cpu):
        check_device(y, "y", x.device)
        check_device(off, "offsets", x.device)
    return x, N, m


def same_device(t: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if t.is_cpu and x.is_cpu:
        return
    if t.device != x.device:
        raise ValueError(f"{name}: expected a tensor on {x.device} (where the data is), got {t.device}")


def theta_arg(theta, model, x: torch.Tensor, m: int, rows: Optional[torch.Tensor], *, inplace: bool,
              name: str = "theta", shared: bool = False) -> Tuple[torch.Tensor, Kind]:
    """The parameters [R, d] as a tensor and how to return results: R = m without ``rows``, else
    one row per entry of ``rows``. ``inplace``: the op writes into it, so it must be contiguous
    and writable; an immutable foreign array (JAX) is copied and a new one is returned.
    ``shared``: a [d] vector is one model for every row."""
    if type(theta) is torch.Tensor:
        t, kind = theta, TORCH
        if not (t.is_cpu and x.is_cpu):
            to_tensor(t, name)  # the device check
    else:
        t, kind = to_tensor(theta, name)
    if t.dtype is not x.dtype:
        check_float(t, name, x.dtype)
    if not (t.is_cpu and x.is_cpu):
        same_device(t, x, name)
    ts = t.shape
    R = m if rows is None else rows.numel()
    if shared and len(ts) == 1 and ts[0] == model.d:
        return (t if t.is_contiguous() else t.contiguous()), kind
    if len(ts) != 2 or ts[1] != model.d or ts[0] != R:
        if rows is not None and len(ts) == 2 and ts[1] == model.d:
            raise ValueError(f"rows: expected one client per row of {name}, i.e. shape [{ts[0]}], got [{R}]")
        check_shape(t, name, (R, model.d), ("[m, d]" if rows is None else "[R, d]") + (" or [d]" if shared else ""))
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


def batches_arg(batches, x: torch.Tensor, R: int, steps: Optional[int]) -> Optional[torch.Tensor]:
    """int32 absolute row indices [R, steps, B] (``steps`` given: local_steps) or [R, B]
    (gradients, hvp); at least one per batch."""
    if batches is None:
        return None
    t = batches if type(batches) is torch.Tensor else to_tensor(batches, "batches")[0]
    if t.dtype is not _I32:
        raise ValueError(f"batches: expected dtype int32 (ops.sample_batches), got {dtype_str(t.dtype)}")
    bs = t.shape
    if steps is None:
        if len(bs) != 2 or bs[0] != R:
            check_shape(t, "batches", (R, None), "[R, B]")
    elif len(bs) != 3 or bs[0] != R or bs[1] != steps:
        check_shape(t, "batches", (R, steps, None), "[R, steps, B]")
    if bs[-1] < 1:
        raise ValueError(f"batches: expected at least one row per batch, got shape {shape_str(t)}")
    if not (t.is_cpu and x.is_cpu):
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


def shared_theta_args(model, theta, data, rows, batches):
    """(theta [R, d] or [d], its kind, rows, batches [R, B]) for the ops that read parameters
    without writing them and accept one model [d] for every row (gradients, evaluate)."""
    check_model(model)
    x, N, m = check_data(model, data)
    rows_t = rows_arg(rows, x)
    theta_t, kind = theta_arg(theta, model, x, m, rows_t, inplace=False, shared=True)
    R = (m if rows_t is None else rows_t.numel()) if theta_t.dim() == 1 else theta_t.shape[0]
    return theta_t, kind, rows_t, batches_arg(batches, x, R, None)


def apart_from(out: torch.Tensor, data: ClientData, *inputs):
    """``(data, *inputs)``, where any array that shares memory with the in-place output ``out`` is
    replaced by a copy: the op then reads the values it had when the op was called, whatever
    order the kernel writes in (a view of the row being updated, e.g. ``anchor=theta[0]``, gave
    thread-dependent results). One address comparison per array."""
    lo = out.data_ptr()
    hi = lo + out.nbytes
    x, y, off = data.x, data.y, data.offsets
    a, b, c = x.data_ptr(), y.data_ptr(), off.data_ptr()
    if (a < hi and lo < a + x.nbytes) or (b < hi and lo < b + y.nbytes) or (c < hi and lo < c + off.nbytes):
        copy = object.__new__(ClientData)
        copy.__dict__.update(data.__dict__)
        copy.x, copy.y, copy.offsets = x.clone(), y.clone(), off.clone()
        data = copy
    out_inputs = [data]
    for t in inputs:
        if t is not None:
            a = t.data_ptr()
            if a < hi and lo < a + t.nbytes:
                t = t.clone()
        out_inputs.append(t)
    return out_inputs


def _overlap(t: torch.Tensor, lo: int, hi: int) -> bool:
    a = t.data_ptr()
    return a < hi and lo < a + t.nbytes


__all__ = ["IN_ALGORITHM", "inside", "refuse_inside_algorithm", "TORCH", "apart_from", "batches_arg", "check_data", "check_model", "rows_arg", "same_device",
           "shared_theta_args", "theta_arg", "vector_arg"]
