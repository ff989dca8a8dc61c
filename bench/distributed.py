"""Communication volume of sharded runs (issue 8), and a weak-scaling smoke test.

What is measured: for each algorithm, the bytes each rank hands to collectives per round
(``Result.history[t]["bytes_sent_per_round"]``, counted by ``pflcore.distributed.TorchComm``:
the payload of every all-reduce, all-gather, broadcast and point-to-point send the rank takes
part in; a ring all-reduce moves about twice that on the wire), with 2 gloo ranks on this
machine, at 32, 128 and 512 clients per rank. The metrics' reductions after a round are not
counted (they are a few dozen scalars).

Workload: ``data.synthetic(0.5, 0.5)`` (dim 60, 10 classes, sizes capped at 200 rows),
``Softmax(60, 10)`` (d = 610), all clients every round, 4 rounds:
FedAvg (5 local steps), pFedMe (R = 5, K = 5), FedPi + Anderson (memory 3, the grand scheme's
per-client state), CGPFL (K = 4; round 1 seeds k-means++ with 3 restarts), IFCA (K = 4) and
PERM (1 warm-up round of FedAvg, then shuffling; α computed at round 2; λ_α = 10⁶ so that
the weights spread and models travel).

Expected: every server step is a reduction of a [d]- or [K, d]-sized sum, so the bytes per
round do not depend on the clients per rank, except PERM, whose α needs every client's
gradient (an all-gather of [m, d]) and whose personalized models travel to the clients they
visit (about m_local·(d + 2)·8 bytes per shuffling round): PERM's traffic is per client by
design. CGPFL's first round seeds k-means++ (restarts, each a different number of Lloyd
iterations of [K, d + 1] float64), later rounds warm-start. The table says which rows stay
constant, over all rounds and from round 2 on.

Weak scaling (smoke only: 2 cores): seconds per round of FedAvg with 256 clients per rank on 1
and 2 ranks.

    python bench/distributed.py           # ~2 minutes on 2 cores
    python bench/distributed.py --quick   # 8 and 32 clients per rank

Writes ``--out`` (default bench/results/distributed.json).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALGORITHMS = ["FedAvg", "pFedMe", "FedPi+Anderson", "CGPFL", "IFCA", "PERM"]


def build(name: str, m: int):
    import pflcore.algorithms as A
    from pflcore import data, models

    fed = data.synthetic(0.5, 0.5, num_clients=m, dim=60, num_classes=10, seed=0, size_scale=1, max_size=200)
    model = models.Softmax(60, 10)
    alg = {
        "FedAvg": lambda: A.FedAvg(lr=0.05, local_steps=5, batch_size=20),
        "pFedMe": lambda: A.PFedMe(lam=15, lr=0.005, personal_lr=0.01, inner_steps=5, local_rounds=5, batch_size=20),
        "FedPi+Anderson": lambda: A.Accelerated(A.FedPi(eta=0.1, prox_steps=5), memory=3),
        "CGPFL": lambda: A.CGPFL(num_contexts=4, lam=12.0, beta=0.005, lr=0.005, inner_steps=5, local_rounds=2,
                                 restarts=3),
        "IFCA": lambda: A.IFCA(num_clusters=4, lr=0.05, local_steps=5),
        # a large λ_α spreads each client's weights over many others, so models do travel
        "PERM": lambda: A.PERM(warmup_rounds=1, lam_alpha=1e6, lr=0.05, local_steps=5, batch_size=20),
    }[name]()
    return alg, fed, model


def worker(spec_path: str) -> None:
    """One rank: runs the algorithms of the spec and writes its per-round bytes and times."""
    import pflcore
    from pflcore import distributed

    with open(spec_path) as fh:
        spec = json.load(fh)
    comm = distributed.init(timeout=300)
    out = {}
    for name in spec["algorithms"]:
        alg, fed, model = build(name, spec["m"])
        res = pflcore.run(alg, fed, model, rounds=spec["rounds"], eval_every=1, progress=False, comm=comm)
        out[name] = {"bytes": [row.get("bytes_sent_per_round", 0.0) for row in res.history[1:]],
                     "seconds": [row["seconds"] for row in res.history[1:]], "clients": list(res.clients)}
    with open(os.path.join(spec["out"], f"rank{comm.rank}.json"), "w") as fh:
        json.dump(out, fh)
    if comm.world > 1:
        distributed.shutdown()


def launch(world: int, m: int, algorithms, rounds: int, tmp: str, threads: int):
    spec = {"m": m, "algorithms": algorithms, "rounds": rounds, "out": tempfile.mkdtemp(dir=tmp)}
    path = os.path.join(spec["out"], "spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
        if world == 1:
            env.pop("WORLD_SIZE")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", path], env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
    return [json.load(open(os.path.join(spec["out"], f"rank{r}.json"))) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "distributed.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from _harness import warn_if_busy, write_json  # the workers need none of it

    warn_if_busy()
    per_rank = [8, 32] if args.quick else [32, 128, 512]
    tmp = tempfile.mkdtemp(prefix="pflcore_bench_dist_")
    table = {}
    t0 = time.perf_counter()
    for n in per_rank:
        ranks = launch(2, 2 * n, ALGORITHMS, args.rounds, tmp, threads=1)
        for name in ALGORITHMS:
            table.setdefault(name, {})[n] = [r[name]["bytes"] for r in ranks]
    weak_n = 64 if args.quick else 256
    one = launch(1, weak_n, ["FedAvg"], args.rounds, tmp, threads=1)[0]["FedAvg"]["seconds"]
    two = launch(2, 2 * weak_n, ["FedAvg"], args.rounds, tmp, threads=1)[0]["FedAvg"]["seconds"]

    print(f"\nbytes sent per round by each rank (2 gloo ranks, Softmax 60x10, d = 610); rounds 1..{args.rounds}")
    head = f"{'algorithm':<16}" + "".join(f"{f'{n} clients/rank (rank 0 | rank 1)':>52}" for n in per_rank)
    print(head + "  constant? (all rounds / from round 2)")
    rows = []
    for name in ALGORITHMS:
        cells, constant, later = [], True, True
        base = table[name][per_rank[0]]
        for n in per_rank:
            r0, r1 = table[name][n]
            cells.append(f"{' '.join(f'{b / 1e3:.1f}' for b in r0)} | {' '.join(f'{b / 1e3:.1f}' for b in r1)} kB")
            constant &= table[name][n] == base
            later &= [r[1:] for r in table[name][n]] == [r[1:] for r in base]
        print(f"{name:<16}" + "".join(f"{c:>52}" for c in cells)
              + f"  {'yes' if constant else 'no'} / {'yes' if later else 'no'}")
        rows.append({"algorithm": name, "bytes_per_round": {str(n): table[name][n] for n in per_rank},
                     "constant_in_clients_per_rank": constant, "constant_from_round_2": later})
    print(f"\nweak scaling smoke (FedAvg, {weak_n} clients per rank, 1 thread per rank): "
          f"1 rank {min(one):.4f} s/round, 2 ranks {min(two):.4f} s/round (2 cores: a smoke test, not a scaling claim)")
    result = {"rounds": args.rounds,
              "clients_per_rank": per_rank, "d": 610, "rows": rows,
              "weak_scaling": {"clients_per_rank": weak_n, "seconds_per_round_1_rank": one,
                               "seconds_per_round_2_ranks": two},
              "seconds": time.perf_counter() - t0}
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
