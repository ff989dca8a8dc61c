"""Markdown tables of experiment results, shaped like Table 1 of the CGPFL and pFedMe papers.

Reads the ``summary.json`` that ``pflcore run`` writes (one or several) and prints a Markdown
table: one row per method, each cell the mean ± sample std (ddof=1) over seeds of the final
accuracy, in percent (summaries written before pflcore kept per-seed values hold a population
std, ddof=0: the note under the table says which). Beside each accuracy column, where the
summaries carry per-seed values: the 10th percentile over clients (mean over seeds), and each
method paired seed by seed with the best of the column (mean difference ± its sample std, wins
out of n); under the table, one verdict line per column (``pflcore.seed_stats``: a paired
t-test at 5%, no claim within the noise).

    python experiments/tables.py experiments/results/cgpfl_synthetic_summary.json
    python experiments/tables.py A_summary.json B_summary.json --out table.md
    python experiments/tables.py lr0005.json=lr=0.005 lr01.json=lr=0.1    # one column group per file

Layouts:

* Plain (default when the method labels carry no model): columns "Accuracy" and "Global model".
  "Accuracy" is the final personalized test accuracy, or, for a method with no personalized
  model (FedAvg), its global model's, marked with †, as the papers do. "Global model" is the
  global model's accuracy where the method has one (not CGPFL: its context models are not
  averaged into one; IFCA's is the cluster-weighted mixture of its cluster models).
* Method × model (automatic when every label ends in a model tag, "pFedMe (MLR)", "pFedMe (DNN)"):
  rows are the methods, columns the models, as in the papers' "MNIST MLR | DNN" columns; the
  global accuracies follow in a second block of columns ("GM").

Several summaries given without a column name are concatenated (an experiment run in parts with
``--algo``); with ``FILE=NAME`` each file becomes its own group of columns headed NAME.
Rows follow the order of the papers' tables where the method is one of theirs, then the order of
the files. The best accuracy of each column is in bold.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from pflcore import seed_stats as S

# Row order of the CGPFL paper's Table 1 (then pFedMe's extra rows); labels are matched on
# their method name, before any " (...)" tag.
PAPER_ORDER = ["FedAvg", "IFCA", "L2SGD", "APFL", "pFedMe", "Per-FedAvg", "Ditto", "CGPFL", "CGPFL-Heur",
               "FedProx", "LocalTrain"]
MODEL_TAGS = ("MLR", "DNN", "CNN", "MLP")
TAG = re.compile(r"^(?P<method>.*?)\s*\((?P<tag>[^()]*)\)\s*$")


def split_label(label: str) -> Tuple[str, Optional[str]]:
    """("Per-FedAvg HF", "DNN") for "Per-FedAvg HF (DNN)"; (label, None) without a model tag."""
    m = TAG.match(label)
    if m and m.group("tag").strip().upper() in MODEL_TAGS:
        return m.group("method").strip(), m.group("tag").strip().upper()
    return label, None


def order_key(method: str, first_seen: int) -> Tuple[int, int]:
    base = method.split(" (")[0].split(" ")[0]
    for i, name in enumerate(PAPER_ORDER):
        if base.lower() == name.lower():
            return (i, first_seen)
    return (len(PAPER_ORDER), first_seen)


def cell(mean: Optional[float], std: Optional[float], bold: bool = False, mark: str = "") -> str:
    """"mean ± std" in percent; the mean alone when std is None (one seed)."""
    if mean is None:
        return "–"
    spread = "" if std is None else f" ± {100 * std:.2f}"
    text = f"{100 * mean:.2f}{spread}{mark}"
    return f"**{text}**" if bold else text


def load(path: str) -> Dict:
    with open(path) as fh:
        summary = json.load(fh)
    if "rows" not in summary:
        raise SystemExit(f"{path}: not a pflcore summary (no 'rows'); expected the summary.json of `pflcore run`")
    return summary


def describe(summaries: List[Dict]) -> List[str]:
    """Lines on what was run: name, rounds, seeds, clients per round, data, run time."""
    lines = []
    for s in summaries:
        cfg = s.get("config", {})
        data = cfg.get("data", {})
        seeds = cfg.get("seeds", [0])
        per_round = cfg.get("clients_per_round") or "all"
        data_txt = ", ".join(f"{k} = {v}" for k, v in data.items())
        algos = ", ".join(r["algorithm"] for r in s["rows"])
        lines.append(f"- `{s.get('name')}`: {cfg.get('rounds')} rounds, clients per round: {per_round}, "
                     f"{len(seeds)} seed(s) {seeds}, data: {data_txt}; methods: {algos} "
                     f"({s.get('seconds', float('nan')):.0f} s of runs)")
    return lines


def table(groups: List[Tuple[Optional[str], List[Dict]]], verdicts: Optional[List[str]] = None) -> str:
    """Markdown for column groups [(name or None, [summary, ...])]; the verdict of each accuracy
    column with per-seed values is appended to ``verdicts``."""
    # entries[(method, model)][group] = row
    entries: Dict[Tuple[str, Optional[str]], Dict[int, Dict]] = {}
    first: Dict[str, int] = {}
    models: List[Optional[str]] = []
    single: Dict[int, bool] = {}  # group -> every summary of it has one seed (no std shown)
    for g, (_, summaries) in enumerate(groups):
        single[g] = all(len(s.get("config", {}).get("seeds", [0])) == 1 for s in summaries)
        for s in summaries:
            for row in s["rows"]:
                method, model = split_label(row["algorithm"])
                first.setdefault(method, len(first))
                if model not in models:
                    models.append(model)
                entries.setdefault((method, model), {})[g] = row
    if None in models and len(models) > 1:  # a mixture: keep full labels, one "model" column
        entries2: Dict[Tuple[str, Optional[str]], Dict[int, Dict]] = {}
        for (method, model), v in entries.items():
            label = method if model is None else f"{method} ({model})"
            first.setdefault(label, len(first))
            entries2[(label, None)] = v
        entries, models = entries2, [None]
    methods = sorted({m for m, _ in entries}, key=lambda m: order_key(m, first[m]))

    def pers(row):  # (mean, std, mark): personalized accuracy, else the global model's (†)
        if row.get("personalized_acc") is not None:
            return row["personalized_acc"], row.get("personalized_acc_std"), ""
        if row.get("global_acc") is not None:
            return row["global_acc"], row.get("global_acc_std"), " †"
        return None, None, ""

    def glob(row):
        return row.get("global_acc"), row.get("global_acc_std"), ""

    # Columns: (header, group index, model, getter)
    cols = []
    multi = len(groups) > 1
    for g, (name, _) in enumerate(groups):
        prefix = f"{name}: " if multi and name else ""
        for model in models:
            head = "Accuracy (%)" if model is None else model
            cols.append((prefix + head, g, model, pers))
        has_global = any(entries.get((m, model), {}).get(g, {}).get("global_acc") is not None
                         for m in methods for model in models)
        if has_global:
            for model in models:
                head = "Global model (%)" if model is None else f"{model} GM"
                cols.append((prefix + head, g, model, glob))
    cols = _with_paired_columns(cols, entries, methods, pers, verdicts, multi or len(models) > 1)
    values = [[getter(entries[(m, model)][g]) if g in entries.get((m, model), {}) else (None, None, "")
               for (_, g, model, getter) in cols] for m in methods]
    best = []
    for j in range(len(cols)):
        col = [v[j][0] for v in values if v[j][0] is not None and not isinstance(v[j][0], str)]
        best.append(max(col) if col else None)
    out = ["| Method | " + " | ".join(c[0] for c in cols) + " |",
           "|---|" + "|".join("---:" for _ in cols) + "|"]
    for m, vals in zip(methods, values):
        cells = [mean if isinstance(mean, str) else  # a paired-difference text
                 cell(mean, None if single[cols[j][1]] else std, bold=(mean is not None and mean == best[j]),
                      mark=mark) for j, (mean, std, mark) in enumerate(vals)]
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _with_paired_columns(cols, entries, methods, pers, verdicts, named):
    """``cols`` with, after each accuracy column whose rows carry per-seed values, a "p10" column
    and a "paired vs best" column (``seed_stats.annotate`` on copies of the rows: a row is
    paired with the best of its own column)."""
    out = []
    for head, g, model, getter in cols:
        out.append((head, g, model, getter))
        if getter is not pers:
            continue
        originals = [entries[(m, model)][g] for m in methods if g in entries.get((m, model), {})]
        if not any(r.get("per_seed") for r in originals):
            continue  # an older summary: no per-seed values to pair
        annotated = {id(r): dict(r) for r in originals}  # keyed by the row the getters receive
        S.annotate(list(annotated.values()), "acc")
        line = S.verdict(list(annotated.values()), "acc")
        if line and verdicts is not None:
            verdicts.append(f"{head}: {line}" if named else line)
        out.append((f"{head} p10 clients", g, model,
                    lambda row, a=annotated: (a[id(row)].get("acc_p10"), None, "")))
        out.append((f"{head} paired vs best", g, model,
                    lambda row, a=annotated: (S.vs_best_text(a[id(row)]), None, "")))
    return out


def _spread_note(summaries: List[Dict]) -> str:
    """What ± is: sample std for summaries with per-seed statistics, population std before."""
    new = [bool(s.get("statistics")) for s in summaries]
    if all(new):
        return "sample std, ddof=1"
    if not any(new):
        return "population std, ddof=0: summaries written before per-seed statistics"
    return "sample std (ddof=1) where the summary has per-seed values, population std (ddof=0) for older ones"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summaries", nargs="+", help="summary JSON files; FILE=NAME makes NAME a column group")
    ap.add_argument("--out", help="also write the Markdown here")
    ap.add_argument("--title", help="a heading above the table")
    ap.add_argument("--note", action="append", default=[], help="a line of text under the table (repeatable)")
    args = ap.parse_args(argv)

    groups: List[Tuple[Optional[str], List[Dict]]] = []
    all_summaries = []
    for item in args.summaries:
        path, _, name = item.partition("=") if not os.path.exists(item) else (item, "", "")
        s = load(path)
        all_summaries.append(s)
        if name:
            groups.append((name, [s]))
        elif groups and groups[-1][0] is None:
            groups[-1][1].append(s)
        else:
            groups.append((None, [s]))
    seeds = sorted({len(s.get("config", {}).get("seeds", [0])) for s in all_summaries})
    lines = []
    if args.title:
        lines += [f"## {args.title}", ""]
    verdicts: List[str] = []
    lines += [table(groups, verdicts), ""]
    what = ("one seed" if seeds == [1] else
            f"mean ± std over {'/'.join(map(str, seeds))} seeds ({_spread_note(all_summaries)}; one seed: the "
            f"value alone)")
    lines.append(f"Final test accuracy (%), {what}; personalized models, or † the global model for a method "
                 "without personalized ones. Bold: best of the column.")
    if verdicts:
        lines.append("p10 clients: the 10th percentile over clients of that accuracy (%), mean over seeds. Paired vs "
                     "best: the method's accuracy minus the column's best, seed by seed (seeds where both "
                     "finished): mean ± sample std of the differences in points, and the seeds it won.")
        lines += [""] + verdicts
    for note in args.note:  # separate paragraphs
        lines += ["", note]
    lines += ["", "Runs:"] + describe(all_summaries)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
