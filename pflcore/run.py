"""The round loop (DESIGN.md §5): sampling, evaluation, history, checkpoints, progress.

Sharded runs (``pflcore.distributed``): when torch.distributed is initialized with several
ranks (or a ``comm`` is passed), every rank calls ``run`` with the same whole federation; each
keeps its block of clients, the metrics are sums over the ranks (the same history on every
rank), a divergence on any rank stops every rank in the same round, and each rank writes its
part of a checkpoint.
"""
from __future__ import annotations

import inspect
import math
import os
import time
import warnings
from dataclasses import fields as dataclass_fields
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from pflcore import checkpoint as ckpt
from pflcore._checks import MAX_COUNT, all_finite
from pflcore._sampling import randperm_prefix
from pflcore import distributed, ops
from pflcore.algorithms.base import Algorithm, Context, state_tensors
from pflcore.data.federation import Federation
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet
from pflcore.errors import NonFiniteError
from pflcore.ops._args import inside
from pflcore.privacy import Mechanism, Privacy
from pflcore.result import Result


class DivergenceError(RuntimeError):
    """Parameters became NaN or infinite. ``algorithm``, ``round`` and ``reason`` say which, when
    and what; ``history`` holds the metrics recorded before it; ``all_ranks`` is False only when
    one rank of a sharded run found it alone (an op's check inside a round), so that its peers
    are still inside the round and the run cannot go on."""

    def __init__(self, message: str, *, algorithm: str = "", round: int = 0, reason: str = "",
                 all_ranks: bool = True, history: Optional[List[dict]] = None):
        super().__init__(message)
        self.algorithm, self.round, self.reason = algorithm, round, reason
        self.all_ranks, self.history = all_ranks, history

    def __reduce__(self):  # picklable with its attributes (e.g. out of a worker process)
        return (_rebuild_divergence, (self.args[0] if self.args else "", dict(vars(self))))


def _rebuild_divergence(message, attrs):
    err = DivergenceError(message)
    err.__dict__.update(attrs)
    return err


def global_optimum(fed: Federation, model: GLM):
    """(min_w F(w), argmin) of F = Σ p_i f_i when it can be found exactly, else None: least squares
    by the normal equations, logistic regression by Newton's method (float64)."""
    if not isinstance(model, GLM) or model.family not in ("least_squares", "logistic"):
        return None  # torch nets: non-convex, no exact optimum
    X, y = fed.train.x.double(), fed.train.y.double()
    if model.fit_intercept:
        X = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype, device=X.device)], 1)
    # row weights p_i / n_i turn the row sums into Σ p_i · mean over client i
    r = (fed.weights.double() / fed.train.sizes.double()).repeat_interleave(fed.train.sizes)
    eye = torch.eye(X.shape[1], dtype=X.dtype, device=X.device)

    def value(w):
        z = X @ w
        loss = 0.5 * (z - y) ** 2 if model.family == "least_squares" else torch.nn.functional.softplus(z) - y * z
        return float((r * loss).sum() + 0.5 * model.l2 * (w ** 2).sum())

    if model.family == "least_squares":
        w = torch.linalg.solve(X.T @ (X * r[:, None]) + model.l2 * eye, X.T @ (r * y))
        return value(w), w.to(fed.train.dtype)
    w = torch.zeros(X.shape[1], dtype=X.dtype, device=X.device)
    for _ in range(100):
        s = torch.sigmoid(X @ w)
        grad = X.T @ (r * (s - y)) + model.l2 * w
        if float(grad.norm()) < 1e-13:
            return value(w), w.to(fed.train.dtype)
        hess = X.T @ (X * (r * s * (1 - s))[:, None]) + model.l2 * eye
        w = w - torch.linalg.solve(hess, grad)
        if not bool(torch.isfinite(w).all()) or float(w.norm()) > 1e8:
            return None  # separable data without l2: no minimizer
    return None


def heterogeneity(fed: Federation, model: GLM, w_star: torch.Tensor) -> float:
    """(1/m) Σ_i ‖∇f_i(w*)‖² at the minimizer w* of the global objective."""
    return float((ops.gradients(model, w_star, fed.train).double() ** 2).sum(1).mean())


def _client_spread(correct: torch.Tensor, count: torch.Tensor, ctx: Context) -> dict:
    """Sample-weighted accuracy and the spread of the clients' accuracies (std, 10th percentile)
    over every rank's clients."""
    acc_i = correct.double() / count.double()
    acc = ctx.sum(float(correct.sum())) / ctx.sum(float(count.sum()))
    return {"acc": acc, "acc_std": distributed.std(acc_i, ctx.comm),
            "acc_p10": distributed.quantile(acc_i, 0.1, ctx.comm)}


def _ratio(num: torch.Tensor, den: torch.Tensor, ctx: Context) -> float:
    """Σ num / Σ den over the clients of every rank."""
    return ctx.sum(float(num.sum())) / ctx.sum(float(den.sum()))


# elements of the [chunk, d] buffer a metric works in: 4 MB of float32, reused from chunk to chunk
# (chunks of 65,536 rows made three fresh [65,536, 610] temporaries each: the stat error of FedAvg's
# global model at 10^5 clients took 139 of a 181 ms evaluation round, mostly their page faults)
_CHUNK_ELEMENTS = 1 << 20


def _mean_sq_error(models: torch.Tensor, truth: torch.Tensor, ctx: Context) -> float:
    """mean over all clients of ‖θ_i − θ*_i‖² (``models`` [m, d], or [1, d]: one for all), in
    chunks of clients through one reused buffer."""
    m, d = truth.shape
    err = torch.empty(m, dtype=models.dtype, device=models.device)
    rows = max(1, min(m, _CHUNK_ELEMENTS // max(1, d)))
    buf = torch.empty(rows, d, dtype=models.dtype, device=models.device)
    for c0 in range(0, m, rows):
        c1 = min(m, c0 + rows)
        mine = models if models.shape[0] == 1 else models[c0:c1]
        diff = buf[:c1 - c0]
        torch.sub(mine, truth[c0:c1].to(models), out=diff)
        torch.sum(diff.mul_(diff), 1, out=err[c0:c1])
    return float(err.mean()) if not ctx.sharded else ctx.sum(float(err.double().sum())) / ctx.num_clients


def _weights_part(model, d: int) -> Optional[slice]:
    """The slice of a GLM parameter row that holds its feature weights (the intercept row, last
    in the ``[P, C]`` layout, dropped) when that is ``d`` long, else None."""
    if isinstance(model, GLM) and model.p * model.C == d:
        return slice(0, d)
    return None


def truth_layout(model, truth_d: int) -> Optional[tuple]:
    """How a model's parameter rows compare with true models of length ``truth_d``: a pair of
    slices (of the model's row, of the truth's row), or None when they cannot be compared. The
    same layout compares whole; a GLM whose intercept the truth lacks (or the reverse: e.g.
    ``Logistic(p)``, intercept on by default, on ``data.logistic_truth``, whose truth has none)
    compares the feature weights only."""
    whole = slice(None)
    if truth_d == model.d:
        return whole, whole
    if isinstance(model, GLM):
        if model.fit_intercept and _weights_part(model, truth_d) is not None:
            return slice(0, truth_d), whole  # the model's extra intercept row is left out
        if not model.fit_intercept and truth_d == (model.p + 1) * model.C:
            return whole, slice(0, model.d)  # the truth's intercept row is left out
    return None


def _truth_warning(fed: Federation, model) -> Optional[str]:
    """Why stat_error_* cannot be recorded for this model, or None."""
    for name, truth in (("truth", fed.truth), ("truth_global", fed.truth_global)):
        if truth is not None and truth_layout(model, truth.shape[-1]) is None:
            layout = fed.meta.get("model", "an unnamed layout") if isinstance(fed.meta, dict) else "an unnamed layout"
            return (f"stat_error_local and stat_error_global are not recorded: the federation's true models "
                    f"({name}, d = {truth.shape[-1]}, layout of {layout}) and {model!r} (d = {model.d}) have "
                    "different parameters")
    return None


# The training loss is estimated on a fixed sample of the training rows: every client (at most
# TRAIN_SAMPLE_ROWS of them, fixed at the start) with TRAIN_SAMPLE_ROWS // m rows drawn once (at
# least 1, at most 32). The full loss would cost a pass over every training row at every
# evaluation: more than a FedAvg round itself. ``train_loss="full"`` computes it exactly.
TRAIN_SAMPLE_ROWS = 20_000
_SAMPLE_STREAM = 0xFFFFFFFF  # the stream of the sample's draw (rounds draw from streams 0, 1, ...)


def _train_sample(ctx: Context) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(local client rows [R] or None for all, int32 row indices [R, k]) of the training-loss
    sample, drawn once per run from the run's seed (the same clients and rows on every rank and
    after a resume)."""
    cached = getattr(ctx, "_train_sample", None)
    if cached is not None:
        return cached
    n = ctx.num_clients
    if n <= TRAIN_SAMPLE_ROWS:
        rows, k = None, min(32, max(1, TRAIN_SAMPLE_ROWS // n))
    else:  # a fixed subset of the clients, one row each
        chosen = randperm_prefix(n, TRAIN_SAMPLE_ROWS, (ctx.seed * 1_000_003 + 12_345) & 0x7FFFFFFFFFFFFFFF).sort().values
        lo = ctx.first_client
        rows = (chosen[(chosen >= lo) & (chosen < lo + ctx.m)] - lo).to(ctx.device)
        k = 1
    clients = rows if rows is not None else torch.arange(ctx.m, device=ctx.device)
    sample = ctx.batches(_SAMPLE_STREAM, _SAMPLE_STREAM, clients, 1, k)[:, 0]
    ctx._train_sample = (rows, ctx._mark(sample))
    return ctx._train_sample


def _train_loss(ctx: Context, theta: torch.Tensor, mode: str) -> Optional[float]:
    """Mean training loss of ``theta`` ([m, d], or [d] for every client): on the fixed sample, on
    every training row (``mode == "full"``), or None (``mode == "none"``)."""
    if mode == "none":
        return None
    if mode == "full":
        tl, _, tc = ctx.evaluate(theta)
        return _ratio(tl, tc, ctx)
    rows, sample = _train_sample(ctx)
    if rows is not None and theta.dim() == 2:
        # the sampled clients' models, gathered into a buffer kept for the run: a fresh [20,000, d]
        # copy each evaluation paid its page faults (10^5 clients, d = 610: 15-20 ms, reused 3-4)
        buf = getattr(ctx, "_train_theta", None)
        if buf is None or buf.shape != (rows.numel(), theta.shape[1]) or buf.dtype != theta.dtype \
                or buf.device != theta.device:
            buf = ctx._train_theta = torch.empty(rows.numel(), theta.shape[1], dtype=theta.dtype, device=theta.device)
        theta = torch.index_select(theta, 0, rows, out=buf)
    tl, _, tc = ctx.evaluate(theta, rows=rows, batches=sample)
    return _ratio(tl, tc, ctx)


def evaluate_round(algorithm: Algorithm, state, ctx: Context, t: int, train_loss: str = "sample",
                   models: Optional[tuple] = None) -> dict:
    """The metrics of DESIGN.md §5 for the current state (over every rank's clients): one
    evaluation call on the test data per model set (the personalized models; the global model,
    shared by every client without an [m, d] copy), the training loss on a fixed sample.
    ``models``: ``algorithm.evaluated_models(state, ctx)`` when the caller has it already."""
    row = {"round": t}
    model = ctx.model
    personal, w = algorithm.evaluated_models(state, ctx) if models is None else models
    ctx._evaluated = (t, personal, w)  # the run's result reuses the last round's
    fed = ctx.federation
    if personal is not None:
        personal = personal.contiguous()
        loss, correct, count = ctx.evaluate(personal, data=ctx.test)
        st = _client_spread(correct, count, ctx)
        row.update(personalized_acc=st["acc"], personalized_acc_std=st["acc_std"],
                   personalized_acc_p10=st["acc_p10"], personalized_loss=_ratio(loss, count, ctx))
        row["train_loss"] = _train_loss(ctx, personal, train_loss)
        if fed.truth is not None and (lay := truth_layout(model, fed.truth.shape[1])) is not None:
            row["stat_error_local"] = _mean_sq_error(personal[:, lay[0]], fed.truth[:, lay[1]], ctx)
    if w is not None:
        loss, correct, count = ctx.evaluate(w, data=ctx.test)
        st = _client_spread(correct, count, ctx)
        row.update(global_acc=st["acc"], global_acc_std=st["acc_std"], global_acc_p10=st["acc_p10"],
                   global_loss=_ratio(loss, count, ctx))
        if personal is None:
            row["train_loss"] = _train_loss(ctx, w, train_loss)
            if fed.truth is not None and (lay := truth_layout(model, fed.truth.shape[1])) is not None:
                row["stat_error_local"] = _mean_sq_error(w[None, lay[0]], fed.truth[:, lay[1]], ctx)  # all use w
        if fed.truth_global is not None and (lay := truth_layout(model, fed.truth_global.shape[0])) is not None:
            row["stat_error_global"] = float(((w[lay[0]] - fed.truth_global[lay[1]].to(w)) ** 2).sum())
    if w is not None and ctx.f_star is not None:
        tl, _, tc = ctx.evaluate(w)
        F = ctx.sum(float((fed.weights.double() * (tl.double() / tc.double())).sum())) \
            + 0.5 * model.l2 * float((w.double() ** 2).sum())
        row["optimality_gap"] = F - ctx.f_star
    if row.get("train_loss", 0) is None:
        del row["train_loss"]
    if not model.is_classifier:  # accuracies are meaningless for regression
        for k in [k for k in row if "acc" in k]:
            del row[k]
    residual = algorithm.residual(state)
    if residual is not None:
        row["residual"] = residual
    return row


def _diverged(algorithm: Algorithm, t: int, what: str, saved: Optional[str], all_ranks: bool = True) -> DivergenceError:
    """``saved``: where the last checkpoint of this run was written ("round T in DIR"), if any."""
    where = f"; the last good checkpoint is {saved}" if saved else ""
    return DivergenceError(f"{algorithm.name} diverged in round {t}: {what}{where}. "
                           f"Try smaller step sizes ({algorithm!r}).", algorithm=algorithm.name, round=t,
                           reason=what, all_ranks=all_ranks)


def _round(algorithm: Algorithm, state, ctx: Context, t: int, saved: Optional[str]):
    """One round; NaN/inf appearing inside it (an op's finiteness check) or in the new state is
    reported as a divergence of this round (on every rank, when any rank's state has it)."""
    ctx._changed = [] if algorithm.marks_changed_rows else None
    try:
        if ctx.privacy is not None:
            ctx.privacy.begin_round(t)
        with inside(algorithm.name):  # the plain ops refuse to run in here: the algorithm uses ctx's
            state = algorithm.round(state, ctx, t)
        if ctx.privacy is not None:
            ctx.privacy.end_round(ctx)
    except NonFiniteError as exc:
        raise _diverged(algorithm, t, f"an intermediate result has NaN/inf values ({exc})", saved,
                        all_ranks=not ctx.sharded) from exc
    bad = _first_nonfinite(state, ctx)
    if ctx.comm.max(0.0 if bad is None else 1.0) > 0:
        where = f"state.{bad}" if bad is not None else f"the state of another rank (this is rank {ctx.comm.rank})"
        raise _diverged(algorithm, t, f"{where} has NaN/inf values", saved)
    return state


def _first_nonfinite(state, ctx: Context) -> Optional[str]:
    """The first state field with a NaN/inf after a round: every field whole, or, when the
    algorithm marks the rows it changed (Context.changed_rows), only those rows of the
    per-client fields (the others were checked in the round that last changed them)."""
    changed = ctx._changed
    ctx._changed = None
    rows = None
    if changed is not None:
        rows = torch.cat(changed) if changed else None
    for name, tensor, per_client in state_tensors(state, with_kind=True):
        if changed is not None and per_client and tensor.dim() >= 1:
            if rows is None:  # the round changed no per-client row
                continue
            tensor = tensor.index_select(0, rows.to(tensor.device))
        if not all_finite(tensor):
            return name
    return None


def _privacy_columns(mechanism: Optional[Mechanism]) -> dict:
    """``epsilon`` spent so far and the current ``clip_norm`` (nothing without privacy)."""
    if mechanism is None:
        return {}
    eps = mechanism.epsilon()  # inf without noise: recorded as None ("no guarantee"), not as a divergence
    return {"epsilon": eps if math.isfinite(eps) else None, "clip_norm": mechanism.clip_norm}


def _nonfinite_metrics(row: dict) -> List[str]:
    """The metrics of a history row that are NaN or infinite (None means "not recorded")."""
    return [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]


def _evaluate(algorithm: Algorithm, state, ctx: Context, t: int, train_loss: str, saved: Optional[str]) -> dict:
    """``evaluate_round``, with a divergence that shows only in what is evaluated (the models
    handed to evaluation, a loss, a statistical error, a residual: PERM's personalized loss and
    CGPFL's errors overflow rounds before their parameters do) reported as a DivergenceError of
    round ``t`` naming the quantity, on every rank alike (the models are checked, and the ranks
    agree, before any collective of the evaluation)."""
    try:  # the models may be computed here (Per-FedAvg's step, LocalizedFedAvg's fine-tuning)
        personal, w = algorithm.evaluated_models(state, ctx)
    except NonFiniteError as exc:
        raise _diverged(algorithm, t, f"computing the evaluated models met NaN/inf values ({exc})", saved,
                        all_ranks=not ctx.sharded) from exc
    bad = next((name for name, tensor in (("the personalized models", personal), ("the global model", w))
                if tensor is not None and not all_finite(tensor)), None)
    if ctx.comm.max(0.0 if bad is None else 1.0) > 0:
        where = bad or f"the evaluated models of another rank (this is rank {ctx.comm.rank})"
        raise _diverged(algorithm, t, f"{where} have NaN/inf values", saved)
    try:
        row = evaluate_round(algorithm, state, ctx, t, train_loss, models=(personal, w))
    except NonFiniteError as exc:  # e.g. a test row's loss overflowing in an op's check
        raise _diverged(algorithm, t, f"the evaluation met NaN/inf values ({exc})", saved,
                        all_ranks=not ctx.sharded) from exc
    bad_metrics = _nonfinite_metrics(row)  # the same on every rank: metrics are sums over the ranks
    if bad_metrics:
        shown = ", ".join(f"{k} = {row[k]}" for k in bad_metrics)
        raise _diverged(algorithm, t, f"NaN/inf in its metrics ({shown})", saved)
    return row


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024


def _training_cost(algorithm: Algorithm, state, ctx: Context, clients_per_round: Optional[int]) -> Optional[str]:
    """The warning for an algorithm that trains more clients per round than ``clients_per_round``
    (pFedMe's ``train_all``), with an estimate of the memory of its [m, d] matrices; None
    otherwise. Called on every rank (the state's size is summed over them)."""
    n = ctx.num_clients
    trained = algorithm.clients_trained_per_round(n, clients_per_round)
    if clients_per_round is None or trained <= clients_per_round:
        return None
    row = ctx.d * torch.empty((), dtype=ctx.dtype).element_size()  # bytes of one client's model
    matrices = [t for _, t in state_tensors(state) if t.dim() == 2 and t.shape[0] == ctx.m and ctx.m > 1]
    held = ctx.sum(sum(t.numel() * t.element_size() for t in matrices))
    copies = algorithm.working_copies
    need, sampled = held + copies * trained * row, held + copies * clients_per_round * row
    note = algorithm.training_note()
    return (f"{algorithm.name} trains {trained} clients per round, {trained / clients_per_round:.3g}x "
            f"clients_per_round = {clients_per_round}{f' ({note})' if note else ''}: about "
            f"{trained / clients_per_round:.3g}x the local work, and about {_size(need)} for its [m, d] "
            f"matrices ({len(matrices)} in the state, {copies} working copies of the trained clients' models) vs "
            f"{_size(sampled)} were only the sampled clients trained. An estimate, for m = {n}, d = {ctx.d}, "
            f"{str(ctx.dtype).replace('torch.', '')}: the data, the kernels' buffers and the evaluation come on top")


def _validate(algorithm, federation, model, rounds, clients_per_round, eval_every, seed):
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"algorithm: expected a pflcore.algorithms algorithm, got {type(algorithm).__name__}")
    if not isinstance(federation, Federation):
        raise ValueError(f"federation: expected a pflcore.data.Federation, got {type(federation).__name__}")
    if not isinstance(model, (GLM, TorchNet)):
        raise ValueError(f"model: expected a pflcore.models model (a GLM or a torch net), got {type(model).__name__}")
    if federation.num_features != model.p:
        raise ValueError(f"model: expects p = {model.p} features, the federation has {federation.num_features}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= MAX_COUNT:
        raise ValueError(f"rounds: expected an integer in [0, {MAX_COUNT}], got {rounds!r}")
    m = federation.num_clients
    if clients_per_round is not None and (isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int)
                                          or not 1 <= clients_per_round <= m):
        raise ValueError(f"clients_per_round: expected an integer in [1, m = {m}] or None, got {clients_per_round!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or not 1 <= eval_every <= MAX_COUNT:
        raise ValueError(f"eval_every: expected an integer in [1, {MAX_COUNT}], got {eval_every!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed!r}")


def _device(device) -> torch.device:
    """``device`` as a torch.device this process can use, or a ValueError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device (torch "
                             f"{torch.__version__}, CUDA {torch.version.cuda or 'not built'})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but there are {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device: expected 'cpu' or 'cuda' (pflcore's backends), got {device!r}")
    return dev


def _every_round(cb) -> bool:
    """Whether ``cb`` takes the keyword ``evaluated`` (or ``**kwargs``): then it is called after
    every round, else (cb(round, row, state), as before) after the evaluated ones only."""
    try:
        params = inspect.signature(cb).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the old form
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == "evaluated" and p.kind in (p.KEYWORD_ONLY,
                                                                              p.POSITIONAL_OR_KEYWORD))
               for p in params)


def _callbacks(callbacks) -> list:
    """[(callback, called every round)]."""
    try:
        cbs = list(callbacks)
    except TypeError:
        raise ValueError(f"callbacks: expected an iterable of callables cb(round, row, state), "
                         f"got {callbacks!r}") from None
    bad = [cb for cb in cbs if not callable(cb)]
    if bad:
        raise ValueError(f"callbacks: expected callables cb(round, row, state), got {bad[0]!r}")
    return [(cb, _every_round(cb)) for cb in cbs]


def _checkpoint_args(checkpoint, checkpoint_every, eval_every):
    """(folder or None, every): ``checkpoint_every`` defaults to ``eval_every`` rounds."""
    if checkpoint is None:
        if checkpoint_every is not None:
            raise ValueError(f"checkpoint_every: given ({checkpoint_every!r}) without checkpoint= (a folder to "
                             "write to)")
        return None, None
    if not isinstance(checkpoint, (str, os.PathLike)) or not os.fspath(checkpoint):
        raise ValueError(f"checkpoint: expected a folder path (str or os.PathLike), got {checkpoint!r}")
    if checkpoint_every is None:
        checkpoint_every = eval_every
    if (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
            or not 1 <= checkpoint_every <= MAX_COUNT):
        raise ValueError(f"checkpoint_every: expected an integer in [1, {MAX_COUNT}] (rounds between checkpoints), "
                         f"got {checkpoint_every!r}")
    return os.fspath(checkpoint), checkpoint_every


@ckpt.releases_locks  # the checkpoint folder's lock, taken by ckpt.claim, is released however run ends
def run(algorithm: Algorithm, federation: Federation, model: GLM, *, rounds: int, clients_per_round: Optional[int] = None,
        seed: int = 0, eval_every: int = 1, device="cpu", progress: bool = True, checkpoint: Optional[str] = None,
        checkpoint_every: Optional[int] = None, callbacks: Iterable[Callable] = (),
        comm: Optional[distributed.Comm] = None, train_loss: str = "sample", privacy: Optional[Privacy] = None,
        _resume=None) -> Result:
    """Run ``rounds`` rounds of ``algorithm`` on ``federation`` and record metrics every
    ``eval_every`` rounds (and after the last). ``checkpoint`` (a folder) with
    ``checkpoint_every`` saves the state so that ``resume(folder)`` continues bitwise
    identically (every ``eval_every`` rounds by default, and after the last round). A checkpoint
    folder belongs to one run: a run into a folder that holds another run's checkpoints (other
    algorithm, hyperparameters, model, data, seed, clients per round, device or number of ranks)
    raises ``ValueError`` naming what differs, and one writer at a time: a run into a folder
    that another live process is writing raises ``checkpoint.CheckpointBusyError`` naming the
    holder (a killed writer's lock is taken over). ``callbacks`` are called after
    the evaluated rounds as ``cb(round, metrics_row, state)``; a callback that takes a keyword
    ``evaluated`` (or ``**kwargs``) is called after every round instead, as
    ``cb(round, metrics_row, state, evaluated=True)`` on the evaluated rounds and
    ``cb(round, None, state, evaluated=False)`` on the others (e.g. to time every round); a
    callback runs before the round's checkpoint is written. ``train_loss``: "sample" (the mean
    loss on a fixed sample of training rows, drawn once: up to 20,000 rows), "full" (every
    training row: a pass over the training data at every evaluation) or "none". An algorithm
    that trains more clients per round than ``clients_per_round`` (pFedMe's ``train_all``, the
    paper's behaviour) gets a RuntimeWarning at the start saying so, with an estimate of the
    memory of its [m, d] matrices.

    ``comm`` (default: the initialized torch.distributed group if it has several ranks, else
    one process) shards the clients over the ranks: every rank passes the same whole
    federation and gets the same history; ``Result.personalized`` and ``Result.state`` hold
    this rank's clients (``Result.clients``), ``pflcore.distributed.gather_rows`` collects them.

    ``privacy`` (``pflcore.Privacy``): client-level central differential privacy on whatever the
    clients send to the server to be averaged (``pflcore.privacy.mechanism`` says what is
    released); every evaluated row records ``epsilon`` (at the settings' δ) and ``clip_norm``.
    An algorithm whose server sees individual clients' vectors otherwise (CGPFL, IFCA, PERM,
    L2SGD, Anderson on a per-client fixed point) raises ValueError saying why.
    """
    _validate(algorithm, federation, model, rounds, clients_per_round, eval_every, seed)
    if train_loss not in ("sample", "full", "none"):
        raise ValueError(f"train_loss: expected 'sample', 'full' or 'none', got {train_loss!r}")
    checkpoint, checkpoint_every = _checkpoint_args(checkpoint, checkpoint_every, eval_every)
    device, callbacks = _device(device), _callbacks(callbacks)
    if comm is not None and not isinstance(comm, distributed.Comm):
        raise ValueError(f"comm: expected a pflcore.distributed.Comm (from pflcore.distributed.init()) or None, "
                         f"got {type(comm).__name__}")
    comm = distributed.default_comm() if comm is None else comm
    if federation.is_shard:
        raise ValueError("federation: expected the whole federation (every rank passes the same one; run shards "
                         f"it), got a shard of {federation.num_clients} of {federation.num_clients_total} clients")
    if privacy is not None:
        if not isinstance(privacy, Privacy):
            raise ValueError(f"privacy: expected a pflcore.Privacy or None, got {type(privacy).__name__}")
        if algorithm.dp_unsupported:
            raise ValueError(f"privacy: {algorithm.name} cannot run under client-level DP: "
                             f"{algorithm.dp_unsupported}")
    m = federation.num_clients
    whole = federation if federation.train.device == device or comm.world > 1 else federation.to(device)
    optimum = global_optimum(whole, model)
    config = {"algorithm": repr(algorithm), "federation": whole.name, "model": repr(model), "rounds": rounds,
              "clients_per_round": clients_per_round, "seed": seed, "eval_every": eval_every, "device": str(device),
              "checkpoint_every": checkpoint_every, "train_loss": train_loss}
    mechanism = None
    if privacy is not None:
        cohort = m if clients_per_round is None else min(clients_per_round, m)
        mechanism = Mechanism(privacy, population=m, cohort=cohort, releases=algorithm.dp_releases_per_round,
                              rounds=rounds, seed=seed, client_weights=federation.weights,
                              client_rows=federation.train.sizes)
        if _resume is not None and _resume.get("privacy") is not None:
            mechanism.load_state_dict(_resume["privacy"])
        config["privacy"] = {**privacy.as_dict(), "noise_multiplier_run": mechanism.noise_multiplier,
                             "update_noise_multiplier": mechanism.update_noise}
    if optimum is not None:
        config["f_star"] = optimum[0]
        config["heterogeneity"] = heterogeneity(whole, model, optimum[1])
    if comm.world > 1:
        config["ranks"] = comm.world
        seen = comm.all_gather(torch.tensor([m, federation.train.num_rows], dtype=torch.int64))
        if any(not torch.equal(s, seen[0]) for s in seen):
            raise ValueError(f"federation: every rank must pass the same federation; (clients, rows) per rank: "
                             f"{[s.tolist() for s in seen]}")
        ranges = [distributed.shard_range(m, comm.world, r) for r in range(comm.world)]
        lo, hi = ranges[comm.rank]
        fed = whole.shard(lo, hi)
        fed = fed if fed.train.device == device else fed.to(device)
    else:
        lo, hi, ranges, fed = 0, m, [(0, m)], whole
    if checkpoint is not None:  # before any work: a folder of another run is refused at once
        fp = ckpt.fingerprint(algorithm, federation, model, seed=seed, clients_per_round=clients_per_round,
                              device=device, ranks=comm.world, privacy=privacy)
        ckpt.claim(checkpoint, fp, comm, resuming=_resume is not None)
    why_no_truth = _truth_warning(federation, model)
    if why_no_truth and comm.rank == 0:
        warnings.warn(why_no_truth, RuntimeWarning, stacklevel=2)
    ctx = Context(fed, model, device, seed, clients_per_round, comm=comm, privacy=mechanism)
    if optimum is not None:
        ctx.f_star = optimum[0]
    if _resume is None:
        try:
            with inside(algorithm.name):
                state = algorithm.init(ctx)
        except NonFiniteError as exc:
            raise _diverged(algorithm, 0, f"its initial state has NaN/inf values ({exc})", None,
                            all_ranks=not ctx.sharded) from exc
        history, start = [], 0
        history.append({**_evaluate(algorithm, state, ctx, 0, train_loss, None), "seconds": 0.0,
                        "client_steps_per_s": None, **_privacy_columns(mechanism)})
    else:
        state, history, start = _resume["state"], _resume["history"], _resume["round"]
    costly = _training_cost(algorithm, state, ctx, clients_per_round)  # once per run, before its rounds
    if costly and comm.rank == 0:
        warnings.warn(costly, RuntimeWarning, stacklevel=3)  # past releases_locks: the caller's line
    saved = f"round {start} in {checkpoint}" if _resume is not None else None  # the last checkpoint written
    bar = None
    if progress and comm.rank == 0:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=rounds, initial=start, desc=algorithm.name, leave=False, dynamic_ncols=True)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None
    elapsed, steps0, bytes0 = 0.0, ctx.client_steps, comm.bytes_sent
    for t in range(start + 1, rounds + 1):
        t0 = time.perf_counter()
        try:
            state = _round(algorithm, state, ctx, t, saved)
        except DivergenceError as exc:
            exc.history = list(history)
            if bar is not None:
                bar.close()
            raise
        elapsed += time.perf_counter() - t0
        if t % eval_every == 0 or t == rounds:
            sent = comm.bytes_sent - bytes0  # the rounds' traffic only, not the metrics'
            try:
                row = _evaluate(algorithm, state, ctx, t, train_loss, saved)
            except DivergenceError as exc:
                exc.history = list(history)
                if bar is not None:
                    bar.close()
                raise
            done = t - (history[-1]["round"] if history else 0)
            slowest = comm.max(elapsed)  # a sharded round lasts as long as its slowest rank
            row["seconds"] = slowest / max(1, done)
            row["client_steps_per_s"] = ctx.sum(ctx.client_steps - steps0) / slowest if slowest > 0 else None
            if comm.world > 1:
                row["bytes_sent_per_round"] = sent / max(1, done)  # by this rank, in collectives
            row.update(_privacy_columns(mechanism))
            history.append(row)
            elapsed, steps0, bytes0 = 0.0, ctx.client_steps, comm.bytes_sent
            for cb, every in callbacks:
                if every:
                    cb(t, row, state, evaluated=True)
                else:
                    cb(t, row, state)
            if bar is not None:
                acc = row.get("personalized_acc", row.get("global_acc"))
                bar.set_postfix_str(("acc %.4f " % acc if acc is not None else "")
                                    + "steps/s %.3g" % (row["client_steps_per_s"] or 0))
        else:  # a round without evaluation: only callbacks that take `evaluated` hear of it
            for cb, every in callbacks:
                if every:
                    cb(t, None, state, evaluated=False)
        if checkpoint is not None and (t % checkpoint_every == 0 or t == rounds):
            ckpt.save(checkpoint, t, algorithm, state, history, config, federation, model, comm, (lo, hi), ranges,
                      privacy=None if mechanism is None else mechanism.state_dict())
            saved = f"round {t} in {checkpoint}"
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    last = getattr(ctx, "_evaluated", None)
    personal, w = last[1:] if last is not None and last[0] == rounds else algorithm.evaluated_models(state, ctx)
    return Result(algorithm.name, history, None if personal is None else personal.clone(),
                  None if w is None else w.clone(), state, config, clients=(lo, hi))


def resume(checkpoint: str, *, rounds: Optional[int] = None, progress: bool = True, callbacks=(),
           comm: Optional[distributed.Comm] = None) -> Result:
    """Continue the run saved in ``checkpoint`` from its latest complete round (to ``rounds`` in
    total, default the original number), on this process or on the ranks of ``comm`` (default
    as in ``run``) whatever the number of ranks that wrote it. The result equals the
    uninterrupted run's bitwise (but the timing columns) when the number of ranks is the same.
    A round file that cannot be read (e.g. cut short by a full disk) is skipped with a warning
    naming it, and the run continues from the newest intact round. A custom algorithm's class
    (and its state's) must be importable: one the checkpoint cannot find here (defined in the
    script that ran, ``__main__``, or in a module not on the path) raises
    ``checkpoint.MissingClassError`` naming the class and its module, and nothing is skipped."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise ValueError(f"checkpoint: expected a folder path (str or os.PathLike), got {checkpoint!r}")
    checkpoint = os.fspath(checkpoint)
    comm = distributed.default_comm() if comm is None else comm
    base = ckpt.load_federation(checkpoint)
    m = base["federation"].num_clients
    lo, hi = distributed.shard_range(m, comm.world, comm.rank) if comm.world > 1 else (0, m)
    saved = ckpt.load(checkpoint, lo, hi, comm)
    cfg = saved["config"]
    return run(saved["algorithm"], base["federation"], base["model"], rounds=rounds or cfg["rounds"],
               clients_per_round=cfg["clients_per_round"], seed=cfg["seed"], eval_every=cfg["eval_every"],
               device=cfg["device"], progress=progress, checkpoint=checkpoint, checkpoint_every=cfg["checkpoint_every"],
               callbacks=callbacks, comm=comm, train_loss=cfg.get("train_loss", "sample"),
               privacy=_saved_privacy(cfg), _resume=saved)


def _saved_privacy(cfg: dict) -> Optional[Privacy]:
    saved = cfg.get("privacy")
    if saved is None:
        return None
    return Privacy(**{f.name: saved[f.name] for f in dataclass_fields(Privacy)})


__all__ = ["run", "resume", "DivergenceError", "evaluate_round", "truth_layout"]
