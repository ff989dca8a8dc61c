"""Experiments as data: a TOML file (or dict) names the data, the model, the algorithms, the
rounds and the seeds; ``run_experiment`` runs every algorithm on every seed and writes a table,
JSON and PNG (DESIGN.md §1: ``pflcore run``). An optional ``[sweep]`` varies one key."""
from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from pflcore import algorithms as A
from pflcore import data as D
from pflcore import distributed
from pflcore import models as M
from pflcore.result import finish_axes, plot_matrix, plot_results, pyplot, save_figure
from pflcore.run import run

# The comparison `pflcore run` makes with no arguments: Synthetic(0.5, 0.5), 100 clients,
# multinomial logistic regression, the hyperparameters of experiments/pfedme_table1_synthetic_mlr.toml
# (pFedMe's paper), 300 rounds of 10 sampled clients; a minute or two on 2 cores.
DEFAULT: Dict[str, Any] = {
    "name": "default_synthetic",
    "rounds": 300, "clients_per_round": 10, "eval_every": 10, "seeds": [0], "out": "pflcore_results",
    "metrics": ["personalized_acc", "global_acc"],
    "data": {"generator": "synthetic", "alpha": 0.5, "beta": 0.5, "num_clients": 100},
    "model": {"family": "softmax"},
    "algorithms": {
        "pFedMe": {"type": "pfedme", "lam": 20.0, "lr": 0.005, "personal_lr": 0.01, "inner_steps": 5,
                   "local_rounds": 20, "batch_size": 20, "beta": 1.0},
        "FedProx": {"type": "fedprox", "lam": 0.5, "local_lr": 0.05, "global_lr": 1.0, "local_steps": 20},
        "Per-FedAvg": {"type": "perfedavg", "alpha": 0.02, "beta": 0.005, "local_steps": 20, "batch_size": 20},
        "FedAvg": {"type": "fedavg", "lr": 0.005, "local_steps": 20, "batch_size": 20},
        "LocalTrain": {"type": "localtrain", "lr": 0.005, "steps": 20, "batch_size": 20},
    },
}

GENERATORS = {"synthetic": D.synthetic, "logistic_truth": D.logistic_truth, "least_squares": D.least_squares,
              "two_groups": D.two_groups, "contexts": D.contexts, "mnist": D.mnist, "digits": D.digits}


def load(path: Optional[str]) -> Dict[str, Any]:
    """The experiment in ``path`` (TOML), or the default comparison."""
    if path is None:
        return copy.deepcopy(DEFAULT)
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def apply_overrides(cfg: Dict[str, Any], overrides: List[str]) -> Dict[str, Any]:
    """``key=value`` pairs with dotted keys (``data.num_clients=50``, ``algorithms.pFedMe.lam=20``);
    values are parsed as TOML scalars/arrays where possible, else kept as strings."""
    import tomllib

    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = cfg
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return cfg


def build_federation(spec: Dict[str, Any], seed: int):
    spec = dict(spec)
    name = spec.pop("generator", None)
    if name not in GENERATORS:
        raise ValueError(f"data.generator: expected one of {sorted(GENERATORS)}, got {name!r}")
    spec.setdefault("seed", seed)
    if isinstance(spec.get("dtype"), str):  # "float32" | "float64" in TOML
        if spec["dtype"] not in ("float32", "float64"):
            raise ValueError(f"data.dtype: expected 'float32' or 'float64', got {spec['dtype']!r}")
        spec["dtype"] = getattr(torch, spec["dtype"])
    return GENERATORS[name](**spec)


def build_model(spec: Dict[str, Any], fed):
    spec = dict(spec or {})
    family = spec.pop("family", "softmax")
    p = fed.num_features
    if family == "mlp":  # torch nets: [model] family = "mlp", hidden = [100], l2 = ...
        return M.MLP(p, spec.pop("hidden", 100), fed.num_classes, **spec)
    if family == "cnn":  # channels, kernel_size, padding, pool, hidden, image_shape, l2
        return M.CNN(p, fed.num_classes, **spec)
    if "fit_intercept" not in spec and "model" in fed.meta:  # follow the generator's truth layout
        spec["fit_intercept"] = "fit_intercept=False" not in fed.meta["model"]
    if family == "softmax":
        return M.Softmax(p, fed.num_classes, **spec)
    if family == "logistic":
        return M.Logistic(p, **spec)
    if family == "least_squares":
        return M.LeastSquares(p, **spec)
    raise ValueError(f"model.family: expected softmax, logistic, least_squares, mlp or cnn, got {family!r}")


def build_algorithm(label: str, spec: Dict[str, Any], fed, model):
    spec = dict(spec)
    spec.pop("model", None)  # an algorithm's own [algorithms.X.model] (see run_experiment)
    kind = str(spec.pop("type", label)).lower().replace("-", "").replace("_", "")
    if kind not in A.REGISTRY:
        raise ValueError(f"algorithms.{label}.type: unknown algorithm {kind!r}; known: {sorted(A.REGISTRY)}")
    if kind == "fedprox" and spec.get("lam") == "adaptive":
        # λ from the heterogeneity R of the data and the training samples per client.
        n = int(fed.train.sizes.min())
        spec["lam"] = min(A.FedProx.adaptive_lambda(float(fed.meta.get("R", 0.0)), n), 1e6)
    if kind == "fedprox" and spec.get("local_lr") == "auto":
        L = A.FedProx.smoothness(fed)
        spec["global_lr"], spec["local_lr"] = A.FedProx.step_sizes(L, spec["lam"])
    memory = spec.pop("anderson", None)  # `anderson = τ`: wrap in Anderson acceleration
    reg = float(spec.pop("anderson_reg", 1e-10))
    alg = A.REGISTRY[kind](**spec)
    return alg if memory is None else A.Accelerated(alg, memory=int(memory), reg=reg)


def _summary(values: List[Optional[float]]):
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def run_experiment(cfg: Dict[str, Any], *, only: Optional[List[str]] = None, progress: bool = True,
                   out: Optional[str] = None, log=print) -> Dict[str, Any]:
    """Run every (sweep value, algorithm, seed); returns and writes a summary.

    Under torchrun (several ranks) every rank runs every (algorithm, seed) on its shard of the
    clients; the histories are the same on every rank and rank 0 alone logs and writes."""
    cfg = copy.deepcopy(cfg)
    out = out or cfg.get("out") or "pflcore_results"
    comm = distributed.default_comm()
    writer = comm.rank == 0
    if not writer:
        log = lambda *a, **k: None  # noqa: E731
    if writer:
        os.makedirs(out, exist_ok=True)
    algos = cfg.get("algorithms") or {}
    if only:
        lower = {k.lower(): k for k in algos}
        missing = [a for a in only if a.lower() not in lower]
        if missing:
            raise ValueError(f"--algo: unknown {missing}; this experiment has {list(algos)}")
        algos = {lower[a.lower()]: algos[lower[a.lower()]] for a in only}
    sweep = cfg.get("sweep")
    points = [(None, None)] if not sweep else [(sweep["key"], v) for v in sweep["values"]]
    seeds = cfg.get("seeds", [0])
    metrics = cfg.get("metrics", ["personalized_acc", "global_acc", "stat_error_local", "stat_error_global"])
    rows, curves = [], {}
    t_start = time.perf_counter()
    for key, value in points:
        point_cfg = apply_overrides(copy.deepcopy(cfg), [f"{key}={json.dumps(value)}"]) if key else cfg
        for label, spec in algos.items():
            finals = {k: [] for k in metrics}
            for seed in seeds:
                fed = build_federation(point_cfg["data"], seed)
                # [algorithms.X.model] overrides [model], so one file can compare method × model
                model = build_model(point_cfg["algorithms"][label].get("model") or point_cfg.get("model"), fed)
                alg = build_algorithm(label, point_cfg["algorithms"][label], fed, model)
                res = run(alg, fed, model, rounds=point_cfg["rounds"], clients_per_round=point_cfg.get("clients_per_round"),
                          seed=seed, eval_every=point_cfg.get("eval_every", 1), progress=progress)
                for k in metrics:
                    finals[k].append(res.final(k))
                tag = label if key is None else f"{label} ({key}={value})"
                curves.setdefault(tag, res)
                if writer:
                    res.to_json(os.path.join(out, f"{_slug(tag)}_seed{seed}.json"))
                _plot_state_matrices(res, tag, seed, out, log, comm)
            row = {"algorithm": label, "sweep": value}
            for k in metrics:
                row[k], row[k + "_std"] = _summary(finals[k])
            rows.append(row)
            log(_row_text(row, metrics, key))
    summary = {"name": cfg.get("name"), "config": cfg, "rows": rows, "seconds": time.perf_counter() - t_start}
    if comm.world > 1:
        summary["ranks"] = comm.world
    if not writer:
        return summary
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    try:
        if sweep:
            _plot_sweep(rows, sweep, metrics, os.path.join(out, "sweep.png"))
        else:
            plot_results(curves, os.path.join(out, "curves.png"), tuple(cfg.get("plot", ("personalized_acc", "global_acc"))))
    except ImportError as exc:
        log(f"(no plot: {exc})")
    return summary


def _plot_state_matrices(res, tag: str, seed: int, out: str, log, comm) -> None:
    """PERM's mixing weights α [m, m] as a heat-map PNG beside the run's JSON (every rank calls
    it: a sharded α is gathered, its rows being spread over the ranks)."""
    alpha = getattr(res.state, "alpha", None)
    if not isinstance(alpha, torch.Tensor) or alpha.dim() != 2:
        return
    if comm.world > 1:
        alpha = comm.all_gather_rows(alpha)
    if comm.rank != 0:
        return
    try:
        plot_matrix(alpha, os.path.join(out, f"{_slug(tag)}_seed{seed}_alpha.png"),
                    f"{tag}: mixing weights α (row i: model i's weight on client j)")
    except ImportError as exc:
        log(f"(no plot: {exc})")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _row_text(row, metrics, key) -> str:
    parts = [f"{row['algorithm']:<14}"] + ([f"{key}={row['sweep']:<6}"] if key else [])
    for k in metrics:
        if row[k] is not None:
            parts.append(f"{k} {row[k]:.4g} ± {row[k + '_std']:.2g}")
    return "  ".join(parts)


def format_table(rows, metrics) -> str:
    shown = [k for k in metrics if any(r[k] is not None for r in rows)]
    wide = max([14] + [len(r["algorithm"]) for r in rows])  # names like "CGPFL (K=4)" set the column
    head = f"{'algorithm':<{wide}} {'sweep':>8} " + " ".join(f"{k:>24}" for k in shown)
    lines = [head]
    for r in rows:
        cells = [f"{r[k]:.4g} ± {r[k + '_std']:.2g}" if r[k] is not None else "-" for k in shown]
        lines.append(f"{r['algorithm']:<{wide}} {str(r['sweep'] if r['sweep'] is not None else ''):>8} "
                     + " ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def _plot_sweep(rows, sweep, metrics, path):
    plt = pyplot()
    metric = sweep.get("metric") or next(k for k in metrics if any(r[k] is not None for r in rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["sweep"], r[metric]) for r in rows if r["algorithm"] == label and r[metric] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    finish_axes(ax, sweep["key"], metric, bool(sweep.get("log_y")))
    save_figure(fig, path)
