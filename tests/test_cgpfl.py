"""CGPFL and CGPFL-Heur (DESIGN.md §5): the K = 1 special case, context recovery, label
stability, empty contexts, the choice of K, checkpoints."""
from __future__ import annotations

import os

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, models


def adjusted_rand_index(a, b) -> float:
    """Hubert & Arabie's ARI of two labelings (1 = the same partition up to renaming)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    _, ai = a.unique(return_inverse=True)
    _, bi = b.unique(return_inverse=True)
    table = torch.zeros(int(ai.max()) + 1, int(bi.max()) + 1, dtype=torch.float64)
    table.index_put_((ai, bi), torch.ones(a.numel(), dtype=torch.float64), accumulate=True)

    def pairs(x):
        return (x * (x - 1) / 2).sum()

    s, sa, sb = pairs(table), pairs(table.sum(1)), pairs(table.sum(0))
    expected = sa * sb / (a.numel() * (a.numel() - 1) / 2)
    return float((s - expected) / (0.5 * (sa + sb) - expected))


def test_adjusted_rand_index():
    assert adjusted_rand_index([0, 0, 1, 1, 2], [5, 5, 3, 3, 1]) == pytest.approx(1.0)
    assert adjusted_rand_index([0, 0, 1, 1], [0, 1, 0, 1]) < 0


def _contexts(seed=0):
    return data.contexts(num_clients=40, num_contexts=4, dim=20, num_classes=5, sizes=(60, 200), seed=seed), \
        models.Softmax(20, 5)


def test_one_context_is_pfedme():
    """With K = 1, every client starts from the single context model, the local rounds are
    pFedMe's, and the context mean is P_H: CGPFL(K=1) ≡ pFedMe(lr=β, personal_lr=η, beta=α)."""
    fed = data.synthetic(0.5, 0.5, num_clients=10, dim=7, num_classes=3, seed=1, size_scale=1, max_size=120,
                         dtype=torch.float64)
    model = models.Softmax(7, 3, l2=1e-3)
    kw = dict(rounds=6, clients_per_round=6, eval_every=3, progress=False, seed=4)
    cg = pflcore.run(A.CGPFL(1, lam=15.0, alpha=0.7, beta=0.02, lr=0.05, inner_steps=3, local_rounds=4,
                             batch_size=8), fed, model, **kw)
    pm = pflcore.run(A.PFedMe(lam=15.0, lr=0.02, personal_lr=0.05, inner_steps=3, local_rounds=4, beta=0.7,
                              batch_size=8, train_all=False), fed, model, **kw)
    assert bool((cg.state.labels == 0).all())
    # The two server steps round differently ((1−β)w + β·mean vs w + α(mean − w)) by an ulp.
    torch.testing.assert_close(cg.state.contexts[0], pm.state.w, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(cg.state.theta, pm.state.theta, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(cg.state.omega_local, pm.state.w_local, rtol=1e-12, atol=1e-13)
    for a, b in zip(cg.history, pm.history):
        assert a["personalized_acc"] == pytest.approx(b["personalized_acc"])


@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_true_contexts_within_10_rounds_and_keeps_labels(seed):
    fed, model = _contexts(seed)
    truth = fed.meta["contexts"]
    seen = {}
    alg = A.CGPFL(4, lam=12.0, beta=0.005, lr=0.005, inner_steps=5, local_rounds=10)
    res = pflcore.run(alg, fed, model, rounds=20, eval_every=1, progress=False, seed=seed,
                      callbacks=[lambda t, row, st: seen.__setitem__(t, st.labels.clone())])
    assert adjusted_rand_index(seen[10], truth) == 1.0
    # Warm-started clustering: once found, the contexts keep their names.
    assert all(torch.equal(seen[t], seen[10]) for t in range(10, 21))
    assert res.state.contexts.shape == (4, model.d)
    # Each context model is the mean of its clients' uploads (α = 1), so the 4 differ.
    assert torch.cdist(res.state.contexts, res.state.contexts).add(torch.eye(4)).min() > 0


def test_heuristic_picks_the_true_number_of_contexts():
    fed, model = _contexts(0)
    alg = A.CGPFLHeur(mu=100.0, max_contexts=8, lam=12.0, beta=0.005, lr=0.005, inner_steps=5, local_rounds=10)
    res = pflcore.run(alg, fed, model, rounds=10, eval_every=10, progress=False)
    e = res.state.e_values
    assert len(e) == 8 and min(range(8), key=e.__getitem__) == 3
    assert res.state.contexts.shape[0] == 4
    assert adjusted_rand_index(res.state.labels, fed.meta["contexts"]) == 1.0
    # The complexity term grows like sqrt(K); without it (μ large) more contexts always look better.
    assert alg.generalization_term(100, 4, 1000) == pytest.approx(2 * alg.generalization_term(100, 1, 1000))


def test_empty_context_keeps_its_model():
    fed, model = _contexts(0)
    alg = A.CGPFL(4, lam=12.0, beta=0.005, lr=0.005, inner_steps=2, local_rounds=2)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.round(alg.init(ctx), ctx, 1)
    far = torch.full((model.d,), 1e3)
    state.contexts[2] = far  # no client is near it: the warm-started clustering leaves it empty
    state.labels[state.labels == 2] = 0
    state = alg.round(state, ctx, 2)
    assert not bool((state.labels == 2).any())
    assert torch.equal(state.contexts[2], far)


def test_bad_hyperparameters_and_too_few_clients():
    with pytest.raises(ValueError, match="beta·lam"):
        A.CGPFL(4, lam=12.0, beta=0.5)
    with pytest.raises(ValueError, match="alpha"):
        A.CGPFL(4, lam=12.0, alpha=1.5)
    with pytest.raises(ValueError, match="num_contexts"):
        A.CGPFL(0, lam=12.0)
    with pytest.raises(ValueError, match="max_contexts"):
        A.CGPFLHeur(mu=1.0, max_contexts=0, lam=1.0)
    fed, model = _contexts(0)
    with pytest.raises(ValueError, match="clients_per_round"):
        pflcore.run(A.CGPFL(4, lam=12.0, local_rounds=1), fed, model, rounds=1, clients_per_round=3, progress=False)


def test_resume_is_bitwise(tmp_path):
    fed, model = _contexts(1)
    alg = A.CGPFLHeur(mu=100.0, max_contexts=5, lam=12.0, beta=0.005, lr=0.005, inner_steps=2, local_rounds=3)
    kw = dict(rounds=6, clients_per_round=30, eval_every=2, progress=False)
    full = pflcore.run(alg, fed, model, **kw)
    ck = tmp_path / "ck"
    pflcore.run(alg, fed, model, checkpoint=str(ck), checkpoint_every=2, **kw)
    for late in ("round_0000004.pt", "round_0000006.pt"):
        os.remove(ck / late)
    resumed = pflcore.resume(str(ck), progress=False)
    assert torch.equal(resumed.personalized, full.personalized)
    assert torch.equal(resumed.state.contexts, full.state.contexts)
    assert torch.equal(resumed.state.labels, full.state.labels)
    assert resumed.state.e_values == full.state.e_values
