"""The op boundary's cost (DESIGN.md §8): a small call -- 1 client x 1 step x a minibatch of 20
rows, Softmax 60x10 -- should cost at most ~2x a torch ``[200, 60] @ [60, 10]`` matmul timed in
the same process. In one group: that matmul (the baseline), and the small calls of
``local_steps``, ``gradients`` and ``evaluate`` (the client's 200 rows), ``kmeans_assign`` (200
points, 10 centroids, d = 60) and ``sample_batches`` on pflcore's native backend; the table's
ratios are the boundary's cost in matmuls. The same calls appear with the other implementations
in their ops' groups.

Also a group of reference points for the GFLOP/s and GB/s in ``extra_info``: a 2048² float32
matmul and a 256 MiB copy on this machine, at torch's thread count.
"""
from __future__ import annotations

import pytest
import torch

from pflcore import backend, ops

from _suite import BATCH, C, MODEL, P, SMALL_ROWS, batches, clients, expected, max_abs_diff, measure, models

GROUP = f"small calls (op boundary): 1 client, B={BATCH}, vs a torch [{SMALL_ROWS}, {P}] @ [{P}, {C}] matmul"
pytestmark = pytest.mark.op("small_calls")


def _points():
    g = torch.Generator().manual_seed(3)
    return torch.randn(SMALL_ROWS, P, generator=g), torch.randn(C, P, generator=g)


def _calls():
    data, theta, b = clients("small"), models("small"), batches("small")
    x, w = data.x.contiguous(), torch.randn(P, C, generator=torch.Generator().manual_seed(4))
    points, centroids = _points()
    th = theta.clone()
    return {
        "matmul": (lambda: x @ w, lambda out: torch.allclose(out, x.double().mm(w.double()).float(), atol=1e-4),
                   2 * SMALL_ROWS * P * C),
        "local_steps": (lambda: ops.local_steps(MODEL, th, data, steps=1, lr=0.05, batches=b),
                        lambda out: max_abs_diff(ops.local_steps(MODEL, theta.clone(), data, steps=1, lr=0.05,
                                                                 batches=b),
                                                 ops.local_steps_ref(MODEL, theta.clone(), data, steps=1, lr=0.05,
                                                                     batches=b)) <= 1e-6,
                        4 * (P + 1) * C * BATCH),
        "gradients": (lambda: ops.gradients(MODEL, theta, data),
                      lambda out: max_abs_diff(out, ops.gradients_ref(MODEL, theta, data)) <= 1e-6,
                      4 * (P + 1) * C * SMALL_ROWS),
        "evaluate": (lambda: ops.evaluate(MODEL, theta, data),
                     lambda out: torch.equal(out[1], ops.evaluate_ref(MODEL, theta, data)[1])
                     and max_abs_diff(out[0], ops.evaluate_ref(MODEL, theta, data)[0]) <= 1e-5 * float(out[0].abs().max()),
                     2 * (P + 1) * C * SMALL_ROWS),
        "kmeans_assign": (lambda: ops.kmeans_assign(points, centroids),
                          lambda out: torch.equal(out[0], ops.kmeans_assign_ref(points, centroids)[0]),
                          2 * SMALL_ROWS * C * P),
        "sample_batches": (lambda: ops.sample_batches(data, steps=1, batch_size=BATCH, seed=3, counter=7),
                           lambda out: torch.equal(out, ops.sample_batches_ref(data, steps=1, batch_size=BATCH,
                                                                               seed=3, counter=7)),
                           None),
    }


@pytest.mark.parametrize("call", ["matmul", "local_steps", "gradients", "evaluate", "kmeans_assign",
                                  "sample_batches"])
def test_small_call(benchmark, call):
    run, ok, flops = expected(("small_calls",), _calls)[call]
    impl = "torch" if call == "matmul" else "native"

    def timed():
        if impl == "native":
            with backend.use("native"):
                return run()
        return run()

    def check(out):
        assert ok(out), f"{call}: the small call disagrees with its reference"

    measure(benchmark, op="small_calls", size="small", group=GROUP, impl=f"{impl} {call}", run=timed, check=check,
            flops=flops, baseline=call == "matmul", info={"call": call})


@pytest.mark.op("reference_points")
@pytest.mark.parametrize("what", ["matmul_2048", "copy_256MiB"])
def test_machine_reference_points(benchmark, what):
    g = torch.Generator().manual_seed(1)
    if what == "matmul_2048":
        a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
        c = torch.empty(2048, 2048)

        def run():
            return torch.mm(a, b, out=c)

        def check(out):
            assert torch.allclose(out[:4], a[:4].double().mm(b.double()).float(), rtol=1e-3, atol=1e-2)
        kw = dict(flops=2 * 2048 ** 3)
    else:
        n = (256 << 20) // 4
        src, dst = torch.randn(n, generator=g), torch.empty(n)

        def run():
            return dst.copy_(src)

        def check(out):
            assert torch.equal(out[:1000], src[:1000])
        kw = dict(bytes_moved=2 * n * 4)
    measure(benchmark, op="reference_points", size="", group="reference points: this machine's matmul and copy",
            impl=f"torch {what}", run=run, check=check, baseline=False, **kw)
