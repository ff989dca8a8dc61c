"""`pflcore run`: experiments from TOML, overrides, outputs, errors."""
from __future__ import annotations

import glob
import json
import os

import pytest

from pflcore import experiments
from pflcore.cli import main

EXPERIMENTS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "experiments", "*.toml")))

TINY = """
name = "tiny"
rounds = 3
eval_every = 1
seeds = [0, 1]
metrics = ["personalized_acc", "global_acc"]
[data]
generator = "synthetic"
alpha = 0.5
beta = 0.5
num_clients = 6
dim = 5
num_classes = 3
size_scale = 1
max_size = 80
[model]
family = "softmax"
[algorithms.pFedMe]
type = "pfedme"
lam = 15.0
lr = 0.01
personal_lr = 0.05
local_rounds = 2
inner_steps = 2
batch_size = 5
[algorithms.FedAvg]
type = "fedavg"
lr = 0.05
"""


def test_run_writes_summary_runs_and_plot(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    assert main(["run", str(cfg), "rounds=2", "algorithms.FedAvg.lr=0.1", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rounds"] == 2 and summary["config"]["algorithms"]["FedAvg"]["lr"] == 0.1
    assert [r["algorithm"] for r in summary["rows"]] == ["pFedMe", "FedAvg"]
    assert 0 <= summary["rows"][0]["personalized_acc"] <= 1
    assert len(list(out.glob("*_seed*.json"))) == 4 and (out / "curves.png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "personalized_acc" in text and "pFedMe" in text


def test_algo_filter_and_errors(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--algo", "fedavg", "--out", str(out), "--no-progress", "seeds=[0]"]) == 0
    assert [r["algorithm"] for r in json.loads((out / "summary.json").read_text())["rows"]] == ["FedAvg"]
    with pytest.raises(ValueError, match=r"--algo: unknown \['Ditto'\]"):
        main(["run", str(cfg), "--algo", "Ditto", "--out", str(out), "--no-progress"])
    with pytest.raises(ValueError, match=r"algorithms.FedAvg.type: unknown algorithm 'fedsgd'"):
        main(["run", str(cfg), "algorithms.FedAvg.type=fedsgd", "--out", str(out), "--no-progress"])
    with pytest.raises(ValueError, match=r"FedAvg: lr must be > 0, got -1"):
        main(["run", str(cfg), "algorithms.FedAvg.lr=-1", "--out", str(out), "--no-progress"])


def test_overrides_parse_values():
    cfg = experiments.apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=[1, 2]", "name=word", "flag=true"])
    assert cfg == {"a": {"b": 2.5, "c": [1, 2]}, "name": "word", "flag": True}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[os.path.basename(p) for p in EXPERIMENTS])
def test_shipped_experiments_build(path):
    """Every experiment file names real generators, models and algorithms with valid values."""
    cfg = experiments.load(path)
    points = [None] if "sweep" not in cfg else cfg["sweep"]["values"]
    for value in points:
        c = cfg if value is None else experiments.apply_overrides(dict(cfg), [f"{cfg['sweep']['key']}={value}"])
        fed = experiments.build_federation(c["data"], 0)
        model = experiments.build_model(c.get("model"), fed)
        for label, spec in c["algorithms"].items():
            experiments.build_algorithm(label, spec, fed, model)


def test_default_experiment_builds():
    cfg = experiments.load(None)
    fed = experiments.build_federation(dict(cfg["data"], num_clients=5), 0)
    model = experiments.build_model(cfg["model"], fed)
    assert {type(experiments.build_algorithm(k, v, fed, model)).__name__ for k, v in cfg["algorithms"].items()} == {
        "PFedMe", "FedProx", "PerFedAvg", "FedAvg", "LocalTrain"}
