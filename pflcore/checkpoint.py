"""Checkpoints of a run (DESIGN.md §5): atomic, written per rank, restorable on any number of
ranks.

A checkpoint folder holds

    federation.pt         the whole federation and the model (rank 0, once)
    round_T.rank<r>.pt    (sharded runs) rank r's state, i.e. its clients' rows of every
                          per-client field, and its client range
    round_T.pt            round T's record: round, algorithm, history, config, the number of
                          ranks and their client ranges, and (one process) the state itself

Every file is written to a temporary name and renamed, and ``round_T.pt`` is written last, by
rank 0, after a barrier that every rank reaches once its own file is in place: a round whose
``round_T.pt`` exists is complete. Restoring on W' ranks re-splits the per-client fields
(``per_client()`` in the state dataclasses) along the clients: each rank reads the files of the
ranks whose clients overlap its own; every other field is the same on every rank.
"""
from __future__ import annotations

import copy
import glob
import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, List, Tuple

import torch

from pflcore import ops
from pflcore.distributed import Comm

_ROUND = re.compile(r"round_(\d+)\.pt$")


def _atomic_save(obj, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # never a torn file


def save(folder: str, t: int, algorithm, state, history, config, federation, model, comm: Comm,
         client_range: Tuple[int, int], ranges: List[Tuple[int, int]]) -> None:
    """Writes round ``t`` (called by every rank of the run at the same point)."""
    os.makedirs(folder, exist_ok=True)
    fed_path = os.path.join(folder, "federation.pt")
    if comm.rank == 0 and not os.path.exists(fed_path):
        _atomic_save({"federation": federation, "model": model}, fed_path)
    record = {"round": t, "algorithm": algorithm, "history": history, "config": config, "world": comm.world,
              "ranges": ranges}
    if comm.world == 1:
        record["state"] = state
    else:
        _atomic_save({"range": client_range, "state": state}, os.path.join(folder, f"round_{t:07d}.rank{comm.rank}.pt"))
        comm.barrier()  # every rank's file is in place before the record says the round is complete
    if comm.rank == 0:
        _atomic_save(record, os.path.join(folder, f"round_{t:07d}.pt"))
    if comm.world > 1:
        comm.barrier()  # nobody moves on (and may fail) before the round is recorded


def latest(folder: str) -> str:
    """Path of the newest complete round record in ``folder``."""
    records = sorted(p for p in glob.glob(os.path.join(folder, "round_*.pt")) if _ROUND.search(os.path.basename(p)))
    if not records:
        raise ValueError(f"checkpoint: no round_*.pt files in {folder!r}")
    return records[-1]


def load(folder: str, lo: int, hi: int) -> dict:
    """The newest complete round, with the state of clients ``lo .. hi-1``."""
    record = torch.load(latest(folder), weights_only=False)
    if "world" not in record or record["world"] == 1:  # one process wrote the whole state
        m = record.get("ranges", [(0, None)])[0][1]
        parts = [(0, m if m is not None else hi, record["state"])]
    else:
        t, parts = record["round"], []
        for r, (plo, phi) in enumerate(record["ranges"]):
            if phi <= lo or plo >= hi:
                continue  # no client of ours: not read
            part = torch.load(os.path.join(folder, f"round_{t:07d}.rank{r}.pt"), weights_only=False)
            parts.append((plo, phi, part["state"]))
    whole = len(parts) == 1 and parts[0][0] == lo and parts[0][1] == hi
    record["state"] = parts[0][2] if whole else reshard(parts, lo, hi)
    return record


# ---- re-splitting a state along the clients ----------------------------------------------------

def _rows(parts: List[Tuple[int, int, torch.Tensor]], lo: int, hi: int, dim: int = 0) -> torch.Tensor:
    pieces = []
    for plo, phi, t in parts:
        a, b = max(lo, plo), min(hi, phi)
        if a < b:
            pieces.append(t.narrow(dim, a - plo, b - a))
    return torch.cat(pieces, dim).clone()


def _reshard_anderson(parts, lo: int, hi: int) -> ops.Anderson:
    """An Anderson mixer over a per-client fixed point [m_r, d]: its stored pairs [H, m_r·d] are
    re-split along the clients; the Gram matrix and weights are global already."""
    first = parts[0][2]
    out = copy.copy(first)
    if hasattr(first, "_R"):
        H = first._R.shape[0]
        d = first._shape[1]
        views = lambda name: [(plo, phi, getattr(a, name).view(H, phi - plo, d)) for plo, phi, a in parts]  # noqa: E731
        out._R = _rows(views("_R"), lo, hi, dim=1).view(H, -1)
        out._TU = _rows(views("_TU"), lo, hi, dim=1).view(H, -1)
        out._shape = (hi - lo, d)
    return out


def reshard(parts: List[Tuple[int, int, Any]], lo: int, hi: int) -> Any:
    """The state of clients ``lo .. hi-1`` from states of consecutive client ranges ``(plo, phi,
    state)`` (the parts overlapping [lo, hi), in client order)."""
    first = parts[0][2]
    if not is_dataclass(first):
        return copy.deepcopy(first)
    out = copy.copy(first)
    for f in fields(first):
        values = [(plo, phi, getattr(s, f.name)) for plo, phi, s in parts]
        v = values[0][2]
        if v is None:
            continue
        if f.metadata.get("per_client"):
            setattr(out, f.name, _rows(values, lo, hi))
        elif isinstance(v, ops.Anderson):
            # AcceleratedState.per_client says whether its mixer's history is per client
            setattr(out, f.name, _reshard_anderson(values, lo, hi) if getattr(first, "per_client", False)
                    else copy.deepcopy(v))
        elif is_dataclass(v):
            setattr(out, f.name, reshard(values, lo, hi))
        else:  # the same on every rank
            setattr(out, f.name, copy.deepcopy(v))
    return out
