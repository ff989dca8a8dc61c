"""Anderson acceleration of any fixed-point algorithm (the unifying paper, §4.2): the server
treats one round as a map u ← T(u) on the algorithm's fixed-point state and replaces T(u) by the
Anderson (type II) mixture of the last ``memory`` + 1 pairs, through ``ops.Anderson``. It needs
no extra communication: u and T(u) already live on the server.

Sharded runs: a server model (FedAvg, pFedMe) is the same on every rank, and so is every
Anderson step. A per-client fixed point (the grand scheme's u [m, d]) is split over the ranks
with its clients: each rank keeps the history of its rows, and the k dot products of the new
Gram column are summed over the ranks (one all-reduce of k float64) before the small solve,
so every rank mixes with the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pflcore import ops
from pflcore.algorithms.base import Algorithm, Context


@dataclass
class AcceleratedState:
    inner: Any               # the wrapped algorithm's state
    anderson: ops.Anderson   # the mixer with its history (saved with checkpoints)
    residual: Optional[float] = None  # ‖T(u) − u‖ of the last round; None before the first
    per_client: bool = False  # the fixed point (and so the history) is per client: split with the clients


class Accelerated(Algorithm):
    """Anderson acceleration of a fixed-point algorithm ("A Unifying Framework for Federated
    Learning", §4.2): ``algorithm`` (FedAvg, pFedMe, the grand scheme ...: anything with
    fixed_point/set_fixed_point) runs its round as a map u ← T(u), and the server replaces T(u)
    by the Anderson (type II) mixture of the last ``memory`` + 1 pairs, regularized by ``reg``;
    ``safeguard=True`` resets the history and takes the plain step T(u) when the residual grows
    more than tenfold over the last accepted one. No extra
    communication. ``anderson = τ`` in an experiment file wraps an algorithm in it."""

    def __init__(self, algorithm: Algorithm, memory: int = 5, reg: float = 1e-8, safeguard: bool = True):
        if not (hasattr(algorithm, "fixed_point") and hasattr(algorithm, "set_fixed_point")):
            raise ValueError(f"algorithm: {type(algorithm).__name__} does not expose a fixed-point state "
                             f"(fixed_point / set_fixed_point)")
        self.algorithm = algorithm
        self.memory, self.reg, self.safeguard = memory, reg, safeguard
        ops.Anderson(memory, reg, safeguard)  # validates the arguments now
        self.name = f"{algorithm.name}+Anderson"

    def init(self, ctx: Context) -> AcceleratedState:
        return AcceleratedState(self.algorithm.init(ctx), ops.Anderson(self.memory, self.reg, self.safeguard),
                                per_client=self._per_client)

    @property
    def dp_releases_per_round(self) -> int:
        return self.algorithm.dp_releases_per_round

    @property
    def dp_unsupported(self):
        if self._per_client:  # FedSplit's u_i: the mixture needs every client's vector at the server
            return "its Anderson mixing of a per-client fixed point needs every client's vector at the server"
        return self.algorithm.dp_unsupported  # a server-side mixture of released models: post-processing

    @property
    def _per_client(self) -> bool:
        return bool(getattr(self.algorithm, "fixed_point_per_client", False))

    def round(self, state: AcceleratedState, ctx: Context, t: int) -> AcceleratedState:
        alg = self.algorithm
        u = alg.fixed_point(state.inner).clone()
        state.inner = alg.round(state.inner, ctx, t)
        tu = alg.fixed_point(state.inner)
        sharded = ctx.sharded and self._per_client
        state.residual = ctx.norm(tu - u) if sharded else float((tu - u).norm())
        reduce = ctx.comm.all_reduce if sharded else None  # the Gram column's dots over all ranks
        state.inner = alg.set_fixed_point(state.inner, state.anderson.step(u, tu, reduce=reduce))
        return state

    def personalized(self, state: AcceleratedState) -> Optional[torch.Tensor]:
        return self.algorithm.personalized(state.inner)

    def global_model(self, state: AcceleratedState) -> Optional[torch.Tensor]:
        return self.algorithm.global_model(state.inner)

    def evaluated_models(self, state: AcceleratedState, ctx: Context):
        return self.algorithm.evaluated_models(state.inner, ctx)

    @property
    def working_copies(self) -> int:
        return self.algorithm.working_copies

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        return self.algorithm.clients_trained_per_round(m, clients_per_round)

    def training_note(self) -> str:
        return self.algorithm.training_note()

    def residual(self, state: AcceleratedState) -> Optional[float]:
        return state.residual  # None before the first round: absent from the history
