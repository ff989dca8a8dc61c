"""The native adapter: the C++/OpenMP kernels of ``pflcore._core`` on CPU tensors.

Arguments go to the module as raw addresses with their sizes (``bindings/core.cpp``): the
public op has checked every shape, dtype and contiguity, and the kernels check the values as
they read them and raise what they find (``csrc/include/pflcore/checks.h``). Addresses keep a
small call cheap: a numpy view of a tensor costs ~0.5 µs, ``data_ptr()`` ~0.05 µs.
"""
from __future__ import annotations

import importlib
from typing import List

import torch

from pflcore.backends.base import Adapter

_F64 = torch.float64


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


class NativeAdapter(Adapter):
    name = "native"
    devices = ("cpu",)

    def _load(self):
        try:
            module = importlib.import_module("pflcore._core")
        except ModuleNotFoundError as exc:
            if exc.name != "pflcore._core":
                raise  # a dependency of pflcore itself is missing: not a backend question
            return None, ("not built: pflcore._core is missing from this installation; "
                          "reinstall with `pip install .` from the source tree")
        except (ImportError, OSError) as exc:  # the file is there but does not load
            if str(exc).startswith("PFLCORE_CPU_CAPABILITY"):
                # asked for a level this build or CPU cannot run: an error, not a silent fallback
                raise ValueError(str(exc)) from None
            return None, (f"built, but pflcore._core failed to load ({type(exc).__name__}: {exc}); "
                          f"rebuild it against this Python and torch (`pip install .`)")
        self._core = module
        return module, ""

    def describe(self) -> str:
        module, reason = self.load()
        if module is None:
            return reason
        info = module.build_info()
        threads = (f"OpenMP, {info['openmp_max_threads']} threads" if info["openmp_version"]
                   else "no OpenMP (built serial: one thread)")
        return (f"C++, {threads}, {info.get('compiler', '?')}, CPU capability {info['cpu_capability']} "
                f"(built: {', '.join(info['cpu_capabilities_built'])}; "
                f"this CPU: {', '.join(info['cpu_capabilities_supported'])})")

    # ---- model ops (GLMs only: nets go to the nets adapter) ----------------------------------

    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False):
        # sizes by numel(): ~3x cheaper than .shape[i], and this is a small call's hot path
        x, offsets = data.x, data.offsets
        R = theta.numel() // model.d
        if R == 0 or steps == 0:
            return
        self._core.local_steps(
            theta.dtype is _F64, model.code, model.p, model.C, model.fit_intercept, model.l2,
            theta.data_ptr(), R, x.data_ptr(), x.numel() // model.p, data.y.data_ptr(), offsets.data_ptr(),
            offsets.numel() - 1, 0 if rows is None else rows.data_ptr(),
            0 if batches is None else batches.data_ptr(), 0 if batches is None else batches.numel() // (R * steps),
            0 if anchor is None else anchor.data_ptr(), anchor is not None and anchor.dim() == 1,
            0 if grad_scale is None else grad_scale.data_ptr(), steps, lr, prox, not trusted)

    def gradients(self, model, theta, data, rows, batches, trusted=False):
        x, offsets = data.x, data.offsets
        shared = theta.dim() == 1  # one model for every row
        R = (offsets.numel() - 1 if rows is None else rows.numel()) if shared else theta.numel() // model.d
        out = torch.empty(R, model.d, dtype=theta.dtype)
        if R == 0:
            return out
        self._core.gradients(
            theta.dtype is _F64, model.code, model.p, model.C, model.fit_intercept, model.l2,
            theta.data_ptr(), shared, R, x.data_ptr(), x.numel() // model.p, data.y.data_ptr(), offsets.data_ptr(),
            offsets.numel() - 1, _ptr(rows), _ptr(batches), 0 if batches is None else batches.numel() // R,
            out.data_ptr(), not trusted)
        return out

    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        x, offsets = data.x, data.offsets
        shared = theta.dim() == 1  # one model for every row
        R = (offsets.numel() - 1 if rows is None else rows.numel()) if shared else theta.numel() // model.d
        loss = torch.empty(R, dtype=theta.dtype)
        counts = torch.empty(2, R, dtype=torch.int64)  # correct, count: one allocation
        if R:
            self._core.evaluate(
                theta.dtype is _F64, model.code, model.p, model.C, model.fit_intercept, model.l2,
                theta.data_ptr(), shared, R, x.data_ptr(), x.numel() // model.p, data.y.data_ptr(), offsets.data_ptr(),
                offsets.numel() - 1, _ptr(rows), _ptr(batches), 0 if batches is None else batches.numel() // R,
                loss.data_ptr(), counts.data_ptr(), counts.data_ptr() + 8 * R, not trusted)
        return loss, counts[0], counts[1]

    # ---- the rest ---------------------------------------------------------------------------

    def sample_batches(self, data, clients, steps, batch_size, seed, counter, trusted=False):
        offsets = data.offsets
        R = offsets.shape[0] - 1 if clients is None else clients.shape[0]
        out = torch.empty(R, steps, batch_size, dtype=torch.int32)
        self._core.sample_batches(offsets.data_ptr(), offsets.shape[0] - 1, data.x.shape[0], _ptr(clients),
                                  data.first_client, R, steps, batch_size, seed, counter, out.data_ptr())
        return out

    def kmeans_assign(self, points, centroids):
        N, d = points.shape
        labels = torch.empty(N, dtype=torch.int64)
        sqdist = torch.empty(N, dtype=points.dtype)
        self._core.kmeans_assign(points.dtype is _F64, points.data_ptr(), N, d, centroids.data_ptr(),
                                 centroids.shape[0], labels.data_ptr(), sqdist.data_ptr())
        return labels, sqdist

    def kmeans_update(self, points, labels, weights, centroids):
        wsum = torch.empty(centroids.shape[0], dtype=_F64)
        self._core.kmeans_update(points.dtype is _F64, points.data_ptr(), points.shape[0], points.shape[1],
                                 labels.data_ptr(), _ptr(weights), centroids.data_ptr(), centroids.shape[0],
                                 wsum.data_ptr())
        return wsum

    def kmeans_lloyd(self, points, centroids, weights, iters: int, tol: float):
        """The whole Lloyd loop in one kernel call; centroids in place."""
        N, d = points.shape
        labels = torch.empty(N, dtype=torch.int64)
        history = torch.empty(iters + 1, dtype=_F64)
        it = self._core.kmeans_lloyd(points.dtype is _F64, points.data_ptr(), N, d, _ptr(weights),
                                     centroids.data_ptr(), centroids.shape[0], iters, float(tol), labels.data_ptr(),
                                     history.data_ptr())
        return labels, history[:it + 1].tolist(), it

    def anderson_push(self, u, tu, R_hist, TU_hist, slot: int, slots: List[int]):
        order = torch.tensor(slots, dtype=torch.int64)
        dots = torch.empty(len(slots), dtype=_F64)
        self._core.anderson_push(u.dtype is _F64, u.data_ptr(), tu.data_ptr(), R_hist.data_ptr(), TU_hist.data_ptr(),
                                 u.numel(), slot, order.data_ptr(), len(slots), dots.data_ptr())
        return dots

    def anderson_mix(self, TU_hist, slots: List[int], pi):
        order = torch.tensor(slots, dtype=torch.int64)
        out = torch.empty(TU_hist.shape[1], dtype=TU_hist.dtype)
        self._core.anderson_mix(TU_hist.dtype is _F64, TU_hist.data_ptr(), TU_hist.shape[1], order.data_ptr(),
                                pi.data_ptr(), len(slots), out.data_ptr())
        return out

    def gram(self, vecs):
        k = vecs.shape[0]
        G = torch.empty(k, k, dtype=_F64)
        self._core.gram(vecs.dtype is _F64, vecs.data_ptr(), k, vecs.shape[1], G.data_ptr())
        return G

    def anderson_solve(self, G, reg: float):
        G = G.contiguous()
        pi = torch.empty(G.shape[0], dtype=_F64)
        self._core.anderson_solve(G.data_ptr(), G.shape[0], float(reg), pi.data_ptr())
        return pi

    def water_fill(self, costs, w, w_own=None):
        costs, w = costs.to(_F64).contiguous(), w.to(_F64).contiguous()
        w_own = None if w_own is None else w_own.to(_F64).contiguous()
        alpha = torch.empty_like(costs)
        self._core.water_fill(costs.data_ptr(), costs.shape[0], costs.shape[1], w.data_ptr(), _ptr(w_own),
                              alpha.data_ptr())
        return alpha

    def water_fill_gram(self, gram, sq_r, sq_c, own, w, out, out_rows, cols, fill: str = "block"):
        _check_gram_block(gram, sq_r, sq_c, own, w, out, out_rows, cols)
        gram = gram.contiguous()
        sq_r, sq_c, w = sq_r.to(_F64).contiguous(), sq_c.to(_F64).contiguous(), w.to(_F64).contiguous()
        own, out_rows, cols = own.contiguous(), out_rows.contiguous(), cols.contiguous()
        levels = torch.empty(gram.shape[0], dtype=_F64)
        self._core.water_fill_gram(gram.dtype is _F64, gram.data_ptr(), sq_r.data_ptr(), sq_c.data_ptr(), own.data_ptr(),
                                   gram.shape[0], gram.shape[1], w.data_ptr(), out.data_ptr(), out.stride(0),
                                   out_rows.data_ptr(), cols.data_ptr(), _FILL[fill], levels.data_ptr())
        return levels

    def clip_and_sum(self, updates, weights, clip_norm: float, noise_std: float, seed: int, counter: int):
        R, d = updates.shape
        out = torch.empty(d, dtype=_F64)
        clipped = self._core.clip_and_sum(updates.dtype is _F64, updates.data_ptr() if R else 0, R, d, _ptr(weights),
                                          clip_norm, noise_std, seed, counter, out.data_ptr())
        return out, int(clipped)

    def dp_normals(self, n: int, seed: int, counter: int):
        out = torch.empty(n, dtype=_F64)
        self._core.dp_normals(seed, counter, n, out.data_ptr() if n else 0)
        return out

    def average(self, theta, weights, rows):
        M, d = theta.shape
        out = torch.empty(d, dtype=theta.dtype)
        self._core.average(theta.dtype is _F64, theta.data_ptr(), M, d, weights.data_ptr(), _ptr(rows),
                           M if rows is None else rows.shape[0], out.data_ptr())
        return out


# water_fill_gram's ``fill``: "block" writes every entry of the block; "positive": those entries are
# 0 already, only the positive weights are written; "row": each output row is cleared first (out
# may be uninitialized), then the positive weights written
_FILL = {"block": 0, "positive": 1, "row": 2}


def _check_gram_block(gram, sq_r, sq_c, own, w, out, out_rows, cols) -> None:
    """The indices water_fill_gram writes through are in range (the kernel trusts them)."""
    r, k = gram.shape
    if gram.dtype not in (torch.float32, _F64) or sq_r.shape != (r,) or sq_c.shape != (k,) or w.shape != (k,) \
            or own.shape != (r,) or out_rows.shape != (r,) or cols.shape != (k,):
        raise ValueError(f"water_fill_gram: expected gram [r, k] float32/float64 with sq_r, own, out_rows [r] and "
                         f"sq_c, w, cols [k], got gram {list(gram.shape)} {gram.dtype}, sq_r {list(sq_r.shape)}, "
                         f"sq_c {list(sq_c.shape)}, w {list(w.shape)}, own {list(own.shape)}, "
                         f"out_rows {list(out_rows.shape)}, cols {list(cols.shape)}")
    if out.dtype is not _F64 or out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"water_fill_gram: out: expected a float64 [rows, m] with contiguous rows, got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
    for name, idx, bound in (("own", own, k), ("out_rows", out_rows, out.shape[0]), ("cols", cols, out.shape[1])):
        if idx.dtype is not torch.int64:
            raise ValueError(f"water_fill_gram: {name}: expected int64 indices, got {idx.dtype}")
        if idx.numel() and not (int(idx.min()) >= 0 and int(idx.max()) < bound):
            raise ValueError(f"water_fill_gram: {name}: expected indices in [0, {bound}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
