"""Server-side ops on the clients' models ``[m, 610]`` (Softmax 60x10), 1,000 and 10,000 clients.

``Anderson(memory=5).step`` with a full history (k = 6 stored pairs): pflcore's backends vs
``dst.copy_(src)`` of the bytes a step must touch (u, tu in; r, tu into the ring; k residuals
for the Gram column; k T(u) for the mix; out: 17·D elements for k = 6): the memory-bandwidth
floor. Agreement: the native and reference steps give the same next point after the same
sequence of pairs (max |Δ| <= 1e-4 relative to the point's scale).

``average`` (the weighted mean of the rows, the server step of FedAvg-like methods): pflcore's
backends vs ``weights @ theta / weights.sum()`` in torch and ``numpy.average``. Agreement:
max |Δ| <= 1e-6. Bytes: the [m, d] rows read once.

``water_fill`` (PERM's mixing weights from the clients' pairwise gradient distances, m = 2,000:
the [m, m] float64 costs of 4 groups of clients, ~40 nonzero weights a row): pflcore's backends
(the native active-set kernel, the reference's top-k and sort) through ``perm.water_filling``.
Agreement: max |Δα| <= 1e-12 against ``water_filling_ref``. Bytes: the costs read once.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from pflcore import backend, ops
from pflcore.algorithms.perm import pairwise_sqdist, water_filling, water_filling_ref

from _suite import D, SIZES, cached, device_of, expected, group_name, impls, max_abs_diff, measure, models

MEMORY = 5


@cached
def pairs(size):
    """Distinct (u, T(u)) pairs: a repeated pair would make the Gram matrix singular."""
    m = SIZES[size].clients
    g = torch.Generator().manual_seed(5)
    us = [torch.randn(m, D, generator=g) for _ in range(MEMORY + 3)]
    return [(us[i], 0.9 * us[i] + 0.1 * us[i + 1]) for i in range(MEMORY + 2)]


@pytest.mark.op("anderson")
@pytest.mark.parametrize("impl", impls("torch_copy"))
@pytest.mark.parametrize("size", ["1k", "10k"])
def test_anderson_step(benchmark, size, impl):
    ps = pairs(size)
    numel = ps[0][0].numel()
    touched = (2 + 2 + (MEMORY + 1) * 2 + 1) * numel

    def steps_with(name, dev):
        acc = ops.Anderson(memory=MEMORY)
        moved = [(u.to(dev), tu.to(dev)) for u, tu in ps]
        with backend.use(name):
            outs = [acc.step(u, tu) for u, tu in moved[:MEMORY + 1]]  # fills the history
        return acc, moved, outs[-1]

    want = expected(("anderson", size), lambda: steps_with("reference", "cpu")[2])
    if impl == "torch_copy":
        src = torch.randn(touched // 2)
        dst = torch.empty_like(src)

        def run():
            return dst.copy_(src)

        def check(out):
            assert torch.equal(out, src)
    else:
        acc, moved, last = steps_with(impl, device_of(impl))
        scale = float(want.abs().max())
        diff = max_abs_diff(last, want)
        assert diff <= 1e-4 * scale, f"{impl}: Anderson's point differs from the reference by {diff:.3g}"
        turn = iter(range(10 ** 12))

        def run():
            u, tu = moved[next(turn) % len(moved)]
            with backend.use(impl):
                return acc.step(u, tu)

        def check(out):
            assert bool(torch.isfinite(torch.as_tensor(out)).all()), f"{impl}: non-finite Anderson step"
            assert len(acc._order) == MEMORY + 1, "the history is not full"

    measure(benchmark, op="anderson", size=size,
            group=group_name("anderson", size, f"Anderson(memory={MEMORY}).step, state [{SIZES[size].clients}, {D}]"),
            impl=impl, run=run, check=check, bytes_moved=touched * 4, baseline=impl == "native")


@pytest.mark.op("average")
@pytest.mark.parametrize("impl", impls("torch_matmul", "numpy"))
@pytest.mark.parametrize("size", ["1k", "10k"])
def test_average(benchmark, size, impl):
    theta = models(size)
    w = torch.rand(theta.shape[0], generator=torch.Generator().manual_seed(6)) + 0.1
    want = expected(("average", size), lambda: ops.average_ref(theta, w))
    if impl == "torch_matmul":
        def run():
            return w @ theta / w.sum()
    elif impl == "numpy":
        T, W = theta.numpy(), w.numpy()

        def run():
            return torch.from_numpy(np.average(T, axis=0, weights=W))
    else:
        dev = device_of(impl)
        t, wd = theta.to(dev), w.to(dev)

        def run():
            with backend.use(impl):
                return ops.average(t, wd)

    def check(out):
        diff = max_abs_diff(out, want)
        assert diff <= 1e-6, f"{impl}: the average differs from average_ref by {diff:.3g}"

    measure(benchmark, op="average", size=size, group=group_name("average", size, f"weighted mean of [m, {D}]"),
            impl=impl, run=run, check=check, bytes_moved=theta.numel() * 4, flops=2 * theta.numel(),
            baseline=impl == "native")


@cached
def water_costs():
    """[2000, 2000] float64 squared distances of gradients in 4 groups, and the clients' sizes."""
    g = torch.Generator().manual_seed(7)
    m = 2000
    centres = torch.randn(4, D, generator=g, dtype=torch.float64)
    G = centres[torch.randint(0, 4, (m,), generator=g)] + 0.03 * torch.randn(m, D, generator=g, dtype=torch.float64)
    return pairwise_sqdist(G), torch.randint(50, 250, (m,), generator=g)


@pytest.mark.op("water_fill")
@pytest.mark.parametrize("impl", impls())
def test_water_fill(benchmark, impl):
    costs, n = water_costs()
    lam = 100.0
    want = expected(("water_fill",), lambda: water_filling_ref(costs, n, lam))
    dev = device_of(impl)
    c, nd = costs.to(dev), n.to(dev)

    def run():
        with backend.use(impl):
            return water_filling(c, nd, lam)

    def check(out):
        diff = max_abs_diff(out, want)
        assert diff <= 1e-12, f"{impl}: the mixing weights differ from water_filling_ref by {diff:.3g}"

    active = float((want > 0).sum(1).double().mean())
    measure(benchmark, op="water_fill", size="", group=group_name("water_fill", "", f"PERM's α, costs [2000, 2000] "
                                                                   f"float64, {active:.0f} nonzero a row"),
            impl=impl, run=run, check=check, bytes_moved=costs.numel() * 8, baseline=impl == "native")
