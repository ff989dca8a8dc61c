"""bench/gpu.py without a GPU (its measurements need one): one command that exits 0 with a
clear message, and the pass/fail logic of its table. `python bench/gpu.py --dry-run` runs
every measurement's code path on the CPU (minutes under the Triton interpreter: not here)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import gpu_workloads as W  # noqa: E402


def _run_without_a_gpu(script, out):
    """``bench/<script> --out <out>`` in a subprocess: (its stdout); it must exit 0 and write nothing."""
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not out.exists(), "nothing measured, nothing written"
    return r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures (minutes)")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    stdout = _run_without_a_gpu("gpu.py", tmp_path / "gpu.json")
    assert "no CUDA device is visible to torch" in stdout and "--dry-run" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures")
def test_the_overheads_benchmark_without_a_gpu_says_so_and_exits_0(tmp_path):
    assert "no CUDA device" in _run_without_a_gpu("gpu_overheads.py", tmp_path / "over.json")


def test_table_rows_apply_the_targets():
    res = {"kernel_backend": "cuda",
           "small_call": {"cuda_s": 140e-6, "cuda_warp_rows_s": 150e-6},
           "local_steps": [{"m": 10_000, "ref_clients": 200, "bound": "bandwidth", "fraction_of_bound": 0.62,
                            "speedup_vs_reference": 9.5, "triton_over_cuda_time": 1.3},
                           {"m": 10_000, "batch_size": 20, "ref_clients": 200, "bound": "bandwidth",
                            "fraction_of_bound": 0.3}],
           "evaluate": {"m": 100_000, "N": 35_000_000, "cuda_s": 0.004},
           "kmeans_assign": [{"N": 100_000, "K": 16, "d": 610, "target": 1.5, "speedup_vs_cdist": 1.4},
                             {"N": 100_000, "K": 64, "d": 7_850, "target": 2.0, "speedup_vs_cdist": 2.4}],
           "server_ops": {"average": {"m": 100_000, "d": 610, "served_by": "cuda", "fraction_of_copy_bandwidth": 0.7}},
           "anderson": {"rows": 10_000, "d": 7_850}}
    rows = {r["name"]: r for r in W.table_rows(res)}
    assert rows["local_steps 1 client, 1 step: cuda wall per call"]["pass"] is False  # 140 us > 100 us
    variant = rows["local_steps 1 client, 1 step, PFLCORE_CUDA_GLM=warp_rows: wall per call"]  # no target
    assert variant["value"] == 150e-6 and variant["target"] is None and variant["pass"] is None
    assert rows["local_steps m=10,000 full batch: cuda fraction of the bandwidth floor"]["pass"] is True
    assert rows["local_steps m=10,000 B=20: cuda fraction of the bandwidth floor"]["pass"] is False
    speed = [r for n, r in rows.items() if n.startswith("local_steps m=10,000 full batch: cuda speed-up vs torch")]
    assert len(speed) == 1 and speed[0]["pass"] is False and speed[0]["target"] == 10.0
    assert rows["evaluate m=100,000 (35,000,000 rows): cuda time"]["pass"] is True  # 4 ms <= 50 ms
    assert rows["kmeans_assign N=100,000 K=16 d=610: cuda speed-up vs cdist+argmin"]["pass"] is False
    assert rows["kmeans_assign N=100,000 K=64 d=7,850: cuda speed-up vs cdist+argmin"]["pass"] is True
    assert rows["kmeans_assign N=100,000 K=64: triton time / cuda time"]["value"] is None  # not measured
    assert rows["kmeans_assign N=100,000 K=64: triton time / cuda time"]["pass"] is None
    assert rows["average 100,000x610: cuda bytes/s / copy bandwidth"]["pass"] is True
    W.print_table(list(rows.values()))  # every kind of row formats


def test_local_steps_bytes_counts_k_passes_over_the_data():
    # m = 2 clients, N = 10 rows, p = 3, d = 8, K = 4: 4·10·(12 + 8) + 2·2·8·4 + 8·4 + 3·8 + 2·8
    assert W.local_steps_bytes(2, 10, 3, 8, 4) == 800 + 128 + 32 + 24 + 16
    # B = 5 rows a step: 4·(2·5)·(12 + 8 + 4) instead of the K passes over all rows
    assert W.local_steps_bytes(2, 10, 3, 8, 4, batch_size=5) == 960 + 128 + 32 + 24 + 16
    assert W.local_steps_flops(10, 8, 4) == 4 * 10 * 2 * 2 * 8


def test_the_federation_benchmark_runs_its_code_paths_on_the_cpu(tmp_path):
    """bench/gpu_federation.py --dry-run: both algorithms at both cohort sizes on a tiny
    federation (the GPU columns need a GPU), results written; without a GPU and without
    --dry-run it says so and exits 0."""
    import json
    out = tmp_path / "fed.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_federation.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    runs = json.loads(out.read_text())["runs"]
    assert {(x["algorithm"].split("(")[0], x["clients_per_round"]) for x in runs} == \
        {("FedAvg", 5), ("FedAvg", 50), ("PFedMe", 5), ("PFedMe", 50)}
    assert all(x["round_s"] > 0 and x["evaluate_s"] > 0 and x["device"] == "cpu" for x in runs)
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_federation.py"), "--out", str(out) + "2"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "no CUDA device" in r.stdout
        assert not os.path.exists(str(out) + "2")


def test_the_round_profile_runs_its_code_paths_on_the_cpu(tmp_path):
    """bench/gpu_round_profile.py --dry-run: both algorithms' rounds profiled on the CPU (host
    counts; kernel times need a GPU) and the local_steps latencies, results written; without a
    GPU and without --dry-run it says so and exits 0."""
    import json
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_round_profile.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [run["algorithm"].split("(")[0] for run in res["runs"]] == ["FedAvg", "PFedMe"]
    for run in res["runs"]:
        assert run["round_wall_s"] > 0 and run["host_counts_per_round"]["top-level aten ops"] > 0
    # pFedMe's 20 local rounds each issue their own ops: many more than FedAvg's one call
    fedavg, pfedme = (run["host_counts_per_round"]["top-level aten ops"] for run in res["runs"])
    assert pfedme > 5 * fedavg
    # clients 0..k-1 and k sampled clients, FedAvg's call and pFedMe's (default kernel on the CPU)
    assert [(c["clients"], c["steps"]) for c in res["local_steps"]] == [("first", 20), ("first", 5), ("sampled", 20),
                                                                         ("sampled", 5)]
    assert all(c["median_s"] > 0 for c in res["local_steps"])
    if not torch.cuda.is_available():
        assert "no CUDA device" in _run_without_a_gpu("gpu_round_profile.py", tmp_path / "none.json")
