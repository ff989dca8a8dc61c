"""A simulated federation: train and test data of the same m clients (DESIGN.md §2)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from pflcore.client_data import ClientData
from pflcore._arrays import to_tensor as as_tensor
from pflcore._checks import check_finite, check_float, check_shape


@dataclass
class Federation:
    """Train and test ``ClientData`` of the same m clients.

    ``weights`` are the client weights p_i of the global objective Σ p_i f_i (default
    n_i / N over the training rows); ``truth [m, d]`` and ``truth_global [d]`` are the true
    per-client and global models of a synthetic generator, laid out like the parameters of
    ``meta["model"]``; ``meta`` records the generator's arguments.

    ``shard(lo, hi)`` gives one rank's part of the federation (``pflcore.distributed``): the
    clients lo..hi-1 with their global ids (``train.first_client``), their weights p_i as they
    are in the whole federation (they sum to less than 1) and ``num_clients_total`` = the m of
    the whole federation.
    """

    train: ClientData
    test: ClientData
    num_classes: int
    weights: Optional[torch.Tensor] = None
    truth: Optional[torch.Tensor] = None
    truth_global: Optional[torch.Tensor] = None
    name: str = "federation"
    meta: Dict[str, Any] = field(default_factory=dict)
    num_clients_total: Optional[int] = None  # a shard's whole federation has this many clients

    def __post_init__(self):
        if not isinstance(self.train, ClientData) or not isinstance(self.test, ClientData):
            raise ValueError("train, test: expected pflcore.ClientData")
        m = self.train.num_clients
        if self.test.num_clients != m:
            raise ValueError(f"test: expected the same {m} clients as train, got {self.test.num_clients}")
        if self.test.num_features != self.train.num_features:
            raise ValueError(f"test: expected {self.train.num_features} features like train, "
                             f"got {self.test.num_features}")
        if self.test.dtype != self.train.dtype:
            raise ValueError(f"test: expected dtype {self.train.dtype} like train, got {self.test.dtype}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"num_classes: expected an integer >= 0 (0 for regression), got {self.num_classes!r}")
        if self.num_clients_total is not None and self.weights is None:
            raise ValueError("weights: a shard (num_clients_total set) needs the weights of the whole federation")
        if self.weights is None:
            sizes = self.train.sizes.to(torch.float64)
            self.weights = (sizes / sizes.sum()).to(self.train.dtype)
        else:
            w, _ = as_tensor(self.weights, "weights")
            check_float(w, "weights")
            check_shape(w, "weights", (m,), f"[m] = [{m}]")
            check_finite(w, "weights")
            whole = self.num_clients_total is None or self.num_clients_total == m
            if bool((w < 0).any()) or (whole and abs(float(w.sum()) - 1.0) > 1e-6):
                raise ValueError(f"weights: expected non-negative client weights summing to 1, "
                                 f"got sum {float(w.sum()):.6g}")
            self.weights = w.to(self.train.dtype)
        for name in ("truth", "truth_global"):
            value = getattr(self, name)
            if value is not None:
                t, _ = as_tensor(value, name)
                check_float(t, name)
                if name == "truth" and (t.dim() != 2 or t.shape[0] != m):
                    raise ValueError(f"truth: expected shape [m, d] with m = {m}, got {list(t.shape)}")
                if name == "truth_global" and t.dim() != 1:
                    raise ValueError(f"truth_global: expected shape [d], got {list(t.shape)}")
                check_finite(t, name)  # a NaN true model would make every stat_error NaN, silently
                setattr(self, name, t)

    @property
    def num_clients(self) -> int:
        return self.train.num_clients

    @property
    def num_features(self) -> int:
        return self.train.num_features

    @property
    def is_shard(self) -> bool:
        return self.num_clients_total is not None and self.num_clients_total != self.num_clients

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "Federation":
        """A copy of the federation on ``device`` and/or with floating data of ``dtype``."""
        conv = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return Federation(self.train.to(device, dtype), self.test.to(device, dtype), self.num_classes,
                          conv(self.weights), conv(self.truth), conv(self.truth_global), self.name, dict(self.meta),
                          self.num_clients_total)

    def shard(self, lo: int, hi: int) -> "Federation":
        """Clients ``lo .. hi-1`` of this (whole) federation, keeping their global ids and weights."""
        if self.is_shard:
            raise ValueError("shard: this federation is already a shard; shard the whole federation")
        rows = slice(lo, hi)
        train, test = self.train.shard(lo, hi), self.test.shard(lo, hi)
        return Federation(train, test, self.num_classes, self.weights[rows],
                          None if self.truth is None else self.truth[rows], self.truth_global, self.name,
                          dict(self.meta), self.num_clients)

    def __repr__(self) -> str:
        return (f"Federation({self.name!r}, m={self.num_clients}, p={self.num_features}, "
                f"classes={self.num_classes}, train rows={self.train.num_rows}, test rows={self.test.num_rows})")
