"""A federation's data and the models as JAX pytrees, and int64 arrays for a JAX without x64.

``ClientData`` becomes a pytree whose leaves are its three arrays as JAX arrays, so that it
can be an argument of a jitted function: XLA then hands the kernels the very buffers the
ClientData holds (a ClientData captured by the jitted function instead becomes a constant of
the compiled program, a copy). The JAX views of a ClientData's torch tensors are made once,
through DLPack (no copy; ~0.1 ms each), and kept while the ClientData keeps those tensors.
JAX takes CPU memory without a copy only when it is aligned to 64 bytes: torch and JAX
allocate so, numpy mostly does not (16 bytes). An unaligned array is copied on every call that
flattens the ClientData (never cached: the caller may change the original), with a warning
that says how to avoid it. The GLMs are static pytrees (no leaves), so they may be jit
arguments too.

int64: labels, offsets and row indices are int64 in the kernels. JAX without ``jax_enable_x64``
has no int64 arrays, so the int64 tensors of a ClientData are handed over as int32 ``[n, 2]``
views of the same bytes ("pairs", little-endian), which the FFI shim reads as int64 again;
int32 indices a caller passes (``rows``) are widened to pairs in the graph (a copy of R ints).
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Tuple

import jax
import jax.numpy as jnp
import torch

from pflcore.client_data import ClientData
from pflcore.models.glm import LeastSquares, Logistic, Softmax

if sys.byteorder != "little":  # pragma: no cover - every platform JAX supports is little-endian
    raise ImportError("pflcore.jax reads int64 arrays as int32 pairs, which assumes a little-endian machine")


def x64() -> bool:
    """Whether JAX has int64/float64 here (``jax_enable_x64``, or inside ``jax.enable_x64(True)``)."""
    return bool(jax.config.jax_enable_x64)


class TracedClientData(ClientData):
    """A ClientData inside a jitted function: its arrays are JAX tracers (or arrays) as the
    FFI takes them; ``pairs`` says which int64 arrays are int32 [n, 2] pairs (y, offsets).
    Made by the pytree machinery, never by hand."""

    pairs: Tuple[bool, bool] = (False, False)

    def __repr__(self) -> str:
        return f"TracedClientData(x={self.x!r}, first_client={self.first_client})"


# ClientData -> (its tensors, x64 at the time, their JAX views); weak: the entry goes with the ClientData
_views: "weakref.WeakKeyDictionary[ClientData, tuple]" = weakref.WeakKeyDictionary()


ALIGNMENT = 64  # what JAX's DLPack import needs to share CPU memory
_warned_unaligned = False


def _jax_view(t: torch.Tensor, name: str):
    """A JAX array over ``t``'s memory (a copy when JAX cannot share it: unaligned)."""
    global _warned_unaligned
    if t.data_ptr() % ALIGNMENT and t.numel() and not _warned_unaligned:
        _warned_unaligned = True
        warnings.warn(f"pflcore.jax: {name} of a ClientData is not aligned to {ALIGNMENT} bytes (numpy arrays "
                      f"often are not), so JAX copies it on every call; build the ClientData from JAX arrays "
                      f"(jnp.asarray) or torch tensors to hand the kernels its memory without a copy",
                      RuntimeWarning, stacklevel=4)
    return jax.dlpack.from_dlpack(t)


def _int64_view(t: torch.Tensor, wide: bool, name: str):
    if wide:
        return _jax_view(t, name), False
    return _jax_view(t.view(torch.int32).view(t.shape[0], 2), name), True


def views(data: ClientData):
    """(x, y, offsets, (y_pairs, offsets_pairs)) of a ClientData as JAX values for the FFI."""
    if isinstance(data, TracedClientData):
        return data.x, data.y, data.offsets, data.pairs
    wide = x64()
    x, y, off = data.x, data.y, data.offsets
    hit = _views.get(data)
    if hit is not None and hit[0] is x and hit[1] is y and hit[2] is off and hit[3] == wide:
        return hit[4]
    if not (x.is_cpu and y.is_cpu and off.is_cpu):
        raise ValueError(f"data: pflcore.jax runs the CPU kernels, got data on {x.device}")
    xj = _jax_view(x, "x")
    if y.dtype == torch.int64:
        yj, y_pairs = _int64_view(y, wide, "y")
    else:
        yj, y_pairs = _jax_view(y, "y"), False
    oj, off_pairs = _int64_view(off, wide, "offsets")
    out = (xj, yj, oj, (y_pairs, off_pairs))
    if all(t.data_ptr() % ALIGNMENT == 0 for t in (x, y, off)):  # views, not copies: they stay right
        _views[data] = (x, y, off, wide, out)
    return out


def _flatten(data: ClientData):
    x, y, off, pairs = views(data)
    return (x, y, off), (data.first_client, pairs)


def _unflatten(aux, leaves):
    first_client, pairs = aux
    x, y, off = leaves
    if all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in leaves):
        # concrete arrays (a jitted function returned the data, tree_map): a real ClientData
        data = object.__new__(ClientData)
        data.x = torch.from_dlpack(x)
        data.y = _back(y, pairs[0])
        data.offsets = _back(off, pairs[1])
    else:
        data = object.__new__(TracedClientData)
        data.x, data.y, data.offsets, data.pairs = x, y, off, pairs
    data.first_client = first_client
    return data


def _back(a, is_pairs: bool) -> torch.Tensor:
    t = torch.from_dlpack(a)
    return t.view(torch.int64).view(-1) if is_pairs else t


def int64_operand(a, name: str):
    """Indices a caller passed (rows), as the FFI's int64: int64 as they are; narrower integers
    widened in the graph (to int64 with x64, else to int32 pairs)."""
    dt = jnp.dtype(a.dtype)
    if dt == jnp.int64:
        return a
    if dt.kind not in "iu" or dt.itemsize > 4 or (dt.kind == "u" and dt.itemsize == 4):
        raise ValueError(f"{name}: expected int64 (or int32) indices, got {dt.name}")
    if x64():
        return a.astype(jnp.int64)
    a = a.astype(jnp.int32)
    return jnp.stack([a, jax.lax.shift_right_arithmetic(a, jnp.int32(31))], axis=-1)


def int64_result(shape: Tuple[int, ...]):
    """The FFI result type of an int64 array of ``shape``: int64, or int32 pairs without x64."""
    if x64():
        return jax.ShapeDtypeStruct(shape, jnp.int64)
    return jax.ShapeDtypeStruct(tuple(shape) + (2,), jnp.int32)


def from_int64_result(a):
    """An int64 result as the caller gets it: int64 with x64, else int32 (JAX's integer; the
    values, labels and counts below 2**31, fit)."""
    return a if x64() else a[..., 0]


def _register() -> None:
    jax.tree_util.register_pytree_node(ClientData, _flatten, _unflatten)
    jax.tree_util.register_pytree_node(TracedClientData, _flatten, _unflatten)
    for cls in (LeastSquares, Logistic, Softmax):
        jax.tree_util.register_static(cls)


_register()
