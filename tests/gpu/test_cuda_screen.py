"""The cuda backend's value screen of local_steps / gradients / evaluate (csrc/cuda/screen.cu):
every fault the torch screen of ``_values.py`` catches is raised with the reference's error
(type and message), and the module's flag is 0 on clean inputs and nonzero on each fault."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model
from _gpu import GPU, SKIP, require
from pflcore import backend, ops
from pflcore.backends import cuda as _cuda

pytestmark = SKIP
NAN, INF = float("nan"), float("inf")


def _case(family, dtype):
    """A call on 4 clients (N = 48) with rows (one client twice), minibatches of 8 indices in all
    (fewer than N: the screen gathers their rows), anchor and grad_scale; CPU tensors."""
    model = make_model(family, 7, 3, l2=0.05)
    data = make_data(model, [5, 1, 12, 30], dtype, seed=2)
    g = torch.Generator().manual_seed(4)
    rows = torch.tensor([2, 0, 3, 2])
    with backend.use("reference"):
        batches = ops.sample_batches(data, steps=1, batch_size=2, seed=1, counter=0, clients=rows)
    return dict(model=model, data=data, rows=rows, batches=batches,
                theta=0.3 * torch.randn(4, model.d, generator=g, dtype=dtype),
                anchor=torch.randn(4, model.d, generator=g, dtype=dtype),
                grad_scale=torch.rand(4, generator=g, dtype=dtype) + 0.5)


def _first_batch_row(c):
    return int(c["batches"][0, 0, 0])


def _unread_row(c):
    """A row of client 0 (rows [0, 5), read by the full-batch calls) that no batch index reads."""
    read = set(c["batches"].reshape(-1).tolist())
    return next(i for i in range(5) if i not in read)


# (name, families, call, edit): call "steps" (minibatch local_steps with anchor and grad_scale),
# "full" (full-batch gradients), "mini" (minibatch evaluate), "shared" (evaluate of theta [d])
FAULTS = [
    ("theta NaN", "csl", "steps", lambda c: c["theta"].__setitem__((1, 2), NAN)),
    ("theta inf", "csl", "full", lambda c: c["theta"].__setitem__((3, 0), INF)),
    ("shared theta NaN", "csl", "shared", lambda c: c.__setitem__("theta", c["theta"][0].clone().fill_(NAN))),
    ("anchor NaN", "csl", "steps", lambda c: c["anchor"].__setitem__((2, 1), NAN)),
    ("grad_scale inf", "csl", "steps", lambda c: c["grad_scale"].__setitem__(3, -INF)),
    ("x NaN, full batch", "csl", "full", lambda c: c["data"].x.__setitem__((_unread_row(c), 4), NAN)),
    ("x inf in a batch row", "csl", "steps", lambda c: c["data"].x.__setitem__((_first_batch_row(c), 6), INF)),
    ("x NaN in a batch row", "csl", "mini", lambda c: c["data"].x.__setitem__((_first_batch_row(c), 0), NAN)),
    ("label too large", "cs", "full", lambda c: c["data"].y.__setitem__(7, c["model"].num_classes)),
    ("label negative in a batch row", "cs", "mini", lambda c: c["data"].y.__setitem__(_first_batch_row(c), -1)),
    ("float label NaN", "l", "full", lambda c: c["data"].y.__setitem__(9, NAN)),
    ("float label inf in a batch row", "l", "steps", lambda c: c["data"].y.__setitem__(_first_batch_row(c), INF)),
    ("row too large", "csl", "mini", lambda c: c["rows"].__setitem__(1, 4)),
    ("row negative", "csl", "full", lambda c: c["rows"].__setitem__(3, -2)),
    ("batch index outside its client", "csl", "steps",
     lambda c: c["batches"].__setitem__((1, 0, 1), int(c["data"].offsets[1]))),  # row 1 is client 0: [0, 5)
    ("batch index negative", "csl", "mini", lambda c: c["batches"].__setitem__((2, 0, 0), -1)),
    ("empty client", "csl", "full", lambda c: c["data"].offsets.__setitem__(1, 0)),  # client 0: [0, 0)
]
FAMILIES = {"c": "softmax", "s": "logistic", "l": "least_squares"}
CASES = [pytest.param(FAMILIES[f], name, call, edit, id=f"{FAMILIES[f]}-{name}")
         for name, fams, call, edit in FAULTS for f in fams]


def _on(c, dev):
    """The case's tensors on ``dev`` (the data's arrays as they are now, edits included)."""
    out = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in c.items()}
    d = c["data"]
    data = copy.copy(d)  # not ClientData(...): that would refuse the edited arrays
    data.x, data.y, data.offsets = d.x.to(dev), d.y.to(dev), d.offsets.to(dev)
    out["data"] = data
    return out


def _run(call, c, ref):
    """The call on case ``c``: the op's reference implementation (``ref``) or the dispatched op."""
    suffix = "_ref" if ref else ""
    model, data, theta = c["model"], c["data"], c["theta"].clone()
    if call == "steps":
        return getattr(ops, "local_steps" + suffix)(model, theta, data, steps=1, lr=0.05, prox=0.3,
                                                   anchor=c["anchor"], batches=c["batches"], rows=c["rows"],
                                                   grad_scale=c["grad_scale"])
    if call == "full":
        return getattr(ops, "gradients" + suffix)(model, theta, data, rows=c["rows"])
    return getattr(ops, "evaluate" + suffix)(model, theta, data, rows=c["rows"],
                                            batches=c["batches"][:, 0].contiguous())


def _screen_args(call, c):
    theta, batches = c["theta"], c["batches"]
    if call == "steps":
        return c["model"], theta, c["data"], c["rows"], batches, c["anchor"], c["grad_scale"]
    if call == "full":
        return c["model"], theta, c["data"], c["rows"], None, None, None
    return c["model"], theta, c["data"], c["rows"], batches[:, 0].contiguous(), None, None


def _edited(family, dtype, edit):
    c = _case(family, dtype)
    data = c["data"]
    # the data's own arrays, writable and no longer the validated ones: edits land in them
    data.x, data.y, data.offsets = data.x.clone(), data.y.clone(), data.offsets.clone()
    edit(c)
    return c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,name,call,edit", CASES)
def test_cuda_glm_faults_are_the_reference_ones(dtype, family, name, call, edit):
    require("cuda")
    c = _edited(family, dtype, edit)
    with pytest.raises(ValueError) as want:
        _run(call, c, ref=True)
    with backend.use("cuda"), pytest.raises(type(want.value), match=re.escape(str(want.value))):
        _run(call, _on(c, GPU), ref=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["softmax", "logistic", "least_squares"])
def test_the_module_screen_flags_each_fault_and_nothing_else(dtype, family):
    require("cuda")
    adapter = backend.adapter("cuda")
    for call in ("steps", "full", "mini", "shared"):
        c = _case(family, dtype)
        if call == "shared":
            c["theta"] = c["theta"][0].clone()
        assert adapter._screen_flag(*_screen_args(call, _on(c, GPU))) == 0, call
    # a NaN in a row no minibatch reads: not read, not flagged (the screen gathers the batch rows)
    c = _edited(family, dtype, lambda c: c["data"].x.__setitem__((_unread_row(c), 1), NAN))
    assert adapter._screen_flag(*_screen_args("steps", _on(c, GPU))) == 0
    assert adapter._screen_flag(*_screen_args("full", _on(c, GPU))) != 0
    for name, fams, call, edit in FAULTS:
        if not any(FAMILIES[f] == family for f in fams):
            continue
        c = _edited(family, dtype, edit)
        args = _screen_args("mini" if call == "shared" else call, _on(c, GPU))
        assert adapter._screen_flag(*args) != 0, name


def test_the_screen_is_skipped_for_trusted_calls_and_the_torch_one_is_kept(monkeypatch):
    """PFLCORE_CUDA_SCREEN=torch: the torch screen, the same error."""
    require("cuda")
    c = _edited("softmax", torch.float32, lambda c: c["data"].x.__setitem__((_first_batch_row(c), 0), NAN))
    with pytest.raises(ValueError) as want:
        _run("mini", c, ref=True)
    monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "torch")
    with backend.use("cuda"), pytest.raises(type(want.value), match=re.escape(str(want.value))):
        _run("mini", _on(c, GPU), ref=False)
    assert isinstance(backend.adapter("cuda"), _cuda.CudaAdapter)


# ---- local_steps and its screen in one module call (the default; PFLCORE_CUDA_SCREEN=fused was its
# opt-in name, =separate makes them two module calls) ------------------------------------------

STEPS_CASES = [c for c in CASES if c.values[2] == "steps"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,name,call,edit", STEPS_CASES)
def test_fused_screen_faults_are_the_reference_ones_and_theta_is_untouched(monkeypatch, dtype, family, name, call,
                                                                          edit):
    """A fault in a minibatch local_steps call: the reference's error, and the device theta as it
    was (the steps' kernel did nothing behind the flag)."""
    require("cuda")
    monkeypatch.delenv("PFLCORE_CUDA_SCREEN", raising=False)
    c = _edited(family, dtype, edit)
    with pytest.raises(ValueError) as want:
        _run(call, c, ref=True)
    d = _on(c, GPU)
    theta = d["theta"].clone()
    before = theta.clone()
    with backend.use("cuda"), pytest.raises(type(want.value), match=re.escape(str(want.value))):
        ops.local_steps(d["model"], theta, d["data"], steps=1, lr=0.05, prox=0.3, anchor=d["anchor"],
                        batches=d["batches"], rows=d["rows"], grad_scale=d["grad_scale"])
    # (a NaN or inf edited into theta stays where it was: compare with those mapped to numbers)
    assert torch.equal(torch.nan_to_num(theta), torch.nan_to_num(before)), "theta was written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["softmax", "logistic", "least_squares"])
def test_fused_screen_on_clean_inputs_is_the_module_screens_result(monkeypatch, dtype, family):
    """Clean inputs: the fused call's theta equals the reference's and is bitwise the one of the
    separate screen (PFLCORE_CUDA_SCREEN=separate: the same kernel), full batch and minibatches."""
    require("cuda")
    c = _case(family, dtype)
    d = _on(c, GPU)
    for kw in (dict(), dict(batches=d["batches"], rows=d["rows"], anchor=d["anchor"], grad_scale=d["grad_scale"])):
        ref_kw = {k: v.cpu() for k, v in kw.items()}
        R = d["theta"].shape[0] if kw else d["data"].num_clients
        want = ops.local_steps_ref(c["model"], c["theta"][:R].clone(), c["data"], steps=2 if not kw else 1, lr=0.05,
                                   **ref_kw)
        got = {}
        for screen in ("module", "fused"):
            if screen == "fused":
                monkeypatch.delenv("PFLCORE_CUDA_SCREEN", raising=False)
            else:
                monkeypatch.setenv("PFLCORE_CUDA_SCREEN", "separate")
            with backend.use("cuda"):
                got[screen] = ops.local_steps(d["model"], d["theta"][:R].clone(), d["data"], steps=2 if not kw else 1,
                                              lr=0.05, **kw)
        torch.testing.assert_close(got["fused"].cpu(), want, **TOL[dtype])
        assert torch.equal(got["fused"], got["module"])
