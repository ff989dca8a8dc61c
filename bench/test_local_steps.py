"""``local_steps``: pflcore's backends vs the per-client PyTorch loop (autograd + torch.optim.SGD).

Groups: 1 client / 1,000 / 10,000 clients x 1 step of a minibatch of 20 rows (lr 0.05), 1,000
clients x 1 step of B = 64, and 1,000 clients x 5 full-batch steps with a prox term toward a shared anchor (about 350 rows per
client: the full-batch workload pflcore's earlier kernel figures came from). Agreement: every
implementation's θ against ``local_steps_ref`` (max |Δθ| <= 1e-5, float32; the steps move θ by
~1e-2; at 10,000 clients on every 10th client).
FLOPs: 4·(p+1)·C per row and step (logits and gradient).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pflcore
from pflcore import backend, ops

from _suite import (BATCH, C, MODEL, P, batches, cached, checked_rows, clients, device_of, expected, group_name, impls,
                    max_abs_diff, measure, models, on_device, torch_sgd_loop)

LR, TOL = 0.05, 1e-5
pytestmark = pytest.mark.op("local_steps")


def _case(size, impl, data, theta0, kw, flops, what, benchmark):
    rows = checked_rows(size)
    sub = (lambda t: t) if rows is None else (lambda t: t[rows])
    ref_kw = kw if rows is None else {**kw, "rows": rows, "batches": kw["batches"][rows]}
    want = expected(("local_steps", size), lambda: ops.local_steps_ref(MODEL, sub(theta0).clone(), data, **ref_kw))
    dev = device_of(impl)
    theta = theta0.clone().to(dev)  # the timed calls keep stepping this θ: only the cost matters
    if impl == "torch_sgd":
        def run():
            return torch_sgd_loop(theta, data, **kw)
    else:
        ddata, dkw = on_device(data, dev), {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}

        def run():
            with backend.use(impl):
                return ops.local_steps(MODEL, theta, ddata, **dkw)

    def check(out):
        diff = max_abs_diff(sub(torch.as_tensor(out).cpu()), want)
        assert diff <= TOL, f"{impl}: max |Δθ| = {diff:.3g} vs local_steps_ref (tolerance {TOL})"

    measure(benchmark, op="local_steps", size=size, group=group_name("local_steps", size, what), impl=impl,
            run=run, check=check, flops=flops, baseline=impl == "native",
            info={"max_abs_update": max_abs_diff(want, sub(theta0)),
                  "checked_clients": "all" if rows is None else int(rows.numel())})


@pytest.mark.parametrize("impl", impls("torch_sgd"))
@pytest.mark.parametrize("size", ["small", "1k", "10k"])
def test_local_steps_minibatch(benchmark, size, impl):
    data, theta0, b = clients(size), models(size), batches(size)
    kw = dict(steps=1, lr=LR, batches=b)
    flops = 4 * (P + 1) * C * b.numel()
    _case(size, impl, data, theta0, kw, flops, f"1 step, B={BATCH}", benchmark)


@pytest.mark.parametrize("impl", impls("torch_sgd"))
def test_local_steps_minibatch_b64(benchmark, impl):
    """The larger minibatch of the kernel figures (DESIGN.md §4): 1,000 clients x 1 step of B = 64."""
    data, theta0, b = clients("1k"), models("1k"), batches("1k", batch_size=64)
    kw = dict(steps=1, lr=LR, batches=b)
    flops = 4 * (P + 1) * C * b.numel()
    _case("1k-b64", impl, data, theta0, kw, flops, "1,000 clients, 1 step, B=64", benchmark)


@cached
def _full_batch_workload():
    rng = np.random.RandomState(0)
    sizes = np.maximum(1, np.round(rng.lognormal(math.log(350) - 0.125, 0.5, 1000)))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(offsets[-1])
    data = pflcore.ClientData(torch.from_numpy(rng.standard_normal((N, P)).astype(np.float32)),
                              torch.from_numpy(rng.randint(0, C, N).astype(np.int64)), torch.from_numpy(offsets))
    g = torch.Generator().manual_seed(2)
    theta0 = 0.01 * torch.randn(1000, MODEL.d, generator=g)
    anchor = 0.01 * torch.randn(MODEL.d, generator=g)
    return data, theta0, anchor


@pytest.mark.large
@pytest.mark.parametrize("impl", impls("torch_sgd"))
def test_local_steps_full_batch(benchmark, impl):
    data, theta0, anchor = _full_batch_workload()
    kw = dict(steps=5, lr=LR, prox=0.1, anchor=anchor)
    flops = 4 * (P + 1) * C * 5 * data.num_rows
    _case("1k-full", impl, data, theta0, kw, flops, "1,000 clients x 5 full-batch steps (~350 rows), prox 0.1",
          benchmark)
