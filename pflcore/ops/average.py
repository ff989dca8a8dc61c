"""``average``: the weighted mean of model rows, the projection P_H (DESIGN.md §4, §5):
``Σ_{r ∈ rows} w_r θ_r / Σ_{r ∈ rows} w_r``, accumulated in float64."""
from __future__ import annotations

import torch

from pflcore import backend
from pflcore.ops._checks import (as_tensor, check_device, check_finite, check_float, check_shape,
                                 cpu_numpy, index_tensor, out_like)


def _validate(theta, weights, rows):
    theta_t, is_np = as_tensor(theta, "theta")
    check_float(theta_t, "theta")
    if theta_t.dim() != 2:
        raise ValueError(f"theta: expected shape [m, d], got {list(theta_t.shape)}")
    check_finite(theta_t, "theta")
    m = theta_t.shape[0]
    w, _ = as_tensor(weights, "weights")
    check_float(w, "weights", theta_t.dtype)
    check_device(w, "weights", theta_t.device)
    check_shape(w, "weights", (m,), f"[m] = [{m}]")
    check_finite(w, "weights")
    if bool((w < 0).any()):
        raise ValueError("weights: expected non-negative weights")
    if rows is None:
        rows_t = torch.arange(m, dtype=torch.int64, device=theta_t.device)
    else:
        rows_t = index_tensor(rows, "rows", None, m, theta_t.device)
    if not float(w[rows_t].sum()) > 0:
        raise ValueError("weights: the weights of the averaged rows sum to 0")
    return theta_t.contiguous(), is_np, w.contiguous(), rows_t


def average(theta, weights, rows=None):
    """``[d]`` weighted mean of ``theta [m, d]`` over ``rows`` (default all) with ``weights [m]``."""
    theta_t, is_np, w, rows_t = _validate(theta, weights, rows)
    name, module = backend.select("average", theta_t.device)
    if name == "reference":
        out = average_ref(theta_t, w, rows_t)
    else:
        out = torch.empty(theta_t.shape[1], dtype=theta_t.dtype)
        module.average(cpu_numpy(theta_t), cpu_numpy(w), cpu_numpy(rows_t), cpu_numpy(out))
    return out_like(out, is_np)


def average_ref(theta, weights, rows=None):
    """Pure-torch reference of ``average``."""
    theta_t, is_np = as_tensor(theta, "theta")
    w, _ = as_tensor(weights, "weights")
    if rows is not None:
        rows_t = as_tensor(rows, "rows")[0]
        theta_t, w = theta_t[rows_t], w[rows_t]
    w64 = w.to(torch.float64)
    out = (w64 @ theta_t.to(torch.float64)) / w64.sum()
    return out_like(out.to(theta_t.dtype), is_np)
