"""Checkpoints of a run (DESIGN.md §5): atomic, written per rank, restorable on any number of
ranks, and bound to one run.

A checkpoint folder holds

    run.json              the fingerprint of the run the folder belongs to (written first)
    writer.lock           the lock of the one process writing the folder, naming it (pid, host, since)
    federation.pt         the whole federation and the model (rank 0, once)
    round_T.rank<r>.pt    (sharded runs) rank r's state, i.e. its clients' rows of every
                          per-client field, and its client range
    round_T.pt            round T's record: round, algorithm, history, config, the number of
                          ranks and their client ranges, the run's digest, and (one process) the
                          state itself

One folder, one run: the fingerprint names what decides the run's trajectory (the algorithm and
its hyperparameters, the model, a SHA-256 of the federation's tensors, the seed, the clients per
round, the device type and the number of ranks). ``run`` into a folder whose ``run.json`` holds
another fingerprint is refused with the differences, before any round; the same run again
(same fingerprint) rewrites the same files with the same bytes. ``resume`` may change the number
of ranks (the state is re-split), nothing else.

Guarantees:

- One writer per folder. From ``claim`` to the end of ``run`` (success or any exception,
  DivergenceError and KeyboardInterrupt included) rank 0 holds an exclusive ``flock`` on
  ``writer.lock``; another process running or resuming into the folder meanwhile is refused,
  on every rank, with a CheckpointBusyError naming the folder and the holder. The kernel drops
  the lock of a process that dies (kill -9 included): the next writer takes it over, and removes
  the temporaries the dead one left. (flock: local file systems and NFS; where locks are not
  supported a warning says the folder is unguarded.)
- Atomic, collision-free files. Every file is written to a temporary name of its own
  (``.NAME.<pid>.<random>.tmp``), flushed to disk and renamed, and ``round_T.pt`` is written
  last, by rank 0, once every rank's file is in place: a round whose ``round_T.pt`` exists is
  complete.
- Write errors named. A write that fails (no space left, file too large, read-only, no
  permission ...) removes its temporary and raises a CheckpointError naming the file and the
  OS's reason (ENOSPC ...), on every rank, where torch.save would say "unexpected pos"; the
  rounds written before stay intact.
- Torn and alien round files skipped. A file that cannot be read back (truncated, empty, not a
  checkpoint) is named in the error; a round file of another run (each carries the digest of its
  run's fingerprint, ``run_digest``; files of the previous format are compared on their config)
  or whose per-client state has another number of clients is named too. ``load`` falls back to
  the newest round of this run whose files are all intact and warns which files it skipped.
- A missing class is not a torn file. A file that names a class this process cannot import (an
  algorithm defined in the script that ran, ``__main__``, or in a module not on the path) raises
  MissingClassError naming the class, its module and what to import; no round is skipped for it.

Restoring on W' ranks re-splits the per-client fields (``per_client()`` in the state
dataclasses) along the clients: each rank reads the files of the ranks whose clients overlap
its own; every other field is the same on every rank.
"""
from __future__ import annotations

import copy
import datetime
import errno
import fcntl
import functools
import glob
import hashlib
import json
import os
import pickle
import re
import secrets
import socket
import threading
import types
import warnings
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from pflcore import ops
from pflcore.distributed import Comm

_ROUND = re.compile(r"round_(\d+)\.pt$")
FINGERPRINT = "run.json"
FEDERATION = "federation.pt"
LOCK = "writer.lock"
_FORMAT = 1  # of run.json


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used: another run's, empty, unreadable, or unwritable."""


class CheckpointBusyError(CheckpointError):
    """The checkpoint folder is being written by another live process (it holds the folder's lock)."""


class MissingClassError(CheckpointError):
    """An intact checkpoint file holds objects whose classes this process cannot import (an
    algorithm or state class defined in the script that ran, ``__main__``, or in a module not on
    the path). ``classes`` lists them as (module, name), ``path`` names the file. Not a torn
    file: it is never skipped, since every older round of the run needs the same classes."""

    def __init__(self, message: str, *, classes: Tuple[Tuple[str, str], ...] = (), path: str = ""):
        super().__init__(message)
        self.classes, self.path = tuple(classes), path


# ---- one writer per folder ----------------------------------------------------------------------

class FolderLock:
    """An exclusive ``flock`` on ``FOLDER/writer.lock``, held by the one process that writes the
    folder. The kernel drops it when that process dies (kill -9 included), so the lock of a
    killed writer is taken over by the next one without any clean-up. The file stays after
    release: unlinking it would let a process that opened the old file and one that creates a
    new one both hold "the" lock. It records its holder (pid, host, time) for the refusal."""

    def __init__(self, folder: str):
        self.folder, self.path, self._fd = folder, os.path.join(folder, LOCK), None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock, or raises CheckpointBusyError naming the live holder."""
        os.makedirs(self.folder, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_error(self.path, exc, "cannot open the writer lock") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointBusyError(f"checkpoint: {self.folder!r} is being written by another run ({holder}; "
                                      f"lock {self.path}): one writer per folder. Wait for it to end, or pass "
                                      "another folder") from None
        except OSError as exc:  # a file system without locks (ENOLCK, EOPNOTSUPP): nothing to hold
            os.close(fd)
            warnings.warn(f"checkpoint: cannot lock {self.path} ({os.strerror(exc.errno or 0)}): a second process "
                          "writing this folder at the same time will not be refused", RuntimeWarning, stacklevel=4)
            return
        self._fd = fd
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        line = (json.dumps(me) + "\n").encode()
        os.pwrite(fd, line, 0)  # one line, then cut: a reader sees a whole line (or the old one)
        os.ftruncate(fd, len(line))

    def release(self) -> None:
        """Drops the lock (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:  # unlocked explicitly: a child forked meanwhile shares the open file, and its lock
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _holder(fd: int) -> str:
    """"pid P on HOST since T" from a lock file's first line (best effort: it is what the holder wrote)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).split(b"\n")[0])
        text = f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: the lock file names none yet"
    if info["host"] == socket.gethostname() and not _alive(info["pid"]):
        text += " (that pid is gone: a process it started, which inherited the lock, still holds it)"
    return text


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, TypeError):
        return True  # e.g. another user's process: it exists
    return True


# The locks ``claim`` took during the current call of ``run`` (a stack: a callback may run another
# run), released when that call ends however it ends. ``run`` is decorated rather than wrapped in
# a try/finally so that its body, with its many exits, stays as it is.
_scopes = threading.local()


def releases_locks(fn: Callable) -> Callable:
    """Decorator (of ``run``): every folder lock that ``claim`` takes during a call of ``fn`` is
    released when the call returns or raises, whatever it raises (DivergenceError,
    KeyboardInterrupt, a write error ...)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        stack = _scopes.__dict__.setdefault("stack", [])
        stack.append([])
        try:
            return fn(*args, **kwargs)
        finally:
            for lock in stack.pop():
                lock.release()
    return call


def _in_scope(lock: FolderLock) -> None:
    stack = getattr(_scopes, "stack", None)
    if stack:
        stack[-1].append(lock)


# ---- writing ------------------------------------------------------------------------------------

_HINTS = {errno.ENOSPC: "free some space or pass a folder on another disk",
          errno.EDQUOT: "the disk quota is used up: free some space or pass a folder on another disk",
          errno.EFBIG: "the file is larger than the file size limit (ulimit -f) or the file system allows",
          errno.EROFS: "the file system is read-only: pass a writable folder",
          errno.EACCES: "this user may not write there: pass a writable folder",
          errno.EPERM: "this user may not write there: pass a writable folder"}


def _os_error(path: str, exc: OSError, what: str = "cannot write") -> CheckpointError:
    """A one-line CheckpointError naming ``path`` and the OS's reason (e.g. ENOSPC)."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    reason = (os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__).lower()
    hint = f"; {_HINTS[exc.errno]}" if exc.errno in _HINTS else ""
    return CheckpointError(f"checkpoint: {what} {path}: {reason}{f' ({code})' if code else ''}{hint}")


class _RecordingWriter:
    """A file's ``write`` that keeps the OSError it raised: torch.save turns a failed write into a
    RuntimeError ("[enforce fail at inline_container.cc:...] unexpected pos ...") that hides
    the OS's reason (ENOSPC, EFBIG ...). Nothing is copied: the state is not serialized twice."""

    def __init__(self, fh):
        self._fh, self.error = fh, None

    def write(self, data) -> int:
        if self.error is not None:  # torch may go on writing after a failed write
            raise self.error
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _atomic_write(path: str, write) -> None:
    """``write(fileobj)`` to a temporary name beside ``path``, flushed to disk, then renamed over
    ``path``: a reader sees the old file or the whole new one, never a torn file. The temporary's
    name is this process's own (pid and a random token): two writers never share one. It is
    removed when anything fails; an OSError (no space left, file too large, read-only ...) is
    raised as a CheckpointError naming ``path`` and the reason."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            recording = _RecordingWriter(fh)
            try:
                write(recording)
            except Exception as exc:
                if recording.error is not None and recording.error is not exc:
                    raise recording.error from exc
                raise
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError):
            raise _os_error(path, exc) from exc
        raise


def _remove_temporaries(folder: str) -> None:
    """Removes the temporaries of writers that died mid-write (kill -9, power cut): called by
    the lock's holder, the folder's only writer, before it writes."""
    for path in glob.glob(os.path.join(folder, ".*.tmp")):
        _remove(path)


def _atomic_save(obj, path: str) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


def _agree(problem: Optional[CheckpointError], comm: Comm, others: str) -> None:
    """Raises on every rank when any rank has a ``problem`` (its own error there, ``others``
    elsewhere); a collective, so it is also a barrier. A busy folder stays a CheckpointBusyError
    on every rank."""
    code = 0.0 if problem is None else 2.0 if isinstance(problem, CheckpointBusyError) else 1.0
    worst = comm.max(code) if comm.world > 1 else code
    if problem is not None:
        raise problem
    if worst > 0:
        kind = CheckpointBusyError if worst == 2.0 else CheckpointError
        raise kind(f"{others} (this is rank {comm.rank}; that rank's error names the cause)")


def _attempt(fn: Callable[[], None]) -> Optional[CheckpointError]:
    """``fn()``'s CheckpointError, returned rather than raised (for ``_agree``)."""
    try:
        fn()
    except CheckpointError as exc:
        return exc
    return None


def run_digest(fp: Dict[str, Any]) -> str:
    """SHA-256 of a fingerprint without its number of ranks (a resume may change it): stored in
    every round file so that a round file of another run, copied in, is told apart."""
    same = {k: v for k, v in fp.items() if k != "ranks"}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()


def _folder_digest(folder: str) -> str:
    fp = read_fingerprint(folder)
    if fp is None:
        raise CheckpointError(f"checkpoint: {os.path.join(folder, FINGERPRINT)} is missing: it was removed during "
                              "the run, so its round files cannot be bound to it")
    return run_digest(fp)


def save(folder: str, t: int, algorithm, state, history, config, federation, model, comm: Comm,
         client_range: Tuple[int, int], ranges: List[Tuple[int, int]], privacy: Optional[dict] = None) -> None:
    """Writes round ``t`` (called by every rank of the run at the same point). A file that
    cannot be written raises a CheckpointError naming it and the reason, on every rank.
    ``privacy``: the privacy mechanism's state (the same on every rank), restored on resume."""
    digest = _folder_digest(folder)  # the run.json that ``claim`` wrote: small, read once per round
    record = {"round": t, "algorithm": algorithm, "history": history, "config": config, "world": comm.world,
              "ranges": ranges, "run": digest}
    if privacy is not None:
        record["privacy"] = privacy
    fed_path = os.path.join(folder, FEDERATION)

    def mine():
        if comm.rank == 0 and not os.path.exists(fed_path):
            _atomic_save({"federation": federation, "model": model}, fed_path)
        if comm.world > 1:
            _atomic_save({"range": client_range, "state": state, "run": digest},
                         os.path.join(folder, f"round_{t:07d}.rank{comm.rank}.pt"))

    if comm.world == 1:
        mine()
        record["state"] = state
        _atomic_save(record, os.path.join(folder, f"round_{t:07d}.pt"))
        return
    # every rank's file is in place before the record says the round is complete
    _agree(_attempt(mine), comm, f"checkpoint: writing round {t} to {folder!r} failed on another rank")
    problem = _attempt(lambda: _atomic_save(record, os.path.join(folder, f"round_{t:07d}.pt"))) \
        if comm.rank == 0 else None
    # nobody moves on (and may fail) before the round is recorded
    _agree(problem, comm, f"checkpoint: writing round {t}'s record to {folder!r} failed on rank 0")


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


def fingerprint(algorithm, federation, model, *, seed: int, clients_per_round, device, ranks: int,
                privacy=None) -> Dict[str, Any]:
    """What defines a run's trajectory, as JSON-able strings and numbers."""
    out = {
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
    if privacy is not None:  # absent without: the fingerprints of runs without privacy are unchanged
        out["privacy"] = {k: repr(v) for k, v in privacy.as_dict().items()}
    return out


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


def _foreign(folder: str, fp: Dict[str, Any], resuming: bool) -> Optional[CheckpointError]:
    """Why ``folder`` cannot take the run of fingerprint ``fp``, or None."""
    if not os.path.isdir(folder):
        return None
    try:
        stored = read_fingerprint(folder)
    except CheckpointError as exc:
        return exc
    if stored is not None:
        diff = differences(fp, stored, ignore=("ranks",) if resuming else ())
        if diff:
            return CheckpointError(f"checkpoint: {folder!r} holds the checkpoints of another run ({'; '.join(diff)}); "
                                   "pass another folder, or delete this one to start over")
    elif not resuming and (_round_files(folder) or os.path.exists(os.path.join(folder, FEDERATION))):
        return CheckpointError(f"checkpoint: {folder!r} holds checkpoint files but no {FINGERPRINT} (written by an "
                               "older pflcore?), so this run cannot be told apart from theirs; pass another folder")
    return None


def claim(folder: str, fp: Dict[str, Any], comm: Comm, *, resuming: bool) -> Optional[FolderLock]:
    """Binds ``folder`` to the run of fingerprint ``fp`` before its first round, or refuses it
    (on every rank) when another live process writes it (CheckpointBusyError) or it holds
    another run. Called by every rank. Rank 0 takes the folder's lock and returns it (other
    ranks: None); inside ``run`` (see ``releases_locks``) it is released when the run ends,
    else it is the caller's to release."""
    problem, lock = None, None
    if os.path.exists(folder) and not os.path.isdir(folder):
        problem = CheckpointError(f"checkpoint: {folder!r} exists and is not a folder")
    elif comm.rank == 0:
        lock = FolderLock(folder)
        problem = _attempt(lock.acquire)
        if problem is None:
            _in_scope(lock)
    try:
        _agree(problem, comm, f"checkpoint: {folder!r} was refused on another rank")
        _agree(_foreign(folder, fp, resuming), comm, f"checkpoint: {folder!r} was refused on another rank")
        if comm.rank == 0:
            _remove_temporaries(folder)  # only the lock's holder may: nobody else writes the folder now
            if read_fingerprint(folder) != fp:  # a new folder, an older one being resumed, or new ranks
                import pflcore

                text = json.dumps({"format": _FORMAT, "pflcore": pflcore.__version__, "fingerprint": fp}, indent=1)
                _atomic_write(os.path.join(folder, FINGERPRINT), lambda fh: fh.write(text.encode()))
        if comm.world > 1:
            comm.barrier()
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


# ---- reading ------------------------------------------------------------------------------------

class _Absent:
    """Stands in for a class the unpickler cannot find, so that the load goes on and every missing
    class of the file is named at once (the object built from it is thrown away)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


_unpickling = threading.local()  # .missing: the classes the current load could not find


class _Unpickler(pickle.Unpickler):
    """pickle's Unpickler that tells a class it cannot find apart from a torn file: the class
    lookup of an intact file fails with AttributeError ("Can't get attribute 'FedRep' on
    <module '__main__'>") or ImportError, which torch.load would pass on like any other error.
    It records the class and goes on with a stand-in."""

    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as exc:
            missing = getattr(_unpickling, "missing", None)
            if missing is None:  # not inside _read: the plain behaviour
                raise
            if (module, name) not in [(m, n) for m, n, _ in missing]:
                missing.append((module, name, exc))
            return _Absent


# pickle, with the Unpickler above, for torch.load(pickle_module=...) (torch subclasses its Unpickler)
_pickle = types.ModuleType("pickle")
_pickle.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
_pickle.Unpickler = _Unpickler


def _missing_classes(path: str, missing: List[Tuple[str, str, BaseException]]) -> MissingClassError:
    """What to do when the intact file at ``path`` names classes this process cannot import."""
    names = lambda items: ", ".join(repr(n) for _, n, _ in items)  # noqa: E731
    main = [c for c in missing if c[0] == "__main__"]
    other = [c for c in missing if c[0] != "__main__"]
    parts = []
    if main:
        first = main[0][1]
        parts.append(f"the class(es) {names(main)} defined in the script that ran it (module '__main__'), which "
                     f"this process does not define ({type(main[0][2]).__name__}: {main[0][2]}). Define or import "
                     f"them in the script that resumes, before calling resume (e.g. `from mymodule import "
                     f"{first}`); for new runs define them in a module and import it, so that the checkpoints name "
                     "that module")
    for module in dict.fromkeys(m for m, _, _ in other):
        mine = [c for c in other if c[0] == module]
        cause = mine[0][2]
        fix = (f"put {module!r} on the Python path (PYTHONPATH, or install its package) and import it before "
               "resuming" if isinstance(cause, ImportError) else
               f"it has no such class here: renamed or removed since the run? Import a module that defines it "
               "before resuming")
        parts.append(f"the class(es) {names(mine)} of the module {module!r}, which this process cannot import "
                     f"({type(cause).__name__}: {cause}): {fix}")
    return MissingClassError(f"checkpoint: {path} is intact but holds objects of " + "; and ".join(parts),
                             classes=tuple((m, n) for m, n, _ in missing), path=path)


def _read(path: str, what: str, keys=()) -> Any:
    """torch.load of one checkpoint file, or a CheckpointError naming it (a MissingClassError
    when the file is intact but names a class this process cannot import)."""
    outer, _unpickling.missing = getattr(_unpickling, "missing", None), []
    try:
        obj = torch.load(path, weights_only=False, pickle_module=_pickle)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {path} is missing ({what})") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, OSError, UnpicklingError ... on torn files
        if _unpickling.missing:  # what failed after a stand-in was used says nothing about the file
            raise _missing_classes(path, _unpickling.missing) from None
        detail = (str(exc).splitlines() or [""])[0].split(". ")[0][:160]  # torch's messages run on
        raise CheckpointError(f"checkpoint: {path} is unreadable ({what}; truncated or corrupt: "
                              f"{type(exc).__name__}: {detail})") from None
    finally:
        missing, _unpickling.missing = _unpickling.missing, outer
    if missing:
        raise _missing_classes(path, missing)
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


def _alien(record: dict, path: str, fp: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why the round record at ``path`` is not one of the run of fingerprint ``fp`` (the folder's
    run.json), or None. A record carries its run's digest; one written before records did
    (pflcore 0.1.0 and earlier) is compared on what its config and algorithm tell."""
    if fp is None:  # a folder of an older pflcore, without run.json: nothing to compare against
        return None
    if "run" in record:
        want = run_digest(fp)
        if record["run"] == want:
            return None
        return (f"checkpoint: {path} belongs to another run (run digest {str(record['run'])[:12]}… in the file, "
                f"{want[:12]}… in {FINGERPRINT})")
    cfg, alg = record["config"], record["algorithm"]
    theirs = {"algorithm": type(alg).__name__, "model": cfg.get("model"), "seed": cfg.get("seed"),
              "clients_per_round": cfg.get("clients_per_round")}
    if hasattr(alg, "hyperparameters"):
        theirs.update({f"hyperparameters.{k}": repr(v) for k, v in alg.hyperparameters().items()})
    if record.get("ranges"):
        theirs["federation.clients"] = record["ranges"][-1][1]
    ours = _flat(fp)
    diff = [f"{k}: {v} in the file, {ours.get(k, 'absent')} in {FINGERPRINT}" for k, v in theirs.items()
            if v != ours.get(k, "absent")]
    return f"checkpoint: {path} belongs to another run ({'; '.join(diff)})" if diff else None


def _misfit(state, rows: int, path: str, prefix: str = "state") -> Optional[str]:
    """Why ``state`` does not fit ``rows`` local clients (a per-client field with another number
    of rows), or None."""
    if not is_dataclass(state):
        return None
    for f in fields(state):
        v = getattr(state, f.name)
        if f.metadata.get("per_client") and isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != rows):
            return (f"checkpoint: {path} does not fit this run ({prefix}.{f.name} has shape {list(v.shape)}, "
                    f"expected {rows} rows: one per client)")
        if is_dataclass(v) and (why := _misfit(v, rows, path, f"{prefix}.{f.name}")):
            return why
    return None


def _load_round(folder: str, path: str, lo: int, hi: int, fp: Optional[Dict[str, Any]] = None) -> dict:
    record = _read(path, "a round record", keys=("round", "algorithm", "history", "config"))
    if (why := _alien(record, path, fp)) is not None:
        raise CheckpointError(why)
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
            part_path = os.path.join(folder, f"round_{t:07d}.rank{r}.pt")
            part = _read(part_path, f"rank {r}'s state of round {t}", keys=("state",))
            if part.get("run", record.get("run")) != record.get("run"):
                raise CheckpointError(f"checkpoint: {part_path} belongs to another run than {path} (their run "
                                      "digests differ)")
            parts.append((plo, phi, part["state"]))
    whole = len(parts) == 1 and parts[0][0] == lo and parts[0][1] == hi
    if not parts or parts[0][0] > lo or parts[-1][1] < hi:
        raise CheckpointError(f"checkpoint: {path} does not fit this run (its ranks hold clients "
                              f"{record.get('ranges')}, expected clients {lo} .. {hi - 1} among them)")
    record["state"] = parts[0][2] if whole else reshard(parts, lo, hi)
    if (why := _misfit(record["state"], hi - lo, path)) is not None:
        raise CheckpointError(why)
    return record


def load(folder: str, lo: int, hi: int, comm: Optional[Comm] = None) -> dict:
    """The newest round of this folder's run whose files are intact, with the state of clients
    ``lo .. hi-1``. Newer rounds that cannot be read, or that belong to another run (a file
    copied in), are named in a warning (every rank settles on the same round)."""
    comm = Comm() if comm is None else comm
    _check_folder(folder)
    fp = read_fingerprint(folder)
    records = _round_files(folder)
    if not records:
        latest(folder)  # raises: no round yet
    skipped: List[str] = []
    for path in reversed(records):
        missing = None
        try:
            record, problem = _load_round(folder, path, lo, hi, fp), None
        except MissingClassError as exc:
            record, problem, missing = None, str(exc), exc
        except CheckpointError as exc:
            record, problem = None, str(exc)
        worst = comm.max(0.0 if problem is None else 2.0 if missing is not None else 1.0)
        if worst == 2.0:  # an intact file whose class is missing here: every older round needs it too
            if missing is not None:
                raise missing
            raise MissingClassError(f"checkpoint: {path} names a class that another rank cannot import (this is "
                                    f"rank {comm.rank}; that rank's error names it)", path=path)
        if worst > 0:  # a round is used only if every rank can read it
            skipped.append(problem or f"checkpoint: {path} is unreadable on another rank")
            continue
        if skipped:
            warnings.warn(f"{'; '.join(skipped)}. Resuming from round {record['round']} ({path}), the newest "
                          "intact round of this run", RuntimeWarning, stacklevel=3)
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
