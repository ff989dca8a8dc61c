"""Synthetic federations with known true models (DESIGN.md §6).

Every generator draws from ``numpy.random.default_rng(seed)`` only, so the same arguments give
the same ``Federation`` bit for bit. Labels are computed from the features and models *after*
rounding them to ``dtype``, so the stored ``truth`` is exactly consistent with the stored data.
Each client's rows are i.i.d.; its first ``round(n_k·(1 − test_fraction))`` rows (at least one,
and at least one fewer than n_k) are its training rows, the rest its test rows.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from pflcore.client_data import ClientData
from pflcore.data.federation import Federation
from pflcore._checks import check_positive_int, check_real

_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


# ----------------------------------------------------------------------------- helpers

def _check_dtype(dtype) -> type:
    if dtype not in _NP_DTYPE:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
    return _NP_DTYPE[dtype]


def _check_fraction(test_fraction) -> float:
    f = check_real(test_fraction, "test_fraction")
    if not 0.0 < f < 1.0:
        raise ValueError(f"test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    return f


def _rounded(a: np.ndarray, npd) -> np.ndarray:
    """``a`` rounded to the output precision, kept in float64 to compute labels from."""
    return a.astype(npd).astype(np.float64)


def _diag_cov(dim: int) -> np.ndarray:
    """Σ = diag(j^{-1.2}), j = 1..dim (Li et al.)."""
    return np.arange(1, dim + 1, dtype=np.float64) ** -1.2


def _federation(x: np.ndarray, y: np.ndarray, sizes: np.ndarray, test_fraction: float, *, dtype,
                num_classes: int, truth: np.ndarray, truth_global: Optional[np.ndarray], name: str,
                meta: dict) -> Federation:
    """Split each client's consecutive rows of (x, y) into train and test, wrap as a Federation."""
    sizes = np.asarray(sizes, dtype=np.int64)
    n_train = np.clip(np.round(sizes * (1.0 - test_fraction)).astype(np.int64), 1, sizes - 1)
    # Position of every row inside its client, to mark the first n_train rows of each client.
    pos = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    train = pos < np.repeat(n_train, sizes)

    def client_data(mask, counts):
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        return ClientData(torch.from_numpy(np.ascontiguousarray(x[mask])).to(dtype),
                          torch.from_numpy(np.ascontiguousarray(y[mask])), offsets)

    def tensor(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    meta = dict(meta, dtype=str(dtype).replace("torch.", ""))
    return Federation(client_data(train, n_train), client_data(~train, sizes - n_train), num_classes,
                      truth=tensor(truth), truth_global=tensor(truth_global), name=name, meta=meta)


# ----------------------------------------------------------------------------- generators

def synthetic(alpha: float, beta: float, num_clients: int = 100, dim: int = 60, num_classes: int = 10,
              seed: int = 0, size_scale: int = 5, iid: bool = False, test_fraction: float = 0.25,
              max_size: Optional[int] = None, dtype: torch.dtype = torch.float32) -> Federation:
    """Synthetic(α, β) of Li et al. (FedProx), with pFedMe's sizes (``size_scale=5``).

    For client k (α, β are standard deviations)::

        n_k = (int(lognormal(4, 2)) + 50) · size_scale      (drawn first, for all clients)
        u_k ~ N(0, α²),  B_k ~ N(0, β²),  v_k ~ N(B_k, 1)^dim
        W_k ~ N(u_k, 1)^{dim×C},  b_k ~ N(u_k, 1)^C
        x ~ N(v_k, Σ),  Σ = diag(j^{-1.2}),  y = argmax(x W_k + b_k)

    α controls how much the client models differ, β how much the feature distributions do.
    ``iid=True``: one W, b ~ N(0, 1) and v = 0 for every client (the original's iid variant,
    generated there with β = 0 so that its v_k = B_k·1 is 0; here v = 0 whatever β).

    The lognormal(4, 2) sizes are heavy-tailed (pFedMe reports 250 to 25,810 rows at scale 5,
    and single clients of 10^5+ rows occur): ``max_size`` caps n_k after drawing it (None = no
    cap, the faithful default); the cap changes no other draw.

    ``truth [m, (dim+1)·C]``: [W_k; b_k] flattened row-major, the layout of
    ``Softmax(dim, C, fit_intercept=True)`` (intercept row last). ``truth_global``: the shared
    model with ``iid=True``, else None (the clients share no model).
    """
    alpha = check_real(alpha, "alpha", minimum=0.0)
    beta = check_real(beta, "beta", minimum=0.0)
    m = check_positive_int(num_clients, "num_clients")
    dim = check_positive_int(dim, "dim")
    C = check_positive_int(num_classes, "num_classes", minimum=2)
    seed = check_positive_int(seed, "seed", minimum=0)
    size_scale = check_positive_int(size_scale, "size_scale")
    if max_size is not None:
        max_size = check_positive_int(max_size, "max_size", minimum=2)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)

    rng = np.random.default_rng(seed)
    sizes = (rng.lognormal(4, 2, m).astype(np.int64) + 50) * size_scale
    if max_size is not None:
        sizes = np.minimum(sizes, max_size)
    u = rng.normal(0.0, alpha, m)
    B = rng.normal(0.0, beta, m)
    v = rng.normal(B[:, None], 1.0, (m, dim))
    if iid:
        W = np.broadcast_to(rng.normal(0.0, 1.0, (dim, C)), (m, dim, C))
        b = np.broadcast_to(rng.normal(0.0, 1.0, C), (m, C))
        v = np.zeros((m, dim))
    else:
        W = rng.normal(u[:, None, None], 1.0, (m, dim, C))
        b = rng.normal(u[:, None], 1.0, (m, C))
    x = _rounded(np.repeat(v, sizes, axis=0) + rng.standard_normal((sizes.sum(), dim)) * np.sqrt(_diag_cov(dim)), npd)
    truth = _rounded(np.concatenate([W, b[:, None, :]], axis=1).reshape(m, (dim + 1) * C), npd)

    y = np.empty(sizes.sum(), dtype=np.int64)
    for k, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        Wb = truth[k].reshape(dim + 1, C)
        y[lo:hi] = np.argmax(x[lo:hi] @ Wb[:dim] + Wb[dim], axis=1)

    meta = dict(generator="synthetic", alpha=alpha, beta=beta, num_clients=m, dim=dim, num_classes=C, seed=seed,
                size_scale=size_scale, iid=bool(iid), test_fraction=test_fraction, max_size=max_size,
                model=f"Softmax(p={dim}, C={C}, fit_intercept=True)")
    name = f"synthetic(alpha={alpha:g}, beta={beta:g}{', iid' if iid else ''})"
    return _federation(x, y, sizes, test_fraction, dtype=dtype, num_classes=C, truth=truth,
                       truth_global=truth[0] if iid else None, name=name, meta=meta)


def logistic_truth(num_clients: int = 10, samples_per_client: int = 2000, dim: int = 20, R: float = 1.0,
                   seed: int = 0, labels: str = "sample", test_fraction: float = 0.25,
                   dtype: torch.dtype = torch.float32) -> Federation:
    """The controlled-heterogeneity logistic setting of the FedProx-personalization paper.

    For client k::

        w_k ~ N(0, R·I_dim),  v_k ~ N(0, 1)^dim,  x ~ N(v_k, Σ),  Σ = diag(j^{-1.2})
        labels="sample":  y ~ Bernoulli(σ(xᵀw_k))  (w_k is exactly the true local model)
        labels="argmax":  y = 1[xᵀw_k > 0]         (the paper's literal rule; separable data)

    R is the variance of every coordinate of every client model about the common mean 0
    (the paper uses R in [0, 3]): the heterogeneity Σ_k p_k ‖w_k − w̄‖² is about R·dim·(1 − 1/m)
    (its drawn value is in ``meta["heterogeneity"]``), and R = 0 gives identical clients —
    with the degenerate model w = 0, i.e. coin-flip labels ("sample") or all zeros ("argmax").
    No intercept: ``truth [m, dim]`` has the layout of ``Logistic(dim, fit_intercept=False)``.
    The global minimizer has no closed form, so ``truth_global`` is the mean of the client
    models (the paper's w_g = Σ p_k w_k with the equal p_k here).
    """
    m = check_positive_int(num_clients, "num_clients")
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2)
    dim = check_positive_int(dim, "dim")
    R = check_real(R, "R", minimum=0.0)
    seed = check_positive_int(seed, "seed", minimum=0)
    if labels not in ("sample", "argmax"):
        raise ValueError(f"labels: expected 'sample' or 'argmax', got {labels!r}")
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)

    rng = np.random.default_rng(seed)
    w = _rounded(rng.normal(0.0, math.sqrt(R), (m, dim)), npd)
    v = rng.normal(0.0, 1.0, (m, dim))
    x = _rounded(np.repeat(v, n, axis=0) + rng.standard_normal((m * n, dim)) * np.sqrt(_diag_cov(dim)), npd)
    z = np.einsum("knp,kp->kn", x.reshape(m, n, dim), w).reshape(-1)
    if labels == "sample":
        # σ(z) = exp(−log(1 + e^{−z})), without overflow for large |z|.
        y = (rng.random(m * n) < np.exp(-np.logaddexp(0.0, -z))).astype(np.int64)
    else:
        y = (z > 0).astype(np.int64)
    w_bar = w.mean(axis=0)

    meta = dict(generator="logistic_truth", num_clients=m, samples_per_client=n, dim=dim, R=R, seed=seed,
                labels=labels, test_fraction=test_fraction, model=f"Logistic(p={dim}, fit_intercept=False)",
                truth_global="mean of client models",
                heterogeneity=float(((w - w_bar) ** 2).sum(axis=1).mean()))
    return _federation(x, y, np.full(m, n), test_fraction, dtype=dtype, num_classes=2, truth=w,
                       truth_global=w_bar, name=f"logistic_truth(R={R:g}, labels={labels})", meta=meta)


def least_squares(num_clients: int = 25, samples_per_client: int = 5000, dim: int = 100,
                  noise_var: float = 0.25, shift: float = 0.0, seed: int = 0, test_fraction: float = 0.2,
                  dtype: torch.dtype = torch.float32) -> Federation:
    """Linear regression around a common model::

        w* ~ N(0, I_dim),  w*_i = w* + shift·N(0, I_dim)
        rows a ~ N(0, I_dim),  b = aᵀw*_i + ε,  ε ~ N(0, noise_var)

    ``shift = 0`` makes all clients share w* (only their samples differ). y holds the float
    targets b (dtype of x); ``num_classes = 0``. ``truth [m, dim]`` = w*_i, the layout of
    ``LeastSquares(dim, fit_intercept=False)``; ``truth_global`` = w*.
    """
    m = check_positive_int(num_clients, "num_clients")
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2)
    dim = check_positive_int(dim, "dim")
    noise_var = check_real(noise_var, "noise_var", minimum=0.0)
    shift = check_real(shift, "shift", minimum=0.0)
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)

    rng = np.random.default_rng(seed)
    w_star = _rounded(rng.normal(0.0, 1.0, dim), npd)
    w = _rounded(w_star + shift * rng.normal(0.0, 1.0, (m, dim)), npd)
    A = _rounded(rng.normal(0.0, 1.0, (m * n, dim)), npd)
    b = np.einsum("knp,kp->kn", A.reshape(m, n, dim), w).reshape(-1)
    b = (b + rng.normal(0.0, math.sqrt(noise_var), m * n)).astype(npd)

    meta = dict(generator="least_squares", num_clients=m, samples_per_client=n, dim=dim, noise_var=noise_var,
                shift=shift, seed=seed, test_fraction=test_fraction,
                model=f"LeastSquares(p={dim}, fit_intercept=False)")
    return _federation(A, b, np.full(m, n), test_fraction, dtype=dtype, num_classes=0, truth=w,
                       truth_global=w_star, name=f"least_squares(shift={shift:g}, noise_var={noise_var:g})",
                       meta=meta)


def two_groups(num_clients: int = 50, samples_per_client: int = 100, dim: int = 60, mu: float = 1.0,
               seed: int = 0, test_fraction: float = 0.25, dtype: torch.dtype = torch.float32) -> Federation:
    """PERM's two conflicting groups of clients.

    One unit vector w = g/‖g‖, g ~ N(0, I_dim). Group 0 (clients 0 … m//2 − 1)::

        x ~ N(+μ·w, I),  y = 1[xᵀw ≥ 0]
    group 1 (the other clients)::

        x ~ N(−μ·w, I),  y = 1[xᵀ(−w) ≥ 0]

    The feature shift is along w itself, so in both groups y = 1 with probability Φ(μ) and a
    single linear model without intercept is right on one group exactly where it is wrong on
    the other. ``truth [m, dim]``: +w for group 0, −w for group 1, unit norm (any positive
    multiple classifies the same; the data is separable, so the logistic loss has no finite
    minimizer), the layout of ``Logistic(dim, fit_intercept=False)``; ``truth_global`` = None.
    ``meta["groups"]``: the group (0/1) of every client.
    """
    m = check_positive_int(num_clients, "num_clients")
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2)
    dim = check_positive_int(dim, "dim")
    mu = check_real(mu, "mu")
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)

    rng = np.random.default_rng(seed)
    g = rng.normal(0.0, 1.0, dim)
    w = g / np.linalg.norm(g)
    groups = (np.arange(m) >= m // 2).astype(np.int64)
    sign = 1.0 - 2.0 * groups  # +1 for group 0, −1 for group 1
    truth = _rounded(sign[:, None] * w, npd)
    x = _rounded(np.repeat(sign[:, None] * mu * w, n, axis=0) + rng.standard_normal((m * n, dim)), npd)
    y = (np.einsum("knp,kp->kn", x.reshape(m, n, dim), truth).reshape(-1) >= 0).astype(np.int64)

    meta = dict(generator="two_groups", num_clients=m, samples_per_client=n, dim=dim, mu=mu, seed=seed,
                test_fraction=test_fraction, model=f"Logistic(p={dim}, fit_intercept=False)",
                groups=groups.tolist())
    return _federation(x, y, np.full(m, n), test_fraction, dtype=dtype, num_classes=2, truth=truth,
                       truth_global=None, name=f"two_groups(mu={mu:g})", meta=meta)


def contexts(num_clients: int = 40, num_contexts: int = 4, dim: int = 60, num_classes: int = 10,
             client_noise: float = 0.0, beta: float = 0.5, feature_spread: float = 1.0, sizes=(100, 500),
             seed: int = 0,
             test_fraction: float = 0.25, dtype: torch.dtype = torch.float32) -> Federation:
    """Clients drawn from a few latent contexts (the setting CGPFL is built for).

    A context is a data distribution: its own model and its own feature mean. For context c
    and client k in context c(k) (contexts dealt evenly, then shuffled)::

        W_c ~ N(0, 1)^{dim×C},  b_c ~ N(0, 1)^C,  B_c ~ N(0, β²),  v_c ~ N(B_c, s²)^dim
        W_k = W_c(k) + client_noise·N(0, 1)  (and b_k, v_k alike)
        n_k ~ uniform integers in [sizes[0], sizes[1]]
        x ~ N(v_k, Σ),  Σ = diag(j^{-1.2}),  y = argmax(x W_k + b_k)

    with s = ``feature_spread``. With ``client_noise = 0`` the clients of a context draw from one
    distribution exactly (they differ only by their samples and sizes). ``beta = 0`` and
    ``feature_spread = 0`` give every context the same features (v = 0): the contexts then
    differ only in how they label the same inputs (concept shift), which no single model fits.
    ``truth [m, (dim+1)·C]``: [W_k; b_k] in the layout of ``Softmax(dim, C, fit_intercept=True)``;
    ``truth_global`` = None; ``meta["contexts"]``: the context of every client.
    """
    m = check_positive_int(num_clients, "num_clients")
    K = check_positive_int(num_contexts, "num_contexts")
    if K > m:
        raise ValueError(f"num_contexts: expected at most num_clients = {m} contexts, got {K}")
    dim = check_positive_int(dim, "dim")
    C = check_positive_int(num_classes, "num_classes", minimum=2)
    client_noise = check_real(client_noise, "client_noise", minimum=0.0)
    beta = check_real(beta, "beta", minimum=0.0)
    if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2
            or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sizes)
            or not 2 <= sizes[0] <= sizes[1]):
        raise ValueError(f"sizes: expected (low, high) integers with 2 <= low <= high, got {sizes!r}")
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)

    rng = np.random.default_rng(seed)
    context = rng.permutation(np.arange(m) % K)
    W_c = rng.normal(0.0, 1.0, (K, dim + 1, C))  # [W_c; b_c]
    feature_spread = check_real(feature_spread, "feature_spread", minimum=0.0)
    v_c = rng.normal(0.0, 1.0, (K, dim)) * feature_spread + rng.normal(0.0, beta, K)[:, None]
    Wb = W_c[context] + client_noise * rng.normal(0.0, 1.0, (m, dim + 1, C))
    v = v_c[context] + client_noise * rng.normal(0.0, 1.0, (m, dim))
    truth = _rounded(Wb.reshape(m, (dim + 1) * C), npd)
    n = rng.integers(int(sizes[0]), int(sizes[1]) + 1, m)
    x = _rounded(np.repeat(v, n, axis=0) + rng.standard_normal((n.sum(), dim)) * np.sqrt(_diag_cov(dim)), npd)
    y = np.empty(n.sum(), dtype=np.int64)
    for k, (lo, hi) in enumerate(zip(np.cumsum(n) - n, np.cumsum(n))):
        Wk = truth[k].reshape(dim + 1, C)
        y[lo:hi] = np.argmax(x[lo:hi] @ Wk[:dim] + Wk[dim], axis=1)

    meta = dict(generator="contexts", num_clients=m, num_contexts=K, dim=dim, num_classes=C,
                client_noise=client_noise, beta=beta, feature_spread=feature_spread, sizes=[int(sizes[0]), int(sizes[1])], seed=seed,
                test_fraction=test_fraction, model=f"Softmax(p={dim}, C={C}, fit_intercept=True)",
                contexts=context.tolist())
    return _federation(x, y, n, test_fraction, dtype=dtype, num_classes=C, truth=truth, truth_global=None,
                       name=f"contexts(K={K}, client_noise={client_noise:g})", meta=meta)
