"""average: the weighted mean P_H (DESIGN.md §4)."""
from __future__ import annotations

import pytest
import torch

from conftest import DTYPES
from pflcore import ops

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d", [(1, 1), (7, 13), (300, 1031)])
def test_average_matches_reference_and_definition(m, d, dtype):
    g = torch.Generator().manual_seed(m * d)
    theta = torch.randn(m, d, generator=g, dtype=dtype)
    w = torch.rand(m, generator=g, dtype=dtype) + 0.1
    got = ops.average(theta, w)
    # Both sum in float64 (the native kernel in row order, torch in BLAS order): float32
    # results round to the same value; float64 ones may differ in the last bits.
    torch.testing.assert_close(got, ops.average_ref(theta, w), rtol=1e-14, atol=1e-14)
    want = (w.double()[:, None] * theta.double()).sum(0) / w.double().sum()
    torch.testing.assert_close(got, want.to(dtype))
    rows = torch.tensor([m - 1, 0])
    sub = ops.average(theta, w, rows)
    want_sub = (w[rows, None].double() * theta[rows].double()).sum(0) / w[rows].double().sum()
    torch.testing.assert_close(sub, want_sub.to(dtype))
