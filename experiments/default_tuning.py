"""How the hyperparameters of the built-in comparison (`pflcore run` with no file) were chosen,
without looking at test accuracy.

Each client's training rows are split in two: the first 80% train, the last 20% validate (the
rows of a client are i.i.d., so this is a random split). Every algorithm runs the default's
rounds and sampling on the 80% for every point of its grid below, and the point with the best
validation accuracy of the model each client uses (its personalized model, or the global model
for FedAvg) at the last round is kept (ties: the first in grid order). The test rows are never
read. The chosen values are what `pflcore.experiments.DEFAULT` holds; this script prints them
and writes every point's validation accuracy to a JSON file.

    python experiments/default_tuning.py                          # the default's data
    python experiments/default_tuning.py data.client_noise=1.0     # another setting (overrides)
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import time

import pflcore
from pflcore import experiments as E
from pflcore.data import ClientData, Federation

# label -> (fixed part of the spec, {key: values to try})
GRID = {
    "pFedMe": ({"type": "pfedme", "inner_steps": 5, "local_rounds": 20, "batch_size": 20, "beta": 1.0},
               {"lam": [15.0, 30.0], "lr": [0.05, 0.1, 0.2], "personal_lr": [0.02, 0.05]}),
    "FedProx": ({"type": "fedprox", "global_lr": 1.0, "local_steps": 20},
                {"lam": [0.1, 0.5, 2.0], "local_lr": [0.1, 0.3, 1.0]}),
    "Per-FedAvg": ({"type": "perfedavg", "local_steps": 20, "batch_size": 20},
                   {"alpha": [0.1, 0.3, 1.0], "beta": [0.03, 0.1, 0.3]}),
    "FedAvg": ({"type": "fedavg", "local_steps": 20, "batch_size": 20}, {"lr": [0.03, 0.1, 0.3, 1.0]}),
    "LocalTrain": ({"type": "localtrain", "steps": 20, "batch_size": 20}, {"lr": [0.03, 0.1, 0.3, 1.0]}),
}
# A first grid (pFedMe lam in {5, 15, 30}, lr in {0.01, 0.05}, personal_lr in {0.02, 0.05, 0.1};
# the others one step lower) put every best value on its upper edge; this grid extends them.


def validation_split(fed: Federation, fraction: float = 0.2) -> Federation:
    """The training rows of every client, the last ``fraction`` of them (at least one) as the
    "test" data; the federation's own test rows are dropped."""
    xs, ys, xv, yv = [], [], [], []
    for i in range(fed.num_clients):
        x, y = fed.train.client(i)
        k = max(1, int(round(fraction * x.shape[0])))
        if k >= x.shape[0]:
            raise ValueError(f"client {i} has {x.shape[0]} training rows: too few to hold out validation rows")
        xs.append(x[:-k]), ys.append(y[:-k]), xv.append(x[-k:]), yv.append(y[-k:])
    return Federation(ClientData.from_clients(xs, ys), ClientData.from_clients(xv, yv), fed.num_classes,
                      name=fed.name + " [fit/validation]", meta=dict(fed.meta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default (e.g. rounds=100)")
    parser.add_argument("--algo", action="append", help="tune only this algorithm (repeatable)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "default_tuning.json"))
    args = parser.parse_args()
    cfg = E.apply_overrides(E.load(None), args.overrides)
    fed = validation_split(E.build_federation(cfg["data"], cfg["seeds"][0]))
    model = E.build_model(cfg["model"], fed)
    print(f"{fed}; {model!r}; {cfg['rounds']} rounds, {cfg.get('clients_per_round')} clients per round")
    report = {"data": cfg["data"], "rounds": cfg["rounds"], "clients_per_round": cfg.get("clients_per_round"),
              "points": {}, "chosen": {}}
    t0 = time.perf_counter()
    for label, (fixed, grid) in GRID.items():
        if args.algo and label not in args.algo:
            continue
        best = None
        for values in itertools.product(*grid.values()):
            spec = dict(copy.deepcopy(fixed), **dict(zip(grid, values)))
            alg = E.build_algorithm(label, spec, fed, model)
            try:
                res = pflcore.run(alg, fed, model, rounds=cfg["rounds"], clients_per_round=cfg.get("clients_per_round"),
                                  seed=cfg["seeds"][0], eval_every=cfg["rounds"], progress=False)
                acc = res.final("acc")
            except pflcore.DivergenceError:
                acc = None
            point = dict(zip(grid, values))
            report["points"].setdefault(label, []).append({**point, "validation_acc": acc})
            print(f"  {label:<11} {point}  validation acc {'diverged' if acc is None else f'{acc:.4f}'}", flush=True)
            if acc is not None and (best is None or acc > best[0]):
                best = (acc, spec)
        report["chosen"][label] = best[1] if best else None
        print(f"{label}: {best[1] if best else 'every point diverged'}  ({best[0]:.4f})" if best else label)
    report["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
