"""PERM's mixing weights from a pair screen in a few principal directions (``perm.screened_weights``).

Once FedAvg has run a while, the clients' gradients g_i shrink, their contexts stop being
separable by cluster bounds, and client i's weights sit on its ~5% nearest clients (~110 of 2,000,
bench/server_steps.py part (d)). The gradients still lie close to a low-dimensional subspace (at m =
2,000, d = 610: 16 principal directions hold 98.7% of their spread), so every pair's cost
c_ij = ‖g_i − g_j‖² is bounded in r dimensions: with V [d, r] an orthonormal basis, s_i = g_i − μ,
p_i = Vᵀs_i and ρ_i = ‖s_i − V p_i‖,

    ‖p_i − p_j‖² + (ρ_i − ρ_j)²  ≤  c_ij  ≤  ‖p_i − p_j‖² + (ρ_i + ρ_j)².

Client i's water level τ_i is at most the level of the upper bounds (the level grows with the
costs), and α_ij > 0 needs c_ij < τ_i, so only the pairs whose lower bound is below that level
are computed (~140 a row there, against 2,000); the rest of the row is 0. The native kernel
(csrc/cpu/water_fill_screened.cpp) does that per row, the bounds in r = 16 dimensions.

Rigour: V comes from a randomized range finder (one power iteration) in the gradients' dtype and
is orthonormal only to rounding; p and ρ are rounded too. The kernel's bounds carry every such
error (``bounds``: Δ = VᵀV − I, the products' γ_d bound, the shift's rounding), so they hold for
the costs exactly; a kernel row whose level would exceed its bound (never) is computed from every
column. The basis decides only which costs are computed, not their values: the weights do not
depend on V's bits.

Costs: float64 differences of the gradients as given, or float32 differences for float32
gradients (``f64_costs`` False: each cost within ~1.1e-6 of its value, relatively; α within ~1e-8
of the float64 solve at m = 2,000).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch

RANK = 16  # principal directions of the screen (r = 12 and 24 leave ~2.5% more and ~3% fewer candidates)
MAX_SHARE = 0.25  # above this mean share of candidate columns the cluster screen is used instead
CLUSTER_PAIRS_SHARE = 0.3  # the pair screen is tried where the cluster screen would compute more of the pairs
# (m = 2,000, bench/server_steps.py: the cluster screen faster up to a plan of 25% of the pairs, 1.7x slower at 34%)
BASIS_ROWS = 512  # rows the basis is found from (every (m // 512)-th)
ETA = 1e-3  # the bounds' relative slack: |‖a‖ − ‖ã‖| ≤ e becomes a (1 ± η) factor and an e²/η term


def kernel(G: torch.Tensor):
    """The native module where it has the screen's kernel for ``G`` (CPU, float32/float64,
    contiguous, not forced onto the reference backend), else None."""
    from pflcore.algorithms.perm import _screen_kernel  # (perm imports this module)
    return _screen_kernel(G, "water_fill_screened")


def _basis(S: torch.Tensor, r: int) -> torch.Tensor:
    """``[d, r]`` in S's dtype: an orthonormal (to rounding) basis of the span of Sᵀ S Ω, a fixed
    random Ω (the top right singular directions of S, by one power iteration)."""
    from pflcore.algorithms.perm import _projection
    omega = _projection(S.shape[1], r).to(S.dtype)
    Z = torch.mm(S.T, torch.mm(S, omega))
    return torch.linalg.qr(Z.to(torch.float64)).Q.to(S.dtype).contiguous()


class Bounds(NamedTuple):
    """The kernel's inputs (float32 [r, m] and [m], scaled by powers of 2: coordinates by 2^-k,
    slacks and costs by ``cost_scale`` = 2^-2k, so that the float32 arithmetic of the bounds
    neither overflows nor loses what matters to underflow)."""
    PT: torch.Tensor
    rho_lo: torch.Tensor
    rho_hi: torch.Tensor
    slack: torch.Tensor
    k_lo: float
    k_hi: float
    eta: float
    cost_scale: float


def bounds(G: torch.Tensor, rank: int = RANK, eta: float = ETA) -> Bounds:
    """Bounds of every pair's cost: with A = ‖p_i − p_j‖² from the rows of ``PT``ᵀ and
    gap = max(0, ρlo_i − ρhi_j, ρlo_j − ρhi_i),

        k_lo·A + (1 − η)·gap² − slack_i − slack_j  ≤  cost_scale·‖g_i − g_j‖²
                       ≤  k_hi·A + (1 + η)·(ρhi_i + ρhi_j)² + slack_i + slack_j

    (the kernel adds the rounding of its float32 arithmetic to k and η).

    Derivation, before the scaling (u: the unit roundoff of G's dtype, γ = (d + 2)u/(1 − (d + 2)u)):
    ŝ_i = fl(g_i − μ) is within U_i = 1.01·u‖ŝ_i‖ of g_i − μ. With a_i = Vᵀŝ_i (exact), Δ = VᵀV − I
    and z_i = ŝ_i − V a_i, x = ŝ_i − ŝ_j has ‖x‖² = ‖a‖² − aᵀΔa + ‖z_i − z_j‖², a = a_i − a_j, and
    ρ_i = ‖z_i‖ satisfies ρ_i² = ‖ŝ_i‖² − ‖a_i‖² + a_iᵀΔa_i. The float32 p_i is within e_i =
    √r·γ·‖ŝ_i‖·‖V‖ + 1.01·2⁻²⁴‖p_i‖ of a_i (the product's rounding, then float32's), so ‖a‖ is within
    e_i + e_j of ‖p_i − p_j‖, and (A ± e)² lies in [(1 − η)A² − e²/η, (1 + η)A² + (1 + 1/η)e²];
    (e_i + e_j)² ≤ 2(e_i² + e_j²). ρ_i² is known to within ε_i (the rounding of ‖ŝ_i‖², of ‖p_i‖²,
    and ‖Δ‖‖a_i‖²), hence [ρlo_i, ρhi_i]. slack_i gathers 2.1(e_i² + U_i²)/η and a 1e-12 relative
    margin; the float32 values are rounded outward (ρlo down, ρhi and the slacks up)."""
    m, d = G.shape
    T = G.dtype
    u = torch.finfo(T).eps / 2
    r = max(1, min(int(rank), d, m))
    # [m, d] in G's dtype, shifted by the mean of ~128 rows (any shift keeps the distances, and its
    # rounding is U_i below; the column mean of all rows was ~0.5 ms, a strided reduction)
    S = G - G[::max(1, m // 128)].mean(dim=0)
    # the basis from ~512 of the rows (m = 2,000: 138.4 candidates a row against 137.9 from all)
    V = _basis(S[::max(1, m // BASIS_ROWS)], r)  # [d, r]
    V64 = V.to(torch.float64)
    # ‖Δ‖₂ ≤ ‖Δ‖_F, plus the rounding of its float64 products
    delta = float((V64.T @ V64 - torch.eye(r, dtype=torch.float64)).norm()) + 4.0 * d * 2.0 ** -53
    Pt = torch.mm(S, V)  # [m, r] in T
    # the per-row terms in numpy (a few dozen small operations: ~1 ms of torch's per-op overhead)
    P = Pt.to(torch.float64).numpy()
    # ‖ŝ_i‖² from the norms (no [m, d] temporary), within (γ + 3u)·‖ŝ_i‖² ≤ 2γ·‖ŝ_i‖²
    sq = torch.linalg.vector_norm(S, dim=1).to(torch.float64).numpy() ** 2
    gam = (d + 2) * u / (1 - (d + 2) * u)
    snorm = np.sqrt(sq * (1.0 + gam))
    pn = np.sqrt(np.einsum("ij,ij->i", P, P))
    e = math.sqrt(r) * gam * math.sqrt(1.0 + delta) * snorm + 1.01 * 2.0 ** -24 * pn  # |p_i − a_i| ≤ e_i
    shift = 1.01 * u * snorm
    rho2 = sq - pn * pn
    eps2 = (2.0 * pn + 3.0 * e) * e + delta * (pn + e) ** 2 + 2.0 * gam * sq + 1e-12 * sq
    rho_lo = np.sqrt(np.maximum(rho2 - eps2, 0.0))
    rho_hi = np.sqrt(np.maximum(rho2, 0.0) + eps2) * (1.0 + 1e-12)
    slack = (e * e + shift * shift) * (2.1 / eta) + 1e-12 * sq
    k_lo = 1.0 - 2.0 * eta - delta - 1e-12
    k_hi = 1.0 + 3.0 * eta + 2.0 * delta + 1e-12
    # the scale: the largest coordinate, residual norm or slack's root at most 1
    top = max(float(np.abs(P).max()) if P.size else 0.0, float(rho_hi.max()), math.sqrt(float(slack.max())))
    k = math.frexp(top)[1] if top > 0 else 0  # top < 2^k
    scale, cost_scale = math.ldexp(1.0, -k), math.ldexp(1.0, -2 * k)
    out = 1.0 + 2.0 ** -20  # outward rounding: float32's (2^-24 relative) is within this
    f32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    return Bounds(f32((P * scale).T), f32(rho_lo * (scale / out)), f32(rho_hi * (scale * out)),
                  f32(slack * (cost_scale * out)), k_lo, k_hi, eta, cost_scale)


def weights(G: torch.Tensor, sizes: torch.Tensor, lam: float, first: int, stop: int, f64_costs: bool, core,
            max_share: float = MAX_SHARE, counts_out: Optional[list] = None) -> Optional[torch.Tensor]:
    """float64 ``[stop − first, m]``: rows first..stop of α by the principal screen, or None where
    the screen is too loose (its candidates average more than ``max_share`` of the columns: the
    kernel declines after its bounds). The bounds in torch on one thread (MKL's small products:
    one thread is faster, and their bits then do not depend on the thread count), the kernel on
    torch's threads. ``counts_out``: a list that receives the rows' candidate counts (tests)."""
    m, d = G.shape
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = bounds(G)
    finally:
        torch.set_num_threads(threads)
    w = sizes.to(dtype=torch.float64) / (2.0 * lam)
    n = stop - first
    out = torch.empty(n, m, dtype=torch.float64)
    levels = torch.empty(n, dtype=torch.float64)
    counts = torch.empty(n, dtype=torch.int64)
    G = G.contiguous()
    done = core.water_fill_screened(G.dtype is torch.float64, G.data_ptr(), m, d, b.PT.data_ptr(), b.PT.shape[0],
                                    b.rho_lo.data_ptr(), b.rho_hi.data_ptr(), b.slack.data_ptr(), b.k_lo, b.k_hi,
                                    b.eta, b.cost_scale, w.data_ptr(), first, stop, bool(f64_costs), min(int(min(max_share, 2.0) * n * m), 2 ** 62),
                                    out.data_ptr(), levels.data_ptr(), counts.data_ptr())
    if counts_out is not None:
        counts_out.append(counts)
    return out if done else None
