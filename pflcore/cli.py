"""Command line: ``pflcore run [EXPERIMENT.toml] [--algo NAME ...] [key=value ...]`` and
``pflcore info``.

``torchrun --nproc-per-node N -m pflcore run EXPERIMENT.toml`` runs the experiment with the
clients sharded over N ranks (``pflcore.distributed``): the same numbers, rank 0 prints and
writes."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional


def _info(_args) -> int:
    import numpy
    import torch

    import pflcore
    from pflcore import backend

    print(f"pflcore {pflcore.__version__}  (python {platform.python_version()}, torch {torch.__version__}, "
          f"numpy {numpy.__version__})")
    print(f"installed at {os.path.dirname(pflcore.__file__)}")
    forced = os.environ.get("PFLCORE_BACKEND")
    print(f"PFLCORE_BACKEND = {forced!r}" if forced else "PFLCORE_BACKEND not set: automatic choice "
          "(CPU: native -> reference; CUDA: cuda -> triton -> reference)")
    print("backends:")
    for name, (ok, detail) in backend.status().items():
        print(f"  {name:<10} {'yes' if ok else 'no ':<4} {detail}")
    print("devices:")
    for line in backend.devices():
        print(f"  {line}")
    import torch.distributed as dist

    if dist.is_available():
        print(f"sharding (torchrun -m pflcore run ...): gloo {'yes' if dist.is_gloo_available() else 'no'}, "
              f"nccl {'yes' if dist.is_nccl_available() and torch.cuda.is_available() else 'no'}")
    else:
        print("sharding: torch.distributed is not available in this torch build")
    return 0


def _run(args) -> int:
    from pflcore import distributed, experiments

    comm = distributed.init()  # a torch.distributed group under torchrun, else one process
    code = _run_experiment(args, experiments, comm)
    # Only after success: a rank that failed mid-round must not enter a barrier its peers (still
    # inside another collective) would mistake for theirs; its exit drops their connections.
    if comm.world > 1:
        distributed.shutdown()
    return code


def _run_experiment(args, experiments, comm) -> int:
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    if args.experiment and "=" in args.experiment and not args.experiment.endswith(".toml"):
        args.overrides.insert(0, args.experiment)  # `pflcore run rounds=10`: no file, an override
        args.experiment = None
    cfg = experiments.apply_overrides(experiments.load(args.experiment), args.overrides)
    ranks = f", clients sharded over {comm.world} ranks ({comm.backend})" if comm.world > 1 else ""
    say(f"pflcore run: {cfg.get('name', args.experiment)} — {len(args.algo) if args.algo else len(cfg.get('algorithms', {}))} algorithm(s), "
        f"{cfg.get('rounds')} rounds, seeds {cfg.get('seeds', [0])}{ranks}")
    summary = experiments.run_experiment(cfg, only=args.algo, progress=not args.no_progress, out=args.out, log=say)
    metrics = cfg.get("metrics", ["personalized_acc", "global_acc", "stat_error_local", "stat_error_global"])
    say()
    say(experiments.format_table(summary["rows"], metrics))
    out = args.out or cfg.get("out") or "pflcore_results"
    say(f"\nwrote {out}/summary.json, per-run JSON and a PNG ({summary['seconds']:.0f} s)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pflcore", description="Fast personalized federated learning core")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="version, and which backends load (and why not)")
    p_info.set_defaults(func=_info)
    p_run = sub.add_parser("run", help="run an experiment (TOML) or, with no file, the default comparison")
    p_run.add_argument("experiment", nargs="?", help="experiment TOML file (default: the built-in comparison)")
    p_run.add_argument("overrides", nargs="*", help="key=value overrides, dotted keys (e.g. rounds=50)")
    p_run.add_argument("--algo", action="append", help="run only this algorithm (repeatable)")
    p_run.add_argument("--out", help="output folder (default: the experiment's `out`)")
    p_run.add_argument("--no-progress", action="store_true", help="no progress bars")
    p_run.set_defaults(func=_run)
    from pflcore import bench_cli
    bench_cli.add_parser(sub)  # `pflcore bench`: the benchmark suite of a checkout (bench/)
    # Overrides may follow options (`pflcore run exp.toml --algo pFedMe rounds=10`).
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "run" or any("=" not in tok or tok.startswith("-") for tok in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
