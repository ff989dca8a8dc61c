"""``gradients``: ∇f_i(θ_r) for every model row (DESIGN.md §4), where
f_i(θ) = mean loss over client i's rows + l2/2·‖θ‖², or, with ``batches [R, B]``, the mean
loss over the rows ``batches[r]`` (a minibatch gradient, as Per-FedAvg needs)."""
from __future__ import annotations

from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor
from pflcore.ops import _compile
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm, shared_theta_args


def gradients(model, theta, data, *, rows=None, batches=None):
    """``[R, d]`` gradients of each row's client objective at ``theta`` [R, d] (a new array of
    theta's kind); ``theta`` [d] is one model for every row (e.g. a global model at every
    client, without an [m, d] copy). ``batches``: ``int32 [R, B]`` absolute row indices of each
    row's minibatch (each in its client's rows); None = every row of the client. Values are
    checked as they are read (DESIGN.md §8). Inside an algorithm, use ``ctx.gradients``."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.gradients
        return _compile.traced_gradients(model, theta, data, rows, batches)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("gradients")
    return run_gradients(model, theta, data, rows, batches, False)


def run_gradients(model, theta, data, rows, batches, trusted: bool):
    """``gradients`` without the algorithm guard (``Context``)."""
    theta_t, kind, rows_t, batches_t = shared_theta_args(model, theta, data, rows, batches)
    out = backend.select("gradients", model, theta_t).gradients(model, theta_t, data, rows_t, batches_t, trusted)
    return from_tensor(out, kind)


def gradients_ref(model, theta, data, *, rows=None, batches=None):
    """``gradients`` on the pure-torch reference (a loop over model rows)."""
    with backend.reference():
        return gradients(model, theta, data, rows=rows, batches=batches)
