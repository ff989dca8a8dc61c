"""Algorithms against closed forms and limits (DESIGN.md §5, issue: simulator)."""
from __future__ import annotations

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import ClientData, data, models


def _ls_federation(seed=0):
    return data.least_squares(num_clients=5, samples_per_client=60, dim=6, noise_var=0.25, shift=1.0, seed=seed,
                              dtype=torch.float64)


def _pooled_solution(fed):
    X, y = fed.train.x, fed.train.y
    return torch.linalg.solve(X.T @ X, X.T @ y)


def test_fedavg_one_local_step_converges_to_pooled_least_squares():
    """With one full-batch step and p_i = n_i/N, FedAvg is gradient descent on the pooled loss."""
    fed = _ls_federation()
    model = models.LeastSquares(6, fit_intercept=False)
    res = pflcore.run(A.FedAvg(lr=0.5, local_steps=1), fed, model, rounds=300, eval_every=300, progress=False)
    want = _pooled_solution(fed)
    assert float((res.global_model - want).norm() / want.norm()) < 1e-6


def test_localized_fedavg_fine_tunes_the_global_model_on_each_client():
    """Its global model is FedAvg's; its personalized models are that model after the fine-tuning
    steps on each client (with many steps: each client's own least-squares solution)."""
    fed = _ls_federation(3)
    model = models.LeastSquares(6, fit_intercept=False)
    loc = pflcore.run(A.LocalizedFedAvg(lr=0.1, local_steps=2, finetune_steps=400, finetune_lr=0.5), fed, model,
                      rounds=5, eval_every=5, progress=False)
    avg = pflcore.run(A.FedAvg(lr=0.1, local_steps=2), fed, model, rounds=5, eval_every=5, progress=False)
    assert torch.equal(loc.global_model, avg.global_model)
    for i in range(fed.num_clients):
        X, y = fed.train.client(i)
        want = torch.linalg.solve(X.T @ X, X.T @ y)
        assert float((loc.personalized[i] - want).norm() / want.norm()) < 1e-6


def test_localtrain_converges_to_each_clients_solution():
    fed = _ls_federation(1)
    model = models.LeastSquares(6, fit_intercept=False)
    res = pflcore.run(A.LocalTrain(lr=0.5, steps=2), fed, model, rounds=300, eval_every=300, progress=False)
    for i in range(fed.num_clients):
        X, y = fed.train.client(i)
        want = torch.linalg.solve(X.T @ X, X.T @ y)
        assert float((res.personalized[i] - want).norm() / want.norm()) < 1e-6


def test_one_stage_fedprox_interpolates_between_local_and_global():
    """λ → 0 approaches LocalTrain, λ large approaches GlobalTrain (statistical errors within 5%)."""
    fed = data.logistic_truth(num_clients=6, samples_per_client=300, dim=5, R=0.5, seed=3, dtype=torch.float64)
    model = models.Logistic(5, fit_intercept=False)
    kw = dict(rounds=400, eval_every=400, progress=False)
    local = pflcore.run(A.LocalTrain(lr=1.0, steps=5), fed, model, **kw).final("stat_error_local")
    glob_res = pflcore.run(A.FedAvg(lr=1.0, local_steps=1), fed, model, **kw)
    glob_w = glob_res.global_model
    glob = float(((glob_w - fed.truth) ** 2).sum(1).mean())
    small = pflcore.run(A.FedProx(lam=1e-4, local_lr=1.0, global_lr=1.0, local_steps=5), fed, model, **kw)
    L = A.FedProx.smoothness(fed)
    gamma, eta = A.FedProx.step_sizes(L, 50.0)
    large = pflcore.run(A.FedProx(lam=50.0, local_lr=eta, global_lr=gamma, local_steps=5), fed, model,
                        rounds=1500, eval_every=1500, progress=False)
    assert small.final("stat_error_local") == pytest.approx(local, rel=0.05)
    assert large.final("stat_error_local") == pytest.approx(glob, rel=0.05)
    assert local != pytest.approx(glob, rel=0.2), "the test needs local and global training to differ"


def test_fedprox_helpers():
    assert A.FedProx.adaptive_lambda(0.01, 100) == pytest.approx(2 / (10 * 0.01))
    assert A.FedProx.adaptive_lambda(1.0, 100) == pytest.approx(4 / 100)
    assert A.FedProx.adaptive_lambda(0.0, 100) == float("inf")
    gamma, eta = A.FedProx.step_sizes(2.0, 3.0)
    assert gamma == pytest.approx(5 / 6) and eta == pytest.approx(1 / 5)


def test_pfedme_with_huge_lambda_behaves_like_fedavg():
    """As λ → ∞ the personal models collapse onto the local ones and pFedMe's local update
    becomes a gradient step: pFedMe's global model approaches FedAvg's fixed point."""
    fed = _ls_federation(2)
    model = models.LeastSquares(6, fit_intercept=False)
    big = A.PFedMe(lam=1e4, lr=0.02, personal_lr=5e-5, inner_steps=5, local_rounds=1, beta=1.0, batch_size=400)
    res = pflcore.run(big, fed, model, rounds=400, eval_every=400, progress=False)
    avg = pflcore.run(A.FedAvg(lr=0.5, local_steps=1), fed, model, rounds=300, eval_every=300, progress=False)
    assert float((res.global_model - avg.global_model).norm() / avg.global_model.norm()) < 2e-2
    assert float((res.personalized - res.global_model).norm(dim=1).max()) < 1e-2


@pytest.mark.parametrize("variant", ["FO", "HF"])
def test_perfedavg_runs_and_hvp_is_exact(variant):
    fed = data.synthetic(0.5, 0.5, num_clients=8, dim=7, num_classes=3, seed=1, size_scale=1, max_size=200)
    model = models.Softmax(7, 3, l2=0.01)
    res = pflcore.run(A.PerFedAvg(alpha=0.05, beta=0.05, variant=variant, local_steps=3, batch_size=8), fed, model,
                      rounds=20, eval_every=10, progress=False)
    assert res.final("personalized_acc") > 0.4
    # ops.hvp against autograd's Hessian-vector product of the same minibatch loss.
    from pflcore import ops
    theta = torch.randn(1, model.d, dtype=torch.float64)
    v = torch.randn(1, model.d, dtype=torch.float64)
    f64 = fed.train.to(dtype=torch.float64)
    idx = torch.tensor([[0, 3, 3, 5]], dtype=torch.int32)
    X, y = f64.x[idx[0].long()], f64.y[idx[0].long()]

    def loss(t):
        W = t.view(model.P, model.C)
        return torch.nn.functional.cross_entropy(X @ W[:7] + W[7], y) + 0.005 * (t ** 2).sum()

    want = torch.autograd.functional.hvp(loss, theta[0], v[0])[1]
    torch.testing.assert_close(ops.hvp(model, theta, v, f64, batches=idx, rows=[0])[0], want)


def test_bad_configuration_fails_before_any_work():
    fed = _ls_federation()
    model = models.LeastSquares(6, fit_intercept=False)
    with pytest.raises(ValueError, match=r"FedAvg: lr must be > 0, got 0"):
        A.FedAvg(lr=0)
    with pytest.raises(ValueError, match=r"FedProx: lam must be >= 0, got -1"):
        A.FedProx(lam=-1, local_lr=0.1, global_lr=1.0)
    with pytest.raises(ValueError, match=r"clients_per_round: expected an integer in \[1, m = 5\]"):
        pflcore.run(A.FedAvg(lr=0.1), fed, model, rounds=1, clients_per_round=6, progress=False)
    with pytest.raises(ValueError, match=r"model: expects p = 7 features, the federation has 6"):
        pflcore.run(A.FedAvg(lr=0.1), fed, models.LeastSquares(7), rounds=1, progress=False)
    with pytest.raises(ValueError, match=r"pFedMe: personal_eval must be"):
        A.PFedMe(lam=1, lr=0.1, personal_lr=0.1, personal_eval="global")


def test_diverging_run_names_round_and_algorithm(tmp_path):
    fed = _ls_federation()
    model = models.LeastSquares(6, fit_intercept=False)
    with pytest.raises(pflcore.DivergenceError, match=r"FedAvg diverged in round \d+: .*smaller step sizes"):
        pflcore.run(A.FedAvg(lr=50.0), fed, model, rounds=400, progress=False, checkpoint=str(tmp_path),
                    checkpoint_every=1)
    kept = sorted(p.name for p in tmp_path.glob("round_*.pt"))
    assert kept, "the last good checkpoint is kept"
    last = torch.load(tmp_path / kept[-1], weights_only=False)
    assert bool(torch.isfinite(last["state"].w).all())


def test_pfedme_switches_train_all_and_personal_eval():
    fed = data.synthetic(0.5, 0.5, num_clients=8, dim=5, num_classes=3, seed=4, size_scale=1, max_size=100)
    model = models.Softmax(5, 3)
    from pflcore.algorithms.base import Context

    ctx = Context(fed, model, torch.device("cpu"), seed=0, clients_per_round=3)
    S = ctx.sample_clients(1)
    only = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=5, train_all=False)
    state = only.round(only.init(ctx), ctx, 1)
    trained = (state.theta != 0).any(dim=1)
    assert trained.tolist() == [i in S.tolist() for i in range(8)]
    every = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=5)
    state_all = every.round(every.init(ctx), ctx, 1)
    assert bool((state_all.theta != 0).any(dim=1).all())
    # Only the sampled clients are aggregated, so both variants produce the same global model.
    torch.testing.assert_close(state_all.w, state.w)
    local_eval = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, personal_eval="local")
    assert local_eval.personalized(state_all) is state_all.w_local
    assert every.personalized(state_all) is state_all.theta


@pytest.mark.parametrize("make", [
    lambda: A.FedAvg(lr=0.1, local_steps=3),
    lambda: A.LocalizedFedAvg(lr=0.1, local_steps=2, finetune_steps=2),
    lambda: A.Ditto(lam=0.5, lr=0.1, local_steps=2),
    lambda: A.APFL(alpha=0.3, lr=0.1, local_steps=2),
    lambda: A.PERM(warmup_rounds=1, lam_alpha=10.0, lr=0.05, local_steps=2),
], ids=["FedAvg", "LocalizedFedAvg", "Ditto", "APFL", "PERM"])
def test_one_client_trains_like_two_identical_clients(make):
    """Averaging two equal rows is exact, so a federation of one client must train exactly like
    one of two copies of it (full-batch algorithms: minibatches are drawn per client id). A
    round with one participant once made the server model share memory with that client's
    copy, ``w.expand(1, d).contiguous()`` being a view, so its local steps moved the server
    model itself."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
    xt, yt = torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)

    def fed(copies):
        train = ClientData.from_clients([x] * copies, [y] * copies)
        test = ClientData.from_clients([xt] * copies, [yt] * copies)
        return data.Federation(train, test, 3)

    model = models.Softmax(4, 3)
    one = pflcore.run(make(), fed(1), model, rounds=3, progress=False)
    two = pflcore.run(make(), fed(2), model, rounds=3, progress=False)
    if one.global_model is not None:
        assert torch.equal(one.global_model, two.global_model)
    if one.personalized is not None:
        assert torch.equal(one.personalized[0], two.personalized[0])


def test_pfedme_with_one_client_mixes_the_old_global_model():
    """β = 1/2 and one client: w₁ = ½·w₀ + ½·w_local with w₀ = 0, exactly (not w_local, which is
    what a server model aliased by the client's copy gave)."""
    fed = data.synthetic(0.5, 0.5, num_clients=1, dim=4, num_classes=3, seed=0, size_scale=1, max_size=50)
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=2, beta=0.5, batch_size=5)
    res = pflcore.run(alg, fed, models.Softmax(4, 3), rounds=1, progress=False)
    assert bool(res.state.w_local.abs().sum() > 0)
    assert torch.equal(res.global_model, 0.5 * res.state.w_local[0])
