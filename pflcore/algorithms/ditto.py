"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Alg. 1; the baseline of the CGPFL paper).

Round t: the server sends w to the sampled clients S. Each client i ∈ S

    global part:   w_i ← w, then K steps      w_i ← w_i − η ∇f_i(w_i; D)
    personal part: warm start from its v_i, s steps
                                   v_i ← v_i − η_v (∇f_i(v_i; D') + λ (v_i − w))

(the anchor of the prox is the w the client received, as in the paper), and the server sets
w ← Σ_{i∈S} p_i w_i (p renormalized over S). Both parts are one ``ops.local_steps`` call for
all of S (the personal one with prox = λ, anchor = w); the global part is exactly FedAvg's
round, so Ditto's w follows FedAvg's bitwise. Personalized models are v (a client never
sampled keeps its initial v); the global model is w. λ → 0 gives local training of v, λ → ∞
pins v to w.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive, replicate


@dataclass
class DittoState:
    w: torch.Tensor  # [d] global model
    v: torch.Tensor = per_client()  # [m, d] personal models


class Ditto(Algorithm):
    """Ditto (T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated Learning
    Through Personalization", ICML 2021, Alg. 1).

    Each round, every sampled client takes ``local_steps`` steps of size ``lr`` from the global
    model (FedAvg's part, averaged by the server) and ``personal_steps`` steps (default
    ``local_steps``) of size ``personal_lr`` (default ``lr``) on its personal model v_i, on
    f_i(v) + ``lam``/2‖v − w‖². ``batch_size``: minibatch rows (None: full batch). Personalized
    models: v."""

    name = "Ditto"
    marks_changed_rows = True  # a round changes the sampled clients' rows of v only

    def __init__(self, lam: float, lr: float, local_steps: int = 1, personal_lr: Optional[float] = None,
                 personal_steps: Optional[int] = None, batch_size: Optional[int] = None):
        n = self.name
        self.lam = positive(lam, "lam", n, allow_zero=True)
        self.lr = positive(lr, "lr", n)
        self.local_steps = count_int(local_steps, "local_steps", n)
        self.personal_lr = self.lr if personal_lr is None else positive(personal_lr, "personal_lr", n)
        self.personal_steps = self.local_steps if personal_steps is None else count_int(
            personal_steps, "personal_steps", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)
        if self.personal_lr * self.lam >= 2:
            # The prox part of a personal step multiplies v − w by (1 − η_v λ): |1 − η_v λ| < 1 needs η_v λ < 2.
            raise ValueError(f"{n}: personal_lr·lam must be < 2, or the personal steps overshoot and diverge "
                             f"(got personal_lr = {self.personal_lr!r}, lam = {lam!r}; "
                             f"personal_lr = 1/lam pins v to w for large lam)")

    def init(self, ctx: Context) -> DittoState:
        return DittoState(ctx.initial_global(), ctx.initial_models(ctx.m))

    def round(self, state: DittoState, ctx: Context, t: int) -> DittoState:
        S = ctx.sample_clients(t)
        n = S.numel()
        W = replicate(state.w, n)
        b = None if self.batch_size is None else ctx.batches(t, 0, S, self.local_steps, self.batch_size)
        ctx.local_steps(W, steps=self.local_steps, lr=self.lr, rows=S, batches=b)
        V = state.v[S].contiguous()
        bv = None if self.batch_size is None else ctx.batches(t, 1, S, self.personal_steps, self.batch_size)
        ctx.local_steps(V, steps=self.personal_steps, lr=self.personal_lr, prox=self.lam,
                        anchor=state.w, rows=S, batches=bv)
        state.v[S] = V
        ctx.changed_rows(S)
        state.w = ctx.average(W, ctx.weights[S], center=state.w)
        return state

    def personalized(self, state: DittoState) -> torch.Tensor:
        return state.v

    def global_model(self, state: DittoState) -> torch.Tensor:
        return state.w
