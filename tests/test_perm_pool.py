"""PERM's pooled mixing weights (``PERM(alpha_pool=s)``, pflcore/algorithms/_perm_pool.py): each
model's α over a pool of s clients and its own client, against the definition (the exact
water-filling on those candidates), on every backend, in a run, sharded (tests/dist_worker.py's
``perm_pooled``) and resumed (tests/test_perm.py's ``test_resume_is_bitwise[pooled]``)."""
import pytest
import torch

import pflcore
from pflcore import backend, data, models, ops
from pflcore.algorithms import PERM
from pflcore.algorithms import _perm_pool as PL
from pflcore.algorithms import perm as P
from pflcore.backends import reference

NATIVE = backend.ADAPTERS.get("native") if backend.loaded("native") is not None else None


def _brute_water_fill(costs, w, w_own):
    """Per row, the weights written out in full and the reference's sorted solve."""
    rows = []
    for i in range(costs.shape[0]):
        wi = w.clone()
        wi[-1] = w_own[i]
        tau = reference.water_levels(costs[i:i + 1], wi[None, :].expand(1, -1).contiguous())[0]
        rows.append((tau - costs[i]).clamp(min=0) * wi)
    return torch.stack(rows)


@pytest.mark.parametrize("r,k", [(1, 1), (1, 2), (7, 5), (33, 129), (65, 3)])
def test_water_fill_own_weight_on_every_backend(r, k):
    g = torch.Generator().manual_seed(r * 131 + k)
    costs = torch.rand(r, k, generator=g, dtype=torch.float64) * 3
    costs[:, -1] = 0.0
    w = torch.rand(k, generator=g, dtype=torch.float64) + 0.05
    w_own = torch.rand(r, generator=g, dtype=torch.float64) * 2 + 0.01
    want = _brute_water_fill(costs, w, w_own)
    got_ref = reference.water_fill(costs, w, 256, w_own)
    torch.testing.assert_close(got_ref, want, rtol=0, atol=1e-14)
    assert torch.allclose(got_ref.sum(1), torch.ones(r, dtype=torch.float64), atol=1e-12)
    if NATIVE is not None:
        got = NATIVE.water_fill(costs, w, w_own)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
        # without w_own: the kernel as before (column k − 1 takes w[k − 1])
        torch.testing.assert_close(NATIVE.water_fill(costs, w), reference.water_fill(costs, w), rtol=0, atol=1e-13)


@pytest.mark.skipif(NATIVE is None, reason="the native module is not built")
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_water_fill_kernel_refuses_a_bad_own_weight_by_row(bad):
    w_own = torch.ones(4, dtype=torch.float64)
    w_own[2] = bad
    with pytest.raises(ValueError, match=r"w_own\[2\]"):
        NATIVE.water_fill(torch.rand(4, 3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), w_own)


def _gradients(m, d, dtype, seed, scale=0.3, groups=3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(groups, d, generator=g, dtype=torch.float64)
    # within a group, costs ~2·scale² (against the own client's 2λ/n_i ~ 1): mixtures of a few clients
    G = centres[torch.arange(m) % groups] + scale / d ** 0.5 * torch.randn(m, d, generator=g, dtype=torch.float64)
    sizes = torch.randint(5, 60, (m,), generator=g).to(dtype)
    return G.to(dtype), sizes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m,d,s", [(1, 1, 1), (2, 3, 1), (7, 5, 3), (37, 11, 9), (37, 11, 36), (130, 61, 17)])
def test_pooled_weights_are_the_definition(dtype, m, d, s):
    G, sizes = _gradients(m, d, dtype, seed=m * 7 + s)
    pool = PL.draw(m, s, seed=3, refresh=0)
    lam = 30.0
    alpha = P.weights_from_gradients(G, sizes, lam, pool=pool)
    assert alpha.shape == (m, pool.numel() + 1) and alpha.dtype == torch.float64
    ids = torch.arange(m)
    dense = PL.dense(alpha, pool, ids, m)
    want = PL.weights_ref(G, sizes, pool, lam)
    tol = 1e-12  # float64 products of the gradients as given (float32 ones: test_products_precision)
    torch.testing.assert_close(dense, want, rtol=0, atol=tol)
    assert torch.allclose(alpha.sum(1), torch.ones(m, dtype=torch.float64), atol=1e-12)
    assert bool((alpha >= 0).all())
    # the own client's weight is in the last column, and where it is in the pool its pool column is 0
    in_pool = torch.isin(ids, pool)
    pos = torch.searchsorted(pool, ids).clamp(max=pool.numel() - 1)
    assert bool((alpha[in_pool, pos[in_pool]] == 0).all())
    assert bool((alpha[:, -1] > 0).all()), "the own client (cost 0) always carries weight"
    if m >= 37 and dtype is torch.float64:
        assert float((dense > 0).sum(1).double().mean()) > 1.5, "a real mixture, for the test to mean anything"
    # every backend: the torch reference of the water-filling gives the same weights
    with backend.reference():
        torch.testing.assert_close(P.weights_from_gradients(G, sizes, lam, pool=pool), alpha, rtol=0, atol=1e-12)


def test_lookup_matches_the_dense_weights():
    m = 41
    G, sizes = _gradients(m, 9, torch.float64, seed=5)
    pool = PL.draw(m, 12, seed=1, refresh=4)
    alpha = P.weights_from_gradients(G, sizes, 40.0, pool=pool)
    dense = PL.dense(alpha, pool, torch.arange(m), m)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, m, (500,), generator=g)
    clients = torch.cat([torch.randint(0, m, (400,), generator=g), rows[400:]])  # some own clients
    got = PL.at(alpha, pool, rows, rows, clients)
    assert torch.equal(got, dense[rows, clients])


def test_pool_draw():
    a = PL.draw(1000, 50, seed=7, refresh=0)
    assert a.shape == (50,) and bool((a[1:] > a[:-1]).all()) and int(a.min()) >= 0 and int(a.max()) < 1000
    assert torch.equal(a, PL.draw(1000, 50, seed=7, refresh=0)), "counter-based: the same draw"
    assert not torch.equal(a, PL.draw(1000, 50, seed=7, refresh=10)), "a new pool at each recomputation"
    assert not torch.equal(a, PL.draw(1000, 50, seed=8, refresh=0))
    assert torch.equal(PL.draw(5, 50, seed=0, refresh=0), torch.arange(5))


@pytest.mark.parametrize("products", [torch.float64, torch.float32])
def test_pooled_weights_are_bitwise_at_any_thread_count(products):
    G, sizes = _gradients(1500, 61, torch.float32, seed=2, scale=0.05)
    pool = PL.draw(1500, 150, seed=0, refresh=0)
    ids = torch.arange(1500)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(PL.weights(G, sizes, ids, G[pool], sizes[pool], pool, 100.0, products))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # a shard of the rows (another product shape) gives those rows' bits
    part = PL.weights(G[300:1101], sizes[300:1101], ids[300:1101], G[pool], sizes[pool], pool, 100.0, products)
    assert torch.equal(part, outs[0][300:1101])


def _run(alg, **kw):
    fed = data.two_groups(num_clients=12, samples_per_client=30, dim=6, seed=0)
    model = models.Logistic(6, fit_intercept=False)
    return fed, model, pflcore.run(alg, fed, model, progress=False, **kw)


def test_perm_with_a_pool_solves_alpha_on_its_candidates():
    alg = PERM(warmup_rounds=3, lam_alpha=10.0, lr=0.05, local_steps=2, alpha_pool=5)
    fed, model, res = _run(alg, rounds=4, eval_every=4)
    state = res.state
    assert state.pool.shape == (5,) and state.alpha.shape == (12, 6)
    G = ops.gradients(model, state.w, fed.train)  # two-loop: w̃ stays where α was computed
    want = PL.weights_ref(G, fed.train.sizes, state.pool, 10.0)
    torch.testing.assert_close(PERM.dense_alpha(state), want, rtol=0, atol=2e-6)
    assert float((PERM.dense_alpha(state) > 0).sum(1).double().mean()) > 1.0


def test_perm_pool_of_every_client_is_exact_perm():
    kw = dict(rounds=6, clients_per_round=6, eval_every=3)
    base = dict(warmup_rounds=2, lam_alpha=10.0, lr=0.05, local_steps=2, single_loop=True, alpha_every=2)
    _, _, exact = _run(PERM(**base), **kw)
    _, _, pooled = _run(PERM(**base, alpha_pool=12), **kw)
    assert pooled.state.pool is None
    assert torch.equal(pooled.personalized, exact.personalized)


def test_perm_pool_trains_the_models_its_weights_say():
    """A shuffling round moves exactly the models whose visited client has a positive pooled
    weight (the others only shrink by l2 = 0 here: unchanged)."""
    alg = PERM(warmup_rounds=2, lam_alpha=10.0, lr=0.05, local_steps=2, alpha_pool=4)
    fed, model, res3 = _run(alg, rounds=3, eval_every=3)
    _, _, res4 = _run(alg, rounds=4, eval_every=4)
    s3 = res3.state
    j = alg.visits(s3.sigma, s3.shuffle_rounds)
    a = PL.at(s3.alpha, s3.pool, torch.arange(12), torch.arange(12), j)
    moved = (res4.state.theta != s3.theta).any(dim=1)
    assert torch.equal(moved, a > 0)
    assert 0 < int(moved.sum()) < 12, "some visits carry weight, some do not"


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4"])
def test_bad_alpha_pool(bad):
    with pytest.raises(ValueError, match="alpha_pool"):
        PERM(warmup_rounds=1, lam_alpha=1.0, lr=0.1, alpha_pool=bad)


def test_products_precision():
    """float32 gradients: float64 products (the default) give the definition to float64 rounding;
    float32 products stay within their bound."""
    m, d, lam = 300, 61, 30.0
    G, sizes = _gradients(m, d, torch.float32, seed=9)
    pool = PL.draw(m, 40, seed=2, refresh=1)
    ids = torch.arange(m)
    want = PL.weights_ref(G, sizes, pool, lam)
    err = {}
    for prod in (torch.float32, torch.float64):
        alpha = PL.weights(G, sizes, ids, G[pool], sizes[pool], pool, lam, products=prod)
        err[prod] = float((PL.dense(alpha, pool, ids, m) - want).abs().max())
    assert err[torch.float64] <= 1e-12
    assert 1e-12 < err[torch.float32] <= 4 * float(sizes.max()) / (2 * lam) * d * 2.0 ** -24 * float(
        ((G.double() - G[pool].double().mean(0)) ** 2).sum(1).max())
    with pytest.raises(ValueError, match="products"):
        PL.weights(G, sizes, ids, G[pool], sizes[pool], pool, lam, products=torch.float16)


def test_exact_alpha_that_does_not_fit_names_alpha_pool(monkeypatch):
    """Where the [m, m] α cannot be allocated (torch's CPU allocator raises a RuntimeError; at 10⁵
    clients it is 80 GB), the run stops with a MemoryError that names the way out. (The
    allocation's failure is simulated: a real one would depend on this machine's memory.)"""
    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 80000000000 bytes")
    monkeypatch.setattr(P, "weights_from_gradients", no_memory)
    with pytest.raises(MemoryError, match=r"exact mixing weights need a float64 \[12, 12\] α.*alpha_pool"):
        _run(PERM(warmup_rounds=1, lam_alpha=10.0, lr=0.05), rounds=3, eval_every=3)
    with pytest.raises(RuntimeError, match="can't allocate"):  # a pooled α's own failure is left as it is
        _run(PERM(warmup_rounds=1, lam_alpha=10.0, lr=0.05, alpha_pool=4), rounds=3, eval_every=3)


def test_pooled_weights_refuse_bad_arguments():
    G, sizes = _gradients(20, 5, torch.float64, seed=1)
    pool = PL.draw(20, 6, seed=0, refresh=0)
    with pytest.raises(ValueError, match=r"pool: expected ascending distinct client ids in \[0, 20\)"):
        P.weights_from_gradients(G, sizes, 10.0, pool=pool.flip(0))
    with pytest.raises(ValueError, match=r"pool: expected ascending distinct client ids in \[0, 20\)"):
        P.weights_from_gradients(G, sizes, 10.0, pool=torch.tensor([3, 20]))
    with pytest.raises(ValueError, match="pool: expected a non-empty int64"):
        P.weights_from_gradients(G, sizes, 10.0, pool=pool.to(torch.int32))
    bad = G.clone()
    bad[7, 2] = float("nan")
    with pytest.raises(ValueError, match="G: expected finite values"):
        P.weights_from_gradients(bad, sizes, 10.0, pool=pool)
    zero = sizes.clone()
    zero[3] = 0
    with pytest.raises(ValueError, match="sizes: expected positive sample counts"):
        P.weights_from_gradients(G, zero, 10.0, pool=pool)
    with pytest.raises(ValueError, match="lam_alpha"):
        P.weights_from_gradients(G, sizes, 0.0, pool=pool)


def test_mixing_weights_takes_a_pool():
    fed = data.two_groups(num_clients=12, samples_per_client=30, dim=6, seed=0)
    model = models.Logistic(6, fit_intercept=False)
    w = torch.zeros(6)
    pool = PL.draw(12, 5, seed=0, refresh=0)
    got = P.mixing_weights(model, w, fed.train, 10.0, pool=pool)
    want = P.weights_from_gradients(ops.gradients(model, w, fed.train), fed.train.sizes, 10.0, pool=pool)
    assert got.shape == (12, 6) and torch.equal(got, want)
