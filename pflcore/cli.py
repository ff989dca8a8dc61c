"""Command line: ``pflcore info`` (more subcommands come with the simulator)."""
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
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pflcore", description="Fast personalized federated learning core")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="version, and which backends load (and why not)")
    p_info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
