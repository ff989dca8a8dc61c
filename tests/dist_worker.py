"""One rank of a sharded run, for tests/test_distributed.py (not collected by pytest).

Started as ``python tests/dist_worker.py SPEC.json`` with torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) in the environment. SPEC: ``{"mode": "run" | "resume" |
"die", "cases": [...], "rounds": R, "out": folder, "checkpoint": folder or null,
"checkpoint_every": k}``. Writes ``out/rank<r>.pt``: per case the history (timing and traffic
columns removed), the rank's client range and its rows of the personalized models, the global
model, and the bytes it sent per round.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, distributed, models

NOT_COMPARED = ("seconds", "client_steps_per_s", "bytes_sent_per_round")


def strip(history):
    return [{k: v for k, v in row.items() if k not in NOT_COMPARED} for row in history]


# PFLCORE_TEST_DOUBLE_CLIENTS=1: twice the clients, same models (the traffic test)
def _scale() -> int:
    return 2 if os.environ.get("PFLCORE_TEST_DOUBLE_CLIENTS") == "1" else 1


# name -> (algorithm, federation, model, run keyword arguments); small, fast and deterministic
def _synthetic():
    fed = data.synthetic(0.5, 0.5, num_clients=11 * _scale(), dim=7, num_classes=3, seed=3, size_scale=1, max_size=120)
    return fed, models.Softmax(7, 3, l2=1e-3)


def case(name: str):
    if name == "fedavg":
        fed, model = _synthetic()
        return A.FedAvg(lr=0.1, local_steps=3, batch_size=8), fed, model, {"clients_per_round": 5}
    if name == "localtrain":
        fed, model = _synthetic()
        return A.LocalTrain(lr=0.1, steps=2, batch_size=6), fed, model, {}
    if name == "pfedme":
        fed, model = _synthetic()
        return (A.PFedMe(lam=15, lr=0.01, personal_lr=0.05, inner_steps=3, local_rounds=3, batch_size=8), fed, model,
                {"clients_per_round": 4})
    if name == "fedpi_anderson":
        fed = data.least_squares(num_clients=9 * _scale(), samples_per_client=40, dim=5, seed=1)
        model = models.LeastSquares(5, fit_intercept=False)
        return A.Accelerated(A.FedPi(eta=0.5, prox_steps=5), memory=2), fed, model, {}
    if name == "cgpfl":
        fed = data.contexts(num_clients=12 * _scale(), num_contexts=3, dim=6, num_classes=3, sizes=(20, 40), seed=2)
        model = models.Softmax(6, 3)
        return (A.CGPFL(num_contexts=3, lam=12.0, beta=0.005, lr=0.05, inner_steps=2, local_rounds=2, batch_size=8),
                fed, model, {})
    if name == "cgpfl_heur":
        fed = data.contexts(num_clients=12, num_contexts=3, dim=6, num_classes=3, sizes=(20, 40), seed=2)
        model = models.Softmax(6, 3)
        return (A.CGPFLHeur(mu=100.0, max_contexts=4, lam=12.0, beta=0.005, lr=0.05, inner_steps=2, local_rounds=2,
                            batch_size=8), fed, model, {})
    if name == "perm":
        fed = data.two_groups(num_clients=10, samples_per_client=30, dim=6, seed=0)
        model = models.Logistic(6, fit_intercept=False)
        return A.PERM(warmup_rounds=2, lam_alpha=100.0, lr=0.05, local_steps=2, batch_size=8), fed, model, {}
    if name == "perm_single_loop":  # α's gradient pass also the sampled clients' first FedAvg step
        fed = data.two_groups(num_clients=10, samples_per_client=30, dim=6, seed=0)
        model = models.Logistic(6, fit_intercept=False)
        return (A.PERM(warmup_rounds=1, lam_alpha=100.0, lr=0.05, local_steps=2, single_loop=True, alpha_every=2),
                fed, model, {"clients_per_round": 6})
    if name == "perm_pooled":  # α over a pool of 4 clients (gathered from both ranks) and the own client
        fed = data.two_groups(num_clients=10, samples_per_client=30, dim=6, seed=0)
        model = models.Logistic(6, fit_intercept=False)
        return (A.PERM(warmup_rounds=1, lam_alpha=100.0, lr=0.05, local_steps=2, single_loop=True, alpha_every=2,
                       alpha_pool=4), fed, model, {"clients_per_round": 6})
    if name == "ifca":
        fed, model = _synthetic()
        return A.IFCA(num_clusters=2, lr=0.1, local_steps=2), fed, model, {"clients_per_round": 6}
    if name == "l2sgd":
        fed, model = _synthetic()
        return A.L2SGD(lam=0.5, p=0.3, lr=0.5, iterations=4), fed, model, {}
    if name == "ditto":
        fed, model = _synthetic()
        return A.Ditto(lam=0.5, lr=0.1, local_steps=2), fed, model, {"clients_per_round": 6}
    if name == "apfl":
        fed, model = _synthetic()
        return A.APFL(alpha=0.3, lr=0.1, local_steps=2, adaptive_alpha=True), fed, model, {"clients_per_round": 6}
    if name in ("dp_fedavg", "dp_fedpi"):  # tests/test_dp.py: the private release, bitwise on 1 and 2 ranks
        privacy = pflcore.Privacy(clip_norm=0.3, noise_multiplier=0.7, adaptive=True, count_noise=1.0)
        if name == "dp_fedavg":
            fed, model = _synthetic()
            return A.FedAvg(lr=0.1, local_steps=3), fed, model, {"clients_per_round": 6, "privacy": privacy}
        fed = data.least_squares(num_clients=9, samples_per_client=40, dim=5, seed=1)
        model = models.LeastSquares(5, fit_intercept=False)
        return A.FedPi(eta=0.5, prox_steps=5), fed, model, {"clients_per_round": 5, "privacy": privacy}
    raise ValueError(name)


CASES = ["fedavg", "localtrain", "pfedme", "fedpi_anderson", "cgpfl", "cgpfl_heur", "perm", "perm_single_loop", "perm_pooled",
         "ifca",
         "l2sgd", "ditto", "apfl"]


def outcome(res) -> dict:
    return {"history": strip(res.history), "clients": res.clients,
            "personalized": res.personalized, "global": res.global_model,
            "bytes": [row.get("bytes_sent_per_round") for row in res.history[1:]]}


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    comm = distributed.init(timeout=spec.get("timeout", 60))
    results = {}
    for name in spec["cases"]:
        alg, fed, model, kw = case(name)
        callbacks = ()
        if spec["mode"] == "die" and comm.rank == 1:
            def die(t, row, state):  # this rank vanishes mid-run, as a crashed process does
                if t == 2:
                    os._exit(3)
            callbacks = (die,)
        if spec["mode"] == "resume":
            res = pflcore.resume(os.path.join(spec["checkpoint"], name), progress=False)
        else:
            ck = spec.get("checkpoint")
            res = pflcore.run(alg, fed, model, rounds=spec["rounds"], seed=spec.get("seed", 0), eval_every=1,
                              progress=False, callbacks=callbacks,
                              checkpoint=os.path.join(ck, name) if ck else None,
                              checkpoint_every=spec.get("checkpoint_every"), **kw)
        results[name] = outcome(res)
    torch.save(results, os.path.join(spec["out"], f"rank{comm.rank}.pt"))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
