"""Privacy accounting with Google's ``dp-accounting`` (extra ``privacy``): ε of a run of sampled
Gaussian mechanisms, and the noise multiplier that reaches a target ε.

Each round is one sampled event: the cohort is drawn (``"poisson"``: every client independently
with probability q; ``"fixed"``: k of the N clients without replacement), and every release of
that round (``releases`` Gaussian mechanisms on the same cohort, e.g. two for the splitting
family's P_H steps, plus adaptive clipping's count) is composed inside it. Poisson cohorts are
accounted under add/remove-one adjacency with the PLD (default) or RDP accountant; fixed-size
cohorts under replace-one adjacency with the RDP accountant (the one that supports sampling
without replacement), where replacing a client moves the clipped sum by up to 2C: the Gaussian's
ratio of noise to sensitivity is then σ/2.
"""
from __future__ import annotations

import math
from typing import Sequence

ACCOUNTANTS = ("pld", "rdp")
SAMPLINGS = ("poisson", "fixed")


def _dpa():
    try:
        import dp_accounting
    except ImportError as exc:  # pragma: no cover - the extra is in dev
        raise ImportError("privacy accounting needs Google's dp-accounting: pip install 'pflcore[privacy]'") from exc
    return dp_accounting


def _check(sampling: str, accountant: str, population: int, cohort: int) -> None:
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling: expected one of {SAMPLINGS}, got {sampling!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant: expected one of {ACCOUNTANTS}, got {accountant!r}")
    if sampling == "fixed" and accountant != "rdp":
        raise ValueError("accountant: fixed-size cohorts (sampling without replacement) are accounted with 'rdp' "
                         "(dp-accounting's PLD accountant has no such event), got 'pld'")
    if not (isinstance(population, int) and isinstance(cohort, int) and 1 <= cohort <= population):
        raise ValueError(f"cohort: expected 1 <= cohort <= population, got cohort={cohort!r}, "
                         f"population={population!r}")


def round_event(noise_multipliers: Sequence[float], *, sampling: str, population: int, cohort: int):
    """The dp-accounting event of one round: its releases (one Gaussian per noise multiplier,
    each the ratio of noise std to the clipped sum's add/remove sensitivity) on a sampled cohort."""
    dpa = _dpa()
    # Gaussians on the same cohort compose into one Gaussian, exactly: 1/z² = Σ 1/z_i² (their
    # joint release is one Gaussian query of the stacked sums), which the sampled events take
    if any(z == 0 for z in noise_multipliers):
        z = 0.0
    else:
        z = sum(zi ** -2 for zi in noise_multipliers if zi != math.inf) ** -0.5 \
            if any(zi != math.inf for zi in noise_multipliers) else math.inf
    inner = dpa.GaussianDpEvent(z / 2.0 if sampling == "fixed" else z)
    if sampling == "poisson":
        return dpa.PoissonSampledDpEvent(cohort / population, inner)
    return dpa.SampledWithoutReplacementDpEvent(population, cohort, inner)


def new_accountant(accountant: str, sampling: str):
    dpa = _dpa()
    from dp_accounting.privacy_accountant import NeighboringRelation
    relation = NeighboringRelation.REPLACE_ONE if sampling == "fixed" else NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "pld":
        # 1e-3: ε to ~4 digits of the default 1e-4's (still an upper bound), ~10x faster
        return dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
    return dpa.rdp.RdpAccountant(neighboring_relation=relation)


def epsilon(noise_multiplier: float, *, rounds: int, population: int, cohort: int, delta: float,
            releases: int = 1, sampling: str = "poisson", accountant: str = "pld") -> float:
    """ε after ``rounds`` rounds of ``releases`` Gaussian releases of noise multiplier
    ``noise_multiplier`` on cohorts of ``cohort`` of ``population`` clients, at ``delta``."""
    _check(sampling, accountant, population, cohort)
    if not (0 < delta < 1):
        raise ValueError(f"delta: expected a number in (0, 1), got {delta!r}")
    if rounds == 0 or noise_multiplier == math.inf:
        return 0.0
    acc = new_accountant(accountant, sampling)
    acc.compose(round_event([noise_multiplier] * releases, sampling=sampling, population=population, cohort=cohort),
                rounds)
    return float(acc.get_epsilon(delta))


def noise_multiplier_for(target_epsilon: float, *, rounds: int, population: int, cohort: int, delta: float,
                         releases: int = 1, sampling: str = "poisson", accountant: str = "pld") -> float:
    """The smallest noise multiplier (to 0.1 %) whose run has ε <= ``target_epsilon``
    (``dp_accounting.calibrate_dp_mechanism``)."""
    _check(sampling, accountant, population, cohort)
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"epsilon: expected a finite number > 0, got {target_epsilon!r}")
    dpa = _dpa()

    def event(z: float):
        round_ = round_event([z] * releases, sampling=sampling, population=population, cohort=cohort)
        return dpa.SelfComposedDpEvent(round_, rounds)

    bracket = dpa.mechanism_calibration.ExplicitBracketInterval(0.05, 500.0)
    z = dpa.calibrate_dp_mechanism(lambda: new_accountant(accountant, sampling), event, float(target_epsilon),
                                   float(delta), bracket_interval=bracket, tol=1e-3)
    return float(z)
