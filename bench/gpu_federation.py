"""A whole federation on the GPU against the same run on the machine's CPU cores.

Workload (the same on both devices, one process): ``data.synthetic(0.5, 0.5, num_clients=m,
size_scale=1, max_size=20)`` (20 rows a client: 15 train, 5 test; dim 60, 10 classes, float32),
model Softmax(60, 10), FedAvg and pFedMe (``train_all=False``: the sampled clients train) with
the hyperparameters of experiments/pfedme_table1_synthetic_mlr.toml (bench/scale.py's), for each
cohort size (clients a round) ``pflcore.run(..., rounds, clients_per_round, eval_every,
device)``. Reported per run: training seconds a round (run's own ``seconds`` column, the mean
over the rounds after the first evaluation: warm), seconds per evaluation round (every
``evaluate_round`` call timed, median; it evaluates all m clients' test rows and a train-loss
sample), the run's wall time, the final accuracy, and on the GPU the peak memory that torch
allocated. The GPU/CPU ratio of the round time is the speed-up.

Largest federation in GPU memory: the peak allocation at m and at ``--memory-clients``
(one GPU run of each algorithm at that size, 2 rounds, evaluated) gives bytes per client and a
fixed part; the largest m whose peak fits the device's memory is extrapolated from that line
(stated as an extrapolation in the output).

    python bench/gpu_federation.py                               # on a machine with a GPU
    python bench/gpu_federation.py --dry-run                     # the code paths on the CPU, tiny

Writes ``--out`` (default bench/results/gpu_federation.json; a dry run writes nothing unless
``--out`` is given).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=100_000, help="m, the federation's clients")
    ap.add_argument("--cohorts", type=int, nargs="+", default=[20, 1000], help="clients a round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--cpu-threads", type=int, default=os.cpu_count(), help="torch and OpenMP threads of the CPU runs")
    ap.add_argument("--memory-clients", type=int, default=1_000_000,
                    help="second size of the memory line (0: skip the extrapolation)")
    ap.add_argument("--glm-variants", nargs="*", default=["warp_fast"],
                    help="PFLCORE_CUDA_GLM values whose GPU runs are repeated after the default's (A/B)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.clients, args.cohorts, args.rounds, args.eval_every = 300, [5, 50], 4, 2
        args.devices, args.memory_clients = ["cpu"], 0
    return args


def _federation(m: int):
    from pflcore import data
    t0 = time.perf_counter()
    fed = data.synthetic(0.5, 0.5, num_clients=m, size_scale=1, max_size=20, seed=0)
    return fed, time.perf_counter() - t0


def one_run(algorithm, fed, device: str, cohort: int, rounds: int, eval_every: int) -> dict:
    import torch

    import pflcore
    from pflcore import models
    from scale import _timed_evaluations

    run_module = sys.modules["pflcore.run"]
    evals: list = []

    class _NoPeaks:  # scale's wrapper records memory phases; here only the times are wanted
        def start(self, tidy=True):
            return 0

        def stop(self, *a, **k):
            return {}

    original = _timed_evaluations(run_module, _NoPeaks(), evals)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        res = pflcore.run(algorithm, fed, models.Softmax(60, 10), rounds=rounds, clients_per_round=cohort,
                          eval_every=eval_every, device=device, progress=False, seed=0)
        wall = time.perf_counter() - t0
    finally:
        run_module.evaluate_round = original
    rows = [r for r in res.history if r["round"] > 0]
    warm = [r["seconds"] for r in rows[1:]] or [r["seconds"] for r in rows]
    last = res.history[-1]
    out = {"algorithm": repr(algorithm), "device": device, "clients_per_round": cohort, "rounds": rounds,
           "eval_every": eval_every, "round_s": statistics.mean(warm),
           "round_s_by_period": [r["seconds"] for r in rows], "evaluate_s": statistics.median(evals),
           "evaluate_s_all": evals, "run_wall_s": wall,
           "accuracy": {k: last[k] for k in ("personalized_acc", "global_acc") if k in last}}
    if device == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if "cuda" in args.devices and not torch.cuda.is_available():
        print("bench/gpu_federation.py: no CUDA device is visible to torch; nothing was measured "
              "(`--dry-run` checks the script on the CPU)")
        return 0
    from _harness import write_json
    from scale import algorithms

    from pflcore import backend

    fed, gen_s = _federation(args.clients)
    print(f"federation: {args.clients:,} clients, {int(fed.train.offsets[-1]):,} train rows "
          f"(generated in {gen_s:.1f} s)", flush=True)
    res = {"workload": f"data.synthetic(0.5, 0.5, num_clients={args.clients}, size_scale=1, max_size=20); "
                       f"Softmax(60, 10); FedAvg and pFedMe (train_all=False) with "
                       f"experiments/pfedme_table1_synthetic_mlr.toml's hyperparameters; rounds={args.rounds}, "
                       f"eval_every={args.eval_every}",
           "clients": args.clients, "runs": [], "cpu_threads": args.cpu_threads}
    for device in args.devices:
        if device == "cpu":
            torch.set_num_threads(args.cpu_threads)
        res.setdefault("backends", {})[device] = {k: v[1] for k, v in backend.status().items()}
        for alg in algorithms():
            for cohort in args.cohorts:
                r = one_run(alg, fed, device, cohort, args.rounds, args.eval_every)
                res["runs"].append(r)
                print(f"  {device:4s} {alg.name:7s} {cohort:5d}/round: {r['round_s'] * 1e3:9.2f} ms a round, "
                      f"{r['evaluate_s'] * 1e3:8.2f} ms an evaluation, accuracy {r['accuracy']}", flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
    if "cuda" in args.devices:  # the GPU runs again with each other GLM kernel, the default's A/B
        from _harness import environ
        for variant in args.glm_variants:
            for alg in algorithms():
                for cohort in args.cohorts:
                    with environ(PFLCORE_CUDA_GLM=variant):
                        r = one_run(alg, fed, "cuda", cohort, args.rounds, args.eval_every)
                    r["glm_kernel"] = variant
                    res.setdefault("variant_runs", []).append(r)
                    print(f"  cuda {alg.name:7s} {cohort:5d}/round, PFLCORE_CUDA_GLM={variant}: "
                          f"{r['round_s'] * 1e3:9.2f} ms a round, {r['evaluate_s'] * 1e3:8.2f} ms an evaluation, "
                          f"accuracy {r['accuracy']}", flush=True)
                    torch.cuda.empty_cache()
    key = lambda r: (r["algorithm"].split("(")[0], r["clients_per_round"])  # noqa: E731
    cpu_runs = {key(r): r for r in res["runs"] if r["device"] == "cpu"}

    def vs_cpu(gpu_runs):  # each GPU run's speed-up over the CPU run of its algorithm and cohort
        return [{**({"glm_kernel": r["glm_kernel"]} if "glm_kernel" in r else {}), "algorithm": key(r)[0],
                 "clients_per_round": key(r)[1], "round": cpu["round_s"] / r["round_s"],
                 "evaluation": cpu["evaluate_s"] / r["evaluate_s"]}
                for r in gpu_runs if (cpu := cpu_runs.get(key(r))) is not None]

    res["speedup"] = vs_cpu(r for r in res["runs"] if r["device"] == "cuda")
    if res.get("variant_runs"):
        res["variant_speedup"] = vs_cpu(res["variant_runs"])
    if "cuda" in args.devices and args.memory_clients:
        del fed
        big, gen_big = _federation(args.memory_clients)
        print(f"memory line: {args.memory_clients:,} clients (generated in {gen_big:.1f} s)", flush=True)
        total = torch.cuda.get_device_properties(0).total_memory
        res["memory"] = {"device_bytes": total, "points": [], "largest_clients_extrapolated": {}}
        for alg in algorithms():
            small = next(r for r in res["runs"] if r["device"] == "cuda" and r["algorithm"] == repr(alg)
                         and r["clients_per_round"] == max(args.cohorts))
            r = one_run(alg, big, "cuda", max(args.cohorts), 2, 2)
            torch.cuda.empty_cache()
            slope = (r["peak_gpu_bytes"] - small["peak_gpu_bytes"]) / (args.memory_clients - args.clients)
            fixed = small["peak_gpu_bytes"] - slope * args.clients
            largest = int((total - fixed) / slope) if slope > 0 else None
            res["memory"]["points"].append({"algorithm": alg.name, "clients": [args.clients, args.memory_clients],
                                            "peak_gpu_bytes": [small["peak_gpu_bytes"], r["peak_gpu_bytes"]],
                                            "bytes_per_client": slope, "round_s_at_memory_clients": r["round_s"],
                                            "evaluate_s_at_memory_clients": r["evaluate_s"]})
            res["memory"]["largest_clients_extrapolated"][alg.name] = largest
            print(f"  {alg.name}: {slope:.0f} B a client on the GPU -> about {largest:,} clients in "
                  f"{total / 2 ** 30:.0f} GiB (extrapolated); at {args.memory_clients:,}: "
                  f"{r['round_s'] * 1e3:.2f} ms a round, {r['evaluate_s'] * 1e3:.2f} ms an evaluation", flush=True)
    print("\nGPU round vs CPU round (same run, same machine):")
    for s in res["speedup"]:
        print(f"  {s['algorithm']:7s} {s['clients_per_round']:5d}/round: {s['round']:6.1f}x a round, "
              f"{s['evaluation']:6.1f}x an evaluation")
    for s in res.get("variant_speedup", []):
        print(f"  {s['algorithm']:7s} {s['clients_per_round']:5d}/round, PFLCORE_CUDA_GLM={s['glm_kernel']}: "
              f"{s['round']:6.1f}x a round, {s['evaluation']:6.1f}x an evaluation")
    out = args.out or (None if args.dry_run else os.path.join(HERE, "results", "gpu_federation.json"))
    if out:
        write_json(out, res)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
