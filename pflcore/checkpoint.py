"""Checkpoints of a run (DESIGN.md §5): atomic, written per rank, restorable on any number of
ranks, and bound to one run.

A checkpoint folder holds

    run.json              the fingerprint of the run the folder belongs to (written first)
    federation.pt         the whole federation and the model (rank 0, once)
    round_T.rank<r>.pt    (sharded runs) rank r's state, i.e. its clients' rows of every
                          per-client field, and its client range
    round_T.pt            round T's record: round, algorithm, history, config, the number of
                          ranks and their client ranges, and (one process) the state itself

One folder, one run: the fingerprint names what decides the run's trajectory (the algorithm and
its hyperparameters, the model, a SHA-256 of the federation's tensors, the seed, the clients per
round, the device type and the number of ranks). ``run`` into a folder whose ``run.json`` holds
another fingerprint is refused with the differences, before any round; the same run again
(same fingerprint) rewrites the same files with the same bytes. ``resume`` may change the number
of ranks (the state is re-split), nothing else.

Every file is written to a temporary name, flushed to disk and renamed, and ``round_T.pt`` is
written last, by rank 0, after a barrier that every rank reaches once its own file is in place:
a round whose ``round_T.pt`` exists is complete. A file that cannot be read back (truncated,
empty, not a checkpoint) is named in the error; ``load`` then falls back to the newest round
whose files are all intact and warns which one it used. Restoring on W' ranks re-splits the
per-client fields (``per_client()`` in the state dataclasses) along the clients: each rank reads
the files of the ranks whose clients overlap its own; every other field is the same on every
rank.
"""
from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import re
import warnings
from dataclasses import fields, is_dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from pflcore import ops
from pflcore.distributed import Comm

_ROUND = re.compile(r"round_(\d+)\.pt$")
FINGERPRINT = "run.json"
FEDERATION = "federation.pt"
_FORMAT = 1  # of run.json


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used: another run's, empty, or unreadable."""


# ---- writing ------------------------------------------------------------------------------------

def _atomic_write(path: str, write) -> None:
    """``write(fileobj)`` to a temporary name beside ``path``, flushed to disk, then renamed over
    ``path``: a reader sees the old file or the whole new one, never a torn file."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_save(obj, path: str) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


def save(folder: str, t: int, algorithm, state, history, config, federation, model, comm: Comm,
         client_range: Tuple[int, int], ranges: List[Tuple[int, int]]) -> None:
    """Writes round ``t`` (called by every rank of the run at the same point)."""
    os.makedirs(folder, exist_ok=True)
    fed_path = os.path.join(folder, FEDERATION)
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


# ---- the fingerprint of a run -------------------------------------------------------------------

def federation_digest(federation) -> str:
    """SHA-256 over the bytes, dtypes and shapes of every tensor of a federation (train and test
    features, labels and offsets, client weights, true models) and its number of classes. Every
    byte is hashed: about 0.13 s per 200 MB on one core, a small part of any run on such data."""
    h = hashlib.sha256(f"classes={federation.num_classes};".encode())
    parts = [("train.x", federation.train.x), ("train.y", federation.train.y),
             ("train.offsets", federation.train.offsets), ("test.x", federation.test.x),
             ("test.y", federation.test.y), ("test.offsets", federation.test.offsets),
             ("weights", federation.weights), ("truth", federation.truth), ("truth_global", federation.truth_global)]
    for name, t in parts:
        if t is None:
            h.update(f"{name}=None;".encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{str(t.dtype)}:{list(t.shape)};".encode())
        if t.numel():
            h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def fingerprint(algorithm, federation, model, *, seed: int, clients_per_round, device, ranks: int) -> Dict[str, Any]:
    """What defines a run's trajectory, as JSON-able strings and numbers."""
    return {
        "algorithm": type(algorithm).__name__,
        "hyperparameters": {k: repr(v) for k, v in algorithm.hyperparameters().items()},
        "model": repr(model),
        "federation": {"name": federation.name, "clients": federation.num_clients,
                       "features": federation.num_features, "train_rows": federation.train.num_rows,
                       "test_rows": federation.test.num_rows,
                       "dtype": str(federation.train.dtype).replace("torch.", ""),
                       "sha256": federation_digest(federation)},
        "seed": seed,
        "clients_per_round": clients_per_round,
        "device": torch.device(device).type,
        "ranks": ranks,
    }


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def differences(mine: Dict[str, Any], theirs: Dict[str, Any], ignore=()) -> List[str]:
    """``key: value here vs value there`` for every entry where two fingerprints differ."""
    a, b = _flat(mine), _flat(theirs)
    out = []
    for k in list(a) + [k for k in b if k not in a]:
        if k in ignore or k.startswith("federation.name") or a.get(k, "absent") == b.get(k, "absent"):
            continue
        va, vb = a.get(k, "absent"), b.get(k, "absent")
        if k == "federation.sha256":
            out.append(f"federation content: sha256 {str(va)[:12]}… in this run, {str(vb)[:12]}… in the folder")
        else:
            out.append(f"{k}: {va} in this run, {vb} in the folder")
    return out


def _round_files(folder: str) -> List[str]:
    return sorted(p for p in glob.glob(os.path.join(folder, "round_*.pt")) if _ROUND.search(os.path.basename(p)))


def read_fingerprint(folder: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(folder, FINGERPRINT)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            stored = json.load(fh)
        return stored["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint: {path} is unreadable ({type(exc).__name__}: {exc}); it records which "
                              "run the folder belongs to, so the folder cannot be used") from None


def claim(folder: str, fp: Dict[str, Any], comm: Comm, *, resuming: bool) -> None:
    """Binds ``folder`` to the run of fingerprint ``fp`` before its first round, or refuses it
    (on every rank) when it holds another run. Called by every rank."""
    problem, stored = None, None
    if os.path.exists(folder) and not os.path.isdir(folder):
        problem = f"checkpoint: {folder!r} exists and is not a folder"
    elif os.path.isdir(folder):
        try:
            stored = read_fingerprint(folder)
        except CheckpointError as exc:
            problem = str(exc)
        if stored is not None:
            diff = differences(fp, stored, ignore=("ranks",) if resuming else ())
            if diff:
                problem = (f"checkpoint: {folder!r} holds the checkpoints of another run ({'; '.join(diff)}); "
                           "pass another folder, or delete this one to start over")
        elif problem is None and not resuming and (_round_files(folder)
                                                   or os.path.exists(os.path.join(folder, FEDERATION))):
            problem = (f"checkpoint: {folder!r} holds checkpoint files but no {FINGERPRINT} (written by an older "
                       "pflcore?), so this run cannot be told apart from theirs; pass another folder")
    if comm.max(0.0 if problem is None else 1.0) > 0:
        raise CheckpointError(problem or f"checkpoint: {folder!r} was refused on another rank "
                                         f"(this is rank {comm.rank})")
    if comm.rank == 0 and stored != fp:  # a new folder, an older one being resumed, or new ranks
        import pflcore

        os.makedirs(folder, exist_ok=True)
        text = json.dumps({"format": _FORMAT, "pflcore": pflcore.__version__, "fingerprint": fp}, indent=1)
        _atomic_write(os.path.join(folder, FINGERPRINT), lambda fh: fh.write(text.encode()))
    if comm.world > 1:
        comm.barrier()


# ---- reading ------------------------------------------------------------------------------------

def _read(path: str, what: str, keys=()) -> Any:
    """torch.load of one checkpoint file, or a CheckpointError naming it."""
    try:
        obj = torch.load(path, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {path} is missing ({what})") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, OSError, UnpicklingError ... on torn files
        detail = (str(exc).splitlines() or [""])[0].split(". ")[0][:160]  # torch's messages run on
        raise CheckpointError(f"checkpoint: {path} is unreadable ({what}; truncated or corrupt: "
                              f"{type(exc).__name__}: {detail})") from None
    if keys and (not isinstance(obj, dict) or any(k not in obj for k in keys)):
        raise CheckpointError(f"checkpoint: {path} is not a pflcore checkpoint file ({what}: expected the keys "
                              f"{list(keys)})")
    return obj


def _check_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint: no folder {folder!r}" if not os.path.exists(folder)
                              else f"checkpoint: {folder!r} is not a folder")
    names = (FINGERPRINT, FEDERATION)
    if not _round_files(folder) and not any(os.path.exists(os.path.join(folder, n)) for n in names):
        raise CheckpointError(f"checkpoint: {folder!r} holds no checkpoint (no {FINGERPRINT}, {FEDERATION} or "
                              "round_*.pt files)")


def load_federation(folder: str) -> dict:
    """The federation and model of the run saved in ``folder``."""
    _check_folder(folder)
    path = os.path.join(folder, FEDERATION)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint: {folder!r} has no {FEDERATION} yet (the run stopped before its first "
                              "checkpoint); start it again with pflcore.run")
    return _read(path, "the federation and model, written once per folder: the run cannot be resumed without it",
                 keys=("federation", "model"))


def latest(folder: str) -> str:
    """Path of the newest round record in ``folder`` (complete, not necessarily readable)."""
    records = _round_files(folder)
    if not records:
        raise CheckpointError(f"checkpoint: no round_*.pt files in {folder!r} (the run stopped before its first "
                              "checkpoint); start it again with pflcore.run")
    return records[-1]


def _load_round(folder: str, path: str, lo: int, hi: int) -> dict:
    record = _read(path, "a round record", keys=("round", "algorithm", "history", "config"))
    if "world" not in record or record["world"] == 1:  # one process wrote the whole state
        if "state" not in record:
            raise CheckpointError(f"checkpoint: {path} is not a pflcore checkpoint file (a round record without "
                                  "its state)")
        m = record.get("ranges", [(0, None)])[0][1]
        parts = [(0, m if m is not None else hi, record["state"])]
    else:
        t, parts = record["round"], []
        for r, (plo, phi) in enumerate(record["ranges"]):
            if phi <= lo or plo >= hi:
                continue  # no client of ours: not read
            part = _read(os.path.join(folder, f"round_{t:07d}.rank{r}.pt"), f"rank {r}'s state of round {t}",
                         keys=("state",))
            parts.append((plo, phi, part["state"]))
    whole = len(parts) == 1 and parts[0][0] == lo and parts[0][1] == hi
    record["state"] = parts[0][2] if whole else reshard(parts, lo, hi)
    return record


def load(folder: str, lo: int, hi: int, comm: Optional[Comm] = None) -> dict:
    """The newest round whose files are intact, with the state of clients ``lo .. hi-1``. Newer
    rounds that cannot be read are named in a warning (every rank settles on the same round)."""
    comm = Comm() if comm is None else comm
    _check_folder(folder)
    records = _round_files(folder)
    if not records:
        latest(folder)  # raises: no round yet
    skipped: List[str] = []
    for path in reversed(records):
        try:
            record, problem = _load_round(folder, path, lo, hi), None
        except CheckpointError as exc:
            record, problem = None, str(exc)
        if comm.max(0.0 if problem is None else 1.0) > 0:  # a round is used only if every rank can read it
            skipped.append(problem or f"checkpoint: {path} is unreadable on another rank")
            continue
        if skipped:
            warnings.warn(f"{'; '.join(skipped)}. Resuming from round {record['round']} ({path}), the newest "
                          "intact round", RuntimeWarning, stacklevel=3)
        return record
    raise CheckpointError(f"checkpoint: no intact round in {folder!r}: " + "; ".join(skipped))


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
