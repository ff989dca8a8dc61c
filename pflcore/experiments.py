"""Experiments as data: a TOML file (or dict) names the data, the model, the algorithms, the
rounds and the seeds; ``run_experiment`` runs every algorithm on every seed and writes a table,
JSON and PNG (DESIGN.md §1: ``pflcore run``). An optional ``[sweep]`` varies one key.

The configuration is checked whole before the first run (``pflcore.experiment_config``): unknown
keys, wrong types and values the constructors reject raise ``ConfigError`` naming the key. A run
that diverges (NaN/inf) is a result: it is recorded with its round and reason in the summary and
the table, and the other runs go on.
"""
from __future__ import annotations

import copy
import os
import stat
import time
from typing import Any, Dict, List, Optional

import torch

from pflcore import algorithms as A
from pflcore import data as D
from pflcore import distributed
from pflcore import experiment_config as C
from pflcore import models as M
from pflcore import seed_stats as S
from pflcore.run import _validate as check_run_arguments
from pflcore.experiment_config import ConfigError
from pflcore.result import LABELS, Result, finish_axes, plot_matrix, plot_results, pyplot, save_figure, strict_json
from pflcore.run import DivergenceError, run

# The comparison `pflcore run` makes with no arguments: the setting the personalization papers
# study, where neither training alone nor one global model serves the clients well. 100 clients
# share one true softmax model up to a deviation of their own (each client's weights and feature
# mean = the shared ones + 0.5·N(0, 1); data.contexts with one context), and each has 20 to 60
# samples (15 to 45 for training) for a model of 610 parameters. The hyperparameters were chosen
# on a validation split of the training rows, never on the test rows:
# experiments/default_tuning.py (grids, procedure and its output in
# experiments/results/default_tuning.json).
DEFAULT: Dict[str, Any] = {
    "name": "default_personalization",
    "rounds": 200, "clients_per_round": 10, "eval_every": 10, "seeds": [0], "out": "pflcore_results",
    "metrics": ["acc", "personalized_acc", "global_acc"],
    "plot": ["acc", "global_acc"],
    "data": {"generator": "contexts", "num_clients": 100, "num_contexts": 1, "client_noise": 0.5, "beta": 0.0,
             "feature_spread": 0.0, "sizes": [20, 60], "dim": 60, "num_classes": 10},
    "model": {"family": "softmax"},
    "algorithms": {
        "pFedMe": {"type": "pfedme", "lam": 15.0, "lr": 0.1, "personal_lr": 0.05, "inner_steps": 5,
                   "local_rounds": 20, "batch_size": 20, "beta": 1.0},
        "FedProx": {"type": "fedprox", "lam": 0.5, "local_lr": 0.3, "global_lr": 1.0, "local_steps": 20},
        "Per-FedAvg": {"type": "perfedavg", "alpha": 0.3, "beta": 0.3, "local_steps": 20, "batch_size": 20},
        "FedAvg": {"type": "fedavg", "lr": 0.3, "local_steps": 20, "batch_size": 20},
        "LocalTrain": {"type": "localtrain", "lr": 0.3, "steps": 20, "batch_size": 20},
    },
}

# leaf and cifar10 read files: `root = "<folder>"` (relative to the working directory), which
# experiment_config.check_data requires where the reader has no default.
GENERATORS = {"synthetic": D.synthetic, "logistic_truth": D.logistic_truth, "least_squares": D.least_squares,
              "two_groups": D.two_groups, "contexts": D.contexts, "mnist": D.mnist, "digits": D.digits,
              "leaf": D.leaf, "cifar10": D.cifar10}

BASELINES = {"localtrain": "local", "fedavg": "global", "globaltrain": "global"}


def load(path: Optional[str]) -> Dict[str, Any]:
    """The experiment in ``path`` (TOML), or the default comparison. A missing or malformed file
    raises ConfigError."""
    if path is None:
        return copy.deepcopy(DEFAULT)
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore
    try:
        _check_file(os.stat(path), path)  # before open(): opening a FIFO would wait for a writer
        with open(path, "rb") as fh:
            return tomllib.loads(_read_bounded(fh, path).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"experiment file {path!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"experiment file {path!r} is a folder") from None
    except OSError as exc:
        raise ConfigError(f"experiment file {path!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML (not UTF-8 text: {exc.reason} at byte {exc.start})") from None


# An experiment file is a few kB of TOML; the bound keeps `pflcore run /dev/zero` (or a data file
# passed by mistake) from reading until memory runs out.
MAX_EXPERIMENT_BYTES = 4 << 20


def _check_file(info: os.stat_result, path: str) -> None:
    """ConfigError unless ``info`` is a regular file of at most MAX_EXPERIMENT_BYTES."""
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(info.st_mode):
        kind = ("a character device" if stat.S_ISCHR(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "a block device" if stat.S_ISBLK(info.st_mode)
                else "not a regular file")
        raise ConfigError(f"experiment file {path!r}: expected a regular file (TOML text), got {kind}")
    limit = MAX_EXPERIMENT_BYTES
    if info.st_size > limit:
        raise ConfigError(f"experiment file {path!r}: expected at most {limit >> 20} MiB of TOML, got "
                          f"{info.st_size / 2**20:.1f} MiB (is it an experiment file?)")


def _read_bounded(fh, path: str) -> bytes:
    """The whole of an experiment file (checked again once open: a device, a pipe or a huge file
    is refused before it is read)."""
    _check_file(os.fstat(fh.fileno()), path)
    limit = MAX_EXPERIMENT_BYTES
    raw = fh.read(limit + 1)  # a file that grew since fstat still stops here
    if len(raw) > limit:
        raise ConfigError(f"experiment file {path!r}: expected at most {limit >> 20} MiB of TOML, got more")
    return raw


def apply_overrides(cfg: Dict[str, Any], overrides: List[str], *, strict: bool = True) -> Dict[str, Any]:
    """``key=value`` pairs with dotted keys (``data.num_clients=50``, ``algorithms.pFedMe.lam=20``);
    values are parsed as TOML values where possible, else kept as strings. ``strict``: the tables
    on a key's way must exist (a misspelt table or algorithm is an error, not a new table)."""
    return C.apply_overrides(cfg, overrides, strict=strict)


def check(cfg: Dict[str, Any]) -> None:
    """ConfigError for the first unknown key or ill-typed value of an experiment."""
    C.check(cfg, GENERATORS)


def _wrap(where: str, exc: Exception) -> ConfigError:
    text = str(exc)
    return ConfigError(text if text.startswith(where) else f"{where}: {text}", key=where)


def build_federation(spec: Dict[str, Any], seed: int):
    spec = dict(spec)
    name = spec.pop("generator", None)
    if name not in GENERATORS:
        raise ConfigError(f"data.generator: expected one of {sorted(GENERATORS)}, got {name!r}", key="data.generator")
    if "seed" in C.parameters(GENERATORS[name]):  # leaf's files are the data: no seed to give
        spec.setdefault("seed", seed)
    if isinstance(spec.get("dtype"), str):  # "float32" | "float64" in TOML
        if spec["dtype"] not in ("float32", "float64"):
            raise ConfigError(f"data.dtype: expected 'float32' or 'float64', got {spec['dtype']!r}", key="data.dtype")
        spec["dtype"] = getattr(torch, spec["dtype"])
    if isinstance(spec.get("sizes"), list):  # a TOML array where the generators take a pair
        spec["sizes"] = tuple(spec["sizes"])
    try:
        return GENERATORS[name](**spec)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # FileNotFoundError: a reader's missing root
        raise _wrap("data", exc) from None


def build_model(spec: Dict[str, Any], fed, where: str = "model"):
    spec = dict(spec or {})
    family = spec.pop("family", "softmax")
    p = fed.num_features
    try:
        if family == "mlp":  # torch nets: [model] family = "mlp", hidden = [100], l2 = ...
            return M.MLP(p, spec.pop("hidden", 100), fed.num_classes, **spec)
        if family == "cnn":  # channels, kernel_size, padding, pool, hidden, image_shape, l2
            if "image_shape" not in spec and fed.meta.get("image_shape"):  # cifar10's (3, 32, 32), leaf's
                spec["image_shape"] = tuple(fed.meta["image_shape"])
            return M.CNN(p, fed.num_classes, **spec)
        if "fit_intercept" not in spec and "model" in fed.meta:  # follow the generator's truth layout
            spec["fit_intercept"] = "fit_intercept=False" not in fed.meta["model"]
        if family == "softmax":
            return M.Softmax(p, fed.num_classes, **spec)
        if family == "logistic":
            return M.Logistic(p, **spec)
        if family == "least_squares":
            return M.LeastSquares(p, **spec)
    except (ValueError, TypeError) as exc:
        raise _wrap(where, exc) from None
    raise ConfigError(f"{where}.family: expected softmax, logistic, least_squares, mlp or cnn, got {family!r}",
                      key=f"{where}.family")


def build_algorithm(label: str, spec: Dict[str, Any], fed, model):
    where = f"algorithms.{label}"
    spec = dict(spec)
    spec.pop("model", None)  # an algorithm's own [algorithms.X.model] (see run_experiment)
    kind = C.algorithm_kind(label, spec)
    cls = C.algorithm_class(label, spec)  # built-in, entry point or "package.module:Class"
    spec.pop("type", None)
    spec.pop("private", None)  # run_experiment's: whether [privacy] applies to this algorithm
    try:
        if kind == "fedprox" and spec.get("lam") == "adaptive":
            # λ from the heterogeneity R of the data and the training samples per client.
            n = int(fed.train.sizes.min())
            spec["lam"] = min(A.FedProx.adaptive_lambda(float(fed.meta.get("R", 0.0)), n), 1e6)
        if kind == "fedprox" and spec.get("local_lr") == "auto":
            L = A.FedProx.smoothness(fed)
            spec["global_lr"], spec["local_lr"] = A.FedProx.step_sizes(L, spec["lam"])
        memory = spec.pop("anderson", None)  # `anderson = τ`: wrap in Anderson acceleration
        reg = float(spec.pop("anderson_reg", 1e-10))
        alg = cls(**spec)
        return alg if memory is None else A.Accelerated(alg, memory=int(memory), reg=reg)
    except (ValueError, TypeError) as exc:
        raise _wrap(where, exc) from None


def _summary(values: List[Optional[float]]):
    """(mean, sample std (ddof=1)) of the finite values; the std is None for one value (one seed:
    there is no spread to show)."""
    mean, std, _ = S.summarize(values)
    return mean, std


# Kept per seed beside the experiment's metrics: "acc" (what the verdict ranks by default) and
# the 10th percentile over clients, the spread a mean over clients hides.
SPREAD = ("acc", "acc_p10", "personalized_acc_p10", "global_acc_p10")


def main_metric(cfg: Dict[str, Any], metrics: List[str], rows: List[Dict[str, Any]]) -> Optional[str]:
    """The metric the verdict ranks by: ``sweep.metric``, else the first of ``metrics`` that
    some row has. ``personalized_acc`` is read as ``acc`` (the model each client uses): a method
    without personalized models (FedAvg) is then ranked by its global model, as the papers'
    tables do, instead of being left out."""
    wanted = [(cfg.get("sweep") or {}).get("metric")] + list(metrics)
    for k in wanted:
        k = "acc" if k == "personalized_acc" else k
        if k and any(r.get(k) is not None for r in rows):
            return k
    return None


def _p10_key(main: Optional[str]) -> Optional[str]:
    """The per-client spread shown beside an accuracy: its 10th percentile over clients."""
    return {"acc": "acc_p10", "global_acc": "global_acc_p10"}.get(main or "")


def _statistics(rows: List[Dict[str, Any]], main: Optional[str]) -> Optional[str]:
    """Pairs every row with the best of its sweep point (``seed_stats.annotate``); returns the
    verdict: one line, or one line per sweep value."""
    if main is None:
        return None
    lines = []
    for value in dict.fromkeys(r["sweep"] for r in rows):
        point = [r for r in rows if r["sweep"] == value]
        S.annotate(point, main)
        line = S.verdict(point, main)
        if line:
            lines.append(line if value is None else f"[sweep = {value}] {line}")
    return "\n".join(lines) or None


def _select(algos: Dict[str, Any], only: Optional[List[str]]) -> Dict[str, Any]:
    if not only:
        return algos
    lower = {k.lower(): k for k in algos}
    missing = [a for a in only if a.lower() not in lower]
    if missing:
        close = C.difflib.get_close_matches(missing[0].lower(), list(lower), n=1, cutoff=0.6)
        hint = f" (did you mean '{lower[close[0]]}'?)" if close else ""
        raise ConfigError(f"--algo: unknown {missing}{hint}; this experiment has {list(algos)}", key="--algo")
    return {lower[a.lower()]: algos[lower[a.lower()]] for a in only}


def _points(cfg: Dict[str, Any]):
    """[(sweep key, value, that point's configuration)]; one point without a sweep."""
    sweep = cfg.get("sweep")
    if not sweep:
        return [(None, None, cfg)]
    points = []
    for value in sweep["values"]:
        point_cfg = copy.deepcopy(cfg)
        try:
            C.set_key(point_cfg, sweep["key"], value, strict=True)
        except ConfigError as exc:
            raise ConfigError(f"sweep.key: {exc}", key="sweep.key") from None
        points.append((sweep["key"], value, point_cfg))
    return points


def _model_spec(point_cfg, label):
    """[algorithms.X.model] overrides [model], so one file can compare method × model."""
    return point_cfg["algorithms"][label].get("model") or point_cfg.get("model")


def _prepare(points, algos, seeds) -> Dict[Any, Any]:
    """Builds every point's data (first seed), models and algorithms and checks the run's
    arguments, so that a bad value stops the experiment before its first run. Returns the first
    point's federation, to be reused."""
    kept = {}
    for i, (_, _, point_cfg) in enumerate(points):
        fed = build_federation(point_cfg["data"], seeds[0])
        for label in algos:
            where = f"algorithms.{label}.model" if point_cfg["algorithms"][label].get("model") else "model"
            model = build_model(_model_spec(point_cfg, label), fed, where)
            alg = build_algorithm(label, point_cfg["algorithms"][label], fed, model)
            try:
                check_run_arguments(alg, fed, model, point_cfg["rounds"], point_cfg.get("clients_per_round"),
                                    point_cfg.get("eval_every", 1), seeds[0])
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if i == 0:
            kept[(0, seeds[0])] = fed
    return kept


def run_experiment(cfg: Dict[str, Any], *, only: Optional[List[str]] = None, progress: bool = True,
                   out: Optional[str] = None, log=print) -> Dict[str, Any]:
    """Run every (sweep value, algorithm, seed); returns and writes a summary.

    Under torchrun (several ranks) every rank runs every (algorithm, seed) on its shard of the
    clients; the histories are the same on every rank and rank 0 alone logs and writes."""
    cfg = copy.deepcopy(cfg)
    check(cfg)
    out = out or cfg.get("out") or "pflcore_results"
    comm = distributed.default_comm()
    writer = comm.rank == 0
    if not writer:
        log = lambda *a, **k: None  # noqa: E731
    algos = _select(cfg["algorithms"], only)
    points = _points(cfg)
    for _, _, point_cfg in points[1:]:
        check(point_cfg)
    seeds = cfg.get("seeds", [0])
    metrics = cfg.get("metrics", ["personalized_acc", "global_acc", "stat_error_local", "stat_error_global"]
                      + (["epsilon"] if "privacy" in cfg else []))
    feds = _prepare(points, algos, seeds)
    if writer:
        os.makedirs(out, exist_ok=True)
    rows, curves, facts = [], {}, None
    t_start = time.perf_counter()
    for i, (key, value, point_cfg) in enumerate(points):
        for label in algos:
            spec = point_cfg["algorithms"][label]
            tracked = list(dict.fromkeys(list(metrics) + list(SPREAD)))
            per_seed = {"seed": [], **{k: [] for k in tracked}}  # None where the seed diverged
            diverged = []
            for seed in seeds:
                fed = feds.get((i, seed)) or build_federation(point_cfg["data"], seed)
                feds[(i, seed)] = fed
                model = build_model(_model_spec(point_cfg, label), fed)
                alg = build_algorithm(label, spec, fed, model)
                if facts is None:
                    facts = _facts(fed, model)
                tag = label if key is None else f"{label} ({key}={value})"
                try:
                    privacy = C.privacy_settings(point_cfg["privacy"]) \
                        if "privacy" in point_cfg and spec.get("private", True) else None
                    res = run(alg, fed, model, rounds=point_cfg["rounds"],
                              clients_per_round=point_cfg.get("clients_per_round"), seed=seed,
                              eval_every=point_cfg.get("eval_every", 1), progress=progress, privacy=privacy)
                except DivergenceError as exc:
                    if not exc.all_ranks:
                        raise  # one rank alone stopped inside a round: its peers cannot go on with it
                    diverged.append({"seed": seed, "round": exc.round, "reason": exc.reason})
                    res = Result(alg.name, exc.history or [], None, None, None, {"algorithm": repr(alg), "seed": seed},
                                 diverged={"round": exc.round, "reason": exc.reason})
                    log(f"{tag}: diverged in round {exc.round} (seed {seed}): {exc.reason}")
                per_seed["seed"].append(seed)
                for k in tracked:
                    per_seed[k].append(None if res.diverged else res.final(k))
                curves.setdefault(tag, []).append(res)  # every seed: the figure shows their mean
                if writer:
                    res.to_json(os.path.join(out, f"{_slug(tag)}_seed{seed}.json"))
                if res.state is not None:
                    _plot_state_matrices(res, tag, seed, out, log, comm)
            row = {"algorithm": label, "sweep": value, "type": C.algorithm_kind(label, spec),
                   "seeds": len(seeds), "diverged": diverged}
            for k in tracked:
                if k in metrics or any(v is not None for v in per_seed[k]):
                    row[k], row[k + "_std"], row[k + "_n"] = S.summarize(per_seed[k])
            row["per_seed"] = {k: v for k, v in per_seed.items() if k == "seed" or any(x is not None for x in v)}
            rows.append(row)
            log(_row_text(row, metrics, key))
        for seed in seeds:  # this point's data is no longer needed
            feds.pop((i, seed), None)
    main = main_metric(cfg, metrics, rows)
    summary = {"name": cfg.get("name"), "config": cfg, "rows": rows, "seconds": time.perf_counter() - t_start,
               "facts": facts, "main_metric": main, "statistics": {"std": S.STD, "verdict_rule": S.RULE}}
    summary["verdict"] = _statistics(rows, main)  # sets each row's vs_best
    if comm.world > 1:
        summary["ranks"] = comm.world
    if not writer:
        return summary
    with open(os.path.join(out, "summary.json"), "w") as fh:
        fh.write(strict_json(summary))
    sweep = cfg.get("sweep")
    try:
        if sweep:
            _plot_sweep(rows, sweep, metrics, os.path.join(out, "sweep.png"))
        else:
            keys = tuple(cfg.get("plot", ("personalized_acc", "global_acc")))
            plot_results(curves, os.path.join(out, "curves.png"), keys)
    except ImportError as exc:
        log(f"(no plot: {exc})")
    return summary


def _facts(fed, model) -> Dict[str, Any]:
    """What the takeaway sentence cites about the setting."""
    sizes = fed.train.sizes.double()
    return {"clients": fed.num_clients, "median_train_samples": float(sizes.median()),
            "min_train_samples": int(sizes.min()), "max_train_samples": int(sizes.max()), "parameters": model.d,
            "model": repr(model), "federation": fed.name}


def takeaway(summary: Dict[str, Any], metric: str = "acc") -> Optional[str]:
    """One sentence on what a comparison shows: the best personalized method against training
    alone (LocalTrain) and one global model (FedAvg), with the reason the setting gives; None
    unless the experiment has both baselines, another method and no sweep."""
    rows = [r for r in summary["rows"] if r.get("sweep") is None]
    if summary["config"].get("sweep") or not rows or summary.get("facts") is None:
        return None
    local = next((r for r in rows if BASELINES.get(r.get("type")) == "local" and r.get(metric) is not None), None)
    glob = next((r for r in rows if BASELINES.get(r.get("type")) == "global" and r.get(metric) is not None), None)
    others = [r for r in rows if r.get("type") not in BASELINES and r.get(metric) is not None]
    if local is None or glob is None or not others:
        return None
    best = max(others, key=lambda r: r[metric])
    f = summary["facts"]
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    few = (f"each client has a median of {f['median_train_samples']:.0f} training samples for a model of "
           f"{f['parameters']} parameters")
    if best[metric] > local[metric] and best[metric] > glob[metric]:
        return _hedged(best, [local, glob], metric, (
            f"{best['algorithm']} is ahead ({pct(best[metric])}) of both LocalTrain ({pct(local[metric])}) and "
            f"FedAvg ({pct(glob[metric])}): {few}, too few to learn alone, and the clients' data differ, so one "
            f"global model fits none of them exactly; a personalized model borrows what the clients share and "
            f"keeps what is each one's own."))
    if local[metric] >= glob[metric]:
        return _hedged(local, [best, glob], metric, (
            f"Here LocalTrain ({pct(local[metric])}) is ahead of every personalized method (best: "
            f"{best['algorithm']}, {pct(best[metric])}) and of FedAvg ({pct(glob[metric])}): {few}, enough for "
            f"each client to learn on its own, so sharing adds little."))
    return _hedged(glob, [best, local], metric, (
        f"Here FedAvg's one global model ({pct(glob[metric])}) is ahead of every personalized method (best: "
        f"{best['algorithm']}, {pct(best[metric])}) and of LocalTrain ({pct(local[metric])}): the clients' data "
        f"are alike enough that one model serves them all, and {few}."))


def _hedged(leader, others, metric: str, sentence: str) -> str:
    """``sentence`` (``leader`` ahead of ``others``), with a warning where the seeds do not
    support that lead: the paired difference (rows with per-seed values, 2+ seeds in common) is
    within its noise. The sentence itself stays: it is the reason the setting gives."""
    level = []
    for row in others:
        p = S.paired(S.seed_values(leader, metric), S.seed_values(row, metric), S.lower_is_better(metric))
        if p is not None and p["n"] >= 2 and not p["beyond_noise"]:
            level.append(f"{row['algorithm']} ({p['n']} seeds)")
    if not level:
        return sentence
    return (f"{sentence} But the lead of {leader['algorithm']} over {' and '.join(level)} is within the noise "
            f"of the seeds (see the verdict): this run does not show it.")


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
    pooled = getattr(res.state, "pool", None) is not None  # PERM(alpha_pool=s): α is [m, s + 1]
    try:
        plot_matrix(alpha, os.path.join(out, f"{_slug(tag)}_seed{seed}_alpha.png"),
                    f"{tag}: mixing weights α (row i: model i's weight on client j)" if not pooled else
                    f"{tag}: pooled mixing weights α",
                    xlabel="client j" if not pooled else "the pool's j-th client (last column: model i's own client)")
    except ImportError as exc:
        log(f"(no plot: {exc})")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _cell(mean: Optional[float], std: Optional[float]) -> str:
    """"mean ± std" over seeds; the mean alone for one seed."""
    if mean is None:
        return "-"
    return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def _note(row) -> str:
    """"diverged in round t (seed s): reason" for the runs of a row that diverged."""
    div = row.get("diverged") or []
    if not div:
        return ""
    first = div[0]
    reason = first["reason"] if len(first["reason"]) <= 70 else first["reason"].split(" (")[0][:70]
    which = (f"seed {first['seed']}" if row.get("seeds", 1) == 1
             else f"{len(div)} of {row['seeds']} seeds{', left out of the means' if len(div) < row['seeds'] else ''}; "
                  f"first: seed {first['seed']}")
    return f"diverged in round {first['round']} ({which}): {reason}"


def _row_text(row, metrics, key) -> str:
    parts = [f"{row['algorithm']:<14}"] + ([f"{key}={row['sweep']:<6}"] if key else [])
    for k in metrics:
        if row[k] is not None:
            parts.append(f"{k} {_cell(row[k], row[k + '_std'])}")
    if _note(row):
        parts.append(_note(row))
    return "  ".join(parts)


def format_table(rows, metrics) -> str:
    """The summary rows as a text table: mean ± sample std over seeds (the mean alone for one
    seed), "-" where a metric does not apply, and a note on runs that diverged. Rows annotated
    by ``seed_stats.annotate`` also get the per-client spread (p10 of the main accuracy) and the
    paired difference with the best method; the lines under the table say what each column is."""
    main = next((r["vs_best"]["metric"] for r in rows if r.get("vs_best")), None)
    p10 = _p10_key(main)
    shown = [k for k in metrics if any(r.get(k) is not None for r in rows)] or list(metrics[:1])
    if p10 in shown or not any(r.get(p10) is not None for r in rows):
        p10 = None  # already a column of its own (with its ±), or not recorded
    else:
        shown.append(p10)  # mean over seeds alone: the ± of a percentile would crowd the table
    wide = max([14] + [len(r["algorithm"]) for r in rows])  # names like "CGPFL (K=4)" set the column
    sweep = any(r["sweep"] is not None for r in rows)
    cells = [[_cell(r.get(k), None if k == p10 else r.get(k + "_std")) for k in shown] for r in rows]
    heads = list(shown)
    if main:
        heads.append(f"paired vs best ({main})")
        for r, c in zip(rows, cells):
            c.append(S.vs_best_text(r))
    widths = [max(len(k), *(len(c[j]) for c in cells)) for j, k in enumerate(heads)]
    head = f"{'algorithm':<{wide}}" + (f" {'sweep':>8}" if sweep else "") + "".join(
        f"  {k:>{w}}" for k, w in zip(heads, widths))
    lines = [head]
    for r, c in zip(rows, cells):
        value = str(r["sweep"] if r["sweep"] is not None else "")
        line = f"{r['algorithm']:<{wide}}" + (f" {value:>8}" if sweep else "")
        line += "".join(f"  {v:>{w}}" for v, w in zip(c, widths))
        if _note(r):
            line += "  " + _note(r)
        lines.append(line.rstrip())
    legend = [f"{k}: {LABELS[k]}" for k in shown if k in LABELS]
    seeds = max((r.get("seeds", 1) for r in rows), default=1)
    if any(r.get(k + "_std") is not None for r in rows for k in shown):
        legend.append(f"±: {S.STD} (n = {seeds} seeds; a diverged seed is left out of the means)")
    if main:
        legend.append(f"paired vs best: {main} minus the best method's, seed by seed: mean ± sample std of the "
                      f"differences, and the seeds on which the method beat the best")
    return "\n".join(lines + legend)


def _plot_sweep(rows, sweep, metrics, path):
    """The sweep's metric against the swept value, one line per method: the mean over seeds with
    error bars of ± 1 sample std (several seeds; the title says so and n)."""
    plt = pyplot()
    metric = sweep.get("metric") or next((k for k in metrics if any(r[k] is not None for r in rows)), metrics[0])
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["sweep"], r[metric], r.get(metric + "_std")) for r in rows
               if r["algorithm"] == label and r[metric] is not None]
        if not pts:
            continue
        xs, ys, stds = zip(*pts)
        if any(sd is not None for sd in stds):
            ax.errorbar(xs, ys, yerr=[sd or 0.0 for sd in stds], marker="o", capsize=3, label=label)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    finish_axes(ax, sweep["key"], metric, bool(sweep.get("log_y")))
    seeds = max((r.get("seeds", 1) for r in rows), default=1)
    if seeds > 1:
        ax.set_title(f"mean over {seeds} seeds; bars: ± 1 sample std (ddof=1)", fontsize=10)
    save_figure(fig, path)
