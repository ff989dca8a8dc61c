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
    """LocalTrain, the local baseline of the personalization papers: each client trains its own
    model alone. Every round, EVERY client (clients_per_round is not used; ``pflcore.run`` warns
    when it is below m) takes ``steps`` gradient steps of size ``lr``, on its full data or on
    minibatches of ``batch_size`` rows. No communication."""

    name = "LocalTrain"
    dp_releases_per_round = 0  # nothing leaves a client

    def __init__(self, lr: float, steps: int = 1, batch_size: Optional[int] = None):
        self.lr = positive(lr, "lr", self.name)
        self.steps = count_int(steps, "steps", self.name)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", self.name)

    working_copies = 0  # in place on the state's θ

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        return m

    def training_note(self) -> str:
        return "every client trains its own model every round; clients_per_round is not used"

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
    """FedAvg (B. McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017; = GlobalTrain, the global baseline): each round the
    sampled clients take ``local_steps`` steps of size ``lr`` from the global model, on their
    full data or on minibatches of ``batch_size`` rows; the server averages them with the client
    weights p_i (renormalized over the sample)."""

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
        state.w = ctx.average(theta, ctx.weights[S], center=state.w)
        return state

    def global_model(self, state: GlobalState) -> torch.Tensor:
        return state.w


@dataclass
class LocalizedState:
    """The state of LocalizedFedAvg before it fine-tuned at evaluation only (it held the
    fine-tuned θ [m, d] too): kept so that its checkpoints still load; FedAvg's GlobalState now."""
    w: torch.Tensor


class LocalizedFedAvg(FedAvg):
    """Localized FedAvg (PERM's baseline, "Distributed Personalized Empirical Risk
    Minimization"): FedAvg, whose global model every client then fine-tunes on its own data.

    Each round is FedAvg's (``lr``, ``local_steps``, ``batch_size``: see FedAvg): the sampled
    clients train from the global model and the server averages them. The personalized models are
    computed only when the round is evaluated (``evaluated_models``): every client takes
    ``finetune_steps`` full-batch gradient steps of size ``finetune_lr`` (default ``lr``) from the
    global model on its own training data. That is what the fine-tuning after every round gave,
    bitwise, without its cost on rounds that are not evaluated; the fine-tuning steps are not
    counted as training client-steps (they are evaluation's)."""

    name = "LocalizedFedAvg"

    def __init__(self, lr: float, local_steps: int = 1, batch_size: Optional[int] = None, finetune_steps: int = 5,
                 finetune_lr: Optional[float] = None):
        super().__init__(lr, local_steps, batch_size)
        self.finetune_steps = count_int(finetune_steps, "finetune_steps", self.name)
        self.finetune_lr = self.lr if finetune_lr is None else positive(finetune_lr, "finetune_lr", self.name)

    def evaluated_models(self, state: GlobalState, ctx: Context):
        theta = replicate(state.w, ctx.m)
        counted = ctx.client_steps
        ctx.local_steps(theta, steps=self.finetune_steps, lr=self.finetune_lr)
        ctx.client_steps = counted  # evaluation's work: client_steps_per_s is training throughput
        return theta, state.w
