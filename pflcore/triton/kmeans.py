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
in two passes, so that a large cluster is summed by many programs: pass 1 splits the sorted
order into chunks of ROWS positions and sums each chunk's piece of each cluster it meets;
pass 2 adds a cluster's pieces in chunk order. Every sum runs in a fixed order (no atomics):
the result is bitwise the same run to run. A cluster with wsum = 0 keeps its centroid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pflcore.triton._util import BLOCK_BUDGET, launch_device, next_pow2, row_offset


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
def _partial_kernel(
    points_ptr,    # [N, d]
    order_ptr,     # [N] int64 point indices sorted by label (stable)
    labels_ptr,    # [N] int64 labels
    seg_ptr,       # [K + 1] int64 start of each cluster's run in order
    weights_ptr,   # [N] sample weights (HAS_WEIGHTS)
    partial_ptr,   # [num_chunks + K, d] float64 piece sums, row c + k for (chunk c, cluster k)
    wpartial_ptr,  # [num_chunks + K] float64 piece weights
    N, d, ROWS,
    HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 1: chunk c = positions [c·ROWS, (c+1)·ROWS) of ``order``. For each cluster k whose
    run meets the chunk, in order: partial[c + k] = Σ_{t ∈ chunk ∩ seg k} w_t·x_t (float64),
    wpartial[c + k] = Σ w_t. The (c, k) pieces form a staircase (c and k never decrease, one
    of them grows), so c + k numbers them without collisions."""
    c = tl.program_id(0).to(tl.int64)
    start = c * ROWS
    stop = tl.minimum(start + ROWS, N)
    k = tl.load(labels_ptr + tl.load(order_ptr + start))  # the cluster of the chunk's first point
    for jt in range(tl.program_id(1), tl.cdiv(d, BLOCK_D), tl.num_programs(1)):  # past the 65,535 grid limit
        jj = jt * BLOCK_D + tl.arange(0, BLOCK_D)
        jmask = jj < d
        pos = start
        kk = k
        while pos < stop:
            end = tl.minimum(tl.load(seg_ptr + kk + 1), stop)
            acc = tl.zeros([BLOCK_D], dtype=tl.float64)
            wacc = tl.zeros([BLOCK_T], dtype=tl.float64)
            for t0 in range(pos, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tmask = t < end
                idx = tl.load(order_ptr + t, mask=tmask, other=0)
                if HAS_WEIGHTS:
                    w = tl.load(weights_ptr + idx, mask=tmask, other=0.0).to(tl.float64)
                else:
                    w = tl.where(tmask, 1.0, 0.0).to(tl.float64)
                x = tl.load(points_ptr + idx[:, None] * d + jj[None, :], mask=tmask[:, None] & jmask[None, :],
                            other=0.0)
                acc += tl.sum(x.to(tl.float64) * w[:, None], axis=0)
                wacc += w
            tl.store(partial_ptr + row_offset(c + kk, d) + jj, acc, mask=jmask)
            if jt == 0:
                tl.store(wpartial_ptr + c + kk, tl.sum(wacc, axis=0))
            pos = end
            kk += 1


@triton.jit
def _combine_kernel(
    seg_ptr,       # [K + 1] int64 start of each cluster's run in order
    partial_ptr,   # [num_chunks + K, d] float64 pass 1's piece sums
    wpartial_ptr,  # [num_chunks + K] float64 pass 1's piece weights
    centroids_ptr, # [K, d] updated in place where the cluster's weight is > 0
    wsum_ptr,      # [K] float64 cluster weights
    d, ROWS,
    BLOCK_D: tl.constexpr,
):
    """Pass 2: wsum[k] = Σ_c wpartial[c + k], c_k = Σ_c partial[c + k] / wsum[k], over the chunks
    c = s0 // ROWS .. (s1 − 1) // ROWS of cluster k's run [s0, s1) in ascending order: a fixed
    order, so the result is bitwise the same run to run. wsum = 0 keeps the centroid."""
    k = tl.program_id(0).to(tl.int64)
    dt = centroids_ptr.dtype.element_ty
    s0 = tl.load(seg_ptr + k)
    s1 = tl.load(seg_ptr + k + 1)
    c0 = s0 // ROWS
    c1 = tl.where(s1 > s0, (s1 - 1) // ROWS + 1, c0)
    for jt in range(tl.program_id(1), tl.cdiv(d, BLOCK_D), tl.num_programs(1)):
        jj = jt * BLOCK_D + tl.arange(0, BLOCK_D)
        jmask = jj < d
        acc = tl.zeros([BLOCK_D], dtype=tl.float64)
        total = tl.zeros([BLOCK_D], dtype=tl.float64)  # as a block: the interpreter cannot `&` a scalar
        for c in range(c0, c1):
            acc += tl.load(partial_ptr + row_offset(c + k, d) + jj, mask=jmask, other=0.0)
            total += tl.load(wpartial_ptr + c + k + jj * 0)
        if jt == 0:
            tl.store(wsum_ptr + k, tl.max(total, axis=0))
        keep = total > 0
        tl.store(centroids_ptr + k * d + jj, (acc / tl.where(keep, total, 1.0)).to(dt), mask=jmask & keep)


def kmeans_assign(points, centroids, labels, sqdist):
    """``labels [N]`` int64 and ``sqdist [N]`` of the nearest centroid (see the module doc)."""
    N, d = points.shape
    K = centroids.shape[0]
    if N == 0:
        return
    const = assign_blocks(K, d)
    with launch_device(points):
        _assign_kernel[(triton.cdiv(N, const["BLOCK_M"]),)](points, centroids, labels, sqdist, N, K, d, **const)


def assign_blocks(K: int, d: int) -> dict:
    """The constexprs of the assignment (BLOCK_M points x BLOCK_K centroids x BLOCK_D features)."""
    scale = BLOCK_BUDGET // 4096
    block_d = min(32 * scale, next_pow2(d))
    block_k = min(16, next_pow2(K))
    block_m = max(1, min(32 * scale, 2 * BLOCK_BUDGET // (block_k * block_d)))
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d)


def update_blocks(d: int):
    """(BLOCK_T, BLOCK_D, ROWS) of the update: BLOCK_T points x BLOCK_D features a load, ROWS
    positions of the sorted order a pass-1 program (a chunk: 16 loads in sequence, not a whole
    cluster's ~N/K)."""
    block_d = min(128 * BLOCK_BUDGET // 4096, next_pow2(d))
    block_t = max(1, min(64 * BLOCK_BUDGET // 4096, BLOCK_BUDGET // block_d))
    return block_t, block_d, 16 * block_t


# Largest grid extent of axes 1 and 2 (CUDA); the kernels loop over feature tiles past it.
MAX_GRID_Y = 65535


def kmeans_update(points, labels, order, seg, weights, centroids, wsum, *, rows=None):
    """``centroids [K, d]`` ← weighted cluster means in place and ``wsum [K]`` float64 ← cluster
    weights, given ``labels [N]`` int64, ``order [N]`` (point indices sorted stably by label) and
    ``seg [K + 1]`` int64 (the start of each cluster's run in ``order``): pass 1 sums chunks of
    the sorted points, pass 2 adds each cluster's chunks in chunk order. ``rows`` overrides the
    chunk length ROWS (tests: many chunks per cluster)."""
    N, d = points.shape
    K = centroids.shape[0]
    block_t, block_d, chunk = update_blocks(d)
    chunk = rows or chunk
    chunks = triton.cdiv(N, chunk)
    tiles = min(triton.cdiv(d, block_d), MAX_GRID_Y)
    partial = torch.empty(chunks + K, d, dtype=torch.float64, device=points.device)
    wpartial = torch.empty(chunks + K, dtype=torch.float64, device=points.device)
    with launch_device(points):
        if chunks:
            _partial_kernel[(chunks, tiles)](points, order, labels, seg, weights if weights is not None else points,
                                             partial, wpartial, N, d, chunk, HAS_WEIGHTS=weights is not None,
                                             BLOCK_T=block_t, BLOCK_D=block_d)
        _combine_kernel[(K, tiles)](seg, partial, wpartial, centroids, wsum, d, chunk, BLOCK_D=block_d)
