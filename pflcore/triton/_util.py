"""Launch helpers shared by the Triton kernel wrappers."""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether kernels decorated now run under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # Triton < 3.4 reads the environment directly
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Elements of the largest block product a kernel forms. On a GPU the product lives in
# registers (4096 = 32 per thread with 4 warps); the interpreter runs each block operation
# as one numpy call, so fewer, larger blocks are what makes it fast.
BLOCK_BUDGET = (1 << 16) if interpreting() else 4096


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block sizes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch_device(t: torch.Tensor):
    """Context in which a launch goes to ``t``'s device (Triton launches on the current CUDA
    device and its current stream); nothing to do for CPU tensors under the interpreter."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


@triton.jit
def row_offset(row, width):
    """``row · width`` as int64: the element offset of row ``row`` of a row-major [*, width]
    array. Triton passes integer arguments below 2**31 as int32 and multiplies them in int32,
    so ``slot * D`` wraps around once the history holds 2**31 entries; every row offset of a
    kernel argument goes through here."""
    return tl.cast(row, tl.int64) * width
