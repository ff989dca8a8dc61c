"""sample_batches: the counter-based hash of DESIGN.md §4, identical in C++ and torch."""
from __future__ import annotations

import pytest
import torch

from conftest import make_data, make_model, random_sizes
from pflcore import ops
from pflcore.backends.reference import murmur3_words as _murmur3_words

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")


def _murmur3_bytes(data: bytes, seed: int = 0) -> int:
    """Textbook murmur3_x86_32, written independently of the library, for a known-answer check."""
    c1, c2, M = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for i in range(0, len(data) // 4 * 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * c1) & M
        k = ((k << 15) | (k >> 17)) & M
        k = (k * c2) & M
        h ^= k
        h = ((h << 13) | (h >> 19)) & M
        h = (h * 5 + 0xE6546B64) & M
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def test_hash_is_murmur3_of_the_five_keys():
    keys = [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (0xFFFFFFFF, 7, 123456, 99, 31), (42, 0xDEADBEEF, 1, 0, 0)]
    for ks in keys:
        want = _murmur3_bytes(b"".join(k.to_bytes(4, "little") for k in ks))
        got = int(_murmur3_words(*(torch.tensor([k], dtype=torch.int64) for k in ks))[0])
        assert got == want


def test_native_equals_reference_bitwise():
    model = make_model("softmax", 3, 2)
    data = make_data(model, random_sizes(37, seed=2, high=500), torch.float32)
    for seed, counter in [(0, 0), (5, 17), (2**32 - 1, 2**31 + 3)]:
        got = ops.sample_batches(data, steps=3, batch_size=7, seed=seed, counter=counter)
        want = ops.sample_batches_ref(data, steps=3, batch_size=7, seed=seed, counter=counter)
        assert got.dtype == torch.int32 and got.shape == (37, 3, 7)
        assert torch.equal(got, want)


def test_indices_stay_in_each_clients_rows_and_cover_them():
    model = make_model("logistic", 2, 1)
    sizes = torch.tensor([1, 2, 3, 50])
    data = make_data(model, sizes, torch.float64)
    b = ops.sample_batches(data, steps=40, batch_size=25, seed=3, counter=0).to(torch.int64)
    lo, hi = data.offsets[:-1].view(-1, 1, 1), data.offsets[1:].view(-1, 1, 1)
    assert bool(((b >= lo) & (b < hi)).all())
    assert bool((b[0] == 0).all())  # a client with one row always draws it
    counts = torch.bincount(b[3].reshape(-1) - 6, minlength=50).double()
    # 1,000 draws over 50 rows: expected 20 each; a chi-square with 49 dof stays far below 150.
    chi2 = float(((counts - 20) ** 2 / 20).sum())
    assert chi2 < 150, chi2


def test_draws_depend_on_client_id_not_on_sharding_or_the_other_clients():
    model = make_model("softmax", 3, 2)
    data = make_data(model, random_sizes(12, seed=5, high=90), torch.float32)
    full = ops.sample_batches(data, steps=2, batch_size=6, seed=1, counter=4)
    subset = torch.tensor([11, 3, 3, 0])
    part = ops.sample_batches(data, steps=2, batch_size=6, seed=1, counter=4, clients=subset)
    assert torch.equal(part, full[subset])
    other = ops.sample_batches(data, steps=2, batch_size=6, seed=1, counter=5)
    assert not torch.equal(other, full)
    other_seed = ops.sample_batches(data, steps=2, batch_size=6, seed=2, counter=4)
    assert not torch.equal(other_seed, full)
