"""The kernels Nsight Compute profiles for bench/h100.sh: ``local_steps`` (cuda) at m = 20,000
clients of bench/gpu.py's workload (lognormal sizes, mean 350 rows; Softmax(60, 10); K = 5
steps), full batch and B = 20: a warm-up call, then one call of each (``ncu --launch-skip 1
--launch-count 2 --kernel-name regex:glm_(warp|kernel)``: the warp kernel for this shape).
``--sampled``: FedAvg's call in a round instead (1,000 of 10^5 clients, 20 steps at B = 20;
``--launch-count 1``)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gpu_workloads as W  # noqa: E402
from pflcore import backend, models, ops  # noqa: E402


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sampled", action="store_true",
                    help="instead: FedAvg's call in a round, 1,000 clients sampled out of 10^5 (their rows "
                         "scattered through 8.4 GB), 20 steps at B = 20: a warm-up, then one call")
    sampled = ap.parse_args().sampled
    args = argparse.Namespace(clients=[20_000], steps=5, ref_clients=10, repeats=1)
    cfg = W.Config.full(args)
    model = models.Softmax(cfg.p, cfg.C)
    if sampled:
        # where warp_fast lost to the default kernel on 2026-11-27 (the federation's rounds), while
        # it won on clients 0-999 (their rows in L2)
        from pflcore._sampling import randperm_prefix
        data = W.make_clients(cfg, 100_000)
        rows = randperm_prefix(100_000, 1000, 7).sort().values.to(cfg.device)
        theta = 0.01 * torch.randn(1000, model.d, device=cfg.device)
        batches = ops.sample_batches(data, steps=20, batch_size=20, seed=1, counter=0, clients=rows)
        with backend.use("cuda"):
            for _ in range(2):  # a warm-up (skipped by ncu), then the profiled call
                ops.local_steps(model, theta, data, steps=20, lr=0.005, rows=rows, batches=batches)
        torch.cuda.synchronize()
        print("ncu target (sampled clients): done")
        return
    data = W.make_clients(cfg, 20_000)
    theta = 0.01 * torch.randn(20_000, model.d, device=cfg.device)
    kw = dict(steps=cfg.steps, lr=0.05, prox=0.1, anchor=theta[0].clone())
    batches = ops.sample_batches(data, steps=cfg.steps, batch_size=20, seed=1, counter=0)
    with backend.use("cuda"):
        ops.local_steps(model, theta, data, **kw)       # warm-up (skipped by ncu)
        ops.local_steps(model, theta, data, **kw)       # full batch
        ops.local_steps(model, theta, data, batches=batches, **kw)  # B = 20
    torch.cuda.synchronize()
    print("ncu target: done")


if __name__ == "__main__":
    main()
