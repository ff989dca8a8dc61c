"""k-means of client models (DESIGN.md §4).

``kmeans_assign(points [N, d], centroids [K, d]) -> (labels int64 [N], sqdist [N])``: one pass
over the points; distances are direct sums of squared differences and ties go to the lowest
index. ``kmeans(points, k, ...)``: Lloyd iterations with k-means++ seeding (or given
centroids: a warm start), optional sample weights; an empty cluster keeps its centroid.

One process: the backend's ``kmeans_lloyd`` runs the whole loop (the native one in one kernel
call, one pass over the points per iteration; backends without one compose their assignment and
update in ``backends/_lloyd.py``). Sharded points (``comm``): every rank passes its own rows and
the same arguments; the composed loop runs with the communicator summing what it needs over the
ranks (cluster sums, inertia, label changes), and k-means++ draws each seed on the rank that
holds it and broadcasts it; a sharded run gives the one-process centroids to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor, to_tensor
from pflcore._checks import MAX_COUNT, check_float, check_positive_int, check_real, check_shape
from pflcore._comm import Comm
from pflcore.backends._lloyd import lloyd_loop
from pflcore.errors import NonFiniteError
from pflcore.ops import _compile
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm, same_device

_ONE_PROCESS = Comm()
_Tensor, _F32, _F64, _STRIDED = torch.Tensor, torch.float32, torch.float64, torch.strided


def _points(points, name="points"):
    t, kind = to_tensor(points, name)
    check_float(t, name)
    if t.dim() != 2 or t.shape[1] < 1:
        raise ValueError(f"{name}: expected shape [N, d] with d >= 1, got {list(t.shape)}")
    t = t.detach()  # outputs never require grad (the torch code of the Lloyd loop would record a graph)
    return (t if t.is_contiguous() else t.contiguous()), kind


def _centroids(centroids, points_t, name="centroids"):
    c, _ = to_tensor(centroids, name)
    if c.dtype is not points_t.dtype:
        check_float(c, name, points_t.dtype)
    same_device(c, points_t, name)
    if c.dim() != 2 or c.shape[1] != points_t.shape[1]:
        check_shape(c, name, (None, points_t.shape[1]), f"[K, d] with d = {points_t.shape[1]}")
    if c.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one centroid, got shape {list(c.shape)}")
    return c if c.is_contiguous() else c.contiguous()


# ---- kmeans_assign -------------------------------------------------------------------------

def _assign(points: torch.Tensor, centroids: torch.Tensor):
    """Nearest centroids of checked tensors (values checked by the adapter)."""
    if points.shape[0] == 0:  # a rank that holds no points
        return (torch.empty(0, dtype=torch.int64, device=points.device),
                torch.empty(0, dtype=points.dtype, device=points.device))
    return backend.select("kmeans_assign", None, points).kmeans_assign(points, centroids)


def _plain_pair(points, centroids) -> bool:
    """True for the common small call: two contiguous CPU tensors of one float dtype, [N, d]
    and [K, d] with N, K, d >= 1, neither requiring grad. Only attribute reads (~0.5 µs): the
    general path's conversions and checks cost ~1.5 µs of a ~10 µs call at 200 points."""
    if type(points) is not _Tensor or type(centroids) is not _Tensor:
        return False
    dt = points.dtype
    if (dt is not _F32 and dt is not _F64) or centroids.dtype is not dt:
        return False
    ps, cs = points.shape, centroids.shape
    return (len(ps) == 2 and len(cs) == 2 and ps[0] >= 1 and ps[1] >= 1 and cs[0] >= 1 and cs[1] == ps[1]
            and points.is_cpu and centroids.is_cpu and points.layout is _STRIDED and centroids.layout is _STRIDED
            and not points.requires_grad and not centroids.requires_grad
            and points.is_contiguous() and centroids.is_contiguous())


def kmeans_assign(points, centroids):
    """Nearest centroid of every point: ``(labels int64 [N], sqdist [N])``, as arrays of the
    points' kind. NaN/inf in the centroids or the points is a NonFiniteError naming the first
    bad row."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.kmeans_assign
        return _compile.traced_kmeans_assign(points, centroids)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("kmeans_assign")
    if _plain_pair(points, centroids):  # what _points and _centroids would pass through unchanged
        return backend.select("kmeans_assign", None, points).kmeans_assign(points, centroids)
    points_t, kind = _points(points)
    labels, sqdist = _assign(points_t, _centroids(centroids, points_t))
    return from_tensor(labels, kind), from_tensor(sqdist, kind)


def kmeans_assign_ref(points, centroids):
    """``kmeans_assign`` on the reference: squared differences in chunks of points, then argmin
    (the first minimum, i.e. ties go to the lowest index)."""
    with backend.reference():
        return kmeans_assign(points, centroids)


# ---- the Lloyd update ----------------------------------------------------------------------

def cluster_means(points: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor],
                  centroids: torch.Tensor, comm: Comm = _ONE_PROCESS) -> torch.Tensor:
    """``centroids [K, d]`` ← the weighted mean of each cluster's points, in place (an empty
    cluster keeps its centroid); returns the clusters' float64 weights [K]. One process: the
    backend's update kernel. Sharded: float64 sums on each rank and one all-reduce of
    [K, d + 1]."""
    if comm.world == 1:
        return backend.select("kmeans_update", None, points).kmeans_update(points, labels, weights, centroids)
    K, d = centroids.shape
    w = torch.ones(points.shape[0], dtype=torch.float64, device=points.device) if weights is None \
        else weights.to(torch.float64)
    acc = torch.zeros(K, d + 1, dtype=torch.float64, device=points.device)
    if points.shape[0]:
        acc[:, :d].index_add_(0, labels, points.to(torch.float64) * w[:, None])
        acc[:, d].index_add_(0, labels, w)
    comm.all_reduce(acc)
    wsum = acc[:, d]
    keep = wsum > 0
    centroids[keep] = (acc[keep, :d] / wsum[keep, None]).to(centroids.dtype)
    return wsum


# ---- kmeans ----------------------------------------------------------------------------------

@dataclass
class KMeans:
    centroids: torch.Tensor       # [K, d]
    labels: torch.Tensor          # int64 [N] (a sharded run: this rank's points)
    inertia: float                # Σ_i w_i ‖x_i − c_{label_i}‖² (over every rank's points)
    iterations: int               # Lloyd updates performed
    history: List[float] = field(default_factory=list)  # inertia after seeding and each update


def _kmeans_pp(points, k, weights, seed, assign: Callable, comm: Comm) -> torch.Tensor:
    """k-means++ seeding: D²·w sampling from a CPU generator seeded by ``seed``. The same
    generator draws u ∈ [0, total) on every rank; the rank whose share of the cumulative mass
    holds u picks the point and broadcasts it (one process: it picks, the broadcast is the
    identity)."""
    gen = torch.Generator().manual_seed(int(seed))
    N = points.shape[0]
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.detach().cpu().to(torch.float64)

    def draw(prob: torch.Tensor) -> torch.Tensor:
        cdf = torch.cumsum(prob, 0)
        totals = torch.stack(comm.all_gather(torch.tensor([float(cdf[-1]) if N else 0.0], dtype=torch.float64)))[:, 0]
        cum = torch.cumsum(totals, 0)
        u = torch.rand((), generator=gen, dtype=torch.float64) * cum[-1]
        owner = int(torch.searchsorted(cum, u, right=True))
        if owner >= comm.world:  # u at the very top: the last rank holding any mass
            owner = int(torch.nonzero(totals > 0)[-1])
        row = torch.empty(points.shape[1], dtype=points.dtype, device=points.device)
        if comm.rank == owner:
            local_u = u - (cum[owner] - totals[owner])
            row.copy_(points[min(int(torch.searchsorted(cdf, local_u, right=True)), N - 1)])
        return comm.broadcast(row, owner)

    centroids = torch.empty(k, points.shape[1], dtype=points.dtype, device=points.device)
    centroids[0] = draw(w)
    d2 = assign(points, centroids[:1])[1].detach().cpu().to(torch.float64)
    for j in range(1, k):
        prob = d2 * w
        centroids[j] = draw(prob if comm.sum(float(prob.sum())) > 0 else w)
        d2 = torch.minimum(d2, assign(points, centroids[j:j + 1])[1].detach().cpu().to(torch.float64))
    return centroids


def _lloyd(points, k, init, iters, tol, seed, weights, comm: Comm, assign: Callable) -> KMeans:
    centroids = _kmeans_pp(points, k, weights, seed, assign, comm) if isinstance(init, str) else init.clone()
    adapter = backend.select("kmeans_assign", None, points)
    if comm.world == 1 and "kmeans_lloyd" in adapter.ops():
        # one process on a backend with a whole loop (the native one: one kernel call, one pass
        # over the points per iteration)
        labels, history, it = adapter.kmeans_lloyd(points, centroids, weights, iters, tol)
    else:
        # the backend's assignment and update (CUDA, Triton); sharded: the cluster sums, inertia
        # and label changes summed over the ranks
        labels, history, it = lloyd_loop(
            points, centroids, weights, iters, tol, assign,
            lambda p, lab, w, c: cluster_means(p, lab, w, c, comm), comm)
    return KMeans(centroids, labels, history[-1], it, history)


def _check_weights(w: torch.Tensor, comm: Comm) -> None:
    """k-means++ samples in proportion to the weights before any kernel reads them: checked
    here, one pass over [N]."""
    if w.numel():
        bad = ~(torch.isfinite(w) & (w >= 0))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            v = float(w[i])
            kind = ValueError if v == v and abs(v) != float("inf") else NonFiniteError
            raise kind(f"weights: expected finite weights >= 0, got weights[{i}] = {v:g}")
    if not comm.sum(float(w.to(torch.float64).sum())) > 0:
        raise ValueError("weights: expected non-negative weights with a positive sum")


def kmeans(points, k=None, *, init="k-means++", iters: int = 100, tol: float = 1e-6, seed: int = 0,
           weights=None, comm: Optional[Comm] = None) -> KMeans:
    """Lloyd's k-means on ``points [N, d]``.

    ``init`` is "k-means++" (seeded by ``seed``, an integer in [0, 2**64)) or ``[k, d]``
    starting centroids (a warm start; ``k`` may then be omitted). Iteration stops after
    ``iters`` updates, when no label changes, or when the squared centroid shift falls below
    ``tol`` times the total variance of the points. ``weights [N]`` are sample weights. The
    inertia never increases across iterations; ``history`` records it. ``comm``: a
    communicator (``pflcore.distributed``) when each rank holds part of the points; the result's
    labels are then this rank's, the centroids and inertia global. Inside an algorithm, use
    ``ctx.kmeans``.
    """
    if is_dynamo_compiling() or is_exporting():  # torch.compile: a graph break (ops/_compile.py)
        return _compile.eager_kmeans(points, k, init, iters, tol, seed, weights, comm)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("kmeans")
    return run_kmeans(points, k, init, iters, tol, seed, weights, comm)


def run_kmeans(points, k, init, iters, tol, seed, weights, comm: Optional[Comm]) -> KMeans:
    """``kmeans`` without the algorithm guard (``Context.kmeans``)."""
    comm = _ONE_PROCESS if comm is None else comm
    points_t, kind = _points(points)
    N = comm.sum(int(points_t.shape[0]))
    if isinstance(init, str):
        if init != "k-means++":
            raise ValueError(f"init: expected 'k-means++' or a [k, d] tensor of centroids, got {init!r}")
        k = check_positive_int(k, "k")
        if k > N:
            raise ValueError(f"k: expected at most N = {N} clusters (one per point), got {k}")
        init_t = init
    else:
        init_t = _centroids(init, points_t, "init")
        if k is not None and init_t.shape[0] != k:
            raise ValueError(f"init: expected {k} centroids (k), got {init_t.shape[0]}")
        k = init_t.shape[0]
    iters = check_positive_int(iters, "iters", minimum=0, maximum=MAX_COUNT)
    tol = check_real(tol, "tol", minimum=0.0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed!r}")
    w = None
    if weights is not None:
        w, _ = to_tensor(weights, "weights")
        if w.dtype is not points_t.dtype:
            check_float(w, "weights", points_t.dtype)
        same_device(w, points_t, "weights")
        if w.dim() != 1 or w.shape[0] != points_t.shape[0]:
            check_shape(w, "weights", (points_t.shape[0],), f"[N] = [{points_t.shape[0]}]")
        w = w if w.is_contiguous() else w.contiguous()
        _check_weights(w, comm)
    res = _lloyd(points_t, k, init_t, iters, tol, int(seed), w, comm, _assign)
    if kind.name != "torch":
        res.centroids, res.labels = from_tensor(res.centroids, kind), from_tensor(res.labels, kind)
    return res


def kmeans_ref(points, k=None, *, init="k-means++", iters: int = 100, tol: float = 1e-6, seed: int = 0,
               weights=None) -> KMeans:
    """``kmeans`` with every assignment and update on the pure-torch reference."""
    with backend.reference():
        return kmeans(points, k, init=init, iters=iters, tol=tol, seed=seed, weights=weights)
