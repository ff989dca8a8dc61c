"""pflcore._sampling.randperm_prefix: the first k of torch.randperm(n, seeded) in O(k), bitwise
torch's (the clients a round samples, and every run's history, depend on it)."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from pflcore import backend
from pflcore._sampling import randperm_prefix


def _torch(n, k, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


def _cases():
    rng = random.Random(5)
    fixed = [(1, 1, 0), (1, 0, 3), (2, 2, 1), (10, 3, 1), (50, 50, 7), (1000, 999, 2 ** 40 + 5),
             (100_000, 1000, 123456789012345), (100_000, 20, 2 ** 63 - 1), (4097, 512, 11), (4096, 513, 12)]
    drawn = []
    for _ in range(200):
        n = rng.randint(1, 30_000)
        drawn.append((n, rng.choice([rng.randint(0, n), rng.randint(0, max(1, n // 50))]), rng.getrandbits(63)))
    return fixed + drawn


def test_equals_torch_randperm_on_sparse_and_dense_draws():
    if not hasattr(backend.loaded("native") or object(), "randperm_prefix"):
        pytest.skip("the native module is not built: randperm_prefix is torch.randperm itself")
    for n, k, seed in _cases():
        got = randperm_prefix(n, k, seed)
        assert got.dtype == torch.int64 and got.shape == (k,)
        assert torch.equal(got, _torch(n, k, seed)), (n, k, seed)


def test_without_the_native_module_it_is_torch_randperm(monkeypatch):
    monkeypatch.setattr(backend, "loaded", lambda name: None)
    for n, k, seed in _cases()[:20]:
        assert torch.equal(randperm_prefix(n, k, seed), _torch(n, k, seed))


def test_bad_k_is_a_value_error():
    with pytest.raises(ValueError, match="0 <= k <= n, got k = 5, n = 4"):
        randperm_prefix(4, 5, 0)
    with pytest.raises(ValueError, match="got k = -1"):
        randperm_prefix(4, -1, 0)


def test_the_module_refuses_what_it_cannot_draw_in_a_subprocess():
    """The binding's own checks (n out of its range, k > n, a null output): a ValueError, never a
    crash (run in a subprocess: a crash would end this test, not the suite)."""
    code = ("import pflcore._core as c\n"
            "for args in [(0, 0, 1, 0), (2 ** 31, 1, 1, 0), (5, 6, 1, 0), (5, 2, 1, 0)]:\n"
            "    try:\n"
            "        c.randperm_prefix(*args)\n"
            "    except ValueError as e:\n"
            "        print('ValueError', e)\n")
    if backend.loaded("native") is None:
        pytest.skip("the native module is not built")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ValueError") == 4 and "randperm_prefix" in r.stdout
