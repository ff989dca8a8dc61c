"""One-stage bilevel FedProx with personalization ("The Effect of Personalization in FedProx",
Alg. 1; DESIGN.md §5).

Per round the server sends w_g; each participating client warm-starts θ_i from its last value
and takes K steps of θ_i ← θ_i − η(∇f_i(θ_i) + λ(θ_i − w_g)); the server then moves
w_g ← w_g − γ Σ_i p_i λ (w_g − θ_i) (p_i renormalized over the participants). λ → 0 gives
local training, λ → ∞ global training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive


@dataclass
class FedProxState:
    theta: torch.Tensor = per_client()  # [m, d] personalized models
    w: torch.Tensor      # [d] global model


class FedProx(Algorithm):
    """One-stage bilevel FedProx ("The Effect of Personalization in FedProx", Alg. 1).

    Each round, every sampled client warm-starts θ_i from its last value and takes
    ``local_steps`` steps θ_i ← θ_i − ``local_lr``(∇f_i(θ_i) + ``lam``(θ_i − w)); the server moves
    w ← w − ``global_lr``·``lam``·(w − Σ_{i∈S} p_i θ_i). ``lam`` → 0 is local training, → ∞ global
    training; ``adaptive_lambda``, ``step_sizes`` and ``smoothness`` give the paper's choices
    (``lam = "adaptive"``, ``local_lr = "auto"`` in an experiment file). Personalized models: θ."""

    name = "FedProx"

    def __init__(self, lam: float, local_lr: float, global_lr: float, local_steps: int = 1):
        self.lam = positive(lam, "lam", self.name, allow_zero=True)
        self.local_lr = positive(local_lr, "local_lr", self.name)
        self.global_lr = positive(global_lr, "global_lr", self.name)
        self.local_steps = count_int(local_steps, "local_steps", self.name)

    @staticmethod
    def adaptive_lambda(R: float, n: int, rho: float = 2.0) -> float:
        """The paper's choice of λ from the heterogeneity R and the samples per client n:
        ρ/(√n·R) when R ≤ n^{-1/2}, else ρ²/(n·R²); infinite (global training) when R = 0."""
        if R < 0 or n < 1 or rho <= 0:
            raise ValueError(f"adaptive_lambda: expected R >= 0, n >= 1, rho > 0; got R={R}, n={n}, rho={rho}")
        if R == 0:
            return math.inf
        return rho / (math.sqrt(n) * R) if R <= n ** -0.5 else rho ** 2 / (n * R ** 2)

    @staticmethod
    def step_sizes(L: float, lam: float):
        """(γ, η) = ((λ + L)/(λL), 1/(L + λ)) for L-smooth client losses."""
        if L <= 0 or lam <= 0:
            raise ValueError(f"step_sizes: expected L > 0 and lam > 0, got L={L}, lam={lam}")
        return (lam + L) / (lam * L), 1.0 / (L + lam)

    @staticmethod
    def smoothness(federation) -> float:
        """L of logistic regression: max over clients of λ_max(X_iᵀX_i/n_i)/4."""
        L = 0.0
        for i in range(federation.num_clients):
            X = federation.train.client(i)[0].to(torch.float64)
            L = max(L, float(torch.linalg.eigvalsh(X.T @ X / X.shape[0])[-1]) / 4)
        return L

    def init(self, ctx: Context) -> FedProxState:
        return FedProxState(ctx.initial_models(ctx.m),
                            ctx.initial_global())

    def round(self, state: FedProxState, ctx: Context, t: int) -> FedProxState:
        S = ctx.sample_clients(t)
        theta = state.theta[S].contiguous()
        ctx.local_steps(theta, steps=self.local_steps, lr=self.local_lr, prox=self.lam,
                        anchor=state.w, rows=S)
        state.theta[S] = theta
        state.w = state.w - self.global_lr * self.lam * (state.w - ctx.average(theta, ctx.weights[S], center=state.w))
        return state

    def personalized(self, state: FedProxState) -> torch.Tensor:
        return state.theta

    def global_model(self, state: FedProxState) -> torch.Tensor:
        return state.w
