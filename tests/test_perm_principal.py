"""PERM's pair screen in a few principal directions (pflcore/algorithms/_perm_principal.py, kernel
csrc/cpu/water_fill_screened.cpp) against the dense water-filling of every cost."""
import math

import pytest
import torch

from pflcore import backend
from pflcore.algorithms import _perm_principal as principal
from pflcore.algorithms.perm import pairwise_sqdist, screened_weights, water_filling

core = backend.loaded("native")
pytestmark = pytest.mark.skipif(core is None or not hasattr(core, "water_fill_screened"),
                                reason="no native module with the principal screen")


def _low_rank_gradients(m, d, rank, noise, seed, dtype=torch.float64, offset=3.0):
    """Rows near a ``rank``-dimensional subspace (as the clients' gradients once FedAvg has run a
    while), plus isotropic noise, shifted by ``offset`` (norms large against the distances)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, d, generator=g, dtype=torch.float64)
    G = torch.randn(m, rank, generator=g, dtype=torch.float64) @ basis / math.sqrt(d)
    G = G + noise * torch.randn(m, d, generator=g, dtype=torch.float64) + offset
    return G.to(dtype).contiguous(), torch.randint(1, 300, (m,), generator=g)


def _exact_costs(G):
    """float64 ‖g_i − g_j‖² by differences (exact inputs: float32 values are exact in float64)."""
    X = G.to(torch.float64)
    return torch.stack([((X - X[i]) ** 2).sum(dim=1) for i in range(X.shape[0])])


def _weights(G, n, lam, rows=slice(None), f64_costs=True, share=math.inf):
    m = G.shape[0]
    first, stop = rows.start or 0, m if rows.stop is None else rows.stop
    counts = []
    out = principal.weights(G, n, lam, first, stop, f64_costs, core, share, counts_out=counts)
    return out, counts[0]


@pytest.mark.usefixtures("cpu_level")  # every CPU level's copy of the kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m, d, rank, noise, lam", [(1, 5, 1, 0.1, 1.0), (2, 1, 1, 0.1, 1.0), (37, 3, 2, 0.01, 0.5),
                                                    (131, 17, 4, 0.02, 30.0), (600, 61, 6, 0.01, 100.0),
                                                    (1030, 610, 16, 0.005, 100.0)])
def test_principal_weights_equal_the_dense_solve(dtype, m, d, rank, noise, lam):
    """Every entry as the dense water-filling of all m² costs: to float64 rounding with float64
    differences, within the float32 differences' rounding (each cost within ~1.1e-6 relatively)
    with them; odd shapes (m = 1, d = 1, d not a multiple of a vector, rows of 1,030 streamed),
    both dtypes, a block of rows, and every row's candidates fewer than the columns where the
    rows are near a subspace (else the test would not exercise the screen)."""
    G, n = _low_rank_gradients(m, d, rank, noise, seed=m + d, dtype=dtype)
    dense = water_filling(pairwise_sqdist(G), n, lam)
    got, counts = _weights(G, n, lam)
    torch.testing.assert_close(got, dense, rtol=1e-9, atol=1e-12)
    assert bool((counts >= 1).all()) and bool((counts <= m).all())
    if m >= 600:
        assert float(counts.double().mean()) < 0.25 * m
    part, _ = _weights(G, n, lam, slice(m // 3, m - m // 4))
    torch.testing.assert_close(part, dense[m // 3:m - m // 4], rtol=1e-9, atol=1e-12)
    if dtype is torch.float32:
        low, _ = _weights(G, n, lam, f64_costs=False)
        torch.testing.assert_close(low, dense, rtol=0, atol=5e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m, d, rank, noise, offset", [(200, 40, 3, 0.01, 1e3), (150, 1, 1, 0.0, 7.0),
                                                       (120, 90, 90, 1.0, 0.0), (100, 33, 2, 0.0, 0.0)])
def test_principal_bounds_hold_for_every_pair(dtype, m, d, rank, noise, offset):
    """The kernel's bounds (their formulas in csrc/cpu/water_fill_screened.cpp, from
    ``principal.bounds``) below and above every exact cost: gradients far from the origin (norms
    10⁴× the distances, where a Gram formula would cancel), d = 1, full rank (the basis misses most
    of the spread), exact low rank (residuals 0, the rounding all there is)."""
    G, _ = _low_rank_gradients(m, d, rank, noise, seed=d, dtype=dtype, offset=offset)
    b = principal.bounds(G)
    P, lo, hi, slack = b.PT.T.double(), b.rho_lo.double(), b.rho_hi.double(), b.slack.double()
    k_lo, k_hi, eta = b.k_lo, b.k_hi, b.eta
    A = ((P[:, None, :] - P[None, :, :]) ** 2).sum(dim=2)
    gap = torch.maximum(lo[:, None] - hi[None, :], lo[None, :] - hi[:, None]).clamp(min=0)
    e = slack[:, None] + slack[None, :]
    lower = k_lo * A + (1 - eta) * gap ** 2 - e
    upper = k_hi * A + (1 + eta) * (hi[:, None] + hi[None, :]) ** 2 + e
    c = _exact_costs(G) * b.cost_scale
    assert bool((lower <= c).all()) and bool((c <= upper).all())
    # and they are not vacuous where the rows lie in the subspace: apart by their relative slack and
    # the rounding (the bounds' coordinates are float32; float32 gradients: the residuals' norms
    # known to ~1e-2 of the rows')
    if noise == 0.0 and rank < d and offset < 100:
        tol = 1e-6 if dtype is torch.float64 else 1e-4
        assert float((upper - lower - (k_hi - k_lo + 2 * eta) * c).max()) < tol * float(c.max()) + 1e-12


def test_rows_whose_bounds_fail_are_computed_from_every_column():
    """Bounds that do not hold (ρ's intervals shrunk to nothing, so the screen leaves out columns
    with weight): the rows whose level comes out above their bound are taken from every column
    (count −1), and every row still equals the dense solve."""
    G, n = _low_rank_gradients(300, 20, 3, 0.05, seed=5)
    lam = 20.0
    dense = water_filling(pairwise_sqdist(G), n, lam)
    b = principal.bounds(G)
    m, d = G.shape
    w = n.to(torch.float64) / (2 * lam)
    out, levels, counts = torch.empty(m, m, dtype=torch.float64), torch.empty(m, dtype=torch.float64), \
        torch.empty(m, dtype=torch.int64)
    wrong = torch.zeros_like(b.rho_hi)  # ρ ∈ [0, 0]: the residuals' part of every cost dropped
    assert core.water_fill_screened(True, G.data_ptr(), m, d, b.PT.data_ptr(), b.PT.shape[0], wrong.data_ptr(),
                                    wrong.data_ptr(), torch.zeros_like(b.slack).data_ptr(), 1.0, 1.0, 0.0,
                                    b.cost_scale, w.data_ptr(), 0, m, True, 2 ** 62, out.data_ptr(),
                                    levels.data_ptr(), counts.data_ptr())
    assert int((counts == -1).sum()) > 0
    torch.testing.assert_close(out, dense, rtol=1e-9, atol=1e-12)


def test_principal_weights_bitwise_at_any_thread_count():
    """Rows are computed by whichever thread takes their block, in blocks of rows formed in row
    order: the same bits at 1, 2 and 3 threads (each cost's sum and each level's sums have a fixed
    order; the basis, whose products could round differently, decides only which costs are
    computed)."""
    G, n = _low_rank_gradients(1100, 61, 8, 0.01, seed=3, dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        results = {}
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results[t] = (screened_weights(G, n, 80.0, screen="principal"),
                          screened_weights(G, n, 80.0, screen="principal", products=torch.float64))
    finally:
        torch.set_num_threads(threads)
    for t in (2, 3):
        assert torch.equal(results[t][0], results[1][0]) and torch.equal(results[t][1], results[1][1])


def test_principal_weights_of_a_ranks_rows_are_the_full_calls_bits():
    """A sharded rank computes the rows of its clients only (``rows``): its blocks of rows differ
    from the one-process call's, but a cost's bits do not depend on its block, so its rows are
    bitwise the one-process rows (DESIGN.md: regardless of sharding)."""
    G, n = _low_rank_gradients(1100, 61, 8, 0.01, seed=4, dtype=torch.float32)
    full = screened_weights(G, n, 80.0, screen="principal")
    for a, b in ((0, 367), (367, 733), (733, 1100), (5, 6)):
        assert torch.equal(screened_weights(G, n, 80.0, slice(a, b), screen="principal"), full[a:b])


def test_loose_screen_declines_and_the_cluster_screen_answers():
    """Gradients with no low-dimensional structure (isotropic noise) and a λ_α large enough that
    most columns carry weight: the pair screen's candidates would be most columns, so it declines
    (None) and ``screened_weights`` answers by the cluster screen, equal to the dense solve."""
    G, n = _low_rank_gradients(700, 120, 120, 1.0, seed=8, offset=0.0)
    lam = 1e5
    assert principal.weights(G, n, lam, 0, 700, True, core) is None
    dense = water_filling(pairwise_sqdist(G), n, lam)
    torch.testing.assert_close(screened_weights(G, n, lam), dense, rtol=1e-9, atol=1e-12)


def test_screen_argument_is_checked():
    G, n = _low_rank_gradients(20, 4, 2, 0.1, seed=1)
    with pytest.raises(ValueError, match=r"screen: expected 'auto', 'principal' or 'clusters', got 'pairs'"):
        screened_weights(G, n, 1.0, screen="pairs")
