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
clients) and α is recomputed at the current w̃ every ``alpha_every`` shuffling rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pflcore import ops
from pflcore.algorithms.base import Algorithm, Context, count_int, positive

_M63 = 0x7FFFFFFFFFFFFFFF


# ---- mixing weights -----------------------------------------------------------------------------

def pairwise_sqdist(G: torch.Tensor) -> torch.Tensor:
    """``[m, m]`` float64 squared distances ‖g_i − g_j‖² between the rows of ``G [m, d]``.

    One Gram matrix in float64 after centring the rows (the gradients of similar clients are
    close, so their distance is a small difference of large norms: centring and float64 keep
    it accurate); the diagonal is exactly 0 and rounding never makes an entry negative."""
    Gc = G.to(torch.float64)
    Gc = Gc - Gc.mean(dim=0, keepdim=True)
    sq = (Gc * Gc).sum(dim=1)
    D = (sq[:, None] + sq[None, :]) - 2.0 * (Gc @ Gc.T)
    D.clamp_(min=0.0).fill_diagonal_(0.0)
    return D


def _level(c_sorted: torch.Tensor, w_sorted: torch.Tensor) -> torch.Tensor:
    """``[r]`` water level τ of rows whose costs are sorted ascending (weights alongside)."""
    level = (1.0 + torch.cumsum(c_sorted * w_sorted, dim=1)) / torch.cumsum(w_sorted, dim=1)
    # The prefix condition level_a > c_(a) holds for a = 1 (level_1 = c_(1) + 1/w_(1)) and, the
    # costs being sorted, exactly on a prefix: its length is the number of entries where it holds.
    active = (level > c_sorted).sum(dim=1, keepdim=True)
    return level.gather(1, active - 1)[:, 0]


def water_filling(costs: torch.Tensor, counts: torch.Tensor, lam_alpha: float, *, candidates: int = 64) -> torch.Tensor:
    """Rows α_i [m, k] of  argmin_{α ∈ simplex} Σ_j c_{i,j} α_j + λ_α Σ_j α_j² / n_j,  exactly.

    KKT: α_j = max(0, (τ_i − c_{i,j})·w_j) with w_j = n_j/(2λ_α) and the level τ_i such that
    Σ_j α_j = 1. Sorting a row's costs ascending, the active set is a prefix of length a, and
    τ = (1 + Σ_{j≤a} c_j w_j) / Σ_{j≤a} w_j; a is the longest prefix whose level exceeds its
    last cost.

    The weights of a client are usually carried by few others, so the level is first found
    among each row's ``candidates`` smallest costs (``torch.topk``, far cheaper than sorting
    the row); it is exact for the row when τ ≤ the next smallest cost, since every other entry
    is then inactive. Rows that fail the check retry with 8× as many candidates, up to a full
    sort.

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
    c = costs.to(torch.float64)  # the output is built in place on c, so never alias the input
    if c.data_ptr() == costs.data_ptr():
        c = c.clone()
    w = counts.to(device=c.device, dtype=torch.float64) / (2.0 * lam)
    tau = torch.empty(c.shape[0], dtype=torch.float64, device=c.device)
    todo = torch.arange(c.shape[0], device=c.device)
    L = max(1, min(int(candidates), k))
    while todo.numel():
        rows = c[todo]
        if L >= k:
            vals, idx = torch.sort(rows, dim=1, stable=True)
            bound = torch.full((todo.numel(),), float("inf"), dtype=torch.float64, device=c.device)
        else:
            vals, idx = torch.topk(rows, L + 1, dim=1, largest=False, sorted=True)
            bound, vals, idx = vals[:, L], vals[:, :L], idx[:, :L]
        level = _level(vals, w[idx])
        exact = level <= bound
        tau[todo[exact]] = level[exact]
        todo, L = todo[~exact], min(8 * L, k)
    return c.neg().add_(tau[:, None]).clamp_(min=0.0).mul_(w[None, :])  # in place on a fresh [m, k]


def mixing_weights(model, w: torch.Tensor, train, lam_alpha: float) -> torch.Tensor:
    """``[m, m]`` float64 α: row i holds personalized model i's weights on the m clients, from
    one ``ops.gradients`` call at w (every client's full-batch gradient) and one pairwise
    distance computation."""
    m = train.num_clients
    G = ops.gradients(model, w.expand(m, w.shape[0]).contiguous(), train)
    return water_filling(pairwise_sqdist(G), train.sizes, lam_alpha)


# ---- the algorithm ------------------------------------------------------------------------------

@dataclass
class PERMState:
    w: torch.Tensor                 # [d] the FedAvg model w̃
    theta: torch.Tensor             # [m, d] personalized models
    sigma: torch.Tensor             # int64 [m] the shuffling permutation σ
    alpha: Optional[torch.Tensor] = None  # float64 [m, m] mixing weights (None during warm-up)
    shuffle_rounds: int = 0         # shuffling rounds done


class PERM(Algorithm):
    name = "PERM"

    def __init__(self, warmup_rounds: int, lam_alpha: float, lr: float, local_steps: int = 1,
                 single_loop: bool = False, alpha_every: int = 10, fedavg_lr: Optional[float] = None,
                 fedavg_steps: Optional[int] = None, batch_size: Optional[int] = None):
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

    def init(self, ctx: Context) -> PERMState:
        g = torch.Generator().manual_seed((ctx.seed * 6_364_136_223 + 1_442_695) & _M63)
        sigma = torch.randperm(ctx.m, generator=g).to(ctx.device)
        return PERMState(ctx.initial_global(), ctx.initial_models(ctx.m), sigma)

    @staticmethod
    def visits(sigma: torch.Tensor, r: int) -> torch.Tensor:
        """``int64 [m]``: the client j = σ((i + r) mod m) that model i visits in shuffling round r."""
        m = sigma.numel()
        return sigma[(torch.arange(m, device=sigma.device) + r) % m]

    def _fedavg(self, state: PERMState, ctx: Context, t: int) -> None:
        S = ctx.sample_clients(t)
        theta = state.w.expand(S.numel(), ctx.d).contiguous()
        b = None if self.batch_size is None else ctx.batches(t, 0, S, self.fedavg_steps, self.batch_size)
        ops.local_steps(ctx.model, theta, ctx.train, steps=self.fedavg_steps, lr=self.fedavg_lr, rows=S, batches=b)
        state.w = ops.average(theta, ctx.weights[S])
        ctx.count(S.numel() * self.fedavg_steps)

    def _shuffle(self, state: PERMState, ctx: Context, t: int) -> None:
        m, r = ctx.m, state.shuffle_rounds
        j = self.visits(state.sigma, r)
        a = state.alpha[torch.arange(m, device=ctx.device), j]
        active = torch.nonzero(a > 0).flatten()
        idle = torch.nonzero(a <= 0).flatten()
        if active.numel():
            theta = state.theta[active].contiguous()
            b = None if self.batch_size is None else ctx.batches(t, 1, j[active], self.local_steps, self.batch_size)
            ops.local_steps(ctx.model, theta, ctx.train, steps=self.local_steps, lr=self.lr, rows=j[active],
                            batches=b, grad_scale=(m * a[active]).to(ctx.dtype))
            state.theta[active] = theta
            ctx.count(active.numel() * self.local_steps)
        if idle.numel() and ctx.model.l2 > 0:
            state.theta[idle] *= (1.0 - self.lr * ctx.model.l2) ** self.local_steps
        state.shuffle_rounds += 1

    def round(self, state: PERMState, ctx: Context, t: int) -> PERMState:
        if t <= self.warmup_rounds or self.single_loop:
            self._fedavg(state, ctx, t)
        if t <= self.warmup_rounds:
            return state
        refresh = self.single_loop and state.shuffle_rounds % self.alpha_every == 0
        if state.alpha is None or refresh:
            if state.alpha is None:
                state.theta = state.w.expand(ctx.m, ctx.d).clone()  # personalized models start at w̃
            state.alpha = mixing_weights(ctx.model, state.w, ctx.train, self.lam_alpha)
        self._shuffle(state, ctx, t)
        return state

    def personalized(self, state: PERMState) -> torch.Tensor:
        if state.alpha is None:  # warm-up: every client uses the FedAvg model
            return state.w.expand(state.theta.shape[0], state.w.shape[0])
        return state.theta

    def global_model(self, state: PERMState) -> torch.Tensor:
        return state.w
