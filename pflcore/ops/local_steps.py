"""``local_steps``: K fused gradient steps for every model row at once (DESIGN.md §4).

For every row r, with client i = rows[r] and s = 0..steps-1:
    θ_r ← θ_r − lr·( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) )
ℓ_i(θ; B) is the mean loss over rows B of client i (all its rows when ``batches`` is None,
else ``batches[r, s, :]``, absolute row indices into x); a_r is ``anchor[r]`` ([R, d]),
``anchor`` ([d], shared) or 0 when None.
"""
from __future__ import annotations

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


def local_steps(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                grad_scale=None):
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
        return _compile.traced_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("local_steps")
    return run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, False)


def run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, trusted: bool):
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
    data, anchor_t, scale_t, rows_t, batches_t = apart_from(theta_t, data, anchor_t, scale_t, rows_t, batches_t)
    backend.select("local_steps", model, theta_t).local_steps(
        model, theta_t, data, rows_t, batches_t, anchor_t, scale_t, steps, lr, prox, trusted)
    if kind is TORCH or kind.writable:
        return theta  # the caller's own array, updated in place
    return from_tensor(theta_t, kind)  # an immutable array (JAX): a new one


def local_steps_ref(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                    grad_scale=None):
    """``local_steps`` on the pure-torch reference (a loop over model rows and steps;
    ``pflcore/backends/reference.py``): the same checks, errors and result."""
    with backend.reference():
        return local_steps(model, theta, data, steps=steps, lr=lr, prox=prox, anchor=anchor, batches=batches,
                           rows=rows, grad_scale=grad_scale)
