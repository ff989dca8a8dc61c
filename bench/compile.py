"""The ops under ``torch.compile`` (issue 18, DESIGN.md §8), measured in one process.

(1) What the compile hook costs eager callers. Each public op's first line is one branch,
    ``if is_dynamo_compiling() or is_exporting():`` (``torch.compiler``), routing to the custom
    op ``torch.ops.pflcore.<op>`` inside ``torch.compile`` and ``torch.export``. Timed on the small call the op boundary is held to: 1 client of
    200 rows, 1 step, a minibatch of B = 20 (``Softmax(60, 10)``, float32, native backend):
      - ``ops.local_steps`` as shipped (with the branch);
      - the same function without the branch (this file's copy of the op's body before the hook:
        the algorithm guard, then ``run_local_steps``), and with ``torch.compiler.is_compiling()``
        as the branch's test (the alternative);
      - the branch's test alone, and ``torch.compiler.is_compiling()`` (the same answer where it
        matters, and a third function call);
      - a torch ``[200, 60] @ [60, 10]`` matmul (the boundary's yardstick).
    Times are CPU time per call (``time.thread_time_ns`` around loops of ``--calls`` calls), the
    minimum over ``--repeats`` rounds in which they alternate; the branch's cost is the median
    over the rounds of (with the branch − without), which is steadier than the difference of
    the minima when both are ~8 µs. Target: the branch adds <= 0.1 µs.

(2) What a compiled caller pays per call: a ``torch.compile(fullgraph=True)`` function calling
    the same small ``ops.local_steps`` (the custom op in an Inductor graph) vs the eager call;
    and one FedProx-like round on 1,000 clients (``sample_batches``, ``local_steps`` with a prox
    anchor, ``evaluate``, ``average``) compiled vs eager, where the ops' own work dominates. The
    compiled results are checked bitwise against eager first.

    python bench/compile.py --threads 1   # ~1 minute (two compilations); how the README's figures ran
    python bench/compile.py --quick       # fewer calls and repeats

Writes ``--out`` (default bench/results/compile.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5_000, help="calls per timed loop (small calls)")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--clients", type=int, default=1_000, help="clients of the compiled round")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of torch and OpenMP (pflcore's kernels, Inductor's); default: theirs")
    ap.add_argument("--quick", action="store_true", help="fewer calls and repeats (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compile.json"))
    return ap


if __name__ == "__main__":
    ARGS = parser().parse_args()
    if ARGS.threads:  # before torch and the OpenMP runtime start
        os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
from torch.compiler import is_compiling  # noqa: E402  (imported as the ops import theirs)

from pflcore import ClientData, models, ops  # noqa: E402
from pflcore.ops import _compile  # noqa: E402
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm  # noqa: E402
from pflcore.ops.local_steps import run_local_steps  # noqa: E402

from _harness import print_table, torch_threads, warn_if_busy, write_json  # noqa: E402

P, C, ROWS, BATCH = 60, 10, 200, 20
MODEL = models.Softmax(P, C)


def local_steps_without_hook(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                             grad_scale=None):
    """``ops.local_steps`` as it was before the compile hook (same signature, same body)."""
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("local_steps")
    return run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, False)


def local_steps_is_compiling(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                              grad_scale=None):
    """The alternative hook: ``torch.compiler.is_compiling()`` as the test."""
    if is_compiling():
        return _compile.traced_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale)
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm("local_steps")
    return run_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale, False)


def small_workload():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, P, generator=g)
    y = torch.randint(0, C, (ROWS,), generator=g)
    data = ClientData(x, y, torch.tensor([0, ROWS]))
    theta = MODEL.zeros(1)
    b = ops.sample_batches(data, steps=1, batch_size=BATCH, seed=3, counter=7)
    return data, theta, b, x, torch.randn(P, C, generator=g)


def per_call_ns(fn, calls: int) -> float:
    t0 = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - t0) / calls


def bench_hook(calls: int, repeats: int):
    data, theta, b, x, w = small_workload()
    from torch.compiler import is_dynamo_compiling, is_exporting
    shipped, without, alternative = ops.local_steps, local_steps_without_hook, local_steps_is_compiling
    fns = {  # called alike (local names)
        "ops.local_steps (with the hook)": lambda: shipped(MODEL, theta, data, steps=1, lr=0.05, batches=b),
        "the same without the hook": lambda: without(MODEL, theta, data, steps=1, lr=0.05, batches=b),
        "the same, hook testing is_compiling()": lambda: alternative(MODEL, theta, data, steps=1, lr=0.05,
                                                                      batches=b),
        "the branch's test": lambda: is_dynamo_compiling() or is_exporting(),
        "torch.compiler.is_compiling()": lambda: is_compiling(),
        "matmul [200, 60] @ [60, 10]": lambda: x @ w,
    }
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        per_call_ns(fn, calls // 10 + 1)
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(per_call_ns(fn, calls) / 1000)  # µs
    best = {k: min(v) for k, v in times.items()}
    # The branch's cost is below the spread of the minima (~0.1 µs on a busy machine): the
    # median of the per-round differences, each round timing both functions back to back, is
    # the steadier figure.
    base = times["the same without the hook"]
    added = {k: statistics.median(a - b for a, b in zip(times[k], base))
             for k in ("ops.local_steps (with the hook)", "the same, hook testing is_compiling()")}
    return best, added


def best_alternating(fns, repeats: int, measure):
    """The best of ``repeats`` measurements of each function, taken in turn (the machine's load
    then weighs on all of them alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], measure(fn))
    return best


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_compiled_small(calls: int, repeats: int):
    data, theta, b, _, _ = small_workload()

    def step(th):
        return ops.local_steps(MODEL, th, data, steps=1, lr=0.05, batches=b)

    compiled = torch.compile(step, fullgraph=True)
    t0 = time.perf_counter()
    a = compiled(theta.clone())
    compile_s = time.perf_counter() - t0
    assert torch.equal(a, step(theta.clone())), "compiled local_steps disagrees with eager"
    th = theta.clone()
    eager_ns, compiled_ns = best_alternating([lambda: step(th), lambda: compiled(th)], repeats,
                                             lambda fn: per_call_ns(fn, calls))
    return compile_s, eager_ns / 1000, compiled_ns / 1000


def bench_compiled_round(m: int, repeats: int):
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(20, 100, (m,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    N = int(offsets[-1])
    data = ClientData(torch.randn(N, P, generator=g), torch.randint(0, C, (N,), generator=g), offsets)
    w0 = torch.randn(MODEL.d, generator=g) * 0.01

    def fedprox_round(w, counter: int):
        theta = w.expand(m, MODEL.d).contiguous()
        b = ops.sample_batches(data, steps=5, batch_size=BATCH, seed=0, counter=counter)
        ops.local_steps(MODEL, theta, data, steps=5, lr=0.05, prox=0.1, anchor=w, batches=b)
        loss, correct, count = ops.evaluate(MODEL, theta, data)
        return ops.average(theta, count.to(theta.dtype)), loss / count  # (a torch sum would differ by its order)

    compiled = torch.compile(fedprox_round, fullgraph=True)
    t0 = time.perf_counter()
    out_c = compiled(w0, 1)
    compile_s = time.perf_counter() - t0
    out_e = fedprox_round(w0, 1)
    assert all(torch.equal(p, q) for p, q in zip(out_c, out_e)), "compiled round disagrees with eager"
    eager_s, compiled_s = best_alternating([lambda: fedprox_round(w0, 1), lambda: compiled(w0, 1)], repeats,
                                           seconds)
    return compile_s, eager_s, compiled_s


def main(args):
    if args.quick:
        args.calls, args.repeats, args.clients = 1_000, 5, 200
    warn_if_busy()
    with torch_threads(args.threads or torch.get_num_threads()):
        run(args)


def run(args):
    hook, added = bench_hook(args.calls, args.repeats)
    with_hook = hook["ops.local_steps (with the hook)"]
    matmul = hook["matmul [200, 60] @ [60, 10]"]
    c_small = bench_compiled_small(args.calls // 4, 15)
    c_round = bench_compiled_round(args.clients, 15)

    rows = [(f"{k} [µs]", None, v, None, None) for k, v in hook.items()]
    rows += [("hook's added cost per call [µs] (median paired difference)", None,
              added["ops.local_steps (with the hook)"], 0.1, "le"),
             ("  the same, an is_compiling() hook", None, added["the same, hook testing is_compiling()"], None, None),
             ("small local_steps / matmul (with the hook)", None, with_hook / matmul, None, None),
             ("small local_steps, compiled fullgraph: per call [µs]", None, c_small[2], None, None),
             ("small local_steps, compiled / eager", None, c_small[2] / c_small[1], None, None),
             (f"FedProx-like round, {args.clients} clients: eager", c_round[1], None, None, None),
             (f"FedProx-like round, {args.clients} clients: compiled / eager", c_round[2], c_round[2] / c_round[1],
              None, None)]
    print_table(rows)
    print(f"compile time: small call {c_small[0]:.1f} s, round {c_round[0]:.1f} s")
    results = {"small_call_us": hook, "added_us": added, "hook_target_us": 0.1,
               "compiled_small_call": {"compile_s": c_small[0], "eager_us": c_small[1], "compiled_us": c_small[2]},
               "compiled_round": {"clients": args.clients, "compile_s": c_round[0], "eager_s": c_round[1],
                                  "compiled_s": c_round[2]},
               "args": vars(args)}
    print("wrote", write_json(args.out, results))


if __name__ == "__main__":
    main(ARGS)
