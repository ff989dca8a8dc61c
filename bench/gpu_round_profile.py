"""Where a GPU round's time goes: host work and launches, or kernels (bench/h100.sh's stage ``prof``).

bench/gpu_federation.py found a GPU round costs about the same at 20 and at 1,000 clients a round
(FedAvg ~2 ms, pFedMe ~4.6 ms on an H100, 2026-11-27): either the host (Python, launches, host
reads) or the latency of each client's chain of steps on the device (one warp a client, its
minibatch steps one after another) sets it, and the two call for different fixes. This script
runs the same workload (gpu_federation.py's federation and algorithms, 1,000 clients a round,
no evaluation) under torch.profiler with CUDA activity and reports per round:

- wall time (the run's own seconds column, without the profiler: each round ends in a host read);
- the summed device time of the kernels, by kernel (top 12), and their count;
- host-side counts: top-level aten ops, cudaLaunchKernel calls, device-to-host copies and
  synchronizations;

so that "round wall ≈ kernel time" says the kernels bound it, and "round wall ≫ kernel time"
says the host does. A second table times the local_steps call of each algorithm alone on the
round's shapes (one client per warp), the device synchronized: its latency against the number
of sequential steps in it.

    python bench/gpu_round_profile.py --out bench/results/gpu_round_profile-h100.json   # on a GPU
    python bench/gpu_round_profile.py --dry-run        # the code paths on the CPU, tiny
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--cohort", type=int, default=1000, help="clients a round")
    ap.add_argument("--rounds", type=int, default=6, help="profiled rounds (after 2 untimed ones)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.clients, args.cohort, args.rounds = 300, 50, 2
    return args


def _device_time_us(evt) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        v = getattr(evt, name, None)
        if v:
            return float(v)
    return 0.0


def profile_rounds(alg, fed, device: str, cohort: int, rounds: int) -> dict:
    """The run's first 2 rounds untimed (warm-up: module loads, allocator), then ``rounds`` rounds
    under the profiler; every figure is per round."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import pflcore
    from pflcore import models

    model = models.Softmax(60, 10)
    kw = dict(clients_per_round=cohort, eval_every=10 ** 9, device=device, progress=False, seed=0)

    def run(n):
        res = pflcore.run(alg, fed, model, rounds=n, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return res

    run(2)
    # the wall of a round without the profiler: the run's own seconds column (each round ends in
    # its finiteness check, a host read), the rounds after the first two
    hist = run(2 + rounds).history
    wall = [r["seconds"] for r in hist if r["round"] > 2 and "seconds" in r]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # the difference of two runs of different lengths cancels the run's set-up and its final evaluation
    counts, kernels = {}, {}
    with profile(activities=acts):  # the profiler's own start-up, outside the measured runs
        run(1)
    for n in (2, 2 + rounds):
        with profile(activities=acts) as prof:
            run(n)
        c = collections.Counter()
        k = collections.defaultdict(float)
        kn = collections.Counter()
        for e in prof.events():
            name = e.name
            if name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
                c["top-level aten ops"] += 1
            if name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
                c["kernel launches"] += 1
            if name in ("cudaMemcpyAsync", "cudaMemcpy"):
                c["memcpy calls"] += 1
            if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
                c["synchronizations"] += 1
            if device == "cuda" and getattr(e, "device_type", None) is not None and \
                    str(e.device_type).endswith("CUDA") and not name.startswith(("cuda", "cu")):
                k[name] += _device_time_us(e)
                kn[name] += 1
        counts[n], kernels[n] = c, (k, kn)
    a, b = 2, 2 + rounds
    per = lambda x, y: (y - x) / rounds  # noqa: E731
    out = {"algorithm": repr(alg), "device": device, "clients_per_round": cohort, "rounds": rounds,
           "round_wall_s": statistics.median(wall) if wall else None,
           "host_counts_per_round": {key: per(counts[a].get(key, 0), counts[b].get(key, 0))
                                     for key in set(counts[a]) | set(counts[b])}}
    if device == "cuda":
        ka, kna = kernels[a]
        kb, knb = kernels[b]
        per_kernel = {name: (per(ka.get(name, 0.0), kb[name]) * 1e-6, per(kna.get(name, 0), knb[name]))
                      for name in kb}
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
        out["kernel_s_per_round"] = sum(v[0] for v in per_kernel.values())
        out["kernels_per_round"] = sum(v[1] for v in per_kernel.values())
        out["top_kernels"] = [{"kernel": name[:120], "s_per_round": s, "calls_per_round": n} for name, (s, n) in top]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_round_profile.py: no CUDA device is visible to torch; nothing was measured "
              "(`--dry-run` checks the script on the CPU)")
        return 0
    from _harness import machine_info, write_json
    from gpu_federation import _federation
    from scale import algorithms

    fed, gen_s = _federation(args.clients)
    print(f"federation: {args.clients:,} clients (generated in {gen_s:.1f} s); {args.cohort} a round", flush=True)
    res = {"clients": args.clients, "runs": [], "local_steps": []}
    for alg in algorithms():
        r = profile_rounds(alg, fed, device, args.cohort, args.rounds)
        res["runs"].append(r)
        hc = r["host_counts_per_round"]
        print(f"{alg.name}: {r['round_wall_s'] * 1e3:.2f} ms a round; under the profiler, kernels "
              f"{r.get('kernel_s_per_round', 0) * 1e3:.2f} ms in {r.get('kernels_per_round', 0):.0f} launches; "
              f"host: " + ", ".join(f"{v:.0f} {k}" for k, v in sorted(hc.items())), flush=True)
        for k in r.get("top_kernels", []):
            print(f"    {k['s_per_round'] * 1e6:9.1f} us  x{k['calls_per_round']:5.1f}  {k['kernel']}")
    try:
        res["local_steps"] = local_steps_latency(fed.train.to(device), device, args.cohort)
        for r in res["local_steps"]:
            print(f"{r['call']}, {r['cohort']} clients ({r['clients']}), kernel {r['kernel']}: "
                  f"{r['median_s'] * 1e6:.1f} us a call, "
                  f"{r['per_step_s'] * 1e6:.1f} us a step", flush=True)
    except Exception as exc:  # the profile above is the main result; say why this part is missing
        res["local_steps_error"] = f"{type(exc).__name__}: {exc}"
        print(f"local_steps latency: {res['local_steps_error']}", flush=True)
    res["measured"] = machine_info()
    if args.out:
        write_json(args.out, res)
        print(f"wrote {args.out}")
    return 0


def local_steps_latency(train, device: str, cohort: int) -> list:
    """One local_steps call on ``cohort`` clients of ``train`` (on ``device``) with a round's
    shapes (B = 20; FedAvg's 20 steps, and one of pFedMe's local rounds: 5 steps with its anchor
    [R, d] and prox = λ = 20), trusted (as a run calls it), the device synchronized: the median
    wall of 50 calls, per GLM kernel. Two kinds of cohort: clients 0..cohort-1 (their rows
    contiguous: ~3.6 MB at 1,000 of gpu_federation.py's clients, in an H100's L2) and ``cohort``
    clients sampled out of all (their rows scattered through the whole data, as a run's round
    draws them): on 2026-11-27 warp_fast won the first and lost whole rounds of the second."""
    import torch

    import _harness as harness
    from gpu_workloads import GLM_VARIANTS
    from pflcore import models, ops
    from pflcore._sampling import randperm_prefix
    from pflcore.ops.local_steps import run_local_steps

    model = models.Softmax(60, 10)
    m = train.offsets.numel() - 1
    cohorts = {"first": torch.arange(cohort, device=device),
               "sampled": randperm_prefix(m, min(cohort, m), 12345).sort().values.to(device)}
    out = []
    # each GLM kernel (PFLCORE_CUDA_GLM; "" the default): at 1,000 clients a warp-per-client
    # kernel fills ~12% of an H100's warp slots, so a kernel that spreads a client over more
    # threads may have the shorter chain of steps even where it is slower on 10^5 clients
    variants = [""] + (list(GLM_VARIANTS) if device == "cuda" else [])
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else None
    for which, rows in cohorts.items():
        R = rows.numel()
        for name, steps, prox in (("FedAvg local_steps (20 steps, B = 20)", 20, 0.0),
                                  ("pFedMe local round (5 steps, B = 20, anchor, prox 20)", 5, 20.0)):
            theta = torch.zeros(R, model.d, device=device)
            anchor = torch.zeros(R, model.d, device=device) if prox else None
            batches = ops.sample_batches(train, steps=steps, batch_size=20, seed=0, counter=0, clients=rows)
            for variant in variants:
                with harness.environ(PFLCORE_CUDA_GLM=variant or None):
                    t = harness.time_runs(lambda: run_local_steps(model, theta, train, steps, 0.005, prox, anchor,
                                                                  batches, rows, None, True), 50, sync=sync,
                                          warmup=5).median
                out.append({"call": name, "clients": which, "kernel": variant or "default", "cohort": R,
                            "steps": steps, "median_s": t, "per_step_s": t / steps})
    return out


if __name__ == "__main__":
    sys.exit(main())
