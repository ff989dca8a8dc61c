"""Triton kernels (pflcore/triton) against the torch references (DESIGN.md §1, §4).

Without a GPU they run on CPU tensors under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before the backend is first loaded); with one, on CUDA tensors. The
interpreter executes every block operation as a numpy call, program after program, so the
shapes are the native-core tests' odd shapes at small sizes: m = 1, n_i = 1, p ∈ {1, 3, 17},
C ∈ {1, 2, 10}, both dtypes. Tolerances: conftest.TOL (rounding of differently ordered sums).
"""
from __future__ import annotations

import importlib
import inspect
import sys

import numpy as np
import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model, random_sizes
from pflcore import backend, ops
from pflcore.errors import BackendUnavailable

pytest.importorskip("triton", reason="the triton extra is not installed: pip install 'pflcore[triton]'")
tt = importlib.import_module("pflcore.triton")
triton = importlib.import_module("triton")
tl = importlib.import_module("triton.language")
DEV = torch.device("cpu") if tt.INTERPRETED else torch.device("cuda")
if DEV.type == "cuda" and not torch.cuda.is_available():  # pragma: no cover - guarded by conftest
    pytest.skip("Triton compiled for a GPU, but there is none", allow_module_level=True)

# (family, p, C, client sizes): p ∈ {1, 3, 17}, C ∈ {1, 2, 10}; m = 1, n_i = 1 and ragged.
GLM_CASES = [("least_squares", 1, 1, [1]), ("logistic", 3, 1, [1, 1, 1]), ("softmax", 17, 10, [5, 1, 12]),
             ("softmax", 1, 2, [9]), ("least_squares", 17, 1, [3, 1, 6]), ("softmax", 3, 2, [1, 1])]


def _on(data):
    return data if DEV.type == "cpu" else data.to(DEV)


@pytest.fixture
def use_triton():
    with backend.use("triton"):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", GLM_CASES)
def test_local_steps_full_batch(family, p, C, sizes, dtype, use_triton):
    model = make_model(family, p, C, l2=0.05, fit_intercept=p != 3)
    data = _on(make_data(model, sizes, dtype, seed=p + C))
    theta = 0.3 * torch.randn(data.num_clients, model.d, generator=torch.Generator().manual_seed(7), dtype=dtype)
    theta = theta.to(DEV)
    got = ops.local_steps(model, theta.clone(), data, steps=2, lr=0.1)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.1)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not torch.equal(got, theta), "the steps must move theta"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,anchor_kind", [("softmax", 17, 10, "none"), ("logistic", 3, 1, "shared"),
                                                     ("least_squares", 17, 1, "per_row"), ("softmax", 1, 2, "per_row")])
def test_local_steps_minibatch_anchor_rows_grad_scale(family, p, C, anchor_kind, dtype, use_triton):
    model = make_model(family, p, C, l2=0.01, fit_intercept=p != 3)
    data = _on(make_data(model, random_sizes(4, seed=p, high=9), dtype, seed=11))
    R = 3
    g = torch.Generator().manual_seed(5)
    rows = torch.tensor([2, 0, 2]).to(DEV)  # a client may appear twice
    theta = (0.2 * torch.randn(R, model.d, generator=g, dtype=dtype)).to(DEV)
    anchor = {"none": None, "shared": torch.randn(model.d, generator=g, dtype=dtype),
              "per_row": torch.randn(R, model.d, generator=g, dtype=dtype)}[anchor_kind]
    anchor = None if anchor is None else anchor.to(DEV)
    grad_scale = (torch.rand(R, generator=g, dtype=dtype) * 3).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=3, seed=9, counter=1, clients=rows)
    kw = dict(steps=2, lr=0.05, prox=0.7, anchor=anchor, batches=batches, rows=rows, grad_scale=grad_scale)
    got = ops.local_steps(model, theta.clone(), data, **kw)
    want = ops.local_steps_ref(model, theta.clone(), data, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("family,p,C,blocks", [("logistic", 17, 1, (4, 8, 1)), ("softmax", 5, 3, (2, 4, 4))])
def test_local_steps_many_small_tiles(family, p, C, blocks, batched):
    """On a GPU the blocks split a client's rows into chunks and the features into tiles; under
    the interpreter they are large. Small explicit blocks exercise that loop structure here."""
    model = make_model(family, p, C, l2=0.1)
    data = _on(make_data(model, [9, 5], torch.float64, seed=3))
    assert blocks[0] < 9 and blocks[1] < model.P, "several row chunks and feature tiles"
    theta = torch.randn(2, model.d, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEV)
    rows = torch.arange(2).to(DEV)
    batches = None
    if batched:
        with backend.use("reference"):
            batches = ops.sample_batches(data, steps=2, batch_size=7, seed=1, counter=0)
    anchor = torch.ones(model.d, dtype=torch.float64).to(DEV)
    got = theta.clone()
    tt.glm.local_steps(model, got, data, rows, batches, anchor, None, 2, 0.2, 0.3, blocks=blocks)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.2, prox=0.3, anchor=anchor,
                               batches=batches)
    torch.testing.assert_close(got, want, **TOL[torch.float64])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C,sizes", GLM_CASES[:4])
def test_gradients_and_evaluate(family, p, C, sizes, dtype, use_triton):
    model = make_model(family, p, C, l2=0.3)
    data = _on(make_data(model, sizes, dtype, seed=1))
    theta = torch.randn(data.num_clients, model.d, generator=torch.Generator().manual_seed(1), dtype=dtype).to(DEV)
    torch.testing.assert_close(ops.gradients(model, theta, data), ops.gradients_ref(model, theta, data), **TOL[dtype])
    loss, correct, count = ops.evaluate(model, theta, data)
    rloss, rcorrect, rcount = ops.evaluate_ref(model, theta, data)
    torch.testing.assert_close(loss, rloss, **TOL[dtype])
    assert torch.equal(count, rcount) and torch.equal(correct, rcorrect)


def test_minibatch_gradients_with_rows(use_triton):
    model = make_model("softmax", 3, 2, l2=0.1)
    data = _on(make_data(model, [4, 2, 7], torch.float64, seed=8))
    rows = torch.tensor([2, 1]).to(DEV)
    theta = torch.randn(2, model.d, dtype=torch.float64).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=4, seed=3, counter=2, clients=rows)[:, 0]
    torch.testing.assert_close(ops.gradients(model, theta, data, rows=rows, batches=batches),
                               ops.gradients_ref(model, theta, data, rows=rows, batches=batches),
                               **TOL[torch.float64])


# ---- k-means --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,d", [(1, 1, 1), (33, 5, 17), (7, 64, 3), (40, 3, 300)])
def test_kmeans_assign_matches_reference(N, K, d, dtype, use_triton):
    g = torch.Generator().manual_seed(N + K + d)
    points = torch.randn(N, d, generator=g, dtype=dtype).to(DEV)
    centroids = torch.randn(K, d, generator=g, dtype=dtype).to(DEV)
    labels, sq = ops.kmeans_assign(points, centroids)
    rlabels, rsq = ops.kmeans_assign_ref(points, centroids)
    assert torch.equal(labels, rlabels)
    torch.testing.assert_close(sq, rsq, **TOL[dtype])


def test_kmeans_assign_exact_ties_and_nan(use_triton):
    """Small integers make every distance exact: ties go to the lowest index, across tiles of
    16 centroids too; a NaN centroid makes the distances NaN, which the op reports."""
    rng = np.random.default_rng(0)
    points = torch.from_numpy(rng.integers(-2, 3, size=(25, 6)).astype(np.float32)).to(DEV)
    centroids = torch.from_numpy(rng.integers(-2, 3, size=(20, 6)).astype(np.float32)).to(DEV)
    centroids[17] = centroids[3]
    centroids[19] = centroids[0]
    labels, sq = ops.kmeans_assign(points, centroids)
    full = ((points[:, None].double() - centroids[None].double()) ** 2).sum(-1)
    assert torch.equal(labels, full.argmin(1)) and torch.equal(sq.double(), full.min(1).values)
    assert not bool(((labels == 17) | (labels == 19)).any())
    centroids[2, 1] = float("nan")
    with pytest.raises(ValueError, match="centroids: row 2 holds a NaN or infinite value"):
        ops.kmeans_assign(points, centroids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_kmeans_update_matches_reference(dtype, weighted):
    g = torch.Generator().manual_seed(4)
    N, K, d = 37, 5, 19
    points = torch.randn(N, d, generator=g, dtype=dtype).to(DEV)
    labels = torch.randint(0, K - 1, (N,), generator=g).to(DEV)  # cluster K-1 stays empty
    weights = (torch.rand(N, generator=g, dtype=dtype) + 0.1).to(DEV) if weighted else None
    start = torch.randn(K, d, generator=g, dtype=dtype).to(DEV)
    got, want = start.clone(), start.clone()
    wsum = backend.adapter("triton").kmeans_update(points, labels, weights, got)
    rwsum = backend.adapter("reference").kmeans_update(points, labels, weights, want)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(wsum, rwsum, rtol=1e-14, atol=1e-14)
    assert torch.equal(got[K - 1], start[K - 1]), "an empty cluster keeps its centroid"


def test_kmeans_whole_run_matches_reference(use_triton):
    g = torch.Generator().manual_seed(0)
    centers = 8 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    pts = torch.cat([c + torch.randn(15, 4, generator=g, dtype=torch.float64) for c in centers]).to(DEV)
    res = ops.kmeans(pts, 3, seed=2, iters=10)
    ref = ops.kmeans_ref(pts, 3, seed=2, iters=10)
    assert torch.equal(res.labels, ref.labels)
    torch.testing.assert_close(res.centroids, ref.centroids, **TOL[torch.float64])


# ---- Anderson -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_anderson_push_and_mix_match_reference(dtype):
    ref = backend.adapter("reference")
    g = torch.Generator().manual_seed(1)
    H, D = 4, 2500  # D spans three blocks of the dot kernel
    R0 = torch.randn(H, D, generator=g, dtype=dtype).to(DEV)
    TU0 = torch.randn(H, D, generator=g, dtype=dtype).to(DEV)
    u, tu = torch.randn(D, generator=g, dtype=dtype).to(DEV), torch.randn(D, generator=g, dtype=dtype).to(DEV)
    order = [3, 0, 2]  # the new pair goes to slot 2, the newest
    R1, TU1, R2, TU2 = R0.clone(), TU0.clone(), R0.clone(), TU0.clone()
    dots = torch.empty(3, dtype=torch.float64)
    tt.anderson_push(u, tu, R1, TU1, 2, torch.tensor(order).to(DEV), dots)
    want = ref.anderson_push(u, tu, R2, TU2, 2, order)
    assert torch.equal(R1, R2) and torch.equal(TU1, TU2)
    torch.testing.assert_close(dots, want, rtol=1e-12, atol=1e-12)
    pi = torch.tensor([0.5, -0.25, 0.75], dtype=torch.float64)
    out = torch.empty(D, dtype=dtype).to(DEV)
    tt.anderson_mix(TU1, torch.tensor(order).to(DEV), pi.to(DEV), out)
    torch.testing.assert_close(out, ref.anderson_mix(TU2, order, pi), **TOL[dtype])


def test_anderson_weights_and_a_run_match_reference(use_triton):
    g = torch.Generator().manual_seed(3)
    R = torch.randn(4, 300, generator=g, dtype=torch.float64).to(DEV)
    ref = ops.anderson_weights_ref(R, 1e-8)
    torch.testing.assert_close(ops.anderson_weights(R, 1e-8), ref, rtol=1e-9, atol=1e-9)
    # a nonlinear contraction in [5, 3], with more steps than memory + 1 (the ring buffer wraps)
    A = (0.4 * torch.randn(15, 15, generator=g, dtype=torch.float64) / 15 ** 0.5).to(DEV)
    b = torch.randn(15, generator=g, dtype=torch.float64).to(DEV)

    def T(u):
        return torch.tanh(A @ u.reshape(-1) + b).reshape(5, 3)

    def run():
        acc, u, out = ops.Anderson(memory=2), torch.zeros(5, 3, dtype=torch.float64).to(DEV), []
        for _ in range(6):
            u = acc.step(u, T(u))
            out.append(u.clone())
        return torch.stack(out)

    got = run()
    with backend.use("reference"):
        want = run()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@triton.jit
def _row_offset_probe(out_ptr, row, width):
    tl.store(out_ptr, tt._util.row_offset(row, width))


@pytest.mark.parametrize("row,width", [(1, 2**30), (3, 2**30), (5, 500_000_000), (2, 7)])
def test_row_offset_is_int64_past_2_31(row, width):
    """Regression: the Anderson kernels computed ``slot * D`` in int32 (both arguments below
    2**31 arrive as int32), so with memory + 1 slots of D entries past 2**31 elements in all
    they read and wrote the wrong row. Every row offset now goes through ``row_offset``; a
    history that large (>= 8 GiB) does not fit this test, the offset itself does."""
    out = torch.zeros(1, dtype=torch.int64, device=DEV)
    _row_offset_probe[(1,)](out, row, width)
    assert int(out) == row * width


def test_anderson_kernels_take_row_offsets_in_int64():
    """The kernels whose offsets the probe above checks use it for every row of the history."""
    src = inspect.getsource(tt.anderson)
    assert "slot * D" not in src and "sj * D" not in src
    assert src.count("row_offset(") >= 4


# ---- dispatch -------------------------------------------------------------------------------

def test_triton_serves_cpu_tensors_only_by_name(monkeypatch):
    assert set(backend.ops_of("triton")) == {"local_steps", "gradients", "evaluate", "kmeans_assign",
                                             "kmeans_update", "anderson_push", "anderson_mix", "gram"}
    if not tt.INTERPRETED:
        pytest.skip("compiled Triton serves CUDA tensors only")
    cpu, glm = torch.zeros(1), make_model("softmax", 3, 2)
    assert backend.select("local_steps", glm, cpu).name == "native"  # the automatic order skips it
    with backend.use("triton"):
        assert backend.select("local_steps", glm, cpu).name == "triton"
        # an op triton has no kernel for runs on the reference, so whole runs can be forced
        assert backend.select("average", None, cpu).name == "reference"
    monkeypatch.setenv("PFLCORE_BACKEND", "triton")
    assert backend.select("kmeans_assign", None, cpu).name == "triton"
    # and the dispatch really runs the Triton kernel: make it fail
    monkeypatch.setattr(tt, "kmeans_assign", lambda *a: (_ for _ in ()).throw(RuntimeError("triton ran")))
    with pytest.raises(RuntimeError, match="triton ran"):
        ops.kmeans_assign(torch.zeros(2, 2), torch.zeros(1, 2))


def test_use_triton_without_triton_installed_raises_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setattr(backend.adapter("triton"), "_state", None)
    with pytest.raises(BackendUnavailable, match=r"triton is not installed: pip install 'pflcore\[triton\]'"):
        with backend.use("triton"):
            pass
    assert backend.status()["triton"][0] is False
    assert backend.select("local_steps", make_model("softmax", 3, 2), torch.zeros(1)).name == "native"
    monkeypatch.setenv("PFLCORE_BACKEND", "triton")
    with pytest.raises(BackendUnavailable, match="triton is not installed"):
        ops.kmeans_assign(torch.zeros(2, 2), torch.zeros(1, 2))
    monkeypatch.undo()  # restores the cached real module
    assert backend.loaded("triton") is tt
