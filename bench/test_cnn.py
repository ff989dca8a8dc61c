"""The CNN local step across clients (issue 24): 32 clients, one step on a minibatch of B = 20.

Two nets (``algorithms.cnn_workloads``): the unifying paper's MNIST CNN and a CIFAR-shaped CNN
(two 5x5 conv layers of 6 and 16 channels, 120 and 84 hidden units; synthetic 3x32x32 rows).
Implementations, the same SGD step from the same models on the same rows:

  native    ``ops.local_steps`` on the CPU's default path: the direct convolutions of
            ``csrc/cpu/cnn.cpp`` (``backends/cnn_native.py``), the baseline
  grouped   ``ops.local_steps`` with the chunks on oneDNN's grouped convolutions
            (``cnn_batched.CPU_PATH = "grouped"``: the path without the native module)
  vmap      ``ops.local_steps`` through ``torch.func`` (vmap of the module's gradient)
  loop      a per-client ``nn.Module`` loop (``algorithms.cnn_loop``): what users write

Agreement before timing: each result equals the loop's step within 1e-4 (float32; a max-pooling
window whose two largest inputs lie within rounding may send a row's gradient to either, so a few
clients may differ by more: at most 2 of 32). FLOPs from the layer shapes (``algorithms.cnn_flops``).
``python bench/algorithms.py --only cnn`` runs the same comparison on 100 clients at 1 and 2
threads with float64 checks.
"""
from __future__ import annotations

import pytest
import torch

import pflcore
from pflcore import ops
from pflcore.backends import cnn_batched, cnn_native

from _suite import cached, measure
from algorithms import cnn_flops, cnn_loop, cnn_workloads, torch_func_cnn

CLIENTS, B, LR = 32, 20, 0.05
IMPLS = ["native", "grouped", "vmap", "loop"]


@cached
def workload(net: str):
    model = cnn_workloads()[net]
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=CLIENTS, dim=model.p, seed=0, max_size=200)
    theta = model.initial(CLIENTS, seed=0)
    b = ops.sample_batches(fed.train, steps=1, batch_size=B, seed=1, counter=0, clients=torch.arange(CLIENTS))
    return model, fed.train, theta, b


@cached
def loop_step(net: str) -> torch.Tensor:
    model, data, theta, b = workload(net)
    return cnn_loop(model, data, theta, b, LR)


@pytest.mark.op("cnn_step")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("net", ["mnist", "cifar"])
def test_cnn_step(benchmark, monkeypatch, net, impl):
    model, data, theta, b = workload(net)
    if impl == "native" and cnn_native.native_ops() is None:
        pytest.skip("the native module has no CNN kernels")
    if impl == "grouped":
        monkeypatch.setattr(cnn_batched, "CPU_PATH", "grouped")
    want = loop_step(net)

    if impl == "loop":
        def run():
            return cnn_loop(model, data, theta, b, LR)
    elif impl == "vmap":
        def run():
            with torch_func_cnn():
                t = theta.clone()
                ops.local_steps(model, t, data, steps=1, lr=LR, batches=b)
            return t
    else:
        def run():
            t = theta.clone()
            ops.local_steps(model, t, data, steps=1, lr=LR, batches=b)
            return t

    def check(out):
        per_client = (out - want).abs().amax(dim=1)
        over = int((per_client > 1e-4).sum())
        assert over <= 2, f"{impl}: {over} of {CLIENTS} clients differ from the loop's step by more than 1e-4"
        assert bool(torch.isfinite(out).all())

    measure(benchmark, op="cnn_step", size=net,
            group=f"cnn_step: {net} CNN, {CLIENTS} clients x 1 step, B = {B}",
            impl=impl, run=run, check=check, flops=CLIENTS * cnn_flops(model, B), baseline=impl == "native")
