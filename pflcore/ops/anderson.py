"""Anderson mixing (type II) of a fixed-point map u ← T(u) (DESIGN.md §4).

Given the last k ≤ memory+1 pairs (u_j, T(u_j)) with residuals r_j = T(u_j) − u_j, the
weights solve
    min_π ‖Σ_j π_j r_j‖² + reg·‖R‖²_F·‖π‖²   s.t.  Σ_j π_j = 1,
i.e. π = (G + λI)⁻¹1 / 1ᵀ(G + λI)⁻¹1 with the Gram matrix G = R Rᵀ and λ = reg·trace(G),
and the next iterate is Σ_j π_j T(u_j). ``Anderson`` keeps the pairs in ring buffers and adds
one Gram column per step (one pass over the state fused with storing the new pair).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._arrays import from_tensor, to_tensor
from pflcore._checks import check_finite, check_float, check_positive_int, check_real, check_shape
from pflcore.ops import _compile
from pflcore.ops._args import same_device


def _solve(G: torch.Tensor, reg: float) -> torch.Tensor:
    """π [k] for the float64 Gram matrix G [k, k] on the host (k <= memory + 1: tiny), by the
    backend that serves CPU tensors (a compiled core when there is one)."""
    return backend.select("anderson_solve", None, G).anderson_solve(G, reg)


def _residuals(residuals):
    R, kind = to_tensor(residuals, "residuals")
    check_float(R, "residuals")
    if R.dim() != 2 or R.shape[0] < 1 or R.shape[1] < 1:
        raise ValueError(f"residuals: expected shape [k, D] with k >= 1 and D >= 1, got {list(R.shape)}")
    return (R if R.is_contiguous() else R.contiguous()), kind


def anderson_weights(residuals, reg: float = 1e-8):
    """π ``[k]`` (float64, sums to 1) for residuals ``[k, D]``."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.anderson_weights
        return _compile.traced_anderson_weights(residuals, reg)
    return run_anderson_weights(residuals, reg)


def run_anderson_weights(residuals, reg: float = 1e-8):
    """``anderson_weights`` (what its custom op runs)."""
    R, kind = _residuals(residuals)
    reg = check_real(reg, "reg", minimum=0.0)
    G = backend.select("gram", None, R).gram(R)
    if not bool(torch.isfinite(G).all()):  # NaN/inf in R (or an overflow): name it
        check_finite(R, "residuals")
        raise ValueError("residuals: their Gram matrix overflows (the squared norms are not finite)")
    return from_tensor(_solve(G, reg).to(R.device), kind)


def anderson_weights_ref(residuals, reg: float = 1e-8):
    """``anderson_weights`` on the reference (the Gram matrix and the solve in torch)."""
    with backend.reference():
        return anderson_weights(residuals, reg)


class Anderson:
    """Type-II Anderson acceleration of ``u ← T(u)`` on tensors of any shape.

    ``step(u, tu)`` takes the current point and its image and returns the next point.
    ``memory`` m keeps the last m+1 pairs; ``reg`` is the relative Tikhonov weight.
    Safeguard: when the new residual norm exceeds the last accepted one by more than
    ``safeguard_factor``, the history is reset and the plain step T(u) is returned.

    Attributes after a step: ``residual_norm`` (‖T(u) − u‖), ``weights`` (the last π),
    ``resets`` (how many times the safeguard fired).
    """

    def __init__(self, memory: int = 5, reg: float = 1e-8, safeguard: bool = True,
                 safeguard_factor: float = 10.0):
        self.memory = check_positive_int(memory, "memory", minimum=0, maximum=1024)
        self.reg = check_real(reg, "reg", minimum=0.0)
        self.safeguard = bool(safeguard)
        self.safeguard_factor = check_real(safeguard_factor, "safeguard_factor", minimum=1.0)
        self.resets = 0
        self.reset()

    def reset(self) -> None:
        """Forget the history (the buffers are kept)."""
        self._order: List[int] = []          # slots, oldest first
        self._last_norm: Optional[float] = None
        self.residual_norm: Optional[float] = None
        self.weights: Optional[torch.Tensor] = None
        if hasattr(self, "_G"):
            self._G.zero_()

    def _allocate(self, ref: torch.Tensor) -> None:
        H, D = self.memory + 1, ref.numel()
        self._R = torch.zeros(H, D, dtype=ref.dtype, device=ref.device)
        self._TU = torch.zeros(H, D, dtype=ref.dtype, device=ref.device)
        self._G = torch.zeros(H, H, dtype=torch.float64)
        self._shape = tuple(ref.shape)

    def step(self, u, tu, *, reduce=None):
        """The next iterate from ``u`` and ``tu`` = T(u). ``reduce``, when given, is applied to
        the float64 vector of the new Gram column's dot products before they are used: with
        u split in pieces over processes, ``reduce`` sums the pieces' dots (an all-reduce), so
        every piece mixes with the weights of the whole vector.

        Under ``torch.compile`` this is a graph break (the history is Python state updated by
        data-dependent branches): compiled code mixes with ``anderson_weights``."""
        if is_dynamo_compiling() or is_exporting():  # torch.compile: a graph break (ops/_compile.py)
            return _compile.eager_anderson_step(self, u, tu, reduce)
        return self._step(u, tu, reduce)

    def _step(self, u, tu, reduce):
        u_t, kind = to_tensor(u, "u")
        tu_t, _ = to_tensor(tu, "tu")
        check_float(u_t, "u")
        if tu_t.dtype is not u_t.dtype:
            check_float(tu_t, "tu", u_t.dtype)
        same_device(tu_t, u_t, "tu")
        if tu_t.shape != u_t.shape:
            check_shape(tu_t, "tu", tuple(u_t.shape), "the shape of u")
        if u_t.numel() == 0 and reduce is None:  # (a piece of a sharded vector may be empty)
            raise ValueError(f"u: expected at least one value, got shape {list(u_t.shape)}")
        # NaN/inf in u or tu make the new residual's norm non-finite: that is checked below,
        # after the fused pass, instead of two extra passes over the state here.
        if not hasattr(self, "_R") or self._R.dtype != u_t.dtype or self._R.device != u_t.device \
                or self._shape != tuple(u_t.shape):
            if self._order:
                raise ValueError(f"u: shape, dtype and device must stay the same between steps "
                                 f"(history has {list(self._shape)} {self._R.dtype} on {self._R.device}, "
                                 f"got {list(u_t.shape)} {u_t.dtype} on {u_t.device}); call reset() first")
            self._allocate(u_t)
        impl = backend.select("anderson_push", None, u_t)
        uf, tuf = u_t.reshape(-1).contiguous(), tu_t.reshape(-1).contiguous()

        H = self.memory + 1
        free = [s for s in range(H) if s not in self._order]
        slot = free[0] if free else self._order[0]  # a free slot, else the oldest pair's
        order = [s for s in self._order if s != slot] + [slot]
        dots = impl.anderson_push(uf, tuf, self._R, self._TU, slot, order)
        if reduce is not None:
            dots = reduce(dots)
        if not bool(torch.isfinite(dots).all()):
            # The slot now holds the bad pair: forget it (it may have been the oldest pair's), so
            # the history stays usable, then name the culprit.
            self._order = [s for s in self._order if s != slot]
            self._G[slot, :] = 0.0
            self._G[:, slot] = 0.0
            check_finite(u_t, "u")
            check_finite(tu_t, "tu")
            raise ValueError("tu - u: the residual overflows (its squared norm is not finite)")
        norm = math.sqrt(max(float(dots[-1]), 0.0))
        self.residual_norm = norm
        if (self.safeguard and self._last_norm is not None and self._last_norm > 0
                and norm > self.safeguard_factor * self._last_norm):
            # Restart from this pair alone: the plain step T(u).
            self.resets += 1
            self._order = [slot]
            self._G.zero_()
            self._G[slot, slot] = float(dots[-1])
            self._last_norm = norm
            self.weights = torch.ones(1, dtype=torch.float64)
            return from_tensor(tu_t.clone().contiguous(), kind)
        self._order = order
        idx = torch.tensor(order)
        self._G[slot, idx] = dots
        self._G[idx, slot] = dots
        pi = _solve(self._G[idx][:, idx].contiguous(), self.reg)
        self.weights = pi
        out = backend.select("anderson_mix", None, u_t).anderson_mix(self._TU, order, pi)
        self._last_norm = norm
        return from_tensor(out.view(self._shape), kind)

    def state_dict(self) -> Dict:
        """Everything needed to continue bitwise identically after ``load_state_dict``."""
        state = {"memory": self.memory, "reg": self.reg, "safeguard": self.safeguard,
                 "safeguard_factor": self.safeguard_factor, "resets": self.resets,
                 "order": list(self._order), "last_norm": self._last_norm}
        if hasattr(self, "_R"):
            state.update(R=self._R.clone(), TU=self._TU.clone(), G=self._G.clone(), shape=self._shape)
        return state

    def load_state_dict(self, state: Dict) -> None:
        self.memory, self.reg = state["memory"], state["reg"]
        self.safeguard, self.safeguard_factor = state["safeguard"], state["safeguard_factor"]
        self.resets, self._order, self._last_norm = state["resets"], list(state["order"]), state["last_norm"]
        if "R" in state:
            self._R, self._TU, self._G = state["R"].clone(), state["TU"].clone(), state["G"].clone()
            self._shape = tuple(state["shape"])
