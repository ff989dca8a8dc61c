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
