"""Synthetic generators and partitioners (DESIGN.md §6): determinism, layout, truth, errors."""
from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np
import pytest
import torch

from pflcore import data, models, ops

# Small instances of every generator, fast enough to build many times.
SMALL = {
    "synthetic": lambda seed=0, **kw: data.synthetic(0.5, 0.5, num_clients=8, dim=7, num_classes=4, seed=seed,
                                                     size_scale=1, max_size=300, **kw),
    "logistic_truth": lambda seed=0, **kw: data.logistic_truth(num_clients=5, samples_per_client=40, dim=6,
                                                               seed=seed, **kw),
    "least_squares": lambda seed=0, **kw: data.least_squares(num_clients=4, samples_per_client=30, dim=5,
                                                             shift=0.5, seed=seed, **kw),
    "two_groups": lambda seed=0, **kw: data.two_groups(num_clients=5, samples_per_client=20, dim=6, seed=seed,
                                                       **kw),
    "contexts": lambda seed=0, **kw: data.contexts(num_clients=6, num_contexts=2, dim=5, num_classes=3,
                                                   sizes=(10, 30), seed=seed, **kw),
}
# Every argument of each generator must be recorded in meta.
ARGS = {
    "synthetic": ["alpha", "beta", "num_clients", "dim", "num_classes", "seed", "size_scale", "iid",
                  "test_fraction", "max_size", "dtype"],
    "logistic_truth": ["num_clients", "samples_per_client", "dim", "R", "seed", "labels", "test_fraction", "dtype"],
    "least_squares": ["num_clients", "samples_per_client", "dim", "noise_var", "shift", "seed", "test_fraction",
                      "dtype"],
    "two_groups": ["num_clients", "samples_per_client", "dim", "mu", "seed", "test_fraction", "dtype"],
    "contexts": ["num_clients", "num_contexts", "dim", "num_classes", "client_noise", "beta", "feature_spread",
                 "sizes", "seed", "test_fraction", "dtype"],
}


def _tensors(fed):
    return [fed.train.x, fed.train.y, fed.train.offsets, fed.test.x, fed.test.y, fed.test.offsets, fed.weights,
            fed.truth] + ([] if fed.truth_global is None else [fed.truth_global])


def _rows(fed):
    """All rows (train then test) of every client: list of (x_k, y_k)."""
    out = []
    for i in range(fed.num_clients):
        (xa, ya), (xb, yb) = fed.train.client(i), fed.test.client(i)
        out.append((torch.cat([xa, xb]), torch.cat([ya, yb])))
    return out


def _accuracy(model, fed, split="train"):
    _, correct, count = ops.evaluate(model, fed.truth, getattr(fed, split))
    return correct, count


def _assert_labels_decided(fed, intercept: bool):
    """Every row's logits under the client's true model (x W_k + b_k, or xᵀw_k for one column) are
    farther from a tie — the top two apart, or the one logit from 0 — than 4·γ·S, S the largest
    Σ|terms| summed into a logit and γ = n·2⁻²⁴/(1 − n·2⁻²⁴) (n terms) the worst rounding of a
    float32 sum in any order. So any evaluation in float32 or float64 (any BLAS, kernel or SIMD
    width) finds the stored labels, and the exact-label checks below hold on every machine:
    the data are the same bits everywhere (tests/test_data_memory.py), so is this margin."""
    p = fed.num_features
    n = p + 1 + intercept
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    for split in (fed.train, fed.test):
        for k in range(fed.num_clients):
            x, _ = split.client(k)
            x, t = x.double(), fed.truth[k].double()
            W = t.view(p + 1, -1) if intercept else t.view(p, -1)
            z = x @ W[:p] + (W[p] if intercept else 0.0)
            S = x.abs() @ W[:p].abs() + (W[p].abs() if intercept else 0.0)
            gap = (z.topk(2, dim=1).values.diff(dim=1).neg()[:, 0] if z.shape[1] > 1 else z[:, 0].abs())
            assert bool((gap > 4 * gamma * S.max(dim=1).values).all()), f"client {k}: a row's logits nearly tie"


# ----------------------------------------------------------------------------- all generators

@pytest.mark.parametrize("gen", sorted(SMALL))
def test_determinism(gen):
    a, b, c = SMALL[gen](seed=3), SMALL[gen](seed=3), SMALL[gen](seed=4)
    for ta, tb in zip(_tensors(a), _tensors(b)):
        assert torch.equal(ta, tb)
    assert a.meta == b.meta and a.name == b.name
    assert not torch.equal(a.truth, c.truth)
    assert a.train.x.shape != c.train.x.shape or not torch.equal(a.train.x, c.train.x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gen", sorted(SMALL))
def test_layout_dtypes_meta(gen, dtype):
    fed = SMALL[gen](dtype=dtype)
    m, p = fed.num_clients, fed.num_features
    tf = fed.meta["test_fraction"]
    for cd in (fed.train, fed.test):
        assert cd.x.dtype == dtype and cd.offsets.dtype == torch.int64 and cd.num_clients == m
        assert cd.y.dtype == (dtype if gen == "least_squares" else torch.int64)
        assert bool((cd.sizes >= 1).all())
    n = fed.train.sizes + fed.test.sizes
    expected_train = torch.tensor([min(max(round(int(k) * (1 - tf)), 1), int(k) - 1) for k in n])
    assert torch.equal(fed.train.sizes, expected_train)
    assert fed.truth.dtype == dtype and fed.truth.shape[0] == m
    assert torch.allclose(fed.weights.double(), fed.train.sizes.double() / fed.train.num_rows)
    for arg in ARGS[gen]:
        assert arg in fed.meta, arg
    assert fed.meta["dtype"] == str(dtype).replace("torch.", "")
    assert fed.meta["generator"] == gen and fed.name.startswith(gen)
    C = fed.num_classes
    layout = {"synthetic": (f"Softmax(p={p}, C={C}, fit_intercept=True)", (p + 1) * C),
              "logistic_truth": (f"Logistic(p={p}, fit_intercept=False)", p),
              "least_squares": (f"LeastSquares(p={p}, fit_intercept=False)", p),
              "two_groups": (f"Logistic(p={p}, fit_intercept=False)", p),
              "contexts": (f"Softmax(p={p}, C={C}, fit_intercept=True)", (p + 1) * C)}[gen]
    assert (fed.meta["model"], fed.truth.shape[1]) == layout
    if fed.truth_global is not None:
        assert fed.truth_global.shape == (fed.truth.shape[1],) and fed.truth_global.dtype == dtype


# ----------------------------------------------------------------------------- synthetic

def test_synthetic_labels_are_argmax_of_truth():
    fed = data.synthetic(1.0, 1.0, num_clients=10, dim=12, num_classes=5, size_scale=2, max_size=400, seed=1)
    assert fed.truth_global is None
    _assert_labels_decided(fed, intercept=True)
    for k, (x, y) in enumerate(_rows(fed)):
        Wb = fed.truth[k].double().view(13, 5)  # [W_k; b_k], intercept row last
        assert torch.equal(y, torch.argmax(x.double() @ Wb[:12] + Wb[12], dim=1))
    model = models.Softmax(12, 5)
    for split in ("train", "test"):
        correct, count = _accuracy(model, fed, split)
        assert torch.equal(correct, count)
    assert len(torch.unique(fed.train.y)) == 5


def test_synthetic_sizes():
    m, scale = 30, 2
    fed = data.synthetic(0.5, 0.5, num_clients=m, dim=3, num_classes=3, size_scale=scale, seed=5)
    sizes = (fed.train.sizes + fed.test.sizes).numpy()
    # The sizes are the first draw of the generator's stream (documented order).
    # floor(L) with L = e^t, t ~ N(4, 2) (numpy's lognormal(4, 2) draws these t), computed exactly:
    # numpy's lognormal(...).astype(int) is the same except where libm's e^t is within an ulp of
    # an integer, which differs between libms.
    t = np.random.default_rng(5).normal(4.0, 2.0, m)
    with localcontext() as ctx:
        ctx.prec = 50
        floor = [int(Decimal(float(v)).exp().to_integral_value(rounding="ROUND_FLOOR")) for v in t]
    expected = (np.array(floor, dtype=np.int64) + 50) * scale
    np.testing.assert_allclose(expected, (np.random.default_rng(5).lognormal(4, 2, m).astype(np.int64) + 50) * scale,
                               rtol=0, atol=scale)
    np.testing.assert_array_equal(sizes, expected)
    capped = data.synthetic(0.5, 0.5, num_clients=m, dim=3, num_classes=3, size_scale=scale, seed=5, max_size=200)
    np.testing.assert_array_equal((capped.train.sizes + capped.test.sizes).numpy(), np.minimum(expected, 200))
    assert torch.equal(capped.truth, fed.truth)  # the cap changes no other draw


def test_synthetic_size_distribution():
    fed = data.synthetic(0.0, 0.0, num_clients=500, dim=1, num_classes=2, size_scale=3, seed=2)
    sizes = (fed.train.sizes + fed.test.sizes).numpy()
    assert np.all(sizes % 3 == 0) and sizes.min() >= 150
    # int(L) + 50 with L ~ lognormal(4, 2): log(int(L)) for int(L) >= 1 has mean ≈ 4, std ≈ 2.
    raw = sizes // 3 - 50
    logs = np.log(raw[raw >= 1])
    assert abs(logs.mean() - 4) < 0.3 and abs(logs.std() - 2) < 0.3


def test_synthetic_iid_shares_one_model():
    fed = data.synthetic(0.5, 2.0, num_clients=6, dim=5, num_classes=3, size_scale=4, iid=True, seed=0)
    assert torch.equal(fed.truth, fed.truth[:1].expand_as(fed.truth))
    assert torch.equal(fed.truth_global, fed.truth[0])
    for x, _ in _rows(fed):  # v = 0 for every client even with beta > 0
        assert float(x[:, 0].mean().abs()) < 4 / len(x) ** 0.5
    non_iid = data.synthetic(0.5, 2.0, num_clients=6, dim=5, num_classes=3, size_scale=4, seed=0)
    assert not torch.equal(non_iid.truth[0], non_iid.truth[1])


# ----------------------------------------------------------------------------- logistic_truth

def test_logistic_argmax_truth_classifies_all():
    fed = data.logistic_truth(num_clients=6, samples_per_client=300, dim=8, R=2.0, labels="argmax", seed=1)
    _assert_labels_decided(fed, intercept=False)
    model = models.Logistic(8, fit_intercept=False)
    for split in ("train", "test"):
        correct, count = _accuracy(model, fed, split)
        assert torch.equal(correct, count)
    assert torch.allclose(fed.truth_global, fed.truth.mean(0), atol=1e-6)
    assert fed.meta["truth_global"] == "mean of client models"


def test_logistic_sample_mle_recovers_client_models():
    m, dim = 8, 5
    fed = data.logistic_truth(num_clients=m, samples_per_client=2000, dim=dim, R=1.0, seed=3, dtype=torch.float64)
    y = fed.train.y.double()
    assert 0.05 < float(y.mean()) < 0.95
    model = models.Logistic(dim, fit_intercept=False)
    theta = model.zeros(m, dtype=torch.float64)
    ops.local_steps(model, theta, fed.train, steps=5000, lr=1.0)  # full-batch GD to ≈ the local MLE
    dist = torch.cdist(theta, fed.truth)  # [fit, truth]
    assert torch.equal(dist.argmin(1), torch.arange(m))  # each fit is nearest its own client's model
    random = torch.randn(m, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert bool((dist.diag() < (theta - random).norm(dim=1)).all())
    assert bool((dist.diag() < 0.6 * fed.truth.norm(dim=1)).all())


def test_logistic_heterogeneity_scales_with_R():
    h = [data.logistic_truth(num_clients=50, samples_per_client=2, dim=20, R=R).meta["heterogeneity"]
         for R in (0.0, 0.5, 2.0)]
    assert h[0] == 0.0
    for R, value in zip((0.5, 2.0), h[1:]):  # E Σ_k p_k ‖w_k − w̄‖² = R·dim·(1 − 1/m)
        assert abs(value / (R * 20 * 0.98) - 1) < 0.15


# ----------------------------------------------------------------------------- least squares

def test_least_squares_residual_variance_and_truth():
    fed = data.least_squares(num_clients=4, samples_per_client=5000, dim=10, noise_var=0.25, shift=0.0, seed=2)
    for k, (A, b) in enumerate(_rows(fed)):
        resid = b.double() - A.double() @ fed.truth[k].double()
        assert abs(float(resid.var()) / 0.25 - 1) < 0.1
    assert fed.num_classes == 0
    assert torch.equal(fed.truth, fed.truth_global.expand_as(fed.truth))  # shift = 0: one model
    shifted = data.least_squares(num_clients=30, samples_per_client=2, dim=50, shift=0.3, seed=2)
    spread = (shifted.truth - shifted.truth_global).double().std()
    assert abs(float(spread) / 0.3 - 1) < 0.1
    exact = data.least_squares(num_clients=2, samples_per_client=10, dim=3, noise_var=0.0, dtype=torch.float64)
    for k, (A, b) in enumerate(_rows(exact)):
        torch.testing.assert_close(b, A @ exact.truth[k])


# ----------------------------------------------------------------------------- two groups

def test_two_groups_truth_classifies_all():
    fed = data.two_groups(num_clients=7, samples_per_client=200, dim=10, mu=1.5, seed=4)
    assert fed.meta["groups"] == [0, 0, 0, 1, 1, 1, 1]
    w = fed.truth[0]
    assert abs(float(w.norm()) - 1) < 1e-6
    assert torch.equal(fed.truth[:3], w.expand(3, 10)) and torch.equal(fed.truth[3:], -w.expand(4, 10))
    _assert_labels_decided(fed, intercept=False)
    model = models.Logistic(10, fit_intercept=False)
    for split in ("train", "test"):
        correct, count = _accuracy(model, fed, split)
        assert torch.equal(correct, count)
    # The groups conflict: the other group's model gets most rows wrong.
    swapped = fed.truth.flip(0)
    _, correct, count = ops.evaluate(model, swapped, fed.train)
    assert float(correct[0]) / float(count[0]) < 0.5 and float(correct[-1]) / float(count[-1]) < 0.5


def test_contexts_clients_of_a_context_share_their_model():
    fed = data.contexts(num_clients=10, num_contexts=3, dim=8, num_classes=4, sizes=(20, 40), seed=3)
    ctx = torch.tensor(fed.meta["contexts"])
    assert sorted(torch.bincount(ctx).tolist()) == [3, 3, 4]  # dealt evenly
    for c in range(3):
        rows = fed.truth[ctx == c]
        assert torch.equal(rows, rows[:1].expand_as(rows))
    assert not torch.equal(fed.truth[ctx == 0][0], fed.truth[ctx == 1][0])
    sizes = fed.train.sizes + fed.test.sizes
    assert int(sizes.min()) >= 20 and int(sizes.max()) <= 40
    model = models.Softmax(8, 4)
    _assert_labels_decided(fed, intercept=True)
    correct, count = _accuracy(model, fed, "train")
    assert torch.equal(correct, count)  # labels are the argmax of the stored truth
    again = data.contexts(num_clients=10, num_contexts=3, dim=8, num_classes=4, sizes=(20, 40), seed=3)
    assert torch.equal(again.train.x, fed.train.x) and torch.equal(again.train.y, fed.train.y)
    noisy = data.contexts(num_clients=10, num_contexts=3, dim=8, num_classes=4, sizes=(20, 40), seed=3,
                          client_noise=0.1)
    assert not torch.equal(noisy.truth[ctx == 0][0], noisy.truth[ctx == 0][1])
    shared = data.contexts(num_clients=6, num_contexts=2, dim=5, beta=0.0, feature_spread=0.0, seed=1)
    assert abs(float(shared.train.x.mean())) < 0.1  # every context's features centred at 0
    with pytest.raises(ValueError, match="num_contexts"):
        data.contexts(num_clients=3, num_contexts=4)
    with pytest.raises(ValueError, match="sizes"):
        data.contexts(sizes=(10, 5))


# ----------------------------------------------------------------------------- partition

LABELS = np.random.default_rng(7).integers(0, 10, 2000)


def _entropy(parts, labels):
    out = []
    for p in parts:
        q = np.bincount(labels[p], minlength=10) / len(p)
        out.append(-(q[q > 0] * np.log(q[q > 0])).sum())
    return float(np.mean(out))


@pytest.mark.parametrize("scheme", ["classes", "shards", "dirichlet", "iid"])
def test_partition_is_a_disjoint_cover(scheme):
    parts = data.partition(LABELS, 20, scheme, seed=1)
    assert len(parts) == 20 and all(p.dtype == np.int64 and p.size >= 1 for p in parts)
    rows = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(LABELS)))
    again = data.partition(torch.from_numpy(LABELS), 20, scheme, seed=1)  # torch labels, same seed
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = data.partition(LABELS, 20, scheme, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("c,sizes", [(1, None), (2, None), (3, None), (2, (1165, 3834))])
def test_partition_classes_per_client(c, sizes):
    parts = data.partition(LABELS, 15, "classes", classes_per_client=c, sizes=sizes)
    assert all(len(np.unique(LABELS[p])) == c for p in parts)
    if sizes is None:  # every class is shared equally among the clients holding it
        for k in range(10):
            shares = [n for n in (np.sum(LABELS[p] == k) for p in parts) if n]
            assert max(shares) - min(shares) <= 1
    else:
        lengths = np.array([len(p) for p in parts])
        assert lengths.max() / lengths.min() > 1.5


def test_partition_classes_with_fewer_slots_than_classes():
    parts = data.partition(LABELS, 3, "classes", classes_per_client=2)  # 6 of the 10 classes dealt
    held = [set(np.unique(LABELS[p]).tolist()) for p in parts]
    assert held == [{0, 1}, {2, 3}, {4, 5}]
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.nonzero(LABELS < 6)[0])


def test_partition_shards_and_dirichlet_skew():
    shards = data.partition(LABELS, 20, "shards", shards_per_client=2)
    assert all(len(np.unique(LABELS[p])) <= 4 for p in shards)  # a shard spans at most 2 labels
    assert sorted(len(p) for p in shards) == [100] * 20
    skewed = data.partition(LABELS, 10, "dirichlet", alpha=0.1, min_size=5)
    flat = data.partition(LABELS, 10, "dirichlet", alpha=100.0)
    assert min(len(p) for p in skewed) >= 5
    assert _entropy(skewed, LABELS) < _entropy(flat, LABELS) - 0.5
    assert _entropy(flat, LABELS) > 0.95 * np.log(10)


def test_partition_to_client_data():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int32)
    cd = data.partition_to_client_data(x, y, [np.array([4, 1]), np.array([0, 2, 5])])
    assert cd.offsets.tolist() == [0, 2, 5] and cd.y.dtype == torch.int64
    assert cd.y.tolist() == [1, 1, 0, 2, 2] and cd.x[:, 0].tolist() == [8, 2, 0, 4, 10]
    parts = data.partition(LABELS, 5, "iid")
    xs = torch.randn(len(LABELS), 3)
    cd = data.partition_to_client_data(xs, torch.from_numpy(LABELS), parts)
    assert torch.equal(cd.sizes, torch.tensor([len(p) for p in parts]))


# ----------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("call,match", [
    (lambda: data.synthetic(-0.1, 0.5), r"alpha: expected a number >= 0"),
    (lambda: data.synthetic(0.5, float("nan")), r"beta: expected a finite number"),
    (lambda: data.synthetic(0.5, 0.5, num_clients=0), r"num_clients: expected an integer in \[1, 2147483647\], got 0"),
    (lambda: data.synthetic(0.5, 0.5, dim=0), r"dim: expected an integer in \[1, 2147483647\]"),
    (lambda: data.synthetic(0.5, 0.5, num_classes=1), r"num_classes: expected an integer in \[2, 2147483647\]"),
    (lambda: data.synthetic(0.5, 0.5, size_scale=0), r"size_scale: expected an integer in \[1, 2147483647\]"),
    (lambda: data.synthetic(0.5, 0.5, max_size=1), r"max_size: expected an integer in \[2, 2147483647\]"),
    (lambda: data.synthetic(0.5, 0.5, test_fraction=1.0), r"test_fraction: expected a number in \(0, 1\), got 1.0"),
    (lambda: data.synthetic(0.5, 0.5, dtype=torch.float16), r"dtype: expected torch.float32 or torch.float64"),
    (lambda: data.synthetic(0.5, 0.5, seed=-1), r"seed: expected an integer >= 0"),
    (lambda: data.logistic_truth(R=-1), r"R: expected a number >= 0"),
    (lambda: data.logistic_truth(labels="max"), r"labels: expected 'sample' or 'argmax', got 'max'"),
    (lambda: data.logistic_truth(samples_per_client=1),
     r"samples_per_client: expected an integer in \[2, 2147483647\]"),
    (lambda: data.logistic_truth(test_fraction=0), r"test_fraction: expected a number in \(0, 1\)"),
    (lambda: data.least_squares(noise_var=-0.1), r"noise_var: expected a number >= 0"),
    (lambda: data.least_squares(shift=-1), r"shift: expected a number >= 0"),
    (lambda: data.least_squares(dim=2.5), r"dim: expected an integer in \[1, 2147483647\], got 2.5"),
    (lambda: data.two_groups(num_clients=-2), r"num_clients: expected an integer in \[1, 2147483647\]"),
    (lambda: data.two_groups(mu="a"), r"mu: expected a real number"),
    (lambda: data.partition(LABELS, 5, "pathological"), r"scheme: expected one of 'classes', .*got 'pathological'"),
    (lambda: data.partition(LABELS, 0), r"num_clients: expected an integer >= 1, got 0"),
    (lambda: data.partition(LABELS[:3], 4, "iid"),
     r"num_clients: 4 clients .* need at least 4 rows, but labels has N = 3"),
    (lambda: data.partition(LABELS, 5, classes_per_client=11), r"classes_per_client: expected at most the 10 .*got 11"),
    (lambda: data.partition(LABELS, 5, "dirichlet", alpha=0), r"alpha: expected a number > 0"),
    (lambda: data.partition(LABELS, 100, "dirichlet", alpha=0.001, min_size=15), r"alpha: no Dirichlet"),
    (lambda: data.partition(LABELS, 300, "shards", shards_per_client=7), r"shards_per_client: 300 clients x 7"),
    (lambda: data.partition(LABELS, 5, sizes=(3, 1)), r"sizes\[1\]: expected a number >= 3"),
    (lambda: data.partition(LABELS, 5, sizes=3), r"sizes: expected None or a pair"),
    (lambda: data.partition(np.array([0, 0, 1, 1, 1]), 5, classes_per_client=1),
     r"classes_per_client: class 0 has 2 rows"),
    (lambda: data.partition(LABELS.astype(float), 5), r"labels: expected integer class labels"),
    (lambda: data.partition(LABELS.reshape(2, -1), 5), r"labels: expected a non-empty 1-D array"),
    (lambda: data.partition_to_client_data(np.zeros((3, 2)), np.zeros(3, dtype=np.int64), [[0], []]),
     r"parts: client 1 is empty"),
    (lambda: data.partition_to_client_data(np.zeros((3, 2)), np.zeros(3, dtype=np.int64), [[0, 3]]),
     r"parts: client 0 has indices in \[0, 3\], outside the 3 rows of x"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
