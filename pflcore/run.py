"""The round loop (DESIGN.md §5): sampling, evaluation, history, checkpoints, progress."""
from __future__ import annotations

import glob
import os
import time
from typing import Callable, Iterable, Optional

import torch

from pflcore import ops
from pflcore.algorithms.base import Algorithm, Context, state_tensors
from pflcore.data.federation import Federation
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet
from pflcore.ops._checks import NonFiniteError
from pflcore.result import Result


class DivergenceError(RuntimeError):
    """Parameters became NaN or infinite."""


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
    W = w_star.expand(fed.num_clients, model.d).contiguous()
    return float((ops.gradients(model, W, fed.train).double() ** 2).sum(1).mean())


def _weighted_stats(correct: torch.Tensor, count: torch.Tensor) -> dict:
    acc_i = correct.double() / count.double()
    return {"acc": float(correct.sum()) / float(count.sum()), "acc_std": float(acc_i.std(unbiased=False)),
            "acc_p10": float(torch.quantile(acc_i, 0.1))}


def evaluate_round(algorithm: Algorithm, state, ctx: Context, t: int) -> dict:
    """The metrics of DESIGN.md §5 for the current state."""
    row = {"round": t}
    model, m = ctx.model, ctx.m
    personal = algorithm.personalized(state)
    w = algorithm.global_model(state)
    fed = ctx.federation
    if personal is not None:
        loss, correct, count = ops.evaluate(model, personal.contiguous(), ctx.test)
        st = _weighted_stats(correct, count)
        row.update(personalized_acc=st["acc"], personalized_acc_std=st["acc_std"],
                   personalized_acc_p10=st["acc_p10"], personalized_loss=float(loss.sum()) / float(count.sum()))
        tl, _, tc = ops.evaluate(model, personal.contiguous(), ctx.train)
        row["train_loss"] = float(tl.sum()) / float(tc.sum())
        if fed.truth is not None and fed.truth.shape == personal.shape:
            row["stat_error_local"] = float(((personal - fed.truth.to(personal)) ** 2).sum(1).mean())
    if w is not None:
        W = w.expand(m, model.d).contiguous()
        loss, correct, count = ops.evaluate(model, W, ctx.test)
        st = _weighted_stats(correct, count)
        row.update(global_acc=st["acc"], global_acc_std=st["acc_std"], global_acc_p10=st["acc_p10"],
                   global_loss=float(loss.sum()) / float(count.sum()))
        if personal is None:
            tl, _, tc = ops.evaluate(model, W, ctx.train)
            row["train_loss"] = float(tl.sum()) / float(tc.sum())
            if fed.truth is not None and fed.truth.shape == W.shape:  # every client uses w
                row["stat_error_local"] = float(((W - fed.truth.to(W)) ** 2).sum(1).mean())
        if fed.truth_global is not None and fed.truth_global.shape == w.shape:
            row["stat_error_global"] = float(((w - fed.truth_global.to(w)) ** 2).sum())
    if w is not None and ctx.f_star is not None:
        W = w.expand(m, model.d).contiguous()
        tl, _, tc = ops.evaluate(model, W, ctx.train)
        F = float((fed.weights.double() * (tl.double() / tc.double())).sum()) + 0.5 * model.l2 * float((w.double() ** 2).sum())
        row["optimality_gap"] = F - ctx.f_star
    if not model.is_classifier:  # accuracies are meaningless for regression
        for k in [k for k in row if "acc" in k]:
            del row[k]
    residual = algorithm.residual(state)
    if residual is not None:
        row["residual"] = residual
    return row


def _diverged(algorithm: Algorithm, t: int, what: str, checkpoint: Optional[str]) -> DivergenceError:
    where = f"; the last good checkpoint is in {checkpoint}" if checkpoint else ""
    return DivergenceError(f"{algorithm.name} diverged in round {t}: {what}{where}. "
                           f"Try smaller step sizes ({algorithm!r}).")


def _round(algorithm: Algorithm, state, ctx: Context, t: int, checkpoint: Optional[str]):
    """One round; NaN/inf appearing inside it (an op's finiteness check) or in the new state is
    reported as a divergence of this round."""
    try:
        state = algorithm.round(state, ctx, t)
    except NonFiniteError as exc:
        raise _diverged(algorithm, t, f"an intermediate result has NaN/inf values ({exc})", checkpoint) from exc
    for name, tensor in state_tensors(state):
        if not bool(torch.isfinite(tensor).all()):
            raise _diverged(algorithm, t, f"state.{name} has NaN/inf values", checkpoint)
    return state


def _validate(algorithm, federation, model, rounds, clients_per_round, eval_every):
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"algorithm: expected a pflcore.algorithms algorithm, got {type(algorithm).__name__}")
    if not isinstance(federation, Federation):
        raise ValueError(f"federation: expected a pflcore.data.Federation, got {type(federation).__name__}")
    if not isinstance(model, (GLM, TorchNet)):
        raise ValueError(f"model: expected a pflcore.models model (a GLM or a torch net), got {type(model).__name__}")
    if federation.num_features != model.p:
        raise ValueError(f"model: expects p = {model.p} features, the federation has {federation.num_features}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds: expected an integer >= 0, got {rounds!r}")
    m = federation.num_clients
    if clients_per_round is not None and (isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int)
                                          or not 1 <= clients_per_round <= m):
        raise ValueError(f"clients_per_round: expected an integer in [1, m = {m}] or None, got {clients_per_round!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every: expected an integer >= 1, got {eval_every!r}")


def _save(checkpoint: str, t: int, algorithm, state, history, config, federation, model) -> None:
    os.makedirs(checkpoint, exist_ok=True)
    fed_path = os.path.join(checkpoint, "federation.pt")
    if not os.path.exists(fed_path):
        torch.save({"federation": federation, "model": model}, fed_path)
    tmp = os.path.join(checkpoint, f".round_{t:07d}.pt.tmp")
    torch.save({"round": t, "algorithm": algorithm, "state": state, "history": history, "config": config}, tmp)
    os.replace(tmp, os.path.join(checkpoint, f"round_{t:07d}.pt"))  # atomic: never a torn checkpoint


def run(algorithm: Algorithm, federation: Federation, model: GLM, *, rounds: int, clients_per_round: Optional[int] = None,
        seed: int = 0, eval_every: int = 1, device="cpu", progress: bool = True, checkpoint: Optional[str] = None,
        checkpoint_every: Optional[int] = None, callbacks: Iterable[Callable] = (), _resume=None) -> Result:
    """Run ``rounds`` rounds of ``algorithm`` on ``federation`` and record metrics every
    ``eval_every`` rounds (and after the last). ``checkpoint`` (a folder) with
    ``checkpoint_every`` saves the state so that ``resume(folder)`` continues bitwise
    identically. ``callbacks`` are called as ``cb(round, metrics_row, state)``."""
    _validate(algorithm, federation, model, rounds, clients_per_round, eval_every)
    device = torch.device(device)
    fed = federation if federation.train.device == device else federation.to(device)
    ctx = Context(fed, model, device, seed, clients_per_round)
    optimum = global_optimum(fed, model)
    config = {"algorithm": repr(algorithm), "federation": fed.name, "model": repr(model), "rounds": rounds,
              "clients_per_round": clients_per_round, "seed": seed, "eval_every": eval_every, "device": str(device),
              "checkpoint_every": checkpoint_every}
    if optimum is not None:
        ctx.f_star = optimum[0]
        config["f_star"] = optimum[0]
        config["heterogeneity"] = heterogeneity(fed, model, optimum[1])
    if _resume is None:
        state, history, start = algorithm.init(ctx), [], 0
        history.append({**evaluate_round(algorithm, state, ctx, 0), "seconds": 0.0, "client_steps_per_s": None})
    else:
        state, history, start = _resume["state"], _resume["history"], _resume["round"]
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=rounds, initial=start, desc=algorithm.name, leave=False, dynamic_ncols=True)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None
    elapsed, steps0 = 0.0, ctx.client_steps
    for t in range(start + 1, rounds + 1):
        t0 = time.perf_counter()
        state = _round(algorithm, state, ctx, t, checkpoint)
        elapsed += time.perf_counter() - t0
        if t % eval_every == 0 or t == rounds:
            row = evaluate_round(algorithm, state, ctx, t)
            row["seconds"] = elapsed / max(1, t - (history[-1]["round"] if history else 0))
            row["client_steps_per_s"] = (ctx.client_steps - steps0) / elapsed if elapsed > 0 else None
            history.append(row)
            elapsed, steps0 = 0.0, ctx.client_steps
            for cb in callbacks:
                cb(t, row, state)
            if bar is not None:
                acc = row.get("personalized_acc", row.get("global_acc"))
                bar.set_postfix_str(("acc %.4f " % acc if acc is not None else "")
                                    + "steps/s %.3g" % (row["client_steps_per_s"] or 0))
        if checkpoint and checkpoint_every and (t % checkpoint_every == 0 or t == rounds):
            _save(checkpoint, t, algorithm, state, history, config, federation, model)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    personal, w = algorithm.personalized(state), algorithm.global_model(state)
    return Result(algorithm.name, history, None if personal is None else personal.clone(),
                  None if w is None else w.clone(), state, config)


def resume(checkpoint: str, *, rounds: Optional[int] = None, progress: bool = True, callbacks=()) -> Result:
    """Continue the run saved in ``checkpoint`` from its latest round (to ``rounds`` in total,
    default the original number). The result equals the uninterrupted run's bitwise (but the
    timing columns)."""
    files = sorted(glob.glob(os.path.join(checkpoint, "round_*.pt")))
    if not files:
        raise ValueError(f"checkpoint: no round_*.pt files in {checkpoint!r}")
    saved = torch.load(files[-1], weights_only=False)
    base = torch.load(os.path.join(checkpoint, "federation.pt"), weights_only=False)
    cfg = saved["config"]
    return run(saved["algorithm"], base["federation"], base["model"], rounds=rounds or cfg["rounds"],
               clients_per_round=cfg["clients_per_round"], seed=cfg["seed"], eval_every=cfg["eval_every"],
               device=cfg["device"], progress=progress, checkpoint=checkpoint, checkpoint_every=cfg["checkpoint_every"],
               callbacks=callbacks, _resume=saved)


__all__ = ["run", "resume", "DivergenceError", "evaluate_round"]
