"""The harness of the checkpoint stress test, for tests/test_checkpoint_safety.py (not collected
by pytest).

Started as ``python tests/ckpt_stress_worker.py SPEC.json`` (OMP_NUM_THREADS=1). SPEC:
``{"root": folder, "trials": T, "writers": W, "seed": s, "out": report.json}``. It imports
pflcore once and starts every process of the test with ``os.fork()`` from this process, which
never runs a round itself: each child is a fresh process (no state of an earlier trial), and
starting one costs milliseconds instead of an interpreter and torch import (2 s each here).

Per trial, W writers start at once on one new folder, each running the same small run
(``pflcore.run``, or ``pflcore.resume`` once the folder has a round) and retrying after a
CheckpointBusyError; after a random delay the harness SIGKILLs one writer still alive, chosen at
random (every other trial: the writer holding the folder's lock, i.e. the one mid-run), and
lets the others finish. A fresh child then resumes the folder and reports its
history and what it finds in the folder. The report (JSON) holds, per trial: the writers' exit
codes, whom the kill hit and the newest round file at that moment, the refusals the writers met,
the resumed history (timing columns removed), the rounds whose file does not hold the
uninterrupted run's history up to that round, and the temporaries left.
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import sys
import time
import traceback

import torch

import pflcore
from pflcore import algorithms as A
from pflcore import checkpoint as ckpt
from pflcore import data, models

TIMING = ("seconds", "client_steps_per_s")
ROUNDS = 30
RETRY_FOR = 30.0  # seconds a writer keeps retrying a busy folder


def strip(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def one_run(folder=None):
    fed = data.least_squares(num_clients=6, samples_per_client=20, dim=4, seed=0)
    return pflcore.run(A.FedAvg(lr=0.05, local_steps=2), fed, models.LeastSquares(4), rounds=ROUNDS,
                       checkpoint=folder, checkpoint_every=1 if folder else None, progress=False)


def rounds_in(folder):
    return sorted(glob.glob(os.path.join(folder, "round_*.pt")))


def writer(folder, refusals_path, rng_seed) -> int:
    """Runs (or resumes) the run into ``folder`` until done; 0 when done."""
    rng = random.Random(rng_seed)
    deadline = time.monotonic() + RETRY_FOR
    while True:
        try:
            if rounds_in(folder):
                pflcore.resume(folder, progress=False)
            else:
                one_run(folder)
            return 0
        except ckpt.CheckpointBusyError:
            with open(refusals_path, "ab") as fh:  # one byte per refusal: a kill cannot tear the count
                fh.write(b"x")
            if time.monotonic() > deadline:
                raise
            time.sleep(rng.uniform(0.002, 0.02))


def check(folder, baseline, out_path) -> int:
    """Resumes ``folder`` and checks every round file against the uninterrupted history."""
    resumed = strip(pflcore.resume(folder, progress=False).history)
    bad = []
    for path in rounds_in(folder):
        record = torch.load(path, weights_only=False)
        t = record["round"]
        if strip(record["history"]) != baseline[: t + 1]:
            bad.append(os.path.basename(path))
    report = {"history": resumed, "bad_rounds": bad,
              "temporaries": sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, ".*.tmp")))}
    with open(out_path, "w") as fh:
        json.dump(report, fh)
    return 0


def fork(fn, *args) -> int:
    """Runs ``fn(*args)`` in a forked child; its exit status is fn's result, 1 after an exception."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = fn(*args)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def status(raw: int) -> int:
    """A waitpid status as subprocess reports it: the exit code, or -signal."""
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def reap(pids, codes) -> None:
    """Adds the exit status of every child of ``pids`` that has ended to ``codes`` (pid -> status)."""
    for pid in pids:
        if pid not in codes:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = status(raw)


def wait_all(pids, timeout, codes=None):
    """Exit statuses of ``pids`` (``codes``: those reaped already); a child still running after
    ``timeout`` s is killed (reported -9, and the trial as hung)."""
    codes, end = dict(codes or {}), time.monotonic() + timeout
    while len(codes) < len(pids):
        reap(pids, codes)
        if time.monotonic() > end:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[pid] = status(os.waitpid(pid, 0)[1])
            return [codes[p] for p in pids], True
        time.sleep(0.002)
    return [codes[p] for p in pids], False


def lock_holder(folder, pids):
    """The writer (index) whose pid the folder's lock file names, or None."""
    try:
        with open(os.path.join(folder, ckpt.LOCK)) as fh:
            pid = json.loads(fh.readline())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pids.index(pid) if pid in pids else None


def trial(i, spec, baseline, duration, rng):
    folder = os.path.join(spec["root"], f"trial{i}")
    refusal_files = [os.path.join(spec["root"], f"refusals{i}_{w}") for w in range(spec["writers"])]
    pids = [fork(writer, folder, refusal_files[w], rng.randrange(2 ** 32)) for w in range(spec["writers"])]
    kill_at = rng.uniform(0.0, 1.2 * duration)
    time.sleep(kill_at)
    reaped = {}
    reap(pids, reaped)
    alive = [w for w, pid in enumerate(pids) if pid not in reaped]
    victim, newest, holder = None, None, lock_holder(folder, pids)
    if alive:
        # every other trial kills the lock's holder (the writer mid-run), the others anyone alive
        victim = holder if i % 2 == 0 and holder in alive else rng.choice(alive)
        newest = os.path.basename(rounds_in(folder)[-1]) if rounds_in(folder) else None
        os.kill(pids[victim], signal.SIGKILL)
    codes, hung = wait_all(pids, timeout=60, codes=reaped)
    if victim is not None and codes[victim] == 0:
        # it exited between the check for the living and the signal (a zombie takes the kill
        # silently): that trial had no kill
        victim = None
    out = os.path.join(spec["root"], f"check{i}.json")
    check_code, _ = wait_all([fork(check, folder, baseline, out)], timeout=60)
    result = {"trial": i, "codes": codes, "victim": victim, "holder": holder, "kill_at": kill_at,
              "newest_at_kill": newest,
              "hung": hung, "check_code": check_code[0],
              "refusals": [os.path.getsize(p) if os.path.exists(p) else 0 for p in refusal_files]}
    if os.path.exists(out):
        with open(out) as fh:
            result.update(json.load(fh))
    return result


def main(path):
    with open(path) as fh:
        spec = json.load(fh)
    rng = random.Random(spec["seed"])
    base_out = os.path.join(spec["root"], "baseline.json")

    def baseline_child():
        # what a checkpointed run takes in a fresh child, as a writer's is (its first run loads the
        # native module and numpy.random: ~3x a warm run's time): the kill window
        t0 = time.perf_counter()
        one_run(os.path.join(spec["root"], "timed"))
        seconds = time.perf_counter() - t0
        history = strip(one_run().history)
        with open(base_out, "w") as fh:
            json.dump({"history": history, "seconds": seconds}, fh)
        return 0

    codes, _ = wait_all([fork(baseline_child)], timeout=60)
    assert codes == [0], f"the uninterrupted run failed ({codes})"
    with open(base_out) as fh:
        base = json.load(fh)
    results = [trial(i, spec, base["history"], base["seconds"], rng) for i in range(spec["trials"])]
    with open(spec["out"], "w") as fh:
        json.dump({"baseline": base["history"], "run_seconds": base["seconds"], "trials": results}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
