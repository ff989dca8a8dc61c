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

from pflcore import backend
from pflcore.ops import _cuda
from pflcore.ops._checks import (as_tensor, check_device, check_finite, check_float, check_positive_int,
                                 check_real, check_shape, cpu_numpy, out_like)


# ---- the small solve -------------------------------------------------------------------------

def _solve_ref(G: torch.Tensor, reg: float) -> torch.Tensor:
    """π for a float64 Gram matrix G [k, k] (the same rule as csrc/cpu/anderson.cpp):
    a zero residual is taken as is; otherwise π = A⁻¹1 / 1ᵀA⁻¹1, A = G + reg·trace(G)·I,
    solved on the equilibrated Â = S A S, S = diag(A)^{-1/2}, with a jitter on Â's diagonal
    from 1e-14 upwards if rounding leaves it indefinite."""
    k = G.shape[0]
    diag = torch.diagonal(G)
    zero = torch.nonzero(diag == 0)
    if zero.numel():
        pi = torch.zeros(k, dtype=torch.float64)
        pi[int(zero[-1])] = 1.0
        return pi
    lam = reg * float(diag.sum())
    A = G + lam * torch.eye(k, dtype=torch.float64)
    scale = torch.diagonal(A).rsqrt()
    A_hat = A * scale[:, None] * scale[None, :]
    jitter = 0.0
    for _ in range(40):
        L, info = torch.linalg.cholesky_ex(A_hat + jitter * torch.eye(k, dtype=torch.float64))
        if int(info) == 0:
            x = torch.cholesky_solve(scale[:, None], L)[:, 0] * scale
            s = float(x.sum())
            if math.isfinite(s) and s != 0.0:
                return x / s
        jitter = 1e-14 if jitter == 0.0 else jitter * 10.0
    raise RuntimeError("anderson: the Gram matrix is not finite")


def _solve(G: torch.Tensor, reg: float, name: str, module) -> torch.Tensor:
    if name in ("cuda", "triton"):
        # The k x k solve (k <= memory + 1) stays on the host, where G already is: in the
        # native core when it is built, else in torch.
        module = backend.loaded("native")
        name = "native" if module is not None else "reference"
    if name == "reference":
        return _solve_ref(G, reg)
    pi = torch.empty(G.shape[0], dtype=torch.float64)
    module.anderson_solve(cpu_numpy(G.contiguous()), float(reg), cpu_numpy(pi))
    return pi


def _validate_residuals(residuals):
    R, is_np = as_tensor(residuals, "residuals")
    check_float(R, "residuals")
    if R.dim() != 2 or R.shape[0] < 1:
        raise ValueError(f"residuals: expected shape [k, D] with k >= 1, got {list(R.shape)}")
    check_finite(R, "residuals")
    return R.contiguous(), is_np


def anderson_weights(residuals, reg: float = 1e-8):
    """π ``[k]`` (float64, sums to 1) for residuals ``[k, D]``."""
    R, is_np = _validate_residuals(residuals)
    reg = check_real(reg, "reg", minimum=0.0)
    name, module = backend.select("anderson", R.device)
    if name == "reference":
        return anderson_weights_ref(residuals, reg)
    k = R.shape[0]
    G = torch.empty(k, k, dtype=torch.float64, device=R.device)
    if name == "native":
        module.gram(cpu_numpy(R), cpu_numpy(G))
    elif name == "triton":
        module.gram(R, G)
    else:  # cuda
        with torch.cuda.device(R.device):
            _cuda.launch("anderson_weights", module.gram, _cuda.ptr(R, "residuals", R.device, R.dtype), k,
                         R.shape[1], _cuda.ptr(G, "G", R.device, torch.float64), _cuda.dtype_name(R), _cuda.stream(R))
    return out_like(_solve(G.cpu(), reg, name, module).to(R.device), is_np)


def anderson_weights_ref(residuals, reg: float = 1e-8):
    """Pure-torch reference of ``anderson_weights``."""
    R, is_np = as_tensor(residuals, "residuals")
    R64 = R.to(torch.float64)
    return out_like(_solve_ref((R64 @ R64.T).cpu(), reg).to(R.device), is_np)


# ---- the stateful mixer --------------------------------------------------------------------

def _push_ref(u, tu, R_hist, TU_hist, slot: int, slots: List[int]) -> torch.Tensor:
    R_hist[slot] = tu - u
    TU_hist[slot] = tu
    idx = torch.tensor(slots, device=u.device)
    return (R_hist[idx].to(torch.float64) @ R_hist[slot].to(torch.float64)).cpu()


def _mix_ref(TU_hist, slots: List[int], pi: torch.Tensor) -> torch.Tensor:
    idx = torch.tensor(slots, device=TU_hist.device)
    return (pi.to(TU_hist.device) @ TU_hist[idx].to(torch.float64)).to(TU_hist.dtype)


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
        self.memory = check_positive_int(memory, "memory", minimum=0)
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
        every piece mixes with the weights of the whole vector."""
        u_t, is_np = as_tensor(u, "u")
        tu_t, _ = as_tensor(tu, "tu")
        check_float(u_t, "u")
        check_float(tu_t, "tu", u_t.dtype)
        check_device(tu_t, "tu", u_t.device)
        check_shape(tu_t, "tu", tuple(u_t.shape), "the shape of u")
        # NaN/inf in u or tu make the new residual's norm non-finite: that is checked below,
        # after the fused pass, instead of two extra passes over the state here.
        if not hasattr(self, "_R") or self._R.dtype != u_t.dtype or self._R.device != u_t.device \
                or self._shape != tuple(u_t.shape):
            if self._order:
                raise ValueError(f"u: shape, dtype and device must stay the same between steps "
                                 f"(history has {list(self._shape)} {self._R.dtype} on {self._R.device}, "
                                 f"got {list(u_t.shape)} {u_t.dtype} on {u_t.device}); call reset() first")
            self._allocate(u_t)
        name, module = backend.select("anderson", u_t.device)
        uf, tuf = u_t.reshape(-1).contiguous(), tu_t.reshape(-1).contiguous()

        H = self.memory + 1
        free = [s for s in range(H) if s not in self._order]
        slot = free[0] if free else self._order[0]  # a free slot, else the oldest pair's
        order = [s for s in self._order if s != slot] + [slot]
        if name == "reference":
            dots = _push_ref(uf, tuf, self._R, self._TU, slot, order)
        elif name == "native":
            dots = torch.empty(len(order), dtype=torch.float64)
            module.anderson_push(cpu_numpy(uf), cpu_numpy(tuf), cpu_numpy(self._R), cpu_numpy(self._TU), slot,
                                 cpu_numpy(torch.tensor(order, dtype=torch.int64)), cpu_numpy(dots))
        else:  # GPU backends: the history stays on the device, only the k dots come back
            slots = torch.tensor(order, dtype=torch.int64, device=uf.device)
            dots_dev = torch.empty(len(order), dtype=torch.float64, device=uf.device)
            if name == "triton":
                module.anderson_push(uf, tuf, self._R, self._TU, slot, slots, dots_dev)
            else:
                dev, dt = uf.device, uf.dtype
                with torch.cuda.device(dev):
                    _cuda.launch("Anderson.step", module.anderson_push, _cuda.ptr(uf, "u", dev, dt),
                                 _cuda.ptr(tuf, "tu", dev, dt), _cuda.ptr(self._R, "residual history", dev, dt),
                                 _cuda.ptr(self._TU, "image history", dev, dt), uf.numel(), slot,
                                 _cuda.ptr(slots, "slots", dev, torch.int64), len(order),
                                 _cuda.ptr(dots_dev, "dots", dev, torch.float64), _cuda.dtype_name(uf),
                                 _cuda.stream(uf))
            dots = dots_dev.cpu()
        if reduce is not None:
            dots = reduce(dots)
        if not bool(torch.isfinite(dots).all()):
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
            return out_like(tu_t.clone().contiguous(), is_np)
        self._order = order
        idx = torch.tensor(order)
        self._G[slot, idx] = dots
        self._G[idx, slot] = dots
        pi = _solve(self._G[idx][:, idx], self.reg, name, module)
        self.weights = pi
        if name == "reference":
            out = _mix_ref(self._TU, order, pi)
        elif name == "native":
            out = torch.empty_like(uf)
            module.anderson_mix(cpu_numpy(self._TU), cpu_numpy(idx), cpu_numpy(pi), cpu_numpy(out))
        else:
            out = torch.empty_like(uf)
            slots, pi_dev = idx.to(uf.device), pi.to(uf.device)
            if name == "triton":
                module.anderson_mix(self._TU, slots, pi_dev, out)
            else:
                dev = uf.device
                with torch.cuda.device(dev):
                    _cuda.launch("Anderson.step", module.anderson_mix, _cuda.ptr(self._TU, "image history", dev, uf.dtype),
                                 uf.numel(), _cuda.ptr(slots, "slots", dev, torch.int64),
                                 _cuda.ptr(pi_dev, "pi", dev, torch.float64), len(order),
                                 _cuda.ptr(out, "out", dev, uf.dtype), _cuda.dtype_name(uf), _cuda.stream(uf))
        self._last_norm = norm
        return out_like(out.view(self._shape), is_np)

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
