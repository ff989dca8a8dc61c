"""The Triton kernels' GPU-scale structure (issue 25), against the torch references, under the
interpreter here (conftest.py sets TRITON_INTERPRET=1 without a GPU), compiled on a GPU:

- evaluate on ``batches`` is a mode of the GLM kernel: one launch, whatever the rows;
- the GLM grid is capped and its programs take rows grid-stride, with a scratch of [grid, d];
  a shared model [d] is read in place (row stride 0); hyperparameters are float64-exact;
- kmeans_update sums chunks of each cluster in a first pass and adds them in chunk order;
- the shapes of the tests are the odd ones of tests/test_triton.py, and 10,000 clients (points)
  for one test per op, with small d;
- ``python -m pflcore.triton.aot`` compiles a variant for sm_90 without a GPU.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model, random_sizes
from pflcore import backend, ops

pytest.importorskip("triton", reason="the triton extra is not installed: pip install 'pflcore[triton]'")
tt = importlib.import_module("pflcore.triton")
triton = importlib.import_module("triton")
tl = importlib.import_module("triton.language")
glm = importlib.import_module("pflcore.triton.glm")
km = importlib.import_module("pflcore.triton.kmeans")
DEV = torch.device("cpu") if tt.INTERPRETED else torch.device("cuda")
if DEV.type == "cuda" and not torch.cuda.is_available():  # pragma: no cover - guarded by conftest
    pytest.skip("Triton compiled for a GPU, but there is none", allow_module_level=True)


@pytest.fixture
def use_triton():
    with backend.use("triton"):
        yield


@pytest.fixture
def launches(monkeypatch):
    """The launches of each jitted kernel during the test: {kernel name: [grid, ...]}, and the
    arguments of the GLM kernel's launches (the runtime's ``run`` of the jitted object is what
    ``kernel[grid](...)`` calls, compiled or interpreted)."""
    seen = {"args": []}
    rows_kernel = importlib.import_module("pflcore.triton.glm_rows")
    for mod, name, key in ((glm, "_glm_kernel", "glm"), (rows_kernel, "_glm_rows_kernel", "glm"),
                           (km, "_partial_kernel", "_partial_kernel"), (km, "_combine_kernel", "_combine_kernel")):
        kernel = getattr(mod, name)
        run = kernel.run

        def counted(*args, _name=name, _key=key, _run=run, **kwargs):
            seen.setdefault(_key, []).append(kwargs.get("grid"))
            if _key == "glm":  # either GLM kernel: (which, its arguments)
                seen["args"].append((_name, args))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted)
    return seen


def _assert_eval_equal(got, want, dtype):
    torch.testing.assert_close(got[0].cpu(), want[0].cpu(), **TOL[dtype])
    assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[2].cpu(), want[2].cpu())


# ---- evaluate on batches ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C", [("softmax", 17, 10), ("logistic", 3, 1), ("least_squares", 1, 1),
                                        ("softmax", 61, 3)])
def test_evaluate_on_batches_matches_reference(family, p, C, dtype, use_triton, launches):
    """Clients of 1 to 6 rows with B = 7 (drawn with replacement: more rows than the client
    has), a client twice in rows, per-row and shared models; one launch per call."""
    model = make_model(family, p, C, l2=0.1, fit_intercept=p != 3)
    data = make_data(model, [1, 6, 3, 1, 5], dtype, seed=p + C).to(DEV)
    rows = torch.tensor([4, 0, 1, 1, 3, 2]).to(DEV)
    g = torch.Generator().manual_seed(2)
    theta = (0.5 * torch.randn(rows.numel(), model.d, generator=g, dtype=dtype)).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=7, seed=4, counter=1, clients=rows)[:, 0]
    _assert_eval_equal(ops.evaluate(model, theta, data, rows=rows, batches=batches),
                       ops.evaluate_ref(model, theta, data, rows=rows, batches=batches), dtype)
    shared = theta[0].clone()
    _assert_eval_equal(ops.evaluate(model, shared, data, rows=rows, batches=batches),
                       ops.evaluate_ref(model, shared, data, rows=rows, batches=batches), dtype)
    assert len(launches["glm"]) == 2


def test_evaluate_on_20000_batch_rows_is_one_launch(use_triton, launches):
    """1,000 clients x B = 20: a sample of 20,000 rows is evaluated by one kernel launch (it
    was a Python loop over the rows on the reference: 1.7 s here, seconds a round on a GPU)."""
    model = make_model("softmax", 3, 2, l2=0.0)
    data = make_data(model, random_sizes(1000, seed=3, high=12), torch.float32, seed=1).to(DEV)
    theta = (0.3 * torch.randn(1000, model.d, generator=torch.Generator().manual_seed(0))).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=20, seed=1, counter=0)[:, 0]
    assert batches.numel() == 20_000
    got = ops.evaluate(model, theta, data, batches=batches)
    assert len(launches["glm"]) == 1
    _assert_eval_equal(got, ops.evaluate_ref(model, theta, data, batches=batches), torch.float32)
    assert int(got[2].sum()) == 20_000


def test_evaluate_on_batches_checks_the_indices(use_triton):
    model = make_model("softmax", 3, 2)
    data = make_data(model, [3, 4], torch.float64, seed=0).to(DEV)
    theta = torch.zeros(2, model.d, dtype=torch.float64).to(DEV)
    batches = torch.tensor([[0, 1], [0, 5]], dtype=torch.int32).to(DEV)  # row 0 is client 0's, not 1's
    with pytest.raises(ValueError, match=r"batches"):
        ops.evaluate(model, theta, data, batches=batches)


# ---- the GLM grid, scratch, shared model, hyperparameters -------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("one_tile", [True, False])
def test_programs_take_several_rows_through_a_grid_sized_scratch(one_tile, dtype, launches):
    """grid = 2 programs for 10 model rows, a per-row anchor and grad_scale, minibatches: every
    program of the tiled kernel takes rows g, g + 2, ... and reuses its scratch row ([2, d]);
    the rows kernel takes blocks of 4 rows: 0-3 and 8-11 (10, 11 masked), then 4-7."""
    model = make_model("softmax", 11, 3, l2=0.02)
    data = make_data(model, random_sizes(7, seed=2, high=9), dtype, seed=5).to(DEV)
    R = 10
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 2, 0]).to(DEV)
    theta = (0.2 * torch.randn(R, model.d, generator=g, dtype=dtype)).to(DEV)
    anchor = torch.randn(R, model.d, generator=g, dtype=dtype).to(DEV)
    scale = (torch.rand(R, generator=g, dtype=dtype) + 0.5).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=3, batch_size=5, seed=2, counter=0, clients=rows)
    blocks = (2, 16, 4, 4) if one_tile else (2, 4, 4)  # rows kernel: 4 rows a block; tiled: 3 feature tiles of P = 12
    got = theta.clone()
    glm.local_steps(model, got, data, rows, batches, anchor, scale, 3, 0.1, 0.3, blocks=blocks, grid=2)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=3, lr=0.1, prox=0.3, anchor=anchor,
                               batches=batches, rows=rows, grad_scale=scale)
    torch.testing.assert_close(got, want, **TOL[dtype])
    (grid,), (name, args) = launches["glm"][0], launches["args"][0]
    assert grid == 2 and name == ("_glm_rows_kernel" if one_tile else "_glm_kernel")
    if not one_tile:
        assert tuple(args[1].shape) == (2, model.d), "the scratch has one row per program"
    # gradients and evaluate walk the rows the same way
    out = torch.empty(R, model.d, dtype=dtype).to(DEV)
    glm.gradients(model, theta, data, rows, None, out, blocks=blocks, grid=2)
    torch.testing.assert_close(out, ops.gradients_ref(model, theta, data, rows=rows), **TOL[dtype])
    res = [torch.empty(R, dtype=t).to(DEV) for t in (dtype, torch.int64, torch.int64)]
    glm.evaluate(model, theta, data, rows, None, *res, blocks=blocks, grid=2)
    _assert_eval_equal(res, ops.evaluate_ref(model, theta, data, rows=rows), dtype)


def test_the_grid_is_capped_at_the_resident_programs(launches):
    model = make_model("logistic", 2, 1)
    data = make_data(model, [1] * 150, torch.float32, seed=0).to(DEV)
    theta = torch.zeros(150, model.d).to(DEV)
    glm.local_steps(model, theta, data, torch.arange(150).to(DEV), None, None, None, 1, 0.1, 0.0, blocks=(4, 4, 1))
    cap = glm.grid_cap(data.x)
    assert launches["glm"][0] == (cap,) and cap < 150
    assert tuple(launches["args"][0][1][1].shape) == (cap, model.d), "scratch [grid, d], not [R, d]"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_model_is_read_in_place(dtype, use_triton, launches, monkeypatch):
    """gradients and evaluate of one model [d] at every row: the kernel reads it with row
    stride 0; no [R, d] copy is made (one_per_row is not called)."""
    model = make_model("softmax", 5, 3, l2=0.2)
    data = make_data(model, [4, 1, 7, 2], dtype, seed=3).to(DEV)
    theta = torch.randn(model.d, generator=torch.Generator().manual_seed(4), dtype=dtype).to(DEV)
    rows = torch.tensor([3, 3, 0, 2, 1]).to(DEV)
    want_grad, want_eval = ops.gradients_ref(model, theta, data, rows=rows), ops.evaluate_ref(model, theta, data)
    values = importlib.import_module("pflcore.backends._values")
    monkeypatch.setattr(values, "one_per_row", lambda *a: pytest.fail("theta was expanded to [R, d]"))
    got = ops.gradients(model, theta, data, rows=rows)
    assert got.shape == (5, model.d)
    torch.testing.assert_close(got, want_grad, **TOL[dtype])
    _assert_eval_equal(ops.evaluate(model, theta, data), want_eval, dtype)
    assert launches["args"][0][1][0].shape == (model.d,), "the [d] model itself is passed"


@triton.jit
def _float_arg_probe(out_ptr, bits):
    tl.store(out_ptr, glm.float_arg(bits, out_ptr.dtype.element_ty))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 in float32: inf, as in torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.0, -0.0, 0.1, 1 / 3, 5e-324, 1e300, 2.5])
def test_hyperparameters_reach_the_kernel_exactly(value, dtype):
    """lr, prox and l2 are int64 bit patterns of scalar arguments (Triton would pass a Python
    float as float32): float64 values arrive bit for bit, float32 ones rounded as torch rounds."""
    out = torch.empty(1, dtype=dtype).to(DEV)
    _float_arg_probe[(1,)](out, glm.scalar_bits(value))
    assert out.item() == torch.tensor(value, dtype=dtype).item()
    assert glm.scalar_bits(value) < -(2 ** 31) or value < 0, "typed int64: one compiled variant"


def test_local_steps_are_bitwise_deterministic(use_triton):
    model = make_model("softmax", 7, 4, l2=0.01)
    data = make_data(model, random_sizes(9, seed=4), torch.float32, seed=2).to(DEV)
    theta = torch.randn(9, model.d, generator=torch.Generator().manual_seed(0)).to(DEV)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=6, seed=0, counter=3)
    a = ops.local_steps(model, theta.clone(), data, steps=2, lr=0.3, prox=0.1, anchor=theta[1], batches=batches)
    b = ops.local_steps(model, theta.clone(), data, steps=2, lr=0.3, prox=0.1, anchor=theta[1], batches=batches)
    assert torch.equal(a, b)


# ---- 10,000 clients ---------------------------------------------------------------------------

def _federation(m, dtype=torch.float32, family="softmax", p=3, C=3):
    model = make_model(family, p, C, l2=0.05)
    data = make_data(model, random_sizes(m, seed=7, high=5), dtype, seed=9).to(DEV)
    theta = (0.3 * torch.randn(m, model.d, generator=torch.Generator().manual_seed(5), dtype=dtype)).to(DEV)
    return model, data, theta


def test_local_steps_at_10000_clients(use_triton):
    model, data, theta = _federation(10_000)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=4, seed=3, counter=0)
    kw = dict(steps=2, lr=0.1, prox=0.2, anchor=theta[0].clone(), batches=batches)
    got = ops.local_steps(model, theta.clone(), data, **kw)
    torch.testing.assert_close(got, ops.local_steps_ref(model, theta.clone(), data, **kw), **TOL[torch.float32])


def test_gradients_at_10000_clients(use_triton):
    model, data, theta = _federation(10_000, torch.float64, "logistic", 4, 1)
    torch.testing.assert_close(ops.gradients(model, theta, data), ops.gradients_ref(model, theta, data),
                               **TOL[torch.float64])


def test_evaluate_at_10000_clients(use_triton):
    model, data, theta = _federation(10_000)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=3, seed=3, counter=0)[:, 0]
    _assert_eval_equal(ops.evaluate(model, theta, data), ops.evaluate_ref(model, theta, data), torch.float32)
    _assert_eval_equal(ops.evaluate(model, theta, data, batches=batches),
                       ops.evaluate_ref(model, theta, data, batches=batches), torch.float32)


# ---- kmeans_update in two passes --------------------------------------------------------------

def _update(points, labels, weights, start, rows=None):
    from pflcore.backends.base import label_segments

    K = start.shape[0]
    got = start.clone()
    wsum = torch.empty(K, dtype=torch.float64, device=points.device)
    order, seg = label_segments(labels, K)
    km.kmeans_update(points, labels, order, seg, weights, got, wsum, rows=rows)
    return got, wsum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kmeans_update_in_chunks_matches_reference(rows, weighted, dtype):
    """Chunks of 1, 7 and 64 sorted points: clusters span many chunks, chunks span several
    clusters; cluster 2 is empty (keeps its centroid), cluster 0 holds most points."""
    g = torch.Generator().manual_seed(rows)
    N, K, d = 203, 6, 13
    points = torch.randn(N, d, generator=g, dtype=dtype).to(DEV)
    labels = torch.randint(0, K, (N,), generator=g)
    labels[labels == 2] = 0
    labels[:100] = 0
    labels = labels.to(DEV)
    weights = (torch.rand(N, generator=g, dtype=dtype) + 0.1).to(DEV) if weighted else None
    start = torch.randn(K, d, generator=g, dtype=dtype).to(DEV)
    got, wsum = _update(points, labels, weights, start, rows)
    want = start.clone()
    rwsum = backend.adapter("reference").kmeans_update(points, labels, weights, want)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(wsum, rwsum, rtol=1e-13, atol=1e-13)
    assert torch.equal(got[2], start[2])


def test_kmeans_update_loops_past_the_grid_axis_limit(monkeypatch):
    """Feature tiles beyond the grid's second axis (65,535 on CUDA; 1 here) are taken by a loop
    in each program."""
    g = torch.Generator().manual_seed(0)
    points = torch.randn(40, 70, generator=g, dtype=torch.float64).to(DEV)
    labels = torch.randint(0, 3, (40,), generator=g).to(DEV)
    start = torch.zeros(3, 70, dtype=torch.float64).to(DEV)
    block_t, _, chunk = km.update_blocks(70)
    monkeypatch.setattr(km, "update_blocks", lambda d: (block_t, 16, chunk))  # 5 tiles of 16 features
    monkeypatch.setattr(km, "MAX_GRID_Y", 2)
    got, _ = _update(points, labels, None, start, rows=9)
    want = start.clone()
    backend.adapter("reference").kmeans_update(points, labels, None, want)
    torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_kmeans_update_at_10000_points_is_deterministic(launches):
    g = torch.Generator().manual_seed(1)
    N, K, d = 10_000, 7, 5
    points = torch.randn(N, d, generator=g, dtype=torch.float32).to(DEV)
    labels = torch.randint(0, K, (N,), generator=g).to(DEV)
    weights = (torch.rand(N, generator=g) + 0.5).to(DEV)
    start = torch.randn(K, d, generator=g).to(DEV)
    a, wa = _update(points, labels, weights, start, rows=256)
    b, wb = _update(points, labels, weights, start, rows=256)
    assert torch.equal(a, b) and torch.equal(wa, wb), "bitwise the same run to run"
    assert launches["_partial_kernel"][0][0] == 40, "40 chunks of 256 sorted points"
    want = start.clone()
    rwsum = backend.adapter("reference").kmeans_update(points, labels, weights, want)
    torch.testing.assert_close(a, want, **TOL[torch.float32])
    torch.testing.assert_close(wa, rwsum, rtol=1e-12, atol=1e-12)


# ---- ahead-of-time compile --------------------------------------------------------------------

def test_aot_compiles_a_variant_for_sm90_without_a_gpu(tmp_path):
    """``python -m pflcore.triton.aot`` in a child without TRITON_INTERPRET (it re-executes
    itself without it anyway), on this pflcore (PYTHONPATH), for one small variant."""
    import json

    import pflcore

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pflcore.__file__))
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "pflcore.triton.aot", "--targets", "sm_90", "--json", str(out),
                           "--only", "anderson._mix_kernel fp32"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["target"] == "sm_90" and rows[0]["error"] is None
    assert 0 < rows[0]["regs"] <= 255 and rows[0]["spills"] >= 0
    assert "regs" in proc.stdout and "anderson._mix_kernel fp32" in proc.stdout


def test_aot_lists_every_variant_the_launchers_choose():
    """The list comes from the launchers' own block rules (for a GPU: in a child without the
    interpreter, whose blocks differ): each GLM mode and dtype of each shape, the rows kernel
    and the tiled one, every k-means and Anderson kernel."""
    import json

    import pflcore

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pflcore.__file__))
    code = "import json; from pflcore.triton import aot; print(json.dumps([v.name() for v in aot.variants()]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(names) == len(set(names))
    for kernel in ("_glm_kernel", "_glm_rows_kernel", "_assign_kernel", "_partial_kernel", "_combine_kernel", "_dots_kernel",
                   "_mix_kernel"):
        for dt in ("fp32", "fp64"):
            assert any(f".{kernel} {dt}" in n for n in names), (kernel, dt)
    assert any(n.startswith("glm_rows._glm_rows_kernel") for n in names), "the rows kernel (W, G in registers)"
    assert any(n.startswith("glm._glm_kernel") for n in names), "the tiled kernel (a scratch row a program)"
    assert all(any(f"MODE={m}" in n for n in names) for m in range(3))
