"""pytest configuration of the benchmark suite (``pytest bench --benchmark-only``).

Options added here:
  --bench-quick        leave out the 10,000-client sizes and the full-batch group (what
                       ``pflcore bench --quick`` runs);
  --bench-only NAME    run only the benchmarks of an op (``local_steps``, ``kmeans``, ...: exact),
                       or whose group or test id contains NAME (repeatable);
  --bench-keep-data    keep every round's time in the JSON (by default only the statistics).
The machine record of the JSON gets the CPU model, torch's threads, pflcore's backends, the git
commit and the load average (bench/_harness.py).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import pytest_benchmark  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise pytest.UsageError("bench/ is a pytest-benchmark suite: pip install '.[bench]' (or pytest-benchmark)") from e

import _harness  # noqa: E402
import _suite  # noqa: E402

OPS = ("local_steps", "gradients", "evaluate", "sample_batches", "kmeans_assign", "kmeans", "anderson", "average",
       "water_fill", "small_calls", "reference_points", "cnn_step")


def pytest_addoption(parser):
    group = parser.getgroup("pflcore bench")
    group.addoption("--bench-quick", action="store_true", default=False,
                    help="leave out the 10,000-client sizes and the full-batch local_steps group")
    group.addoption("--bench-only", action="append", default=[], metavar="NAME",
                    help=f"only the benchmarks of op NAME ({', '.join(OPS)}) or whose group/test id contains NAME")
    group.addoption("--bench-keep-data", action="store_true", default=False,
                    help="keep every round's time in --benchmark-json (default: the statistics only; the raw "
                         "times of a full run are ~10 MB)")


def _op_of(item) -> str:
    marker = item.get_closest_marker("op")
    return marker.args[0] if marker else ""


def _size_of(item) -> str:
    spec = getattr(item, "callspec", None)
    return spec.params.get("size", "") if spec else ""


def pytest_configure(config):
    config.addinivalue_line("markers", "op(name): the pflcore op a benchmark measures")
    config.addinivalue_line("markers", "large: left out by --bench-quick")


def pytest_collection_modifyitems(config, items):
    quick, only = config.getoption("--bench-quick"), config.getoption("--bench-only")
    keep, drop = [], []
    for item in items:
        large = _size_of(item) in _suite.LARGE or item.get_closest_marker("large") is not None
        wanted = not only or any(
            name == _op_of(item) if name in OPS else name in item.nodeid for name in only)
        (keep if wanted and not (quick and large) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True, scope="module")
def _release_workloads():
    yield
    _suite.release()


def pytest_sessionstart(session):
    session.config._bench_load_start = _harness.loadavg()


def pytest_benchmark_update_machine_info(config, machine_info):
    # What stays the same between runs on one machine (--benchmark-compare warns when it differs);
    # the load and the commit go to the JSON's "load" and pytest-benchmark's "commit_info".
    machine_info.update({k: v for k, v in _harness.machine_info().items() if k not in ("loadavg_1min", "git_commit")})


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["load"] = {"loadavg_1min_start": getattr(config, "_bench_load_start", None),
                           "loadavg_1min_end": _harness.loadavg()}
    if not config.getoption("--bench-keep-data"):
        for bench in output_json.get("benchmarks", []):
            bench.get("stats", {}).pop("data", None)
