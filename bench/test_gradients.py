"""``gradients`` (full batch, every client's rows) and ``evaluate`` (loss sum, correct count):
pflcore's backends vs a per-client PyTorch loop (``nn.Linear`` + autograd for the gradients;
``addmm`` + ``cross_entropy(reduction="sum")`` + argmax for the evaluation).

Sizes: 1 client of 200 rows; 1,000 and 10,000 clients of ~50 rows. Agreement against
``gradients_ref`` / ``evaluate_ref`` (at 10,000 clients on every 10th client): max |Δ| <= 1e-5
(gradients), loss sums within 1e-5 relative, correct counts equal (ties are measure-zero on
random data).
FLOPs per row: 4·(p+1)·C for a gradient (logits and the outer product), 2·(p+1)·C for an evaluation.
"""
from __future__ import annotations

import pytest
import torch

from pflcore import backend, ops

from _suite import (C, MODEL, P, checked_rows, clients, device_of, expected, group_name, impls, max_abs_diff, measure, models, on_device,
                    torch_evaluate_loop, torch_gradients_loop)

SIZES = ["small", "1k", "10k"]


def _pflcore(op, impl, theta, data):
    dev = device_of(impl)
    theta, data = theta.to(dev), on_device(data, dev)

    def run():
        with backend.use(impl):
            return getattr(ops, op)(MODEL, theta, data)
    return run


@pytest.mark.op("gradients")
@pytest.mark.parametrize("impl", impls("torch_autograd"))
@pytest.mark.parametrize("size", SIZES)
def test_gradients(benchmark, size, impl):
    data, theta = clients(size), models(size)
    rows = checked_rows(size)
    sub = (lambda t: t) if rows is None else (lambda t: t[rows])
    want = expected(("gradients", size), lambda: ops.gradients_ref(MODEL, sub(theta), data, rows=rows))
    run = (lambda: torch_gradients_loop(theta, data)) if impl == "torch_autograd" else \
        _pflcore("gradients", impl, theta, data)

    def check(out):
        diff = max_abs_diff(sub(torch.as_tensor(out).cpu()), want)
        assert diff <= 1e-5, f"{impl}: max |Δ grad| = {diff:.3g} vs gradients_ref"

    measure(benchmark, op="gradients", size=size, group=group_name("gradients", size, "full batch"), impl=impl,
            run=run, check=check, flops=4 * (P + 1) * C * data.num_rows, baseline=impl == "native")


@pytest.mark.op("evaluate")
@pytest.mark.parametrize("impl", impls("torch_loop"))
@pytest.mark.parametrize("size", SIZES)
def test_evaluate(benchmark, size, impl):
    data, theta = clients(size), models(size)
    rows = checked_rows(size)
    sub = (lambda t: t) if rows is None else (lambda t: t[rows])
    want = expected(("evaluate", size), lambda: ops.evaluate_ref(MODEL, sub(theta), data, rows=rows))
    run = (lambda: torch_evaluate_loop(theta, data)) if impl == "torch_loop" else \
        _pflcore("evaluate", impl, theta, data)

    def check(out):
        loss, correct, count = (sub(torch.as_tensor(t).cpu()) for t in out)
        rel = float(((loss.double() - want[0].double()).abs() / want[0].double().abs()).max())
        assert rel <= 1e-5, f"{impl}: loss sums differ from evaluate_ref by up to {rel:.3g} (relative)"
        assert torch.equal(correct, want[1]) and torch.equal(count, want[2]), f"{impl}: counts differ from evaluate_ref"

    measure(benchmark, op="evaluate", size=size, group=group_name("evaluate", size, "all rows"), impl=impl,
            run=run, check=check, flops=2 * (P + 1) * C * data.num_rows, baseline=impl == "native")
