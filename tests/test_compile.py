"""The ops under torch.compile and torch.export (issue 18, DESIGN.md §8; pflcore/ops/_compile.py):
registered as torch custom ops, a function calling them compiles with fullgraph=True and gives
eager's numbers; each op passes torch.library.opcheck; the algorithm guard holds when a compiled
graph runs; what does not apply (autograd, vmap, numpy arrays, kmeans and Anderson.step) fails
or falls back as documented.

Compiling is slow (seconds), so the compiled functions are built once per module and shared:
one GLM function (compiled for float32 and float64), one for the nets, one with graph breaks."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import pflcore
from conftest import make_data
from pflcore import ClientData, backend, models, ops
from pflcore.algorithms.base import Algorithm
from pflcore.ops._compile import model_args

SOFTMAX = models.Softmax(5, 3, l2=1e-3)
LOGISTIC = models.Logistic(5, l2=0.0, fit_intercept=False)
SIZES = [7, 12, 3, 9]  # ragged clients
M = len(SIZES)


@functools.lru_cache(maxsize=None)
def _inputs(dtype):
    data = make_data(SOFTMAX, SIZES, dtype, seed=1)
    binary = make_data(LOGISTIC, SIZES, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    theta = (torch.randn(M, SOFTMAX.d, generator=g) * 0.3).to(dtype)
    centroids = (torch.randn(2, SOFTMAX.d, generator=g) * 0.3).to(dtype)
    residuals = torch.randn(3, 10, generator=g).to(dtype)
    images = torch.randn(3, 10, generator=g).to(dtype)
    return data, binary, theta, centroids, residuals, images


def glm_round(theta, data, binary, centroids, residuals, images):
    """Every registered op on GLMs, with their optional arguments."""
    b = ops.sample_batches(data, steps=3, batch_size=4, seed=5, counter=2)
    scale = torch.linspace(0.5, 1.5, M, dtype=theta.dtype)
    out = ops.local_steps(SOFTMAX, theta, data, steps=3, lr=0.2, prox=0.5, anchor=theta[0], batches=b,
                          grad_scale=scale)
    rows = [2, 0, 2]
    b_rows = ops.sample_batches(data, steps=1, batch_size=3, seed=5, counter=3, clients=torch.tensor(rows))[:, 0]
    g_full = ops.gradients(SOFTMAX, theta, data)
    g_shared = ops.gradients(SOFTMAX, theta[1], data, rows=rows, batches=b_rows)
    hv = ops.hvp(SOFTMAX, theta[:3], g_full[:3], data, batches=b_rows, rows=rows)
    loss, correct, count = ops.evaluate(SOFTMAX, theta, data)
    bin_loss, bin_correct, _ = ops.evaluate(LOGISTIC, theta[:, :LOGISTIC.d], binary)
    labels, sqdist = ops.kmeans_assign(theta, centroids)
    mean = ops.average(theta, count.to(theta.dtype), rows=torch.tensor([0, 1, 3]))
    pi = ops.anderson_weights(residuals)
    mixed = pi.to(images.dtype) @ images  # Anderson's next iterate: Σ_j π_j T(u_j)
    return dict(out=out, b=b, g_full=g_full, g_shared=g_shared, hv=hv, loss=loss, correct=correct, count=count,
                bin_loss=bin_loss, bin_correct=bin_correct, labels=labels, sqdist=sqdist, mean=mean, pi=pi,
                mixed=mixed)


COMPILED_GLM = torch.compile(glm_round, fullgraph=True)


def _run(fn, dtype):
    data, binary, theta, centroids, residuals, images = _inputs(dtype)
    th = theta.clone()
    return th, fn(th, data, binary, centroids, residuals, images)


@functools.lru_cache(maxsize=None)
def _compiled_and_eager(dtype):
    return _run(COMPILED_GLM, dtype), _run(glm_round, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fullgraph_compile_matches_eager_bitwise(dtype):
    (th_c, got), (th_e, want) = _compiled_and_eager(dtype)
    assert got["out"] is th_c, "local_steps returns the caller's theta, updated in place"
    assert torch.equal(th_c, th_e) and not torch.equal(th_c, _inputs(dtype)[2])
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        if key == "mixed":  # a torch matmul, compiled by Inductor: equal to rounding
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
        else:  # the pflcore ops: the same kernels on the same inputs
            assert torch.equal(got[key], value), key


def test_compiled_ops_honour_the_backend_chosen_around_the_call():
    (th_c, _), _ = _compiled_and_eager(torch.float64)
    data, binary, theta, centroids, residuals, images = _inputs(torch.float64)
    th = theta.clone()
    with backend.use("reference"):
        got = COMPILED_GLM(th, data, binary, centroids, residuals, images)  # no recompile: same guards
    assert not torch.equal(th, th_c)  # the reference sums in another order
    torch.testing.assert_close(th, th_c, rtol=1e-11, atol=1e-11)
    assert torch.equal(got["labels"], ops.kmeans_assign_ref(th, centroids)[0])


def test_bad_values_raise_when_the_compiled_graph_runs():
    _compiled_and_eager(torch.float32)
    data, binary, theta, centroids, residuals, images = _inputs(torch.float32)
    saved = int(data.y[4])
    data.y[4] = 3  # out of [0, 3): the arrays stay the caller's, checked on every call
    try:
        with pytest.raises(ValueError, match=r"^y: expected labels in \[0, 3\), got y\[4\] = 3"):
            COMPILED_GLM(theta.clone(), data, binary, centroids, residuals, images)
    finally:
        data.y[4] = saved


class _CompiledInside(Algorithm):
    """Calls a function compiled outside the run from inside its round."""

    name = "CompiledInside"

    def init(self, ctx):
        return ctx.initial_global()

    def round(self, state, ctx, t):
        data, binary, theta, centroids, residuals, images = _inputs(torch.float32)
        COMPILED_GLM(theta.clone(), data, binary, centroids, residuals, images)
        return state

    def global_model(self, state):
        return state


def test_the_algorithm_guard_applies_when_the_compiled_graph_runs():
    _compiled_and_eager(torch.float32)  # compiled outside any run
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=3, dim=5, num_classes=3, seed=0, size_scale=1, max_size=30)
    with pytest.raises(RuntimeError, match=r"^ops\.sample_batches called inside CompiledInside"):
        pflcore.run(_CompiledInside(), fed, models.Softmax(5, 3), rounds=1, progress=False)


# ---- torch nets: the same custom ops, the model passed as its sizes ---------------------------

MLP = models.MLP(6, (5, 4), 3, l2=1e-3)
CNN = models.CNN(16, 3, channels=(2,), kernel_size=3, padding=1, hidden=(4,))


def nets_round(theta_mlp, theta_cnn, data_mlp, data_cnn):
    out = []
    for model, theta, data in ((MLP, theta_mlp, data_mlp), (CNN, theta_cnn, data_cnn)):
        b = ops.sample_batches(data, steps=2, batch_size=3, seed=1, counter=0)
        ops.local_steps(model, theta, data, steps=2, lr=0.1, batches=b)
        out += [theta, ops.gradients(model, theta, data), *ops.evaluate(model, theta, data),
                ops.hvp(model, theta, theta, data, batches=b[:, 0])]
    return out


def test_nets_compile_fullgraph_and_match_eager_bitwise():
    g = torch.Generator().manual_seed(0)
    data_mlp = ClientData(torch.randn(31, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (31,), generator=g),
                          torch.tensor([0, 10, 25, 31]))
    data_cnn = ClientData(torch.randn(31, 16, generator=g, dtype=torch.float64),
                          torch.randint(0, 3, (31,), generator=g), torch.tensor([0, 10, 25, 31]))
    start = (MLP.initial(3, dtype=torch.float64, seed=1), CNN.initial(3, dtype=torch.float64, seed=2))
    got = torch.compile(nets_round, fullgraph=True)(start[0].clone(), start[1].clone(), data_mlp, data_cnn)
    want = nets_round(start[0].clone(), start[1].clone(), data_mlp, data_cnn)
    assert len(got) == len(want) == 12
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_models_round_trip_through_the_custom_ops_scalars():
    from pflcore.ops._compile import _model

    for model in (SOFTMAX, LOGISTIC, models.LeastSquares(4, l2=0.5), MLP, models.MLP(3, (), 2), CNN,
                  models.CNN(36, 4, image_shape=(1, 6, 6), channels=(2, 3), kernel_size=3, pool=1, padding=0,
                             hidden=(5, 4), l2=0.1)):
        assert _model(*model_args(model)) == model
    with pytest.raises(ValueError, match="^family: expected 0-2"):
        _model(7, 3, 2, True, 0.0, [])
    with pytest.raises(ValueError, match="^C: LeastSquares has C = 1, got 2"):
        _model(0, 3, 2, True, 0.0, [])


# ---- opcheck: schema, fake tensors, autograd registration, AOT dispatch -----------------------

def _opcheck_cases():
    data = make_data(SOFTMAX, SIZES, torch.float32, seed=1)
    x, y, off = data.x, data.y, data.offsets
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(M, SOFTMAX.d, generator=g) * 0.3
    b3 = ops.sample_batches(data, steps=2, batch_size=3, seed=0, counter=0)
    b2 = b3[:, 0].contiguous()
    glm = model_args(SOFTMAX)
    mlp_data = ClientData(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g),
                          torch.tensor([0, 8, 20]))
    mlp, mlp_theta = model_args(MLP), MLP.initial(2, seed=0)
    mlp_b = ops.sample_batches(mlp_data, steps=1, batch_size=3, seed=0, counter=0, clients=torch.tensor([1, 0]))
    P = torch.ops.pflcore
    return {
        "local_steps": (P.local_steps, (theta.clone(), x, y, off, 0, *glm, 2, 0.1, 0.5, theta[1].clone(), b3, None,
                                        torch.ones(M))),
        "local_steps(rows, mlp)": (P.local_steps, (mlp_theta.clone(), mlp_data.x, mlp_data.y, mlp_data.offsets, 0,
                                                   *mlp, 1, 0.1, 0.0, None, mlp_b, torch.tensor([1, 0]), None)),
        "gradients": (P.gradients, (theta, x, y, off, 0, *glm, None, None)),
        "gradients(shared theta, batches)": (P.gradients, (theta[0].clone(), x, y, off, 0, *glm, None, b2)),
        "evaluate(rows)": (P.evaluate, (theta[:2].clone(), x, y, off, 0, *glm, torch.tensor([3, 3]), None)),
        "hvp": (P.hvp, (theta, torch.randn(M, SOFTMAX.d, generator=g), x, y, off, 0, *glm, b2, None)),
        "hvp(rows, mlp)": (P.hvp, (mlp_theta, mlp_theta.clone(), mlp_data.x, mlp_data.y, mlp_data.offsets, 0, *mlp,
                                   mlp_b[:, 0].contiguous(), torch.tensor([1, 0]))),
        "sample_batches": (P.sample_batches, (x, y, off, 2, torch.tensor([1, 3]), 3, 4, 7, 1)),
        "kmeans_assign": (P.kmeans_assign, (theta, theta[:2].clone())),
        "average": (P.average, (theta, torch.rand(M, generator=g), None)),
        "anderson_weights": (P.anderson_weights, (torch.randn(3, 8, generator=g, dtype=torch.float64), 1e-8)),
    }


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case):
    # All four of opcheck's tests run. test_aot_dispatch_dynamic checks the forward pass only:
    # no input requires grad, as the ops have no derivative formula (see the autograd test).
    op, args = OPCHECK_CASES[case]
    results = torch.library.opcheck(op, args)
    assert results == {t: "SUCCESS" for t in ("test_schema", "test_autograd_registration", "test_faketensor",
                                               "test_aot_dispatch_dynamic")}


def test_every_public_op_with_a_kernel_is_registered():
    registered = {name for name in dir(torch.ops.pflcore) if not name.startswith("_")}
    assert {"local_steps", "gradients", "evaluate", "hvp", "sample_batches", "kmeans_assign", "average",
            "anderson_weights"} <= registered


# ---- export ----------------------------------------------------------------------------------

class _Exported(torch.nn.Module):
    def forward(self, theta, centroids):
        data = _inputs(torch.float32)[0]
        return ops.gradients(SOFTMAX, theta, data), ops.kmeans_assign(theta, centroids)[0]


def test_torch_export_keeps_the_custom_ops():
    _, _, theta, centroids, _, _ = _inputs(torch.float32)
    program = torch.export.export(_Exported(), (theta, centroids))  # non-strict: no Dynamo
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"pflcore.gradients.default", "pflcore.kmeans_assign.default"} <= targets
    got = program.module()(theta, centroids)
    assert torch.equal(got[0], ops.gradients(SOFTMAX, theta, _inputs(torch.float32)[0]))
    assert torch.equal(got[1], ops.kmeans_assign(theta, centroids)[0])


# ---- what does not apply ---------------------------------------------------------------------

def server_step(points, u):
    km = ops.kmeans(points, 2, seed=0)
    return km.centroids, km.labels, ANDERSON.step(u, 0.5 * u + 1.0)


ANDERSON = ops.Anderson(memory=2)


def test_kmeans_and_anderson_step_are_graph_breaks_that_run_eagerly():
    points = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(server_step)  # not fullgraph: the two calls run eagerly in between graphs
    plain = ops.Anderson(memory=2)
    u_c = u_e = torch.ones(4)
    for _ in range(3):
        c_c, l_c, u_c = compiled(points, u_c)
        km = ops.kmeans(points, 2, seed=0)
        u_e = plain.step(u_e, 0.5 * u_e + 1.0)
        assert torch.equal(c_c, km.centroids) and torch.equal(l_c, km.labels) and torch.equal(u_c, u_e)
    assert ANDERSON.weights is not None and torch.equal(ANDERSON.weights, plain.weights)


def test_fullgraph_names_what_cannot_be_compiled():
    """Each is a compile-time error with fullgraph=True (torch's Unsupported, naming the reason);
    without fullgraph, Dynamo runs these calls eagerly instead."""
    data, _, theta, centroids, _, _ = _inputs(torch.float32)
    cases = [
        (lambda p: ops.kmeans(p, 2).centroids, (theta,), "pflcore.ops.kmeans runs eagerly under torch.compile"),
        (lambda u: ops.Anderson().step(u, 0.5 * u), (theta[0],), "pflcore.ops.Anderson.step runs eagerly"),
        (lambda t: ops.local_steps(SOFTMAX, t, data, steps=1, lr=0.1), (np.zeros((M, SOFTMAX.d), np.float32),),
         "theta: under torch.compile the ops take torch tensors, got ndarray"),
        (lambda t: ops.local_steps(SOFTMAX, t, data, steps=1, lr=0.1), (theta.clone().requires_grad_(),),
         "theta: requires grad, and this op updates it in place outside autograd"),
    ]
    for fn, args, message in cases:
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            torch.compile(fn, fullgraph=True)(*args)
        assert message in str(info.value)


def test_no_autograd_formula():
    data, _, theta, _, _, _ = _inputs(torch.float32)
    t = theta.clone().requires_grad_()
    # the public ops, eager as compiled, read theta.detach(): their outputs never require grad
    assert not ops.gradients(SOFTMAX, t, data).requires_grad
    assert not ops.evaluate(SOFTMAX, t, data)[0].requires_grad
    # the custom op called directly: torch's own error on the way back
    out = torch.ops.pflcore.evaluate(t, data.x, data.y, data.offsets, 0, *model_args(SOFTMAX), None, None)[0]
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        out.sum().backward()


def test_vmap_does_not_apply_to_the_eager_ops():
    data, _, theta, _, _, _ = _inputs(torch.float32)
    stacked = theta.unsqueeze(0).expand(2, M, SOFTMAX.d).contiguous()
    with pytest.raises(RuntimeError, match="data pointer"):  # the kernels read raw memory
        torch.func.vmap(lambda t: ops.gradients(SOFTMAX, t, data))(stacked)
