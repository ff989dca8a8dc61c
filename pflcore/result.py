"""The outcome of ``pflcore.run``: per-evaluation history, final models and state (DESIGN.md §5)."""
from __future__ import annotations

import json
import math
import statistics
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
    if key in ("acc", "acc_p10"):  # acc_p10: the 10th percentile over clients of the same accuracy
        tail = key[3:]
        mine = row.get("personalized_acc" + tail)
        return mine if mine is not None else row.get("global_acc" + tail)
    return row.get(key)


LABELS = {"acc": "test accuracy of the model each client uses",
          "acc_p10": "10th percentile over clients of acc (the worst-served tenth), mean over seeds"}


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


def seed_curve(runs: List["Result"], key: str) -> Optional[Dict[str, Any]]:
    """What ``plot_results`` draws for one method: the mean of ``key`` over its seeds at the
    rounds all of them recorded, with the sample std (ddof=1; None for one seed). Diverged seeds
    are left out (their histories stop early and would drag the mean), unless every seed
    diverged. None when no round has a value."""
    used = [r for r in runs if r.diverged is None] or list(runs)
    series = [{row["round"]: metric(row, key) for row in res.history if metric(row, key) is not None}
              for res in used]
    rounds = sorted(set(series[0]).intersection(*series[1:])) if series else []
    if not rounds:
        return None
    mean = [statistics.fmean(s[t] for s in series) for t in rounds]
    std = [statistics.stdev(s[t] for s in series) for t in rounds] if len(series) > 1 else None
    return {"rounds": rounds, "mean": mean, "std": std, "n": len(used), "of": len(runs),
            "diverged": any(r.diverged is not None for r in runs)}


def _curve_label(label: str, curve: Dict[str, Any]) -> str:
    if curve["of"] == 1:
        return label + (" (diverged)" if curve["diverged"] else "")
    if curve["n"] < curve["of"]:
        return f"{label} ({curve['n']} of {curve['of']} seeds; {curve['of'] - curve['n']} diverged, left out)"
    return label + (f" (all {curve['n']} seeds diverged)" if curve["diverged"] else "")


def plot_results(results: Dict[str, Any], path: str, keys=("personalized_acc", "global_acc")) -> str:
    """Curves of ``keys`` against the round, one per method: ``results`` maps a label to a Result
    or to the Results of its seeds. Several seeds: the mean per round with a band of ± 1 sample
    std, the title saying so and n (``seed_curve``)."""
    plt = pyplot()
    runs = {label: list(r) if isinstance(r, (list, tuple)) else [r] for label, r in results.items()}
    keys = [k for k in keys if any(r.final(k) is not None for rs in runs.values() for r in rs)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(5.5 * max(1, len(keys)), 4), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}  # one color per run in every panel
    for ax, key in zip(axes[0], keys):
        for label, rs in runs.items():
            curve = seed_curve(rs, key)
            if curve is None:
                continue
            dashed = "+Anderson" in rs[0].algorithm or "+AA" in label
            ax.plot(curve["rounds"], curve["mean"], label=_curve_label(label, curve), color=colors[label],
                    linestyle="--" if dashed else "-")
            if curve["std"] is not None:
                ax.fill_between(curve["rounds"], [m - s for m, s in zip(curve["mean"], curve["std"])],
                                [m + s for m, s in zip(curve["mean"], curve["std"])], color=colors[label],
                                alpha=0.2, linewidth=0)
        finish_axes(ax, "round", key, key in ("optimality_gap", "residual") or key.startswith("stat_error"))
    seeds = max(len(rs) for rs in runs.values()) if runs else 1
    if seeds > 1:  # one seed: no title, the figure as it always was
        fig.suptitle(f"mean over {seeds} seeds per round; band: ± 1 sample std (ddof=1)", fontsize=10)
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
