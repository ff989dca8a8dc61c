"""Custom algorithms: `type = "package.module:Class"` in an experiment, and the entry point group
`pflcore.algorithms` of installed packages (both checked like the built-in algorithms)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from pflcore import experiments
from pflcore.cli import main
from pflcore.experiment_config import ConfigError

MODULE = "pflcore_test_custom_alg"

# FedAvg written as a user would (pflcore.run's Algorithm protocol): it must reproduce the
# built-in FedAvg exactly, which shows that the class itself was run.
SOURCE = textwrap.dedent('''
    from dataclasses import dataclass

    import torch

    from pflcore.algorithms.base import Algorithm, replicate


    @dataclass
    class MyState:
        w: torch.Tensor


    class MyAvg(Algorithm):
        name = "MyAvg"

        def __init__(self, lr: float, local_steps: int = 1):
            self.lr, self.local_steps = lr, local_steps

        def init(self, ctx):
            return MyState(ctx.initial_global())

        def round(self, state, ctx, t):
            S = ctx.sample_clients(t)
            theta = replicate(state.w, S.numel())
            ctx.local_steps(theta, steps=self.local_steps, lr=self.lr, rows=S)
            state.w = ctx.average(theta, ctx.weights[S])
            return state

        def global_model(self, state):
            return state.w
''')

EXPERIMENT = """
name = "custom"
rounds = 3
eval_every = 1
clients_per_round = 4
seeds = [0, 1]
metrics = ["global_acc"]
[data]
generator = "synthetic"
alpha = 0.5
beta = 0.5
num_clients = 6
dim = 5
num_classes = 3
size_scale = 1
max_size = 80
[algorithms.Mine]
type = "{type}"
lr = 0.05
local_steps = 2
[algorithms.FedAvg]
type = "fedavg"
lr = 0.05
local_steps = 2
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """A module defining MyAvg, importable for the test (its folder on sys.path), forgotten after."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop(MODULE, None)


def _experiment(tmp_path, type_):
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT.format(type=type_))
    return str(path)


def test_an_import_path_runs_through_the_cli_with_seeds_table_and_summary(tmp_path, capsys, custom_module):
    out = tmp_path / "out"
    assert main(["run", _experiment(tmp_path, f"{MODULE}:MyAvg"), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    mine, fedavg = summary["rows"]
    assert mine["algorithm"] == "Mine" and mine["type"] == f"{MODULE}:MyAvg" and mine["seeds"] == 2
    assert mine["global_acc"] is not None and mine["global_acc_std"] is not None  # two seeds: a spread
    # the same computation as the built-in FedAvg, seed for seed
    assert (mine["global_acc"], mine["global_acc_std"]) == (fedavg["global_acc"], fedavg["global_acc_std"])
    for seed in (0, 1):
        a = json.loads((out / f"Mine_seed{seed}.json").read_text())
        b = json.loads((out / f"FedAvg_seed{seed}.json").read_text())
        assert [r["global_acc"] for r in a["history"]] == [r["global_acc"] for r in b["history"]]
    table = capsys.readouterr().out
    assert re.search(r"^Mine\s+\d", table, re.M), table  # a table row with its number


@pytest.mark.parametrize("type_, expected", [
    ("pflcore_no_such_module_x:MyAvg", r"algorithms\.Mine\.type: cannot import the module "
                                       r"'pflcore_no_such_module_x' of 'pflcore_no_such_module_x:MyAvg' "
                                       r"\(ModuleNotFoundError"),
    (f"{MODULE}:Nope", rf"algorithms\.Mine\.type: the module '{MODULE}' has no 'Nope'"),
    (f"{MODULE}:MyState", r"algorithms\.Mine\.type: .*MyState.* expected a subclass of "
                          r"pflcore\.algorithms\.base\.Algorithm"),
    (f"{MODULE}:", r"algorithms\.Mine\.type: expected an algorithm name or an import path"),
])
def test_a_bad_import_path_is_a_config_error_naming_the_key(tmp_path, capsys, custom_module, type_, expected):
    assert main(["run", _experiment(tmp_path, type_), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(expected, err), err
    assert not (tmp_path / "o").exists(), "nothing ran"


@pytest.mark.parametrize("override, expected", [
    ("algorithms.Mine.lrr=0.1", r"unknown key 'algorithms\.Mine\.lrr' \(did you mean 'algorithms\.Mine\.lr'\?\)"),
    ("algorithms.Mine.local_steps=1.5", r"algorithms\.Mine\.local_steps: expected an integer .*got 1\.5"),
    ("algorithms.Mine.lr=\"fast\"", r"algorithms\.Mine\.lr: expected a number, got 'fast'"),
])
def test_a_custom_class_parameters_are_checked_like_the_builtins(tmp_path, capsys, custom_module, override,
                                                                  expected):
    argv = ["run", _experiment(tmp_path, f"{MODULE}:MyAvg"), override, "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err


def test_a_failing_module_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "pflcore_test_broken_alg.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = experiments.load(_experiment(tmp_path, "pflcore_test_broken_alg:X"))
    with pytest.raises(ConfigError, match=r"algorithms\.Mine\.type: cannot import .*RuntimeError: boom at import"):
        experiments.check(cfg)


def _dist(site, name, entry_points):
    """An installed distribution as importlib.metadata finds it: NAME-0.1.dist-info with its
    METADATA and entry_points.txt, in the folder ``site`` (a sys.path entry)."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pflcore.algorithms]\n" + "".join(f"{k} = {v}\n"
                                                                               for k, v in entry_points.items()))


def test_an_entry_point_of_an_installed_package_is_a_type_name(tmp_path, capsys, custom_module):
    _dist(custom_module, "pflcore_test_plugin", {"My-Avg": f"{MODULE}:MyAvg", "broken": f"{MODULE}:Missing",
                                                  "notalg": f"{MODULE}:MyState"})
    out = tmp_path / "out"
    # the name is compared as the built-in names are: case, '-' and '_' do not matter
    assert main(["run", _experiment(tmp_path, "my_avg"), "seeds=[0]", "--out", str(out), "--no-progress"]) == 0
    mine, fedavg = json.loads((out / "summary.json").read_text())["rows"]
    assert mine["type"] == "myavg" and mine["global_acc"] == fedavg["global_acc"]
    capsys.readouterr()
    # an unknown name lists the registered ones with the built-ins
    assert main(["run", _experiment(tmp_path, "myavgg"), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm (type = 'myavgg') (did you mean 'myavg'?)" in err and "myavg" in err.split("known:")[1]
    assert "fedavg" in err.split("known:")[1]
    cfg = experiments.load(_experiment(tmp_path, "broken"))
    with pytest.raises(ConfigError, match=rf"algorithms\.Mine\.type: cannot load the entry point broken = "
                                          rf"'{MODULE}:Missing' of group 'pflcore\.algorithms' \(AttributeError"):
        experiments.check(cfg)
    cfg = experiments.load(_experiment(tmp_path, "notalg"))
    with pytest.raises(ConfigError, match=r"the entry point notalg = .* expected a subclass of "
                                          r"pflcore\.algorithms\.base\.Algorithm"):
        experiments.check(cfg)


def test_a_builtin_name_wins_over_an_entry_point_with_a_warning(tmp_path, custom_module):
    _dist(custom_module, "pflcore_test_shadow", {"fedavg": f"{MODULE}:MyAvg"})
    cfg = experiments.load(_experiment(tmp_path, "FedAvg"))
    with pytest.warns(RuntimeWarning, match=r"'fedavg' is a built-in algorithm and also the entry point "
                                            rf"'{MODULE}:MyAvg'"):
        experiments.check(cfg)
    from pflcore import algorithms as A
    from pflcore.experiment_config import algorithm_class
    with pytest.warns(RuntimeWarning):
        assert algorithm_class("Mine", {"type": "fedavg"}) is A.FedAvg


def test_an_import_path_keeps_its_case(custom_module):
    from pflcore.experiment_config import algorithm_class, algorithm_kind
    assert algorithm_kind("X", {"type": f" {MODULE}:MyAvg "}) == f"{MODULE}:MyAvg"
    assert algorithm_kind("X", {"type": "Per-Fed_Avg"}) == "perfedavg"
    cls = algorithm_class("X", {"type": f"{MODULE}:MyAvg"})
    assert cls.__name__ == "MyAvg" and cls.__module__ == MODULE
    fed = experiments.build_federation({"generator": "synthetic", "alpha": 0.5, "beta": 0.5, "num_clients": 4,
                                        "dim": 5, "num_classes": 3, "size_scale": 1, "max_size": 40}, 0)
    model = experiments.build_model({}, fed)
    alg = experiments.build_algorithm("X", {"type": f"{MODULE}:MyAvg", "lr": 0.1}, fed, model)
    assert type(alg) is cls and alg.lr == 0.1
    with pytest.raises(ConfigError, match=r"algorithms\.X: .*unexpected keyword argument 'nope'"):
        experiments.build_algorithm("X", {"type": f"{MODULE}:MyAvg", "lr": 0.1, "nope": 1}, fed, model)


# ---- resuming a run of a custom algorithm in a new process ---------------------------------------

FEDREP = SOURCE.replace("MyState", "FedRepState").replace("MyAvg", "FedRep")

RUN = """
import sys

import torch

import pflcore
from pflcore import data, models

if sys.argv[4] == "module":
    from pflcore_test_fedrep import FedRep  # noqa: F811 (checkpoints then name that module)

fed = data.synthetic(0.5, 0.5, num_clients=6, dim=5, num_classes=3, seed=0, size_scale=1, max_size=50)
res = pflcore.run(FedRep(lr=0.05, local_steps=2), fed, models.Softmax(5, 3), rounds=int(sys.argv[2]),
                  checkpoint=sys.argv[1], checkpoint_every=2, progress=False)
torch.save(res.global_model, sys.argv[3])
"""

RESUME = """
import sys
import warnings

import torch

import pflcore
from pflcore.checkpoint import MissingClassError

warnings.simplefilter("error")  # a round skipped with a warning would fail here
if sys.argv[4] == "import":
    from pflcore_test_fedrep import FedRep, FedRepState  # noqa: F401 (what the message asks for)
try:
    res = pflcore.resume(sys.argv[1], rounds=int(sys.argv[2]), progress=False)
except MissingClassError as exc:
    print("MISSING", exc.classes)
    print(exc)
    sys.exit(3)
torch.save(res.global_model, sys.argv[3])
"""


def _scripts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "pflcore_test_fedrep.py").write_text(FEDREP)
    # run.py defines FedRep in its __main__ (as the researcher's script did); "module" imports it instead
    (tmp_path / "run.py").write_text(FEDREP + RUN)
    (tmp_path / "resume.py").write_text(RESUME)
    return src


def _python(tmp_path, script, *args, path=()):
    """``python script args`` with this process's pflcore (its sys.path) and ``path`` in front."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(p) for p in path] + [p for p in sys.path if p]))
    return subprocess.run([sys.executable, str(tmp_path / script), *map(str, args)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_resume_without_the_main_class_names_it_and_skips_nothing(tmp_path):
    """The issue: a run whose FedRep was defined in its script (__main__), resumed from a new
    process, reported every round file "truncated or corrupt" and then "no intact round"."""
    src = _scripts(tmp_path)
    ck, full = tmp_path / "ck", tmp_path / "full"
    done = _python(tmp_path, "run.py", ck, 4, tmp_path / "w4.pt", "main")
    assert done.returncode == 0, done.stderr
    assert _python(tmp_path, "run.py", full, 6, tmp_path / "w6.pt", "main").returncode == 0
    before = _snapshot(ck)
    assert {"round_0000002.pt", "round_0000004.pt"} <= set(before)

    failed = _python(tmp_path, "resume.py", ck, 6, tmp_path / "r.pt", "plain")
    assert failed.returncode == 3, failed.stdout + failed.stderr
    out = failed.stdout
    assert "MISSING (('__main__', 'FedRep'), ('__main__', 'FedRepState'))" in out, out
    assert "round_0000004.pt is intact" in out and "(module '__main__')" in out
    assert "Define or import them in the script that resumes" in out and "from mymodule import FedRep" in out
    assert "corrupt" not in out + failed.stderr and "no intact round" not in out
    assert _snapshot(ck) == before, "nothing written, renamed or deleted"

    # the fix the message gives: FedRep imported into the resuming script's __main__
    resumed = _python(tmp_path, "resume.py", ck, 6, tmp_path / "r.pt", "import", path=[src])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert torch.equal(torch.load(tmp_path / "r.pt"), torch.load(tmp_path / "w6.pt"))  # = the uninterrupted run


def test_resume_without_the_module_names_it_and_with_it_continues(tmp_path):
    src = _scripts(tmp_path)
    ck = tmp_path / "ck"
    assert _python(tmp_path, "run.py", ck, 4, tmp_path / "w4.pt", "module", path=[src]).returncode == 0
    assert _python(tmp_path, "run.py", tmp_path / "full", 6, tmp_path / "w6.pt", "module",
                   path=[src]).returncode == 0
    before = _snapshot(ck)
    failed = _python(tmp_path, "resume.py", ck, 6, tmp_path / "r.pt", "plain")  # the module is not on the path
    assert failed.returncode == 3, failed.stdout + failed.stderr
    out = failed.stdout
    assert "MISSING (('pflcore_test_fedrep', 'FedRep'), ('pflcore_test_fedrep', 'FedRepState'))" in out, out
    assert "of the module 'pflcore_test_fedrep', which this process cannot import (ModuleNotFoundError" in out
    assert "PYTHONPATH" in out and "corrupt" not in out
    assert _snapshot(ck) == before
    # on the path, the module is imported by the checkpoint itself: nothing to import by hand
    resumed = _python(tmp_path, "resume.py", ck, 6, tmp_path / "r.pt", "plain", path=[src])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert torch.equal(torch.load(tmp_path / "r.pt"), torch.load(tmp_path / "w6.pt"))
