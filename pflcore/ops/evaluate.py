"""``evaluate``: per-model-row loss sum, correct count and row count on its client's rows
(DESIGN.md §4). The loss sum excludes the l2 term; least squares has no classes, so its
correct count is 0; logistic predicts 1 when z > 0; softmax predicts the first maximal logit."""
from __future__ import annotations

import torch

from pflcore import backend
from pflcore.ops import _cuda, _glm, _nets
from pflcore.ops._checks import as_tensor, cpu_numpy, out_like


def evaluate(model, theta, data, *, rows=None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])`` of every model row."""
    if _nets.is_net(model):  # torch nets (MLP, CNN): torch.func over all rows, no native kernel
        return _nets.evaluate(model, theta, data, rows=rows)
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    theta_t = theta_t.contiguous()
    name, module = backend.select("evaluate", theta_t.device, _cuda.glm_limit(model, theta_t.dtype))
    if name == "reference":
        loss, correct, count = evaluate_ref(model, theta_t, data, rows=rows_t)
    else:
        R, dev = theta_t.shape[0], theta_t.device
        loss = torch.empty(R, dtype=theta_t.dtype, device=dev)
        correct = torch.empty(R, dtype=torch.int64, device=dev)
        count = torch.empty(R, dtype=torch.int64, device=dev)
        if name == "triton":
            module.evaluate(model, theta_t, data, rows_t, loss, correct, count)
        elif name == "cuda":
            with torch.cuda.device(dev):
                _cuda.launch("evaluate", module.evaluate, *_cuda.glm_args(model, theta_t, data, rows_t),
                             _cuda.ptr(loss, "loss", dev, theta_t.dtype), _cuda.ptr(correct, "correct", dev, torch.int64),
                             _cuda.ptr(count, "count", dev, torch.int64), _cuda.dtype_name(theta_t),
                             _cuda.stream(theta_t))
        else:
            module.evaluate(*_glm.native_args(model, theta_t, data, rows_t), cpu_numpy(loss),
                            cpu_numpy(correct), cpu_numpy(count))
    return tuple(out_like(t, is_np) for t in (loss, correct, count))


def evaluate_ref(model, theta, data, *, rows=None):
    """Pure-torch reference of ``evaluate`` (a loop over model rows)."""
    if _nets.is_net(model):
        return _nets.evaluate_ref(model, theta, data, rows=rows)
    theta_t, is_np = as_tensor(theta, "theta")
    R = theta_t.shape[0]
    rows_t = torch.arange(R) if rows is None else as_tensor(rows, "rows")[0]
    loss = torch.empty(R, dtype=theta_t.dtype, device=theta_t.device)
    correct = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    count = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    for r in range(R):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        X, y = data.x[lo:hi], data.y[lo:hi]
        z = _glm.logits_ref(model, theta_t[r].view(model.P, model.C), X)
        loss[r] = _glm.loss_dz_ref(model, z, y)[0].sum()
        correct[r] = _glm.correct_ref(model, z, y)
        count[r] = hi - lo
    return tuple(out_like(t, is_np) for t in (loss, correct, count))
