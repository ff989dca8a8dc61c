"""FedRep's local phase on the fused path (issue 29 item 2), measured in one process.

Workload: ``data.contexts`` with 1,000 clients (dim 60, 10 classes, sizes in [50, 250]),
``MLP(60, 32, 10)`` float32, 100 clients a round (a fixed sample), minibatches of 20; FedRep's
local phase = 10 head steps (body frozen) + 1 body step (head frozen). Timed, each from the
same starting models:

  masked    two ``ops.local_steps`` calls with ``lr_scale`` = the head mask, then the body mask
  unmasked  the same two calls without ``lr_scale`` (every parameter steps): the target is
            masked <= 1.3x this
  gradients what a user without ``lr_scale`` writes: per step one ``ops.gradients`` call on the
            step's minibatch, then θ -= lr·mask ⊙ g in torch: the target is >= 3x slower than
            masked

The three results are compared too (masked equals the gradients route to float32 rounding).
Times are the median of ``--repeats`` runs (time.perf_counter); the 1-minute load average is
recorded (a shared machine).

    python bench/masked.py [--repeats 15] [--out bench/results/masked.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from pflcore import data as D
from pflcore import models as M
from pflcore import ops
from pflcore.algorithms.fedrep import head_mask


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "masked.json"))
    args = parser.parse_args()

    fed = D.contexts(num_clients=args.clients, num_contexts=4, dim=60, num_classes=10, sizes=(50, 250), seed=0)
    model = M.MLP(60, hidden=32, C=10)
    head = head_mask(model).float()
    body = 1.0 - head
    rows = torch.randperm(args.clients, generator=torch.Generator().manual_seed(1))[:args.per_round].sort().values
    theta0 = 0.1 * torch.randn(args.per_round, model.d, generator=torch.Generator().manual_seed(2))
    head_steps, body_steps, lr, B = 10, 1, 0.05, 20
    bh = ops.sample_batches(fed.train, steps=head_steps, batch_size=B, seed=3, counter=0, clients=rows)
    bb = ops.sample_batches(fed.train, steps=body_steps, batch_size=B, seed=3, counter=1, clients=rows)

    def masked():
        th = theta0.clone()
        ops.local_steps(model, th, fed.train, steps=head_steps, lr=lr, rows=rows, batches=bh, lr_scale=head)
        ops.local_steps(model, th, fed.train, steps=body_steps, lr=lr, rows=rows, batches=bb, lr_scale=body)
        return th

    def unmasked():
        th = theta0.clone()
        ops.local_steps(model, th, fed.train, steps=head_steps, lr=lr, rows=rows, batches=bh)
        ops.local_steps(model, th, fed.train, steps=body_steps, lr=lr, rows=rows, batches=bb)
        return th

    def gradients():
        th = theta0.clone()
        for batches, steps, mask in ((bh, head_steps, head), (bb, body_steps, body)):
            for s in range(steps):
                g = ops.gradients(model, th, fed.train, rows=rows, batches=batches[:, s].contiguous())
                th -= lr * mask * g
        return th

    a, c = masked(), gradients()
    max_diff = float((a - c).abs().max())
    for fn in (masked, unmasked, gradients):  # warm-up
        fn()
    t = {name: _median_time(fn, args.repeats) for name, fn in
         (("masked", masked), ("unmasked", unmasked), ("gradients", gradients))}
    result = {
        "workload": f"FedRep local phase, MLP(60, 32, 10) float32, {args.per_round} of {args.clients} clients, "
                    f"{head_steps} head + {body_steps} body steps, B = {B}",
        "seconds": t,
        "masked_over_unmasked": t["masked"] / t["unmasked"],
        "gradients_over_masked": t["gradients"] / t["masked"],
        "max_abs_diff_masked_vs_gradients": max_diff,
        "threads": torch.get_num_threads(), "loadavg_1min": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
