"""``evaluate``: per-model-row loss sum, correct count and row count on its client's rows
(DESIGN.md §4). The loss sum excludes the l2 term; least squares has no classes, so its
correct count is 0; logistic predicts 1 when z > 0; softmax (and the nets) predict the first
maximal logit."""
from __future__ import annotations

from pflcore import backend
from pflcore._arrays import from_tensor
from pflcore.ops._args import check_data, check_model, rows_arg, theta_arg


def evaluate(model, theta, data, *, rows=None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])`` of every model row, as arrays of
    theta's kind. Values are checked as they are read (DESIGN.md §8)."""
    check_model(model)
    x, N, m = check_data(model, data)
    rows_t = rows_arg(rows, x)
    theta_t, kind = theta_arg(theta, model, x, m, rows_t, inplace=False)
    out = backend.select("evaluate", model, theta_t).evaluate(model, theta_t, data, rows_t)
    return tuple(from_tensor(t, kind) for t in out)


def evaluate_ref(model, theta, data, *, rows=None):
    """``evaluate`` on the pure-torch reference (a loop over model rows)."""
    with backend.use("reference"):
        return evaluate(model, theta, data, rows=rows)
