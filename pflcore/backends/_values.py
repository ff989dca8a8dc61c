"""Value checks in torch, for the backends whose kernels cannot raise (reference, cuda, triton,
nets): one vectorized pre-pass per call on the tensors' device, before anything is written.

Each check is a screen and an explanation. The screen queues a few reductions on the device
(one 0-dim flag per condition: an index out of range, a non-finite sum, a label out of range)
and reads their OR back with ONE host read: on a GPU every read is a synchronization that
stalls the queue, and a call whose inputs are fine must pay for one only. When the screen
flags something, the exact checks of ``_faults.py`` find the first fault and raise the message
the native kernels raise (slow, and only then). The screen is conservative: a flag that is no
fault (a NaN in rows no call reads, a finite sum that overflowed) costs the exact pass, which
then returns.

The GPU adapters skip the pre-pass of a ``trusted`` call (the native kernels skip only their
batch-index checks then): a run's context drew the indices itself, so they lie in their
clients' rows and no kernel reads out of bounds, and a NaN or inf that the pre-pass would have
named (in parameters the run computed, or in data changed after ``ClientData`` checked it)
flows into the results, where the run's per-round finiteness check stops it as a
``DivergenceError``. That keeps a round's GPU calls free of host synchronizations.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from pflcore.backends import _faults
from pflcore.backends._faults import _GATHER_VALUES, rows_finite  # noqa: F401 (rows_finite: public here)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: ``t`` may hold a NaN or inf (its sum is not finite: NaN and inf propagate, and
    inf - inf is NaN; a sum that overflowed on finite values flags too, and the exact pass
    clears it)."""
    return ~torch.isfinite(t.sum())


def _flagged(flags: List[torch.Tensor]) -> bool:
    """The one host read of a check: whether any flag is set."""
    if not flags:
        return False
    return bool(torch.stack(flags).any())


def _rows_nonfinite(x: torch.Tensor, flat: torch.Tensor) -> List[torch.Tensor]:
    """Flags: some row ``x[flat]`` may hold a NaN or inf. On the CPU one ``embedding_bag`` sums
    the rows into a single ``[p]`` vector without copying them (NaN and inf propagate as in
    ``_nonfinite``; a sum that overflowed flags too and the exact pass clears it): ~2x faster
    than gathering them, the CIFAR net's 4,000 rows of 3,072 values in 15 ms instead of 30.
    Elsewhere the rows are gathered and summed in bounded pieces."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64) and x.shape[1]:
        sums = torch.nn.functional.embedding_bag(flat, x, flat.new_zeros(1), mode="sum")
        return [_nonfinite(sums)]
    step = max(1, _GATHER_VALUES // max(1, x[0].numel()))  # bounds the gathered copy
    return [_nonfinite(x.index_select(0, flat[a:a + step])) for a in range(0, flat.numel(), step)]


def _labels_flag(model, y: torch.Tensor) -> torch.Tensor:
    if not model.is_classifier:
        return _nonfinite(y)
    lo, hi = torch.aminmax(y)
    return (lo < 0) | (hi >= model.num_classes)


def _weights_flag(w: torch.Tensor, upper: Optional[float] = None) -> torch.Tensor:
    """Some weight is negative, NaN or inf (or above ``upper``). min propagates NaN."""
    lo, hi = torch.aminmax(w)
    bad = ~(lo >= 0) | ~torch.isfinite(hi)
    return bad if upper is None else bad | ~(hi <= upper)


def _client_flags(rows: Optional[torch.Tensor], offsets: torch.Tensor, m: int, N: int, flags: list):
    """Appends the flags of the clients' indices and offsets; returns their row ranges [lo, hi)
    with out-of-range indices clamped (the flag is set then: what they read does not matter)."""
    if rows is None:
        lo, hi = offsets[:-1], offsets[1:]
    else:
        first, last = torch.aminmax(rows)
        flags.append((first < 0) | (last >= m))
        safe = rows.clamp(0, m - 1)
        lo, hi = offsets[safe], offsets[safe + 1]
    flags.append(~((lo >= 0) & (lo < hi) & (hi <= N)).all())
    return lo, hi


def _glm_flags(model, theta, data, rows, batches, anchor, grad_scale) -> List[torch.Tensor]:
    x, y, offsets = data.x, data.y, data.offsets
    N, m = x.shape[0], offsets.numel() - 1
    R = m if rows is None else rows.numel()
    flags = [] if theta is None else [_nonfinite(theta)]
    if R == 0:  # nothing is read but a shared model [d], checked as a whole
        return flags if theta is not None and theta.dim() == 1 else []
    lo, hi = _client_flags(rows, offsets, m, N, flags)
    for t in (anchor, grad_scale):
        if t is not None:
            flags.append(_nonfinite(t))
    if N == 0:  # every client has no rows: flagged above; there is nothing to gather
        return flags
    if batches is None or batches.numel() >= N:
        # every row is read, or reading them all is cheaper than gathering the read ones
        flags += [_labels_flag(model, y), _nonfinite(x)]
    if batches is not None:
        # each model row's smallest and largest index against its client's range: one pass over
        # the indices in their own dtype (comparing int32 with int64 would copy them twice)
        b = batches.view(R, -1)
        if b.shape[1]:
            first, last = torch.aminmax(b, dim=1)
            flags.append(((first < lo) | (last >= hi)).any())
        if batches.numel() < N:
            # a call reads only its minibatches' rows (a pFedMe step on 1,000 clients reads 20
            # rows of each, not the federation); out-of-range indices are flagged, clamped here
            flat = b.reshape(-1).clamp(0, N - 1)
            if flat.numel():
                flags.append(_labels_flag(model, y.index_select(0, flat)))
                flags += _rows_nonfinite(x, flat)
    return flags


def glm_fault(model, theta: Optional[torch.Tensor], data, rows: Optional[torch.Tensor],
              batches: Optional[torch.Tensor] = None, anchor: Optional[torch.Tensor] = None,
              grad_scale: Optional[torch.Tensor] = None) -> None:
    """Raises the first fault of a local_steps / gradients / evaluate call (``_faults.py``).
    ``theta`` [R, d], or [d]: one model for every row; ``batches`` [R, steps, B] (local_steps)
    or [R, B] (gradients, one step)."""
    if _flagged(_glm_flags(model, theta, data, rows, batches, anchor, grad_scale)):
        _faults.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)


def sample_batches_fault(data, clients: Optional[torch.Tensor]) -> None:
    offsets = data.offsets
    if clients is not None and clients.numel() == 0:
        return
    flags: list = []
    _client_flags(clients, offsets, offsets.numel() - 1, data.x.shape[0], flags)
    if _flagged(flags):
        _faults.sample_batches_fault(data, clients)


def kmeans_assign_fault(points: torch.Tensor, centroids: torch.Tensor) -> None:
    if _flagged([_nonfinite(centroids), _nonfinite(points)]):
        _faults.kmeans_assign_fault(points, centroids)


def kmeans_update_fault(labels: torch.Tensor, weights: Optional[torch.Tensor], K: int) -> None:
    flags = []
    if labels.numel():
        lo, hi = torch.aminmax(labels)
        flags.append((lo < 0) | (hi >= K))
    if weights is not None and weights.numel():
        flags.append(_weights_flag(weights))
    if _flagged(flags):
        _faults.kmeans_update_fault(labels, weights, K)


def average_fault(theta: torch.Tensor, weights: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
    if rows is not None and rows.numel() == 0:  # the weights of no rows sum to 0: a fault
        _faults.average_fault(theta, weights, rows)
        return
    safe, _, flags = average_screen(theta, weights, rows)
    th = theta if safe is None else theta.index_select(0, safe)
    if _flagged(flags + [_nonfinite(th)]):
        _faults.average_fault(theta, weights, rows)


def average_screen(theta: torch.Tensor, weights: torch.Tensor, rows: Optional[torch.Tensor]):
    """The part of ``average_fault`` a kernel needs before its launch, read nothing back: (rows
    clamped into [0, M) for the launch, or None; the float64 0-dim sum of the selected weights,
    the mean's divisor; the flags so far). ``rows`` is None or not empty. ``theta`` is screened
    after the launch, in the mean (``average_result_fault``): no extra pass over it."""
    M = theta.shape[0]
    flags = []
    w, safe = weights, None
    if rows is not None:
        first, last = torch.aminmax(rows)
        flags.append((first < 0) | (last >= M))
        safe = rows.clamp(0, M - 1)
        w = weights[safe]
    flags.append(_weights_flag(w))
    wsum = w.to(torch.float64).sum()
    flags.append(~(wsum > 0))
    return safe, wsum, flags


def average_result_fault(theta: torch.Tensor, weights: torch.Tensor, rows: Optional[torch.Tensor],
                         out: torch.Tensor, flags: List[torch.Tensor]) -> None:
    """After an average kernel: ``flags`` of ``average_screen`` and the finiteness of its mean
    ``out`` [d], read back at once. A NaN or inf in a selected row of theta makes the mean non-finite
    (w·NaN is NaN even for w = 0, and so is 0·inf); a mean that overflowed on finite rows flags too,
    and the exact pass clears it."""
    if _flagged(flags + [_nonfinite(out)]):
        _faults.average_fault(theta, weights, rows)


def clip_and_sum_fault(updates: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
    """A row whose norm is not finite (in float64: a float32 row's cannot overflow, a float64
    row's can, and then so does the norm of all rows), a weight outside [0, 1]."""
    flags = [_nonfinite(updates) if updates.dtype != torch.float64
             else ~torch.isfinite(torch.linalg.vector_norm(updates))]
    if weights is not None and weights.numel():
        flags.append(_weights_flag(weights, upper=1.0))
    if _flagged(flags):
        _faults.clip_and_sum_fault(updates, weights)


def finite_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() and _flagged([_nonfinite(t)]):
        _faults.finite_rows(t, name)


def one_per_row(theta: torch.Tensor, data, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``theta`` [R, d] as it is, or a shared model [d] copied to every row (for the kernels that
    take one model per row; the native ones read a shared model in place)."""
    if theta.dim() != 1:
        return theta
    R = data.offsets.numel() - 1 if rows is None else rows.numel()
    return theta.expand(R, theta.shape[0]).contiguous()
