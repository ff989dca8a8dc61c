"""Benchmarks of whole algorithm rounds, the torch nets' batched steps, and what a round costs.

Everything runs in ONE process; every figure is taken at torch's default thread count (2 here)
AND at one thread (``torch.set_num_threads`` also sets the native kernels' OpenMP threads), the
best of several runs (other processes only ever add time), with the 1-minute load average
recorded. The machine these figures come from is a 2-core CPU shared with other busy processes:
at one thread the CPU time of the calling thread (``time.thread_time``, all work runs on it) is
reported beside the wall time, as it is what a quiet core would show.

Parts (``--only PART``, repeatable; the JSON keeps the other parts' last entries):

``rounds`` (issue 16's workloads): ``pflcore.run`` on ``data.synthetic(0.5, 0.5,
num_clients=100)`` (seed 0) with ``Softmax(60, 10)``, 10 clients sampled per round:
  * pFedMe with pFedMe's Table 1 setting (every client trains, R = 20 local rounds, K = 5 inner
    steps, B = 20, λ, η and the personal learning rate of
    ``experiments/pfedme_table1_synthetic_mlr.toml``); target <= 12 ms/round;
  * Per-FedAvg FO (10 clients, 20 steps, B = 20, α = 0.02, β = 0.002); target <= 5 ms/round;
  * FedAvg (10 clients, 20 steps of B = 20, lr 0.02); target <= 2 ms/round evaluating every
    round, the evaluation costing at most the round's training.
  Each algorithm runs twice: without evaluation (``eval_every`` = the number of rounds) and
  evaluating every round (``eval_every=1``, ``train_loss="sample"``, the default). Timers wrap
  ``algorithm.round`` and the loop's ``evaluate_round``; a callback stamps the end of every
  evaluated round. Figures: the best over blocks of consecutive rounds of the mean per round
  (after warm-up rounds) of the round, of the evaluation, and of the whole loop iteration
  (round + evaluation + the loop's own work).

``accuracy``: ``experiments/pfedme_table1_synthetic_mlr.toml`` run again (its seeds, 600
rounds, its step sizes; at one thread: the results do not depend on it) and the final
accuracies compared with the committed summaries in ``experiments/results/`` (mean ± population
std over the seeds): unchanged within noise when
|Δ mean| <= the committed std over seeds / sqrt(seeds) (the standard error of its mean).

``pfedme_round`` / ``pfedme_round_mlp``: one pFedMe round on m = 1,000 clients of
Synthetic(0.5, 0.5) (client sizes capped at ``--max-size`` rows), λ = 15, η = 0.005,
personal_lr = 0.01, K = 5, R = 20, B = 20, every client training, with ``Softmax(60, 10)`` or
``MLP(60, 100, 10)``, against a per-client PyTorch loop with the same math: one reused
``nn.Module`` whose parameters are loaded per client, autograd on ``F.cross_entropy``, the pFedMe
update θ ← θ − personal_lr(∇f(θ; D) + λ(θ − w_i)), w_i ← w_i − ηλ(w_i − θ), exactly pflcore's
minibatches. Agreement (max |Δ| of w, θ_i, w_i on the loop's clients, tolerance 1e-4) is checked
before timing; the loop is timed on ``--slow-clients`` clients and scaled by the client count.
For the MLP also pflcore's generic ``torch.func`` path (``pflcore.backends.nets.HAND_WRITTEN_MLP
= False``). Where pflcore's round goes: the share inside the native kernel (Softmax) or the nets
adapter's math (MLP), in the value pre-pass of the torch adapters (``_values.glm_fault``), in
``ctx.batches`` and elsewhere.

``mlp_step``: the batched MLP step (``pflcore/backends/nets.py``, hand-written path) in GFLOP/s
against a 2048² float32 matmul timed in the same process at the same thread count. MLP(60, 100,
10) on 1,000 clients, B = 20; FLOPs per client-step = 2 x the multiply-adds of the forward (x W1ᵀ,
h W2ᵀ) and backward (dW2, dh, dW1; no dx) passes = 600 kFLOP (what ``torch.utils.flop_counter``
counts for the ``nn.Module``, recorded beside it). Workloads: FedAvg's local training
(20 plain SGD steps per call), 5 plain steps, and pFedMe's call (5 steps on one minibatch, prox
toward per-row anchors). The adapter's math (``nets.local_steps``, the ≥ 25% target) and the
public ``ops.local_steps`` (with its value pre-pass) are both reported. Agreement with
``ops.local_steps_ref`` on 20 clients first.

``cnn``: CNNs batched across clients (issue 24, item 3). Two nets: the unifying paper's MNIST
CNN (``models.CNN()``, 11,910 parameters) on MNIST-shaped synthetic rows
(``data.synthetic(0.5, 0.5, dim=784)``, 28x28) and a 2-layer CIFAR-shaped CNN (3x32x32 input,
conv 6 and 16 channels 5x5, hidden 120 and 84; synthetic rows with dim = 3,072), ``--cnn-clients``
clients (default 100, sizes capped at 200 rows), minibatches of B = 20, 2 plain SGD steps.
Compared: pflcore's ``local_steps`` (the batched im2col + GEMM path of
``pflcore/backends/cnn_batched.py``; also the adapter's math alone), the ``torch.func`` vmap path
(``HAND_WRITTEN_CNN = False``) and a per-client ``nn.Module`` loop with the same math (same
minibatches). Agreement first: the gradients of one minibatch against the loop's (tolerance
1e-5), the steps (1e-4). GFLOP/s (FLOPs counted from the layer shapes: forward, weight gradients
and the input gradients of every layer but the first) and their fraction of a 2048² float32
matmul timed in the same process at the same thread count; at one thread also the calling
thread's CPU time. Target: loop / pflcore >= 3 at one thread.

``anderson_share``: the share of an ``Accelerated(FedPi, memory=5)`` round (1,000 clients, all
participating, state [m, d]) spent in ``Anderson.step`` (target <= 5%).

Run from the repository root::

    python bench/algorithms.py                    # every part (~15 min on 2 busy cores)
    python bench/algorithms.py --quick            # smaller sizes, a smoke run
    python bench/algorithms.py --only rounds --only mlp_step

It prints a table (name, time, value, target, pass/fail) and writes every number, the machine
and the load to ``--out`` (default bench/results/algorithms.json).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import pflcore
from pflcore import backend, ops
from pflcore.algorithms import Context, FedAvg, PerFedAvg, PFedMe
from pflcore.backends import _values
from pflcore.backends import nets as nets_adapter
from pflcore.models import CNN, MLP, Softmax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, even under PYTHONSAFEPATH
from _harness import (Stopwatch, best_of, loadavg, machine_info, now, print_table, read_json, rows_from,  # noqa: E402
                      torch_threads, warn_if_busy, write_json)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TABLE1 = os.path.join(ROOT, "experiments", "pfedme_table1_synthetic_mlr.toml")
COMMITTED = {"pFedMe": "pfedme_table1_summary_pfedme_fedavg.json", "FedAvg": "pfedme_table1_summary_pfedme_fedavg.json",
             "Per-FedAvg": "pfedme_table1_summary_perfedavg.json"}
HYPER = dict(lam=15.0, lr=0.005, personal_lr=0.01, inner_steps=5, local_rounds=20, beta=1.0, batch_size=20,
             train_all=True)
threads = torch_threads
run_module = sys.modules["pflcore.run"]  # the round loop's module (pflcore.run is the function)


def thread_counts():
    """torch's default thread count, then 1."""
    return sorted({torch.get_num_threads(), 1}, reverse=True)


# ---- part `rounds`: the workloads through pflcore.run -------------------------------------

def table1_pfedme() -> dict:
    """pFedMe's hyperparameters in experiments/pfedme_table1_synthetic_mlr.toml."""
    from pflcore.experiments import load
    spec = dict(load(TABLE1)["algorithms"]["pFedMe"])
    spec.pop("type", None)
    return spec


def round_workloads():
    return {
        "pFedMe": (lambda: PFedMe(**table1_pfedme()), 12e-3),
        "Per-FedAvg FO": (lambda: PerFedAvg(alpha=0.02, beta=0.002, variant="FO", local_steps=20, batch_size=20),
                          5e-3),
        "FedAvg": (lambda: FedAvg(lr=0.02, local_steps=20, batch_size=20), None),
    }


@contextlib.contextmanager
def call_clock(owner, name: str, log: list):
    """Appends (wall s, thread CPU s) of every call of ``owner.name`` to ``log`` inside the block."""
    fn = getattr(owner, name)

    def timed(*a, **k):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            log.append((time.perf_counter() - w0, time.thread_time() - c0))
    setattr(owner, name, timed)
    try:
        yield log
    finally:
        setattr(owner, name, fn)


def block_best(values, warm: int, block: int):
    """The smallest mean over consecutive blocks of ``block`` values after ``warm`` ones."""
    vals = values[warm:]
    means = [statistics.fmean(vals[i:i + block]) for i in range(0, len(vals) - block + 1, block)]
    return min(means) if means else math.nan


def time_rounds(make_alg, fed, model, *, warm: int, block: int, blocks: int, evaluate: bool) -> dict:
    """One ``pflcore.run`` of warm + block·blocks rounds; per-round wall and CPU seconds of the
    round, of the evaluation and of the whole loop iteration (best block mean)."""
    alg = make_alg()
    rounds = warm + block * blocks
    rounds_log, evals_log, stamps = [], [], []

    def stamp(t, row, state):
        stamps.append((time.perf_counter(), time.thread_time()))
    with call_clock(type(alg), "round", rounds_log), call_clock(run_module, "evaluate_round", evals_log):
        res = pflcore.run(alg, fed, model, rounds=rounds, clients_per_round=10, seed=0,
                          eval_every=1 if evaluate else rounds, progress=False, callbacks=[stamp])
    evals_log = evals_log[1:]  # the loop's evaluation at round 0, before any round
    out = {"rounds": rounds, "warm": warm, "block": block,
           "round_s": block_best([r[0] for r in rounds_log], warm, block),
           "round_cpu_s": block_best([r[1] for r in rounds_log], warm, block),
           "round_median_s": statistics.median(r[0] for r in rounds_log[warm:])}
    if evaluate:
        loop_w = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
        loop_c = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
        out.update(eval_s=block_best([e[0] for e in evals_log], warm, block),
                   eval_cpu_s=block_best([e[1] for e in evals_log], warm, block),
                   eval_median_s=statistics.median(e[0] for e in evals_log[warm:]),
                   loop_s=block_best(loop_w, warm - 1, block), loop_cpu_s=block_best(loop_c, warm - 1, block),
                   loop_median_s=statistics.median(loop_w[warm - 1:]))
    last = res.history[-1]
    out["final_acc"] = last.get("personalized_acc", last.get("global_acc"))
    return out


def bench_rounds(args) -> dict:
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=100, seed=0)
    model = Softmax(60, 10)
    blocks = 2 if args.quick else args.blocks
    out = {"dataset": "synthetic(0.5, 0.5, num_clients=100, seed=0)", "train_rows": int(fed.train.num_rows),
           "test_rows": int(fed.test.num_rows), "model": repr(model), "clients_per_round": 10, "block": args.block,
           "blocks": blocks, "warm": args.warm, "algorithms": {}}
    for name, (make, target) in round_workloads().items():
        out["algorithms"][name] = entry = {"algorithm": repr(make()), "target_round_s": target, "by_threads": {}}
        for th in thread_counts():
            with threads(th):
                plain = time_rounds(make, fed, model, warm=args.warm, block=args.block, blocks=blocks, evaluate=False)
                evald = time_rounds(make, fed, model, warm=args.warm, block=args.block, blocks=blocks, evaluate=True)
            entry["by_threads"][th] = {"no_eval": plain, "eval_every_round": evald, "loadavg_1min": loadavg()}
            print(f"[rounds] {name}, {th} thread(s): round {plain['round_s'] * 1e3:.2f} ms "
                  f"(CPU {plain['round_cpu_s'] * 1e3:.2f}); evaluating every round {evald['loop_s'] * 1e3:.2f} ms "
                  f"(round {evald['round_s'] * 1e3:.2f} + evaluation {evald['eval_s'] * 1e3:.2f}; "
                  f"CPU {evald['loop_cpu_s'] * 1e3:.2f}), load {loadavg():.1f}")
    return out


def rows_of_rounds(r):
    rows = []
    for name, e in r["algorithms"].items():
        for th, v in e["by_threads"].items():
            p, ev = v["no_eval"], v["eval_every_round"]
            tag = f"{name} round, {th} thr (load {v['loadavg_1min']:.1f})"
            target = e["target_round_s"]
            rows.append((tag + " [s]", p["round_s"], p["round_s"], target, "le" if target else None))
            rows.append((f"  CPU time of the round [s]", p["round_cpu_s"], p["round_cpu_s"], target,
                         "le" if target else None))
            if name == "FedAvg":
                rows.append((f"  evaluating every round [s]", ev["loop_s"], ev["loop_s"], 2e-3, "le"))
                rows.append((f"  evaluating every round, CPU [s]", ev["loop_cpu_s"], ev["loop_cpu_s"], 2e-3, "le"))
                rows.append((f"  evaluation / the round's training (CPU)", None,
                             ev["eval_cpu_s"] / ev["round_cpu_s"], 1.0, "le"))
            else:
                rows.append((f"  evaluating every round [s] (evaluation {ev['eval_s'] * 1e3:.1f} ms)", ev["loop_s"],
                             None, None, None))
    return rows


# ---- part `accuracy`: round 600 against the committed results ---------------------------------------

def bench_accuracy(args) -> dict:
    from pflcore.experiments import build_algorithm, build_federation, build_model, load
    cfg = load(TABLE1)
    seeds = cfg["seeds"][:1] if args.quick else cfg["seeds"]
    rounds = 60 if args.quick else cfg["rounds"]
    out = {"config": os.path.relpath(TABLE1, ROOT), "rounds": rounds, "seeds": seeds, "algorithms": {}}
    for label, spec in cfg["algorithms"].items():
        with open(os.path.join(ROOT, "experiments", "results", COMMITTED[label])) as f:
            committed = json.load(f)
        old = next(r for r in committed["rows"] if r["algorithm"] == label)
        same_spec = committed["config"]["algorithms"][label] == spec
        finals = {"personalized_acc": [], "global_acc": []}
        t0 = time.perf_counter()
        for seed in seeds:
            fed = build_federation(cfg["data"], seed)
            model = build_model(cfg.get("model"), fed)
            with threads(1):  # the same bits at any thread count; one thread is the fastest on a busy machine
                res = pflcore.run(build_algorithm(label, spec, fed, model), fed, model, rounds=rounds,
                                  clients_per_round=cfg["clients_per_round"], seed=seed,
                                  eval_every=cfg["eval_every"], progress=False)
            for k in finals:
                finals[k].append(res.final(k))
        entry = {"spec": spec, "committed_file": COMMITTED[label], "committed_spec_matches": same_spec,
                 "seconds": time.perf_counter() - t0, "metrics": {}}
        for k, vals in finals.items():
            vals = [v for v in vals if v is not None]
            if not vals or old.get(k) is None:
                continue
            mean = statistics.fmean(vals)
            std = statistics.pstdev(vals) if len(vals) > 1 else None
            noise = (old.get(k + "_std") or 0.0) / math.sqrt(len(vals))
            entry["metrics"][k] = {"per_seed": vals, "mean": mean, "std": std, "committed_mean": old[k],
                                   "committed_std": old.get(k + "_std"), "diff": mean - old[k],
                                   "noise_bound": noise, "within_noise": abs(mean - old[k]) <= noise}
            print(f"[accuracy] {label} {k}: {mean:.4f} ± {std or 0:.4f} now, {old[k]:.4f} ± "
                  f"{old.get(k + '_std') or 0:.4f} committed (Δ {mean - old[k]:+.4f}, bound {noise:.4f})")
        out["algorithms"][label] = entry
    return out


def rows_of_accuracy(a):
    rows = []
    for label, e in a["algorithms"].items():
        for k, m in e["metrics"].items():
            rows.append((f"{label} {k} at round {a['rounds']}: {m['mean']:.4f} vs {m['committed_mean']:.4f}, |Δ|",
                         None, abs(m["diff"]), m["noise_bound"], "le"))
    return rows


# ---- parts `pfedme_round` and `pfedme_round_mlp`: 1,000 clients against a per-client loop ---------

def _pfedme_client_loop(ctx, w, t, clients, S, net, params, load, flatten, input_view, lam, lr, personal_lr,
                        inner_steps, local_rounds, beta, batch_size, train_all=True):
    """The per-client pFedMe loop: ``net`` is one reused module whose parameter tensors
    ``params`` are loaded from a flat pflcore row by ``load(vec, tensors)`` and read back by
    ``flatten(tensors)``; autograd, then the pFedMe optimizer's update
    θ ← θ − personal_lr·(∇f(θ; D) + λ(θ − w_local)) per tensor. Returns (theta [n, d],
    w_local [n, d], new w or None when S ⊄ clients)."""
    model, (x, y) = ctx.model, (ctx.train.x, ctx.train.y)
    clients = torch.as_tensor(clients, dtype=torch.int64)
    n = clients.numel()
    # exactly pflcore's minibatches: [n, R, B] absolute row indices
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
    """The loop for Softmax: one reused ``nn.Linear(p, C)``; rows in pflcore's layout [p+1, C]
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


def torch_loop_net(ctx, w, t, clients, S, **hyper):
    """The loop for a torch net of pflcore.models.nets: one reused ``model.module()``; rows in
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
def mlp_path(hand_written: bool):
    """pflcore's MLP path: the hand-written batched math (default) or the generic torch.func one."""
    old = nets_adapter.HAND_WRITTEN_MLP
    nets_adapter.HAND_WRITTEN_MLP = hand_written
    try:
        yield
    finally:
        nets_adapter.HAND_WRITTEN_MLP = old


def where_the_round_goes(alg, ctx, state0, t, repeats, inner):
    """Shares of the fastest of ``repeats`` instrumented rounds: in ``inner`` ((owner, name) of the
    math: the native kernel or the nets adapter's function), in the torch adapters' value
    pre-pass, in ``ctx.local_steps`` (the op's wrapper around them), in ``ctx.batches``."""
    best = None
    for _ in range(repeats):
        s = copy.deepcopy(state0)
        with Stopwatch([inner]) as math_, Stopwatch([(_values, "glm_fault")]) as pre, \
                Stopwatch([(Context, "local_steps")]) as ls, Stopwatch([(Context, "batches")]) as bt:
            t0 = time.perf_counter()
            alg.round(s, ctx, t)
            total = time.perf_counter() - t0
        if best is None or total < best["round_s"]:
            best = dict(round_s=total, math_s=math_.seconds, value_prepass_s=pre.seconds,
                        ctx_local_steps_s=ls.seconds, batches_s=bt.seconds)
    r = best["round_s"]
    best.update(math_share=best["math_s"] / r, value_prepass_share=best["value_prepass_s"] / r,
                op_wrapper_share=(best["ctx_local_steps_s"] - best["math_s"] - best["value_prepass_s"]) / r,
                batches_share=best["batches_s"] / r,
                other_share=1 - (best["ctx_local_steps_s"] + best["batches_s"]) / r)
    return best


def _setup_pfedme(args, m, model):
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, max_size=args.max_size)
    ctx = Context(fed, model, torch.device("cpu"), seed=0, clients_per_round=10)
    alg = PFedMe(**HYPER)
    state0 = alg.round(alg.init(ctx), ctx, 1)  # untimed: w moved from its start for the timed round
    return fed, ctx, alg, state0


def _check_clients(args, m, S):
    if args.slow_clients is None or args.slow_clients >= m:
        return torch.arange(m)
    return torch.unique(torch.cat([torch.arange(min(m, max(20, args.slow_clients))), S]))


def _diffs(st, th_b, wl_b, w_b, check):
    return dict(w=float((w_b - st.w).abs().max()), theta=float((th_b - st.theta[check]).abs().max()),
                w_local=float((wl_b - st.w_local[check]).abs().max()))


def bench_pfedme_round(args, m) -> dict:
    model = Softmax(60, 10)
    fed, ctx, alg, state0 = _setup_pfedme(args, m, model)
    t, S = 2, ctx.sample_clients(2)
    st_a = alg.round(copy.deepcopy(state0), ctx, t)  # also the warm-up
    check = _check_clients(args, m, S)
    with threads(1):
        diff = _diffs(st_a, *torch_loop(ctx, state0.w, t, check, S, **HYPER), check)
    print(f"[pfedme_round] agreement on {check.numel()} clients: {diff} (tolerance 1e-4)")
    ms = m if args.slow_clients is None else min(m, args.slow_clients)
    times_a, times_b = {}, {}
    for th in thread_counts():
        with threads(th):
            times_a[th] = best_of(lambda s: alg.round(s, ctx, t), args.repeats, lambda: copy.deepcopy(state0))
            times_b[th] = m / ms * best_of(lambda: torch_loop(ctx, state0.w, t, torch.arange(ms), S, **HYPER),
                                           max(1, min(args.repeats, 3)))
        print(f"[pfedme_round] {th} thread(s): pflcore {times_a[th]:.4f} s, loop {times_b[th]:.4f} s per round")
    th_a = min(times_a, key=times_a.get)
    with threads(th_a):
        where = where_the_round_goes(alg, ctx, state0, t, args.repeats, (backend.loaded("native"), "local_steps"))
    t_a, t_b = min(times_a.values()), min(times_b.values())
    steps = m * HYPER["local_rounds"] * HYPER["inner_steps"]
    return dict(m=m, max_size=args.max_size, train_rows=int(fed.train.num_rows), model=repr(model),
                hyperparameters=HYPER, agreement_clients=int(check.numel()), max_abs_diff=diff, tolerance=1e-4,
                time_pflcore_s=t_a, time_torch_loop_s=t_b, time_pflcore_by_threads_s=times_a,
                time_torch_loop_by_threads_s=times_b, threads_pflcore=th_a,
                threads_torch_loop=min(times_b, key=times_b.get), torch_loop_clients=ms, torch_loop_scale=m / ms,
                ratio_loop_over_pflcore=t_b / t_a, client_steps=steps, client_steps_per_s=steps / t_a,
                where=where)


def bench_pfedme_round_mlp(args, m, hidden=100) -> dict:
    model = MLP(60, hidden, 10)
    fed, ctx, alg, state0 = _setup_pfedme(args, m, model)
    t, S = 2, ctx.sample_clients(2)
    with mlp_path(True):
        st_a = alg.round(copy.deepcopy(state0), ctx, t)
    with mlp_path(False):
        st_v = alg.round(copy.deepcopy(state0), ctx, t)
    check = _check_clients(args, m, S)
    with threads(1):
        ref = torch_loop_net(ctx, state0.w, t, check, S, **HYPER)
    diffs = {"a": _diffs(st_a, *ref, check), "vmap": _diffs(st_v, *ref, check)}
    print(f"[pfedme_round_mlp] agreement on {check.numel()} clients: {diffs} (tolerance 1e-4)")
    ms = m if args.slow_clients is None else min(m, args.slow_clients)
    reps = max(1, min(args.repeats, 3))
    times_a, times_v, times_b = {}, {}, {}
    for th in thread_counts():
        with threads(th):
            with mlp_path(True):
                times_a[th] = best_of(lambda s: alg.round(s, ctx, t), reps, lambda: copy.deepcopy(state0))
            with mlp_path(False):
                times_v[th] = best_of(lambda s: alg.round(s, ctx, t), reps, lambda: copy.deepcopy(state0))
            times_b[th] = m / ms * best_of(lambda: torch_loop_net(ctx, state0.w, t, torch.arange(ms), S, **HYPER),
                                           reps)
        print(f"[pfedme_round_mlp] {th} thread(s): pflcore {times_a[th]:.3f} s, torch.func path {times_v[th]:.3f} s, "
              f"loop {times_b[th]:.3f} s per round")
    th_a = min(times_a, key=times_a.get)
    with threads(th_a), mlp_path(True):
        where = where_the_round_goes(alg, ctx, state0, t, reps, (nets_adapter, "local_steps"))
    t_a, t_v, t_b = min(times_a.values()), min(times_v.values()), min(times_b.values())
    steps = m * HYPER["local_rounds"] * HYPER["inner_steps"]
    return dict(m=m, max_size=args.max_size, train_rows=int(fed.train.num_rows), model=repr(model), d=model.d,
                hyperparameters=HYPER, agreement_clients=int(check.numel()), max_abs_diff=diffs["a"],
                max_abs_diff_vmap=diffs["vmap"], tolerance=1e-4, time_pflcore_s=t_a, time_pflcore_vmap_s=t_v,
                time_torch_loop_s=t_b, time_pflcore_by_threads_s=times_a, time_pflcore_vmap_by_threads_s=times_v,
                time_torch_loop_by_threads_s=times_b, threads_pflcore=th_a,
                threads_pflcore_vmap=min(times_v, key=times_v.get), threads_torch_loop=min(times_b, key=times_b.get),
                torch_loop_clients=ms, torch_loop_scale=m / ms, ratio_loop_over_pflcore=t_b / t_a,
                ratio_loop_over_pflcore_vmap=t_b / t_v,
                # from the instrumented round: its time without the value pre-pass
                ratio_loop_over_pflcore_math=t_b / (where["round_s"] - where["value_prepass_s"]),
                client_steps=steps, client_steps_per_s=steps / t_a, where=where)


def _rows_of_where(w, prefix):
    return [(f"{prefix} share in the math ({'kernel' if 'MLP' not in prefix else 'nets adapter'})", w["math_s"],
             w["math_share"], None, None),
            (f"{prefix} share in the value pre-pass (_values.glm_fault)", w["value_prepass_s"],
             w["value_prepass_share"], None, None),
            (f"{prefix} share in the rest of ctx.local_steps", None, w["op_wrapper_share"], None, None),
            (f"{prefix} share in ctx.batches", w["batches_s"], w["batches_share"], None, None),
            (f"{prefix} share elsewhere in round()", None, w["other_share"], None, None)]


def rows_of_pfedme_round(r):
    sc = f", scaled from {r['torch_loop_clients']}" if r["torch_loop_scale"] > 1 else ""
    d = r["max_abs_diff"]
    return [("agreement max|Δ| (w, θ_i, w_i)", None, max(d.values()), 1e-4, "le"),
            (f"pFedMe round, Softmax, m={r['m']}, pflcore, {r['threads_pflcore']} thr", r["time_pflcore_s"], None,
             None, None),
            (f"  per-client torch loop / pflcore, {r['threads_torch_loop']} thr{sc}", r["time_torch_loop_s"],
             r["ratio_loop_over_pflcore"], 20, "ge")] + _rows_of_where(r["where"], "  Softmax:")


def rows_of_pfedme_round_mlp(r):
    sc = f", scaled from {r['torch_loop_clients']}" if r["torch_loop_scale"] > 1 else ""
    return [("MLP agreement max|Δ| (w, θ_i, w_i)", None, max(r["max_abs_diff"].values()), 1e-4, "le"),
            ("MLP agreement max|Δ|, torch.func path", None, max(r["max_abs_diff_vmap"].values()), 1e-4, "le"),
            (f"pFedMe round, MLP(60,100,10), m={r['m']}, pflcore, {r['threads_pflcore']} thr", r["time_pflcore_s"],
             None, None, None),
            (f"  torch.func path, {r['threads_pflcore_vmap']} thr", r["time_pflcore_vmap_s"], None, None, None),
            (f"  per-client torch loop / pflcore, {r['threads_torch_loop']} thr{sc}", r["time_torch_loop_s"],
             r["ratio_loop_over_pflcore"], 5, "ge"),
            ("  loop / pflcore without the value pre-pass", None, r["ratio_loop_over_pflcore_math"], None, None),
            ("  loop / torch.func path", None, r["ratio_loop_over_pflcore_vmap"], None, None)] + \
        _rows_of_where(r["where"], "  MLP:")


# ---- part `mlp_step`: GFLOP/s of the batched MLP step against a matmul --------------------------

def mlp_step_flops(model: MLP, B: int) -> int:
    """2 x multiply-adds of one client-step: forward of every layer, backward: every layer's weight
    gradient and the input gradient of every layer but the first."""
    sizes = (model.p,) + model.hidden + (model.C,)
    fwd = sum(sizes[j] * sizes[j + 1] for j in range(len(sizes) - 1))
    bwd = fwd + sum(sizes[j] * sizes[j + 1] for j in range(1, len(sizes) - 1))
    return 2 * B * (fwd + bwd)


def torch_flop_count(model, B: int) -> int:
    """FLOPs torch's own counter (``torch.utils.flop_counter``) sees in one forward and backward
    pass of the model's ``nn.Module`` on B rows: the cross-check of the counts above."""
    from torch.utils.flop_counter import FlopCounterMode
    net = model.module()
    x, y = torch.randn(B, model.p), torch.randint(0, model.C, (B,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(model.input_view(x)), y).backward()
    return counter.get_total_flops()


def matmul_gflops(repeats: int, n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / best_of(lambda: a @ b, repeats, warmup=1) / 1e9


def bench_mlp_step(args, m) -> dict:
    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, seed=0, max_size=args.max_size)
    data, model, B = fed.train, MLP(60, 100, 10), 20
    clients = torch.arange(m)
    theta0 = model.initial(m, seed=0) + 0.1 * torch.randn(m, model.d, generator=torch.Generator().manual_seed(1))
    anchor = model.initial(m, seed=0)
    one = ops.sample_batches(data, steps=1, batch_size=B, seed=3, counter=0, clients=clients)
    workloads = {  # name -> (steps, batches, prox, anchor, lr)
        "FedAvg local training: 20 SGD steps": (20, ops.sample_batches(data, steps=20, batch_size=B, seed=2,
                                                                        counter=0, clients=clients), 0.0, None, 0.05),
        "5 SGD steps": (5, ops.sample_batches(data, steps=5, batch_size=B, seed=2, counter=1, clients=clients), 0.0,
                        None, 0.05),
        "pFedMe call: 5 steps on one minibatch, prox": (5, one.repeat_interleave(5, dim=1).contiguous(), 15.0, anchor,
                                                        0.01),
    }
    flops = mlp_step_flops(model, B)
    out = {"m": m, "model": repr(model), "d": model.d, "batch_size": B, "flops_per_client_step": flops,
           "flops_torch_counter": torch_flop_count(model, B), "workloads": {}}
    sub = torch.arange(min(m, 20))
    for name, (steps, b, prox, a, lr) in workloads.items():
        kw = dict(steps=steps, lr=lr, prox=prox, anchor=None if a is None else a[sub], batches=b[sub], rows=sub)
        got, want = theta0[sub].clone(), theta0[sub].clone()
        ops.local_steps(model, got, data, **kw)
        ops.local_steps_ref(model, want, data, **kw)
        diff = float((got - want).abs().max())
        entry = out["workloads"][name] = {"steps": steps, "prox": prox, "agreement_max_abs_diff": diff,
                                          "tolerance": 1e-4, "by_threads": {}}
        for th in thread_counts():
            with threads(th):
                mm = matmul_gflops(args.repeats)
                t_math = best_of(lambda th_: nets_adapter.local_steps(model, th_, data, clients, b, a, None, steps, lr,
                                                                      prox), args.repeats, lambda: theta0.clone())
                t_op = best_of(lambda th_: ops.local_steps(model, th_, data, steps=steps, lr=lr, prox=prox, anchor=a,
                                                           batches=b), max(1, args.repeats // 2),
                               lambda: theta0.clone())
                c0 = time.thread_time()
                nets_adapter.local_steps(model, theta0.clone(), data, clients, b, a, None, steps, lr, prox)
                cpu = time.thread_time() - c0
            g_math, g_op = m * steps * flops / t_math / 1e9, m * steps * flops / t_op / 1e9
            entry["by_threads"][th] = dict(matmul_gflops=mm, time_math_s=t_math, time_op_s=t_op, gflops_math=g_math,
                                           gflops_op=g_op, fraction_of_matmul=g_math / mm,
                                           fraction_of_matmul_op=g_op / mm, cpu_s_one_run=cpu,
                                           loadavg_1min=loadavg())
            print(f"[mlp_step] {name}, {th} thread(s): {t_math * 1e3:.1f} ms = {g_math:.1f} GFLOP/s = "
                  f"{100 * g_math / mm:.1f}% of the matmul's {mm:.0f} GFLOP/s; through ops.local_steps "
                  f"{t_op * 1e3:.1f} ms ({100 * g_op / mm:.1f}%); agreement {diff:.1e}")
    return out


def rows_of_mlp_step(r):
    rows = []
    for name, e in r["workloads"].items():
        rows.append((f"MLP step agreement ({name})", None, e["agreement_max_abs_diff"], 1e-4, "le"))
        for th, v in e["by_threads"].items():
            rows.append((f"  {th} thr: nets adapter / 2048² matmul ({v['matmul_gflops']:.0f} GFLOP/s)",
                         v["time_math_s"], v["fraction_of_matmul"], 0.25, "ge"))
            rows.append((f"  {th} thr: ops.local_steps (with the value pre-pass) / matmul", v["time_op_s"],
                         v["fraction_of_matmul_op"], None, None))
    return rows


# ---- part `cnn`: the unifying paper's MNIST CNN against a per-client nn.Module loop ----------------

def cnn_flops(model: CNN, B: int) -> int:
    """2 x multiply-adds of one client-step (forward; backward: weight gradients of every layer,
    input gradients of every layer but the first), from the layer shapes (pooling and ReLU not
    counted): the dense computation's count, which the loop and vmap perform. pflcore's conv
    backward runs from the pooled gradient's nonzero windows (``cnn_pooled_backward``: about a
    quarter of those multiply-adds at 2 x 2 pooling, fewer after the ReLU), so its GFLOP/s here
    are effective rates, and its fraction of the matmul's rate can pass 1."""
    c, h, w = model.image_shape
    fwd, first_in = [], True
    for cout in model.channels:
        h, w = h + 2 * model.padding - model.kernel_size + 1, w + 2 * model.padding - model.kernel_size + 1
        fwd.append(h * w * cout * c * model.kernel_size ** 2)
        h, w, c = h // model.pool, w // model.pool, cout
    sizes = (model.flat_features,) + model.hidden + (model.C,)
    fwd += [sizes[j] * sizes[j + 1] for j in range(len(sizes) - 1)]
    return 2 * B * (sum(fwd) + sum(fwd) + sum(fwd[1:]))


def cnn_loop(model, data, theta, batches, lr):
    """Per-client nn.Module loop: parameters loaded per client, autograd on F.cross_entropy, plain
    SGD on every tensor; same minibatches ``batches [n, steps, B]`` as pflcore. Returns [n, d]."""
    net = model.module(dtype=theta.dtype)
    params = list(net.parameters())
    out = torch.empty_like(theta)
    x, y = data.x, data.y
    for i in range(theta.shape[0]):
        with torch.no_grad():
            o = 0
            for q in params:
                q.copy_(theta[i, o:o + q.numel()].view_as(q))
                o += q.numel()
        for s in range(batches.shape[1]):
            idx = batches[i, s].long()
            net.zero_grad()
            F.cross_entropy(net(model.input_view(x[idx])), y[idx]).backward()
            with torch.no_grad():
                for q in params:
                    q.sub_(lr * q.grad)
        with torch.no_grad():
            out[i] = torch.cat([q.reshape(-1) for q in params])
    return out


def cnn_loop_gradients(model, data, theta, batch):
    """Per-client nn.Module gradients of the mean cross-entropy on the rows ``batch [n, B]``: [n, d]."""
    net = model.module(dtype=theta.dtype)
    params = list(net.parameters())
    out = torch.empty_like(theta)
    for i in range(theta.shape[0]):
        torch.nn.utils.vector_to_parameters(theta[i], params)
        idx = batch[i].long()
        net.zero_grad()
        F.cross_entropy(net(model.input_view(data.x[idx])), data.y[idx]).backward()
        out[i] = torch.cat([q.grad.reshape(-1) for q in params])
    return out


@contextlib.contextmanager
def torch_func_cnn():
    """The nets adapter's generic torch.func path (vmap of the module's gradient) for CNNs."""
    old = nets_adapter.HAND_WRITTEN_CNN
    nets_adapter.HAND_WRITTEN_CNN = False
    try:
        yield
    finally:
        nets_adapter.HAND_WRITTEN_CNN = old


def cnn_workloads():
    """The unifying paper's MNIST net (Table 1) and a 2-layer CIFAR-shaped net (two 5x5 conv
    layers of 6 and 16 channels, 120 and 84 hidden units: the classic CIFAR-10 CNN; the papers'
    own CIFAR nets are unspecified (CGPFL, PERM) or need LocalResponseNorm (the unifying paper's
    Table 2), which CNN does not have)."""
    return {"mnist": CNN(),
            "cifar": CNN(3072, 10, image_shape=(3, 32, 32), channels=(6, 16), kernel_size=5, hidden=(120, 84))}


def bench_cnn(args) -> dict:
    m = 20 if args.quick else args.cnn_clients
    B, steps, lr = 20, 2, 0.05
    out = {"m": m, "batch_size": B, "steps": steps, "lr": lr, "gradient_tolerance": 1e-5, "steps_tolerance": 1e-4,
           "target_ratio_loop_over_pflcore_1_thread": 3.0, "workloads": {}}
    reps = max(1, min(args.repeats, 3))
    for name, model in cnn_workloads().items():
        fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=model.p, seed=0, max_size=200)
        data = fed.train
        clients = torch.arange(m)
        theta0 = model.initial(m, seed=0)
        b = ops.sample_batches(data, steps=steps, batch_size=B, seed=1, counter=0, clients=clients)
        first = b[:, 0].contiguous()
        flops = cnn_flops(model, B)
        # agreement before timing: gradients of one minibatch, and the steps
        with threads(1):
            g_loop = cnn_loop_gradients(model, data, theta0, first)
            want = cnn_loop(model, data, theta0, b, lr)
        g_batched = ops.gradients(model, theta0, data, batches=first)
        with torch_func_cnn():
            g_vmap = ops.gradients(model, theta0, data, batches=first)
        got = theta0.clone()
        ops.local_steps(model, got, data, steps=steps, lr=lr, batches=b)
        # float32 gradients can differ at kinks (a pooling window whose two largest inputs are
        # within rounding: each side may pick the other), so the function is also checked in float64
        per_client = (g_batched - g_loop).abs().amax(1)
        data64 = pflcore.ClientData(data.x.double(), data.y, data.offsets)
        with threads(1):
            g_loop64 = cnn_loop_gradients(model, data64, theta0.double(), first)
        g64 = ops.gradients(model, theta0.double(), data64, batches=first)
        e = {"model": repr(model), "d": model.d,
             "grad_float64_max_abs_diff_batched_vs_loop": float((g64 - g_loop64).abs().max()),
             "grad_clients_over_tolerance_float32": int((per_client > 1e-5).sum()),
             "grad_median_client_max_abs_diff_float32": float(per_client.median()),
             "data": f"synthetic(0.5, 0.5, dim={model.p}, max_size=200) as {model.image_shape}",
             "flops_per_client_step": flops, "flops_torch_counter": torch_flop_count(model, B),
             "grad_max_abs_diff_batched_vs_loop": float((g_batched - g_loop).abs().max()),
             "grad_max_abs_diff_vmap_vs_loop": float((g_vmap - g_loop).abs().max()),
             "grad_max_abs": float(g_loop.abs().max()),
             "steps_max_abs_diff_batched_vs_loop": float((got - want).abs().max()),
             "max_abs_update": float((got - theta0).abs().max()), "by_threads": {}}
        print(f"[cnn] {name}: gradients batched vs loop max|Δ| = {e['grad_max_abs_diff_batched_vs_loop']:.1e}, vmap vs "
              f"loop {e['grad_max_abs_diff_vmap_vs_loop']:.1e} (tolerance 1e-5; max|g| {e['grad_max_abs']:.2f}); "
              f"{steps} steps max|Δ| = {e['steps_max_abs_diff_batched_vs_loop']:.1e}; clients over 1e-5 in float32: "
              f"{e['grad_clients_over_tolerance_float32']} of {m}; float64 max|Δ| "
              f"{e['grad_float64_max_abs_diff_batched_vs_loop']:.1e}")
        ms = min(m, args.slow_clients or m)
        for th in thread_counts():
            with threads(th):
                mm = matmul_gflops(args.repeats)

                def timed(fn):  # wall time (best of reps) and, at one thread, the calling thread's CPU time
                    wall = best_of(fn, reps)
                    c0 = time.thread_time()
                    fn()
                    return wall, time.thread_time() - c0

                t_op, cpu_op = timed(lambda: ops.local_steps(model, theta0.clone(), data, steps=steps, lr=lr,
                                                             batches=b))
                t_math, _ = timed(lambda: nets_adapter.local_steps(model, theta0.clone(), data, clients, b, None, None,
                                                                   steps, lr, 0.0))
                with torch_func_cnn():
                    t_vmap, cpu_vmap = timed(lambda: ops.local_steps(model, theta0.clone(), data, steps=steps, lr=lr,
                                                                     batches=b))
                t_loop, cpu_loop = timed(lambda: cnn_loop(model, data, theta0[:ms], b[:ms], lr))
                t_loop, cpu_loop = t_loop * m / ms, cpu_loop * m / ms
            work = m * steps * flops
            v = dict(matmul_gflops=mm, time_op_s=t_op, time_math_s=t_math, time_vmap_s=t_vmap, time_loop_s=t_loop,
                     gflops_op=work / t_op / 1e9, gflops_math=work / t_math / 1e9, gflops_vmap=work / t_vmap / 1e9,
                     gflops_loop=work / t_loop / 1e9, fraction_of_matmul_op=work / t_op / 1e9 / mm,
                     ratio_loop_over_op=t_loop / t_op, ratio_vmap_over_op=t_vmap / t_op, loadavg_1min=loadavg())
            if th == 1:
                v.update(cpu_op_s=cpu_op, cpu_vmap_s=cpu_vmap, cpu_loop_s=cpu_loop, cpu_ratio_loop_over_op=cpu_loop / cpu_op)
            e["by_threads"][th] = v
            print(f"[cnn] {name}, {th} thread(s): pflcore {t_op:.3f} s ({v['gflops_op']:.1f} GFLOP/s = "
                  f"{100 * v['fraction_of_matmul_op']:.1f}% of the 2048² matmul's {mm:.0f}), vmap {t_vmap:.3f} s, "
                  f"loop {t_loop:.3f} s: loop / pflcore {v['ratio_loop_over_op']:.2f}, vmap / pflcore "
                  f"{v['ratio_vmap_over_op']:.2f}" + (f"; CPU time loop / pflcore {cpu_loop / cpu_op:.2f}"
                                                       if th == 1 else ""))
        out["workloads"][name] = e
    return out


def rows_of_cnn(r):
    if "workloads" not in r:  # an entry written before the part compared two nets
        return []
    rows = []
    for name, e in r["workloads"].items():
        rows.append((f"CNN {name}: gradients max|Δ| batched vs nn.Module loop, float64", None,
                     e["grad_float64_max_abs_diff_batched_vs_loop"], 1e-5, "le"))
        rows.append((f"  float32 (clients over 1e-5: {e['grad_clients_over_tolerance_float32']} of {r['m']}, at "
                     f"pooling near-ties)", None, e["grad_max_abs_diff_batched_vs_loop"], None, None))
        for th, v in e["by_threads"].items():
            rows += [(f"CNN {name} m={r['m']}, {th} thr: pflcore local_steps, GFLOP/s", v["time_op_s"], v["gflops_op"],
                      None, None),
                     (f"  {th} thr: fraction of the 2048² matmul's {v['matmul_gflops']:.0f} GFLOP/s", None,
                      v["fraction_of_matmul_op"], None, None),
                     (f"  {th} thr: torch.func vmap, GFLOP/s", v["time_vmap_s"], v["gflops_vmap"], None, None),
                     (f"  {th} thr: per-client loop, GFLOP/s", v["time_loop_s"], v["gflops_loop"], None, None),
                     (f"  {th} thr: loop / pflcore", None, v["ratio_loop_over_op"],
                      3.0 if str(th) == "1" else None, "ge" if str(th) == "1" else None)]
    return rows


# ---- part `anderson_share` --------------------------------------------------------------------------

def bench_anderson_share(args, m) -> dict:
    """Server-side cost of Anderson acceleration: the share of an accelerated FedPi round
    (Softmax 60x10, m clients, all participating, 10 prox steps) spent in ``Anderson.step`` on
    the [m, d] state. Target <= 5%."""
    from pflcore.algorithms import Accelerated, FedPi
    from pflcore.ops.anderson import Anderson

    fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, max_size=args.max_size)
    ctx = Context(fed, Softmax(60, 10), torch.device("cpu"), seed=0)
    alg = Accelerated(FedPi(eta=0.5, prox_steps=10), memory=5)
    state = alg.init(ctx)
    for t in range(1, 8):  # fill the history (memory + 1 pairs)
        state = alg.round(state, ctx, t)
    spent, rounds = [], []
    real_step = Anderson.step

    def timed_step(self, u, tu, **kw):
        t0 = time.perf_counter()
        out = real_step(self, u, tu, **kw)
        spent.append(time.perf_counter() - t0)
        return out
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
                anderson_share=share, threads=torch.get_num_threads())


def rows_of_anderson(a):
    return [(f"FedPi+Anderson round, m={a['m']}, state {a['m']}x{a['d']}", a["round_s"], None, None, None),
            ("  Anderson.step share of the round", a["anderson_step_s"], a["anderson_share"], 0.05, "le")]


# ---- main -------------------------------------------------------------------------------------------

PARTS = ("rounds", "accuracy", "pfedme_round", "pfedme_round_mlp", "mlp_step", "cnn", "anderson_share")
ROWS = {"rounds": rows_of_rounds, "accuracy": rows_of_accuracy, "pfedme_round": rows_of_pfedme_round,
        "pfedme_round_mlp": rows_of_pfedme_round_mlp, "mlp_step": rows_of_mlp_step, "cnn": rows_of_cnn,
        "anderson_share": rows_of_anderson}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds: a smoke run")
    ap.add_argument("--only", action="append", choices=PARTS,
                    help="run only this part (repeatable; default: all); the other parts' entries in --out are kept")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "algorithms.json"), help="JSON output path")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the best is kept)")
    ap.add_argument("--slow-clients", type=int, default=100,
                    help="time the per-client loops on this many clients and scale by the client count (0 = all)")
    ap.add_argument("--max-size", type=int, default=2000, help="cap on the rows of a client (train + test), m = 1,000")
    ap.add_argument("--warm", type=int, default=5, help="part rounds: untimed rounds at the start of each run")
    ap.add_argument("--block", type=int, default=20, help="part rounds: rounds per timed block")
    ap.add_argument("--blocks", type=int, default=5, help="part rounds: timed blocks per run (the best is kept)")
    ap.add_argument("--cnn-clients", type=int, default=100, help="part cnn: clients")
    args = ap.parse_args()
    m = 100 if args.quick else 1000
    if args.quick:
        args.slow_clients = min(args.slow_clients or 20, 20)
        args.repeats = min(args.repeats, 3)
    if not args.slow_clients:
        args.slow_clients = None
    parts = [p for p in PARTS if p in (args.only or PARTS)]
    status = backend.status()
    if not status["native"][0]:
        raise SystemExit(f"the native backend is not available: {status['native'][1]}")
    warn_if_busy()
    t0 = time.perf_counter()
    results = {part: entry for part, entry in read_json(args.out).items() if part in PARTS}
    run_fn = {"rounds": lambda: bench_rounds(args), "accuracy": lambda: bench_accuracy(args),
              "pfedme_round": lambda: bench_pfedme_round(args, m),
              "pfedme_round_mlp": lambda: bench_pfedme_round_mlp(args, m),
              "mlp_step": lambda: bench_mlp_step(args, m), "cnn": lambda: bench_cnn(args),
              "anderson_share": lambda: bench_anderson_share(args, m)}
    for part in parts:
        l0, p0 = loadavg(), time.perf_counter()
        results[part] = run_fn[part]()
        results[part]["measured"] = dict(
            timestamp=now(), git_commit=machine_info()["git_commit"], quick=args.quick, repeats=args.repeats,
            slow_clients=args.slow_clients, torch_threads=torch.get_num_threads(), loadavg_1min_start=l0,
            loadavg_1min_end=loadavg(), wall_s=time.perf_counter() - p0)
    print_table([row for part in parts for row in ROWS[part](results[part])])
    results["table"] = [r.as_dict() for part in PARTS if part in results
                        for r in rows_from(ROWS[part](results[part]))]
    results["config"] = {k: v for k, v in vars(args).items() if k != "only"} | {"parts": parts}
    results["total_wall_s"] = time.perf_counter() - t0
    write_json(args.out, results)
    print(f"\nwrote {args.out} (parts run now: {', '.join(parts)}; {results['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
