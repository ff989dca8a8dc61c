"""``hvp``: exact Hessian-vector products of the clients' minibatch objectives (what
Per-FedAvg's HF variant needs), ∇²f_i(θ_r; B_r)·v_r + l2·v_r for every model row r with client
i = rows[r]. GLMs in closed form (∇²(mean loss)·v = Xᵀ J X v / B, J the Hessian of the loss in
the logits); torch nets by forward-over-reverse autodiff, vmapped over rows."""
from __future__ import annotations

from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor
from pflcore.ops import _compile
from pflcore.ops._args import (IN_ALGORITHM, batches_arg, check_data, check_model, refuse_inside_algorithm, rows_arg,
                               theta_arg)


def hvp(model, theta, v, data, *, batches, rows=None):
    """``[R, d]``: the Hessian of each row's minibatch objective at ``theta [R, d]`` times
    ``v [R, d]``; ``batches``: ``int32 [R, B]`` absolute row indices in each row's client.
    Inside an algorithm, use ``ctx.hvp``."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.hvp
        return _compile.traced_hvp(model, theta, v, data, batches, rows)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("hvp")
    return run_hvp(model, theta, v, data, batches, rows, False)


def run_hvp(model, theta, v, data, batches, rows, trusted: bool):
    """``hvp`` without the algorithm guard (``Context``)."""
    check_model(model)
    x, N, m = check_data(model, data)
    rows_t = rows_arg(rows, x)
    theta_t, kind = theta_arg(theta, model, x, m, rows_t, inplace=False)
    R = theta_t.shape[0]
    v_t, _ = theta_arg(v, model, x, R, None, inplace=False, name="v")
    if batches is None:
        raise ValueError("batches: expected int32 [R, B] minibatch indices (ops.sample_batches), got None")
    batches_t = batches_arg(batches, x, R, None)
    # Detached: an op's output never requires grad (README), and the torch paths (the reference's
    # closed form, the nets' autodiff) would otherwise record a graph through inputs that do.
    theta_t, v_t = theta_t.detach(), v_t.detach()
    out = backend.select("hvp", model, theta_t).hvp(model, theta_t, v_t, data, rows_t, batches_t, trusted)
    return from_tensor(out.detach(), kind)


def hvp_ref(model, theta, v, data, *, batches, rows=None):
    """``hvp`` on the reference: the closed form above for GLMs; for nets, double backward on a
    ``torch.nn`` module, one row at a time."""
    with backend.reference():
        return hvp(model, theta, v, data, batches=batches, rows=rows)
