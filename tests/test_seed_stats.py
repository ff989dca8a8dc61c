"""Statistics over seeds (pflcore.seed_stats): what ± is, the pairing with the best method, the
verdict; the multi-seed figure; experiments/tables.py carrying the same figures."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics

import pytest

from pflcore import experiments, result
from pflcore import seed_stats as S
from pflcore.cli import main

from test_cli import TINY

BASE = [0.800, 0.750, 0.850]  # seed-to-seed spread (std 0.05) much larger than the gaps below


def _row(name, values, seeds=(0, 1, 2)):
    mean, std, n = S.summarize(values)
    return {"algorithm": name, "sweep": None, "type": name.lower(), "seeds": len(seeds), "diverged": [],
            "acc": mean, "acc_std": std, "acc_n": n, "per_seed": {"seed": list(seeds), "acc": list(values)}}


def test_a_small_steady_lead_is_named_though_the_stds_overlap():
    a = _row("A", BASE)
    b = _row("B", [v - d for v, d in zip(BASE, (0.010, 0.012, 0.011))])
    assert a["acc"] - b["acc"] < a["acc_std"] / 2  # the ± overlap: unpaired, it would look like a tie
    rows = [b, a]
    S.annotate(rows, "acc")
    assert a["vs_best"]["verdict"] == "best" and b["vs_best"]["verdict"] == "behind"
    assert b["vs_best"]["wins"] == 0 and b["vs_best"]["n"] == 3
    assert b["vs_best"]["mean"] == pytest.approx(-0.011) and b["vs_best"]["std"] == pytest.approx(0.001)
    line = S.verdict(rows, "acc")
    assert re.search(r"A is best \(80\.00%, mean of 3 seeds\); ahead of B by \+1\.10 ± 0\.10 pts \(3/3 seeds\)\.$",
                     line), line
    table = experiments.format_table(rows, ["acc"])
    assert re.search(r"^B .*-1\.10 ± 0\.10 pts vs A, 0/3 wins$", table, re.M), table
    assert "±: sample std (ddof=1)" in table and "n = 3 seeds" in table


def test_no_claim_where_the_difference_is_within_its_noise():
    a = _row("A", BASE)
    c = _row("C", [v + d for v, d in zip(BASE, (0.020, -0.030, 0.005))])  # mean -0.0017, std 0.026
    rows = [a, c]
    S.annotate(rows, "acc")
    assert c["vs_best"]["verdict"] == "indistinguishable" and not c["vs_best"]["beyond_noise"]
    line = S.verdict(rows, "acc")
    assert "indistinguishable from C (lead +0.17 ± 2.57 pts on 3 seeds)" in line and "ahead of" not in line
    # all three seeds agree in sign but t = 4.0 < 4.30 (Student, 2 df): still no claim
    d = _row("D", [v - x for v, x in zip(BASE, (0.01, 0.02, 0.03))])
    S.annotate([a, d], "acc")
    assert d["vs_best"]["wins"] == 0 and d["vs_best"]["t"] == pytest.approx(-2 * 3 ** 0.5)
    assert d["vs_best"]["verdict"] == "indistinguishable"


def test_one_seed_and_diverged_seeds():
    a, b = _row("A", [0.8], seeds=(0,)), _row("B", [0.7], seeds=(0,))
    S.annotate([a, b], "acc")
    assert b["vs_best"]["verdict"] == "untested"
    assert "no claim against B (1 seed in common: no noise estimate)" in S.verdict([a, b], "acc")
    # B diverged on seed 2: left out of its mean and of the pairing
    a, b = _row("A", BASE), _row("B", [BASE[0] - 0.01, BASE[1] - 0.011, None])
    S.annotate([a, b], "acc")
    assert b["acc_n"] == 2 and b["vs_best"]["seeds"] == [0, 1] and b["vs_best"]["verdict"] == "behind"
    # lower is better for errors
    e1, e2 = _row("E1", [0.10, 0.20, 0.30]), _row("E2", [0.11, 0.21, 0.31])
    for r in (e1, e2):
        r["stat_error_local"], r["per_seed"]["stat_error_local"] = r["acc"], r["per_seed"]["acc"]
    assert S.annotate([e2, e1], "stat_error_local") is e1 and e2["vs_best"]["verdict"] == "behind"


def test_critical_values():
    assert S.critical_t(2) == 4.303 and S.critical_t(22) == 2.086 and S.critical_t(1000) == 1.96


def _plotted(monkeypatch):
    """The figures plot_results saves, captured before saving."""
    figures = []
    real = result.save_figure
    monkeypatch.setattr(result, "save_figure", lambda fig, path: (figures.append(fig), real(fig, path))[1])
    return figures


def test_the_multi_seed_figure_plots_the_mean_of_the_seeds_with_a_band(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    figures = _plotted(monkeypatch)
    assert main(["run", str(cfg), "seeds=[0, 1, 2]", "--out", str(out), "--no-progress"]) == 0
    (fig,) = figures
    assert "mean over 3 seeds per round; band: ± 1 sample std (ddof=1)" in fig._suptitle.get_text()
    for ax in fig.axes:
        key = "personalized_acc" if "personalized" in ax.get_ylabel() else "global_acc"
        bands = ax.collections
        for line, band in zip(ax.get_lines(), bands):
            label = line.get_label()
            hist = [json.loads((out / f"{label}_seed{s}.json").read_text())["history"] for s in range(3)]
            per_seed = [[r[key] for r in h] for h in hist]
            want = [statistics.fmean(v) for v in zip(*per_seed)]
            std = [statistics.stdev(v) for v in zip(*per_seed)]
            assert list(line.get_xdata()) == [r["round"] for r in hist[0]]
            assert list(line.get_ydata()) == pytest.approx(want, abs=1e-12), (label, key)
            ys = band.get_paths()[0].vertices[:, 1]
            assert max(ys) == pytest.approx(max(m + s for m, s in zip(want, std)))
            assert min(ys) == pytest.approx(min(m - s for m, s in zip(want, std)))
        assert len(bands) == len(ax.get_lines()) >= 1  # FedAvg has no personalized_acc
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"][0]["personalized_acc_p10"] == pytest.approx(
        statistics.fmean(summary["rows"][0]["per_seed"]["personalized_acc_p10"]))  # pFedMe
    assert summary["main_metric"] == "acc" and summary["verdict"].startswith("Verdict on acc")
    for row in summary["rows"]:
        assert row["per_seed"]["seed"] == [0, 1, 2] and row["acc_n"] == 3 and row["acc_p10"] is not None
        assert row["global_acc_std"] == pytest.approx(statistics.stdev(row["per_seed"]["global_acc"]))
        assert row["vs_best"]["verdict"] in ("best", "ahead", "behind", "indistinguishable")
    text = capsys.readouterr().out
    assert summary["verdict"] in text and "paired vs best (acc)" in text and "acc_p10" in text
    # one seed: the curve of that seed, no band, no title
    figures.clear()
    assert main(["run", str(cfg), "seeds=[0]", "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    (fig,) = figures
    assert fig._suptitle is None and all(not ax.collections for ax in fig.axes)
    hist = json.loads((tmp_path / "one" / "pFedMe_seed0.json").read_text())["history"]
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "pFedMe")
    assert list(line.get_ydata()) == [r["personalized_acc"] for r in hist]


def test_tables_py_carries_the_same_statistics(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "tables", os.path.join(os.path.dirname(__file__), "..", "experiments", "tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    a = _row("pFedMe", BASE)
    b = _row("Per-FedAvg", [v - d for v, d in zip(BASE, (0.015, 0.0095, 0.0125))])
    for r, p10 in ((a, 0.5), (b, 0.45)):
        r["personalized_acc"], r["personalized_acc_std"], r["acc_p10"] = r["acc"], r["acc_std"], p10
    summary = {"name": "t", "config": {"seeds": [0, 1, 2], "rounds": 1, "data": {}}, "rows": [a, b],
               "statistics": {"std": S.STD}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert tables.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "(sample std, ddof=1;" in text and "Accuracy (%) p10 clients" in text
    assert "| Per-FedAvg | 78.77 ± 4.86 | 45.00 | -1.23 ± 0.28 pts vs pFedMe, 0/3 wins |" in text
    assert "pFedMe is best (80.00%, mean of 3 seeds); ahead of Per-FedAvg by +1.23 ± 0.28 pts (3/3 seeds)." in text
    # an older summary (no per-seed values): its std was the population one, and nothing is paired
    for r in (a, b):
        del r["per_seed"]
    del summary["statistics"]
    path.write_text(json.dumps(summary))
    assert tables.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "population std, ddof=0" in text and "paired" not in text and "Verdict" not in text
