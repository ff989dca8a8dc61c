"""``gradients``: full-batch ∇f_i(θ_r) for every model row (DESIGN.md §4), where
f_i(θ) = mean loss over client i's rows + l2/2·‖θ‖²."""
from __future__ import annotations

import torch

from pflcore import backend
from pflcore.ops import _glm
from pflcore.ops._checks import as_tensor, cpu_numpy, out_like


def gradients(model, theta, data, *, rows=None):
    """``[R, d]`` gradients of each row's client objective at ``theta`` [R, d]."""
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows, "gradients")
    theta_t = theta_t.contiguous()
    name, module = backend.select("gradients", theta_t.device)
    if name == "reference":
        out = gradients_ref(model, theta_t, data, rows=rows_t)
    else:
        out = torch.empty_like(theta_t)
        module.gradients(*_glm.native_args(model, theta_t, data, rows_t), cpu_numpy(out))
    return out_like(out, is_np)


def gradients_ref(model, theta, data, *, rows=None):
    """Pure-torch reference of ``gradients`` (a loop over model rows)."""
    theta_t, is_np = as_tensor(theta, "theta")
    R = theta_t.shape[0]
    rows_t = torch.arange(R) if rows is None else as_tensor(rows, "rows")[0]
    out = torch.empty_like(theta_t)
    for r in range(R):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        W = theta_t[r].view(model.P, model.C)
        g = _glm.grad_sum_ref(model, W, data.x[lo:hi], data.y[lo:hi]) / (hi - lo)
        out[r] = (g + model.l2 * W).reshape(-1)
    return out_like(out, is_np)
