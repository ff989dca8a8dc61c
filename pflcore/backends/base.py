"""What every backend adapter is (DESIGN.md §8).

An adapter is one implementation of the ops: a class whose public methods are the ops it
serves, each with the same tensor-level signature in every adapter (the public op has already
checked the metadata: shapes, dtypes, devices, contiguity; the adapter checks the values, or
its kernels do). The set of ops an adapter serves is the set of those methods: there is no
list to keep. Each adapter owns its argument conversion (raw addresses for the compiled
modules, tensors for Triton and torch).

The signatures, for R model rows of a model with d parameters on a ClientData ``data``:

    local_steps(model, theta [R, d], data, rows [R] | None, batches int32 [R, steps, B] | None,
                anchor [R, d] | [d] | None, grad_scale [R] | None, steps, lr, prox, trusted) -> None  (in place)
    gradients(model, theta [R, d] | [d], data, rows, batches int32 [R, B] | None, trusted) -> [R, d]
    evaluate(model, theta [R, d] | [d], data, rows) -> (loss_sum [R], correct int64 [R], count int64 [R])
    hvp(model, theta, v [R, d], data, rows, batches int32 [R, B], trusted) -> [R, d]
    sample_batches(data, clients [R] | None, steps, batch_size, seed, counter, trusted) -> int32 [R, steps, B]
    kmeans_assign(points [N, d], centroids [K, d]) -> (labels int64 [N], sqdist [N])
    kmeans_update(points, labels int64 [N], weights [N] | None, centroids [K, d]) -> weight sums f64 [K]  (in place)
    kmeans_lloyd(points, centroids [K, d], weights | None, iters, tol) -> (labels int64 [N], history: list of
        float, iterations)  (centroids in place; backends without one run backends/_lloyd.py on their own
        kmeans_assign and kmeans_update)
    anderson_push(u [D], tu [D], R_hist [H, D], TU_hist [H, D], slot, slots: list) -> dots f64 [k] (CPU)
    anderson_mix(TU_hist [H, D], slots: list, pi f64 [k] (CPU)) -> [D]
    gram(vecs [k, D]) -> f64 [k, k] (CPU)
    average(theta [M, d], weights [M], rows [R] | None) -> [d]

``rows`` None means every client in order (R = m) and is never materialized. A ``theta`` of
shape [d] is one model shared by every row (evaluating or differentiating a global model on all
clients without an [m, d] copy). ``trusted``: the batch indices were drawn by the run's context
(``Context.batches``), so the adapter may skip checking that they lie in their clients' rows.
"""
from __future__ import annotations

from typing import FrozenSet, Optional, Tuple


class Adapter:
    """Base of the adapters: loading, the device types served, and the ops (its methods)."""

    name = ""
    devices: Tuple[str, ...] = ()
    auto = True  # may the automatic choice pick it (the Triton interpreter: only by name)
    # whether its local_steps takes lr_scale (a per-coordinate step); the others' steps are then
    # composed from their gradients (ops/local_steps.py)
    takes_lr_scale = False

    def __init__(self):
        self._state: Optional[Tuple[object, str]] = None

    # ---- what a backend says about itself ---------------------------------------------------

    def _load(self) -> Tuple[Optional[object], str]:
        """(the implementation's module or None, why not / what it is); called once."""
        raise NotImplementedError

    def load(self) -> Tuple[Optional[object], str]:
        if self._state is None:
            self._state = self._load()
        return self._state

    @property
    def module(self):
        return self.load()[0]

    @property
    def available(self) -> bool:
        return self.load()[0] is not None

    def serves(self, device_type: str) -> bool:
        return device_type in self.devices

    def limit(self, op: str, model, dtype) -> Optional[str]:
        """Why this adapter cannot take this call (e.g. too many classes), or None."""
        return None

    def describe(self) -> str:
        """One line for ``pflcore info``."""
        return self.load()[1]

    @classmethod
    def ops(cls) -> FrozenSet[str]:
        """The ops this adapter serves: its public methods beyond the base class's."""
        cached = cls.__dict__.get("_ops")
        if cached is None:
            base = set(dir(Adapter))
            cached = frozenset(n for n in dir(cls) if not n.startswith("_") and n not in base
                               and callable(getattr(cls, n)))
            cls._ops = cached
        return cached


def all_rows(data, rows):
    """``rows``, or every client's index when None: the kernels index a rows array. An adapter
    that hands only the address to a module keeps the tensor alive until the launch."""
    import torch

    return torch.arange(data.offsets.numel() - 1, device=data.x.device) if rows is None else rows


def evaluation_outputs(R: int, dtype, device):
    """(loss_sum [R], correct int64 [R], count int64 [R]): what a kernel's evaluate writes."""
    import torch

    return (torch.empty(R, dtype=dtype, device=device), torch.empty(R, dtype=torch.int64, device=device),
            torch.empty(R, dtype=torch.int64, device=device))


def label_segments(labels, K: int):
    """(order [N], seg [K + 1]): the points sorted stably by label, and where each cluster's run
    starts in that order; the input of a segmented k-means update kernel."""
    import torch

    order = torch.sort(labels, stable=True).indices
    # counts by index_add_, not bincount: bincount on CUDA reads the largest label back to the
    # host to size its output, a second synchronization in a call that has one (the value check)
    seg = torch.zeros(K + 1, dtype=torch.int64, device=labels.device)
    seg.index_add_(0, labels + 1, torch.ones_like(labels))
    return order, torch.cumsum(seg, 0)
