"""PFLCORE_NETS_TF32=0 (issue 25, item 3): the nets' convolutions and matrix products run with
TF32 off inside each nets call, and the caller's torch settings are back after it; unset, the
caller's settings apply. Checked on the CPU by reading torch's flags from inside the call."""
from __future__ import annotations

import pytest
import torch

from pflcore import ClientData, models, ops
from pflcore.backends import _precision, nets


def _fed(p=36, m=3, n=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m * n, p, generator=g)
    return ClientData(x, torch.randint(0, 3, (m * n,), generator=g), torch.arange(0, m * n + 1, n))


def _flags():
    return {name: obj.fp32_precision for name, obj in _precision._precision_flags()} or \
        {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32}


@pytest.fixture
def seen_inside(monkeypatch):
    """Records torch's float32 precision flags from inside the nets' computation."""
    seen = []
    for name in ("gradients", "evaluate", "local_steps"):
        orig = getattr(nets, name)

        def spy(*a, _orig=orig, **k):
            seen.append(_flags())
            return _orig(*a, **k)

        monkeypatch.setattr(nets, name, spy)
    return seen


@pytest.fixture
def tf32_allowed():
    """The caller's settings: TF32 allowed for cuDNN convolutions (torch's default) and for
    CUDA matrix products (what ``torch.set_float32_matmul_precision("high")`` does)."""
    flags = _precision._precision_flags()
    before = [(o, o.fp32_precision) for _, o in flags]
    for name, o in flags:
        if name.startswith("cud"):
            o.fp32_precision = "tf32"
    yield _flags()
    for o, v in before:
        o.fp32_precision = v


def _calls(model, data):
    theta = torch.zeros(3, model.d) + 0.01
    return [lambda: ops.gradients(model, theta, data), lambda: ops.evaluate(model, theta, data),
            lambda: ops.local_steps(model, theta.clone(), data, steps=1, lr=0.1)]


def test_full_float32_inside_the_call_and_restored_after(monkeypatch, seen_inside, tf32_allowed):
    model, data = models.CNN(36, 3, channels=(2,), kernel_size=3, padding=1, hidden=()), _fed()
    monkeypatch.setenv("PFLCORE_NETS_TF32", "0")
    results = [call() for call in _calls(model, data)]
    assert len(seen_inside) == 3
    for flags in seen_inside:
        assert set(flags.values()) <= {"ieee", False} and len(flags) >= 2, flags
    assert _flags() == tf32_allowed and "tf32" in tf32_allowed.values()  # the caller's settings are back
    # unset: the caller's settings apply inside, and on the CPU the results are the same bits
    monkeypatch.delenv("PFLCORE_NETS_TF32")
    seen_inside.clear()
    again = [call() for call in _calls(model, data)]
    assert seen_inside == [tf32_allowed] * 3
    assert torch.equal(results[0], again[0]) and torch.equal(results[1][0], again[1][0])


def test_restored_when_the_call_raises(monkeypatch, tf32_allowed):
    model, data = models.MLP(36, 4, 3), _fed()
    monkeypatch.setenv("PFLCORE_NETS_TF32", "0")
    theta = torch.zeros(3, model.d)
    theta[1, 0] = float("nan")
    with pytest.raises(ValueError, match="theta: row 1"):
        ops.gradients(model, theta, data)
    assert _flags() == tf32_allowed


def test_a_bad_value_is_named(monkeypatch):
    model, data = models.MLP(36, 4, 3), _fed()
    monkeypatch.setenv("PFLCORE_NETS_TF32", "off")
    with pytest.raises(ValueError, match=r"^PFLCORE_NETS_TF32: expected '0' .* got 'off'$"):
        ops.gradients(model, torch.zeros(3, model.d), data)
