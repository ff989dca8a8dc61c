"""Argument marshalling for pflcore._core_cuda: raw device pointers, sizes, a dtype name and
the current CUDA stream of the tensors' device (the module links no libtorch)."""
from __future__ import annotations

from typing import Optional

import torch


def ptr(t: Optional[torch.Tensor]) -> int:
    """Device address of a contiguous tensor, 0 for None."""
    return 0 if t is None else t.data_ptr()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def stream(t: torch.Tensor) -> int:
    """Handle of the current stream on ``t``'s device: kernels queue behind torch's work."""
    return torch.cuda.current_stream(t.device).cuda_stream


def glm_args(model, theta: torch.Tensor, data, rows: torch.Tensor) -> tuple:
    """The leading arguments of _core_cuda.local_steps / gradients / evaluate."""
    return (model.code, model.p, model.C, model.fit_intercept, model.l2, ptr(theta), ptr(data.x), ptr(data.y),
            ptr(data.offsets), ptr(rows), theta.shape[0])
