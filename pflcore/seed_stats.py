"""Statistics over seeds: what ± means, the per-seed pairing of methods and the verdict line.

* ``±`` is the sample standard deviation (ddof=1) over the seeds that finished (a diverged seed
  is left out of every mean and std, and the table says so).
* Every method is paired with the best one seed by seed: a seed fixes the data, the initial
  model and the clients drawn each round for every method alike, so the difference on one seed
  cancels that seed's shared luck, and a small but steady lead shows even where the two
  methods' ± overlap. Pairing uses the seeds where both methods finished.
* Verdict rule: a paired two-sided t-test at 5%. A difference is claimed only when
  ``|t| = |mean d| / (s_d / sqrt(n))`` exceeds the 97.5% quantile of Student's t with n - 1
  degrees of freedom (12.71 for n = 2, 4.30 for n = 3, 2.78 for n = 5, 2.26 for n = 10). Why the
  quantile and not a fixed 2: with 3 seeds s_d is itself a noisy estimate, and |t| > 2 would
  happen by chance about one time in five. Why not "all seeds agree in sign": with 3 seeds two
  equal methods agree by chance one time in four. One seed gives no noise estimate: no claim.
  Caveats: the best method is picked on the same runs, and each other method is one more test
  at 5%, so a table of many near-equal methods can still show a spurious "ahead".
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

# 97.5% quantiles of Student's t by degrees of freedom; between two entries the smaller df's
# (larger, so stricter) value is used; past 120 the normal quantile.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}

STD = "sample std (ddof=1) over the seeds that finished"
RULE = "paired t-test over seeds at 5% (two-sided), vs the best method on the main metric"


def critical_t(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (from ``T975``)."""
    if df < 1:
        raise ValueError(f"df: expected >= 1, got {df}")
    return T975[max(k for k in T975 if k <= df)] if df <= 120 else 1.960


def finite(values: Sequence[Optional[float]]) -> List[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def summarize(values: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float], int]:
    """(mean, sample std, n) of the finite values; the std is None below two values (one seed:
    no spread to show)."""
    vals = finite(values)
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None), len(vals)


def lower_is_better(metric: str) -> bool:
    """Errors and losses: smaller wins; accuracies: larger wins."""
    return metric.startswith("stat_error") or metric.endswith("loss") or metric in ("optimality_gap", "residual")


def seed_values(row: Dict[str, Any], metric: str) -> Dict[int, float]:
    """{seed: final value} of a summary row's finished seeds (rows carry ``per_seed``)."""
    per = row.get("per_seed") or {}
    return {s: v for s, v in zip(per.get("seed", []), per.get(metric, [])) if v is not None and math.isfinite(v)}


def paired(a: Dict[int, float], b: Dict[int, float], lower: bool = False) -> Optional[Dict[str, Any]]:
    """a − b seed by seed, over the seeds both have: mean, sample std, n, wins (seeds where a is
    better; losses: worse), t and whether the difference is beyond its noise; None without a common seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [a[s] - b[s] for s in seeds]
    n = len(d)
    mean = statistics.fmean(d)
    std = statistics.stdev(d) if n > 1 else None
    wins = sum(1 for x in d if (x < 0 if lower else x > 0))
    losses = sum(1 for x in d if (x > 0 if lower else x < 0))
    t = None
    beyond = False
    if n > 1:
        if std > 0:
            t = mean / (std / math.sqrt(n))
            beyond = abs(t) > critical_t(n - 1)
        else:  # the same difference on every seed: no noise at all, a claim if it is not zero
            beyond = mean != 0
    return {"mean": mean, "std": std, "n": n, "wins": wins, "losses": losses, "t": t, "beyond_noise": beyond, "seeds": seeds}


def best_row(rows: List[Dict[str, Any]], metric: str) -> Optional[Dict[str, Any]]:
    """The row with the best mean of ``metric`` (None if no row has one)."""
    have = [r for r in rows if r.get(metric) is not None]
    if not have:
        return None
    return (min if lower_is_better(metric) else max)(have, key=lambda r: r[metric])


def annotate(rows: List[Dict[str, Any]], metric: str) -> Optional[Dict[str, Any]]:
    """Sets each row's ``vs_best`` (its paired difference with the best row on ``metric``, and a
    ``verdict``: best | ahead | behind | indistinguishable | untested); returns the best row."""
    best = best_row(rows, metric)
    lower = lower_is_better(metric)
    for row in rows:
        if best is None or row is best:
            row["vs_best"] = None if best is None else {"metric": metric, "vs": row["algorithm"], "verdict": "best"}
            continue
        p = paired(seed_values(row, metric), seed_values(best, metric), lower)
        if p is None or p["n"] < 2:
            verdict = "untested"
        elif not p["beyond_noise"]:
            verdict = "indistinguishable"
        else:
            verdict = "ahead" if (p["mean"] < 0) == lower else "behind"
        row["vs_best"] = dict(p or {"n": 0}, metric=metric, vs=best["algorithm"], verdict=verdict)
    return best


def fmt_diff(metric: str, mean: float, std: Optional[float]) -> str:
    """"+1.23 ± 0.28 pts" for an accuracy (percentage points), "-0.0012 ± 0.0003" otherwise."""
    if "acc" in metric:
        return f"{100 * mean:+.2f}" + ("" if std is None else f" ± {100 * std:.2f}") + " pts"
    return f"{mean:+.3g}" + ("" if std is None else f" ± {std:.2g}")


def fmt_value(metric: str, value: float) -> str:
    return f"{100 * value:.2f}%" if "acc" in metric else f"{value:.4g}"


def vs_best_text(row: Dict[str, Any]) -> str:
    """The table's cell: "-1.23 ± 0.28 pts vs pFedMe, 0/3 wins", "best", or "-"."""
    vs = row.get("vs_best")
    if not vs:
        return "-"
    if vs["verdict"] == "best":
        return "best"
    if not vs.get("n"):  # diverged on every seed, or finished on other seeds than the best
        return "-" if not seed_values(row, vs["metric"]) else f"no seed in common with {vs['vs']}"
    return f"{fmt_diff(vs['metric'], vs['mean'], vs['std'])} vs {vs['vs']}, {vs['wins']}/{vs['n']} wins"


def verdict(rows: List[Dict[str, Any]], metric: str) -> Optional[str]:
    """One line from the rows' ``vs_best`` (see ``annotate``): the best method on ``metric`` and,
    for each other one, a claim only where the paired difference is beyond its noise."""
    best = next((r for r in rows if (r.get("vs_best") or {}).get("verdict") == "best"), None)
    if best is None:
        return None
    n = best.get(metric + "_n") or len(seed_values(best, metric))
    head = (f"Verdict on {metric} ({'lower' if lower_is_better(metric) else 'higher'} is better; paired t-test over "
            f"seeds at 5%): {best['algorithm']} is best ({fmt_value(metric, best[metric])}, mean of {n} seed"
            f"{'s' if n != 1 else ''})")
    others = [r for r in rows if r is not best and r.get("vs_best")]
    if not others:
        return head + "; no other method to compare."
    groups: Dict[str, List[str]] = {"behind": [], "ahead": [], "indistinguishable": [], "untested": []}
    for r in others:
        vs = r["vs_best"]
        name = r["algorithm"]
        if vs["verdict"] == "behind":  # the best's lead, best − r: the sign a reader expects after "ahead of"
            groups["behind"].append(f"{name} by {fmt_diff(metric, -vs['mean'], vs['std'])} "
                                    f"({vs['losses']}/{vs['n']} seeds)")
        elif vs["verdict"] == "ahead":
            groups["ahead"].append(f"{name} ({fmt_diff(metric, vs['mean'], vs['std'])}, {vs['wins']}/{vs['n']} seeds)")
        elif vs["verdict"] == "indistinguishable":
            groups["indistinguishable"].append(f"{name} (lead {fmt_diff(metric, -vs['mean'], vs['std'])} on "
                                               f"{vs['n']} seeds)")
        elif not seed_values(r, metric):
            groups["untested"].append(f"{name} (diverged on every seed)")
        else:
            groups["untested"].append(f"{name} ({vs['n']} seed{'s' if vs['n'] != 1 else ''} in common: "
                                      f"no noise estimate)")
    parts = []
    if groups["behind"]:
        parts.append(f"ahead of {', '.join(groups['behind'])}")
    if groups["indistinguishable"]:
        parts.append(f"indistinguishable from {', '.join(groups['indistinguishable'])}")
    if groups["ahead"]:  # possible only on a subset of seeds (the best's mean counts seeds the other lost)
        parts.append(f"yet behind {', '.join(groups['ahead'])} on the seeds both finished")
    if groups["untested"]:
        parts.append(f"no claim against {', '.join(groups['untested'])}")
    return head + "; " + "; ".join(parts) + "."
