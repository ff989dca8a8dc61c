"""kmeans_assign and kmeans (DESIGN.md §4) against brute force and the torch references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from conftest import DTYPES, TOL
from pflcore import backend, ops

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")


def brute_force(points: np.ndarray, centroids: np.ndarray):
    """Independent of the library: float64 distances, first minimum."""
    d = ((points[:, None, :].astype(np.float64) - centroids[None, :, :].astype(np.float64)) ** 2).sum(-1)
    return d.argmin(1), d.min(1)


@settings(max_examples=60, deadline=None)
@given(N=st.integers(1, 40), K=st.integers(1, 9), d=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       dup=st.booleans())
def test_assign_equals_brute_force(N, K, d, seed, dup):
    rng = np.random.default_rng(seed)
    # Small integers make every distance exact in float32, so even ties must agree.
    points = rng.integers(-3, 4, size=(N, d)).astype(np.float32)
    centroids = rng.integers(-3, 4, size=(K, d)).astype(np.float32)
    if dup and K > 1:
        centroids[K - 1] = centroids[0]  # an exact tie: must go to index 0
    labels, sqdist = ops.kmeans_assign(points, centroids)
    want_labels, want_sq = brute_force(points, centroids)
    assert isinstance(labels, np.ndarray) and labels.dtype == np.int64
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(sqdist, want_sq.astype(np.float32))


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=30),
                  elements=st.floats(-1e3, 1e3)), st.integers(1, 6))
def test_assign_real_valued_points(points, K):
    centroids = points[:K] + 0.5 if points.shape[0] >= K else np.zeros((K, points.shape[1]))
    labels, sqdist = ops.kmeans_assign(points, centroids)
    want_labels, want_sq = brute_force(points, centroids)
    np.testing.assert_allclose(sqdist, want_sq, rtol=1e-12, atol=1e-9)
    # Labels may differ only where two distances tie to rounding.
    full = ((points[:, None] - centroids[None]) ** 2).sum(-1)
    picked = full[np.arange(len(labels)), labels]
    np.testing.assert_allclose(picked, want_sq, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,d", [(1, 1, 1), (33, 5, 17), (200, 16, 1000), (7, 64, 3)])
def test_assign_matches_reference(N, K, d, dtype):
    g = torch.Generator().manual_seed(N + K + d)
    points = torch.randn(N, d, generator=g, dtype=dtype)
    centroids = torch.randn(K, d, generator=g, dtype=dtype)
    labels, sq = ops.kmeans_assign(points, centroids)
    rlabels, rsq = ops.kmeans_assign_ref(points, centroids)
    assert torch.equal(labels, rlabels)
    torch.testing.assert_close(sq, rsq, **TOL[dtype])


def _blobs(n_per=40, k=4, d=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    centers = 10 * torch.randn(k, d, generator=g, dtype=dtype)
    pts = torch.cat([c + torch.randn(n_per, d, generator=g, dtype=dtype) for c in centers])
    truth = torch.arange(k).repeat_interleave(n_per)
    return pts, truth, centers


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a[:, None] == a[None, :], b[:, None] == b[None, :]))


def test_kmeans_recovers_separated_blobs_and_matches_reference():
    pts, truth, _ = _blobs()
    res = ops.kmeans(pts, 4, seed=1)
    assert _same_partition(res.labels, truth)
    ref = ops.kmeans_ref(pts, 4, seed=1)
    assert torch.equal(res.labels, ref.labels)
    torch.testing.assert_close(res.centroids, ref.centroids, rtol=1e-12, atol=1e-12)
    assert res.inertia == pytest.approx(ref.inertia, rel=1e-12)
    assert res.inertia == pytest.approx(float(((pts - res.centroids[res.labels]) ** 2).sum()), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 8), weighted=st.booleans(), f32=st.booleans())
def test_inertia_never_increases(seed, k, weighted, f32):
    dtype = torch.float32 if f32 else torch.float64
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(120, 6, generator=g, dtype=dtype) * torch.rand(6, generator=g, dtype=dtype) * 5
    w = torch.rand(120, generator=g, dtype=dtype) if weighted else None
    res = ops.kmeans(pts, k, seed=seed, weights=w, iters=50, tol=0.0)
    h = np.array(res.history)
    # Each Lloyd step cannot increase the inertia; float sums may wobble by rounding.
    slack = 1e-5 if f32 else 1e-12
    assert np.all(h[1:] <= h[:-1] * (1 + slack)), h
    assert len(h) == res.iterations + 1


def test_weights_warm_start_and_empty_cluster():
    pts = torch.tensor([[0.0], [1.0], [10.0], [11.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    init = torch.tensor([[0.0], [10.0], [100.0]], dtype=torch.float64)  # the third stays empty
    res = ops.kmeans(pts, init=init, weights=w, iters=10)
    torch.testing.assert_close(res.centroids, torch.tensor([[0.75], [10.5], [100.0]], dtype=torch.float64))
    assert res.labels.tolist() == [0, 0, 1, 1]
    assert res.inertia == pytest.approx(1 * 0.75**2 + 3 * 0.25**2 + 2 * 0.25)
    # A warm start from converged centroids stops at once with the same labels.
    again = ops.kmeans(pts, init=res.centroids, weights=w)
    assert again.iterations == 1 and torch.equal(again.labels, res.labels)


def test_kmeans_plus_plus_is_seeded_and_native_equals_reference_on_float32():
    pts, _, _ = _blobs(dtype=torch.float32, seed=3)
    a = ops.kmeans(pts, 4, seed=7)
    b = ops.kmeans(pts, 4, seed=7)
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.labels, b.labels)
    with backend.use("reference"):
        c = ops.kmeans(pts, 4, seed=7)
    assert torch.equal(a.labels, c.labels)
    torch.testing.assert_close(a.centroids, c.centroids, **TOL[torch.float32])


# ---- the native Lloyd loop (one kernel call) against the reference's composed loop -------------
# Shapes: d below one vector (3), between (17), above with a tail (61, 610 % 8 = 2); K in one
# vector of screens (5), two (13: float32 on AVX2 pads to 16), a remainder block (37), one (1).

def _lloyd_data(N, K, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    centers = 0.5 * torch.randn(K, d, generator=g, dtype=dtype)
    pts = centers[torch.randint(0, K, (N,), generator=g)] + torch.randn(N, d, generator=g, dtype=dtype)
    return pts, pts[torch.randperm(N, generator=g)[:K]].clone(), g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,d", [(1, 1, 1), (40, 5, 3), (300, 13, 17), (500, 37, 61), (1500, 4, 610)])
@pytest.mark.parametrize("weighted", [False, True])
def test_lloyd_matches_reference(N, K, d, dtype, weighted):
    pts, init, g = _lloyd_data(N, K, d, dtype, N + K + d)
    w = torch.rand(N, generator=g, dtype=dtype) if weighted else None
    got = ops.kmeans(pts, init=init, iters=6, tol=0.0, weights=w)
    ref = ops.kmeans_ref(pts, init=init, iters=6, tol=0.0, weights=w)
    assert torch.equal(got.labels, ref.labels)
    assert got.iterations == ref.iterations and len(got.history) == got.iterations + 1
    torch.testing.assert_close(got.centroids, ref.centroids, **TOL[dtype])
    rel = 1e-5 if dtype is torch.float32 else 1e-12  # sums in another order (chunks)
    np.testing.assert_allclose(got.history, ref.history, rtol=rel, atol=1e-300)
    # the result's inertia is the final labels' weighted distances
    full = ((pts.double() - got.centroids.double()[got.labels]) ** 2).sum(1)
    want = float(full.sum() if w is None else (full * w.double()).sum())
    assert got.inertia == pytest.approx(want, rel=1e-4 if dtype is torch.float32 else 1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lloyd_stopping_rule_matches_reference(dtype):
    """tol > 0: the shift is compared with tol × the total variance (computed natively without
    a float64 copy of the points); both stop at the same iteration."""
    pts, init, _ = _lloyd_data(2000, 6, 9, dtype, 5)
    for tol in (1e-2, 1e-4):
        got = ops.kmeans(pts, init=init, iters=100, tol=tol)
        ref = ops.kmeans_ref(pts, init=init, iters=100, tol=tol)
        assert got.iterations == ref.iterations < 100
        assert torch.equal(got.labels, ref.labels)


@pytest.mark.parametrize("d", [3, 40])
def test_lloyd_ties_and_empty_clusters_on_exact_data(d):
    """Small integers: every distance is exact, so ties must go to the lowest index as in the
    reference; a duplicated centroid stays empty (its twin takes the points) and keeps its
    value, and so does a far-away one."""
    g = torch.Generator().manual_seed(d)
    pts = torch.randint(-3, 4, (257, d), generator=g).to(torch.float32)
    init = pts[:4].clone()
    init = torch.cat([init, init[1:2], torch.full((1, d), 100.0)])  # 4 = copy of 1; 5 far away
    first = ops.kmeans(pts, init=init, iters=0)  # the first assignment only
    assert torch.equal(first.labels, ops.kmeans_ref(pts, init=init, iters=0).labels)
    assert not bool((first.labels == 4).any()) and not bool((first.labels == 5).any())
    got = ops.kmeans(pts, init=init, iters=1)  # so the update leaves clusters 4 and 5 as they were
    ref = ops.kmeans_ref(pts, init=init, iters=1)
    assert torch.equal(got.labels, ref.labels)
    assert torch.equal(got.centroids[4:], init[4:])
    torch.testing.assert_close(got.centroids, ref.centroids, rtol=0, atol=1e-6)
    labels, sq = ops.kmeans_assign(pts, init)
    rl, rsq = ops.kmeans_assign_ref(pts, init)
    assert torch.equal(labels, rl) and torch.equal(sq, rsq)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lloyd_is_bitwise_the_same_on_one_and_two_threads(dtype):
    """Large enough for the parallel regions and several chunks (N > 1024): the chunks' sums are
    added in chunk order, never in thread order."""
    import pflcore

    pts, init, g = _lloyd_data(3000, 7, 33, dtype, 11)
    w = torch.rand(3000, generator=g, dtype=dtype)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            pflcore.set_num_threads(threads)
            res = ops.kmeans(pts, init=init, iters=5, tol=0.0, weights=w)
            runs.append((res.centroids, res.labels, res.history, ops.kmeans_assign(pts, res.centroids)))
    finally:
        pflcore.set_num_threads(before)
    (c1, l1, h1, a1), (c2, l2, h2, a2) = runs
    assert torch.equal(c1, c2) and torch.equal(l1, l2) and h1 == h2
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_lloyd_reports_non_finite_points_and_weights_like_the_reference():
    from pflcore.errors import NonFiniteError

    pts = torch.randn(50, 4, dtype=torch.float64)
    pts[17, 2] = float("nan")
    for fn in (ops.kmeans, ops.kmeans_ref):
        with pytest.raises(NonFiniteError, match=r"points: row 17 holds a NaN or infinite value"):
            fn(pts, init=torch.zeros(2, 4, dtype=torch.float64), iters=3)
    bad = torch.zeros(2, 4, dtype=torch.float64)
    bad[1, 0] = float("inf")
    for fn in (ops.kmeans, ops.kmeans_ref):
        with pytest.raises(NonFiniteError, match=r"centroids: row 1 holds a NaN or infinite value"):
            fn(torch.randn(5, 4, dtype=torch.float64), init=bad, iters=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_assign_huge_values_fall_back_to_direct_distances(dtype):
    """Where ‖x‖‖c‖ could overflow the screen in this dtype, every centroid is computed directly:
    labels and distances stay the reference's."""
    big = 1e18 if dtype is torch.float32 else 1e150
    pts = torch.tensor([[big, 0.0, 1.0], [-big, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=dtype)
    cen = torch.tensor([[0.9 * big, 0.0, 0.0], [0.0, 0.0, 0.0], [-big, 0.0, 0.0]], dtype=dtype)
    labels, sq = ops.kmeans_assign(pts, cen)
    rl, rsq = ops.kmeans_assign_ref(pts, cen)
    assert torch.equal(labels, rl)
    torch.testing.assert_close(sq, rsq, rtol=1e-5, atol=0)


# ---- few centroids (K <= 12): the per-point dot-product path of kmeans_screen.h ----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 7, 10, 11, 12, 13])
@pytest.mark.parametrize("d", [8, 9, 16, 60, 61])
def test_assign_few_centroids_equals_brute_force_with_ties(K, d, dtype):
    """Small integers (every distance exact): labels and distances equal brute force bit for bit,
    ties to the lowest index (a duplicated centroid, points on a centroid and halfway between
    two), on both sides of the 12-centroid limit and of whole vectors of coordinates."""
    rng = np.random.default_rng(K * 100 + d)
    npd = np.float32 if dtype is torch.float32 else np.float64
    points = rng.integers(-3, 4, size=(301, d)).astype(npd)
    centroids = rng.integers(-3, 4, size=(K, d)).astype(npd)
    if K > 2:
        centroids[K - 1] = centroids[1]
    points[0] = centroids[0]
    points[1] = centroids[K - 1]
    labels, sq = ops.kmeans_assign(torch.from_numpy(points), torch.from_numpy(centroids))
    want_labels, want_sq = brute_force(points, centroids)
    np.testing.assert_array_equal(labels.numpy(), want_labels)
    np.testing.assert_array_equal(sq.numpy(), want_sq.astype(npd))
    # and the Lloyd loop's assignment (the same path with the cluster sums) agrees with the reference
    init = torch.from_numpy(centroids)
    got = ops.kmeans(torch.from_numpy(points), init=init, iters=2, tol=0.0)
    ref = ops.kmeans_ref(torch.from_numpy(points), init=init, iters=2, tol=0.0)
    assert torch.equal(got.labels, ref.labels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_assign_few_centroids_huge_values_and_non_finite_rows(dtype):
    """d = 9, K = 3: where the screen could overflow every centroid is computed directly; a NaN
    or inf row is reported by its index, in kmeans_assign and in the Lloyd loop."""
    from pflcore.errors import NonFiniteError

    big = 1e18 if dtype is torch.float32 else 1e150
    pts = torch.zeros(4, 9, dtype=dtype)
    pts[0, 0], pts[0, 8], pts[1, 0], pts[1, 4] = big, 1.0, -big, 1.0
    pts[3, 5] = 2.0
    cen = torch.zeros(3, 9, dtype=dtype)
    cen[0, 0], cen[2, 0] = 0.9 * big, -big
    labels, sq = ops.kmeans_assign(pts, cen)
    rl, rsq = ops.kmeans_assign_ref(pts, cen)
    assert torch.equal(labels, rl)
    torch.testing.assert_close(sq, rsq, rtol=1e-5, atol=0)
    bad = torch.randn(40, 9, dtype=dtype)
    bad[23, 8] = float("inf")
    with pytest.raises(NonFiniteError, match=r"points: row 23 holds a NaN or infinite value"):
        ops.kmeans_assign(bad, cen)
    bad[23, 8] = float("nan")
    with pytest.raises(NonFiniteError, match=r"points: row 23 holds a NaN or infinite value"):
        ops.kmeans(bad, init=cen, iters=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_assign_full_blocks_huge_values_and_non_finite_rows(dtype):
    """d = 20, K = 3, 48 points: whole blocks of 16 points (the float kernel's points-in-lanes
    pass) with values that overflow the screen in some rows (every centroid computed directly)
    and a NaN/inf row inside a block (the block is taken by the row form, which reports it):
    labels equal the reference, errors name the first bad row."""
    from pflcore.errors import NonFiniteError

    big = 1e18 if dtype is torch.float32 else 1e150
    g = torch.Generator().manual_seed(5)
    pts = torch.randn(48, 20, generator=g, dtype=dtype)
    pts[3, 0], pts[17, 19], pts[40, 7] = big, -big, 0.5 * big
    cen = torch.randn(3, 20, generator=g, dtype=dtype)
    cen[1, 0] = 0.9 * big
    labels, sq = ops.kmeans_assign(pts, cen)
    rl, rsq = ops.kmeans_assign_ref(pts, cen)
    assert torch.equal(labels, rl)
    torch.testing.assert_close(sq, rsq, rtol=1e-5, atol=0)
    bad = torch.randn(48, 20, generator=g, dtype=dtype)
    bad[37, 4], bad[21, 11] = float("nan"), float("inf")
    with pytest.raises(NonFiniteError, match=r"points: row 21 holds a NaN or infinite value"):
        ops.kmeans_assign(bad, cen)
    with pytest.raises(NonFiniteError, match=r"points: row 21 holds a NaN or infinite value"):
        ops.kmeans(bad, init=cen, iters=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assign_full_blocks_equal_brute_force(seed, dtype):
    """Random float points in whole blocks of 16 and a tail (N = 16·12 + 7), K from 1 to 12
    (odd K: the padding centroid), d = 16, 31, 60: labels and distances bit for bit those of each
    point assigned alone (a call of one point takes the row form), labels those of the reference,
    and the Lloyd loop (cached norms on its later passes) equals the reference."""
    rng = np.random.default_rng(seed)
    npd = np.float32 if dtype is torch.float32 else np.float64
    for K in (1, 5, 10, 12):
        for d in (16, 31, 60):
            centroids = rng.standard_normal((K, d)).astype(npd)
            points = (centroids[rng.integers(0, K, 199)] + 2.0 * rng.standard_normal((199, d))).astype(npd)
            P, C = torch.from_numpy(points), torch.from_numpy(centroids)
            labels, sq = ops.kmeans_assign(P, C)
            alone = [ops.kmeans_assign(P[i:i + 1].clone(), C) for i in range(0, 199, 5)]
            assert torch.equal(labels[::5], torch.cat([a[0] for a in alone]))
            assert torch.equal(sq[::5], torch.cat([a[1] for a in alone]))
            rl, rsq = ops.kmeans_assign_ref(P, C)
            assert torch.equal(labels, rl)
            torch.testing.assert_close(sq, rsq, rtol=1e-5, atol=1e-6)
            init = C
            got = ops.kmeans(P, init=init, iters=3, tol=0.0)
            ref = ops.kmeans_ref(P, init=init, iters=3, tol=0.0)
            assert torch.equal(got.labels, ref.labels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [96, 200, 1001])
def test_small_assign_split_over_threads_is_bitwise_the_one_thread_result(N, dtype):
    """A small call (N x K x d from 2^14 multiply-adds, N >= 96) is split over the threads in
    blocks of 48 points: labels and distances bitwise those of one thread, and a NaN row is
    still reported by the smallest bad index whichever thread meets it first."""
    import pflcore
    from pflcore.errors import NonFiniteError

    g = torch.Generator().manual_seed(N)
    pts = torch.randn(N, 60, generator=g, dtype=dtype)
    cen = torch.randn(10, 60, generator=g, dtype=dtype)
    cen[7] = cen[2]  # exact ties
    bad = pts.clone()
    bad[N - 3, 5] = float("nan")
    bad[N // 2 + 1, 0] = float("inf")
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            pflcore.set_num_threads(threads)
            runs.append(ops.kmeans_assign(pts, cen))
            with pytest.raises(NonFiniteError, match=rf"points: row {N // 2 + 1} holds a NaN or infinite value"):
                ops.kmeans_assign(bad, cen)
    finally:
        pflcore.set_num_threads(before)
    (l1, s1), (l2, s2) = runs
    assert torch.equal(l1, l2) and torch.equal(s1, s2)
    want_l, want_s = brute_force(pts.numpy(), cen.numpy())
    assert np.array_equal(l1.numpy(), want_l)


def test_assign_fast_path_equals_the_general_path():
    """Plain contiguous CPU tensors skip the conversions (ops/kmeans.py _plain_pair); numpy
    arrays, a transposed view and a requires-grad tensor take the general path: same results."""
    g = torch.Generator().manual_seed(5)
    pts = torch.randn(150, 33, generator=g)
    cen = torch.randn(9, 33, generator=g)
    fast = ops.kmeans_assign(pts, cen)
    via_numpy = ops.kmeans_assign(pts.numpy(), cen.numpy())
    strided = ops.kmeans_assign(pts.t().contiguous().t(), cen)
    grad = ops.kmeans_assign(pts.clone().requires_grad_(), cen)
    for other in (strided, grad):
        assert torch.equal(fast[0], other[0]) and torch.equal(fast[1], other[1])
        assert not other[1].requires_grad
    assert np.array_equal(fast[0].numpy(), via_numpy[0]) and np.array_equal(fast[1].numpy(), via_numpy[1])
    with pytest.raises(ValueError, match=r"centroids: expected dtype float32"):
        ops.kmeans_assign(pts, cen.double())
    with pytest.raises(ValueError, match=r"centroids"):
        ops.kmeans_assign(pts, cen[:, :5])


def test_sparse_tensors_are_refused_with_a_value_error():
    """A sparse (non-strided) tensor is a ValueError naming the argument, on the fast path's
    checks and the general path's alike (it used to be torch's RuntimeError from .contiguous())."""
    pts, cen = torch.randn(6, 3), torch.randn(2, 3)
    for call, name in ((lambda: ops.kmeans_assign(pts.to_sparse(), cen), "points"),
                       (lambda: ops.kmeans_assign(pts, cen.to_sparse()), "centroids"),
                       (lambda: ops.kmeans(pts.to_sparse(), 2), "points"),
                       (lambda: ops.average(pts.to_sparse(), torch.ones(6)), "theta")):
        with pytest.raises(ValueError, match=rf"^{name}: expected a dense \(strided\) tensor"):
            call()
