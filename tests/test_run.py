"""The round loop: metrics, results, checkpoints, determinism (DESIGN.md §5)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, models

TIMING = ("seconds", "client_steps_per_s")


def _strip(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def _small():
    fed = data.synthetic(0.5, 0.5, num_clients=12, dim=9, num_classes=4, seed=2, size_scale=1, max_size=150)
    return fed, models.Softmax(9, 4, l2=1e-3)


def test_metrics_and_result_outputs(tmp_path):
    fed, model = _small()
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=4, batch_size=10)
    res = pflcore.run(alg, fed, model, rounds=6, clients_per_round=5, eval_every=3, progress=False)
    assert [r["round"] for r in res.history] == [0, 3, 6]
    last = res.history[-1]
    for key in ("personalized_acc", "personalized_acc_std", "personalized_acc_p10", "personalized_loss",
                "global_acc", "global_loss", "train_loss", "stat_error_local", "seconds", "client_steps_per_s"):
        assert last[key] is not None and last[key] == last[key], key
    assert 0 <= last["personalized_acc"] <= 1 and last["client_steps_per_s"] > 0
    # sample-weighted accuracy: recompute from ops.evaluate
    _, correct, count = pflcore.ops.evaluate(model, res.personalized, fed.test)
    assert last["personalized_acc"] == float(correct.sum()) / float(count.sum())
    out = json.loads(res.to_json(str(tmp_path / "r.json")))
    assert out["history"][-1]["round"] == 6 and os.path.exists(tmp_path / "r.json")
    assert "personalized_acc" in res.table()
    png = res.plot(str(tmp_path / "r.png"))
    assert os.path.getsize(png) > 1000


def test_resume_equals_uninterrupted_run_bitwise(tmp_path):
    fed, model = _small()
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=4, batch_size=10)
    full = pflcore.run(alg, fed, model, rounds=8, clients_per_round=5, eval_every=2, progress=False)
    ck = tmp_path / "ck"
    pflcore.run(alg, fed, model, rounds=8, clients_per_round=5, eval_every=2, progress=False,
                checkpoint=str(ck), checkpoint_every=3)
    for late in ("round_0000006.pt", "round_0000008.pt"):  # as if the run had stopped after round 3
        os.remove(ck / late)
    resumed = pflcore.resume(str(ck), progress=False)
    assert _strip(resumed.history) == _strip(full.history)
    assert torch.equal(resumed.personalized, full.personalized)
    assert torch.equal(resumed.global_model, full.global_model)


SCRIPT = r"""
import hashlib, json, pflcore
from pflcore import algorithms as A, data, models
fed = data.synthetic(0.5, 0.5, num_clients=12, dim=9, num_classes=4, seed=2, size_scale=1, max_size=150)
alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=4, batch_size=10)
res = pflcore.run(alg, fed, models.Softmax(9, 4, l2=1e-3), rounds=5, clients_per_round=5, progress=False)
h = [{k: v for k, v in r.items() if k not in ("seconds", "client_steps_per_s")} for r in res.history]
print(hashlib.sha256((json.dumps(h) + res.personalized.numpy().tobytes().hex()).encode()).hexdigest())
"""


def test_same_seed_same_history_with_one_and_two_threads():
    digests = []
    for threads in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip())
    assert digests[0] == digests[1] and len(digests[0]) == 64


def test_stat_error_compares_the_weights_when_only_the_intercept_differs():
    """Logistic(10) has an intercept (on by default); logistic_truth's true models have none.
    The metric used to vanish from the history; it is the error of the feature weights."""
    fed = data.logistic_truth(num_clients=5, samples_per_client=40, dim=10, seed=1)
    res = pflcore.run(A.LocalTrain(lr=0.5, steps=5), fed, models.Logistic(10), rounds=2, progress=False)
    theta = res.personalized[:, :10]  # [p + 1, 1] row-major: the intercept is the last entry
    want = float(((theta - fed.truth) ** 2).sum(1).mean())
    assert res.final("stat_error_local") == pytest.approx(want, rel=1e-6)
    # FedAvg: the global model against truth_global, the same way
    res = pflcore.run(A.FedAvg(lr=0.5), fed, models.Logistic(10), rounds=2, progress=False)
    assert res.final("stat_error_global") == pytest.approx(
        float(((res.global_model[:10] - fed.truth_global) ** 2).sum()), rel=1e-6)
    # the reverse: a truth with an intercept row (synthetic) and a model without one
    syn = data.synthetic(0.5, 0.5, num_clients=4, dim=5, num_classes=3, size_scale=1, max_size=40)
    res = pflcore.run(A.LocalTrain(lr=0.1), syn, models.Softmax(5, 3, fit_intercept=False), rounds=1, progress=False)
    want = float(((res.personalized - syn.truth[:, :15]) ** 2).sum(1).mean())
    assert res.final("stat_error_local") == pytest.approx(want, rel=1e-6)


def test_a_model_that_cannot_be_compared_with_the_truth_warns_once():
    fed = data.logistic_truth(num_clients=3, samples_per_client=20, dim=4, seed=0)
    with pytest.warns(RuntimeWarning, match=r"stat_error_local and stat_error_global are not recorded: .*"
                                            r"d = 4.*MLP\(p=4.*\(d = 23\)") as caught:
        res = pflcore.run(A.LocalTrain(lr=0.1), fed, models.MLP(4, 3, 2), rounds=3, progress=False)
    assert len([w for w in caught if "stat_error" in str(w.message)]) == 1
    assert res.final("stat_error_local") is None


def test_nan_in_true_models_is_rejected():
    fed = data.logistic_truth(num_clients=3, samples_per_client=10, dim=4)
    for name in ("truth", "truth_global"):
        bad = getattr(fed, name).clone()
        bad.view(-1)[1] = float("nan")
        kw = {"truth": fed.truth, "truth_global": fed.truth_global, name: bad}
        with pytest.raises(ValueError, match=rf"{name}: contains 1 NaN"):
            pflcore.Federation(fed.train, fed.test, 2, **kw)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 2 ** 70, 1.0, True, "0"])
def test_run_seed_must_be_a_64_bit_unsigned_integer(seed):
    fed, model = _small()
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 2\*\*64\)"):
        pflcore.run(A.FedAvg(lr=0.1), fed, model, rounds=1, seed=seed, progress=False)


@pytest.mark.filterwarnings("ignore:stat_error_local and stat_error_global are not recorded")
def test_the_largest_seed_runs_with_a_net():
    fed, _ = _small()
    res = pflcore.run(A.FedAvg(lr=0.1), fed, models.MLP(9, 4, 4), rounds=1, seed=2 ** 64 - 1, progress=False)
    assert res.history[-1]["round"] == 1


def test_mean_sq_error_in_chunks_equals_the_direct_formula():
    """The stat error's chunked computation (one reused buffer) gives bitwise the direct
    mean of ‖θ_i − θ*_i‖²: several chunks, one model for all, and a column slice of the models."""
    import importlib

    run_module = importlib.import_module("pflcore.run")

    class One:
        sharded = False

    g = torch.Generator().manual_seed(3)
    m, d = 5003, 610  # (chunks of 2^20 // 610 = 1,718 rows: three of them, the last short)
    truth = torch.randn(m, d, generator=g)
    models = torch.randn(m, d + 10, generator=g)
    w = torch.randn(1, d, generator=g)
    assert run_module._mean_sq_error(w, truth, One()) == float(((w - truth) ** 2).sum(1).mean())
    sliced = models[:, :d]
    assert run_module._mean_sq_error(sliced, truth, One()) == float(((sliced - truth) ** 2).sum(1).mean())
