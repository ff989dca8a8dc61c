"""pflcore.jax: the shim's first-use compile time and the per-call cost of a jitted op.

1. Compile time: a fresh process with an empty cache directory loads ``pflcore.jax`` (the shim
   is compiled), then a second process with the same directory (it must come from the cache).
   ``--compiles`` fresh directories; the compile seconds are the shim's own (``status()``), the
   load seconds the whole ``status()`` call in that process.
2. Per-call cost, all in this process, float32, ``Softmax(p=60, C=10)`` on m = 100 clients of
   ~50 rows:
   - small: one model row, one step on a minibatch of B = 20 rows (DESIGN.md §8's small call):
       (a) the numpy path ``ops.local_steps`` on numpy arrays (in place),
       (b) ``jax.jit`` of ``pflcore.jax.local_steps`` on JAX arrays (FFI): theta [1, d], the
           ClientData, batches and rows as arguments; also with theta donated,
       (c) the same jitted function on the pure_callback path (the fallback),
       (d) ``ops.local_steps`` eagerly on JAX arrays (DLPack in, a new JAX array out),
       (e) a jitted ``theta + 1`` on the same theta: JAX's own dispatch floor;
   - ``kmeans_assign`` of 100 points to 4 centroids, d = 610: numpy path vs jitted FFI;
   - large: 5 full-batch steps on all 100 clients: numpy path vs jitted FFI.
   Every variant runs ``--calls`` calls per timing; the figure is the best mean per call over
   ``--repeats`` timings, the variants interleaved so each sees the same machine load.

    python bench/jax_ffi.py            # ~1 minute on 2 shared cores
    python bench/jax_ffi.py --quick

Writes bench/results/jax_ffi.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, even under PYTHONSAFEPATH
from _harness import RESULTS, warn_if_busy, write_json  # noqa: E402

_PROBE = ("import time, json; t0 = time.perf_counter(); import pflcore.jax as p; s = p.status(); "
          "print(json.dumps([s['ffi'], s['compile_seconds'], time.perf_counter() - t0]))")


def compile_times(n: int):
    rows = []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as cache:
            # PYTHONSAFEPATH: the installed pflcore, not a checkout's (no compiled module) in the working directory
            env = dict(os.environ, PFLCORE_CACHE_DIR=cache, JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1")
            first, second = [json.loads(subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                                                       text=True, check=True).stdout.splitlines()[-1])
                             for _ in range(2)]
        assert first[0] and second[0], "the shim did not load"
        rows.append({"compile_s": first[1], "first_import_and_load_s": first[2], "cached_compile_s": second[1],
                     "cached_import_and_load_s": second[2]})
    return rows


def per_call(fns: dict, calls: int, repeats: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()  # warm
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compiles", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(RESULTS, "jax_ffi.json"))
    args = ap.parse_args()
    if args.quick:
        args.compiles, args.calls, args.repeats = 1, 200, 3

    warn_if_busy()
    comp = compile_times(args.compiles)

    import jax
    import jax.numpy as jnp
    import torch

    import pflcore.jax as pjax
    from pflcore import ClientData, ops
    from pflcore.jax import _shim
    from pflcore.models import Softmax

    rng = np.random.default_rng(0)
    m, p, C = 100, 60, 10
    sizes = rng.integers(30, 70, m)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(off[-1])
    x_t = torch.from_numpy(rng.standard_normal((N, p)).astype(np.float32)).clone()  # torch: 64-byte aligned
    y_t = torch.from_numpy(rng.integers(0, C, N)).clone()
    data = ClientData(x_t, y_t, torch.from_numpy(off).clone())
    model = Softmax(p, C, l2=1e-3)
    theta1 = np.zeros((1, model.d), np.float32)
    rows = np.array([17], np.int64)
    batches = np.asarray(ops.sample_batches(data, clients=rows, steps=1, batch_size=20, seed=0, counter=0))

    small = jax.jit(lambda t, d, b, r: pjax.local_steps(model, t, d, steps=1, lr=0.05, batches=b, rows=r))
    small_donated = jax.jit(lambda t, d, b, r: pjax.local_steps(model, t, d, steps=1, lr=0.05, batches=b, rows=r),
                            donate_argnums=0)
    tj, bj, rj = jnp.asarray(theta1), jnp.asarray(batches), jnp.asarray(rows.astype(np.int32))
    # the numbers agree before anything is timed
    want = ops.local_steps(model, theta1.copy(), data, steps=1, lr=0.05, batches=batches, rows=rows)
    assert np.array_equal(np.asarray(small(tj, data, bj, rj)), want)

    state = {"t": jnp.asarray(theta1)}

    def donated():
        state["t"] = small_donated(state["t"], data, bj, rj)
        state["t"].block_until_ready()

    floor = jax.jit(lambda t: t + 1.0)
    fns = {
        "numpy_path": lambda: ops.local_steps(model, theta1, data, steps=1, lr=0.05, batches=batches, rows=rows),
        "jit_ffi": lambda: small(tj, data, bj, rj).block_until_ready(),
        "jit_ffi_donated": donated,
        "eager_ops_on_jax_arrays": lambda: ops.local_steps(model, tj, data, steps=1, lr=0.05, batches=bj,
                                                           rows=rj).block_until_ready(),
        "jit_theta_plus_1": lambda: floor(tj).block_until_ready(),
    }
    small_t = per_call(fns, args.calls, args.repeats)

    # the callback path: a fresh jitted function traced with the shim switched off
    saved = _shim._state
    _shim._state = {"ffi": False, "reason": "bench: the pure_callback path"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cb = jax.jit(lambda t, d, b, r: pjax.local_steps(model, t, d, steps=1, lr=0.05, batches=b, rows=r))
        assert np.array_equal(np.asarray(cb(tj, data, bj, rj)), want)
    _shim._state = saved
    small_t.update(per_call({"jit_pure_callback": lambda: cb(tj, data, bj, rj).block_until_ready()},
                            max(1, args.calls // 4), args.repeats))

    pts = rng.standard_normal((100, model.d)).astype(np.float32)
    cen = pts[:4].copy()
    km = jax.jit(pjax.kmeans_assign)
    pj, cj = jnp.asarray(pts), jnp.asarray(cen)
    assert np.array_equal(np.asarray(km(pj, cj)[0]), ops.kmeans_assign(pts, cen)[0])
    km_t = per_call({"numpy_path": lambda: ops.kmeans_assign(pts, cen),
                     "jit_ffi": lambda: km(pj, cj)[1].block_until_ready()}, args.calls, args.repeats)

    theta = np.zeros((m, model.d), np.float32)
    large = jax.jit(lambda t, d: pjax.local_steps(model, t, d, steps=5, lr=0.05))
    tl = jnp.asarray(theta)
    assert np.array_equal(np.asarray(large(tl, data)), ops.local_steps(model, theta.copy(), data, steps=5, lr=0.05))
    big_calls = max(1, args.calls // 100)
    large_t = per_call({"numpy_path": lambda: ops.local_steps(model, theta, data, steps=5, lr=0.05),
                        "jit_ffi": lambda: large(tl, data).block_until_ready()}, big_calls, args.repeats)

    us = lambda d: {k: round(v * 1e6, 2) for k, v in d.items()}  # noqa: E731
    result = {
        "measured": {"jax": jax.__version__, "compiler": _shim.compiler(), "calls": args.calls,
                     "repeats": args.repeats},
        "compile": comp,
        "small_local_steps_us": us(small_t),
        "small_ratios": {k: round(v / small_t["numpy_path"], 2) for k, v in small_t.items()},
        "kmeans_assign_us": us(km_t),
        "kmeans_assign_ratio_jit_ffi_vs_numpy": round(km_t["jit_ffi"] / km_t["numpy_path"], 2),
        "large_local_steps_ms": {k: round(v * 1e3, 3) for k, v in large_t.items()},
        "large_ratio_jit_ffi_vs_numpy": round(large_t["jit_ffi"] / large_t["numpy_path"], 3),
    }
    print(json.dumps(result, indent=1))
    print("wrote", write_json(args.out, result))


if __name__ == "__main__":
    main()
