"""``sample_batches``: counter-based minibatch indices (DESIGN.md §4).

Index j of step s of client i is ``offsets[i] + (h · n_i) >> 32`` with
``h = murmur3_32([seed, counter, client id, s, j])`` (csrc/include/pflcore/hash.h), drawn
with replacement. A draw depends only on these five keys, so results do not depend on the
thread count, the backend, or how clients are sharded.
"""
from __future__ import annotations

import numpy as np
import torch

from pflcore import backend
from pflcore.data.client_data import ClientData
from pflcore.ops._checks import check_positive_int, cpu_numpy, index_tensor

_M32 = 0xFFFFFFFF


def _check_u32(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _M32:
        raise ValueError(f"{name}: expected an integer in [0, 2**32), got {value!r}")
    return int(value)


def _validate(data, steps, batch_size, seed, counter, clients):
    if not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    steps = check_positive_int(steps, "steps", minimum=0)
    batch_size = check_positive_int(batch_size, "batch_size")
    seed, counter = _check_u32(seed, "seed"), _check_u32(counter, "counter")
    if data.num_rows >= 2**31:
        raise ValueError(f"data: int32 batch indices need N < 2**31 rows, got {data.num_rows}")
    m = data.num_clients
    if clients is None:
        clients_t = torch.arange(m, dtype=torch.int64, device=data.device)
    else:
        clients_t = index_tensor(clients, "clients", None, m, data.device)
    return steps, batch_size, seed, counter, clients_t


def sample_batches(data, *, steps, batch_size, seed, counter, clients=None):
    """``int32 [R, steps, batch_size]`` absolute row indices into ``data.x``, one batch per
    step for each client in ``clients`` (default: all m, R = m). The hash takes the global
    client id ``data.first_client + clients[r]``, so a shard draws what the whole federation
    draws for the same clients."""
    steps, B, seed, counter, clients_t = _validate(data, steps, batch_size, seed, counter, clients)
    name, module = backend.select("sample_batches", data.device)
    if name == "reference":
        return sample_batches_ref(data, steps=steps, batch_size=B, seed=seed, counter=counter,
                                  clients=clients_t)
    out = torch.empty(clients_t.numel(), steps, B, dtype=torch.int32)
    ids = clients_t + data.first_client if data.first_client else clients_t  # global ids (a shard's offset)
    module.sample_batches(cpu_numpy(data.offsets), cpu_numpy(clients_t), cpu_numpy(ids), steps,
                          B, seed, counter, cpu_numpy(out))
    return out


def _rotl(v: torch.Tensor, r: int) -> torch.Tensor:
    return ((v << r) | (v >> (32 - r))) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _murmur3_words(*words: torch.Tensor) -> torch.Tensor:
    """murmur3_32 (seed 0) of 32-bit words, in int64 tensors. Products of two 32-bit values
    wrap modulo 2**64 in int64, which leaves the low 32 bits exact."""
    h = torch.zeros_like(words[0])
    for k in words:
        k = (k * 0xCC9E2D51) & _M32
        k = _rotl(k, 15)
        k = (k * 0x1B873593) & _M32
        h = h ^ k
        h = _rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & _M32
    return _fmix32(h ^ (4 * len(words)))


def sample_batches_ref(data, *, steps, batch_size, seed, counter, clients=None):
    """Pure-torch reference of ``sample_batches`` (the same hash, vectorized)."""
    dev = data.device
    clients_t = torch.arange(data.num_clients, device=dev) if clients is None else torch.as_tensor(clients, device=dev)
    R = clients_t.numel()
    shape = (R, steps, batch_size)
    first = getattr(data, "first_client", 0)  # global id of local client 0 (a shard of a federation)
    cid = (clients_t.to(torch.int64) + first).view(R, 1, 1).expand(shape)
    s = torch.arange(steps, dtype=torch.int64, device=dev).view(1, steps, 1).expand(shape)
    j = torch.arange(batch_size, dtype=torch.int64, device=dev).view(1, 1, batch_size).expand(shape)
    const = lambda v: torch.full(shape, v, dtype=torch.int64, device=dev)  # noqa: E731
    h = _murmur3_words(const(seed), const(counter), cid & _M32, s, j)
    lo = data.offsets[clients_t].view(R, 1, 1)
    n = (data.offsets[clients_t + 1] - data.offsets[clients_t]).view(R, 1, 1)
    return (lo + ((h * n) >> 32)).to(torch.int32)
