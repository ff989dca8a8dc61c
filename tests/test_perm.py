"""PERM (DESIGN.md §5): the exact water-filling solve, model shuffling, and the two-groups
setting of the paper."""
from __future__ import annotations

import os

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, models
from pflcore.algorithms.perm import (PERM, PERMState, mixing_weights, pairwise_sqdist, screened_weights, water_filling,
                                     water_filling_ref)


def _project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row onto the simplex (sort-based; Held et al.)."""
    u, _ = torch.sort(v, dim=1, descending=True)
    css = torch.cumsum(u, dim=1) - 1
    k = torch.arange(1, v.shape[1] + 1, dtype=v.dtype)
    rho = (u - css / k > 0).sum(dim=1, keepdim=True)
    return (v - css.gather(1, rho - 1) / rho).clamp_min(0)


def _pgd(costs, counts, lam, iters=2000):
    """Projected gradient descent on Σ c_j α_j + λ Σ α_j²/n_j with step 1/L, L = 2λ/min n: a
    contraction by 1 − min n/max n ≥ 1 − 5/40 per step, so 2,000 steps are exact to rounding."""
    q = lam / counts.to(torch.float64)
    step = 1.0 / (2 * float(q.max()))
    a = torch.full_like(costs, 1.0 / costs.shape[1])
    for _ in range(iters):
        a = _project_simplex(a - step * (costs + 2 * q * a))
    return a


@pytest.mark.parametrize("seed", range(4))
def test_water_filling_equals_projected_gradient_descent(seed):
    g = torch.Generator().manual_seed(seed)
    m, k = 7, 13
    costs = torch.rand(m, k, generator=g, dtype=torch.float64) * 3
    costs[0, 5] = costs[0, 6]  # a tie
    counts = torch.randint(5, 40, (k,), generator=g)
    lam = [0.05, 1.0, 20.0, 300.0][seed]
    alpha = water_filling(costs, counts, lam)
    assert alpha.dtype == torch.float64 and alpha.shape == (m, k)
    assert bool((alpha >= 0).all())
    torch.testing.assert_close(alpha.sum(1), torch.ones(m, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(alpha, _pgd(costs, counts, lam), rtol=0, atol=1e-8)


@pytest.mark.parametrize("lam", [0.01, 1.0, 100.0, 1e5])
def test_water_filling_candidate_screen_is_exact(lam):
    """The top-k screen (few candidates, retried with more) equals the full sort, including rows
    whose active set is larger than the first screen."""
    g = torch.Generator().manual_seed(5)
    costs = pairwise_sqdist(torch.randn(300, 8, generator=g, dtype=torch.float64))
    counts = torch.randint(1, 100, (300,), generator=g)
    full = water_filling_ref(costs, counts, lam, candidates=10**6)
    assert torch.equal(water_filling_ref(costs, counts, lam, candidates=2), full)
    assert torch.equal(water_filling_ref(costs, counts, lam), full)
    assert torch.equal(water_filling(costs.float(), counts, lam), water_filling(costs.float().double(), counts, lam))


def _water_cases():
    g = torch.Generator().manual_seed(11)
    cases = []
    for m, k in [(1, 1), (3, 1), (5, 2), (17, 33), (64, 257), (301, 301)]:
        costs = torch.rand(m, k, generator=g, dtype=torch.float64) * 4
        if k > 3:
            costs[0, 1] = costs[0, 2] = costs[0, 3]  # ties
            costs[m - 1] = 0.5  # a row of equal costs
        counts = torch.randint(1, 300, (k,), generator=g)
        cases.append((costs, counts))
    G = torch.randn(257, 9, generator=g, dtype=torch.float64)
    cases.append((pairwise_sqdist(G), torch.randint(1, 100, (257,), generator=g)))
    return cases


@pytest.mark.usefixtures("cpu_level")  # once per CPU capability level this CPU runs
@pytest.mark.parametrize("lam", [1e-4, 0.3, 30.0, 1e6])
def test_water_filling_native_equals_the_reference(lam):
    """The native level (Michelot's active-set iteration) equals the reference's sorted prefix to
    rounding, with the same zeros, on odd shapes, ties, one column and equal costs."""
    from pflcore import backend
    assert backend.select("water_fill", None, torch.zeros(1, dtype=torch.float64)) is backend.ADAPTERS["native"]
    for costs, counts in _water_cases():
        want = water_filling_ref(costs, counts, lam)
        got = water_filling(costs, counts, lam)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert torch.equal(got > 1e-12, want > 1e-12)
        # the rows sum to 1 up to the rounding of τ − c: τ ≈ c + 1/Σw when many weights share the
        # mass, so the error is ~ u·c·Σw (large weights n/(2λ), equal costs)
        tol = 1e-14 * (1.0 + costs.abs().amax(1) * counts.double().sum() / (2 * lam))
        assert bool(((got.sum(1) - 1.0).abs() <= tol).all())


def test_water_fill_kernel_refuses_bad_values_by_row():
    """The native kernel's own checks (water_filling checks first; a direct call must not compute
    silently): a non-finite cost names its row, a bad weight its column."""
    from pflcore import backend
    native = backend.ADAPTERS["native"]
    costs = torch.rand(4, 6, dtype=torch.float64)
    costs[2, 3] = float("nan")
    with pytest.raises(Exception, match=r"costs: row 2"):
        native.water_fill(costs, torch.ones(6, dtype=torch.float64))
    w = torch.ones(6, dtype=torch.float64)
    w[4] = 0.0
    with pytest.raises(ValueError, match=r"weights\[4\] = 0"):
        native.water_fill(torch.rand(4, 6, dtype=torch.float64), w)


def _gram_cases():
    """(gram, sq_r, sq_c, own, w, rows, cols, stride) blocks: odd shapes, a row block of a
    symmetric Gram matrix, columns scattered over a wider output, one column, ties."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for r, k, d, stride in [(1, 1, 3, 1), (3, 5, 2, 9), (17, 33, 7, 40), (70, 257, 13, 300)]:
        Y = torch.randn(k, d, generator=g, dtype=torch.float64)
        rows_of_Y = torch.randperm(k, generator=g)[:r].sort().values  # the rows are some of the columns
        if k > 3:
            Y[1] = Y[2]  # two identical clients: tied costs
        sq = (Y * Y).sum(1)
        cols = torch.randperm(stride, generator=g)[:k].sort().values
        w = torch.randint(1, 300, (k,), generator=g).double() / 7.0
        out_rows = torch.randperm(r + 2, generator=g)[:r]
        cases.append((Y[rows_of_Y] @ Y.T, sq[rows_of_Y], sq, rows_of_Y, w, out_rows, cols, stride))
    return cases


@pytest.mark.usefixtures("cpu_level")  # once per CPU capability level this CPU runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_water_fill_gram_equals_the_reference(dtype):
    """The fused kernel (costs from a Gram block, water-filling, α scattered into the output
    rows) against the reference: the same α to rounding, entries outside the block untouched,
    the levels τ_i = α_{i,own}/w_own."""
    from pflcore import backend
    native, ref = backend.ADAPTERS["native"], backend.ADAPTERS["reference"]
    for gram, sq_r, sq_c, own, w, out_rows, cols, stride in _gram_cases():
        gram = gram.to(dtype)
        outs = []
        for a in (native, ref):
            out = torch.full((out_rows.numel() + 2, stride), -7.0, dtype=torch.float64)
            levels = a.water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows, cols)
            outs.append((out, levels))
        (got, tau), (want, tau_ref) = outs
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(tau, tau_ref, rtol=1e-12, atol=1e-14)
        block = got[out_rows][:, cols]
        assert torch.equal(block > 1e-12, want[out_rows][:, cols] > 1e-12)
        torch.testing.assert_close(block.sum(1), torch.ones(len(out_rows), dtype=torch.float64), rtol=0, atol=1e-12)
        mask = torch.ones_like(got, dtype=torch.bool)
        mask[out_rows[:, None], cols[None, :]] = False
        assert bool((got[mask] == -7.0).all()), "entries outside the block were written"
        at = torch.arange(len(out_rows))
        torch.testing.assert_close(tau, block[at, own] / w[own], rtol=1e-12, atol=0)
        # fill="positive" (the block of out is 0 already): only the positive weights are written,
        # and the output is bitwise the one of writing every entry; fill="row" (on both backends):
        # each output row cleared first, so an uninitialized out gives the same rows
        every, positive = (torch.zeros(out_rows.numel() + 2, stride, dtype=torch.float64) for _ in range(2))
        tau_every = native.water_fill_gram(gram, sq_r, sq_c, own, w, every, out_rows, cols)
        tau_positive = native.water_fill_gram(gram, sq_r, sq_c, own, w, positive, out_rows, cols, fill="positive")
        assert torch.equal(positive, every) and torch.equal(tau_positive, tau_every)
        assert torch.equal(every[out_rows][:, cols], got[out_rows][:, cols])
        for a in (native, ref):
            cleared = torch.full((out_rows.numel() + 2, stride), float("nan"), dtype=torch.float64)
            a.water_fill_gram(gram, sq_r, sq_c, own, w, cleared, out_rows, cols, fill="row")
            assert torch.equal(cleared[out_rows], every[out_rows]) if a is native else \
                bool(torch.allclose(cleared[out_rows], every[out_rows], rtol=1e-12, atol=1e-14))
            others = torch.ones(out_rows.numel() + 2, dtype=torch.bool)
            others[out_rows] = False
            assert bool(cleared[others].isnan().all()), "rows outside out_rows were written"


def test_water_fill_gram_refuses_indices_out_of_range():
    """The native kernel writes through out_rows and cols: indices past ``out`` are a ValueError
    naming the argument, never a write out of bounds."""
    from pflcore import backend
    gram, sq_r, sq_c, own, w, out_rows, cols, stride = _gram_cases()[2]
    native = backend.select("water_fill_gram", None, w)
    out = torch.zeros(out_rows.numel() + 2, stride, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"out_rows: expected indices in \[0, 19\)"):
        native.water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows + 100, cols)
    with pytest.raises(ValueError, match=r"cols: expected indices in \[0, 40\)"):
        native.water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows, cols + 40)
    with pytest.raises(ValueError, match=r"own: expected indices in \[0, 33\)"):
        native.water_fill_gram(gram, sq_r, sq_c, own - 1000, w, out, out_rows, cols)
    with pytest.raises(ValueError, match="out: expected a float64"):
        native.water_fill_gram(gram, sq_r, sq_c, own, w, out.float(), out_rows, cols)


def test_water_fill_gram_refuses_non_finite_costs():
    from pflcore import backend
    from pflcore.errors import NonFiniteError
    gram, sq_r, sq_c, own, w, out_rows, cols, stride = _gram_cases()[2]
    for bad in (float("inf"), float("nan")):  # +inf gives a cost of −inf, which a clamp at 0 would hide
        gram = gram.clone()
        gram[4, 6] = bad
        for name in ("native", "reference"):
            out = torch.zeros(out_rows.numel() + 2, stride, dtype=torch.float64)
            with pytest.raises(NonFiniteError, match="gram: row 4"):
                backend.ADAPTERS[name].water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows, cols)


def test_water_filling_limits_and_errors():
    costs = torch.tensor([[0.0, 1.0, 4.0]], dtype=torch.float64)
    counts = torch.tensor([10, 10, 10])
    assert water_filling(costs, counts, 1e-6)[0].tolist() == pytest.approx([1.0, 0.0, 0.0])  # λ → 0: nearest
    assert water_filling(costs, counts, 1e9)[0].tolist() == pytest.approx([1 / 3] * 3, abs=1e-6)  # λ → ∞: ∝ n
    with pytest.raises(ValueError, match="lam_alpha"):
        water_filling(costs, counts, 0.0)
    with pytest.raises(ValueError, match="counts"):
        water_filling(costs, counts[:2], 1.0)
    with pytest.raises(ValueError, match="costs"):
        water_filling(costs[0], counts, 1.0)


def test_pairwise_sqdist_matches_cdist():
    G = torch.randn(9, 30, dtype=torch.float64) + 100.0  # large common offset: centring keeps precision
    D = pairwise_sqdist(G)
    torch.testing.assert_close(D, torch.cdist(G - 100.0, G - 100.0) ** 2, rtol=1e-10, atol=1e-9)
    assert bool((torch.diagonal(D) == 0).all()) and bool((D >= 0).all())


def test_shuffling_visits_every_client_once_per_epoch():
    m = 11
    sigma = torch.randperm(m, generator=torch.Generator().manual_seed(3))
    visits = torch.stack([PERM.visits(sigma, r) for r in range(m)], dim=1)  # [model, round]
    full = torch.arange(m)
    for i in range(m):
        assert torch.equal(visits[i].sort().values, full)  # model i meets every client once
    for r in range(m):
        assert torch.equal(visits[:, r].sort().values, full)  # each round is a permutation


def test_shuffling_round_is_one_batched_local_steps_call():
    """A shuffling round equals, for every model i with α_{i,j} > 0, `local_steps_ref` on client
    j = σ((i + r) mod m) with grad_scale m·α_{i,j}; models with α_{i,j} = 0 only shrink by l2."""
    fed = data.two_groups(num_clients=8, samples_per_client=20, dim=5, seed=1, dtype=torch.float64)
    model = models.Logistic(5, l2=0.01, fit_intercept=False)
    alg = PERM(warmup_rounds=2, lam_alpha=3.0, lr=0.1, local_steps=3)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=2)
    state = alg.init(ctx)
    for t in (1, 2, 3):
        state = alg.round(state, ctx, t)
    assert state.shuffle_rounds == 1 and bool((state.alpha == 0).any())
    before = state.theta.clone()
    state = alg.round(state, ctx, 4)
    j = PERM.visits(state.sigma, 1)
    for i in range(8):
        a = float(state.alpha[i, j[i]])
        expect = before[i:i + 1].clone()
        if a > 0:
            pflcore.ops.local_steps_ref(model, expect, fed.train, steps=3, lr=0.1, rows=j[i:i + 1],
                                        grad_scale=torch.tensor([8 * a], dtype=torch.float64))
        else:
            expect *= (1 - 0.1 * 0.01) ** 3
        torch.testing.assert_close(state.theta[i:i + 1], expect, rtol=1e-12, atol=1e-12)


def test_two_groups_mixing_weights_and_accuracy():
    fed = data.two_groups(num_clients=50, seed=0)
    model = models.Logistic(60, fit_intercept=False)
    groups = torch.tensor(fed.meta["groups"])
    perm = pflcore.run(PERM(warmup_rounds=20, lam_alpha=100.0, lr=0.05, local_steps=5), fed, model, rounds=100,
                       eval_every=100, progress=False)
    same = (groups[:, None] == groups[None, :]).to(torch.float64)
    own = (perm.state.alpha * same).sum(1)
    assert float(own.min()) >= 0.9
    assert int((perm.state.alpha > 0).sum(1).min()) > 1  # a real mixture, not local training
    fedavg = pflcore.run(A.FedAvg(lr=0.05, local_steps=5), fed, model, rounds=100, eval_every=100, progress=False)
    # pFedMe with the best λ of experiments/perm_two_groups.toml's grid (λ = 0.3).
    pfedme = pflcore.run(A.PFedMe(lam=0.3, lr=0.1, personal_lr=0.1, inner_steps=5, local_rounds=5, batch_size=20),
                         fed, model, rounds=100, eval_every=100, progress=False)
    acc = perm.history[-1]["personalized_acc"]
    assert acc > fedavg.history[-1]["global_acc"] + 0.2
    assert acc > pfedme.history[-1]["personalized_acc"] + 0.1


def test_single_loop_recomputes_alpha():
    fed = data.two_groups(num_clients=10, samples_per_client=30, dim=6, seed=0)
    model = models.Logistic(6, fit_intercept=False)
    alg = PERM(warmup_rounds=0, lam_alpha=10.0, lr=0.05, local_steps=2, single_loop=True, alpha_every=3)
    ctx = A.Context(fed, model, torch.device("cpu"))
    state = alg.init(ctx)
    alphas, starts = [], []
    for t in range(1, 8):
        starts.append(state.w.clone())
        state = alg.round(state, ctx, t)
        alphas.append(state.alpha.clone())
    assert torch.equal(alphas[0], alphas[2]) and not torch.equal(alphas[2], alphas[3])
    # α of round 4 at the w̃ round 4 started from (the gradients its FedAvg steps start from), not at
    # the w̃ its FedAvg made
    assert torch.equal(alphas[3], mixing_weights(model, starts[3], fed.train, 10.0))
    assert float((alphas[3] - mixing_weights(model, state.w, fed.train, 10.0)).abs().max()) > 1e-6


def test_single_loop_fedavg_steps_start_from_alphas_gradients():
    """A single-loop round that recomputes α runs one gradient pass: with full-batch FedAvg steps,
    each sampled client's first step is the step along its gradient from that pass. Its w̃ is the
    plain FedAvg round's (to rounding: the step is taken by torch, not in the kernel), and it costs
    m gradient rows + S·(steps − 1) FedAvg steps + the shuffling round's steps."""
    fed = data.two_groups(num_clients=12, samples_per_client=30, dim=6, seed=0)
    model = models.Logistic(6, fit_intercept=False)
    for steps in (1, 3):
        alg = PERM(warmup_rounds=2, lam_alpha=10.0, lr=0.05, local_steps=2, single_loop=True, fedavg_steps=steps)
        ctx = A.Context(fed, model, torch.device("cpu"), clients_per_round=5)
        state = alg.init(ctx)
        for t in (1, 2):
            state = alg.round(state, ctx, t)
        plain = PERMState(state.w.clone(), state.theta.clone(), state.sigma)
        alg._fedavg(plain, ctx, 3)  # FedAvg alone, every step in the kernel
        before = ctx.client_steps
        state = alg.round(state, ctx, 3)  # the first shuffling round: α recomputed
        torch.testing.assert_close(state.w, plain.w, rtol=1e-6, atol=1e-7)
        assert not torch.equal(state.w, ctx.initial_global())
        shuffled = int((state.alpha[torch.arange(12), alg.visits(state.sigma, 0)] > 0).sum())
        assert ctx.client_steps - before == 12 + 5 * (steps - 1) + shuffled * 2


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="lam_alpha"):
        PERM(warmup_rounds=1, lam_alpha=0.0, lr=0.1)
    with pytest.raises(ValueError, match="warmup_rounds"):
        PERM(warmup_rounds=-1, lam_alpha=1.0, lr=0.1)
    with pytest.raises(ValueError, match="alpha_every"):
        PERM(warmup_rounds=1, lam_alpha=1.0, lr=0.1, alpha_every=0)


@pytest.mark.parametrize("pooled", [{}, dict(single_loop=True, alpha_every=2, alpha_pool=4)],
                         ids=["exact", "pooled"])
def test_resume_is_bitwise(tmp_path, pooled):
    """Exact α, and the pooled α of a single-loop run (its pool redrawn after the resume)."""
    fed = data.two_groups(num_clients=12, samples_per_client=30, dim=6, seed=0)
    model = models.Logistic(6, fit_intercept=False)
    alg = PERM(warmup_rounds=3, lam_alpha=10.0, lr=0.05, local_steps=2, batch_size=5, **pooled)
    kw = dict(rounds=9, clients_per_round=6, eval_every=3, progress=False)
    full = pflcore.run(alg, fed, model, **kw)
    ck = tmp_path / "ck"
    pflcore.run(alg, fed, model, checkpoint=str(ck), checkpoint_every=3, **kw)
    for late in ("round_0000006.pt", "round_0000009.pt"):
        os.remove(ck / late)
    resumed = pflcore.resume(str(ck), progress=False)
    assert torch.equal(resumed.personalized, full.personalized)
    assert torch.equal(resumed.state.alpha, full.state.alpha)
    if pooled:
        assert torch.equal(resumed.state.pool, full.state.pool)


def _grouped_gradients(m, d, groups, spread, seed, dtype=torch.float64):
    """Rows around ``groups`` well separated centres (PERM's setting), plus a few outliers."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(groups, d, generator=g, dtype=torch.float64) * 5
    G = centres[torch.randint(0, groups, (m,), generator=g)] + spread * torch.randn(m, d, generator=g,
                                                                                    dtype=torch.float64)
    G[:3] += 3 * torch.randn(3, d, generator=g, dtype=torch.float64)
    return G.to(dtype) + 40.0, torch.randint(1, 300, (m,), generator=g)


@pytest.mark.parametrize("groups, spread, lam", [(4, 0.1, 100.0), (4, 0.1, 1e4), (6, 1.0, 3.0), (1, 1.0, 1.0),
                                                 (3, 0.05, 0.01)])
def test_screened_weights_equal_the_dense_solve(groups, spread, lam):
    """The screened computation (clusters, triangle bounds, exact distances of the kept pairs)
    gives the dense water-filling of all m² distances: to rounding (the kept distances come from
    GEMMs of other shapes), with the same zeros; for all rows, a block of rows (a rank's), tiny
    clusters and one cluster (nothing screened)."""
    G, n = _grouped_gradients(257, 23, groups, spread, seed=groups)
    dense = water_filling(pairwise_sqdist(G), n, lam)
    for clusters in (16, 1, 300):
        got = screened_weights(G, n, lam, clusters=clusters)
        torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-12)
        assert torch.equal(got > 1e-9, dense > 1e-9)
    part = screened_weights(G, n, lam, slice(100, 170))
    torch.testing.assert_close(part, dense[100:170], rtol=1e-9, atol=1e-12)
    if groups > 1:  # weight only inside a group: the screen had something to skip
        assert float((dense > 0).double().mean()) < 0.6


@pytest.mark.parametrize("m", [1031, 1280])
def test_screened_weights_of_streamed_rows(m):
    """From 1,024 clients on, the native kernel writes whole output rows by non-temporal stores from
    a scratch row (csrc/cpu/water_fill.cpp ``stream_row``): rows of 1,031 entries start unaligned
    (plain stores up to the first 64-byte boundary), rows of 1,280 aligned. Every entry, zeros
    included, as the dense solve's (to the products' rounding); a block of rows too; the same bits
    at any thread count."""
    G, n = _grouped_gradients(m, 9, 3, 0.1, seed=m, dtype=torch.float32)
    dense = water_filling(pairwise_sqdist(G), n, 30.0)
    got = screened_weights(G, n, 30.0, products=torch.float64)
    torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-12)
    assert torch.equal(got > 1e-9, dense > 1e-9) and float((dense > 0).double().mean()) < 0.6
    # float32 products (groups of 64 rows and more): within their rounding, the same zeros
    low = screened_weights(G, n, 30.0)
    torch.testing.assert_close(low, dense, rtol=0, atol=1e-6)
    assert bool((low[dense == 0] == 0).all())
    part = screened_weights(G, n, 30.0, slice(7, 500), products=torch.float64)  # (products of other shapes)
    torch.testing.assert_close(part, dense[7:500], rtol=1e-9, atol=1e-12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(screened_weights(G, n, 30.0), low)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("screen", ["clusters", "principal"])
def test_screened_weights_float32_gradients_and_threads(screen):
    """float32 gradients: the cluster screen's groups here are below 64 rows, so its products are
    float64 (the dense solve to rounding); the principal screen takes float32 differences (each
    cost within ~1.1e-6 relatively), float64 ones with products=torch.float64. The same bits at 1
    and 2 threads."""
    G, n = _grouped_gradients(200, 31, 4, 0.2, seed=9, dtype=torch.float32)
    dense = water_filling(pairwise_sqdist(G), n, 50.0)
    got = screened_weights(G, n, 50.0, screen=screen)
    if screen == "clusters":
        torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-12)
    else:
        torch.testing.assert_close(got, dense, rtol=0, atol=5e-7)
        torch.testing.assert_close(screened_weights(G, n, 50.0, screen=screen, products=torch.float64), dense,
                                   rtol=1e-9, atol=1e-12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = screened_weights(G, n, 50.0, screen=screen)
        torch.set_num_threads(2)
        assert torch.equal(screened_weights(G, n, 50.0, screen=screen), one)
    finally:
        torch.set_num_threads(threads)


def _contexts_gradients(m=512, d=40, contexts=4, seed=3):
    """float32 gradients of m clients in ``contexts`` groups (≥ 64 clients each, so that the
    screened solve takes its float32 products), noise ∝ 1/√n as a client's sampling noise."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(50, 250, (m,), generator=g)
    centres = 3.0 * torch.randn(contexts, d, generator=g, dtype=torch.float64)
    G = centres[torch.arange(m) % contexts] + torch.randn(m, d, generator=g, dtype=torch.float64) / n[:, None].sqrt()
    return (G + 10.0).to(torch.float32), n


@pytest.mark.parametrize("candidates", [256, 8])
def test_water_levels_solve_the_level_equation(candidates):
    """``reference.water_levels`` (the level PERM's float64 probe reads): Σ_j w_j·max(0, τ − c_j) = 1
    for each row (random costs, ties, a row whose cheapest column alone carries it), with enough
    candidates at once and with too few (the retries with more)."""
    from pflcore.backends import reference
    g = torch.Generator().manual_seed(5)
    costs = torch.rand(7, 300, generator=g, dtype=torch.float64)
    costs[1] = 0.25  # every column tied
    costs[2, 0] = -10.0  # (one column far below the others: its level alone)
    w = torch.rand(300, generator=g, dtype=torch.float64) + 0.1
    tau = reference.water_levels(costs, w, candidates)
    torch.testing.assert_close((w * (tau[:, None] - costs).clamp(min=0)).sum(1), torch.ones(7, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert float(tau[2]) == pytest.approx(-10.0 + 1.0 / float(w[0]), rel=1e-12)


def _noisy_gradients(m, d, seed):
    """float32 gradients without groups (a trained model's: sampling noise only, all close)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(50, 250, (m,), generator=g)
    G = torch.randn(m, d, generator=g, dtype=torch.float64) / n[:, None].sqrt() + 1.0
    return G.to(torch.float32), n


@pytest.mark.parametrize("lam, float32_pass", [(0.05, False), (1e5, True)])
def test_screened_weights_skip_a_float32_pass_a_sample_shows_too_coarse(monkeypatch, lam, float32_pass):
    """A large group whose rows' water levels sit far below its spread (small λ_α: each client
    weighs its nearest few) goes straight to float64 products: no float32 pass, α the dense
    float64 solve's to rounding. With levels above the spread (large λ_α) the float32 pass runs
    and is kept."""
    from pflcore.algorithms import perm
    G, n = _noisy_gradients(1100, 30, seed=9)
    calls = []
    real = perm._shifted_gram32
    monkeypatch.setattr(perm, "_shifted_gram32", lambda *a: calls.append(a[1].numel()) or real(*a))
    got = screened_weights(G, n, lam)
    dense = water_filling(pairwise_sqdist(G), n, lam)
    assert bool(calls) == float32_pass
    scale = float(dense.max())
    tol = 2e-6 if float32_pass else 1e-9
    assert float((got - dense).abs().max()) <= tol * scale
    assert perm._float64_needed(G, torch.arange(1100), torch.arange(1100), n.double() / (2 * lam),
                                torch.arange(1100)) == (not float32_pass)


@pytest.mark.usefixtures("cpu_level")
def test_rows_of_a_group_from_its_columns_symmetric_products():
    """A group's rows among its columns (r ≥ k/2): the products taken as those rows of the
    columns' symmetric products equal the direct product (float64: to rounding; float32 shifted:
    to float32 rounding, each row's cost to its own column exactly 0)."""
    from pflcore.algorithms import perm
    sym = perm._sym_kernel()
    g = torch.Generator().manual_seed(11)
    Gc = torch.randn(300, 45, generator=g, dtype=torch.float64)
    cols = torch.arange(0, 300, 2)  # 150 columns, ascending
    rows = cols[torch.randperm(150, generator=g)[:90]].sort().values  # 90 of them
    pos = torch.searchsorted(cols, rows)
    torch.testing.assert_close(perm._gram(Gc, rows, cols, sym, pos), Gc[rows] @ Gc[cols].T, rtol=1e-12, atol=1e-12)
    G32 = (Gc + 5.0).to(torch.float32)
    gram, sq_r, sq_c, spread = perm._shifted_gram32(G32, rows, cols, sym, pos)
    Y = G32.double()[cols]
    Y -= Y.mean(dim=0)
    torch.testing.assert_close(gram.double(), Y[pos] @ Y.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sq_c, (Y * Y).sum(1), rtol=1e-5, atol=1e-5)
    if sym is not None:  # (the symmetric products' own diagonal: the own costs cancel exactly)
        own = sq_r + sq_c[pos] - 2.0 * gram[torch.arange(90), pos].double()
        assert torch.equal(own, torch.zeros(90, dtype=torch.float64))


def test_screened_weights_float32_products_against_the_float64_solve(monkeypatch):
    """float32 gradients: the groups' products in float32 (rows shifted by their columns' mean)
    give the float64 dense solve's α to ~1e-6 of its largest entry, with the same support
    above that; products=torch.float64 gives it to rounding. The float32 path is the one taken."""
    from pflcore.algorithms import perm
    G, n = _contexts_gradients()
    lam = 2.0
    dense = water_filling(pairwise_sqdist(G), n, lam)
    calls = []
    real = perm._shifted_gram32
    monkeypatch.setattr(perm, "_shifted_gram32", lambda *a: calls.append(a[1].numel()) or real(*a))
    got = screened_weights(G, n, lam, screen="clusters")
    assert calls and max(calls) >= 64
    scale = float(dense.max())
    assert float((got - dense).abs().max()) <= 2e-6 * scale
    big = dense > 1e-5 * scale
    assert torch.equal(got[big] > 0, dense[big] > 0)
    torch.testing.assert_close(got.sum(1), torch.ones(G.shape[0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(screened_weights(G, n, lam, products=torch.float64, screen="clusters"), dense, rtol=1e-9, atol=1e-12)
    # the groups solved by 2 and 3 worker threads (torch's thread count): bitwise the one-thread α
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = screened_weights(G, n, lam, screen="clusters")
        for t in (2, 3):
            torch.set_num_threads(t)
            assert torch.equal(screened_weights(G, n, lam, screen="clusters"), one), t
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    # where the levels are small against the group's spread (λ_α → 0: a client keeps its nearest
    # neighbours), the float32 rounding would matter: those groups are solved again in float64
    calls.clear()
    tiny = screened_weights(G, n, 1e-4, screen="clusters")
    assert calls, "the float32 products were tried first"
    assert torch.equal(tiny, screened_weights(G, n, 1e-4, products=torch.float64, screen="clusters"))
    with pytest.raises(ValueError, match="products: expected None, torch.float32 or torch.float64"):
        screened_weights(G, n, lam, products=torch.float16, screen="clusters")


@pytest.mark.parametrize("d, offset", [(3000, 1e3), (9, 0.0)])
def test_screened_weights_screen_in_float32_is_conservative(monkeypatch, d, offset):
    """float32 gradients are screened in float32 (their rows centred in float32, the distances to
    the cluster centres by float32 products, with bounds on that rounding): the weights are still
    the dense solve's, wide rows and a large common offset included, and the float64 rows are
    only made for a group that needs float64 products (here products=torch.float64)."""
    from pflcore.algorithms import perm
    G, n = _grouped_gradients(300, d, 4, 0.05, seed=d)
    G = (G + offset).to(torch.float32)
    dense = water_filling(pairwise_sqdist(G), n, 3.0)
    made = []
    real = perm._centred
    monkeypatch.setattr(perm, "_centred", lambda A: made.append(A.shape) or real(A))
    got = screened_weights(G, n, 3.0, products=torch.float64, screen="clusters")
    torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-11)
    assert torch.equal(got > 1e-9, dense > 1e-9)
    assert float((dense > 0).double().mean()) < 0.6  # weight only inside a group: there was something to skip
    assert made == [G.shape]  # once, for the float64 products
    # float32 products where the levels allow them: no float64 copy of the rows at all
    G, n = _contexts_gradients()
    made.clear()
    screened_weights(G, n, 200.0, screen="clusters")  # (levels large against the groups' spread: no group falls back)
    assert made == []


@pytest.mark.usefixtures("cpu_level")  # every CPU level's copy of the kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m, d, groups", [(300, 23, 4), (64, 9, 2), (500, 610, 6), (40, 17, 1)])
def test_native_screen_statistics_equal_the_torch_ones(dtype, m, d, groups):
    """The screen's statistics in two native passes (csrc/cpu/perm_screen.cpp) against their torch
    code: the same farthest-point clusters (well separated groups: no near-ties), squared norms,
    centres' norms and distances to the centres to float rounding; bitwise the same at 1 and 3
    threads; and fewer clusters than asked where the rows have fewer distinct projections."""
    from pflcore.algorithms import perm
    if perm._screen_kernel(torch.zeros(1, 1)) is None:
        pytest.skip("no native module")
    G, _ = _grouped_gradients(m, d, groups, 0.05, seed=m + d, dtype=dtype)
    omega = perm._projection(d, min(16, d))
    got = perm._screen_stats_native(G, omega, 16)
    want = perm._screen_stats_torch(G, omega, 16)
    assert got[0] is None  # (the shifted rows are not stored)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip((got[1], got[4]), (want[1], want[4])):  # squared norms
        torch.testing.assert_close(a, b, rtol=rtol, atol=0.0)
    # t: both within the screen's error term E = (d + 3)·2u·(‖s‖² + ‖μ‖²) of the exact value
    E = (d + 3) * torch.finfo(dtype).eps * (want[1][:, None] + want[4][None, :])
    assert bool(((got[5] - want[5]).abs() <= 2 * E).all())
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            again = perm._screen_stats_native(G, omega, 16)
            assert all(torch.equal(a, b) for a, b in zip(again[1:], got[1:])), t
    finally:
        torch.set_num_threads(threads)
    # three distinct rows: three clusters (each row's projection is computed alike, so copies lie at
    # distance 0; MKL's product may round copies differently, splitting them in the torch code)
    D = G[:3].repeat(5, 1)
    few = perm._screen_stats_native(D, omega, 16)
    assert torch.equal(few[2], few[2][:3].repeat(5)) and sorted(few[2][:3].tolist()) == [0, 1, 2]
    assert few[3].tolist() == [5.0, 5.0, 5.0] and few[5].shape == (15, 3)


def test_screened_weights_errors():
    G, n = _grouped_gradients(10, 3, 2, 0.1, seed=1)
    with pytest.raises(ValueError, match="lam_alpha"):
        screened_weights(G, n, 0.0)
    with pytest.raises(ValueError, match=r"sizes: expected shape \[10\]"):
        screened_weights(G, n[:9], 1.0)
    with pytest.raises(ValueError, match="sizes: expected positive"):
        screened_weights(G, n * 0, 1.0)
    with pytest.raises(ValueError, match=r"G: expected shape \[m, d\]"):
        screened_weights(G[0], n, 1.0)
    bad = G.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="G: expected finite"):
        screened_weights(bad, n, 1.0)


def test_mixing_weights_of_many_clients_take_the_screen(monkeypatch):
    """``weights_from_gradients`` screens from SCREEN_MIN_CLIENTS clients on; same α as dense."""
    from pflcore.algorithms import perm
    G, n = _grouped_gradients(120, 12, 3, 0.1, seed=4)
    calls = []
    real = perm.screened_weights
    monkeypatch.setattr(perm, "screened_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(perm, "SCREEN_MIN_CLIENTS", 100)
    got = perm.weights_from_gradients(G, n, 20.0)
    assert calls == [1]
    torch.testing.assert_close(got, water_filling(pairwise_sqdist(G), n, 20.0), rtol=1e-9, atol=1e-12)


def test_merged_patterns_join_groups_whose_columns_hold_theirs():
    """A row group joins a kept group whose clusters include its own when that group has at most
    MERGE_GROWTH times its columns (widest patterns kept first); otherwise it stays apart."""
    from pflcore.algorithms.perm import MERGE_GROWTH, _merged_patterns
    count = torch.tensor([100.0, 100.0, 10.0, 100.0])
    patterns = torch.tensor([[1, 0, 0, 0],   # 100 columns, inside pattern 2 (110): joins it
                             [0, 0, 0, 1],   # 100 columns, inside nothing wider: kept
                             [1, 0, 1, 0],   # 110 columns: kept (the widest holding pattern 0)
                             [1, 1, 1, 0],   # 210: kept
                             [0, 1, 0, 0]],  # 100, inside pattern 3 (210 > 1.25·100): kept
                            dtype=torch.bool)
    assert MERGE_GROWTH == 1.25
    group = torch.tensor([0, 1, 2, 3, 4, 0, 2])
    kept, new_group = _merged_patterns(patterns, group, count)
    assert torch.equal(kept, patterns[[1, 2, 3, 4]])
    assert new_group.tolist() == [1, 0, 1, 2, 3, 1, 1]
    # nothing to merge: the same objects back
    same, g = _merged_patterns(patterns[[1, 3]], torch.tensor([0, 1]), count)
    assert torch.equal(same, patterns[[1, 3]]) and g.tolist() == [0, 1]


def test_screened_weights_with_merged_groups_equal_the_dense_solve(monkeypatch):
    """Where a context's rows need different neighbouring clusters (several patterns), the merged
    groups (fewer, wider) give the dense α to rounding, like the unmerged ones."""
    from pflcore.algorithms import perm
    G, n = _grouped_gradients(300, 17, 3, 0.6, seed=12)
    dense = water_filling(pairwise_sqdist(G), n, 5.0)
    sizes = []
    real = perm._merged_patterns
    monkeypatch.setattr(perm, "_merged_patterns",
                        lambda p, g, c: (lambda out: sizes.append((p.shape[0], out[0].shape[0])) or out)(real(p, g, c)))
    merged = screened_weights(G, n, 5.0, clusters=24, screen="clusters")
    assert sizes[0][1] < sizes[0][0], sizes  # this case has groups to merge
    monkeypatch.setattr(perm, "MERGE_GROWTH", 0.0)  # no merging
    apart = screened_weights(G, n, 5.0, clusters=24, screen="clusters")
    for got in (merged, apart):
        torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-12)
        assert torch.equal(got > 1e-9, dense > 1e-9)


def test_row_patterns_equal_unique_rows():
    """The packed-key grouping of screened_weights gives torch.unique(dim=0)'s patterns and
    inverse, for widths up to the packing limit and past it (the fallback)."""
    from pflcore.algorithms.perm import _row_patterns
    g = torch.Generator().manual_seed(4)
    for k in (1, 5, 62, 63, 80):
        need = torch.rand(300, k, generator=g) < 0.5
        need[100:200] = need[0]  # repeated rows
        pats, inv = _row_patterns(need)
        want_pats, want_inv = torch.unique(need, dim=0, return_inverse=True)
        assert torch.equal(pats, want_pats) and torch.equal(inv, want_inv)


@pytest.mark.parametrize("n", [255, 256, 301, 517])
def test_symmetric_gram_blocks_equal_the_product(n):
    """_gram's block-symmetric product (rows = cols; from 256 rows on, fewer take one product)
    equals the plain product to rounding, its blocks below the diagonal the transposes of those
    above; other row/column sets give the plain product."""
    from pflcore.algorithms.perm import _gram
    g = torch.Generator().manual_seed(n)
    Gc = torch.randn(600, 37, generator=g, dtype=torch.float64)
    rows = torch.randperm(600, generator=g)[:n].sort().values
    got = _gram(Gc, rows, rows)
    torch.testing.assert_close(got, Gc[rows] @ Gc[rows].T, rtol=1e-13, atol=1e-12)
    if n >= 256:
        a, b = slice(0, n // 4), slice(n // 4, n // 2)
        assert torch.equal(got[b, a], got[a, b].T)
    every = _gram(Gc[:n], torch.arange(n), None)
    torch.testing.assert_close(every, Gc[:n] @ Gc[:n].T, rtol=1e-13, atol=1e-12)
    other = _gram(Gc, rows, rows.flip(0))
    torch.testing.assert_close(other, Gc[rows] @ Gc[rows.flip(0)].T, rtol=1e-13, atol=1e-12)


@pytest.mark.usefixtures("cpu_level")  # once per CPU capability level this CPU runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sym_products_equal_the_product(dtype):
    """The native symmetric products Y·Yᵀ (upper block triangle, mirrored) against torch's
    product in float64: odd shapes around the panels (16/32 columns) and row blocks (6/12 rows),
    one row, one column; the result exactly symmetric."""
    from pflcore import backend
    core = backend.loaded("native")
    if core is None:
        pytest.skip("the native module is not built")
    g = torch.Generator().manual_seed(31)
    for n, d in [(1, 1), (1, 9), (5, 3), (12, 17), (13, 40), (33, 7), (64, 64), (97, 130), (257, 61)]:
        Y = torch.randn(n, d, generator=g, dtype=dtype)
        out = torch.full((n, n), 7.0, dtype=dtype)
        core.sym_products(dtype is torch.float64, Y.data_ptr(), n, d, out.data_ptr())
        want = Y.double() @ Y.double().T
        tol = dict(rtol=1e-5, atol=1e-5 * d) if dtype is torch.float32 else dict(rtol=1e-12, atol=1e-12 * d)
        torch.testing.assert_close(out.double(), want, **tol)
        assert torch.equal(out, out.T)
    # OpenMP threads split the panels: bitwise the same at 1, 2 and 3 threads
    Y = torch.randn(300, 250, generator=g, dtype=dtype)
    threads, outs = torch.get_num_threads(), []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out = torch.empty(300, 300, dtype=dtype)
            core.sym_products(dtype is torch.float64, Y.data_ptr(), 300, 250, out.data_ptr())
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_screened_weights_take_the_native_symmetric_products_where_they_serve(monkeypatch):
    """On the avx512 level the groups' symmetric products come from the native kernel (elsewhere
    from torch); α the same to rounding either way, and the dense solve's."""
    from pflcore import backend
    from pflcore.algorithms import perm
    G, n = _contexts_gradients()
    dense = water_filling(pairwise_sqdist(G), n, 200.0)
    calls = []
    core = backend.loaded("native")
    native = perm._sym_kernel()
    if native is not None:
        class Spy:
            def __getattr__(self, name):
                return getattr(core, name)

            def sym_products(self, *a):
                calls.append(a[2])
                return core.sym_products(*a)
        monkeypatch.setattr(perm, "_sym_kernel", lambda: Spy())
    got = screened_weights(G, n, 200.0, screen="clusters")
    assert (len(calls) > 0) == (native is not None)
    monkeypatch.setattr(perm, "_sym_kernel", lambda: None)
    torch_path = screened_weights(G, n, 200.0, screen="clusters")
    scale = float(dense.max())
    for a in (got, torch_path):
        assert float((a - dense).abs().max()) <= 2e-6 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m, d, groups, spread, lam, rows", [
    (600, 23, 4, 0.05, 100.0, slice(None)), (700, 61, 6, 0.3, 3.0, slice(150, 420)),
    (520, 9, 2, 1.0, 1e4, slice(0, 1)), (800, 610, 5, 0.1, 30.0, slice(799, 800))])
def test_native_screen_bounds_equal_the_torch_ones(monkeypatch, dtype, m, d, groups, spread, lam, rows):
    """The screen's bounds in one native call (csrc/cpu/perm_bounds.cpp) against their torch code
    (_screen_need): the same clusters needed by every row (as keys: the same row patterns and
    groups), so bitwise the same α; for row slices (a sharded rank's rows) and both precisions."""
    from pflcore.algorithms import perm
    if perm._bounds_kernel(torch.zeros(1)) is None:
        pytest.skip("no native module")
    G, n = _grouped_gradients(m, d, groups, spread, seed=m + d, dtype=dtype)
    seen = {}

    def spy(name, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            seen[name] = out
            return out
        return wrapped

    merged = perm._merged_patterns  # (its input: the row patterns and groups)
    monkeypatch.setattr(perm, "_merged_patterns", lambda p, g, c: merged(*spy("native", lambda *a: a)(p, g), c))
    native = screened_weights(G, n, lam, rows, screen="clusters")
    monkeypatch.setattr(perm, "_bounds_kernel", lambda G: None)
    monkeypatch.setattr(perm, "_merged_patterns", lambda p, g, c: merged(*spy("torch", lambda *a: a)(p, g), c))
    reference = screened_weights(G, n, lam, rows, screen="clusters")
    assert torch.equal(native, reference)
    (pn, gn), (pt, gt) = seen["native"], seen["torch"]
    assert torch.equal(pn, pt) and torch.equal(gn, gt)
    # and the screen did skip clusters for some rows (else the test would not exercise the bounds)
    if groups > 1:
        assert not bool(pn.all())
