"""Clustered federated learning on Flower: CGPFL's server (IFCA-style contexts).

The server keeps K context models Ω [K, D] and the context of every node it has heard from.
Each round it sends every sampled node its context's model (a node not yet clustered gets the
global model), and clusters the models that come back, flattened to [S, D], with
``pflcore.ops.kmeans`` weighted by the nodes' ``num-examples``: k-means++ (best of ``restarts``
seeds) at the first round, then warm-started from Ω so that a context keeps its label across
rounds. Every context model moves a fraction ``alpha`` toward the weighted mean of its members'
models (``ops.average``); a context that no sampled node joined keeps its model:

    Ω_k ← Ω_k + α (mean of the models labelled k − Ω_k)

The first clustering starts every context from the parameters the server sent. K is fixed
(``num_contexts=K``) or chosen at the first round as CGPFL-Heur chooses it (``"auto"``): the K
in 1..max_contexts that minimizes

    e(K) = sqrt(D·K/N_s · max(log(e·N_s/D), 1)) + μ·cost(K)

with N_s the sum of the first round's ``num-examples`` and cost(K) the weighted mean squared
distance of the uploaded models to their nearest of K k-means centres (DESIGN.md §5).

What ``aggregate_train`` returns to Flower's loop (``Result.arrays``) is the global model, the
context models weighted by their members' examples; the context models themselves are
``context_arrays(k)`` and a node's context is ``context_of(node_id)``. Evaluation messages carry
each node's context model too. Sampling, configs and metrics are FedAvg's (this class extends
``flwr.serverapp.strategy.FedAvg``; its keyword arguments pass through). Each node's ConfigRecord
gains ``context`` (its label, −1 before it is clustered).

IFCA differs in who assigns: its clients pick the best of the K models by their own loss (K
models downloaded per round); here the server assigns by the uploaded models, as CGPFL does,
and each node downloads one model.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from pflcore import ops
from pflcore.algorithms.cgpfl import best_of_restarts, generalization_term
from pflcore.flower.params import Layout, flatten, layout_of, stack, to_record


def _count(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def reply_arrays(message: Message, key: str) -> ArrayRecord:
    """The parameters in a reply: the ArrayRecord under ``key``, else its only ArrayRecord."""
    records = message.content.array_records
    if key in records:
        return records[key]
    if len(records) == 1:
        return next(iter(records.values()))
    raise ValueError(f"reply of node {message.metadata.src_node_id}: expected the ArrayRecord {key!r} (or exactly "
                     f"one ArrayRecord), got {sorted(records)}")


def reply_weight(message: Message, key: str) -> float:
    """The reply's ``key`` metric (e.g. ``num-examples``): a finite number >= 0."""
    for metrics in message.content.metric_records.values():
        if key in metrics:
            w = metrics[key]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
                raise ValueError(f"reply of node {message.metadata.src_node_id}: expected {key!r} to be a finite "
                                 f"number >= 0, got {w!r}")
            return float(w)
    raise ValueError(f"reply of node {message.metadata.src_node_id}: its MetricRecord has no {key!r} (the weight)")


def personalize(message: Message, arrays: ArrayRecord, array_key: str, config_key: str,
                extra: Dict[str, Union[int, float]]) -> Message:
    """A copy of the instruction ``message`` carrying ``arrays`` and its config plus ``extra``."""
    content = message.content
    config = ConfigRecord(dict(content[config_key])) if config_key in content.config_records else ConfigRecord()
    for k, v in extra.items():
        config[k] = v
    md = message.metadata
    return Message(RecordDict({array_key: arrays, config_key: config}), dst_node_id=md.dst_node_id,
                   message_type=md.message_type, group_id=md.group_id or None, ttl=md.ttl)


class ClusteredStrategy(FedAvg):
    """Cluster the nodes' models into contexts; one model per context.

    ``num_contexts``: K, or ``"auto"`` (CGPFL-Heur; then ``mu`` >= 0 and ``max_contexts``).
    ``alpha`` in (0, 1]: how far a context model moves toward its members' mean per round.
    ``kmeans_iters``, ``restarts``, ``seed``: of the k-means runs. Other keyword arguments go to
    ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ``weighted_by_key``, ...)."""

    def __init__(self, num_contexts: Union[int, str] = "auto", *, mu: Optional[float] = None,
                 max_contexts: Optional[int] = None, alpha: float = 1.0, kmeans_iters: int = 100, restarts: int = 5,
                 seed: int = 0, **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        if num_contexts == "auto":
            if mu is None or max_contexts is None:
                raise ValueError(f"num_contexts='auto' chooses K by CGPFL-Heur's e(K): give mu (>= 0) and "
                                 f"max_contexts (>= 1), got mu={mu!r}, max_contexts={max_contexts!r}")
            if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not (math.isfinite(mu) and mu >= 0):
                raise ValueError(f"mu: expected a finite number >= 0, got {mu!r}")
            self.num_contexts: Optional[int] = None
            self.mu, self.max_contexts = float(mu), _count(max_contexts, "max_contexts")
        else:
            if isinstance(num_contexts, str):
                raise ValueError(f"num_contexts: expected an integer >= 1 or 'auto', got {num_contexts!r}")
            self.num_contexts = _count(num_contexts, "num_contexts")
            self.mu, self.max_contexts = mu, max_contexts
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.kmeans_iters = _count(kmeans_iters, "kmeans_iters")
        self.restarts = _count(restarts, "restarts")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
            raise ValueError(f"seed: expected an integer in [0, 2**31), got {seed!r}")
        self.seed = int(seed)
        self._forget()

    def _forget(self) -> None:
        self.contexts: Optional[np.ndarray] = None   # [K, D] context models Ω
        self.labels: Dict[int, int] = {}             # node id -> context
        self.e_values: List[float] = []              # CGPFL-Heur: e(K) for K = 1..
        self.layout: Optional[Layout] = None
        self._context_weight: Optional[np.ndarray] = None
        self._sent: Optional[ArrayRecord] = None
        self._like: Optional[ArrayRecord] = None
        self._records: Dict[int, ArrayRecord] = {}
        self._round = 0

    def summary(self) -> None:
        k = self.num_contexts if self.num_contexts is not None else \
            f"auto (CGPFL-Heur, mu {self.mu:g}, up to {self.max_contexts})"
        log(INFO, "\t├──> Contexts (pflcore k-means): K = %s, alpha %g, %d restarts, seed %d", k, self.alpha,
            self.restarts, self.seed)
        super().summary()

    # ---- what the nodes get ------------------------------------------------------------------

    def context_of(self, node_id: int) -> Optional[int]:
        """The context of ``node_id`` after its last clustering (None: never clustered)."""
        return self.labels.get(int(node_id))

    def context_arrays(self, k: int) -> ArrayRecord:
        """Context model ``k`` as an ArrayRecord (built once per round)."""
        if self.contexts is None:
            raise ValueError("context_arrays: no clustering has happened yet (call after a training round)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < self.contexts.shape[0]:
            raise ValueError(f"k: expected a context in [0, {self.contexts.shape[0]}), got {k!r}")
        if k not in self._records:
            self._records[k] = to_record(self.contexts[k], self.layout, like=self._like)
        return self._records[k]

    def _for_node(self, message: Message, arrays: ArrayRecord) -> Message:
        k = self.labels.get(message.metadata.dst_node_id) if self.contexts is not None else None
        model = arrays if k is None else self.context_arrays(k)
        return personalize(message, model, self.arrayrecord_key, self.configrecord_key,
                           {"context": -1 if k is None else k})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if server_round <= self._round:  # a new run
            self._forget()
        self._round = server_round
        self._sent = arrays
        return [self._for_node(m, arrays) for m in super().configure_train(server_round, arrays, config, grid)]

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return [self._for_node(m, arrays) for m in super().configure_evaluate(server_round, arrays, config, grid)]

    # ---- clustering ---------------------------------------------------------------------------

    def _seeded_kmeans(self, points: np.ndarray, k: int, weights: np.ndarray, seed: int) -> ops.KMeans:
        """The lowest-inertia of ``restarts`` k-means++ runs (the seeds CGPFL uses)."""
        return best_of_restarts(ops.kmeans, points, k, weights, seed, self.restarts, self.kmeans_iters)

    def choose_contexts(self, points: np.ndarray, weights: np.ndarray) -> int:
        """CGPFL-Heur's K for ``points [S, D]`` with sample counts ``weights [S]``; sets ``e_values``."""
        n_samples, total = float(weights.sum()), float(weights.sum())
        d = points.shape[1]
        self.e_values = []
        for k in range(1, min(self.max_contexts, points.shape[0]) + 1):
            km = self._seeded_kmeans(points, k, weights, self.seed + 31 * k)
            self.e_values.append(generalization_term(d, k, n_samples) + self.mu * km.inertia / total)
        return 1 + int(np.argmin(self.e_values))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        valid = [r for r in replies if not r.has_error()]
        if not valid:
            return None, None
        nodes = [int(r.metadata.src_node_id) for r in valid]
        records = [reply_arrays(r, self.arrayrecord_key) for r in valid]
        if self.layout is None and self._sent is not None:  # replies must have the arrays the server sent
            self.layout = layout_of(self._sent, "arrays")
        P, layout = stack(records, self.layout, names=[f"reply of node {n}" for n in nodes])
        w = np.array([reply_weight(r, self.weighted_by_key) for r in valid], dtype=P.dtype)
        if not w.sum() > 0:
            raise ValueError(f"replies: expected a positive total {self.weighted_by_key!r}, got {w.tolist()}")
        self.layout, self._like = layout, records[0]
        if self.contexts is None:
            K = self.num_contexts if self.num_contexts is not None else self.choose_contexts(P, w)
            if K > len(valid):
                raise ValueError(f"num_contexts: {K} contexts need at least {K} replies in the first round, got "
                                 f"{len(valid)} (raise min_train_nodes / fraction_train)")
            km = self._seeded_kmeans(P, K, w, self.seed + server_round)
            start = flatten(self._sent, layout, name="arrays")[0] if self._sent is not None else None
            previous = km.centroids.copy() if start is None else np.repeat(start[None, :].astype(P.dtype), K, 0)
        else:
            km = ops.kmeans(P, init=self.contexts, iters=self.kmeans_iters, weights=w)
            previous = self.contexts
        labels = np.asarray(km.labels)
        K = previous.shape[0]
        means = previous.copy()
        weight = np.zeros(K) if self._context_weight is None else self._context_weight.copy()
        for k in range(K):
            members = np.nonzero(labels == k)[0]
            if members.size:
                means[k] = ops.average(P, w, rows=members)
                weight[k] = float(w[members].sum())
        self.contexts = previous + self.alpha * (means - previous)
        self._context_weight, self._records = weight, {}
        self.labels.update(zip(nodes, (int(k) for k in labels)))
        metrics = self.train_metrics_aggr_fn([r.content for r in valid], self.weighted_by_key)
        metrics["num-contexts"] = K
        metrics["kmeans-inertia"] = float(km.inertia)
        used = weight > 0
        glob = ops.average(self.contexts[used], weight[used].astype(P.dtype))
        return to_record(glob, layout, like=records[0]), metrics
