"""pflcore on a busy machine: its slowdown under load against torch's, in one script.

Users share cores (a laptop with a browser, a cluster node with other jobs, a CI runner). Here
the load is one busy process per core (a spinning Python process each; `stress-ng --cpu N` does
the same). For each setting, a child process times, quiet and then under that load, round-robin:

  * pflcore: ``ops.local_steps``, 1,000 clients x 1 minibatch step of B = 20, Softmax 60 x 10
    (24.4 M multiply-adds: 20 rows x 61 x 10, forward and backward, per client);
  * torch: one matmul of the same multiply-adds, ``[20,000, 61] @ [61, 20]``, with torch's own
    thread pool (the issue's reference);
  * torch, same duration: a matmul of 3x the multiply-adds, ``[60,000, 61] @ [61, 20]``, which
    takes about as long as pflcore's call: under load, how much a call suffers depends on how long
    it runs against the scheduler's time slice (a thread preempted inside a parallel region holds
    up the others until it runs again), so this is the like-for-like reference.

Slowdown = median time loaded / median time quiet (medians: under load the times spread, and the
best run would hide the spread). The target (issue 23): pflcore's slowdown <= 1.5x torch's.

pflcore's kernels and torch share one OpenMP runtime in a process (torch's libgomp: the wheel
does not carry its own, .ci/run's `auditwheel repair --exclude libgomp.so.1`), so the wait
policy is one setting for both. Settings compared (each in a fresh process: OpenMP reads them
when it starts):
  * ``default``: nothing set (GCC's libgomp: idle threads spin ~300,000 times, then sleep);
  * ``passive``: ``OMP_WAIT_POLICY=passive`` (idle threads sleep at once);
  * ``1 thread``: ``pflcore.set_num_threads(1)`` (and so torch's OpenMP regions too).

    python bench/busy.py                 # ~2 minutes
Writes ``--out`` (default bench/results/busy.json).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _harness, under PYTHONSAFEPATH too

SETTINGS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "1 thread": {"PFLCORE_NUM_THREADS": "1"},
}


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def _times(fns, repeats):
    """Round-robin runs of each fn; per fn, the list of wall times."""
    out = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def child(repeats, busy):
    import torch
    import pflcore
    from pflcore import models, ops
    from _suite import batches, clients, models as client_models

    if os.environ.get("PFLCORE_NUM_THREADS"):
        pflcore.set_num_threads(int(os.environ["PFLCORE_NUM_THREADS"]))
    data, theta0, one = clients("1k"), client_models("1k"), batches("1k")
    softmax = models.Softmax(60, 10)
    theta = theta0.clone()
    a, a3, b = torch.randn(20_000, 61), torch.randn(60_000, 61), torch.randn(61, 20)
    fns = {"pflcore": lambda: ops.local_steps(softmax, theta, data, steps=1, lr=0.1, batches=one),
           "torch": lambda: a @ b, "torch, same duration": lambda: a3 @ b}
    _times(fns, 5)  # warm-up
    quiet = _times(fns, repeats)
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    try:
        loaded = _times(fns, repeats)
    finally:
        stop.set()
        for p in procs:
            p.join()
    res = {"threads": pflcore.get_num_threads(), "torch_threads": torch.get_num_threads(), "busy": busy}
    for k in fns:
        q, l = statistics.median(quiet[k]), statistics.median(loaded[k])
        res[k] = {"quiet_median_s": q, "loaded_median_s": l, "quiet_best_s": min(quiet[k]),
                  "loaded_best_s": min(loaded[k]), "slowdown": l / q}
    res["ratio"] = res["pflcore"]["slowdown"] / res["torch"]["slowdown"]
    res["ratio_same_duration"] = res["pflcore"]["slowdown"] / res["torch, same duration"]["slowdown"]
    print(json.dumps(res))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--busy", type=int, default=os.cpu_count(), help="busy processes (default: one per core)")
    ap.add_argument("--only", action="append", choices=list(SETTINGS), help="settings to run (default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "busy.json"))
    args = ap.parse_args(argv)
    if args.child:
        return child(args.repeats, args.busy)
    from _harness import write_json

    results = {"repeats": args.repeats, "busy_processes": args.busy, "settings": {}}
    for name in args.only or SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "PFLCORE_NUM_THREADS")}
        env.update(SETTINGS[name])
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(args.repeats),
                            "--busy", str(args.busy)], env=env, capture_output=True, text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        results["settings"][name] = res
        p, t, t3 = res["pflcore"], res["torch"], res["torch, same duration"]
        print(f"[busy] {name:9s} pflcore {1e3 * p['quiet_median_s']:.2f} -> {1e3 * p['loaded_median_s']:.2f} ms "
              f"({p['slowdown']:.2f}x); torch matmul {1e3 * t['quiet_median_s']:.2f} -> "
              f"{1e3 * t['loaded_median_s']:.2f} ms ({t['slowdown']:.2f}x), same duration "
              f"{1e3 * t3['quiet_median_s']:.2f} -> {1e3 * t3['loaded_median_s']:.2f} ms ({t3['slowdown']:.2f}x); "
              f"pflcore/torch slowdown {res['ratio']:.2f} (target <= 1.5), same duration "
              f"{res['ratio_same_duration']:.2f}", flush=True)
    print(f"[busy] wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
