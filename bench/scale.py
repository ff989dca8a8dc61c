"""Scale: seconds per round and peak memory against the number of clients, 10^3 to 10^6.

For each m (a fresh process per m, so that its peak RSS is its own):

1. Data: ``data.synthetic(0.5, 0.5, num_clients=m, size_scale=1, max_size=20, seed=0)``: 20 rows
   per client (pFedMe's sizes are lognormal + 50 >= 50 rows, so the cap makes every client 20
   rows: 15 train, 5 test), dim 60, 10 classes, float32. Timed, with the peak RSS it adds.
2. FedAvg and pFedMe with the hyperparameters of experiments/pfedme_table1_synthetic_mlr.toml
   (read from it), model Softmax(60, 10), ``clients_per_round`` = 1,000 (m when m < 1,000),
   5 rounds, ``pflcore.run(..., eval_every=1)``: every round is evaluated (the round-0 state
   too, as run always does), over all m clients' train and test rows. pFedMe runs with
   ``train_all=False`` so that the 1,000 sampled clients train (its default, the public code's,
   trains all m clients every round: 10^6 clients x 100 steps per round).
   Reported per algorithm: seconds per round of training (median of the 5 rounds, run's own
   ``seconds`` column), seconds per evaluation (median of the 6 ``evaluate_round`` calls),
   their sum (a round evaluated every round), and the peak RSS of the run.

Peak RSS: ``VmHWM`` (Linux /proc/self/status), reset before each phase through
``/proc/self/clear_refs`` so that every phase (generation, algorithm init, each round, each
evaluation) has its own peak; the process's peak is the largest. Data bytes = x, y, offsets of
train and test, weights and truth.

``--profile``: at the largest m, cProfile of one more round and one evaluation of each
algorithm (top functions by own time) and the phases' peak memory, to find costs that grow
with m although a round touches 1,000 clients.

``--data``: the generator alone at the issue's size, ``synthetic(0.5, 0.5, num_clients=m,
size_scale=1, max_size=200)`` for m = 20,000 and 100,000: time and peak RSS against the data's
bytes.

Run from the repository root (one heavy job at a time; the 10^6 point needs ~16 GB):

    python bench/scale.py                         # 10^3 .. 10^6, with --profile at 10^6
    python bench/scale.py --clients 1000 10000    # a quick subset
    python bench/scale.py --data                  # the generator figures

Writes bench/results/scale.json (updated, not replaced: a run keeps the other entries) and
bench/results/scale.png.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from _harness import RESULTS, machine_info, now, read_json, warn_if_busy, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOML = os.path.join(ROOT, "experiments", "pfedme_table1_synthetic_mlr.toml")
DEFAULT_CLIENTS = [1_000, 10_000, 100_000, 1_000_000]


# ---- memory ------------------------------------------------------------------------------------

def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peaks:
    """Peak RSS per phase: ``with peaks.phase(name):`` resets VmHWM to VmRSS (clear_refs 5) and
    records (peak above the RSS at entry, RSS at exit); ``overall`` is the process's peak."""

    def __init__(self):
        self.phases, self.overall = [], _status("VmHWM")
        try:
            self._trim = ctypes.CDLL(None).malloc_trim  # freed heap back to the system
        except AttributeError:
            self._trim = None
        try:
            self._reset()
            self.resettable = True
        except OSError:
            self.resettable = False

    def _reset(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def start(self, tidy: bool = True) -> int:
        """Reset the peak; ``tidy``: first collect garbage and hand freed heap back to the system
        (tens of ms: not inside a timed round), so that the RSS at entry is what is in use."""
        self.overall = max(self.overall, _status("VmHWM"))
        if tidy:
            gc.collect()
            if self._trim is not None:
                self._trim(0)
        if self.resettable:
            self._reset()
        return _status("VmRSS")

    def stop(self, name: str, before: int, **extra) -> dict:
        hwm = _status("VmHWM")
        self.overall = max(self.overall, hwm)
        row = {"phase": name, "rss_before": before, "peak_added": hwm - before, "rss_after": _status("VmRSS"),
               "peak": hwm, **extra}
        self.phases.append(row)
        return row


def _nbytes(fed) -> int:
    ts = [fed.train.x, fed.train.y, fed.train.offsets, fed.test.x, fed.test.y, fed.test.offsets, fed.weights,
          fed.truth, fed.truth_global]
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ---- the algorithms ----------------------------------------------------------------------------

def algorithms():
    """FedAvg and pFedMe as in the pFedMe Table 1 experiment file (pFedMe: the sampled clients
    train, see the module docstring)."""
    import tomllib

    from pflcore.algorithms import FedAvg, PFedMe

    with open(TOML, "rb") as f:
        spec = tomllib.load(f)["algorithms"]
    keep = lambda d: {k: v for k, v in d.items() if k != "type"}  # noqa: E731
    assert spec["FedAvg"]["type"] == "fedavg" and spec["pFedMe"]["type"] == "pfedme"
    return [FedAvg(**keep(spec["FedAvg"])), PFedMe(**keep(spec["pFedMe"]), train_all=False)]


def _timed_evaluations(run_module, peaks, store):
    """Wrap run's evaluate_round so that each call is timed and gets its own memory phase."""
    original = run_module.evaluate_round

    def wrapper(algorithm, state, ctx, t, *args, **kwargs):
        before = peaks.start()
        t0 = time.perf_counter()
        row = original(algorithm, state, ctx, t, *args, **kwargs)
        store.append(time.perf_counter() - t0)
        peaks.stop(f"{algorithm.name} evaluate (round {t})", before, seconds=store[-1])
        return row

    run_module.evaluate_round = wrapper
    return original


def _round_function(run_module):
    """What run times as a round: its ``_round`` (the algorithm's round plus run's checks of
    the new state) when it has one, else the algorithm's ``round``."""
    inner = getattr(run_module, "_round", None)
    if inner is not None:
        return inner, lambda alg, state, ctx, t: inner(alg, state, ctx, t, None)
    return None, lambda alg, state, ctx, t: type(alg).round(alg, state, ctx, t)


def _timed_rounds(run_module, peaks):
    """Give each round its own memory phase (wrapping run's ``_round``); returns a function
    that undoes it. Without ``_round`` (a later run.py), rounds get no phase of their own."""
    inner, _ = _round_function(run_module)
    if inner is None:
        return lambda: None

    def round_(algorithm, state, ctx, t, saved):
        before = peaks.start(tidy=False)  # inside run's timing: only the cheap reset
        state = inner(algorithm, state, ctx, t, saved)
        peaks.stop(f"{algorithm.name} round {t}", before)
        return state

    run_module._round = round_
    return lambda: setattr(run_module, "_round", inner)


def _profile(fn, top: int = 25) -> list:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]


def worker(m: int, rounds: int, cohort: int, profile: bool, threads: int) -> dict:
    """One m: generate, run both algorithms, (optionally) profile. Returns the JSON row."""
    import torch

    torch.set_num_threads(threads)
    import pflcore
    from pflcore import data, models

    run_module = sys.modules["pflcore.run"]
    peaks = Peaks()
    data.synthetic(0.5, 0.5, num_clients=3, size_scale=1, max_size=20)  # first-call allocations
    before = peaks.start()
    t0 = time.perf_counter()
    fed = data.synthetic(0.5, 0.5, num_clients=m, size_scale=1, max_size=20, seed=0)
    gen = peaks.stop("generate", before, seconds=time.perf_counter() - t0)
    model = models.Softmax(fed.num_features, fed.num_classes)
    row = {"m": m, "rows": fed.train.num_rows + fed.test.num_rows, "train_rows": fed.train.num_rows,
           "data_bytes": _nbytes(fed), "generate_s": gen["seconds"], "generate_peak_added": gen["peak_added"],
           "baseline_rss": before, "cohort": min(cohort, m), "rounds": rounds, "eval_every": 1,
           "torch_threads": torch.get_num_threads(), "peak_reset_per_phase": peaks.resettable, "algorithms": {}}
    for alg in algorithms():
        evals: list = []
        undo_rounds = _timed_rounds(run_module, peaks)
        original = _timed_evaluations(run_module, peaks, evals)
        first = len(peaks.phases)
        try:
            start = peaks.start()
            t0 = time.perf_counter()
            res = pflcore.run(alg, fed, model, rounds=rounds, clients_per_round=min(cohort, m), seed=0,
                              eval_every=1, progress=False)
            wall = time.perf_counter() - t0
        finally:
            run_module.evaluate_round = original
            undo_rounds()
        mine = peaks.phases[first:]
        train_s = sorted(h["seconds"] for h in res.history[1:])
        eval_s = sorted(evals)
        last = res.history[-1]
        row["algorithms"][alg.name] = {
            "repr": repr(alg), "round_s": train_s[len(train_s) // 2],
            "round_s_all": [h["seconds"] for h in res.history[1:]],
            "evaluate_s": eval_s[len(eval_s) // 2], "evaluate_s_all": evals,
            "round_with_eval_s": train_s[len(train_s) // 2] + eval_s[len(eval_s) // 2], "run_wall_s": wall,
            "rss_before": start, "peak_rss": max(p["peak"] for p in mine),
            "peak_added_round": max((p["peak_added"] for p in mine if " round " in p["phase"]), default=None),
            "peak_added_evaluate": max(p["peak_added"] for p in mine if "evaluate" in p["phase"]),
            "state_bytes": sum(t.numel() * t.element_size() for t in vars(res.state).values()
                               if isinstance(t, torch.Tensor)),
            "accuracy": {k: last[k] for k in ("personalized_acc", "global_acc") if k in last},
        }
        del res
        if profile:
            row["algorithms"][alg.name]["profile"] = profile_one(alg, fed, model, cohort, rounds, run_module)
    row["peak_rss"] = peaks.overall
    row["phases"] = peaks.phases
    return row


def profile_one(alg, fed, model, cohort: int, rounds: int, run_module) -> dict:
    """cProfile of one more round (as run times it: with its checks of the new state) and one
    evaluation, on a fresh context (the round's clients are round ``rounds + 1``'s)."""
    import torch

    from pflcore.algorithms.base import Context
    from pflcore.run import evaluate_round

    ctx = Context(fed, model, torch.device("cpu"), 0, min(cohort, fed.num_clients))
    state = alg.init(ctx)
    holder = {}
    t = rounds + 1
    _, round_ = _round_function(run_module)
    return {"round": _profile(lambda: holder.setdefault("s", round_(alg, state, ctx, t))),
            "evaluate": _profile(lambda: evaluate_round(alg, holder["s"], ctx, t))}


def data_worker(m: int) -> dict:
    """The generator alone at the issue's size (max_size=200)."""
    from pflcore import data

    peaks = Peaks()
    data.synthetic(0.5, 0.5, num_clients=3, size_scale=1, max_size=20)
    before = peaks.start()
    t0 = time.perf_counter()
    fed = data.synthetic(0.5, 0.5, num_clients=m, size_scale=1, max_size=200)
    ph = peaks.stop("generate", before, seconds=time.perf_counter() - t0)
    return {"m": m, "call": f"data.synthetic(0.5, 0.5, num_clients={m}, size_scale=1, max_size=200)",
            "seconds": ph["seconds"], "data_bytes": _nbytes(fed), "peak_added": ph["peak_added"],
            "peak_rss": peaks.overall, "baseline_rss": before,
            "peak_added_over_data": ph["peak_added"] / _nbytes(fed), "peak_rss_over_data": peaks.overall / _nbytes(fed)}


# ---- the parent: one process per m, table, JSON, plot -------------------------------------------

def _child(args: list, threads: int = 1) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__)] + args
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def table(rows: list) -> str:
    """Markdown: per m the data, the generator's cost, and per algorithm seconds per round of
    training, seconds per evaluation of all clients, and the run's peak RSS."""
    head = ("| clients | rows | data GB | generate s | generate peak GB (added / data) | FedAvg s/round "
            "| FedAvg eval s "
            "| FedAvg peak GB | pFedMe s/round | pFedMe eval s | pFedMe peak GB (state GB) |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        fa, pm = r["algorithms"]["FedAvg"], r["algorithms"]["pFedMe"]
        gen_peak = r["baseline_rss"] + r["generate_peak_added"]
        lines.append(f"| {r['m']:,} | {r['rows']:,} | {_gb(r['data_bytes'])} | {r['generate_s']:.1f} "
                     f"| {_gb(gen_peak)} ({r['generate_peak_added'] / r['data_bytes']:.2f}) "
                     f"| {fa['round_s']:.3f} | {fa['evaluate_s']:.3f} | {_gb(fa['peak_rss'])} "
                     f"| {pm['round_s']:.3f} | {pm['evaluate_s']:.3f} "
                     f"| {_gb(pm['peak_rss'])} ({_gb(pm['state_bytes'])}) |")
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[plot]'): no PNG")
        return
    ms = [r["m"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("FedAvg", "o-"), ("pFedMe", "s-")):
        a.plot(ms, [r["algorithms"][name]["round_s"] for r in rows], style, label=f"{name}: round")
        a.plot(ms, [r["algorithms"][name]["evaluate_s"] for r in rows], style[0] + "--", alpha=0.5,
               label=f"{name}: evaluation (all clients)")
    cohort = rows[-1]["cohort"]
    a.set(xscale="log", yscale="log", xlabel="clients m", ylabel="seconds",
          title=f"{cohort:,} clients per round, 20 rows each, {rows[-1]['torch_threads']} thread(s)")
    a.legend(fontsize=8)
    b.plot(ms, [r["data_bytes"] / 1e9 for r in rows], "k:", label="data (x, y, offsets, truth)")
    b.plot(ms, [1.5 * r["data_bytes"] / 1e9 for r in rows], "k--", alpha=0.4, label="1.5x data")
    b.plot(ms, [r["generate_peak_added"] / 1e9 + r["baseline_rss"] / 1e9 for r in rows], "^-",
           label="peak RSS after generating")
    b.plot(ms, [r["peak_rss"] / 1e9 for r in rows], "v-", label="peak RSS of the process")
    b.set(xscale="log", yscale="log", xlabel="clients m", ylabel="GB", title="memory")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=DEFAULT_CLIENTS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cohort", type=int, default=1000, help="clients per round")
    p.add_argument("--profile", action="store_true", help="profile at the largest m (default with 10^6 in --clients)")
    p.add_argument("--data", action="store_true", help="the generator alone at 20,000 and 100,000 clients")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and OpenMP threads (default 1: on a shared 2-core machine thread pools stall)")
    p.add_argument("--out", default=os.path.join(RESULTS, "scale.json"))
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data-worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.rounds, args.cohort, args.profile, args.threads)))
        return
    if args.data_worker is not None:
        print(json.dumps(data_worker(args.data_worker)))
        return

    result = read_json(args.out)
    warn_if_busy()
    measured = {"timestamp": now(), **machine_info(), "worker_threads": args.threads}
    if args.data:
        result["generator"] = {"measured": measured, "rows": [_child(["--data-worker", str(m)])
                                                              for m in (20_000, 100_000)]}
        for r in result["generator"]["rows"]:
            print(f"{r['call']}: {r['seconds']:.1f} s, peak RSS {_gb(r['peak_rss'])} GB "
                  f"({_gb(r['peak_added'])} GB above the process before it) for {_gb(r['data_bytes'])} GB of data")
    else:
        profile_at = max(args.clients) if (args.profile or max(args.clients) >= 1_000_000) else None
        rows = []
        for m in sorted(args.clients):
            extra = ["--profile"] if m == profile_at else []
            t0 = time.perf_counter()
            rows.append(_child(["--worker", str(m), "--rounds", str(args.rounds), "--cohort", str(args.cohort),
                                "--threads", str(args.threads)] + extra, args.threads))
            print(f"m = {m:,}: {time.perf_counter() - t0:.0f} s", flush=True)
        old = {r["m"]: r for r in result.get("scale", {}).get("rows", [])}
        old.update({r["m"]: r for r in rows})
        rows = [old[m] for m in sorted(old)]
        result["scale"] = {"measured": measured, "rows": rows,
                           "workload": "data.synthetic(0.5, 0.5, num_clients=m, size_scale=1, max_size=20): 20 rows "
                                       "per client; Softmax(60, 10); FedAvg and pFedMe (train_all=False) with "
                                       "experiments/pfedme_table1_synthetic_mlr.toml's hyperparameters; "
                                       f"{args.cohort} clients per round, {args.rounds} rounds, eval_every=1"}
        print(table(rows))
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {write_json(args.out, result, machine=False)}")


if __name__ == "__main__":
    main()
