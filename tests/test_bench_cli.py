"""``pflcore bench``: runs the pytest-benchmark suite of bench/ and summarizes it (ratios, PNG)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pflcore import bench_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ratios_are_over_the_groups_baseline():
    report = {"benchmarks": [
        {"name": "a", "group": "g", "stats": {"min": 2e-3}, "extra_info": {"impl": "native", "baseline": True,
                                                                          "gflops_per_s": 5.0}},
        {"name": "b", "group": "g", "stats": {"min": 6e-3}, "extra_info": {"impl": "torch_loop"}},
        {"name": "c", "group": "h", "stats": {"min": 1.0}, "extra_info": {"impl": "torch matmul"}},
    ]}
    groups = bench_cli.ratios(report)
    assert groups["g"]["native"]["ratio"] == 1.0
    assert groups["g"]["torch_loop"]["ratio"] == pytest.approx(3.0)
    assert groups["h"]["torch matmul"]["ratio"] is None  # no baseline in the group: no ratio


def test_default_output_names_say_what_ran(tmp_path):
    suite = str(tmp_path)
    assert bench_cli.default_out(suite, False, None).endswith(os.path.join("results", "suite.json"))
    assert bench_cli.default_out(suite, True, None).endswith("suite_quick.json")
    assert bench_cli.default_out(suite, True, ["local_steps", "a b"]).endswith("suite_quick_only-local_steps-a_b.json")


def test_without_a_suite_it_says_where_the_suite_lives(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pflcore", "bench", "--suite", str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no benchmark suite at" in r.stderr and "source checkout" in r.stderr


def test_quick_run_of_one_group_prints_ratios_and_writes_json_and_png(tmp_path):
    pytest.importorskip("pytest_benchmark")
    out = tmp_path / "suite.json"
    r = subprocess.run([sys.executable, "-m", "pflcore", "bench", "--quick", "--only", "average", "--out", str(out),
                        "--suite", os.path.join(ROOT, "bench"), "--", "-k", "1k and (native or numpy)"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    impls = {b["extra_info"]["impl"] for b in report["benchmarks"]}
    assert impls == {"native", "numpy"}
    assert all(b["group"].startswith("average: 1,000 clients") for b in report["benchmarks"])
    assert "ratios: best time / the group's baseline" in r.stdout and "numpy" in r.stdout
    assert report["machine_info"]["backends"]["native"][0] is True  # the suite's machine record
    png = tmp_path / "suite.png"
    if "no PNG" not in r.stdout:
        assert png.stat().st_size > 1000
