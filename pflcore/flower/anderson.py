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
participation is the setting it accelerates. A strategy with server optimizer state (FedAdam,
FedYogi, FedAdagrad; FedAvgM with momentum) is not a map of u alone: its next step depends on
moments that the mixture never visited. Anderson on it can diverge (FedAdam and FedYogi do on the
least-squares example), so wrapping one warns. The memoryless aggregations (FedAvg, FedProx,
FedMedian, FedTrimmedAvg, Krum, ...) are the maps it is for.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from logging import INFO
from typing import Any, List, Optional, Tuple

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflcore import ops
from pflcore.flower.params import Layout, flatten, flatten_as, to_record


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
        bases = {c.__name__ for c in type(strategy).__mro__}  # FedOpt: FedAdam, FedYogi, FedAdagrad
        stateful = "FedOpt" in bases or ("FedAvgM" in bases and getattr(strategy, "server_momentum", 0.0))
        if stateful:
            warnings.warn(f"strategy: {type(strategy).__name__} keeps optimizer state across rounds, so a round is "
                          f"not a map of the parameters alone; Anderson mixing of its iterates can diverge",
                          RuntimeWarning, stacklevel=2)
        self.strategy = strategy
        self.anderson = ops.Anderson(memory, reg, safeguard, safeguard_factor)  # validates the arguments
        self.history: List[dict] = []
        self._u: Optional[ArrayRecord] = None  # the parameters sent this round
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
        self._u = arrays  # u, read (in place where the format allows) when T(u) is known
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        tu_record, metrics = self.strategy.aggregate_train(server_round, replies)
        if tu_record is None or self._u is None:  # nothing aggregated: the server keeps u
            return tu_record, metrics
        # T(u)'s layout rules: a strategy may return other dtypes than it was sent (FedAdam gives
        # float64 for float32 parameters, FedAvg averages integer counters into floats).
        tu, layout = flatten(tu_record, name=f"{type(self.strategy).__name__}.aggregate_train's arrays")
        u = flatten_as(self._u, layout, name="arrays (u)")
        restarts = self.anderson.resets
        if self._layout is not None and self._layout != layout:
            self.anderson.reset()  # the vector changed dtype or shape: its history cannot mix with it
        self._layout = layout
        u_next = self.anderson.step(u, tu)
        residual = float(self.anderson.residual_norm)
        pairs = int(self.anderson.weights.numel())
        self.history.append({"round": server_round, "residual": residual, "pairs": pairs,
                             "restarted": self.anderson.resets > restarts})
        self._u = None
        metrics = MetricRecord() if metrics is None else metrics
        metrics["anderson-residual"] = residual
        metrics["anderson-pairs"] = pairs
        return to_record(u_next, layout, like=tu_record), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return self.strategy.aggregate_evaluate(server_round, replies)
