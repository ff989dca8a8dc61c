"""The CUDA adapter: the kernels of ``pflcore._core_cuda`` on CUDA tensors.

The module links no libtorch: every tensor goes as a raw device address with its sizes, a
dtype name and the handle of the current CUDA stream of the tensors' device, so the kernels
queue behind torch's work. The module dereferences whatever address it gets, so every address
passes ``ptr`` first: a tensor that is not contiguous, not on the device of the call, or not of
the dtype the kernel reads is a ValueError naming the argument (never a silent wrong read).
``launch`` turns a failed launch into a ``CudaKernelError`` that says which op failed and how to
avoid it. Values are checked before the launch by the torch pre-pass of ``_values.py`` (on the
device: one extra read of the inputs and one synchronization per call; ``average`` screens
its output instead of making a pass over theta). The untrusted GLM calls (local_steps,
gradients, evaluate) screen with the module's ``glm_screen`` instead: one binding call, one
kernel and one host read in place of the torch screen's ~20 small ops (~5-8 µs of launch time
each); a flag runs the exact checks of ``_faults.py`` as the torch screen's does. An untrusted
local_steps queues the screen and the steps in one module call with one synchronization (the
steps' kernel does nothing when the screen flags); PFLCORE_CUDA_SCREEN=separate makes them two
module calls, =torch keeps the torch screen (for A/B timing, and as a fallback); a module built
without ``glm_screen`` uses it too. ``average`` screens inside its two kernels and reads one flag
back; PFLCORE_CUDA_AVERAGE=torch keeps the torch screen around them. Both became the defaults
after the 2026-11-27 H100 run (tests/gpu and compute-sanitizer clean; the one-client call 127 ->
110 µs by the fused screen alone, 74 µs with the null rows address, the raw stream handle, the
skipped device context and the reused flag below; ``average`` 21.9% -> 56.5% of the copy
bandwidth).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Callable, List, Optional

import torch

from pflcore.backends import _faults, _values
from pflcore.backends.base import Adapter, evaluation_outputs, label_segments
from pflcore.errors import CudaKernelError


def _dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def ptr(t: Optional[torch.Tensor], name: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> int:
    """Device address of ``t`` (0 for None) after checking that the kernel may read it as a
    dense array of ``dtype`` on ``device``."""
    if t is None:
        return 0
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {_dtype(dtype)} for the CUDA kernel, got {_dtype(t.dtype)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor for the CUDA kernel (it reads raw memory), "
                         f"got strides {tuple(t.stride())} for shape {list(t.shape)}")
    if device.type != "cuda":
        raise ValueError(f"{name}: the CUDA kernels take CUDA tensors, got one on {t.device}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the CUDA call), got {t.device}")
    return t.data_ptr()


def dtype_name(t: torch.Tensor) -> str:
    return _dtype(t.dtype)


# torch's raw handle of a device's current stream, without building a Stream object (a few µs a
# call on the H100 host, on every launch); the public route where a torch lacks it
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream(t: torch.Tensor) -> int:
    """Handle of the current stream on ``t``'s device: kernels queue behind torch's work."""
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


_SAME_DEVICE = contextlib.nullcontext()


def on_device(dev: torch.device):
    """``torch.cuda.device(dev)`` where ``dev`` is not the current device, else a no-op context: the
    module launches on the current device, and entering and leaving torch's context costs a few µs
    on every call, most of which find the device already current."""
    if dev.type != "cuda":  # before anything reads its memory: a CPU tensor is the caller's mistake
        raise ValueError(f"the CUDA kernels take CUDA tensors, got one on {dev} (a cuda device is expected)")
    if dev.index is None or dev.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(dev)


_screen_flags = threading.local()


def screen_flag(dev: torch.device) -> torch.Tensor:
    """The int32 [1] flag of the GLM screens on ``dev``, one per thread and device, reused: the module
    zeroes it before each screen and reads it back before the call returns, so a thread's calls never
    overlap on it (an allocation per call cost ~3 µs of a one-client call's ~100)."""
    flags = _screen_flags.__dict__.setdefault("by_device", {})
    flag = flags.get(dev)
    if flag is None:
        flag = flags[dev] = scratch(1, torch.int32, dev)
    return flag


_HINT = ("Run `pflcore info` to see the device and the architectures the module was built for; "
         "PFLCORE_BACKEND=triton or =reference runs the op without it")


def launch(op: str, fn: Callable, *args) -> None:
    """``fn(*args)`` (a binding of pflcore._core_cuda) with its failure explained.

    Kernels run asynchronously: an error while one runs (not at its launch) surfaces at the
    next synchronizing call, wherever that is. With PFLCORE_CUDA_SYNC=1 every launch is
    followed by a synchronize, so such an error is reported here, naming the op (slow: for
    debugging)."""
    try:
        fn(*args)
    except RuntimeError as exc:
        raise CudaKernelError(f"{op}: the CUDA backend failed to launch its kernel ({exc}). {_HINT}") from exc
    if os.environ.get("PFLCORE_CUDA_SYNC", "") == "1":
        try:
            torch.cuda.synchronize()
        except RuntimeError as exc:
            raise CudaKernelError(f"{op}: the CUDA kernel failed while it ran ({exc}). {_HINT}") from exc


def max_classes(module, dtype: torch.dtype) -> int:
    """Largest number of classes C the module's GLM kernels take for ``dtype``."""
    f32, f64 = module.build_info()["max_classes"]
    return f64 if dtype == torch.float64 else f32


def _archs(module) -> List[int]:
    """Compute capabilities (major*10 + minor) the CUDA module has code for."""
    out = []
    for a in str(module.build_info()["architectures"]).replace(";", ",").split(","):
        digits = "".join(ch for ch in a if ch.isdigit())
        if digits:
            out.append(int(digits))
    return out


def usable(module):
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
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        if caps and all(c[0] * 10 + c[1] < min(archs) for c in caps):
            return None, (f"built for compute capability {', '.join(str(a) for a in archs)}, but the "
                          f"devices have {', '.join(f'{c[0]}.{c[1]}' for c in caps)} (below "
                          f"{min(archs) // 10}.{min(archs) % 10}): rebuild with "
                          f"CMAKE_CUDA_ARCHITECTURES set for them")
    return module, ""


def model_rows(theta: torch.Tensor, data, rows: Optional[torch.Tensor]) -> int:
    """R: the model rows of a call; ``theta`` [d] is one model for every row (the kernels read it
    with row stride 0, no [R, d] copy)."""
    if theta.dim() == 1:
        return data.offsets.numel() - 1 if rows is None else rows.numel()
    return theta.shape[0]


def glm_args(model, theta: torch.Tensor, data, rows: Optional[torch.Tensor]) -> tuple:
    """The leading arguments of _core_cuda.local_steps / gradients / evaluate, up to R. ``rows``
    None goes as a null address: the kernels then take model row r as client r (no ``arange``
    of the clients, which cost a launch and an allocation on every such call). A tensor made here
    would be freed before the kernel reads it (only its address goes to the module;
    compute-sanitizer's memcheck on an H100 caught that), so nothing is."""
    dev, dt = theta.device, theta.dtype
    y_dtype = torch.int64 if model.is_classifier else dt
    return (model.code, model.p, model.C, model.fit_intercept, model.l2, ptr(theta, "theta", dev, dt),
            ptr(data.x, "x", dev, dt), ptr(data.y, "y", dev, y_dtype),
            ptr(data.offsets, "offsets", dev, torch.int64), ptr(rows, "rows", dev, torch.int64),
            model_rows(theta, data, rows))


def scratch(values: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch memory of a kernel from torch's caching allocator, on the current stream: freed
    when the caller drops it, reused in stream order by later work (the module allocates none)."""
    return torch.empty(max(values, 1), dtype=dtype, device=device)


class CudaAdapter(Adapter):
    name = "cuda"
    devices = ("cuda",)

    def __init__(self):
        super().__init__()
        self._scratch_cache = {}  # (module, device, dtype, GLM shape) -> glm_scratch_rows

    def _load(self):
        try:
            module = importlib.import_module("pflcore._core_cuda")
        except ModuleNotFoundError as exc:
            if exc.name != "pflcore._core_cuda":
                raise
            return None, ("not built: the CUDA module is compiled only when nvcc is found at "
                          "install time (or PFLCORE_CUDA=ON); reinstall with nvcc on PATH")
        except (ImportError, OSError) as exc:
            return None, (f"built, but pflcore._core_cuda failed to load ({type(exc).__name__}: {exc}); "
                          f"rebuild it against this Python and torch (`pip install .`)")
        return usable(module)

    def describe(self) -> str:
        module, reason = self.load()
        if module is None:
            return reason
        info = module.build_info()
        driver = module.runtime_status()["driver_version"] if hasattr(module, "runtime_status") else -1
        return (f"CUDA runtime {info['cuda_runtime_version']}, driver {driver}, architectures "
                f"{info['architectures']}, ops: {', '.join(sorted(self.ops()))}, GLM classes up to "
                f"{info['max_classes'][0]} (float32) / {info['max_classes'][1]} (float64)")

    def limit(self, op: str, model, dtype) -> Optional[str]:
        if op not in ("local_steps", "gradients", "evaluate") or model is None:
            return None
        most = max_classes(self.module, dtype)
        if model.C > most:
            return (f"its GLM kernels hold one row's {model.C} logits in shared memory and take at most "
                    f"C = {most} classes in {_dtype(dtype)}")
        return None

    def _scratch_rows(self, model, dtype, dev) -> int:
        """Scratch rows of a local_steps launch (0 when the parameters fit shared memory): a
        function of the module, the device and the shape, asked once per combination."""
        key = (id(self.module), dev.index, dtype, model.code, model.p, model.C, model.fit_intercept)
        rows = self._scratch_cache.get(key)
        if rows is None:
            rows = int(self.module.glm_scratch_rows(model.code, model.p, model.C, model.fit_intercept, _dtype(dtype)))
            self._scratch_cache[key] = rows
        return rows

    def _screen(self, model, theta, data, rows, batches, anchor=None, grad_scale=None) -> None:
        """``_values.glm_fault`` with the module's one-kernel screen: raises the call's first
        fault (the exact checks run only when the screen flags something, and clear a false
        alarm). ``rows`` as the caller got it (None: every client), not materialized."""
        if os.environ.get("PFLCORE_CUDA_SCREEN", "") == "torch" or not hasattr(self.module, "glm_screen"):
            _values.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
        elif self._screen_flag(model, theta, data, rows, batches, anchor, grad_scale):
            _faults.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)

    def _screen_flag(self, model, theta, data, rows, batches, anchor=None, grad_scale=None) -> int:
        """The module's screen of a GLM call: nonzero when it may hold a fault (one binding call:
        a kernel and one host read; never 0 where ``_values._glm_flags`` flags)."""
        dev, dt = theta.device, theta.dtype
        x, y, offsets = data.x, data.y, data.offsets
        m = offsets.numel() - 1
        # every address first: a tensor the kernel cannot read is the adapter's ValueError, before
        # anything touches the device
        args = (ptr(theta, "theta", dev, dt), theta.numel(), ptr(anchor, "anchor", dev, dt),
                0 if anchor is None else anchor.numel(), ptr(grad_scale, "grad_scale", dev, dt),
                0 if grad_scale is None else grad_scale.numel(), ptr(x, "x", dev, dt),
                ptr(y, "y", dev, torch.int64 if model.is_classifier else dt), model.is_classifier,
                model.num_classes if model.is_classifier else 0, x.shape[0], x.shape[1:].numel(),
                ptr(offsets, "offsets", dev, torch.int64), m, ptr(rows, "rows", dev, torch.int64),
                m if rows is None else rows.numel(), ptr(batches, "batches", dev, torch.int32),
                0 if batches is None else batches.numel())
        flag = screen_flag(dev)
        with on_device(dev):
            try:
                return int(self.module.glm_screen(*args, ptr(flag, "flag", dev, torch.int32), dtype_name(theta),
                                                  stream(theta)))
            except RuntimeError as exc:
                raise CudaKernelError(f"the value screen of a GLM call failed on the CUDA backend ({exc}). "
                                      f"{_HINT}") from exc

    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False):
        if steps == 0:
            return
        if not trusted and os.environ.get("PFLCORE_CUDA_SCREEN", "") not in ("separate", "torch") and \
                hasattr(self.module, "local_steps_screened"):
            if self._local_steps_screened(model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox):
                return
            # flagged, theta untouched: the exact checks raise, or it was a false alarm and the
            # values are known good
            _faults.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
            trusted = True
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            self._screen(model, theta, data, rows, batches, anchor, grad_scale)
        dev, dt = theta.device, theta.dtype
        with on_device(dev):
            # G of each resident block when W and G do not fit shared memory: [min(R, rows), d]
            n_scratch = min(theta.shape[0], self._scratch_rows(model, dt, dev))
            buf = scratch(n_scratch * model.d, dt, dev) if n_scratch else None
            launch("local_steps", self.module.local_steps, *glm_args(model, theta, data, rows),
                   ptr(batches, "batches", dev, torch.int32), 0 if batches is None else batches.shape[2],
                   ptr(anchor, "anchor", dev, dt), anchor is not None and anchor.dim() == 1,
                   ptr(grad_scale, "grad_scale", dev, dt), steps, lr, prox, ptr(buf, "scratch", dev, dt),
                   n_scratch, dtype_name(theta), stream(theta))

    def _local_steps_screened(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox) -> bool:
        """The screen and the steps in one module call with one synchronization (the steps' kernel
        does nothing when the screen flags). True when the steps ran; False when the screen flagged
        and theta was not written."""
        dev, dt = theta.device, theta.dtype
        x, y, offsets = data.x, data.y, data.offsets
        with on_device(dev):  # the scratch rows are asked of the call's device
            n_scratch = min(theta.shape[0], self._scratch_rows(model, dt, dev))
            buf = scratch(n_scratch * model.d, dt, dev) if n_scratch else None
            flag = screen_flag(dev)
            args = glm_args(model, theta, data, rows) + (
                ptr(batches, "batches", dev, torch.int32), 0 if batches is None else batches.shape[2],
                ptr(anchor, "anchor", dev, dt), anchor is not None and anchor.dim() == 1,
                ptr(grad_scale, "grad_scale", dev, dt), steps, lr, prox, ptr(buf, "scratch", dev, dt), n_scratch,
                theta.numel(), 0 if anchor is None else anchor.numel(),
                0 if grad_scale is None else grad_scale.numel(), model.num_classes if model.is_classifier else 0,
                x.shape[0], offsets.numel() - 1, 0 if batches is None else batches.numel(),
                ptr(flag, "flag", dev, torch.int32), dtype_name(theta), stream(theta))
            try:
                return not self.module.local_steps_screened(*args)
            except RuntimeError as exc:
                raise CudaKernelError(f"local_steps: the CUDA backend failed ({exc}). {_HINT}") from exc

    def gradients(self, model, theta, data, rows, batches, trusted=False):
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            self._screen(model, theta, data, rows, batches)
        dev = theta.device
        out = torch.empty(model_rows(theta, data, rows), model.d, dtype=theta.dtype, device=dev)
        with on_device(dev):
            launch("gradients", self.module.gradients, *glm_args(model, theta, data, rows), theta.dim() == 1,
                   ptr(batches, "batches", dev, torch.int32), 0 if batches is None else batches.shape[1],
                   ptr(out, "out", dev, theta.dtype), dtype_name(theta), stream(theta))
        return out

    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        """One launch, whole clients or ``batches`` [R, B] (a sample of each row's client)."""
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            self._screen(model, theta, data, rows, batches)
        dev = theta.device
        loss, correct, count = evaluation_outputs(model_rows(theta, data, rows), theta.dtype, dev)
        with on_device(dev):
            launch("evaluate", self.module.evaluate, *glm_args(model, theta, data, rows), theta.dim() == 1,
                   ptr(batches, "batches", dev, torch.int32), 0 if batches is None else batches.shape[1],
                   ptr(loss, "loss", dev, theta.dtype), ptr(correct, "correct", dev, torch.int64),
                   ptr(count, "count", dev, torch.int64), dtype_name(theta), stream(theta))
        return loss, correct, count

    def sample_batches(self, data, clients, steps, batch_size, seed, counter, trusted=False):
        """One launch of the counter-based hash (bitwise the reference's draws). ``trusted``: the
        run's own clients (``Context.batches``): no screen, no host read."""
        if not trusted:
            _values.sample_batches_fault(data, clients)
        offsets = data.offsets
        dev = offsets.device
        R = offsets.shape[0] - 1 if clients is None else clients.shape[0]
        out = torch.empty(R, steps, batch_size, dtype=torch.int32, device=dev)
        with on_device(dev):
            launch("sample_batches", self.module.sample_batches, ptr(offsets, "offsets", dev, torch.int64),
                   ptr(clients, "clients", dev, torch.int64), data.first_client, R, steps, batch_size, seed, counter,
                   ptr(out, "out", dev, torch.int32), stream(offsets))
        return out

    def kmeans_assign(self, points, centroids):
        _values.kmeans_assign_fault(points, centroids)
        N = points.shape[0]
        labels = torch.empty(N, dtype=torch.int64, device=points.device)
        sqdist = torch.empty(N, dtype=points.dtype, device=points.device)
        dev, dt = points.device, points.dtype
        with on_device(dev):
            launch("kmeans_assign", self.module.kmeans_assign, ptr(points, "points", dev, dt),
                   ptr(centroids, "centroids", dev, dt), ptr(labels, "labels", dev, torch.int64),
                   ptr(sqdist, "sqdist", dev, dt), N, centroids.shape[0], points.shape[1], dtype_name(points),
                   stream(points))
        return labels, sqdist

    def kmeans_update(self, points, labels, weights, centroids):
        """A segmented reduction over the points sorted (stably) by label."""
        K = centroids.shape[0]
        _values.kmeans_update_fault(labels, weights, K)
        wsum = torch.empty(K, dtype=torch.float64, device=points.device)
        order, seg = label_segments(labels, K)
        dev, dt = points.device, points.dtype
        N, d = points.shape
        with on_device(dev):
            buf = scratch(self.module.kmeans_update_scratch(N, K, d), torch.float64, dev)  # chunk partial sums
            launch("kmeans_update", self.module.kmeans_update, ptr(points, "points", dev, dt),
                   ptr(order, "order", dev, torch.int64), ptr(seg, "seg", dev, torch.int64),
                   ptr(weights, "weights", dev, dt), ptr(centroids, "centroids", dev, dt),
                   ptr(wsum, "wsum", dev, torch.float64), N, K, d, ptr(buf, "scratch", dev, torch.float64),
                   dtype_name(points), stream(points))
        return wsum

    def anderson_push(self, u, tu, R_hist, TU_hist, slot: int, slots: List[int]):
        """The history stays on the device; only the k dots come back."""
        dev, dt = u.device, u.dtype
        order = torch.tensor(slots, dtype=torch.int64, device=dev)
        dots = torch.empty(len(slots), dtype=torch.float64, device=dev)
        with on_device(dev):
            buf = scratch(self.module.anderson_scratch(u.numel(), len(slots)), torch.float64, dev)
            launch("Anderson.step", self.module.anderson_push, ptr(u, "u", dev, dt), ptr(tu, "tu", dev, dt),
                   ptr(R_hist, "residual history", dev, dt), ptr(TU_hist, "image history", dev, dt), u.numel(),
                   slot, ptr(order, "slots", dev, torch.int64), len(slots),
                   ptr(dots, "dots", dev, torch.float64), ptr(buf, "scratch", dev, torch.float64),
                   dtype_name(u), stream(u))
        return dots.cpu()

    def anderson_mix(self, TU_hist, slots: List[int], pi):
        dev, dt = TU_hist.device, TU_hist.dtype
        order = torch.tensor(slots, dtype=torch.int64, device=dev)
        pi_dev = pi.to(dev)
        out = torch.empty(TU_hist.shape[1], dtype=dt, device=dev)
        with on_device(dev):
            launch("Anderson.step", self.module.anderson_mix, ptr(TU_hist, "image history", dev, dt),
                   TU_hist.shape[1], ptr(order, "slots", dev, torch.int64), ptr(pi_dev, "pi", dev, torch.float64),
                   len(slots), ptr(out, "out", dev, dt), dtype_name(out), stream(out))
        return out

    def gram(self, vecs):
        k, dev = vecs.shape[0], vecs.device
        G = torch.empty(k, k, dtype=torch.float64, device=dev)
        with on_device(dev):
            buf = scratch(self.module.gram_scratch(vecs.shape[1], k), torch.float64, dev)
            launch("anderson_weights", self.module.gram, ptr(vecs, "residuals", dev, vecs.dtype), k, vecs.shape[1],
                   ptr(G, "G", dev, torch.float64), ptr(buf, "scratch", dev, torch.float64), dtype_name(vecs),
                   stream(vecs))
        return G.cpu()

    def average(self, theta, weights, rows):
        if os.environ.get("PFLCORE_CUDA_AVERAGE", "") != "torch" and hasattr(self.module, "average_fused"):
            return self._average_fused(theta, weights, rows)
        return self._average_screened(theta, weights, rows)

    def _average_fused(self, theta, weights, rows):
        """Two launches with the screen inside them (rows clamped and flagged, weights flagged and
        summed per chunk, the mean's finiteness) and one host read of their flag, in place of ~8
        torch ops around them (on an H100: 161 µs a call at 10^5 x 610 against 315 with the torch
        screen, whose ops took more than the kernels)."""
        if rows is not None and rows.numel() == 0:
            _values.average_fault(theta, weights, rows)  # the weights of no rows sum to 0: raises
        M, d = theta.shape
        dev, dt = theta.device, theta.dtype
        R = M if rows is None else rows.numel()
        out = torch.empty(d, dtype=dt, device=dev)
        flag = scratch(1, torch.int32, dev)
        with on_device(dev):
            buf = scratch(self.module.average_fused_scratch(R, d), torch.float64, dev)
            try:
                flagged = self.module.average_fused(
                    ptr(theta, "theta", dev, dt), ptr(weights, "weights", dev, dt), ptr(rows, "rows", dev, torch.int64),
                    M, d, R, ptr(out, "out", dev, dt), ptr(buf, "scratch", dev, torch.float64),
                    ptr(flag, "flag", dev, torch.int32), dtype_name(theta), stream(theta))
            except RuntimeError as exc:
                raise CudaKernelError(f"average: the CUDA backend failed ({exc}). {_HINT}") from exc
        if flagged:
            _faults.average_fault(theta, weights, rows)
        return out

    def _average_screened(self, theta, weights, rows):
        """PFLCORE_CUDA_AVERAGE=torch, or a module without average_fused: two launches (chunks' partial sums, then their sum over chunks) and one host read: the
        weights, rows and weight sum are screened on the device before the launch, a NaN or inf
        of theta after it, in the mean (no extra pass over theta)."""
        if rows is not None and rows.numel() == 0:
            _values.average_fault(theta, weights, rows)  # the weights of no rows sum to 0: raises
        M, d = theta.shape
        dev, dt = theta.device, theta.dtype
        # rows clamped into [0, M): an index out of range never reaches the kernel (it is flagged
        # and raised after the launch)
        safe, wsum, flags = _values.average_screen(theta, weights, rows)
        R = M if rows is None else rows.numel()
        out = torch.empty(d, dtype=dt, device=dev)
        with on_device(dev):
            buf = scratch(self.module.average_scratch(R, d), torch.float64, dev)  # chunk partial sums
            launch("average", self.module.average, ptr(theta, "theta", dev, dt), ptr(weights, "weights", dev, dt),
                   ptr(safe, "rows", dev, torch.int64), M, d, R, ptr(wsum, "wsum", dev, torch.float64),
                   ptr(out, "out", dev, dt), ptr(buf, "scratch", dev, torch.float64), dtype_name(theta),
                   stream(theta))
        _values.average_result_fault(theta, weights, rows, out, flags)
        return out
