"""Partial personalization of a net: a shared body, a personal head (the last layer).

FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
Layers", 2019) and FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared
Representations for Personalized Federated Learning", ICML 2021, Alg. 1), both PFLlib baselines.

Round t: the server sends the body of w to the sampled clients S. Each client i ∈ S starts from
(body of w, its own head h_i) and

    FedPer:  ``local_steps`` steps on every parameter;
    FedRep:  ``head_steps`` steps on the head alone (body frozen), then ``body_steps`` steps on
             the body alone (head frozen);

and the server sets the body of w to Σ_{i∈S} p_i body_i (p renormalized over S); each client
keeps its head. A client's personalized model is (body of w, h_i). Each phase is one
``ctx.local_steps`` call for all of S, with ``lr_scale`` the 0/1 mask of the part that trains:
the frozen layers are skipped inside the fused steps, so no per-step Python loop is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive
from pflcore.models.nets import TorchNet


def head_mask(model) -> torch.Tensor:
    """``[d]`` float mask, 1 on the parameters of a net's last layer (its weight and bias: the
    head), 0 on the others (the body)."""
    if not isinstance(model, TorchNet) or len(model.param_shapes) < 4:
        raise ValueError(f"model: expected a net with at least two layers (a body and a head; e.g. "
                         f"pflcore.models.MLP), got {model!r}")
    sizes = [int(torch.Size(shape).numel()) for _, shape in model.param_shapes]
    head = sum(sizes[-2:])  # the last layer's weight and bias
    mask = torch.zeros(model.d, dtype=torch.float64)
    mask[model.d - head:] = 1.0
    return mask


@dataclass
class SharedBodyState:
    w: torch.Tensor  # [d] the server's model: its body is shared (its head is unused)
    heads: torch.Tensor = per_client()  # [m, d] each client's model: its head is the client's own


class _SharedBody(Algorithm):
    """The round and the models of FedPer and FedRep; ``_train`` runs a client's local phase."""

    marks_changed_rows = True  # a round changes the sampled clients' rows of heads only

    def __init__(self, lr: float, batch_size: Optional[int]):
        self.lr = positive(lr, "lr", self.name)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", self.name)

    def init(self, ctx: Context) -> SharedBodyState:
        self._mask(ctx)  # a GLM is refused before any round
        return SharedBodyState(ctx.initial_global(), ctx.initial_models(ctx.m))

    def _mask(self, ctx: Context) -> torch.Tensor:
        cached = getattr(ctx, "_head_mask", None)
        if cached is None:
            cached = ctx._head_mask = head_mask(ctx.model).to(device=ctx.device, dtype=ctx.train.dtype)
        return cached

    def _with_body(self, heads: torch.Tensor, w: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """``heads`` rows with the body of ``w`` (a new [R, d]; values copied, not mixed)."""
        return torch.where(head.bool(), heads, w)

    def round(self, state: SharedBodyState, ctx: Context, t: int) -> SharedBodyState:
        S = ctx.sample_clients(t)
        head = self._mask(ctx)
        theta = self._with_body(state.heads[S], state.w, head).contiguous()
        self._train(theta, ctx, t, S, head)
        state.heads[S] = theta
        ctx.changed_rows(S)
        # its body is the new shared body; the heads stay on the clients (sent as the old w's: no release)
        state.w = ctx.average(self._with_body(state.w, theta, head).contiguous(), ctx.weights[S], center=state.w)
        return state

    def _batches(self, ctx: Context, t: int, stream: int, S: torch.Tensor, steps: int):
        return None if self.batch_size is None else ctx.batches(t, stream, S, steps, self.batch_size)

    def evaluated_models(self, state: SharedBodyState, ctx: Context):
        return self._with_body(state.heads, state.w, self._mask(ctx)), None


class FedPer(_SharedBody):
    """FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019).
    Each round the sampled clients train every parameter (``local_steps`` steps of size ``lr``,
    minibatches of ``batch_size`` or full batch) from (shared body, own head); the server
    averages the bodies, each client keeps its head. Needs a net (``MLP``, ``CNN``)."""

    name = "FedPer"

    def __init__(self, lr: float, local_steps: int = 1, batch_size: Optional[int] = None):
        super().__init__(lr, batch_size)
        self.local_steps = count_int(local_steps, "local_steps", self.name)

    def _train(self, theta, ctx, t, S, head) -> None:
        ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=S,
                        batches=self._batches(ctx, t, 0, S, self.local_steps))


class FedRep(_SharedBody):
    """FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
    Learning", ICML 2021, Alg. 1). Each round the sampled clients take ``head_steps`` steps on
    their head (body frozen), then
    ``body_steps`` steps on the body (head frozen), of size ``lr`` (``head_lr`` for the head
    steps, default ``lr``), on minibatches of ``batch_size`` or full batch; the server averages
    the bodies, each client keeps its head. Needs a net (``MLP``, ``CNN``)."""

    name = "FedRep"

    def __init__(self, lr: float, head_steps: int = 10, body_steps: int = 1, head_lr: Optional[float] = None,
                 batch_size: Optional[int] = None):
        super().__init__(lr, batch_size)
        self.head_steps = count_int(head_steps, "head_steps", self.name)
        self.body_steps = count_int(body_steps, "body_steps", self.name)
        self.head_lr = self.lr if head_lr is None else positive(head_lr, "head_lr", self.name)

    def _body(self, head: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_body_of", (None,))[0] is not head:  # the complement, once per run
            self._body_of = (head, 1.0 - head)
        return self._body_of[1]

    def _train(self, theta, ctx, t, S, head) -> None:
        ctx.local_steps(theta, steps=self.head_steps, lr=self.head_lr, rows=S, lr_scale=head,
                        batches=self._batches(ctx, t, 0, S, self.head_steps))
        ctx.local_steps(theta, steps=self.body_steps, lr=self.lr, rows=S, lr_scale=self._body(head),
                        batches=self._batches(ctx, t, 1, S, self.body_steps))
