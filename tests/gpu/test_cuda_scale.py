"""The CUDA kernels at GPU scale (issue 25): evaluate on minibatches in one launch, a shared
model [d] read in place by gradients and evaluate, the split k-means update, the padded
shared-memory layout of the GLM kernels and their global-memory scratch path, each against
``<op>_ref`` on odd shapes in both dtypes, and bitwise identical on a second call.
Tolerances: tests/conftest.TOL (the same sums in another order)."""
from __future__ import annotations

import importlib

import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model, random_sizes
from _gpu import GPU, SKIP, require
from pflcore import backend, models, ops

pytestmark = SKIP
# family, p, C, client sizes: C = 16 and 2 are even (the padded rows of W), 1 and 5 odd
CASES = [("least_squares", 1, 1, [1]), ("logistic", 3, 1, [1, 4, 2]), ("softmax", 17, 10, [5, 1, 12]),
         ("softmax", 61, 16, None), ("softmax", 1, 2, [9]), ("softmax", 40, 5, [3, 30])]


@pytest.fixture(autouse=True)
def _cuda_module():
    """Every test here is of the CUDA module: skipped before it builds its inputs where the module
    is not built (or in the CPU check of tests/gpu)."""
    require("cuda")


def _cuda():
    return backend.use("cuda")


def _case(family, p, C, sizes, dtype, seed=0):
    model = make_model(family, p, C, l2=0.05, fit_intercept=p % 2 == 1)
    data = make_data(model, random_sizes(37, seed=p) if sizes is None else sizes, dtype, seed=seed + p + C)
    return model, data


def _rows(m):
    return torch.cat([torch.arange(m), torch.tensor([0, m - 1, 0])])  # repeats: a client evaluated twice


def _batches(data, rows, B, counter=7):
    with backend.use("reference"):
        b = ops.sample_batches(data, steps=1, batch_size=B, seed=5, counter=counter, clients=rows)
    return b.reshape(rows.numel(), B)  # [R, B] int32, contiguous


def _assert_eval(got, want, dtype):
    torch.testing.assert_close(got[0].cpu(), want[0], **TOL[dtype])
    assert torch.equal(got[1].cpu(), want[1]), "correct counts"
    assert torch.equal(got[2].cpu(), want[2]), "row counts"


# ---- evaluate on minibatches -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", CASES)
@pytest.mark.parametrize("B", [1, 7, 45])  # 45 > the 32 rows of a chunk: two chunks of a batch
def test_evaluate_on_batches_equals_the_reference(dtype, family, p, C, sizes, B):
    model, data = _case(family, p, C, sizes, dtype)
    rows = _rows(data.num_clients)
    R = rows.numel()
    theta = 0.3 * torch.randn(R, model.d, generator=torch.Generator().manual_seed(B), dtype=dtype)
    batches = _batches(data, rows, B)
    want = ops.evaluate_ref(model, theta, data, rows=rows, batches=batches)
    assert torch.equal(want[2], torch.full((R,), B)), "count is the batch size"
    with _cuda():
        d_args = (model, theta.to(GPU), data.to(GPU))
        got = ops.evaluate(*d_args, rows=rows.to(GPU), batches=batches.to(GPU))
        again = ops.evaluate(*d_args, rows=rows.to(GPU), batches=batches.to(GPU))
    _assert_eval(got, want, dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "bitwise identical on a second call"


@pytest.mark.parametrize("dtype", DTYPES)
def test_evaluate_on_batches_at_the_scale_of_a_run(dtype):
    """5,000 model rows (a grid of 5,000 blocks) over 400 clients, minibatches of 20."""
    model = models.Softmax(61, 10, l2=0.01)
    data = make_data(model, random_sizes(400, seed=3, high=60), dtype, seed=4)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 400, (5000,), generator=g)
    theta = 0.2 * torch.randn(5000, model.d, generator=g, dtype=dtype)
    batches = _batches(data, rows, 20)
    want = ops.evaluate_ref(model, theta, data, rows=rows, batches=batches)
    with _cuda():
        got = ops.evaluate(model, theta.to(GPU), data.to(GPU), rows=rows.to(GPU), batches=batches.to(GPU))
    _assert_eval(got, want, dtype)


# ---- one shared model [d] --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", CASES)
def test_gradients_and_evaluate_of_a_shared_model(dtype, family, p, C, sizes):
    """theta [d] serves every row (row stride 0), with and without rows and batches."""
    model, data = _case(family, p, C, sizes, dtype, seed=1)
    theta = 0.3 * torch.randn(model.d, generator=torch.Generator().manual_seed(2), dtype=dtype)
    rows = _rows(data.num_clients)
    batches = _batches(data, rows, 6)
    calls = [dict(), dict(rows=rows), dict(rows=rows, batches=batches)]
    d_data = data.to(GPU)
    for kw in calls:
        d_kw = {k: v.to(GPU) for k, v in kw.items()}
        want_g = ops.gradients_ref(model, theta, data, **kw)
        want_e = ops.evaluate_ref(model, theta, data, **kw)
        with _cuda():
            got_g = ops.gradients(model, theta.to(GPU), d_data, **d_kw)
            got_e = ops.evaluate(model, theta.to(GPU), d_data, **d_kw)
        torch.testing.assert_close(got_g.cpu(), want_g, **TOL[dtype])
        _assert_eval(got_e, want_e, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_model_larger_than_shared_memory(dtype):
    """d = 60,010 parameters do not fit shared memory: gradients and evaluate read the one model
    [d] from global memory for 300 rows (several per block in float64)."""
    model = models.Softmax(6000, 10, l2=0.01)
    data = make_data(model, random_sizes(300, seed=2, high=5), dtype, seed=3)
    theta = 0.01 * torch.randn(model.d, generator=torch.Generator().manual_seed(0), dtype=dtype)
    want_g = ops.gradients_ref(model, theta, data)
    want_e = ops.evaluate_ref(model, theta, data)
    with _cuda():
        got_g = ops.gradients(model, theta.to(GPU), data.to(GPU))
        got_e = ops.evaluate(model, theta.to(GPU), data.to(GPU))
    torch.testing.assert_close(got_g.cpu(), want_g, **TOL[dtype])
    _assert_eval(got_e, want_e, dtype)


# ---- the GLM kernels' parameter layouts ----------------------------------------------------------

def _smem_total(P, ws, C, dtype, with_G):
    """Bytes of dynamic shared memory of a GLM block holding W (and G) as [P, ws] (glm.cu's
    SmemLayout, nt = min(16 KiB / (2·C·size), 32))."""
    a16 = lambda b: (b + 15) // 16 * 16  # noqa: E731
    ts = 8 if dtype == torch.float64 else 4
    nt = min(16384 // (2 * C * ts), 32)
    params = a16(P * ws * ts) * (2 if with_G else 1)
    return params + 2 * a16(nt * C * ts) + a16(nt * ts) + 2 * a16(nt * 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameters_that_fit_shared_memory_only_unpadded(dtype):
    """C = 16: the padded rows (stride 17) would not fit the device's shared memory but the
    unpadded ones do; the kernels fall back to stride 16 and compute the same values."""
    optin = getattr(torch.cuda.get_device_properties(GPU), "shared_memory_per_block_optin", 0)
    if not optin:
        pytest.skip("torch does not report the opt-in shared memory per block")
    C = 16
    P = next(P for P in range(1, 10 ** 6) if _smem_total(P, C + 1, C, dtype, True) > optin)
    assert _smem_total(P, C, C, dtype, True) <= optin < _smem_total(P, C + 1, C, dtype, True)
    model = models.Softmax(P - 1, C, l2=0.02)  # P - 1 features and the intercept
    data = make_data(model, [3, 40, 1, 9], dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    theta = 0.05 * torch.randn(4, model.d, generator=g, dtype=dtype)
    anchor = torch.randn(model.d, generator=g, dtype=dtype)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=3, lr=0.05, prox=0.3, anchor=anchor)
    want_g = ops.gradients_ref(model, theta, data)
    want_e = ops.evaluate_ref(model, theta, data)
    with _cuda():
        got = ops.local_steps(model, theta.to(GPU), data.to(GPU), steps=3, lr=0.05, prox=0.3, anchor=anchor.to(GPU))
        got_g = ops.gradients(model, theta.to(GPU), data.to(GPU))
        got_e = ops.evaluate(model, theta.to(GPU), data.to(GPU))
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(got_g.cpu(), want_g, **TOL[dtype])
    _assert_eval(got_e, want_e, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_steps_through_the_global_scratch(dtype):
    """d = 30,010 (float64: 240 KB per W, beyond any device's shared memory per block) and 700
    model rows: W stays in theta, G in a scratch row of each resident block (allocated by torch),
    blocks take several rows each; minibatches, a per-row anchor and grad_scale. Bitwise
    identical on a second call."""
    model = models.Softmax(3000, 10, l2=0.01)
    data = make_data(model, random_sizes(350, seed=4, high=6), dtype, seed=5)
    g = torch.Generator().manual_seed(8)
    R = 700
    rows = torch.cat([torch.arange(350), torch.arange(350)])
    theta = 0.01 * torch.randn(R, model.d, generator=g, dtype=dtype)
    anchor = 0.01 * torch.randn(R, model.d, generator=g, dtype=dtype)
    scale = torch.rand(R, generator=g, dtype=dtype) + 0.5
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=5, seed=9, counter=1, clients=rows)
    kw = dict(steps=2, lr=0.1, prox=0.2, rows=rows, batches=batches, anchor=anchor, grad_scale=scale)
    want = ops.local_steps_ref(model, theta.clone(), data, **kw)
    d_kw = {k: (v.to(GPU) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with _cuda():
        got = ops.local_steps(model, theta.to(GPU), data.to(GPU), **d_kw)
        again = ops.local_steps(model, theta.to(GPU), data.to(GPU), **d_kw)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    assert torch.equal(got, again)


# ---- the two GLM kernels: one warp per model row (P <= 128, C <= 16), one block per row ---------

# (family, p, C, sizes): P = p + intercept (odd p) at the warp kernel's edges: 2 parameter rows
# a lane (P <= 64) and 4 (P = 101, 128), C = 1, 10 and 16 (the registers' capacity), the block
# kernel past them (P = 129, C = 17); clients of 1 row, of fewer and more than a chunk's 32.
# warp_fast's class widths: 1 (C = 1, softmax too), 4 (C = 3), 8 (C = 7), 12 (C = 10), 16; odd p
# with an intercept (9, 33): its X rows hold P = p + 1 values, one more than glm_warp_kernel's
WARP_EDGE_CASES = [("least_squares", 128, 1, [1, 33, 64]), ("logistic", 63, 1, [2, 31, 40]),
                   ("softmax", 60, 10, None), ("softmax", 101, 16, [1, 32, 70]), ("softmax", 127, 16, [5, 33]),
                   ("softmax", 129, 3, [4, 40]), ("softmax", 20, 17, [3, 35]),
                   ("softmax", 9, 3, [2, 33]), ("softmax", 33, 7, [31, 65]), ("softmax", 6, 1, [3, 40])]


@pytest.mark.parametrize("kernel", ["default", "warp_rows", "warp_fast", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", WARP_EDGE_CASES)
def test_both_glm_kernels_equal_the_reference(monkeypatch, kernel, dtype, family, p, C, sizes):
    """local_steps (full batch, and minibatches with a per-row anchor and grad_scale), gradients
    and evaluate (per-row and shared models) through the warp kernel where the shape allows it
    (by default with its batched staging; one row at a time when PFLCORE_CUDA_GLM=warp_rows; its
    variant with the class
    count in the template and cp.async staging, glm_warp_fast_kernel, when warp_fast: C = 1, 10
    and 16 take its widths 1, 12 and 16, C = 17 the block kernel) and through the block kernel
    when PFLCORE_CUDA_GLM=block; a second call is bitwise equal."""
    if kernel == "default":
        monkeypatch.delenv("PFLCORE_CUDA_GLM", raising=False)
    else:
        monkeypatch.setenv("PFLCORE_CUDA_GLM", kernel)
    model, data = _case(family, p, C, sizes, dtype, seed=3)
    m = data.num_clients
    g = torch.Generator().manual_seed(11)
    rows = _rows(m)
    R = rows.numel()
    theta = 0.1 * torch.randn(R, model.d, generator=g, dtype=dtype)
    anchor = 0.1 * torch.randn(R, model.d, generator=g, dtype=dtype)
    scale = torch.rand(R, generator=g, dtype=dtype) + 0.5
    shared = 0.1 * torch.randn(model.d, generator=g, dtype=dtype)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=3, batch_size=37, seed=2, counter=4, clients=rows)
    mini = dict(steps=3, lr=0.05, prox=0.3, rows=rows, batches=batches, anchor=anchor, grad_scale=scale)
    want_full = ops.local_steps_ref(model, theta[:m].clone(), data, steps=2, lr=0.1, prox=0.2, anchor=shared)
    want_mini = ops.local_steps_ref(model, theta.clone(), data, **mini)
    want_g = ops.gradients_ref(model, theta, data, rows=rows)
    want_gs = ops.gradients_ref(model, shared, data, rows=rows)
    want_e = ops.evaluate_ref(model, theta, data, rows=rows)
    want_es = ops.evaluate_ref(model, shared, data, rows=rows)
    dd = data.to(GPU)
    d_mini = {k: (v.to(GPU) if isinstance(v, torch.Tensor) else v) for k, v in mini.items()}
    with _cuda():
        got_full = ops.local_steps(model, theta[:m].clone().to(GPU), dd, steps=2, lr=0.1, prox=0.2,
                                   anchor=shared.to(GPU))
        got_mini = ops.local_steps(model, theta.clone().to(GPU), dd, **d_mini)
        again = ops.local_steps(model, theta.clone().to(GPU), dd, **d_mini)
        got_g = ops.gradients(model, theta.to(GPU), dd, rows=rows.to(GPU))
        got_gs = ops.gradients(model, shared.to(GPU), dd, rows=rows.to(GPU))
        got_e = ops.evaluate(model, theta.to(GPU), dd, rows=rows.to(GPU))
        got_es = ops.evaluate(model, shared.to(GPU), dd, rows=rows.to(GPU))
    torch.testing.assert_close(got_full.cpu(), want_full, **TOL[dtype])
    torch.testing.assert_close(got_mini.cpu(), want_mini, **TOL[dtype])
    assert torch.equal(got_mini, again), "bitwise identical run to run"
    torch.testing.assert_close(got_g.cpu(), want_g, **TOL[dtype])
    torch.testing.assert_close(got_gs.cpu(), want_gs, **TOL[dtype])
    _assert_eval(got_e, want_e, dtype)
    _assert_eval(got_es, want_es, dtype)


# ---- the split k-means update ----------------------------------------------------------------

def _update(points, labels, weights, centroids, name):
    km = importlib.import_module("pflcore.ops.kmeans")
    c = centroids.clone()
    with backend.use(name):
        wsum = km.cluster_means(points, labels, weights, c)
    return c, wsum


def _check_update(points, labels, weights, centroids, wsum_rtol=1e-13):
    """cuda against the reference (both on the device: float64 sums either way), and a second
    cuda call bitwise equal to the first."""
    want_c, want_w = _update(points, labels, weights, centroids, "reference")
    got_c, got_w = _update(points, labels, weights, centroids, "cuda")
    again_c, again_w = _update(points, labels, weights, centroids, "cuda")
    torch.testing.assert_close(got_c.cpu(), want_c.cpu(), **TOL[points.dtype])
    torch.testing.assert_close(got_w.cpu(), want_w.cpu(), rtol=wsum_rtol, atol=1e-13)
    assert torch.equal(got_c, again_c) and torch.equal(got_w, again_w), "bitwise identical run to run"
    return got_c, got_w


@pytest.mark.parametrize("dtype", DTYPES)
def test_kmeans_update_at_cgpfl_scale(dtype):
    """N = 10^6 points, K = 10, d = 610 (three feature tiles): ~100 chunks per cluster; one
    cluster left empty keeps its centroid and weighs 0."""
    N, K, d = 10 ** 6, 10, 610
    g = torch.Generator(device=GPU).manual_seed(0)
    points = torch.randn(N, d, generator=g, dtype=dtype, device=GPU)
    labels = torch.randint(0, K - 1, (N,), generator=g, device=GPU)  # cluster K - 1 empty
    weights = torch.rand(N, generator=g, dtype=dtype, device=GPU) + 0.1
    centroids = torch.randn(K, d, generator=g, dtype=dtype, device=GPU)
    got_c, got_w = _check_update(points, labels, weights, centroids, wsum_rtol=1e-11)
    assert got_w[K - 1].item() == 0.0 and torch.equal(got_c[K - 1], centroids[K - 1])
    _check_update(points, labels, None, centroids, wsum_rtol=1e-11)  # unweighted: wsum = counts exactly
    counts = torch.bincount(labels, minlength=K).to(torch.float64)
    _, wsum = _update(points, labels, None, centroids, "cuda")
    assert torch.equal(wsum, counts)


def _labels_with_runs(sizes, seed):
    """Labels whose cluster k has sizes[k] points, shuffled."""
    labels = torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in enumerate(sizes)])
    return labels[torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,d", [
    ([1], 1),
    ([0, 3, 0], 5),                               # empty clusters around a small one
    ([255, 256, 257, 512, 1, 0, 513], 33),        # chunks of 256 (N < 2^18): runs at chunk edges
    ([3000, 17, 0, 250], 257),                    # two feature tiles, the second of one feature
    ([170_000, 130_001, 1], 70),                  # N > 2^18: chunks of ceil(N / 1024) = 293 points
])
def test_kmeans_update_on_odd_shapes(dtype, sizes, d):
    labels = _labels_with_runs(sizes, seed=d).to(GPU)
    N, K = labels.numel(), len(sizes)
    g = torch.Generator().manual_seed(N + d)
    points = torch.randn(N, d, generator=g, dtype=dtype).to(GPU)
    weights = (torch.rand(N, generator=g, dtype=dtype) + 0.1).to(GPU)
    centroids = torch.randn(K, d, generator=g, dtype=dtype).to(GPU)
    got_c, _ = _check_update(points, labels, weights, centroids)
    for k, n in enumerate(sizes):
        if n == 0:
            assert torch.equal(got_c[k], centroids[k]), "an empty cluster keeps its centroid"


def test_kmeans_update_with_more_clusters_than_a_grid_dimension():
    """K = 70,000 > 65,535: the combining pass strides over clusters past gridDim.y, and the scan
    of chunk starts carries across 274 tiles of 256 clusters."""
    K, d = 70_000, 3
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, K, (300_000,), generator=g).to(GPU)
    points = torch.randn(300_000, d, generator=g, dtype=torch.float64).to(GPU)
    centroids = torch.randn(K, d, generator=g, dtype=torch.float64).to(GPU)
    _check_update(points, labels, None, centroids)
