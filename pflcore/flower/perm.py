"""PERM on Flower: mixing weights from client gradients, then model shuffling.

"Distributed Personalized Empirical Risk Minimization" (DESIGN.md §5), two-loop form, in three
phases of Flower rounds:

1. rounds 1..``warmup_rounds``: FedAvg (this class extends ``flwr.serverapp.strategy.FedAvg``)
   trains the global model w̃;
2. round ``warmup_rounds + 1``: every node gets a ``query.gradient`` message with w̃ and answers
   with its full-batch gradient g_j and its ``num-examples`` n_j; the server computes

       α_i = argmin_{α ∈ simplex} Σ_j α_j ‖g_i − g_j‖² + λ_α Σ_j α_j² / n_j

   for every node i at once, exactly (``pflcore.algorithms.perm``'s water-filling);
3. every later round is a shuffling round r: with a permutation σ of the m nodes drawn once,
   personalized model i visits node j = σ((i + r) mod m), which takes its local steps on it with
   its loss gradient scaled by ``grad-scale`` = m·α_ij (the pair is skipped when α_ij = 0). Over m
   rounds model i visits every node once: a pass of permutation SGD on Σ_j α_ij f_j.

The nodes are those that answered the gradient query, in increasing node id (node i of α is
the i-th of them). A node that does not answer a shuffling round leaves the model that visited
it as it was. Evaluation rounds send every node its own personalized model (w̃ during the
warm-up). ``aggregate_train`` returns w̃ after the warm-up (``Result.arrays``); the personalized
models are ``personalized_arrays(node_id)`` and the weights ``alpha`` ([m, m], rows on the
simplex). Why this fits Flower's Message API, and what clients must implement: see
``pflcore.flower``'s docstring and ``pflcore.flower.clients``.

Not carried over: PERM's single-loop variant (α recomputed while w̃ keeps training) and the l2
shrink of skipped pairs (the server does not know a client's regularization).
"""
from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from pflcore.algorithms.perm import pairwise_sqdist, water_filling
from pflcore.flower.clients import GRADIENT
from pflcore.flower.clustered import personalize, reply_arrays, reply_weight
from pflcore.flower.params import Layout, flatten, stack, to_record

_M63 = 0x7FFFFFFFFFFFFFFF


def shuffling_permutation(m: int, seed: int) -> torch.Tensor:
    """σ: the permutation ``pflcore.algorithms.PERM`` draws for ``m`` clients and ``seed``."""
    g = torch.Generator().manual_seed((seed * 6_364_136_223 + 1_442_695) & _M63)
    return torch.randperm(m, generator=g)


class PERMStrategy(FedAvg):
    """PERM's server. ``warmup_rounds`` >= 0 FedAvg rounds, then the gradient query, then
    shuffling rounds; ``lam_alpha`` > 0 weighs the sample-size term of the mixing weights;
    ``seed`` draws σ. Other keyword arguments go to ``FedAvg`` (its sampling serves the warm-up;
    the later phases address every node)."""

    def __init__(self, warmup_rounds: int, lam_alpha: float, *, seed: int = 0, **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        if isinstance(warmup_rounds, bool) or not isinstance(warmup_rounds, (int, np.integer)) or warmup_rounds < 0:
            raise ValueError(f"warmup_rounds: expected an integer >= 0, got {warmup_rounds!r}")
        if isinstance(lam_alpha, bool) or not isinstance(lam_alpha, (int, float)) or not (0 < lam_alpha < float("inf")):
            raise ValueError(f"lam_alpha: expected a finite number > 0, got {lam_alpha!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2**63), got {seed!r}")
        self.warmup_rounds, self.lam_alpha, self.seed = int(warmup_rounds), float(lam_alpha), int(seed)
        self._forget()

    def _forget(self) -> None:
        self.nodes: List[int] = []                 # node ids, in the order of α's rows and columns
        self.alpha: Optional[np.ndarray] = None    # float64 [m, m]
        self.sigma: Optional[np.ndarray] = None    # int64 [m]
        self.theta: Optional[np.ndarray] = None    # [m, D] personalized models
        self.shuffle_rounds = 0
        self.layout: Optional[Layout] = None
        self._w: Optional[ArrayRecord] = None      # w̃ as sent in the gradient round
        self._visiting: Dict[int, int] = {}        # node id -> the model visiting it this round
        self._round = 0

    def summary(self) -> None:
        log(INFO, "\t├──> PERM (pflcore): %d warm-up rounds of FedAvg, then the gradient query, lam_alpha %g, "
            "seed %d", self.warmup_rounds, self.lam_alpha, self.seed)
        super().summary()

    @property
    def phase(self) -> str:
        """"warmup", "gradient" (the next training round queries gradients) or "shuffle"."""
        if self.alpha is not None:
            return "shuffle"
        return "gradient" if self._round > self.warmup_rounds else "warmup"

    def personalized_arrays(self, node_id: int) -> ArrayRecord:
        """The personalized model of ``node_id`` (after the gradient round)."""
        if self.theta is None:
            raise ValueError("personalized_arrays: no personalized models yet (they start at the gradient round)")
        if int(node_id) not in self.nodes:
            raise ValueError(f"node_id: {node_id} is not one of the {len(self.nodes)} nodes of the mixing weights")
        return to_record(self.theta[self.nodes.index(int(node_id))], self.layout, like=self._w)

    # ---- rounds ------------------------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if server_round <= self._round:  # a new run
            self._forget()
        self._round = server_round
        if server_round <= self.warmup_rounds:
            return super().configure_train(server_round, arrays, config, grid)
        config["server-round"] = server_round
        if self.alpha is None:  # the gradient query at w̃, to every node
            self._w = arrays
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            return [Message(content, dst_node_id=int(n), message_type=GRADIENT) for n in sorted(grid.get_node_ids())]
        m, r = len(self.nodes), self.shuffle_rounds
        connected = set(grid.get_node_ids())
        self._visiting = {}
        messages = []
        for i in range(m):
            j = int(self.sigma[(i + r) % m])
            a = float(self.alpha[i, j])
            if a <= 0 or self.nodes[j] not in connected:
                continue
            self._visiting[self.nodes[j]] = i
            cfg = ConfigRecord(dict(config))
            cfg["grad-scale"], cfg["perm-model"] = m * a, i
            model = to_record(self.theta[i], self.layout, like=self._w)
            messages.append(Message(RecordDict({self.arrayrecord_key: model, self.configrecord_key: cfg}),
                                    dst_node_id=self.nodes[j], message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        if server_round <= self.warmup_rounds:
            return super().aggregate_train(server_round, replies)
        valid = sorted((r for r in replies if not r.has_error()), key=lambda r: int(r.metadata.src_node_id))
        if self.alpha is None:
            return self._mixing_weights(valid)
        for r in valid:
            node = int(r.metadata.src_node_id)
            if node in self._visiting:
                self.theta[self._visiting[node]] = flatten(reply_arrays(r, self.arrayrecord_key), self.layout,
                                                           name=f"reply of node {node}")[0]
        self.shuffle_rounds += 1
        metrics = self.train_metrics_aggr_fn([r.content for r in valid], self.weighted_by_key) if valid \
            else MetricRecord()
        metrics["perm-visits"] = len(valid)
        return self._w, metrics

    def _mixing_weights(self, valid: List[Message]) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        if not valid:
            return None, None
        self.nodes = [int(r.metadata.src_node_id) for r in valid]
        G, layout = stack([reply_arrays(r, self.arrayrecord_key) for r in valid],
                          flatten(self._w, name="arrays")[1], names=[f"gradient of node {n}" for n in self.nodes])
        counts = torch.tensor([reply_weight(r, self.weighted_by_key) for r in valid], dtype=torch.float64)
        if not bool((counts > 0).all()):
            raise ValueError(f"replies: every node must report a positive {self.weighted_by_key!r} for the mixing "
                             f"weights, got {counts.tolist()}")
        alpha = water_filling(pairwise_sqdist(torch.from_numpy(G)), counts, self.lam_alpha)
        m = len(self.nodes)
        self.alpha, self.layout = alpha.numpy(), layout
        self.sigma = shuffling_permutation(m, self.seed).numpy()
        self.theta = np.repeat(flatten(self._w, layout, name="arrays")[0][None, :], m, 0)
        metrics = MetricRecord({"perm-clients": m, "perm-active-weights": float((self.alpha > 0).sum(1).mean())})
        return self._w, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        if self.theta is None:
            return messages
        index = {n: i for i, n in enumerate(self.nodes)}
        return [personalize(msg, self.personalized_arrays(msg.metadata.dst_node_id), self.arrayrecord_key,
                            self.configrecord_key, {}) if msg.metadata.dst_node_id in index else msg
                for msg in messages]
