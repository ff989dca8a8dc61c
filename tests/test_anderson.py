"""Anderson mixing (DESIGN.md §4): weights, convergence on affine maps, backends, safeguard."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DTYPES
from pflcore import backend, ops

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")


@settings(max_examples=50, deadline=None)
@given(k=st.integers(1, 7), D=st.integers(1, 300), seed=st.integers(0, 10**6),
       reg=st.sampled_from([0.0, 1e-10, 1e-8, 1e-3]))
def test_weights_sum_to_one_and_match_reference(k, D, seed, reg):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(k, D, generator=g, dtype=torch.float64)
    pi = ops.anderson_weights(R, reg)
    assert pi.dtype == torch.float64 and pi.shape == (k,)
    assert abs(float(pi.sum()) - 1.0) < 1e-12
    with backend.use("reference"):
        ref = ops.anderson_weights(R, reg)
    # When k > D the Gram matrix is singular and π is pinned down only by reg, so compare the
    # objective both backends minimize rather than π itself.
    lam = reg * float((R ** 2).sum())
    objective = lambda p: float((p @ R).norm() ** 2 + lam * (p ** 2).sum())  # noqa: E731
    assert objective(pi) == pytest.approx(objective(ref), rel=1e-8, abs=1e-12)
    if k <= D and reg >= 1e-8:
        torch.testing.assert_close(pi, ref, rtol=1e-7, atol=1e-7)


def test_weights_minimize_the_combined_residual():
    """With reg = 0 the weights are the constrained least-squares minimizer: no feasible
    perturbation (Σδ = 0) lowers ‖Σ π_j r_j‖."""
    g = torch.Generator().manual_seed(0)
    R = torch.randn(4, 50, generator=g, dtype=torch.float64)
    pi = ops.anderson_weights(R, 0.0)
    best = float((pi @ R).norm())
    for _ in range(200):
        delta = torch.randn(4, generator=g, dtype=torch.float64) * 0.05
        delta -= delta.mean()
        assert float(((pi + delta) @ R).norm()) >= best - 1e-12


def _affine_contraction(n: int, seed: int, rho: float = 0.95, symmetric: bool = False):
    """T(u) = A u + b with ‖A‖₂ = rho. Symmetric A has real eigenvalues spread over [0, rho],
    where acceleration pays; a general A has them in a disk, where no Krylov method beats
    plain iteration by much."""
    g = torch.Generator().manual_seed(seed)
    if symmetric:
        Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        eig = torch.linspace(0.0, rho, n, dtype=torch.float64)
        A = Q @ torch.diag(eig) @ Q.T
    else:
        A = torch.randn(n, n, generator=g, dtype=torch.float64)
        A = rho * A / torch.linalg.matrix_norm(A, 2)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    x_star = torch.linalg.solve(torch.eye(n, dtype=torch.float64) - A, b)
    return A, b, x_star


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 10**6), be=st.sampled_from(["native", "reference"]))
def test_affine_contraction_reaches_fixed_point_in_n_plus_2_steps(n, seed, be):
    A, b, x_star = _affine_contraction(n, seed)
    with backend.use(be):
        acc = ops.Anderson(memory=n, reg=0.0)
        u = torch.zeros(n, dtype=torch.float64)
        errors = []
        for _ in range(n + 2):
            u = acc.step(u, A @ u + b)
            errors.append(float((u - x_star).norm()))
    assert min(errors) <= 1e-10 * max(1.0, float(x_star.norm())), errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_equals_reference_along_a_run(dtype):
    """Anderson on a nonlinear map with a full ring buffer (more steps than memory + 1), in
    both backends; any shape of state."""
    g = torch.Generator().manual_seed(1)
    M = 0.1 * torch.randn(6, 35, generator=g, dtype=dtype)  # ‖MᵀM‖/2 < 1: a contraction
    T = lambda u: torch.tanh(u @ M.T @ M * 0.5) + 0.1  # noqa: E731
    runs = {}
    for be in ("native", "reference"):
        with backend.use(be):
            acc = ops.Anderson(memory=3, reg=1e-8)
            u = torch.zeros(5, 35, dtype=dtype)
            for _ in range(12):
                u = acc.step(u, T(u))
            runs[be] = u
    assert runs["native"].shape == (5, 35)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(runs["native"], runs["reference"], rtol=tol, atol=tol)
    assert float((T(runs["native"]) - runs["native"]).norm()) < 1e-3


def test_anderson_is_much_faster_than_plain_iteration():
    A, b, x_star = _affine_contraction(30, 4, rho=0.99, symmetric=True)
    acc = ops.Anderson(memory=5, reg=1e-12)
    u = torch.zeros(30, dtype=torch.float64)
    for it in range(1, 500):
        u = acc.step(u, A @ u + b)
        if float((u - x_star).norm()) < 1e-8:
            break
    plain = torch.zeros(30, dtype=torch.float64)
    for plain_it in range(1, 5000):
        plain = A @ plain + b
        if float((plain - x_star).norm()) < 1e-8:
            break
    assert it * 3 <= plain_it, (it, plain_it)


def test_safeguard_resets_after_a_bad_step():
    A, b, x_star = _affine_contraction(8, 2, rho=0.5, symmetric=True)
    acc = ops.Anderson(memory=3, reg=1e-10)
    u = torch.zeros(8, dtype=torch.float64)
    for _ in range(3):
        u = acc.step(u, A @ u + b)
    bad = u + 1e6  # a corrupted iterate: its residual is far larger than the last one
    out = acc.step(bad, A @ bad + b)
    assert acc.resets == 1
    assert torch.equal(out, A @ bad + b), "after a reset the plain step T(u) is taken"
    u = out
    for _ in range(40):
        u = acc.step(u, A @ u + b)
    assert float((u - x_star).norm()) < 1e-8
    off = ops.Anderson(memory=3, safeguard=False)
    v = torch.zeros(8, dtype=torch.float64)
    v = off.step(v, A @ v + b)
    off.step(v + 1e6, A @ (v + 1e6) + b)
    assert off.resets == 0


def test_state_dict_round_trip_continues_identically():
    A, b, _ = _affine_contraction(10, 9, rho=0.9)
    acc = ops.Anderson(memory=4)
    u = torch.zeros(10, dtype=torch.float64)
    for _ in range(6):
        u = acc.step(u, A @ u + b)
    clone = ops.Anderson(memory=1)
    clone.load_state_dict(acc.state_dict())
    v = u.clone()
    for _ in range(5):
        u = acc.step(u, A @ u + b)
        v = clone.step(v, A @ v + b)
    assert torch.equal(u, v)


def test_numpy_state_and_shape_change_error():
    acc = ops.Anderson(memory=2)
    u = np.zeros((3, 4))
    out = acc.step(u, u + 1)
    assert isinstance(out, np.ndarray) and out.shape == (3, 4)
    with pytest.raises(ValueError, match="u: shape"):
        acc.step(np.zeros(5), np.ones(5))
    acc.reset()
    assert acc.step(np.zeros(5), np.ones(5)).shape == (5,)
