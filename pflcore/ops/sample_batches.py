"""``sample_batches``: counter-based minibatch indices (DESIGN.md §4).

Index j of step s of client i is ``offsets[i] + (h · n_i) >> 32`` with
``h = murmur3_32([seed, counter, client id, s, j])`` (csrc/include/pflcore/hash.h), drawn
with replacement. A draw depends only on these five keys, so results do not depend on the
thread count, the backend, or how clients are sharded.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from pflcore import backend
from pflcore._checks import MAX_COUNT, check_positive_int
from pflcore.client_data import ClientData
from pflcore.ops import _compile
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm, rows_arg

_M32 = 0xFFFFFFFF


def _check_u32(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _M32:
        raise ValueError(f"{name}: expected an integer in [0, 2**32), got {value!r}")
    return int(value)


def sample_batches(data, *, steps, batch_size, seed, counter, clients=None):
    """``int32 [R, steps, batch_size]`` absolute row indices into ``data.x`` (a torch tensor on
    the data's device), one batch per step for each client in ``clients`` (default: all m,
    R = m). The hash takes the global client id ``data.first_client + clients[r]``, so a shard
    draws what the whole federation draws for the same clients. Inside an algorithm, use
    ``ctx.batches``."""
    if is_dynamo_compiling() or is_exporting():  # compile, export: torch.ops.pflcore.sample_batches
        return _compile.traced_sample_batches(data, steps, batch_size, seed, counter, clients)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("sample_batches")
    return run_sample_batches(data, steps, batch_size, seed, counter, clients)


def run_sample_batches(data, steps, batch_size, seed, counter, clients, trusted: bool = False):
    """``sample_batches`` without the algorithm guard (``Context.batches``; ``trusted``: clients
    the run drew itself, which a GPU backend need not screen)."""
    if not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    steps = check_positive_int(steps, "steps", minimum=0, maximum=MAX_COUNT)
    B = check_positive_int(batch_size, "batch_size", maximum=MAX_COUNT)
    seed, counter = _check_u32(seed, "seed"), _check_u32(counter, "counter")
    x, off = data.x, data.offsets
    if x.shape[0] >= 2**31:
        raise ValueError(f"data: int32 batch indices need N < 2**31 rows, got {x.shape[0]}")
    if off.dtype is not torch.int64 or off.dim() != 1 or off.shape[0] < 2 or not off.is_contiguous():
        raise ValueError(f"offsets: expected a contiguous int64 [m + 1] array with m >= 1, got {off.dtype} "
                         f"{list(off.shape)}")
    clients_t = rows_arg(clients, x, "clients")
    return backend.select("sample_batches", None, x).sample_batches(data, clients_t, steps, B, seed, counter,
                                                                     trusted=trusted)


def sample_batches_ref(data, *, steps, batch_size, seed, counter, clients=None):
    """``sample_batches`` on the reference: the same hash written in torch."""
    with backend.reference():
        return sample_batches(data, steps=steps, batch_size=batch_size, seed=seed, counter=counter, clients=clients)
