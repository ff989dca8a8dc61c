"""``local_steps``: K fused gradient steps for every model row at once (DESIGN.md §4).

For every row r, with client i = rows[r] and s = 0..steps-1:
    θ_r ← θ_r − lr·( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) )
ℓ_i(θ; B) is the mean loss over rows B of client i (all its rows when ``batches`` is None,
else ``batches[r, s, :]``, absolute row indices into x); a_r is ``anchor[r]`` ([R, d]),
``anchor`` ([d], shared) or 0 when None.
"""
from __future__ import annotations

import torch

from pflcore import backend
from pflcore.ops import _cuda, _glm, _nets
from pflcore.ops._checks import (as_tensor, check_contiguous, check_device, check_dtype, check_finite,
                                 check_float, check_positive_int, check_real, check_shape, cpu_numpy,
                                 out_like)


def _validate(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale):
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    check_contiguous(theta_t, "theta")
    steps = check_positive_int(steps, "steps", minimum=0)
    lr = check_real(lr, "lr", minimum=0.0, strict=True)
    prox = check_real(prox, "prox", minimum=0.0)
    R, d = theta_t.shape
    anchor_t = None
    if anchor is not None:
        anchor_t, _ = as_tensor(anchor, "anchor")
        check_float(anchor_t, "anchor", data.dtype)
        check_device(anchor_t, "anchor", data.device)
        if anchor_t.dim() == 1:
            check_shape(anchor_t, "anchor", (d,), "[d]")
        else:
            check_shape(anchor_t, "anchor", (R, d), "[R, d] or [d]")
        check_finite(anchor_t, "anchor")
        anchor_t = anchor_t.contiguous()
    batches_t = None
    if batches is not None:
        batches_t, _ = as_tensor(batches, "batches")
        check_dtype(batches_t, "batches", torch.int32)
        check_device(batches_t, "batches", data.device)
        check_shape(batches_t, "batches", (R, steps, None), "[R, steps, B]")
        if batches_t.shape[2] < 1:
            raise ValueError(f"batches: expected at least one row per batch, got shape {list(batches_t.shape)}")
        batches_t = batches_t.contiguous()
        _glm.check_batch_rows(batches_t, data, rows_t)
    grad_scale_t = _glm.optional_vector(grad_scale, "grad_scale", R, data.dtype, data.device)
    return theta_t, is_np, rows_t, steps, lr, prox, anchor_t, batches_t, grad_scale_t


def local_steps(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                grad_scale=None):
    """Run ``steps`` gradient steps on every row of ``theta`` [R, d] in place and return it.

    Args:
        model: a GLM (``pflcore.models.LeastSquares | Logistic | Softmax``).
        theta: ``[R, d]`` parameters (R = m without ``rows``), contiguous, dtype of the data.
        data: ``ClientData``.
        steps, lr: number of steps (>= 0) and step size (> 0).
        prox, anchor: proximal weight (>= 0) and its centre: ``[R, d]``, ``[d]`` or None (= 0).
        batches: ``int32 [R, steps, B]`` absolute row indices (``ops.sample_batches``); each must
            lie in its client's rows. None = full batch.
        rows: ``int64 [R]`` client of each model row (default ``arange(m)``).
        grad_scale: ``[R]`` factor on the loss gradient (not on l2 or prox); default 1.

    numpy in, numpy out (the same array, updated). Read-only inputs that are not contiguous
    are copied; theta must be contiguous.
    """
    if _nets.is_net(model):  # torch nets (MLP, CNN): torch.func over all rows, no native kernel
        return _nets.local_steps(model, theta, data, steps=steps, lr=lr, prox=prox, anchor=anchor,
                                 batches=batches, rows=rows, grad_scale=grad_scale)
    (theta_t, is_np, rows_t, steps, lr, prox, anchor_t, batches_t,
     grad_scale_t) = _validate(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale)
    name, module = backend.select("local_steps", theta_t.device, _cuda.glm_limit(model, theta_t.dtype))
    if name == "reference":
        local_steps_ref(model, theta_t, data, steps=steps, lr=lr, prox=prox, anchor=anchor_t,
                        batches=batches_t, rows=rows_t, grad_scale=grad_scale_t)
    elif name == "triton":
        module.local_steps(model, theta_t, data, rows_t, batches_t, anchor_t, grad_scale_t, steps, lr, prox)
    elif name == "cuda":
        dev, dt = theta_t.device, theta_t.dtype
        with torch.cuda.device(dev):
            _cuda.launch("local_steps", module.local_steps, *_cuda.glm_args(model, theta_t, data, rows_t),
                         _cuda.ptr(batches_t, "batches", dev, torch.int32),
                         0 if batches_t is None else batches_t.shape[2], _cuda.ptr(anchor_t, "anchor", dev, dt),
                         anchor_t is not None and anchor_t.dim() == 1,
                         _cuda.ptr(grad_scale_t, "grad_scale", dev, dt), steps, lr, prox, _cuda.dtype_name(theta_t),
                         _cuda.stream(theta_t))
    else:
        opt = lambda t: None if t is None else cpu_numpy(t)  # noqa: E731
        module.local_steps(*_glm.native_args(model, theta_t, data, rows_t), opt(batches_t),
                           opt(anchor_t), opt(grad_scale_t), steps, lr, prox)
    return theta if is_np else theta_t  # the caller's own array, updated in place


def local_steps_ref(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                    grad_scale=None):
    """Pure-torch reference of ``local_steps``: a loop over model rows (clear, not fast)."""
    if _nets.is_net(model):
        return _nets.local_steps_ref(model, theta, data, steps=steps, lr=lr, prox=prox, anchor=anchor,
                                     batches=batches, rows=rows, grad_scale=grad_scale)
    theta_t, is_np = as_tensor(theta, "theta")
    R = theta_t.shape[0]
    rows_t = torch.arange(R) if rows is None else as_tensor(rows, "rows")[0]
    anchor_t = None if anchor is None else as_tensor(anchor, "anchor")[0]
    batches_t = None if batches is None else as_tensor(batches, "batches")[0].to(torch.int64)
    gs = None if grad_scale is None else as_tensor(grad_scale, "grad_scale")[0]
    P, C = model.P, model.C
    for r in range(R):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        W = theta_t[r].view(P, C)
        a = 0.0 if anchor_t is None else (anchor_t if anchor_t.dim() == 1 else anchor_t[r]).view(P, C)
        scale = 1.0 if gs is None else gs[r]
        for s in range(steps):
            if batches_t is None:
                X, y = data.x[lo:hi], data.y[lo:hi]
            else:
                X, y = data.x[batches_t[r, s]], data.y[batches_t[r, s]]
            g = _glm.grad_sum_ref(model, W, X, y) / X.shape[0]
            W -= lr * (scale * g + model.l2 * W + prox * (W - a))
    return out_like(theta_t, is_np)
