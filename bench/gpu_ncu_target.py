"""The kernels Nsight Compute profiles for bench/h100.sh: ``local_steps`` (cuda) at m = 20,000
clients of bench/gpu.py's workload (lognormal sizes, mean 350 rows; Softmax(60, 10); K = 5
steps), full batch and B = 20: a warm-up call, then one call of each (``ncu --launch-skip 1
--launch-count 2 --kernel-name regex:glm_``: the warp kernel for this
shape, glm_warp_kernel)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gpu_workloads as W  # noqa: E402
from pflcore import backend, models, ops  # noqa: E402


def main() -> None:
    import argparse
    args = argparse.Namespace(clients=[20_000], steps=5, ref_clients=10, repeats=1)
    cfg = W.Config.full(args)
    data = W.make_clients(cfg, 20_000)
    model = models.Softmax(cfg.p, cfg.C)
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
