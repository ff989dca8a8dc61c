"""What every benchmark in bench/ shares: timing, machine and load info, JSON results, tables, plots.

The pytest-benchmark suite (``bench/test_*.py``) times with pytest-benchmark and uses this module
for machine info and the ratio plot; the process-level scripts (``algorithms.py``,
``server_steps.py``, ``distributed.py``, ``gpu.py``, ``peers.py``) use all of it, so that every
result file in ``bench/results/`` carries the same machine record and every table reads alike.

Timing rule (a 2-core machine shared with other processes): the best of several runs is the
figure (other processes only ever add time), ratios are taken between runs in one process, and
the 1-minute load average is recorded so that a reader can tell a quiet run from a busy one.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


# ---- timing -----------------------------------------------------------------------------------

@dataclass
class Timing:
    """Wall times of repeated runs of one function (seconds)."""
    times: List[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.times) if self.times else math.nan

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    def as_dict(self) -> Dict:
        return {"min_s": self.min, "median_s": self.median, "repeats": len(self.times), "times_s": self.times}


def time_runs(fn: Callable, repeats: int, setup: Optional[Callable] = None, sync: Optional[Callable] = None,
              warmup: int = 0) -> Timing:
    """Times ``fn(setup())`` (or ``fn()`` without ``setup``) ``repeats`` times after ``warmup``
    untimed calls; ``setup`` is not timed; ``sync`` (e.g. ``torch.cuda.synchronize``) is called
    before the clock starts and before it stops, so that asynchronous devices are measured."""
    def call():
        if setup is None:
            return None, fn
        arg = setup()
        return arg, (lambda: fn(arg))

    for _ in range(warmup):
        call()[1]()
    out = Timing()
    for _ in range(max(1, repeats)):
        _, run = call()
        if sync:
            sync()
        t0 = time.perf_counter()
        run()
        if sync:
            sync()
        out.times.append(time.perf_counter() - t0)
    return out


def best_of(fn: Callable, repeats: int, setup: Optional[Callable] = None, sync: Optional[Callable] = None,
            warmup: int = 0) -> float:
    """The best wall time of ``fn`` over ``repeats`` runs (see ``time_runs``)."""
    return time_runs(fn, repeats, setup, sync, warmup).min


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def environ(**values: Optional[str]) -> Iterator[None]:
    """The environment variables ``values`` set inside the block (None: unset); each restored on
    exit (unset if it was unset). For the variants an op reads from the environment at each call,
    e.g. PFLCORE_CUDA_GLM."""
    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Stopwatch:
    """Wraps attributes ``(owner, name)`` (functions of modules or classes) and adds up the
    seconds spent inside them while the block runs; restores them on exit."""

    def __init__(self, targets: Iterable):
        self.targets, self.seconds, self._saved = list(targets), 0.0, []

    def __enter__(self) -> "Stopwatch":
        for owner, name in self.targets:
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t0
            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


# ---- machine and load -------------------------------------------------------------------------

def loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        return None


def warn_if_busy(threshold: float = 0.5) -> Optional[float]:
    """Prints a warning when other processes keep the machine busy; returns the load average."""
    load = loadavg()
    if load is not None and load > threshold:
        print(f"warning: 1-minute load average is {load:.2f} before starting; other processes compete for the "
              f"{os.cpu_count()} cores and the timings will be noisy")
    return load


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def git_commit() -> Optional[str]:
    """HEAD of the checkout (``+dirty`` with uncommitted changes); ``PFLCORE_GIT_COMMIT`` when
    set (a copy of the tree without .git, e.g. on a lent GPU machine)."""
    if os.environ.get("PFLCORE_GIT_COMMIT"):
        return os.environ["PFLCORE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return (commit + ("+dirty" if dirty else "")) if commit else None


def machine_info() -> Dict:
    """Where a result was measured: CPU, threads, versions, pflcore's backends, commit, load."""
    info = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "git_commit": git_commit(), "loadavg_1min": loadavg()}
    try:
        import torch
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    cuda_device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        import pflcore
        from pflcore import backend
        info.update(pflcore=pflcore.__version__,
                    backends={k: [ok, why] for k, (ok, why) in backend.status().items()})
    except ImportError:  # pragma: no cover
        pass
    return info


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- results ----------------------------------------------------------------------------------

def write_json(path: str, results: Dict, *, machine: bool = True) -> str:
    """Writes ``results`` with a ``measured`` record (timestamp, machine, load) to ``path``."""
    if machine:
        results = {**results, "measured": {"timestamp": now(), **machine_info(), **results.get("measured", {})}}
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    return path


def _json_default(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "tolist"):
        return v.tolist()
    if hasattr(v, "__dataclass_fields__"):
        return asdict(v)
    return str(v)


def read_json(path: str) -> Dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ---- tables -----------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of a script's table: a time, a value (a ratio, a share, a difference), and an
    optional target the value must reach (``sense`` "ge": value >= target; "le": <=)."""
    name: str
    time_s: Optional[float] = None
    value: Optional[float] = None
    target: Optional[float] = None
    sense: Optional[str] = None

    @property
    def passed(self) -> Optional[bool]:
        if self.sense is None or self.value is None or self.target is None:
            return None
        return self.value >= self.target if self.sense == "ge" else self.value <= self.target

    def as_dict(self) -> Dict:
        return {**asdict(self), "passed": self.passed}


def rows_from(tuples: Iterable[Sequence]) -> List[Row]:
    """Rows from ``(name, time, value, target, sense)`` tuples."""
    return [t if isinstance(t, Row) else Row(*t) for t in tuples]


def passed(value, target, sense) -> Optional[bool]:
    return Row("", None, value, target, sense).passed


def print_table(rows: Iterable) -> None:
    rows = rows_from(rows)
    width = max([52] + [len(r.name) for r in rows])
    print(f"\n{'benchmark':<{width}} {'time [s]':>10} {'value':>10} {'target':>10}  result")
    print("-" * (width + 40))
    for r in rows:
        ts = f"{r.time_s:10.4f}" if r.time_s is not None else " " * 10
        vs = f"{r.value:10.3g}" if r.value is not None else " " * 10
        tg = f"{'>=' if r.sense == 'ge' else '<='}{r.target:g}".rjust(10) if r.sense else " " * 10
        ok = r.passed
        print(f"{r.name:<{width}} {ts} {vs} {tg}  {'' if ok is None else 'PASS' if ok else 'FAIL'}")


# ---- plots ------------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_ratio_groups(groups: Dict[str, Dict[str, float]], path: str, *, title: str, xlabel: str,
                      baseline: Optional[str] = None) -> Optional[str]:
    """A horizontal bar chart per group: ``groups[group][label] = ratio`` (1 = the group's
    baseline, drawn as a line). Log scale when the ratios span more than 20x. Returns the path,
    or None when matplotlib is missing (the ``plot`` extra)."""
    plt = _pyplot()
    if plt is None or not groups:
        return None
    n = sum(len(v) for v in groups.values()) + len(groups)
    fig, ax = plt.subplots(figsize=(10, 0.28 * n + 1.6))
    y, ticks, labels, colors = 0, [], [], []
    values = []
    palette = {"pflcore": "tab:green", "peer": "tab:orange", "base": "tab:gray"}  # pflcore's backends / others
    for group, bars in groups.items():
        ax.text(0.0, y, group, transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=8,
                fontweight="bold")
        y += 1
        for label, ratio in bars.items():
            kind = "base" if label == baseline else (
                "pflcore" if label.startswith(("native", "cuda", "triton", "reference", "pflcore")) else "peer")
            ticks.append(y)
            labels.append(label)
            values.append(ratio)
            colors.append(palette[kind])
            y += 1
    ax.barh(ticks, values, color=colors, left=0)
    for t, v in zip(ticks, values):
        ax.text(v, t, f" {v:.3g}", va="center", fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y - 0.5, -0.5)
    finite = [v for v in values if v and v > 0 and math.isfinite(v)]
    log = bool(finite) and max(finite) / min(finite) > 20
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel + (" (log scale)" if log else ""))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
