"""Per-FedAvg (Fallah et al.), the MAML-style baseline of the pFedMe paper (DESIGN.md §5).

Each sampled client starts from w and takes τ steps of
    w ← w − β ĝ,  ĝ = ∇f(w − α∇f(w; D); D')                       (FO)
    ĝ = (I − α∇²f(w; D''))∇f(w − α∇f(w; D); D')                  (HF)
on independent minibatches D, D', D''; the server averages. The personalized model of client
i is one step from the global model on its own data: θ_i = w − α∇f_i(w). For GLMs the
Hessian-vector product is exact (``ops.hvp``: closed form for GLMs, autodiff for nets), not a
finite difference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, positive, replicate


@dataclass
class PerFedAvgState:
    w: torch.Tensor         # [d] global (meta) model


class PerFedAvg(Algorithm):
    """Per-FedAvg (A. Fallah, A. Mokhtari, A. Ozdaglar, "Personalized Federated Learning with
    Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020).

    Each round, every sampled client takes ``local_steps`` meta-steps from the global model w,
    w ← w − ``beta``·ĝ with ĝ the gradient at w − ``alpha``∇f(w; D) on fresh minibatches of
    ``batch_size`` rows (``variant="FO"``: first order; "HF": with the exact Hessian-vector
    product term); the server averages them. The personalized model of a client is one step
    w − ``alpha``∇f_i(w) on its data, computed when the round is evaluated."""

    name = "Per-FedAvg"

    def __init__(self, alpha: float, beta: float, variant: str = "FO", local_steps: int = 20, batch_size: int = 20):
        self.alpha = positive(alpha, "alpha", self.name)
        self.beta = positive(beta, "beta", self.name)
        if variant not in ("FO", "HF"):
            raise ValueError(f"{self.name}: variant must be 'FO' or 'HF', got {variant!r}")
        self.variant = variant
        self.local_steps = count_int(local_steps, "local_steps", self.name)
        self.batch_size = count_int(batch_size, "batch_size", self.name)

    def init(self, ctx: Context) -> PerFedAvgState:
        return PerFedAvgState(ctx.initial_global())

    def round(self, state: PerFedAvgState, ctx: Context, t: int) -> PerFedAvgState:
        S = ctx.sample_clients(t)
        n, B = S.numel(), self.batch_size
        W = replicate(state.w, n)
        for s in range(self.local_steps):
            draws = ctx.batches(t, s, S, 3, B)  # D, D', D'' for this step
            D, D2, D3 = (draws[:, j].contiguous() for j in range(3))
            tmp = W - self.alpha * ctx.gradients(W, rows=S, batches=D)
            g = ctx.gradients(tmp, rows=S, batches=D2)
            if self.variant == "HF":
                g = g - self.alpha * ctx.hvp(W, g, batches=D3, rows=S)
            W = W - self.beta * g
        state.w = ctx.average(W.contiguous(), ctx.weights[S], center=state.w)
        return state

    def evaluated_models(self, state: PerFedAvgState, ctx: Context):
        """The personalized model of client i is one step from w on its own data, w − α∇f_i(w):
        computed here, for the clients' evaluation (one gradients call at the shared w), not in
        every round."""
        return state.w[None, :] - self.alpha * ctx.gradients(state.w), state.w

    def global_model(self, state: PerFedAvgState) -> torch.Tensor:
        return state.w
