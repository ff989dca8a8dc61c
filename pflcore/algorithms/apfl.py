"""APFL (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", 2020, Alg. 1 with
the adaptive α of its eq. (10); a baseline of the CGPFL paper).

Client i keeps a local model v_i, a mixing weight α_i ∈ [0, 1] and, during a round, a copy w_i
of the global model; its personalized model is the mixture v̄_i = α_i v_i + (1 − α_i) w_i.
Round t: each sampled client sets w_i ← w and takes K simultaneous steps (s = 1..K, minibatch
D_s, the same for all three updates, all evaluated at the step's starting point):

    g_i = ∇f_i(v̄_i; D_s),                 v̄_i = α_i v_i + (1 − α_i) w_i
    w_i ← w_i − η ∇f_i(w_i; D_s)
    v_i ← v_i − η α_i g_i                  (= η ∇_{v_i} f_i(v̄_i): the gradient is exact)
    α_i ← clip_[0,1](α_i − η_α ⟨v_i − w_i, g_i⟩)   (adaptive_alpha only; ∂f_i(v̄_i)/∂α_i)

and the server sets w ← Σ_{i∈S} p_i w_i (p renormalized over S). The w-part is exactly
FedAvg's round (its steps go through ``ops.local_steps`` one step at a time), so APFL's w
follows FedAvg's bitwise. ∇f_i(v̄_i; D_s) comes from one ``ops.gradients`` call for all of S
(with ``batches`` for minibatches, so it is exact in both cases).

Evaluation: the personalized model of client i is α_i v_i + (1 − α_i) w with the current server
model w (the mixture a client holds right after it synchronizes, w_i = w); α = 0 makes it w.
A client never sampled keeps v_i at the initial point. The global model is w.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive, replicate


@dataclass
class APFLState:
    w: torch.Tensor      # [d] global model
    v: torch.Tensor = per_client()      # [m, d] local models v_i
    alpha: torch.Tensor = per_client()  # [m] mixing weights α_i ∈ [0, 1] (dtype of the data)


class APFL(Algorithm):
    """APFL (Y. Deng, M. Kamani, M. Mahdavi, "Adaptive Personalized Federated Learning", 2020,
    Alg. 1).

    Each round, every sampled client takes ``local_steps`` simultaneous steps of size ``lr`` on
    its copy of the global model w_i and on its local model v_i (through the mixture
    α_i v_i + (1 − α_i) w_i, α_i starting at ``alpha``); ``adaptive_alpha=True`` also moves α_i
    by gradient steps of size ``alpha_lr`` (default ``lr``, the paper's eq. (10)). ``batch_size``:
    minibatch rows (None: full batch). The server averages the w_i. Personalized models: the
    mixtures with the current w."""

    name = "APFL"
    marks_changed_rows = True  # a round changes the sampled clients' rows of v and alpha only

    def __init__(self, alpha: float, lr: float, local_steps: int = 1, adaptive_alpha: bool = False,
                 alpha_lr: Optional[float] = None, batch_size: Optional[int] = None):
        n = self.name
        self.alpha = positive(alpha, "alpha", n, allow_zero=True)
        if self.alpha > 1:
            raise ValueError(f"{n}: alpha must be in [0, 1] (the weight of the local model), got {alpha!r}")
        self.lr = positive(lr, "lr", n)
        self.local_steps = count_int(local_steps, "local_steps", n)
        self.adaptive_alpha = bool(adaptive_alpha)
        self.alpha_lr = self.lr if alpha_lr is None else positive(alpha_lr, "alpha_lr", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)

    def init(self, ctx: Context) -> APFLState:
        alpha = torch.full((ctx.m,), self.alpha, dtype=ctx.dtype, device=ctx.device)
        return APFLState(ctx.initial_global(), ctx.initial_models(ctx.m), alpha)

    def round(self, state: APFLState, ctx: Context, t: int) -> APFLState:
        S = ctx.sample_clients(t)
        n = S.numel()
        W = replicate(state.w, n)
        V = state.v[S].contiguous()
        a = state.alpha[S].clone()                      # [S]
        b = None if self.batch_size is None else ctx.batches(t, 0, S, self.local_steps, self.batch_size)
        # With α fixed at 0 the mixture is w_i and v never moves: skip its gradients.
        moves_v = self.adaptive_alpha or self.alpha > 0
        for s in range(self.local_steps):
            bs = None if b is None else b[:, s:s + 1].contiguous()   # int32 [S, 1, B]
            if moves_v:
                mix = a[:, None] * V + (1 - a[:, None]) * W          # [S, d] v̄_i at the step's start
                g = ctx.gradients(mix, rows=S, batches=None if bs is None else bs[:, 0])
                da = ((V - W) * g).sum(1) if self.adaptive_alpha else None
            ctx.local_steps(W, steps=1, lr=self.lr, rows=S, batches=bs)
            if moves_v:
                V -= self.lr * a[:, None] * g
                if da is not None:
                    a = (a - self.alpha_lr * da).clamp_(0.0, 1.0)
        state.v[S] = V
        state.alpha[S] = a
        ctx.changed_rows(S)
        state.w = ctx.average(W, ctx.weights[S], center=state.w)
        return state

    def personalized(self, state: APFLState) -> torch.Tensor:
        a = state.alpha[:, None]
        return a * state.v + (1 - a) * state.w

    def global_model(self, state: APFLState) -> torch.Tensor:
        return state.w
