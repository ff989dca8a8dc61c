"""The op boundary (DESIGN.md §8, issue 14): what users pass from their own code.

- the crash reproducers of the issue, each in a subprocess (a crash fails the test instead of
  ending pytest), now ValueErrors naming the argument;
- values checked where they are read, on every call (nothing cached about the caller's arrays),
  with the same message from the native kernels and the reference;
- in-place outputs: read-only arrays refused, inputs that alias the output copied first
  (deterministic at any thread count);
- any array in: DLPack objects (a stand-in here; JAX in test_jax.py) come back as their kind.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import make_data
from pflcore import backend, models, ops
from pflcore.errors import NonFiniteError

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")

PRELUDE = """
import numpy as np, torch
from pflcore import ClientData, models, ops
"""


def _run(code: str, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.dirname(__file__))


def _expect_value_error(code: str, pattern: str):
    """The snippet must end with one ValueError matching ``pattern``, never a signal."""
    out = _run(textwrap.dedent(code) + "\nprint('NO ERROR')")
    assert out.returncode == 1, f"exit {out.returncode} (negative: killed by a signal)\n{out.stdout}\n{out.stderr}"
    last = out.stderr.strip().splitlines()[-1]
    assert "Error: " in last and re.search(pattern, last), last


# ---- the crash reproducers ---------------------------------------------------------------

def test_read_only_memmap_theta_is_refused(tmp_path):
    _expect_value_error(f"""
        d = ClientData(torch.randn(20, 4), torch.randint(0, 3, (20,)), torch.tensor([0, 10, 20])); m = models.Softmax(4, 3)
        np.save(r"{tmp_path}/t.npy", np.zeros((2, m.d), np.float32))
        ops.local_steps(m, np.load(r"{tmp_path}/t.npy", mmap_mode="r"), d, steps=1, lr=0.1)
    """, r"^ValueError: theta: the array is read-only")


def test_read_only_numpy_theta_is_refused_not_written():
    model, data = models.Softmax(4, 3), make_data(models.Softmax(4, 3), [10, 10], torch.float32)
    t = np.zeros((2, model.d), np.float32)
    t.setflags(write=False)
    with pytest.raises(ValueError, match=r"^theta: the array is read-only"):
        ops.local_steps(model, t, data, steps=1, lr=0.1)
    assert not t.any()


def test_labels_changed_after_a_call_are_checked_again():
    _expect_value_error("""
        m = models.Softmax(4, 3)
        y = torch.randint(0, 3, (20,)); d = ClientData(torch.randn(20, 4), y, torch.tensor([0, 10, 20]))
        ops.evaluate(m, m.zeros(2), d); y[0] = 10**6
        ops.local_steps(m, m.zeros(2), d, steps=1, lr=0.1)
    """, r"^ValueError: y: expected labels in \[0, 3\), got y\[0\] = 1000000$")


def test_offsets_changed_after_construction_are_checked():
    _expect_value_error("""
        m = models.Softmax(4, 3)
        off = torch.tensor([0, 10, 20]); d = ClientData(torch.randn(20, 4), torch.randint(0, 3, (20,)), off)
        off[2] = 10**8; ops.evaluate(m, torch.zeros(2, 15), d)
    """, r"^ValueError: offsets: client 1 needs 0 <= offsets\[1\] < offsets\[2\] <= N = 20, got 10 and 100000000$")


@pytest.mark.parametrize("op", ["local_steps", "gradients", "evaluate", "sample_batches"])
def test_mutated_offsets_never_reach_memory_in_any_op(op):
    """Offsets that point before the data, past it, or backwards: every op that reads them. The
    three cases run in one interpreter, one after the other (a fresh one costs ~3.5 s): a crash in
    any of them ends it with a signal and fails the test, and each case's outcome is printed."""
    code = f"""
        m = models.Softmax(4, 3)
        for bad in (-5, 10**9, 3):
            off = torch.tensor([0, 10, 20]); d = ClientData(torch.randn(20, 4), torch.randint(0, 3, (20,)), off)
            off[1] = bad
            try:
                if "{op}" == "local_steps": ops.local_steps(m, m.zeros(2), d, steps=2, lr=0.1)
                elif "{op}" == "gradients": ops.gradients(m, m.zeros(2), d)
                elif "{op}" == "evaluate": ops.evaluate(m, m.zeros(2), d)
                else: ops.sample_batches(d, steps=2, batch_size=3, seed=0, counter=0)
                print(f"{{bad}}: no error", flush=True)
            except ValueError as e:
                print(f"{{bad}}: ValueError: {{e}}", flush=True)
    """
    out = _run(code)
    assert out.returncode == 0, f"exit {out.returncode} (negative: killed by a signal)\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    for line, bad in zip(lines, ("-5", "1000000000")):  # out of bounds: refused, naming the argument
        assert re.match(rf"^{bad}: ValueError: offsets: client \d needs 0 <= offsets", line), line
    assert lines[2] == "3: no error"  # in order and in bounds: a valid (if different) split


def test_x_set_to_nan_after_construction_is_reported():
    model = models.Softmax(4, 3)
    data = make_data(model, [5, 6], torch.float32, seed=1)
    data.x[7, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^x: row 7 holds a NaN or infinite value$"):
        ops.evaluate(model, model.zeros(2), data)
    with pytest.raises(NonFiniteError, match=r"^x: row 7 holds a NaN or infinite value$"):
        ops.gradients(model, model.zeros(2), data)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_kmeans_assign_refuses_a_non_finite_centroid(value):
    pts, cent = torch.randn(8, 3), torch.randn(4, 3)
    cent[2, 1] = value
    for fn in (ops.kmeans_assign, ops.kmeans_assign_ref):
        with pytest.raises(NonFiniteError, match=r"^centroids: row 2 holds a NaN or infinite value$"):
            fn(pts, cent)


# ---- aliasing: an anchor that is a view of theta -----------------------------------------------

ALIAS = """
import hashlib, torch
from pflcore import ClientData, models, ops
from conftest import make_data
m = models.Softmax(6, 4)
d = make_data(m, [7, 3, 9, 5, 8, 6, 4, 7], torch.float32, seed=3)
th = 0.1 * torch.randn(8, m.d, generator=torch.Generator().manual_seed(1))
ops.local_steps(m, th, d, steps=20, lr=0.5, prox=5.0, anchor=th[0])
print(hashlib.sha256(th.numpy().tobytes()).hexdigest())
"""


def test_an_anchor_aliasing_theta_gives_one_result_at_any_thread_count():
    """The issue's case: anchor = theta[0], a row being updated. The anchor is copied at the call,
    so two runs at each of 1 and 2 threads agree bitwise, and with an explicit copy. (Each run is
    a fresh interpreter, ~3.5 s: this test runs at every CPU level and again in CI's other builds.)"""
    digests = set()
    for threads in (1, 2, 1, 2):
        # cwd = tests/ (no pflcore there) on sys.path so that the snippet can import conftest
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
        env["OMP_NUM_THREADS"] = str(threads)
        out = subprocess.run([sys.executable, "-c", ALIAS], capture_output=True, text=True, env=env, timeout=120,
                             cwd=os.path.dirname(__file__))
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1
    model = models.Softmax(6, 4)
    data = make_data(model, [7, 3, 9, 5, 8, 6, 4, 7], torch.float32, seed=3)
    a = 0.1 * torch.randn(8, model.d, generator=torch.Generator().manual_seed(1))
    b = a.clone()
    ops.local_steps(model, a, data, steps=20, lr=0.5, prox=5.0, anchor=a[0])
    ops.local_steps(model, b, data, steps=20, lr=0.5, prox=5.0, anchor=b[0].clone())
    assert torch.equal(a, b)


def test_other_inputs_aliasing_theta_are_copied_too():
    model = models.Softmax(3, 2)
    data = make_data(model, [4, 5], torch.float64, seed=2)
    th = torch.randn(2, model.d + 2, dtype=torch.float64)
    a, b = th[:, : model.d], th.clone()[:, : model.d].contiguous()
    theta = th.view(-1)[: 2 * model.d].view(2, model.d)  # contiguous, shares memory with the scale below
    scale = th.view(-1)[2 * model.d - 2: 2 * model.d]     # the last two entries of theta itself
    expect = theta.clone()
    ops.local_steps(model, expect, data, steps=3, lr=0.1, grad_scale=scale.clone())
    ops.local_steps(model, theta, data, steps=3, lr=0.1, grad_scale=scale)
    assert torch.equal(theta, expect)
    del a, b


def test_theta_that_requires_grad_is_refused_for_in_place_updates():
    model = models.Softmax(3, 2)
    data = make_data(model, [4, 5], torch.float32)
    with pytest.raises(ValueError, match=r"^theta: requires grad"):
        ops.local_steps(model, model.zeros(2).requires_grad_(), data, steps=1, lr=0.1)


# ---- the same errors from the native kernels and the reference --------------------------------------

def _bad_cases():
    """(name, op(fn_of_backend) -> call) pairs: each call fails one value check."""
    model = models.Softmax(4, 3)
    ls = models.LeastSquares(4)

    def data(seed=0):
        return make_data(model, [3, 1, 5, 2], torch.float32, seed=seed)

    def batches(d, steps=2, B=3):
        return ops.sample_batches(d, steps=steps, batch_size=B, seed=1, counter=0)

    def nan_x_in_batch():
        d = data()
        b = batches(d)
        d.x[int(b[2, 1, 2])] = float("nan")
        d.x[int(b[3, 0, 0])] = float("inf")  # a later row: the first one (row order) is reported
        return lambda: ops.local_steps(model, model.zeros(4), d, steps=2, lr=0.1, batches=b)

    def label_then_x():
        d = data()
        d.y[5] = 7          # client 2's second row
        d.x[4, 0] = float("nan")  # client 2's first row: met first
        return lambda: ops.gradients(model, model.zeros(4), d)

    def batch_outside():
        d = data()
        b = batches(d)
        b[1, 1, 2] = 0  # client 1 owns row 3 only
        b[3, 0, 1] = 0
        return lambda: ops.local_steps(model, model.zeros(4), d, steps=2, lr=0.1, batches=b)

    def bad_rows():
        d = data()
        return lambda: ops.evaluate(model, model.zeros(3), d, rows=torch.tensor([0, 4, -1]))

    def theta_row():
        d = data()
        th = model.zeros(4)
        th[2, 5] = float("inf")
        return lambda: ops.local_steps(model, th, d, steps=1, lr=0.1)

    def anchor_rows():
        d = data()
        a = model.zeros(4)
        a[3, 0] = float("nan")
        return lambda: ops.local_steps(model, model.zeros(4), d, steps=1, lr=0.1, anchor=a)

    def shared_anchor():
        d = data()
        a = torch.zeros(model.d)
        a[1] = float("nan")
        return lambda: ops.local_steps(model, model.zeros(4), d, steps=1, lr=0.1, anchor=a)

    def grad_scale():
        d = data()
        return lambda: ops.local_steps(model, model.zeros(4), d, steps=1, lr=0.1,
                                       grad_scale=torch.tensor([1.0, 1.0, float("inf"), 1.0]))

    def targets():
        d = make_data(ls, [2, 3], torch.float64, seed=4)
        d.y[3] = float("nan")
        return lambda: ops.evaluate(ls, ls.zeros(2, torch.float64), d)

    def average_weights():
        th = torch.randn(5, 3)
        return lambda: ops.average(th, torch.tensor([1.0, -2.0, 1.0, 1.0, 1.0]), rows=[0, 1])

    def average_theta():
        th = torch.randn(5, 3)
        th[3, 1] = float("nan")
        return lambda: ops.average(th, torch.ones(5), rows=[4, 3, 0])

    def sample_clients():
        d = data()
        return lambda: ops.sample_batches(d, steps=1, batch_size=2, seed=0, counter=0, clients=[1, 9])

    def points():
        p = torch.randn(6, 2)
        p[4, 1] = float("nan")
        return lambda: ops.kmeans_assign(p, torch.randn(2, 2))

    return {
        "nan_x_in_batch": (nan_x_in_batch, NonFiniteError, r"^x: row \d+ holds a NaN or infinite value$"),
        "label_then_x": (label_then_x, NonFiniteError, r"^x: row 4 holds a NaN or infinite value$"),
        "batch_outside": (batch_outside, ValueError,
                          r"^batches: index 0 at \[1, 1, 2\] is outside the rows \[3, 4\) of client 1$"),
        "bad_rows": (bad_rows, ValueError, r"^rows: expected client indices in \[0, 4\), got rows\[1\] = 4$"),
        "theta_row": (theta_row, NonFiniteError, r"^theta: row 2 holds a NaN or infinite value$"),
        "anchor_rows": (anchor_rows, NonFiniteError, r"^anchor: row 3 holds a NaN or infinite value$"),
        "shared_anchor": (shared_anchor, NonFiniteError, r"^anchor: holds a NaN or infinite value$"),
        "grad_scale": (grad_scale, NonFiniteError, r"^grad_scale: grad_scale\[2\] = inf is not finite$"),
        "targets": (targets, NonFiniteError, r"^y: y\[3\] = nan is not finite$"),
        "average_weights": (average_weights, ValueError,
                            r"^weights: expected finite weights >= 0, got weights\[1\] = -2$"),
        "average_theta": (average_theta, NonFiniteError, r"^theta: row 3 holds a NaN or infinite value$"),
        "sample_clients": (sample_clients, ValueError,
                           r"^clients: expected client indices in \[0, 4\), got clients\[1\] = 9$"),
        "points": (points, NonFiniteError, r"^points: row 4 holds a NaN or infinite value$"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_native_and_reference_report_the_same_first_bad_value(case):
    make, kind, pattern = _bad_cases()[case]
    messages = []
    for name in ("native", "reference"):
        with backend.use(name):
            with pytest.raises(kind) as info:
                make()()
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert re.search(pattern, messages[0]), messages[0]


def test_the_first_bad_x_row_in_read_order_is_the_one_named():
    model = models.Softmax(4, 3)
    d = make_data(model, [3, 1, 5, 2], torch.float32)
    b = ops.sample_batches(d, steps=2, batch_size=3, seed=1, counter=0)
    b[2, :, :] = 4  # client 2 owns rows 4..8: its row 8 is met at step 0, its row 6 at step 1
    first, later = 8, 6
    b[2, 0, 1], b[2, 1, 0] = first, later
    d.x[later] = float("nan")
    d.x[first] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"^x: row {first} holds"):
        ops.local_steps(model, model.zeros(4), d, steps=2, lr=0.1, batches=b)


def test_native_keeps_the_failing_rows_and_updates_the_others():
    """Documented: the native kernels check as they go, so after a value error the rows that
    met a bad value are unchanged and the others are updated; the reference writes nothing."""
    model = models.Softmax(4, 3)
    d = make_data(model, [3, 1, 5, 2], torch.float32)
    d.x[4, 1] = float("nan")  # client 2
    good = model.zeros(4)
    ops.local_steps(model, good, make_data(model, [3, 1, 5, 2], torch.float32), steps=2, lr=0.1)
    th = model.zeros(4)
    with pytest.raises(NonFiniteError):
        ops.local_steps(model, th, d, steps=2, lr=0.1)
    assert torch.equal(th[2], torch.zeros(model.d))
    assert torch.equal(th[[0, 1, 3]], good[[0, 1, 3]])
    th = model.zeros(4)
    with pytest.raises(NonFiniteError):
        ops.local_steps_ref(model, th, d, steps=2, lr=0.1)
    assert not th.any()


# ---- any array in --------------------------------------------------------------------------------

class StandIn:
    """What CuPy or any array-API library hands over: only ``__dlpack__``, ``__dlpack_device__`` and
    ``__array_namespace__`` (whose ``from_dlpack`` builds results of this kind)."""

    made = 0

    def __init__(self, t: torch.Tensor):
        self._t = t

    def __dlpack__(self, **kwargs):
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()

    def __array_namespace__(self, api_version=None):
        return _Namespace


class _Namespace:
    @staticmethod
    def from_dlpack(x):
        StandIn.made += 1
        return StandIn(torch.from_dlpack(x))


def test_a_dlpack_array_is_taken_without_a_copy_and_updated_in_place():
    model = models.Softmax(4, 3)
    data = make_data(model, [3, 4], torch.float32, seed=5)
    theta = torch.zeros(2, model.d)
    ext = StandIn(theta)
    out = ops.local_steps(model, ext, data, steps=2, lr=0.1)
    assert out is ext and theta.abs().sum() > 0  # the stand-in's own memory was updated
    want = ops.local_steps(model, torch.zeros(2, model.d), data, steps=2, lr=0.1)
    assert torch.equal(theta, want)


@pytest.mark.parametrize("op", ["gradients", "evaluate", "kmeans_assign", "average", "kmeans", "anderson"])
def test_results_come_back_as_the_kind_that_came_in(op):
    model = models.Softmax(4, 3)
    data = make_data(model, [3, 4], torch.float32, seed=5)
    theta = 0.1 * torch.randn(2, model.d)
    pts = torch.randn(9, 3)
    if op == "gradients":
        got, want = ops.gradients(model, StandIn(theta), data), [ops.gradients(model, theta, data)]
    elif op == "evaluate":
        got, want = ops.evaluate(model, StandIn(theta), data), ops.evaluate(model, theta, data)
    elif op == "kmeans_assign":
        got, want = ops.kmeans_assign(StandIn(pts), StandIn(pts[:2])), ops.kmeans_assign(pts, pts[:2])
    elif op == "average":
        got, want = ops.average(StandIn(theta), StandIn(torch.ones(2))), [ops.average(theta, torch.ones(2))]
    elif op == "kmeans":
        res = ops.kmeans(StandIn(pts), 2, seed=1)
        got, want = (res.centroids, res.labels), (ops.kmeans(pts, 2, seed=1).centroids, ops.kmeans(pts, 2, seed=1).labels)
    else:
        got, want = [ops.Anderson(memory=2).step(StandIn(pts[0]), StandIn(pts[1]))], [ops.Anderson(memory=2).step(pts[0], pts[1])]
    got = got if isinstance(got, (tuple, list)) else [got]
    assert all(isinstance(g, StandIn) for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g._t, w)


def test_numpy_in_numpy_out_unchanged():
    model = models.Softmax(4, 3)
    data = make_data(model, [3, 4], torch.float32, seed=5)
    theta = np.zeros((2, model.d), np.float32)
    out = ops.local_steps(model, theta, data, steps=2, lr=0.1)
    assert out is theta and np.abs(theta).sum() > 0
    g = ops.gradients(model, theta, data)
    assert isinstance(g, np.ndarray) and g.shape == (2, model.d)
    assert all(isinstance(t, np.ndarray) for t in ops.evaluate(model, theta, data))


def test_an_object_that_is_no_array_is_named():
    with pytest.raises(ValueError, match=r"^points: expected an array .*got list"):
        ops.kmeans_assign([[1.0, 2.0]], torch.zeros(1, 2))


def test_rows_shorter_or_longer_than_theta_are_refused():
    """The kernels index rows[r] for every row r of theta: a rows array of another length must be
    refused before they run (found by the fuzz suite: a tuple rows=(1,) beside a 2-row theta)."""
    model = models.Softmax(3, 2)
    data = make_data(model, [3, 4, 2], torch.float32)
    for op in (lambda r: ops.evaluate(model, model.zeros(2), data, rows=r),
               lambda r: ops.gradients(model, model.zeros(2), data, rows=r),
               lambda r: ops.local_steps(model, model.zeros(2), data, steps=1, lr=0.1, rows=r)):
        for rows in ((1,), [0, 1, 2], torch.tensor([2])):
            with pytest.raises(ValueError, match=r"^rows: expected one client per row of theta, i\.e\. shape \[2\], "):
                op(rows)


def test_counts_are_bounded_where_the_kernels_count_in_int64():
    model = models.Softmax(3, 2)
    data = make_data(model, [3, 4], torch.float32)
    with pytest.raises(ValueError, match=r"^steps: expected an integer in \[0, 2147483647\], got 9223372036854775808"):
        ops.local_steps(model, model.zeros(2), data, steps=2**63, lr=0.1)
    with pytest.raises(ValueError, match=r"^memory: expected an integer in \[0, 1024\]"):
        ops.Anderson(memory=2**63)
    with pytest.raises(ValueError, match=r"^seed: expected an integer in \[0, 2\*\*64\), got 1180591620717411303424"):
        ops.kmeans(torch.randn(5, 2), 2, seed=2**70)
    assert ops.kmeans(torch.randn(5, 2), 2, seed=2**64 - 1).centroids.shape == (2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_value_prepass_row_check_is_exact_where_row_sums_overflow(dtype):
    # The torch pre-pass checks a row's sum first (one fast pass); a sum that overflows must not
    # flag a finite row, and NaN, inf, -inf and inf - inf rows must all be flagged.
    from pflcore._checks import all_finite
    from pflcore.backends._values import rows_finite
    big = torch.finfo(dtype).max
    t = torch.zeros(6, 5, dtype=dtype)
    t[0] = big  # finite, sum overflows
    t[1, 2] = float("nan")
    t[2, 0] = float("inf")
    t[3, 4] = -float("inf")
    t[4, 0], t[4, 1] = float("inf"), -float("inf")
    want = torch.isfinite(t).all(1)
    assert torch.equal(rows_finite(t), want) and want.tolist() == [True, False, False, False, False, True]
    assert all_finite(t[[0, 5]]) and not all_finite(t[:2]) and not all_finite(t[4:])
    assert torch.equal(rows_finite(t.view(6, 5, 1)), want) and rows_finite(t[:0]).numel() == 0



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_the_prepass_flags_any_non_finite_row_it_reads(dtype, idx_dtype):
    # _rows_nonfinite (embedding_bag's sum of the read rows on the CPU, else gathered pieces)
    # flags a NaN, inf, -inf or inf - inf in any read row, repeated rows included, on contiguous
    # and strided x; rows that are not read do not flag.
    from pflcore.backends._values import _rows_nonfinite
    from pflcore.backends import _values

    def flag(x, idx):
        return bool(torch.stack(_rows_nonfinite(x, torch.tensor(idx, dtype=idx_dtype))).any())

    base = torch.randn(9, 7, dtype=dtype)
    for strided in (False, True):
        for value in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
            for row in (0, 4, 8):
                t = base.clone()
                for j, v in enumerate(value):
                    t[row, 2 + j] = v
                x = torch.stack([t, torch.zeros_like(t)], 2).view(9, 14)[:, ::2] if strided else t
                assert x.stride(1) == (2 if strided else 1) and torch.equal(x.nan_to_num(), t.nan_to_num())
                assert flag(x, [1, row, 3]) and flag(x, [row, row]) and flag(x, [row])
                assert not flag(x, [r for r in range(9) if r != row] * 2)
                old = _values._GATHER_VALUES
                try:  # the gathered pieces (off the CPU): one row at a time
                    _values._GATHER_VALUES = 1
                    assert flag(x.view(9, 7, 1), [1, row, 3]) and not flag(x.view(9, 7, 1), [1, 3])
                finally:
                    _values._GATHER_VALUES = old
    big = torch.finfo(dtype).max  # an overflowing sum of finite rows flags (the exact pass clears it)
    assert flag(torch.full((2, 3), big, dtype=dtype), [0, 1])

def _twenty_row_batches():
    """A client of 30 rows and one minibatch of 20 (three blocks of the row path: 8 + 8 + 4)."""
    model = models.Softmax(5, 4)
    d = make_data(model, [30, 6], torch.float32)
    b = ops.sample_batches(d, steps=1, batch_size=20, seed=3, counter=0)
    b[0, 0] = torch.arange(20, dtype=b.dtype)  # positions = rows
    b[1, 0] = 30 + torch.arange(20, dtype=b.dtype) % 6
    return model, d, b


def _fault_messages(op, model, d, b, theta_value):
    """The ValueError messages of op on (d, b) from the native backend and the reference, at
    θ = theta_value everywhere (two model rows; minibatch b as _twenty_row_batches gives it)."""
    messages = []
    for name in ("native", "reference"):
        th = theta_value * torch.ones(2, model.d)
        call = {"local_steps": lambda: ops.local_steps(model, th, d, steps=2, lr=0.1, batches=b.repeat(1, 2, 1)),
                "local_steps_full_batch": lambda: ops.local_steps(model, th, d, steps=2, lr=0.1),
                "gradients": lambda: ops.gradients(model, th, d, batches=b[:, 0]),
                "evaluate": lambda: ops.evaluate(model, th, d, batches=b[:, 0])}[op]
        with backend.use(name), pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("op", ["local_steps", "local_steps_full_batch", "gradients", "evaluate"])
@pytest.mark.parametrize("faults, want", [
    ({"x": 13, "y": 17}, r"^x: row 13 holds"),         # x in the 2nd block before a bad label in the 3rd
    ({"y": 5, "x": 13}, r"^y: expected labels in \[0, 4\), got y\[5\] = 9$"),
    ({"x": 18}, r"^x: row 18 holds"),                  # the short last block
    ({"x": 0}, r"^x: row 0 holds"),
])
def test_features_checked_through_the_logits_report_the_first_bad_value(op, faults, want):
    # The row path checks labels up front and a row's features through its logits (a NaN/inf
    # feature makes them non-finite); the fault named is still the first bad value in row order.
    model, d, b = _twenty_row_batches()
    if "x" in faults:
        d.x[faults["x"], 2] = float("inf") if faults["x"] % 2 else float("nan")
    if "y" in faults:
        d.y[faults["y"]] = 9
    messages = _fault_messages(op, model, d, b, 0.1)
    assert messages[0] == messages[1] and re.search(want, messages[0]), messages


def test_finite_features_whose_logits_overflow_are_not_a_fault():
    # Finite x of 3e38 gives inf logits (five of them summed): the logits check must then find
    # no bad feature and compute as the reference does, not report a fault.
    model, d, b = _twenty_row_batches()
    d.x[11] = 3e38
    th = torch.ones(2, model.d)
    got = {}
    for name in ("native", "reference"):
        with backend.use(name):
            loss, correct, count = ops.evaluate(model, th, d, batches=b[:, 0])
            got[name] = (loss, correct, count, ops.gradients(model, th, d, batches=b[:, 0]))
    assert torch.equal(got["native"][1], got["reference"][1]) and torch.equal(got["native"][2], got["reference"][2])
    assert not torch.isfinite(got["native"][0][0]) and not torch.isfinite(got["reference"][0][0])
    torch.testing.assert_close(got["native"][0][1], got["reference"][0][1])
    torch.testing.assert_close(got["native"][3][1], got["reference"][3][1])
    assert torch.isfinite(got["native"][3][1]).all()


@pytest.mark.parametrize("op", ["local_steps", "local_steps_full_batch", "gradients", "evaluate"])
def test_a_bad_feature_after_a_block_whose_logits_overflow_is_still_reported(op):
    # Row 3's finite features overflow its logits (block 1 of 8 + 8 + 4), so the logits check
    # stops there and finds no bad feature in that block; row 13's NaN, in the next block, must
    # still be reported, not run through unchecked.
    model, d, b = _twenty_row_batches()
    d.x[3] = 3e38
    d.x[13, 2] = float("nan")
    messages = _fault_messages(op, model, d, b, 1.0)
    assert messages[0] == messages[1] and re.search(r"^x: row 13 holds", messages[0]), messages
