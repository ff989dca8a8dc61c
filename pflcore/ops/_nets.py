"""``local_steps``, ``gradients``, ``evaluate`` (and the Hessian-vector product Per-FedAvg
needs) for the torch nets of ``pflcore.models.nets``, with exactly the semantics of the GLM ops
(DESIGN.md §4); the public ops in ``local_steps.py``, ``gradients.py``, ``evaluate.py`` route
nets here.

How all clients run at once: the per-row loss of ONE model is written with
``torch.func.functional_call`` and ``torch.func.vmap(torch.func.grad(...))`` maps it over the
model rows, so one call computes the gradients of many clients' networks (batched matmuls and
convolutions, no Python loop over clients). Rows are processed in chunks of consecutive model
rows sized so that a chunk's parameters, gradients and activations fit in about
``CHUNK_BYTES`` (a few MB on the CPU, so a chunk's K steps run in cache; far more on a GPU);
every chunk runs all its steps before the next chunk starts. The Python loops are over chunks
and steps only. Which rows share a chunk depends only on R, the model and the batch shape,
never on values or on the thread count.

Threads (CPU): every chunk is computed by ONE thread, and chunks run in parallel on a pool of
``torch.get_num_threads()`` threads. Letting torch split a chunk's matrix products across
threads instead would make results depend on the thread count: MKL's single- and
multi-threaded GEMMs sum in different orders (measured on most MLP shapes, e.g. a batch of
[10, 59] x [59, 16] products), so 1 and 2 threads gave different bits. This way results are
bitwise identical for any thread count, like the native kernels'.

Ragged clients in full-batch mode (``batches=None``): the rows of a chunk's clients are padded
to the largest client of the chunk and every row gets a weight, ``1/n_i`` for the client's own
rows and 0 for padding (a padding slot repeats the client's last row, so it stays finite), and
the loss of model row r is ``Σ_j w_rj·ce_rj``: exactly the mean over the client's rows.
Minibatches ``[R, steps, B]`` need no padding (weight 1/B). ``grad_scale[r]`` multiplies the
row weights of r (it scales the loss gradient only, not l2 or prox).

MLPs take a faster path by default (``HAND_WRITTEN_MLP``): the same batched math written out
with ``torch.baddbmm`` (forward, then backward layer by layer), where the update of each weight
matrix is fused into the GEMM that forms its gradient (``W.baddbmm_(dzᵀ, h, alpha=−lr)``) right
after that W was last read; bench/algorithms.py measures it against the vmap path and a
per-client loop of ``torch.nn`` modules.

Each op has a ``*_ref``: a plain loop over model rows with ``torch.autograd`` on a
``torch.nn`` module holding the row's parameters (``net.module()``), written independently of
the vmapped path (it also checks the parameter layout).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pflcore.data.client_data import ClientData
from pflcore.models.nets import MLP, TorchNet
from pflcore.ops import _glm
from pflcore.ops._checks import (as_tensor, check_contiguous, check_device, check_dtype, check_finite,
                                 check_float, check_positive_int, check_real, check_shape, out_like)

# Bytes of parameters + gradients + activations that one chunk of model rows may touch per step.
CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
# CPU: at least this many chunks when there are that many rows (chunks are the unit of
# parallelism; a fixed number, so the chunks never depend on the thread count).
MIN_CHUNKS = 16
# MLPs: hand-written batched forward/backward (False: the generic torch.func path).
HAND_WRITTEN_MLP = True


def is_net(model) -> bool:
    return isinstance(model, TorchNet)


# ---- validation ------------------------------------------------------------------------------

def _anchor(anchor, R: int, d: int, data: ClientData) -> Optional[torch.Tensor]:
    if anchor is None:
        return None
    a, _ = as_tensor(anchor, "anchor")
    check_float(a, "anchor", data.dtype)
    check_device(a, "anchor", data.device)
    if a.dim() == 1:
        check_shape(a, "anchor", (d,), "[d]")
    else:
        check_shape(a, "anchor", (R, d), "[R, d] or [d]")
    check_finite(a, "anchor")
    return a.contiguous()


def _batches(batches, shape, what: str, data: ClientData, rows: torch.Tensor) -> Optional[torch.Tensor]:
    if batches is None:
        return None
    b, _ = as_tensor(batches, "batches")
    check_dtype(b, "batches", torch.int32)
    check_device(b, "batches", data.device)
    check_shape(b, "batches", shape, what)
    if b.shape[-1] < 1:
        raise ValueError(f"batches: expected at least one row per batch, got shape {list(b.shape)}")
    b = b.contiguous()
    _glm.check_batch_rows(b, data, rows)
    return b


# ---- vmapped per-model functions (cached on the model, rebuilt after unpickling) --------------

def _cached(model: TorchNet, key: str, build):
    cache = model.__dict__.setdefault("_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _grad_fn(model: TorchNet):
    """vmapped (params {name: [R, *s]}, x [R, n, p], y [R, n], w [R, n]) -> grads {name: [R, *s]}
    of Σ_j w_j·ce_j for every row."""
    def loss(params, x, y, w):
        return (w * model.row_losses(params, x, y)).sum()
    return _cached(model, "grad", lambda: torch.func.vmap(torch.func.grad(loss)))


def _logits_fn(model: TorchNet):
    """vmapped (params {name: [R, *s]}, x [R, n, p]) -> logits [R, n, C]."""
    return _cached(model, "logits", lambda: torch.func.vmap(model.logits))


def _hvp_fn(model: TorchNet):
    """vmapped (params, v {name: [R, *s]}, x [R, B, p], y [R, B]) -> ∇²(mean ce)·v {name: [R, *s]}
    (forward-over-reverse: the jvp of the gradient)."""
    def mean_loss(params, x, y):
        return model.row_losses(params, x, y).mean()

    def one(params, v, x, y):
        return torch.func.jvp(lambda q: torch.func.grad(mean_loss)(q, x, y), (params,), (v,))[1]
    return _cached(model, "hvp", lambda: torch.func.vmap(one))


# ---- chunks and batches ------------------------------------------------------------------------

def _chunks(model: TorchNet, R: int, rows_per_model: int, dtype: torch.dtype, device: torch.device
            ) -> Iterator[Tuple[int, int]]:
    """[c0, c1) ranges of model rows: parameters, gradient, update temporaries (4·d) and the
    rows' features and activations of one model cost ``per`` bytes; a chunk holds
    CHUNK_BYTES // per models (at least one) and, on the CPU, at most ceil(R / MIN_CHUNKS) so
    that even a few rows spread over the threads."""
    item = torch.finfo(dtype).bits // 8
    per = item * (4 * model.d + rows_per_model * (model.p + model.activation_size))
    size = max(1, min(R, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // per))
    if device.type == "cpu":
        size = min(size, max(1, -(-R // MIN_CHUNKS)))
    for c0 in range(0, R, size):
        yield c0, min(R, c0 + size)


_pool: Optional[ThreadPoolExecutor] = None
_pool_threads = 0
_pool_lock = threading.Lock()


def _single_thread_worker() -> None:
    torch.set_num_threads(1)  # also this thread's OpenMP and MKL settings


def _thread_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="pflcore-nets", initializer=_single_thread_worker)
            _pool_threads = n
        return _pool


def _for_chunks(chunks: List[Tuple[int, int]], work: Callable[[int, int], None], device: torch.device, *,
                parallel: bool = True) -> None:
    """Runs ``work(c0, c1)`` (no autograd) for every chunk; the chunks' rows are disjoint. On the
    CPU each chunk runs on one thread (torch's intra-op threads set to 1 for the duration), the
    chunks in parallel on ``torch.get_num_threads()`` threads (``parallel=False``: one after
    the other, for work that must not run concurrently): see the module docstring."""
    def run(c):
        with torch.no_grad():  # grad mode is per thread
            work(*c)

    if device.type != "cpu":
        for c in chunks:
            run(c)
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if n == 1 or len(chunks) == 1 or not parallel:
            for c in chunks:
                run(c)
        else:
            for _ in _thread_pool(n).map(run, chunks):  # re-raises a worker's exception
                pass
    finally:
        torch.set_num_threads(n)


def _full_batch(data: ClientData, clients: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(idx int64 [c, n_max], w [c, n_max]): every row of each client, padded with its last row
    at weight 0; the weights of real rows are 1/n_i."""
    lo, hi = data.offsets[clients], data.offsets[clients + 1]
    n = hi - lo
    n_max = int(n.max())
    j = torch.arange(n_max, device=data.device)
    idx = torch.minimum(lo[:, None] + j, (hi - 1)[:, None])
    w = torch.where(j < n[:, None], 1.0 / n.to(data.dtype)[:, None], torch.zeros((), dtype=data.dtype,
                                                                                   device=data.device))
    return idx, w


def _max_rows(data: ClientData, rows: torch.Tensor) -> int:
    return int(data.sizes[rows].max()) if rows.numel() else 1


# ---- hand-written MLP --------------------------------------------------------------------------

def _fast_mlp(model) -> bool:
    return HAND_WRITTEN_MLP and isinstance(model, MLP)


def _mlp_layers(model: MLP, theta: torch.Tensor):
    """[(W [c, out, in], b [c, out])] views into ``theta [c, d]`` (or ``[d]``, then W [out, in])."""
    views = model.split(theta if theta.dim() == 2 else theta[None])
    out = []
    for j in range(len(model.hidden) + 1):
        W, b = views[f"{2 * j}.weight"], views[f"{2 * j}.bias"]
        out.append((W, b) if theta.dim() == 2 else (W[0], b[0]))
    return out


def _mlp_backward(model: MLP, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, visit):
    """Forward and backward of Σ_j w_j·ce_j for the c models in ``theta [c, d]`` on rows
    ``x [c, n, p]``, labels ``y [c, n]``, row weights ``w [c, n]``. For every layer, last first,
    calls ``visit(j, W, b, dz, h)`` with the layer's parameter views, the gradient of the loss
    in its output ``dz [c, n, out]`` and its input ``h [c, n, in]`` (so dW = dzᵀh, db = Σ_n dz);
    ``visit`` may overwrite W and b: this layer's W has already been read for the next dz."""
    layers = _mlp_layers(model, theta)
    hs, zs = [x], []
    for j, (W, b) in enumerate(layers):
        z = torch.baddbmm(b[:, None, :], hs[-1], W.transpose(1, 2))  # [c, n, out]
        zs.append(z)
        if j < len(layers) - 1:
            hs.append(torch.relu(z))
    dz = torch.softmax(zs[-1], dim=2)
    dz.scatter_add_(2, y[:, :, None], torch.full(y.shape + (1,), -1.0, dtype=dz.dtype, device=dz.device))
    dz.mul_(w[:, :, None])
    for j in range(len(layers) - 1, -1, -1):
        W, b = layers[j]
        dh = torch.bmm(dz, W) if j > 0 else None  # [c, n, in], with W before visit() changes it
        visit(j, W, b, dz, hs[j])
        if j > 0:
            dz = dh.mul_(zs[j - 1] > 0)


# ---- local_steps -------------------------------------------------------------------------------

def local_steps(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                grad_scale=None):
    """``ops.local_steps`` for a torch net: in place on ``theta [R, d]``, for s = 0..steps-1
    θ_r ← θ_r − lr·( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) ), i = rows[r]."""
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    check_contiguous(theta_t, "theta")
    steps = check_positive_int(steps, "steps", minimum=0)
    lr = check_real(lr, "lr", minimum=0.0, strict=True)
    prox = check_real(prox, "prox", minimum=0.0)
    R, d = theta_t.shape
    anchor_t = _anchor(anchor, R, d, data)
    batches_t = _batches(batches, (R, steps, None), "[R, steps, B]", data, rows_t)
    scale_t = _glm.optional_vector(grad_scale, "grad_scale", R, data.dtype, data.device)
    if steps == 0 or R == 0:
        return theta if is_np else theta_t
    grad = _grad_fn(model)
    rows_per_model = batches_t.shape[2] if batches_t is not None else _max_rows(data, rows_t)
    shrink = 1.0 - lr * (model.l2 + prox)  # θ(1 − lr(l2 + prox)) + lr·prox·a − lr·g
    fast = _fast_mlp(model)

    def work(c0: int, c1: int) -> None:
        th = theta_t[c0:c1]  # consecutive rows of a contiguous [R, d]: a contiguous view
        a = None if anchor_t is None else (anchor_t if anchor_t.dim() == 1 else anchor_t[c0:c1])
        if batches_t is None:
            idx, w = _full_batch(data, rows_t[c0:c1])
            x, y = data.x[idx], data.y[idx]
        else:
            w = torch.full(batches_t[c0:c1, 0].shape, 1.0 / batches_t.shape[2], dtype=data.dtype,
                           device=data.device)
        if scale_t is not None:
            w = w * scale_t[c0:c1, None]
        if fast:
            a_layers = None if a is None else _mlp_layers(model, a)

            def update(j, W, b, dz, h):  # θ ← θ(1 − lr(l2 + prox)) + lr·prox·a − lr·g, fused
                for k, (p_, g_) in enumerate(((W, None), (b, dz.sum(1)))):
                    if prox and a_layers is not None and model.l2 == 0:
                        p_.lerp_(a_layers[j][k], lr * prox)  # one pass: θ + lr·prox·(a − θ)
                    elif shrink != 1.0:
                        p_.mul_(shrink)
                        if prox and a_layers is not None:
                            p_.add_(a_layers[j][k], alpha=lr * prox)
                    if g_ is None:
                        p_.baddbmm_(dz.transpose(1, 2), h, alpha=-lr)
                    else:
                        p_.add_(g_, alpha=-lr)
        for s in range(steps):
            if batches_t is not None:
                idx = batches_t[c0:c1, s].to(torch.int64)
                x, y = data.x[idx], data.y[idx]
            if fast:
                _mlp_backward(model, th, x, y, w, update)
                continue
            g = model.flatten(grad(model.split(th), x, y, w))
            if shrink != 1.0:
                th.mul_(shrink)
            if prox and a is not None:
                th.add_(a, alpha=lr * prox)
            th.add_(g, alpha=-lr)
    _for_chunks(list(_chunks(model, R, rows_per_model, data.dtype, data.device)), work, data.device)
    return theta if is_np else theta_t


def _module_ref(model: TorchNet, dtype, device):
    with torch.random.fork_rng(devices=[]):  # its own init is overwritten; keep the global RNG
        return model.module(dtype=dtype, device=device)


def _grad_ref(model: TorchNet, module, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇ (mean cross-entropy over rows x [n, p]) at parameters ``row [d]``, by torch.autograd."""
    torch.nn.utils.vector_to_parameters(row, module.parameters())
    with torch.enable_grad():
        loss = F.cross_entropy(module(model.input_view(x)), y)
        grads = torch.autograd.grad(loss, list(module.parameters()))
    return torch.nn.utils.parameters_to_vector(grads)


def _ref_args(theta, rows, batches):
    theta_t, is_np = as_tensor(theta, "theta")
    rows_t = torch.arange(theta_t.shape[0]) if rows is None else as_tensor(rows, "rows")[0]
    b = None if batches is None else as_tensor(batches, "batches")[0].to(torch.int64)
    return theta_t, is_np, rows_t, b


def local_steps_ref(model, theta, data, *, steps, lr, prox=0.0, anchor=None, batches=None, rows=None,
                    grad_scale=None):
    """Reference of ``local_steps`` for nets: a loop over model rows and steps with autograd."""
    theta_t, is_np, rows_t, b = _ref_args(theta, rows, batches)
    anchor_t = None if anchor is None else as_tensor(anchor, "anchor")[0]
    gs = None if grad_scale is None else as_tensor(grad_scale, "grad_scale")[0]
    module = _module_ref(model, theta_t.dtype, theta_t.device)
    for r in range(theta_t.shape[0]):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        a = 0.0 if anchor_t is None else (anchor_t if anchor_t.dim() == 1 else anchor_t[r])
        scale = 1.0 if gs is None else gs[r]
        for s in range(steps):
            x, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r, s]], data.y[b[r, s]])
            g = _grad_ref(model, module, theta_t[r], x, y)
            theta_t[r] -= lr * (scale * g + model.l2 * theta_t[r] + prox * (theta_t[r] - a))
    return out_like(theta_t, is_np)


# ---- gradients ---------------------------------------------------------------------------------

def gradients(model, theta, data, *, rows=None, batches=None):
    """``[R, d]``: ∇f_i(θ_r) (full batch) or the minibatch gradient on ``batches [R, B]``, + l2·θ_r."""
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    theta_t = theta_t.contiguous()
    R = theta_t.shape[0]
    batches_t = _batches(batches, (R, None), "[R, B]", data, rows_t)
    out = torch.empty_like(theta_t)
    grad = _grad_fn(model)
    rows_per_model = batches_t.shape[1] if batches_t is not None else _max_rows(data, rows_t)

    def work(c0: int, c1: int) -> None:
        th = theta_t[c0:c1]
        if batches_t is None:
            idx, w = _full_batch(data, rows_t[c0:c1])
        else:
            idx = batches_t[c0:c1].to(torch.int64)
            w = torch.full(idx.shape, 1.0 / idx.shape[1], dtype=data.dtype, device=data.device)
        if _fast_mlp(model):
            dst = _mlp_layers(model, out[c0:c1])

            def store(j, W, b, dz, h):
                torch.bmm(dz.transpose(1, 2), h, out=dst[j][0]) if dst[j][0].is_contiguous() else \
                    dst[j][0].copy_(torch.bmm(dz.transpose(1, 2), h))
                dst[j][1].copy_(dz.sum(1))
            _mlp_backward(model, th, data.x[idx], data.y[idx], w, store)
            if model.l2:
                out[c0:c1].add_(th, alpha=model.l2)
            return
        g = model.flatten(grad(model.split(th), data.x[idx], data.y[idx], w))
        out[c0:c1] = g if model.l2 == 0 else g.add_(th, alpha=model.l2)
    _for_chunks(list(_chunks(model, R, rows_per_model, data.dtype, data.device)), work, data.device)
    return out_like(out, is_np)


def gradients_ref(model, theta, data, *, rows=None, batches=None):
    """Reference of ``gradients`` for nets (a loop over model rows with autograd)."""
    theta_t, is_np, rows_t, b = _ref_args(theta, rows, batches)
    module = _module_ref(model, theta_t.dtype, theta_t.device)
    out = torch.empty_like(theta_t)
    for r in range(theta_t.shape[0]):
        i = int(rows_t[r])
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        x, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r]], data.y[b[r]])
        out[r] = _grad_ref(model, module, theta_t[r], x, y) + model.l2 * theta_t[r]
    return out_like(out, is_np)


# ---- evaluate ----------------------------------------------------------------------------------

def evaluate(model, theta, data, *, rows=None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])``: cross-entropy summed over the
    client's rows (no l2), rows whose first maximal logit is the label, rows."""
    theta_t, is_np, rows_t = _glm.validate(model, theta, data, rows)
    theta_t = theta_t.contiguous()
    R = theta_t.shape[0]
    loss = torch.empty(R, dtype=theta_t.dtype, device=theta_t.device)
    correct = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    count = data.sizes[rows_t].clone()
    logits = _logits_fn(model)

    def work(c0: int, c1: int) -> None:
        idx, w = _full_batch(data, rows_t[c0:c1])
        y = data.y[idx]
        z = logits(model.split(theta_t[c0:c1]), data.x[idx])                       # [c, n, C]
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none").view(y.shape)
        real = w > 0
        loss[c0:c1] = torch.where(real, ce, torch.zeros((), dtype=ce.dtype, device=ce.device)).sum(1)
        correct[c0:c1] = ((z.argmax(-1) == y) & real).sum(1)
    _for_chunks(list(_chunks(model, R, _max_rows(data, rows_t), data.dtype, data.device)), work, data.device)
    return tuple(out_like(t, is_np) for t in (loss, correct, count))


def evaluate_ref(model, theta, data, *, rows=None):
    """Reference of ``evaluate`` for nets (a loop over model rows)."""
    theta_t, is_np, rows_t, _ = _ref_args(theta, rows, None)
    module = _module_ref(model, theta_t.dtype, theta_t.device)
    R = theta_t.shape[0]
    loss = torch.empty(R, dtype=theta_t.dtype, device=theta_t.device)
    correct = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    count = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    with torch.no_grad():
        for r in range(R):
            i = int(rows_t[r])
            lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
            x, y = data.x[lo:hi], data.y[lo:hi]
            torch.nn.utils.vector_to_parameters(theta_t[r], module.parameters())
            z = module(model.input_view(x))
            loss[r] = F.cross_entropy(z, y, reduction="sum")
            correct[r] = (z.argmax(1) == y).sum()
            count[r] = hi - lo
    return tuple(out_like(t, is_np) for t in (loss, correct, count))


# ---- Hessian-vector products (Per-FedAvg HF) ----------------------------------------------------

def hvp(model: TorchNet, theta: torch.Tensor, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
        batches: torch.Tensor) -> torch.Tensor:
    """∇²f_i(θ_r; B_r)·v_r + l2·v_r for every row r, exactly (forward-over-reverse autodiff),
    vmapped over rows: the signature of ``perfedavg.glm_hvp``. theta, v: [R, d];
    batches: int32 [R, B] absolute row indices into x [N, p], y [N]."""
    R, d = theta.shape
    if v.shape != theta.shape or batches.dim() != 2 or batches.shape[0] != R:
        raise ValueError(f"hvp: expected theta, v [R, d] and batches [R, B], got theta {list(theta.shape)}, "
                         f"v {list(v.shape)}, batches {list(batches.shape)}")
    out = torch.empty_like(theta)
    fn = _hvp_fn(model)
    idx_all = batches.to(torch.int64)

    def work(c0: int, c1: int) -> None:
        idx = idx_all[c0:c1]
        th, vv = theta[c0:c1].contiguous(), v[c0:c1].contiguous()
        hv = model.flatten(fn(model.split(th), model.split(vv), x[idx], y[idx]))
        out[c0:c1] = hv + model.l2 * vv
    # Serially: torch's forward-AD levels (the jvp) are global to the process, not per thread.
    _for_chunks(list(_chunks(model, R, 3 * batches.shape[1], theta.dtype, theta.device)), work, theta.device,
                parallel=False)
    return out


def hvp_ref(model: TorchNet, theta, v, x, y, batches) -> torch.Tensor:
    """Reference of ``hvp``: double backward on a module, one row at a time."""
    module = _module_ref(model, theta.dtype, theta.device)
    out = torch.empty_like(theta)
    for r in range(theta.shape[0]):
        idx = batches[r].to(torch.int64)
        torch.nn.utils.vector_to_parameters(theta[r], module.parameters())
        params = list(module.parameters())
        with torch.enable_grad():
            loss = F.cross_entropy(module(model.input_view(x[idx])), y[idx])
            g = torch.nn.utils.parameters_to_vector(torch.autograd.grad(loss, params, create_graph=True))
            hv = torch.autograd.grad(g @ v[r], params)
        out[r] = torch.nn.utils.parameters_to_vector(hv) + model.l2 * v[r]
    return out
