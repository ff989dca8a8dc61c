"""``gradients``: ∇f_i(θ_r) for every model row (DESIGN.md §4), where
f_i(θ) = mean loss over client i's rows + l2/2·‖θ‖², or, with ``batches [R, B]``, the mean
loss over the rows ``batches[r]`` (a minibatch gradient, as Per-FedAvg needs)."""
from __future__ import annotations

import torch

from pflcore import backend
from pflcore.ops import _cuda, _glm, _nets
from pflcore.ops._checks import as_tensor, check_device, check_dtype, check_shape, cpu_numpy, out_like


def _validate_batches(batches, data, rows_t, R):
    if batches is None:
        return None
    b, _ = as_tensor(batches, "batches")
    check_dtype(b, "batches", torch.int32)
    check_device(b, "batches", data.device)
    check_shape(b, "batches", (R, None), "[R, B]")
    if b.shape[1] < 1:
        raise ValueError(f"batches: expected at least one row per batch, got shape {list(b.shape)}")
    _glm.check_batch_rows(b, data, rows_t)
    return b.contiguous()


def gradients(model, theta, data, *, rows=None, batches=None):
    """``[R, d]`` gradients of each row's client objective at ``theta`` [R, d]."""
    if _nets.is_net(model):  # torch nets (MLP, CNN): torch.func over all rows, no native kernel
        return _nets.gradients(model, theta, data, rows=rows, batches=batches)
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    theta_t = theta_t.contiguous()
    batches_t = _validate_batches(batches, data, rows_t, theta_t.shape[0])
    name, module = backend.select("gradients", theta_t.device, _cuda.glm_limit(model, theta_t.dtype))
    if name == "reference":
        out = gradients_ref(model, theta_t, data, rows=rows_t, batches=batches_t)
    elif name == "triton":
        out = torch.empty_like(theta_t)
        module.gradients(model, theta_t, data, rows_t, batches_t, out)
    elif name == "cuda":
        out = torch.empty_like(theta_t)
        dev = theta_t.device
        with torch.cuda.device(dev):
            _cuda.launch("gradients", module.gradients, *_cuda.glm_args(model, theta_t, data, rows_t),
                         _cuda.ptr(batches_t, "batches", dev, torch.int32),
                         0 if batches_t is None else batches_t.shape[1], _cuda.ptr(out, "out", dev, theta_t.dtype),
                         _cuda.dtype_name(theta_t), _cuda.stream(theta_t))
    else:
        out = torch.empty_like(theta_t)
        module.gradients(*_glm.native_args(model, theta_t, data, rows_t),
                         None if batches_t is None else cpu_numpy(batches_t), cpu_numpy(out))
    return out_like(out, is_np)


def gradients_ref(model, theta, data, *, rows=None, batches=None):
    """Pure-torch reference of ``gradients`` (a loop over model rows)."""
    if _nets.is_net(model):
        return _nets.gradients_ref(model, theta, data, rows=rows, batches=batches)
    theta_t, is_np = as_tensor(theta, "theta")
    R = theta_t.shape[0]
    rows_t = torch.arange(R) if rows is None else as_tensor(rows, "rows")[0]
    b = None if batches is None else as_tensor(batches, "batches")[0].to(torch.int64)
    out = torch.empty_like(theta_t)
    for r in range(R):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        X, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r]], data.y[b[r]])
        W = theta_t[r].view(model.P, model.C)
        g = _glm.grad_sum_ref(model, W, X, y) / X.shape[0]
        out[r] = (g + model.l2 * W).reshape(-1)
    return out_like(out, is_np)
