"""pflcore.jax: the native CPU kernels inside ``jax.jit`` through XLA's FFI (DESIGN.md §8).

The jitted ops must give the numbers of the numpy path bitwise (the same kernels), hand the
kernels the very buffers of the JAX arrays (checked with the shim's pointer-recording hook
against ``unsafe_buffer_pointer()``), raise the kernels' value errors naming the argument, and
fall back to ``jax.pure_callback`` with a warning when the shim is not there. The first test
to load the shim compiles it (~7 s) unless the per-user cache has it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import make_data, make_model
from pflcore import ClientData, ops

jax = pytest.importorskip("jax", reason="the dev extra installs jax (CPU)")
jnp = jax.numpy
pjax = pytest.importorskip("pflcore.jax")
from pflcore.jax import _ops, _shim  # noqa: E402

FAMILIES = ["least_squares", "logistic", "softmax"]
SIZES = [5, 1, 8, 3]  # a one-row client among them


@pytest.fixture(scope="module")
def ffi():
    state = pjax.status()
    if not state["ffi"]:
        pytest.fail(f"the FFI shim did not load: {state['reason']}")
    return state


def _problem(family, dtype=torch.float32, seed=0, l2=0.05):
    model = make_model(family, 6, 3, l2=l2)
    data = make_data(model, SIZES, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    theta = (0.3 * torch.randn(len(SIZES), model.d, generator=g, dtype=dtype)).numpy()
    return model, data, theta


def _np(a):
    return np.asarray(a)


# ---- same numbers as the numpy path ---------------------------------------------------------

@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_jitted_ops_equal_the_numpy_path_bitwise(ffi, family, x64):
    dtype = torch.float64 if x64 else torch.float32
    with jax.enable_x64(x64):
        model, data, theta = _problem(family, dtype)
        R = theta.shape[0]
        batches = _np(ops.sample_batches(data, steps=3, batch_size=4, seed=7, counter=0))
        anchor = theta[::-1].copy()
        scale = np.linspace(0.5, 1.5, R).astype(theta.dtype)

        @jax.jit
        def step(theta, data, batches, anchor, scale):
            t = pjax.local_steps(model, theta, data, steps=3, lr=0.2, prox=0.1, anchor=anchor, batches=batches,
                                 grad_scale=scale)
            return t, pjax.gradients(model, t, data), pjax.evaluate(model, t, data)

        t, g, (loss, correct, count) = step(jnp.asarray(theta), data, jnp.asarray(batches), jnp.asarray(anchor),
                                            jnp.asarray(scale))
        want = ops.local_steps(model, theta.copy(), data, steps=3, lr=0.2, prox=0.1, anchor=anchor, batches=batches,
                               grad_scale=scale)
        assert t.dtype == theta.dtype
        np.testing.assert_array_equal(_np(t), want)
        np.testing.assert_array_equal(_np(g), ops.gradients(model, want, data))
        for got, ref in zip((loss, correct, count), ops.evaluate(model, want, data)):
            np.testing.assert_array_equal(_np(got), ref)
        assert correct.dtype == (jnp.int64 if x64 else jnp.int32)


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_jitted_kmeans_assign_equals_the_numpy_path(ffi, x64):
    with jax.enable_x64(x64):
        rng = np.random.default_rng(3)
        points = rng.standard_normal((300, 17)).astype(np.float64 if x64 else np.float32)
        centroids = points[[4, 90, 200]].copy()
        labels, sqdist = jax.jit(pjax.kmeans_assign)(jnp.asarray(points), jnp.asarray(centroids))
        want_l, want_d = ops.kmeans_assign(points, centroids)
        np.testing.assert_array_equal(_np(labels), want_l)
        np.testing.assert_array_equal(_np(sqdist), want_d)
        assert labels.dtype == (jnp.int64 if x64 else jnp.int32)


def test_rows_shared_theta_and_minibatch_gradients(ffi):
    model, data, theta = _problem("softmax")
    rows = np.array([2, 0, 2, 3, 1], dtype=np.int64)
    batches = _np(ops.sample_batches(data, clients=rows, steps=2, batch_size=3, seed=1, counter=0))
    big = np.repeat(theta[:1], len(rows), axis=0)

    @jax.jit
    def f(big, shared, data, rows, batches):
        t = pjax.local_steps(model, big, data, steps=2, lr=0.1, rows=rows, batches=batches)
        return (t, pjax.gradients(model, shared, data, rows=rows, batches=batches[:, 0]),
                pjax.evaluate(model, shared, data, rows=rows, batches=batches[:, 1]))

    # rows as JAX's default int32: widened in the graph
    t, g, ev = f(jnp.asarray(big), jnp.asarray(theta[0]), data, jnp.asarray(rows.astype(np.int32)),
                 jnp.asarray(batches))
    np.testing.assert_array_equal(_np(t), ops.local_steps(model, big.copy(), data, steps=2, lr=0.1, rows=rows,
                                                          batches=batches))
    np.testing.assert_array_equal(_np(g), ops.gradients(model, theta[0], data, rows=rows, batches=batches[:, 0]))
    for got, ref in zip(ev, ops.evaluate(model, theta[0], data, rows=rows, batches=batches[:, 1])):
        np.testing.assert_array_equal(_np(got), ref)


def test_traced_learning_rate_and_an_anchor_that_is_theta(ffi):
    """lr is an operand (a schedule inside a loop needs no retrace); anchor = theta itself:
    XLA must not let the in-place result overwrite the anchor it reads."""
    model, data, theta = _problem("logistic")

    @jax.jit
    def loop(theta, data):
        def body(k, t):
            return pjax.local_steps(model, t, data, steps=1, lr=0.3 / (1.0 + k), prox=0.5, anchor=t)
        return jax.lax.fori_loop(0, 3, body, theta)

    want = theta.copy()
    for k in range(3):
        want = ops.local_steps(model, want, data, steps=1, lr=np.float32(0.3) / np.float32(1.0 + k), prox=0.5,
                               anchor=want)
    np.testing.assert_array_equal(_np(loop(jnp.asarray(theta), data)), want)


def test_vmap_runs_one_call_per_element(ffi):
    model, data, theta = _problem("least_squares")
    stack = np.stack([theta, 2 * theta])
    out = jax.jit(jax.vmap(lambda t: pjax.local_steps(model, t, data, steps=2, lr=0.1)))(jnp.asarray(stack))
    for k in range(2):
        np.testing.assert_array_equal(_np(out[k]), ops.local_steps(model, stack[k].copy(), data, steps=2, lr=0.1))


# ---- no copy: the kernels get the JAX buffers --------------------------------------------------

def test_the_kernels_receive_the_jax_buffers_without_a_copy(ffi):
    """The shim's hook records the data addresses of the buffers XLA hands each call; they must
    be the JAX arrays' own (``unsafe_buffer_pointer``) and the ClientData's, and with theta
    donated the result must live in theta's buffer."""
    model = make_model("softmax", 6, 3)
    rng = np.random.default_rng(0)
    off = jnp.asarray([0, 5, 6, 14, 17])
    x = jnp.asarray(rng.standard_normal((17, 6)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, 17))
    data = ClientData(x, y, off)  # JAX arrays in: the ClientData views their memory
    assert data.x.data_ptr() == x.unsafe_buffer_pointer()
    theta = jnp.zeros((4, model.d), jnp.float32)
    anchor = jnp.ones((4, model.d), jnp.float32)
    theta_ptr = theta.unsafe_buffer_pointer()
    step = jax.jit(lambda t, d, a: pjax.local_steps(model, t, d, steps=2, lr=0.1, prox=0.1, anchor=a),
                   donate_argnums=0)
    with _shim.record_pointers() as rec:
        out = step(theta, data, anchor).block_until_ready()
    got_theta, got_x, got_y, got_off, got_rows, got_batches, got_anchor, got_scale, got_out = rec.pointers
    assert got_theta == theta_ptr and got_out == theta_ptr == out.unsafe_buffer_pointer()
    assert got_x == x.unsafe_buffer_pointer() == data.x.data_ptr()
    assert got_y == data.y.data_ptr() and got_off == data.offsets.data_ptr()  # the ClientData's int64 tensors
    assert got_anchor == anchor.unsafe_buffer_pointer()
    assert got_rows == got_batches == got_scale == 0

    points = jnp.asarray(rng.standard_normal((50, 8)).astype(np.float32))
    centroids = points[:3] + 0.5
    with _shim.record_pointers() as rec:
        labels, sqdist = jax.jit(pjax.kmeans_assign)(points, centroids)
        sqdist.block_until_ready()
    assert rec.pointers[:2] == [points.unsafe_buffer_pointer(), centroids.unsafe_buffer_pointer()]
    assert rec.pointers[3] == sqdist.unsafe_buffer_pointer()


def test_unaligned_numpy_data_is_copied_with_a_warning_and_stays_right(ffi, monkeypatch):
    model, data, theta = _problem("softmax")
    x = np.empty(data.x.numel() + 1, np.float32)[1:].reshape(data.x.shape)  # 4 bytes past an aligned start
    x[...] = data.x.numpy()
    unaligned = ClientData(x, data.y.numpy(), data.offsets.numpy())
    monkeypatch.setattr(pjax._data, "_warned_unaligned", False)
    with pytest.warns(RuntimeWarning, match="not aligned to 64 bytes"):
        out = jax.jit(lambda t, d: pjax.local_steps(model, t, d, steps=2, lr=0.1))(jnp.asarray(theta), unaligned)
    np.testing.assert_array_equal(_np(out), ops.local_steps(model, theta.copy(), data, steps=2, lr=0.1))
    x[0, 0] = 5.0  # the caller changes its array: the next call sees it (nothing stale is cached)
    data.x[0, 0] = 5.0
    out = jax.jit(lambda t, d: pjax.local_steps(model, t, d, steps=2, lr=0.1))(jnp.asarray(theta), unaligned)
    np.testing.assert_array_equal(_np(out), ops.local_steps(model, theta.copy(), data, steps=2, lr=0.1))


# ---- errors name the argument ------------------------------------------------------------------

def _run_raises(match, fn, *args):
    # JAX raises an XLA error as JaxRuntimeError from the call, or as ValueError (its class for
    # INVALID_ARGUMENT) when it surfaces later, at block_until_ready
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=match):
        jax.block_until_ready(fn(*args))


def test_bad_values_raise_the_kernels_message(ffi):
    model, data, theta = _problem("softmax")
    f = jax.jit(lambda t, d, r: pjax.local_steps(model, t, d, steps=1, lr=0.1, rows=r))
    _run_raises(r"rows: expected client indices in \[0, 4\), got rows\[1\] = 9", f, jnp.asarray(theta[:2]), data,
                jnp.asarray([0, 9]))
    bad = theta.copy()
    bad[2, 1] = np.nan
    _run_raises(r"NonFiniteError: theta: row 2", jax.jit(lambda t, d: pjax.evaluate(model, t, d)), jnp.asarray(bad),
                data)
    batches = _np(ops.sample_batches(data, steps=1, batch_size=2, seed=0, counter=0)).copy()
    batches[3, 0, 1] = 0  # a row of client 0 in client 3's batch
    _run_raises(r"batches: index 0 at \[3, 0, 1\] is outside the rows",
                jax.jit(lambda t, d, b: pjax.local_steps(model, t, d, steps=1, lr=0.1, batches=b)),
                jnp.asarray(theta), data, jnp.asarray(batches))
    _run_raises(r"lr: expected a finite number > 0", jax.jit(lambda t, d, lr: pjax.local_steps(model, t, d, steps=1,
                                                                                                lr=lr)),
                jnp.asarray(theta), data, jnp.float32(-1.0))
    cen = np.ones((2, 4), np.float32)
    cen[1, 2] = np.inf
    _run_raises(r"centroids: row 1 holds a NaN", jax.jit(pjax.kmeans_assign), jnp.ones((5, 4)), jnp.asarray(cen))


def test_bad_metadata_is_refused_when_traced(ffi):
    model, data, theta = _problem("softmax")
    with pytest.raises(ValueError, match=r"theta: expected shape \[m, d\] = \[4, 21\], got \[3, 21\]"):
        jax.jit(lambda t, d: pjax.local_steps(model, t, d, steps=1, lr=0.1))(jnp.asarray(theta[:3]), data)
    with pytest.raises(ValueError, match="theta: expected dtype float32"):
        pjax.gradients(model, jnp.asarray(theta, jnp.int32), data)
    with pytest.raises(ValueError, match="lr: expected a number > 0.0"):
        pjax.local_steps(model, jnp.asarray(theta), data, steps=1, lr=0.0)
    with pytest.raises(ValueError, match=r"batches: expected shape \[R, steps, B\]"):
        pjax.local_steps(model, jnp.asarray(theta), data, steps=2, lr=0.1, batches=jnp.zeros((4, 1, 3), jnp.int32))
    with pytest.raises(ValueError, match="data: expected a pflcore.ClientData"):
        pjax.evaluate(model, jnp.asarray(theta), (data.x, data.y, data.offsets))
    with pytest.raises(ValueError, match=r"centroids: expected shape \[K, d\] with d = 4"):
        pjax.kmeans_assign(jnp.ones((5, 4)), jnp.ones((2, 3)))


def test_the_shim_refuses_inconsistent_buffers_from_a_direct_ffi_call(ffi):
    """The targets are registered process-wide: a caller that reaches them through
    jax.ffi.ffi_call with shapes that do not fit gets an error, not an out-of-bounds read."""
    model, data, theta = _problem("softmax")
    x, y, off = jax.tree.leaves(data)
    attrs = dict(family=np.int64(2), C=np.int64(3), intercept=True, l2=np.float64(0.0), check_batches=True)
    short = jnp.zeros((4, 5), jnp.float32)  # d = 21 expected
    call = jax.ffi.ffi_call("pflcore_local_steps", jax.ShapeDtypeStruct(short.shape, short.dtype),
                            input_output_aliases={0: 0})
    _run_raises(r"theta: expected \[R, d\]", lambda: call(short, x, y, off, jnp.float32(0.1), jnp.float32(0.0),
                                                          steps=np.int64(1), has=np.int64(0), **attrs))
    _run_raises("the operands do not match", lambda: call(short, x, y, off, jnp.float32(0.1), jnp.float32(0.0),
                                                          steps=np.int64(1), has=np.int64(1), **attrs))
    grads = jax.ffi.ffi_call("pflcore_gradients", jax.ShapeDtypeStruct((4, 21), jnp.float32))
    _run_raises("y: expected int64", lambda: grads(jnp.asarray(theta), x, y[:5], off, has=np.int64(0), **attrs))


# ---- the callback path, and the cache -------------------------------------------------------

def test_pure_callback_fallback_warns_and_gives_the_same_numbers(ffi, monkeypatch):
    model, data, theta = _problem("logistic")
    monkeypatch.setattr(_shim, "_state", {"ffi": False, "reason": "a test without the shim"})
    monkeypatch.setattr(_ops, "_warned", False)
    with pytest.warns(RuntimeWarning, match="a test without the shim.*pure_callback"):
        t, ev = jax.jit(lambda t, d: (lambda u: (u, pjax.evaluate(model, u, d)))(
            pjax.local_steps(model, t, d, steps=2, lr=0.1, rows=jnp.arange(4))))(jnp.asarray(theta), data)
    want = ops.local_steps(model, theta.copy(), data, steps=2, lr=0.1)
    np.testing.assert_array_equal(_np(t), want)
    for got, ref in zip(ev, ops.evaluate(model, want, data)):
        np.testing.assert_array_equal(_np(got), ref)
    labels, _ = jax.jit(pjax.kmeans_assign)(jnp.asarray(theta), jnp.asarray(theta[:2]))
    np.testing.assert_array_equal(_np(labels), [0, 1, *ops.kmeans_assign(theta, theta[:2])[0][2:]])
    with pytest.raises(Exception, match=r"rows: expected client indices in \[0, 4\)"):
        jax.block_until_ready(jax.jit(lambda t, d: pjax.gradients(model, t, d, rows=jnp.asarray([7])))(
            jnp.asarray(theta[:1]), data))


def test_without_a_compiler_the_shim_says_why(ffi, monkeypatch):
    monkeypatch.setenv("PFLCORE_CXX", "/nonexistent/c++")
    assert _shim._load() == {"ffi": False, "reason": "the C++ compiler '/nonexistent/c++' (PFLCORE_CXX or CXX) "
                                                     "is not on PATH"}
    monkeypatch.setenv("PFLCORE_JAX_FFI", "0")
    assert _shim._load()["reason"] == "PFLCORE_JAX_FFI=0"


def test_the_compiled_shim_is_cached_across_processes(ffi):
    code = ("import pflcore.jax as p, json; s = p.status(); "
            "print(json.dumps([s['ffi'], s['library'], s['compile_seconds']]))")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, library, seconds = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert loaded and library == ffi["library"] and seconds == 0.0


def test_no_warning_on_the_ffi_path(ffi):
    model, data, theta = _problem("least_squares")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.block_until_ready(jax.jit(lambda t, d: pjax.gradients(model, t, d))(jnp.asarray(theta), data))
