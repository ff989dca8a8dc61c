"""Workloads, the non-pflcore implementations and the measuring helper of the pytest-benchmark
suite (``bench/test_*.py``; run ``pytest bench --benchmark-only``).

Every workload uses the model ``Softmax(60, 10)`` (d = 610, float32) so that sizes read alike
across ops. Sizes:
  - ``small``: one call of the size users make in their own loops: 1 client of 200 rows, 1 step,
    a minibatch of B = 20 rows (``local_steps``, ``sample_batches``); the client's 200 rows
    (``gradients``, ``evaluate``); 200 points, 10 centroids, d = 60 (``kmeans_assign``) -- the
    shapes of the ``[200, 60] @ [60, 10]`` matmul that the op boundary is held to (DESIGN.md §8);
  - ``1k`` / ``10k``: 1,000 / 10,000 clients of about 50 rows each (lognormal sizes, at least
    20), 1 step of B = 20 per client; server-side ops on the clients' models ``[m, 610]``.
All data comes from fixed seeds; every implementation runs on every client (no scaling). The
agreement checks compare with the pure-torch references, which loop over clients in Python: at
10,000 clients they compare every 10th client's result (``checked_rows``).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pflcore
from pflcore import backend, ops
from pflcore.models import Softmax

P, C = 60, 10
MODEL = Softmax(P, C)
D = MODEL.d
SMALL_ROWS, BATCH = 200, 20


@dataclass(frozen=True)
class Size:
    key: str      # in test ids and for --bench-only
    clients: int
    label: str    # in group names


SIZES = {s.key: s for s in (Size("small", 1, "1 client"), Size("1k", 1_000, "1,000 clients"),
                            Size("10k", 10_000, "10,000 clients"))}
LARGE = ("10k",)  # left out by --bench-quick


# ---- which implementations run here ------------------------------------------------------------

def device_of(impl: str) -> torch.device:
    return torch.device("cuda" if impl in ("cuda", "triton") else "cpu")


@functools.lru_cache(maxsize=None)
def pflcore_backends() -> tuple:
    """pflcore's backends that load here: native and reference always (CPU); cuda when a device
    is visible; triton only compiled for a GPU (its CPU interpreter is a test tool, not a backend
    to time)."""
    status = backend.status()
    out = [name for name in ("native", "reference") if status[name][0]]
    if torch.cuda.is_available():
        out += [name for name in ("cuda", "triton") if status[name][0]]
    return tuple(out)


def impls(*peers: str) -> list:
    """pflcore's backends, then the peers, as pytest params (a peer that is not installed is
    skipped with the reason, so that the table says what is missing)."""
    out = [pytest.param(b, id=b) for b in pflcore_backends()]
    for peer in peers:
        missing = _missing(peer)
        marks = [pytest.mark.skip(reason=missing)] if missing else []
        out.append(pytest.param(peer, id=peer, marks=marks))
    return out


def _missing(peer: str) -> Optional[str]:
    module = {"faiss": "faiss", "sklearn": "sklearn"}.get(peer)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError:
        return f"{peer} is not installed (pip install '.[bench]')"
    return None


def sync_of(impl: str):
    return torch.cuda.synchronize if device_of(impl).type == "cuda" else None


# ---- workloads ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def clients(size: str, device: str = "cpu") -> pflcore.ClientData:
    """The federation of a size: 1 client of 200 rows, or m clients of ~50 rows."""
    m = SIZES[size].clients
    rng = np.random.RandomState(0)
    if m == 1:
        sizes = np.array([SMALL_ROWS])
    else:
        sizes = np.maximum(20, np.round(rng.lognormal(math.log(50) - 0.125, 0.5, m))).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(offsets[-1])
    x = torch.from_numpy(rng.standard_normal((N, P)).astype(np.float32))
    y = torch.from_numpy(rng.randint(0, C, N).astype(np.int64))
    return pflcore.ClientData(x.to(device), y.to(device), torch.from_numpy(offsets).to(device))


@functools.lru_cache(maxsize=None)
def models(size: str, device: str = "cpu") -> torch.Tensor:
    """``[m, d]`` client models, small and distinct."""
    g = torch.Generator().manual_seed(1)
    return (0.01 * torch.randn(SIZES[size].clients, D, generator=g)).to(device)


@functools.lru_cache(maxsize=None)
def batches(size: str, device: str = "cpu", steps: int = 1, batch_size: int = BATCH) -> torch.Tensor:
    """``int32 [m, steps, B]`` minibatch rows drawn with replacement (pflcore's sampler)."""
    return ops.sample_batches_ref(clients(size), steps=steps, batch_size=batch_size, seed=0, counter=0).to(device)


_EXPECTED: Dict = {}
_CACHES: list = []


def cached(fn: Callable) -> Callable:
    """``functools.lru_cache`` whose entries ``release()`` drops (for the test modules' workloads)."""
    wrapped = functools.lru_cache(maxsize=None)(fn)
    _CACHES.append(wrapped)
    return wrapped


def checked_rows(size: str) -> Optional[torch.Tensor]:
    """The clients whose results are compared with the (slow, per-client) reference: all of them,
    but every 10th at 10,000 clients (the reference is a Python loop over clients)."""
    m = SIZES[size].clients if size in SIZES else 0
    return torch.arange(0, m, 10) if m >= 10_000 else None


def expected(key, compute: Callable):
    """The reference result of a workload, computed once for all the implementations compared with it."""
    if key not in _EXPECTED:
        _EXPECTED[key] = compute()
    return _EXPECTED[key]


def release() -> None:
    """Drops the cached workloads (between test modules: a 2-core machine has little memory to spare)."""
    for fn in (clients, models, batches, _moved, *_CACHES):
        fn.cache_clear()
    _EXPECTED.clear()


# ---- the per-client PyTorch loop: how PFL libraries run clients today ---------------------------

def _load(lin: torch.nn.Linear, row: torch.Tensor) -> None:
    W = row.view(P + 1, C)
    lin.weight.copy_(W[:P].T)
    lin.bias.copy_(W[P])


def _store(lin: torch.nn.Linear, row: torch.Tensor) -> None:
    W = row.view(P + 1, C)
    W[:P].copy_(lin.weight.T)
    W[P].copy_(lin.bias)


def torch_sgd_loop(theta, data, *, steps, lr, batches=None, prox=0.0, anchor=None):
    """Each client loads its row of ``theta`` into one reused ``nn.Linear(60, 10)``, takes
    ``steps`` ``torch.optim.SGD`` steps with autograd on ``F.cross_entropy`` (its minibatch rows
    ``batches[i, s]``, or all its rows) plus prox/2·‖θ − a‖², and writes the result back."""
    lin = torch.nn.Linear(P, C, device=theta.device)
    if anchor is not None:
        A = anchor.view(P + 1, C)
        a_w, a_b = A[:P].T.contiguous(), A[P].clone()
    offsets = data.offsets.tolist()
    for i in range(theta.shape[0]):
        with torch.no_grad():
            _load(lin, theta[i])
        opt = torch.optim.SGD(lin.parameters(), lr=lr)
        for s in range(steps):
            if batches is None:
                xb, yb = data.x[offsets[i]:offsets[i + 1]], data.y[offsets[i]:offsets[i + 1]]
            else:
                idx = batches[i, s].long()
                xb, yb = data.x[idx], data.y[idx]
            opt.zero_grad()
            loss = F.cross_entropy(lin(xb), yb)
            if prox:
                loss = loss + prox / 2 * ((lin.weight - a_w).pow(2).sum() + (lin.bias - a_b).pow(2).sum())
            loss.backward()
            opt.step()
        with torch.no_grad():
            _store(lin, theta[i])
    return theta


def torch_gradients_loop(theta, data):
    """Per client: load θ_i, autograd of the mean cross-entropy over its rows, flatten the grads."""
    lin = torch.nn.Linear(P, C, device=theta.device)
    out = torch.empty_like(theta)
    offsets = data.offsets.tolist()
    for i in range(theta.shape[0]):
        with torch.no_grad():
            _load(lin, theta[i])
        lin.zero_grad()
        F.cross_entropy(lin(data.x[offsets[i]:offsets[i + 1]]), data.y[offsets[i]:offsets[i + 1]]).backward()
        with torch.no_grad():
            out[i].view(P + 1, C)[:P].copy_(lin.weight.grad.T)
            out[i].view(P + 1, C)[P].copy_(lin.bias.grad)
    return out


@torch.no_grad()
def torch_evaluate_loop(theta, data):
    """Per client: logits of its rows, summed cross-entropy, count of correct argmax."""
    m = theta.shape[0]
    loss = torch.empty(m, dtype=theta.dtype, device=theta.device)
    correct = torch.empty(m, dtype=torch.int64, device=theta.device)
    offsets = data.offsets.tolist()
    for i in range(m):
        W = theta[i].view(P + 1, C)
        xb, yb = data.x[offsets[i]:offsets[i + 1]], data.y[offsets[i]:offsets[i + 1]]
        logits = torch.addmm(W[P], xb, W[:P])
        loss[i] = F.cross_entropy(logits, yb, reduction="sum")
        correct[i] = (logits.argmax(1) == yb).sum()
    return loss, correct, data.offsets[1:] - data.offsets[:-1]


# ---- measuring --------------------------------------------------------------------------------

def max_abs_diff(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64).cpu() - torch.as_tensor(b, dtype=torch.float64).cpu())
                 .abs().max())


def measure(benchmark, *, op: str, size: str, group: str, impl: str, run: Callable, check: Callable,
            flops: Optional[float] = None, bytes_moved: Optional[float] = None, baseline: bool = False,
            info: Optional[Dict] = None):
    """Checks that ``run()`` agrees (``check(result)`` asserts), then times ``run``.

    Fast calls go through pytest-benchmark's calibration (many iterations per round, the
    statistics over rounds); a call over 20 ms is timed for a few single rounds (enough for a
    minimum on a busy machine; ``--benchmark-max-time`` bounds it). With ``--benchmark-disable``
    ``run`` is called once and checked: the suite is then a test of its agreement checks.
    ``extra_info`` gets the op, size, implementation, FLOPs/bytes and the achieved GFLOP/s, GB/s.
    """
    benchmark.group = group
    benchmark.extra_info.update(op=op, size=size, impl=impl, baseline=baseline, **(info or {}))
    if flops:
        benchmark.extra_info["flops"] = flops
    if bytes_moved:
        benchmark.extra_info["bytes"] = bytes_moved
    sync = sync_of(impl)

    def call():
        out = run()
        if sync:
            sync()
        return out

    if getattr(benchmark, "disabled", False):
        check(benchmark(call))
        return
    t0 = time.perf_counter()
    check(call())  # agreement first (also the warm-up)
    took = spent = time.perf_counter() - t0
    for _ in range(4):  # a busy machine can stretch any one call: decide on the best of a few
        if took <= 0.02 or spent > 0.3:
            break
        t0 = time.perf_counter()
        call()
        took = min(took, time.perf_counter() - t0)
        spent += time.perf_counter() - t0
    if took > 0.02:
        budget = float(getattr(benchmark, "_max_time", 1.0))
        rounds = int(min(20, max(2, math.ceil(budget / took))))
        benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=0)
    else:
        benchmark(call)
    stats = getattr(benchmark, "stats", None)
    best = getattr(getattr(stats, "stats", None), "min", None)
    if best:
        if flops:
            benchmark.extra_info["gflops_per_s"] = flops / best / 1e9
        if bytes_moved:
            benchmark.extra_info["gbytes_per_s"] = bytes_moved / best / 1e9


def group_name(op: str, size: str, what: str) -> str:
    return f"{op}: {SIZES[size].label}, {what}" if size in SIZES else f"{op}: {what}"


def on_device(data: pflcore.ClientData, device) -> pflcore.ClientData:
    """``data`` on ``device`` (the same object on its own device)."""
    device = torch.device(device)
    if data.x.device == device:
        return data
    return _moved(id(data), data, str(device))


@functools.lru_cache(maxsize=4)
def _moved(_key, data, device):
    return pflcore.ClientData(data.x.to(device), data.y.to(device), data.offsets.to(device))
