"""Synthetic federations with known true models (DESIGN.md §6).

Every generator draws from ``numpy.random.default_rng(seed)`` only, so the same arguments give
the same ``Federation`` bit for bit. Labels are computed from the features and models *after*
rounding them to ``dtype``, so the stored ``truth`` is exactly consistent with the stored data.
Each client's rows are i.i.d.; its first ``round(n_k·(1 − test_fraction))`` rows (at least one,
and at least one fewer than n_k) are its training rows, the rest its test rows.

Same bits on every machine: what a generator computes from its random draws goes through
elementwise IEEE operations only (+, −, ×, /, sqrt, casts), whose results do not depend on the
CPU, the BLAS or the libm, so that a federation (and ``checkpoint.federation_digest``, which a
``resume`` checks) is the same on any x86/ARM machine with the same numpy. Not used: BLAS
products (matmul, dot, norm: OpenBLAS picks its kernel, and with it the summation order, by CPU),
reductions whose order follows the SIMD width, and libm's or numpy's exp/log/pow (glibc has
FMA and non-FMA variants, numpy AVX-512 ones: their last bits differ). So:

- x·w (labels, regression targets) is accumulated over the features j = 0, 1, … in this order
  by elementwise multiplies and adds (``_linear``);
- Σ = diag(j^{-1.2}) is computed in decimal arithmetic (libmpdec, software) and rounded once;
- the few results that are a transcendental function of a draw — the lognormal sizes
  floor(e^t) and the Bernoulli labels 1[u < σ(z)] — are decided exactly: by the float value
  where it is farther from the decision boundary than any libm's error, in decimal otherwise.
  (These are the same results as the float formulas except for a draw within ~1e-10 of the
  boundary.)
numpy's normal sampler itself calls libm's exp in its ziggurat's rejection test; a last-bit
difference there changes a draw only when a uniform falls within one ulp of the test's bound.

Memory: the outputs (features, labels, truth) are allocated once in the output dtype and
filled a block of clients at a time, so a float64 temporary never holds more than about
``_BLOCK`` values (8 MB) whatever the number of clients; peak memory is the federation's
bytes plus the per-client float64 parameters a generator needs until its last row (e.g.
synthetic's feature means, m·dim values). The random numbers are drawn in the same order and
with the same calls as when everything was drawn at once (numpy's Generator streams do not
depend on how a draw is cut into pieces), and every value is computed elementwise from the same
operands in the same order, so the outputs are the same bits whatever the block size
(tests/test_data_memory.py).
"""
from __future__ import annotations

import decimal
import functools
import math
import os
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from pflcore.client_data import ClientData
from pflcore.data.federation import Federation
from pflcore._checks import MAX_COUNT, check_positive_int, check_real
from pflcore.errors import NonFiniteError

_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}

# Values per float64 temporary (a block of clients' rows or parameters): 1M values = 8 MB.
# Tests lower it to cut small federations into many blocks.
_BLOCK = 1 << 20

_TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64, np.int64: torch.int64}


def _output(shape, npd) -> np.ndarray:
    """An uninitialized output array, allocated by torch (the tensor the federation keeps).
    Not ``np.empty``: numpy asks for transparent huge pages on large arrays, and on the VMs
    measured here (THP defrag=madvise) first touching 2 GB took 5.7 s that way against 1.1 s."""
    return torch.empty(shape, dtype=_TORCH_DTYPE[npd]).numpy()


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


# Decimal arithmetic for the few transcendental values: precision far beyond float64's, and
# exponents wide enough that no exp/ln here overflows.
_DECIMAL = decimal.Context(prec=40, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


@functools.lru_cache(maxsize=8)
def _diag_cov_cached(dim: int) -> np.ndarray:
    with decimal.localcontext(_DECIMAL):
        e = decimal.Decimal(-1.2)  # the float -1.2 exactly, the exponent of the earlier ``** -1.2``
        out = np.array([float((e * decimal.Decimal(j).ln()).exp()) for j in range(1, dim + 1)], dtype=np.float64)
    out.setflags(write=False)
    return out


def _diag_cov(dim: int) -> np.ndarray:
    """Σ = diag(j^{-1.2}), j = 1..dim (Li et al.), each j^{-1.2} computed in 40-digit decimal
    arithmetic and rounded to float64: the same bits on every machine (``j ** -1.2`` goes through
    libm's or numpy's SIMD pow, whose last bit differs between CPUs). About 40 µs per feature,
    once per dim in a process."""
    return _diag_cov_cached(int(dim))


def _linear(x: np.ndarray, W: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """z = x W_k (+ b_k) row by row for the clients of a block, in float64: ``x [Σ sizes, dim]``
    their rows, ``W [k, dim, C]`` or ``[k, dim + 1, C]`` (intercept row last) their models;
    returns ``z`` transposed, ``[C, Σ sizes]``.

    Accumulated over the features in a fixed order, z = ((x_0 w_0 + x_1 w_1) + x_2 w_2) + … (+ b),
    with elementwise multiplies and adds only: every element is rounded the same way on every
    machine (a BLAS product or a SIMD reduction sums in an order that depends on the CPU).
    Class-major so that every operation runs along a client's rows (contiguous)."""
    rows, dim = x.shape
    k, _, C = W.shape
    xt = np.ascontiguousarray(x.T)  # [dim, rows]: one feature's values contiguous
    Wt = np.ascontiguousarray(W.transpose(1, 2, 0))  # [dim(+1), C, k]
    if np.all(sizes == sizes[0]):
        n = int(sizes[0])
        col = lambda j: xt[j].reshape(1, k, n)  # noqa: E731
        coef = lambda j: Wt[j][:, :, None]  # noqa: E731  [C, k, 1], broadcast over a client's rows
        shape = (C, k, n)
    else:
        col = lambda j: xt[j]  # noqa: E731
        coef = lambda j: np.repeat(Wt[j], sizes, axis=1)  # noqa: E731  [C, rows], client k's column sizes[k] times
        shape = (C, rows)
    z = np.empty(shape)
    np.multiply(col(0), coef(0), out=z)
    term = np.empty(shape)
    for j in range(1, dim):
        np.multiply(col(j), coef(j), out=term)
        z += term
    if W.shape[1] > dim:
        z += coef(dim)
    return z.reshape(C, rows)


def _floor_exp(t: np.ndarray) -> np.ndarray:
    """floor(e^t) as int64, exactly: the float e^t where it is farther from an integer than any
    libm's error, else decided in decimal (t ≥ ln r or not, r the nearest integer). Values of
    2^52 and beyond are cast as they are (no federation holds that many rows per client)."""
    e = np.exp(t)
    out = e.astype(np.int64)
    r = np.rint(e)
    near = np.nonzero((np.abs(e - r) <= 1e-10 * e) & (e < 2.0 ** 52))[0]
    with decimal.localcontext(_DECIMAL):
        for i in near.tolist():
            ri = int(r[i])
            out[i] = ri if ri == 0 or decimal.Decimal(float(t[i])) >= decimal.Decimal(ri).ln() else ri - 1
    return out


def _bernoulli(u: np.ndarray, z: np.ndarray) -> np.ndarray:
    """y = 1[u < σ(z)] as int64, exactly: by the float σ(z) where u is farther from it than any
    libm's error (relative 1e-10), else in decimal (u·(1 + e^{−z}) < 1). Non-finite z: the float
    rule (σ(+inf) = 1, σ(−inf) = 0)."""
    p = np.exp(-np.logaddexp(0.0, -z))  # σ(z) = exp(−log(1 + e^{−z})), without overflow for large |z|
    y = (u < p).astype(np.int64)
    near = np.nonzero((np.abs(u - p) <= 1e-10 * p + 1e-300) & np.isfinite(z))[0]
    with decimal.localcontext(_DECIMAL):
        for i in near.tolist():
            ui = float(u[i])
            # σ(z) > 0 for finite z, so u = 0 always draws 1 (and e^{−z} may not fit a decimal then).
            y[i] = 1 if ui == 0.0 else int(decimal.Decimal(ui) * (1 + (-decimal.Decimal(float(z[i]))).exp()) < 1)
    return y


def _check_memory(nbytes: int, names: str) -> None:
    """A federation that cannot fit in this machine's memory is refused before anything is
    allocated (instead of an allocation failure, or the system killing the process midway)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not POSIX: no check
        return
    if nbytes > total:
        raise ValueError(f"{names}: the federation would take {nbytes / 1e9:.3g} GB, more than this machine's "
                         f"{total / 1e9:.3g} GB of memory")


def _federation_bytes(rows: int, m: int, dim: int, truth_d: int, npd, y_bytes: int = 8) -> int:
    """Bytes of the outputs (x, y, truth, offsets) plus the per-client float64 feature means."""
    item = np.dtype(npd).itemsize
    return rows * (dim * item + y_bytes) + m * (truth_d * item + 16 + dim * 8)


def _blocks(count: int, width: int) -> Iterator[Tuple[int, int]]:
    """Ranges [lo, hi) cutting ``count`` items of ``width`` values into blocks of at most
    ``_BLOCK`` values (at least one item each)."""
    step = max(1, _BLOCK // max(1, width))
    for lo in range(0, count, step):
        yield lo, min(count, lo + step)


def _fill_rows(out: np.ndarray, width: int, draw) -> None:
    """``out[lo:hi] = draw(lo, hi)`` block by block (``draw`` returns float64; the assignment
    rounds to ``out``'s dtype as ``astype`` would)."""
    for lo, hi in _blocks(out.shape[0], width):
        out[lo:hi] = draw(lo, hi)


def _argmax_labels(x: np.ndarray, Wb: np.ndarray, sizes: np.ndarray, dim: int, C: int) -> np.ndarray:
    """y = argmax(x W_k + b_k) row by row for the clients of a block: ``x [Σ sizes, dim]`` their
    rows, ``Wb [k, (dim+1)·C]`` their [W_k; b_k] (float64). The logits in ``_linear``'s fixed
    order, so the same labels on every machine (the first class of a tie)."""
    return np.argmax(_linear(x, Wb.reshape(-1, dim + 1, C), sizes), axis=0)


class _Rows:
    """The rows of m clients, generated client block by client block and written straight into
    the train and test arrays: client k's first ``n_train[k]`` rows go to train, the rest to
    test, as if all rows had been generated at once and split afterwards."""

    def __init__(self, sizes: np.ndarray, test_fraction: float, dim: int, npd, y_dtype):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.n_train = np.clip(np.round(self.sizes * (1.0 - test_fraction)).astype(np.int64), 1, self.sizes - 1)
        self.start = np.concatenate([[0], np.cumsum(self.sizes)])  # row offsets of all rows
        self.train_off = np.concatenate([[0], np.cumsum(self.n_train)])
        self.test_off = self.start - self.train_off
        n_tr, n_te = int(self.train_off[-1]), int(self.test_off[-1])
        self.x = (_output((n_tr, dim), npd), _output((n_te, dim), npd))
        self.y = (_output(n_tr, y_dtype), _output(n_te, y_dtype))
        self.dim = dim

    def blocks(self) -> Iterator[Tuple[int, int, int, int]]:
        """(k0, k1, r0, r1): clients k0..k1-1 own rows r0..r1-1; about ``_BLOCK`` values of x
        per block, a client never cut."""
        m, rows = self.sizes.size, max(1, _BLOCK // self.dim)
        k0 = 0
        while k0 < m:
            k1 = int(np.searchsorted(self.start, self.start[k0] + rows, side="right")) - 1
            k1 = min(m, max(k1, k0 + 1))
            yield k0, k1, int(self.start[k0]), int(self.start[k1])
            k0 = k1

    def put(self, k0: int, k1: int, block: np.ndarray, out: Tuple[np.ndarray, np.ndarray]) -> None:
        """Write the rows of clients k0..k1-1 (``block``, in generation order) to ``out``
        (train, test)."""
        sizes = self.sizes[k0:k1]
        if np.all(sizes == sizes[0]):  # equal sizes: a reshape instead of a mask
            by_client = block.reshape(k1 - k0, int(sizes[0]), *block.shape[1:])
            cut = int(self.n_train[k0])
            if np.all(self.n_train[k0:k1] == cut):
                out[0][self.train_off[k0]:self.train_off[k1]] = by_client[:, :cut].reshape(-1, *block.shape[1:])
                out[1][self.test_off[k0]:self.test_off[k1]] = by_client[:, cut:].reshape(-1, *block.shape[1:])
                return
        pos = np.arange(block.shape[0]) - np.repeat(self.start[k0:k1] - self.start[k0], sizes)
        train = pos < np.repeat(self.n_train[k0:k1], sizes)
        out[0][self.train_off[k0]:self.train_off[k1]] = block[train]
        out[1][self.test_off[k0]:self.test_off[k1]] = block[~train]

    def features(self, k0: int, k1: int, mean: Optional[np.ndarray], noise: np.ndarray, npd,
                 scale: Optional[np.ndarray] = None) -> np.ndarray:
        """x = mean_k + noise·scale for the rows of clients k0..k1-1 (``mean`` [k1 - k0, dim],
        ``scale`` [dim]; None for 0 and 1), rounded to ``npd`` and stored; returns the rounded
        rows as float64 (what the labels are computed from). ``noise`` (float64) is overwritten."""
        if scale is not None:
            noise *= scale
        if mean is not None:
            noise += np.repeat(mean, self.sizes[k0:k1], axis=0)  # a + b == b + a exactly
        x = noise.astype(npd)
        self.put(k0, k1, x, self.x)
        return x.astype(np.float64, copy=False)

    def federation(self, dtype, num_classes: int, truth: np.ndarray, truth_global: Optional[np.ndarray],
                   name: str, meta: dict, scales: str) -> Federation:
        """The Federation of the filled arrays; ``scales`` names the arguments whose size can
        make values overflow ``dtype`` (the error names them, not the internal arrays)."""
        def client_data(x, y, off):
            return ClientData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(off.astype(np.int64)))

        meta = dict(meta, dtype=str(dtype).replace("torch.", ""))
        try:
            return Federation(client_data(self.x[0], self.y[0], self.train_off),
                              client_data(self.x[1], self.y[1], self.test_off), num_classes,
                              truth=torch.from_numpy(truth),
                              truth_global=None if truth_global is None else torch.from_numpy(truth_global),
                              name=name, meta=meta)
        except NonFiniteError as exc:
            raise NonFiniteError(f"{scales}: too large for {str(dtype).replace('torch.', '')}: the generated data "
                                 f"overflows ({exc})") from None


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
    m = check_positive_int(num_clients, "num_clients", maximum=MAX_COUNT)
    dim = check_positive_int(dim, "dim", maximum=MAX_COUNT)
    C = check_positive_int(num_classes, "num_classes", minimum=2, maximum=MAX_COUNT)
    seed = check_positive_int(seed, "seed", minimum=0)
    size_scale = check_positive_int(size_scale, "size_scale", maximum=MAX_COUNT)
    if max_size is not None:
        max_size = check_positive_int(max_size, "max_size", minimum=2, maximum=MAX_COUNT)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)
    names = "num_clients, dim, num_classes, size_scale, max_size"
    least = 50 * size_scale if max_size is None else min(50 * size_scale, max_size)  # rows per client, at least
    _check_memory(_federation_bytes(m * least, m, dim, (dim + 1) * C, npd), names)

    rng = np.random.default_rng(seed)
    # lognormal(4, 2) = e^{N(4, 2)}: numpy draws the same normals for both, and floor(e^t) exactly
    sizes = (_floor_exp(rng.normal(4.0, 2.0, m)) + 50) * size_scale
    if max_size is not None:
        sizes = np.minimum(sizes, max_size)
    _check_memory(_federation_bytes(int(sizes.sum()), m, dim, (dim + 1) * C, npd), names)
    u = rng.normal(0.0, alpha, m)
    B = rng.normal(0.0, beta, m)
    D = dim * C
    truth = _output((m, D + C), npd)  # [W_k; b_k] rounded to dtype
    if iid:
        for lo, hi in _blocks(m, dim):  # the v_k are drawn (the stream stays the same), then v = 0
            rng.normal(B[lo:hi, None], 1.0, (hi - lo, dim))
        v = None
        truth[:, :D] = rng.normal(0.0, 1.0, (dim, C)).reshape(D)
        truth[:, D:] = rng.normal(0.0, 1.0, C)
    else:
        v = rng.normal(B[:, None], 1.0, (m, dim))
        _fill_rows(truth[:, :D], D, lambda lo, hi: rng.normal(u[lo:hi, None, None], 1.0, (hi - lo, dim, C))
                   .reshape(hi - lo, D))
        _fill_rows(truth[:, D:], C, lambda lo, hi: rng.normal(u[lo:hi, None], 1.0, (hi - lo, C)))

    rows = _Rows(sizes, test_fraction, dim, npd, np.int64)
    scale = np.sqrt(_diag_cov(dim))
    for k0, k1, r0, r1 in rows.blocks():
        mean = np.zeros((k1 - k0, dim)) if v is None else v[k0:k1]
        x = rows.features(k0, k1, mean, rng.standard_normal((r1 - r0, dim)), npd, scale)
        y = _argmax_labels(x, truth[k0:k1].astype(np.float64), sizes[k0:k1], dim, C)
        rows.put(k0, k1, y, rows.y)

    meta = dict(generator="synthetic", alpha=alpha, beta=beta, num_clients=m, dim=dim, num_classes=C, seed=seed,
                size_scale=size_scale, iid=bool(iid), test_fraction=test_fraction, max_size=max_size,
                model=f"Softmax(p={dim}, C={C}, fit_intercept=True)")
    name = f"synthetic(alpha={alpha:g}, beta={beta:g}{', iid' if iid else ''})"
    return rows.federation(dtype, C, truth, truth[0].copy() if iid else None, name, meta, "alpha, beta")


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
    m = check_positive_int(num_clients, "num_clients", maximum=MAX_COUNT)
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2, maximum=MAX_COUNT)
    dim = check_positive_int(dim, "dim", maximum=MAX_COUNT)
    R = check_real(R, "R", minimum=0.0)
    seed = check_positive_int(seed, "seed", minimum=0)
    if labels not in ("sample", "argmax"):
        raise ValueError(f"labels: expected 'sample' or 'argmax', got {labels!r}")
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)
    _check_memory(_federation_bytes(m * n, m, dim, 2 * dim, npd, 16), "num_clients, samples_per_client, dim")

    rng = np.random.default_rng(seed)
    truth = rng.normal(0.0, math.sqrt(R), (m, dim)).astype(npd)
    w = truth.astype(np.float64)
    v = rng.normal(0.0, 1.0, (m, dim))
    rows = _Rows(np.full(m, n), test_fraction, dim, npd, np.int64)
    scale = np.sqrt(_diag_cov(dim))
    z = np.empty(m * n) if labels == "sample" else None  # x_iᵀw_k, until all features are drawn
    for k0, k1, r0, r1 in rows.blocks():
        x = rows.features(k0, k1, v[k0:k1], rng.standard_normal((r1 - r0, dim)), npd, scale)
        zb = _linear(x, w[k0:k1, :, None], rows.sizes[k0:k1])[0]
        if z is None:
            rows.put(k0, k1, (zb > 0).astype(np.int64), rows.y)
        else:
            z[r0:r1] = zb
    if z is not None:  # the Bernoulli draws come after all the features' draws
        for k0, k1, r0, r1 in rows.blocks():
            rows.put(k0, k1, _bernoulli(rng.random(r1 - r0), z[r0:r1]), rows.y)
    # w̄ = (Σ_k w_k) / m, summed in client order (elementwise adds: the same bits on every machine)
    w_bar = np.zeros(dim)
    for lo, hi in _blocks(m, dim):
        w_bar = np.add.accumulate(np.concatenate([w_bar[None], w[lo:hi]]), axis=0)[-1]
    w_bar /= m
    sq = np.zeros(m)  # ‖w_k − w̄‖², summed over j in order
    for j in range(dim):
        d = w[:, j] - w_bar[j]
        sq += d * d

    meta = dict(generator="logistic_truth", num_clients=m, samples_per_client=n, dim=dim, R=R, seed=seed,
                labels=labels, test_fraction=test_fraction, model=f"Logistic(p={dim}, fit_intercept=False)",
                truth_global="mean of client models",
                heterogeneity=math.fsum(sq.tolist()) / m)  # fsum: exactly rounded, any order
    return rows.federation(dtype, 2, truth, w_bar.astype(npd), f"logistic_truth(R={R:g}, labels={labels})", meta,
                           "R")


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
    m = check_positive_int(num_clients, "num_clients", maximum=MAX_COUNT)
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2, maximum=MAX_COUNT)
    dim = check_positive_int(dim, "dim", maximum=MAX_COUNT)
    noise_var = check_real(noise_var, "noise_var", minimum=0.0)
    shift = check_real(shift, "shift", minimum=0.0)
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)
    _check_memory(_federation_bytes(m * n, m, dim, 2 * dim, npd, 16), "num_clients, samples_per_client, dim")

    rng = np.random.default_rng(seed)
    w_star = rng.normal(0.0, 1.0, dim).astype(npd)
    truth = (w_star.astype(np.float64) + shift * rng.normal(0.0, 1.0, (m, dim))).astype(npd)
    w = truth.astype(np.float64)
    rows = _Rows(np.full(m, n), test_fraction, dim, npd, npd)
    b = np.empty(m * n)  # a_iᵀw*_k, until all rows are drawn
    for k0, k1, r0, r1 in rows.blocks():
        A = rows.features(k0, k1, None, rng.normal(0.0, 1.0, (r1 - r0, dim)), npd)
        b[r0:r1] = _linear(A, w[k0:k1, :, None], rows.sizes[k0:k1])[0]
    sd = math.sqrt(noise_var)
    for k0, k1, r0, r1 in rows.blocks():  # the noise draws come after all the rows' draws
        rows.put(k0, k1, (b[r0:r1] + rng.normal(0.0, sd, r1 - r0)).astype(npd), rows.y)

    meta = dict(generator="least_squares", num_clients=m, samples_per_client=n, dim=dim, noise_var=noise_var,
                shift=shift, seed=seed, test_fraction=test_fraction,
                model=f"LeastSquares(p={dim}, fit_intercept=False)")
    return rows.federation(dtype, 0, truth, w_star, f"least_squares(shift={shift:g}, noise_var={noise_var:g})",
                           meta, "shift, noise_var")


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
    m = check_positive_int(num_clients, "num_clients", maximum=MAX_COUNT)
    n = check_positive_int(samples_per_client, "samples_per_client", minimum=2, maximum=MAX_COUNT)
    dim = check_positive_int(dim, "dim", maximum=MAX_COUNT)
    mu = check_real(mu, "mu")
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)
    _check_memory(_federation_bytes(m * n, m, dim, dim, npd), "num_clients, samples_per_client, dim")

    rng = np.random.default_rng(seed)
    g = rng.normal(0.0, 1.0, dim)
    w = g / math.sqrt(math.fsum((g * g).tolist()))  # ‖g‖ from the exactly rounded Σ g_j² (not BLAS's dot)
    groups = (np.arange(m) >= m // 2).astype(np.int64)
    sign = 1.0 - 2.0 * groups  # +1 for group 0, −1 for group 1
    truth = (sign[:, None] * w).astype(npd)
    rows = _Rows(np.full(m, n), test_fraction, dim, npd, np.int64)
    for k0, k1, r0, r1 in rows.blocks():
        x = rows.features(k0, k1, sign[k0:k1, None] * mu * w, rng.standard_normal((r1 - r0, dim)), npd)
        z = _linear(x, truth[k0:k1, :, None].astype(np.float64), rows.sizes[k0:k1])[0]
        rows.put(k0, k1, (z >= 0).astype(np.int64), rows.y)

    meta = dict(generator="two_groups", num_clients=m, samples_per_client=n, dim=dim, mu=mu, seed=seed,
                test_fraction=test_fraction, model=f"Logistic(p={dim}, fit_intercept=False)",
                groups=groups.tolist())
    return rows.federation(dtype, 2, truth, None, f"two_groups(mu={mu:g})", meta, "mu")


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
    m = check_positive_int(num_clients, "num_clients", maximum=MAX_COUNT)
    K = check_positive_int(num_contexts, "num_contexts", maximum=MAX_COUNT)
    if K > m:
        raise ValueError(f"num_contexts: expected at most num_clients = {m} contexts, got {K}")
    dim = check_positive_int(dim, "dim", maximum=MAX_COUNT)
    C = check_positive_int(num_classes, "num_classes", minimum=2, maximum=MAX_COUNT)
    client_noise = check_real(client_noise, "client_noise", minimum=0.0)
    beta = check_real(beta, "beta", minimum=0.0)
    if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2
            or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sizes)
            or not 2 <= sizes[0] <= sizes[1] <= MAX_COUNT):
        raise ValueError(f"sizes: expected (low, high) integers with 2 <= low <= high <= {MAX_COUNT}, got {sizes!r}")
    seed = check_positive_int(seed, "seed", minimum=0)
    test_fraction = _check_fraction(test_fraction)
    npd = _check_dtype(dtype)
    feature_spread = check_real(feature_spread, "feature_spread", minimum=0.0)
    names = "num_clients, dim, num_classes, sizes"
    _check_memory(_federation_bytes(m * int(sizes[0]), m, dim, (dim + 1) * C, npd), names)

    rng = np.random.default_rng(seed)
    context = rng.permutation(np.arange(m) % K)
    W_c = rng.normal(0.0, 1.0, (K, dim + 1, C))  # [W_c; b_c]
    v_c = rng.normal(0.0, 1.0, (K, dim)) * feature_spread + rng.normal(0.0, beta, K)[:, None]
    P = (dim + 1) * C
    truth = _output((m, P), npd)  # [W_k; b_k] rounded to dtype
    _fill_rows(truth, P, lambda lo, hi: (W_c[context[lo:hi]] + client_noise
                                         * rng.normal(0.0, 1.0, (hi - lo, dim + 1, C))).reshape(hi - lo, P))
    v = np.empty((m, dim))
    _fill_rows(v, dim, lambda lo, hi: v_c[context[lo:hi]] + client_noise * rng.normal(0.0, 1.0, (hi - lo, dim)))
    n = rng.integers(int(sizes[0]), int(sizes[1]) + 1, m)
    _check_memory(_federation_bytes(int(n.sum()), m, dim, (dim + 1) * C, npd), names)

    rows = _Rows(n, test_fraction, dim, npd, np.int64)
    scale = np.sqrt(_diag_cov(dim))
    for k0, k1, r0, r1 in rows.blocks():
        x = rows.features(k0, k1, v[k0:k1], rng.standard_normal((r1 - r0, dim)), npd, scale)
        rows.put(k0, k1, _argmax_labels(x, truth[k0:k1].astype(np.float64), n[k0:k1], dim, C), rows.y)

    meta = dict(generator="contexts", num_clients=m, num_contexts=K, dim=dim, num_classes=C,
                client_noise=client_noise, beta=beta, feature_spread=feature_spread,
                sizes=[int(sizes[0]), int(sizes[1])], seed=seed,
                test_fraction=test_fraction, model=f"Softmax(p={dim}, C={C}, fit_intercept=True)",
                contexts=context.tolist())
    return rows.federation(dtype, C, truth, None, f"contexts(K={K}, client_noise={client_noise:g})", meta,
                           "client_noise, beta, feature_spread")
