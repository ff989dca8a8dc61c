"""Unpickling data files without running their code (CIFAR-10's python batches).

``pickle.load`` calls whatever function a file names, so a file from elsewhere can run any
code. ``load`` uses an Unpickler whose ``find_class`` refuses every global except the few a
pickled numeric numpy array refers to (``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``,
``numpy.dtype``, ``numpy._core.numeric._frombuffer``, ``numpy.core.multiarray.scalar``, under
numpy 1's and numpy 2's module names, and ``_codecs.encode`` with which Python 3 writes bytes
in protocol 2). Even those are not numpy's own functions: they are replaced by builders here
that accept only numeric dtypes and raw bytes of the right length, and build the array with
``np.frombuffer``. So a file can hold dicts, lists, tuples, strings, numbers and numeric
arrays, and nothing it holds is called.
"""
from __future__ import annotations

import io
import math
import os
import pickle
from typing import Any

import numpy as np

# dtype codes a numeric array may have (bool, signed and unsigned integers, floats)
NUMERIC_CODES = frozenset({"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8"})


def _text(value, what: str) -> str:
    if isinstance(value, bytes):  # a Python 2 str read with encoding="bytes"
        value = value.decode("latin1")
    if not isinstance(value, str):
        raise pickle.UnpicklingError(f"{what}: expected a string, got {type(value).__name__}")
    return value


class _DType:
    """Stands for ``numpy.dtype(code, align, copy)``; only numeric codes."""

    def __init__(self, code, align=False, copy=False):
        code = _text(code, "dtype")
        if code.lstrip("<>|=") not in NUMERIC_CODES:
            raise pickle.UnpicklingError(f"dtype {code!r} refused: only numeric arrays "
                                         f"({', '.join(sorted(NUMERIC_CODES))}) are read")
        self.dtype = np.dtype(code)

    def __setstate__(self, state):
        # (version, byte order, subarray, names, fields, elsize, alignment, flags): only the byte
        # order matters for the numeric dtypes accepted above.
        if not isinstance(state, tuple) or len(state) < 2:
            raise pickle.UnpicklingError("dtype state: expected a tuple (version, byte order, ...)")
        order = _text(state[1], "dtype byte order")
        if order not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"dtype byte order {order!r}: expected '<', '>', '|' or '='")
        if order in "<>":
            self.dtype = self.dtype.newbyteorder(order)


class _NdarrayClass:
    """Stands for ``numpy.ndarray`` (only passed to _reconstruct)."""


def _shape(value) -> tuple:
    if not isinstance(value, tuple) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                               for s in value):
        raise pickle.UnpicklingError(f"array shape: expected a tuple of integers >= 0, got {value!r}")
    return value


def _array(raw, dtype, shape, order: str) -> np.ndarray:
    if not isinstance(dtype, _DType):
        raise pickle.UnpicklingError("array: its dtype is not a numpy dtype")
    shape = _shape(shape)
    if isinstance(raw, str):  # a Python 2 str read with encoding="latin1"
        raw = raw.encode("latin1")
    if isinstance(raw, bytearray):  # protocol 5's in-band buffer: the array gets bytes of its own
        raw = bytes(raw)
    if not isinstance(raw, bytes):
        raise pickle.UnpicklingError(f"array data: expected raw bytes, got {type(raw).__name__}")
    want = math.prod(shape) * dtype.dtype.itemsize
    if len(raw) != want:
        raise pickle.UnpicklingError(f"array data: shape {list(shape)} of {dtype.dtype} needs {want} bytes, got "
                                     f"{len(raw)}")
    return np.frombuffer(raw, dtype=dtype.dtype).reshape(shape, order="F" if order == "F" else "C")


class _ArrayBuilder:
    """What ``_reconstruct`` returns; the pickle's BUILD hands it the array's state."""

    def __init__(self):
        self.array = None

    def __setstate__(self, state):
        # (version, shape, dtype, is_fortran, raw bytes); numpy also reads the form without version
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError("array state: expected (version, shape, dtype, is_fortran, data)")
        shape, dtype, fortran, raw = state[-4:]
        self.array = _array(raw, dtype, shape, "F" if fortran else "C")


def _reconstruct(cls, shape, typecode):
    if cls is not _NdarrayClass:
        raise pickle.UnpicklingError("_reconstruct: only numpy.ndarray is built")
    return _ArrayBuilder()


def _frombuffer(buf, dtype, shape, order):
    return _array(bytes(buf) if isinstance(buf, (memoryview, pickle.PickleBuffer)) else buf, dtype, shape,
                  _text(order, "order"))


def _scalar(dtype, raw=None):
    return _array(raw, dtype, (), "C")[()].item() if raw is not None else None


def _encode(text, encoding="utf-8"):
    """``_codecs.encode(str, "latin1")``: how Python 3 writes bytes in protocol 2."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode: only str with 'latin1' (Python 3's protocol-2 bytes)")
    return text.encode("latin1")


_ALLOWED = {("_codecs", "encode"): _encode, ("numpy", "ndarray"): _NdarrayClass, ("numpy", "dtype"): _DType}
for _core in ("numpy.core", "numpy._core"):  # numpy 1 and numpy 2 module names
    _ALLOWED[(f"{_core}.multiarray", "_reconstruct")] = _reconstruct
    _ALLOWED[(f"{_core}.multiarray", "scalar")] = _scalar
    _ALLOWED[(f"{_core}.numeric", "_frombuffer")] = _frombuffer


class SafeUnpickler(pickle.Unpickler):
    """An Unpickler that refuses every global but the array builders above."""

    def find_class(self, module, name):
        builder = _ALLOWED.get((module, name))
        if builder is None:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}: a data file holds plain values and "
                                         f"numeric arrays only, and naming a function is how a pickle runs code")
        return builder


def _resolve(obj: Any, depth: int = 0) -> Any:
    """The arrays in place of their builders, in dicts, lists and tuples (a few levels deep)."""
    if isinstance(obj, _ArrayBuilder):
        if obj.array is None:
            raise pickle.UnpicklingError("an array without its data")
        return obj.array
    if depth < 4 and isinstance(obj, dict):
        return {k: _resolve(v, depth + 1) for k, v in obj.items()}
    if depth < 4 and isinstance(obj, (list, tuple)) and any(isinstance(v, (_ArrayBuilder, dict, list, tuple))
                                                            for v in obj[:16]):
        return type(obj)(_resolve(v, depth + 1) for v in obj)
    return obj


def load(path, *, encoding: str = "bytes") -> Any:
    """The object pickled in the file ``path``, read with ``SafeUnpickler``; Python 2 strings
    come back as bytes (``encoding="bytes"``, so CIFAR-10's keys are ``b"data"``, ``b"labels"``).
    A file that names any other global, or is not a pickle, raises ValueError naming it."""
    path = os.fspath(path)
    with open(path, "rb") as fh:
        # Read whole first: a corrupt length field then finds the data short ("truncated")
        # instead of making the unpickler allocate the gigabytes it claims.
        raw = io.BytesIO(fh.read())
    try:
        return _resolve(SafeUnpickler(raw, encoding=encoding).load())
    except Exception as exc:  # UnpicklingError, EOFError, and the errors of malformed opcodes
        raise ValueError(f"{path}: not a readable data pickle ({type(exc).__name__}: {exc})") from None
