"""pFedMe ("Personalized Federated Learning with Moreau Envelopes", Alg. 1; DESIGN.md §5).

Round t: the server sends w; each training client sets w_i ← w and θ_i ← w, then for
r = 1..R draws a minibatch D and approximately solves the personal problem
min_θ f_i(θ; D) + λ/2‖θ − w_i‖² with K gradient steps of size ``personal_lr`` (one
``ops.local_steps`` call for all clients: prox = λ, anchor = w_i), and moves
w_i ← w_i − η λ (w_i − θ_i). The server sets w ← (1 − β) w + β Σ_{i∈S} p_i w_i (p over S).
``train_all`` (the public code): every client trains and the sampled S are aggregated; else only
S trains. ``personal_eval``: "theta" evaluates θ_i, "local" evaluates w_i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, ServerModelFixedPoint, count_int, per_client, positive, replicate


@dataclass
class PFedMeState:
    w: torch.Tensor        # [d] global model
    w_local: torch.Tensor = per_client()  # [m, d] local models w_i
    theta: torch.Tensor = per_client()    # [m, d] personal models θ_i


class PFedMe(ServerModelFixedPoint, Algorithm):
    """pFedMe (T. Dinh, N. Tran, T. Nguyen, "Personalized Federated Learning with Moreau
    Envelopes", NeurIPS 2020, Alg. 1).

    Each round, every trainer sets w_i ← θ_i ← w and, ``local_rounds`` times, draws a minibatch
    of ``batch_size`` rows, takes ``inner_steps`` gradient steps of size ``personal_lr`` on
    f_i(θ; D) + ``lam``/2‖θ − w_i‖² (the personal problem) and moves w_i ← w_i − ``lr``·``lam``
    (w_i − θ_i); the server sets w ← (1 − ``beta``) w + ``beta`` Σ_{i∈S} p_i w_i over the sampled
    clients S. ``train_all=True`` (the default, the paper's public code): ALL m clients train every
    round and only the sampled ones are averaged, i.e. m/clients_per_round times the local work
    and two more [m, d] working matrices (``pflcore.run`` warns with the estimate);
    ``train_all=False`` trains only S. ``personal_eval``: "theta" evaluates the personal models
    θ_i, "local" the local models w_i."""

    name = "pFedMe"

    def __init__(self, lam: float, lr: float, personal_lr: float, inner_steps: int = 5, local_rounds: int = 20,
                 beta: float = 1.0, batch_size: int = 20, train_all: bool = True, personal_eval: str = "theta"):
        self.lam = positive(lam, "lam", self.name)
        self.lr = positive(lr, "lr", self.name)
        self.personal_lr = positive(personal_lr, "personal_lr", self.name)
        self.inner_steps = count_int(inner_steps, "inner_steps", self.name)
        self.local_rounds = count_int(local_rounds, "local_rounds", self.name)
        self.beta = positive(beta, "beta", self.name)
        self.batch_size = count_int(batch_size, "batch_size", self.name)
        self.train_all = bool(train_all)
        if personal_eval not in ("theta", "local"):
            raise ValueError(f"{self.name}: personal_eval must be 'theta' or 'local', got {personal_eval!r}")
        self.personal_eval = personal_eval

    working_copies = 2  # the round's w_i and θ_i of every trainer
    marks_changed_rows = True  # a round changes the trainers' rows of w_local and theta only

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        return m if self.train_all else super().clients_trained_per_round(m, clients_per_round)

    def training_note(self) -> str:
        return ("train_all=True, the paper's behaviour: all m clients train every round and the sampled ones are "
                "averaged; train_all=False trains only the sampled clients" if self.train_all else "")

    def init(self, ctx: Context) -> PFedMeState:
        zeros = ctx.initial_models(ctx.m)
        return PFedMeState(ctx.initial_global(), zeros, zeros.clone())

    def round(self, state: PFedMeState, ctx: Context, t: int) -> PFedMeState:
        S = ctx.sample_clients(t)
        trainers = torch.arange(ctx.m, device=ctx.device) if self.train_all else S
        T = trainers.numel()
        w_local = replicate(state.w, T)
        theta = w_local.clone()
        for r in range(self.local_rounds):
            # One minibatch per local round, reused by the K inner steps.
            batches = ctx.batches(t, r, trainers, 1, self.batch_size, repeat=self.inner_steps)
            ctx.local_steps(theta, steps=self.inner_steps, lr=self.personal_lr, prox=self.lam, anchor=w_local,
                            rows=trainers, batches=batches)
            w_local -= self.lr * self.lam * (w_local - theta)
        state.w_local[trainers] = w_local
        state.theta[trainers] = theta
        ctx.changed_rows(trainers)
        mean = ctx.average(state.w_local[S].contiguous(), ctx.weights[S], center=state.w)
        state.w = (1 - self.beta) * state.w + self.beta * mean
        return state

    def personalized(self, state: PFedMeState) -> torch.Tensor:
        return state.theta if self.personal_eval == "theta" else state.w_local

    def global_model(self, state: PFedMeState) -> torch.Tensor:
        return state.w
