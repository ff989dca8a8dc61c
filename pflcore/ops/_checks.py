"""Argument conversion and validation shared by the ops (DESIGN.md §4, §7).

Every failure is a ValueError that names the argument and gives the expected and the
actual shape, dtype or device.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

FLOAT_DTYPES = (torch.float32, torch.float64)


def as_tensor(value, name: str) -> Tuple[torch.Tensor, bool]:
    """(tensor, came_from_numpy). numpy arrays are wrapped without a copy."""
    if isinstance(value, torch.Tensor):
        if value.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: tensors on device {value.device.type!r} are not served by any "
                             f"backend (pflcore runs on 'cpu' and 'cuda' tensors)")
        return value, False
    if isinstance(value, np.ndarray):
        with warnings.catch_warnings():  # read-only arrays: we never write to them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(value), True
    raise ValueError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def out_like(t: torch.Tensor, numpy: bool):
    """Return ``t`` as the kind of container the caller passed in."""
    return t.numpy() if numpy else t


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_float(t: torch.Tensor, name: str, dtype: Optional[torch.dtype] = None) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 or float64, got {str(t.dtype).replace('torch.', '')}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {str(dtype).replace('torch.', '')} (the dtype of the data), "
                         f"got {str(t.dtype).replace('torch.', '')}")


def check_dtype(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {str(dtype).replace('torch.', '')}, "
                         f"got {str(t.dtype).replace('torch.', '')}")


def check_shape(t: torch.Tensor, name: str, shape: Sequence[Optional[int]], what: str = "") -> None:
    """``shape`` may hold None for 'any size'; ``what`` names the dimensions, e.g. '[m, d]'."""
    ok = t.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, t.shape))
    if not ok:
        filled = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        # A symbolic description gets the sizes appended; one that has numbers is used as is.
        want = filled if not what else what if any(ch.isdigit() for ch in what) else f"{what} = {filled}"
        raise ValueError(f"{name}: expected shape {want}, got {shape_str(t)}")


class NonFiniteError(ValueError):
    """An argument holds NaN or infinite values (inside a training run: a divergence)."""


def check_finite(t: torch.Tensor, name: str) -> None:
    # min and max propagate NaN and expose ±inf, in one pass without a [numel] bool temporary
    # (torch.isfinite(t).all() is ~17x slower on large tensors); counting runs only on failure.
    if not t.numel():
        return
    lo, hi = torch.aminmax(t)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(f"{name}: contains {bad} NaN or infinite value(s)")


def check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where the data is), got {t.device}")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (it is updated in place); "
                         f"call .contiguous() first")


def check_positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def check_real(value, name: str, *, minimum: Optional[float] = None, strict: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a real number, got {value!r}") from None
    if not np.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise ValueError(f"{name}: expected a number {'>' if strict else '>='} {minimum}, got {value!r}")
    return v


def index_tensor(value, name: str, length: Optional[int], upper: int, device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of indices in [0, upper) on ``device``."""
    t, _ = as_tensor(value, name) if not isinstance(value, (list, tuple, range)) else (
        torch.as_tensor(list(value), dtype=torch.int64), False)
    check_dtype(t, name, torch.int64)
    check_shape(t, name, (length,), f"[{length}]" if length is not None else "[R]")
    check_device(t, name, device)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= upper:
            raise ValueError(f"{name}: expected indices in [0, {upper}), got values in [{lo}, {hi}]")
    return t.contiguous()


def cpu_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    return t.detach().numpy()
