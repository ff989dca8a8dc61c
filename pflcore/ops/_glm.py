"""Pieces shared by the GLM ops (local_steps, gradients, evaluate): argument validation,
the native argument tuple, and the pure-torch math of the references."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from pflcore.data.client_data import ClientData
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet
from pflcore.ops._checks import (as_tensor, check_device, check_finite, check_float, check_shape,
                                 cpu_numpy, index_tensor)


def validate(model, theta, data, rows) -> Tuple[torch.Tensor, bool, torch.Tensor]:
    """Checks the common arguments; returns (theta tensor, theta came from numpy, rows [R])."""
    if not isinstance(model, (GLM, TorchNet)):  # torch nets share these checks (ops/_nets.py)
        raise ValueError(f"model: expected a GLM from pflcore.models (LeastSquares, Logistic, "
                         f"Softmax) or a torch net (MLP, CNN), got {type(model).__name__}")
    if not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    if data.num_features != model.p:
        raise ValueError(f"data: x has {data.num_features} features but the model expects p = {model.p}")
    if model.is_classifier:
        if data.y.dtype != torch.int64:
            raise ValueError(f"y: {type(model).__name__} needs int64 class labels, got "
                             f"{str(data.y.dtype).replace('torch.', '')}")
        if data.label_max >= model.num_classes:
            raise ValueError(f"y: labels must lie in [0, {model.num_classes}) for {model!r}, "
                             f"got a label {data.label_max}")
    elif not data.y.dtype.is_floating_point:
        raise ValueError(f"y: LeastSquares needs float targets of dtype "
                         f"{str(data.dtype).replace('torch.', '')}, got {str(data.y.dtype).replace('torch.', '')}")
    theta_t, is_np = as_tensor(theta, "theta")
    check_float(theta_t, "theta", data.dtype)
    check_device(theta_t, "theta", data.device)
    m = data.num_clients
    if rows is None:
        check_shape(theta_t, "theta", (m, model.d), "[m, d]")
        rows_t = torch.arange(m, dtype=torch.int64, device=data.device)
    else:
        check_shape(theta_t, "theta", (None, model.d), "[R, d]")
        rows_t = index_tensor(rows, "rows", theta_t.shape[0], m, data.device)
    check_finite(theta_t, "theta")
    return theta_t, is_np, rows_t


def check_batch_rows(batches: torch.Tensor, data: ClientData, rows: torch.Tensor) -> None:
    """Every index in ``batches [R, ...]`` must lie in the rows of client ``rows[r]``."""
    b64 = batches.to(torch.int64)
    shape = (-1,) + (1,) * (b64.dim() - 1)
    lo, hi = data.offsets[rows].view(shape), data.offsets[rows + 1].view(shape)
    bad = (b64 < lo) | (b64 >= hi)
    if bool(bad.any()):
        at = tuple(int(v) for v in torch.nonzero(bad)[0])
        r = at[0]
        raise ValueError(f"batches: index {int(b64[at])} at {list(at)} is outside the rows "
                         f"[{int(data.offsets[rows[r]])}, {int(data.offsets[rows[r] + 1])}) of client {int(rows[r])}")


def native_args(model: GLM, theta: torch.Tensor, data: ClientData, rows: torch.Tensor) -> tuple:
    """The leading arguments of _core.local_steps / gradients / evaluate."""
    return (model.code, model.p, model.C, model.fit_intercept, model.l2, cpu_numpy(theta),
            cpu_numpy(data.x), cpu_numpy(data.y), cpu_numpy(data.offsets), cpu_numpy(rows))


def optional_vector(value, name: str, length: int, dtype, device, *, finite: bool = True) -> Optional[torch.Tensor]:
    if value is None:
        return None
    t, _ = as_tensor(value, name)
    check_float(t, name, dtype)
    check_device(t, name, device)
    check_shape(t, name, (length,), f"[R] = [{length}]")
    if finite:
        check_finite(t, name)
    return t.contiguous()


# ---- reference math (pure torch) --------------------------------------------------------

def logits_ref(model: GLM, W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """z [n, C] of rows X [n, p] under parameters W [P, C]."""
    z = X @ W[: model.p]
    if model.fit_intercept:
        z = z + W[model.p]
    return z


def loss_dz_ref(model: GLM, z: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss [n], d loss / d z [n, C])."""
    if model.family == "least_squares":
        r = z[:, 0] - y
        return 0.5 * r * r, r[:, None]
    if model.family == "logistic":
        # log(1 + e^z) − y z = softplus(s), s = z (y = 0) or −z (y = 1), written out because
        # F.softplus switches to the identity above 20 (an absolute error of 2e-9).
        z0, yf = z[:, 0], y.to(z.dtype)
        s = torch.where(y == 1, -z0, z0)
        return s.clamp_min(0) + torch.log1p(torch.exp(-s.abs())), (torch.sigmoid(z0) - yf)[:, None]
    loss = torch.logsumexp(z, dim=1) - z.gather(1, y[:, None])[:, 0]
    dz = torch.softmax(z, dim=1)
    dz[torch.arange(z.shape[0], device=z.device), y] -= 1
    return loss, dz


def correct_ref(model: GLM, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Number of correctly classified rows (0 for least squares)."""
    if model.family == "least_squares":
        return torch.zeros((), dtype=torch.int64)
    pred = (z[:, 0] > 0).to(torch.int64) if model.family == "logistic" else z.argmax(dim=1)
    return (pred == y).sum()


def grad_sum_ref(model: GLM, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_rows ∇_W loss(row) as [P, C] (not divided by the row count, no l2)."""
    _, dz = loss_dz_ref(model, logits_ref(model, W, X), y)
    G = torch.empty_like(W)
    G[: model.p] = X.T @ dz
    if model.fit_intercept:
        G[model.p] = dz.sum(0)
    return G
