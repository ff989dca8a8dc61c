"""Ops in a process started by fork() (issue 28, row 1): GNU libgomp's worker threads do not
survive fork, so a child that entered a parallel region of the pool its parent had started
waited forever. Each case runs in its own interpreter with a timeout: a hang fails the test
instead of stopping the suite."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")

# Ops large enough to enter their parallel regions (kmeans_assign above 2^16 N·K·d, average above
# 2^18 R·d, the GLM step always), plus torch's own parallel reduction: the parent runs them first
# so that the OpenMP pool exists when it forks.
WORK = textwrap.dedent(r"""
    import hashlib, os, sys, torch, pflcore
    from pflcore import ClientData, backend, models, ops

    def work():
        g = torch.Generator().manual_seed(0)
        sizes = torch.randint(20, 60, (400,), generator=g)
        off = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        n = int(off[-1])
        data = ClientData(torch.randn(n, 60, generator=g), torch.randint(0, 10, (n,), generator=g), off)
        model = models.Softmax(60, 10)
        theta = 0.1 * torch.randn(400, model.d, generator=g)
        ops.local_steps(model, theta, data, steps=3, lr=0.1, prox=0.5, anchor=theta.mean(0))
        x = torch.randn(20000, 64, generator=g)
        labels = ops.kmeans_assign(x, x[:16].clone())
        labels = labels[0] if isinstance(labels, tuple) else labels
        mean = ops.average(torch.randn(1000, 610, generator=g), torch.rand(1000, generator=g))
        total = float(torch.randn(4_000_000, generator=g).double().sum())  # torch's own pool
        h = hashlib.sha256()
        for t in (theta, labels, mean):  # pflcore's bits do not depend on the thread count; torch's sum's do
            h.update(t.numpy().tobytes())
        return h.hexdigest() + ":" + format(round(total, 3), ".3f")
""")

CASES = {
    "os.fork": r"""
        parent, threads_before = work(), pflcore.get_num_threads()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, (work() + " " + str(backend.forked_child()) + " "
                         + str(pflcore.get_num_threads())).encode())
            os._exit(0)
        os.close(w)
        child = os.read(r, 4096).decode()
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        digest, forked, threads = child.split()
        assert digest == parent, (digest, parent)
        assert forked == "True" and threads == "1", child
        assert not backend.forked_child() and pflcore.get_num_threads() == threads_before  # the parent's own
        print("ok")
    """,
}
for method in ("fork", "forkserver", "spawn"):
    CASES[f"multiprocessing {method}"] = f"""
        import multiprocessing as mp

        def child(_):
            return work(), backend.forked_child()

        if __name__ == "__main__":
            parent = work()
            with mp.get_context({method!r}).Pool(2) as pool:
                results = pool.map(child, range(4))
            assert all(d == parent for d, _ in results), (results, parent)
            assert all(f == ({method!r} == "fork") for _, f in results), results
            print("ok")
    """


def _run(script: str, folder, timeout: float = 180) -> subprocess.CompletedProcess:
    path = folder / "script.py"  # a file, not -c: 'spawn' and 'forkserver' workers import its functions
    path.write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="3")  # a pool of workers even on a 1-core machine
    try:
        return subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=folder)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script hung (no result in {timeout} s): the forked child waits for OpenMP workers")


@pytest.mark.parametrize("case", list(CASES))
def test_ops_in_a_child_process_finish_with_the_parents_bits(case, tmp_path):
    out = _run(WORK + textwrap.dedent(CASES[case]), tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_forked_child_refuses_more_threads_with_a_message(tmp_path):
    script = WORK + textwrap.dedent(r"""
        work()
        pid = os.fork()
        if pid == 0:
            try:
                pflcore.set_num_threads(4)
            except ValueError as exc:
                ok = "fork" in str(exc) and "spawn" in str(exc) and "got 4" in str(exc)
                pflcore.set_num_threads(1)  # one thread stays allowed
                os._exit(0 if ok else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        print("ok")
    """)
    out = _run(script, tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_fork_from_native_code_makes_the_native_module_serial(tmp_path):
    """pthread_atfork in the native module: a fork that bypasses Python's os.fork hooks (here
    libc's fork through ctypes, as a C extension would) still leaves the child serial."""
    script = WORK + textwrap.dedent(r"""
        import ctypes
        work()
        core = backend.loaded("native")
        assert not core.forked_child()
        pid = ctypes.CDLL(None).fork()
        if pid == 0:
            ok = core.forked_child() and core.get_num_threads() == 1
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        print("ok")
    """)
    out = _run(script, tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
