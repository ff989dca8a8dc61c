"""``average``: the weighted mean of model rows, the projection P_H (DESIGN.md §4, §5):
``Σ_{r ∈ rows} w_r θ_r / Σ_{r ∈ rows} w_r``, accumulated in float64."""
from __future__ import annotations

from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor, to_tensor
from pflcore._checks import check_float, check_shape
from pflcore.ops import _compile
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm, rows_arg, same_device


def average(theta, weights, rows=None):
    """``[d]`` weighted mean of ``theta [m, d]`` over ``rows`` (default all) with ``weights [m]``
    (finite, >= 0, with a positive sum over the rows; checked as they are read). Inside an
    algorithm, use ``ctx.average`` (a collective when the clients are sharded)."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.average
        return _compile.traced_average(theta, weights, rows)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("average")
    return run_average(theta, weights, rows)


def run_average(theta, weights, rows=None):
    """``average`` without the algorithm guard (the context's one-process P_H)."""
    theta_t, kind = to_tensor(theta, "theta")
    check_float(theta_t, "theta")
    if theta_t.dim() != 2 or theta_t.shape[0] < 1 or theta_t.shape[1] < 1:
        raise ValueError(f"theta: expected shape [m, d] with m >= 1 and d >= 1, got {list(theta_t.shape)}")
    m = theta_t.shape[0]
    w, _ = to_tensor(weights, "weights")
    if w.dtype is not theta_t.dtype:
        check_float(w, "weights", theta_t.dtype)
    if w.dim() != 1 or w.shape[0] != m:
        check_shape(w, "weights", (m,), f"[m] = [{m}]")
    same_device(w, theta_t, "weights")
    rows_t = rows_arg(rows, theta_t)
    theta_t = theta_t if theta_t.is_contiguous() else theta_t.contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    out = backend.select("average", None, theta_t).average(theta_t, w, rows_t)
    return from_tensor(out, kind)


def average_ref(theta, weights, rows=None):
    """``average`` on the pure-torch reference."""
    with backend.reference():
        return average(theta, weights, rows)
