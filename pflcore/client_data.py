"""The ragged layout of a federation's data (DESIGN.md §2). Part of the bottom layer: the ops
and the data generators both build on it."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from pflcore._arrays import to_tensor as as_tensor
from pflcore._checks import check_device, check_dtype, check_finite, check_float, check_shape


_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.uint8)


def _int64(t: torch.Tensor, name: str) -> torch.Tensor:
    """int64 as it is; another integer dtype (JAX's default int32) converted, a copy."""
    if t.dtype in _INTEGERS:
        return t.to(torch.int64)
    check_dtype(t, name, torch.int64)
    return t


class ClientData:
    """The rows of all clients in one array: client ``i`` owns rows ``offsets[i]:offsets[i+1]``.

    Args:
        x: ``[N, p]`` float32 or float64 features.
        y: ``[N]`` int64 class labels, or float targets (the dtype of ``x``) for least squares.
        offsets: ``[m + 1]`` int64, starting at 0, strictly increasing (every client has at
            least one row), ending at N.
        Labels and offsets of a narrower integer dtype (JAX's default int32) are converted to
        int64, a copy; everything else is used without one.
        first_client: the global id of local client 0 (0 unless this is one rank's shard of a
            bigger federation, ``shard``): client ``i`` here is client ``first_client + i`` of
            the federation, the id that ``ops.sample_batches`` hashes.

    numpy arrays (and DLPack arrays: JAX, CuPy) are wrapped without a copy. Everything is
    validated here, so that a mistake shows where it is made; the ops do not rely on it: the
    arrays stay the caller's, who may change them, so every op checks again the values it reads
    (DESIGN.md §8).
    """

    first_client: int = 0  # (class default: objects pickled before the attribute existed)

    def __init__(self, x, y, offsets, first_client: int = 0):
        x, _ = as_tensor(x, "x")
        y, _ = as_tensor(y, "y")
        offsets, _ = as_tensor(offsets, "offsets")
        check_float(x, "x")
        if x.dim() != 2:
            raise ValueError(f"x: expected shape [N, p], got {list(x.shape)}")
        N = x.shape[0]
        check_shape(y, "y", (N,), f"[N] = [{N}]")
        check_device(y, "y", x.device)
        check_device(offsets, "offsets", x.device)
        if y.dtype.is_floating_point:
            check_float(y, "y", x.dtype)
            check_finite(y, "y")
        else:
            y = _int64(y, "y")
            if N and int(y.min()) < 0:
                raise ValueError(f"y: class labels must be >= 0, got {int(y.min())}")
        offsets = _int64(offsets, "offsets")
        if offsets.dim() != 1 or offsets.numel() < 2:
            raise ValueError(f"offsets: expected shape [m + 1] with m >= 1, got {list(offsets.shape)}")
        off = offsets.cpu()
        if int(off[0]) != 0:
            raise ValueError(f"offsets: must start at 0, got offsets[0] = {int(off[0])}")
        if int(off[-1]) != N:
            raise ValueError(f"offsets: must end at N = {N} (the rows of x), got offsets[-1] = {int(off[-1])}")
        steps = off[1:] - off[:-1]
        if bool((steps < 0).any()):
            i = int(torch.nonzero(steps < 0)[0])
            raise ValueError(f"offsets: must be non-decreasing, got offsets[{i}] = {int(off[i])} > "
                             f"offsets[{i + 1}] = {int(off[i + 1])}")
        if bool((steps == 0).any()):
            i = int(torch.nonzero(steps == 0)[0])
            raise ValueError(f"offsets: client {i} is empty (offsets[{i}] == offsets[{i + 1}] == {int(off[i])}); "
                             f"every client needs at least one row")
        check_finite(x, "x")
        if isinstance(first_client, bool) or not isinstance(first_client, int) or first_client < 0:
            raise ValueError(f"first_client: expected an integer >= 0, got {first_client!r}")
        self.first_client = first_client
        self.x = x.contiguous()
        self.y = y.contiguous()
        self.offsets = offsets.contiguous()

    @classmethod
    def from_clients(cls, xs: Sequence, ys: Sequence) -> "ClientData":
        """Concatenate per-client arrays ``xs[i] [n_i, p]``, ``ys[i] [n_i]``."""
        if len(xs) != len(ys) or not xs:
            raise ValueError(f"xs, ys: expected two non-empty lists of equal length, got {len(xs)} and {len(ys)}")
        xt = [as_tensor(v, f"xs[{i}]")[0] for i, v in enumerate(xs)]
        yt = [as_tensor(v, f"ys[{i}]")[0] for i, v in enumerate(ys)]
        sizes = torch.tensor([0] + [int(v.shape[0]) for v in xt], dtype=torch.int64)
        return cls(torch.cat(xt), torch.cat(yt), torch.cumsum(sizes, 0).to(xt[0].device))

    @property
    def num_clients(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]

    @property
    def num_features(self) -> int:
        return self.x.shape[1]

    @property
    def sizes(self) -> torch.Tensor:
        """``[m]`` int64 rows per client."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def client(self, i: int):
        """(x_i, y_i) of client ``i`` (views)."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.x[lo:hi], self.y[lo:hi]

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "ClientData":
        """A copy on ``device`` and/or with features (and float targets) of ``dtype``."""
        x = self.x.to(device=device, dtype=dtype)
        y = self.y.to(device=device, dtype=dtype if self.y.dtype.is_floating_point else None)
        return ClientData(x, y, self.offsets.to(device), self.first_client)

    def shard(self, lo: int, hi: int) -> "ClientData":
        """Clients ``lo .. hi-1`` (views of their rows, offsets rebased to 0), keeping their
        global ids: the result's ``first_client`` is ``self.first_client + lo``."""
        m = self.num_clients
        if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int) \
                or not 0 <= lo < hi <= m:
            raise ValueError(f"lo, hi: expected integers with 0 <= lo < hi <= m = {m}, got {lo!r}, {hi!r}")
        r0, r1 = int(self.offsets[lo]), int(self.offsets[hi])
        return ClientData(self.x[r0:r1], self.y[r0:r1], self.offsets[lo:hi + 1] - r0, self.first_client + lo)

    def __repr__(self) -> str:
        ids = f", clients {self.first_client}..{self.first_client + self.num_clients - 1}" if self.first_client else ""
        return (f"ClientData(m={self.num_clients}, N={self.num_rows}, p={self.num_features}, "
                f"dtype={str(self.dtype).replace('torch.', '')}, device={self.device}{ids})")
