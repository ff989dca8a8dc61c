"""LocalTrain (every client alone) and FedAvg (= GlobalTrain) (DESIGN.md §5)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, ServerModelFixedPoint, count_int, per_client, positive, replicate


@dataclass
class LocalState:
    theta: torch.Tensor = per_client()  # [m, d] one model per client


class LocalTrain(Algorithm):
    """Each client trains its own model: ``steps`` gradient steps of size ``lr`` per round, on
    its full data or on minibatches of ``batch_size``. No communication."""

    name = "LocalTrain"

    def __init__(self, lr: float, steps: int = 1, batch_size: Optional[int] = None):
        self.lr = positive(lr, "lr", self.name)
        self.steps = count_int(steps, "steps", self.name)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", self.name)

    def init(self, ctx: Context) -> LocalState:
        return LocalState(ctx.initial_models(ctx.m))

    def round(self, state: LocalState, ctx: Context, t: int) -> LocalState:
        clients = torch.arange(ctx.m, device=ctx.device)
        b = None if self.batch_size is None else ctx.batches(t, 0, clients, self.steps, self.batch_size)
        ctx.local_steps(state.theta, steps=self.steps, lr=self.lr, batches=b)
        return state

    def personalized(self, state: LocalState) -> torch.Tensor:
        return state.theta


@dataclass
class GlobalState:
    w: torch.Tensor  # [d] the global model


class FedAvg(ServerModelFixedPoint, Algorithm):
    """FedAvg: the sampled clients take ``local_steps`` steps of size ``lr`` from the global
    model; the server averages them with the client weights p_i (renormalized over the sample)."""

    name = "FedAvg"

    def __init__(self, lr: float, local_steps: int = 1, batch_size: Optional[int] = None):
        self.lr = positive(lr, "lr", self.name)
        self.local_steps = count_int(local_steps, "local_steps", self.name)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", self.name)

    def init(self, ctx: Context) -> GlobalState:
        return GlobalState(ctx.initial_global())

    def round(self, state: GlobalState, ctx: Context, t: int) -> GlobalState:
        S = ctx.sample_clients(t)
        theta = replicate(state.w, S.numel())
        b = None if self.batch_size is None else ctx.batches(t, 0, S, self.local_steps, self.batch_size)
        ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=S, batches=b)
        state.w = ctx.average(theta, ctx.weights[S])
        return state

    def global_model(self, state: GlobalState) -> torch.Tensor:
        return state.w


@dataclass
class LocalizedState:
    w: torch.Tensor      # [d] the global model
    theta: torch.Tensor = per_client()  # [m, d] w fine-tuned on each client's training data


class LocalizedFedAvg(FedAvg):
    """FedAvg followed by local fine-tuning ("localized FedAvg", PERM's baseline): after each
    round every client takes ``finetune_steps`` full-batch gradient steps of ``finetune_lr``
    from the new global model on its own data; those are the personalized models."""

    name = "LocalizedFedAvg"

    def __init__(self, lr: float, local_steps: int = 1, batch_size: Optional[int] = None, finetune_steps: int = 5,
                 finetune_lr: Optional[float] = None):
        super().__init__(lr, local_steps, batch_size)
        self.finetune_steps = count_int(finetune_steps, "finetune_steps", self.name)
        self.finetune_lr = self.lr if finetune_lr is None else positive(finetune_lr, "finetune_lr", self.name)

    def init(self, ctx: Context) -> LocalizedState:
        return LocalizedState(ctx.initial_global(), ctx.initial_models(ctx.m))

    def round(self, state: LocalizedState, ctx: Context, t: int) -> LocalizedState:
        state = super().round(state, ctx, t)
        state.theta = replicate(state.w, ctx.m)
        ctx.local_steps(state.theta, steps=self.finetune_steps, lr=self.finetune_lr)
        return state

    def personalized(self, state: LocalizedState) -> torch.Tensor:
        return state.theta
