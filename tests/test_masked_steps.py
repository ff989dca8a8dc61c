"""``local_steps`` with a per-coordinate step (``lr_scale``), and FedRep and FedPer built on it
(issue 29, item 2): every path against the reference, frozen coordinates untouched, and the
algorithms against a per-client PyTorch loop."""
from __future__ import annotations

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import backend, ops
from pflcore import data as D
from pflcore import models as M
from pflcore.algorithms.fedrep import head_mask

MODELS = {
    "softmax": lambda: M.Softmax(7, 4),                 # GLM: one gradients call per step
    "least_squares": lambda: M.LeastSquares(7),
    "mlp": lambda: M.MLP(7, hidden=5, C=4),             # the nets' fused MLP steps
    "mlp2": lambda: M.MLP(7, hidden=(5, 3), C=4),
    "cnn": lambda: M.CNN(p=49, C=4, image_shape=(1, 7, 7), channels=(2,), kernel_size=3, hidden=(5,)),  # generic
}


def _federation(name, dtype):
    if name == "cnn":
        return D.contexts(num_clients=9, sizes=(11, 23), dim=49, num_classes=4, dtype=dtype)
    if name == "least_squares":
        return D.least_squares(num_clients=9, samples_per_client=13, dim=7, dtype=dtype)
    return D.contexts(num_clients=9, sizes=(11, 23), dim=7, num_classes=4, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("minibatch", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_lr_scale_equals_the_reference_and_freezes_its_zeros(name, minibatch, dtype):
    fed = _federation(name, dtype)
    model = MODELS[name]()
    g = torch.Generator().manual_seed(3)
    theta0 = (0.3 * torch.randn(9, model.d, generator=g, dtype=torch.float64)).to(dtype)
    scale = torch.rand(model.d, generator=g, dtype=torch.float64)
    scale[torch.rand(model.d, generator=g) < 0.4] = 0.0  # a mixed mask: zeros, fractions
    scale = scale.to(dtype)
    rows = torch.tensor([0, 3, 3, 8, 5])  # odd: repeated clients, a subset
    theta0 = theta0[:5].contiguous()
    kwargs = dict(steps=3, lr=0.2, prox=0.3, anchor=theta0.mean(0), rows=rows, lr_scale=scale,
                  grad_scale=torch.linspace(0.5, 1.5, 5, dtype=dtype),
                  batches=ops.sample_batches(fed.train, steps=3, batch_size=4, seed=1, counter=0, clients=rows)
                  if minibatch else None)
    fast, ref = theta0.clone(), theta0.clone()
    ops.local_steps(model, fast, fed.train, **kwargs)
    ops.local_steps_ref(model, ref, fed.train, **kwargs)
    tol = 1e-5 if dtype is torch.float32 else 1e-12
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    frozen = scale == 0
    assert torch.equal(fast[:, frozen], theta0[:, frozen]) and torch.equal(ref[:, frozen], theta0[:, frozen])
    assert not torch.equal(fast[:, ~frozen], theta0[:, ~frozen])


@pytest.mark.parametrize("name", ["softmax", "mlp"])
def test_an_all_ones_lr_scale_is_the_plain_step(name):
    fed = _federation(name, torch.float64)
    model = MODELS[name]()
    theta0 = 0.1 * torch.randn(9, model.d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain, ones = theta0.clone(), theta0.clone()
    ops.local_steps(model, plain, fed.train, steps=2, lr=0.1)
    ops.local_steps(model, ones, fed.train, steps=2, lr=0.1, lr_scale=torch.ones(model.d, dtype=torch.float64))
    torch.testing.assert_close(ones, plain, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bad, message", [
    (lambda d: torch.ones(d + 1), r"lr_scale: expected shape \[R\] = \["),
    (lambda d: torch.full((d,), -1.0), r"lr_scale: expected finite values >= 0 .*got -1.0 at index 0"),
    (lambda d: torch.tensor([float("nan")] + [1.0] * (d - 1)), r"lr_scale: expected finite values >= 0"),
    (lambda d: torch.ones(d, dtype=torch.float64), r"lr_scale: expected dtype float32"),
])
def test_a_bad_lr_scale_names_the_argument(bad, message):
    fed = _federation("mlp", torch.float32)
    model = MODELS["mlp"]()
    theta = torch.zeros(9, model.d)
    with pytest.raises(ValueError, match=message):
        ops.local_steps(model, theta, fed.train, steps=1, lr=0.1, lr_scale=bad(model.d))


def test_head_mask_marks_the_last_layer():
    model = M.MLP(60, hidden=32, C=10)
    mask = head_mask(model)
    assert mask.sum() == 32 * 10 + 10 and torch.equal(mask[-330:], torch.ones(330))
    with pytest.raises(ValueError, match="model: expected a net with at least two layers"):
        head_mask(M.Softmax(3, 2))


# ---- FedRep and FedPer against a per-client loop ---------------------------------------------

def _forward(params, x):
    h = torch.relu(x @ params[0].T + params[1])
    return h @ params[2].T + params[3]


def _loop(fed, model, w, heads, rounds, phases):
    """The algorithms written as a PyTorch user would: client by client, autograd, full batch.
    ``phases``: [(which parameters train: "head" | "body" | "all", steps, lr)]."""
    split = lambda flat: [v.clone() for v in model.split(flat[None]).values()]  # noqa: E731
    w = w.clone()
    heads = heads.clone()
    m = fed.num_clients
    for _ in range(rounds):
        trained = []
        for i in range(m):
            lo, hi = int(fed.train.offsets[i]), int(fed.train.offsets[i + 1])
            x, y = fed.train.x[lo:hi], fed.train.y[lo:hi]
            params = split(w)[:2] + split(heads[i])[2:]  # shared body, own head
            params = [p[0] for p in params]
            for part, steps, lr in phases:
                train = {"head": [2, 3], "body": [0, 1], "all": [0, 1, 2, 3]}[part]
                for _ in range(steps):
                    ps = [p.detach().requires_grad_(k in train) for k, p in enumerate(params)]
                    loss = torch.nn.functional.cross_entropy(_forward(ps, x), y)
                    grads = torch.autograd.grad(loss, [ps[k] for k in train])
                    params = [p.detach() for p in ps]
                    for k, gk in zip(train, grads):
                        params[k] = params[k] - lr * gk
            trained.append(torch.cat([p.reshape(-1) for p in params]))
        theta = torch.stack(trained)
        heads = theta
        p = fed.weights.double()
        w = (p[:, None] * theta).sum(0) / p.sum()
    body = head_mask(model).bool().logical_not()
    return torch.where(body, w, heads)  # each client's (shared body, own head)


@pytest.mark.parametrize("algorithm, phases", [
    (A.FedRep(lr=0.2, head_steps=4, body_steps=2, head_lr=0.3), [("head", 4, 0.3), ("body", 2, 0.2)]),
    (A.FedPer(lr=0.2, local_steps=3), [("all", 3, 0.2)]),
])
@pytest.mark.filterwarnings("ignore:stat_error_local")
def test_fedrep_and_fedper_equal_a_per_client_loop(algorithm, phases):
    fed = D.contexts(num_clients=7, sizes=(10, 25), dim=6, num_classes=3, dtype=torch.float64)
    model = M.MLP(6, hidden=5, C=3)
    start = pflcore.run(algorithm, fed, model, rounds=0, progress=False).state
    res = pflcore.run(algorithm, fed, model, rounds=3, progress=False)
    expected = _loop(fed, model, start.w, start.heads, 3, phases)
    torch.testing.assert_close(res.personalized, expected, rtol=1e-5, atol=1e-5)
    assert res.history[-1]["personalized_acc"] > res.history[0]["personalized_acc"]


def test_fedrep_refuses_a_glm():
    fed = D.contexts(num_clients=3, num_contexts=1, sizes=(10, 12), dim=4, num_classes=3)
    with pytest.raises(ValueError, match="model: expected a net with at least two layers"):
        pflcore.run(A.FedRep(lr=0.1), fed, M.Softmax(4, 3), rounds=1, progress=False)


def test_masked_mlp_steps_stay_on_the_nets_path():
    """The masked steps of an MLP run in the nets adapter's fused steps (not the reference's
    loop over rows)."""
    fed = _federation("mlp", torch.float32)
    model = MODELS["mlp"]()
    assert backend.select("local_steps", model, torch.zeros(1)) is backend.NETS
