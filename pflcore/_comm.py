"""The one-process communicator: the collectives the sharded parts of pflcore use, each the
identity for a single process. ``pflcore.distributed.TorchComm`` is the same interface over
torch.distributed; ``ops.kmeans`` takes either (its ``comm`` argument), so one Lloyd loop
serves one process and a sharded run. Part of the bottom layer: imports nothing of pflcore."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class Comm:
    """One process: world size 1, every collective returns its input."""

    rank = 0
    world = 1
    backend = "none"

    def __init__(self):
        self.bytes_sent = 0  # payload bytes this rank handed to collectives (0 here)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place on ``t`` and returned: the elementwise sum (max, min) over ranks."""
        return t

    def all_gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        """``t`` of every rank (same shape everywhere), in rank order."""
        return [t]

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows ``[n_r, ...]`` of every rank concatenated in rank order (n_r may differ)."""
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` of rank ``src`` on every rank (in place on the others' ``t``)."""
        return t

    def exchange(self, sends: Sequence[Optional[torch.Tensor]], width: int, dtype: torch.dtype,
                 device=None) -> List[torch.Tensor]:
        """All-to-all of 2-D blocks: ``sends[q]`` (``[n, width]`` of ``dtype`` or None) goes to rank q;
        returns the blocks every rank sent to this one, in rank order (empty ``[0, width]`` if
        none), on ``device`` (default the CPU)."""
        block = sends[0]
        return [block if block is not None else torch.empty(0, width, dtype=dtype, device=device)]

    def barrier(self) -> None:
        pass

    # conveniences over all_reduce
    def sum(self, value):
        """Sum over ranks of a number or tensor (a tensor is reduced in float64 or int64 and
        returned with its dtype; a number comes back as a float or int)."""
        if isinstance(value, torch.Tensor):
            return value if self.world == 1 else self._sum_tensor(value)
        if self.world == 1:
            return value
        is_int = isinstance(value, int) and not isinstance(value, bool)
        t = torch.tensor([value], dtype=torch.int64 if is_int else torch.float64)
        out = self._sum_tensor(t)[0]
        return int(out) if is_int else float(out)

    def _sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        wide = torch.int64 if not t.is_floating_point() else torch.float64
        return self.all_reduce(t.to(wide).clone()).to(t.dtype)

    def max(self, value: float) -> float:
        if self.world == 1:
            return value
        return float(self.all_reduce(torch.tensor([float(value)], dtype=torch.float64), "max")[0])
