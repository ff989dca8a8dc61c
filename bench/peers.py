"""pflcore against the frameworks users would otherwise pick, on one FedAvg workload.

Workload (pFedMe's Synthetic(0.5, 0.5) setting): ``pflcore.data.synthetic(0.5, 0.5,
num_clients=100)`` (dim 60, 10 classes, 75/25 train/test split), a linear softmax model started
at zero, FedAvg with 10 clients a round, 20 local SGD steps on minibatches of 20 rows drawn with
replacement, lr 0.02, no momentum, the server average weighted by the clients' sample counts.
A second configuration has 1,000 clients and a cohort of 100 (pflcore and pfl-research).

  pflcore       ``pflcore.run(FedAvg(lr=0.02, local_steps=20, batch_size=20), fed, Softmax(60, 10),
                clients_per_round=10, eval_every=...)``
  pfl-research  Apple's ``pfl`` as its own benchmarks use it (bench/_peer_pfl.py says how, and
                what was changed through its public API to make the workload the same)
  Flower        a ClientApp/ServerApp pair as in Flower's PyTorch quickstart, on its simulation
                engine (``run_simulation``, ray) (bench/_peer_flower.py, idem)

Measured, per framework and configuration, without evaluation and evaluating every round:
  - seconds per round: (T(R) − T(R0)) / (R − R0), where T(n) is the wall time of a whole run of
    n rounds (setting up, starting ray, the first round's warm-up and the final evaluation are
    the same in both and cancel); the best of ``--repeats`` runs of each length is used, and the
    frameworks' runs are interleaved so that the machine's load reaches all of them alike; every
    framework first runs once untimed (imports, caches, ray's first start). pflcore's rounds
    without evaluation are so short that they are timed on runs 10x as long (10·R0 and 10·R);
    for Flower the median time between the ends of rounds 3..R inside a run is recorded too;
  - the test accuracy of the final global model after R rounds, all computed by one function
    here (the global model on every client's test rows) -- the workloads must agree on it;
  - the ratios to pflcore.
"Evaluating every round" means what each framework does when asked to: pflcore's ``run`` records
the global model's test accuracy and loss on all clients and the training loss on all training
rows; pfl-research evaluates each trained user before and after training and runs the central
evaluation on all test rows; Flower runs the centralized ``evaluate_fn`` on all test rows.

``--threads N`` sets torch's and OpenMP's thread count for every framework (Flower's ray actors
get 1 CPU each, as its simulation docs configure them). On a 2-core machine shared with other
busy processes, torch's OpenMP pool stalls on every small op (a [20, 10] cross-entropy waits a
scheduler quantum for its second thread): all frameworks then slow down many-fold, and
``--threads 1`` measures them at their best.

    pip install ".[peers,plot]"
    python bench/peers.py --threads 1     # ~10 minutes (Flower: ~0.2 s per round, ray starts 9 times)
    python bench/peers.py --quick         # fewer rounds, one repeat (~2-3 minutes)
    python bench/peers.py --only pflcore --only pfl

Prints the table and writes ``--out`` (default bench/results/peers.json) and a PNG beside it.
The peers' console output goes to ``--log``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FRAMEWORKS = ("pflcore", "pfl", "flower")
NAMES = {"pflcore": "pflcore", "pfl": "pfl-research", "flower": "Flower"}
WORKLOAD = dict(lr=0.02, local_steps=20, batch_size=20)
PFLCORE_SCALE = 10


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="R = 20 and R0 = 5 rounds (1,000 clients: 8 and 3), 1 repeat")
    ap.add_argument("--only", action="append", choices=FRAMEWORKS, help="run only this framework (repeatable)")
    ap.add_argument("--rounds", type=int, default=100, help="R: rounds of the long run (accuracy after R rounds)")
    ap.add_argument("--short-rounds", type=int, default=20, help="R0: rounds of the short run")
    ap.add_argument("--rounds-1k", type=int, default=30, help="R for the 1,000-client configuration")
    ap.add_argument("--short-rounds-1k", type=int, default=10, help="R0 for the 1,000-client configuration")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each length for pflcore and pfl-research")
    ap.add_argument("--flower-repeats", type=int, default=2, help="runs of each length for Flower")
    ap.add_argument("--no-1k", action="store_true", help="skip the 1,000-client configuration")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peers.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG and reprint the table from --out")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "pflcore_peers.log"),
                    help="where the peers' console output goes")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.short_rounds, args.rounds_1k, args.short_rounds_1k = 20, 5, 8, 3
        args.repeats = args.flower_repeats = 1
    return args


@contextlib.contextmanager
def console_to(path):
    """Sends this process's stdout and stderr (and its children's: ray's) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:  # before torch and pflcore's OpenMP runtime start
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network here: Flower's telemetry would wait
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    sys.path.insert(0, HERE)
    import torch

    import pflcore
    import _harness as H

    if args.replot:
        results = H.read_json(args.out)
        print_table(results)
        print("wrote", plot(results, os.path.splitext(args.out)[0] + ".png", H))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [f for f in FRAMEWORKS if f in (args.only or FRAMEWORKS)]
    missing = {}
    for f, module in (("pfl", "pfl"), ("flower", "flwr")):
        if f in wanted:
            try:
                __import__(module)
            except ImportError as e:
                missing[f] = f"not installed ({e}); pip install '.[peers]'"
    for f, why in missing.items():
        print(f"{NAMES[f]}: {why}")
    wanted = [f for f in wanted if f not in missing]
    load0 = H.warn_if_busy()
    print(f"console output of the peers: {args.log}")

    configs = [("100 clients, cohort 10", 100, 10, args.rounds, args.short_rounds, wanted)]
    if not args.no_1k:
        configs.append(("1,000 clients, cohort 100", 1000, 100, args.rounds_1k, args.short_rounds_1k,
                        [f for f in wanted if f != "flower"]))
    results = {"workload": {"data": "pflcore.data.synthetic(0.5, 0.5, num_clients=m), dim 60, 10 classes",
                            "model": "linear softmax (Softmax(60, 10)), zero init", "algorithm": "FedAvg",
                            **WORKLOAD, "minibatches": "drawn with replacement", "momentum": 0,
                            "aggregation": "weighted by sample counts"},
               "threads": torch.get_num_threads(), "seed": args.seed, "configs": []}
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="pflcore_peers_")
    for label, m, cohort, R, R0, frameworks in configs:
        fed = pflcore.data.synthetic(0.5, 0.5, num_clients=m, seed=args.seed)
        print(f"\n[{label}] {fed.train.num_rows:,} training rows, {fed.test.num_rows:,} test rows; R = {R}, R0 = {R0}",
              flush=True)
        runner = make_runners(fed, cohort, args, tmp, frameworks)
        entry = {"config": label, "clients": m, "cohort": cohort, "rounds": R, "short_rounds": R0,
                 "train_rows": fed.train.num_rows, "test_rows": fed.test.num_rows, "frameworks": {}}
        # pflcore's rounds without evaluation last ~1 ms: those runs are PFLCORE_SCALE times longer,
        # so that the difference of the two runs stands well above the noise; its accuracy then
        # comes from a run of R rounds.
        lengths = {(f, ev): ((R0 * PFLCORE_SCALE, R * PFLCORE_SCALE) if f == "pflcore" and not ev else (R0, R))
                   for f in frameworks for ev in (False, True)}
        times = {(f, ev, n): [] for (f, ev), ns in lengths.items() for n in ns}
        finals, intervals = {}, {}
        for f in frameworks:  # warm-up: imports, caches, ray's first start
            with console_to(args.log):
                runner[f](2, False)
                if f == "pflcore":
                    finals[(f, False)] = runner[f](R, False)
        reps = {f: (args.flower_repeats if f == "flower" else args.repeats) for f in frameworks}
        for rep in range(max(reps.values())):
            for f in frameworks:
                if rep >= reps[f]:
                    continue
                for evaluate in (False, True):
                    short, long_ = lengths[(f, evaluate)]
                    for n in (short, long_):
                        t0 = time.perf_counter()
                        with console_to(args.log):
                            final = runner[f](n, evaluate)
                        times[(f, evaluate, n)].append(time.perf_counter() - t0)
                        if f == "flower" and n == long_:
                            clock = sys.modules["_peer_flower"].LAST_RUN.get("round_clock", [])
                            intervals.setdefault(evaluate, []).extend(b - a for a, b in zip(clock[2:], clock[3:]))
                        if n == R and finals.get((f, evaluate)) is None:
                            finals[(f, evaluate)] = final
                    per = per_round(times, f, evaluate, short, long_)
                    print(f"  {NAMES[f]:<13} {'evaluating every round' if evaluate else 'no evaluation':<23} "
                          f"repeat {rep + 1}: {per * 1e3:9.2f} ms/round (best T({long_}) = "
                          f"{min(times[(f, evaluate, long_)]):.2f} s, T({short}) = "
                          f"{min(times[(f, evaluate, short)]):.2f} s)", flush=True)
        for f in frameworks:
            row = {}
            for evaluate, key in ((False, "no_eval"), (True, "eval_every_round")):
                row[f"{key}_rounds_timed"] = list(lengths[(f, evaluate)])
                row[f"{key}_s_per_round"] = per_round(times, f, evaluate, *lengths[(f, evaluate)])
                row[f"{key}_accuracy"] = accuracy(fed, *finals[(f, evaluate)])
                row[f"{key}_runs_s"] = {str(n): times[(f, evaluate, n)] for n in lengths[(f, evaluate)]}
                if f == "flower" and intervals.get(evaluate):
                    # a cross-check inside one run: the median time between the ends of rounds 3..R
                    row[f"{key}_median_round_interval_s"] = statistics.median(intervals[evaluate])
            entry["frameworks"][NAMES[f]] = row
        base = entry["frameworks"].get("pflcore")
        for name, row in entry["frameworks"].items():
            if base:
                row["ratio_to_pflcore_no_eval"] = row["no_eval_s_per_round"] / base["no_eval_s_per_round"]
                row["ratio_to_pflcore_eval_every_round"] = (row["eval_every_round_s_per_round"]
                                                            / base["eval_every_round_s_per_round"])
        results["configs"].append(entry)
    results["total_wall_s"] = time.perf_counter() - t_start
    results["measured"] = {"loadavg_1min_start": load0, "loadavg_1min_end": H.loadavg(), "versions": versions()}
    print_table(results)
    H.write_json(args.out, results)
    png = plot(results, os.path.splitext(args.out)[0] + ".png", H)
    print(f"\nwrote {args.out}" + (f" and {png}" if png else "") + f" ({results['total_wall_s']:.0f} s)")
    return 0


def make_runners(fed, cohort, args, tmp, frameworks):
    """{framework: run(rounds, evaluate) -> (weight [C, p], bias [C])}."""
    import torch

    import pflcore
    from pflcore.algorithms import FedAvg
    from pflcore.models import Softmax

    p, C = fed.train.x.shape[1], fed.num_classes
    runners = {}

    def run_pflcore(rounds, evaluate):
        res = pflcore.run(FedAvg(lr=WORKLOAD["lr"], local_steps=WORKLOAD["local_steps"],
                                 batch_size=WORKLOAD["batch_size"]), fed, Softmax(p, C), rounds=rounds,
                          clients_per_round=cohort, eval_every=1 if evaluate else rounds, seed=args.seed,
                          progress=False)
        W = res.global_model.view(p + 1, C)
        return W[:p].T.clone(), W[p].clone()
    runners["pflcore"] = run_pflcore

    if "pfl" in frameworks:
        import _peer_pfl

        def run_pfl(rounds, evaluate):
            return _peer_pfl.run(fed, rounds=rounds, cohort=cohort, evaluate=evaluate, seed=args.seed, **WORKLOAD)
        runners["pfl"] = run_pfl

    if "flower" in frameworks:
        import _peer_flower
        path = os.path.join(tmp, f"federation_{fed.num_clients}.pt")
        _peer_flower.save_federation(fed, path)

        def run_flower(rounds, evaluate):
            import random
            random.seed(args.seed)  # the server's node sampling
            torch.manual_seed(args.seed)
            return _peer_flower.run(path, clients=fed.num_clients, rounds=rounds, cohort=cohort, evaluate=evaluate,
                                    **WORKLOAD)
        runners["flower"] = run_flower
    return runners


def per_round(times, f, evaluate, short, long_):
    return (min(times[(f, evaluate, long_)]) - min(times[(f, evaluate, short)])) / (long_ - short)


def accuracy(fed, weight, bias) -> float:
    """Test accuracy of a global linear model on every client's test rows."""
    import torch
    with torch.no_grad():
        logits = fed.test.x @ weight.to(fed.test.x.dtype).T + bias.to(fed.test.x.dtype)
        return float((logits.argmax(1) == fed.test.y).double().mean())


def versions():
    import torch

    import pflcore
    out = {"pflcore": pflcore.__version__, "torch": torch.__version__}
    from importlib.metadata import version
    for name in ("pfl", "flwr", "ray"):
        try:
            out[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            out[name] = None
    return out


def print_table(results):
    print(f"\n{'configuration':<27} {'framework':<13} {'ms/round':>10} {'ratio':>8} {'ms/round eval':>14} "
          f"{'ratio':>8} {'accuracy':>9} {'acc (eval)':>10}")
    for entry in results["configs"]:
        for name, row in entry["frameworks"].items():
            r1, r2 = row.get("ratio_to_pflcore_no_eval"), row.get("ratio_to_pflcore_eval_every_round")
            print(f"{entry['config']:<27} {name:<13} {row['no_eval_s_per_round'] * 1e3:10.2f} "
                  f"{'' if r1 is None else f'{r1:7.1f}x':>8} {row['eval_every_round_s_per_round'] * 1e3:14.2f} "
                  f"{'' if r2 is None else f'{r2:7.1f}x':>8} {row['no_eval_accuracy']:9.4f} "
                  f"{row['eval_every_round_accuracy']:10.4f}")
    for entry in results["configs"]:
        for name, row in entry["frameworks"].items():
            if row.get("no_eval_median_round_interval_s") is not None:
                print(f"{name}, {entry['config']}: median time between rounds inside a run "
                      f"{row['no_eval_median_round_interval_s'] * 1e3:.1f} ms (evaluating every round "
                      f"{row['eval_every_round_median_round_interval_s'] * 1e3:.1f} ms)")
    print(f"(accuracy: the final global model on all test rows after R rounds; threads: {results['threads']})")


def plot(results, path, H):
    groups = {}
    for entry in results["configs"]:
        for key, what in (("no_eval", "no evaluation"), ("eval_every_round", "evaluating every round")):
            groups[f"{entry['config']}, {what}: seconds per round / pflcore's"] = {
                name: row[f"ratio_to_pflcore_{key}"] for name, row in entry["frameworks"].items()
                if row.get(f"ratio_to_pflcore_{key}") is not None}
    ms = {f"{e['config']}": {n: r["no_eval_s_per_round"] * 1e3 for n, r in e["frameworks"].items()}
          for e in results["configs"]}
    title = "FedAvg, Synthetic(0.5, 0.5), 20 local steps of B=20: time per round relative to pflcore\n" + "\n".join(
        f"{c}, no evaluation: " + ", ".join(f"{n} {v:.1f} ms" for n, v in d.items()) for c, d in ms.items())
    return H.plot_ratio_groups(groups, path, title=title, xlabel="seconds per round / pflcore's", baseline="pflcore")


if __name__ == "__main__":
    sys.exit(main())
