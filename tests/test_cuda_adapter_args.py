"""What the CUDA adapter hands pflcore._core_cuda, checked without a GPU (DESIGN.md §8): a
stand-in module records every call, ``ptr`` gives each tensor back under its argument name, and
the adapter runs on CPU tensors. One launch per call (evaluate on minibatches too), a shared
model [d] passed as it is (row stride 0, no [R, d] copy), scratch from torch sized by the
module, values checked before any launch. tests/gpu/test_cuda_scale.py runs the real kernels."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from conftest import make_data, make_model
from pflcore import backend, ops
from pflcore.backends import _values
from pflcore.backends import cuda as _cuda


class _Ptr:
    """What the stand-in module gets for a tensor: its name and the tensor itself."""

    def __init__(self, t, name):
        self.t, self.name = t, name


class _Module:
    """A stand-in for pflcore._core_cuda that records its calls."""

    def __init__(self, scratch_rows=0):
        self.calls = []
        self.screens = []  # (launches before it, args) of each glm_screen call
        self.screen_result = 1  # flag every call: the exact checks decide, on CPU tensors
        self.average_result = 1  # average_fused's flag
        self.fused_result = 0  # local_steps_screened's flag
        self.scratch_rows_asked = 0
        self._scratch_rows = scratch_rows

    def __getattr__(self, op):
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda *args: self.calls.append((op, args))

    def glm_scratch_rows(self, family, p, C, intercept, dtype):
        self.scratch_rows_asked += 1
        return self._scratch_rows

    def glm_screen(self, *args):
        self.screens.append((len(self.calls), args))
        return self.screen_result

    def kmeans_update_scratch(self, N, K, d):
        return 1000 * N + 10 * K + d

    def anderson_scratch(self, D, k):
        return 100 * D + k

    def gram_scratch(self, D, k):
        return 10 * D + k

    def average_scratch(self, R, d):
        return 7 * R + d

    def local_steps_screened(self, *args):
        self.calls.append(("local_steps_screened", args))
        return self.fused_result

    def average_fused_scratch(self, R, d):
        return 11 * R + d

    def average_fused(self, *args):
        self.calls.append(("average_fused", args))
        return self.average_result

    def build_info(self):
        return {"max_classes": (2048, 1024), "architectures": "80,90", "cuda_runtime_version": 13000}


@pytest.fixture
def adapter(monkeypatch):
    """The cuda adapter on CPU tensors with a recording stand-in module."""
    a = _cuda.CudaAdapter()
    mod = _Module()
    monkeypatch.setattr(a, "_state", (mod, ""))
    monkeypatch.setattr(_cuda, "ptr", lambda t, name, device, dtype=None: None if t is None else _Ptr(t, name))
    monkeypatch.setattr(_cuda, "stream", lambda t: 0)
    monkeypatch.setattr(_cuda, "on_device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(_values, "one_per_row", lambda *a: pytest.fail("one_per_row copies a shared model"))
    return a


# evaluate / gradients after glm_args' 11 leading arguments (family .. R)
_EVAL = ["theta_shared", "batches", "B", "loss_sum", "correct", "count", "dtype", "stream"]
_GRAD = ["theta_shared", "batches", "B", "out", "dtype", "stream"]
_LEAD = ["family", "p", "C", "intercept", "l2", "theta", "x", "y", "offsets", "rows", "R"]


def _named(args, names):
    assert len(args) == len(names), (len(args), names)
    return dict(zip(names, args))


def _glm(dtype=torch.float64, sizes=(3, 5, 2)):
    model = make_model("softmax", 4, 3, l2=0.1)
    return model, make_data(model, list(sizes), dtype, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_evaluate_on_batches_is_one_launch_with_the_batches(adapter, dtype):
    model, data = _glm(dtype)
    rows = torch.tensor([2, 0, 2, 1])
    theta = torch.randn(4, model.d, dtype=dtype)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=6, seed=0, counter=0, clients=rows).reshape(4, 6)
    loss, correct, count = adapter.evaluate(model, theta, data, rows, batches)
    assert [c[0] for c in adapter.module.calls] == ["evaluate"]
    a = _named(adapter.module.calls[0][1], _LEAD + _EVAL)
    assert a["theta"].t is theta and a["rows"].t is rows and a["R"] == 4
    assert a["theta_shared"] is False
    assert a["batches"].t is batches and a["B"] == 6
    assert a["loss_sum"].t is loss and a["correct"].t is correct and a["count"].t is count
    assert loss.shape == (4,) and loss.dtype == dtype and correct.dtype == count.dtype == torch.int64
    assert a["dtype"] == str(dtype).replace("torch.", "")


def test_evaluate_without_batches_passes_none(adapter):
    model, data = _glm()
    adapter.evaluate(model, torch.zeros(3, model.d, dtype=torch.float64), data, None)
    a = _named(adapter.module.calls[0][1], _LEAD + _EVAL)
    assert a["batches"] is None and a["B"] == 0 and a["R"] == 3
    assert a["rows"] is None  # a null address: the kernel takes model row r as client r


@pytest.mark.parametrize("rows", [None, torch.tensor([1, 1, 0, 2, 0])])
def test_a_shared_model_goes_to_the_kernels_as_it_is(adapter, rows):
    """theta [d] with theta_shared: R comes from rows (or the clients), the outputs have R rows,
    and no [R, d] copy is made (one_per_row fails this test if called)."""
    model, data = _glm()
    theta = torch.randn(model.d, dtype=torch.float64)
    R = 3 if rows is None else rows.numel()
    out = adapter.gradients(model, theta, data, rows, None)
    loss, _, _ = adapter.evaluate(model, theta, data, rows, None)
    (op_g, args_g), (op_e, args_e) = adapter.module.calls
    g, e = _named(args_g, _LEAD + _GRAD), _named(args_e, _LEAD + _EVAL)
    assert (op_g, op_e) == ("gradients", "evaluate")
    for a in (g, e):
        assert a["theta"].t is theta and a["theta_shared"] is True and a["R"] == R
    assert g["out"].t is out and out.shape == (R, model.d)
    assert loss.shape == (R,)


def test_bad_batches_are_refused_before_a_launch(adapter):
    """The evaluate kernel reads x at the batch indices: one outside the row's client is a
    ValueError naming it, and nothing is launched."""
    model, data = _glm()
    batches = torch.tensor([[0, 1], [3, 9], [8, 9]], dtype=torch.int32)  # row 1 (client 1: rows 3..7) has 9
    with pytest.raises(ValueError, match="batches"):
        adapter.evaluate(model, torch.zeros(3, model.d, dtype=torch.float64), data, None, batches)
    assert adapter.module.calls == []


@pytest.mark.parametrize("rows_needed,R,expect", [(0, 3, 0), (7, 3, 3), (2, 3, 2)])
def test_local_steps_scratch_is_sized_by_the_module(adapter, monkeypatch, rows_needed, R, expect):
    """G's scratch: min(R, glm_scratch_rows) rows of d values from torch, none when the
    parameters fit shared memory; the module is asked once per shape (the separate screen's
    path: local_steps' own arguments)."""
    monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "separate")
    adapter.module._scratch_rows = rows_needed
    model, data = _glm(sizes=(2, 2, 2))
    theta = torch.zeros(R, model.d, dtype=torch.float64)
    for _ in range(2):
        adapter.local_steps(model, theta, data, None, None, None, None, 2, 0.1, 0.0)
    assert adapter.module.scratch_rows_asked == 1
    names = _LEAD + ["batches", "B", "anchor", "anchor_shared", "grad_scale", "steps", "lr", "prox", "scratch",
                     "scratch_rows", "dtype", "stream"]
    a = _named(adapter.module.calls[-1][1], names)
    assert a["scratch_rows"] == expect and (a["steps"], a["lr"], a["prox"]) == (2, 0.1, 0.0)
    if expect:
        assert a["scratch"].t.numel() == expect * model.d and a["scratch"].t.dtype == torch.float64
    else:
        assert a["scratch"] is None


_SCREEN = ["theta", "n_theta", "anchor", "n_anchor", "grad_scale", "n_grad_scale", "x", "y", "classifier",
           "num_classes", "N", "p", "offsets", "m", "rows", "R", "batches", "n_batches", "flag", "dtype", "stream"]


@pytest.mark.parametrize("family", ["softmax", "logistic", "least_squares"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_untrusted_glm_call_is_one_screen_call_before_its_launch(adapter, monkeypatch, family, dtype):
    """The module's glm_screen, once per call and before the launch, with every tensor by its
    name and size; a clean screen (0) runs no exact pass, a trusted call no screen at all.
    PFLCORE_CUDA_SCREEN=separate: local_steps screens in its own module call too (by default its
    screen and steps are one call: the next test)."""
    monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "separate")
    monkeypatch.setattr(_values, "glm_fault", lambda *a: pytest.fail("the torch screen ran"))
    monkeypatch.setattr(_cuda._faults, "glm_fault", lambda *a: pytest.fail("the exact pass ran on a clean screen"))
    adapter.module.screen_result = 0
    model = make_model(family, 4, 3, l2=0.1)
    data = make_data(model, [3, 5, 2], dtype, seed=1)
    rows = torch.tensor([2, 0, 2, 1])
    theta = torch.randn(4, model.d, dtype=dtype)
    anchor, gs = torch.randn(model.d, dtype=dtype), torch.rand(4, dtype=dtype)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=3, seed=0, counter=0, clients=rows)
    adapter.local_steps(model, theta, data, rows, batches, anchor, gs, 2, 0.1, 0.0)
    adapter.gradients(model, theta, data, None, None)
    adapter.evaluate(model, theta, data, rows, batches[:, 0].contiguous(), trusted=True)
    assert [c[0] for c in adapter.module.calls] == ["local_steps", "gradients", "evaluate"]
    assert [before for before, _ in adapter.module.screens] == [0, 1]  # each before its own launch
    a = _named(adapter.module.screens[0][1], _SCREEN)
    assert a["theta"].t is theta and a["n_theta"] == theta.numel()
    assert a["anchor"].t is anchor and a["n_anchor"] == model.d and a["grad_scale"].t is gs and a["n_grad_scale"] == 4
    assert a["x"].t is data.x and a["y"].t is data.y and (a["N"], a["p"]) == (10, 4)
    assert a["classifier"] is model.is_classifier
    assert a["num_classes"] == (model.num_classes if model.is_classifier else 0)
    assert a["offsets"].t is data.offsets and a["m"] == 3
    assert a["rows"].t is rows and a["R"] == 4 and a["batches"].t is batches and a["n_batches"] == 24
    assert a["flag"].t.dtype == torch.int32 and a["flag"].t.numel() == 1
    assert a["dtype"] == str(dtype).replace("torch.", "")
    g = _named(adapter.module.screens[1][1], _SCREEN)
    assert g["rows"] is None and g["R"] == 3 and g["batches"] is None and g["n_batches"] == 0
    assert g["anchor"] is None and g["n_anchor"] == 0 and g["grad_scale"] is None


_FUSED = _LEAD + ["batches", "B", "anchor", "anchor_shared", "grad_scale", "steps", "lr", "prox", "scratch",
                  "scratch_rows", "n_theta", "n_anchor", "n_grad_scale", "num_classes", "N", "m", "n_batches", "flag",
                  "dtype", "stream"]


@pytest.mark.parametrize("flagged", [False, True])
@pytest.mark.parametrize("env", [None, "fused"])
def test_fused_screen_is_one_call_and_a_flag_runs_the_exact_checks(adapter, monkeypatch, flagged, env):
    """By default (and with PFLCORE_CUDA_SCREEN=fused, the name it had when opt-in) an untrusted
    local_steps is one local_steps_screened call (no glm_screen, no separate launch) with the rows
    as a null address and every size the screen needs; a raised flag (theta untouched) runs the
    exact checks, and after a false alarm the steps run unscreened."""
    if env is None:
        monkeypatch.delenv("PFLCORE_CUDA_SCREEN", raising=False)
    else:
        monkeypatch.setenv("PFLCORE_CUDA_SCREEN", env)
    exact = []
    monkeypatch.setattr(_cuda._faults, "glm_fault", lambda *a: exact.append(a))
    adapter.module.fused_result = int(flagged)
    model = make_model("softmax", 4, 3, l2=0.1)
    data = make_data(model, [3, 5, 2], torch.float32, seed=1)
    theta = torch.randn(3, model.d)
    anchor = torch.randn(3, model.d)
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=2, batch_size=3, seed=0, counter=0)
    adapter.local_steps(model, theta, data, None, batches, anchor, None, 2, 0.1, 0.3)
    ops_called = [c[0] for c in adapter.module.calls]
    assert adapter.module.screens == []
    assert ops_called == (["local_steps_screened", "local_steps"] if flagged else ["local_steps_screened"])
    assert len(exact) == int(flagged)
    a = _named(adapter.module.calls[0][1], _FUSED)
    assert a["theta"].t is theta and a["rows"] is None and a["R"] == 3
    assert a["batches"].t is batches and a["B"] == 3 and a["n_batches"] == batches.numel()
    assert a["anchor"].t is anchor and a["anchor_shared"] is False and a["n_anchor"] == anchor.numel()
    assert a["grad_scale"] is None and a["n_grad_scale"] == 0
    assert (a["steps"], a["lr"], a["prox"]) == (2, 0.1, 0.3)
    assert (a["n_theta"], a["num_classes"], a["N"], a["m"]) == (theta.numel(), 3, 10, 3)
    assert a["flag"].t.dtype == torch.int32 and a["flag"].t.numel() == 1
    # gradients and evaluate keep the module's screen
    adapter.gradients(model, theta, data, None, None)
    assert len(adapter.module.screens) == 1


def test_the_torch_screen_on_request_or_without_glm_screen(adapter, monkeypatch):
    """PFLCORE_CUDA_SCREEN=torch, or a module built before glm_screen: _values.glm_fault."""
    seen = []
    monkeypatch.setattr(_values, "glm_fault", lambda *a: seen.append(a))
    model, data = _glm()
    theta = torch.zeros(3, model.d, dtype=torch.float64)
    monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "torch")
    adapter.gradients(model, theta, data, None, None)
    assert len(seen) == 1 and adapter.module.screens == []
    monkeypatch.delenv("PFLCORE_CUDA_SCREEN")
    old = _OldModule()
    monkeypatch.setattr(adapter, "_state", (old, ""))
    adapter.gradients(model, theta, data, None, None)
    assert len(seen) == 2 and [c[0] for c in old.calls] == ["gradients"]


class _OldModule(_Module):
    """A module built before glm_screen."""

    def __getattribute__(self, op):
        if op == "glm_screen":
            raise AttributeError(op)
        return super().__getattribute__(op)

    def __getattr__(self, op):
        if op == "glm_screen":
            raise AttributeError(op)
        return super().__getattr__(op)


def test_kmeans_update_and_anderson_take_scratch_of_the_size_the_module_says(adapter):
    points = torch.randn(7, 3, dtype=torch.float32)
    labels = torch.tensor([0, 1, 1, 0, 1, 1, 0])
    wsum = adapter.kmeans_update(points, labels, None, torch.zeros(2, 3))
    op, args = adapter.module.calls[-1]
    assert op == "kmeans_update" and wsum.shape == (2,)
    N, K, d, buf = args[6], args[7], args[8], args[9]
    assert (N, K, d) == (7, 2, 3) and buf.name == "scratch"
    assert buf.t.dtype == torch.float64 and buf.t.numel() == 1000 * 7 + 10 * 2 + 3
    R_hist = torch.zeros(3, 5)
    adapter.anderson_push(torch.zeros(5), torch.ones(5), R_hist, R_hist.clone(), 0, [0, 2])
    op, args = adapter.module.calls[-1]
    assert op == "anderson_push" and args[9].t.numel() == 100 * 5 + 2
    adapter.gram(torch.zeros(4, 9))
    op, args = adapter.module.calls[-1]
    assert op == "gram" and args[4].t.numel() == 10 * 9 + 4


_AVERAGE = ["theta", "weights", "rows", "M", "d", "R", "wsum", "out", "scratch", "dtype", "stream"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [None, torch.tensor([2, 0, 2, 4])])
def test_average_is_one_launch_with_the_weight_sum_and_scratch(adapter, monkeypatch, dtype, rows):
    """PFLCORE_CUDA_AVERAGE=torch (the torch screen around the kernels): theta and weights as they
    are, rows (a clamped copy: the kernel never sees an index out of range), R, the float64 sum of
    the selected weights as the divisor, the output [d] of theta's dtype and scratch sized by the
    module."""
    monkeypatch.setenv("PFLCORE_CUDA_AVERAGE", "torch")
    theta = torch.randn(5, 3, dtype=dtype)
    w = torch.rand(5, dtype=dtype) + 0.1
    out = adapter.average(theta, w, rows)
    ((op, args),) = adapter.module.calls
    a = _named(args, _AVERAGE)
    R = 5 if rows is None else 4
    assert op == "average" and (a["M"], a["d"], a["R"]) == (5, 3, R)
    assert a["theta"].t is theta and a["weights"].t is w
    if rows is None:
        assert a["rows"] is None
    else:
        assert torch.equal(a["rows"].t, rows) and a["rows"].t.dtype == torch.int64
    sel = w if rows is None else w[rows]
    assert a["wsum"].t.dtype == torch.float64 and a["wsum"].t.dim() == 0
    assert float(a["wsum"].t) == float(sel.to(torch.float64).sum())
    assert a["out"].t is out and out.shape == (3,) and out.dtype == dtype
    assert a["scratch"].t.dtype == torch.float64 and a["scratch"].t.numel() == 7 * R + 3
    assert a["dtype"] == str(dtype).replace("torch.", "")


def test_average_faults_are_the_reference_ones(adapter, monkeypatch):
    """PFLCORE_CUDA_AVERAGE=torch: bad rows and weights raise the reference's errors; no rows never
    launches. The stand-in writes no mean: ``out`` holds whatever torch.empty gave, so only faults
    found before the output matters are checked here (tests/gpu runs the NaN in theta)."""
    monkeypatch.setenv("PFLCORE_CUDA_AVERAGE", "torch")
    theta = torch.randn(4, 3)
    w = torch.ones(4)
    with pytest.raises(ValueError, match=r"rows: expected indices in \[0, 4\), got rows\[1\] = 4"):
        adapter.average(theta, w, torch.tensor([0, 4]))
    # the launch got the rows clamped into range
    assert torch.equal(_named(adapter.module.calls[-1][1], _AVERAGE)["rows"].t, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"weights: expected finite weights >= 0, got weights\[2\] = -1"):
        adapter.average(theta, torch.tensor([1.0, 1.0, -1.0, 1.0]), None)
    with pytest.raises(ValueError, match="sum to 0"):
        adapter.average(theta, torch.zeros(4), None)
    n = len(adapter.module.calls)
    with pytest.raises(ValueError, match="sum to 0"):
        adapter.average(theta, w, torch.zeros(0, dtype=torch.int64))
    assert len(adapter.module.calls) == n  # no rows: nothing launched


_AVERAGE_FUSED = ["theta", "weights", "rows", "M", "d", "R", "out", "scratch", "flag", "dtype", "stream"]


@pytest.mark.parametrize("rows", [None, torch.tensor([2, 0, 2, 7])])
@pytest.mark.parametrize("env", [None, "fused"])
def test_fused_average_is_one_call_with_the_raw_rows_and_its_flag(adapter, monkeypatch, rows, env):
    """By default (and with PFLCORE_CUDA_AVERAGE=fused, its opt-in name): one average_fused call (no torch screen before it) with the
    rows as the caller gave them (the kernel clamps and flags them), scratch sized by the module,
    an int32 flag; a raised flag runs the exact checks (an index out of range raises the reference's
    error), a clear one returns the output as it is."""
    if env is None:
        monkeypatch.delenv("PFLCORE_CUDA_AVERAGE", raising=False)
    else:
        monkeypatch.setenv("PFLCORE_CUDA_AVERAGE", env)
    monkeypatch.setattr(_values, "average_screen", lambda *a: pytest.fail("the torch screen ran"))
    theta = torch.randn(5, 3)
    w = torch.rand(5) + 0.1
    adapter.module.average_result = 0
    if rows is None:
        out = adapter.average(theta, w, rows)
    else:
        adapter.module.average_result = 1
        with pytest.raises(ValueError, match=r"rows: expected indices in \[0, 5\), got rows\[3\] = 7"):
            adapter.average(theta, w, rows)
    ((op, args),) = adapter.module.calls
    a = _named(args, _AVERAGE_FUSED)
    R = 5 if rows is None else 4
    assert op == "average_fused" and (a["M"], a["d"], a["R"]) == (5, 3, R)
    assert a["theta"].t is theta and a["weights"].t is w
    assert (a["rows"] is None) if rows is None else (a["rows"].t is rows)
    assert a["scratch"].t.dtype == torch.float64 and a["scratch"].t.numel() == 11 * R + 3
    assert a["flag"].t.dtype == torch.int32 and a["flag"].t.numel() == 1
    if rows is None:
        assert a["out"].t is out and out.shape == (3,)


def test_fused_average_without_rows_launches_nothing(adapter, monkeypatch):
    monkeypatch.delenv("PFLCORE_CUDA_AVERAGE", raising=False)
    with pytest.raises(ValueError, match="sum to 0"):
        adapter.average(torch.randn(4, 3), torch.ones(4), torch.zeros(0, dtype=torch.int64))
    assert adapter.module.calls == []


class _Alive:
    """A stand-in for a device address that does not keep its tensor alive: the module checks at
    the launch that the tensor still exists (only its address travels, so a temporary freed
    before the launch would be read after its memory went back to the allocator)."""

    def __init__(self, t, name):
        import weakref
        self.ref, self.name = weakref.ref(t), name


def test_every_tensor_handed_to_the_module_is_alive_at_the_launch(monkeypatch):
    import gc
    a = _cuda.CudaAdapter()
    dead = []

    class _Checking(_Module):
        def __getattr__(self, op):
            if op.startswith("_"):
                raise AttributeError(op)

            def call(*args):
                gc.collect()
                dead.extend(f"{op}: {x.name}" for x in args if isinstance(x, _Alive) and x.ref() is None)
            return call

    monkeypatch.setattr(a, "_state", (_Checking(), ""))
    monkeypatch.setattr(_cuda, "ptr", lambda t, name, device, dtype=None: None if t is None else _Alive(t, name))
    monkeypatch.setattr(_cuda, "stream", lambda t: 0)
    monkeypatch.setattr(_cuda, "on_device", lambda dev: contextlib.nullcontext())
    model, data = _glm(torch.float32)
    theta = torch.zeros(3, model.d)
    a.local_steps(model, theta, data, None, None, None, None, 2, 0.1, 0.0)
    a.local_steps(model, theta, data, torch.tensor([2, 0]), None, None, None, 2, 0.1, 0.0, trusted=True)
    a.gradients(model, theta, data, None, None)
    a.evaluate(model, theta, data, None)
    a.evaluate(model, theta[0], data, None)  # a shared model
    a.sample_batches(data, None, 2, 3, 0, 0)
    a.average(theta, torch.ones(3), None)
    assert not dead, f"freed before the kernel could read them: {dead}"


def test_the_screen_flag_is_one_per_thread_and_device_and_reused(adapter):
    """The GLM screens' int32 flag: the same tensor on every call of a thread (the module zeroes it
    before each screen and reads it back before returning), another one in another thread."""
    import threading
    model, data = _glm(torch.float32)
    theta = torch.zeros(3, model.d)
    adapter.module.fused_result = 0
    flags = []

    def two_calls():
        for _ in range(2):
            adapter.local_steps(model, theta, data, None, None, None, None, 1, 0.1, 0.0)
            flags.append(_named(adapter.module.calls[-1][1], _FUSED)["flag"].t)

    two_calls()
    t = threading.Thread(target=two_calls)
    t.start()
    t.join()
    assert len(flags) == 4 and flags[0] is flags[1] and flags[2] is flags[3] and flags[0] is not flags[2]
    assert all(f.dtype == torch.int32 and f.numel() == 1 for f in flags)
