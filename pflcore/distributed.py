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
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["Comm", "TorchComm", "DistributedError", "init", "shutdown", "default_comm", "shard_range", "shard_starts",
           "owner_of", "gather_rows", "quantile", "std", "kmeans", "cluster_means"]


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


# ---- sharded k-means --------------------------------------------------------------------------

def cluster_means(points: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor],
                  centroids: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``centroids`` [K, d] ← the weighted mean of each cluster's points over all ranks, in
    place (an empty cluster keeps its centroid); returns the clusters' float64 weights [K].
    One all-reduce of [K, d + 1] float64."""
    from pflcore.ops.kmeans import _update

    if comm.world == 1:
        return _update(points, labels, weights, centroids)
    K, d = centroids.shape
    w = torch.ones(points.shape[0], dtype=torch.float64, device=points.device) if weights is None \
        else weights.to(torch.float64)
    acc = torch.zeros(K, d + 1, dtype=torch.float64, device=points.device)
    if points.shape[0]:
        acc[:, :d].index_add_(0, labels, points.to(torch.float64) * w[:, None])
        acc[:, d].index_add_(0, labels, w)
    comm.all_reduce(acc)
    wsum = acc[:, d]
    keep = wsum > 0
    centroids[keep] = (acc[keep, :d] / wsum[keep, None]).to(centroids.dtype)
    return wsum


def _assign_local(points: torch.Tensor, centroids: torch.Tensor):
    from pflcore.ops.kmeans import _assign

    if points.shape[0] == 0:
        return (torch.empty(0, dtype=torch.int64, device=points.device),
                torch.empty(0, dtype=points.dtype, device=points.device))
    return _assign(points.contiguous(), centroids.contiguous())


def _kmeans_pp(points, k, weights, seed, comm: Comm) -> torch.Tensor:
    """k-means++ over the points of every rank, as ``ops.kmeans`` seeds it: the same generator
    draws u ∈ [0, total) on every rank; the rank whose cumulative share holds u picks the point
    (searchsorted on its local cdf) and broadcasts it."""
    gen = torch.Generator().manual_seed(int(seed))
    N = points.shape[0]
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.detach().cpu().to(torch.float64)

    def draw(prob: torch.Tensor) -> torch.Tensor:
        cdf = torch.cumsum(prob, 0)
        totals = torch.stack(comm.all_gather(torch.tensor([float(cdf[-1]) if N else 0.0], dtype=torch.float64)))[:, 0]
        cum = torch.cumsum(totals, 0)
        u = torch.rand((), generator=gen, dtype=torch.float64) * cum[-1]
        owner = int(torch.searchsorted(cum, u, right=True))
        if owner >= comm.world:  # u at the very top: the last rank holding any mass
            owner = int(torch.nonzero(totals > 0)[-1])
        row = torch.empty(points.shape[1], dtype=points.dtype, device=points.device)
        if comm.rank == owner:
            local_u = u - (cum[owner] - totals[owner])
            row.copy_(points[min(int(torch.searchsorted(cdf, local_u, right=True)), N - 1)])
        return comm.broadcast(row, owner)

    centroids = torch.empty(k, points.shape[1], dtype=points.dtype, device=points.device)
    centroids[0] = draw(w)
    d2 = _assign_local(points, centroids[:1])[1].detach().cpu().to(torch.float64)
    for j in range(1, k):
        prob = d2 * w
        centroids[j] = draw(prob if comm.sum(float(prob.sum())) > 0 else w)
        d2 = torch.minimum(d2, _assign_local(points, centroids[j:j + 1])[1].detach().cpu().to(torch.float64))
    return centroids


def kmeans(points: torch.Tensor, k: Optional[int] = None, *, init="k-means++", iters: int = 100, tol: float = 1e-6,
           seed: int = 0, weights: Optional[torch.Tensor] = None, comm: Comm):
    """``ops.kmeans`` over the points of every rank (each rank passes its own rows; the result's
    ``labels`` are this rank's, the centroids and inertia are global). One process: exactly
    ``ops.kmeans``. The Lloyd loop is ``ops.kmeans``'s: the stop tests use replicated values
    (centroid shift, all-reduced inertia and label changes), so every rank iterates alike."""
    from pflcore import ops
    from pflcore.ops.kmeans import KMeans

    if comm.world == 1:
        return ops.kmeans(points, k, init=init, iters=iters, tol=tol, seed=seed, weights=weights)
    N = comm.sum(int(points.shape[0]))
    if isinstance(init, str):
        if init != "k-means++":
            raise ValueError(f"init: expected 'k-means++' or a [k, d] tensor of centroids, got {init!r}")
        if k is None or k < 1 or k > N:
            raise ValueError(f"k: expected 1 <= k <= N = {N} (points over all ranks), got {k!r}")
        centroids = _kmeans_pp(points, k, weights, seed, comm)
    else:
        centroids = init.clone()
    w64 = None if weights is None else weights.to(torch.float64)

    def inertia_of(sq):
        local = float(sq.to(torch.float64).sum() if w64 is None else (sq.to(torch.float64) * w64).sum())
        return comm.sum(local)

    labels, sq = _assign_local(points, centroids)
    history = [inertia_of(sq)]
    scale = 0.0
    if N > 1:  # Σ over features of the population variance, in two passes like torch.var
        mean = comm.sum(points.to(torch.float64).sum(0)) / N
        scale = comm.sum(float(((points.to(torch.float64) - mean) ** 2).sum())) / N
    it = 0
    for it in range(1, iters + 1):
        previous = centroids.clone()
        cluster_means(points, labels, weights, centroids, comm)
        new_labels, sq = _assign_local(points, centroids)
        history.append(inertia_of(sq))
        shift = float(((centroids - previous).to(torch.float64) ** 2).sum())
        changed = comm.sum(int((new_labels != labels).sum()))
        labels = new_labels
        if changed == 0 or shift <= tol * scale:
            break
    return KMeans(centroids, labels, history[-1], it, history)
