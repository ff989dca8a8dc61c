"""The operator-splitting family ("A Unifying Framework for Federated Learning", §3–§4;
DESIGN.md §5) as one grand scheme, eqs. (42)–(44), over the per-client state u [m, d]:

    z_i = (1 − α) u_i + α P^η_{f_i}(u_i)          (42)
    w_i = (1 − β) z_i + β P_H(z)                  (43)
    u_i ← (1 − γ) u_i + γ w_i                     (44)

P_H is the weighted mean over the participating clients and P^η_f the proximal map
argmin_x f(x) + ‖x − u‖²/(2η): ``prox_steps`` gradient steps (``ops.local_steps`` with anchor u and
prox 1/η) or, for least squares, ``prox="exact"`` (one batched Cholesky solve, factored once per
η). Presets (the paper's Table 3): FedProxClassic (1, 1, 1), FedSplit (2, 2, 1), FedPi (2, 2, ½),
FedRP (2, 1, 1); the grand scheme's FedAvg takes k gradient steps G^η_{f,k} instead of P^η_f
(``local_update="gradient"``) and is the same algorithm as ``FedAvg``.

The global model reported is P_H(P^η_f(u)) of the last round (for FedProx and FedRP it equals u
at the fixed point, for FedSplit and FedPi it is the minimizer); the personalized models are the
clients' P^η_{f_i}(u_i). ``ergodic=True`` reports Σ_s η_s w_s / Σ_s η_s instead (Theorem 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pflcore.algorithms.base import Algorithm, Context, count_int, per_client, positive


@dataclass
class SplittingState:
    u: torch.Tensor = per_client()     # [m, d] the fixed-point variable
    prox: torch.Tensor = per_client()  # [m, d] P^η_f(u) of the last round (personalized models)
    w: torch.Tensor          # [d] P_H(prox): the global model
    w_ergodic: torch.Tensor  # [d] Σ η_s w_s (divided by eta_sum when reported)
    eta_sum: float = 0.0
    residual: Optional[float] = None  # ‖T(u) − u‖ of the last round; None before the first


class GrandScheme(Algorithm):
    """The grand scheme of "A Unifying Framework for Federated Learning" (eqs. (42)–(44)).

    Each round, on the sampled clients' rows of u [m, d]: z_i = (1 − ``alpha``) u_i + ``alpha``
    P(u_i), w_i = (1 − ``beta``) z_i + ``beta`` P_H(z), u_i ← (1 − ``gamma``) u_i + ``gamma`` w_i,
    where P is the proximal map of f_i with step η (``eta``; ``schedule`` "constant", "inverse"
    η/t or "exponential": η·``decay`` every ``decay_period`` rounds) and P_H the weighted mean.
    ``prox="steps"``: ``prox_steps`` gradient steps of size ``prox_lr`` (default η/(2(1 + η)));
    ``prox="exact"``: a batched Cholesky solve (least squares). ``local_update="gradient"`` takes
    gradient steps instead of the prox (the scheme's FedAvg). ``ergodic=True`` reports the
    η-weighted average of the global models (Theorem 3). Personalized models: P(u_i)."""

    name = "GrandScheme"
    dp_releases_per_round = 2  # P_H of z (the step) and of the prox points (the global model)

    def __init__(self, alpha: float = 1.0, beta: float = 1.0, gamma: float = 1.0, eta: float = 0.1, *,
                 prox: str = "steps", prox_steps: int = 10, prox_lr: Optional[float] = None,
                 local_update: str = "prox", schedule: str = "constant", decay_period: int = 100,
                 decay: float = 0.5, ergodic: bool = False):
        n = self.name
        self.alpha = positive(alpha, "alpha", n, allow_zero=True)
        self.beta = positive(beta, "beta", n, allow_zero=True)
        self.gamma = positive(gamma, "gamma", n)
        self.eta = positive(eta, "eta", n)
        if prox not in ("steps", "exact"):
            raise ValueError(f"{n}: prox must be 'steps' or 'exact', got {prox!r}")
        if local_update not in ("prox", "gradient"):
            raise ValueError(f"{n}: local_update must be 'prox' or 'gradient', got {local_update!r}")
        if schedule not in ("constant", "inverse", "exponential"):
            raise ValueError(f"{n}: schedule must be 'constant', 'inverse' (η0/t) or 'exponential', got {schedule!r}")
        self.prox, self.local_update, self.schedule = prox, local_update, schedule
        self.prox_steps = count_int(prox_steps, "prox_steps", n)
        self.prox_lr = None if prox_lr is None else positive(prox_lr, "prox_lr", n)
        self.decay_period = count_int(decay_period, "decay_period", n)
        self.decay = positive(decay, "decay", n)
        self.ergodic = bool(ergodic)
        self._factor = None  # (key, Cholesky factors [m, P, P], rhs [m, P]) for the exact prox; key = (η, clients)

    def eta_at(self, t: int) -> float:
        if self.schedule == "inverse":
            return self.eta / t
        if self.schedule == "exponential":
            return self.eta * self.decay ** ((t - 1) // self.decay_period)
        return self.eta

    def init(self, ctx: Context) -> SplittingState:
        zeros = ctx.initial_models(ctx.m)
        w = ctx.initial_global()
        return SplittingState(zeros, zeros.clone(), w, w.clone())

    # ---- the local operator: P^η_f or G^η_{f,k} ----------------------------------------------

    def _exact_prox(self, u: torch.Tensor, S: torch.Tensor, ctx: Context, eta: float) -> torch.Tensor:
        """argmin_x f_i(x) + ‖x − u_i‖²/(2η) for least squares: (H_i + (l2 + 1/η)I) x = g_i + u_i/η."""
        model = ctx.model
        if model.family != "least_squares":
            raise ValueError(f"{self.name}: prox='exact' needs a LeastSquares model, got {model!r}")
        key = (eta, ctx.first_client, ctx.m)  # the factors belong to this rank's clients
        if self._factor is None or self._factor[0] != key:
            P = model.P
            H = torch.empty(ctx.m, P, P, dtype=torch.float64, device=ctx.device)
            g = torch.empty(ctx.m, P, dtype=torch.float64, device=ctx.device)
            for i in range(ctx.m):  # one-time setup per η, not per round
                X, y = ctx.train.client(i)
                X = X.to(torch.float64)
                if model.fit_intercept:
                    X = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype, device=X.device)], 1)
                H[i] = X.T @ X / X.shape[0]
                g[i] = X.T @ y.to(torch.float64) / X.shape[0]
            eye = torch.eye(P, dtype=torch.float64, device=ctx.device)
            L = torch.linalg.cholesky(H + (model.l2 + 1.0 / eta) * eye)
            self._factor = (key, L, g)
        _, L, g = self._factor
        rhs = g[S] + u.to(torch.float64) / eta
        return torch.cholesky_solve(rhs[:, :, None], L[S])[:, :, 0].to(u.dtype)

    def _local(self, u: torch.Tensor, S: torch.Tensor, ctx: Context, eta: float) -> torch.Tensor:
        if self.local_update == "gradient":  # G^η_{f,k}: k plain gradient steps of size η
            out = u.clone()
            ctx.local_steps(out, steps=self.prox_steps, lr=eta, rows=S)
            return out
        if self.prox == "exact":
            return self._exact_prox(u, S, ctx, eta)
        # Gradient steps on f_i(x) + ‖x − u_i‖²/(2η); the step must be below 2/(L + 1/η).
        lr = self.prox_lr if self.prox_lr is not None else 0.5 * eta / (1.0 + eta)
        out = u.clone()
        ctx.local_steps(out, steps=self.prox_steps, lr=lr, prox=1.0 / eta, anchor=u, rows=S)
        return out

    # ---- one round: eqs. (42)–(44) ---------------------------------------------------------

    def round(self, state: SplittingState, ctx: Context, t: int) -> SplittingState:
        S = ctx.sample_clients(t)
        eta = self.eta_at(t)
        u = state.u[S].contiguous()
        p = self._local(u, S, ctx, eta)
        z = (1 - self.alpha) * u + self.alpha * p
        weights = ctx.weights[S]
        w = (1 - self.beta) * z + self.beta * ctx.average(z.contiguous(), weights, center=state.w)
        u_new = (1 - self.gamma) * u + self.gamma * w
        state.residual = ctx.norm(u_new - u)
        state.u[S] = u_new
        state.prox[S] = p
        state.w = ctx.average(p.contiguous(), weights, center=state.w)
        state.w_ergodic = state.w_ergodic + eta * state.w
        state.eta_sum += eta
        return state

    def personalized(self, state: SplittingState) -> torch.Tensor:
        return state.prox

    def global_model(self, state: SplittingState) -> torch.Tensor:
        if self.ergodic and state.eta_sum > 0:
            return state.w_ergodic / state.eta_sum
        return state.w

    def residual(self, state: SplittingState) -> Optional[float]:
        return state.residual  # None before the first round: absent from the history

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_factor"] = None  # a cache of this process's clients: rebuilt on first use
        return state

    # The fixed-point variable that Accelerated mixes: per client, so sharded with the clients.
    fixed_point_per_client = True

    def fixed_point(self, state: SplittingState) -> torch.Tensor:
        return state.u

    def set_fixed_point(self, state: SplittingState, u: torch.Tensor) -> SplittingState:
        state.u = u
        return state


def _preset(name: str, alpha: float, beta: float, gamma: float):
    class Preset(GrandScheme):
        __doc__ = (f"{name} (\"A Unifying Framework for Federated Learning\", Table 3): the grand scheme "
                   f"(GrandScheme) with (α, β, γ) = ({alpha}, {beta}, {gamma}): each round, the sampled clients "
                   "take their proximal step from u_i, the server averages, and u moves as eqs. (42)–(44) "
                   "say with these weights.\n\n    Its parameters are the "
                   "grand scheme's others: the prox step ``eta`` and its ``schedule`` (``decay``, "
                   "``decay_period``), ``prox`` (\"steps\": ``prox_steps`` steps of size ``prox_lr``; "
                   "\"exact\"), ``local_update`` and ``ergodic``; see GrandScheme.")

        def __init__(self, eta: float = 0.1, **kwargs):
            super().__init__(alpha, beta, gamma, eta, **kwargs)

        def hyperparameters(self) -> dict:
            return {k: v for k, v in super().hyperparameters().items() if k not in ("alpha", "beta", "gamma")}

    Preset.name = name
    Preset.__name__ = Preset.__qualname__ = name
    return Preset


FedProxClassic = _preset("FedProxClassic", 1.0, 1.0, 1.0)
FedSplit = _preset("FedSplit", 2.0, 2.0, 1.0)
FedPi = _preset("FedPi", 2.0, 2.0, 0.5)
FedRP = _preset("FedRP", 2.0, 1.0, 1.0)
