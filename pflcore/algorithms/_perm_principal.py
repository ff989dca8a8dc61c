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
error (``_bounds``: Δ = VᵀV − I, the products' γ_d bound, the shift's rounding), so they hold for
the costs exactly; a kernel row whose level would exceed its bound (never) is computed from every
column. The basis decides only which costs are computed, not their values: the weights do not
depend on V's bits.

Costs: float64 differences of the gradients as given, or float32 differences for float32
gradients (``f64_costs`` False: each cost within ~1.1e-6 of its value, relatively; α within ~1e-8
of the float64 solve at m = 2,000).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

RANK = 16  # principal directions of the screen (r = 12 and 24 leave ~2.5% more and ~3% fewer candidates)
MAX_SHARE = 0.25  # above this mean share of candidate columns the cluster screen is used instead
CLUSTER_PAIRS_SHARE = 0.3  # the pair screen is tried where the cluster screen would compute more of the pairs
# (m = 2,000, bench/server_steps.py: the cluster screen faster up to a plan of 25% of the pairs, 1.7x slower at 34%)
ETA = 1e-3  # the bounds' relative slack: |‖a‖ − ‖ã‖| ≤ e becomes a (1 ± η) factor and an e²/η term


def kernel(G: torch.Tensor):
    """The native module where it has the screen's kernel for ``G`` (CPU, float32/float64,
    contiguous, not forced onto the reference backend), else None."""
    from pflcore.algorithms.perm import _native_with  # (perm imports this module)
    if G.dtype not in (torch.float32, torch.float64) or not G.is_contiguous():
        return None
    return _native_with(G, "water_fill_screened")


def _basis(S: torch.Tensor, r: int) -> torch.Tensor:
    """``[d, r]`` in S's dtype: an orthonormal (to rounding) basis of the span of Sᵀ S Ω, a fixed
    random Ω (the top right singular directions of S, by one power iteration)."""
    from pflcore.algorithms.perm import _projection
    omega = _projection(S.shape[1], r).to(S.dtype)
    Z = torch.mm(S.T, torch.mm(S, omega))
    return torch.linalg.qr(Z.to(torch.float64)).Q.to(S.dtype).contiguous()


def bounds(G: torch.Tensor, rank: int = RANK, eta: float = ETA):
    """The kernel's inputs: ``(PT [r, m] float64, rho_lo, rho_hi, slack [m] float64, k_lo, k_hi, eta)``
    such that for every pair, with A = ‖p_i − p_j‖² (computed from PT in float64 or as precisely),
    gap = max(0, ρlo_i − ρhi_j, ρlo_j − ρhi_i):

        k_lo·A + (1 − η)·gap² − slack_i − slack_j  ≤  ‖g_i − g_j‖²
                       ≤  k_hi·A + (1 + η)·(ρhi_i + ρhi_j)² + slack_i + slack_j.

    Derivation (u: the unit roundoff of G's dtype, γ = (d + 2)u/(1 − (d + 2)u)): ŝ_i = fl(g_i − μ)
    is within U_i = 1.01·u‖ŝ_i‖ of g_i − μ. With a_i = Vᵀŝ_i (exact), Δ = VᵀV − I and z_i =
    ŝ_i − V a_i, x = ŝ_i − ŝ_j has ‖x‖² = ‖a‖² − aᵀΔa + ‖z_i − z_j‖², a = a_i − a_j, and ρ_i = ‖z_i‖
    satisfies ρ_i² = ‖ŝ_i‖² − ‖a_i‖² + a_iᵀΔa_i. The computed p_i is within e_i = √r·γ·‖ŝ_i‖·‖V‖
    of a_i, so ‖a‖ is within e_i + e_j of ‖p_i − p_j‖, and (A ± e)² lies in [(1 − η)A² − e²/η,
    (1 + η)A² + (1 + 1/η)e²]; (e_i + e_j)² ≤ 2(e_i² + e_j²). ρ_i² is known to within ε_i (the
    rounding of ‖ŝ_i‖², of ‖p_i‖², and ‖Δ‖‖a_i‖²), hence [ρlo_i, ρhi_i]. slack_i gathers
    2.1(e_i² + U_i²)/η and a 1e-12 relative margin for the arithmetic of the bounds themselves."""
    m, d = G.shape
    T = G.dtype
    u = torch.finfo(T).eps / 2
    r = max(1, min(int(rank), d, m))
    S = G - G.mean(dim=0)  # [m, d] in G's dtype (any shift: its rounding is U_i below)
    V = _basis(S, r)  # [d, r]
    V64 = V.to(torch.float64)
    # ‖Δ‖₂ ≤ ‖Δ‖_F, plus the rounding of its float64 products
    delta = float((V64.T @ V64 - torch.eye(r, dtype=torch.float64)).norm()) + 4.0 * d * 2.0 ** -53
    P = torch.mm(S, V).to(torch.float64)  # [m, r]
    sq = (S * S).sum(dim=1).to(torch.float64)  # ‖ŝ_i‖², within γ·‖ŝ_i‖² (products and sums in T)
    gam = (d + 2) * u / (1 - (d + 2) * u)
    snorm = (sq * (1.0 + gam)).sqrt()
    pn = P.norm(dim=1)
    e = math.sqrt(r) * gam * math.sqrt(1.0 + delta) * snorm  # |p_i − a_i| ≤ e_i
    shift = 1.01 * u * snorm
    rho2 = sq - pn * pn
    eps2 = (2.0 * pn + 3.0 * e) * e + delta * (pn + e) ** 2 + 2.0 * gam * sq + 1e-12 * sq
    rho_lo = (rho2 - eps2).clamp_(min=0.0).sqrt_()
    rho_hi = (rho2.clamp(min=0.0) + eps2).sqrt_().mul_(1.0 + 1e-12)
    slack = (e * e + shift * shift).mul_(2.1 / eta).add_(1e-12 * sq + 1e-300)
    k_lo = 1.0 - 2.0 * eta - delta - 1e-12
    k_hi = 1.0 + 3.0 * eta + 2.0 * delta + 1e-12
    return P.T.contiguous(), rho_lo.contiguous(), rho_hi.contiguous(), slack.contiguous(), k_lo, k_hi, eta


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
        PT, rho_lo, rho_hi, slack, k_lo, k_hi, eta = bounds(G)
    finally:
        torch.set_num_threads(threads)
    w = sizes.to(dtype=torch.float64) / (2.0 * lam)
    n = stop - first
    out = torch.empty(n, m, dtype=torch.float64)
    levels = torch.empty(n, dtype=torch.float64)
    counts = torch.empty(n, dtype=torch.int64)
    G = G.contiguous()
    w = w.contiguous()
    done = core.water_fill_screened(G.dtype is torch.float64, G.data_ptr(), m, d, PT.data_ptr(), PT.shape[0],
                                    rho_lo.data_ptr(), rho_hi.data_ptr(), slack.data_ptr(), k_lo, k_hi, eta,
                                    w.data_ptr(), first, stop, bool(f64_costs), min(int(min(max_share, 2.0) * n * m), 2 ** 62),
                                    out.data_ptr(), levels.data_ptr(), counts.data_ptr())
    if counts_out is not None:
        counts_out.append(counts)
    return out if done else None
