"""What an algorithm costs, made visible: the warning of an algorithm that trains more clients per
round than clients_per_round (pFedMe's train_all), the docstrings of every algorithm,
LocalizedFedAvg's fine-tuning at evaluation only, and callbacks on every round."""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, models
from pflcore.algorithms import base
from pflcore.algorithms.base import replicate
from pflcore.experiment_config import parameters

TIMING = ("seconds", "client_steps_per_s")


def _fed(m=20, seed=0):
    return data.synthetic(0.5, 0.5, num_clients=m, dim=5, num_classes=3, seed=seed, size_scale=1, max_size=50)


MODEL = models.Softmax(5, 3)  # d = 6 · 3 = 18


def _pfedme(**kw):
    return A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=5, **kw)


def _costly(records):
    return [str(w.message) for w in records if "clients per round" in str(w.message)]


def test_pfedme_train_all_warns_once_with_the_memory_estimate():
    m, cpr, d = 20, 4, MODEL.d
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        pflcore.run(_pfedme(), _fed(m), MODEL, rounds=3, clients_per_round=cpr, progress=False)
    said = _costly(records)
    assert len(said) == 1, said  # once per run, not per round
    text = said[0]
    assert text.startswith(f"pFedMe trains {m} clients per round, 5x clients_per_round = {cpr} (train_all=True, "
                           "the paper's behaviour"), text
    assert "train_all=False trains only the sampled clients" in text and "An estimate" in text
    # the state's w_local and θ [m, d] + the round's two working copies, float32
    row = d * 4
    need, sampled = 2 * m * row + 2 * m * row, 2 * m * row + 2 * cpr * row
    assert f"about {need / 1024:.3g} KiB for its [m, d] matrices (2 in the state, 2 working copies" in text, text
    assert f"vs {sampled / 1024:.3g} KiB were only the sampled clients trained" in text, text


@pytest.mark.parametrize("make, cpr", [
    (lambda: _pfedme(train_all=False), 4),  # trains the sampled clients only
    (lambda: _pfedme(), None),              # every client is sampled
    (lambda: A.FedAvg(lr=0.1), 4),
    (lambda: A.LocalizedFedAvg(lr=0.1), 4),
])
def test_no_warning_when_a_round_trains_the_sampled_clients(make, cpr):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        pflcore.run(make(), _fed(), MODEL, rounds=2, clients_per_round=cpr, progress=False)
    assert _costly(records) == []


def test_every_client_trainer_says_so():
    """LocalTrain, L2SGD and PERM train every client whatever clients_per_round says, and so does
    an Anderson-accelerated pFedMe."""
    for alg, note in [(A.LocalTrain(lr=0.1), "clients_per_round is not used"),
                      (A.L2SGD(lam=0.1, p=0.5, lr=0.1), "clients_per_round is not used"),
                      (A.PERM(warmup_rounds=1, lam_alpha=10.0, lr=0.05), "model shuffling"),
                      (A.Accelerated(_pfedme()), "train_all=True")]:
        assert alg.clients_trained_per_round(20, 4) == 20
        with pytest.warns(RuntimeWarning, match=rf"{re.escape(alg.name)} trains 20 clients per round, 5x "
                                                rf"clients_per_round = 4 \(.*{note}"):
            pflcore.run(alg, _fed(), MODEL, rounds=1, clients_per_round=4, progress=False)
    assert A.FedAvg(lr=0.1).clients_trained_per_round(20, None) == 20
    assert A.FedAvg(lr=0.1).clients_trained_per_round(20, 4) == 4


CLASSES = sorted({*A.REGISTRY.values(), A.Accelerated}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_algorithm_documents_its_hyperparameters(cls):
    """help(A.PFedMe) printed no docstring: each public class now has its own, naming every
    constructor parameter (as ``name``) and what a round runs."""
    assert cls.__name__ in A.__all__ or cls in A.REGISTRY.values()
    doc = cls.__dict__.get("__doc__") or ""
    assert len(doc) > 150, f"{cls.__name__}: no docstring of its own"
    missing = [p for p in parameters(cls) if f"``{p}" not in doc]
    assert missing == [], f"{cls.__name__}'s docstring does not name {missing}"
    assert "round" in doc.lower() or "iteration" in doc.lower()


# ---- LocalizedFedAvg ---------------------------------------------------------------------------

@dataclass
class _OldState:
    w: torch.Tensor
    theta: torch.Tensor = base.per_client()


class _FineTuneEveryRound(A.FedAvg):
    """LocalizedFedAvg as it was: FedAvg's round, then every client fine-tunes, every round."""

    name = "old"

    def __init__(self, lr, local_steps, finetune_steps, finetune_lr):
        super().__init__(lr, local_steps)
        self.finetune_steps, self.finetune_lr = finetune_steps, finetune_lr

    def init(self, ctx):
        return _OldState(ctx.initial_global(), ctx.initial_models(ctx.m))

    def round(self, state, ctx, t):
        state = super().round(state, ctx, t)
        state.theta = replicate(state.w, ctx.m)
        ctx.local_steps(state.theta, steps=self.finetune_steps, lr=self.finetune_lr)
        return state

    def personalized(self, state):
        return state.theta


@pytest.mark.parametrize("eval_every", [1, 3])
def test_localized_fedavg_evaluates_what_fine_tuning_every_round_gave_bitwise(eval_every):
    fed = _fed(12)
    kw = dict(rounds=7, clients_per_round=5, eval_every=eval_every, progress=False)
    new = pflcore.run(A.LocalizedFedAvg(lr=0.1, local_steps=2, finetune_steps=3, finetune_lr=0.2), fed, MODEL, **kw)
    old = pflcore.run(_FineTuneEveryRound(0.1, 2, 3, 0.2), fed, MODEL, **kw)
    strip = lambda h: [{k: v for k, v in r.items() if k not in TIMING} for r in h]  # noqa: E731
    # every evaluated round, bitwise (the same steps from the same global model)
    assert strip(new.history)[1:] == strip(old.history)[1:] and len(new.history) > 2
    assert torch.equal(new.personalized, old.personalized) and torch.equal(new.global_model, old.global_model)
    # round 0, before any round: the old state's θ was the initial point, un-tuned (personalized =
    # global); now it is the initial global model fine-tuned, as on every other round
    assert old.history[0]["personalized_acc"] == old.history[0]["global_acc"]
    assert new.history[0]["global_acc"] == old.history[0]["global_acc"]
    assert new.history[0]["personalized_loss"] < old.history[0]["personalized_loss"]


def test_localized_fedavg_rounds_without_evaluation_train_what_fedavg_trains(monkeypatch):
    """The issue: at 1,000 clients every round fine-tuned all of them (0.67 s vs FedAvg's 0.009 s).
    Now a round that is not evaluated runs FedAvg's local steps and nothing else."""
    calls = []
    real = base.run_local_steps

    def counting(model, theta, *args):
        calls.append(theta.shape[0])
        return real(model, theta, *args)

    monkeypatch.setattr(base, "run_local_steps", counting)
    per_round = {}

    def log(t, row, state, *, evaluated):
        per_round[t] = (evaluated, list(calls))
        calls.clear()

    fed = _fed(30)
    for alg in (A.FedAvg(lr=0.1, local_steps=2), A.LocalizedFedAvg(lr=0.1, local_steps=2, finetune_steps=4)):
        calls.clear()
        pflcore.run(alg, fed, MODEL, rounds=4, clients_per_round=5, eval_every=4, callbacks=[log], progress=False)
        per_round[alg.name] = dict(per_round)
    fedavg, localized = per_round["FedAvg"], per_round["LocalizedFedAvg"]
    for t in (2, 3):  # not evaluated: the 5 sampled clients' local steps, alike
        assert localized[t] == fedavg[t] == (False, [5])
    assert fedavg[1] == (False, [5])
    assert localized[1] == (False, [30, 5])  # the evaluation of round 0 (before round 1) fine-tunes, then round 1
    assert fedavg[4] == (True, [5])
    assert localized[4] == (True, [5, 30])  # the round, then every client's fine-tuning for its evaluation


# ---- callbacks -----------------------------------------------------------------------------------

def test_callbacks_old_form_on_evaluated_rounds_keyword_form_on_every_round():
    seen = {"old": [], "kw": [], "var": [], "pos": []}

    def old(t, row, state):
        seen["old"].append((t, row["round"]))

    def kw(t, row, state, *, evaluated):
        seen["kw"].append((t, evaluated, None if row is None else row["round"]))

    def var(t, row, state, **info):
        seen["var"].append((t, info["evaluated"]))

    def pos(t, row, state, evaluated=None):
        seen["pos"].append((t, evaluated))

    pflcore.run(A.FedAvg(lr=0.1), _fed(), MODEL, rounds=5, eval_every=2, callbacks=[old, kw, var, pos],
                progress=False)
    evaluated = {2, 4, 5}  # every eval_every rounds and the last
    assert seen["old"] == [(t, t) for t in sorted(evaluated)]
    assert seen["kw"] == [(t, t in evaluated, t if t in evaluated else None) for t in range(1, 6)]
    assert seen["var"] == seen["pos"] == [(t, t in evaluated) for t in range(1, 6)]


def test_callbacks_every_round_after_a_resume(tmp_path):
    ticks = []
    fed = _fed()
    pflcore.run(A.FedAvg(lr=0.1), fed, MODEL, rounds=3, eval_every=2, checkpoint=str(tmp_path / "ck"),
                checkpoint_every=1, progress=False)
    pflcore.resume(str(tmp_path / "ck"), rounds=6, progress=False,
                   callbacks=[lambda t, row, state, evaluated: ticks.append((t, evaluated))])
    assert ticks == [(4, True), (5, False), (6, True)]


def test_the_cli_says_the_cost_on_one_line(tmp_path, capsys):
    from pflcore.cli import main

    argv = ["run", "rounds=2", "clients_per_round=10", "seeds=[0, 1]", "--algo", "pFedMe", "--algo", "FedAvg",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "clients per round" in line]
    # once, for pFedMe (same message for both seeds), and nothing for FedAvg
    assert len(err) == 1 and err[0].startswith("pflcore: warning: pFedMe trains 100 clients per round, 10x "
                                               "clients_per_round = 10 (train_all=True"), err
    assert "GiB" in err[0] or "KiB" in err[0] or "MiB" in err[0]
