"""The ops on JAX arrays, as XLA custom calls (``jax.ffi.ffi_call``) or host callbacks.

Each op checks the metadata (shapes, dtypes: static under ``jax.jit``) when it is traced, with
the messages of ``pflcore.ops``, then stages one call:

- the FFI path, on CPU: the handler of ``ffi.cpp`` gets XLA's buffers and calls the kernel
  table of ``pflcore._core``; the kernels check the values as they read them and a fault
  becomes an XLA error, which JAX raises as a ValueError carrying the kernel's message;
- the callback path (``jax.pure_callback``), where the FFI cannot serve: when the shim cannot
  be built (no C++ compiler, no FFI headers in jaxlib, or ``PFLCORE_JAX_FFI=0``), and for
  arrays on another platform than CPU (the kernels are CPU code: a round trip through host
  memory). It runs ``pflcore.ops`` on the host copies, so the numbers are the same.
"""
from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pflcore._checks import MAX_COUNT, check_positive_int, check_real
from pflcore.client_data import ClientData
from pflcore.jax import _data, _shim
from pflcore.models.glm import GLM

_warned = False


def _ffi_or_callback(ffi_fn, callback_fn, *operands):
    """``ffi_fn(*operands)`` on CPU, ``callback_fn(*operands)`` on other platforms; the callback
    everywhere (with one warning per process) when the shim is not there."""
    global _warned
    state = _shim.state()
    if not state["ffi"]:
        if not _warned:
            _warned = True
            warnings.warn(f"pflcore.jax: the FFI shim is not available ({state['reason']}); the ops run through "
                          f"jax.pure_callback (a host round trip with copies)", RuntimeWarning, stacklevel=3)
        return callback_fn(*operands)
    return jax.lax.platform_dependent(*operands, cpu=ffi_fn, default=callback_fn)


# ---- metadata checks (trace time) --------------------------------------------------------------

def _shape(a) -> str:
    return "[" + ", ".join(str(s) for s in a.shape) + "]"


def _array(value, name: str):
    """A JAX array (or tracer) from what the caller passed: JAX values as they are, numpy
    arrays and torch CPU tensors moved in (a copy; pass JAX arrays to avoid it)."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic, list, tuple, float, int)):
        return jnp.asarray(value)
    if hasattr(value, "__dlpack__"):
        return jnp.asarray(np.asarray(value))
    raise ValueError(f"{name}: expected a JAX array, got {type(value).__name__}")


def _float(a, name: str, dtype=None):
    dt = jnp.dtype(a.dtype)
    if dtype is not None and dt != dtype:
        if dt not in (jnp.float32, jnp.float64):
            raise ValueError(f"{name}: expected dtype float32 or float64, got {dt.name}")
        raise ValueError(f"{name}: expected dtype {jnp.dtype(dtype).name} (the dtype of the data), got {dt.name}")
    if dt not in (jnp.float32, jnp.float64):
        raise ValueError(f"{name}: expected dtype float32 or float64, got {dt.name}")


def _model(model) -> GLM:
    if not isinstance(model, GLM):
        raise ValueError(f"model: pflcore.jax serves the GLMs of pflcore.models (LeastSquares, Logistic, Softmax), "
                         f"got {type(model).__name__} (the torch nets run on torch tensors: pflcore.ops)")
    return model


def _client_data(model: GLM, data):
    """(x, y, offsets, pairs, N, m) after checking the data's metadata against the model."""
    if not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    x, y, off, pairs = _data.views(data)
    _float(x, "x")
    if x.ndim != 2 or x.shape[1] != model.p:
        raise ValueError(f"data: x has shape {_shape(x)} but the model expects [N, p] with p = {model.p}")
    N = x.shape[0]
    if model.is_classifier:
        if not (jnp.dtype(y.dtype) == jnp.int64 or pairs[0]):
            raise ValueError(f"y: {type(model).__name__} needs int64 class labels, got {jnp.dtype(y.dtype).name}")
    elif jnp.dtype(y.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"y: {type(model).__name__} needs float targets of dtype {jnp.dtype(x.dtype).name}, "
                         f"got {jnp.dtype(y.dtype).name}")
    if y.shape[0] != N:
        raise ValueError(f"y: expected shape [N] = [{N}], got {_shape(y)}")
    m = off.shape[0] - 1
    return x, y, off, pairs, N, m


def _rows(rows):
    if rows is None:
        return None, None
    if isinstance(rows, (list, tuple, range)):
        rows = np.asarray(list(rows), dtype=np.int64)
    r = _array(rows, "rows")
    if r.ndim != 1:
        raise ValueError(f"rows: expected int64 indices of shape [R], got {jnp.dtype(r.dtype).name} {_shape(r)}")
    return _data.int64_operand(r, "rows"), r.shape[0]


def _theta(theta, model: GLM, x, R: int, has_rows: bool, shared: bool):
    t = _array(theta, "theta")
    _float(t, "theta", x.dtype)
    if shared and t.ndim == 1 and t.shape[0] == model.d:
        return t
    if t.ndim != 2 or t.shape[1] != model.d or t.shape[0] != R:
        if has_rows and t.ndim == 2 and t.shape[1] == model.d:
            raise ValueError(f"rows: expected one client per row of theta, i.e. shape [{t.shape[0]}], got [{R}]")
        want = ("[R, d]" if has_rows else "[m, d]") + (" or [d]" if shared else "")
        raise ValueError(f"theta: expected shape {want} = [{R}, {model.d}], got {_shape(t)}")
    return t


def _batches(batches, R: int, steps: Optional[int]):
    if batches is None:
        return None
    b = _array(batches, "batches")
    if jnp.dtype(b.dtype) != jnp.int32:
        raise ValueError(f"batches: expected dtype int32 (ops.sample_batches), got {jnp.dtype(b.dtype).name}")
    want = (R, steps) if steps is not None else (R,)
    if b.ndim != len(want) + 1 or tuple(b.shape[:-1]) != want:
        dims = "[R, steps, B]" if steps is not None else "[R, B]"
        raise ValueError(f"batches: expected shape {dims} = [{', '.join(str(s) for s in want)}, *], got {_shape(b)}")
    if b.shape[-1] < 1:
        raise ValueError(f"batches: expected at least one row per batch, got shape {_shape(b)}")
    return b


def _vector(value, name: str, x, length: int):
    if value is None:
        return None
    v = _array(value, name)
    _float(v, name, x.dtype)
    if v.ndim != 1 or v.shape[0] != length:
        raise ValueError(f"{name}: expected shape [R] = [{length}], got {_shape(v)}")
    return v


def _anchor(anchor, x, R: int, d: int):
    if anchor is None:
        return None
    a = _array(anchor, "anchor")
    _float(a, "anchor", x.dtype)
    if not ((a.ndim == 1 and a.shape[0] == d) or (a.ndim == 2 and a.shape == (R, d))):
        raise ValueError(f"anchor: expected shape [R, d] or [d] = [{R}, {d}] or [{d}], got {_shape(a)}")
    return a


def _scalar(value, name: str, dtype, minimum: float, strict: bool):
    """A Python number is checked now; a traced one by the FFI shim (or the callback's op)."""
    if isinstance(value, jax.core.Tracer) or (isinstance(value, jax.Array) and value.ndim == 0):
        if value.ndim != 0:
            raise ValueError(f"{name}: expected a scalar, got shape {_shape(value)}")
        return jnp.asarray(value, dtype)
    return jnp.asarray(check_real(value, name, minimum=minimum, strict=strict), dtype)


def _present(*optional):
    """(the optional operands that are given, their bit mask for the shim)."""
    has = 0
    given = []
    for bit, a in enumerate(optional):
        if a is not None:
            has |= 1 << bit
            given.append(a)
    return given, has


def _glm_attrs(model: GLM):
    return dict(family=np.int64(model.code), C=np.int64(model.C), intercept=bool(model.fit_intercept),
                l2=np.float64(model.l2), check_batches=True)


# ---- host side of the callback path --------------------------------------------------------

def _host_int64(a: np.ndarray, is_pairs: bool) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.int64).reshape(a.shape[:-1]) if is_pairs else a


def _host_data(x, y, off, pairs) -> ClientData:
    """A ClientData over the callback's host arrays, without ClientData's construction checks
    (the op checks what it reads)."""
    import torch

    data = object.__new__(ClientData)
    with warnings.catch_warnings():  # the callback's arrays are read-only, and are only read
        warnings.simplefilter("ignore", UserWarning)
        data.x = torch.from_numpy(np.ascontiguousarray(x))
        labels = pairs[0] or y.dtype == np.int64
        data.y = torch.from_numpy(_host_int64(y, pairs[0]) if labels else np.ascontiguousarray(y))
        data.offsets = torch.from_numpy(_host_int64(off, pairs[1]))
    data.first_client = 0
    return data


def _host_int64_out(a: np.ndarray) -> np.ndarray:
    """An int64 host result in the FFI's result layout (int32 pairs without x64)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    return a if _data.x64() else a.view(np.int32).reshape(a.shape + (2,))


def _host_rows(rows_op):
    if rows_op is None:
        return None
    r = np.asarray(rows_op)
    return _host_int64(r, r.dtype == np.int32 and r.ndim == 2)


# ---- local_steps ---------------------------------------------------------------------------

def local_steps(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None, grad_scale=None):
    """``steps`` gradient steps on every row of ``theta [R, d]``: a NEW array (JAX arrays are
    immutable); under ``jax.jit`` with theta donated (``donate_argnums``) XLA reuses theta's
    buffer. Arguments as ``pflcore.ops.local_steps``; ``lr`` and ``prox`` may be traced
    scalars (then checked when the call runs). Not differentiable."""
    model = _model(model)
    x, y, off, pairs, N, m = _client_data(model, data)
    steps = check_positive_int(steps, "steps", minimum=0, maximum=MAX_COUNT)
    rows_op, R = _rows(rows)
    R = m if R is None else R
    theta = _theta(theta, model, x, R, rows_op is not None, shared=False)
    lr = _scalar(lr, "lr", x.dtype, 0.0, True)
    prox = _scalar(prox, "prox", x.dtype, 0.0, False)
    anchor = _anchor(anchor, x, R, model.d)
    batches = _batches(batches, R, steps)
    scale = _vector(grad_scale, "grad_scale", x, R)
    if R == 0 or steps == 0:
        return theta
    optional, has = _present(rows_op, batches, anchor, scale)
    attrs = dict(_glm_attrs(model), steps=np.int64(steps), has=np.int64(has))
    out_type = jax.ShapeDtypeStruct(theta.shape, theta.dtype)

    def ffi(*ops):
        return jax.ffi.ffi_call("pflcore_local_steps", out_type, input_output_aliases={0: 0},
                                vmap_method="sequential")(*ops, **attrs)

    def host(theta_h, x_h, y_h, off_h, lr_h, prox_h, *opt):
        from pflcore import ops

        opt = iter(opt)
        r, b, a, s = (next(opt) if has & (1 << k) else None for k in range(4))
        out = np.array(theta_h)  # writable: the op updates it in place
        ops.local_steps(model, out, _host_data(x_h, y_h, off_h, pairs), steps=steps, lr=float(lr_h),
                        prox=float(prox_h), anchor=a, batches=b, rows=_host_rows(r), grad_scale=s)
        return out

    def callback(*ops):
        return jax.pure_callback(host, out_type, *ops, vmap_method="sequential")

    return _ffi_or_callback(ffi, callback, theta, x, y, off, lr, prox, *optional)


# ---- gradients and evaluate ----------------------------------------------------------------

def _model_rows(model, theta, data, rows, batches):
    model = _model(model)
    x, y, off, pairs, N, m = _client_data(model, data)
    rows_op, R = _rows(rows)
    R = m if R is None else R
    theta = _theta(theta, model, x, R, rows_op is not None, shared=True)
    batches = _batches(batches, R, None)
    optional, has = _present(rows_op, batches)
    return model, (theta, x, y, off, *optional), pairs, R, dict(_glm_attrs(model), has=np.int64(has)), has


def _host_model_rows(operands, pairs, has):
    theta_h, x_h, y_h, off_h, *opt = operands
    opt = iter(opt)
    r, b = (next(opt) if has & (1 << k) else None for k in range(2))
    return theta_h, _host_data(x_h, y_h, off_h, pairs), _host_rows(r), b


def gradients(model, theta, data, *, rows=None, batches=None):
    """``[R, d]`` gradients of each row's client objective at ``theta`` ([R, d], or [d]: one
    model for every row), as ``pflcore.ops.gradients``."""
    model, operands, pairs, R, attrs, has = _model_rows(model, theta, data, rows, batches)
    out_type = jax.ShapeDtypeStruct((R, model.d), operands[0].dtype)
    if R == 0:
        return jnp.zeros(out_type.shape, out_type.dtype)

    def ffi(*ops):
        return jax.ffi.ffi_call("pflcore_gradients", out_type, vmap_method="sequential")(*ops, **attrs)

    def host(*ops):
        from pflcore import ops as pops

        theta_h, data_h, r, b = _host_model_rows(ops, pairs, has)
        return np.asarray(pops.gradients(model, np.array(theta_h), data_h, rows=r, batches=b))

    def callback(*ops):
        return jax.pure_callback(host, out_type, *ops, vmap_method="sequential")

    return _ffi_or_callback(ffi, callback, *operands)


def evaluate(model, theta, data, *, rows=None, batches=None):
    """``(loss_sum [R], correct [R], count [R])`` of every model row on its client's rows (or
    on ``batches [R, B]``), as ``pflcore.ops.evaluate``; the counts are int64 with
    ``jax_enable_x64``, else int32 (JAX's integer)."""
    model, operands, pairs, R, attrs, has = _model_rows(model, theta, data, rows, batches)
    out_types = (jax.ShapeDtypeStruct((R,), operands[0].dtype), _data.int64_result((R,)), _data.int64_result((R,)))
    if R == 0:
        return tuple(_data.from_int64_result(jnp.zeros(t.shape, t.dtype)) if i else jnp.zeros(t.shape, t.dtype)
                     for i, t in enumerate(out_types))

    def ffi(*ops):
        return tuple(jax.ffi.ffi_call("pflcore_evaluate", out_types, vmap_method="sequential")(*ops, **attrs))

    def host(*ops):
        from pflcore import ops as pops

        theta_h, data_h, r, b = _host_model_rows(ops, pairs, has)
        loss, correct, count = pops.evaluate(model, np.array(theta_h), data_h, rows=r, batches=b)
        return np.asarray(loss), _host_int64_out(correct), _host_int64_out(count)

    def callback(*ops):
        return tuple(jax.pure_callback(host, out_types, *ops, vmap_method="sequential"))

    loss, correct, count = _ffi_or_callback(ffi, callback, *operands)
    return loss, _data.from_int64_result(correct), _data.from_int64_result(count)


# ---- kmeans_assign -------------------------------------------------------------------------

def kmeans_assign(points, centroids):
    """Nearest centroid of every point: ``(labels [N], sqdist [N])``, as
    ``pflcore.ops.kmeans_assign``; labels are int64 with ``jax_enable_x64``, else int32."""
    p = _array(points, "points")
    _float(p, "points")
    if p.ndim != 2:
        raise ValueError(f"points: expected shape [N, d], got {_shape(p)}")
    c = _array(centroids, "centroids")
    _float(c, "centroids", p.dtype)
    if c.ndim != 2 or c.shape[1] != p.shape[1]:
        raise ValueError(f"centroids: expected shape [K, d] with d = {p.shape[1]}, got {_shape(c)}")
    if c.shape[0] < 1:
        raise ValueError(f"centroids: expected at least one centroid, got shape {_shape(c)}")
    N = p.shape[0]
    out_types = (_data.int64_result((N,)), jax.ShapeDtypeStruct((N,), p.dtype))
    if N == 0:
        return _data.from_int64_result(jnp.zeros(out_types[0].shape, out_types[0].dtype)), jnp.zeros((0,), p.dtype)

    def ffi(pts, cen):
        return tuple(jax.ffi.ffi_call("pflcore_kmeans_assign", out_types, vmap_method="sequential")(pts, cen))

    def host(pts, cen):
        from pflcore import ops

        labels, sqdist = ops.kmeans_assign(np.asarray(pts), np.asarray(cen))
        return _host_int64_out(labels), np.asarray(sqdist)

    def callback(pts, cen):
        return tuple(jax.pure_callback(host, out_types, pts, cen, vmap_method="sequential"))

    labels, sqdist = _ffi_or_callback(ffi, callback, p, c)
    return _data.from_int64_result(labels), sqdist
