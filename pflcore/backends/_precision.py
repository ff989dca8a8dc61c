"""Full float32 for the torch nets on request: ``PFLCORE_NETS_TF32=0``.

By default torch lets cuDNN run float32 convolutions in TF32 on Ampere and Hopper GPUs (10-bit
mantissa inputs): faster, but a CNN's results then differ from float32 math, from a CPU run and
from run to run across GPU generations. With ``PFLCORE_NETS_TF32=0`` every nets call
(local_steps, gradients, evaluate, hvp of an MLP or CNN) runs with TF32 off for convolutions
and matrix products, restoring the caller's settings when it returns; unset (or ``torch``),
torch's own settings apply. The variable is read on every call. The settings are process-wide
torch flags: another thread's GPU work that runs during a nets call sees them too.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator, List, Tuple

import torch

ENV = "PFLCORE_NETS_TF32"


def full_float32_requested() -> bool:
    mode = os.environ.get(ENV, "")
    if mode in ("", "torch"):
        return False
    if mode == "0":
        return True
    raise ValueError(f"{ENV}: expected '0' (full float32 in the nets' convolutions and matrix products) or "
                     f"'torch' / unset (torch's own TF32 settings), got {mode!r}")


def _precision_flags() -> List[Tuple[str, object]]:
    """(name, object with ``fp32_precision``) of each float32 precision setting of this torch
    (2.9+: one per backend and op kind; reading the legacy ``allow_tf32`` after one of them is
    set raises)."""
    found = []
    for backend in ("cuda", "cudnn", "mkldnn"):
        mod = getattr(torch.backends, backend, None)
        for kind in ("matmul", "conv", "rnn"):
            obj = getattr(mod, kind, None)
            if obj is not None and hasattr(obj, "fp32_precision"):
                found.append((f"{backend}.{kind}", obj))
    return found


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for convolutions and matrix products inside the block, the caller's settings
    restored after it."""
    flags = _precision_flags()
    if flags:
        saved = [(obj, "fp32_precision", obj.fp32_precision) for _, obj in flags]
        values = [(obj, name, "ieee") for obj, name, _ in saved]
    else:  # a torch before fp32_precision
        saved = [(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32),
                 (torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)]
        values = [(obj, name, False) for obj, name, _ in saved]
    try:
        for obj, name, value in values:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def nets_math(method: Callable) -> Callable:
    """Runs an adapter method under ``full_float32`` when ``PFLCORE_NETS_TF32=0``."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        if not full_float32_requested():
            return method(*args, **kwargs)
        with full_float32():
            return method(*args, **kwargs)
    return call
