"""``evaluate``: per-model-row loss sum, correct count and row count on its client's rows
(DESIGN.md §4). The loss sum excludes the l2 term; least squares has no classes, so its
correct count is 0; logistic predicts 1 when z > 0; softmax (and the nets) predict the first
maximal logit."""
from __future__ import annotations

from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor
from pflcore.ops import _compile
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm, shared_theta_args


def evaluate(model, theta, data, *, rows=None, batches=None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])`` of every model row on its client's
    rows, or on ``batches [R, B]`` (int32 absolute row indices in each row's client: a sample),
    as arrays of theta's kind; ``theta`` [d] is one model for every row (a global model at every
    client, without an [m, d] copy). Values are checked as they are read (DESIGN.md §8). Inside
    an algorithm, use ``ctx.evaluate``."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.evaluate
        return _compile.traced_evaluate(model, theta, data, rows, batches)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("evaluate")
    return run_evaluate(model, theta, data, rows, batches, False)


def run_evaluate(model, theta, data, rows, batches=None, trusted: bool = False):
    """``evaluate`` without the algorithm guard (the context's, and the round loop's metrics)."""
    theta_t, kind, rows_t, batches_t = shared_theta_args(model, theta, data, rows, batches)
    out = backend.select("evaluate", model, theta_t).evaluate(model, theta_t, data, rows_t, batches_t, trusted)
    return tuple(from_tensor(t, kind) for t in out)


def evaluate_ref(model, theta, data, *, rows=None, batches=None):
    """``evaluate`` on the pure-torch reference (a loop over model rows)."""
    with backend.reference():
        return evaluate(model, theta, data, rows=rows, batches=batches)
