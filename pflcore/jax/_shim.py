"""Builds, caches and loads the FFI shim (``ffi.cpp``) and registers its handlers with XLA.

jax is not a build requirement of pflcore, so the shim cannot be compiled when pflcore is
installed: it is compiled here, on first use, against the XLA FFI headers of the jaxlib in
use (``jax.ffi.include_dir()``) with the system C++ compiler, into a per-user cache directory
keyed by a hash of everything that goes into the library (the shim's source, the kernel
table's header, the FFI headers, jaxlib's version, the compiler and the flags). A second
process finds it there. The shim links to nothing: ``pflcore._core`` hands it the kernels as
a C function table (``pflcore/include/pflcore_kernels.h``) through ``pflcore_jax_init``.

Environment:
    PFLCORE_CACHE_DIR   where the library goes (default ``$XDG_CACHE_HOME/pflcore`` or
                        ``~/.cache/pflcore``), under ``jax-ffi-<key>/``.
    PFLCORE_CXX, CXX    the C++ compiler (default: the first of c++, g++, clang++ on PATH).
    PFLCORE_JAX_FFI=0   do not build or load the shim: every op runs through
                        ``jax.pure_callback`` (a host round trip, with copies).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import jax
import jaxlib

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "ffi.cpp"
INCLUDE = _HERE.parent / "include"  # pflcore_kernels.h
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared")
LIBRARY = "libpflcore_jax.so"
TARGETS = ("local_steps", "gradients", "evaluate", "kmeans_assign")

_lock = threading.Lock()
_state: Optional[Dict[str, object]] = None


def cache_root() -> Path:
    env = os.environ.get("PFLCORE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pflcore"


def compiler() -> Optional[list]:
    """The C++ compiler's command line (a list), or None when there is none."""
    for var in ("PFLCORE_CXX", "CXX"):
        cmd = os.environ.get(var)
        if cmd:
            parts = shlex.split(cmd)
            return parts if parts and shutil.which(parts[0]) else None
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cache_key(cxx: list, include_dir: Path) -> str:
    h = hashlib.sha256()
    for path in [SOURCE, INCLUDE / "pflcore_kernels.h"] + sorted((include_dir / "xla" / "ffi" / "api").glob("*.h")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    version = subprocess.run(cxx + ["--version"], capture_output=True, text=True, timeout=60).stdout
    for part in (jaxlib.__version__, " ".join(cxx), version, " ".join(FLAGS)):
        h.update(part.encode())
    return h.hexdigest()[:20]


def _build(cxx: list, include_dir: Path, target: Path) -> float:
    """Compiles the shim to ``target`` (atomically: concurrent builders each write their own
    file and rename it); returns the seconds it took."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=LIBRARY + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    cmd = cxx + list(FLAGS) + ["-isystem", str(include_dir), f"-I{INCLUDE}", str(SOURCE), "-o", tmp]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
            raise RuntimeError(f"compiling the FFI shim failed ({' '.join(cmd)}):\n" + "\n".join(tail))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - t0


def _kernel_table_address() -> int:
    from pflcore import backend
    _core = backend.loaded("native")
    if _core is None:
        raise ImportError(f"pflcore._core: {backend.adapter('native').describe()}")

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get(_core.kernel_table(), b"pflcore_kernel_table")


def _load() -> Dict[str, object]:
    if os.environ.get("PFLCORE_JAX_FFI", "1") == "0":
        return {"ffi": False, "reason": "PFLCORE_JAX_FFI=0"}
    cxx = compiler()
    if cxx is None:
        given = os.environ.get("PFLCORE_CXX") or os.environ.get("CXX")
        return {"ffi": False, "reason": (f"the C++ compiler {given!r} (PFLCORE_CXX or CXX) is not on PATH" if given
                                         else "no C++ compiler found (install g++ or clang++, or set PFLCORE_CXX)")}
    include_dir = Path(jax.ffi.include_dir())
    if not (include_dir / "xla" / "ffi" / "api" / "ffi.h").is_file():
        return {"ffi": False, "reason": f"jaxlib {jaxlib.__version__} ships no XLA FFI headers at {include_dir}"}
    try:
        target = cache_root() / f"jax-ffi-{_cache_key(cxx, include_dir)}" / LIBRARY
        seconds = 0.0
        if not target.is_file():
            seconds = _build(cxx, include_dir, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return {"ffi": False, "reason": str(exc)}
    err = ctypes.create_string_buffer(256)
    lib.pflcore_jax_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    if lib.pflcore_jax_init(_kernel_table_address(), err, len(err)) != 0:
        return {"ffi": False, "reason": f"{target}: {err.value.decode()} (a stale build: delete it)"}
    for name in TARGETS:
        jax.ffi.register_ffi_target(f"pflcore_{name}", jax.ffi.pycapsule(getattr(lib, f"pflcore_jax_{name}")),
                                    platform="cpu")
    lib.pflcore_jax_recorded.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    return {"ffi": True, "reason": "", "library": str(target), "compile_seconds": seconds, "lib": lib}


def state() -> Dict[str, object]:
    """Loads the shim once per process: {'ffi': bool, 'reason': why not, 'library': path,
    'compile_seconds': 0.0 when it came from the cache, 'lib': the ctypes library}."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


class record_pointers:
    """Test hook: ``with record_pointers() as rec: ...`` then ``rec.pointers`` holds the data
    addresses the last FFI call received (its operands in order, absent optional ones as 0,
    then the in-place result for local_steps and the results of kmeans_assign)."""

    def __enter__(self):
        self._lib = state().get("lib")
        if self._lib is None:
            raise RuntimeError("the FFI shim is not loaded: " + str(state()["reason"]))
        self._lib.pflcore_jax_record(1)
        self.pointers = []
        return self

    def read(self) -> list:
        buf = (ctypes.c_uint64 * 32)()
        n = self._lib.pflcore_jax_recorded(buf, 32)
        return [int(v) for v in buf[:n]]

    def __exit__(self, *exc):
        self.pointers = self.read()
        self._lib.pflcore_jax_record(0)
        return False
