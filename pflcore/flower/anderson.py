"""Anderson acceleration of any Flower strategy's server fixed point.

One round of a Flower strategy is a map u ↦ T(u): the server sends the parameters u, the
clients train from them, and the wrapped strategy aggregates their results into T(u) (FedAvg's
weighted mean, FedAdam's adaptive step, ...). ``AndersonStrategy`` keeps everything else of
the wrapped strategy (node sampling, configs, evaluation, metrics) and replaces the new
parameters T(u) by the type-II Anderson mixture of the last ``memory`` + 1 pairs (u_j, T(u_j)),
``pflcore.ops.Anderson`` on the flattened floating-point arrays (the unifying paper's §4.2: no
extra communication, u and T(u) already live on the server). The safeguard restarts from the
plain step T(u) when the residual ‖T(u) − u‖ grows by more than ``safeguard_factor``.

A map with sampled clients (``fraction_train < 1``) changes from round to round: Anderson
mixes iterates of different maps, and the safeguard is what keeps that from diverging; full
participation is the setting it accelerates.
"""
from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import Any, List, Optional, Tuple

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflcore import ops
from pflcore.flower.params import Layout, flatten, to_record


class AndersonStrategy(Strategy):
    """Wrap ``strategy`` (any ``flwr.serverapp.strategy.Strategy``) with Anderson mixing.

    ``memory``, ``reg``, ``safeguard``, ``safeguard_factor``: as in ``pflcore.ops.Anderson``.
    The aggregated training metrics gain ``anderson-residual`` (‖T(u) − u‖) and
    ``anderson-pairs`` (how many pairs the last mixture used; 1 after a safeguard restart).
    ``history`` holds one dict per round (round, residual, pairs, restarted). A new run (a round
    number that does not follow the last one) forgets the history.
    """

    def __init__(self, strategy: Strategy, memory: int = 5, reg: float = 1e-8, safeguard: bool = True,
                 safeguard_factor: float = 10.0) -> None:
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy: expected a flwr.serverapp.strategy.Strategy, got {type(strategy).__name__}")
        self.strategy = strategy
        self.anderson = ops.Anderson(memory, reg, safeguard, safeguard_factor)  # validates the arguments
        self.history: List[dict] = []
        self._u: Optional[np.ndarray] = None
        self._layout: Optional[Layout] = None
        self._round = 0

    def __getattr__(self, name: str) -> Any:  # the wrapped strategy's settings (fraction_train, ...)
        if name == "strategy":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def summary(self) -> None:
        a = self.anderson
        log(INFO, "\t├──> Anderson acceleration (pflcore): memory %d, reg %g, safeguard %s (factor %g)",
            a.memory, a.reg, a.safeguard, a.safeguard_factor)
        log(INFO, "\t└──> of %s:", type(self.strategy).__name__)
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if server_round <= self._round:  # a new run: the old pairs belong to another sequence
            self.anderson.reset()
            self.history.clear()
        self._round = server_round
        # u: a view of the sent arrays' bytes when the model is one array (bytes are immutable,
        # and ops.Anderson copies u into its history).
        self._u, self._layout = flatten(arrays, name="arrays")
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        tu_record, metrics = self.strategy.aggregate_train(server_round, replies)
        if tu_record is None or self._u is None:  # nothing aggregated: the server keeps u
            return tu_record, metrics
        tu, _ = flatten(tu_record, self._layout, name=f"{type(self.strategy).__name__}.aggregate_train's arrays")
        restarts = self.anderson.resets
        u_next = self.anderson.step(self._u, tu)
        residual = float(self.anderson.residual_norm)
        pairs = int(self.anderson.weights.numel())
        self.history.append({"round": server_round, "residual": residual, "pairs": pairs,
                             "restarted": self.anderson.resets > restarts})
        self._u = None
        metrics = MetricRecord() if metrics is None else metrics
        metrics["anderson-residual"] = residual
        metrics["anderson-pairs"] = pairs
        return to_record(u_next, self._layout, like=tu_record), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return self.strategy.aggregate_evaluate(server_round, replies)
