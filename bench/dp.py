"""The Gaussian mechanism on client updates (issue 27): ``ops.clip_and_sum`` at R × d against
what a user would otherwise write, in one process.

Workload: updates ``[R, d]`` float32 (default 10,000 × 610, a Softmax 60 × 10 per client, norms
spread around the clip norm C = 1), unit weights, noise multiplier 1.

Compared:
  * ``copy``: ``dst.copy_(src)`` of the same matrix, the memory-bandwidth yardstick. A copy moves
    2·R·d·4 bytes (read + write); the op reads R·d·4. "fraction of a copy's bandwidth" is
    (R·d·4 / t_op) / (2·R·d·4 / t_copy) = t_copy / (2·t_op) (target >= 0.5: the op no slower than
    the copy); "fraction of the copy's read bandwidth" counts only the copy's reads.
  * ``per_client_loop``: pfl-research's way, one client at a time in Python (norm, scale,
    accumulate into the sum; torch ops on each [d] row), then one noise draw (target: the op
    >= 20x faster).
  * ``torch_vectorized``: the same formula as whole-matrix torch ops (row norms, scale, a
    weighted sum with float64 accumulation), the stronger baseline; reported, no target.
Agreement: without noise, the loop's and torch's sums equal the op's to 1e-5 relative.

    python bench/dp.py [--rows 10000 --dim 610 --repeats 15]
Writes ``--out`` (default bench/results/dp.json).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import print_table, time_runs, torch_threads, warn_if_busy, write_json  # noqa: E402

import pflcore  # noqa: E402
from pflcore import ops  # noqa: E402

C, Z = 1.0, 1.0


def per_client_loop(u: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(u.shape[1], dtype=torch.float64)
    for row in u:  # one client's update at a time
        norm = float(torch.linalg.vector_norm(row))
        acc += row.double() * min(1.0, C / norm) if norm > 0 else row.double()
    return acc


def torch_vectorized(u: torch.Tensor) -> torch.Tensor:
    norms = torch.linalg.vector_norm(u, dim=1, dtype=torch.float64)
    scale = torch.clamp(C / norms, max=1.0)
    return scale @ u.double()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=610)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--loop-repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dp.json"))
    args = ap.parse_args(argv)
    warn_if_busy()
    g = torch.Generator().manual_seed(0)
    R, d = args.rows, args.dim
    u = torch.randn(R, d, generator=g) * (torch.rand(R, 1, generator=g) * 2 / d ** 0.5 * 1.0)
    want = ops.clip_and_sum(u, clip_norm=C).sum.double()
    scale = float(want.abs().max())
    for name, fn in (("per_client_loop", per_client_loop), ("torch_vectorized", torch_vectorized)):
        diff = float((fn(u) - want).abs().max())
        assert diff <= 1e-5 * scale, f"{name} disagrees with clip_and_sum: max |Δ| = {diff:.3g}"
    print(f"[dp] agreement: the loop and torch equal clip_and_sum (no noise) to 1e-5 relative; "
          f"{int((torch.linalg.vector_norm(u, dim=1) > C).sum())} of {R} rows clipped")
    dst = torch.empty_like(u)
    results, rows = {"rows": R, "dim": d, "dtype": "float32", "clip_norm": C, "noise_multiplier": Z,
                     "threads": {}}, []
    before = pflcore.get_num_threads()
    try:
        for th in (1, 2):
            pflcore.set_num_threads(th)
            with torch_threads(th):
                t_op = time_runs(lambda: ops.clip_and_sum(u, clip_norm=C, noise_multiplier=Z, seed=1), args.repeats,
                                 warmup=2).median
                t_copy = time_runs(lambda: dst.copy_(u), args.repeats, warmup=2).median
                t_torch = time_runs(lambda: torch_vectorized(u), args.repeats, warmup=1).median
                t_loop = time_runs(lambda: per_client_loop(u), args.loop_repeats).median
            frac = t_copy / (2 * t_op)
            r = {"op_s": t_op, "copy_s": t_copy, "torch_vectorized_s": t_torch, "per_client_loop_s": t_loop,
                 "fraction_of_copy_bandwidth": frac, "fraction_of_copy_read_bandwidth": t_copy / t_op,
                 "op_GBps": R * d * 4 / t_op / 1e9, "speedup_vs_loop": t_loop / t_op,
                 "speedup_vs_torch": t_torch / t_op}
            results["threads"][str(th)] = r
            rows += [(f"{th} thr: clip_and_sum {R}x{d}, fraction of a copy's bandwidth", t_op, frac, 0.5, "ge"),
                     (f"{th} thr: speedup vs the per-client Python loop", t_loop, t_loop / t_op, 20, "ge"),
                     (f"{th} thr: speedup vs vectorized torch", t_torch, t_torch / t_op, None, None)]
    finally:
        pflcore.set_num_threads(before)
    print_table(rows)
    print(f"\nwrote {write_json(args.out, results)}")
    return results


if __name__ == "__main__":
    main()
