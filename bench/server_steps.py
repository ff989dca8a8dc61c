"""Server-side costs of CGPFL and PERM at scale (issue 5), measured in one process.

(1) CGPFL's clustering share. Workload: ``data.contexts`` with m = 10,000 clients (4
    contexts, dim 60, 10 classes, sizes uniform in [50, 250]), ``Softmax(60, 10)``, CGPFL with
    K = 4, λ = 12, β = 0.005, η = 0.005, S = 5 inner steps, R = 10 local rounds, minibatches of
    20, all clients participating. The timed round is t = 3 (after two untimed rounds, so the
    contexts exist and the clustering is the warm-started one of every later round); every
    repeat starts from a deep copy of the same state. Timers wrap ``ops.kmeans`` and the
    per-context mean (``ops.kmeans._update``) inside the round. Reported: the round's time and
    the share spent clustering (target <= 10%).

(2) PERM's mixing weights. Workload: the same generator with m = 2,000 clients, PERM with
    ``local_steps = 5`` full-batch steps. Timed: ``perm.mixing_weights`` (one ``ops.gradients``
    call, the pairwise distances, the water-filling solve), against one shuffling round of
    PERM (``local_steps`` for all m models, each on the client it visits). Reported: both
    times and their ratio (target: α costs less than one round, ratio < 1).

Times are the best of ``--repeats`` runs (time.perf_counter). The 1-minute load average is
recorded: this 2-core machine is shared, so timings are noisy.

    python bench/server_steps.py            # ~1 minute
    python bench/server_steps.py --quick    # m = 2,000 and 500, a smoke run

Writes ``--out`` (default bench/results/server_steps.json).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import time

import torch

from pflcore import algorithms as A
from pflcore import data, models, ops
from pflcore.algorithms import perm as perm_module


def best_of(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Timer:
    """Wraps module attributes and accumulates the seconds spent inside them."""

    def __init__(self, targets):
        self.targets, self.seconds, self.saved = targets, 0.0, []

    def __enter__(self):
        for module, name in self.targets:
            fn = getattr(module, name)
            self.saved.append((module, name, fn))

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t0
            setattr(module, name, timed)
        return self

    def __exit__(self, *exc):
        for module, name, fn in self.saved:
            setattr(module, name, fn)


def bench_cgpfl(m, repeats):
    fed = data.contexts(num_clients=m, num_contexts=4, dim=60, num_classes=10, sizes=(50, 250), seed=0)
    model = models.Softmax(60, 10)
    alg = A.CGPFL(4, lam=12.0, beta=0.005, lr=0.005, inner_steps=5, local_rounds=10, batch_size=20)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.init(ctx)
    for t in (1, 2):
        state = alg.round(state, ctx, t)
    best = None
    for _ in range(repeats):
        s = copy.deepcopy(state)
        from pflcore.algorithms import cgpfl as cgpfl_module
        with Timer([(ops, "kmeans"), (cgpfl_module, "_cluster_means")]) as timer:
            t0 = time.perf_counter()
            alg.round(s, ctx, 3)
            total = time.perf_counter() - t0
        if best is None or total < best[0]:
            best = (total, timer.seconds)
    total, clustering = best
    return {"m": m, "rows": fed.train.num_rows, "round_s": total, "clustering_s": clustering,
            "clustering_share": clustering / total, "target_share": 0.10, "pass": clustering / total <= 0.10}


def bench_perm(m, repeats):
    fed = data.contexts(num_clients=m, num_contexts=4, dim=60, num_classes=10, sizes=(50, 250), seed=1)
    model = models.Softmax(60, 10)
    alg = A.PERM(warmup_rounds=1, lam_alpha=100.0, lr=0.05, local_steps=5)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.round(alg.init(ctx), ctx, 1)  # the warm-up: w̃ after one FedAvg round
    state = alg.round(state, ctx, 2)          # α and the first shuffling round
    alpha_s = best_of(lambda: perm_module.mixing_weights(model, state.w, fed.train, 100.0), repeats)

    def shuffle():
        alg._shuffle(copy.deepcopy(state), ctx, 3)
    shuffle_s = best_of(shuffle, repeats)
    copy_s = best_of(lambda: copy.deepcopy(state), repeats)  # the copy is inside `shuffle`: subtract it
    round_s = max(shuffle_s - copy_s, 1e-9)
    active = float((state.alpha > 0).sum(1).double().mean())
    return {"m": m, "rows": fed.train.num_rows, "alpha_s": alpha_s, "shuffle_round_s": round_s,
            "ratio": alpha_s / round_s, "mean_active_weights_per_client": active, "target_ratio": 1.0,
            "pass": alpha_s < round_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "server_steps.json"))
    args = ap.parse_args()
    m_cgpfl, m_perm = (2000, 500) if args.quick else (10_000, 2000)
    cg = bench_cgpfl(m_cgpfl, args.repeats)
    pe = bench_perm(m_perm, args.repeats)
    print(f"CGPFL round, m = {cg['m']:,}: {cg['round_s'] * 1e3:.1f} ms, clustering {cg['clustering_s'] * 1e3:.1f} ms"
          f" = {100 * cg['clustering_share']:.1f}% (target <= 10%): {'PASS' if cg['pass'] else 'FAIL'}")
    print(f"PERM, m = {pe['m']:,}: mixing weights {pe['alpha_s'] * 1e3:.1f} ms vs one shuffling round "
          f"{pe['shuffle_round_s'] * 1e3:.1f} ms, ratio {pe['ratio']:.2f} (target < 1): {'PASS' if pe['pass'] else 'FAIL'}"
          f"; {pe['mean_active_weights_per_client']:.1f} nonzero weights per client")
    out = {"cgpfl_clustering": cg, "perm_mixing_weights": pe, "threads": torch.get_num_threads(),
           "load_average_1min": os.getloadavg()[0], "machine": platform.platform(), "torch": torch.__version__,
           "timestamp": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
