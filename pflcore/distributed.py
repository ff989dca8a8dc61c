"""Clients sharded across ranks with torch.distributed (DESIGN.md §1, §4, §7).

A federation that outgrows one process runs on several: ``torchrun --nproc-per-node N -m
pflcore run EXPERIMENT.toml`` (or ``pflcore.run(...)`` in a script started by torchrun). Every
rank builds the same federation, keeps the contiguous block of clients ``shard_range(m, N,
rank)`` (its rows of the data and of every per-client ``[m, d]`` matrix) and runs the rounds
on it; client ids stay global, so client sampling and ``ops.sample_batches`` draw the same
numbers as one process does.

The server steps become collectives of a size set by d and the number of ranks, never by the
number of clients a rank holds:

- weighted averages (P_H): one all-reduce of the weighted sum [d] and the weight;
- Anderson's Gram update over per-client states: one all-reduce of the k new dot products;
- k-means (CGPFL): Lloyd iterations on the local points with an all-reduce of the per-cluster
  sums and weights [K, d + 1]; k-means++ draws its point on the rank that holds it and
  broadcasts it [d];
- metrics: all-reduces of sums; the 10th percentile of the clients' accuracies exactly, by
  bisection on the values' bit patterns (one all-reduced count per step);
- PERM: the gradient matrix by all-gather (its mixing weights couple all clients), and model
  shuffling moves models to the rank of the client they visit and back (PERM's models travel
  by design: a per-client cost).

``Comm`` is the single-process communicator: every collective is the identity, and the
algorithms then call exactly the ops they call without pflcore.distributed, so a one-process
run is bitwise what it was. ``TorchComm`` wraps a torch.distributed process group (gloo on the
CPU, NCCL on CUDA) and counts the bytes each rank sends (``bytes_sent``). A failed or timed-out
collective raises ``DistributedError`` naming the rank and the operation; a rank that dies
makes the others fail at once (connection reset), one that stops without dying makes them fail
after the group's timeout (``PFLCORE_DIST_TIMEOUT`` seconds, default 300, when pflcore creates
the group).

Bitwise equality with one process holds where a result does not depend on a reduction order
(client sampling, minibatches, every client's local steps, PERM's shuffling, counts and
accuracies); sums over clients split across ranks are added in another order, so averages
agree to float rounding.
"""
from __future__ import annotations

import datetime
import math
import os
from typing import Callable, List, Optional, Tuple

import torch

from pflcore._comm import Comm

__all__ = ["Comm", "TorchComm", "DistributedError", "init", "shutdown", "default_comm", "shard_range", "shard_starts",
           "owner_of", "gather_rows", "quantile", "std"]


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, raised, or timed out."""


def shard_range(m: int, world: int, rank: int) -> Tuple[int, int]:
    """``[lo, hi)``: the contiguous clients of ``rank`` among ``world`` ranks (sizes differ by at
    most one, the first ranks get the extra clients)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world = {world}, got {rank}")
    if m < world:
        raise ValueError(f"world: {world} ranks need at least {world} clients (one per rank), the federation has {m}")
    starts = shard_starts(m, world)
    return int(starts[rank]), int(starts[rank + 1])


def shard_starts(m: int, world: int) -> torch.Tensor:
    """``int64 [world + 1]``: rank r holds clients ``starts[r] .. starts[r+1] - 1``."""
    base, extra = divmod(m, world)
    sizes = torch.full((world,), base, dtype=torch.int64)
    sizes[:extra] += 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])


def owner_of(clients: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``int64``: the rank holding each global client id."""
    return torch.searchsorted(starts.to(clients.device), clients, right=True) - 1


# ---- communicators ------------------------------------------------------------------------------

class TorchComm(Comm):
    """A torch.distributed process group. Collectives run on the CPU for gloo and on the
    current CUDA device for NCCL; results come back on the input's device."""

    def __init__(self, group=None):
        super().__init__()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError("no torch.distributed process group: call pflcore.distributed.init() "
                                   "(or start the script with torchrun)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _guard(self, what: str, fn: Callable):
        try:
            return fn()
        except DistributedError:
            raise
        except Exception as exc:  # gloo and NCCL raise RuntimeError (and subclasses) on failures
            raise DistributedError(f"rank {self.rank} of {self.world}: {what} failed; a peer rank died, raised or "
                                   f"timed out ({type(exc).__name__}: {exc})") from exc

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def all_reduce(self, t, op="sum"):
        ops = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX, "min": self._dist.ReduceOp.MIN}
        work = self._on(t.contiguous())
        self.bytes_sent += work.numel() * work.element_size()
        self._guard(f"all_reduce({op}) of {list(t.shape)}", lambda: self._dist.all_reduce(work, ops[op], group=self.group))
        if work.data_ptr() != t.data_ptr():
            t.copy_(work)
        return t

    def all_gather(self, t):
        work = self._on(t.contiguous())
        outs = [torch.empty_like(work) for _ in range(self.world)]
        self.bytes_sent += work.numel() * work.element_size()
        self._guard(f"all_gather of {list(t.shape)}", lambda: self._dist.all_gather(outs, work, group=self.group))
        return [o.to(t.device) for o in outs]

    def all_gather_rows(self, t):
        n = torch.tensor([t.shape[0]], dtype=torch.int64)
        counts = [int(c[0]) for c in self.all_gather(n)]
        top = max(counts)
        padded = torch.zeros((top,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[:t.shape[0]] = t
        parts = self.all_gather(padded)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def broadcast(self, t, src):
        work = self._on(t.contiguous())
        if self.rank == src:
            self.bytes_sent += work.numel() * work.element_size()
        self._guard(f"broadcast from rank {src}", lambda: self._dist.broadcast(work, src, group=self.group))
        if work.data_ptr() != t.data_ptr():
            t.copy_(work)
        return t

    def exchange(self, sends, width, dtype, device=None):
        if len(sends) != self.world:
            raise ValueError(f"sends: expected one entry per rank ({self.world}), got {len(sends)}")
        device = torch.device("cpu") if device is None else torch.device(device)
        mine = torch.tensor([0 if s is None else s.shape[0] for s in sends], dtype=torch.int64)
        counts = torch.stack(self.all_gather(mine))  # counts[src, dst]
        recvs: List[torch.Tensor] = [torch.empty(0, width, dtype=dtype, device=device) for _ in range(self.world)]
        work = []

        def post():
            for q in range(self.world):
                n_in, n_out = int(counts[q, self.rank]), int(counts[self.rank, q])
                if q == self.rank:
                    if n_out:
                        recvs[q] = sends[q]
                    continue
                if n_in:
                    buf = torch.empty(n_in, width, dtype=dtype, device=self.device)
                    work.append((q, buf, self._dist.irecv(buf, q, group=self.group)))
                if n_out:
                    block = self._on(sends[q].contiguous())
                    self.bytes_sent += block.numel() * block.element_size()
                    work.append((None, block, self._dist.isend(block, q, group=self.group)))
            for q, buf, req in work:
                req.wait()
                if q is not None:
                    recvs[q] = buf.to(device)

        self._guard("exchange (point-to-point)", post)
        return recvs

    def barrier(self):
        self._guard("barrier", lambda: self._dist.barrier(group=self.group))


def init(backend: Optional[str] = None, timeout: Optional[float] = None) -> Comm:
    """The communicator of this process: a ``TorchComm`` over the default process group, which is
    created here from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if it
    does not exist yet; a plain ``Comm`` when WORLD_SIZE is unset or 1.

    ``backend`` defaults to NCCL when CUDA is available and LOCAL_RANK is set, else gloo;
    ``timeout`` (seconds) to ``PFLCORE_DIST_TIMEOUT`` or 300."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return TorchComm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Comm()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seconds = float(timeout if timeout is not None else os.environ.get("PFLCORE_DIST_TIMEOUT", "300"))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
    return TorchComm()


def shutdown() -> None:
    """Leave the default process group cleanly after every rank finished its work: a barrier (no
    rank leaves while another still talks to it), then its destruction (a process that exits
    with the group alive can abort in the communication threads' teardown). Not after a failure:
    a rank that raised mid-run should just exit, which fails its peers' collectives at once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def default_comm() -> Comm:
    """The default process group's communicator if one is initialized (world > 1), else ``Comm()``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchComm()
    return Comm()


def gather_rows(t: torch.Tensor, comm: Optional[Comm] = None) -> torch.Tensor:
    """Every rank's rows of a per-client tensor (e.g. ``Result.personalized``) concatenated in
    client order, on every rank (a collective: all ranks call it)."""
    comm = default_comm() if comm is None else comm
    return comm.all_gather_rows(t)


# ---- exact order statistics and spread ----------------------------------------------------------

def _ordered_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys that order like the float64 values (IEEE bit patterns, negatives flipped)."""
    bits = values.to(torch.float64).contiguous().view(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)


def _from_key(key: int) -> float:
    bits = key ^ 0x7FFFFFFFFFFFFFFF if key < 0 else key
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])


def kth_smallest(values: torch.Tensor, k: int, comm: Comm) -> float:
    """The k-th smallest (0-based) of the union of every rank's ``values`` (finite), exactly:
    bisection on the ordered bit patterns, one all-reduced count per step (at most 64)."""
    keys = _ordered_keys(values.detach().cpu())
    big = torch.iinfo(torch.int64).max
    lo = -int(comm.all_reduce(torch.tensor([-(int(keys.min()) if keys.numel() else big)]), "max")[0])
    hi = int(comm.all_reduce(torch.tensor([int(keys.max()) if keys.numel() else -big]), "max")[0])
    while lo < hi:  # invariant: the answer's key lies in [lo, hi]
        mid = lo + (hi - lo) // 2
        below = int(comm.sum(torch.tensor([int((keys <= mid).sum())]))[0])
        if below >= k + 1:
            hi = mid
        else:
            lo = mid + 1
    return _from_key(lo)


def quantile(values: torch.Tensor, q: float, comm: Comm) -> float:
    """``torch.quantile(all values, q)`` (linear interpolation) over the values of every rank,
    bitwise: the two order statistics exactly, then torch's own lerp."""
    if comm.world == 1:
        return float(torch.quantile(values.to(torch.float64), q))
    n = comm.sum(int(values.numel()))
    rank = torch.tensor(q, dtype=torch.float64) * (n - 1)  # as torch.quantile computes it
    below, above = int(rank.floor()), int(rank.ceil())
    lo_val = torch.tensor(kth_smallest(values, below, comm), dtype=torch.float64)
    hi_val = torch.tensor(kth_smallest(values, above, comm) if above != below else float(lo_val),
                          dtype=torch.float64)
    return float(torch.lerp(lo_val, hi_val, rank - below))


def std(values: torch.Tensor, comm: Comm) -> float:
    """Population standard deviation of every rank's values (two passes, float64)."""
    if comm.world == 1:
        return float(values.to(torch.float64).std(unbiased=False))
    v = values.to(torch.float64)
    n = comm.sum(int(v.numel()))
    mean = comm.sum(float(v.sum())) / n
    return math.sqrt(comm.sum(float(((v - mean) ** 2).sum())) / n)
