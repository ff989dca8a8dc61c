"""Which implementation of the ops a call uses (DESIGN.md §1, §8).

Backends: ``native`` (C++/OpenMP, CPU tensors), ``cuda`` (CUDA C++, CUDA tensors), ``triton``
(Triton, CUDA tensors) and ``reference`` (pure torch, any device); the torch nets (``MLP``,
``CNN``) run on their own adapter, ``nets``, chosen by the model's type. Each is an adapter in
``pflcore/backends/``; the ops an adapter serves are its methods.

Choose one with ``pflcore.backend.use("reference")`` (a context manager) or the environment
variable ``PFLCORE_BACKEND``. A backend requested by name that cannot serve a call raises at
once with the reason; one that has no kernel for an op leaves that op to the reference (so a
whole run can be forced onto triton or cuda). The automatic choice falls back in a fixed
order, per op: native -> reference for CPU tensors, cuda -> triton -> reference for CUDA
tensors. Nets take the nets adapter unless the reference is asked for.

Triton needs the ``triton`` package (``pip install 'pflcore[triton]'``) and a CUDA device.
With ``TRITON_INTERPRET=1`` set before its kernels are first loaded, they run under Triton's
CPU interpreter (slow; that is how the test suite checks them without a GPU): the backend
then serves CPU (and CUDA) tensors, but only when asked for by name.

Compiled modules are imported lazily, on first use, so ``import pflcore`` is fast and works
on a machine where they were not built.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Dict, Iterator, List, Optional, Tuple

from pflcore.backends.base import Adapter
from pflcore.backends.cuda import CudaAdapter
from pflcore.backends.native import NativeAdapter
from pflcore.backends.nets import NetsAdapter
from pflcore.backends.reference import ReferenceAdapter
from pflcore.backends.triton import TritonAdapter
from pflcore.errors import BackendUnavailable
from pflcore.models.glm import LeastSquares, Logistic, Softmax
from pflcore.models.nets import TorchNet

ADAPTERS: Dict[str, Adapter] = {a.name: a for a in (NativeAdapter(), CudaAdapter(), TritonAdapter(),
                                                    ReferenceAdapter(), NetsAdapter())}
BACKENDS = ("native", "cuda", "triton", "reference")  # the names a user may ask for
_AUTO_ORDER = {"cpu": ("native", "reference"), "cuda": ("cuda", "triton", "reference")}
REFERENCE = ADAPTERS["reference"]
_GLM_TYPES = (LeastSquares, Logistic, Softmax)  # the common case, told apart without isinstance
NETS = ADAPTERS["nets"]

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pflcore_backend", default=None)
# (op, device type, GLM classes, dtype) -> adapter of the automatic choice: the order and what
# loads never change in a process, so the walk down the order is done once.
_auto_cache: Dict[tuple, Adapter] = {}


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def adapter(name: str) -> Adapter:
    """The adapter of backend ``name`` (whether or not it loads)."""
    return ADAPTERS[_check_name(name, "backend")]


def loaded(name: str) -> Optional[object]:
    """The module of backend ``name`` if it loads, else None (no error)."""
    return adapter(name).module


def ops_of(name: str) -> Tuple[str, ...]:
    """Names of the ops backend ``name`` implements (empty if it does not load)."""
    a = adapter(name)
    return tuple(sorted(a.ops())) if a.available else ()


def status() -> Dict[str, Tuple[bool, str]]:
    """{backend: (usable, detail)} for ``pflcore info``."""
    return {name: (ADAPTERS[name].available, ADAPTERS[name].describe()) for name in BACKENDS}


def devices() -> List[str]:
    """One line per CUDA device torch sees (for ``pflcore info``), or why there is none."""
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no device or no driver")
        return [f"no CUDA device: {why}"]
    lines = []
    for i in range(torch.cuda.device_count()):
        prop = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {prop.name}, compute capability {prop.major}.{prop.minor}, "
                     f"{prop.total_memory / 2**30:.1f} GiB, {prop.multi_processor_count} SMs "
                     f"(torch CUDA {torch.version.cuda})")
    return lines


# PFLCORE_BACKEND is read on every call (a test or a user may set it at any time), from the
# environment's own dict: os.environ.get decodes and costs ~1 µs, a tenth of a small op call.
_ENV = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("PFLCORE_BACKEND") if _ENV is not None else None


def requested() -> Optional[str]:
    """The backend asked for by ``use()`` or ``PFLCORE_BACKEND``, or None for automatic."""
    name = _forced.get()
    if name is not None:
        return name
    if _ENV is not None:
        raw = _ENV.get(_ENV_KEY)
        env = None if raw is None else os.environ.decodevalue(raw)
    else:  # pragma: no cover - an environment without the private dict
        env = os.environ.get("PFLCORE_BACKEND")
    if env:
        env = env.strip()
        return _check_name(env, "PFLCORE_BACKEND") if env else None
    return None


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run the ops inside the block with backend ``name``; raises at once if it cannot load."""
    a = adapter(name)
    module, reason = a.load()
    if module is None:
        raise BackendUnavailable(f"backend {name!r} cannot be used: {reason}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def reference():
    """``use`` of the pure-torch reference: what every ``ops.<op>_ref`` runs under."""
    return use("reference")


def select(op: str, model, tensor) -> Adapter:
    """The adapter that runs ``op`` for ``model`` (None for ops without one) on tensors like
    ``tensor`` (its device type and dtype decide)."""
    dev = "cpu" if tensor.is_cpu else "cuda" if tensor.is_cuda else tensor.device.type
    if dev not in _AUTO_ORDER:
        raise ValueError(f"{op}: tensors on device {dev!r} are not served by any backend "
                         f"(pflcore runs on 'cpu' and 'cuda' tensors)")
    name = requested()
    if model is not None and type(model) not in _GLM_TYPES and isinstance(model, TorchNet):
        return REFERENCE if name == "reference" else NETS
    if name is not None:
        return _requested(name, op, model, tensor, dev)
    key = (op, dev, 0 if model is None else model.C, tensor.dtype)
    found = _auto_cache.get(key)
    if found is None:
        found = next(a for a in (ADAPTERS[n] for n in _AUTO_ORDER[dev])
                     if a.auto and a.available and op in a.ops() and not a.limit(op, model, tensor.dtype))
        _auto_cache[key] = found
    return found


def _requested(name: str, op: str, model, tensor, dev: str) -> Adapter:
    a = ADAPTERS[name]
    module, reason = a.load()
    if module is None:
        raise BackendUnavailable(f"{op}: backend {name!r} was requested but cannot be used: {reason}")
    if op not in a.ops():
        # an op the requested backend has no kernel for (sample_batches and average on triton;
        # Anderson's small solve, always on the host) runs on the reference, so that a whole run
        # can be forced onto a backend
        return REFERENCE
    if not a.serves(dev):
        served = "/".join(d for d in ("cpu", "cuda") if a.serves(d))
        raise BackendUnavailable(f"{op}: backend {name!r} was requested but it serves {served} tensors, "
                                 f"got {dev!r} tensors")
    why = a.limit(op, model, tensor.dtype)
    if why:
        raise BackendUnavailable(f"{op}: backend {name!r} was requested but cannot take these arguments: {why}")
    return a


def _reset_cache() -> None:
    """Forget the automatic choices (tests that swap a backend's module)."""
    _auto_cache.clear()


# ---- the native kernels' threads and CPU capability level -------------------------------------------

def _native_module():
    module = loaded("native")
    if module is None:
        raise RuntimeError(f"the native backend did not load: {adapter('native').describe()}")
    return module


# ---- fork -------------------------------------------------------------------------------------------
# A process started by fork() has only the forking thread: GNU libgomp's pool workers (pflcore's
# and torch's: one runtime) are gone, and a parallel region there waits for them forever. So a
# forked child runs every op on one thread; its results are bitwise those of the parent (they do
# not depend on the thread count). The native module registers the same switch with
# pthread_atfork (a fork from C); this hook also covers a parent that had not loaded it yet.
_forked_child = False


def _serial_after_fork() -> None:
    global _forked_child
    _forked_child = True
    import torch

    torch.set_num_threads(1)  # the OpenMP setting pflcore's kernels read too


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_serial_after_fork)


def forked_child() -> bool:
    """True in a process started by ``os.fork`` (or a ``multiprocessing`` 'fork' worker) after
    ``import pflcore``: its ops run on one thread (the OpenMP pool does not survive fork). Workers
    started with 'spawn' or 'forkserver' are fresh processes with the usual threads."""
    return _forked_child


def set_num_threads(n: int) -> None:
    """Threads of the native kernels' OpenMP pool, from the next call on (``OMP_NUM_THREADS`` sets
    the start value; torch's own pool is ``torch.set_num_threads``). Results do not depend on it.
    In a forked child (``forked_child()``) only 1 is accepted."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    if n > 1 and _forked_child:
        raise ValueError(f"n: expected 1 in a process started by fork() (the OpenMP thread pool does not survive "
                         f"fork: more threads would wait forever), got {n}; start parallel workers with "
                         "multiprocessing's 'spawn' or 'forkserver' method")
    _native_module().set_num_threads(n)


def get_num_threads() -> int:
    """Threads of the native kernels' OpenMP pool (1 in a build without OpenMP)."""
    return int(_native_module().get_num_threads())


def cpu_capability() -> str:
    """The CPU capability level whose native kernels run: ``baseline``, ``avx2`` or ``avx512``
    (DESIGN.md §9): the best this CPU has, or ``PFLCORE_CPU_CAPABILITY``'s."""
    return str(_native_module().cpu_capability())


def set_cpu_capability(level: str) -> None:
    """Runs the native kernels of another level built into this binary, from the next call on;
    ``ValueError`` naming the levels available when this CPU lacks ``level``. Results may differ
    in the last bits between levels (other vector widths, other summation orders)."""
    if not isinstance(level, str):
        raise ValueError(f"level: expected one of {_native_module().cpu_capabilities_supported()}, got {level!r}")
    _native_module().set_cpu_capability(level)
