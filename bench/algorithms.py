"""Benchmark of one pFedMe round in pflcore against a per-client PyTorch loop.

What is measured (one process, same thread count everywhere, float32, fixed seeds):

Workload: m = 1,000 clients of Synthetic(0.5, 0.5) (``pflcore.data.synthetic``, dim 60,
10 classes, seed 0; client sizes CAPPED at ``--max-size`` rows, default 2,000, because the
uncapped lognormal sizes reach 10^5+ rows), model ``Softmax(60, 10)``, pFedMe with λ = 15,
η = 0.005, personal_lr = 0.01, K = 5 inner steps, R = 20 local rounds, batch size 20, β = 1,
``train_all=True`` (all m clients train; the 10 sampled clients are aggregated). The timed
round is t = 2, started from the state after one untimed round (so w ≠ 0).

  (a) pflcore: ``PFedMe.round(state, ctx, t)``; every repeat starts from a deep copy of the
      same state (the copy is not timed).
  (b) a per-client PyTorch loop, the way PFL libraries (e.g. the pFedMe reference code) run
      clients: one reused ``nn.Linear(60, 10)`` whose parameters are loaded per client,
      autograd on ``F.cross_entropy``, and the pFedMe optimizer's update
      θ ← θ − personal_lr·(∇f(θ; D) + λ(θ − w_local)); after the K steps of each local round
      w_local ← w_local − η λ (w_local − θ); at the end w ← (1 − β) w + β Σ_S p_i w_local_i
      (p renormalized over the sampled S). It uses exactly pflcore's minibatches
      (``ctx.batches(t, r, clients, 1, B)``; the draws are keyed by client id).

First (a) and (b) are checked to agree: max |Δ| of the new global w, of the personal models
θ_i and of the local models w_i, on the clients the loop runs (the first ``--slow-clients``,
at least 20, plus the sampled S, so that w is comparable too; all clients if 0). Then both
are timed, the loop on the first ``--slow-clients`` clients (default 100) and scaled linearly
by client count (every client costs the same: fixed-size minibatches), as stated in the
output and the JSON. Both are timed at torch's default thread count and at 1 thread and the
faster of each is kept: tiny per-client torch ops gain nothing from 2 threads and lose much
to spinning threads on a busy machine, so this keeps the baseline at its best. Reported: the
time per round of (a) and (b), (b)/(a) (target ≥ 20), the client-steps per second of (a)
(m·R·K per round), and where (a)'s round goes: the share inside the native kernel
``pflcore._core.local_steps``, in the rest of the ``ops.local_steps`` wrapper (input
validation), in ``ctx.batches`` (minibatch sampling) and elsewhere in ``round`` (measured in
separate instrumented rounds at (a)'s faster thread count, timers wrapped around those
functions).

Times are the best of ``--repeats`` runs (time.perf_counter); the slow loop uses at most 3.
The 1-minute load average is recorded (a 2-core machine shared with other processes gives
noisy timings).

Run from the repository root:

    python bench/algorithms.py              # default sizes, ~3 minutes on 2 cores
    python bench/algorithms.py --quick      # m = 100 clients, loop on 20, a smoke run (~1 min)

It prints a table (name, time, value, target, pass/fail) and writes all numbers, the machine
and a timestamp to ``--out`` (default bench/results/algorithms.json).

Also: the server-side cost of Anderson acceleration, as the share of an ``Accelerated(FedPi,
memory=5)`` round on the same clients (all participating, state [m, d]) spent in
``Anderson.step`` (target <= 5%).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import pflcore
from pflcore import backend
from pflcore.algorithms import Context, PFedMe
from pflcore.models import Softmax

from kernels import best_of, machine_extra, passed, print_table  # same style and helpers

HERE = os.path.dirname(os.path.abspath(__file__))
HYPER = dict(lam=15.0, lr=0.005, personal_lr=0.01, inner_steps=5, local_rounds=20, beta=1.0, batch_size=20,
             train_all=True)


def torch_loop(ctx, w, t, clients, S, lam, lr, personal_lr, inner_steps, local_rounds, beta, batch_size,
               **_):
    """(b): returns (theta [n, d], w_local [n, d], new w or None when S ⊄ clients), rows in
    pflcore's layout [p+1, C] flattened (W = weightᵀ, intercept row last)."""
    model, (x, y) = ctx.model, (ctx.train.x, ctx.train.y)
    p, C = model.p, model.C
    clients = torch.as_tensor(clients, dtype=torch.int64)
    n = clients.numel()
    # Exactly pflcore's minibatches: [n, R, B] absolute row indices.
    idx = torch.stack([ctx.batches(t, r, clients, 1, batch_size)[:, 0] for r in range(local_rounds)], 1).long()
    W = w.view(p + 1, C)
    w_weight, w_bias = W[:p].T.contiguous(), W[p].clone()
    lin = torch.nn.Linear(p, C)
    params = (lin.weight, lin.bias)
    theta_out, wloc_out = torch.empty(n, model.d), torch.empty(n, model.d)
    for j in range(n):
        with torch.no_grad():
            lin.weight.copy_(w_weight)
            lin.bias.copy_(w_bias)
        local = (w_weight.clone(), w_bias.clone())  # w_i ← w
        for r in range(local_rounds):
            xb, yb = x[idx[j, r]], y[idx[j, r]]
            for _ in range(inner_steps):
                lin.zero_grad()
                F.cross_entropy(lin(xb), yb).backward()
                with torch.no_grad():  # the pFedMe optimizer's step
                    for prm, a in zip(params, local):
                        prm.sub_(personal_lr * (prm.grad + lam * (prm - a)))
            with torch.no_grad():
                for prm, a in zip(params, local):
                    a.sub_(lr * lam * (a - prm))
        with torch.no_grad():
            theta_out[j] = torch.cat([lin.weight.T, lin.bias[None]]).reshape(-1)
            wloc_out[j] = torch.cat([local[0].T, local[1][None]]).reshape(-1)
    pos = {int(c): j for j, c in enumerate(clients)}
    if not all(int(s) in pos for s in S):
        return theta_out, wloc_out, None
    pS = ctx.weights[S]
    mean = (pS[:, None] * wloc_out[[pos[int(s)] for s in S]]).sum(0) / pS.sum()
    return theta_out, wloc_out, (1 - beta) * w + beta * mean


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def instrumented(ctx):
    """Accumulates the time spent in ctx.batches, ops.local_steps and _core.local_steps."""
    import pflcore.algorithms.pfedme as pfedme_mod
    acc = dict(batches=0.0, local_steps=0.0, kernel=0.0)
    core = backend._load("native")[0]

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
        return wrapper

    orig_ops, orig_core, orig_batches = pfedme_mod.ops.local_steps, core.local_steps, ctx.batches
    pfedme_mod.ops.local_steps = timed("local_steps", orig_ops)
    core.local_steps = timed("kernel", orig_core)
    ctx.batches = timed("batches", orig_batches)
    try:
        yield acc
    finally:
        pfedme_mod.ops.local_steps, core.local_steps = orig_ops, orig_core
        del ctx.batches  # back to the method


def bench(args, m):
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, max_size=args.max_size)
    model = Softmax(60, 10)
    ctx = Context(fed, model, torch.device("cpu"), seed=0, clients_per_round=10)
    alg = PFedMe(**HYPER)
    R, K = HYPER["local_rounds"], HYPER["inner_steps"]
    state0 = alg.round(alg.init(ctx), ctx, 1)  # untimed: w ≠ 0 for the timed round
    t = 2
    S = ctx.sample_clients(t)
    sizes = fed.train.sizes
    print(f"[pFedMe] m={m} clients, train rows {int(sizes.sum())} (sizes capped at {args.max_size}: "
          f"{int((sizes + fed.test.sizes >= args.max_size).sum())} clients hit the cap), d={model.d}, "
          f"R={R}, K={K}, B={HYPER['batch_size']}, S={S.tolist()}")

    # ---- agreement (also the warm-up) ----
    st_a = alg.round(copy.deepcopy(state0), ctx, t)
    if args.slow_clients is None or args.slow_clients >= m:
        check = torch.arange(m)
    else:
        check = torch.unique(torch.cat([torch.arange(min(m, max(20, args.slow_clients))), S]))
    with threads(1):  # the same math at any thread count; 1 is the fastest for the loop
        th_b, wl_b, w_b = torch_loop(ctx, state0.w, t, check, S, **HYPER)
    d_theta = float((th_b - st_a.theta[check]).abs().max())
    d_wloc = float((wl_b - st_a.w_local[check]).abs().max())
    d_w = float((w_b - st_a.w).abs().max())
    moved = float((st_a.theta[check] - state0.w).abs().max())
    print(f"[agreement] on {check.numel()} clients: max|Δw| = {d_w:.2e}, max|Δθ| = {d_theta:.2e}, "
          f"max|Δw_local| = {d_wloc:.2e} (tolerance 1e-4; θ moved from w by up to {moved:.2e})")

    # ---- timings at torch's default thread count and at 1 thread; the best of each is kept ----
    ms = m if args.slow_clients is None else min(m, args.slow_clients)
    slow_reps = max(1, min(args.repeats, 3))
    times_a, times_b = {}, {}
    for th in sorted({torch.get_num_threads(), 1}, reverse=True):
        with threads(th), backend.use("native"):
            times_a[th] = best_of(lambda s: alg.round(s, ctx, t), args.repeats, lambda: copy.deepcopy(state0))
            # (b) on all clients or the first --slow-clients, scaled by client count.
            times_b[th] = m / ms * best_of(
                lambda _: torch_loop(ctx, state0.w, t, torch.arange(ms), S, **HYPER), slow_reps)
        print(f"[timing] {th} thread(s): (a) {times_a[th]:.4f} s, (b) {times_b[th]:.4f} s per round")
    t_a, t_b = min(times_a.values()), min(times_b.values())
    # Instrumented rounds at (a)'s faster thread count: where the time goes (the fastest run).
    best, th_a = None, min(times_a, key=times_a.get)
    with threads(th_a), backend.use("native"):
        for _ in range(args.repeats):
            s = copy.deepcopy(state0)
            with instrumented(ctx) as acc:
                t0 = time.perf_counter()
                alg.round(s, ctx, t)
                acc["round"] = time.perf_counter() - t0
            if best is None or acc["round"] < best["round"]:
                best = acc

    steps = m * R * K
    return dict(
        m=m, dataset="synthetic(0.5, 0.5), dim 60, 10 classes, seed 0", max_size=args.max_size,
        sizes_capped=True, clients_at_cap=int((sizes + fed.test.sizes >= args.max_size).sum()),
        train_rows=int(sizes.sum()), model=repr(model), hyperparameters=HYPER, round=t, sampled=S.tolist(),
        agreement_clients=int(check.numel()), max_abs_diff_w=d_w, max_abs_diff_theta=d_theta,
        max_abs_diff_w_local=d_wloc, max_abs_update_theta=moved, tolerance=1e-4,
        time_pflcore_s=t_a, time_torch_loop_s=t_b, time_pflcore_by_threads_s=times_a,
        time_torch_loop_by_threads_s=times_b, threads_pflcore=th_a,
        threads_torch_loop=min(times_b, key=times_b.get), torch_loop_clients=ms, torch_loop_scaled=ms < m,
        torch_loop_scale=m / ms, torch_loop_repeats=slow_reps, ratio_loop_over_pflcore=t_b / t_a,
        client_steps=steps, client_steps_per_s=steps / t_a, torch_loop_client_steps_per_s=steps / t_b,
        instrumented_threads=th_a, instrumented_round_s=best["round"], time_in_kernel_s=best["kernel"],
        time_in_ops_local_steps_s=best["local_steps"], time_in_batches_s=best["batches"],
        kernel_share=best["kernel"] / best["round"], ops_local_steps_share=best["local_steps"] / best["round"],
        validation_share=(best["local_steps"] - best["kernel"]) / best["round"],
        batches_share=best["batches"] / best["round"],
        other_share=1 - (best["local_steps"] + best["batches"]) / best["round"])


def bench_anderson_share(args, m):
    """Server-side cost of Anderson acceleration (issue: operator splitting): the share of an
    accelerated FedPi round (Softmax 60×10, m clients, all participating, 10 prox steps) spent in
    ``Anderson.step`` on the [m, d] state. Target ≤ 5%."""
    from pflcore.algorithms import Accelerated, FedPi
    from pflcore.ops.anderson import Anderson

    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, max_size=args.max_size)
    ctx = Context(fed, Softmax(60, 10), torch.device("cpu"), seed=0)
    alg = Accelerated(FedPi(eta=0.5, prox_steps=10), memory=5)
    state = alg.init(ctx)
    for t in range(1, 8):  # fill the history (memory + 1 pairs)
        state = alg.round(state, ctx, t)
    spent = []
    real_step = Anderson.step

    def timed_step(self, u, tu):
        t0 = time.perf_counter()
        out = real_step(self, u, tu)
        spent.append(time.perf_counter() - t0)
        return out

    rounds = []
    Anderson.step = timed_step
    try:
        for t in range(8, 8 + max(3, args.repeats)):
            t0 = time.perf_counter()
            state = alg.round(state, ctx, t)
            rounds.append(time.perf_counter() - t0)
    finally:
        Anderson.step = real_step
    share = min(a / r for a, r in zip(spent, rounds))
    return dict(m=m, d=ctx.d, state_shape=[m, ctx.d], memory=5, round_s=min(rounds), anderson_step_s=min(spent),
                anderson_share=share)


def rows_of(r):
    sc = f", scaled from {r['torch_loop_clients']}" if r["torch_loop_scaled"] else ""
    return [
        ("agreement: max|Δw| global model", None, r["max_abs_diff_w"], 1e-4, "le"),
        ("agreement: max|Δθ| personal models", None, r["max_abs_diff_theta"], 1e-4, "le"),
        ("agreement: max|Δw_i| local models", None, r["max_abs_diff_w_local"], 1e-4, "le"),
        (f"pFedMe round, pflcore (a), m={r['m']}, {r['threads_pflcore']} thr", r["time_pflcore_s"], None, None, None),
        (f"torch loop round (b)/(a), {r['threads_torch_loop']} thr" + sc, r["time_torch_loop_s"], r["ratio_loop_over_pflcore"], 20, "ge"),
        ("(a) client-steps per second", None, r["client_steps_per_s"], None, None),
        ("(b) client-steps per second", None, r["torch_loop_client_steps_per_s"], None, None),
        ("(a) share in _core.local_steps (kernel)", r["time_in_kernel_s"], r["kernel_share"], None, None),
        ("(a) share in ops.local_steps validation", None, r["validation_share"], None, None),
        ("(a) share in ctx.batches (sampling)", r["time_in_batches_s"], r["batches_share"], None, None),
        ("(a) share elsewhere in round()", None, r["other_share"], None, None),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="m = 100 clients, a smoke run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "algorithms.json"), help="JSON output path")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (best is kept)")
    ap.add_argument("--slow-clients", type=int, default=100,
                    help="time the torch loop on this many clients and scale by client count (default 100; "
                         "0 = all)")
    ap.add_argument("--max-size", type=int, default=2000, help="cap on the rows of a client (train + test)")
    args = ap.parse_args()
    m = 100 if args.quick else 1000
    if args.quick:
        args.slow_clients = min(args.slow_clients or 20, 20)
    if not args.slow_clients:
        args.slow_clients = None
    if args.quick:
        args.repeats = min(args.repeats, 3)

    status = backend.status()
    if not status["native"][0]:
        raise SystemExit(f"the native backend is not available: {status['native'][1]}")
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: 1-minute load average is {load_start:.2f} before starting; other processes "
              f"compete for the {os.cpu_count()} cores and the timings will be noisy")
    t0 = time.perf_counter()
    results = {"pfedme_round": bench(args, m)}
    results["anderson_share"] = bench_anderson_share(args, m)
    a = results["anderson_share"]
    rows = rows_of(results["pfedme_round"]) + [
        (f"FedPi+Anderson round, m={a['m']}, state {a['m']}x{a['d']}", a["round_s"], None, None, None),
        ("Anderson.step share of the round", a["anderson_step_s"], a["anderson_share"], 0.05, "le")]
    print_table(rows)
    results["table"] = [dict(name=n, time_s=t, value=v, target=tg, sense=s, passed=passed(v, tg, s))
                        for n, t, v, tg, s in rows]
    results["machine"] = dict(
        torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(), platform=platform.platform(),
        python=platform.python_version(), torch=torch.__version__, pflcore=pflcore.__version__,
        backends={k: list(v) for k, v in status.items()}, loadavg_1min_start=load_start,
        loadavg_1min_end=os.getloadavg()[0], **machine_extra())
    results["config"] = dict(quick=args.quick, repeats=args.repeats, slow_clients=args.slow_clients,
                             max_size=args.max_size)
    results["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    results["total_wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out} ({results['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
