"""The GPU adapters' value pre-pass reads the device at most once per op call, and not at all
for a trusted call (issue 25, item 1): every host read of a device tensor is a synchronization
that stalls the GPU's queue.

Counted: what the adapters' own Python code reads (``.item()``, ``bool()``, ``int()``,
``float()``, ``index()`` of a tensor, ``.tolist()``, ``.numpy()``, ``nonzero``, ``.cpu()``),
patched on torch.Tensor during the call. The Triton adapter runs with its kernel module
replaced by a recording stand-in (the interpreter's launches read tensors themselves, and on a
GPU they would not); the CUDA adapter's kernels need a CUDA device, so for it the ``_values``
functions it calls are counted on CPU tensors, and its ``trusted`` path up to the launch."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

from pflcore import ClientData, models
from pflcore.backends import _faults, _values
from pflcore.backends.cuda import CudaAdapter
from pflcore.backends.triton import TritonAdapter
from pflcore.errors import NonFiniteError

_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "nonzero", "cpu")


class Reads(list):
    """The names of the host reads seen; none are recorded while ``paused`` (a kernel runs)."""

    paused = False

    def add(self, name):
        if not self.paused:
            self.append(name)


@contextlib.contextmanager
def host_reads(monkeypatch):
    """Yields a Reads that receives the name of every host read made inside the block."""
    seen = Reads()
    with monkeypatch.context() as mp:
        for name in _READS:
            orig = getattr(torch.Tensor, name)

            def counted(self, *a, _orig=orig, _name=name, **k):
                seen.add(_name)
                return _orig(self, *a, **k)

            mp.setattr(torch.Tensor, name, counted)
        orig_nonzero = torch.nonzero
        mp.setattr(torch, "nonzero", lambda *a, **k: seen.add("torch.nonzero") or orig_nonzero(*a, **k))
        yield seen


def test_the_counter_sees_each_kind_of_read(monkeypatch):
    t = torch.tensor([1.0, 0.0])
    with host_reads(monkeypatch) as seen:
        bool(t[0]), int(t[0]), float(t[0]), t[0].item(), t.tolist(), t.cpu(), torch.nonzero(t), t.nonzero()
        list(range(10))[torch.tensor(1)]
    assert seen == ["__bool__", "__int__", "__float__", "item", "tolist", "cpu", "torch.nonzero", "nonzero",
                    "__index__"]


class Recorder:
    """Stands in for pflcore.triton: records each kernel call, computes nothing."""

    INTERPRETED = True

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def _fed(dtype=torch.float32, m=3, n=6, p=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m * n, p, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (m * n,), generator=g)
    return ClientData(x, y, torch.arange(0, m * n + 1, n))


def _triton_cases():
    model = models.Softmax(4, 3)
    data = _fed()
    m, d = 3, model.d
    theta = torch.zeros(m, d)
    rows = torch.tensor([2, 0, 1])
    batches = (torch.randint(0, 6, (m, 2, 3)) + data.offsets[rows].view(m, 1, 1)).to(torch.int32)
    anchor, scale = torch.zeros(d), torch.ones(m)
    pts, cen = torch.randn(20, 5), torch.randn(4, 5)
    hist = torch.randn(3, 5)
    return model, {
        "local_steps": lambda a, tr: a.local_steps(model, theta, data, rows, batches, anchor, scale, 2, 0.1, 0.0, tr),
        "gradients": lambda a, tr: a.gradients(model, theta, data, rows, batches[:, 0], tr),
        "evaluate": lambda a, tr: a.evaluate(model, theta[0], data, None, None, tr),
        "kmeans_assign": lambda a, tr: a.kmeans_assign(pts, cen),
        "kmeans_update": lambda a, tr: a.kmeans_update(pts, torch.randint(0, 4, (20,)), torch.rand(20), cen.clone()),
        "anderson_push": lambda a, tr: a.anderson_push(hist[0], hist[1], hist.clone(), hist.clone(), 1, [0, 1]),
        "anderson_mix": lambda a, tr: a.anderson_mix(hist, [0, 2], torch.tensor([0.5, 0.5], dtype=torch.float64)),
        "gram": lambda a, tr: a.gram(hist),
    }


def _triton_adapter():
    adapter = TritonAdapter()
    adapter._state = (Recorder(), "recording stand-in")
    return adapter


def test_every_triton_op_reads_the_host_at_most_once(monkeypatch):
    _, cases = _triton_cases()
    assert set(cases) == set(TritonAdapter.ops())  # a new op needs a case here
    for op, call in cases.items():
        adapter = _triton_adapter()
        with host_reads(monkeypatch) as seen:
            call(adapter, False)
        assert len(seen) <= 1, f"{op}: {seen}"
        assert adapter.module.calls, f"{op}: no kernel was launched"


class Paused:
    """The real pflcore.triton, its kernels run with the count paused: what the interpreter
    reads while it runs a kernel is no read of the adapter's (on a GPU there is none)."""

    def __init__(self, module, seen):
        self.module, self.seen, self.INTERPRETED = module, seen, module.INTERPRETED

    def __getattr__(self, name):
        kernel = getattr(self.module, name)

        def run(*a, **k):
            self.seen.paused = True
            try:
                return kernel(*a, **k)
            finally:
                self.seen.paused = False
        return run


def test_triton_ops_under_the_interpreter_read_the_host_at_most_once(monkeypatch):
    """The same count with the real kernels (TRITON_INTERPRET=1, CPU tensors), whose results
    must match the reference adapter's: the screen let them run and they ran."""
    pytest.importorskip("triton")
    from pflcore import backend

    real = backend.adapter("triton")
    if real.module is None or not real.module.INTERPRETED:
        pytest.skip("the Triton backend is not under TRITON_INTERPRET=1 here (a GPU machine: tests/gpu covers it)")
    ref = backend.adapter("reference")
    model, data = models.Softmax(4, 3), _fed()
    theta = torch.randn(3, model.d, generator=torch.Generator().manual_seed(2)) * 0.1
    rows = torch.tensor([2, 0, 1])
    b = (torch.randint(0, 6, (3, 3)) + data.offsets[rows].view(3, 1)).to(torch.int32)
    for trusted in (False, True):
        adapter = TritonAdapter()
        with host_reads(monkeypatch) as seen:
            adapter._state = (Paused(real.module, seen), "paused")
            got = adapter.gradients(model, theta, data, rows, b, trusted)
            in_gradients = len(seen)
            loss = adapter.evaluate(model, theta, data, None, None, trusted)[0]
        assert in_gradients <= (0 if trusted else 1) and len(seen) - in_gradients <= (0 if trusted else 1), seen
        torch.testing.assert_close(got, ref.gradients(model, theta, data, rows, b))
        torch.testing.assert_close(loss, ref.evaluate(model, theta, data, None)[0])


@pytest.mark.parametrize("op", ["local_steps", "gradients", "evaluate"])
def test_trusted_triton_calls_never_read_the_host(op, monkeypatch):
    _, cases = _triton_cases()
    adapter = _triton_adapter()
    with host_reads(monkeypatch) as seen:
        cases[op](adapter, True)
    assert seen == [] and adapter.module.calls == [op]


def test_trusted_skips_the_pre_pass_and_untrusted_runs_it(monkeypatch):
    model, data = models.Softmax(4, 3), _fed()
    theta = torch.zeros(3, model.d)
    theta[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"theta: row 1 holds a NaN"):
        _triton_adapter().gradients(model, theta, data, None, None, False)
    adapter = _triton_adapter()
    adapter.gradients(model, theta, data, None, None, True)
    assert adapter.module.calls == ["gradients"]
    # the CUDA adapter: untrusted, the screen runs first: the module's (whose address checks
    # refuse CPU tensors before anything reaches the device) or, with PFLCORE_CUDA_SCREEN=torch,
    # the torch pre-pass, which raises the NaN; trusted, the call goes on to the launch's
    # argument checks (which refuse CPU tensors), reading nothing on the way
    cuda = CudaAdapter()
    cuda._state = (Recorder(), "recording stand-in")
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda.gradients(model, theta, data, None, None, False)
    assert cuda.module.calls == []
    monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "torch")
    with pytest.raises(NonFiniteError, match=r"theta: row 1 holds a NaN"):
        cuda.gradients(model, theta, data, None, None, False)
    with pytest.raises(ValueError, match="cuda device|CUDA tensors"):
        cuda.gradients(model, theta, data, None, None, True)


def test_trusted_cuda_calls_never_read_the_host(monkeypatch):
    model, data = models.Softmax(4, 3), _fed()
    cuda = CudaAdapter()
    cuda._state = (Recorder(), "recording stand-in")
    theta = torch.zeros(3, model.d)
    for call in (lambda: cuda.gradients(model, theta, data, None, None, True),
                 lambda: cuda.evaluate(model, theta, data, None, None, True),
                 lambda: cuda.local_steps(model, theta, data, None, None, None, None, 1, 0.1, 0.0, True)):
        with host_reads(monkeypatch) as seen, pytest.raises(ValueError, match="cuda device|CUDA tensors"):
            call()
        assert seen == []


def _average_result_case(theta, w, rows):
    """The arguments of average_result_fault after a CUDA average: the screen's flags and the
    mean (computed here as the kernel would)."""
    safe, wsum, flags = _values.average_screen(theta, w, rows)
    th, ws = (theta, w) if safe is None else (theta[safe], w[safe])
    out = ((ws.to(torch.float64) @ th.to(torch.float64)) / wsum).to(theta.dtype)
    return theta, w, rows, out, flags


def _raised_average(theta, w, rows):
    """What the CUDA adapter's checks raise for an average call (screen, the mean, the read)."""
    return _raised(_values.average_result_fault, *_average_result_case(theta, w, rows))


def test_the_average_screen_reads_nothing_before_the_launch(monkeypatch):
    pts = torch.randn(30, 5)
    for rows in (None, torch.tensor([3, 1, 3]), torch.tensor([-1, 40])):
        with host_reads(monkeypatch) as seen:
            safe, _, _ = _values.average_screen(pts, torch.rand(30), rows)
        assert seen == [], seen
        assert rows is None or (safe.min() >= 0 and safe.max() < 30)


def test_the_average_screen_after_the_launch_raises_what_the_exact_checks_raise():
    """Faults injected one at a time in theta (a selected row, an unselected one), weights and
    rows: the post-launch screen (with the mean's finiteness instead of a pass over theta) raises
    exactly what _faults.average_fault raises, and nothing when there is nothing to raise."""
    nan, inf = float("nan"), float("inf")
    for dtype in (torch.float32, torch.float64):
        for rows in (None, torch.tensor([4, 1, 1, 2])):
            edits = [("theta", (1, 2), nan), ("theta", (3, 0), inf), ("theta", (2, 1), -inf),
                     ("w", (2,), -1.0), ("w", (1,), nan), ("w", (4,), inf), ("rows", (2,), 5), ("rows", (0,), -1),
                     ("zero", None, None), ("none", None, None)]
            for what, at, value in edits:
                theta = torch.randn(5, 3, dtype=dtype)
                w = torch.rand(5, dtype=dtype) + 0.1
                r = None if rows is None else rows.clone()
                if what == "rows":
                    if r is None:
                        continue
                    r[at] = value
                elif what == "zero":
                    w.zero_()
                elif what != "none":
                    (theta if what == "theta" else w)[at] = value
                want = _raised(_faults.average_fault, theta, w, r)
                assert _raised_average(theta, w, r) == want, (dtype, rows, what, at)
                unread = what == "theta" and r is not None and at[0] not in r.tolist()  # theta row 3
                assert (want is None) == (what == "none" or unread), (what, at, want)


def _value_cases():
    """Each fault function with arguments that pass, on CPU tensors; the GLM ones in every form
    the adapters call them (full batch, minibatches, rows, a shared model, anchors)."""
    out = []
    for dtype in (torch.float32, torch.float64):
        for model in (models.Softmax(4, 3), models.LeastSquares(4)):
            data = _fed(dtype)
            if not model.is_classifier:
                data = ClientData(data.x, data.x[:, 0].clone(), data.offsets)
            theta = torch.zeros(3, model.d, dtype=dtype)
            rows = torch.tensor([1, 1, 2])
            b = (torch.randint(0, 6, (3, 2, 2)) + data.offsets[rows].view(3, 1, 1)).to(torch.int32)
            many = (torch.randint(0, 6, (3, 4, 6)) + data.offsets[rows].view(3, 1, 1)).to(torch.int32)
            out += [
                ("glm_fault", (model, theta, data, None)),
                ("glm_fault", (model, theta[0], data, None)),
                ("glm_fault", (model, theta, data, rows, b, theta, torch.ones(3, dtype=dtype))),
                ("glm_fault", (model, theta, data, rows, many, theta[0])),
                ("glm_fault", (model, theta, data, rows, b[:, 0])),
            ]
        pts = torch.randn(30, 5, dtype=dtype)
        out += [
            ("kmeans_assign_fault", (pts, pts[:4])),
            ("kmeans_update_fault", (torch.randint(0, 4, (30,)), torch.rand(30, dtype=dtype), 4)),
            ("kmeans_update_fault", (torch.randint(0, 4, (30,)), None, 4)),
            ("average_fault", (pts, torch.rand(30, dtype=dtype), None)),
            ("average_fault", (pts, torch.rand(30, dtype=dtype), torch.tensor([3, 1]))),
            ("average_result_fault", _average_result_case(pts, torch.rand(30, dtype=dtype), None)),
            ("average_result_fault", _average_result_case(pts, torch.rand(30, dtype=dtype), torch.tensor([3, 1, 3]))),
            ("clip_and_sum_fault", (pts, torch.rand(30, dtype=dtype))),
            ("finite_rows", (pts, "v")),
            ("sample_batches_fault", (_fed(dtype), torch.tensor([0, 2]))),
        ]
    return out


def test_the_value_checks_read_the_host_once(monkeypatch):
    cases = _value_cases()
    # every check the GPU adapters call is among them
    called = set()
    for f in ("cuda.py", "triton.py"):
        called |= set(re.findall(r"_values\.(\w+_fault)\(", (Path(_values.__file__).parent / f).read_text()))
    assert called and called <= {name for name, _ in cases}
    for name, args in cases:
        with host_reads(monkeypatch) as seen:
            getattr(_values, name)(*args)
        assert len(seen) == 1, f"{name}: {seen}"


def _raised(fn, *args):
    try:
        fn(*args)
    except ValueError as exc:  # NonFiniteError is one
        return type(exc).__name__, str(exc)
    return None


def test_the_screen_raises_exactly_what_the_exact_checks_raise():
    """Faults injected one at a time (in place: the caller may change its tensors after
    ClientData checked them), in every input a GLM call reads: the screen must flag each, and
    the message is then the exact checks' own."""
    model, nan = models.Softmax(4, 3), float("nan")
    rows = torch.tensor([1, 0, 2])
    b0 = (torch.randint(0, 6, (3, 2, 2), generator=torch.Generator().manual_seed(1))
          + torch.tensor([6, 0, 12]).view(3, 1, 1)).to(torch.int32)
    read = b0.reshape(-1).tolist()

    def args():
        return dict(data=_fed(), theta=torch.zeros(3, model.d), rows=rows.clone(), b=b0.clone(),
                    anchor=torch.zeros(3, model.d), scale=torch.ones(3))

    edits = [
        ("rows", (1,), 7), ("offsets", (2,), 3), ("theta", (2, 1), nan), ("anchor", (0, 0), float("inf")),
        ("scale", (2,), nan), ("b", (1, 1, 0), 17), ("b", (2, 0, 1), -5), ("y", (read[1],), 3),
        ("x", (read[8], 2), nan), ("x", (read[3], 0), -float("inf")),
    ]
    for what, at, value in edits:
        a = args()
        target = getattr(a["data"], what) if what in ("x", "y", "offsets") else a[what]
        target[at] = value
        full = (model, a["theta"], a["data"], a["rows"], a["b"], a["anchor"], a["scale"])
        for call in (full, full[:5], full[:4], (model, a["theta"][0], a["data"], None)):
            want = _raised(_faults.glm_fault, *call)
            assert _raised(_values.glm_fault, *call) == want, (what, at, len(call))
        assert _raised(_values.glm_fault, *full) is not None, (what, at)
    # a NaN in a row no minibatch reads is no fault of the minibatch call; the full-batch call
    # reads every row and names it
    a = args()
    unread = sorted(set(range(18)) - set(read))[0]
    a["data"].x[unread, 0] = nan
    assert _raised(_values.glm_fault, model, a["theta"], a["data"], a["rows"], a["b"]) is None
    assert _raised(_values.glm_fault, model, a["theta"], a["data"], None) == \
        ("NonFiniteError", f"x: row {unread} holds a NaN or infinite value")


@pytest.mark.parametrize("name,args,message", [
    ("kmeans_update_fault", (torch.tensor([0, 5]), None, 4), "labels: expected cluster indices in [0, 4), got labels[1] = 5"),
    ("kmeans_update_fault", (torch.tensor([0, 1]), torch.tensor([1.0, -1.0]), 4),
     "weights: expected finite weights >= 0, got weights[1] = -1"),
    ("average_fault", (torch.ones(3, 2), torch.zeros(3), None), "weights: the weights of the averaged rows sum to 0"),
    ("average_fault", (torch.ones(3, 2), torch.ones(3), torch.tensor([0, 3])),
     "rows: expected indices in [0, 3), got rows[1] = 3"),
    ("clip_and_sum_fault", (torch.ones(3, 2), torch.tensor([0.5, 1.5, 0.0])),
     "weights: expected weights in [0, 1] (a client's contribution is bounded by clip_norm), got weights[1] = 1.5"),
    ("clip_and_sum_fault", (torch.full((2, 2), 1e300, dtype=torch.float64), None),
     "updates: row 0 holds a NaN or infinite value (or its norm overflows)"),
    ("kmeans_assign_fault", (torch.ones(3, 2), torch.tensor([[1.0, float("inf")]])),
     "centroids: row 0 holds a NaN or infinite value"),
])
def test_the_other_screens_flag_their_faults(name, args, message):
    assert _raised(getattr(_values, name), *args)[1] == message
    assert _raised(getattr(_faults, name), *args)[1] == message


def test_a_finite_sum_that_overflows_is_cleared_by_the_exact_pass():
    big = torch.full((4, 3), 3e38)  # finite float32 values whose sum is inf
    _values.kmeans_assign_fault(big, big[:2])
    _values.finite_rows(big, "v")
