"""Server-side costs of CGPFL and PERM at scale (issue 5), measured in one process.

(1) CGPFL's clustering share. Workload: ``data.contexts`` with m = 10,000 clients (4
    contexts, dim 60, 10 classes, sizes uniform in [50, 250]), ``Softmax(60, 10)``, CGPFL with
    K = 4, λ = 12, β = 0.005, η = 0.005, S = 5 inner steps, R = 10 local rounds, minibatches of
    20, all clients participating. The timed round is t = 3 (after two untimed rounds, so the
    contexts exist and the clustering is the warm-started one of every later round); every
    repeat starts from a deep copy of the same state. Timers wrap ``Context.kmeans`` (Lloyd,
    i.e. ``ops.kmeans`` in one process) and ``Context.cluster_means`` (the per-context means)
    inside the round. Reported: the round's time and
    the share spent clustering (target <= 10%).

(2) PERM's mixing weights. Workload: the same generator with m = 2,000 clients, PERM with
    ``local_steps = 5`` full-batch steps and λ_α = 100. Timed: ``perm.mixing_weights`` (one
    ``ops.gradients`` call, then ``perm.screened_weights``: only the distances of pairs that can
    carry weight, and their water-filling; each part also timed alone, and the dense solve it
    replaced, ``pairwise_sqdist`` + ``water_filling``, after checking that both give the same α),
    against
      (a) one round of local steps on the same federation: every one of the m models takes its
          5 steps (the cost of a FedAvg round with all clients, or of a PERM shuffling round
          in which no pair is skipped) -- the target (issue 24): α costs at most half of this;
      (b) one PERM shuffling round as implemented: pairs (model i, client it visits) with
          α = 0 are skipped, so with ~4% of the weights nonzero only ~4% of the models train
          and this round is far cheaper than (a); reported, without a target.
    α is recomputed every ``alpha_every`` (default 10) rounds; its cost per round is also
    reported amortized over those rounds.
      (c) single-loop PERM (all clients every round, 5 full-batch FedAvg steps): what α adds to
          the round that recomputes it, against the next round, which does not. There α's
          gradient pass at w̃ is also the FedAvg steps' first (the paper's Algorithm 2), so α adds
          its solve and the pass's excess over one local step -- the same target, ≤ 0.5× (a).
      (d) α at a later w̃, after 20 FedAvg rounds of all clients: the gradients have shrunk ~14x,
          each client's weights sit on its nearest ~5% with water levels far below the groups'
          spread, the cluster screen would leave groups of most columns, and the pair screen in
          16 principal directions (``perm._perm_principal``) computes the costs of ~165 pairs a
          row (what a two-loop α after a longer warm-up, or a single-loop run's later α, costs;
          the warm-up of (a) is one round) -- the same target.
      (e) a whole single-loop run (α every 2 rounds, 30 rounds timed one by one): the median
          round that recomputes α against the median other round, with the pair screen available
          and with the cluster screen alone (what the screens do over a run's regimes).
      (f) ``PERM(alpha_pool=s)``'s pooled α (each model's weights over s clients drawn uniformly
          and its own client; ``perm._perm_pool``) for s = 100 and 200, at the w̃ of (a) and of
          (d): the gradient pass and the pooled solve, alternated with the round (a), after
          checking 64 rows against the definition -- the same target, by the issue's other route
          ("or on a sample of clients"); and, as (c), what it adds to a single-loop round.
      (g) what the pool costs in accuracy: two-loop PERM at m = 2,000 (pools of 100, 200, 500),
          two-loop and single-loop at m = 200 (pools of 10, 20, 50; 3 seeds), the same generator,
          2 epochs of model shuffling; the personalized test accuracy at the end against exact α's.
      (h) single-loop PERM at m = 100,000 with ``alpha_pool = 200``: the rounds that recompute α,
          α's memory and the process' peak (exact α would be 80 GB).

    Precision: the gradients are float32, so the screened solve multiplies in float32 (rows shifted
    by their group's mean; ``screened_weights``' ``products``). Its α is compared with the dense
    float64 solve, beside the scale of the gradients' own rounding: α from the same gradients
    computed in float64 against α from the float32 ones. ``products=torch.float64`` is also timed.

Times are the best of ``--repeats`` runs (time.perf_counter); α and the round it is compared with
alternate run by run. The 1-minute load average is
recorded: this 2-core machine is shared, so timings are noisy.

    python bench/server_steps.py            # ~2 minutes
    python bench/server_steps.py --quick    # m = 2,000 and 500, a smoke run

Writes ``--out`` (default bench/results/server_steps.json).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

from pflcore import algorithms as A
from pflcore import data, models, ops
from pflcore.algorithms import perm as perm_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, even under PYTHONSAFEPATH
from _harness import Stopwatch, best_of, warn_if_busy, write_json  # noqa: E402


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
        with Stopwatch([(A.Context, "kmeans"), (A.Context, "cluster_means")]) as timer:
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
    lam_alpha, alpha_every = 100.0, 10
    alg = A.PERM(warmup_rounds=1, lam_alpha=lam_alpha, lr=0.05, local_steps=5, alpha_every=alpha_every)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.round(alg.init(ctx), ctx, 1)  # the warm-up: w̃ after one FedAvg round
    state = alg.round(state, ctx, 2)          # α and the first shuffling round
    # agreement first: the screened α (what mixing_weights uses from SCREEN_MIN_CLIENTS clients on)
    # against the dense water-filling of all m² distances
    W = state.w.expand(m, state.w.shape[0]).contiguous()
    G = ops.gradients(model, W, fed.train)
    D = perm_module.pairwise_sqdist(G)
    dense = perm_module.water_filling(D, fed.train.sizes, lam_alpha)
    screened = perm_module.screened_weights(G, fed.train.sizes, lam_alpha)
    agreement = float((screened - dense).abs().max())
    same_support = bool(torch.equal(screened > 1e-12, dense > 1e-12))
    # the scale of the float32 gradients' own rounding: α from float64 gradients at the same w̃
    G64 = ops.gradients(model, W.double(), fed.train.to(None, torch.float64))
    inherent = float((perm_module.water_filling(perm_module.pairwise_sqdist(G64), fed.train.sizes, lam_alpha)
                      - dense).abs().max())
    assert agreement <= 4 * inherent + 1e-12, (agreement, inherent)
    # the parts of mixing_weights, each alone (same calls as inside it), and the dense solve it replaced
    parts = {"gradients_s": best_of(lambda: ops.gradients(model, W, fed.train), repeats),
             "screened_weights_s": best_of(lambda: perm_module.screened_weights(G, fed.train.sizes, lam_alpha),
                                           repeats),
             "screened_weights_float64_products_s": best_of(
                 lambda: perm_module.screened_weights(G, fed.train.sizes, lam_alpha, products=torch.float64), repeats),
             "pairwise_sqdist_s": best_of(lambda: perm_module.pairwise_sqdist(G), repeats),
             "water_filling_s": best_of(lambda: perm_module.water_filling(D, fed.train.sizes, lam_alpha), repeats)}
    parts["dense_alpha_s"] = parts["gradients_s"] + parts["pairwise_sqdist_s"] + parts["water_filling_s"]

    theta = state.theta.clone()
    visited = alg.visits(state.sigma, state.shuffle_rounds)

    def all_models_round():  # (a): every model's 5 steps on the client it visits, no pair skipped
        t = theta.clone()
        ops.local_steps(model, t, fed.train, steps=5, lr=0.05, rows=visited)
    clone_s = best_of(lambda: theta.clone(), repeats)
    # α and the round alternate, so that a change of the machine's load reaches both (the ratio is
    # the target); the best of each
    alpha_runs, round_runs = [], []
    for _ in range(repeats):
        alpha_runs.append(best_of(lambda: perm_module.mixing_weights(model, state.w, fed.train, lam_alpha), 1))
        round_runs.append(best_of(all_models_round, 1))
    alpha_s = min(alpha_runs)
    full_round_s = max(min(round_runs) - clone_s, 1e-9)

    single = bench_single_loop_alpha(fed, model, lam_alpha, alpha_every, repeats)
    late = bench_late_alpha(fed, model, lam_alpha, repeats)
    run = bench_single_loop_run(fed, model, lam_alpha)
    pooled = bench_pooled_alpha(fed, model, lam_alpha, {"early": state.w, "late": late.pop("late_w")},
                                all_models_round, clone_s, repeats)

    def shuffle():  # (b)
        alg._shuffle(copy.deepcopy(state), ctx, 3)
    copy_s = best_of(lambda: copy.deepcopy(state), repeats)  # the copy is inside `shuffle`: subtract it
    shuffle_s = max(best_of(shuffle, repeats) - copy_s, 1e-9)
    active = float((state.alpha > 0).sum(1).double().mean())
    return {"m": m, "rows": fed.train.num_rows, "alpha_s": alpha_s, **parts,
            "screened_vs_dense_max_abs_diff": agreement, "screened_same_support": same_support,
            "float64_vs_float32_gradients_max_abs_diff": inherent,
            "full_round_s": full_round_s, "ratio": alpha_s / full_round_s, "target_ratio": 0.5,
            "pass": alpha_s <= 0.5 * full_round_s, "ratio_dense": parts["dense_alpha_s"] / full_round_s,
            "shuffle_round_s": shuffle_s, "ratio_to_shuffle_round": alpha_s / shuffle_s,
            "alpha_every": alpha_every, "alpha_per_round_amortized_s": alpha_s / alpha_every,
            "mean_active_weights_per_client": active, **single,
            "single_loop_alpha_ratio": single["single_loop_alpha_s"] / full_round_s, **late, **run,
            "late_alpha_ratio": late["late_alpha_s"] / full_round_s, "pooled": pooled,
            "single_loop_pass": single["single_loop_alpha_s"] <= 0.5 * full_round_s}


def bench_single_loop_alpha(fed, model, lam_alpha, alpha_every, repeats, alpha_pool=None):
    """(c) What α adds to a single-loop PERM round (all clients each round, 5 full-batch FedAvg
    steps): the round that recomputes α against the round after it, which does not (both from
    copies of the same state, alternating, best of each). In the first, α's gradient pass at w̃
    also gives the FedAvg steps' first step (the paper's Algorithm 2), so α adds its solve and the
    difference between that pass and one local step; the rest of the two rounds (the FedAvg steps,
    the shuffling round's steps on ~4% of the models) is alike."""
    alg = A.PERM(warmup_rounds=1, lam_alpha=lam_alpha, lr=0.05, local_steps=5, single_loop=True,
                 alpha_every=alpha_every, alpha_pool=alpha_pool)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.round(alg.round(alg.init(ctx), ctx, 1), ctx, 2)  # warm-up, then α and a shuffling round
    runs = {True: [], False: []}
    for _ in range(repeats):
        for refresh in (True, False):
            s = copy.deepcopy(state)
            s.shuffle_rounds = alpha_every * 5 + (0 if refresh else 1)  # α recomputed when divisible
            t0 = time.perf_counter()
            alg.round(s, ctx, 3)
            runs[refresh].append(time.perf_counter() - t0)
    with_alpha, without = min(runs[True]), min(runs[False])
    return {"single_loop_round_with_alpha_s": with_alpha, "single_loop_round_without_alpha_s": without,
            "single_loop_alpha_s": max(with_alpha - without, 0.0)}


LATE_ROUNDS = 20  # part (d): FedAvg rounds before α


def bench_late_alpha(fed, model, lam_alpha, repeats):
    """(d) α at a w̃ after ``LATE_ROUNDS`` FedAvg rounds (all clients, 5 full-batch steps), where the
    gradients have shrunk: the water levels sit far below the groups' spread and the screen leaves
    groups of most columns (a two-loop α after a longer warm-up, a single-loop run's later α).
    Timed as (a)'s α (``mixing_weights``, best of ``repeats``), against the same round (a)."""
    alg = A.PERM(warmup_rounds=LATE_ROUNDS, lam_alpha=lam_alpha, lr=0.05, local_steps=5)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    state = alg.init(ctx)
    for t in range(1, LATE_ROUNDS + 1):
        state = alg.round(state, ctx, t)  # the warm-up: FedAvg rounds (α not yet computed)
    w = state.w.clone()
    alpha = perm_module.mixing_weights(model, w, fed.train, lam_alpha)
    # agreement first: against the dense float64 water-filling of all m² costs at that w̃ (the pair
    # screen's float32 differences: each cost within ~1.1e-6 relatively)
    G = ops.gradients(model, w, fed.train)
    dense = perm_module.water_filling(perm_module.pairwise_sqdist(G), fed.train.sizes, lam_alpha)
    agreement = float((alpha - dense).abs().max())
    assert agreement <= 1e-6, agreement
    late_s = best_of(lambda: perm_module.mixing_weights(model, w, fed.train, lam_alpha), repeats)
    return {"late_w": w, "late_rounds": LATE_ROUNDS, "late_alpha_s": late_s, "late_vs_dense_max_abs_diff": agreement,
            "late_gradient_norm": float(ops.gradients(model, w, fed.train).norm(dim=1).mean()),
            "late_mean_active_weights_per_client": float((alpha > 0).sum(1).double().mean())}


POOLS = (100, 200)  # part (f): pool sizes s at m = 2,000 (m/20, m/10)


def bench_pooled_alpha(fed, model, lam_alpha, ws, all_models_round, clone_s, repeats):
    """(f) ``PERM(alpha_pool=s)``'s α (the gradients' pass and the pooled solve,
    ``perm.weights_from_gradients(..., pool=)``) at the w̃ of (a) and of (d), alternated with the
    round (a) in this process. Agreement first: 64 rows against the definition
    (``_perm_pool.weights_ref``: each row's float64 water-filling over its pool and own client)."""
    from pflcore.algorithms import _perm_pool
    m, sizes = fed.train.num_clients, fed.train.sizes
    out = []
    for where, w in ws.items():
        for s in POOLS:
            pool = _perm_pool.draw(m, s, seed=0, refresh=0)
            G = ops.gradients(model, w, fed.train)
            alpha = perm_module.weights_from_gradients(G, sizes, lam_alpha, pool=pool)
            rows = torch.arange(0, m, max(1, m // 64))
            want = _perm_pool.weights_ref(G, sizes, pool, lam_alpha, rows)
            agreement = float((_perm_pool.dense(alpha[rows], pool, rows, m) - want).abs().max())
            assert agreement <= 1e-9, agreement  # float64 products: to rounding

            def pooled():
                perm_module.weights_from_gradients(ops.gradients(model, w, fed.train), sizes, lam_alpha, pool=pool)
            alpha_runs, round_runs = [], []
            for _ in range(repeats):
                alpha_runs.append(best_of(pooled, 1))
                round_runs.append(best_of(all_models_round, 1))
            round_s = max(min(round_runs) - clone_s, 1e-9)
            out.append({"w": where, "pool": s, "alpha_s": min(alpha_runs), "round_s": round_s,
                        "ratio": min(alpha_runs) / round_s, "vs_definition_max_abs_diff": agreement,
                        "mean_active_weights_per_client": float((alpha > 0).sum(1).double().mean())})
    for s in POOLS:  # single-loop, as (c): what the pooled α adds to the round that recomputes it
        single = bench_single_loop_alpha(fed, model, lam_alpha, 10, repeats, alpha_pool=s)
        round_s = max(best_of(all_models_round, repeats) - clone_s, 1e-9)
        out.append({"w": "single_loop", "pool": s, "alpha_s": single["single_loop_alpha_s"], "round_s": round_s,
                    "ratio": single["single_loop_alpha_s"] / round_s, **single})
    return out


# part (g): (m, single_loop, pools, seeds); m = 2,000 single-loop (4,000 rounds of ~55 ms) is left out
ACCURACY = ((2000, False, (100, 200, 500), (0,)), (200, False, (10, 20, 50), (0, 1, 2)),
            (200, True, (10, 20, 50), (0, 1, 2)))


def bench_pool_accuracy():
    """(g) What the pool costs in accuracy: PERM two-loop (20 warm-up rounds) at m = 2,000 and m =
    200, single-loop (α every 10 rounds) at m = 200, 2 epochs of model shuffling (2m rounds) on the
    same generator (4 contexts), exact α against pools; the personalized test accuracy (mean over
    clients, and its 10th percentile) at the end, mean over the seeds of the run (same data), and
    the FedAvg model's."""
    import pflcore
    rows = []
    for m, single, pools, seeds in ACCURACY:
        fed = data.contexts(num_clients=m, num_contexts=4, dim=60, num_classes=10, sizes=(50, 250), seed=1)
        model = models.Softmax(60, 10)
        for pool in (None,) + pools:
            acc, p10, glob, took = [], [], [], 0.0
            for seed in seeds:
                alg = A.PERM(warmup_rounds=1 if single else 20, lam_alpha=100.0, lr=0.05, local_steps=5,
                             single_loop=single, alpha_every=10, alpha_pool=pool)
                rounds = (1 if single else 20) + 2 * m
                t0 = time.perf_counter()
                last = pflcore.run(alg, fed, model, rounds=rounds, eval_every=rounds, seed=seed, progress=False,
                                   train_loss="none").history[-1]
                took += time.perf_counter() - t0
                acc.append(last["personalized_acc"])
                p10.append(last["personalized_acc_p10"])
                glob.append(last["global_acc"])
            rows.append({"m": m, "single_loop": single, "pool": pool, "personalized_acc": sum(acc) / len(acc),
                         "personalized_acc_p10": sum(p10) / len(p10), "global_acc": sum(glob) / len(glob),
                         "per_seed": acc, "run_s": took / len(seeds)})
    return rows


SCALE_M, SCALE_POOL = 100_000, 200  # part (h)


def bench_pool_at_scale():
    """(h) Single-loop PERM at m = 100,000 (the same generator, sizes 20-40: 2.2M rows) with
    ``alpha_pool = 200``, α every 5 rounds, 1,000 clients a round, 12 rounds timed one by one: the
    rounds that recompute α (a gradient pass over every client and the pooled solve) against the
    others, α's size, and the process' peak memory. Exact α would be a float64 [10⁵, 10⁵]: 80 GB."""
    import resource
    import pflcore
    fed = data.contexts(num_clients=SCALE_M, num_contexts=4, dim=60, num_classes=10, sizes=(20, 40), seed=1)
    model = models.Softmax(60, 10)
    alg = A.PERM(warmup_rounds=2, lam_alpha=100.0, lr=0.05, local_steps=5, single_loop=True, alpha_every=5,
                 alpha_pool=SCALE_POOL)
    stamps = []
    t0 = time.perf_counter()
    res = pflcore.run(alg, fed, model, rounds=12, clients_per_round=1000, eval_every=12, progress=False,
                      train_loss="none", callbacks=[lambda r, row, state, evaluated=False: stamps.append(
                          time.perf_counter())])
    took = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    refresh = [took[t - 1] for t in (3, 8)]  # rounds 3 and 8 recompute α (shuffling rounds 0 and 5)
    others = sorted(took[t - 1] for t in range(4, 12) if t != 8)
    return {"m": SCALE_M, "pool": SCALE_POOL, "rows": fed.train.num_rows, "alpha_rounds_s": refresh,
            "other_round_median_s": others[len(others) // 2], "alpha_bytes": res.state.alpha.numel() * 8,
            "exact_alpha_bytes": SCALE_M * SCALE_M * 8,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


RUN_ROUNDS = 30  # part (e)


def bench_single_loop_run(fed, model, lam_alpha):
    """(e) A whole single-loop run, α every 2 rounds, ``RUN_ROUNDS`` rounds timed one by one: the
    median round that recomputes α against the median other round (rounds 3 on), with the pair
    screen available (the default) and with the cluster screen alone, alternated twice (the
    medians of each kind over both runs)."""
    from pflcore.algorithms import _perm_principal
    alg = A.PERM(warmup_rounds=1, lam_alpha=lam_alpha, lr=0.05, local_steps=5, single_loop=True, alpha_every=2)
    ctx = A.Context(fed, model, torch.device("cpu"), seed=0)
    kernel = _perm_principal.kernel
    kinds = {"default": kernel, "clusters_only": lambda G: None}
    rounds = {name: {True: [], False: []} for name in kinds}
    totals = {name: [] for name in kinds}
    try:
        for _ in range(2):
            for name, k in kinds.items():
                _perm_principal.kernel = k
                state, total = alg.init(ctx), 0.0
                for t in range(1, RUN_ROUNDS + 1):
                    refresh = t > 2 and state.shuffle_rounds % 2 == 0  # α recomputed in this round
                    t0 = time.perf_counter()
                    state = alg.round(state, ctx, t)
                    dt = time.perf_counter() - t0
                    total += dt
                    if t > 2:
                        rounds[name][refresh].append(dt)
                totals[name].append(total)
    finally:
        _perm_principal.kernel = kernel
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    out = {"run_rounds": RUN_ROUNDS}
    for name in kinds:
        out[f"run_{name}_alpha_round_s"] = med(rounds[name][True])
        out[f"run_{name}_other_round_s"] = med(rounds[name][False])
        out[f"run_{name}_total_s"] = min(totals[name])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "server_steps.json"))
    args = ap.parse_args()
    m_cgpfl, m_perm = (2000, 500) if args.quick else (10_000, 2000)
    warn_if_busy()
    cg = bench_cgpfl(m_cgpfl, args.repeats)
    pe = bench_perm(m_perm, args.repeats)
    print(f"CGPFL round, m = {cg['m']:,}: {cg['round_s'] * 1e3:.1f} ms, clustering {cg['clustering_s'] * 1e3:.1f} ms"
          f" = {100 * cg['clustering_share']:.1f}% (target <= 10%): {'PASS' if cg['pass'] else 'FAIL'}")
    print(f"PERM, m = {pe['m']:,}: mixing weights {pe['alpha_s'] * 1e3:.1f} ms (gradients "
          f"{pe['gradients_s'] * 1e3:.1f}, screened distances + water-filling {pe['screened_weights_s'] * 1e3:.1f}; "
          f"max|Δα| vs dense float64 {pe['screened_vs_dense_max_abs_diff']:.1e} (float64 vs float32 gradients: "
          f"{pe['float64_vs_float32_gradients_max_abs_diff']:.1e}), same support: {pe['screened_same_support']})"
          f" vs a round of local steps of all m models {pe['full_round_s'] * 1e3:.1f} ms:"
          f" ratio {pe['ratio']:.2f} (target <= 0.5): {'PASS' if pe['pass'] else 'FAIL'}")
    print(f"  single-loop PERM (all clients, full-batch FedAvg steps), α's gradients also its FedAvg steps' first: "
          f"a round {pe['single_loop_round_with_alpha_s'] * 1e3:.1f} ms with α, "
          f"{pe['single_loop_round_without_alpha_s'] * 1e3:.1f} without: α adds {pe['single_loop_alpha_s'] * 1e3:.1f} ms,"
          f" ratio {pe['single_loop_alpha_ratio']:.2f} (target <= 0.5): {'PASS' if pe['single_loop_pass'] else 'FAIL'}")
    print(f"  a single-loop run, α every 2 rounds, {pe['run_rounds']} rounds: rounds recomputing α "
          f"{pe['run_default_alpha_round_s'] * 1e3:.1f} ms (median) against {pe['run_default_other_round_s'] * 1e3:.1f} "
          f"for the others, the run {pe['run_default_total_s']:.2f} s; with the cluster screen alone "
          f"{pe['run_clusters_only_alpha_round_s'] * 1e3:.1f} against {pe['run_clusters_only_other_round_s'] * 1e3:.1f} ms, "
          f"{pe['run_clusters_only_total_s']:.2f} s")
    print(f"  after {pe['late_rounds']} FedAvg rounds (gradients' mean norm {pe['late_gradient_norm']:.2f}, "
          f"{pe['late_mean_active_weights_per_client']:.1f} nonzero weights per client, max|Δα| vs dense float64 "
          f"{pe['late_vs_dense_max_abs_diff']:.1e}): α {pe['late_alpha_s'] * 1e3:.1f} ms, "
          f"ratio {pe['late_alpha_ratio']:.2f} (target <= 0.5): {'PASS' if pe['late_alpha_ratio'] <= 0.5 else 'FAIL'}")
    print(f"  the screened solve with float64 products: {pe['screened_weights_float64_products_s'] * 1e3:.1f} ms")
    print(f"  the dense solve: distances {pe['pairwise_sqdist_s'] * 1e3:.1f} + water-filling "
          f"{pe['water_filling_s'] * 1e3:.1f} + gradients = {pe['dense_alpha_s'] * 1e3:.1f} ms, ratio {pe['ratio_dense']:.2f}")
    print(f"  vs PERM's shuffling round, pairs with α = 0 skipped ({pe['mean_active_weights_per_client']:.1f} nonzero "
          f"weights per client): {pe['shuffle_round_s'] * 1e3:.1f} ms, ratio {pe['ratio_to_shuffle_round']:.1f}; α every "
          f"{pe['alpha_every']} rounds = {pe['alpha_per_round_amortized_s'] * 1e3:.1f} ms per round")
    for row in pe["pooled"]:
        if row["w"] == "single_loop":
            print(f"  single-loop PERM with alpha_pool = {row['pool']} (as above): a round "
                  f"{row['single_loop_round_with_alpha_s'] * 1e3:.1f} ms with α, "
                  f"{row['single_loop_round_without_alpha_s'] * 1e3:.1f} without: α adds {row['alpha_s'] * 1e3:.1f} ms,"
                  f" ratio {row['ratio']:.2f} (target <= 0.5): {'PASS' if row['ratio'] <= 0.5 else 'FAIL'}")
            continue
        print(f"  pooled α (alpha_pool = {row['pool']}, at the w̃ of {'(a)' if row['w'] == 'early' else '(d)'}; "
              f"{row['mean_active_weights_per_client']:.1f} nonzero weights per client, max|Δα| vs its definition "
              f"{row['vs_definition_max_abs_diff']:.1e}): {row['alpha_s'] * 1e3:.1f} ms against the round's "
              f"{row['round_s'] * 1e3:.1f}: ratio {row['ratio']:.2f} (target <= 0.5): "
              f"{'PASS' if row['ratio'] <= 0.5 else 'FAIL'}")
    accuracy = None if args.quick else bench_pool_accuracy()
    for row in accuracy or []:
        print(f"  accuracy, m = {row['m']:,}, {'single-loop' if row['single_loop'] else 'two-loop'}, "
              f"{'exact α' if row['pool'] is None else 'pool of %d' % row['pool']}: personalized "
              f"{row['personalized_acc']:.3f} (10th percentile {row['personalized_acc_p10']:.3f}; seeds "
              f"{', '.join('%.3f' % a for a in row['per_seed'])}; FedAvg's model {row['global_acc']:.3f}), "
              f"a run {row['run_s']:.1f} s")
    scale = None if args.quick else bench_pool_at_scale()
    if scale:
        print(f"  single-loop PERM at m = {scale['m']:,} ({scale['rows']:,} rows), alpha_pool = {scale['pool']}: the "
              f"rounds recomputing α {', '.join('%.2f' % x for x in scale['alpha_rounds_s'])} s, the others "
              f"{scale['other_round_median_s'] * 1e3:.0f} ms (median); α {scale['alpha_bytes'] / 2**20:.0f} MiB "
              f"(exact: {scale['exact_alpha_bytes'] / 1e9:.0f} GB), peak memory {scale['max_rss_bytes'] / 2**30:.2f} GiB")
    out = {"cgpfl_clustering": cg, "perm_mixing_weights": pe, "pool_accuracy": accuracy, "pool_at_scale": scale,
           "quick": args.quick, "repeats": args.repeats}
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
