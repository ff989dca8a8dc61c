"""Command line: ``pflcore run [EXPERIMENT.toml] [--algo NAME ...] [key=value ...]`` and
``pflcore info``.

``torchrun --nproc-per-node N -m pflcore run EXPERIMENT.toml`` runs the experiment with the
clients sharded over N ranks (``pflcore.distributed``): the same numbers, rank 0 prints and
writes.

Errors are one line on stderr, ``pflcore: error: ...``, with exit status 2 for a usage or
configuration error (a bad option, a missing or malformed file, an unknown key, a value of the
wrong type or out of range: any ``ValueError``) and 1 for a run that failed (anything else);
``--debug`` (anywhere on the line, or ``PFLCORE_DEBUG=1``) prints the traceback too.

A subcommand is one function that adds its parser to ``sub`` (see ``COMMANDS``); its handler
takes the parsed arguments and returns the exit status.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback
import warnings
from typing import Callable, List, Optional

USAGE_ERROR, RUN_FAILED = 2, 1


class UsageError(ValueError):
    """A command line argparse rejects."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing its usage and exiting, so that ``main`` reports
    every error the same way."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


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
    print("GPU:")
    for line in _gpu_lines():
        print(f"  {line}")
    import torch.distributed as dist

    if dist.is_available():
        print(f"sharding (torchrun -m pflcore run ...): gloo {'yes' if dist.is_gloo_available() else 'no'}, "
              f"nccl {'yes' if dist.is_nccl_available() and torch.cuda.is_available() else 'no'}")
    else:
        print("sharding: torch.distributed is not available in this torch build")
    return 0


def _cuda_version(v: int) -> str:
    return f"CUDA {v // 1000}.{v % 1000 // 10}"


def _gpu_lines() -> List[str]:
    """``pflcore info``'s GPU section: the NVIDIA driver the CUDA module needs (it links its CUDA
    runtime statically, so the driver must support the toolkit it was built with, whatever
    torch's CUDA is), and for each GPU backend whether CUDA tensors use it, or why not."""
    import importlib

    import torch

    from pflcore import backend

    lines = []
    try:
        module = importlib.import_module("pflcore._core_cuda")
    except (ImportError, OSError):
        module = None  # the cuda line above says why
    if module is not None:
        info = module.build_info()
        runtime, need = info.get("cuda_runtime_version", -1), info.get("min_driver", 0)
        built = _cuda_version(runtime) if runtime > 0 else "an unknown CUDA version"
        needs = (f"an NVIDIA driver >= {need}" if need else
                 "a driver that supports it (this build does not record the minimum driver branch)")
        driver = module.runtime_status()["driver_version"] if hasattr(module, "runtime_status") else -1
        here = ("no NVIDIA driver here" if driver == 0 else "this machine's driver: unknown" if driver < 0
                else f"this machine's driver supports {_cuda_version(driver)}")
        short = 0 < driver < (runtime // 1000) * 1000  # the driver's CUDA major is older
        lines.append(f"CUDA module: built with {built}; needs {needs}; {here}" +
                     ("; rebuild with a toolkit the driver supports (CUDACXX=/path/to/nvcc) or without "
                      "the module (PFLCORE_CUDA=OFF)" if short else ""))
    forced = backend.requested()
    has_gpu = torch.cuda.is_available()
    auto = next((n for n in ("cuda", "triton") if backend.ADAPTERS[n].available and backend.ADAPTERS[n].auto),
                "reference")
    chosen = forced or auto
    for name in ("cuda", "triton"):
        a = backend.ADAPTERS[name]
        if has_gpu and name == chosen:
            lines.append(f"{name}: in use for CUDA tensors" + (" (PFLCORE_BACKEND)" if forced else ""))
        elif not a.available:
            lines.append(f"{name}: not in use: {a.describe()}")
        elif not a.auto:
            lines.append(f"{name}: not in use automatically: under TRITON_INTERPRET=1 it serves only calls that "
                         f"ask for it by name")
        elif not has_gpu:
            lines.append(f"{name}: not in use: torch sees no CUDA device")
        else:
            lines.append(f"{name}: not in use: {chosen} comes first "
                         f"({'PFLCORE_BACKEND' if forced else 'automatic order cuda -> triton -> reference'}); "
                         f"PFLCORE_BACKEND={name} selects it")
    return lines


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as ``pflcore: warning: ...`` on stderr, on one line like the errors (not the
    file, line and source line of Python's default)."""
    print(f"pflcore: warning: {' '.join(str(message).split())}", file=sys.stderr)


def _run(args) -> int:
    from pflcore import distributed, experiments

    # The configuration is read and checked before any process group exists: a bad file fails
    # at once on every rank, with no rank left waiting in a collective.
    if args.experiment and "=" in args.experiment and not args.experiment.endswith(".toml"):
        args.overrides.insert(0, args.experiment)  # `pflcore run rounds=10`: no file, an override
        args.experiment = None
    cfg = experiments.apply_overrides(experiments.load(args.experiment), args.overrides)
    try:
        experiments.check(cfg)
    except experiments.ConfigError as exc:
        culprit = next((o for o in args.overrides if exc.key and o.split("=", 1)[0].strip() == exc.key), None)
        if culprit is None:
            raise
        raise experiments.ConfigError(f"{exc} (in the override {culprit!r})", key=exc.key) from None
    comm = distributed.init()  # a torch.distributed group under torchrun, else one process
    with warnings.catch_warnings():  # what a run warns of (e.g. pFedMe's train_all cost): one line each
        warnings.showwarning = _warning_line
        code = _run_experiment(args, cfg, experiments, comm)
    # Only after success: a rank that failed mid-round must not enter a barrier its peers (still
    # inside another collective) would mistake for theirs; its exit drops their connections.
    if comm.world > 1:
        distributed.shutdown()
    return code


def _run_experiment(args, cfg, experiments, comm) -> int:
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    ranks = f", clients sharded over {comm.world} ranks ({comm.backend})" if comm.world > 1 else ""
    n_algos = len(args.algo) if args.algo else len(cfg.get("algorithms", {}))
    say(f"pflcore run: {cfg.get('name', args.experiment)} — {n_algos} algorithm(s), "
        f"{cfg.get('rounds')} rounds, seeds {cfg.get('seeds', [0])}{ranks}")
    summary = experiments.run_experiment(cfg, only=args.algo, progress=not args.no_progress, out=args.out, log=say)
    metrics = cfg.get("metrics", ["personalized_acc", "global_acc", "stat_error_local", "stat_error_global"])
    say()
    say(experiments.format_table(summary["rows"], metrics))
    if summary.get("verdict"):  # every experiment: what the paired figures support, and no more
        say("\n" + summary["verdict"])
    sentence = experiments.takeaway(summary)
    if sentence:
        say("\n" + sentence)
    out = args.out or cfg.get("out") or "pflcore_results"
    plot = "sweep.png" if cfg.get("sweep") else "curves.png"
    say(f"\nwrote {out}/summary.json, one JSON per run and {out}/{plot} ({summary['seconds']:.0f} s)")
    runs = [r for r in summary["rows"]]
    if runs and all(len(r.get("diverged") or []) == r.get("seeds", 1) for r in runs):
        print("pflcore: error: every run diverged (see the table)", file=sys.stderr)
        return RUN_FAILED
    return 0


def _extras_of_installed() -> dict:
    """{extra: [requirement, ...]} of the installed pflcore's metadata, each requirement kept
    only when its environment marker holds here (e.g. triton on Linux only)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        dist = metadata.distribution("pflcore")
    except metadata.PackageNotFoundError:
        raise ValueError("pflcore extras: pflcore is not installed (no package metadata); "
                         "from a checkout, see pyproject.toml [project.optional-dependencies]") from None
    extras: dict = {name: [] for name in dist.metadata.get_all("Provides-Extra") or []}
    for text in dist.requires or []:
        req = Requirement(text)
        for name in extras:
            if req.marker is not None and req.marker.evaluate({"extra": name}) and "extra" in str(req.marker):
                spec = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "") + str(req.specifier)
                extras[name].append(spec)
    return extras


def _extras(args) -> int:
    extras = _extras_of_installed()
    if not args.names:
        for name, reqs in extras.items():
            print(f"{name:<8} {' '.join(reqs) or '(nothing on this platform)'}")
        return 0
    unknown = [n for n in args.names if n not in extras]
    if unknown:
        raise UsageError(f"extras: unknown extra {unknown[0]!r}; pflcore has {', '.join(extras)}")
    seen: List[str] = []
    for name in args.names:
        seen += [r for r in extras[name] if r not in seen]
    print("\n".join(seen))
    return 0


def _add_extras(sub) -> None:
    p = sub.add_parser("extras", help="the packages of an optional extra, to add it without rebuilding pflcore",
                       description="Prints the packages of the named extras (one per line, for this platform), "
                                   "so that `pip install $(pflcore extras bench)` adds an extra to an installed "
                                   "pflcore without building its core again (`pip install \".[bench]\"` would "
                                   "compile it anew in a fresh build environment). No name: every extra.")
    p.add_argument("names", nargs="*", help="extras (e.g. bench plot)")
    p.set_defaults(func=_extras)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="version, and which backends load (and why not)")
    p.set_defaults(func=_info)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run an experiment (TOML) or, with no file, the default comparison")
    p.add_argument("experiment", nargs="?", help="experiment TOML file (default: the built-in comparison)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, dotted keys (e.g. rounds=50)")
    p.add_argument("--algo", action="append", help="run only this algorithm (repeatable)")
    p.add_argument("--out", help="output folder (default: the experiment's `out`)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run, accepts_overrides=True)


def _add_bench(sub) -> None:
    from pflcore import bench_cli

    bench_cli.add_parser(sub)  # `pflcore bench`: the benchmark suite of a checkout (bench/)


# Subcommands, in the order `pflcore --help` lists them: each adds its parser to `sub`.
COMMANDS: List[Callable] = [_add_run, _add_bench, _add_info, _add_extras]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pflcore", description="Fast personalized federated learning core")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    # Overrides may follow options (`pflcore run exp.toml --algo pFedMe rounds=10`).
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not getattr(args, "accepts_overrides", False) or any("=" not in t or t.startswith("-") for t in extra):
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see 'pflcore {args.command} --help')")
        args.overrides = list(args.overrides) + extra
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("PFLCORE_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere on the line
    try:
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stderr)
            return USAGE_ERROR
        args = _parse(parser, argv)
        return args.func(args)
    except SystemExit as exc:  # --help, or a library calling sys.exit (with a message: one line)
        if isinstance(exc.code, str):
            print(f"pflcore: error: {exc.code}", file=sys.stderr)
            return USAGE_ERROR
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else RUN_FAILED)
    except KeyboardInterrupt:
        print("pflcore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pflcore info | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # one line, unless --debug
        if debug:
            traceback.print_exc()
        code = USAGE_ERROR if isinstance(exc, ValueError) else RUN_FAILED
        text = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the message
        if code == RUN_FAILED and not isinstance(exc, RuntimeError):
            text = f"{type(exc).__name__}: {text}"
        hint = " (--debug shows the traceback)" if code == RUN_FAILED and not debug else ""
        print(f"pflcore: error: {text}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
