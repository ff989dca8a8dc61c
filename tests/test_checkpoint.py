"""Checkpoint folders: one run per folder, defaults and bad values, torn files, fallbacks."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import checkpoint as ckpt
from pflcore import data, models

TIMING = ("seconds", "client_steps_per_s")


def _strip(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def _fed(seed=0):
    return data.synthetic(0.5, 0.5, num_clients=10, dim=5, num_classes=3, seed=seed, size_scale=1, max_size=50)


def _alg():
    return A.FedAvg(lr=0.05, local_steps=2)


MODEL = models.Softmax(5, 3)


def test_a_second_run_into_the_folder_of_another_is_refused_and_the_first_resumes_intact(tmp_path):
    """The issue's reproducer: run 2 (other data) into run 1's folder used to interleave its
    rounds with run 1's, and resume then continued run 2's state on run 1's data."""
    ck = str(tmp_path / "ck")
    f0, f1 = _fed(0), _fed(1)
    pflcore.run(_alg(), f0, MODEL, rounds=4, checkpoint=ck, checkpoint_every=2, progress=False)
    before = sorted(os.listdir(ck))
    with pytest.raises(ValueError, match=r"holds the checkpoints of another run \(federation content: sha256"):
        pflcore.run(_alg(), f1, MODEL, rounds=6, checkpoint=ck, checkpoint_every=2, progress=False)
    assert sorted(os.listdir(ck)) == before, "the refused run wrote nothing"
    resumed = pflcore.resume(ck, rounds=10, progress=False)
    full = pflcore.run(_alg(), f0, MODEL, rounds=10, progress=False)
    assert torch.equal(resumed.global_model, full.global_model)
    assert _strip(resumed.history)[-1] == _strip(full.history)[-1]


@pytest.mark.parametrize("change, expected", [
    (dict(alg=A.FedAvg(lr=0.1, local_steps=2)), r"hyperparameters\.lr: 0\.1 in this run, 0\.05 in the folder"),
    (dict(alg=A.LocalTrain(lr=0.05)), r"algorithm: LocalTrain in this run, FedAvg in the folder"),
    (dict(model=models.Softmax(5, 3, l2=0.1)),
     r"model: Softmax\(p=5, C=3, l2=0\.1.* in this run, Softmax\(p=5, C=3, l2=0\.0"),
    (dict(seed=3), r"seed: 3 in this run, 0 in the folder"),
    (dict(clients_per_round=4), r"clients_per_round: 4 in this run, None in the folder"),
])
def test_the_refusal_names_what_differs(tmp_path, change, expected):
    ck = str(tmp_path / "ck")
    pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint=ck, progress=False)
    kw = dict(seed=change.get("seed", 0), clients_per_round=change.get("clients_per_round"))
    with pytest.raises(ValueError, match=expected):
        pflcore.run(change.get("alg", _alg()), _fed(), change.get("model", MODEL), rounds=2, checkpoint=ck,
                    progress=False, **kw)


def test_the_same_run_again_may_reuse_its_folder(tmp_path):
    ck = str(tmp_path / "ck")
    first = pflcore.run(_alg(), _fed(), MODEL, rounds=3, checkpoint=ck, progress=False)
    again = pflcore.run(_alg(), _fed(), MODEL, rounds=5, checkpoint=ck, progress=False)  # a new object, same data
    assert torch.equal(first.global_model, pflcore.run(_alg(), _fed(), MODEL, rounds=3, progress=False).global_model)
    assert pflcore.resume(ck, progress=False).history[-1]["round"] == 5
    assert again.history[-1]["round"] == 5
    stored = json.loads((tmp_path / "ck" / "run.json").read_text())["fingerprint"]
    assert stored["algorithm"] == "FedAvg" and stored["seed"] == 0 and stored["ranks"] == 1
    assert stored["federation"]["sha256"] == ckpt.federation_digest(_fed())


def test_the_digest_covers_every_tensor_of_the_federation():
    fed = _fed()
    base = ckpt.federation_digest(fed)
    assert ckpt.federation_digest(_fed()) == base
    for field in ("x", "y"):
        other = _fed()
        t = getattr(other.test, field)
        t[3] = t[3] + 1
        assert ckpt.federation_digest(other) != base, field
    reweighted = pflcore.Federation(fed.train, fed.test, fed.num_classes, weights=torch.arange(1.0, 11.0) / 55,
                                    truth=fed.truth, name=fed.name, meta=fed.meta)
    assert ckpt.federation_digest(reweighted) != base
    assert ckpt.federation_digest(fed.to(dtype=torch.float64)) != base


def test_checkpoint_without_checkpoint_every_writes_every_eval_every_rounds(tmp_path):
    ck = tmp_path / "ck"
    pflcore.run(_alg(), _fed(), MODEL, rounds=7, eval_every=3, checkpoint=str(ck), progress=False)
    assert sorted(p.name for p in ck.glob("round_*.pt")) == ["round_0000003.pt", "round_0000006.pt",
                                                             "round_0000007.pt"]
    assert pflcore.resume(str(ck), rounds=9, progress=False).history[-1]["round"] == 9


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_bad_checkpoint_every_is_refused(tmp_path, every):
    with pytest.raises(ValueError, match=r"checkpoint_every: expected an integer in \[1, "):
        pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint=str(tmp_path), checkpoint_every=every, progress=False)


def test_checkpoint_every_without_a_folder_and_a_bad_folder_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint_every: given \(2\) without checkpoint="):
        pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint_every=2, progress=False)
    with pytest.raises(ValueError, match=r"checkpoint: expected a folder path"):
        pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint=3, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"exists and is not a folder"):
        pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint=str(tmp_path / "file"), progress=False)


def _three_rounds(tmp_path):
    ck = tmp_path / "ck"
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=5)
    full = pflcore.run(alg, _fed(), MODEL, rounds=6, clients_per_round=4, eval_every=2, progress=False)
    pflcore.run(alg, _fed(), MODEL, rounds=6, clients_per_round=4, eval_every=2, checkpoint=str(ck), progress=False)
    return ck, full


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_torn_newest_round_is_named_and_resume_falls_back_to_the_last_intact_one(tmp_path, damage):
    ck, full = _three_rounds(tmp_path)
    last = ck / "round_0000006.pt"
    raw = last.read_bytes()
    last.write_bytes({"truncated": raw[: len(raw) // 2], "empty": b"", "garbage": b"not a checkpoint"}[damage])
    with pytest.warns(RuntimeWarning, match=r"round_0000006\.pt is unreadable .*Resuming from round 4 "
                                            r"\(.*round_0000004\.pt\), the newest intact round"):
        resumed = pflcore.resume(str(ck), progress=False)
    assert _strip(resumed.history) == _strip(full.history)
    assert torch.equal(resumed.personalized, full.personalized)
    # the resumed run rewrote round 6: the folder is whole again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # pFedMe's train_all cost is said at every start, a resume's too: not what is checked here
        warnings.filterwarnings("ignore", r"pFedMe trains \d+ clients per round", RuntimeWarning)
        assert pflcore.resume(str(ck), progress=False).history[-1]["round"] == 6


def test_every_round_torn_is_an_error_naming_the_files(tmp_path):
    ck, _ = _three_rounds(tmp_path)
    for p in ck.glob("round_*.pt"):
        p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"no intact round in .*round_0000006\.pt is unreadable.*"
                                         r"round_0000002\.pt is unreadable"):
        pflcore.resume(str(ck), progress=False)


def test_a_torn_federation_file_is_named(tmp_path):
    ck, _ = _three_rounds(tmp_path)
    fed = ck / "federation.pt"
    fed.write_bytes(fed.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"federation\.pt is unreadable \(the federation and model"):
        pflcore.resume(str(ck), progress=False)


def test_empty_missing_and_unstarted_folders_give_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no checkpoint \(no run\.json, federation\.pt or round_\*\.pt"):
        pflcore.resume(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"checkpoint: no folder"):
        pflcore.resume(str(tmp_path / "nowhere"))
    # a run that stopped before its first checkpoint leaves its fingerprint only
    with pytest.raises(pflcore.DivergenceError):
        pflcore.run(A.FedAvg(lr=1e38, local_steps=5), _ls(), models.LeastSquares(4, fit_intercept=False), rounds=9,
                    checkpoint=str(tmp_path / "early"), checkpoint_every=5, progress=False)
    with pytest.raises(ValueError, match=r"stopped before its first checkpoint"):
        pflcore.resume(str(tmp_path / "early"))


def test_a_folder_of_an_older_pflcore_is_not_overwritten_but_resumes(tmp_path):
    ck, full = _three_rounds(tmp_path)
    os.remove(ck / "run.json")
    os.remove(ck / "round_0000006.pt")
    with pytest.raises(ValueError, match=r"holds checkpoint files but no run\.json"):
        pflcore.run(_alg(), _fed(), MODEL, rounds=2, checkpoint=str(ck), progress=False)
    resumed = pflcore.resume(str(ck), progress=False)
    assert torch.equal(resumed.personalized, full.personalized)
    assert (ck / "run.json").exists(), "resuming adopts the folder"


def test_writes_leave_no_temporary_files(tmp_path):
    ck, _ = _three_rounds(tmp_path)
    assert not [p for p in os.listdir(ck) if p.endswith(".tmp")]


def _ls():
    return data.least_squares(num_clients=3, samples_per_client=20, dim=4, seed=0)


def test_divergence_names_a_checkpoint_only_when_one_was_written(tmp_path):
    """pFedMe diverging in round 1 used to point at a checkpoint that was never written."""
    alg = A.PFedMe(lam=15, lr=1e6, personal_lr=1e5)
    with pytest.raises(pflcore.DivergenceError) as caught:
        pflcore.run(alg, _fed(), MODEL, rounds=6, checkpoint=str(tmp_path / "a"), checkpoint_every=5, progress=False)
    assert caught.value.round == 1 and "checkpoint" not in str(caught.value)
    assert caught.value.algorithm == "pFedMe" and caught.value.history and caught.value.history[0]["round"] == 0
    # FedAvg on least squares with a step too big grows geometrically: it overflows after a few rounds
    model = models.LeastSquares(4, fit_intercept=False)
    with pytest.raises(pflcore.DivergenceError) as caught:
        pflcore.run(A.FedAvg(lr=3.0), _ls(), model, rounds=400, checkpoint=str(tmp_path / "b"), checkpoint_every=2,
                    progress=False)
    t = caught.value.round
    last = 2 * ((t - 1) // 2)
    assert t > 2 and f"the last good checkpoint is round {last} in {tmp_path / 'b'}" in str(caught.value)
    assert (tmp_path / "b" / f"round_{last:07d}.pt").exists()


def test_the_number_of_ranks_binds_a_new_run_but_not_a_resume(tmp_path):
    """A folder written by 2 ranks (its run.json says so) refuses a fresh one-process run, whose
    float sums would differ in rounding, but resume re-splits it onto any number of ranks."""
    ck, full = _three_rounds(tmp_path)
    path = ck / "run.json"
    stored = json.loads(path.read_text())
    stored["fingerprint"]["ranks"] = 2
    path.write_text(json.dumps(stored))
    alg = A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=2, local_rounds=2, batch_size=5)
    with pytest.raises(ValueError, match=r"ranks: 1 in this run, 2 in the folder"):
        pflcore.run(alg, _fed(), MODEL, rounds=6, clients_per_round=4, eval_every=2, checkpoint=str(ck),
                    progress=False)
    resumed = pflcore.resume(str(ck), progress=False)
    assert torch.equal(resumed.personalized, full.personalized)
    assert json.loads(path.read_text())["fingerprint"]["ranks"] == 1, "the folder now records its last writer"
