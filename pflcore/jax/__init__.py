"""pflcore's CPU kernels inside ``jax.jit``, through JAX's foreign-function interface.

    import jax, jax.numpy as jnp
    import pflcore.jax as pjax
    from pflcore import ClientData, models

    data = ClientData(x, y, offsets)        # numpy or JAX arrays, wrapped without a copy
    model = models.Softmax(60, 10)

    @jax.jit
    def round_(theta, data):                # data as an ARGUMENT: its buffers go to the kernels
        theta = pjax.local_steps(model, theta, data, steps=5, lr=0.1)
        loss, correct, count = pjax.evaluate(model, theta, data)
        return theta, loss.sum() / count.sum()

The ops (``local_steps``, ``gradients``, ``evaluate``, ``kmeans_assign``) take the arguments of
``pflcore.ops`` with JAX arrays and return JAX arrays. On CPU each is one XLA custom call whose
handler runs the kernel on XLA's buffers (no copy; ``local_steps`` returns a new array whose
buffer XLA takes from theta when theta is donated). The handlers live in a small shim compiled
on first use (~7 s, then cached per user: ``pflcore/jax/_shim.py``). Importing this module makes
``ClientData`` and the GLMs pytrees, so they can be arguments of jitted functions.

Values are checked as the kernels read them: a bad index or NaN raises, when the computation
runs, a ValueError whose message is the kernel's (``pflcore.jax.local_steps: ValueError: rows:
expected client indices in [0, 4), got rows[2] = 7``). The ops are not differentiable, and
``jax.vmap`` over them runs one call per element (``vmap_method="sequential"``).

``jax.pure_callback`` (a host round trip, with copies; same numbers) serves where the FFI cannot:
when the shim cannot be built (no C++ compiler, a jaxlib without FFI headers, or
``PFLCORE_JAX_FFI=0``: a RuntimeWarning says so once) and for arrays on a GPU. ``status()`` says
which path this process takes.
"""
from __future__ import annotations

from typing import Dict

import jax as _jax

if not hasattr(_jax, "ffi") or not hasattr(_jax.ffi, "ffi_call"):
    raise ImportError(f"pflcore.jax needs jax >= 0.5 (the jax.ffi module), found jax {_jax.__version__}: "
                      f"pip install -U jax  (or pflcore's extra: pip install '.[jax]')")

from pflcore.jax import _data  # noqa: F401  (registers the pytrees)
from pflcore.jax import _shim
from pflcore.jax._ops import evaluate, gradients, kmeans_assign, local_steps


def status() -> Dict[str, object]:
    """``{'ffi': bool, 'reason': why not, 'library': the shim's path, 'compile_seconds': the
    time this process spent compiling it (0.0 when it came from the cache)}``; loads the shim."""
    return {k: v for k, v in _shim.state().items() if k != "lib"}


__all__ = ["evaluate", "gradients", "kmeans_assign", "local_steps", "status"]
