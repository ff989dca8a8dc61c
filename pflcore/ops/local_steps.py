"""``local_steps``: K fused gradient steps for every model row at once (DESIGN.md §4).

For every row r, with client i = rows[r] and s = 0..steps-1:
    θ_r ← θ_r − lr·s ⊙ ( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) )
s = ``lr_scale`` ([d], shared by every row; default 1): a per-coordinate factor on the step, 0
freezing a coordinate (partial personalization: FedRep's head or body steps).
ℓ_i(θ; B) is the mean loss over rows B of client i (all its rows when ``batches`` is None,
else ``batches[r, s, :]``, absolute row indices into x); a_r is ``anchor[r]`` ([R, d]),
``anchor`` ([d], shared) or 0 when None.
"""
from __future__ import annotations

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import TORCH, from_tensor, to_tensor
from pflcore._checks import MAX_COUNT, check_float, check_positive_int, check_real, check_shape
from pflcore.ops import _compile
from pflcore.ops._args import (IN_ALGORITHM, apart_from, batches_arg, check_data, check_model,
                               refuse_inside_algorithm, rows_arg, same_device, theta_arg, vector_arg)


def _anchor(anchor, x, R: int, d: int):
    if anchor is None:
        return None
    a, _ = to_tensor(anchor, "anchor")
    if a.dtype is not x.dtype:
        check_float(a, "anchor", x.dtype)
    if a.dim() == 1:
        if a.shape[0] != d:
            check_shape(a, "anchor", (d,), "[d]")
    elif a.dim() != 2 or a.shape[0] != R or a.shape[1] != d:
        check_shape(a, "anchor", (R, d), "[R, d] or [d]")
    same_device(a, x, "anchor")
    return a if a.is_contiguous() else a.contiguous()


def _lr_scale(lr_scale, x, d: int):
    """``lr_scale`` as a [d] tensor of the data's dtype and device (values: finite, >= 0)."""
    if lr_scale is None:
        return None
    t = vector_arg(lr_scale, "lr_scale", x, d)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):  # [d]: one small pass
        bad = int((~torch.isfinite(t) | (t < 0)).nonzero()[0, 0])
        raise ValueError(f"lr_scale: expected finite values >= 0 (0 freezes a coordinate), got {float(t[bad])} "
                         f"at index {bad}")
    return t


def _masked_glm_steps(model, theta_t, data, rows_t, batches_t, anchor_t, scale_t, s_t, steps, lr, prox, trusted):
    """``local_steps`` of a GLM with a per-coordinate step ``s``: one batched ``gradients`` call
    per step (on the backend that serves the tensors: native, cuda or triton),
    then θ ← θ − lr·s ⊙ (grad_scale·∇ℓ + l2·θ + prox·(θ − a)) in torch. The GLM kernels have no
    per-coordinate step; a GLM's coordinates are rarely split into shared and personal parts."""
    impl = backend.select("gradients", model, theta_t)
    step = lr * s_t
    for k in range(steps):
        b = None if batches_t is None else batches_t[:, k].contiguous()
        g = impl.gradients(model, theta_t, data, rows_t, b, trusted)  # ∇ℓ + l2·θ
        if scale_t is not None:  # grad_scale scales the loss gradient only
            g.sub_(theta_t, alpha=model.l2).mul_(scale_t[:, None]).add_(theta_t, alpha=model.l2)
        if prox:
            g.add_(theta_t if anchor_t is None else theta_t - anchor_t, alpha=prox)
        theta_t.sub_(g.mul_(step))


def local_steps(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                grad_scale=None, lr_scale=None):
    """Run ``steps`` gradient steps on every row of ``theta`` [R, d] in place and return it.

    Args:
        model: a GLM (``pflcore.models.LeastSquares | Logistic | Softmax``) or a torch net
            (``MLP``, ``CNN``).
        theta: ``[R, d]`` parameters (R = m without ``rows``), contiguous, dtype of the data;
            a torch tensor, a numpy array or a DLPack array (JAX, CuPy).
        data: ``ClientData``.
        steps, lr: number of steps (>= 0) and step size (> 0).
        prox, anchor: proximal weight (>= 0) and its centre: ``[R, d]``, ``[d]`` or None (= 0).
        batches: ``int32 [R, steps, B]`` absolute row indices (``ops.sample_batches``); each must
            lie in its client's rows. None = full batch.
        rows: ``int64 [R]`` client of each model row (default ``arange(m)``).
        grad_scale: ``[R]`` factor on the loss gradient (not on l2 or prox); default 1.
        lr_scale: ``[d]`` factor on the step of each coordinate, shared by every row (0 freezes
            it: only the head, or only the body, of a net is trained); default 1. Nets take it in
            their fused steps; GLMs run one ``gradients`` call per step; not under torch.compile.

    Returns ``theta``, updated in place: the caller's own tensor or numpy array. An immutable
    array (JAX) cannot be updated: a new array of its kind is returned and the argument is left
    as it was. A read-only numpy array is refused. An input that shares memory with ``theta``
    (e.g. ``anchor=theta[0]``) is copied first, so the steps use the values it had at the call.

    Values are checked as they are read (DESIGN.md §8): a bad client index, batch index or
    label is a ValueError, NaN/inf in theta, the anchor, grad_scale, x or y a NonFiniteError,
    each naming the argument and the first bad index. The compiled CPU kernels then leave the model
    rows that hit the bad value unchanged (the other rows are updated); the other backends
    check everything before they write.

    Inside an algorithm's round, use ``ctx.local_steps`` (this raises RuntimeError there).
    """
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.local_steps
        if lr_scale is not None:
            raise ValueError("lr_scale: not supported under torch.compile / export yet (the custom op has no "
                             "such argument); call local_steps eagerly")
        return _compile.traced_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("local_steps")
    return run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, False, lr_scale)


def run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, trusted: bool,
                    lr_scale=None):
    """``local_steps`` without the algorithm guard; ``trusted``: the batch indices were drawn by
    the caller's run context (``Context``), so the kernels need not check them."""
    check_model(model)
    x, N, m = check_data(model, data)
    steps = check_positive_int(steps, "steps", minimum=0, maximum=MAX_COUNT)
    lr = check_real(lr, "lr", minimum=0.0, strict=True)
    prox = check_real(prox, "prox", minimum=0.0)
    rows_t = rows_arg(rows, x)
    theta_t, kind = theta_arg(theta, model, x, m, rows_t, inplace=True)
    R, d = theta_t.shape
    anchor_t = _anchor(anchor, x, R, d)
    batches_t = batches_arg(batches, x, R, steps)
    scale_t = vector_arg(grad_scale, "grad_scale", x, R)
    s_t = _lr_scale(lr_scale, x, d)
    data, anchor_t, scale_t, rows_t, batches_t, s_t = apart_from(theta_t, data, anchor_t, scale_t, rows_t,
                                                                 batches_t, s_t)
    impl = backend.select("local_steps", model, theta_t)
    if s_t is None:
        impl.local_steps(model, theta_t, data, rows_t, batches_t, anchor_t, scale_t, steps, lr, prox, trusted)
    elif impl.takes_lr_scale:  # the nets adapter and the reference
        impl.local_steps(model, theta_t, data, rows_t, batches_t, anchor_t, scale_t, steps, lr, prox, trusted,
                         lr_scale=s_t)
    elif steps and R:  # a GLM kernel (native, cuda, triton): steps composed from its gradients
        _masked_glm_steps(model, theta_t, data, rows_t, batches_t, anchor_t, scale_t, s_t, steps, lr, prox, trusted)
    if kind is TORCH or kind.writable:
        return theta  # the caller's own array, updated in place
    return from_tensor(theta_t, kind)  # an immutable array (JAX): a new one


def local_steps_ref(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                    grad_scale=None, lr_scale=None):
    """``local_steps`` on the pure-torch reference (a loop over model rows and steps;
    ``pflcore/backends/reference.py``): the same checks, errors and result."""
    with backend.reference():
        return local_steps(model, theta, data, steps=steps, lr=lr, prox=prox, anchor=anchor, batches=batches,
                           rows=rows, grad_scale=grad_scale, lr_scale=lr_scale)
