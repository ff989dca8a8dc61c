"""Which implementations of the ops exist, and which one a call uses (DESIGN.md §1, §4).

Backends: ``native`` (C++/OpenMP, CPU tensors), ``cuda`` (CUDA C++, CUDA tensors),
``triton`` (Triton, CUDA tensors) and ``reference`` (pure torch, any device).

Choose one with ``pflcore.backend.use("reference")`` (a context manager) or the
environment variable ``PFLCORE_BACKEND``. A backend requested by name that cannot serve a
call raises at once with the reason; the automatic choice falls back in a fixed order:
native -> reference for CPU tensors, cuda -> triton -> reference for CUDA tensors. The
choice is per op: a backend that lacks an op leaves it to the next one in the order.

Triton needs the ``triton`` package (``pip install 'pflcore[triton]'``) and a CUDA device.
With ``TRITON_INTERPRET=1`` set before its kernels are first loaded, they run under Triton's
CPU interpreter (slow; that is how the test suite checks them without a GPU): the backend
then serves CPU (and CUDA) tensors, but only when asked for by name (``use("triton")`` or
``PFLCORE_BACKEND=triton``); the automatic choice skips it.

Compiled modules are imported lazily, on first use, so ``import pflcore`` is fast and works
on a machine where they were not built.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple

BACKENDS = ("native", "cuda", "triton", "reference")

# Backend -> device types whose tensors it serves.
_SERVES = {"native": ("cpu",), "cuda": ("cuda",), "triton": ("cuda",), "reference": ("cpu", "cuda")}
_AUTO_ORDER = {"cpu": ("native", "reference"), "cuda": ("cuda", "triton", "reference")}
_COMPILED = {"native": "pflcore._core", "cuda": "pflcore._core_cuda"}

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pflcore_backend", default=None)
_loaded: Dict[str, Tuple[Optional[object], str]] = {}


class BackendUnavailable(RuntimeError):
    """A backend that was asked for by name cannot run the call; the message says why."""


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def _load(name: str) -> Tuple[Optional[object], str]:
    """(module or None, reason) for a backend; cached after the first attempt."""
    if name in _loaded:
        return _loaded[name]
    module, reason = None, ""
    if name in _COMPILED:
        try:
            module = importlib.import_module(_COMPILED[name])
        except ModuleNotFoundError as exc:
            if exc.name != _COMPILED[name]:
                raise  # a dependency of pflcore itself is missing: not a backend question
            if name == "cuda":
                reason = ("not built: the CUDA module is compiled only when nvcc is found at "
                          "install time (or PFLCORE_CUDA=ON); reinstall with nvcc on PATH")
            else:
                reason = ("not built: pflcore._core is missing from this installation; "
                          "reinstall with `pip install .` from the source tree")
        except (ImportError, OSError) as exc:  # the file is there but does not load
            reason = (f"built, but {_COMPILED[name]} failed to load ({type(exc).__name__}: {exc}); "
                      f"rebuild it against this Python and torch (`pip install .`)")
        if module is not None and name == "cuda":
            module, reason = _cuda_usable(module)
    elif name == "triton":
        module, reason = _load_triton()
    else:  # reference
        import torch

        module, reason = torch, f"pure torch {torch.__version__}"
    _loaded[name] = (module, reason)
    return module, reason


def _archs(module) -> List[int]:
    """Compute capabilities (major*10 + minor) the CUDA module has code for."""
    out = []
    for a in str(module.build_info()["architectures"]).replace(";", ",").split(","):
        digits = "".join(ch for ch in a if ch.isdigit())
        if digits:
            out.append(int(digits))
    return out


def _cuda_usable(module) -> Tuple[Optional[object], str]:
    """(module, "") when the runtime sees a device the module has code for, else (None, why)."""
    if hasattr(module, "runtime_status"):
        rt = module.runtime_status()
    else:  # a module built before runtime_status existed
        rt = {"device_count": module.device_count(), "error": "", "driver_version": -1}
    if rt["device_count"] == 0:
        if rt["driver_version"] == 0:
            return None, "built, but no NVIDIA driver is installed on this machine"
        if rt["error"]:
            hint = (f" (driver {rt['driver_version']} is older than the CUDA runtime "
                    f"{rt.get('runtime_version', '?')} the module was built with: update the driver or "
                    f"rebuild with an older toolkit)" if "InsufficientDriver" in rt["error"] else "")
            return None, f"built, but the CUDA runtime finds no usable device: {rt['error']}{hint}"
        return None, "built, but no CUDA device is visible to the CUDA runtime"
    archs = _archs(module)
    if archs:
        import torch

        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        if caps and all(c[0] * 10 + c[1] < min(archs) for c in caps):
            return None, (f"built for compute capability {', '.join(str(a) for a in archs)}, but the "
                          f"devices have {', '.join(f'{c[0]}.{c[1]}' for c in caps)} (below "
                          f"{min(archs) // 10}.{min(archs) % 10}): rebuild with "
                          f"CMAKE_CUDA_ARCHITECTURES set for them")
    return module, ""


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


def _load_triton() -> Tuple[Optional[object], str]:
    try:
        import triton
    except ImportError as exc:
        return None, f"triton is not installed: pip install 'pflcore[triton]' ({exc})"
    module = importlib.import_module("pflcore.triton")
    if module.INTERPRETED:
        return module, (f"Triton {triton.__version__} under TRITON_INTERPRET=1: the kernels run on "
                        f"the CPU interpreter (slow); CPU tensors only when requested by name")
    import torch

    if not torch.cuda.is_available():
        return None, (f"Triton {triton.__version__} is installed, but torch sees no CUDA device "
                      f"(set TRITON_INTERPRET=1 before the first use to run its kernels on CPU "
                      f"tensors under the interpreter)")
    return module, f"Triton {triton.__version__}"


def _serves(name: str) -> Tuple[str, ...]:
    """Device types whose tensors ``name`` serves when requested by name."""
    if name == "triton":
        module, _ = _load(name)
        if module is not None and module.INTERPRETED:
            return ("cuda", "cpu")
    return _SERVES[name]


def loaded(name: str) -> Optional[object]:
    """The module of backend ``name`` if it loads, else None (no error)."""
    return _load(_check_name(name, "backend"))[0]


def ops_of(name: str) -> Tuple[str, ...]:
    """Names of the kernels a compiled backend implements (empty if it does not load)."""
    module, _ = _load(name)
    if module is None:
        return ()
    if name == "reference":
        return ("*",)
    return tuple(module.build_info()["ops"])


def status() -> Dict[str, Tuple[bool, str]]:
    """{backend: (usable, detail)} for ``pflcore info``."""
    out = {}
    for name in BACKENDS:
        module, reason = _load(name)
        if module is not None and name in _COMPILED:
            info = module.build_info()
            if name == "native":
                reason = (f"C++/OpenMP, {info['openmp_max_threads']} threads, "
                          f"{info.get('compiler', '?')}, {info['arch_flags'] or 'generic arch'}")
            else:
                driver = module.runtime_status()["driver_version"] if hasattr(module, "runtime_status") else -1
                reason = (f"CUDA runtime {info['cuda_runtime_version']}, driver {driver}, architectures "
                          f"{info['architectures']}, ops: {', '.join(info['ops'])}, GLM classes up to "
                          f"{info['max_classes'][0]} (float32) / {info['max_classes'][1]} (float64)")
        out[name] = (module is not None, reason)
    return out


def requested() -> Optional[str]:
    """The backend asked for by ``use()`` or ``PFLCORE_BACKEND``, or None for automatic."""
    name = _forced.get()
    if name is not None:
        return name
    env = os.environ.get("PFLCORE_BACKEND", "").strip()
    return _check_name(env, "PFLCORE_BACKEND") if env else None


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run the ops inside the block with backend ``name``; raises at once if it cannot load."""
    _check_name(name, "backend")
    module, reason = _load(name)
    if module is None:
        raise BackendUnavailable(f"backend {name!r} cannot be used: {reason}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


Limit = Callable[[str, object], Optional[str]]


def select(op: str, device, limit: Optional[Limit] = None) -> Tuple[str, object]:
    """(backend name, module) that runs ``op`` on tensors of ``device``.

    ``limit(name, module)``, when given, returns why backend ``name`` cannot take this call's
    arguments (e.g. more classes than a kernel holds), or None: the automatic choice then
    goes on to the next backend in the order, a backend requested by name raises. A backend
    requested by name that has no kernel for ``op`` at all leaves it to the reference."""
    dev = device.type
    if dev not in _AUTO_ORDER:
        raise ValueError(f"{op}: tensors on device {dev!r} are not served by any backend "
                         f"(pflcore runs on 'cpu' and 'cuda' tensors)")
    name = requested()
    if name is not None:
        module, reason = _load(name)
        if module is None:
            raise BackendUnavailable(f"{op}: backend {name!r} was requested but cannot be used: {reason}")
        if dev not in _serves(name):
            raise BackendUnavailable(f"{op}: backend {name!r} was requested but it serves "
                                     f"{'/'.join(_serves(name))} tensors, got {dev!r} tensors")
        ops = ops_of(name)
        if "*" not in ops and op not in ops:
            # an op the requested backend has no kernel for (average, sample_batches on cuda and
            # triton) runs on the reference, so that a whole run can be forced onto a backend
            return "reference", _load("reference")[0]
        why = limit(name, module) if limit is not None else None
        if why:
            raise BackendUnavailable(f"{op}: backend {name!r} was requested but cannot take these arguments: {why}")
        return name, module
    for name in _AUTO_ORDER[dev]:
        module, _ = _load(name)
        if name == "triton" and module is not None and module.INTERPRETED:
            continue  # the interpreter is for tests: only ever used by name
        if module is not None and ("*" in ops_of(name) or op in ops_of(name)):
            if limit is not None and limit(name, module):
                continue  # e.g. too many classes for the CUDA kernels: the next backend takes it
            return name, module
    raise AssertionError("unreachable: the reference backend serves every op")  # pragma: no cover
