"""PERM's mixing weights over a pool of clients (``PERM(alpha_pool=s)``).

Exact α solves, for every client i, a water-filling over all m clients: m² costs ‖g_i − g_j‖² (the
screens of ``perm.screened_weights`` compute only those that can carry weight, but how many that is
depends on the gradients: ~8% of the pairs late in a run at m = 2,000), and an [m, m] result: 80 GB
at 10⁵ clients. The pooled α restricts every client's weights to a pool P of s clients drawn
uniformly (the same for every row, drawn again at every recomputation) and its own client:

    α_i = argmin_{α ∈ simplex over P ∪ {i}}  Σ_j α_j ‖g_i − g_j‖² + λ_α Σ_j α_j² / n_j,

the problem of exact α on the candidates P ∪ {i} (issue 24: "or on a sample of clients"). It
costs one [m, s] product and a water-filling of [m, s + 1]: O(m·s·d) whatever the gradients, and
it is stored as ``[m, s + 1]``: columns 0..s−1 the weights on the pool's clients (ascending ids),
column s the weight on the row's own client (where that client is in the pool, its pool column
holds 0 and its weight is in column s). Over a single-loop run the pool changes at every
recomputation, so every client is a candidate in turn. A client's weights sit on fewer
neighbours than exact α gives it: bench/server_steps.py part (g) measures what that costs in
accuracy.

Precision: the costs are the Gram formula ‖s_i‖² + ‖s_j‖² − 2 s_i·s_j of the rows shifted by the
pool's mean, in float64 (``weights``' ``products``); the own client's cost is exactly 0. The
products are torch's (BLAS), taken in blocks of fixed shape with each row at a place fixed by its
client id, so that a row's bits do not depend on the rows computed with it (a rank's shard or one
process) nor, on the machines tests/test_perm_pool.py ran on, on the thread count; across CPUs
they may differ.
"""
from __future__ import annotations

from typing import Optional

import torch

from pflcore import backend
from pflcore._sampling import randperm_prefix

CHUNK_ROWS = 256  # rows per product and water-filling: their float64 temporaries stay in L2
# (1,024 rows: ~10% slower at m = 2,000, s = 100), and stay bounded at 10⁶ clients
_M63 = 0x7FFFFFFFFFFFFFFF


def draw(m: int, size: int, seed: int, refresh: int) -> torch.Tensor:
    """``int64 [s]`` ascending: the pool of the recomputation numbered ``refresh`` (s = min(size, m)),
    from a counter-based stream of ``seed`` (the same on every rank and at any thread count)."""
    key = (seed * 0x9E3779B97F4A7C15 + (refresh + 1) * 0xBF58476D1CE4E5B9 + 0x5A11) & _M63
    return randperm_prefix(m, min(int(size), m), key).sort().values


def weights(G_rows: torch.Tensor, sizes_rows: torch.Tensor, row_ids: torch.Tensor, G_pool: torch.Tensor,
            sizes_pool: torch.Tensor, pool: torch.Tensor, lam_alpha: float,
            products: torch.dtype = torch.float64) -> torch.Tensor:
    """``float64 [r, s + 1]``: the pooled α of the clients ``row_ids`` ([r], consecutive global ids;
    their gradients ``G_rows [r, d]`` and sample counts ``sizes_rows [r]``) over the pool ``pool``
    ([s] ascending global ids; ``G_pool [s, d]``, ``sizes_pool [s]``). Layout: see the module.

    ``products``: the precision of the products s_i·s_j: float64 (default; every cost to float64
    rounding of the gradients as given: ~1.5x the time of float32 products at m = 2,000, s = 100)
    or ``torch.float32`` (each cost within ~√d·2⁻²⁴·(‖s_i‖² + ‖s_j‖²) of its value, s the rows
    shifted by the pool's mean: α within ~3e-5 of the float64 solve at the one-round w̃ of
    bench/server_steps.py, whose 4 contexts are far apart)."""
    from pflcore.algorithms.perm import _row_sumsq  # (perm imports this module)
    if products not in (torch.float32, torch.float64):
        raise ValueError(f"products: expected torch.float32 or torch.float64, got {products!r}")
    r, s = G_rows.shape[0], pool.numel()
    out = torch.empty(r, s + 1, dtype=torch.float64, device=G_rows.device)
    if r == 0:
        return out
    # the rows shifted by the pool's mean (any shift is exact; this one keeps the costs small), in
    # the products' precision (a float32 shift would round float64 products' inputs)
    mu = G_pool.to(torch.float64).mean(dim=0).to(products)
    Sp = G_pool.to(products) - mu  # [s, d]
    sq_p = _row_sumsq(Sp.to(torch.float64))  # [s]
    w_pool = sizes_pool.to(device=G_rows.device, dtype=torch.float64) / (2.0 * lam_alpha)
    w_cols = torch.cat([w_pool, w_pool.new_ones(1)])  # (the last column's weight comes per row)
    w_own = sizes_rows.to(device=G_rows.device, dtype=torch.float64) / (2.0 * lam_alpha)
    # where a row's own client is in the pool: its pool column's cost is pushed to 2/w_i, above the
    # level (τ_i ≤ the level of the own column alone, 0 + 1/w_i), so it takes weight 0 and the own
    # weight is column s's alone
    pos = torch.searchsorted(pool, row_ids).clamp_(max=max(s - 1, 0))
    in_pool = (pool[pos] == row_ids) if s else torch.zeros(r, dtype=torch.bool, device=G_rows.device)
    adapter = backend.select("water_fill", None, out)
    # chunks of the client ids between multiples of CHUNK_ROWS, each multiplied as a whole
    # [CHUNK_ROWS, d] block (missing rows zero) with each row at its id's place in it: every product
    # has one shape and a row one place whichever rows come with it (one process, a rank's shard)
    first = int(row_ids[0])
    cuts = [0] + list(range(-first % CHUNK_ROWS or CHUNK_ROWS, r, CHUNK_ROWS)) + [r]
    block = None
    for a, b in zip(cuts, cuts[1:]):
        lead, at = (first + a) % CHUNK_ROWS, slice(a, b)
        if lead == 0 and b - a == CHUNK_ROWS:
            Sr = G_rows[at].to(products) - mu
            gram = torch.mm(Sr, Sp.T)
        else:
            if block is None:
                block = torch.empty(CHUNK_ROWS, G_rows.shape[1], dtype=products, device=G_rows.device)
            block.zero_()
            Sr = block[lead:lead + b - a]
            torch.sub(G_rows[at].to(products), mu, out=Sr)
            gram = torch.mm(block, Sp.T)[lead:lead + b - a]
        C = torch.empty(b - a, s + 1, dtype=torch.float64, device=G_rows.device)
        body = C[:, :s]
        torch.add(_row_sumsq(Sr.to(torch.float64))[:, None], sq_p[None, :], out=body)
        body.add_(gram.to(torch.float64), alpha=-2.0).clamp_(min=0.0)
        C[:, s] = 0.0
        mine = torch.nonzero(in_pool[at]).flatten()
        C[mine, pos[at][mine]] = 2.0 / w_own[at][mine]
        if adapter is backend.REFERENCE:
            out[at] = adapter.water_fill(C, w_cols, 256, w_own[at])
        else:
            out[at] = adapter.water_fill(C, w_cols, w_own[at])
    return out


def weights_ref(G: torch.Tensor, sizes: torch.Tensor, pool: torch.Tensor, lam_alpha: float,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[r, m]`` float64: the pooled α of the rows ``rows`` (default all) of ``G [m, d]`` written out
    densely, from the definition: each row's water-filling (``perm.water_filling_ref``) over the
    float64 distances (``perm.pairwise_sqdist``) to its candidates P ∪ {i} alone."""
    from pflcore.algorithms.perm import pairwise_sqdist, water_filling_ref
    m = G.shape[0]
    rows = torch.arange(m) if rows is None else rows
    D = pairwise_sqdist(G)
    out = torch.zeros(rows.numel(), m, dtype=torch.float64)
    for q, i in enumerate(rows.tolist()):
        cand = torch.unique(torch.cat([pool, torch.tensor([i])]))
        out[q, cand] = water_filling_ref(D[i, cand][None, :], sizes[cand], lam_alpha)[0]
    return out


def dense(alpha: torch.Tensor, pool: torch.Tensor, row_ids: torch.Tensor, m: int) -> torch.Tensor:
    """``float64 [r, m]``: pooled α ``[r, s + 1]`` (rows ``row_ids``) written out over all m clients."""
    s = pool.numel()
    out = torch.zeros(alpha.shape[0], m, dtype=torch.float64, device=alpha.device)
    out[:, pool] = alpha[:, :s]
    at = torch.arange(alpha.shape[0], device=alpha.device)
    out[at, row_ids] += alpha[:, s]  # (0 there before, where the own client is in the pool)
    return out


def at(alpha: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor,
       clients: torch.Tensor) -> torch.Tensor:
    """``float64 [n]``: the weight of pooled α's row ``rows[q]`` (local index; its client
    ``row_ids[q]``) on the client ``clients[q]`` (global id): its own column, its pool column, or 0."""
    s = pool.numel()
    own = alpha[rows, s]
    if s == 0:
        return torch.where(clients == row_ids, own, torch.zeros_like(own))
    pos = torch.searchsorted(pool, clients).clamp_(max=s - 1)
    pooled = torch.where(pool[pos] == clients, alpha[rows, pos], torch.zeros_like(own))
    return torch.where(clients == row_ids, own, pooled)
