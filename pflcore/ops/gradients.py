"""``gradients``: ∇f_i(θ_r) for every model row (DESIGN.md §4), where
f_i(θ) = mean loss over client i's rows + l2/2·‖θ‖², or, with ``batches [R, B]``, the mean
loss over the rows ``batches[r]`` (a minibatch gradient, as Per-FedAvg needs)."""
from __future__ import annotations

from pflcore import backend
from pflcore._arrays import from_tensor
from pflcore.ops._args import batches_arg, check_data, check_model, rows_arg, theta_arg


def gradients(model, theta, data, *, rows=None, batches=None):
    """``[R, d]`` gradients of each row's client objective at ``theta`` [R, d] (a new array of
    theta's kind). ``batches``: ``int32 [R, B]`` absolute row indices of each row's minibatch
    (each in its client's rows); None = every row of the client. Values are checked as they are
    read (DESIGN.md §8)."""
    check_model(model)
    x, N, m = check_data(model, data)
    rows_t = rows_arg(rows, x)
    theta_t, kind = theta_arg(theta, model, x, m, rows_t, inplace=False)
    batches_t = batches_arg(batches, x, theta_t.shape[0], None)
    out = backend.select("gradients", model, theta_t).gradients(model, theta_t, data, rows_t, batches_t)
    return from_tensor(out, kind)


def gradients_ref(model, theta, data, *, rows=None, batches=None):
    """``gradients`` on the pure-torch reference (a loop over model rows)."""
    with backend.use("reference"):
        return gradients(model, theta, data, rows=rows, batches=batches)
