"""Flower's parameters as pflcore's flat vectors, and back: the one place for this conversion.

Flower's Message API carries a model as an ``ArrayRecord``: named ``Array`` objects whose
``data`` is the ``.npy`` serialization (``np.save`` bytes: a header, then the raw buffer). The
older API carries lists of numpy arrays. The server ops want one vector ``[D]`` per model and one
matrix ``[m, D]`` for many clients' models. This module converts with as few copies as the
formats allow:

- reading an ``Array``: ``array_view`` parses the ``.npy`` header and returns a read-only numpy
  view of the payload inside ``Array.data`` (no copy; ``Array.numpy()`` copies it twice);
- ``flatten``: a record with one floating array IS its vector (a view, no copy); with several,
  each payload is copied once, straight from the message bytes into its slice of the vector;
- ``stack``: ``[m, D]`` allocated once, each client's payload copied once into its row;
- ``to_record``: each array's ``Array.data`` is built by one copy of its slice of the vector into
  the bytes object Flower needs (the ``.npy`` header is computed once per layout).

Only floating arrays take part in the vector (the model's parameters). Other arrays (integer
counters such as BatchNorm's ``num_batches_tracked``, masks) are carried over from a reference
record by ``to_record(..., like=record)``. Float16 parameters are widened to float32 in the
vector (the ops compute in float32 and float64) and rounded back in ``to_record``.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from flwr.app import Array, ArrayRecord

NUMPY_STYPE = "numpy.ndarray"  # Array.stype of the .npy serialization (what Array(ndarray) writes)
_MAGIC = b"\x93NUMPY"

Arrays = Union[ArrayRecord, Sequence[np.ndarray]]


@dataclass(frozen=True)
class Layout:
    """Where each named array lies in the flat vector.

    ``keys``/``shapes``/``dtypes``: every array of the record, in order; ``float_keys``: the
    ones in the vector, at ``offsets[k]`` with ``sizes[k]`` elements; ``dtype``: the vector's
    (the common floating type, at least float32); ``size``: D."""
    keys: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[np.dtype, ...]
    offsets: Dict[str, int]
    sizes: Dict[str, int]
    dtype: np.dtype
    size: int

    @property
    def float_keys(self) -> Tuple[str, ...]:
        return tuple(self.offsets)

    def describe(self) -> str:
        return ", ".join(f"{k}: {d}{list(s)}" for k, s, d in zip(self.keys, self.shapes, self.dtypes))

    def check(self, other: "Layout", name: str) -> None:
        """ValueError naming ``name`` unless ``other`` has the same arrays (names, shapes, dtypes)."""
        if (other.keys, other.shapes, other.dtypes) != (self.keys, self.shapes, self.dtypes):
            raise ValueError(f"{name}: expected the arrays {{{self.describe()}}}, got {{{other.describe()}}}")


# ---- one Array ---------------------------------------------------------------------------------

def _header(data: bytes, name: str) -> Tuple[int, np.dtype, Tuple[int, ...], bool]:
    """(payload offset, dtype, shape, fortran order) of ``.npy`` bytes."""
    if len(data) < 10 or data[:6] != _MAGIC:
        raise ValueError(f"{name}: expected .npy bytes (Array.stype {NUMPY_STYPE!r}), the data does not start "
                         f"with the .npy magic string")
    fp = io.BytesIO(data[:12])
    version = np.lib.format.read_magic(fp)
    width = 2 if version == (1, 0) else 4
    start = 8 + width + int.from_bytes(data[8:8 + width], "little")
    fp = io.BytesIO(data[:start])  # the header only: small
    np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    else:
        raise ValueError(f"{name}: .npy format version {version} is not supported (1.0 and 2.0 are)")
    return start, dtype, tuple(int(s) for s in shape), bool(fortran)


def array_view(array: Array, name: str = "array") -> np.ndarray:
    """The numpy array inside a Flower ``Array``, as a read-only view of its bytes (no copy)."""
    if not isinstance(array, Array):
        raise ValueError(f"{name}: expected a flwr.app.Array, got {type(array).__name__}")
    if array.stype != NUMPY_STYPE:
        raise ValueError(f"{name}: expected Array.stype {NUMPY_STYPE!r}, got {array.stype!r}")
    data = array.data
    start, dtype, shape, fortran = _header(data, name)
    if dtype.hasobject or dtype.fields is not None:
        raise ValueError(f"{name}: expected a numeric dtype, got {dtype}")
    count = math.prod(shape)
    if len(data) - start != count * dtype.itemsize:
        raise ValueError(f"{name}: expected {count * dtype.itemsize} payload bytes for {dtype}{list(shape)}, "
                         f"got {len(data) - start}")
    if count == 0:
        return np.empty(shape, dtype)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return flat.reshape(shape, order="F" if fortran else "C")


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating)


def _named_arrays(arrays: Arrays, name: str) -> List[Tuple[str, np.ndarray]]:
    """(key, numpy view) of every array: an ArrayRecord's by key, a list's as "0", "1", ..."""
    if isinstance(arrays, ArrayRecord):
        return [(k, array_view(a, f"{name}[{k!r}]")) for k, a in arrays.items()]
    if isinstance(arrays, (list, tuple)) and all(isinstance(a, np.ndarray) for a in arrays):
        return [(str(i), a) for i, a in enumerate(arrays)]
    raise ValueError(f"{name}: expected a flwr.app.ArrayRecord or a list of numpy arrays, got {type(arrays).__name__}")


def _layout(named: List[Tuple[str, np.ndarray]], name: str) -> Layout:
    floats = [a.dtype for _, a in named if _is_float(a.dtype)]
    if not floats:
        raise ValueError(f"{name}: expected at least one floating-point array (the model's parameters), got "
                         f"{{{', '.join(f'{k}: {a.dtype}{list(a.shape)}' for k, a in named)}}}")
    dtype = np.promote_types(np.result_type(*floats), np.float32)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"{name}: expected float16/32/64 parameters, got {sorted({str(d) for d in floats})}")
    offsets, sizes, at = {}, {}, 0
    for k, a in named:
        if _is_float(a.dtype):
            offsets[k], sizes[k] = at, a.size
            at += a.size
    return Layout(tuple(k for k, _ in named), tuple(tuple(a.shape) for _, a in named),
                  tuple(a.dtype for _, a in named), offsets, sizes, np.dtype(dtype), at)


def layout_of(arrays: Arrays, name: str = "arrays") -> Layout:
    """The layout of an ArrayRecord or a list of numpy arrays (reads only the headers' data)."""
    return _layout(_named_arrays(arrays, name), name)


# ---- records -> vectors ------------------------------------------------------------------------

def _fill(row: np.ndarray, named, layout: Layout) -> None:
    for k, a in named:
        if k in layout.offsets:
            o = layout.offsets[k]
            np.copyto(row[o:o + layout.sizes[k]].reshape(a.shape), a, casting="same_kind")


def flatten(arrays: Arrays, layout: Optional[Layout] = None, name: str = "arrays") -> Tuple[np.ndarray, Layout]:
    """``(vector [D], layout)``. A record whose only floating array has the vector's dtype and C
    order gives a read-only view of the message bytes; otherwise the vector is new (one copy).
    ``layout``, when given, is checked (ValueError naming ``name`` on any difference)."""
    named = _named_arrays(arrays, name)
    mine = _layout(named, name)
    if layout is not None:
        layout.check(mine, name)
    floats = [(k, a) for k, a in named if k in mine.offsets]
    if len(floats) == 1 and floats[0][1].dtype == mine.dtype and floats[0][1].flags.c_contiguous:
        return floats[0][1].reshape(-1), mine
    out = np.empty(mine.size, mine.dtype)
    _fill(out, floats, mine)
    return out, mine


def flatten_as(arrays: Arrays, layout: Layout, name: str = "arrays") -> np.ndarray:
    """``arrays`` as a vector of ``layout``: the same names and shapes, the dtypes may differ
    (e.g. a strategy that returns float64 for float32 parameters, or averages an integer
    counter): those are cast, one copy. With the same dtypes this is ``flatten`` (a view where it
    can be)."""
    named = _named_arrays(arrays, name)
    if [k for k, _ in named] != list(layout.keys) or [tuple(a.shape) for _, a in named] != list(layout.shapes):
        got = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in named)
        raise ValueError(f"{name}: expected the arrays {{{layout.describe()}}} (any dtypes), got {{{got}}}")
    if tuple(a.dtype for _, a in named) == layout.dtypes:
        return flatten(arrays, layout, name)[0]
    out = np.empty(layout.size, layout.dtype)
    for k, a in named:
        if k in layout.offsets:
            o = layout.offsets[k]
            np.copyto(out[o:o + layout.sizes[k]].reshape(a.shape), a, casting="unsafe")
    return out


def stack(records: Sequence[Arrays], layout: Optional[Layout] = None, names: Optional[Sequence[str]] = None
          ) -> Tuple[np.ndarray, Layout]:
    """``([m, D], layout)``: one row per record, each payload copied once into its row. Every
    record must have ``layout`` (default: the first record's); a mismatch is a ValueError naming
    the record (``names[i]``, e.g. the node that sent it)."""
    if len(records) == 0:
        raise ValueError("records: expected at least one record, got none")
    names = [f"records[{i}]" for i in range(len(records))] if names is None else list(names)
    layout = layout_of(records[0], names[0]) if layout is None else layout
    out = np.empty((len(records), layout.size), layout.dtype)
    for i, rec in enumerate(records):
        named = _named_arrays(rec, names[i])
        layout.check(_layout(named, names[i]), names[i])
        _fill(out[i], named, layout)
    return out, layout


# ---- vectors -> records ------------------------------------------------------------------------

_HEADERS: Dict[Tuple[str, Tuple[int, ...]], bytes] = {}


def _npy_header(dtype: np.dtype, shape: Tuple[int, ...]) -> bytes:
    """The .npy header np.save writes for a C-ordered array (cached: one per dtype and shape)."""
    key = (dtype.str, shape)
    h = _HEADERS.get(key)
    if h is None:
        fp = io.BytesIO()
        d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        try:
            np.lib.format.write_array_header_1_0(fp, d)
        except ValueError:  # a header over 64 KiB (a huge rank): np.save's version 2.0
            fp = io.BytesIO()
            np.lib.format.write_array_header_2_0(fp, d)
        h = _HEADERS[key] = fp.getvalue()
    return h


def to_array(a: np.ndarray) -> Array:
    """A Flower ``Array`` of ``a`` (C order), bytes identical to ``Array(a)``'s, built by one copy
    of the payload."""
    a = a if a.flags.c_contiguous else np.array(a, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
    shape = tuple(int(s) for s in a.shape)
    data = b"".join((_npy_header(a.dtype, shape), memoryview(a.reshape(-1)).cast("B")))
    return Array(dtype=str(a.dtype), shape=shape, stype=NUMPY_STYPE, data=data)


def to_record(vector, layout: Layout, like: Optional[Arrays] = None, name: str = "vector") -> ArrayRecord:
    """An ArrayRecord with ``layout``'s arrays: the floating ones from ``vector [D]`` (cast back to
    their dtype), the others taken as they are from ``like`` (required when there are any)."""
    v = np.asarray(vector)
    if v.shape != (layout.size,):
        raise ValueError(f"{name}: expected shape [{layout.size}] (the layout's D), got {list(v.shape)}")
    others = {}
    if len(layout.offsets) < len(layout.keys):
        if like is None:
            raise ValueError(f"like: the layout has non-floating arrays "
                             f"({', '.join(k for k in layout.keys if k not in layout.offsets)}); pass the record "
                             f"to take them from")
        named = dict(_named_arrays(like, "like"))
        others = {k: named[k] for k in layout.keys if k not in layout.offsets and k in named}
        missing = [k for k in layout.keys if k not in layout.offsets and k not in named]
        if missing:
            raise ValueError(f"like: expected the arrays {missing} of the layout, they are missing")
    record = ArrayRecord()
    for k, shape, dtype in zip(layout.keys, layout.shapes, layout.dtypes):
        if k in layout.offsets:
            o = layout.offsets[k]
            a = v[o:o + layout.sizes[k]].reshape(shape)
            record[k] = to_array(a if a.dtype == dtype else a.astype(dtype))
        else:
            record[k] = to_array(others[k])
    return record


def to_ndarrays(vector, layout: Layout) -> List[np.ndarray]:
    """The floating arrays of ``layout`` as views into ``vector`` (no copy when the dtypes agree):
    the "list of numpy arrays" form of Flower's older API."""
    v = np.asarray(vector)
    out = []
    for k, shape, dtype in zip(layout.keys, layout.shapes, layout.dtypes):
        if k in layout.offsets:
            a = v[layout.offsets[k]:layout.offsets[k] + layout.sizes[k]].reshape(shape)
            out.append(a if a.dtype == dtype else a.astype(dtype))
    return out
