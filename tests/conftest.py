"""Shared fixtures: small random federations with odd shapes (DESIGN.md §7)."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's CPU interpreter (tests/test_triton.py).
# Triton fixes the mode when a kernel is decorated, i.e. when pflcore.triton is first
# imported, so it is set here, before any test can load that backend; with a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Subprocesses started by tests (`python -c`, `python -m`) must import the installed pflcore,
# never the source tree in their working directory: after a plain `pip install .` the checkout's
# pflcore/ has no compiled _core, and a child would silently test the reference fallback.
# Python >= 3.11 reads this and leaves the working directory off sys.path.
os.environ["PYTHONSAFEPATH"] = "1"

from pflcore import ClientData, backend, models  # noqa: E402

# Tolerances of a backend against <op>_ref. Both sides compute the same sums in a different
# order (the kernel in SIMD lanes, torch in BLAS), so the difference is rounding: at most about
# (number of terms) × (unit roundoff) relative to the size of the terms. With up to ~100 rows ×
# 61 features per sum and a few steps, float32 (u = 6e-8) stays below 1e-4 and float64
# (u = 1.1e-16) below 1e-11 for O(1) data; these bounds leave a margin of ~10×.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-11, atol=1e-11)}
DTYPES = [torch.float32, torch.float64]


def make_model(family: str, p: int, C: int, l2: float = 0.0, fit_intercept: bool = True):
    if family == "least_squares":
        return models.LeastSquares(p, l2=l2, fit_intercept=fit_intercept)
    if family == "logistic":
        return models.Logistic(p, l2=l2, fit_intercept=fit_intercept)
    return models.Softmax(p, C, l2=l2, fit_intercept=fit_intercept)


def make_data(model, sizes, dtype, seed=0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.as_tensor(sizes, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    N = int(offsets[-1])
    x = torch.randn(N, model.p, generator=g, dtype=dtype)
    if model.family == "least_squares":
        y = torch.randn(N, generator=g, dtype=dtype)
    else:
        y = torch.randint(0, model.num_classes, (N,), generator=g)
    return ClientData(x, y, offsets)


def random_sizes(m: int, seed: int = 0, high: int = 40):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(1, high, (m,), generator=g)


@pytest.fixture(autouse=True)
def _native_must_load():
    """The native backend is part of the build: a test run without it is a failure, not a skip."""
    ok, why = backend.status()["native"]
    assert ok, f"pflcore._core did not load: {why}"


# ---- CPU capability levels (DESIGN.md §9) --------------------------------------------------------
# A kernel test module opts in with `pytestmark = pytest.mark.usefixtures("cpu_level")`: its tests
# then run once per level this CPU supports (baseline, avx2, avx512), so every copy of the kernels
# is checked against the reference, not only the one the CPU would choose. Subprocesses started
# by such a test follow the level through PFLCORE_CPU_CAPABILITY. PFLCORE_TEST_LEVELS=in-use runs
# them at the level in use only (CI's extra runs: the main run has covered every level).
def _cpu_levels():
    core = backend.loaded("native")
    if os.environ.get("PFLCORE_TEST_LEVELS") == "in-use":
        return [core.cpu_capability()]
    return core.cpu_capabilities_supported()


@pytest.fixture(params=_cpu_levels())
def cpu_level(request, monkeypatch):
    core = backend.loaded("native")
    before = core.cpu_capability()
    core.set_cpu_capability(request.param)
    monkeypatch.setenv("PFLCORE_CPU_CAPABILITY", request.param)
    yield request.param
    core.set_cpu_capability(before)
