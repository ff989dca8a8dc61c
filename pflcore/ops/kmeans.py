"""k-means of client models (DESIGN.md §4).

``kmeans_assign(points [N, d], centroids [K, d]) -> (labels int64 [N], sqdist [N])``: one pass
over the points; distances are direct sums of squared differences and ties go to the lowest
index. ``kmeans(points, k, ...)``: Lloyd iterations with k-means++ seeding (or given
centroids: a warm start), optional sample weights; an empty cluster keeps its centroid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List

import numpy as np
import torch

from pflcore import backend
from pflcore.ops import _cuda
from pflcore.ops._checks import (as_tensor, check_device, check_finite, check_float, check_positive_int,
                                 check_real, check_shape, cpu_numpy, out_like)


def _validate_points(points, name="points", finite=True):
    t, is_np = as_tensor(points, name)
    check_float(t, name)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected shape [N, d], got {list(t.shape)}")
    if finite:
        check_finite(t, name)
    return t.contiguous(), is_np


def _validate_centroids(centroids, points_t, name="centroids", finite=True):
    c, _ = as_tensor(centroids, name)
    check_float(c, name, points_t.dtype)
    check_device(c, name, points_t.device)
    check_shape(c, name, (None, points_t.shape[1]), f"[K, d] with d = {points_t.shape[1]}")
    if c.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one centroid, got shape {list(c.shape)}")
    if finite:
        check_finite(c, name)
    return c.contiguous()


# ---- kmeans_assign -------------------------------------------------------------------------

def _assign(points: torch.Tensor, centroids: torch.Tensor):
    """Dispatch without validation (inputs already checked)."""
    name, module = backend.select("kmeans_assign", points.device)
    if name == "reference":
        return kmeans_assign_ref(points, centroids)
    N = points.shape[0]
    labels = torch.empty(N, dtype=torch.int64, device=points.device)
    sqdist = torch.empty(N, dtype=points.dtype, device=points.device)
    if name == "native":
        module.kmeans_assign(cpu_numpy(points), cpu_numpy(centroids), cpu_numpy(labels), cpu_numpy(sqdist))
    elif name == "triton":
        module.kmeans_assign(points, centroids, labels, sqdist)
    else:  # cuda: raw device pointers on the current stream of the tensors' device
        dev, dt = points.device, points.dtype
        with torch.cuda.device(dev):
            _cuda.launch("kmeans_assign", module.kmeans_assign, _cuda.ptr(points, "points", dev, dt),
                         _cuda.ptr(centroids, "centroids", dev, dt), _cuda.ptr(labels, "labels", dev, torch.int64),
                         _cuda.ptr(sqdist, "sqdist", dev, dt), N, centroids.shape[0], points.shape[1],
                         _cuda.dtype_name(points), _cuda.stream(points))
    return labels, sqdist


def kmeans_assign(points, centroids):
    """Nearest centroid of every point: ``(labels int64 [N], sqdist [N])``."""
    points_t, is_np = _validate_points(points, finite=False)
    centroids_t = _validate_centroids(centroids, points_t, finite=False)
    labels, sqdist = _assign(points_t, centroids_t)
    # A NaN or inf in the inputs makes some distance non-finite: checking the N distances
    # replaces a second pass over the [N, d] points; the full check then names the culprit.
    if not bool(torch.isfinite(sqdist).all()):
        check_finite(points_t, "points")
        check_finite(centroids_t, "centroids")
    return out_like(labels, is_np), out_like(sqdist, is_np)


def kmeans_assign_ref(points, centroids, *, chunk: int = 4096):
    """Pure-torch reference: squared differences in chunks of points, then argmin (which
    returns the first minimum, i.e. ties go to the lowest index)."""
    points_t, is_np = as_tensor(points, "points")
    c, _ = as_tensor(centroids, "centroids")
    labels = torch.empty(points_t.shape[0], dtype=torch.int64, device=points_t.device)
    sqdist = torch.empty(points_t.shape[0], dtype=points_t.dtype, device=points_t.device)
    for s in range(0, points_t.shape[0], chunk):
        blk = points_t[s:s + chunk]
        dist = ((blk[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        sqdist[s:s + chunk], labels[s:s + chunk] = dist.min(dim=1)
    return out_like(labels, is_np), out_like(sqdist, is_np)


# ---- Lloyd update --------------------------------------------------------------------------

def _update(points, labels, weights, centroids) -> torch.Tensor:
    """centroids <- weighted cluster means in place; returns the weight of each cluster."""
    name, module = backend.select("kmeans_update", points.device)
    if name == "reference":
        return kmeans_update_ref(points, labels, weights, centroids)
    wsum = torch.empty(centroids.shape[0], dtype=torch.float64, device=points.device)
    if name == "native":
        module.kmeans_update(cpu_numpy(points), cpu_numpy(labels), None if weights is None else cpu_numpy(weights),
                             cpu_numpy(centroids), cpu_numpy(wsum))
    else:  # GPU backends: a segmented reduction over the points sorted (stably) by label
        K = centroids.shape[0]
        order = torch.sort(labels, stable=True).indices
        seg = torch.zeros(K + 1, dtype=torch.int64, device=labels.device)
        seg[1:] = torch.cumsum(torch.bincount(labels, minlength=K), 0)
        if name == "triton":
            module.kmeans_update(points, order, seg, weights, centroids, wsum)
        else:
            dev, dt = points.device, points.dtype
            with torch.cuda.device(dev):
                _cuda.launch("kmeans_update", module.kmeans_update, _cuda.ptr(points, "points", dev, dt),
                             _cuda.ptr(order, "order", dev, torch.int64), _cuda.ptr(seg, "seg", dev, torch.int64),
                             _cuda.ptr(weights, "weights", dev, dt), _cuda.ptr(centroids, "centroids", dev, dt),
                             _cuda.ptr(wsum, "wsum", dev, torch.float64), points.shape[0], K, points.shape[1],
                             _cuda.dtype_name(points), _cuda.stream(points))
    return wsum


def kmeans_update_ref(points, labels, weights, centroids) -> torch.Tensor:
    """Pure-torch reference of the Lloyd update (float64 sums, empty clusters unchanged)."""
    K = centroids.shape[0]
    w = torch.ones(points.shape[0], dtype=torch.float64, device=points.device) if weights is None \
        else weights.to(torch.float64)
    wsum = torch.zeros(K, dtype=torch.float64, device=points.device).index_add_(0, labels, w)
    sums = torch.zeros(K, points.shape[1], dtype=torch.float64, device=points.device)
    sums.index_add_(0, labels, points.to(torch.float64) * w[:, None])
    keep = wsum > 0
    centroids[keep] = (sums[keep] / wsum[keep, None]).to(centroids.dtype)
    return wsum


# ---- kmeans ----------------------------------------------------------------------------------

@dataclass
class KMeans:
    centroids: torch.Tensor       # [K, d]
    labels: torch.Tensor          # int64 [N]
    inertia: float                # Σ_i w_i ‖x_i − c_{label_i}‖²
    iterations: int               # Lloyd updates performed
    history: List[float] = field(default_factory=list)  # inertia after seeding and each update


def _kmeans_pp(points, k, weights, seed, assign: Callable) -> torch.Tensor:
    """k-means++ seeding: D²·w sampling from a CPU generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    N = points.shape[0]
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.detach().cpu().to(torch.float64)

    def draw(prob: torch.Tensor) -> int:
        cdf = torch.cumsum(prob, 0)
        u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
        return min(int(torch.searchsorted(cdf, u, right=True)), N - 1)

    centroids = torch.empty(k, points.shape[1], dtype=points.dtype, device=points.device)
    centroids[0] = points[draw(w)]
    d2 = assign(points, centroids[:1])[1].detach().cpu().to(torch.float64)
    for j in range(1, k):
        prob = d2 * w
        centroids[j] = points[draw(prob if float(prob.sum()) > 0 else w)]
        d2 = torch.minimum(d2, assign(points, centroids[j:j + 1])[1].detach().cpu().to(torch.float64))
    return centroids


def _lloyd(points, k, init, iters, tol, seed, weights, assign: Callable, update: Callable) -> KMeans:
    if isinstance(init, str):
        centroids = _kmeans_pp(points, k, weights, seed, assign)
    else:
        centroids = init.clone()
    w64 = None if weights is None else weights.to(torch.float64)

    def inertia_of(sq):
        return float(sq.to(torch.float64).sum() if w64 is None else (sq.to(torch.float64) * w64).sum())

    labels, sq = assign(points, centroids)
    history = [inertia_of(sq)]
    # Stop when the centroids move less than tol times the data's mean per-feature variance.
    scale = float(points.to(torch.float64).var(dim=0, unbiased=False).sum()) if points.shape[0] > 1 else 0.0
    it = 0
    for it in range(1, iters + 1):
        previous = centroids.clone()
        update(points, labels, weights, centroids)
        new_labels, sq = assign(points, centroids)
        history.append(inertia_of(sq))
        shift = float(((centroids - previous).to(torch.float64) ** 2).sum())
        unchanged = bool(torch.equal(new_labels, labels))
        labels = new_labels
        if unchanged or shift <= tol * scale:
            break
    return KMeans(centroids, labels, history[-1], it, history)


def _validate_kmeans(points, k, init, iters, tol, seed, weights):
    points_t, is_np = _validate_points(points)
    N = points_t.shape[0]
    if isinstance(init, str):
        if init != "k-means++":
            raise ValueError(f"init: expected 'k-means++' or a [k, d] tensor of centroids, got {init!r}")
        k = check_positive_int(k, "k")
        if k > N:
            raise ValueError(f"k: expected at most N = {N} clusters (one per point), got {k}")
        init_t = init
    else:
        init_t = _validate_centroids(init, points_t, "init")
        if k is not None and init_t.shape[0] != k:
            raise ValueError(f"init: expected {k} centroids (k), got {init_t.shape[0]}")
        k = init_t.shape[0]
    iters = check_positive_int(iters, "iters", minimum=0)
    tol = check_real(tol, "tol", minimum=0.0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    w = None
    if weights is not None:
        w, _ = as_tensor(weights, "weights")
        check_float(w, "weights", points_t.dtype)
        check_device(w, "weights", points_t.device)
        check_shape(w, "weights", (N,), f"[N] = [{N}]")
        check_finite(w, "weights")
        if bool((w < 0).any()) or not float(w.sum()) > 0:
            raise ValueError("weights: expected non-negative weights with a positive sum")
        w = w.contiguous()
    return points_t, is_np, k, init_t, iters, tol, int(seed), w


def _as_result(res: KMeans, is_np: bool) -> KMeans:
    if is_np:
        res.centroids, res.labels = res.centroids.numpy(), res.labels.numpy()
    return res


def kmeans(points, k=None, *, init="k-means++", iters: int = 100, tol: float = 1e-6, seed: int = 0,
           weights=None) -> KMeans:
    """Lloyd's k-means on ``points [N, d]``.

    ``init`` is "k-means++" (seeded by ``seed``) or ``[k, d]`` starting centroids (a warm
    start; ``k`` may then be omitted). Iteration stops after ``iters`` updates, when no label
    changes, or when the squared centroid shift falls below ``tol`` times the total variance
    of the points. ``weights [N]`` are sample weights. The inertia never increases across
    iterations; ``history`` records it.
    """
    points_t, is_np, k, init_t, iters, tol, seed, w = _validate_kmeans(points, k, init, iters, tol, seed, weights)
    return _as_result(_lloyd(points_t, k, init_t, iters, tol, seed, w, _assign, _update), is_np)


def kmeans_ref(points, k=None, *, init="k-means++", iters: int = 100, tol: float = 1e-6, seed: int = 0,
               weights=None) -> KMeans:
    """Pure-torch reference of ``kmeans`` (the same Lloyd loop on the reference primitives)."""
    points_t, is_np, k, init_t, iters, tol, seed, w = _validate_kmeans(points, k, init, iters, tol, seed, weights)
    return _as_result(_lloyd(points_t, k, init_t, iters, tol, seed, w, kmeans_assign_ref, kmeans_update_ref), is_np)
