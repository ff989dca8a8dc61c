"""Generalized linear model families that run in the native kernels (DESIGN.md §3).

Parameters of one model are ``d = (p + fit_intercept) * C`` numbers laid out row-major as
``[p (+1), C]``; the intercept row multiplies an implicit feature equal to 1. Each client
objective is ``f_i(θ) = mean loss over the client's rows + l2/2·‖θ‖²``.
"""
from __future__ import annotations

import torch

from pflcore._checks import check_real

MAX_SIZE = 2**31 - 1

# Must match enum pflcore::Family in csrc/include/pflcore/common.h.
FAMILY_CODE = {"least_squares": 0, "logistic": 1, "softmax": 2}


class GLM:
    """A model family and its sizes: an immutable value (the ops read ``p``, ``C``, ``d`` on every
    call and trust them to describe the kernels' layout, so they cannot change under them)."""

    family: str = ""

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable: build a new model instead of setting {name!r}")

    def __init__(self, p: int, C: int, *, l2: float = 0.0, fit_intercept: bool = True):
        # sizes past 2**31 could not be allocated anyway; bounded here so the error names them
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= MAX_SIZE:
            raise ValueError(f"p: expected an integer in [1, {MAX_SIZE}] (features), got {p!r}")
        if isinstance(C, bool) or not isinstance(C, int) or not 1 <= C <= MAX_SIZE:
            raise ValueError(f"C: expected an integer in [1, {MAX_SIZE}] (outputs), got {C!r}")
        l2 = check_real(l2, "l2", minimum=0.0)
        P = p + int(bool(fit_intercept))
        self.__dict__.update(p=p, C=C, l2=l2, fit_intercept=bool(fit_intercept),
                             P=P,        # rows of the parameter layout: features plus the intercept row
                             d=P * C,    # parameters of one model
                             code=FAMILY_CODE[self.family])  # the family's number in the kernels

    @property
    def is_classifier(self) -> bool:
        return self.family != "least_squares"

    @property
    def num_classes(self) -> int:
        """Labels must lie in [0, num_classes)."""
        return 2 if self.family == "logistic" else self.C

    def zeros(self, m: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """``[m, d]`` parameters of m models, all zero."""
        return torch.zeros(m, self.d, dtype=dtype, device=device)

    def initial(self, m: int, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> torch.Tensor:
        """``[m, d]`` starting parameters of m models: zeros (the objectives are convex, so the
        start is not a symmetry to break). ``seed`` is accepted for the torch nets' sake."""
        return self.zeros(m, dtype, device)

    def __repr__(self) -> str:
        extra = f", C={self.C}" if self.family == "softmax" else ""
        return (f"{type(self).__name__}(p={self.p}{extra}, l2={self.l2}, "
                f"fit_intercept={self.fit_intercept})")

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and (self.p, self.C, self.l2, self.fit_intercept) == (
            other.p, other.C, other.l2, other.fit_intercept)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.p, self.C, self.l2, self.fit_intercept))


class LeastSquares(GLM):
    """Loss ``½(xᵀw − y)²`` with float targets y; C = 1."""

    family = "least_squares"

    def __init__(self, p: int, *, l2: float = 0.0, fit_intercept: bool = True):
        super().__init__(p, 1, l2=l2, fit_intercept=fit_intercept)


class Logistic(GLM):
    """Loss ``log(1 + e^z) − y z`` with labels y in {0, 1}; C = 1."""

    family = "logistic"

    def __init__(self, p: int, *, l2: float = 0.0, fit_intercept: bool = True):
        super().__init__(p, 1, l2=l2, fit_intercept=fit_intercept)


class Softmax(GLM):
    """Cross-entropy of ``softmax(xᵀW)`` over C classes."""

    family = "softmax"

    def __init__(self, p: int, C: int, *, l2: float = 0.0, fit_intercept: bool = True):
        super().__init__(p, C, l2=l2, fit_intercept=fit_intercept)
