"""Checkpoint folders under concurrent writers, killed writers, failing disks and foreign files
(the reliability audit's rows 4-6): one writer per folder, a killed writer's lock taken over,
unique temporaries, write errors named, round files of another run skipped.

Anything that could hang or crash runs in a subprocess with a timeout; children import the same
pflcore as this process (PYTHONPATH) and run with one thread."""
from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import checkpoint as ckpt
from pflcore import data, distributed, models

HERE = os.path.dirname(os.path.abspath(__file__))
TIMING = ("seconds", "client_steps_per_s")
CHILD_TIMEOUT = 120  # seconds for one child (a torch import takes ~2 s of it on a 2-core machine)
MODEL = models.LeastSquares(4)


def _strip(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def _fed(seed=0, clients=6):
    return data.least_squares(num_clients=clients, samples_per_client=20, dim=4, seed=seed)


def _alg():
    return A.FedAvg(lr=0.05, local_steps=2)


def _run(folder=None, rounds=6, seed=0, clients=6, **kw):
    return pflcore.run(_alg(), _fed(clients=clients), MODEL, rounds=rounds, seed=seed, checkpoint=folder,
                       checkpoint_every=1 if folder else None, progress=False, **kw)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _child(code: str, **kw) -> subprocess.Popen:
    """``code`` (with this module's helpers _fed, _alg, MODEL defined) in a new interpreter."""
    prelude = textwrap.dedent("""
        import os, sys, json, time, signal, resource
        import pflcore
        from pflcore import algorithms as A, checkpoint as ckpt, data, models
        MODEL = models.LeastSquares(4)
        def _fed(seed=0, clients=6):
            return data.least_squares(num_clients=clients, samples_per_client=20, dim=4, seed=seed)
        def _alg():
            return A.FedAvg(lr=0.05, local_steps=2)
    """)
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _temporaries(folder):
    return [p for p in os.listdir(folder) if p.endswith(".tmp")]


# ---- one writer per folder ----------------------------------------------------------------------

def test_a_second_writer_is_refused_naming_the_holder_and_the_first_is_unaffected(tmp_path):
    """Row 4: the same run started twice into one folder. The second process, started while the
    first is inside its round 3, is refused with the holder's pid and host; the first goes on
    and its checkpoints resume to the uninterrupted run's history."""
    ck = str(tmp_path / "ck")
    seen = {}

    def second_writer(t, row, state):
        if t == 3:
            child = _child(f"""
                try:
                    pflcore.run(_alg(), _fed(), MODEL, rounds=6, checkpoint={ck!r}, checkpoint_every=1, progress=False)
                except ckpt.CheckpointBusyError as exc:
                    print(exc)
                    sys.exit(3)
            """)
            seen["out"], seen["err"] = child.communicate(timeout=CHILD_TIMEOUT)
            seen["rc"] = child.returncode

    first = _run(ck, callbacks=[second_writer])
    assert seen["rc"] == 3, seen["err"][-3000:]
    assert (f"checkpoint: {ck!r} is being written by another run (pid {os.getpid()} on {socket.gethostname()} "
            f"since ") in seen["out"], seen["out"]
    assert "one writer per folder" in seen["out"]
    full = _run()
    assert _strip(first.history) == _strip(full.history)
    assert torch.equal(first.global_model, full.global_model)
    assert sorted(p for p in os.listdir(ck) if p.startswith("round_")) == [f"round_{t:07d}.pt" for t in range(1, 7)]
    os.remove(os.path.join(ck, "round_0000006.pt"))
    assert _strip(pflcore.resume(ck, progress=False).history) == _strip(full.history)


def test_the_lock_is_released_however_the_run_ends(tmp_path):
    """Success, DivergenceError and KeyboardInterrupt (from a callback) all release the lock: the
    next run into the folder is accepted. While a run holds it, the lock is really taken."""
    ck = str(tmp_path / "ck")
    held = []

    def probe(t, row, state):
        lock = ckpt.FolderLock(ck)
        with pytest.raises(ckpt.CheckpointBusyError, match=r"is being written by another run \(pid \d+"):
            lock.acquire()
        held.append(t)

    _run(ck, rounds=2, callbacks=[probe])
    assert held == [1, 2]

    def interrupt(t, row, state):
        if t == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(ck, rounds=4, callbacks=[interrupt])
    diverging = A.FedAvg(lr=3.0)  # grows geometrically: overflows after a few rounds
    with pytest.raises(pflcore.DivergenceError):
        pflcore.run(diverging, _fed(), models.LeastSquares(4, fit_intercept=False), rounds=400,
                    checkpoint=str(tmp_path / "div"), checkpoint_every=2, progress=False)
    for folder in (ck, str(tmp_path / "div")):
        lock = ckpt.FolderLock(folder)
        lock.acquire()  # raises if a run above still held it
        assert lock.held
        lock.release()
    assert _run(ck, rounds=4).history[-1]["round"] == 4


def test_a_killed_writers_lock_and_temporaries_are_taken_over(tmp_path):
    """kill -9 of the writer: the kernel drops its flock, so the next writer takes the folder
    over (no manual clean-up), removes the temporary the dead one left mid-write, and the
    resume equals the uninterrupted run."""
    ck = str(tmp_path / "ck")
    child = _child(f"""
        def hang(t, row, state):
            if t == 3:
                # as if killed while writing round 4: its temporary is left behind
                open(os.path.join({ck!r}, f".round_0000004.pt.{{os.getpid()}}.0badc0de.tmp"), "wb").write(b"PK")
                print("holding", flush=True)
                time.sleep(600)
        pflcore.run(_alg(), _fed(), MODEL, rounds=6, checkpoint={ck!r}, checkpoint_every=1, progress=False,
                    callbacks=[hang])
    """)
    try:
        assert child.stdout.readline().strip() == "holding", child.stderr.read()[-3000:]
        with pytest.raises(ckpt.CheckpointBusyError, match=rf"pid {child.pid} on {socket.gethostname()} since"):
            _run(ck)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == -signal.SIGKILL
    assert _temporaries(ck) == [f".round_0000004.pt.{child.pid}.0badc0de.tmp"]
    resumed = pflcore.resume(ck, progress=False)
    assert _strip(resumed.history) == _strip(_run().history)
    assert _temporaries(ck) == []
    with open(os.path.join(ck, ckpt.LOCK)) as fh:
        assert json.loads(fh.readline())["pid"] == os.getpid(), "the lock file names its last holder"


class _Comm(distributed.Comm):
    """Rank ``rank`` of 2 whose peers report ``peer`` to every max(): the agreement of a sharded
    claim, without a process group."""

    world = 2

    def __init__(self, rank, peer):
        super().__init__()
        self.rank, self.peer = rank, peer

    def max(self, value):
        return max(value, self.peer)


def test_a_sharded_claim_refuses_on_every_rank(tmp_path):
    """Rank 0 takes the lock; when it finds the folder busy, every rank raises
    CheckpointBusyError (rank 0 with the holder, the others pointing at it)."""
    ck = str(tmp_path / "ck")
    fp = {"seed": 0}
    holder = ckpt.FolderLock(ck)
    holder.acquire()
    try:
        with pytest.raises(ckpt.CheckpointBusyError, match=r"being written by another run \(pid"):
            ckpt.claim(ck, fp, _Comm(0, peer=0.0), resuming=False)
        with pytest.raises(ckpt.CheckpointBusyError, match=r"refused on another rank \(this is rank 1"):
            ckpt.claim(ck, fp, _Comm(1, peer=2.0), resuming=False)
    finally:
        holder.release()
    lock = ckpt.claim(ck, fp, _Comm(0, peer=0.0), resuming=False)
    assert lock is not None and lock.held, "rank 0 holds the lock, returned to the caller outside run"
    assert ckpt.claim(ck, fp, _Comm(1, peer=0.0), resuming=False) is None, "other ranks take none"
    lock.release()


# ---- unique temporaries -------------------------------------------------------------------------

def test_concurrent_writes_to_one_path_never_collide(tmp_path):
    """Row 4's FileNotFoundError: 8 threads write one path 15 times each, every write in small
    pieces so that they interleave. No write fails, the file is one whole payload, and no
    temporary is left."""
    path = str(tmp_path / "round_0000001.pt")
    payloads = {(w, i): (f"{w}:{i}:".encode() + bytes([w]) * 65_536) for w in range(8) for i in range(15)}
    errors = []

    def writer(w):
        for i in range(15):
            data = payloads[(w, i)]

            def write(fh):
                for k in range(0, len(data), 4096):
                    fh.write(data[k:k + 4096])
            try:
                ckpt._atomic_write(path, write)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors[:3]
    with open(path, "rb") as fh:
        assert fh.read() in payloads.values()
    assert _temporaries(tmp_path) == []


# ---- write errors -------------------------------------------------------------------------------

class _FailingFile(io.FileIO):
    """A file whose writes fail with ``code`` once ``after`` bytes are written (a disk filling up)."""

    def __init__(self, path, mode, code, after):
        super().__init__(path, mode)
        self.code, self.left = code, after

    def write(self, b):
        if len(b) > self.left:
            raise OSError(self.code, os.strerror(self.code))
        self.left -= len(b)
        return super().write(b)


def _failing_open(target, code, after=100):
    """``open`` for checkpoint.py whose files named after ``target`` fail (buffered as usual)."""
    def fake(path, mode="r", *args, **kw):
        if target in os.path.basename(path) and "w" in mode:
            return io.BufferedWriter(_FailingFile(path, "wb", code, after))
        return open(path, mode, *args, **kw)
    return fake


@pytest.mark.parametrize("target, code, reason", [
    ("round_0000003.pt", errno.ENOSPC, r"no space left on device \(ENOSPC\); free some space"),
    ("federation.pt", errno.EDQUOT, r"disk quota exceeded \(EDQUOT\)"),
    ("round_0000003.pt", errno.EFBIG, r"file too large \(EFBIG\); the file is larger than the file size limit"),
    ("run.json", errno.EROFS, r"read-only file system \(EROFS\)"),
    ("round_0000001.pt", errno.EACCES, r"permission denied \(EACCES\)"),
])
def test_a_write_error_names_the_file_and_the_cause(tmp_path, monkeypatch, target, code, reason):
    """Row 5: torch.save reported a full disk as "RuntimeError [enforce fail at
    inline_container.cc:672] unexpected pos", and left its .tmp. Now the run raises a
    CheckpointError naming the file and the OS's reason, removes the temporary, keeps the
    rounds written before, and releases the folder."""
    ck = str(tmp_path / "ck")
    monkeypatch.setattr(ckpt, "open", _failing_open(target, code), raising=False)
    with pytest.raises(ckpt.CheckpointError) as caught:
        _run(ck)
    message = str(caught.value)
    assert message.startswith(f"checkpoint: cannot write {os.path.join(ck, target)}: "), message
    assert "\n" not in message
    assert re.search(reason, message), message
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == code
    assert _temporaries(ck) == []
    assert not os.path.exists(os.path.join(ck, target))
    monkeypatch.undo()
    if target == "round_0000003.pt":  # rounds 1 and 2 are intact: resume goes on from round 2
        assert _strip(pflcore.resume(ck, progress=False).history) == _strip(_run().history)
    else:
        assert _run(ck).history[-1]["round"] == 6, "the folder was released"


def test_a_real_file_size_limit_is_named(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE, SIGXFSZ ignored, in a subprocess): the state
    is written by torch.save's C++ writer, whose own error would say "unexpected pos"."""
    ck = str(tmp_path / "ck")
    child = _child(f"""
        fed = data.least_squares(num_clients=6, samples_per_client=400, dim=20, seed=0)  # ~200 KB of data
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (32_768, 32_768))
        try:
            pflcore.run(_alg(), fed, models.LeastSquares(20), rounds=2, checkpoint={ck!r}, progress=False)
        except ckpt.CheckpointError as exc:
            print(exc)
            sys.exit(3)
    """)
    out, err = child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == 3, err[-3000:]
    assert out.strip() == (f"checkpoint: cannot write {os.path.join(ck, 'federation.pt')}: file too large (EFBIG); "
                           "the file is larger than the file size limit (ulimit -f) or the file system allows")
    assert sorted(os.listdir(ck)) == [ckpt.FINGERPRINT, ckpt.LOCK], "no temporary, no partial federation.pt"


# ---- round files of another run ----------------------------------------------------------------

def _record(path):
    return torch.load(path, weights_only=False)


def _without_digest(path):
    """The file as the previous pflcore wrote it (no run digest)."""
    record = _record(path)
    del record["run"]
    torch.save(record, path)


@pytest.mark.parametrize("alien", ["other seed", "other clients", "other seed, old format"])
def test_a_round_file_of_another_run_is_skipped_with_a_warning(tmp_path, alien):
    """Row 6: another run's round files copied in as the newest rounds made resume crash with
    IndexError (other client count) or, worse, continue the other run's state silently (same
    shapes, other seed). They are skipped with a warning naming them, and resume goes on from
    the newest round of this run: the history is the uninterrupted run's."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    _run(str(ck), rounds=6)
    os.remove(ck / "round_0000006.pt")
    os.remove(ck / "round_0000005.pt")  # as if stopped after round 4
    _run(str(other), rounds=8, seed=1 if "seed" in alien else 0, clients=7 if "clients" in alien else 6)
    for t in (6, 8):
        shutil.copy(other / f"round_{t:07d}.pt", ck / f"round_{t:07d}.pt")
        if "old format" in alien:
            _without_digest(ck / f"round_{t:07d}.pt")
    with pytest.warns(RuntimeWarning) as caught:
        resumed = pflcore.resume(str(ck), progress=False)
    message = " ".join(str(w.message) for w in caught)
    for t in (8, 6):
        assert f"checkpoint: {ck / f'round_{t:07d}.pt'} belongs to another run (" in message, message
    why = {"other seed": r"\(run digest [0-9a-f]{12}… in the file, [0-9a-f]{12}… in run\.json\)",
           "other clients": r"\(run digest [0-9a-f]{12}… in the file",
           "other seed, old format": r"\(seed: 1 in the file, 0 in run\.json\)"}[alien]
    assert re.search(why, message), message
    assert "Resuming from round 4" in message and "the newest intact round of this run" in message
    assert _strip(resumed.history) == _strip(_run().history)


def test_a_round_file_whose_state_does_not_fit_is_skipped(tmp_path):
    """A round file of the previous format (no run digest) whose config matches but whose
    per-client state has 7 rows for this run's 6 clients is skipped, named, with the shapes."""
    ck = tmp_path / "ck"
    alg = A.LocalTrain(lr=0.05)
    full = pflcore.run(alg, _fed(), MODEL, rounds=6, progress=False)
    pflcore.run(alg, _fed(), MODEL, rounds=6, checkpoint=str(ck), checkpoint_every=2, progress=False)
    record = _record(ck / "round_0000006.pt")
    record["state"].theta = torch.cat([record["state"].theta, record["state"].theta[:1]])
    del record["run"]
    torch.save(record, ck / "round_0000006.pt")
    with pytest.warns(RuntimeWarning, match=r"round_0000006\.pt does not fit this run \(state\.theta has shape "
                                            r"\[7, 5\], expected 6 rows: one per client\)\. Resuming from round 4"):
        resumed = pflcore.resume(str(ck), progress=False)
    assert _strip(resumed.history) == _strip(full.history)
    assert torch.equal(resumed.personalized, full.personalized)


def test_round_files_of_the_previous_format_still_resume(tmp_path):
    """Round files written before records carried the run digest are this run's when their
    config and algorithm match run.json: resume uses them without a warning."""
    ck = tmp_path / "ck"
    _run(str(ck), rounds=6)
    for t in range(1, 7):
        _without_digest(ck / f"round_{t:07d}.pt")
    os.remove(ck / "round_0000006.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = pflcore.resume(str(ck), progress=False)
    assert _strip(resumed.history) == _strip(_run().history)
    assert "run" in _record(ck / "round_0000006.pt"), "the rewritten round carries the digest"


# ---- stress: three writers, kill -9, resume -----------------------------------------------------

def test_stress_three_writers_one_killed_then_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    """3 processes × 10 trials of the same 30-round run (checkpoint every round) into one folder
    per trial, retrying while refused; one is SIGKILLed at a random moment (every other trial:
    the lock's holder, mid-run). Every writer ends done (0) or killed (-9), never with an error;
    a fresh process's resume gives the uninterrupted history bitwise (timing columns aside);
    every round file holds that history up to its round; no temporary is left. The harness
    (tests/ckpt_stress_worker.py) forks every process from one interpreter: ~10 s here."""
    # On a loaded machine the holder may finish its 30 rounds before the random kill in all 10
    # trials: every batch's results are checked, and up to 3 batches run until one of them has
    # killed the holder mid-run (what the test is for).
    for attempt in range(3):
        if _stress_batch(tmp_path / f"batch{attempt}"):
            return
    raise AssertionError("no trial of 3 batches killed the lock's holder mid-run")


def _stress_batch(root) -> bool:
    """One batch of 10 trials, every result checked; whether a trial killed the holder mid-run."""
    root.mkdir()
    tmp_path = root
    seed = random.randrange(2 ** 31)
    spec = {"root": str(tmp_path), "trials": 10, "writers": 3, "seed": seed, "out": str(tmp_path / "report.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, os.path.join(HERE, "ckpt_stress_worker.py"), str(tmp_path / "spec.json")],
                          env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    baseline = report["baseline"]
    assert [row["round"] for row in baseline] == list(range(31))
    for trial in report["trials"]:
        where = f"seed {seed}, trial {trial['trial']}: {dict((k, trial[k]) for k in ('codes', 'victim', 'kill_at'))}"
        assert not trial["hung"], where
        assert sorted(set(trial["codes"]) - {0}) in ([], [-9]), f"{where}\n{done.stderr[-3000:]}"
        assert trial["codes"].count(-9) == (trial["victim"] is not None), where
        assert trial["check_code"] == 0, f"{where}\n{done.stderr[-3000:]}"
        assert trial["history"] == baseline, where
        assert trial["bad_rounds"] == [], where
        assert trial["temporaries"] == [], where
    trials = report["trials"]
    assert sum(sum(t["refusals"]) for t in trials) > 0, "the writers never met a held lock"
    return any(t["victim"] is not None and t["victim"] == t["holder"] and t["newest_at_kill"] != "round_0000030.pt"
               for t in trials)
