"""Triton kernels of k-means (DESIGN.md §4): the assignment fused with its argmin, and the
Lloyd update as a segmented reduction.

Assignment, for every point x_i (points [N, d], centroids [K, d]):
    dist(i, k) = Σ_j (x_ij − c_kj)²   (direct differences, so equal centroids give equal bits)
    labels[i]  = argmin_k dist(i, k), ties to the lowest k;   sqdist[i] = min_k dist(i, k)
A NaN distance wins, as in torch.min/argmin (the first such k), so non-finite inputs show up in
sqdist. A program holds BLOCK_M points and walks the centroids BLOCK_K at a time and the
features BLOCK_D at a time: the N × K distance matrix is never formed.

Update, with the points sorted by label (``order``, stable) and ``seg [K + 1]`` the offsets of
each cluster's run in that order:
    wsum[k] = Σ_{t ∈ seg k} w_t,   c_k = Σ_{t ∈ seg k} w_t·x_t / wsum[k]   (float64 sums)
one program per (cluster, BLOCK_D features); the sum over a segment runs in a fixed order, so
the result is deterministic (no atomics). A cluster with wsum = 0 keeps its centroid.
"""
from __future__ import annotations

import triton
import triton.language as tl

from pflcore.triton._util import BLOCK_BUDGET, launch_device, next_pow2


@triton.jit
def _assign_kernel(
    points_ptr,     # [N, d]
    centroids_ptr,  # [K, d]
    labels_ptr,     # [N] int64
    sqdist_ptr,     # [N] dtype of points
    N, K, d,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    dt = points_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    # NaN distances are ranked as −inf (never a real squared distance) so that the first one wins.
    best = tl.full([BLOCK_M], float("inf"), dt)
    arg = tl.zeros([BLOCK_M], dtype=tl.int64)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        dist = tl.zeros([BLOCK_M, BLOCK_K], dtype=dt)
        for j0 in range(0, d, BLOCK_D):
            jj = j0 + tl.arange(0, BLOCK_D)
            jmask = jj < d
            x = tl.load(points_ptr + rows[:, None] * d + jj[None, :], mask=rmask[:, None] & jmask[None, :], other=0.0)
            c = tl.load(centroids_ptr + kk[:, None].to(tl.int64) * d + jj[None, :],
                        mask=kmask[:, None] & jmask[None, :], other=0.0)
            diff = x[:, None, :] - c[None, :, :]
            dist += tl.sum(diff * diff, axis=2)
        key = tl.where(dist != dist, float("-inf"), dist)
        key = tl.where(kmask[None, :], key, float("inf"))
        tile_min = tl.min(key, axis=1)
        tile_arg = tl.argmin(key, axis=1, tie_break_left=True).to(tl.int64) + k0
        take = tile_min < best  # strict: an earlier tile keeps a tie
        best = tl.where(take, tile_min, best)
        arg = tl.where(take, tile_arg, arg)
    tl.store(labels_ptr + rows, arg, mask=rmask)
    tl.store(sqdist_ptr + rows, tl.where(best == float("-inf"), float("nan"), best), mask=rmask)


@triton.jit
def _update_kernel(
    points_ptr,     # [N, d]
    order_ptr,      # [N] int64 point indices sorted by label (stable)
    seg_ptr,        # [K + 1] int64 start of each cluster's run in order
    weights_ptr,    # [N] sample weights (HAS_WEIGHTS)
    centroids_ptr,  # [K, d] updated in place where the cluster's weight is > 0
    wsum_ptr,       # [K] float64 cluster weights
    d,
    HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    jt = tl.program_id(1)
    dt = centroids_ptr.dtype.element_ty
    jj = jt * BLOCK_D + tl.arange(0, BLOCK_D)
    jmask = jj < d
    s0 = tl.load(seg_ptr + k)
    s1 = tl.load(seg_ptr + k + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float64)
    wacc = tl.zeros([BLOCK_T], dtype=tl.float64)
    for t0 in range(s0, s1, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < s1
        idx = tl.load(order_ptr + t, mask=tmask, other=0)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + idx, mask=tmask, other=0.0).to(tl.float64)
        else:
            w = tl.where(tmask, 1.0, 0.0).to(tl.float64)
        x = tl.load(points_ptr + idx[:, None] * d + jj[None, :], mask=tmask[:, None] & jmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float64) * w[:, None], axis=0)
        wacc += w
    total = tl.sum(wacc, axis=0)
    if jt == 0:
        tl.store(wsum_ptr + k, total)
    total_d = tl.zeros([BLOCK_D], dtype=tl.float64) + total  # as a block: the interpreter cannot `&` a scalar
    keep = total_d > 0
    tl.store(centroids_ptr + k * d + jj, (acc / tl.where(keep, total_d, 1.0)).to(dt), mask=jmask & keep)


def kmeans_assign(points, centroids, labels, sqdist):
    """``labels [N]`` int64 and ``sqdist [N]`` of the nearest centroid (see the module doc)."""
    N, d = points.shape
    K = centroids.shape[0]
    if N == 0:
        return
    scale = BLOCK_BUDGET // 4096
    block_d = min(32 * scale, next_pow2(d))
    block_k = min(16, next_pow2(K))
    block_m = max(1, min(32 * scale, 2 * BLOCK_BUDGET // (block_k * block_d)))
    with launch_device(points):
        _assign_kernel[(triton.cdiv(N, block_m),)](points, centroids, labels, sqdist, N, K, d,
                                                     BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d)


def kmeans_update(points, order, seg, weights, centroids, wsum):
    """``centroids [K, d]`` ← weighted cluster means in place and ``wsum [K]`` float64 ← cluster
    weights, given ``order [N]`` (point indices sorted stably by label) and ``seg [K + 1]`` int64
    (the start of each cluster's run in ``order``)."""
    d = points.shape[1]
    K = centroids.shape[0]
    block_d = min(128 * BLOCK_BUDGET // 4096, next_pow2(d))
    block_t = max(1, min(64 * BLOCK_BUDGET // 4096, BLOCK_BUDGET // block_d))
    with launch_device(points):
        _update_kernel[(K, triton.cdiv(d, block_d))](points, order, seg, weights if weights is not None else points,
                                                    centroids, wsum, d, HAS_WEIGHTS=weights is not None,
                                                    BLOCK_T=block_t, BLOCK_D=block_d)
