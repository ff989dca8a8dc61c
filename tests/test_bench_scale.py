"""bench/scale.py end to end on a tiny federation: it reaches into run's round loop (to time each
evaluation and give each round its own peak memory), so a change there must not break it
silently. No timing is asserted (performance figures come from the script itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_scale_runs_and_records_every_phase(tmp_path):
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "scale.py"), "--clients", "300", "--rounds", "2",
                        "--cohort", "40", "--profile", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (row,) = res["scale"]["rows"]
    assert row["m"] == 300 and row["rows"] == 300 * 20 and row["cohort"] == 40
    assert row["data_bytes"] > 300 * 20 * 60 * 4 and row["peak_rss"] > row["data_bytes"]
    for name in ("FedAvg", "pFedMe"):
        alg = row["algorithms"][name]
        assert len(alg["round_s_all"]) == 2 and all(t > 0 for t in alg["round_s_all"])
        assert len(alg["evaluate_s_all"]) == 3  # rounds 0, 1, 2
        assert alg["peak_added_round"] is not None, "run's rounds were not wrapped (pflcore.run._round changed?)"
        assert any("evaluate_round" in line for line in alg["profile"]["evaluate"])
    phases = [p["phase"] for p in row["phases"]]
    assert phases[0] == "generate" and "pFedMe round 2" in phases and "FedAvg evaluate (round 0)" in phases
    assert os.path.exists(tmp_path / "scale.png") or "matplotlib not installed" in r.stdout
