"""Torch nets (MLP, CNN) through the ops, vmapped over model rows (DESIGN.md §3, §4; issue 7).

Every vmapped op is compared with its ``*_ref``: a per-row loop of torch.autograd on a
``torch.nn`` module holding the row's parameters (which also checks the parameter layout).
Tolerances: conftest.TOL (the two sides sum the same terms in another order: rounding only).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import pflcore
from pflcore import ClientData, data, models, ops
from pflcore import algorithms as A
from pflcore.backends import nets as _nets

from conftest import DTYPES, TOL, make_data


def _nets_under_test():
    return {
        "mlp": lambda: models.MLP(13, (7, 5), 4, l2=0.01),
        "mlp_vmap": lambda: models.MLP(13, 6, 3),           # run with the generic torch.func path
        "cnn": lambda: models.CNN(36, 3, channels=(2, 3), kernel_size=3, padding=1, hidden=(5,), l2=0.02),
        "cnn_vmap": lambda: models.CNN(36, 3, channels=(2,), kernel_size=3, padding=1, hidden=(), l2=0.02),
    }


NETS = list(_nets_under_test())


@pytest.fixture
def net_factory(request, monkeypatch):
    kind = request.param
    if kind == "mlp_vmap":
        monkeypatch.setattr(_nets, "HAND_WRITTEN_MLP", False)
    if kind == "cnn_vmap":  # the generic torch.func path, kept for other nets
        monkeypatch.setattr(_nets, "HAND_WRITTEN_CNN", False)
    return _nets_under_test()[kind]


def _theta(net, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return net.initial(m, dtype, seed=seed) + 0.3 * torch.randn(m, net.d, generator=g, dtype=dtype)


SHAPES = {"odd": [1, 7, 3, 12, 2], "one_client": [5], "one_row_each": [1, 1, 1]}


@pytest.mark.parametrize("net_factory", NETS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_vmapped_gradients_equal_per_client_autograd(net_factory, dtype, shape):
    net = net_factory()
    sizes = SHAPES[shape]
    d_ = make_data(net, sizes, dtype, seed=1)
    theta = _theta(net, len(sizes), dtype)
    got = ops.gradients(net, theta, d_)
    want = ops.gradients_ref(net, theta, d_)
    assert got.shape == (len(sizes), net.d)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert float(want.abs().max()) > 1e-3  # a real gradient, not zeros
    # minibatch gradients on rows that repeat clients
    rows = torch.tensor([0] * 2 + [len(sizes) - 1], dtype=torch.int64)
    th = _theta(net, 3, dtype, seed=2)
    b = ops.sample_batches(d_, steps=1, batch_size=4, seed=3, counter=0, clients=rows)[:, 0].contiguous()
    torch.testing.assert_close(ops.gradients(net, th, d_, rows=rows, batches=b),
                               ops.gradients_ref(net, th, d_, rows=rows, batches=b), **TOL[dtype])


@pytest.mark.parametrize("net_factory", NETS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("anchor_kind", ["none", "shared", "per_row"])
@pytest.mark.parametrize("minibatch", [False, True])
def test_local_steps_match_reference(net_factory, dtype, anchor_kind, minibatch):
    net = net_factory()
    sizes = [1, 9, 4, 2]
    d_ = make_data(net, sizes, dtype, seed=4)
    rows = torch.tensor([3, 0, 0, 1, 2], dtype=torch.int64)  # repeats and reorders clients
    theta = _theta(net, 5, dtype, seed=5)
    anchor = {"none": None, "shared": _theta(net, 1, dtype, seed=6)[0],
              "per_row": _theta(net, 5, dtype, seed=7)}[anchor_kind]
    scale = torch.tensor([1.0, 0.0, 2.5, 0.5, 1.0], dtype=dtype)
    steps = 3
    batches = (ops.sample_batches(d_, steps=steps, batch_size=3, seed=8, counter=1, clients=rows)
               if minibatch else None)
    kw = dict(steps=steps, lr=0.05, prox=0.7 if anchor_kind != "none" else 0.3, anchor=anchor, rows=rows,
              batches=batches, grad_scale=scale)
    got, want = theta.clone(), theta.clone()
    out = ops.local_steps(net, got, d_, **kw)
    assert out is got  # in place
    ops.local_steps_ref(net, want, d_, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert float((got - theta).abs().max()) > 1e-3  # the steps moved the parameters
    # grad_scale = 0 leaves only the l2 and prox terms: row 1 never sees its loss
    if net.l2 == 0 and anchor_kind == "none":
        torch.testing.assert_close(got[1], theta[1] * (1 - 0.05 * 0.3) ** steps, **TOL[dtype])


@pytest.mark.parametrize("net_factory", NETS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_evaluate_matches_reference(net_factory, dtype):
    net = net_factory()
    sizes = [1, 6, 13, 2]
    d_ = make_data(net, sizes, dtype, seed=9)
    theta = _theta(net, 4, dtype, seed=10)
    rows = torch.tensor([2, 2, 0, 3, 1], dtype=torch.int64)
    th = _theta(net, 5, dtype, seed=11)
    for args in ((theta, {}), (th, {"rows": rows})):
        loss, correct, count = ops.evaluate(net, args[0], d_, **args[1])
        rl, rc, rn = ops.evaluate_ref(net, args[0], d_, **args[1])
        torch.testing.assert_close(loss, rl, **TOL[dtype])
        assert torch.equal(correct, rc) and torch.equal(count, rn)
    assert count.tolist() == [13, 13, 1, 2, 6]


@pytest.mark.parametrize("net_factory", NETS, indirect=True)
def test_a_clients_update_does_not_depend_on_other_clients(net_factory):
    """Perturbing other clients' parameters and data leaves client 0's result bitwise equal;
    running client 0 alone gives the same result to float tolerance."""
    net = net_factory()
    dtype = torch.float32
    sizes = [4, 6, 5]
    d_ = make_data(net, sizes, dtype, seed=12)
    theta = _theta(net, 3, dtype, seed=13)
    b = ops.sample_batches(d_, steps=2, batch_size=3, seed=1, counter=0)

    def all_ops(dd, th):
        t = th.clone()
        ops.local_steps(net, t, dd, steps=2, lr=0.1, prox=0.5, anchor=th, batches=b)
        t2 = th.clone()
        ops.local_steps(net, t2, dd, steps=2, lr=0.1)
        return [t[0], t2[0], ops.gradients(net, th, dd)[0]] + [v[0] for v in ops.evaluate(net, th, dd)]

    base = all_ops(d_, theta)
    x2, y2 = d_.x.clone(), d_.y.clone()
    x2[4:] += torch.randn_like(x2[4:])
    y2[4:] = (y2[4:] + 1) % net.C
    th2 = theta.clone()
    th2[1:] *= -3.0
    other = all_ops(ClientData(x2, y2, d_.offsets), th2)
    for u, v in zip(base, other):
        assert torch.equal(u, v)
    # client 0 alone (a batch of one model row)
    alone = theta[:1].clone()
    ops.local_steps(net, alone, d_, steps=2, lr=0.1, prox=0.5, anchor=theta[:1], batches=b[:1].contiguous(),
                    rows=torch.tensor([0]))
    torch.testing.assert_close(alone[0], base[0], **TOL[dtype])


def test_hand_written_mlp_equals_torch_func_path(monkeypatch):
    net = models.MLP(11, (6, 4), 5, l2=0.03)
    d_ = make_data(net, [3, 1, 8], torch.float64, seed=14)
    theta = _theta(net, 3, torch.float64, seed=15)
    b = ops.sample_batches(d_, steps=4, batch_size=5, seed=2, counter=3)

    def outputs():
        t = theta.clone()
        ops.local_steps(net, t, d_, steps=4, lr=0.1, prox=2.0, anchor=theta.flip(0).contiguous(), batches=b)
        return t, ops.gradients(net, theta, d_)

    fast = outputs()
    monkeypatch.setattr(_nets, "HAND_WRITTEN_MLP", False)
    slow = outputs()
    for u, v in zip(fast, slow):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


def test_mlp_without_hidden_layers_is_softmax_regression():
    """MLP(p, (), C) computes the Softmax GLM's objective; its layout is [W (C×p), b (C)] where
    the GLM's is [[Wᵀ]; [b]] ((p+1)×C), so gradients agree after the layout change."""
    p, C = 7, 4
    mlp, glm = models.MLP(p, (), C, l2=0.1), models.Softmax(p, C, l2=0.1)
    d_ = make_data(glm, [5, 2, 9], torch.float64, seed=16)
    theta = _theta(mlp, 3, torch.float64, seed=17)
    W, bias = theta[:, : C * p].view(3, C, p), theta[:, C * p:]
    as_glm = torch.cat([W.transpose(1, 2), bias[:, None, :]], 1).reshape(3, -1).contiguous()
    g_mlp = ops.gradients(mlp, theta, d_)
    g_glm = ops.gradients(glm, as_glm, d_).view(3, p + 1, C)
    torch.testing.assert_close(g_mlp[:, : C * p].view(3, C, p), g_glm[:, :p].transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_mlp[:, C * p:], g_glm[:, p], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ops.evaluate(mlp, theta, d_)[0], ops.evaluate(glm, as_glm, d_)[0])


def test_default_cnn_is_table_1_of_the_unifying_paper():
    cnn = models.CNN()
    assert cnn.d == 11_910  # the paper's total
    assert [s for _, s in cnn.param_shapes] == [(10, 1, 5, 5), (10,), (20, 10, 5, 5), (20,), (20, 320), (20,),
                                                (10, 20), (10,)]
    assert models.MLP(784, 100, 10).d == 79_510


def test_initial_is_m_copies_of_one_seeded_draw():
    net = models.MLP(9, 5, 3)
    state = torch.random.get_rng_state()
    a = net.initial(4, torch.float32, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is not used
    assert a.shape == (4, net.d) and a.is_contiguous()
    assert all(torch.equal(a[0], a[i]) for i in range(4))
    assert torch.equal(a, net.initial(4, torch.float32, seed=3))
    assert not torch.equal(a[0], net.initial(1, torch.float32, seed=4)[0])
    assert torch.equal(net.initial(1, torch.float64, seed=3)[0].float(), a[0])
    W1 = a[0, :45]
    assert float(W1.abs().max()) <= 1 / 3 and float(W1.std()) > 0.1  # U(−1/√9, 1/√9)
    # the layout is parameters_to_vector of the nn.Module
    mod = net.module()
    torch.nn.utils.vector_to_parameters(a[0], mod.parameters())
    assert torch.equal(torch.nn.utils.parameters_to_vector(mod.parameters()), a[0])


def test_numpy_in_numpy_out():
    net = models.MLP(5, 3, 2)
    d_ = make_data(net, [2, 3], torch.float32, seed=18)
    th = _theta(net, 2, torch.float32).numpy().copy()
    before = th.copy()
    out = ops.local_steps(net, th, d_, steps=2, lr=0.1)
    assert out is th and not np.array_equal(th, before)
    assert isinstance(ops.gradients(net, th, d_), np.ndarray)
    assert all(isinstance(v, np.ndarray) for v in ops.evaluate(net, th, d_))


def test_bad_input_raises_value_errors():
    net = models.MLP(5, 3, 2)
    d_ = make_data(net, [2, 3], torch.float32, seed=19)
    th = net.initial(2)
    with pytest.raises(ValueError, match=r"theta: expected shape \[m, d\] = \[2, 26\], got \[2, 25\]"):
        ops.local_steps(net, th[:, :-1].contiguous(), d_, steps=1, lr=0.1)
    with pytest.raises(ValueError, match="theta: expected dtype float32"):
        ops.gradients(net, th.double(), d_)
    with pytest.raises(ValueError, match="p = 6"):
        ops.evaluate(models.MLP(6, 3, 2), models.MLP(6, 3, 2).initial(2), d_)
    with pytest.raises(ValueError, match=r"^y: expected labels in \[0, 2\), got y\[0\] = 2$"):
        ops.gradients(net, th, ClientData(d_.x, torch.full_like(d_.y, 2), d_.offsets))
    with pytest.raises(ValueError, match="anchor: expected shape"):
        ops.local_steps(net, th, d_, steps=1, lr=0.1, anchor=th[:, :3].contiguous())
    bad = torch.zeros(2, 1, 2, dtype=torch.int32)  # row 0 of client 1 is outside its rows [2, 5)
    with pytest.raises(ValueError, match="batches: index 0"):
        ops.local_steps(net, th, d_, steps=1, lr=0.1, batches=bad)
    with pytest.raises(ValueError, match=r"batches: expected shape \[R, steps, B\]"):
        ops.local_steps(net, th, d_, steps=2, lr=0.1, batches=bad)
    with pytest.raises(ValueError, match="lr: expected a number > 0"):
        ops.local_steps(net, th, d_, steps=1, lr=0.0)
    with pytest.raises(ValueError, match="grad_scale: expected shape"):
        ops.local_steps(net, th, d_, steps=1, lr=0.1, grad_scale=torch.ones(3))
    with pytest.raises(ValueError, match="theta: expected a contiguous"):
        ops.local_steps(net, net.initial(2, seed=0).t().contiguous().t(), d_, steps=1, lr=0.1)
    with pytest.raises(ValueError, match="hidden"):
        models.MLP(5, (3, 0), 2)
    with pytest.raises(ValueError, match="C: a classifier net needs at least 2"):
        models.MLP(5, 3, 1)
    with pytest.raises(ValueError, match="image_shape: p = 50 is not a square"):
        models.CNN(50, 10)
    with pytest.raises(ValueError, match="kernel_size: conv layer 1"):
        models.CNN(64, 10)  # 8×8 digits with the MNIST kernels: 8 → 4 → 4 − 5 + 1 < 1
    with pytest.raises(ValueError, match="image_shape: expected"):
        models.CNN(64, 10, image_shape=(1, 4, 4))


def test_hvp_matches_double_backward():
    net = models.MLP(6, 4, 3, l2=0.05)
    d_ = make_data(net, [5, 4], torch.float64, seed=20)
    theta, v = _theta(net, 2, torch.float64, seed=21), _theta(net, 2, torch.float64, seed=22)
    b = ops.sample_batches(d_, steps=1, batch_size=6, seed=0, counter=0)[:, 0].contiguous()
    got = ops.hvp(net, theta, v, d_, batches=b)
    torch.testing.assert_close(got, ops.hvp_ref(net, theta, v, d_, batches=b), rtol=1e-11, atol=1e-11)
    # against a central finite difference of the gradient
    eps = 1e-6
    fd = (ops.gradients(net, theta + eps * v, d_, batches=b) - ops.gradients(net, theta - eps * v, d_, batches=b)) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-6)


def _small_federation(m=6, seed=0):
    return data.digits(num_clients=m, scheme="classes", classes_per_client=3, seed=seed, num_samples=600)


ALGORITHMS = {
    "LocalTrain": lambda: A.LocalTrain(lr=0.1, steps=3, batch_size=10),
    "FedAvg": lambda: A.FedAvg(lr=0.1, local_steps=3, batch_size=10),
    "FedProx": lambda: A.FedProx(lam=0.5, local_lr=0.1, global_lr=1.0, local_steps=3),
    "pFedMe": lambda: A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=2, batch_size=10),
    "Per-FedAvg FO": lambda: A.PerFedAvg(alpha=0.05, beta=0.05, local_steps=3, batch_size=10),
    "Per-FedAvg HF": lambda: A.PerFedAvg(alpha=0.05, beta=0.05, variant="HF", local_steps=3, batch_size=10),
    "FedPi": lambda: A.FedPi(eta=0.5, prox_steps=3),
    "FedSplit+Anderson": lambda: A.Accelerated(A.FedSplit(eta=0.5, prox_steps=3), memory=2),
    "FedAvg (grand scheme)": lambda: A.GrandScheme(1, 1, 1, 0.1, local_update="gradient", prox_steps=3),
    "CGPFL": lambda: A.REGISTRY["cgpfl"](num_contexts=2, lam=12, lr=0.05, inner_steps=2, local_rounds=2,
                                          batch_size=10),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_runs_with_an_mlp(name):
    fed = _small_federation()
    net = models.MLP(64, 16, 10)
    res = pflcore.run(ALGORITHMS[name](), fed, net, rounds=3, clients_per_round=4, progress=False)
    last = res.history[-1]
    assert last["round"] == 3
    acc = last.get("personalized_acc", last.get("global_acc"))
    assert acc is not None and 0.0 <= acc <= 1.0
    assert last["train_loss"] < res.history[0]["train_loss"]  # three rounds of training lowered the loss
    assert "f_star" not in res.config  # no exact optimum for a net


def test_other_registered_algorithms_run_with_an_mlp():
    """Whatever else the registry holds runs unchanged on a net (default hyperparameters where it
    has them, else skipped by name in the message)."""
    import inspect
    fed = _small_federation(m=4)
    net = models.MLP(64, 8, 10)
    covered = {"localtrain", "fedavg", "globaltrain", "fedprox", "pfedme", "perfedavg", "fedpi", "fedsplit",
               "grandscheme", "cgpfl", "fedproxclassic", "fedrp"}
    for key, cls in A.REGISTRY.items():
        if key in covered:
            continue
        sig = inspect.signature(cls.__init__)
        required = [n for n, p in sig.parameters.items() if n != "self" and p.default is inspect.Parameter.empty
                    and p.kind is p.POSITIONAL_OR_KEYWORD]
        kwargs = {n: {"lr": 0.05, "lam": 1.0, "num_contexts": 2, "max_contexts": 2, "mu": 1.0, "alpha": 0.5,
                      "beta": 0.05, "eta": 0.5, "local_lr": 0.05, "global_lr": 1.0, "p": 0.3,
                      "num_clusters": 2}.get(n, 1) for n in required}
        res = pflcore.run(cls(**kwargs), fed, net, rounds=2, progress=False)
        assert res.history[-1]["round"] == 2, key


def test_exact_prox_needs_least_squares():
    fed = _small_federation(m=3)
    with pytest.raises(ValueError, match="LeastSquares"):
        pflcore.run(A.FedPi(eta=0.5, prox="exact"), fed, models.MLP(64, 8, 10), rounds=1, progress=False)


def test_resume_equals_uninterrupted_run_bitwise_with_a_cnn(tmp_path):
    fed = _small_federation(m=4)
    net = models.CNN(64, 10, channels=(3,), kernel_size=3, padding=1, hidden=())
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=8)
    full = pflcore.run(alg, fed, net, rounds=4, seed=3, progress=False)
    pflcore.run(alg, fed, net, rounds=2, seed=3, progress=False, checkpoint=str(tmp_path), checkpoint_every=2)
    resumed = pflcore.resume(str(tmp_path), rounds=4, progress=False)
    assert torch.equal(full.personalized, resumed.personalized)
    assert torch.equal(full.global_model, resumed.global_model)


SCRIPT = r"""
import hashlib, torch
from pflcore import ClientData, models, ops
g = torch.Generator().manual_seed(0)
sizes = torch.randint(1, 60, (40,), generator=g)
off = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
N = int(off[-1])
data = ClientData(torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g), off)
h = hashlib.sha256()
for net in (models.MLP(64, (32, 16), 10, l2=0.01), models.MLP(64, 40, 10, l2=0.01),  # torch; native (1 layer)
            models.CNN(64, 10, kernel_size=3, padding=1)):
    for R in (40, 1):  # many chunks, and a single model row (one chunk)
        rows = torch.arange(R) if R > 1 else torch.tensor([17])
        theta = net.initial(R, seed=1)
        b = ops.sample_batches(data, steps=3, batch_size=16, seed=4, counter=2, clients=rows)
        ops.local_steps(net, theta, data, steps=3, lr=0.1, prox=0.2, anchor=theta.mean(0), batches=b, rows=rows)
        ops.local_steps(net, theta, data, steps=2, lr=0.1, rows=rows)
        hv = ops.hvp(net, theta, theta.flip(0).contiguous(), data, batches=b[:, 0].contiguous(), rows=rows)
        for t in (theta, hv, ops.gradients(net, theta, data, rows=rows), *ops.evaluate(net, theta, data, rows=rows)):
            h.update(t.numpy().tobytes())
print(h.hexdigest())
"""


def test_nets_bitwise_identical_with_one_two_and_three_threads():
    """MKL's one- and many-thread GEMMs round differently; the net ops run every chunk of model
    rows on one thread (pflcore/backends/nets.py), so the thread count must not change a bit."""
    digests = []
    for threads in (1, 2, 3):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip())
    assert len(digests[0]) == 64 and digests[0] == digests[1] == digests[2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [(), (6,), (7, 5)])
def test_hand_written_mlp_prox_steps_on_repeated_minibatches_match_reference(dtype, hidden):
    """pFedMe's call: K steps on ONE minibatch repeated (the hand-written path gathers it once),
    prox toward a per-row anchor with l2 = 0 (the lerp_ branch), a shared anchor, grad_scale."""
    net = models.MLP(9, hidden, 4)
    sizes = [5, 1, 8, 3]
    d_ = make_data(net, sizes, dtype, seed=23)
    rows = torch.tensor([2, 0, 3, 3, 1], dtype=torch.int64)
    b = ops.sample_batches(d_, steps=2, batch_size=4, seed=5, counter=7, clients=rows)
    batches = b.repeat_interleave(3, dim=1).contiguous()  # 2 local rounds x 3 inner steps
    theta = _theta(net, 5, dtype, seed=24)
    scale = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.5], dtype=dtype)
    for anchor, scale in ((_theta(net, 5, dtype, seed=25), None), (_theta(net, 1, dtype, seed=26)[0], scale)):
        kw = dict(steps=6, lr=0.05, prox=4.0, anchor=anchor, rows=rows, batches=batches, grad_scale=scale)
        got, want = theta.clone(), theta.clone()
        ops.local_steps(net, got, d_, **kw)
        ops.local_steps_ref(net, want, d_, **kw)
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert float((got - theta).abs().max()) > 1e-3


def test_hand_written_mlp_evaluate_counts_first_maximal_logit():
    """The hand-written MLP evaluation (logits classes-first) counts a row correct when its
    label is the FIRST maximal logit, as the vmapped path and the reference do."""
    net = models.MLP(3, (), 3)
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    d_ = ClientData(x, torch.tensor([0, 1, 0]), torch.tensor([0, 3]))
    theta = torch.cat([torch.eye(3).reshape(-1), torch.zeros(3)])[None]  # logits = x
    loss, correct, count = ops.evaluate(net, theta, d_)
    # row 0: label 0 is the max; row 1: all tie, the first (0) is not label 1; row 2: max at 1, label 0
    assert correct.tolist() == [1] and count.tolist() == [3]
    rl, rc, _ = ops.evaluate_ref(net, theta, d_)
    assert torch.equal(correct, rc)
    torch.testing.assert_close(loss, rl)


@pytest.mark.parametrize("net_factory", NETS, indirect=True)
def test_evaluate_of_clients_cut_into_blocks_matches_reference(net_factory):
    """Clients of 1 to 100 rows: each client's rows are evaluated in blocks of L rows (several
    blocks for the large ones) and summed per client; one shared model [d] reads the same."""
    net = net_factory()
    sizes = [1, 40, 3, 100, 2, 17]
    d_ = make_data(net, sizes, torch.float64, seed=27)
    theta = _theta(net, 6, torch.float64, seed=28)
    loss, correct, count = ops.evaluate(net, theta, d_)
    rl, rc, rn = ops.evaluate_ref(net, theta, d_)
    torch.testing.assert_close(loss, rl, **TOL[torch.float64])
    assert torch.equal(correct, rc) and count.tolist() == sizes
    shared = _theta(net, 1, torch.float64, seed=29)[0]
    got = ops.evaluate(net, shared, d_)
    for u, v in zip(got, ops.evaluate(net, shared.expand(6, net.d).contiguous(), d_)):
        assert torch.equal(u, v)


@pytest.mark.parametrize("p,hidden,C", [(60, 100, 10), (7, 5, 2), (13, 37, 3), (9, 128, 16), (5, 16, 11), (6, 129, 4)])
def test_native_mlp_steps_match_reference(p, hidden, C, monkeypatch, cpu_level):
    """A one-hidden-layer float32 MLP's minibatch steps run in csrc/cpu/mlp.cpp where the build has
    AVX-512 (hidden <= 128, C <= 16): against the reference for every option (l2, prox with a
    per-row or shared anchor, grad_scale, minibatches of 1 and 4 rows and one not a multiple of 4,
    a repeated minibatch), with the native path seen to run wherever it is available."""
    net = models.MLP(p, hidden, C, l2=0.02)
    d_ = make_data(net, [7, 30, 12, 21], torch.float32, seed=31)
    theta = _theta(net, 4, torch.float32, seed=32)
    taken = []
    real = _nets._native_mlp_steps
    monkeypatch.setattr(_nets, "_native_mlp_steps", lambda *a: taken.append(real(*a)) or taken[-1])
    for B, anchor, scale, prox in ((1, None, None, 0.0), (4, _theta(net, 4, torch.float32, seed=33), None, 3.0),
                                   (9, _theta(net, 1, torch.float32, seed=34)[0], torch.tensor([0.5, 1.0, 2.0, 0.0]),
                                    1.0)):
        b = ops.sample_batches(d_, steps=2, batch_size=B, seed=B, counter=1).repeat_interleave(2, dim=1).contiguous()
        kw = dict(steps=4, lr=0.1, prox=prox, anchor=anchor, batches=b, grad_scale=scale)
        got, want = theta.clone(), theta.clone()
        ops.local_steps(net, got, d_, **kw)
        ops.local_steps_ref(net, want, d_, **kw)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
        assert float((got - theta).abs().max()) > 1e-3
    core = _nets._native_mlp_module()
    expected = core is not None and core.mlp_local_steps_supported(hidden, C)
    assert taken == [expected] * 3
