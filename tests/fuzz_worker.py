"""The process the fuzz suite (tests/test_fuzz.py) runs its examples in.

It reads cases from stdin and answers each on stdout, both as length-prefixed pickles:
a case is ``{"target": NAME, "args": [...], "kwargs": {...}}``; the answer is
``{"outcome": "ok" | "ValueError" | "error", "type": ..., "message": ..., "problem": ...}``
where ``problem`` is what the target's check found wrong with a result (None if it is right).
The target's callable and check come from ``fuzz_targets.TARGETS``. A crash of this process
(a signal, an abort) or a case that does not answer in time is seen by the test, which fails
the example and starts a new worker; pytest itself is never at risk.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
import warnings


def _read(stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # Answers go to the original stdout; anything the code under test prints goes to stderr.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")  # warnings are not failures here; the tests of each module check them
    import fuzz_targets  # noqa: E402  (after the redirection: importing pflcore may print)

    requests = sys.stdin.buffer
    answers.write(b"R")  # ready
    answers.flush()
    while True:
        head = _read(requests, 8)
        if not head:
            return
        case = pickle.loads(_read(requests, struct.unpack("<Q", head)[0]))
        answer = fuzz_targets.execute(case)
        try:
            payload = pickle.dumps(answer)
        except Exception:  # an unpicklable message: send its text only
            answer = {k: (v if isinstance(v, (str, type(None))) else repr(v)) for k, v in answer.items()}
            payload = pickle.dumps(answer)
        answers.write(struct.pack("<Q", len(payload)) + payload)
        answers.flush()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # the protocol itself broke: say so on stderr, exit non-zero
        traceback.print_exc()
        sys.exit(3)
