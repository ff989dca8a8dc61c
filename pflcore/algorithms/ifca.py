"""IFCA (Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
Learning", NeurIPS 2020, Alg. 2 with model averaging; a baseline of the CGPFL paper).

The server keeps K cluster models Ω = [ω_1 … ω_K] [K, d]. Round t, each sampled client i ∈ S

    estimates its cluster   k(i) = argmin_k f_i(ω_k)     (training data; ties → lowest k)
    trains it               θ_i ← ω_{k(i)}, K_loc steps θ_i ← θ_i − η ∇f_i(θ_i; D)

and the server averages per cluster, ω_k ← Σ_{i∈S, k(i)=k} p_i θ_i / Σ_{i∈S, k(i)=k} p_i
(a cluster nobody picked keeps its model). f_i(ω) = mean training loss + l2/2·‖ω‖². The
losses of all clients × models come from ONE batched ``ops.evaluate`` call (theta = Ω
repeated per client, rows = each client repeated K times); the per-cluster means are
``ops.average`` calls restricted to the cluster's rows (a loop over clusters, not clients).

``relabel_all=True``: after the server update every client re-estimates its cluster under the
new Ω (one evaluate over m·K rows), so ``state.labels`` and the personalized models ω_{k(i)}
are current for every client; the sampled clients of the next round then reuse these labels,
which are the ones they would compute (Ω has not changed since). ``relabel_all=False`` only
evaluates the S·K pairs of each round and leaves the other clients' labels as they were;
training is identical either way, only the personalized models of unsampled clients differ.

Initialization ``init="random"``: ω_k = θ₀ + ``init_scale``·ξ_k, ξ_k ~ N(0, I_d) drawn from a
generator seeded by ``ctx.seed`` (θ₀ the model's initial point; with K = 1 no perturbation, so
IFCA with one cluster is FedAvg exactly). The perturbation breaks the symmetry of the clusters;
its scale decides how different the clusters start (logits move by about
``init_scale``·‖x‖). ``init`` may also be a ``[K, d]`` tensor (e.g. a good initialization).

Personalized model of client i: ω_{k(i)}. Global model: the mixture Σ_k q_k ω_k with q_k the
weight Σ_{i: k(i)=k} p_i of the clients in cluster k (with K = 1 this is ω_1, FedAvg's model),
kept in the state (``cluster_weights``) so that it covers every rank's clients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive


@dataclass
class IFCAState:
    models: torch.Tensor                  # [K, d] cluster models Ω
    labels: torch.Tensor = per_client()   # int64 [m] cluster of each client (its last estimate)
    weights: torch.Tensor = per_client()  # [m] client weights p_i (for the global mixture; dtype of the data)
    cluster_weights: Optional[torch.Tensor] = None  # [K] q_k = Σ_{i: k(i)=k} p_i over all clients


class IFCA(Algorithm):
    """IFCA (A. Ghosh, J. Chung, D. Yin, K. Ramchandran, "An Efficient Framework for Clustered
    Federated Learning", NeurIPS 2020, Alg. 2 with model averaging).

    The server keeps ``num_clusters`` models. Each round, every sampled client picks the cluster
    model with the lowest training loss, takes ``local_steps`` steps of size ``lr`` from it
    (minibatches of ``batch_size`` rows; None: full batch) and the server averages per cluster.
    ``init``: "random" (the initial point + ``init_scale``·N(0, I) per cluster) or a [K, d]
    tensor. ``relabel_all=True`` re-estimates every client's cluster after each round (one
    batched evaluation of m·K losses), else only the sampled clients'. Personalized models: each
    client's cluster model."""

    name = "IFCA"
    dp_unsupported = "its server averages within the clusters the clients chose, which releases every cluster's membership"

    def __init__(self, num_clusters: int, lr: float, local_steps: int = 1, batch_size: Optional[int] = None,
                 init: Union[str, torch.Tensor] = "random", init_scale: float = 0.1, relabel_all: bool = True):
        n = self.name
        self.num_clusters = count_int(num_clusters, "num_clusters", n)
        self.lr = positive(lr, "lr", n)
        self.local_steps = count_int(local_steps, "local_steps", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)
        if isinstance(init, str):
            if init != "random":
                raise ValueError(f"{n}: init must be 'random' or a [K, d] tensor, got {init!r}")
        elif not isinstance(init, torch.Tensor) or init.dim() != 2 or init.shape[0] != self.num_clusters:
            shape = list(init.shape) if isinstance(init, torch.Tensor) else type(init).__name__
            raise ValueError(f"{n}: init must be 'random' or a [K, d] tensor with K = {self.num_clusters}, "
                             f"got {shape}")
        self.init_models = init
        self.init_scale = positive(init_scale, "init_scale", n, allow_zero=True)
        self.relabel_all = bool(relabel_all)

    def init(self, ctx: Context) -> IFCAState:
        K = self.num_clusters
        if isinstance(self.init_models, torch.Tensor):
            if self.init_models.shape[1] != ctx.d:
                raise ValueError(f"{self.name}: init must have shape [K, d] = [{K}, {ctx.d}], "
                                 f"got {list(self.init_models.shape)}")
            models = self.init_models.to(dtype=ctx.dtype, device=ctx.device).clone()
        else:
            models = ctx.initial_models(K)
            if K > 1:
                g = torch.Generator().manual_seed((ctx.seed * 1_000_003 + 0x1FCA) & 0x7FFFFFFFFFFFFFFF)
                xi = torch.randn(K, ctx.d, generator=g, dtype=torch.float64)
                models = models + (self.init_scale * xi).to(dtype=ctx.dtype, device=ctx.device)
        everyone = torch.arange(ctx.m, device=ctx.device)
        state = IFCAState(models, self.cluster_of(models, ctx, everyone), ctx.weights.clone())
        state.cluster_weights = self._cluster_weights(state, ctx)
        return state

    @staticmethod
    def _cluster_weights(state: IFCAState, ctx: Context) -> torch.Tensor:
        K = state.models.shape[0]
        q = torch.zeros(K, dtype=state.weights.dtype, device=state.weights.device)
        return ctx.sum(q.index_add_(0, state.labels, state.weights))

    def cluster_of(self, models: torch.Tensor, ctx: Context, clients: torch.Tensor) -> torch.Tensor:
        """int64 [n] argmin_k f_i(ω_k) for each client of ``clients`` [n] (ties → lowest k)."""
        K, n = models.shape[0], clients.numel()
        theta = models.repeat(n, 1)                         # [n·K, d]: row c·K + k holds ω_k
        rows = clients.repeat_interleave(K)                 # [n·K]: client c for its K rows
        loss, _, count = ctx.evaluate(theta, rows=rows)
        risk = (loss.double() / count.double()).view(n, K)
        risk = risk + 0.5 * ctx.model.l2 * (models.double() ** 2).sum(1)  # the l2 term of f_i
        return risk.argmin(1)  # torch returns the first minimal index

    def round(self, state: IFCAState, ctx: Context, t: int) -> IFCAState:
        S = ctx.sample_clients(t)
        labels = state.labels[S] if self.relabel_all else self.cluster_of(state.models, ctx, S)
        theta = state.models[labels].contiguous()           # [S, d]
        b = None if self.batch_size is None else ctx.batches(t, 0, S, self.local_steps, self.batch_size)
        ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=S, batches=b)
        w = ctx.weights[S]
        # The clusters some sampled client picked, on any rank: a loop over the (few) clusters.
        picked = ctx.sum(torch.bincount(labels, minlength=state.models.shape[0])) > 0
        for k in torch.nonzero(picked).flatten().tolist():
            members = (labels == k).nonzero().flatten()
            state.models[k] = ctx.average(theta, w, rows=members)
        state.labels[S] = labels
        if self.relabel_all:
            state.labels = self.cluster_of(state.models, ctx, torch.arange(ctx.m, device=ctx.device))
        state.cluster_weights = self._cluster_weights(state, ctx)
        return state

    def personalized(self, state: IFCAState) -> torch.Tensor:
        return state.models[state.labels]

    def global_model(self, state: IFCAState) -> torch.Tensor:
        w = state.cluster_weights.to(torch.float64)  # K models, replicated on every rank: plain torch
        return ((w @ state.models.to(torch.float64)) / w.sum()).to(state.models.dtype)
