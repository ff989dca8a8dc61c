"""Every op on every backend, on the same inputs: the native core on CPU tensors and the cuda,
triton and reference backends on CUDA tensors, each against the op's ``<op>_ref`` run on the
CPU (DESIGN.md §4, §7). Odd shapes as in the CPU tests (m = 1, n_i = 1, p not a multiple of
the vector width, C = 1 and 10), both dtypes. Tolerances: tests/conftest.TOL (rounding of
the same sums in another order)."""
from __future__ import annotations

import importlib
import re

import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model, random_sizes
from _gpu import GPU, SKIP, require
from pflcore import backend, models, ops

pytestmark = SKIP
BACKENDS = ["native", "cuda", "triton", "reference"]
GLM_CASES = [("least_squares", 1, 1, [1]), ("logistic", 3, 1, [1, 1, 1]), ("softmax", 17, 10, [5, 1, 12]),
             ("softmax", 61, 10, None), ("least_squares", 33, 1, None), ("softmax", 1, 2, [9])]


def _device(name):
    return torch.device("cpu") if name == "native" else GPU


def _use(name):
    require(name)
    return backend.use(name)


def _glm_case(family, p, C, sizes, dtype, seed=0):
    model = make_model(family, p, C, l2=0.05, fit_intercept=p % 2 == 1)
    data = make_data(model, random_sizes(37, seed=p) if sizes is None else sizes, dtype, seed=seed + p + C)
    return model, data


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", GLM_CASES)
def test_glm_ops(name, dtype, family, p, C, sizes):
    model, data = _glm_case(family, p, C, sizes, dtype)
    g = torch.Generator().manual_seed(3)
    m = data.num_clients
    theta = 0.3 * torch.randn(m, model.d, generator=g, dtype=dtype)
    R = m + 2
    rows = torch.cat([torch.arange(m), torch.tensor([0, m - 1])])  # a client may appear twice
    theta_r = 0.3 * torch.randn(R, model.d, generator=g, dtype=dtype)
    anchor = torch.randn(R, model.d, generator=g, dtype=dtype)
    grad_scale = torch.rand(R, generator=g, dtype=dtype) * 2
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=3, batch_size=4, seed=1, counter=2, clients=rows)
    kw = dict(steps=3, lr=0.05, prox=0.4, anchor=anchor, batches=batches, rows=rows, grad_scale=grad_scale)
    want_full = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.1)
    want_mini = ops.local_steps_ref(model, theta_r.clone(), data, **kw)
    want_grad = ops.gradients_ref(model, theta, data)
    want_eval = ops.evaluate_ref(model, theta, data)

    dev = _device(name)
    d_data = data.to(dev)
    d_kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with _use(name):
        got_full = ops.local_steps(model, theta.clone().to(dev), d_data, steps=2, lr=0.1)
        got_mini = ops.local_steps(model, theta_r.clone().to(dev), d_data, **d_kw)
        got_grad = ops.gradients(model, theta.to(dev), d_data)
        got_eval = ops.evaluate(model, theta.to(dev), d_data)
    torch.testing.assert_close(got_full.cpu(), want_full, **TOL[dtype])
    torch.testing.assert_close(got_mini.cpu(), want_mini, **TOL[dtype])
    torch.testing.assert_close(got_grad.cpu(), want_grad, **TOL[dtype])
    torch.testing.assert_close(got_eval[0].cpu(), want_eval[0], **TOL[dtype])
    assert torch.equal(got_eval[2].cpu(), want_eval[2])
    # a correct count may differ only where a logit tie is broken by rounding: not with random data
    assert torch.equal(got_eval[1].cpu(), want_eval[1])


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_parameters_larger_than_shared_memory_and_more_rows_than_resident_blocks(name):
    """d = 60,000 float32 parameters: W and G do not fit shared memory, so the CUDA kernel keeps
    W in theta and G in a scratch row per block, with the grid capped at the resident blocks;
    600 model rows make every block take several rows (grid stride) through its scratch row."""
    model = models.Softmax(5999, 10, l2=0.01)
    data = make_data(model, random_sizes(600, seed=1, high=4), torch.float32, seed=2)
    theta = 0.01 * torch.randn(600, model.d, generator=torch.Generator().manual_seed(0))
    want = theta.clone()
    with backend.use("native"):
        ops.local_steps(model, want, data, steps=2, lr=0.1, prox=0.1, anchor=theta[0].clone())
    with _use(name):
        got = ops.local_steps(model, theta.to(GPU), data.to(GPU), steps=2, lr=0.1, prox=0.1,
                              anchor=theta[0].to(GPU))
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_classes_than_the_cuda_kernels_take_fall_back_to_triton(dtype):
    """C beyond _core_cuda.build_info()['max_classes']: the automatic choice skips cuda and the
    result is still right; asking for cuda by name says why it cannot."""
    require("cuda")
    most = backend.loaded("cuda").build_info()["max_classes"][dtype == torch.float64]
    model = models.Softmax(3, most + 1)
    data = make_data(model, [4, 1, 3], dtype, seed=5)
    theta = 0.1 * torch.randn(3, model.d, dtype=dtype)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.5)
    got = ops.local_steps(model, theta.to(GPU), data.to(GPU), steps=2, lr=0.5)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    with backend.use("cuda"), pytest.raises(backend.BackendUnavailable, match=f"at most C = {most} classes"):
        ops.local_steps(model, theta.to(GPU), data.to(GPU), steps=1, lr=0.5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,d", [(1, 1, 1), (33, 5, 17), (7, 64, 3), (300, 20, 257), (1000, 64, 785)])
def test_kmeans_assign_and_update(name, dtype, N, K, d):
    km = importlib.import_module("pflcore.ops.kmeans")
    g = torch.Generator().manual_seed(N + K + d)
    points = torch.randn(N, d, generator=g, dtype=dtype)
    centroids = torch.randn(K, d, generator=g, dtype=dtype)
    labels_ref, sq_ref = ops.kmeans_assign_ref(points, centroids)
    weights = torch.rand(N, generator=g, dtype=dtype) + 0.1
    upd_ref = centroids.clone()
    with backend.use("reference"):  # the Lloyd update (ops.kmeans's cluster means) on the reference
        wsum_ref = km.cluster_means(points, labels_ref, weights, upd_ref)
    dev = _device(name)
    with _use(name):
        labels, sq = ops.kmeans_assign(points.to(dev), centroids.to(dev))
        upd = centroids.to(dev).clone()
        wsum = km.cluster_means(points.to(dev), labels_ref.to(dev), weights.to(dev), upd)
    assert torch.equal(labels.cpu(), labels_ref)
    torch.testing.assert_close(sq.cpu(), sq_ref, **TOL[dtype])
    torch.testing.assert_close(upd.cpu(), upd_ref, **TOL[dtype])
    torch.testing.assert_close(wsum.cpu(), wsum_ref, rtol=1e-13, atol=1e-13)  # float64 sums either way


@pytest.mark.parametrize("name", BACKENDS)
def test_kmeans_whole_run(name):
    g = torch.Generator().manual_seed(0)
    centers = 8 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    pts = torch.cat([c + torch.randn(50, 9, generator=g, dtype=torch.float64) for c in centers])
    ref = ops.kmeans_ref(pts, 4, seed=2, iters=20)
    with _use(name):
        res = ops.kmeans(pts.to(_device(name)), 4, seed=2, iters=20)
    assert torch.equal(res.labels.cpu(), ref.labels)
    torch.testing.assert_close(res.centroids.cpu(), ref.centroids, **TOL[torch.float64])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_anderson(name, dtype):
    """anderson_weights on [k, D] with D past one block of the dot kernels, and a run of the
    stateful mixer longer than its memory (the ring buffer wraps)."""
    g = torch.Generator().manual_seed(3)
    Rs = torch.randn(4, 5000, generator=g, dtype=dtype)
    want = ops.anderson_weights_ref(Rs, 1e-8)
    A = 0.4 * torch.randn(60, 60, generator=g, dtype=dtype) / 60 ** 0.5
    b = torch.randn(60, generator=g, dtype=dtype)

    def run(dev):
        acc, u, out = ops.Anderson(memory=2), torch.zeros(6, 10, dtype=dtype, device=dev), []
        Ad, bd = A.to(dev), b.to(dev)
        for _ in range(8):
            u = acc.step(u, torch.tanh(Ad @ u.reshape(-1) + bd).reshape(6, 10))
            out.append(u.cpu())
        return torch.stack(out)

    with backend.use("reference"):
        want_run = run(torch.device("cpu"))
    dev = _device(name)
    with _use(name):
        got = ops.anderson_weights(Rs.to(dev), 1e-8)
        got_run = run(dev)
    # π solves a k x k system from float64 Gram entries: float32 inputs give the same products
    # (exact in float64), only summed in another order.
    torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_run, want_run, **TOL[dtype])


# Gram matrices of k = 1..8 take the one-pass kernel, k = 9 the row-by-row dots; D = 1, odd, past
# one block of either (2,048 entries a block of dots, 1,024 a step of the one-pass grid), and
# past the one-pass grid's 1,024 blocks (each thread loops).
GRAM_CASES = [(k, 5001) for k in range(1, 10)] + [(1, 1), (6, 1), (9, 1), (8, 2048 * 3 + 1), (6, 2_500_001),
                                                   (9, 2_500_001), (2, 1024 * 1024 + 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,D", GRAM_CASES)
def test_anderson_gram_one_pass_and_row_by_row(dtype, k, D):
    require("cuda")
    g = torch.Generator().manual_seed(k * 7 + D % 97)
    Rs = torch.randn(k, D, generator=g, dtype=dtype)
    want_G = Rs.to(torch.float64) @ Rs.to(torch.float64).T
    G = backend.adapter("cuda").gram(Rs.to(GPU))
    assert G.dtype == torch.float64 and G.shape == (k, k)
    assert torch.equal(G, G.T)  # both entries of a pair are the same sum
    torch.testing.assert_close(G, want_G, rtol=1e-9, atol=1e-9 * D)
    want = ops.anderson_weights_ref(Rs, 1e-8)
    with _use("cuda"):
        got = ops.anderson_weights(Rs.to(GPU), 1e-8)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-9)


# (m, d, rows): m = 1, d = 1, d odd and not a multiple of the 128-column tile, repeated rows,
# more rows than one chunk (128), and more than 2,048 chunks of 128 (the chunks grow).
AVERAGE_CASES = [(1, 1, None), (1, 611, None), (1, 5, [0, 0, 0]), (7, 1, [3, 3, 0, 6]), (300, 611, "repeat"),
                 (1000, 610, None), (513, 129, "repeat"), (2048 * 128 + 999, 3, None),
                 (3000, 17, "long")]


def _average_rows(m, rows, g):
    if rows is None or isinstance(rows, list):
        return None if rows is None else torch.tensor(rows)
    n = m // 2 if rows == "repeat" else 2048 * 128 + 7  # "long": more rows than m, each many times
    return torch.randint(0, m, (n,), generator=g)


@pytest.fixture(params=["screened", "fused"])
def average_path(request, monkeypatch):
    """The cuda average with the screen in its kernels (the default) and with the torch screen
    around them (PFLCORE_CUDA_AVERAGE=torch)."""
    if request.param == "fused":
        monkeypatch.delenv("PFLCORE_CUDA_AVERAGE", raising=False)
    else:
        monkeypatch.setenv("PFLCORE_CUDA_AVERAGE", "torch")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,rows", AVERAGE_CASES)
def test_cuda_average(dtype, m, d, rows, average_path):
    require("cuda")
    g = torch.Generator().manual_seed(m + d)
    theta = torch.randn(m, d, generator=g, dtype=dtype)
    w = torch.rand(m, generator=g, dtype=dtype) + 0.01
    rows_t = _average_rows(m, rows, g)
    want = ops.average_ref(theta, w, rows_t)
    with _use("cuda"):
        assert backend.select("average", None, theta.to(GPU)).name == "cuda"
        got = ops.average(theta.to(GPU), w.to(GPU), None if rows_t is None else rows_t.to(GPU))
        again = ops.average(theta.to(GPU), w.to(GPU), None if rows_t is None else rows_t.to(GPU))
    assert got.dtype == dtype and got.shape == (d,)
    assert torch.equal(got, again)  # a fixed summation order
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    # and against the float64 definition
    sel = slice(None) if rows_t is None else rows_t
    w64 = w.to(torch.float64)[sel]
    exact = (w64 @ theta.to(torch.float64)[sel]) / w64.sum()
    torch.testing.assert_close(got.cpu().to(torch.float64), exact, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_average_faults_are_the_reference_ones(dtype, average_path):
    """A NaN or inf in a selected row of theta, a bad weight, a zero weight sum, a row out of
    range, no rows: the reference's error (type and message); a NaN in an unselected row is none."""
    require("cuda")
    g = torch.Generator().manual_seed(5)
    nan = float("nan")

    def case(edit):
        theta = torch.randn(6, 613, generator=g, dtype=dtype)
        w = torch.rand(6, generator=g, dtype=dtype) + 0.1
        rows = torch.tensor([4, 1, 1, 5])
        edit(theta, w, rows)
        return theta, w, rows

    edits = [lambda t, w, r: t.__setitem__((1, 600), nan), lambda t, w, r: t.__setitem__((5, 0), float("inf")),
             lambda t, w, r: w.__setitem__(4, -2.0), lambda t, w, r: w.__setitem__(1, nan),
             lambda t, w, r: w.zero_(), lambda t, w, r: r.__setitem__(2, 6), lambda t, w, r: r.__setitem__(0, -3)]
    for i, edit in enumerate(edits):
        theta, w, rows = case(edit)
        for r in (rows, None if i < 5 else rows):
            with pytest.raises(ValueError) as want:
                ops.average_ref(theta, w, r)
            with _use("cuda"), pytest.raises(type(want.value), match=re.escape(str(want.value))):
                ops.average(theta.to(GPU), w.to(GPU), None if r is None else r.to(GPU))
    with _use("cuda"), pytest.raises(ValueError, match="sum to 0"):
        ops.average(torch.ones(3, 2, device=GPU, dtype=dtype), torch.ones(3, device=GPU, dtype=dtype),
                    torch.zeros(0, dtype=torch.int64, device=GPU))
    theta, w, rows = case(lambda t, w, r: t.__setitem__((0, 3), nan))  # row 0 is not averaged
    with _use("cuda"):
        got = ops.average(theta.to(GPU), w.to(GPU), rows.to(GPU))
    torch.testing.assert_close(got.cpu(), ops.average_ref(theta, w, rows), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_without_gpu_kernels_run_on_cuda_tensors(dtype):
    """average and sample_batches on CUDA tensors (cuda kernels; Triton has neither, so with
    triton requested they run on the reference): the CPU's results, the draws bit for bit."""
    model, data = _glm_case("softmax", 5, 3, [3, 1, 7], dtype)
    theta = torch.randn(3, model.d, dtype=dtype)
    w = torch.tensor([0.2, 0.3, 0.5], dtype=dtype)
    torch.testing.assert_close(ops.average(theta.to(GPU), w.to(GPU)).cpu(), ops.average(theta, w), **TOL[dtype])
    with backend.use("triton") if backend.status()["triton"][0] else backend.use("reference"):
        torch.testing.assert_close(ops.average(theta.to(GPU), w.to(GPU)).cpu(), ops.average(theta, w),
                                   **TOL[dtype])
    b_cpu = ops.sample_batches(data, steps=2, batch_size=5, seed=3, counter=4)
    b_gpu = ops.sample_batches(data.to(GPU), steps=2, batch_size=5, seed=3, counter=4)
    assert torch.equal(b_gpu.cpu(), b_cpu)


@pytest.mark.parametrize("name", ["cuda", "reference"])
def test_sample_batches_on_the_gpu_draws_the_cpu_draws(name):
    """The counter-based hash on the GPU: the same int32 indices as the native core, with and
    without clients (repeated, unsorted), for a shard (first_client > 0), seeds and counters
    past 2^31, and a draw past one grid of blocks; a client index out of range is a ValueError."""
    from pflcore import ClientData
    model = models.Softmax(3, 2)
    data = make_data(model, random_sizes(5000, seed=4, high=30), torch.float32, seed=1)
    shard = ClientData(data.x, data.y, data.offsets, first_client=12_345)
    clients = torch.tensor([7, 0, 4999, 7, 123])
    cases = [dict(data=data, steps=3, batch_size=20, seed=3, counter=4),
             dict(data=data, steps=2, batch_size=7, seed=2**32 - 1, counter=2**31 + 5, clients=clients),
             dict(data=shard, steps=1, batch_size=1, seed=9, counter=0, clients=clients),
             dict(data=data, steps=40, batch_size=50, seed=1, counter=1)]  # 10^7 draws
    for kw in cases:
        want = ops.sample_batches(**kw)  # the native core on the CPU (a requested cuda serves CUDA tensors only)
        gpu = dict(kw, data=kw["data"].to(GPU), **({"clients": kw["clients"].to(GPU)} if "clients" in kw else {}))
        with _use(name):
            got = ops.sample_batches(**gpu)
        assert got.dtype == torch.int32 and got.device.type == GPU.type
        assert torch.equal(got.cpu(), want)
    with _use(name):
        with pytest.raises(ValueError, match="clients"):
            ops.sample_batches(data.to(GPU), steps=1, batch_size=2, seed=0, counter=0,
                               clients=torch.tensor([0, 5000], device=GPU))


def test_raw_pointers_are_checked_before_the_cuda_module_reads_them():
    require("cuda")
    model, data = _glm_case("softmax", 5, 3, [3, 1, 7], torch.float32)
    theta = torch.zeros(model.d, 3, device=GPU).T  # [3, d], not contiguous
    with backend.use("cuda"), pytest.raises(ValueError,
                                            match=r"theta: expected a contiguous array \(it is updated in place\)"):
        ops.local_steps(model, theta, data.to(GPU), steps=1, lr=0.1)
