"""Benchmarks of pflcore's GPU backends (cuda, triton) against torch on the same GPU.

What is measured (one process, float32, fixed seeds; every comparison first checks that the
compared implementations agree, then times them):

1. ``local_steps`` on m = 10,000 and m = 100,000 clients with lognormal sizes (mean ≈ 350 rows),
   ``Softmax(p=60, C=10)``, K = 5 full-batch proximal steps (prox = 0.1, a shared anchor,
   lr = 0.05). Reported:
     - achieved bytes/s of the CUDA kernel as a fraction of the device's copy bandwidth
       (``dst.copy_(src)`` of 1 GiB, measured in the same run; target >= 50%). The bytes are
       what the op must move at least: every step reads each row of x and y once,
       K·N·(p·4 + 8), plus θ read and written once, 2·m·d·4, plus the anchor, offsets and rows;
     - speed-up over the torch reference ``ops.local_steps_ref`` on the GPU (target >= 10×).
       The reference is a Python loop over clients, timed on ``--ref-clients`` clients and
       scaled linearly by the number of clients (stated in the output and the JSON);
     - Triton vs CUDA (time ratio, no target).
2. ``kmeans_assign`` (N = 100,000, K = 64, d = 7,850) vs torch ``cdist(points, centroids)
   .argmin(1)`` (target >= 2×), and Triton vs CUDA. Agreement: pflcore's labels equal
   ``kmeans_assign_ref`` exactly on the first 2,000 points; cdist (which expands
   ‖x‖² + ‖c‖² − 2x·c) must agree on >= 99.9% of the labels.
3. ``Anderson(memory=5).step`` on a 10,000 × 7,850 state with a full history: CUDA, Triton
   and the reference backend; bytes/s of the CUDA step over the 17·D elements a step moves
   (u, tu in; r, tu into the ring; 6 residuals for the Gram column; 6 T(u) for the mix; out)
   as a fraction of the copy bandwidth (no target).

Times are the best of ``--repeats`` runs after one warm-up run (Triton compiles then),
with ``torch.cuda.synchronize()`` around each run.

    python bench/gpu.py                    # on a machine with a CUDA device
    python bench/gpu.py --dry-run          # check the script on the CPU: tiny sizes, the native
                                           # kernels in place of cuda, Triton under its interpreter

Without a CUDA device (and without --dry-run) it says so and exits 0. It prints a table and
writes the numbers, the device and a timestamp to ``--out`` (default bench/results/gpu.json;
a dry run writes bench/results/gpu_dryrun.json).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="run every code path on the CPU with tiny sizes (native kernels stand in for cuda)")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best is kept)")
    ap.add_argument("--steps", type=int, default=5, help="local steps K per call")
    ap.add_argument("--ref-clients", type=int, default=200, help="clients the torch reference loop is timed on")
    ap.add_argument("--clients", type=int, nargs="+", default=None, help="client counts m of the local_steps runs")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before pflcore.triton is first imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device is visible to torch "
              f"(torch {torch.__version__}, CUDA {torch.version.cuda}); nothing was measured. "
              "Run it on a machine with a GPU, or `python bench/gpu.py --dry-run` to check the script on the CPU.")
        return 0
    sys.path.insert(0, HERE)
    import _harness as harness
    import gpu_workloads as W

    cfg = W.Config.dry_run(args) if args.dry_run else W.Config.full(args)
    out = args.out or os.path.join(HERE, "results", "gpu_dryrun.json" if args.dry_run else "gpu.json")
    # written after every measurement, so that a later failure keeps what was measured
    results = W.run_all(cfg, save=lambda res: harness.write_json(out, {**res, "partial": True, "argv": sys.argv[1:]}))
    rows = W.table_rows(results)
    W.print_table(rows)
    results.update(table=rows, argv=sys.argv[1:])
    harness.write_json(out, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(code)
