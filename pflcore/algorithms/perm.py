"""PERM ("Distributed Personalized Empirical Risk Minimization"; DESIGN.md §5).

Personalized model i minimizes the mixture Σ_j α_{i,j} f_j of the clients' objectives. The
mixing weights come from the clients' gradients g_j = ∇f_j(w̃) at the FedAvg model w̃:

    α_i = argmin_{α ∈ simplex}  Σ_j α_j ‖g_i − g_j‖² + λ_α Σ_j α_j² / n_j

(a client with a similar gradient and many samples gets weight). The problem is a separable
strictly convex quadratic on the simplex, solved exactly for all m rows at once by
water-filling (``water_filling``).

Training (model shuffling): a permutation σ of the clients is drawn once; in shuffling round r
personalized model i visits client j = σ((i + r) mod m), which runs ``local_steps`` on it with
``grad_scale = m·α_{i,j}`` — one ``ops.local_steps`` call advances all m models, each on a
different client. Over an epoch of m rounds model i visits every client once, a pass of
permutation SGD on Σ_j α_{i,j} f_j. Pairs with α_{i,j} = 0 skip the gradient (their l2 shrink
θ ← (1 − lr·l2)^steps θ is applied directly).

Two-loop (default): ``warmup_rounds`` of FedAvg give w̃, α is computed once, then every round
is a shuffling round. ``single_loop=True``: FedAvg keeps training w̃ every round (on the sampled
clients) and α is recomputed every ``alpha_every`` shuffling rounds at the w̃ the round starts
from, from the gradients the clients compute there first (the paper's Algorithm 2: the server
takes its step on w̃ and the new α from the same gradients). With full-batch FedAvg steps, a
sampled client's first step is taken along its gradient from that pass, so a round that
recomputes α runs one gradient pass over the clients, not a pass for α beside its FedAvg steps.

Pooled α (``alpha_pool=s``): each model's weights over a pool of s clients drawn at each
recomputation and its own client, the same problem on those candidates (``_perm_pool``): one
[m, s] product instead of the screens' work on m² pairs, α stored as [m, s + 1]. Its weights sit
on fewer neighbours than exact α's, which costs accuracy (bench/server_steps.py part (g)); it is
what makes PERM run at 10⁵ clients and more, where an [m, m] α does not fit in memory.

Sharded runs (``pflcore.distributed``): a rank holds its clients' personalized models and their
rows of α [m_local, m]. α needs every client's gradient (one all-gather of G [m, d]); in a
shuffling round each model travels to the rank of the client it visits, takes its steps there
(one ``local_steps`` call per rank) and comes back: the models move, as they do in PERM itself.
A model row's steps do not depend on the other rows, so the models are bitwise those of one
process.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from pflcore import backend, ops
from pflcore import distributed
from pflcore.algorithms import _perm_pool, _perm_principal
from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive, replicate
from pflcore.backends import reference

_M63 = 0x7FFFFFFFFFFFFFFF


# ---- mixing weights -----------------------------------------------------------------------------

def pairwise_sqdist(G: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """``[r, m]`` float64 squared distances ‖g_i − g_j‖² between the rows ``rows`` of ``G [m, d]``
    (default all: ``[m, m]``) and every row.

    One Gram matrix in float64 after centring the rows (the gradients of similar clients are
    close, so their distance is a small difference of large norms: centring and float64 keep
    it accurate); the distance of a row to itself is exactly 0 and rounding never makes an
    entry negative."""
    Gc = G.to(torch.float64)
    Gc = Gc - Gc.mean(dim=0, keepdim=True)
    sq = (Gc * Gc).sum(dim=1)
    D = sq[rows, None] + sq[None, :]
    D.addmm_(Gc[rows], Gc.T, alpha=-2.0)  # in place: one [r, m] buffer
    D.clamp_(min=0.0)
    first = rows.start or 0
    own = torch.arange(D.shape[0], device=D.device)
    D[own, own + first] = 0.0
    return D


def water_filling(costs: torch.Tensor, counts: torch.Tensor, lam_alpha: float, *, candidates: int = 256) -> torch.Tensor:
    """Rows α_i [m, k] of  argmin_{α ∈ simplex} Σ_j c_{i,j} α_j + λ_α Σ_j α_j² / n_j,  exactly.

    KKT: α_j = max(0, (τ_i − c_{i,j})·w_j) with w_j = n_j/(2λ_α) and the level τ_i such that
    Σ_j α_j = 1. The backend's ``water_fill`` finds the levels: the native kernel by Michelot's
    active-set iteration (csrc/cpu/water_fill.cpp: a few passes over a shrinking list of
    columns), the reference by sorting each row's ``candidates`` smallest costs
    (``pflcore.backends.reference.water_fill``; 256: at m = 2,000 clients of 4 contexts a row has
    ~90 active weights, up to ~160). Both compute the level of the same active set, so they agree
    to rounding.

    Args: costs ``[m, k]`` (finite), counts ``[k]`` positive sample counts n_j, lam_alpha > 0.
    Returns float64 ``[m, k]``, rows on the simplex.
    """
    if costs.dim() != 2:
        raise ValueError(f"costs: expected shape [m, k], got {list(costs.shape)}")
    k = costs.shape[1]
    if counts.shape != (k,):
        raise ValueError(f"counts: expected shape [{k}] (one per column of costs), got {list(counts.shape)}")
    if not math.isfinite(float(costs.sum())) and not bool(torch.isfinite(costs).all()):  # one cheap pass first
        raise ValueError("costs: expected finite values")
    if not bool((counts > 0).all()):
        raise ValueError("counts: expected positive sample counts")
    lam = positive(lam_alpha, "lam_alpha", "water_filling")
    c = costs.to(torch.float64)  # read only: the output is a new tensor
    w = counts.to(device=c.device, dtype=torch.float64) / (2.0 * lam)
    if c.shape[0] == 0 or k == 0:
        return torch.zeros(c.shape, dtype=torch.float64, device=c.device)
    adapter = backend.select("water_fill", None, c)
    if adapter is backend.REFERENCE:
        return adapter.water_fill(c, w, candidates)
    return adapter.water_fill(c, w)


def water_filling_ref(costs: torch.Tensor, counts: torch.Tensor, lam_alpha: float, *,
                      candidates: int = 256) -> torch.Tensor:
    """``water_filling`` on the reference (pure torch: top-k candidates, then a sort)."""
    with backend.reference():
        return water_filling(costs, counts, lam_alpha, candidates=candidates)


def _centred(G: torch.Tensor) -> torch.Tensor:
    """``G`` in float64 minus its column means (the centring of ``pairwise_sqdist``, the same
    bits), in one new ``[m, d]`` buffer."""
    Gc = G.to(torch.float64, copy=True)
    return Gc.sub_(Gc.mean(dim=0, keepdim=True))


def _row_sumsq(A: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``(A * A).sum(dim=1)`` (the same bits: each row's sum is the same reduction) in blocks of
    rows, so that the squares never fill an ``[m, d]`` buffer."""
    return torch.cat([(a * a).sum(dim=1) for a in A.split(block)]) if A.shape[0] else A.new_zeros(0)


class _Float64Rows:
    """The gradients' rows centred in float64 and their squared norms (``pairwise_sqdist``'s
    centring, the same bits), for the groups whose products are taken in float64: made on first
    use (from float32 gradients usually none is), once."""

    def __init__(self, G: torch.Tensor, S: torch.Tensor, sq: torch.Tensor):
        self._G = G
        self._rows = (S, sq) if S is not None and S.dtype is torch.float64 else None

    def get(self):
        if self._rows is None:
            Gc = _centred(self._G)
            self._rows = (Gc, _row_sumsq(Gc))
        return self._rows


@functools.lru_cache(maxsize=8)
def _projection(d: int, k: int) -> torch.Tensor:
    """The screen's random projection ``[d, k]`` (float64, a fixed seed: the same every call;
    drawn once per shape, ~0.2 ms at 610 x 16). Read only."""
    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randn(d, k, generator=gen, dtype=torch.float64)


def _farthest_point_labels(Y: torch.Tensor, k: int) -> torch.Tensor:
    """``int64 [m]`` labels of ``k`` clusters of the rows of ``Y``: farthest-point traversal
    (Gonzalez), each row labelled by its nearest centre. Its clusters have small radii, which is
    what the screen's triangle bounds need; any labelling would keep the result exact."""
    m = Y.shape[0]
    best = ((Y - Y[0]) ** 2).sum(dim=1)
    labels = torch.zeros(m, dtype=torch.int64, device=Y.device)
    for c in range(1, k):
        far = int(torch.argmax(best))  # ties: the lowest index
        if float(best[far]) <= 0.0:  # fewer distinct points than clusters
            break
        dist = ((Y - Y[far]) ** 2).sum(dim=1)
        labels = torch.where(dist < best, c, labels)
        best = torch.minimum(best, dist)
    return labels


def _native_with(G: torch.Tensor, kernel: str):
    """The native module where it has ``kernel`` and serves ``G``'s device (the CPU, not forced onto
    the reference backend), else None."""
    if G.device.type != "cpu" or backend.requested() == "reference":
        return None
    core = backend.loaded("native")
    return core if core is not None and hasattr(core, kernel) else None


def _screen_kernel(G: torch.Tensor, kernel: str = "perm_screen_stats"):
    """The native module where it has ``kernel`` for ``G`` (CPU, float32/float64, contiguous, not
    forced onto the reference backend; by default the screen's statistics), else None."""
    if G.dtype not in (torch.float32, torch.float64) or not G.is_contiguous():
        return None
    return _native_with(G, kernel)


def _screen_stats_native(G: torch.Tensor, omega: torch.Tensor, k: int):
    """``_screen_stats_torch`` in four native passes over G (csrc/cpu/perm_screen.cpp) on torch's
    threads: the shifted rows are not stored (S is None: a float32 G's float64 rows are made from G
    when a group needs them)."""
    m, d = G.shape
    q = omega.shape[1]
    om = omega.to(G.dtype).contiguous()
    labels = torch.empty(m, dtype=torch.int64)
    sq = torch.empty(m, dtype=torch.float64)
    mu = torch.empty(k, d, dtype=G.dtype)
    mu_sq = torch.empty(k, dtype=torch.float64)
    t = torch.empty(m * k, dtype=torch.float64)
    found = _screen_kernel(G).perm_screen_stats(G.dtype is torch.float64, G.data_ptr(), m, d, om.data_ptr(), q, k,
                                                labels.data_ptr(), sq.data_ptr(), mu.data_ptr(), mu_sq.data_ptr(),
                                                t.data_ptr())
    count = torch.bincount(labels, minlength=found).to(torch.float64)
    return None, sq, labels, count, mu_sq[:found], t[:m * found].view(m, found)


def _screen_stats_torch(G: torch.Tensor, omega: torch.Tensor, k: int):
    """The screen's statistics in torch: (the shifted rows S [m, d], their squared norms [m] float64,
    the farthest-point labels [m] of their projections S Ω, the clusters' sizes [k'] float64, their
    centres' squared norms [k'] float64, t [m, k'] float64 = ‖s_j − μ_b‖² by the Gram formula);
    k' <= k the clusters made."""
    m, d = G.shape
    if G.dtype is torch.float32:  # (any shift keeps the distances: the mean's rounding is harmless)
        S = G - G.mean(dim=0)
        sq_s = _row_sumsq(S).to(torch.float64)
    else:
        S = _centred(G)
        sq_s = _row_sumsq(S)
    # (Ωᵀ Gᵀ)ᵀ: MKL multiplies [m, d] by a narrow [d, 16] at ~4 GFLOP/s, the transposed product ~2.6× faster;
    # in the gradients' precision (any labelling keeps the result exact; the labels only decide how
    # much is screened)
    Y = torch.mm(omega.T.to(S.dtype), S.T).T
    labels = _farthest_point_labels(Y, k)
    k = int(labels.max()) + 1
    count = torch.bincount(labels, minlength=k).to(torch.float64)
    mu = torch.zeros(k, d, dtype=S.dtype, device=S.device).index_add_(0, labels, S).div_(count[:, None].to(S.dtype))
    mu_sq = (mu * mu).sum(dim=1, dtype=torch.float64)
    t = sq_s[:, None] + mu_sq[None, :] - 2.0 * torch.mm(mu, S.T).T.to(torch.float64)  # [m, k]
    return S, sq_s, labels, count, mu_sq, t


def screened_weights(G: torch.Tensor, sizes: torch.Tensor, lam_alpha: float, rows: slice = slice(None),
                     clusters: int = 16, projection: int = 16, products: Optional[torch.dtype] = None,
                     screen: str = "auto") -> torch.Tensor:
    """``water_filling(pairwise_sqdist(G, rows), sizes, lam_alpha)`` (to float rounding), without
    forming the distances of pairs that cannot carry weight.

    Two screens. The cluster screen below is planned first; where its plan would compute more
    than ``_perm_principal.CLUSTER_PAIRS_SHARE`` of the pairs (once FedAvg has run a while, the
    contexts stop being separable to its bounds), the pair screen of ``_perm_principal`` answers
    instead, on the CPU with the native module: every pair's cost bounded from the gradients'
    coordinates in 16 principal directions and their residuals' norms, the costs computed only for
    the pairs whose lower bound is below the row's level (one kernel call,
    csrc/cpu/water_fill_screened.cpp), as float64 differences of the gradients, or float32
    differences for float32 gradients (``products`` None or float32: each cost within ~1.1e-6 of
    its value, relatively). It declines where its candidates average over a quarter of the
    columns (gradients far from any low-dimensional subspace), and the cluster screen's plan is
    carried out. GPU tensors, the reference backend and float64 gradients with
    ``products=torch.float32`` keep the cluster screen. ``screen``: ``"auto"`` (that choice),
    ``"principal"`` (the pair screen however loose, where the kernel serves) or ``"clusters"``.

    The cluster screen. Where the clients' gradients form groups (the setting PERM is for), client i's weights sit
    on its own group and the m × m × d Gram matrix is mostly spent on zeros. The rows of G are
    clustered (farthest-point traversal in a random ``projection``; cheap, deterministic) and,
    with the cluster means μ_b and radii r_b in the full space, the triangle inequality bounds
    every distance of client i to a client of cluster b from below by
    ``(‖g_i − μ_b‖ − r_b)²``. Client i's water level τ_i is bounded from above by the level of
    any subset of its columns (Σ_j w_j·max(0, τ − c_j) ≥ 1 there), here the better of two
    single clients: i itself (2λ_α/n_i) and the largest client j of its cluster a
    (c_ij + 2λ_α/n_j, c_ij ≤ (‖g_i − μ_a‖ + r_a)²). A cluster
    whose lower bound reaches that level holds only zero weights for client i (α_ij > 0 needs
    c_ij < τ_i). The distances of the remaining pairs are computed (the Gram formula of
    ``pairwise_sqdist``, in the precision ``products`` says, one GEMM per group of row clusters
    that need the same column clusters) and water-filled over those columns; the others are 0. When
    nothing can be screened (gradients without groups) this is the dense computation.

    ``products``: the precision of those GEMMs. ``None`` (default): that of the gradients —
    float64 gradients, float64 products (the dense solve's α to ~1e-13); float32 gradients,
    float32 products of the group's rows shifted by its columns' mean (half the time of the
    float64 GEMM, which was most of the solve). The shift makes the rows' squared norms about
    half the group's mean pairwise distance, so the products' rounding is ~√d·2⁻²⁴ of that
    mean; a group whose mean squared norm exceeds 8× the smallest water level of its rows (the
    levels come out of the solve) is solved again in float64, so the rounding stays within ~1e-6
    of the levels. Measured at m = 2,000 (bench/server_steps.py): α within 4.4e-7 of the float64
    solve, where α from float64 gradients differs from α from the float32 ones by 3.9e-7 — the
    products add error of the order the gradients already carry. ``torch.float64``: float64
    products whatever the gradients' dtype; ``torch.float32``: float32 products, no fallback.

    Each group's costs ‖y_i‖² + ‖y_j‖² − 2y_i·y_j are formed, water-filled and written into the
    output rows by one kernel call (the backend's ``water_fill_gram``).

    Threads: the screen's statistics for float32 gradients (native passes over G,
    ``_screen_stats_native``) run on torch's t threads; the torch statistics (float64 gradients,
    or no native module), the bounds and the grouping on one (torch's intra-op threads set to 1:
    many small ops, which with 2 threads each on a 2-core machine shared with other processes took
    1.18 s where one thread took 0.17 s, m = 2,000, bench/server_steps.py); the groups one after
    another, each on the t threads (the products and the kernel split a group's rows between
    them). Every entry's arithmetic is the same whichever
    thread computes it, so the result is bitwise the same at any thread count.

    Returns float64 ``[r, m]`` (the rows ``rows``)."""
    threads = torch.get_num_threads()
    try:
        return _screened_weights(G, sizes, lam_alpha, rows, clusters, projection, products, threads, screen)
    finally:
        if torch.get_num_threads() != threads:  # (an error between the switches below)
            torch.set_num_threads(threads)


def _screened_weights(G: torch.Tensor, sizes: torch.Tensor, lam_alpha: float, rows: slice, clusters: int,
                      projection: int, products: Optional[torch.dtype], threads: int = 1,
                      screen: str = "auto") -> torch.Tensor:
    if G.dim() != 2 or G.shape[0] < 1:
        raise ValueError(f"G: expected shape [m, d] with m >= 1, got {list(G.shape)}")
    m, d = G.shape
    if sizes.shape != (m,):
        raise ValueError(f"sizes: expected shape [{m}] (one per row of G), got {list(sizes.shape)}")
    if not bool((sizes > 0).all()):
        raise ValueError("sizes: expected positive sample counts")
    if not math.isfinite(float(G.sum())) and not bool(torch.isfinite(G).all()):  # one cheap pass first
        raise ValueError("G: expected finite values")
    lam = positive(lam_alpha, "lam_alpha", "screened_weights")
    if products not in (None, torch.float32, torch.float64):
        raise ValueError(f"products: expected None, torch.float32 or torch.float64, got {products!r}")
    if screen not in ("auto", "principal", "clusters"):
        raise ValueError(f"screen: expected 'auto', 'principal' or 'clusters', got {screen!r}")
    low = products is torch.float32 or (products is None and G.dtype is not torch.float64)
    first, stop = rows.start or 0, m if rows.stop is None else rows.stop
    # the pair screen in a few principal directions (module _perm_principal): asked for, or (auto)
    # where the cluster screen's plan below would compute most pairs and the pair screen is tight
    core = None if screen == "clusters" or (products is torch.float32 and G.dtype is torch.float64) \
        else _perm_principal.kernel(G)
    f64_costs = products is torch.float64 or G.dtype is torch.float64
    if core is not None and screen == "principal":
        return _perm_principal.weights(G, sizes, lam, first, stop, f64_costs, core, math.inf)
    # The screen's sums in the gradients' precision, from their rows centred in it, with bounds on
    # their rounding; float64 only where a group's products need it (the centred float64 rows and
    # their norms were ~1.3 ms of a ~14 ms solve at m = 2,000).
    k = max(1, min(int(clusters), m))
    omega = _projection(d, min(int(projection), d)).to(G.device)
    # the rows shifted by their mean (s_j), their squared norms, the farthest-point clusters of their
    # projections, the clusters' centres μ_b (any points would do: the bounds below hold for any
    # centre) and t = ‖s_j − μ_b‖² of every client to every centre by the Gram formula, in the
    # gradients' precision; within ±E of the exact value: |fl(s·μ) − s·μ| ≤ γ_d‖s‖‖μ‖ with
    # γ_d ≈ d·u, the sums of squares' γ_d‖s‖², γ_d‖μ‖²
    # (float64 gradients: the torch statistics, whose shifted float64 rows every group's products reuse)
    # The native statistics run on the t threads; the torch code (its farthest-point loop is many
    # small ops) and the bounds' small ops below on one, then the groups on the t threads again.
    native = G.dtype is torch.float32 and _screen_kernel(G) is not None
    if native:
        S, sq_s, labels, count, mu_sq, t = _screen_stats_native(G, omega, k)
    if threads != 1:
        torch.set_num_threads(1)
    if not native:
        S, sq_s, labels, count, mu_sq, t = _screen_stats_torch(G, omega, k)
    k = count.numel()
    fine = _Float64Rows(G, S, sq_s)
    unit = torch.finfo(G.dtype).eps  # 2u
    G32 = G.to(torch.float32) if low else None
    bounds = _bounds_kernel(G) if k <= 62 else None
    if bounds is not None:  # the same bounds in one native call (csrc/cpu/perm_bounds.cpp), as bit keys
        keys = torch.empty(stop - first, dtype=torch.int64)
        sizes64 = sizes.to(dtype=torch.float64).contiguous()
        labels, sq_s, mu_sq, t = labels.contiguous(), sq_s.contiguous(), mu_sq.contiguous(), t.contiguous()
        bounds.perm_screen_need(m, k, d, unit, labels.data_ptr(), sq_s.data_ptr(), mu_sq.data_ptr(), t.data_ptr(),
                                sizes64.data_ptr(), float(lam), first, stop, keys.data_ptr())
        patterns, group = _patterns_of_keys(keys, k)
    else:
        patterns, group = _row_patterns(_screen_need(sq_s, mu_sq, t, labels, sizes, lam, d, unit, first, stop))
    patterns, group = _merged_patterns(patterns, group, count)
    w = sizes.to(device=G.device, dtype=torch.float64) / (2.0 * lam)
    adapter = backend.select("water_fill_gram", None, w)
    sym = None if adapter is backend.REFERENCE else _sym_kernel()
    tasks = [(torch.nonzero(group == g_idx).flatten(),  # the group's rows (ascending)
              torch.nonzero(patterns[g_idx][labels]).flatten())  # its columns: ascending client ids
             for g_idx in range(patterns.shape[0])]
    if core is not None:
        pairs = sum(r_idx.numel() * cols.numel() for r_idx, cols in tasks)
        if pairs > _perm_principal.CLUSTER_PAIRS_SHARE * (stop - first) * m:
            if threads != 1:
                torch.set_num_threads(threads)
            alpha = _perm_principal.weights(G, sizes, lam, first, stop, f64_costs, core)
            if alpha is not None:
                return alpha
    # every row of out belongs to one group, whose kernel call clears it (fill="row", in the worker
    # threads) before writing its weights: no zero-filled [r, m] buffer first (~1 ms at m = 2,000).
    # (Allocated after the choice of screen: a [r, m] allocated and left unused made the pair
    # screen's own output come from fresh pages, ~12 ms of page faults at m = 2,000.)
    out = torch.empty(stop - first, m, dtype=torch.float64, device=G.device)

    def solve(r_idx: torch.Tensor, cols: torch.Tensor) -> None:
        gi = r_idx + first
        every = cols.numel() == m
        some = None if every else cols
        # every row's own client is among its columns (ascending): its cost is exactly 0
        own = gi if every else torch.searchsorted(cols, gi)
        w_cols = w if every else w[cols]
        # the costs and their water-filling in one kernel call, α written into the rows of `out`
        # (a few rows: the columns' shift would cost more than it saves; a group a sample of whose
        # rows already shows the float64 pass to be needed: straight to it)
        if low and gi.numel() >= 64 and not (products is None and _float64_needed(G32, gi, cols, w_cols, own)):
            gram, sq_r, sq_c, spread = _shifted_gram32(G32, gi, some, sym, own)
            levels = adapter.water_fill_gram(gram, sq_r, sq_c, own, w_cols, out, r_idx, cols, fill="row")
            if products is not None or spread <= 8.0 * float(levels.min()):
                return
            # the float32 rounding could be large against the levels: the group again in float64,
            # every entry written (the float32 pass left its positive weights in these rows)
            again = True
        else:
            again = False
        Gc, sq = fine.get()
        adapter.water_fill_gram(_gram(Gc, gi, some, sym, own), sq[gi], sq if every else sq[cols], own, w_cols, out,
                                r_idx, cols, fill="block" if again else "row")

    # the groups one after another, each on every thread (its products and water-filling split
    # their rows between the OpenMP threads): the threads of the gradients' pass just before are
    # still spinning in libgomp, and worker threads of our own competed with them (~3 ms of a ~17 ms
    # α at m = 2,000, 2 threads)
    if threads != 1:
        torch.set_num_threads(threads)
    for r_idx, cols in tasks:
        solve(r_idx, cols)
    return out


def _screen_need(sq_s: torch.Tensor, mu_sq: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, sizes: torch.Tensor,
                 lam: float, d: int, unit: float, first: int, stop: int) -> torch.Tensor:
    """bool ``[r, k]``: the clusters whose clients may carry weight for rows ``first..stop`` (the
    screen's bounds, see ``screened_weights``; ``t`` is overwritten)."""
    m, k = t.shape
    norms = sq_s[:, None] + mu_sq[None, :]
    E = norms.mul_((d + 3) * unit).add_(1e-300)
    far = (t + E).clamp_(min=0.0).sqrt_()  # ‖s_j − μ_b‖ rounded up
    near = t.sub_(E).clamp_(min=0.0).sqrt_()  # and down
    # ‖g_j − μ_{a(j)}‖ rounded up, the clusters' radii (never underestimated)
    at = torch.arange(m, device=t.device)
    own = far[at, labels]
    radius = torch.zeros(k, dtype=torch.float64, device=t.device).scatter_reduce_(0, labels, own, "amax")
    # S's own rounding: s_j = (g_j − mean)(1 + δ), |δ| ≤ u, moves a distance ‖g_i − g_j‖ by at most
    # u(‖s_i‖ + ‖s_j‖), with ‖s_j‖ ≤ ‖μ_b‖ + r_b for a client j of cluster b
    moved = unit * (sq_s[first:stop].sqrt()[:, None] + mu_sq.sqrt()[None, :] + radius[None, :])  # [r, k]
    lower = (near[first:stop] - radius[None, :] - moved).clamp_(min=0.0) ** 2  # [r, k]
    inv_w = 2.0 * lam / sizes.to(device=t.device, dtype=torch.float64)
    # upper bounds of τ_i: the level of client i alone (c_ii = 0), or of the client of its cluster
    # with the most samples, at distance at most ‖g_i − μ_a‖ + r_a
    best = torch.full((k,), float("inf"), dtype=torch.float64, device=t.device)
    best.scatter_reduce_(0, labels, inv_w, "amin")
    mine = labels[first:stop]
    reach = own[first:stop] + radius[mine] + moved[torch.arange(stop - first, device=t.device), mine]
    level = torch.minimum(inv_w[first:stop], reach ** 2 + best[mine]) * (1.0 + 1e-9)
    need = lower < level[:, None]  # [r, k]: clusters that may hold weight for the row
    need[torch.arange(stop - first, device=t.device), labels[first:stop]] = True
    return need


def _bounds_kernel(G: torch.Tensor):
    """The native module where it computes the screen's bounds (``perm_screen_need``) for
    statistics of ``G`` (on the CPU, not forced onto the reference backend), else None."""
    return _native_with(G, "perm_screen_need")


def _key_bits(k: int, device) -> torch.Tensor:
    """int64 ``[k]``: the bit of each column in a row's key (column 0 most significant)."""
    return torch.pow(2, torch.arange(k - 1, -1, -1, device=device, dtype=torch.int64))


def _patterns_of_keys(keys: torch.Tensor, k: int):
    """``_row_patterns``' result from the rows' int64 keys (bit k − 1 − b for cluster b)."""
    bits = _key_bits(k, keys.device)
    uniq, group = torch.unique(keys, return_inverse=True)
    return ((uniq[:, None] // bits[None, :]) % 2).to(torch.bool), group


def _shifted_gram32(G32: torch.Tensor, rows: torch.Tensor, cols: Optional[torch.Tensor], sym=None,
                    pos: Optional[torch.Tensor] = None):
    """The float32 products ``[r, k]`` of ``G32[rows]`` and ``G32[cols]`` (``cols`` None: every
    row) shifted by the columns' mean, the shifted rows' and columns' squared norms, and the
    columns' mean squared norm (the scale of the products' rounding). Any common shift leaves the
    distances ‖y_i‖² + ‖y_j‖² − 2y_i·y_j as they are, even a rounded one (so the mean is taken in
    float32); this one makes the norms small (their mean is half the columns' mean pairwise
    distance). Where the rows are the columns, the squared norms are the products' diagonal: the
    same sums as the products (so a row's cost to itself is 0 before the clamp, and the rounding
    of the norms and of the products is alike); otherwise float64 sums. ``pos``: the rows' positions
    among the columns (every row's own client is one of its columns), with which the rows' products
    come from the columns' symmetric ones where that is cheaper (``_rows_of_symmetric``)."""
    C = G32 if cols is None else G32.index_select(0, cols)
    mu = C.mean(dim=0)
    Yc = C - mu if cols is None else C.sub_(mu)
    same = _same_clients(rows, cols, G32.shape[0])
    if same or _rows_of_symmetric(sym, rows, Yc, pos):
        full = _products(Yc, Yc, sym)
        sq_c = full.diagonal().to(torch.float64)
        if same:
            return full, sq_c, sq_c, float(sq_c.mean())
        return full.index_select(0, pos), sq_c.index_select(0, pos), sq_c, float(sq_c.mean())
    sq_c = (Yc * Yc).sum(dim=1, dtype=torch.float64)
    Yr = G32.index_select(0, rows).sub_(mu)
    return _products(Yr, Yc), (Yr * Yr).sum(dim=1, dtype=torch.float64), sq_c, float(sq_c.mean())


def _row_patterns(need: torch.Tensor):
    """``torch.unique(need, dim=0, return_inverse=True)`` for a bool ``[r, k]``: with k ≤ 62 the
    rows are packed into one int64 key each first (a 1-D unique; the dim=0 unique compares rows
    one by one: 14 ms of a 170 ms solve at m = 2,000). The patterns come out in the same order
    (ascending keys are the rows in lexicographic order read from the last column)."""
    r, k = need.shape
    if k > 62 or r == 0:
        return torch.unique(need, dim=0, return_inverse=True)
    return _patterns_of_keys((need.to(torch.int64) * _key_bits(k, need.device)).sum(dim=1), k)


MERGE_GROWTH = 1.25  # see _merged_patterns


def _merged_patterns(patterns: torch.Tensor, group: torch.Tensor, count: torch.Tensor):
    """The row groups of ``_row_patterns`` merged: a group joins one whose clusters include its
    own and whose columns are at most ``MERGE_GROWTH`` times as many.

    Any superset of the columns a row needs gives the same α (the extra columns are ones the
    screen proved to hold zero weight for it), so merging only changes how the work is cut: one
    larger product in place of several. Where a context's clients split into several patterns
    (some of its rows need a neighbouring cluster, others not), the small groups had taken
    float64 products of a few rows each (m = 2,000, bench/server_steps.py: 7 groups for one
    context of 500, six of them under 64 rows); merged, the context is one group whose rows are
    its columns (a symmetric product). Patterns are taken widest first: each joins the first kept
    pattern (in that order) that holds it within the growth, else it is kept. Deterministic:
    the order is by column count, then by pattern index.

    Args: patterns bool ``[P, k]``, group int64 ``[r]`` (a row's pattern), count ``[k]`` the
    clusters' sizes. Returns the kept patterns and the rows' new group indices."""
    P = patterns.shape[0]
    if P <= 1:
        return patterns, group
    width = (patterns.to(count.dtype) * count[None, :]).sum(dim=1).tolist()  # columns of each pattern
    pats = patterns.tolist()
    order = sorted(range(P), key=lambda q: (-width[q], q))
    kept, target = [], [0] * P
    for q in order:
        for h in kept:
            if width[h] <= MERGE_GROWTH * width[q] and all(b or not a for a, b in zip(pats[q], pats[h])):
                target[q] = h
                break
        else:
            target[q] = q
            kept.append(q)
    if len(kept) == P:
        return patterns, group
    kept.sort()
    new_index = {h: i for i, h in enumerate(kept)}
    remap = torch.tensor([new_index[target[q]] for q in range(P)], dtype=group.dtype, device=group.device)
    return patterns[kept], remap[group]


def _same_clients(rows: torch.Tensor, cols: Optional[torch.Tensor], m: int) -> bool:
    """Whether a group's rows are its columns (``cols`` None: all m clients): its Gram block is
    then symmetric (``_products`` of one tensor with itself)."""
    if cols is None:
        return rows.numel() == m and torch.equal(rows, torch.arange(m, device=rows.device))
    return torch.equal(rows, cols)


def _gram(Gc: torch.Tensor, rows: torch.Tensor, cols: Optional[torch.Tensor], sym=None,
          pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Gc[rows] @ Gc[cols].T`` (``cols`` None: every row of Gc), a fresh ``[r, k]``; ``pos`` as
    in ``_shifted_gram32``."""
    right = Gc if cols is None else Gc[cols]
    if _same_clients(rows, cols, Gc.shape[0]):
        return _products(right, right, sym)
    if _rows_of_symmetric(sym, rows, right, pos):
        return _products(right, right, sym).index_select(0, pos)
    return _products(Gc[rows], right)


def _rows_of_symmetric(sym, rows: torch.Tensor, right: torch.Tensor, pos: Optional[torch.Tensor]) -> bool:
    """Whether a group's products ``[r, k]`` (its r rows among its k columns, at ``pos``) are
    better taken as the rows of the columns' symmetric products ``[k, k]``: with the native
    symmetric kernel and r ≥ k/2, where the triangle's k²/2 multiply-adds are at most r·k. (Once
    the gradients have shrunk, the screen leaves groups such as 1,847 rows of 2,000 columns;
    torch's float64 product of those ran MKL's generic kernels on AMD, ~2x the time.)"""
    return sym is not None and pos is not None and 2 * rows.numel() >= right.shape[0] and right.is_contiguous()


FLOAT64_PROBE_ROWS = 16  # see _float64_needed


def _float64_needed(G32: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, w_cols: torch.Tensor,
                    pos: torch.Tensor) -> bool:
    """Whether the float32 products of a large group (≥ 256 rows, ≥ 1,024 columns) would certainly
    be solved again in float64: the columns' spread (their mean squared distance to their mean)
    above 8x the smallest water level of a few of its rows. The smallest level of all rows is at
    most that of the sample, so the float32 pass's own test (spread ≤ 8x its smallest level) would
    fail too. The sample's costs are float32 products of the shifted rows, as the pass would form
    them (their rounding, ~√d·2⁻²⁴ of the spread, is far below the 1% margin where this matters).
    Once the gradients have shrunk (a single-loop run's later α, or a two-loop α after a longer
    warm-up), the levels sit far below the spread, the screen leaves groups of most columns, and
    every group went through both passes: float32 products, then float64 (m = 2,000, 1 thread: α
    in ~220 ms, ~100 with this test; bench/server_steps.py part (d)). Smaller groups are not
    probed: their float32 pass costs little more than the probe."""
    r, k = rows.numel(), cols.numel()
    if r < 256 or k < 1024:
        return False
    C = G32.index_select(0, cols)
    mu = C.mean(dim=0)
    C.sub_(mu)
    sq_c = (C * C).sum(dim=1, dtype=torch.float64)
    probe = torch.linspace(0, r - 1, FLOAT64_PROBE_ROWS).round().to(torch.int64).unique()
    R = G32.index_select(0, rows[probe]).sub_(mu)
    costs = (R * R).sum(dim=1, dtype=torch.float64)[:, None] + sq_c[None, :] - 2.0 * (R @ C.T).to(torch.float64)
    costs.clamp_(min=0.0)[torch.arange(probe.numel()), pos[probe]] = 0.0
    return float(sq_c.mean()) > 8.0 * 1.01 * float(reference.water_levels(costs, w_cols).min())


def _sym_kernel():
    """The native module where its symmetric products (``sym_products``, csrc/cpu/sym_products.cpp)
    beat torch's: the avx512 level (2.2x MKL's at 500 x 610, float32, AMD Zen 5, one thread: MKL
    runs its 256-bit kernels there); else None."""
    core = backend.loaded("native")
    if core is None or not hasattr(core, "sym_products") or core.cpu_capability() != "avx512":
        return None
    return core


def _products(left: torch.Tensor, right: torch.Tensor, sym=None) -> torch.Tensor:
    """``left @ right.T``, a fresh ``[r, k]``.

    Where left and right are the same tensor (the usual group: a context's clients need each
    other) the product is symmetric. torch has no SYRK, so the rows are cut into 4 blocks and
    each block is multiplied with itself and the blocks after it (4 products, 10/16 of the work;
    the same cut into 10 block products ran ~15% slower at 500 × 610, MKL, one thread); the
    blocks below the diagonal are the transposes. ``sym``: the native module of ``_sym_kernel``, which
    then computes the symmetric case (its upper block triangle, mirrored)."""
    n = left.shape[0]
    if sym is not None and left is right and left.dtype in (torch.float32, torch.float64) and left.is_contiguous() \
            and left.device.type == "cpu" and left.shape[1] >= 1:
        out = torch.empty(n, n, dtype=left.dtype)
        sym.sym_products(left.dtype is torch.float64, left.data_ptr(), n, left.shape[1], out.data_ptr())
        return out
    if left is not right or n < 256:  # small blocks: one product is cheaper than four
        return left @ right.T
    out = torch.empty(n, n, dtype=left.dtype, device=left.device)
    cuts = [n * q // 4 for q in range(5)]
    for a in range(4):
        ra, after = slice(cuts[a], cuts[a + 1]), slice(cuts[a], n)
        torch.mm(right[ra], right[after].T, out=out[ra, after])
        if a < 3:
            out[cuts[a + 1]:, ra] = out[ra, cuts[a + 1]:].T
    return out


SCREEN_MIN_CLIENTS = 512  # below this the dense computation is cheaper than clustering


def mixing_weights(model, w: torch.Tensor, train, lam_alpha: float, comm: distributed.Comm = None,
                   pool: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[m, m]`` float64 α: row i holds personalized model i's weights on the m clients, from
    one ``ops.gradients`` call at w (every client's full-batch gradient) and one pairwise
    distance computation (outside a run; inside one, PERM computes the gradients through its
    context and calls ``weights_from_gradients``). ``pool`` ([s] ascending client ids, e.g.
    ``_perm_pool.draw``): the pooled α, ``[m, s + 1]`` (``weights_from_gradients``)."""
    return weights_from_gradients(ops.gradients(model, w, train), train.sizes, lam_alpha, comm, train.first_client,
                                  pool)


def weights_from_gradients(G: torch.Tensor, sizes: torch.Tensor, lam_alpha: float, comm: distributed.Comm = None,
                           first_client: int = 0, pool: Optional[torch.Tensor] = None) -> torch.Tensor:
    """α from the clients' gradients ``G [m, d]`` at w̃ and their sizes ``[m]``. Sharded (``comm``
    over several ranks, ``G`` this rank's clients from ``first_client`` on): the rows of this
    rank's models, ``[m_local, m]``, after one all-gather of G and the sizes. ``pool`` ([s]
    ascending client ids): the pooled α over each client's candidates pool ∪ {own client},
    ``[m_local, s + 1]`` (``_perm_pool``; sharded, only the pool's rows of G are gathered)."""
    sharded = comm is not None and comm.world > 1
    if pool is not None:
        _check_pool(G, sizes, pool, comm if sharded else None)
        ids = torch.arange(first_client, first_client + G.shape[0], device=G.device)
        if sharded:  # the pool's rows held here, gathered in rank order: ascending, pool order
            local = pool[(pool >= first_client) & (pool < first_client + G.shape[0])] - first_client
            G_pool, sizes_pool = comm.all_gather_rows(G[local]), comm.all_gather_rows(sizes[local])
        else:
            G_pool, sizes_pool = G[pool], sizes[pool]
        lam = positive(lam_alpha, "lam_alpha", "weights_from_gradients")
        return _perm_pool.weights(G, sizes, ids, G_pool, sizes_pool, pool, lam)
    if not sharded:
        G_all, all_sizes, rows = G, sizes, slice(None)
    else:
        G_all, all_sizes = comm.all_gather_rows(G), comm.all_gather_rows(sizes)
        rows = slice(first_client, first_client + G.shape[0])
    if G_all.shape[0] >= SCREEN_MIN_CLIENTS:
        return screened_weights(G_all, all_sizes, lam_alpha, rows)
    return water_filling(pairwise_sqdist(G_all, rows), all_sizes, lam_alpha)


def _check_pool(G: torch.Tensor, sizes: torch.Tensor, pool: torch.Tensor, comm: Optional[distributed.Comm]) -> None:
    """The pooled α's arguments (the exact path's are checked by ``screened_weights`` and
    ``water_filling``): G [m_local, d] finite, sizes positive, the pool ascending ids of clients.
    Sharded: every rank raises or none (one all-reduce), so that no rank waits in the gather."""
    if G.dim() != 2 or sizes.shape != (G.shape[0],):
        raise ValueError(f"G, sizes: expected shapes [m, d] and [m], got {list(G.shape)} and {list(sizes.shape)}")
    bad_g = int(G.numel() > 0 and not bool(torch.isfinite(G).all()))
    bad_n = int(not bool((sizes > 0).all()))
    m = G.shape[0]
    if comm is not None:
        m, bad_g, bad_n = (int(v) for v in comm.sum(torch.tensor([m, bad_g, bad_n], dtype=torch.int64)).tolist())
    if pool.dim() != 1 or pool.dtype is not torch.int64 or pool.numel() < 1:
        raise ValueError(f"pool: expected a non-empty int64 [s] of client ids, got {pool.dtype} {list(pool.shape)}")
    if not bool((pool[1:] > pool[:-1]).all()) or int(pool[0]) < 0 or int(pool[-1]) >= m:
        raise ValueError(f"pool: expected ascending distinct client ids in [0, {m}), got {pool.tolist()[:8]}")
    if bad_g:
        raise ValueError("G: expected finite values")
    if bad_n:
        raise ValueError("sizes: expected positive sample counts")


# ---- the algorithm ------------------------------------------------------------------------------

@dataclass
class PERMState:
    w: torch.Tensor                 # [d] the FedAvg model w̃
    theta: torch.Tensor = per_client()  # [m, d] personalized models
    sigma: Optional[torch.Tensor] = None  # int64 [m] the shuffling permutation σ (of all clients)
    alpha: Optional[torch.Tensor] = per_client(default=None)  # float64 [m, m] mixing weights (None in warm-up);
    # pooled (alpha_pool): [m, s + 1], weights on the pool's clients, then on the own client
    shuffle_rounds: int = 0         # shuffling rounds done
    pool: Optional[torch.Tensor] = None  # int64 [s] ascending: the pooled α's clients (None: α over all)


class PERM(Algorithm):
    """PERM ("Distributed Personalized Empirical Risk Minimization").

    ``warmup_rounds`` rounds of FedAvg (sampled clients, ``fedavg_steps`` steps of size
    ``fedavg_lr``, defaults ``local_steps`` and ``lr``) give w̃; the mixing weights α [m, m]
    come from the clients' gradients at w̃ (water-filling with regularization ``lam_alpha``).
    Then every round is a shuffling round: each of the m personalized models takes
    ``local_steps`` steps of size ``lr`` on the client it visits, scaled by its α (all m models
    train every round, whatever clients_per_round). ``single_loop=True`` keeps training w̃ every
    round and recomputes α every ``alpha_every`` shuffling rounds, at the w̃ the round starts
    from (its FedAvg steps start from the same gradients). ``batch_size``: minibatch
    rows (None: full batch). ``alpha_pool``: s < m pools α: each model's weights over s clients
    drawn uniformly at each recomputation and its own client (``_perm_pool``: O(m·s·d) per
    recomputation, α stored as [m, s + 1]; ``dense_alpha`` writes it out), None: over all clients.
    Personalized models: θ_i."""

    name = "PERM"
    dp_unsupported = ("its mixing weights are computed at the server from every client's gradient, and its "
                      "personalized models visit other clients (model shuffling)")

    def __init__(self, warmup_rounds: int, lam_alpha: float, lr: float, local_steps: int = 1,
                 single_loop: bool = False, alpha_every: int = 10, fedavg_lr: Optional[float] = None,
                 fedavg_steps: Optional[int] = None, batch_size: Optional[int] = None,
                 alpha_pool: Optional[int] = None):
        n = self.name
        self.warmup_rounds = count_int(warmup_rounds, "warmup_rounds", n, minimum=0)
        self.lam_alpha = positive(lam_alpha, "lam_alpha", n)
        self.lr = positive(lr, "lr", n)
        self.local_steps = count_int(local_steps, "local_steps", n)
        self.single_loop = bool(single_loop)
        self.alpha_every = count_int(alpha_every, "alpha_every", n)
        self.fedavg_lr = self.lr if fedavg_lr is None else positive(fedavg_lr, "fedavg_lr", n)
        self.fedavg_steps = self.local_steps if fedavg_steps is None else count_int(fedavg_steps, "fedavg_steps", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)
        self.alpha_pool = None if alpha_pool is None else count_int(alpha_pool, "alpha_pool", n)

    def init(self, ctx: Context) -> PERMState:
        g = torch.Generator().manual_seed((ctx.seed * 6_364_136_223 + 1_442_695) & _M63)
        sigma = torch.randperm(ctx.num_clients, generator=g).to(ctx.device)
        return PERMState(ctx.initial_global(), ctx.initial_models(ctx.m), sigma)

    @staticmethod
    def visits(sigma: torch.Tensor, r: int, models: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``int64``: the client j = σ((i + r) mod m) that model i visits in shuffling round r, for
        the models ``models`` (global ids; default all m)."""
        m = sigma.numel()
        i = torch.arange(m, device=sigma.device) if models is None else models
        return sigma[(i + r) % m]

    def _fedavg(self, state: PERMState, ctx: Context, t: int, G: Optional[torch.Tensor] = None) -> None:
        """A FedAvg round on w̃. ``G``: this rank's clients' full-batch gradients at w̃ (``[m_local,
        d]``, a single-loop round that recomputes α from them): with full-batch steps, the first
        local step of a sampled client is the step along its row of G, taken from there (the
        gradient pass is not run twice)."""
        S = ctx.sample_clients(t)
        if G is not None and self.batch_size is None:
            theta = torch.sub(state.w, G[S], alpha=self.fedavg_lr)  # [|S|, d]: w̃ − lr·∇f_j(w̃)
            if self.fedavg_steps > 1:
                ctx.local_steps(theta, steps=self.fedavg_steps - 1, lr=self.fedavg_lr, rows=S)
        else:
            theta = replicate(state.w, S.numel())
            b = None if self.batch_size is None else ctx.batches(t, 0, S, self.fedavg_steps, self.batch_size)
            ctx.local_steps(theta, steps=self.fedavg_steps, lr=self.fedavg_lr, rows=S, batches=b)
        state.w = ctx.average(theta, ctx.weights[S], center=state.w)

    def _shuffle(self, state: PERMState, ctx: Context, t: int) -> None:
        m, r, held = ctx.num_clients, state.shuffle_rounds, ctx.m
        models = torch.arange(held, device=ctx.device)
        j = self.visits(state.sigma, r, models + ctx.first_client)  # global client ids
        a = state.alpha[models, j] if state.pool is None else \
            _perm_pool.at(state.alpha, state.pool, models, models + ctx.first_client, j)
        active = torch.nonzero(a > 0).flatten()
        idle = torch.nonzero(a <= 0).flatten()
        if ctx.sharded:
            self._shuffle_sharded(state, ctx, t, active, j[active], a[active])
        elif active.numel():
            theta = state.theta[active].contiguous()
            b = None if self.batch_size is None else ctx.batches(t, 1, j[active], self.local_steps, self.batch_size)
            ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=j[active],
                            batches=b, grad_scale=(m * a[active]).to(ctx.dtype))
            state.theta[active] = theta
        if idle.numel() and ctx.model.l2 > 0:
            state.theta[idle] *= (1.0 - self.lr * ctx.model.l2) ** self.local_steps
        state.shuffle_rounds += 1

    def _shuffle_sharded(self, state: PERMState, ctx: Context, t: int, active: torch.Tensor, clients: torch.Tensor,
                         a: torch.Tensor) -> None:
        """The steps of the local models ``active`` on the global ``clients`` they visit, each run by
        the rank holding the client: a model goes there as a float64 row [θ (d) | local client
        index there | α], comes back as [θ] (exact: float32 and float64 fit in float64)."""
        comm, d, m = ctx.comm, ctx.d, ctx.num_clients
        starts = distributed.shard_starts(m, comm.world).to(clients.device)
        owner = distributed.owner_of(clients, starts)
        sends, picks = [], []
        for q in range(comm.world):
            mine = torch.nonzero(owner == q).flatten()
            picks.append(mine)
            if not mine.numel():
                sends.append(None)
                continue
            block = torch.empty(mine.numel(), d + 2, dtype=torch.float64, device=ctx.device)
            block[:, :d] = state.theta[active[mine]]
            block[:, d] = (clients[mine] - starts[q]).to(torch.float64)
            block[:, d + 1] = a[mine]
            sends.append(block)
        got = comm.exchange(sends, d + 2, torch.float64, ctx.device)
        arrived = torch.cat(got)
        if arrived.shape[0]:
            theta = arrived[:, :d].to(ctx.dtype).contiguous()
            rows = arrived[:, d].to(torch.int64)
            b = None if self.batch_size is None else ctx.batches(t, 1, rows, self.local_steps, self.batch_size)
            ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=rows, batches=b,
                            grad_scale=(m * arrived[:, d + 1]).to(ctx.dtype))
        else:
            theta = torch.empty(0, d, dtype=ctx.dtype, device=ctx.device)
        back, start = [], 0  # return each model to the rank it came from, in the order it came
        for block in got:
            n = block.shape[0]
            back.append(theta[start:start + n].to(torch.float64) if n else None)
            start += n
        home = comm.exchange(back, d, torch.float64, ctx.device)
        for q, mine in enumerate(picks):
            if mine.numel():
                state.theta[active[mine]] = home[q].to(ctx.dtype)

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        return m  # after the warm-up: every client's personalized model, each round

    def training_note(self) -> str:
        return (f"after its {self.warmup_rounds} warm-up rounds every one of the m personalized models takes "
                "local steps each round (model shuffling, by design); clients_per_round samples the FedAvg rounds")

    def round(self, state: PERMState, ctx: Context, t: int) -> PERMState:
        if t <= self.warmup_rounds:
            self._fedavg(state, ctx, t)
            return state
        refresh = state.alpha is None or (self.single_loop and state.shuffle_rounds % self.alpha_every == 0)
        # α's gradients at the round's w̃: single-loop, they are what the clients compute first in the
        # round, and the server takes both its FedAvg step and α from them (the paper's Algorithm 2)
        G = ctx.gradients(state.w) if refresh else None
        if self.single_loop:
            self._fedavg(state, ctx, t, G)
        if refresh:
            if state.alpha is None:
                state.theta = replicate(state.w, ctx.m)  # personalized models start at w̃
            # the previous α released first, so that the new [m, m] float64 can take its memory: one
            # allocated while the old is alive comes from fresh pages, faulted in one by one (m =
            # 2,000: 32 MB, ~16 ms at 1 thread, beside a ~14 ms solve at the one-round w̃)
            state.alpha = None
            m = ctx.num_clients
            state.pool = None if self.alpha_pool is None or self.alpha_pool >= m else \
                _perm_pool.draw(m, self.alpha_pool, ctx.seed, state.shuffle_rounds).to(ctx.device)
            try:
                state.alpha = weights_from_gradients(G, ctx.train.sizes, self.lam_alpha, ctx.comm, ctx.first_client,
                                                     state.pool)
            except RuntimeError as exc:  # torch's failed allocation (CPU: "can't allocate memory")
                if state.pool is not None or "allocate" not in str(exc):
                    raise
                gb = ctx.m * m * 8 / 1e9
                raise MemoryError(f"PERM: exact mixing weights need a float64 [{ctx.m:,}, {m:,}] α ({gb:.1f} GB) and "
                                  f"its screen's buffers, which did not fit in memory; PERM(alpha_pool=s) solves each "
                                  f"model's α over a pool of s clients (e.g. 200: [{ctx.m:,}, 201], "
                                  f"{ctx.m * 201 * 8 / 1e9:.2f} GB)") from exc
        self._shuffle(state, ctx, t)
        return state

    def personalized(self, state: PERMState) -> torch.Tensor:
        if state.alpha is None:  # warm-up: every client uses the FedAvg model
            return state.w.expand(state.theta.shape[0], state.w.shape[0])
        return state.theta

    def global_model(self, state: PERMState) -> torch.Tensor:
        return state.w

    @staticmethod
    def dense_alpha(state: PERMState, first_client: int = 0, num_clients: Optional[int] = None) -> Optional[torch.Tensor]:
        """``float64 [m_local, m]``: α over all clients (a pooled α written out; the exact α as it
        is). ``first_client``, ``num_clients``: a sharded rank's first row's client and m (default:
        one process, m = the rows of α)."""
        if state.alpha is None or state.pool is None:
            return state.alpha
        r = state.alpha.shape[0]
        m = r if num_clients is None else int(num_clients)
        ids = torch.arange(first_client, first_client + r, device=state.alpha.device)
        return _perm_pool.dense(state.alpha, state.pool, ids, m)

__all__ = ["PERM", "PERMState", "mixing_weights", "pairwise_sqdist", "screened_weights", "water_filling",
           "water_filling_ref", "weights_from_gradients"]
