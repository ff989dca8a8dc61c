"""Central client-level differential privacy for every algorithm that aggregates through
``ctx.average`` (issue 27): ``pflcore.run(..., privacy=Privacy(...))``.

What is privatized: every ``ctx.average(vectors, weights, center=c)`` an algorithm calls inside a
round, i.e. whatever the clients send to the server to be averaged. Each client's vector is
turned into its update ``v_i − c`` (``c`` is what the server sent, e.g. the global model), clipped
to norm C, summed, noised (``ops.clip_and_sum``), and the server gets

    c + (Σ_i w_i·clip_C(v_i − c) + N(0, (z·C)²)) / (q·W),

the same for every algorithm (DP-FedAvg of McMahan et al. 2018 when the algorithm is FedAvg):
w_i = min(1, n_i / ŵ) the capped sample weights (every contribution stays within C), q the
sampling rate and W = Σ_k w_k over all clients (treated as public, as in that paper), or with
``weighting="uniform"`` w_i = 1 and q·W the expected cohort size. Personalized parts that never leave a client (pFedMe's θ_i, Ditto's
v_i, APFL's v_i, FedRep's heads, the splitting family's u_i) are not released and not noised.
Evaluation metrics are simulation diagnostics, computed from unprivatized quantities.

Adaptive clipping (Andrew et al., 2021): after each round C ← C·exp(−η_C·(b̃ − γ)), b̃ the noised
fraction of the round's first release's clients whose update norm was <= C; the update noise
multiplier is then z_Δ = (z^−2 − (2σ_b)^−2)^−1/2 so that the pair of releases costs what one
release of multiplier z would.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch

from pflcore.ops.dp import dp_normals, run_clip_and_sum, tree_blocks, tree_combine
from pflcore.privacy import accounting

_M64 = (1 << 64) - 1
_COUNT_STREAM = 1 << 15  # the counter's low 16 bits: release index (< 2**15), or this plus it for counts


def _finite(v, name: str, *, low: float = 0.0, low_open: bool = True, high: Optional[float] = None,
            high_open: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))
    if not ok:
        lo = f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f" and {'<' if high_open else '<='} {high:g}"
        raise ValueError(f"privacy.{name}: expected a finite number {lo}{hi}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Privacy:
    """Client-level central DP settings of a run (module docstring). Give ``noise_multiplier``
    (z: noise std / C) or a target ``epsilon`` (at ``delta``; z is then calibrated for the run's
    rounds with ``dp-accounting``), not both.

    ``sampling``: ``"poisson"`` (each client joins a round with probability clients_per_round / N,
    independently: the cohort size varies) or ``"fixed"`` (exactly clients_per_round clients; the
    accountant is then RDP under replace-one adjacency, much more conservative). ``accountant``:
    ``"pld"`` or ``"rdp"`` (Poisson only; fixed uses rdp). ``adaptive``: adaptive clipping toward
    the ``target_quantile`` of update norms with step ``clip_lr`` and count noise ``count_noise``
    (σ_b, default n̄/20). ``weighting``: ``"capped"`` (DP-FedAvg's w_i = min(1, n_i / ``weight_cap``),
    cap default the median client's training rows; the sum is divided by q·Σ_k w_k over all N
    clients, treated as public as in McMahan et al.) or ``"uniform"`` (every client counts once,
    divided by the expected cohort size)."""

    clip_norm: float = 1.0
    noise_multiplier: Optional[float] = None
    epsilon: Optional[float] = None
    delta: float = 1e-5
    sampling: str = "poisson"
    accountant: str = "pld"
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise: Optional[float] = None
    weighting: str = "capped"
    weight_cap: Optional[float] = None

    def __post_init__(self):
        _finite(self.clip_norm, "clip_norm")
        if (self.noise_multiplier is None) == (self.epsilon is None):
            raise ValueError("privacy: expected exactly one of noise_multiplier and epsilon, got "
                             f"noise_multiplier={self.noise_multiplier!r}, epsilon={self.epsilon!r}")
        if self.noise_multiplier is not None:
            _finite(self.noise_multiplier, "noise_multiplier", low_open=False)
        if self.epsilon is not None:
            _finite(self.epsilon, "epsilon")
        _finite(self.delta, "delta", high=1.0, high_open=True)
        if self.sampling not in accounting.SAMPLINGS:
            raise ValueError(f"privacy.sampling: expected one of {accounting.SAMPLINGS}, got {self.sampling!r}")
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"privacy.accountant: expected one of {accounting.ACCOUNTANTS}, got {self.accountant!r}")
        if self.sampling == "fixed" and self.accountant != "rdp":
            raise ValueError("privacy.accountant: fixed-size cohorts are accounted with 'rdp' (dp-accounting's PLD "
                             "accountant has no sampling without replacement); set accountant = \"rdp\" or "
                             "sampling = \"poisson\"")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"privacy.adaptive: expected true or false, got {self.adaptive!r}")
        _finite(self.target_quantile, "target_quantile", high=1.0, high_open=True)
        _finite(self.clip_lr, "clip_lr")
        if self.count_noise is not None:
            _finite(self.count_noise, "count_noise")
        if self.weighting not in ("capped", "uniform"):
            raise ValueError(f"privacy.weighting: expected 'capped' or 'uniform', got {self.weighting!r}")
        if self.weight_cap is not None:
            _finite(self.weight_cap, "weight_cap")

    def as_dict(self) -> dict:
        return asdict(self)


class Mechanism:
    """The run's privacy mechanism: privatizes ``ctx.average`` inside rounds, adapts C, and keeps
    the accounting ledger (checkpointed with the run: ``state_dict``)."""

    def __init__(self, privacy: Privacy, *, population: int, cohort: int, releases: int, rounds: int, seed: int,
                 client_weights: Optional[torch.Tensor] = None, client_rows: Optional[torch.Tensor] = None):
        self.privacy = privacy
        self.population, self.cohort = population, cohort
        self.expected_cohort = float(cohort)  # fixed: k; Poisson: q·N = k as well
        # capped weighting: the cap in the units of ctx.weights (∝ client rows), and the
        # denominator q·Σ_k min(1, p_k / cap) over the whole population
        self.weight_cap, self.denominator = None, self.expected_cohort
        if privacy.weighting == "capped" and client_weights is not None:
            p = client_weights.to(torch.float64).cpu()  # ctx.weights: ∝ the clients' training rows
            n = p if client_rows is None else client_rows.to(torch.float64).cpu()
            cap_rows = float(n.median()) if privacy.weight_cap is None else privacy.weight_cap
            self.weight_cap = cap_rows * float(p.sum()) / float(n.sum())
            self.denominator = cohort / population * float(torch.clamp(p / self.weight_cap, max=1.0).sum())
        self.releases = max(1, releases)
        self.seed = (seed * 0x9E3779B97F4A7C15 + 0x5DEECE66D) & _M64
        self.count_noise = privacy.count_noise if privacy.count_noise is not None else self.expected_cohort / 20.0
        z = privacy.noise_multiplier
        if z is None:
            z = accounting.noise_multiplier_for(privacy.epsilon, rounds=rounds, population=population, cohort=cohort,
                                                delta=privacy.delta, releases=self.releases,
                                                sampling=privacy.sampling, accountant=privacy.accountant)
        self.noise_multiplier = z  # the run's total: what one release per round would need
        self.update_noise = z
        if privacy.adaptive and z > 0:
            if not 2 * self.count_noise > z:
                raise ValueError(f"privacy.count_noise: adaptive clipping needs 2·count_noise > noise_multiplier, got "
                                 f"count_noise={self.count_noise:g}, noise_multiplier={z:g}")
            self.update_noise = (z ** -2 - (2 * self.count_noise) ** -2) ** -0.5
        self.clip_norm = privacy.clip_norm
        self.ledger: List[Tuple[Tuple[float, ...], int]] = []  # (round's noise multipliers, rounds) runs
        self._round: Optional[int] = None
        self._released = 0
        self._unclipped: Optional[Tuple[float, int]] = None  # first release: Σ(1[‖Δ‖<=C] − ½) local, rows
        self._warned_center = False

    # ---- the round -------------------------------------------------------------------------

    @property
    def in_round(self) -> bool:
        return self._round is not None

    def begin_round(self, t: int) -> None:
        self._round, self._released, self._unclipped = t, 0, None

    def end_round(self, ctx) -> None:
        t, self._round = self._round, None
        if self._released == 0:
            return
        zs = [self.update_noise] * self._released
        if self.privacy.adaptive and self.noise_multiplier > 0:
            zs.append(2 * self.count_noise)
            self._adapt(ctx, t)
        key = tuple(zs)
        if self.ledger and self.ledger[-1][0] == key:
            self.ledger[-1] = (key, self.ledger[-1][1] + 1)
        else:
            self.ledger.append((key, 1))

    def _adapt(self, ctx, t: int) -> None:
        centered, _ = self._unclipped
        total = ctx.comm.sum(float(centered))
        noise = float(dp_normals(1, self.seed, (t << 16) | _COUNT_STREAM)[0]) * self.count_noise
        frac = (total + noise) / self.expected_cohort + 0.5
        self.clip_norm *= math.exp(-self.privacy.clip_lr * (frac - self.privacy.target_quantile))

    # ---- the release -------------------------------------------------------------------------

    def average(self, ctx, vectors: torch.Tensor, center: Optional[torch.Tensor], rows,
                weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = self._round
        if rows is not None:
            raise ValueError("privacy: an average over a subset of the cohort (rows=...) would release the "
                             "subset's size; under privacy ctx.average takes the whole cohort")
        if self._released >= _COUNT_STREAM:
            raise ValueError(f"privacy: more than {_COUNT_STREAM} releases in round {t}")
        d = vectors.shape[1]
        if center is None:
            if not self._warned_center:
                warnings.warn("privacy: ctx.average was called without center=: the clients' vectors themselves "
                              "are clipped (pass center=<what the server sent> to clip updates instead)",
                              RuntimeWarning, stacklevel=3)
                self._warned_center = True
            center = torch.zeros(d, dtype=vectors.dtype, device=vectors.device)
        updates = (vectors - center[None, :]).contiguous()
        capped = None
        if self.weight_cap is not None and weights is not None:
            capped = torch.clamp(weights.to(torch.float64) / self.weight_cap, max=1.0).to(updates.dtype).contiguous()
        counter = (t << 16) | self._released
        C, z = self.clip_norm, self.update_noise if self.noise_multiplier > 0 else 0.0
        if not ctx.sharded:
            total, clipped = run_clip_and_sum(updates, capped, C, z, self.seed, counter)
        else:
            total, clipped = self._sharded_sum(ctx, updates, capped, C, z, counter)
        if self._released == 0:
            R = updates.shape[0]
            self._unclipped = ((R - clipped) - 0.5 * R, R)
        self._released += 1
        out = center.to(torch.float64).cpu() + total / (self.expected_cohort if capped is None else self.denominator)
        return out.to(device=vectors.device, dtype=vectors.dtype)

    def _sharded_sum(self, ctx, updates: torch.Tensor, weights: Optional[torch.Tensor], C: float, z: float,
                     counter: int):
        comm = ctx.comm
        counts = [int(c[0]) for c in comm.all_gather(torch.tensor([updates.shape[0]], dtype=torch.int64))]
        start = sum(counts[: comm.rank])
        total_rows = sum(counts)
        d = updates.shape[1]
        rows, clipped = [], 0
        for first, k in tree_blocks(start, start + updates.shape[0]):
            lo = first - start
            node, c = run_clip_and_sum(updates[lo: lo + (1 << k)],
                                       None if weights is None else weights[lo: lo + (1 << k)], C, 0.0, 0, 0)
            clipped += c
            rows.append(torch.cat([torch.tensor([float(first), float(k)], dtype=torch.float64), node]))
        mine = torch.stack(rows) if rows else torch.empty(0, d + 2, dtype=torch.float64)
        every = comm.all_gather_rows(mine)
        nodes = {(int(r[0]), int(r[1])): r[2:].clone() for r in every}
        total = tree_combine(nodes, total_rows, d)
        if z > 0:
            total = total + (z * C) * dp_normals(d, self.seed, counter)
        return total, clipped  # this rank's rows clipped (_adapt sums over the ranks)

    # ---- accounting --------------------------------------------------------------------------

    def epsilon(self) -> float:
        """ε of the releases so far at the settings' δ (0 before any)."""
        if not self.ledger:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        p = self.privacy
        acc = accounting.new_accountant(p.accountant, p.sampling)
        for zs, n in self.ledger:
            acc.compose(accounting.round_event(list(zs), sampling=p.sampling, population=self.population,
                                               cohort=self.cohort), n)
        return float(acc.get_epsilon(p.delta))

    def state_dict(self) -> dict:
        return {"clip_norm": self.clip_norm, "ledger": [list(z) + [n] for z, n in self.ledger]}

    def load_state_dict(self, saved: dict) -> None:
        self.clip_norm = float(saved["clip_norm"])
        self.ledger = [(tuple(float(v) for v in row[:-1]), int(row[-1])) for row in saved["ledger"]]
