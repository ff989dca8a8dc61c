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

    python bench/algorithms.py              # default sizes, all parts
    python bench/algorithms.py --quick      # m = 100 clients, loop on 20, a smoke run (~1 min)
    python bench/algorithms.py --only pfedme_round_mlp    # one part; the others' entries are kept

It prints a table (name, time, value, target, pass/fail) and writes all numbers, the machine
and a timestamp to ``--out`` (default bench/results/algorithms.json).

Also: the server-side cost of Anderson acceleration, as the share of an ``Accelerated(FedPi,
memory=5)`` round on the same clients (all participating, state [m, d]) spent in
``Anderson.step`` (target <= 5%).

Part ``pfedme_round_mlp``: the same pFedMe round (same clients, hyperparameters, minibatches and
timing protocol) with the one-hidden-layer network ``MLP(60, 100, 10)`` (ReLU; d = 7,110) on the
same 60-dimensional Synthetic(0.5, 0.5) inputs; the MNIST DNN ``MLP(784, 100, 10)`` is not used
because 1,000 clients of the 5,000-image MNIST subset would hold 5 images each. Compared:

  (a) pflcore's batched path for MLPs (``ops._nets.HAND_WRITTEN_MLP = True``, the default:
      forward/backward of all clients of a chunk with ``torch.baddbmm``, the update fused into
      the weight-gradient GEMM);
  (a') pflcore's generic torch.func path (``HAND_WRITTEN_MLP = False``: ``vmap(grad(loss))``
      over the clients of a chunk), reported as a second ratio;
  (b) a per-client loop of one reused ``torch.nn`` module (``model.module()``, the same
      nn.Sequential(Linear, ReLU, Linear)): parameters loaded per client with
      ``vector_to_parameters``, autograd on ``F.cross_entropy``, the pFedMe optimizer's update
      on every parameter tensor, exactly as in (b) above.

Agreement of (a), (a') and (b) is checked as above (tolerance 1e-4; float32 GEMMs in a different
order). Target (b)/(a) >= 5 on the CPU.

Parts: ``--only pfedme_round`` / ``pfedme_round_mlp`` / ``anderson_share`` (repeatable; default
all). The JSON at ``--out`` is updated, not replaced: the parts run now overwrite their own
entries and the others are kept as they were, each part carrying its own ``measured`` record
(timestamp, git commit, load average); ``table`` lists the rows of every part in the file.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time

import torch
import torch.nn.functional as F

import pflcore
from pflcore import backend
from pflcore.algorithms import Context, PFedMe
from pflcore.models import MLP, Softmax

from _harness import (best_of, loadavg, machine_info, now, print_table, read_json, rows_from, torch_threads, warn_if_busy,
                      write_json)

HERE = os.path.dirname(os.path.abspath(__file__))
HYPER = dict(lam=15.0, lr=0.005, personal_lr=0.01, inner_steps=5, local_rounds=20, beta=1.0, batch_size=20,
             train_all=True)


def _pfedme_client_loop(ctx, w, t, clients, S, net, params, load, flatten, input_view, lam, lr, personal_lr,
                        inner_steps, local_rounds, beta, batch_size, train_all=True):
    """The per-client pFedMe loop shared by (b) for every model: ``net`` is one reused module whose
    parameter tensors ``params`` are loaded from a flat pflcore row by ``load(vec, tensors)`` and
    read back by ``flatten(tensors)``; autograd, then the pFedMe optimizer's update
    θ ← θ − personal_lr·(∇f(θ; D) + λ(θ − w_local)) per tensor. Returns (theta [n, d],
    w_local [n, d], new w or None when S ⊄ clients). ``train_all`` is pFedMe's (HYPER): the loop
    trains exactly ``clients``."""
    model, (x, y) = ctx.model, (ctx.train.x, ctx.train.y)
    clients = torch.as_tensor(clients, dtype=torch.int64)
    n = clients.numel()
    # Exactly pflcore's minibatches: [n, R, B] absolute row indices.
    idx = torch.stack([ctx.batches(t, r, clients, 1, batch_size)[:, 0] for r in range(local_rounds)], 1).long()
    local = [torch.empty_like(q) for q in params]
    theta_out, wloc_out = torch.empty(n, model.d, dtype=w.dtype), torch.empty(n, model.d, dtype=w.dtype)
    for j in range(n):
        with torch.no_grad():
            load(w, params)          # θ ← w
            load(w, local)           # w_i ← w
        for r in range(local_rounds):
            xb, yb = input_view(x[idx[j, r]]), y[idx[j, r]]
            for _ in range(inner_steps):
                net.zero_grad()
                F.cross_entropy(net(xb), yb).backward()
                with torch.no_grad():  # the pFedMe optimizer's step
                    for prm, a in zip(params, local):
                        prm.sub_(personal_lr * (prm.grad + lam * (prm - a)))
            with torch.no_grad():
                for prm, a in zip(params, local):
                    a.sub_(lr * lam * (a - prm))
        with torch.no_grad():
            theta_out[j] = flatten(params)
            wloc_out[j] = flatten(local)
    pos = {int(c): j for j, c in enumerate(clients)}
    if not all(int(s) in pos for s in S):
        return theta_out, wloc_out, None
    pS = ctx.weights[S]
    mean = (pS[:, None] * wloc_out[[pos[int(s)] for s in S]]).sum(0) / pS.sum()
    return theta_out, wloc_out, (1 - beta) * w + beta * mean


def torch_loop(ctx, w, t, clients, S, **hyper):
    """(b) for Softmax: one reused ``nn.Linear(p, C)``; rows in pflcore's layout [p+1, C]
    flattened (W = weightᵀ, intercept row last)."""
    p, C = ctx.model.p, ctx.model.C
    lin = torch.nn.Linear(p, C)

    def load(vec, tensors):
        W = vec.view(p + 1, C)
        tensors[0].copy_(W[:p].T)
        tensors[1].copy_(W[p])

    def flatten(tensors):
        return torch.cat([tensors[0].T, tensors[1][None]]).reshape(-1)
    return _pfedme_client_loop(ctx, w, t, clients, S, lin, [lin.weight, lin.bias], load, flatten, lambda xb: xb,
                               **hyper)


threads = torch_threads


@contextlib.contextmanager
def instrumented(ctx):
    """Accumulates the time spent in ctx.batches, ops.local_steps and _core.local_steps."""
    import pflcore.algorithms.pfedme as pfedme_mod
    acc = dict(batches=0.0, local_steps=0.0, kernel=0.0)
    core = backend.loaded("native")

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
                lambda: torch_loop(ctx, state0.w, t, torch.arange(ms), S, **HYPER), slow_reps)
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


def torch_loop_net(ctx, w, t, clients, S, **hyper):
    """(b) for a torch net of pflcore.models.nets: one reused ``model.module()``; rows in
    pflcore's flat layout (the module's parameter order)."""
    def load(vec, tensors):  # copies (torch's vector_to_parameters would alias vec's storage)
        o = 0
        for q in tensors:
            q.copy_(vec[o:o + q.numel()].view_as(q))
            o += q.numel()

    def flatten(tensors):
        return torch.cat([q.reshape(-1) for q in tensors])
    net = ctx.model.module(dtype=w.dtype)
    return _pfedme_client_loop(ctx, w, t, clients, S, net, list(net.parameters()), load, flatten,
                               ctx.model.input_view, **hyper)


@contextlib.contextmanager
def mlp_path(hand_written):
    """Switches pflcore's MLP path (a private switch of the nets module: the op layer is being
    rebuilt, so a missing switch raises a clear error instead of timing the wrong path)."""
    try:
        from pflcore.ops import _nets
        old = _nets.HAND_WRITTEN_MLP
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"pfedme_round_mlp: pflcore no longer has the MLP path switch this part compares ({e}); "
                         "run the other parts with --only") from None
    _nets.HAND_WRITTEN_MLP = hand_written
    try:
        yield
    finally:
        _nets.HAND_WRITTEN_MLP = old


def bench_mlp(args, m, hidden=100):
    """pFedMe round with MLP(60, hidden, 10): pflcore's batched paths (a), (a') vs the per-client
    nn.Module loop (b). Same protocol as ``bench``."""
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, max_size=args.max_size)
    model = MLP(60, hidden, 10)
    ctx = Context(fed, model, torch.device("cpu"), seed=0, clients_per_round=10)
    alg = PFedMe(**HYPER)
    R, K = HYPER["local_rounds"], HYPER["inner_steps"]
    state0 = alg.round(alg.init(ctx), ctx, 1)  # untimed: w moved from the initialization
    t = 2
    S = ctx.sample_clients(t)
    sizes = fed.train.sizes
    print(f"[pFedMe MLP] m={m} clients, {model!r}, d={model.d}, R={R}, K={K}, B={HYPER['batch_size']}, "
          f"train rows {int(sizes.sum())} (sizes capped at {args.max_size})")

    # ---- agreement (also the warm-up of every path) ----
    with mlp_path(True):
        st_a = alg.round(copy.deepcopy(state0), ctx, t)
    with mlp_path(False):
        st_v = alg.round(copy.deepcopy(state0), ctx, t)
    if args.slow_clients is None or args.slow_clients >= m:
        check = torch.arange(m)
    else:
        check = torch.unique(torch.cat([torch.arange(min(m, max(20, args.slow_clients))), S]))
    with threads(1):
        th_b, wl_b, w_b = torch_loop_net(ctx, state0.w, t, check, S, **HYPER)
    diffs = {}
    for tag, st in (("a", st_a), ("vmap", st_v)):
        diffs[tag] = dict(w=float((w_b - st.w).abs().max()), theta=float((th_b - st.theta[check]).abs().max()),
                          w_local=float((wl_b - st.w_local[check]).abs().max()))
        print(f"[agreement] {tag} vs loop on {check.numel()} clients: max|Δw| = {diffs[tag]['w']:.2e}, "
              f"max|Δθ| = {diffs[tag]['theta']:.2e}, max|Δw_local| = {diffs[tag]['w_local']:.2e}")
    moved = float((st_a.theta[check] - state0.w).abs().max())

    # ---- timings ----
    ms = m if args.slow_clients is None else min(m, args.slow_clients)
    slow_reps = max(1, min(args.repeats, 3))
    times_a, times_v, times_b = {}, {}, {}
    for th in sorted({torch.get_num_threads(), 1}, reverse=True):
        with threads(th):
            with mlp_path(True):
                times_a[th] = best_of(lambda s: alg.round(s, ctx, t), args.repeats, lambda: copy.deepcopy(state0))
            with mlp_path(False):
                times_v[th] = best_of(lambda s: alg.round(s, ctx, t), max(1, min(args.repeats, 3)),
                                      lambda: copy.deepcopy(state0))
            times_b[th] = m / ms * best_of(
                lambda: torch_loop_net(ctx, state0.w, t, torch.arange(ms), S, **HYPER), slow_reps)
        print(f"[timing] {th} thread(s): (a) {times_a[th]:.3f} s, (a') vmap {times_v[th]:.3f} s, "
              f"(b) {times_b[th]:.3f} s per round")
    t_a, t_v, t_b = min(times_a.values()), min(times_v.values()), min(times_b.values())
    steps = m * R * K
    return dict(
        m=m, dataset="synthetic(0.5, 0.5), dim 60, 10 classes, seed 0", max_size=args.max_size, sizes_capped=True,
        train_rows=int(sizes.sum()), model=repr(model), d=model.d, hyperparameters=HYPER, round=t,
        sampled=S.tolist(), agreement_clients=int(check.numel()),
        max_abs_diff_w=diffs["a"]["w"], max_abs_diff_theta=diffs["a"]["theta"],
        max_abs_diff_w_local=diffs["a"]["w_local"], max_abs_diff_vmap=diffs["vmap"],
        max_abs_update_theta=moved, tolerance=1e-4,
        time_pflcore_s=t_a, time_pflcore_vmap_s=t_v, time_torch_loop_s=t_b,
        time_pflcore_by_threads_s=times_a, time_pflcore_vmap_by_threads_s=times_v,
        time_torch_loop_by_threads_s=times_b, threads_pflcore=min(times_a, key=times_a.get),
        threads_pflcore_vmap=min(times_v, key=times_v.get), threads_torch_loop=min(times_b, key=times_b.get),
        torch_loop_clients=ms, torch_loop_scaled=ms < m, torch_loop_scale=m / ms, torch_loop_repeats=slow_reps,
        ratio_loop_over_pflcore=t_b / t_a, ratio_loop_over_pflcore_vmap=t_b / t_v,
        client_steps=steps, client_steps_per_s=steps / t_a, vmap_client_steps_per_s=steps / t_v,
        torch_loop_client_steps_per_s=steps / t_b)


def rows_of_mlp(r):
    sc = f", scaled from {r['torch_loop_clients']}" if r["torch_loop_scaled"] else ""
    return [
        ("MLP agreement: max|Δw| global model", None, r["max_abs_diff_w"], 1e-4, "le"),
        ("MLP agreement: max|Δθ| personal models", None, r["max_abs_diff_theta"], 1e-4, "le"),
        ("MLP agreement: max|Δw_i| local models", None, r["max_abs_diff_w_local"], 1e-4, "le"),
        ("MLP agreement (vmap path): max|Δθ|", None, r["max_abs_diff_vmap"]["theta"], 1e-4, "le"),
        (f"pFedMe MLP round, pflcore (a), m={r['m']}, {r['threads_pflcore']} thr", r["time_pflcore_s"], None, None,
         None),
        (f"pFedMe MLP round, pflcore vmap (a'), {r['threads_pflcore_vmap']} thr", r["time_pflcore_vmap_s"], None,
         None, None),
        (f"MLP torch loop (b)/(a), {r['threads_torch_loop']} thr" + sc, r["time_torch_loop_s"],
         r["ratio_loop_over_pflcore"], 5, "ge"),
        ("MLP torch loop (b)/(a') vmap path", None, r["ratio_loop_over_pflcore_vmap"], None, None),
        ("MLP (a) client-steps per second", None, r["client_steps_per_s"], None, None),
        ("MLP (b) client-steps per second", None, r["torch_loop_client_steps_per_s"], None, None),
    ]


def rows_of_anderson(a):
    return [(f"FedPi+Anderson round, m={a['m']}, state {a['m']}x{a['d']}", a["round_s"], None, None, None),
            ("Anderson.step share of the round", a["anderson_step_s"], a["anderson_share"], 0.05, "le")]


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

    def timed_step(self, u, tu, **kw):  # kw: e.g. reduce= (sharded runs)
        t0 = time.perf_counter()
        out = real_step(self, u, tu, **kw)
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


PARTS = ("pfedme_round", "pfedme_round_mlp", "anderson_share")
ROWS = {"pfedme_round": rows_of, "pfedme_round_mlp": rows_of_mlp, "anderson_share": rows_of_anderson}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="m = 100 clients, a smoke run")
    ap.add_argument("--only", action="append", choices=PARTS,
                    help="run only this part (repeatable; default: all); the other parts' entries in --out are kept")
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
    parts = [p for p in PARTS if p in (args.only or PARTS)]

    status = backend.status()
    if not status["native"][0]:
        raise SystemExit(f"the native backend is not available: {status['native'][1]}")
    warn_if_busy()
    t0 = time.perf_counter()
    # The parts not run now keep their entries (each carries its own ``measured`` record).
    results = {part: entry for part, entry in read_json(args.out).items() if part in PARTS}
    run_fn = {"pfedme_round": bench, "pfedme_round_mlp": bench_mlp, "anderson_share": bench_anderson_share}
    for part in parts:
        l0 = loadavg()
        results[part] = run_fn[part](args, m)
        results[part]["measured"] = dict(
            timestamp=now(), git_commit=machine_info()["git_commit"], quick=args.quick, repeats=args.repeats,
            slow_clients=args.slow_clients, torch_threads=torch.get_num_threads(), loadavg_1min_start=l0,
            loadavg_1min_end=loadavg())
    rows_now = [row for part in parts for row in ROWS[part](results[part])]
    print_table(rows_now)
    results["table"] = [r.as_dict() for part in PARTS if part in results for r in rows_from(ROWS[part](results[part]))]
    results["config"] = dict(quick=args.quick, repeats=args.repeats, slow_clients=args.slow_clients,
                             max_size=args.max_size, parts=parts)
    results["total_wall_s"] = time.perf_counter() - t0
    write_json(args.out, results)
    print(f"\nwrote {args.out} (parts run now: {', '.join(parts)}; {results['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
