"""Clients sharded across processes (pflcore.distributed, issue 8).

Multi-process tests start 2 gloo ranks on the loopback interface (tests/dist_worker.py, one
process per rank, torchrun's environment variables) and compare them with one process, every
launch bounded in time. Tolerances: averages over clients are summed in float64 in another
order across ranks and rounded to the data's float32, so models agree to float32 rounding
(1e-6 relative); what no reduction touches (sampling, LocalTrain's models, counts) is bitwise.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import dist_worker as W
import pflcore
from pflcore import checkpoint, data, distributed, ops
from pflcore.algorithms.accelerated import AcceleratedState
from pflcore.algorithms.perm import PERMState

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
ROUNDS = 5
LAUNCH_TIMEOUT = 240  # seconds for a whole 2-rank launch (imports included) on a 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, spec, world=2, timeout=LAUNCH_TIMEOUT):
    """Starts ``world`` worker processes; returns [(returncode, stdout, stderr, seconds)]."""
    os.makedirs(spec["out"], exist_ok=True)
    path = os.path.join(tmp, f"spec_{spec['mode']}.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    port = _free_port()
    procs = []
    t0 = time.perf_counter()
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same pflcore as this process
        procs.append(subprocess.Popen([sys.executable, WORKER, path], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank did not finish within {timeout} s: the launch hangs")
        out.append((p.returncode, o, e, time.perf_counter() - t0))
    return out


def _single(name, rounds=ROUNDS, **kw):
    alg, fed, model, extra = W.case(name)
    res = pflcore.run(alg, fed, model, rounds=rounds, eval_every=1, progress=False, comm=distributed.Comm(),
                      **extra, **kw)
    return W.outcome(res)


def _assert_history_close(got, want, rel=1e-6, what=""):
    assert [r["round"] for r in got] == [r["round"] for r in want], what
    for g, w in zip(got, want):
        assert set(g) == set(w), (what, set(g) ^ set(w))
        for k in w:
            if w[k] is None or isinstance(w[k], int):
                assert g[k] == w[k], (what, g["round"], k)
            elif math.isnan(w[k]):
                assert math.isnan(g[k]), (what, g["round"], k)
            else:
                assert math.isclose(g[k], w[k], rel_tol=rel, abs_tol=1e-9), (what, g["round"], k, g[k], w[k])


def _same(a, b) -> bool:
    """Equal histories, NaN equal to NaN (e.g. the residual before the first round)."""
    def norm(h):
        return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in h]
    return norm(a) == norm(b)


def _rows(ranks, name, key):
    parts = [r[name][key] for r in ranks]
    return None if parts[0] is None else torch.cat(parts)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist"))
    spec = {"mode": "run", "cases": W.CASES, "rounds": ROUNDS, "out": os.path.join(tmp, "out"),
            "checkpoint": os.path.join(tmp, "ck"), "checkpoint_every": 3}
    launched = _launch(tmp, spec)
    for rank, (rc, _, err, _) in enumerate(launched):
        assert rc == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [torch.load(os.path.join(spec["out"], f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return {"ranks": ranks, "checkpoint": spec["checkpoint"], "tmp": tmp}


@pytest.mark.parametrize("name", W.CASES)
def test_two_ranks_give_the_history_and_models_of_one_process(two_ranks, name):
    r0, r1 = two_ranks["ranks"]
    one = _single(name)
    assert _same(r0[name]["history"], r1[name]["history"]), "every rank records the same (all-reduced) history"
    assert r0[name]["clients"] == (0, 6) or r0[name]["clients"][0] == 0
    assert r0[name]["clients"][1] == r1[name]["clients"][0], "contiguous shards"
    _assert_history_close(r0[name]["history"], one["history"], what=name)
    personal = _rows((r0, r1), name, "personalized")
    if one["personalized"] is not None:
        assert personal.shape == one["personalized"].shape
        if name == "localtrain":  # nothing crosses ranks: bitwise
            assert torch.equal(personal, one["personalized"])
        else:
            torch.testing.assert_close(personal, one["personalized"], rtol=1e-5, atol=1e-6)
    if one["global"] is not None:
        torch.testing.assert_close(r0[name]["global"], one["global"], rtol=1e-5, atol=1e-6)
        assert torch.equal(r0[name]["global"], r1[name]["global"]), "the global model is the same on every rank"


def test_localtrain_models_and_count_metrics_are_bitwise(two_ranks):
    """LocalTrain never communicates: its models are bitwise those of one process, and so are
    the metrics made of counts (accuracy) and order statistics (the exact 10th percentile);
    losses are float sums, added in another order across ranks."""
    r0, r1 = two_ranks["ranks"]
    one = _single("localtrain")
    assert torch.equal(_rows((r0, r1), "localtrain", "personalized"), one["personalized"])
    for got, want in zip(r0["localtrain"]["history"], one["history"]):
        for key in ("personalized_acc", "personalized_acc_p10"):
            assert got[key] == want[key], (got["round"], key)


def test_checkpoint_of_two_ranks_resumes_in_one_process(two_ranks):
    folder = two_ranks["checkpoint"]
    for name in ("fedpi_anderson", "perm", "cgpfl", "pfedme"):
        ck = os.path.join(folder, name)
        assert os.path.exists(os.path.join(ck, "round_0000003.rank1.pt"))
        os.remove(os.path.join(ck, f"round_{ROUNDS:07d}.pt"))  # as if the run had stopped after round 3
        resumed = W.outcome(pflcore.resume(ck, progress=False, comm=distributed.Comm()))
        one = _single(name)
        _assert_history_close(resumed["history"], one["history"], what=name)
        if one["personalized"] is not None:
            torch.testing.assert_close(resumed["personalized"], one["personalized"], rtol=1e-5, atol=1e-6)
        assert resumed["clients"] == (0, one["personalized"].shape[0] if one["personalized"] is not None
                                      else resumed["clients"][1])


def test_checkpoint_of_one_process_resumes_on_two_ranks(tmp_path):
    names = ["fedpi_anderson", "perm", "ifca"]
    ck = tmp_path / "ck"
    for name in names:
        alg, fed, model, extra = W.case(name)
        pflcore.run(alg, fed, model, rounds=ROUNDS, eval_every=1, progress=False, comm=distributed.Comm(),
                    checkpoint=str(ck / name), checkpoint_every=3, **extra)
        os.remove(ck / name / f"round_{ROUNDS:07d}.pt")
    spec = {"mode": "resume", "cases": names, "out": str(tmp_path / "out"), "checkpoint": str(ck)}
    launched = _launch(str(tmp_path), spec)
    for rank, (rc, _, err, _) in enumerate(launched):
        assert rc == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name in names:
        one = _single(name)
        _assert_history_close(ranks[0][name]["history"], one["history"], what=name)
        torch.testing.assert_close(_rows(ranks, name, "personalized"), one["personalized"], rtol=1e-5, atol=1e-6)


def test_a_rank_that_dies_fails_the_others_within_the_timeout(tmp_path):
    spec = {"mode": "die", "cases": ["fedavg"], "rounds": 6, "out": str(tmp_path / "out"), "timeout": 30}
    (rc0, _, err0, t0), (rc1, _, _, _) = _launch(str(tmp_path), spec, timeout=120)
    assert rc1 == 3, "rank 1 died on purpose"
    assert rc0 != 0 and "DistributedError" in err0 and "rank 0 of 2" in err0, err0[-2000:]
    assert t0 < 90, f"rank 0 took {t0:.0f} s to fail"


def test_traffic_per_round_does_not_grow_with_clients_per_rank(two_ranks):
    """FedAvg, pFedMe, the grand scheme with Anderson and CGPFL send the same bytes per round
    whatever the number of clients a rank holds (server steps are reductions of [d]-sized
    sums): measured on federations of 11 and 22 clients over 2 ranks, same d."""
    tmp = two_ranks["tmp"]
    spec = {"mode": "run", "cases": ["fedavg", "fedpi_anderson", "cgpfl"], "rounds": 3,
            "out": os.path.join(tmp, "out_bytes")}
    launched = _launch(tmp, spec)
    assert all(rc == 0 for rc, *_ in launched), launched[0][2][-2000:]
    small = torch.load(os.path.join(spec["out"], "rank0.pt"), weights_only=False)
    big_spec = dict(spec, out=os.path.join(tmp, "out_bytes_big"), mode="run")
    os.environ["PFLCORE_TEST_DOUBLE_CLIENTS"] = "1"
    try:
        launched = _launch(tmp, big_spec)
    finally:
        del os.environ["PFLCORE_TEST_DOUBLE_CLIENTS"]
    assert all(rc == 0 for rc, *_ in launched), launched[0][2][-2000:]
    big = torch.load(os.path.join(big_spec["out"], "rank0.pt"), weights_only=False)
    for name in spec["cases"]:
        assert big[name]["clients"][1] > small[name]["clients"][1], "the second launch holds more clients per rank"
        # every round sends the same: FedAvg and the grand scheme exactly; CGPFL's Lloyd loop may
        # run a different number of iterations, each of [K, d + 1] float64
        b_small, b_big = small[name]["bytes"], big[name]["bytes"]
        assert all(b > 0 for b in b_small)
        if name == "cgpfl":
            K, d = 3, 6 * 3 + 3
            per_iter = K * (d + 1) * 8
            assert max(b_big) <= max(b_small) + 200 * per_iter
        else:
            assert b_small == b_big, (name, b_small, b_big)


# ---- in one process --------------------------------------------------------------------------

def test_shard_ranges_cover_the_clients_contiguously():
    for m, world in [(1, 1), (7, 2), (10, 3), (100, 7)]:
        ranges = [distributed.shard_range(m, world, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == m
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="at least 3 clients"):
        distributed.shard_range(2, 3, 0)
    starts = distributed.shard_starts(10, 3)
    assert distributed.owner_of(torch.tensor([0, 3, 4, 7, 9]), starts).tolist() == [0, 0, 1, 2, 2]


def test_a_shard_draws_the_minibatches_of_the_whole_federation():
    fed = data.synthetic(0.5, 0.5, num_clients=9, dim=4, num_classes=3, seed=1, size_scale=1, max_size=60)
    whole = ops.sample_batches(fed.train, steps=3, batch_size=5, seed=11, counter=4)
    shard = fed.shard(4, 9)
    assert shard.train.first_client == 4 and shard.num_clients_total == 9 and shard.is_shard
    local = ops.sample_batches(shard.train, steps=3, batch_size=5, seed=11, counter=4)
    # same rows of the same clients: indices shifted by the shard's first row
    assert torch.equal(local + int(fed.train.offsets[4]), whole[4:])
    ref = ops.sample_batches_ref(shard.train, steps=3, batch_size=5, seed=11, counter=4)
    assert torch.equal(ref, local)
    assert torch.equal(shard.weights, fed.weights[4:9])
    with pytest.raises(ValueError, match="whole federation"):
        pflcore.run(pflcore.algorithms.FedAvg(lr=0.1), shard, pflcore.models.Softmax(4, 3), rounds=1, progress=False)
    with pytest.raises(ValueError, match="lo, hi"):
        fed.train.shard(3, 3)


def test_reshard_splits_and_joins_per_client_fields():
    m, d = 7, 3
    theta = torch.arange(m * d, dtype=torch.float32).view(m, d)
    alpha = torch.rand(m, m, dtype=torch.float64)
    whole = PERMState(torch.ones(d), theta, torch.randperm(m), alpha, 4)
    parts = [(lo, hi, checkpoint.reshard([(0, m, whole)], lo, hi)) for lo, hi in [(0, 3), (3, 5), (5, 7)]]
    assert parts[1][2].theta.shape == (2, d) and torch.equal(parts[1][2].alpha, alpha[3:5])
    assert torch.equal(parts[2][2].sigma, whole.sigma) and parts[2][2].shuffle_rounds == 4
    back = checkpoint.reshard(parts, 0, m)
    assert torch.equal(back.theta, theta) and torch.equal(back.alpha, alpha) and torch.equal(back.w, whole.w)
    # an Anderson history over a per-client fixed point is split along the clients too
    mixer = ops.Anderson(memory=2)
    for k in range(3):
        u = torch.randn(m, d, dtype=torch.float64)
        mixer.step(u, 0.5 * u + k)
    acc = AcceleratedState(inner=None, anderson=mixer, per_client=True)
    pieces = [(lo, hi, checkpoint.reshard([(0, m, acc)], lo, hi)) for lo, hi in [(0, 4), (4, 7)]]
    assert pieces[0][2].anderson._R.shape == (3, 4 * d) and pieces[1][2].anderson._shape == (3, d)
    joined = checkpoint.reshard(pieces, 0, m).anderson
    assert torch.equal(joined._R, mixer._R) and torch.equal(joined._TU, mixer._TU) and joined._shape == (m, d)


def test_single_process_comm_is_the_identity():
    comm = distributed.Comm()
    t = torch.arange(4.0)
    assert comm.all_reduce(t) is t and comm.sum(3) == 3 and comm.sum(2.5) == 2.5
    assert torch.equal(comm.all_gather_rows(t), t) and comm.max(1.5) == 1.5
    values = torch.rand(17, dtype=torch.float64)
    assert distributed.quantile(values, 0.1, comm) == float(torch.quantile(values, 0.1))
    assert distributed.std(values, comm) == float(values.std(unbiased=False))
    assert distributed.kth_smallest(values, 5, comm) == float(values.sort().values[5])


TINY = """
name = "tiny"
rounds = 4
eval_every = 2
seeds = [0, 1]
metrics = ["personalized_acc", "global_acc"]
[data]
generator = "two_groups"
num_clients = 10
samples_per_client = 30
dim = 6
[model]
family = "logistic"
[algorithms.PERM]
type = "perm"
warmup_rounds = 1
lam_alpha = 100.0
lr = 0.05
local_steps = 2
[algorithms.FedAvg]
type = "fedavg"
lr = 0.05
local_steps = 2
"""


def test_torchrun_cli_gives_the_summary_of_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m pflcore run EXPERIMENT.toml`: the same summary as one
    process, printed and written once (by rank 0)."""
    (tmp_path / "tiny.toml").write_text(TINY)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), "-m", "pflcore", "run", "tiny.toml", "--no-progress", "--out", "two"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote two/summary.json") == 1 and "sharded over 2 ranks" in two.stdout
    one = subprocess.run([sys.executable, "-m", "pflcore", "run", "tiny.toml", "--no-progress", "--out", "one"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert one.returncode == 0, one.stderr[-3000:]
    a = json.loads((tmp_path / "one" / "summary.json").read_text())["rows"]
    b = json.loads((tmp_path / "two" / "summary.json").read_text())["rows"]
    for ra, rb in zip(a, b):
        for key in ("personalized_acc", "global_acc"):
            assert ra[key] == rb[key] or math.isclose(ra[key], rb[key], rel_tol=1e-6), (ra["algorithm"], key)
    assert (tmp_path / "two" / "PERM_seed0_alpha.png").exists(), "α gathered from both ranks for the heat-map"
