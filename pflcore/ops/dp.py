"""``clip_and_sum``: the Gaussian mechanism of client-level differential privacy on a batch of
client updates (issue 27), one pass over ``updates [R, d]``:

    sum = Σ_r w_r · min(1, C / ‖u_r‖₂) · u_r  +  σ · C · n,      n_j ~ N(0, 1)

with C = ``clip_norm``, σ = ``noise_multiplier`` and n drawn by a counter-based generator
(Philox4x64-10 keyed by ``seed``, counter ``counter``; Box–Muller in float64): the same
``(seed, counter)`` gives the same noise on any machine thread count, backend or number of ranks.
The sum is accumulated in float64 along a fixed binary tree over the rows (csrc/cpu/dp.cpp says
why), so it is bitwise the same at any thread count and however a sharded run splits the rows
(``tree_blocks``). Weights must lie in [0, 1]: a client's contribution stays within C, the
sensitivity the noise is calibrated to. Returns ``ClippedSum(sum [d], clipped)``, ``clipped`` the
number of rows whose norm exceeded C (what adaptive clipping tracks).

Floating-point Gaussian noise is the textbook mechanism (as in pfl-research, Opacus, TensorFlow
Privacy); its low-order bits are not hardened against the precision attacks of Jin et al. (2022).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from pflcore import backend
from pflcore._arrays import from_tensor, to_tensor
from pflcore._checks import check_float, check_shape
from pflcore.ops._args import same_device

_U64 = 1 << 64


class ClippedSum(NamedTuple):
    sum: object     # [d], the dtype and kind of ``updates``
    clipped: int    # rows with ‖u_r‖ > clip_norm


def _check_u64(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{name}: expected an integer in [0, 2**64), got {value!r}")
    return value


def _check_positive(value, name: str, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name}: expected a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def clip_and_sum(updates, weights=None, *, clip_norm: float, noise_multiplier: float = 0.0, seed: int = 0,
                 counter: int = 0) -> ClippedSum:
    """The clipped, weighted, noised sum of the rows of ``updates [R, d]`` (module docstring).
    ``weights [R]`` in [0, 1] (default 1); ``R = 0`` is allowed (the noise alone)."""
    u, kind = to_tensor(updates, "updates")
    total, clipped = run_clip_and_sum(u, weights, clip_norm, noise_multiplier, seed, counter)
    return ClippedSum(from_tensor(total.to(u.dtype), kind), clipped)


def _validate(u: torch.Tensor, weights, clip_norm, noise_multiplier, seed, counter):
    check_float(u, "updates")
    if u.dim() != 2 or u.shape[1] < 1:
        raise ValueError(f"updates: expected shape [R, d] with d >= 1, got {list(u.shape)}")
    R = u.shape[0]
    w = None
    if weights is not None:
        w, _ = to_tensor(weights, "weights")
        check_float(w, "weights", u.dtype)
        if w.dim() != 1 or w.shape[0] != R:
            check_shape(w, "weights", (R,), f"[R] = [{R}]")
        same_device(w, u, "weights")
        w = w if w.is_contiguous() else w.contiguous()
    _check_positive(clip_norm, "clip_norm")
    _check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
    _check_u64(seed, "seed")
    _check_u64(counter, "counter")
    return (u if u.is_contiguous() else u.contiguous()), w


def run_clip_and_sum(u: torch.Tensor, weights, clip_norm: float, noise_multiplier: float, seed: int,
                     counter: int) -> Tuple[torch.Tensor, int]:
    """``(float64 [d] sum, clipped)`` for a tensor ``u`` (the op without the conversions)."""
    u, w = _validate(u, weights, clip_norm, noise_multiplier, seed, counter)
    adapter = backend.select("clip_and_sum", None, u)
    return adapter.clip_and_sum(u, w, float(clip_norm), float(noise_multiplier) * float(clip_norm), seed, counter)


def clip_and_sum_ref(updates, weights=None, *, clip_norm: float, noise_multiplier: float = 0.0, seed: int = 0,
                     counter: int = 0) -> ClippedSum:
    """``clip_and_sum`` on the pure-torch reference."""
    with backend.reference():
        return clip_and_sum(updates, weights, clip_norm=clip_norm, noise_multiplier=noise_multiplier, seed=seed,
                            counter=counter)


def dp_normals(n: int, seed: int, counter: int) -> torch.Tensor:
    """``float64 [n]``: the standard normals the mechanism adds (times σ·C) for ``(seed, counter)``."""
    return backend.select("clip_and_sum", None, torch.empty(0)).dp_normals(n, seed, counter)


# ---- sharded runs: the same tree over the ranks' rows -----------------------------------------

def tree_blocks(start: int, stop: int) -> List[Tuple[int, int]]:
    """The aligned blocks ``(first, log2 size)`` that tile rows ``[start, stop)``, largest first
    from the left: each is a node of the tree over the global row positions."""
    out = []
    while start < stop:
        k = (start & -start).bit_length() - 1 if start else (stop - start).bit_length() - 1
        while start + (1 << k) > stop:
            k -= 1
        out.append((start, k))
        start += 1 << k
    return out


def tree_combine(nodes: dict, total: int, d: int) -> torch.Tensor:
    """The root of the tree over ``total`` rows from nodes ``{(first, log2 size): float64 [d]}``
    that tile it (every rank's ``tree_blocks``): left + right down to the given nodes, a node past
    the last row adding nothing. Equals the one-process kernel's sum bitwise."""
    zero = torch.zeros(d, dtype=torch.float64)

    def value(first: int, k: int) -> Optional[torch.Tensor]:
        if first >= total:
            return None
        got = nodes.get((first, k))
        if got is not None:
            return got
        if k == 0:
            raise AssertionError(f"row {first} is in no rank's blocks")
        left, right = value(first, k - 1), value(first + (1 << (k - 1)), k - 1)
        return left if right is None else left + right

    if total == 0:
        return zero
    top = max(0, (total - 1).bit_length())
    return value(0, top)
