"""The exact value checks of ``_values.py``: run only when its one-read screen found something
(a fault, or a value that might be one), they find the first fault and build its message.

They report exactly what the native kernels report (csrc/include/pflcore/checks.h and the
kernels in csrc/cpu): the same message for the same first fault. "First" is defined by the
order in which a kernel working on model row r meets its inputs, and the smallest r wins:

    rows[r] -> offsets of its client -> theta[r] -> anchor -> grad_scale[r] -> then, step by
    step: the step's batch indices (in order), then each row read (in order): its label, then
    its features.

A full-batch pass reads the client's rows in order. The native kernels check as they go, so
there a model row that fails keeps its old value while the others are updated; here nothing is
written when a check fails. Each function returns when it finds no fault (the screen is
conservative: e.g. a NaN in a row no call reads, or a finite sum that overflowed).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from pflcore._checks import all_finite
from pflcore.errors import NonFiniteError

_BIG = 1 << 62


def _raise(kind, message: str):
    raise kind(message)


def _client_ranges(offsets: torch.Tensor, clients: torch.Tensor, N: int):
    lo, hi = offsets[clients], offsets[clients + 1]
    bad = ~((lo >= 0) & (lo < hi) & (hi <= N))
    return lo, hi, bad


def _first(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D mask, or -1."""
    if mask.numel() == 0:
        return -1
    idx = torch.nonzero(mask)
    return int(idx[0, 0]) if idx.numel() else -1


def rows_finite(t: torch.Tensor) -> torch.Tensor:
    """[R] bool: row r of ``t`` [R, ...] holds no NaN or inf. A row's sum is finite only if every
    value is (NaN and inf propagate; inf - inf is NaN), and a sum is one fast vectorized pass
    where ``isfinite(t).all(1)`` costs ~13x more; rows whose sum is not finite, including
    finite rows whose sum overflowed, are looked at value by value."""
    t = t.flatten(1) if t.dim() > 1 else t.reshape(-1, 1)
    if not t.is_floating_point():
        return torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    ok = torch.isfinite(t.sum(1))
    if not bool(ok.all()):
        bad = torch.nonzero(~ok).view(-1)
        ok[bad] = torch.isfinite(t.index_select(0, bad)).all(1)
    return ok


def _label_bad(model, y: torch.Tensor) -> torch.Tensor:
    if model.is_classifier:
        return (y < 0) | (y >= model.num_classes)
    return ~torch.isfinite(y)


def _row_message_y(model, y: torch.Tensor, row: int) -> tuple:
    v = y[row]
    if model.is_classifier:
        return ValueError, f"y: expected labels in [0, {model.num_classes}), got y[{row}] = {int(v)}"
    return NonFiniteError, f"y: y[{row}] = {float(v):g} is not finite"


def client_rows_fault(rows, offsets, m: int, N: int):
    """Per model row, the fault key of its client index (0) or its offsets (1), else _BIG; with
    the clients (``rows``, or every client for None), the same clamped into range (``safe``),
    their row ranges [lo, hi), and which indices were out of range."""
    R = m if rows is None else rows.numel()
    clients = torch.arange(R, device=offsets.device) if rows is None else rows
    bad_row = None if rows is None else (rows < 0) | (rows >= m)
    safe = clients if bad_row is None else torch.where(bad_row, torch.zeros_like(clients), clients)
    lo, hi, bad_off = _client_ranges(offsets, safe, N)
    key = torch.full((R,), _BIG, dtype=torch.int64, device=offsets.device)
    if bad_row is not None:
        bad_off = bad_off & ~bad_row
        key = torch.where(bad_row, torch.zeros_like(key), key)
    key = torch.where(bad_off, torch.ones_like(key), key)
    return clients, safe, lo, hi, key, bad_row


def _message_client(r: int, code: int, clients, lo, hi, m: int, N: int, name: str) -> tuple:
    i = int(clients[r])
    if code == 0:
        return ValueError, f"{name}: expected client indices in [0, {m}), got {name}[{r}] = {i}"
    return ValueError, (f"offsets: client {i} needs 0 <= offsets[{i}] < offsets[{i + 1}] <= N = {N}, "
                        f"got {int(lo[r])} and {int(hi[r])}")


# Values of features gathered at a time when only the minibatches' rows are checked (bounds the
# temporary copy at 16 MB of float32).
_GATHER_VALUES = 1 << 22


def _batch_rows_bad(model, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor):
    """(label bad, features bad) of the data rows ``rows`` (any shape, valid indices). A call
    reads only its minibatches' rows, so only those are checked when they are fewer than the
    data's rows (a pFedMe step on 1,000 clients reads 20 rows of each, not the whole federation);
    otherwise one pass over all rows is cheaper than the gathers."""
    N = x.shape[0]
    flat = rows.reshape(-1)
    if flat.numel() >= N:
        x_bad = ~rows_finite(x)
        return _label_bad(model, y)[rows], x_bad[rows]
    x_bad = torch.empty(flat.shape, dtype=torch.bool, device=x.device)
    step = max(1, _GATHER_VALUES // max(1, x[0].numel()))  # N > 0 here: fewer rows read than N
    for a in range(0, flat.numel(), step):
        x_bad[a:a + step] = ~rows_finite(x.index_select(0, flat[a:a + step]))
    return _label_bad(model, y.index_select(0, flat)).view(rows.shape), x_bad.view(rows.shape)


def glm_fault(model, theta: Optional[torch.Tensor], data, rows: Optional[torch.Tensor],
              batches: Optional[torch.Tensor] = None, anchor: Optional[torch.Tensor] = None,
              grad_scale: Optional[torch.Tensor] = None) -> None:
    """``theta`` [R, d], or [d]: one model for every row (checked first, as a whole)."""
    if theta is not None and theta.dim() == 1:
        if not all_finite(theta):
            _raise(NonFiniteError, "theta: holds a NaN or infinite value")
        theta = None
    """Raises the first fault of a local_steps / gradients / evaluate call (see the module
    docstring). ``batches`` is [R, steps, B] (local_steps) or [R, B] (gradients, one step)."""
    x, y, offsets = data.x, data.y, data.offsets
    N, m = x.shape[0], offsets.numel() - 1
    R = m if rows is None else rows.numel()
    if R == 0:
        return
    dev = x.device
    clients, safe, lo, hi, key, _ = client_rows_fault(rows, offsets, m, N)
    if theta is not None:
        key = torch.where((key == _BIG) & ~rows_finite(theta), torch.full_like(key, 2), key)
    anchor_shared_bad = False
    if anchor is not None:
        if anchor.dim() == 1:
            anchor_shared_bad = not all_finite(anchor)
            if anchor_shared_bad:
                key = torch.where(key == _BIG, torch.full_like(key, 3), key)
        else:
            key = torch.where((key == _BIG) & ~rows_finite(anchor), torch.full_like(key, 3), key)
    if grad_scale is not None:
        key = torch.where((key == _BIG) & ~torch.isfinite(grad_scale), torch.full_like(key, 4), key)

    step_key = None
    if batches is not None:
        b3 = batches.view(R, -1, batches.shape[-1]).to(torch.int64)  # [R, steps, B]
        S, B = b3.shape[1], b3.shape[2]
        out = (b3 < lo.view(R, 1, 1)) | (b3 >= hi.view(R, 1, 1)) | (b3 < 0) | (b3 >= N)
        j = torch.arange(B, device=dev).view(1, 1, B)
        s = torch.arange(S, device=dev).view(1, S, 1)
        base = 5 + s * (3 * B)
        k_index = torch.where(out, base + j, torch.full_like(b3, _BIG))
        safe_b = torch.where(out, torch.zeros_like(b3), b3)
        yb, xb = _batch_rows_bad(model, x, y, safe_b)
        yb &= ~out
        xb &= ~out
        k_y = torch.where(yb, base + B + 2 * j, torch.full_like(b3, _BIG))
        k_x = torch.where(xb, base + B + 2 * j + 1, torch.full_like(b3, _BIG))
        step_key = torch.minimum(torch.minimum(k_index, k_y), k_x).view(R, -1).min(1).values
    else:
        # faults of the rows read: per data row, 2·row + (0 label, 1 features)
        row_bad = torch.stack([_label_bad(model, y), ~rows_finite(x)], 1).reshape(-1)  # [2N]
        # first bad data row at or after each position: a reverse running minimum
        pos = torch.arange(2 * N, device=dev)
        marked = torch.where(row_bad, pos, torch.full_like(pos, _BIG))
        nxt = torch.flip(torch.cummin(torch.flip(marked, [0]), 0).values, [0]) if N else marked
        nxt = torch.cat([nxt, torch.full((1,), _BIG, dtype=torch.int64, device=dev)])
        first = nxt[(2 * lo).clamp(0, 2 * N)]
        hit = first < 2 * hi
        step_key = torch.where(hit, 5 + (first - 2 * lo), torch.full_like(first, _BIG))
    key = torch.where(key == _BIG, step_key, key)
    r = _first(key < _BIG)
    if r < 0:
        return
    code = int(key[r])
    if code < 2:
        _raise(*_message_client(r, code, clients, lo, hi, m, N, "rows"))
    if code == 2:
        _raise(NonFiniteError, f"theta: row {r} holds a NaN or infinite value")
    if code == 3:
        _raise(NonFiniteError, "anchor: holds a NaN or infinite value" if anchor_shared_bad
               else f"anchor: row {r} holds a NaN or infinite value")
    if code == 4:
        _raise(NonFiniteError, f"grad_scale: grad_scale[{r}] = {float(grad_scale[r]):g} is not finite")
    code -= 5
    i, a, b = int(safe[r]), int(lo[r]), int(hi[r])
    if batches is None:
        row, what = a + code // 2, code % 2
    else:
        B = batches.shape[-1]
        s, rest = divmod(code, 3 * B)
        if rest < B:
            idx = int(batches.view(R, -1, B)[r, s, rest])
            at = f"[{r}, {rest}]" if batches.dim() == 2 else f"[{r}, {s}, {rest}]"
            _raise(ValueError, f"batches: index {idx} at {at} is outside the rows [{a}, {b}) of client {i}")
        jj, what = divmod(rest - B, 2)
        row = int(batches.view(R, -1, B)[r, s, jj])
    if what == 0:
        _raise(*_row_message_y(model, y, row))
    _raise(NonFiniteError, f"x: row {row} holds a NaN or infinite value")


def sample_batches_fault(data, clients: Optional[torch.Tensor]) -> None:
    offsets = data.offsets
    N, m = data.x.shape[0], offsets.numel() - 1
    if clients is not None and clients.numel() == 0:
        return
    ids, _, lo, hi, key, _ = client_rows_fault(clients, offsets, m, N)
    r = _first(key < _BIG)
    if r >= 0:
        _raise(*_message_client(r, int(key[r]), ids, lo, hi, m, N, "clients"))


def kmeans_assign_fault(points: torch.Tensor, centroids: torch.Tensor) -> None:
    k = _first(~rows_finite(centroids))
    if k >= 0:
        _raise(NonFiniteError, f"centroids: row {k} holds a NaN or infinite value")
    n = _first(~rows_finite(points))
    if n >= 0:
        _raise(NonFiniteError, f"points: row {n} holds a NaN or infinite value")


def kmeans_update_fault(labels: torch.Tensor, weights: Optional[torch.Tensor], K: int) -> None:
    bad_l = (labels < 0) | (labels >= K)
    bad_w = torch.zeros_like(bad_l) if weights is None else ~(torch.isfinite(weights) & (weights >= 0))
    i = _first(bad_l | bad_w)
    if i < 0:
        return
    if bool(bad_l[i]):
        _raise(ValueError, f"labels: expected cluster indices in [0, {K}), got labels[{i}] = {int(labels[i])}")
    w = float(weights[i])
    _raise(ValueError if w == w and abs(w) != float("inf") else NonFiniteError,
           f"weights: expected finite weights >= 0, got weights[{i}] = {w:g}")


def average_fault(theta: torch.Tensor, weights: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
    M = theta.shape[0]
    if rows is not None:
        bad_r = (rows < 0) | (rows >= M)
        safe = torch.where(bad_r, torch.zeros_like(rows), rows)
    else:
        bad_r, safe = None, None
    w = weights if safe is None else weights[safe]
    bad_w = ~(torch.isfinite(w) & (w >= 0))
    if bad_r is not None:
        bad_w = bad_w & ~bad_r
    r = _first(bad_w if bad_r is None else bad_r | bad_w)
    if r >= 0:
        if bad_r is not None and bool(bad_r[r]):
            _raise(ValueError, f"rows: expected indices in [0, {M}), got rows[{r}] = {int(rows[r])}")
        i = r if safe is None else int(safe[r])
        v = float(weights[i])
        _raise(ValueError if v == v and abs(v) != float("inf") else NonFiniteError,
               f"weights: expected finite weights >= 0, got weights[{i}] = {v:g}")
    if not float(w.to(torch.float64).sum()) > 0:
        _raise(ValueError, "weights: the weights of the averaged rows sum to 0")
    th = theta if safe is None else theta[safe]
    r = _first(~rows_finite(th))
    if r >= 0:
        _raise(NonFiniteError, f"theta: row {r if safe is None else int(safe[r])} holds a NaN or infinite value")


def clip_and_sum_fault(updates: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
    """The native kernel's checks, in row order: a row whose norm is not finite, a weight
    outside [0, 1]."""
    norms = torch.linalg.vector_norm(updates.to(torch.float64), dim=1)
    bad_row = ~torch.isfinite(norms)
    bad_w = torch.zeros_like(bad_row) if weights is None else \
        ~(torch.isfinite(weights) & (weights >= 0) & (weights <= 1))
    r = _first(bad_row | bad_w)
    if r < 0:
        return
    if bool(bad_row[r]):
        _raise(NonFiniteError, f"updates: row {r} holds a NaN or infinite value (or its norm overflows)")
    v = float(weights[r])
    _raise(ValueError if math.isfinite(v) else NonFiniteError,
           f"weights: expected weights in [0, 1] (a client's contribution is bounded by clip_norm), "
           f"got weights[{r}] = {v:g}")


def finite_rows(t: torch.Tensor, name: str) -> None:
    r = _first(~rows_finite(t)) if t.dim() else -1
    if r >= 0:
        _raise(NonFiniteError, f"{name}: row {r} holds a NaN or infinite value")
