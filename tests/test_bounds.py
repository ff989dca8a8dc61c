"""Bounded inputs (issue 28, rows 7, 9 and 10): the CLI refuses what is not an experiment file
before reading it, every count has the ops' upper bound, zero-width arrays are a ValueError
naming the argument, and no output of an op requires grad."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pflcore import data as D
from pflcore import models as M
from pflcore import ops
from pflcore._checks import MAX_COUNT

CLI = [sys.executable, "-m", "pflcore"]

SMALL = """
rounds = {rounds}
[data]
generator = "least_squares"
num_clients = 4
samples_per_client = 20
dim = 3
[model]
family = "least_squares"
[algorithms.FedAvg]
type = "fedavg"
lr = 0.1
local_steps = {steps}
"""


def _cli(args, timeout=60):
    """The CLI in its own process: a regression would read /dev/zero until memory runs out, or
    wait on a FIFO forever."""
    try:
        return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PFLCORE_DEBUG="0"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"pflcore {' '.join(args)} did not return in {timeout} s")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused_before_it_is_read():
    out = _cli(["run", "/dev/zero"])
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("pflcore: error: experiment file '/dev/zero': expected a regular file (TOML "
                                  "text), got a character device")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "exp.toml"
    os.mkfifo(fifo)
    out = _cli(["run", str(fifo)])
    assert out.returncode == 2 and "got a pipe" in out.stderr, out.stderr


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.toml"
    with open(path, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: 1 GiB that takes no disk
    out = _cli(["run", str(path)])  # in its own process: a regression reads and parses the GiB
    assert out.returncode == 2, out.stderr
    assert "expected at most 4 MiB of TOML, got 1024.0 MiB" in out.stderr, out.stderr


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_huge_round_count_is_refused(tmp_path, where):
    cfg = tmp_path / "exp.toml"
    huge = "99999999999999999999"
    cfg.write_text(SMALL.format(rounds=huge if where == "file" else 3, steps=1))
    args = ["run", str(cfg), "--out", str(tmp_path / "o")] + ([f"rounds={huge}"] if where == "override" else [])
    out = _cli(args)  # in its own process: a regression runs for ever
    assert out.returncode == 2, out.stderr
    assert f"rounds: expected an integer in [0, {MAX_COUNT}], got {huge} (an integer)" in out.stderr, out.stderr
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_every_count_of_an_experiment_has_the_same_bound(tmp_path):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(SMALL.format(rounds=3, steps=2**40))
    out = _cli(["run", str(cfg), "--out", str(tmp_path / "o")])  # a regression would run ~forever
    assert out.returncode == 2, out.stderr
    assert f"algorithms.FedAvg.local_steps: expected an integer in [-{MAX_COUNT}, {MAX_COUNT}]" in out.stderr
    cfg.write_text(f"eval_every = {2**31}\n" + SMALL.format(rounds=3, steps=1))
    out = _cli(["run", str(cfg), "--out", str(tmp_path / "o")])
    assert out.returncode == 2 and f"eval_every: expected an integer in [1, {MAX_COUNT}]" in out.stderr, out.stderr


RUN_BOUNDS = """
import pflcore
from pflcore import algorithms as A, data as D, models as M
fed = D.least_squares(num_clients=3, samples_per_client=10, dim=2)
for kwargs, name in (({"rounds": 2**31}, "rounds"), ({"rounds": 1, "eval_every": 2**31}, "eval_every")):
    try:
        pflcore.run(A.FedAvg(lr=0.1), fed, M.LeastSquares(2), progress=False, **kwargs)
    except ValueError as exc:
        assert str(exc).startswith(name + ": expected an integer in ["), exc
    else:
        raise AssertionError(name + " accepted")
print("ok")
"""


def test_run_bounds_its_counts():
    try:  # in its own process: a regression runs 2**31 rounds
        out = subprocess.run([sys.executable, "-c", RUN_BOUNDS], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("pflcore.run accepted 2**31 rounds")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


ZERO_WIDTH = {
    "kmeans": (lambda: ops.kmeans(torch.randn(5, 0), 2), "points", "[5, 0]"),
    "kmeans_assign": (lambda: ops.kmeans_assign(torch.randn(5, 0), torch.randn(2, 0)), "points", "[5, 0]"),
    "anderson_weights": (lambda: ops.anderson_weights(torch.randn(3, 0)), "residuals", "[3, 0]"),
    "average": (lambda: ops.average(torch.randn(4, 0), torch.rand(4)), "theta", "[4, 0]"),
    "Anderson.step": (lambda: ops.Anderson(memory=2).step(torch.randn(0), torch.randn(0)), "u", "[0]"),
}


@pytest.mark.parametrize("op", list(ZERO_WIDTH))
def test_zero_width_arrays_name_the_argument(op):
    call, name, shape = ZERO_WIDTH[op]
    with pytest.raises(ValueError) as info:
        call()
    text = str(info.value)
    assert text.startswith(f"{name}: expected ") and text.endswith(f"got {shape}" if op != "Anderson.step"
                                                                   else f"got shape {shape}"), text


def test_no_output_of_an_op_requires_grad():
    fed = D.contexts(num_clients=4, sizes=(10, 20), dim=5, num_classes=3)
    data = fed.train
    for model in (M.Softmax(5, 3), M.MLP(5, hidden=4, C=3)):
        theta = (0.1 * torch.randn(4, model.d)).requires_grad_()
        v = torch.randn(4, model.d, requires_grad=True)
        batches = ops.sample_batches(data, steps=1, batch_size=4, seed=0, counter=0)[:, 0]
        outputs = {
            "hvp": ops.hvp(model, theta, v, data, batches=batches),
            "gradients": ops.gradients(model, theta, data),
            "evaluate": ops.evaluate(model, theta, data),
            "average": ops.average(theta, torch.ones(4)),
            "kmeans_assign": ops.kmeans_assign(theta, theta[:2]),
            "kmeans": ops.kmeans(theta, 2).centroids,
            "anderson_weights": ops.anderson_weights(theta),
        }
        for name, out in outputs.items():
            for t in (out if isinstance(out, tuple) else (out,)):
                assert not t.requires_grad, f"{name} ({type(model).__name__}) returned a tensor that requires grad"
