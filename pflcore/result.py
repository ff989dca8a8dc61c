"""The outcome of ``pflcore.run``: per-evaluation history, final models and state (DESIGN.md §5)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

def _finite_or_none(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_or_none(x) for x in v]
    return v


def strict_json(obj, indent: int = 1) -> str:
    """``obj`` as JSON that every parser reads: a NaN or infinity (which ``json.dumps`` would
    write as the bare tokens ``NaN``/``Infinity``, outside the JSON standard) becomes null."""
    return json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)


def metric(row: Dict[str, Any], key: str):
    """``row[key]``; ``"acc"`` is the test accuracy of the model each client uses: its
    personalized model's, or the global model's for algorithms without personalized models."""
    if key == "acc":
        return row.get("personalized_acc") if row.get("personalized_acc") is not None else row.get("global_acc")
    return row.get(key)


LABELS = {"acc": "test accuracy of the model each client uses"}


# Columns of Result.table(), in order, with their formats.
_TABLE = [("round", "{:d}"), ("personalized_acc", "{:.4f}"), ("global_acc", "{:.4f}"), ("train_loss", "{:.4g}"),
          ("stat_error_local", "{:.4g}"), ("stat_error_global", "{:.4g}"), ("optimality_gap", "{:.3g}"),
          ("residual", "{:.3g}"),
          ("seconds", "{:.3f}"), ("client_steps_per_s", "{:.3g}")]


@dataclass
class Result:
    algorithm: str
    history: List[Dict[str, Any]]
    personalized: Optional[torch.Tensor]
    global_model: Optional[torch.Tensor]
    state: Any
    config: Dict[str, Any] = field(default_factory=dict)
    # Sharded runs: the clients [lo, hi) whose rows ``personalized`` and ``state`` hold on this
    # rank (None or (0, m): all of them).
    clients: Optional[Tuple[int, int]] = None
    # A run that stopped on NaN/inf: {"round": t, "reason": ...} (history: the rows before it).
    diverged: Optional[Dict[str, Any]] = None

    def final(self, key: str, default=None):
        """The last recorded value of a metric (``"acc"``: see ``metric``)."""
        for row in reversed(self.history):
            if metric(row, key) is not None:
                return metric(row, key)
        return default

    def to_dict(self) -> Dict[str, Any]:
        out = {"algorithm": self.algorithm, "config": self.config, "history": self.history}
        if self.diverged is not None:
            out["diverged"] = self.diverged
        return out

    def to_json(self, path: Optional[str] = None) -> str:
        """The history and configuration as strict JSON (a NaN or infinity written as null); also
        to ``path``."""
        text = strict_json(self.to_dict())
        if path:
            with open(path, "w") as fh:
                fh.write(text)
        return text

    def table(self, every: int = 1) -> str:
        cols = [(k, f) for k, f in _TABLE if any(r.get(k) is not None for r in self.history)]
        lines = [" ".join(f"{k:>18}" for k, _ in cols)]
        for row in self.history[::every]:
            cells = []
            for k, fmt in cols:
                v = row.get(k)
                cells.append(f"{fmt.format(v) if v is not None else '-':>18}")
            lines.append(" ".join(cells))
        return "\n".join(lines)

    def plot(self, path: str, keys=("personalized_acc", "global_acc")) -> str:
        """Curves of ``keys`` against the round, as a PNG (needs matplotlib: extra ``plot``)."""
        return plot_results({self.algorithm: self}, path, keys)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or an ImportError that says what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'pflcore[plot]'") from exc
    return plt


def finish_axes(ax, xlabel: str, ylabel: str, log_y: bool) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(LABELS.get(ylabel, ylabel.replace("_", " ")))
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_results(results: Dict[str, "Result"], path: str, keys=("personalized_acc", "global_acc")) -> str:
    plt = pyplot()
    keys = [k for k in keys if any(r.final(k) is not None for r in results.values())]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(5.5 * max(1, len(keys)), 4), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(results)}  # one color per run in every panel
    for ax, key in zip(axes[0], keys):
        for label, res in results.items():
            pts = [(r["round"], metric(r, key)) for r in res.history if metric(r, key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=label + (" (diverged)" if res.diverged else ""), color=colors[label],
                        linestyle="--" if "+Anderson" in res.algorithm or "+AA" in label else "-")
        finish_axes(ax, "round", key, key in ("optimality_gap", "residual") or key.startswith("stat_error"))
    return save_figure(fig, path)


def plot_matrix(matrix, path: str, title: str, xlabel: str = "client j", ylabel: str = "model i") -> str:
    """A heat-map of a ``[m, k]`` matrix (e.g. PERM's mixing weights α) as a PNG."""
    plt = pyplot()
    values = matrix.detach().cpu().double().numpy()
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    image = ax.imshow(values, cmap="viridis", interpolation="nearest", aspect="auto")
    fig.colorbar(image, ax=ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return save_figure(fig, path)
