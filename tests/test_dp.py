"""Client-level differential privacy (issue 27): the mechanism op ``clip_and_sum`` against its
reference, its clipping and noise statistics, its bitwise determinism over threads and over
ways of splitting the rows (ranks), and the run setting ``Privacy`` with its accounting."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pflcore
from pflcore import Privacy, algorithms as A, backend, data, models, ops
from pflcore.errors import NonFiniteError
from pflcore.ops.dp import dp_normals, run_clip_and_sum, tree_blocks, tree_combine
from pflcore.backends.reference import philox_normals

dpa = pytest.importorskip("dp_accounting")  # the dev extra has it

# float64: the rows' norms are summed in another order by the kernel's vector lanes than by torch
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _philox4x64(ctr, key):
    """Philox4x64-10 in plain Python big integers (Salmon et al., SC'11)."""
    M0, M1, W0, W1, MASK = 0xD2E7470EE14C6C93, 0xCA5A826395121157, 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B, 2**64 - 1
    c, k = list(ctr), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + W0) & MASK, (k[1] + W1) & MASK]
        p0, p1 = M0 * c[0], M1 * c[2]
        c = [(p1 >> 64) ^ c[1] ^ k[0], p1 & MASK, (p0 >> 64) ^ c[3] ^ k[1], p0 & MASK]
    return c


def test_the_generator_is_philox4x64_10():
    # Random123's known answer for counter 0, key 0
    assert _philox4x64([0, 0, 0, 0], [0, 0])[:2] == [0x16554D9ECA36314C, 0xDB20FE9D672D0FDC]
    # the reference's numpy generator draws the blocks the mechanism defines (word 0 = block + 1)
    gen = np.random.Philox(key=np.array([7, 0], dtype=np.uint64),
                           counter=np.array([0, 5, 0x64702D6E6F697365, 0], dtype=np.uint64))
    assert [int(v) for v in gen.random_raw(4)] == _philox4x64([1, 5, 0x64702D6E6F697365, 0], [7, 0])


def test_native_normals_equal_the_references_philox():
    for seed, counter, n in [(0, 0, 1), (7, 5, 11), (2**64 - 1, 2**63 + 3, 1001)]:
        native = dp_normals(n, seed, counter)
        ref = philox_normals(n, seed, counter)
        assert native.shape == (n,)
        torch.testing.assert_close(native, ref, rtol=1e-13, atol=1e-13)  # libm vs torch's cos/sin/log
    assert not torch.equal(dp_normals(8, 1, 0), dp_normals(8, 1, 1))
    assert not torch.equal(dp_normals(8, 1, 0), dp_normals(8, 2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("R,d", [(0, 3), (1, 1), (7, 5), (130, 61), (1025, 3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_clip_and_sum_equals_reference(dtype, R, d, weighted):
    g = torch.Generator().manual_seed(R * 31 + d)
    u = (torch.randn(R, d, generator=g, dtype=torch.float64) * torch.rand(R, 1, generator=g, dtype=torch.float64)
         * 4).to(dtype)
    w = torch.rand(R, generator=g, dtype=torch.float64).to(dtype) if weighted else None
    got = ops.clip_and_sum(u, w, clip_norm=0.9, noise_multiplier=0.6, seed=11, counter=R)
    want = ops.clip_and_sum_ref(u, w, clip_norm=0.9, noise_multiplier=0.6, seed=11, counter=R)
    assert got.sum.dtype == dtype and got.sum.shape == (d,)
    assert got.clipped == want.clipped
    torch.testing.assert_close(got.sum, want.sum, rtol=TOL[dtype], atol=TOL[dtype])
    # against the formula written out (no tree, no Philox): noise 0
    u64 = u.double()
    norms = u64.norm(dim=1)
    scale = torch.clamp(0.9 / norms, max=1.0) * (1.0 if w is None else w.double())
    exact = (scale[:, None] * u64).sum(0)
    plain = ops.clip_and_sum(u, w, clip_norm=0.9, seed=11, counter=R).sum
    torch.testing.assert_close(plain.double(), exact, rtol=TOL[dtype], atol=TOL[dtype])
    assert got.clipped == int((norms > 0.9).sum())


def test_numpy_in_numpy_out():
    u = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    out = ops.clip_and_sum(u, clip_norm=1.0)
    assert isinstance(out.sum, np.ndarray) and out.sum.dtype == np.float32


def test_every_clipped_row_has_norm_at_most_c():
    u = torch.randn(300, 17, dtype=torch.float64) * torch.logspace(-2, 2, 300, dtype=torch.float64)[:, None]
    for r in range(0, 300, 37):
        one = ops.clip_and_sum(u[r: r + 1], clip_norm=1.5).sum
        assert float(one.norm()) <= 1.5 * (1 + 1e-12)
        if float(u[r].norm()) <= 1.5:
            assert torch.equal(one, u[r])  # a row within C passes unchanged
    total = ops.clip_and_sum(u, clip_norm=1.5)
    assert float(total.sum.norm()) <= 300 * 1.5
    assert total.clipped == int((u.norm(dim=1) > 1.5).sum())


def test_noise_statistics():
    """R = 0: the op's output is the noise alone, N(0, (σC)²) per coordinate."""
    n, sigma, C = 200_000, 1.3, 2.0
    noise = ops.clip_and_sum(torch.zeros(0, n, dtype=torch.float64), clip_norm=C, noise_multiplier=sigma,
                             seed=5, counter=9).sum
    var = (sigma * C) ** 2
    assert abs(float(noise.mean())) < 5 * math.sqrt(var / n)
    # the sample variance's standard error is var·sqrt(2/(n-1)): 5 of them
    assert abs(float(noise.var()) - var) < 5 * var * math.sqrt(2 / (n - 1))
    # Gaussian tails: P(|x| > 3σ) = 0.0027 within its binomial 5-sigma band
    frac = float((noise.abs() > 3 * math.sqrt(var)).double().mean())
    assert abs(frac - 0.0027) < 5 * math.sqrt(0.0027 * 0.9973 / n)
    # neighbouring coordinates (Box–Muller pairs) are uncorrelated
    corr = float(torch.corrcoef(torch.stack([noise[0::2], noise[1::2]]))[0, 1])
    assert abs(corr) < 5 / math.sqrt(n / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitwise_the_same_at_one_and_two_threads(dtype):
    u = torch.randn(3001, 67, dtype=dtype)  # R·d above the kernel's parallel threshold
    w = torch.rand(3001, dtype=dtype)
    before = pflcore.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            pflcore.set_num_threads(n)
            outs.append(ops.clip_and_sum(u, w, clip_norm=0.5, noise_multiplier=1.0, seed=3, counter=4))
    finally:
        pflcore.set_num_threads(before)
    assert torch.equal(outs[0].sum, outs[1].sum) and outs[0].clipped == outs[1].clipped


@pytest.mark.parametrize("adapter", ["native", "reference"])
def test_bitwise_the_same_however_the_rows_are_split(adapter):
    """What a sharded run does: each rank sums its rows' aligned blocks, the blocks are combined
    along the same tree. Any cut gives the one-call sum's bits."""
    g = torch.Generator().manual_seed(0)
    R, d = 777, 9
    u = torch.randn(R, d, generator=g)
    with backend.use(adapter):
        whole, _ = run_clip_and_sum(u, None, 1.0, 0.0, 0, 0)
        for cuts in ([0, R], [0, 1, R], [0, 300, R], [0, 129, 500, 501, R], [0, R, R]):
            nodes = {}
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                for first, k in tree_blocks(lo, hi):
                    nodes[(first, k)] = run_clip_and_sum(u[first: first + (1 << k)], None, 1.0, 0.0, 0, 0)[0]
            assert torch.equal(tree_combine(nodes, R, d), whole), cuts


def test_tree_blocks_tile_the_range():
    for lo, hi in [(0, 0), (0, 1), (3, 17), (5, 6), (64, 1000), (1023, 1025)]:
        blocks = tree_blocks(lo, hi)
        pos = lo
        for first, k in blocks:
            assert first == pos and first % (1 << k) == 0
            pos += 1 << k
        assert pos == hi


@pytest.mark.parametrize("kw,match", [
    ({"clip_norm": 0.0}, "clip_norm"), ({"clip_norm": float("nan")}, "clip_norm"),
    ({"clip_norm": 1.0, "noise_multiplier": -1.0}, "noise_multiplier"),
    ({"clip_norm": 1.0, "seed": -1}, "seed"), ({"clip_norm": 1.0, "counter": 2**64}, "counter"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        ops.clip_and_sum(torch.ones(2, 3), **kw)


@pytest.mark.parametrize("adapter", ["native", "reference"])
def test_bad_values_are_named(adapter):
    u = torch.ones(4, 3)
    with backend.use(adapter):
        u[2, 1] = float("nan")
        with pytest.raises(NonFiniteError, match="updates: row 2"):
            ops.clip_and_sum(u, clip_norm=1.0)
        with pytest.raises(ValueError, match=r"weights: expected weights in \[0, 1\].*weights\[1\] = 1.5"):
            ops.clip_and_sum(torch.ones(4, 3), torch.tensor([1.0, 1.5, 0.0, 0.2]), clip_norm=1.0)
    with pytest.raises(ValueError, match="updates: expected shape"):
        ops.clip_and_sum(torch.ones(3), clip_norm=1.0)
    with pytest.raises(ValueError, match="weights"):
        ops.clip_and_sum(torch.ones(3, 2), torch.ones(2), clip_norm=1.0)


# ---- the run setting -----------------------------------------------------------------------------

def _fed():
    return data.synthetic(0.5, 0.5, num_clients=40, dim=8, num_classes=3, seed=1, size_scale=1, max_size=80)


def _run(alg, privacy, rounds=4, **kw):
    fed = _fed()
    return pflcore.run(alg, fed, models.Softmax(8, 3), rounds=rounds, clients_per_round=kw.pop("k", 10),
                       eval_every=kw.pop("eval_every", 2), progress=False, privacy=privacy, **kw)


def test_without_noise_or_clipping_the_release_is_the_plain_mean_of_the_updates():
    """FedAvg under Privacy(z=0, C huge, uniform weighting) with fixed cohorts: w ← w + mean_i(θ_i − w),
    the unweighted mean of the cohort's local models."""
    fed, model = _fed(), models.Softmax(8, 3)
    priv = Privacy(clip_norm=1e12, noise_multiplier=0.0, sampling="fixed", accountant="rdp", weighting="uniform")
    res = pflcore.run(A.FedAvg(lr=0.1, local_steps=3), fed, model, rounds=1, clients_per_round=40,
                      progress=False, privacy=priv)
    theta = model.zeros(40)
    ops.local_steps(model, theta, fed.train, steps=3, lr=0.1)
    torch.testing.assert_close(res.global_model, theta.double().mean(0).float(), rtol=1e-6, atol=1e-7)
    assert res.history[-1]["epsilon"] is None  # no noise: no guarantee, not a number


def test_capped_weights_are_dp_fedavgs():
    """weighting="capped": Σ_i min(1, n_i/ŵ)(θ_i − w) / (q·Σ_k min(1, n_k/ŵ)); with a cap above every
    client's rows and everyone sampled it is FedAvg's sample-weighted mean; with the median cap
    the weights are min(1, n_i / median)."""
    fed, model = _fed(), models.Softmax(8, 3)
    theta = model.zeros(40)
    ops.local_steps(model, theta, fed.train, steps=3, lr=0.1)
    n = fed.train.sizes.double()
    for cap, w in ((1e9, n / 1e9), (None, torch.clamp(n / n.median(), max=1.0))):
        priv = Privacy(clip_norm=1e12, noise_multiplier=0.0, sampling="fixed", accountant="rdp", weight_cap=cap)
        res = pflcore.run(A.FedAvg(lr=0.1, local_steps=3), fed, model, rounds=1, clients_per_round=40,
                          progress=False, privacy=priv)
        want = (w[:, None] * theta.double()).sum(0) / w.sum()
        torch.testing.assert_close(res.global_model.double(), want, rtol=1e-5, atol=1e-6)


def test_epsilon_equals_dp_accountings_direct_computation():
    z, rounds, k, N = 1.1, 6, 10, 40
    res = _run(A.FedAvg(lr=0.1, local_steps=2), Privacy(clip_norm=0.5, noise_multiplier=z), rounds=rounds, k=k)
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dpa.PoissonSampledDpEvent(k / N, dpa.GaussianDpEvent(z)), rounds)
    assert res.history[-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)  # not bit-pinned (FFTs)
    assert res.history[0]["epsilon"] == 0.0
    eps = [row["epsilon"] for row in res.history]
    assert eps == sorted(eps) and eps[-1] > 0
    # RDP, fixed cohorts: replace-one adjacency, sensitivity 2C
    res = _run(A.FedAvg(lr=0.1, local_steps=2), Privacy(clip_norm=0.5, noise_multiplier=z, sampling="fixed",
                                                        accountant="rdp"), rounds=rounds, k=k)
    from dp_accounting.privacy_accountant import NeighboringRelation
    acc = dpa.rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(N, k, dpa.GaussianDpEvent(z / 2)), rounds)
    assert res.history[-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_two_releases_per_round_are_accounted():
    """The splitting family releases two means per round: ε is that of one Gaussian of
    multiplier z/√2 per round."""
    fed = data.least_squares(num_clients=12, samples_per_client=20, dim=4, seed=0)
    res = pflcore.run(A.FedPi(eta=0.5, prox_steps=3), fed, models.LeastSquares(4, fit_intercept=False), rounds=3,
                      clients_per_round=6, progress=False, privacy=Privacy(clip_norm=1.0, noise_multiplier=2.0))
    # z/√2 as 1/z² = Σ 1/z_i² computes it: 2/√2 rounds one ulp lower, and that ulp moved ε by
    # 1.6e-12 relative on an AVX-512 machine (the PLD's FFTs), past a 1e-12 tolerance
    z = (2.0 ** -2 + 2.0 ** -2) ** -0.5
    assert z == pytest.approx(2.0 / math.sqrt(2), rel=1e-15)
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dpa.PoissonSampledDpEvent(6 / 12, dpa.GaussianDpEvent(z)), 3)
    # not bit-pinned: the PLD's FFTs round differently on other CPUs; a wrong multiplier, sampling
    # rate or release count moves ε by far more than 1e-9
    assert res.history[-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_a_target_epsilon_is_met():
    res = _run(A.FedAvg(lr=0.1, local_steps=2), Privacy(clip_norm=0.5, epsilon=3.0, accountant="rdp"), rounds=5)
    assert 3.0 * 0.99 <= res.history[-1]["epsilon"] <= 3.0 * (1 + 1e-9)
    assert res.config["privacy"]["noise_multiplier_run"] > 0


def test_adaptive_clipping_moves_the_clip_norm_toward_the_quantile():
    # C far below every update norm: the unclipped fraction is ~0 < 0.5, so C grows each round
    res = _run(A.FedAvg(lr=0.1, local_steps=3), Privacy(clip_norm=1e-4, noise_multiplier=1.0, adaptive=True,
                                                        count_noise=1.0), rounds=6, eval_every=1)
    norms = [row["clip_norm"] for row in res.history]
    assert norms[0] == 1e-4 and all(b > a for a, b in zip(norms, norms[1:]))
    # ε of the pair (z_Δ on the update, 2σ_b on the count) is ε of one release of multiplier z
    plain = _run(A.FedAvg(lr=0.1, local_steps=3), Privacy(clip_norm=1e-4, noise_multiplier=1.0), rounds=6,
                 eval_every=1)
    assert res.history[-1]["epsilon"] == pytest.approx(plain.history[-1]["epsilon"], rel=1e-6)


@pytest.mark.parametrize("alg", [A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2),
                                 A.Ditto(lam=0.5, lr=0.1, local_steps=2), A.PerFedAvg(alpha=0.05, beta=0.05),
                                 A.APFL(alpha=0.3, lr=0.1, local_steps=2), A.FedProx(0.5, 0.1, 1.0, 2)],
                         ids=lambda a: a.name)
def test_personalized_algorithms_run_private_and_deterministic(alg):
    priv = Privacy(clip_norm=0.5, noise_multiplier=0.8)
    a, b = _run(alg, priv), _run(alg, priv)
    assert a.history[-1]["epsilon"] > 0
    assert torch.equal(a.global_model, b.global_model)
    other = _run(alg, priv, seed=1)
    assert not torch.equal(a.global_model, other.global_model)


@pytest.mark.parametrize("alg", [A.CGPFL(num_contexts=2, lam=12.0, lr=0.05, inner_steps=2, local_rounds=1),
                                 A.IFCA(num_clusters=2, lr=0.1, local_steps=2),
                                 A.L2SGD(lam=0.5, p=0.3, lr=0.5, iterations=2)], ids=lambda a: a.name)
def test_algorithms_without_a_private_form_are_refused(alg):
    with pytest.raises(ValueError, match=f"privacy: {alg.name} cannot run under client-level DP: its"):
        _run(alg, Privacy(noise_multiplier=1.0))


@pytest.mark.parametrize("kw,match", [({}, "exactly one of noise_multiplier and epsilon"),
                                      ({"noise_multiplier": 1.0, "epsilon": 2.0}, "exactly one"),
                                      ({"noise_multiplier": 1.0, "delta": 1.0}, "privacy.delta"),
                                      ({"noise_multiplier": 1.0, "sampling": "fixed"}, "privacy.accountant"),
                                      ({"noise_multiplier": 1.0, "clip_norm": -1}, "privacy.clip_norm"),
                                      ({"noise_multiplier": 1.0, "weighting": "sample"}, "privacy.weighting"),
                                      ({"noise_multiplier": 1.0, "weight_cap": 0}, "privacy.weight_cap")])
def test_bad_privacy_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        Privacy(**kw)


def test_a_private_run_resumes_bitwise(tmp_path):
    priv = Privacy(clip_norm=0.05, noise_multiplier=1.0, adaptive=True, count_noise=1.0)
    full = _run(A.FedAvg(lr=0.1, local_steps=2), priv, rounds=6, eval_every=1)
    part = _run(A.FedAvg(lr=0.1, local_steps=2), priv, rounds=3, eval_every=1, checkpoint=str(tmp_path / "ck"))
    assert part.history[-1]["clip_norm"] != 0.05
    res = pflcore.resume(str(tmp_path / "ck"), rounds=6, progress=False)
    assert torch.equal(res.global_model, full.global_model)
    for got, want in zip(res.history, full.history):
        assert got["epsilon"] == want["epsilon"] and got["clip_norm"] == want["clip_norm"]


def test_pfl_research_accountant_agrees_within_one_percent():
    """The same mechanism and settings in Apple's pfl-research (extra ``peers``) give our ε."""
    pfl_acc = pytest.importorskip("pfl.privacy.privacy_accountant")
    z, rounds, k, N = 1.0, 20, 10, 40
    theirs = pfl_acc.PLDPrivacyAccountant(num_compositions=rounds, sampling_probability=k / N, mechanism="gaussian",
                                          noise_parameter=z, delta=1e-5)
    res = _run(A.FedAvg(lr=0.1, local_steps=1), Privacy(clip_norm=0.5, noise_multiplier=z), rounds=rounds,
               eval_every=rounds)
    assert res.history[-1]["epsilon"] == pytest.approx(theirs.epsilon, rel=0.01)


def test_a_private_run_is_bitwise_the_same_on_one_and_two_ranks(tmp_path):
    """Two gloo ranks (tests/dist_worker.py): each sums its clients' aligned blocks, the blocks
    are combined along the one-process tree, the noise is drawn by (seed, counter): the global
    model and every recorded ε and clip norm equal the one-process run's bits."""
    import os

    import dist_worker as W
    from test_distributed import _launch

    names = ["dp_fedavg", "dp_fedpi"]
    spec = {"mode": "run", "cases": names, "rounds": 4, "out": str(tmp_path / "out")}
    for rank, (rc, _, err, _) in enumerate(_launch(str(tmp_path), spec)):
        assert rc == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [torch.load(os.path.join(spec["out"], f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for name in names:
        alg, fed, model, kw = W.case(name)
        one = pflcore.run(alg, fed, model, rounds=4, eval_every=1, progress=False, comm=pflcore.distributed.Comm(),
                          **kw)
        for r in ranks:
            assert torch.equal(r[name]["global"], one.global_model), name
            assert [h["epsilon"] for h in r[name]["history"]] == [h["epsilon"] for h in one.history]
            assert [h["clip_norm"] for h in r[name]["history"]] == [h["clip_norm"] for h in one.history]


def test_experiment_files_take_a_privacy_table(tmp_path):
    from pflcore import experiments
    from pflcore.experiment_config import ConfigError
    cfg = {"rounds": 2, "clients_per_round": 10, "eval_every": 1, "seeds": [0],
           "data": {"generator": "synthetic", "alpha": 0.5, "beta": 0.5, "num_clients": 30, "dim": 6,
                    "num_classes": 3, "size_scale": 1},
           "model": {"family": "softmax"}, "privacy": {"clip_norm": 0.5, "noise_multiplier": 1.0},
           "algorithms": {"DP": {"type": "fedavg", "lr": 0.1, "local_steps": 2},
                          "plain": {"type": "fedavg", "lr": 0.1, "local_steps": 2, "private": False}}}
    summary = experiments.run_experiment(cfg, progress=False, out=str(tmp_path), log=lambda *a: None)
    rows = {r["algorithm"]: r for r in summary["rows"]}
    assert rows["DP"]["epsilon"] > 0 and rows["plain"].get("epsilon") is None
    with pytest.raises(ConfigError, match="privacy"):
        experiments.run_experiment({**cfg, "privacy": {"clip_norm": 0.5, "noise_multiplier": 1.0, "epsilom": 2}},
                                   progress=False, out=str(tmp_path), log=lambda *a: None)
    with pytest.raises(ConfigError, match="privacy.noise_multiplier"):
        experiments.run_experiment({**cfg, "privacy": {"noise_multiplier": -1.0}}, progress=False,
                                   out=str(tmp_path), log=lambda *a: None)
