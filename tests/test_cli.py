"""`pflcore run`: experiments from TOML, overrides, outputs, errors."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

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


def test_algo_filter(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--algo", "fedavg", "--out", str(out), "--no-progress", "seeds=[0]"]) == 0
    assert [r["algorithm"] for r in json.loads((out / "summary.json").read_text())["rows"]] == ["FedAvg"]


def _error(capsys, argv, code=2):
    """Runs the CLI, expects exit status ``code`` and one line on stderr; returns that line."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pflcore: error: "), err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("args, expected", [
    (["--algo", "Ditto"], r"--algo: unknown \['Ditto'\]; this experiment has \['pFedMe', 'FedAvg'\]"),
    (["--algo", "FedAv"], r"--algo: unknown \['FedAv'\] \(did you mean 'FedAvg'\?\)"),
    (["algorithms.FedAvg.type=fedsgd"], r"algorithms\.FedAvg\.type: unknown algorithm \(type = 'fedsgd'\)"),
    (["algorithms.FedAvg.lr=-1"], r"algorithms\.FedAvg: FedAvg: lr must be > 0, got -1"),
    (["roundz=5"], r"unknown key 'roundz' \(did you mean 'rounds'\?\) \(in the override 'roundz=5'\)"),
    (["algorithms.FedAvg.lrr=0.1"], r"unknown key 'algorithms\.FedAvg\.lrr' \(did you mean 'algorithms\.FedAvg\.lr'"),
    (["algorithms.FedAvgg.lr=0.1"], r"unknown algorithm 'FedAvgg' in algorithms\.FedAvgg \(did you mean 'FedAvg'\?\)"),
    (["data.num_clientz=3"], r"unknown key 'data\.num_clientz' \(did you mean 'data\.num_clients'\?\)"),
    (["datta.num_clients=3"], r"unknown key 'datta' \(did you mean 'data'\?\)"),
    (["seeds=7"], r"seeds: expected a non-empty array of integers >= 0 .*got 7 \(an integer\)"),
    (["rounds=ten"], r"rounds: expected an integer in \[0, 2147483647\], got 'ten' \(a string\)"),
    (["rounds.x=1"], r"rounds\.x: 'rounds' is an integer \(3\), not a table"),
    (["data.num_clients=x"], r"data\.num_clients: expected an integer in \[-2147483647, 2147483647\], got 'x' \(a string\)"),
    (["algorithms.pFedMe.lam=[1]"], r"algorithms\.pFedMe\.lam: expected a number, got \[1\] \(an array\)"),
    (["model.family=mpl"], r"model\.family: unknown model family 'mpl' \(did you mean 'mlp'\?\)"),
    (["metrics=[\"acc\", \"globl_acc\"]"], r"metrics: unknown metric 'globl_acc' \(did you mean 'global_acc'\?\)"),
    (["clients_per_round=100"], r"clients_per_round: expected an integer in \[1, m = 6\]"),
    (["data.generator=synthetc"], r"data\.generator: unknown generator 'synthetc' \(did you mean 'synthetic'\?\)"),
    (["data.alpha=-1"], r"data: alpha: expected a number >= 0"),
    (["--bogus"], r"unrecognized arguments: --bogus \(see 'pflcore run --help'\)"),
    (["rounds"], r"unrecognized arguments: rounds"),
])
def test_configuration_errors_are_one_line_and_exit_2(tmp_path, capsys, args, expected):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    line = _error(capsys, ["run", str(cfg), "--out", str(tmp_path / "o"), "--no-progress", *args])
    assert re.search(expected, line), line


def test_file_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = \n[data\n")
    assert re.search(r"bad\.toml: not valid TOML: .*line 1", _error(capsys, ["run", str(bad)]))
    assert "experiment file 'missing.toml' not found" in _error(capsys, ["run", "missing.toml"])
    assert "is a folder" in _error(capsys, ["run", str(tmp_path)])
    assert "invalid choice: 'bogus'" in _error(capsys, ["bogus"])
    # the default experiment (no file): an unknown --algo is caught before anything runs
    assert "--algo: unknown ['nope']" in _error(capsys, ["run", "--algo", "nope"])


LS = """
name = "ls"
rounds = 30
eval_every = 5
seeds = [0, 1]
metrics = ["stat_error_local", "stat_error_global"]
[data]
generator = "least_squares"
num_clients = 4
samples_per_client = 30
dim = 6
[model]
family = "least_squares"
[algorithms.FedAvg]
type = "fedavg"
lr = 50.0
[algorithms.LocalTrain]
type = "localtrain"
lr = 0.05
"""


def test_a_diverging_algorithm_is_recorded_and_the_others_still_run(tmp_path, capsys):
    cfg = tmp_path / "ls.toml"
    cfg.write_text(LS)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    fedavg, local = summary["rows"]
    assert [d["seed"] for d in fedavg["diverged"]] == [0, 1] and fedavg["diverged"][0]["round"] > 1
    assert "NaN/inf" in fedavg["diverged"][0]["reason"] and fedavg["stat_error_local"] is None
    assert local["diverged"] == [] and local["stat_error_local"] > 0
    run0 = json.loads((out / "FedAvg_seed0.json").read_text())
    assert run0["diverged"]["round"] == fedavg["diverged"][0]["round"] and run0["history"][0]["round"] == 0
    assert (out / "LocalTrain_seed1.json").exists() and (out / "curves.png").stat().st_size > 1000
    text = capsys.readouterr().out
    table = text[text.index("algorithm "):]
    assert re.search(r"FedAvg +- +- +diverged in round \d+ \(2 of 2 seeds; first: seed 0\)", table), table
    # every run diverged: exit 1, one line
    assert main(["run", str(cfg), "--algo", "FedAvg", "--out", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == "pflcore: error: every run diverged (see the table)"


CLI = [sys.executable, "-m", "pflcore"]


def test_the_command_prints_one_line_and_debug_shows_the_traceback(tmp_path):
    """The issue's four commands, as a user types them."""
    cfg = tmp_path / "exp.toml"
    cfg.write_text(TINY)
    (tmp_path / "bad.toml").write_text("rounds = = 3")
    cases = (["run", "bad.toml"], ["run", "exp.toml", "roundz=5"], ["run", "missing.toml"], ["run", "--algo", "nope"])
    # the 8 commands start at once (each is mostly the interpreter's and torch's start-up: ~3.5 s)
    procs = [[subprocess.Popen(CLI + argv + extra, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for extra in ([], ["--debug"])] for argv in cases]
    try:
        for argv, pair in zip(cases, procs):
            (_, err), (_, err_debug) = (p.communicate(timeout=120) for p in pair)
            plain, debug = pair
            assert plain.returncode == 2 and err.count("\n") == 1, (argv, err)
            assert err.startswith("pflcore: error: ") and "Traceback" not in err
            assert debug.returncode == 2 and "Traceback (most recent call last)" in err_debug
            assert err_debug.rstrip().splitlines()[-1] == err.strip()
    finally:  # none left running if one failed or hung
        for p in (p for pair in procs for p in pair):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_overrides_parse_values():
    cfg = experiments.apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=[1, 2]", "name=word", "flag=true"])
    assert cfg == {"a": {"b": 2.5, "c": [1, 2]}, "name": "word", "flag": True}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[os.path.basename(p) for p in EXPERIMENTS])
def test_shipped_experiments_build(path):
    """Every experiment file names real generators, models and algorithms with valid values."""
    cfg = experiments.load(path)
    experiments.check(cfg)
    points = [None] if "sweep" not in cfg else cfg["sweep"]["values"]
    built = {}  # a sweep that leaves [data] alone builds its federation once
    for value in points:
        c = cfg if value is None else experiments.apply_overrides(dict(cfg), [f"{cfg['sweep']['key']}={value}"])
        if "privacy" in c:
            experiments.C.privacy_settings(c["privacy"])
        key = repr(sorted(c["data"].items()))
        fed = built[key] if key in built else built.setdefault(key, experiments.build_federation(c["data"], 0))
        model = experiments.build_model(c.get("model"), fed)
        for label, spec in c["algorithms"].items():
            experiments.build_algorithm(label, spec, fed, model)


def test_default_experiment_builds():
    cfg = experiments.load(None)
    fed = experiments.build_federation(dict(cfg["data"], num_clients=5), 0)
    model = experiments.build_model(cfg["model"], fed)
    assert {type(experiments.build_algorithm(k, v, fed, model)).__name__ for k, v in cfg["algorithms"].items()} == {
        "PFedMe", "FedProx", "PerFedAvg", "FedAvg", "LocalTrain"}


def test_one_seed_figures_have_no_spread_and_several_seeds_do():
    rows = [{"algorithm": "A", "sweep": None, "acc": 0.8, "acc_std": None},
            {"algorithm": "B", "sweep": None, "acc": None, "acc_std": None}]
    table = experiments.format_table(rows, ["acc"])
    assert "±" not in table and re.search(r"^A +0\.8$", table, re.M) and re.search(r"^B +-$", table, re.M)
    assert "acc: test accuracy of the model each client uses" in table
    rows[0]["acc_std"] = 0.01
    assert "0.8 ± 0.01" in experiments.format_table(rows, ["acc"])
    assert experiments._summary([0.5]) == (0.5, None)
    assert experiments._summary([0.5, 0.7])[1] == pytest.approx(0.02 ** 0.5)  # sample std (ddof=1), not 0.1


def _summary_of(local, glob_, pers):
    rows = [{"algorithm": "LocalTrain", "type": "localtrain", "sweep": None, "acc": local},
            {"algorithm": "FedAvg", "type": "fedavg", "sweep": None, "acc": glob_},
            {"algorithm": "pFedMe", "type": "pfedme", "sweep": None, "acc": pers},
            {"algorithm": "Per-FedAvg", "type": "perfedavg", "sweep": None, "acc": pers - 0.01}]
    facts = {"median_train_samples": 30.0, "parameters": 610}
    return {"config": {}, "rows": rows, "facts": facts}


def test_the_takeaway_sentence_says_what_the_table_shows():
    ahead = experiments.takeaway(_summary_of(0.80, 0.74, 0.85))
    assert ahead.startswith("pFedMe is ahead (85.0%) of both LocalTrain (80.0%) and FedAvg (74.0%): each client "
                            "has a median of 30 training samples for a model of 610 parameters")
    assert experiments.takeaway(_summary_of(0.90, 0.74, 0.85)).startswith("Here LocalTrain (90.0%) is ahead")
    assert experiments.takeaway(_summary_of(0.70, 0.90, 0.85)).startswith("Here FedAvg's one global model (90.0%)")
    no_local = _summary_of(0.8, 0.7, 0.9)
    no_local["rows"] = no_local["rows"][1:]
    assert experiments.takeaway(no_local) is None


def test_the_default_comparison_is_a_valid_experiment():
    cfg = experiments.load(None)
    experiments.check(cfg)
    assert set(cfg["metrics"]) >= {"acc"} and cfg["seeds"] == [0]


def test_the_default_hyperparameters_are_the_ones_validation_chose():
    """experiments/default_tuning.py picked them on a validation split of the training rows; the
    default must be what it wrote (rerun it after changing the default's data or rounds)."""
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "default_tuning.json")
    with open(path) as fh:
        tuning = json.load(fh)
    cfg = experiments.load(None)
    assert tuning["data"] == cfg["data"] and tuning["rounds"] == cfg["rounds"]
    assert tuning["clients_per_round"] == cfg["clients_per_round"]
    for label, spec in cfg["algorithms"].items():
        assert tuning["chosen"][label] == spec, label


def test_extras_lists_the_packages_of_an_extra_for_pip(capsys):
    """`pip install $(pflcore extras bench)` adds an extra without rebuilding the core (issue 29)."""
    assert main(["extras", "bench", "plot"]) == 0
    lines = capsys.readouterr().out.split()
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        declared = tomllib.load(fh)["project"]["optional-dependencies"]
    assert lines == [r.replace(" ", "") for r in declared["bench"] + declared["plot"]]  # (no markers in these)
    assert main(["extras"]) == 0
    table = capsys.readouterr().out
    assert "bench" in table and "dev" in table
    assert main(["extras", "benhc"]) == 2
    assert "unknown extra 'benhc'; pflcore has" in capsys.readouterr().err
