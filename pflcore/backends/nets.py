"""The nets adapter: ``local_steps``, ``gradients``, ``evaluate`` and ``hvp`` for the torch nets
of ``pflcore.models.nets``, with exactly the semantics of the GLM ops (DESIGN.md §4, §8). The
backend chooses this adapter by the model's type; the public ops have validated the metadata,
and the values are checked here by the torch pre-pass of ``_values.py``.

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

The references (``pflcore/backends/reference.py``) are a plain loop over model rows with
``torch.autograd`` on a ``torch.nn`` module holding the row's parameters (``net.module()``),
written independently of the vmapped path (they also check the parameter layout).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pflcore.backends import _values
from pflcore.backends.base import Adapter
from pflcore.client_data import ClientData
from pflcore.models.nets import MLP, TorchNet

# Bytes of parameters + gradients + activations that one chunk of model rows may touch per step.
CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
# CPU: at least this many chunks when there are that many rows (chunks are the unit of
# parallelism; a fixed number, so the chunks never depend on the thread count).
MIN_CHUNKS = 16
# MLPs: hand-written batched forward/backward (False: the generic torch.func path).
HAND_WRITTEN_MLP = True


def is_net(model) -> bool:
    return isinstance(model, TorchNet)


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

def local_steps(model: TorchNet, theta_t: torch.Tensor, data: ClientData, rows_t: torch.Tensor,
                batches_t: Optional[torch.Tensor], anchor_t: Optional[torch.Tensor], scale_t: Optional[torch.Tensor],
                steps: int, lr: float, prox: float) -> None:
    """``ops.local_steps`` for a torch net: in place on ``theta [R, d]``, for s = 0..steps-1
    θ_r ← θ_r − lr·( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) ), i = rows[r]."""
    R = theta_t.shape[0]
    if steps == 0 or R == 0:
        return
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


# ---- gradients ---------------------------------------------------------------------------------

def gradients(model: TorchNet, theta_t: torch.Tensor, data: ClientData, rows_t: torch.Tensor,
              batches_t: Optional[torch.Tensor]) -> torch.Tensor:
    """``[R, d]``: ∇f_i(θ_r) (full batch) or the minibatch gradient on ``batches [R, B]``, + l2·θ_r."""
    R = theta_t.shape[0]
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
    return out


# ---- evaluate ----------------------------------------------------------------------------------

def evaluate(model: TorchNet, theta_t: torch.Tensor, data: ClientData, rows_t: torch.Tensor,
             batches: Optional[torch.Tensor] = None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])``: cross-entropy summed over the
    client's rows (or the rows ``batches [R, B]``; no l2), rows whose first maximal logit is the
    label, rows."""
    R = theta_t.shape[0]
    loss = torch.empty(R, dtype=theta_t.dtype, device=theta_t.device)
    correct = torch.empty(R, dtype=torch.int64, device=theta_t.device)
    count = data.sizes[rows_t].clone() if batches is None else \
        torch.full((R,), batches.shape[1], dtype=torch.int64, device=theta_t.device)
    logits = _logits_fn(model)

    def work(c0: int, c1: int) -> None:
        if batches is None:
            idx, w = _full_batch(data, rows_t[c0:c1])
        else:
            idx = batches[c0:c1].to(torch.int64)
            w = torch.ones(idx.shape, dtype=data.dtype, device=data.device)
        y = data.y[idx]
        z = logits(model.split(theta_t[c0:c1]), data.x[idx])                       # [c, n, C]
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none").view(y.shape)
        real = w > 0
        loss[c0:c1] = torch.where(real, ce, torch.zeros((), dtype=ce.dtype, device=ce.device)).sum(1)
        correct[c0:c1] = ((z.argmax(-1) == y) & real).sum(1)
    per = _max_rows(data, rows_t) if batches is None else batches.shape[1]
    _for_chunks(list(_chunks(model, R, per, data.dtype, data.device)), work, data.device)
    return loss, correct, count


# ---- Hessian-vector products (Per-FedAvg HF) ----------------------------------------------------

def hvp(model: TorchNet, theta: torch.Tensor, v: torch.Tensor, data: ClientData, batches: torch.Tensor) -> torch.Tensor:
    """∇²f_i(θ_r; B_r)·v_r + l2·v_r for every row r, exactly (forward-over-reverse autodiff),
    vmapped over rows. theta, v: [R, d]; batches: int32 [R, B] absolute row indices."""
    R, d = theta.shape
    x, y = data.x, data.y
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


# ---- the adapter -------------------------------------------------------------------------------

def _all_rows(data: ClientData, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.arange(data.offsets.numel() - 1, device=data.x.device) if rows is None else rows


class NetsAdapter(Adapter):
    """The torch nets' implementation (chosen by the model's type, on CPU and CUDA tensors)."""

    name = "nets"
    devices = ("cpu", "cuda")

    def _load(self):
        return torch, f"torch.func over all clients (torch {torch.__version__})"

    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False):
        if steps == 0:
            return
        _values.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
        local_steps(model, theta, data, _all_rows(data, rows), batches, anchor, grad_scale, steps, lr, prox)

    def gradients(self, model, theta, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        theta = _values.one_per_row(theta, data, rows)
        return gradients(model, theta, data, _all_rows(data, rows), batches)

    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        theta = _values.one_per_row(theta, data, rows)
        return evaluate(model, theta, data, _all_rows(data, rows), batches)

    def hvp(self, model, theta, v, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        _values.finite_rows(v, "v")
        return hvp(model, theta, v, data, batches)
