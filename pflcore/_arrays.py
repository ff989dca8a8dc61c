"""Arrays in and out (DESIGN.md §8): the one place where what a caller passes becomes a torch
tensor and a result goes back as the kind of array that came in.

- torch tensors (CPU, CUDA): used as they are.
- numpy arrays: wrapped without a copy (``torch.from_numpy``); results come back as numpy.
- any object with ``__dlpack__`` (JAX, CuPy, array-API libraries): taken without a copy
  (``torch.from_dlpack``); results come back through the object's array-API namespace
  (``x.__array_namespace__().from_dlpack``), so JAX in gives JAX out.
- objects with only ``__cuda_array_interface__`` (older CUDA libraries): wrapped on the GPU.

Nothing here imports the rest of pflcore.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

_Tensor = torch.Tensor

# Libraries whose arrays must never be written: an op that updates its argument in place gets
# a copy of such an array and returns a new one (JAX arrays are immutable by contract; writing
# through DLPack would change every value that shares the buffer).
_IMMUTABLE_MODULES = ("jax", "jaxlib", "tensorflow", "mlx")


class Kind:
    """How a result goes back to the caller: as a tensor, a numpy array, or through a foreign
    library's ``from_dlpack``. ``writable`` says whether the caller's own array may be updated
    in place."""

    __slots__ = ("name", "back", "writable")

    def __init__(self, name: str, back: Optional[Callable[[_Tensor], Any]], writable: bool):
        self.name, self.back, self.writable = name, back, writable

    def __repr__(self) -> str:
        return f"Kind({self.name}, writable={self.writable})"


TORCH = Kind("torch", None, True)
NUMPY = Kind("numpy", _Tensor.numpy, True)
NUMPY_READONLY = Kind("numpy", _Tensor.numpy, False)


def _type_name(value) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _foreign_kind(value) -> Kind:
    module = type(value).__module__.split(".")[0]
    writable = module not in _IMMUTABLE_MODULES
    namespace = getattr(value, "__array_namespace__", None)
    if namespace is not None:
        back = namespace().from_dlpack
    else:  # no array-API namespace: the library's own from_dlpack, if it has one
        import sys

        back = getattr(sys.modules.get(module), "from_dlpack", None)
    return Kind(module, back, writable)


def to_tensor(value, name: str) -> Tuple[_Tensor, Kind]:
    """(tensor viewing the caller's memory, how to give results back). ValueError naming the
    argument for anything that is not an array on a device pflcore runs on."""
    if type(value) is _Tensor or isinstance(value, _Tensor):
        if not (value.is_cpu or value.is_cuda):
            raise ValueError(f"{name}: tensors on device {value.device.type!r} are not served by any "
                             f"backend (pflcore runs on 'cpu' and 'cuda' tensors)")
        if value.layout is not torch.strided:
            raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {value.layout} "
                             f"(convert it with .to_dense())")
        return value, TORCH
    if isinstance(value, np.ndarray):  # np.memmap too (a subclass)
        writable = value.flags.writeable
        try:
            if writable:
                return torch.from_numpy(value), NUMPY
            with warnings.catch_warnings():  # torch warns about read-only arrays: we never write them
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(value), NUMPY_READONLY
        except (TypeError, ValueError) as exc:  # e.g. dtype object, negative strides
            raise ValueError(f"{name}: cannot use this numpy array ({exc})") from None
    if hasattr(value, "__dlpack__"):
        try:
            t = torch.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"{name}: cannot take this {_type_name(value)} through DLPack ({exc})") from None
        return t, _foreign_kind(value)
    if hasattr(value, "__cuda_array_interface__"):
        try:
            t = torch.as_tensor(value, device="cuda")
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"{name}: cannot take this {_type_name(value)} through "
                             f"__cuda_array_interface__ ({exc})") from None
        return t, _foreign_kind(value)
    raise ValueError(f"{name}: expected an array (torch.Tensor, numpy.ndarray, or an object with __dlpack__ "
                     f"such as a JAX or CuPy array), got {_type_name(value)}")


def from_tensor(t: _Tensor, kind: Kind):
    """``t`` as the kind of array the caller passed (torch when the foreign library cannot take
    it back)."""
    if kind is TORCH:
        return t
    if kind.back is None:
        return t
    if kind.name != "numpy" and not t.is_contiguous():
        t = t.contiguous()
    return kind.back(t)


__all__ = ["Kind", "TORCH", "NUMPY", "NUMPY_READONLY", "to_tensor", "from_tensor"]
