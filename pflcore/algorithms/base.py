"""What every algorithm shares (DESIGN.md §5): the run context and the algorithm protocol.

An algorithm holds only its hyperparameters; every tensor lives in its ``state`` (a dataclass
that ``torch.save`` can write and read back), so a checkpoint restores a run exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Optional

import torch

from pflcore import ops
from pflcore.data.federation import Federation
from pflcore.models.glm import GLM

_M32 = 0xFFFFFFFF


@dataclass
class Context:
    """Everything a round needs besides the state: data, model, device, seed, sampling."""

    federation: Federation
    model: GLM
    device: torch.device
    seed: int = 0
    clients_per_round: Optional[int] = None
    client_steps: int = 0  # client-steps done so far (for the throughput metric)
    f_star: Optional[float] = None  # min of Σ p_i f_i when known (least squares), for the optimality gap
    train: object = field(init=False)
    test: object = field(init=False)
    weights: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.train = self.federation.train
        self.test = self.federation.test
        self.weights = self.federation.weights

    @property
    def m(self) -> int:
        return self.federation.num_clients

    @property
    def d(self) -> int:
        return self.model.d

    @property
    def dtype(self) -> torch.dtype:
        return self.train.dtype

    def initial_models(self, m: int) -> torch.Tensor:
        """``[m, d]`` starting parameters: m copies of the model's initial point (zeros for a
        GLM; a seeded random initialization for a torch net), so every client starts alike."""
        return self.model.initial(m, dtype=self.dtype, device=self.device, seed=self.seed)

    def initial_global(self) -> torch.Tensor:
        """``[d]`` starting global model (the model's initial point)."""
        return self.initial_models(1)[0].clone()

    def sample_clients(self, t: int) -> torch.Tensor:
        """``int64 [S]`` sorted ids of the clients of round t, drawn from a generator keyed by
        (seed, t) alone, so a resumed or sharded run draws the same clients."""
        if self.clients_per_round is None or self.clients_per_round >= self.m:
            return torch.arange(self.m, device=self.device)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + t * 7919 + 17) & 0x7FFFFFFFFFFFFFFF)
        chosen = torch.randperm(self.m, generator=g)[: self.clients_per_round]
        return chosen.sort().values.to(self.device)

    def batches(self, t: int, stream: int, clients: torch.Tensor, steps: int, batch_size: int) -> torch.Tensor:
        """``int32 [S, steps, B]`` minibatches for round t; ``stream`` separates independent
        draws within a round (e.g. pFedMe's local rounds)."""
        # The round is the counter; the stream moves the seed by a multiple of the golden ratio,
        # so neither the number of rounds nor of streams is limited and no two draws repeat.
        seed = (self.seed + 0x9E3779B9 * (stream + 1)) & _M32
        return ops.sample_batches(self.train, steps=steps, batch_size=batch_size, seed=seed, counter=t & _M32,
                                  clients=clients)

    def count(self, client_steps: int) -> None:
        self.client_steps += int(client_steps)


class Algorithm:
    """Base class: subclasses set ``name`` and implement init/round/personalized/global_model."""

    name = "algorithm"

    def init(self, ctx: Context):
        raise NotImplementedError

    def round(self, state, ctx: Context, t: int):
        raise NotImplementedError

    def personalized(self, state) -> Optional[torch.Tensor]:
        return None

    def global_model(self, state) -> Optional[torch.Tensor]:
        return None

    def residual(self, state) -> Optional[float]:
        """‖T(u) − u‖ of the last round for fixed-point methods, else None."""
        return None

    def hyperparameters(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class ServerModelFixedPoint:
    """For algorithms whose fixed-point state (what ``Accelerated`` mixes) is the server model
    ``state.w``."""

    def fixed_point(self, state) -> torch.Tensor:
        return state.w

    def set_fixed_point(self, state, w: torch.Tensor):
        state.w = w
        return state


def positive(value, name: str, algorithm: str, *, allow_zero: bool = False) -> float:
    """A hyperparameter check that names the algorithm and the argument."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{algorithm}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{algorithm}: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def count_int(value, name: str, algorithm: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{algorithm}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def state_tensors(state, prefix: str = ""):
    """(name, tensor) pairs of a state dataclass (and of dataclasses inside it), for
    finiteness checks."""
    for f in fields(state):
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            yield prefix + f.name, v
        elif is_dataclass(v):
            yield from state_tensors(v, prefix + f.name + ".")
