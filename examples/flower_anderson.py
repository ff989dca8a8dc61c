"""Rounds saved by Anderson acceleration of a Flower strategy, on Flower's simulation engine.

The setting is the least-squares federation of "A Unifying Framework for Federated Learning"
(experiments/unifying_least_squares.toml): 25 clients with 5,000 rows each (80% for training),
d = 100, noise variance 0.25, client optima spread by shift = 1, float64. The clients are
Flower ClientApps that take ``--local-steps`` gradient steps of size ``--lr`` with pflcore's
``ops.local_steps`` (``pflcore.flower.federation_client_app``); the server runs Flower's own
``FedAvg``, once as it is and once wrapped in ``pflcore.flower.AndersonStrategy`` (memory 2, the
paper's τ). After every round the server computes the optimality gap F(w) − F* of the global
objective F = Σ p_i f_i (F* by the normal equations).

It prints how many rounds plain FedAvg needs to reach its final gap and how many the
accelerated strategy needs to reach the same gap, and writes both curves as JSON.

    pip install ".[flower]"
    python examples/flower_anderson.py                 # Flower's simulation engine (Ray)
    python examples/flower_anderson.py --engine loopback   # the same strategies in this process

The loopback engine (``pflcore.flower.LoopbackGrid``) runs the same ClientApp and strategies
without Ray, one message after another; the two engines give the same rounds and gaps equal to
rounding (FedAvg sums the replies in the order they arrive). (Flower marks its
Python entry point ``run_simulation`` deprecated in favour of the ``flwr run`` CLI on an app
project; the ServerApp, ClientApp and strategies are the same there.)
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no usage reports from the Flower runtime
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, MetricRecord  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from pflcore import data, models, ops  # noqa: E402
from pflcore.flower import AndersonStrategy, LoopbackGrid, federation_client_app, flatten  # noqa: E402
from pflcore.run import global_optimum  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=100, help="rounds of each run (default 100)")
    p.add_argument("--clients", type=int, default=25)
    p.add_argument("--samples", type=int, default=5000, help="rows per client before the 80/20 split")
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--shift", type=float, default=1.0, help="spread of the client optima")
    p.add_argument("--lr", type=float, default=0.1, help="client step size")
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--memory", type=int, default=2, help="Anderson memory (the paper's tau)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("simulation", "loopback"), default="simulation",
                   help="Flower's simulation engine (Ray) or pflcore.flower.LoopbackGrid in this process")
    p.add_argument("--out", default="flower_anderson.json", help="where to write the curves (JSON)")
    p.add_argument("--verbose", action="store_true", help="show Flower's and Ray's INFO logs")
    return p.parse_args(argv)


def make_federation(args):
    """The federation's recipe: a partial of a module-level function pickles by reference, so each
    simulation worker builds the data once (pflcore.flower.federation_client_app caches it)."""
    return functools.partial(data.least_squares, args.clients, args.samples, args.dim, 0.25, shift=args.shift,
                             seed=args.seed, dtype=torch.float64)


def gap_fn(fed, model, f_star, curve, every):
    """Flower's ``evaluate_fn``: F(w) − F* of the global model, recorded in ``curve``."""
    weights = fed.weights.double()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        w = torch.from_numpy(np.array(flatten(arrays)[0]))
        loss, _, count = ops.evaluate(model, w.expand(fed.num_clients, model.d).contiguous(), fed.train)
        gap = float((weights * loss.double() / count.double()).sum()) - f_star
        curve.append(gap)
        if server_round % every == 0:
            print(f"  round {server_round:4d}  F(w) - F* = {gap:.3e}", flush=True)
        return MetricRecord({"optimality-gap": gap})

    return evaluate


def run_one(args, strategy, fed, model, f_star, client_app) -> dict:
    curve = []
    initial = ArrayRecord([np.zeros(model.d)])
    evaluate = gap_fn(fed, model, f_star, curve, max(1, args.rounds // 10))
    t0 = time.perf_counter()
    if args.engine == "loopback":
        strategy.start(grid=LoopbackGrid(client_app, args.clients), initial_arrays=initial, num_rounds=args.rounds,
                       evaluate_fn=evaluate)
    else:
        from flwr.simulation import run_simulation

        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            strategy.start(grid=grid, initial_arrays=initial, num_rounds=args.rounds, evaluate_fn=evaluate)

        backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                   "init_args": {"num_cpus": max(1, min(os.cpu_count() or 1, 4)), "include_dashboard": False,
                                 "logging_level": logging.INFO if args.verbose else logging.WARNING}}
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                       backend_config=backend, verbose_logging=args.verbose)
    if len(curve) != args.rounds + 1:
        raise RuntimeError(f"the run stopped early: {len(curve) - 1} of {args.rounds} rounds evaluated "
                           f"(see Flower's log above; --verbose shows all of it)")
    return {"gap": curve, "seconds": time.perf_counter() - t0}


def rounds_to(curve, target) -> int:
    """The first round whose gap is at most ``target`` (rounds count from 1; curve[0] is the start)."""
    return next(r for r, g in enumerate(curve) if g <= target)


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.verbose:  # Flower's INFO lines and its notes on settings chosen here (no federated evaluation)
        logging.getLogger("flwr").setLevel(logging.ERROR)
    fed = make_federation(args)()
    model = models.LeastSquares(args.dim, fit_intercept=False)
    f_star = global_optimum(fed, model)[0]
    # The clients build the federation themselves (once per worker process), from the same seed.
    client_app = federation_client_app(make_federation(args), model, lr=args.lr, local_steps=args.local_steps)
    nodes = dict(fraction_evaluate=0.0, min_train_nodes=args.clients, min_available_nodes=args.clients)
    print(f"least squares: {args.clients} clients x {args.samples} rows, d = {args.dim}, shift {args.shift:g}; "
          f"clients: {args.local_steps} step(s) of lr {args.lr:g}; engine: {args.engine}")
    print("FedAvg:")
    plain = run_one(args, FedAvg(**nodes), fed, model, f_star, client_app)
    print(f"FedAvg + Anderson (memory {args.memory}):")
    accel = run_one(args, AndersonStrategy(FedAvg(**nodes), memory=args.memory), fed, model, f_star, client_app)
    target = plain["gap"][-1]
    r_plain, r_accel = rounds_to(plain["gap"], target), rounds_to(accel["gap"], target)
    summary = {"final_gap_plain": target, "rounds_plain": r_plain, "rounds_anderson": r_accel,
               "rounds_saved_factor": r_plain / r_accel, "final_gap_anderson": accel["gap"][-1]}
    print(f"\nFedAvg reaches its final gap {target:.3e} in {r_plain} rounds; FedAvg + Anderson in {r_accel} "
          f"rounds ({r_plain / r_accel:.1f}x fewer); after {args.rounds} rounds Anderson's gap is "
          f"{accel['gap'][-1]:.3e}.")
    print(f"wall time: FedAvg {plain['seconds']:.1f} s, FedAvg + Anderson {accel['seconds']:.1f} s ({args.engine})")
    result = {"setting": vars(args), "summary": summary, "fedavg": plain, "fedavg_anderson": accel}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"curves written to {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
