"""Lloyd's loop composed from an implementation's assignment and update (DESIGN.md §4).

The reference backend's ``kmeans_lloyd``, the loop of backends without a fused one (CUDA,
Triton), and the sharded loop (``ops.kmeans`` with a communicator: the update and every sum
become collectives). The native backend runs the same loop in one kernel call
(``csrc/cpu/kmeans.cpp``: ``kmeans_lloyd``). Part of the backends layer: imports only the
bottom layer.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from pflcore._comm import Comm

_ONE_PROCESS = Comm()
_CHUNK = 1 << 16  # rows per float64 chunk of the variance pass (no copy of all the points)


def total_variance(points: torch.Tensor, comm: Comm = _ONE_PROCESS) -> float:
    """Σ_i ‖x_i − mean‖² / N over every rank's points, float64: the scale of the stopping rule."""
    N = comm.sum(int(points.shape[0]))
    if N < 2:
        return 0.0
    mean = comm.sum(points.sum(0, dtype=torch.float64)) / N
    ss = 0.0
    for s in range(0, points.shape[0], _CHUNK):
        ss += float(((points[s:s + _CHUNK].to(torch.float64) - mean) ** 2).sum())
    return comm.sum(ss) / N


def lloyd_loop(points: torch.Tensor, centroids: torch.Tensor, weights: Optional[torch.Tensor], iters: int,
               tol: float, assign: Callable, update: Callable,
               comm: Comm = _ONE_PROCESS) -> Tuple[torch.Tensor, List[float], int]:
    """``centroids [K, d]`` (in place) after up to ``iters`` Lloyd updates from them; returns
    (labels int64 [N] of the last assignment, history: the inertia after each assignment, the
    updates performed). Stops when no label changes or when the squared centroid shift is at most
    ``tol`` times the points' total variance. ``assign(points, centroids) -> (labels, sqdist)``;
    ``update(points, labels, weights, centroids)`` sets each cluster's weighted mean in place
    (an empty cluster keeps its centroid)."""
    w64 = None if weights is None else weights.to(torch.float64)

    def inertia_of(sq):
        sq = sq.to(torch.float64)
        return comm.sum(float(sq.sum() if w64 is None else (sq * w64).sum()))

    labels, sq = assign(points, centroids)
    history = [inertia_of(sq)]
    scale = total_variance(points, comm) if tol > 0 else 0.0  # tol = 0: only a zero shift stops
    it = 0
    for it in range(1, iters + 1):
        previous = centroids.clone()
        update(points, labels, weights, centroids)
        new_labels, sq = assign(points, centroids)
        history.append(inertia_of(sq))
        shift = float(((centroids - previous).to(torch.float64) ** 2).sum())
        changed = comm.sum(int((new_labels != labels).sum()))
        labels = new_labels
        if changed == 0 or shift <= tol * scale:
            break
    return labels, history, it
