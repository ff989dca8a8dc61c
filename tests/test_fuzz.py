"""Fuzzing the public constructors, generators, ``pflcore.run``/``resume`` and the CLI.

Each target of ``fuzz_targets.TARGETS`` is called with arguments hypothesis draws (valid and
invalid mixed), in a worker process (``fuzz_worker.py``): the answer must be a correct result
(the target's check) or a ``ValueError`` that names one of the target's arguments; another
exception, a crash of the worker or an example running past its time limit fails the test, and
a fresh worker takes the next example. Hypothesis runs derandomized with a fixed number of
examples per target, so CI draws the same examples every time. The ops (``pflcore.ops``) are in
``fuzz_targets.OPS``: each is compared with its pure-torch reference on the same inputs.
"""
from __future__ import annotations

import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import fuzz_targets as F

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_worker.py")


class WorkerDied(Exception):
    pass


class Worker:
    """A long-lived worker process; replaced after a crash or a hang."""

    def __init__(self):
        self.proc = None
        self.log = None

    def _start(self):
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)
        if self._read(1, 120) != b"R":
            raise WorkerDied(f"the worker did not start:\n{self._stderr()}")

    def _stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def _read(self, n: int, timeout: float) -> bytes:
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None  # a hang
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return b""  # the worker died
            buf += chunk
        return buf

    def _fail(self, what: str):
        self.proc.kill()
        self.proc.wait()
        status = self.proc.returncode
        text = self._stderr()
        self.proc = None
        raise WorkerDied(f"{what} (worker exit status {status}):\n{text}")

    def call(self, name: str, args, kwargs, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        payload = pickle.dumps({"target": name, "args": args, "kwargs": kwargs})
        try:
            self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._fail("the worker was gone")
        head = self._read(8, timeout)
        if head is None:
            self._fail(f"no answer in {timeout:.0f} s: a hang")
        if head == b"":
            self._fail("the worker crashed")
        body = self._read(struct.unpack("<Q", head)[0], 60)
        if not body:
            self._fail("the worker died while answering")
        return pickle.loads(body)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _names_an_argument(message: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names if n)


def _known(name: str, text: str):
    """The known finding (fuzz_targets.KNOWN) that ``text`` matches, if any."""
    return next((why for pattern, why in F.KNOWN.get(name, ()) if re.search(pattern, text, re.S)), None)


@pytest.mark.parametrize("name", sorted(F.TARGETS))
def test_a_result_or_a_value_error_naming_an_argument(worker, name):
    target = F.TARGETS[name]
    seen, known = Counter(), Counter()

    def failing(text: str):
        why = _known(name, text)
        if why is None:
            pytest.fail(text)
        known[why] += 1

    @settings(max_examples=target.examples, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(target.args)
    def example(drawn):
        args, kwargs = drawn
        shown = f"{name}(*{args!r}, **{kwargs!r})"
        try:
            answer = worker.call(name, args, kwargs, target.timeout)
        except WorkerDied as exc:
            return failing(f"{shown}: {exc}")
        seen[answer["outcome"]] += 1
        if os.environ.get("FUZZ_VERBOSE"):
            print(answer["outcome"], shown[:300], answer["message"])
        if answer["outcome"] == "error":
            failing(f"{shown} raised {answer['type']}: {answer['message']}\n{answer['problem']}")
        elif answer["outcome"] == "ValueError":
            if not _names_an_argument(answer["message"], target.arg_names):
                failing(f"{shown}: the ValueError names none of {target.arg_names}: {answer['message']}")
        elif answer["problem"]:
            failing(f"{shown} returned a wrong result: {answer['problem']}")

    example()
    for why, count in known.items():
        warnings.warn(f"fuzz {name}: known finding hit {count} time(s): {why}", UserWarning)
    # both outcomes were drawn: the strategy reaches the valid and the invalid side
    assert seen["ok"] > 0, f"{name}: no example succeeded ({dict(seen)})"
    assert seen["ValueError"] > 0 or name == "pflcore run (CLI overrides)", \
        f"{name}: no example was refused ({dict(seen)})"


def test_every_public_op_is_fuzzed():
    """Each function and class that pflcore.ops exports (but the references, which the targets
    call beside their op, and the result type) has a target."""
    from pflcore import ops

    public = {n for n in ops.__all__ if not n.endswith("_ref") and n not in ("KMeans", "ClippedSum", "cluster_means")}
    assert {t.name[len("ops."):] for t in F.OPS} == public
