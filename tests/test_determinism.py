"""Same seed and backend give bitwise-identical results for any thread count (DESIGN.md §7)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")

SCRIPT = r"""
import hashlib, torch
from pflcore import ClientData, models, ops
g = torch.Generator().manual_seed(0)
sizes = torch.randint(1, 300, (64,), generator=g)
off = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
N = int(off[-1])
x = torch.randn(N, 37, generator=g)
data = ClientData(x, torch.randint(0, 10, (N,), generator=g), off)
model = models.Softmax(37, 10, l2=0.01)
theta = 0.1 * torch.randn(64, model.d, generator=g)
h = hashlib.sha256()
b = ops.sample_batches(data, steps=3, batch_size=16, seed=4, counter=2)
ops.local_steps(model, theta, data, steps=3, lr=0.1, prox=0.2, anchor=theta.mean(0), batches=b)
ops.local_steps(model, theta, data, steps=2, lr=0.1)
for t in (b, theta, ops.gradients(model, theta, data), *ops.evaluate(model, theta, data)):
    h.update(t.numpy().tobytes())
km = ops.kmeans(theta, 5, seed=1)
h.update(km.centroids.numpy().tobytes()); h.update(km.labels.numpy().tobytes())
h.update(ops.average(theta, torch.rand(64, generator=g)).numpy().tobytes())
acc = ops.Anderson(memory=3)
u = torch.randn(20000, generator=g)
for _ in range(6):
    u = acc.step(u, 0.5 * u + 1.0)
h.update(u.numpy().tobytes())
print(h.hexdigest())
"""


def _digest(threads: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_bitwise_identical_with_one_and_two_threads():
    one, two = _digest(1), _digest(2)
    assert len(one) == 64 and one == two
