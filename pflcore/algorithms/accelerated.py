"""Anderson acceleration of any fixed-point algorithm (the unifying paper, §4.2): the server
treats one round as a map u ← T(u) on the algorithm's fixed-point state and replaces T(u) by the
Anderson (type II) mixture of the last ``memory`` + 1 pairs, through ``ops.Anderson``. It needs
no extra communication: u and T(u) already live on the server."""
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
    residual: float = float("nan")


class Accelerated(Algorithm):
    def __init__(self, algorithm: Algorithm, memory: int = 5, reg: float = 1e-8, safeguard: bool = True):
        if not (hasattr(algorithm, "fixed_point") and hasattr(algorithm, "set_fixed_point")):
            raise ValueError(f"algorithm: {type(algorithm).__name__} does not expose a fixed-point state "
                             f"(fixed_point / set_fixed_point)")
        self.algorithm = algorithm
        self.memory, self.reg, self.safeguard = memory, reg, safeguard
        ops.Anderson(memory, reg, safeguard)  # validates the arguments now
        self.name = f"{algorithm.name}+Anderson"

    def init(self, ctx: Context) -> AcceleratedState:
        return AcceleratedState(self.algorithm.init(ctx), ops.Anderson(self.memory, self.reg, self.safeguard))

    def round(self, state: AcceleratedState, ctx: Context, t: int) -> AcceleratedState:
        alg = self.algorithm
        u = alg.fixed_point(state.inner).clone()
        state.inner = alg.round(state.inner, ctx, t)
        tu = alg.fixed_point(state.inner)
        state.residual = float((tu - u).norm())
        state.inner = alg.set_fixed_point(state.inner, state.anderson.step(u, tu))
        return state

    def personalized(self, state: AcceleratedState) -> Optional[torch.Tensor]:
        return self.algorithm.personalized(state.inner)

    def global_model(self, state: AcceleratedState) -> Optional[torch.Tensor]:
        return self.algorithm.global_model(state.inner)

    def residual(self, state: AcceleratedState) -> Optional[float]:
        return state.residual
