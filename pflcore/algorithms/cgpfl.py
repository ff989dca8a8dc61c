"""CGPFL and CGPFL-Heur ("Personalized Federated Learning with Contextualized Generalization",
Alg. 1 and §4.4; DESIGN.md §5).

The server keeps K context models Ω [K, d] and the context k(i) of every client. Round t, for
each participating client i (all of them in one batch):

    ω̃_i ← ω_{k(i)},  θ_i ← ω̃_i
    R times:  S steps  θ_i ← θ_i − η(∇f_i(θ_i; D) + λ(θ_i − ω̃_i))     (one ops.local_steps call,
                                                                       D: one minibatch per local round)
              ω̃_i ← ω̃_i − βλ(ω̃_i − θ_i)

then the server clusters the uploaded ω̃_i with ``ops.kmeans`` (weights p_i; warm-started from Ω
so that context labels stay stable, k-means++ with ``restarts`` seeds at the first round),
and moves every context model toward the p-weighted mean of its clients' ω̃:

    Ω ← Ω − α(Ω − mean of ω̃ per context)       (a context nobody joined keeps its model)

The paper weighs the clients of a context equally (1/|C_k|); here the federation's client
weights p_i are used, as by every other algorithm of pflcore (give the Federation uniform
weights for the paper's choice). With K = 1 the updates are pFedMe's (lr = β, personal_lr = η,
beta = α, train_all=False).

CGPFL-Heur chooses K once, at the first round, minimizing over K = 1..max_contexts

    e(K) = sqrt(d·K/N_s · max(log(e·N_s/d), 1)) + μ·cost(K)

with N_s the number of training samples and cost(K) the p-weighted mean squared distance of
the personalized models θ_i to their nearest of K k-means centres (the inner objective of
the paper's eq. (2) at the first round's θ).

Sharded runs: the clustering is ``ctx.kmeans`` (Lloyd over every rank's ω̃ with all-reduced
cluster sums) and the context means ``ctx.cluster_means``; Ω and e(K) are the same on every
rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from pflcore import ops
from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive


def best_of_restarts(kmeans, points, k: int, weights, seed: int, restarts: int, iters: int) -> ops.KMeans:
    """The best (lowest inertia) of ``restarts`` k-means++ runs of ``kmeans`` (``ops.kmeans`` or a
    context's), with CGPFL's seeds: run j of round seed s uses (s·1000003 + 7919·j) mod 2^31."""
    best = None
    for j in range(restarts):
        km = kmeans(points, k, init="k-means++", iters=iters, weights=weights,
                    seed=(seed * 1_000_003 + 7919 * j) & 0x7FFFFFFF)
        if best is None or km.inertia < best.inertia:
            best = km
    return best


@dataclass
class CGPFLState:
    contexts: torch.Tensor      # [K, d] context models Ω
    labels: torch.Tensor = per_client()       # int64 [m] context of each client (its last clustering)
    omega_local: torch.Tensor = per_client()  # [m, d] ω̃_i each client uploaded last
    theta: torch.Tensor = per_client()        # [m, d] personalized models θ_i
    clustered: bool = False     # False until the first clustering (k-means++ seeding)
    e_values: List[float] = field(default_factory=list)  # CGPFL-Heur: e(K) for K = 1..max_contexts


class CGPFL(Algorithm):
    """CGPFL ("Personalized Federated Learning with Contextualized Generalization", Alg. 1).

    The server keeps ``num_contexts`` context models. Each round, every sampled client starts
    from its context's model ω̃_i and, ``local_rounds`` times, takes ``inner_steps`` steps of size
    ``lr`` on f_i(θ; D) + ``lam``/2‖θ − ω̃_i‖² (minibatches of ``batch_size`` rows; None: full
    batch) and moves ω̃_i ← ω̃_i − ``beta``·``lam``(ω̃_i − θ_i); the server clusters the uploaded
    ω̃_i with k-means (``kmeans_iters`` Lloyd iterations, warm-started; ``restarts`` k-means++
    seeds at the first round) and moves each context model a fraction ``alpha`` toward its
    clients' mean. Personalized models: θ_i."""

    name = "CGPFL"
    dp_unsupported = "its server clusters the clients' individual uploads (k-means on each ω̃_i)"

    def __init__(self, num_contexts: int, lam: float, alpha: float = 1.0, beta: float = 0.005, lr: float = 0.005,
                 inner_steps: int = 5, local_rounds: int = 10, batch_size: Optional[int] = 20,
                 kmeans_iters: int = 100, restarts: int = 5):
        n = self.name
        self.num_contexts = count_int(num_contexts, "num_contexts", n)
        self._check_common(lam, alpha, beta, lr, inner_steps, local_rounds, batch_size, kmeans_iters, restarts)

    def _check_common(self, lam, alpha, beta, lr, inner_steps, local_rounds, batch_size, kmeans_iters, restarts):
        n = self.name
        self.lam = positive(lam, "lam", n)
        self.alpha = positive(alpha, "alpha", n)
        self.beta = positive(beta, "beta", n)
        self.lr = positive(lr, "lr", n)
        self.inner_steps = count_int(inner_steps, "inner_steps", n)
        self.local_rounds = count_int(local_rounds, "local_rounds", n)
        self.batch_size = None if batch_size is None else count_int(batch_size, "batch_size", n)
        self.kmeans_iters = count_int(kmeans_iters, "kmeans_iters", n)
        self.restarts = count_int(restarts, "restarts", n)
        if self.alpha > 1:
            raise ValueError(f"{n}: alpha must be in (0, 1] (Ω moves a fraction alpha toward the means), got {alpha!r}")
        if self.beta * self.lam >= 2:
            raise ValueError(f"{n}: beta·lam must be < 2, or the step ω̃ ← ω̃ − βλ(ω̃ − θ) overshoots and diverges "
                             f"(got beta = {beta!r}, lam = {lam!r}; the paper's setting is beta = 0.005, lam = 12)")

    # ---- state --------------------------------------------------------------------------------

    def _initial_contexts(self) -> int:
        return self.num_contexts

    def init(self, ctx: Context) -> CGPFLState:
        K = self._initial_contexts()
        start = ctx.initial_models(ctx.m)
        return CGPFLState(ctx.initial_models(K), torch.zeros(ctx.m, dtype=torch.int64, device=ctx.device),
                          start, start.clone())

    # ---- one round ----------------------------------------------------------------------------

    def local_update(self, state: CGPFLState, ctx: Context, t: int, clients: torch.Tensor):
        """(θ, ω̃) [S, d] of ``clients`` after R local rounds from their context models."""
        S = clients.numel()
        omega = state.contexts[state.labels[clients]].contiguous()
        theta = omega.clone()
        for r in range(self.local_rounds):
            batches = None
            if self.batch_size is not None:  # one minibatch per local round, reused by its S steps
                batch = ctx.batches(t, r, clients, 1, self.batch_size)
                batches = batch.expand(S, self.inner_steps, self.batch_size).contiguous()
            ctx.local_steps(theta, steps=self.inner_steps, lr=self.lr, prox=self.lam,
                            anchor=omega, rows=clients, batches=batches)
            omega -= self.beta * self.lam * (omega - theta)
        return theta, omega

    def _seeded_kmeans(self, ctx: Context, points: torch.Tensor, k: int, weights: torch.Tensor,
                       seed: int) -> ops.KMeans:
        return best_of_restarts(ctx.kmeans, points, k, weights, seed, self.restarts, self.kmeans_iters)

    def _choose_contexts(self, state: CGPFLState, ctx: Context, theta, weights, t: int) -> int:
        return state.contexts.shape[0]

    def round(self, state: CGPFLState, ctx: Context, t: int) -> CGPFLState:
        S = ctx.sample_clients(t)
        theta, omega = self.local_update(state, ctx, t, S)
        state.theta[S] = theta
        state.omega_local[S] = omega
        w = ctx.weights[S].to(omega.dtype)
        if not state.clustered:
            K = self._choose_contexts(state, ctx, theta, w, t)
            participants = ctx.count_total(S.numel())
            if K > participants:
                raise ValueError(f"{self.name}: {K} contexts need at least {K} participating clients per round, "
                                 f"got {participants} (clients_per_round)")
            km = self._seeded_kmeans(ctx, omega, K, w, ctx.seed + t)
            previous = state.contexts[:1].expand(K, ctx.d)  # every context starts at the initial point
            state.clustered = True
        else:
            km = ctx.kmeans(omega, init=state.contexts, iters=self.kmeans_iters, weights=w)
            previous = state.contexts
        # The p-weighted mean of ω̃ per context under the final labels (a context that lost all
        # its clients keeps its model), then Ω moves a fraction α toward it.
        means = previous.clone()
        ctx.cluster_means(omega, km.labels, w, means)
        state.contexts = previous + self.alpha * (means - previous)
        state.labels[S] = km.labels
        return state

    def personalized(self, state: CGPFLState) -> torch.Tensor:
        return state.theta

    def context_models(self, state: CGPFLState) -> torch.Tensor:
        """``[m, d]`` the context model of every client (its generalized model)."""
        return state.contexts[state.labels]


def generalization_term(d: int, K: int, n_samples: float) -> float:
    """sqrt(d·K/N_s · max(log(e·N_s/d), 1)): the K-dependent complexity term of CGPFL-Heur's e(K)."""
    return math.sqrt(d * K / n_samples * max(math.log(math.e * n_samples / d), 1.0))


class CGPFLHeur(CGPFL):
    """CGPFL-Heur ("Personalized Federated Learning with Contextualized Generalization", §4.4):
    CGPFL whose number of contexts is chosen at the first round, among 1..``max_contexts``, by
    minimizing e(K) = the generalization term + ``mu``·(the k-means cost of the personalized
    models). Every round is then CGPFL's, with ``lam``, ``alpha``, ``beta``, ``lr``,
    ``inner_steps``, ``local_rounds``, ``batch_size``, ``kmeans_iters`` and ``restarts`` as there."""

    """CGPFL whose number of contexts is chosen at the first round by minimizing e(K)."""

    name = "CGPFL-Heur"

    def __init__(self, mu: float, max_contexts: int, lam: float, alpha: float = 1.0, beta: float = 0.005,
                 lr: float = 0.005, inner_steps: int = 5, local_rounds: int = 10, batch_size: Optional[int] = 20,
                 kmeans_iters: int = 100, restarts: int = 5):
        self.mu = positive(mu, "mu", self.name, allow_zero=True)
        self.max_contexts = count_int(max_contexts, "max_contexts", self.name)
        self._check_common(lam, alpha, beta, lr, inner_steps, local_rounds, batch_size, kmeans_iters, restarts)

    def _initial_contexts(self) -> int:
        return 1  # all contexts start at the initial point; K is chosen after the first round

    def generalization_term(self, d: int, K: int, n_samples: int) -> float:
        return generalization_term(d, K, n_samples)

    def _choose_contexts(self, state: CGPFLState, ctx: Context, theta, weights, t: int) -> int:
        n_samples = ctx.num_rows
        total = ctx.sum(float(weights.sum()))
        e = []
        for K in range(1, min(self.max_contexts, ctx.count_total(theta.shape[0])) + 1):
            km = self._seeded_kmeans(ctx, theta, K, weights, ctx.seed + 31 * K)
            e.append(self.generalization_term(ctx.d, K, n_samples) + self.mu * km.inertia / total)
        state.e_values = e
        return 1 + min(range(len(e)), key=e.__getitem__)
