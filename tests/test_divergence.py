"""Divergence is caught wherever it shows (issue 28, rows 2, 3 and 8): a NaN or infinity in the
parameters, in the models handed to evaluation, or only in a metric (a loss or a statistical
error overflowing rounds before the parameters do) stops the run with a DivergenceError naming
the algorithm, the round and the quantity; no history row holds a NaN or an infinity."""
from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data as D
from pflcore import models as M
from pflcore.cli import main
from pflcore.run import DivergenceError

BIG = 1e6  # every step size of every algorithm
STEP_SIZES = {
    "apfl": dict(alpha=0.5, lr=BIG),
    "cgpfl": dict(num_contexts=2, lam=1.0, lr=BIG, kmeans_iters=5, restarts=1, local_rounds=2),
    "cgpflheur": dict(mu=1.0, max_contexts=2, lam=1.0, lr=BIG, kmeans_iters=5, restarts=1, local_rounds=2),
    # Ditto and L2SGD refuse step sizes whose products with lam overshoot: lam is made small instead
    "ditto": dict(lam=1e-7, lr=BIG, personal_lr=BIG),
    "fedavg": dict(lr=BIG), "globaltrain": dict(lr=BIG), "localtrain": dict(lr=BIG),
    "localizedfedavg": dict(lr=BIG, finetune_lr=BIG),
    "fedpi": dict(eta=BIG), "fedproxclassic": dict(eta=BIG), "fedrp": dict(eta=BIG), "fedsplit": dict(eta=BIG),
    "grandscheme": dict(eta=BIG),
    "fedprox": dict(lam=1.0, local_lr=BIG, global_lr=1.0),
    "ifca": dict(num_clusters=2, lr=BIG),
    "l2sgd": dict(lam=1e-6, p=0.5, lr=BIG),
    "perfedavg": dict(alpha=BIG, beta=BIG, local_steps=3, batch_size=5),
    "perm": dict(warmup_rounds=2, lam_alpha=1.0, lr=BIG, alpha_every=2, fedavg_lr=BIG),
    "pfedme": dict(lam=15.0, lr=BIG, personal_lr=BIG, local_rounds=3),
    "fedrep": dict(lr=BIG, head_steps=3, body_steps=2), "fedper": dict(lr=BIG, local_steps=3),
}
NETS_ONLY = {"fedrep", "fedper"}  # a shared body and a personal head: a GLM is refused


def test_every_registered_algorithm_is_in_the_sweep():
    assert set(STEP_SIZES) == set(A.REGISTRY)


@pytest.fixture(scope="module")
def federations():
    return {"least_squares": D.least_squares(num_clients=12, samples_per_client=40, dim=8),
            "classes": D.contexts(num_clients=12, sizes=(20, 40), dim=8, num_classes=3)}


MODELS = {"least_squares": ("least_squares", lambda f: M.LeastSquares(f.num_features)),
          "softmax": ("classes", lambda f: M.Softmax(f.num_features, f.num_classes)),
          "mlp": ("classes", lambda f: M.MLP(f.num_features, hidden=8, C=f.num_classes))}


def _nonfinite(history):
    return [(row["round"], k) for row in history for k, v in row.items()
            if isinstance(v, float) and not math.isfinite(v)]


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("kind", sorted(STEP_SIZES))
def test_huge_step_sizes_end_finite_or_with_a_named_divergence(kind, family, federations):
    data, make = MODELS[family]
    fed = federations[data]
    algorithm = A.REGISTRY[kind](**STEP_SIZES[kind])
    if kind in NETS_ONLY and family != "mlp":
        with pytest.raises(ValueError, match="model: expected a net"):
            pflcore.run(algorithm, fed, make(fed), rounds=6, clients_per_round=4, progress=False)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "stat_error is not recorded" for the nets
        try:
            res = pflcore.run(algorithm, fed, make(fed), rounds=6, clients_per_round=4, progress=False)
        except DivergenceError as exc:
            assert exc.algorithm == algorithm.name and 0 <= exc.round <= 6 and exc.reason
            assert re.match(rf"{re.escape(algorithm.name)} diverged in round {exc.round}: ", str(exc)), str(exc)
            assert "NaN/inf" in exc.reason
            history = exc.history or []
            assert all(row["round"] < exc.round for row in history)
        else:
            history = res.history
            assert [row["round"] for row in history] == list(range(7))
    assert _nonfinite(history) == []


def test_the_evaluation_of_diverged_personalized_models_names_the_round_and_algorithm(federations):
    """Row 2: Per-FedAvg's personalized models (one step from the global model) overflow before
    the global model does; the bare NonFiniteError of the evaluation escaped ``run``."""
    fed = federations["least_squares"]
    with pytest.raises(DivergenceError) as info:
        pflcore.run(A.PerFedAvg(**STEP_SIZES["perfedavg"]), fed, M.LeastSquares(fed.num_features), rounds=5,
                    progress=False)
    exc = info.value
    assert exc.algorithm == "Per-FedAvg" and exc.round >= 1 and "personalized models" in exc.reason
    assert [row["round"] for row in exc.history] == list(range(exc.round))


def test_a_metric_that_overflows_before_the_parameters_stops_the_run(federations):
    """Row 3: PERM on float32 least squares; its personalized loss was inf from round 4 on while
    the run went on."""
    fed = federations["least_squares"]
    with pytest.raises(DivergenceError) as info:
        pflcore.run(A.PERM(warmup_rounds=2, lam_alpha=1.0, lr=BIG, alpha_every=2), fed,
                    M.LeastSquares(fed.num_features), rounds=8, progress=False)
    assert "metrics" in info.value.reason and "personalized_loss = inf" in info.value.reason
    assert _nonfinite(info.value.history) == []


@pytest.mark.parametrize("fedavg_steps", [1, 3])
def test_single_loop_perm_that_diverges_stops_naming_round_and_algorithm(federations, fedavg_steps):
    """Single-loop PERM takes its FedAvg steps' first step from α's gradient pass, outside the
    kernel (which checks the models it steps): with one FedAvg step nothing else reads w̃ before
    the round ends. A run whose steps blow up still stops with a DivergenceError naming PERM and
    a round, and its history holds only finite rows."""
    fed = federations["least_squares"]
    with pytest.raises(DivergenceError) as info:
        pflcore.run(A.PERM(warmup_rounds=1, lam_alpha=1.0, lr=BIG, single_loop=True, alpha_every=2,
                           fedavg_steps=fedavg_steps), fed, M.LeastSquares(fed.num_features), rounds=8, progress=False)
    exc = info.value
    assert exc.algorithm == "PERM" and 1 <= exc.round <= 8
    assert [row["round"] for row in exc.history] == list(range(exc.round))
    assert _nonfinite(exc.history) == []


def test_accelerated_history_has_no_nan_residual_and_strict_json(tmp_path, federations):
    """Row 8: Accelerated(FedAvg) recorded residual = NaN before its first round, and the JSON
    files held the bare token NaN."""
    fed = federations["classes"]
    res = pflcore.run(A.Accelerated(A.FedAvg(lr=0.1), memory=3), fed, M.Softmax(fed.num_features, fed.num_classes),
                      rounds=3, progress=False)
    assert "residual" not in res.history[0] and res.history[-1]["residual"] > 0

    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    json.loads(res.to_json(), parse_constant=refuse)
    res.history[1]["residual"] = float("nan")  # whatever a caller puts in: still standard JSON
    assert json.loads(res.to_json(), parse_constant=refuse)["history"][1]["residual"] is None


PERFEDAVG = """
name = "pf"
rounds = 6
seeds = [0, 1]
metrics = ["stat_error_local"]
[data]
generator = "least_squares"
num_clients = 6
samples_per_client = 30
dim = 6
[model]
family = "least_squares"
[algorithms.PerFedAvg]
type = "perfedavg"
alpha = 1e6
beta = 1e6
local_steps = 3
batch_size = 5
[algorithms.LocalTrain]
type = "localtrain"
lr = 0.05
"""


def test_the_cli_records_a_divergence_in_evaluation_and_goes_on(tmp_path, capsys):
    """Row 2 through the CLI: the experiment's other algorithm and seeds still run, exit 0, and
    summary.json is standard JSON."""
    cfg = tmp_path / "pf.toml"
    cfg.write_text(PERFEDAVG)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda t: pytest.fail(t))
    perfedavg, local = summary["rows"]
    assert [d["seed"] for d in perfedavg["diverged"]] == [0, 1]
    assert all("personalized models" in d["reason"] for d in perfedavg["diverged"])
    assert local["diverged"] == [] and local["stat_error_local"] > 0
    table = capsys.readouterr().out
    assert re.search(r"PerFedAvg +- +- +diverged in round \d+ \(2 of 2 seeds; first: seed 0\)", table), table


# ---- the check after a round: only the rows an algorithm marks as changed ----------------------

def _marking_fed():
    return D.synthetic(0.5, 0.5, num_clients=40, dim=6, num_classes=3, seed=1)


def test_a_nan_in_a_marked_row_still_stops_the_run_at_that_round(monkeypatch):
    """pFedMe marks its trainers' rows (train_all=False); a NaN written into one of them in
    round 3 stops the run there, named."""
    real_round = A.PFedMe.round

    def poisoned(self, state, ctx, t):
        state = real_round(self, state, ctx, t)
        if t == 3:
            S = ctx.sample_clients(t)
            state.theta[S[0], 0] = float("nan")  # a row this round changed
        return state

    monkeypatch.setattr(A.PFedMe, "round", poisoned)
    alg = A.PFedMe(lam=15.0, lr=0.01, personal_lr=0.01, inner_steps=2, local_rounds=2, train_all=False)
    with pytest.raises(DivergenceError, match=r"pFedMe diverged in round 3: state\.theta has NaN/inf"):
        pflcore.run(alg, _marking_fed(), M.Softmax(6, 3), rounds=5, clients_per_round=5, progress=False)


def test_the_check_reads_only_the_marked_rows_of_per_client_fields(monkeypatch):
    """What the round's check reads: for pFedMe with 5 of 40 clients a round, 5 rows of each
    [m, d] field and all of w; for an algorithm that marks nothing (FedAvg's state has no
    per-client field; a subclass of pFedMe with marking off), every row."""
    import sys
    R = sys.modules["pflcore.run"]  # the module (pflcore.run is also the function)
    seen, inside = [], [False]
    real, real_round = R.all_finite, R._round
    monkeypatch.setattr(R, "all_finite", lambda t: (inside[0] and seen.append(tuple(t.shape))) or real(t))

    def in_round(*a, **k):  # only the check after the round (the evaluations check what they read)
        inside[0] = True
        try:
            return real_round(*a, **k)
        finally:
            inside[0] = False
    monkeypatch.setattr(R, "_round", in_round)
    fed, model = _marking_fed(), M.Softmax(6, 3)
    alg = A.PFedMe(lam=15.0, lr=0.01, personal_lr=0.01, inner_steps=2, local_rounds=2, train_all=False)
    pflcore.run(alg, fed, model, rounds=2, clients_per_round=5, progress=False)
    d = model.d
    # w_local[S] and theta[S] in each of the two rounds; never a whole [m, d] field
    assert seen.count((5, d)) == 4 and (40, d) not in seen

    class Unmarked(A.PFedMe):
        marks_changed_rows = False

    seen.clear()
    pflcore.run(Unmarked(lam=15.0, lr=0.01, personal_lr=0.01, inner_steps=2, local_rounds=2, train_all=False),
                fed, model, rounds=2, clients_per_round=5, progress=False)
    assert seen.count((40, d)) == 4 and (5, d) not in seen  # two [m, d] fields, two rounds


def test_marked_rows_give_the_same_run_bitwise():
    """The check reads less; the run is the same: every marking algorithm with and without."""
    fed, model = _marking_fed(), M.Softmax(6, 3)
    for make in (lambda: A.PFedMe(lam=15.0, lr=0.01, personal_lr=0.01, inner_steps=2, local_rounds=2,
                                  train_all=False),
                 lambda: A.Ditto(lam=0.5, lr=0.05, local_steps=2, batch_size=4),
                 lambda: A.APFL(lr=0.05, alpha=0.3, local_steps=2, batch_size=4, adaptive_alpha=True),
                 lambda: A.FedRep(lr=0.05, head_steps=2, body_steps=1, batch_size=4),
                 lambda: A.FedPer(lr=0.05, local_steps=2, batch_size=4)):
        a, b = make(), make()
        assert a.marks_changed_rows
        b.marks_changed_rows = False
        net = isinstance(a, (A.FedRep, A.FedPer))  # a body and a head
        m = M.MLP(6, hidden=5, C=3) if net else model
        ra = pflcore.run(a, fed, m, rounds=4, clients_per_round=5, progress=False)
        rb = pflcore.run(b, fed, m, rounds=4, clients_per_round=5, progress=False)
        for x, y in ((ra.personalized, rb.personalized), (ra.global_model, rb.global_model)):
            assert (x is None and y is None) or torch.equal(x, y), a.name
