"""The batched CNN of ``pflcore/backends/cnn_batched.py`` (on the CPU the native direct
convolutions of ``cnn_native.py``, also run here with their torch reference operations, or the
grouped convolutions over clients; the im2col + batched GEMMs of ``cnn_im2col.py`` elsewhere, run
here on the CPU too) against the references (a per-row ``torch.nn`` module with autograd) and the torch.func path,
over the configurations ``CNN`` allows: one or three input channels, odd image sizes, padding,
pooling windows that leave a remainder, no hidden layer, m = 1 and minibatches of one row.
Tolerances: conftest.TOL (the same sums in another order)."""
from __future__ import annotations

import pytest
import torch

from pflcore import models, ops
from pflcore.backends import cnn_batched, cnn_native
from pflcore.backends import nets as _nets

from conftest import DTYPES, TOL, make_data

CONFIGS = {
    "mnist": dict(),  # the unifying paper's net, 28×28 (the default)
    "odd_image_pool3": dict(p=7 * 9, C=2, image_shape=(1, 7, 9), channels=(2, 3), kernel_size=2, pool=3, padding=2,
                            hidden=(5,)),
    "rgb_padding_no_hidden": dict(p=3 * 11 * 13, C=4, image_shape=(3, 11, 13), channels=(4,), kernel_size=3,
                                  padding=1, hidden=()),
    "three_conv_two_hidden": dict(p=64, C=3, channels=(3, 2, 2), kernel_size=2, padding=1, hidden=(6, 4),
                                  l2=0.05),
    # RGB: the zero 4th input channel of the grouped path; odd sizes, padding and a pool of 3
    "rgb_pool3_odd": dict(p=3 * 9 * 7, C=5, image_shape=(3, 9, 7), channels=(5, 3), kernel_size=3, pool=3,
                          padding=2, hidden=(7,)),
    # a kernel wider than 8: the native backward's dense sums (the pooled one serves k <= 8)
    "kernel9_dense_backward": dict(p=20 * 22, C=3, image_shape=(1, 20, 22), channels=(2, 3), kernel_size=9,
                                   padding=4, hidden=(5,)),
}


@pytest.fixture(params=["native", "torch_ops", "grouped", "im2col"], autouse=True)
def path(request, monkeypatch):
    """Every test on every chunk implementation: ``native`` (the CPU default), ``torch_ops`` (the
    same chunk on cnn_native's torch reference operations), ``grouped`` (the CPU without the
    native module) and ``im2col`` (what non-CPU devices run)."""
    if request.param == "native" and cnn_native.native_ops() is None:
        pytest.skip("the native module has no CNN kernels")
    if request.param == "torch_ops":
        monkeypatch.setattr(cnn_native, "native_ops", lambda: cnn_native.TorchOps())
    if request.param in ("grouped", "im2col"):
        monkeypatch.setattr(cnn_batched, "CPU_PATH", "grouped")
    if request.param == "im2col":
        monkeypatch.setattr(cnn_batched, "GROUPED_DEVICES", set())
    return request.param


def _theta(net, m, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (net.initial(m, dtype, seed=seed) + 0.2 * torch.randn(m, net.d, generator=g, dtype=dtype)).contiguous()


def _data(net, sizes, dtype, seed):
    d_ = make_data(net, sizes, dtype, seed=seed)
    d_.x[::3, : net.p // 2] = 0.0  # blank image parts: equal values, ties inside the pooling windows
    return d_


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_and_evaluate_equal_the_reference(name, dtype):
    net = models.CNN(**CONFIGS[name])
    sizes = [1, 5, 2] if name == "mnist" else [1, 6, 3, 2]
    d_ = _data(net, sizes, dtype, seed=1)
    theta = _theta(net, len(sizes), dtype, seed=2)
    want = ops.gradients_ref(net, theta, d_)
    torch.testing.assert_close(ops.gradients(net, theta, d_), want, **TOL[dtype])
    assert float(want.abs().max()) > 1e-3
    loss, correct, count = ops.evaluate(net, theta, d_)
    rl, rc, rn = ops.evaluate_ref(net, theta, d_)
    torch.testing.assert_close(loss, rl, **TOL[dtype])
    assert torch.equal(correct, rc) and torch.equal(count, rn)


@pytest.mark.parametrize("name, batch", [("odd_image_pool3", 1), ("rgb_padding_no_hidden", None),
                                         ("three_conv_two_hidden", 3), ("rgb_pool3_odd", 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_local_steps_equal_the_reference(name, dtype, batch):
    """prox toward per-row anchors, grad_scale (0 included), rows that repeat clients; full
    batches (ragged, padded) and minibatches of 1 and 3 rows."""
    net = models.CNN(**CONFIGS[name])
    d_ = _data(net, [1, 4, 2], dtype, seed=3)
    rows = torch.tensor([2, 0, 2, 1], dtype=torch.int64)
    theta = _theta(net, 4, dtype, seed=4)
    kw = dict(steps=2, lr=0.1, prox=0.5, anchor=_theta(net, 4, dtype, seed=5), rows=rows,
              grad_scale=torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=dtype),
              batches=None if batch is None else ops.sample_batches(d_, steps=2, batch_size=batch, seed=6, counter=0,
                                                                    clients=rows))
    got, want = theta.clone(), theta.clone()
    ops.local_steps(net, got, d_, **kw)
    ops.local_steps_ref(net, want, d_, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert float((got - theta).abs().max()) > 1e-3


def test_one_client_one_row_and_frozen_layers():
    """m = 1, B = 1, C = 1 input channel; ``lr_scale`` freezing the conv layers (FedRep's body)
    leaves them bitwise unchanged and moves the head as the reference does."""
    net = models.CNN(p=25, C=3, image_shape=(1, 5, 5), channels=(2,), kernel_size=3, hidden=(4,))
    d_ = _data(net, [1], torch.float64, seed=7)
    theta = _theta(net, 1, torch.float64, seed=8)
    b = ops.sample_batches(d_, steps=3, batch_size=1, seed=9, counter=0)
    conv = sum(torch.Size(s).numel() for n, s in net.param_shapes if n.startswith("0."))
    scale = torch.ones(net.d, dtype=torch.float64)
    scale[:conv] = 0.0
    got, want = theta.clone(), theta.clone()
    ops.local_steps(net, got, d_, steps=3, lr=0.2, batches=b, lr_scale=scale)
    ops.local_steps_ref(net, want, d_, steps=3, lr=0.2, batches=b, lr_scale=scale)
    assert torch.equal(got[:, :conv], theta[:, :conv])
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    assert float((got - theta).abs().max()) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_math_equals_the_torch_func_path(dtype, monkeypatch):
    """The hand-written chunk against ``vmap(grad)`` of the module on the same rows (a CIFAR-shaped
    input, row weights that are not 1/B): the same function to rounding."""
    net = models.CNN(p=3 * 16 * 16, image_shape=(3, 16, 16), channels=(4, 6), kernel_size=3, hidden=(8,))
    g = torch.Generator().manual_seed(10)
    theta = _theta(net, 3, dtype, seed=10)
    x = torch.randn(3, 5, net.p, generator=g, dtype=dtype)
    y = torch.randint(0, net.C, (3, 5), generator=g)
    w = torch.rand(3, 5, generator=g, dtype=dtype)
    out = torch.empty_like(theta)
    cnn_batched.gradient_into(net, theta, x, y, w, out)
    want = net.flatten(_nets._grad_fn(net)(net.split(theta), x, y, w))
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(cnn_batched.logits(net, theta, x), torch.func.vmap(net.logits)(net.split(theta), x),
                               **TOL[dtype])


@pytest.mark.parametrize("cin", [1, 3])
def test_results_do_not_depend_on_the_thread_count(cin):
    net = models.CNN(p=cin * 100, C=3, image_shape=(cin, 10, 10), channels=(3, 4), kernel_size=3, hidden=(5,))
    d_ = _data(net, [4] * 40, torch.float32, seed=11)
    theta = _theta(net, 40, torch.float32, seed=12)
    b = ops.sample_batches(d_, steps=2, batch_size=3, seed=13, counter=0)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            t = theta.clone()
            ops.local_steps(net, t, d_, steps=2, lr=0.1, batches=b)
            outs.append((t, ops.gradients(net, theta, d_), ops.evaluate(net, theta, d_)[0]))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for u, v in zip(outs[0], other):
            assert torch.equal(u, v)
