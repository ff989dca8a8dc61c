"""L2SGD: loopless local gradient descent (Hanzely, Richtárik, "Federated Learning of a Mixture
of Global and Local Models", 2020, Alg. 1 "L2GD"; its minibatch form with ``batch_size``; a
baseline of the CGPFL paper).

Objective over the n = m local models x = (x_1 … x_n) [m, d]:

    F(x) = (1/n) Σ_i f_i(x_i) + λ/(2n) Σ_i ‖x_i − x̄‖²,    x̄ = (1/n) Σ_i x_i

(the same minimizer as Σ_i f_i(x_i) + λ/2 Σ_i ‖x_i − x̄‖²; clients weigh equally, as in the
paper, whatever the federation's p_i). Each iteration flips a coin ξ ~ Bernoulli(p):

    ξ = 0 (local step, prob 1 − p):  x_i ← x_i − α/(n(1 − p)) ∇f_i(x_i)     for every client
    ξ = 1 (averaging, prob p):       x_i ← x_i − αλ/(n p) (x_i − x̄)         for every client

an unbiased stochastic gradient step of size α = ``lr`` on F. Only averaging steps
communicate (expected p per iteration); every client takes part in every step, so
``clients_per_round`` is not used. L2GD converges linearly to a neighbourhood of x* whose
size shrinks with α (the coin's variance does not vanish at x*).

One round = ``iterations`` iterations; the coins of round t come from a generator keyed by
(ctx.seed, t) alone, so a resumed run flips the same coins. A run of consecutive local steps
is one ``ops.local_steps`` call; x̄ is one ``ops.average``. The averaging factor
c = αλ/(n p) must be ≤ 1 (c = 1 moves every x_i onto x̄; the paper's theory has c ≤ 1/2).

Personalized models: x; global model: x̄ (kept in the state, refreshed after every round).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive


@dataclass
class L2SGDState:
    x: torch.Tensor = per_client()  # [m, d] local models
    averaging_steps: int = 0        # communications so far (iterations whose coin said "average")
    x_bar: Optional[torch.Tensor] = None  # [d] mean of x over all clients (the global model)


def _uniform(rows: int, m: int, like: torch.Tensor) -> torch.Tensor:
    """``[rows]`` weights 1/m (m = clients of the whole federation; rows held here)."""
    return torch.full((rows,), 1.0 / m, dtype=like.dtype, device=like.device)


class L2SGD(Algorithm):
    """L2SGD / L2GD (F. Hanzely, P. Richtárik, "Federated Learning of a Mixture of Global and
    Local Models", 2020, Alg. 1).

    A round is ``iterations`` iterations; each flips a coin with probability ``p``: an averaging
    step pulls every x_i toward the mean by ``lr``·``lam``/(m·p), else every client takes a local
    gradient step of size ``lr``/(m(1 − p)) (minibatches of ``batch_size`` rows; None: full
    batch). Every client takes part in every step, so clients_per_round is not used (``pflcore.run``
    warns when it is below m). Personalized models: x; global model: their mean."""

    name = "L2SGD"
    dp_unsupported = "its server averages a random number of times per round"

    def __init__(self, lam: float, p: float, lr: float, iterations: int = 1, batch_size: Optional[int] = None):
        n = self.name
        self.lam = positive(lam, "lam", n, allow_zero=True)
        self.p = positive(p, "p", n)
        if self.p >= 1:
            raise ValueError(f"{n}: p must be in (0, 1) (the probability of an averaging step), got {p!r}")
        self.lr = positive(lr, "lr", n)
        self.iterations = count_int(iterations, "iterations", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)

    working_copies = 0  # in place on the state's x

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        return m

    def training_note(self) -> str:
        return "every client takes part in every iteration (the paper's loopless method); clients_per_round is not used"

    def step_sizes(self, m: int):
        """(local step α/(n(1−p)), averaging factor αλ/(n p)) for n = m clients."""
        return self.lr / (m * (1 - self.p)), self.lr * self.lam / (m * self.p)

    def init(self, ctx: Context) -> L2SGDState:
        m = ctx.num_clients
        _, c = self.step_sizes(m)
        if c > 1:
            raise ValueError(f"{self.name}: lr·lam/(m·p) must be <= 1 or the averaging step moves x_i past x̄ "
                             f"(got lr = {self.lr!r}, lam = {self.lam!r}, p = {self.p!r}, m = {m}: {c:.4g})")
        state = L2SGDState(ctx.initial_models(ctx.m))
        state.x_bar = ctx.average(state.x, _uniform(ctx.m, m, state.x))
        return state

    def coins(self, ctx: Context, t: int) -> torch.Tensor:
        """bool [iterations]: True where iteration j of round t is an averaging step."""
        g = torch.Generator().manual_seed((ctx.seed * 1_000_003 + t * 7919 + 0x12561) & 0x7FFFFFFFFFFFFFFF)
        return torch.rand(self.iterations, generator=g, dtype=torch.float64) < self.p

    def round(self, state: L2SGDState, ctx: Context, t: int) -> L2SGDState:
        m, held = ctx.num_clients, ctx.m
        local_lr, c = self.step_sizes(m)
        average = self.coins(ctx, t).tolist()
        everyone = torch.arange(held, device=ctx.device)
        b = None if self.batch_size is None else ctx.batches(t, 0, everyone, self.iterations, self.batch_size)
        x, j, local = state.x, 0, 0
        while j < self.iterations:
            if average[j]:
                if c > 0:  # λ = 0: the averaging step is the identity
                    x_bar = ctx.average(x, _uniform(held, m, x))
                    x -= c * (x - x_bar)
                state.averaging_steps += 1
                j += 1
                continue
            run = 1  # consecutive local steps form one local_steps call
            while j + run < self.iterations and not average[j + run]:
                run += 1
            bj = None if b is None else b[:, j:j + run].contiguous()
            ctx.local_steps(x, steps=run, lr=local_lr, batches=bj)
            local += run
            j += run
        state.x_bar = ctx.average(x, _uniform(held, m, x))
        return state

    def personalized(self, state: L2SGDState) -> torch.Tensor:
        return state.x

    def global_model(self, state: L2SGDState) -> torch.Tensor:
        return state.x_bar
