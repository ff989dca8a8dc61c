"""JAX arrays through the ops (DESIGN.md §8): taken through DLPack without a copy, results
returned as JAX arrays, equal to the numpy path. JAX arrays are immutable: ``local_steps``
returns a new array and leaves its argument as it was. (JAX on the CPU is in the dev extra.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_data, make_model
from pflcore import ClientData, ops

jax = pytest.importorskip("jax", reason="the dev extra installs jax (CPU)")
jnp = jax.numpy


def _is_jax(a) -> bool:
    return isinstance(a, jax.Array)


def _setup(seed=0):
    model = make_model("softmax", 5, 3)
    data = make_data(model, [4, 1, 6, 3], torch.float32, seed=seed)
    theta = (0.1 * torch.randn(4, model.d, generator=torch.Generator().manual_seed(seed))).numpy()
    return model, data, theta


def test_client_data_from_jax_arrays_shares_their_memory():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32))
    y = jnp.asarray(np.arange(10) % 2)            # int32: JAX's default integer
    off = jnp.asarray(np.array([0, 4, 10]))
    d = ClientData(x, y, off)
    assert d.y.dtype == torch.int64 and d.offsets.dtype == torch.int64  # converted (documented copies)
    assert d.x.data_ptr() == x.unsafe_buffer_pointer()  # the features are not copied
    np.testing.assert_array_equal(d.x.numpy(), np.asarray(x))


def test_local_steps_returns_a_new_jax_array_and_leaves_the_argument():
    model, data, theta = _setup()
    j = jnp.asarray(theta)
    before = np.asarray(j).copy()
    out = ops.local_steps(model, j, data, steps=3, lr=0.2, prox=0.1, anchor=jnp.asarray(theta[0]))
    assert _is_jax(out) and out.shape == j.shape
    np.testing.assert_array_equal(np.asarray(j), before)  # immutable: untouched
    want = ops.local_steps(model, theta.copy(), data, steps=3, lr=0.2, prox=0.1, anchor=theta[0].copy())
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("op", ["gradients", "evaluate", "hvp", "minibatch"])
def test_model_ops_with_jax_equal_numpy(op):
    model, data, theta = _setup(1)
    j = jnp.asarray(theta)
    if op == "gradients":
        got, want = [ops.gradients(model, j, data)], [ops.gradients(model, theta, data)]
    elif op == "evaluate":
        got, want = ops.evaluate(model, j, data), ops.evaluate(model, theta, data)
    elif op == "hvp":
        b = ops.sample_batches(data, steps=1, batch_size=3, seed=0, counter=0)[:, 0].contiguous()
        got, want = [ops.hvp(model, j, j, data, batches=b)], [ops.hvp(model, theta, theta, data, batches=b)]
    else:  # minibatch steps on given rows, JAX indices
        b = ops.sample_batches(data, steps=2, batch_size=4, seed=3, counter=1, clients=[2, 0])
        got = [ops.local_steps(model, j[:2], data, steps=2, lr=0.1, batches=b, rows=jnp.asarray([2, 0]))]
        want = [ops.local_steps(model, theta[:2].copy(), data, steps=2, lr=0.1, batches=b, rows=np.array([2, 0]))]
    for g, w in zip(got, want):
        assert _is_jax(g)
        np.testing.assert_array_equal(np.asarray(g), w)


def test_server_ops_with_jax_equal_numpy():
    rng = np.random.default_rng(2)
    pts = rng.standard_normal((30, 4)).astype(np.float32)
    jp = jnp.asarray(pts)
    lab, sq = ops.kmeans_assign(jp, jp[:3])
    wl, ws = ops.kmeans_assign(pts, pts[:3])
    assert _is_jax(lab) and _is_jax(sq)
    np.testing.assert_array_equal(np.asarray(lab), wl)
    np.testing.assert_array_equal(np.asarray(sq), ws)
    km, kn = ops.kmeans(jp, 3, seed=4), ops.kmeans(pts, 3, seed=4)
    assert _is_jax(km.centroids) and km.inertia == kn.inertia
    np.testing.assert_array_equal(np.asarray(km.centroids), kn.centroids)
    w = rng.random(30).astype(np.float32)
    avg = ops.average(jp, jnp.asarray(w), rows=jnp.asarray([1, 5, 7]))
    assert _is_jax(avg)
    np.testing.assert_array_equal(np.asarray(avg), ops.average(pts, w, rows=np.array([1, 5, 7])))
    pi = ops.anderson_weights(jp[:4])
    assert _is_jax(pi)  # float64 weights: JAX without x64 keeps them as float32 (its own rule)
    np.testing.assert_allclose(np.asarray(pi), ops.anderson_weights(pts[:4]), rtol=1e-6)
    acc_j, acc_n = ops.Anderson(memory=2), ops.Anderson(memory=2)
    for t in range(4):
        u = acc_j.step(jp[t], jp[t + 1])
        v = acc_n.step(pts[t], pts[t + 1])
        assert _is_jax(u)
        np.testing.assert_array_equal(np.asarray(u), v)


def test_jax_float64_under_enable_x64():
    model = make_model("logistic", 3, 1)
    data = make_data(model, [5, 2], torch.float64, seed=3)
    theta = np.zeros((2, model.d))
    with jax.enable_x64(True):  # a State used as a context manager
        out = ops.local_steps(model, jnp.asarray(theta), data, steps=4, lr=0.3)
        assert out.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(out), ops.local_steps(model, theta, data, steps=4, lr=0.3))


def test_bad_values_in_jax_arrays_are_named():
    model, data, theta = _setup()
    bad = theta.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"^theta: row 1 holds a NaN or infinite value$"):
        ops.gradients(model, jnp.asarray(bad), data)
    with pytest.raises(ValueError, match=r"^rows: expected client indices in \[0, 4\), got rows\[0\] = 7$"):
        ops.evaluate(model, jnp.asarray(theta[:1]), data, rows=jnp.asarray([7]))
