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
with batched GEMMs (``_MLPChunk``). For one call a chunk's parameters are copied to one
contiguous block per layer, ``[c, out, in + 1]`` with the bias as the last column, so that a
layer's forward is one ``bmm`` against inputs with a column of ones and its update is one
in-place ``baddbmm_`` that adds the weight AND bias gradients and the step's shrink
(1 − lr(l2 + prox)) at once; activations are kept classes/features-first (``[c, out, n]``),
where torch's softmax is fast; the ReLU's backward is one fused pass; a step that reuses the
previous step's minibatch (pFedMe's inner steps) does not gather it again. bench/algorithms.py
measures it (GFLOP/s against a 2048² matmul) and against the vmap path and a per-client loop of
``torch.nn`` modules.

The minibatch steps of a one-hidden-layer float32 MLP on the CPU (up to 128 hidden units, at
most 16 classes) run in a native kernel instead, where the build has AVX-512
(``csrc/cpu/mlp.cpp``, ``_native_mlp_steps``): one model row per thread with its parameters in
register-wide layouts, 1.3x the batched GEMMs above on MLP(60, 100, 10) at B = 20. Every other
net, dtype, device and call keeps the torch paths.

CNNs take the batched path of ``cnn_batched.py`` by default (``HAND_WRITTEN_CNN``: grouped oneDNN
convolutions on the CPU, im2col + GEMMs elsewhere),
chunked and threaded like the rest; ``evaluate`` uses its forward pass.

The references (``pflcore/backends/reference.py``) are a plain loop over model rows with
``torch.autograd`` on a ``torch.nn`` module holding the row's parameters (``net.module()``),
written independently of the vmapped path (they also check the parameter layout).
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pflcore.backends import _values
from pflcore.backends._precision import nets_math
from pflcore.backends.base import Adapter, all_rows
from pflcore.client_data import ClientData
from pflcore.models.nets import CNN, MLP, TorchNet
from pflcore.backends import cnn_batched

# Bytes of parameters + gradients + activations that one chunk of model rows may touch per step.
CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
# CPU: at least this many chunks when there are that many rows (chunks are the unit of
# parallelism; a fixed number, so the chunks never depend on the thread count).
MIN_CHUNKS = 16
# MLPs: hand-written batched forward/backward (False: the generic torch.func path).
HAND_WRITTEN_MLP = True
# CNNs: the batched forward/backward of cnn_batched.py (False: torch.func).
HAND_WRITTEN_CNN = True


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


def _fast_cnn(model) -> bool:
    return HAND_WRITTEN_CNN and isinstance(model, CNN)


def _mlp_layers(model: MLP, theta: torch.Tensor):
    """[(W [c, out, in], b [c, out])] views into ``theta [c, d]`` (or ``[d]``, then W [out, in])."""
    views = model.split(theta if theta.dim() == 2 else theta[None])
    out = []
    for j in range(len(model.hidden) + 1):
        W, b = views[f"{2 * j}.weight"], views[f"{2 * j}.bias"]
        out.append((W, b) if theta.dim() == 2 else (W[0], b[0]))
    return out


def _relu_backward_(dh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dh ← dh where the ReLU's output h > 0, else 0: one pass in place (multiplying by a
    boolean mask costs ~10x more on the CPU)."""
    return torch.ops.aten.threshold_backward.grad_input(dh, h, 0, grad_input=dh)


class _MLPChunk:
    """c MLPs (one chunk of model rows) in the layout their batched math wants, for one call.

    Parameters: per layer one contiguous ``[c, out, in + 1]`` block, the weight matrix with the
    bias as an extra last column, so that one batched GEMM gives a layer's outputs and one its
    weight AND bias gradient (against inputs with a column of ones). In ``theta [R, d]`` a model's
    layers lie d apart, and torch's in-place batched GEMM on such a strided block falls back to
    one small GEMM per model (1.6x slower); the copy in and out is two passes over the
    parameters per call, shared by all its steps.

    Activations are feature-major, ``[c, features (+1 row of ones), n]``: the logits are
    ``[c, C, n]``, whose softmax over dim 1 torch computes ~10x faster than over a last dimension
    of ~10 classes. The inputs ``x`` stay row-major ``[c, n, p + 1]`` (gathered in place next to
    their column of ones).
    """

    def __init__(self, model: MLP, c: int, n: int, dtype: torch.dtype, device: torch.device):
        self.model, self.c, self.n = model, c, n
        sizes = (model.p,) + model.hidden + (model.C,)
        self.shapes = [(sizes[j + 1], sizes[j]) for j in range(len(sizes) - 1)]  # (out, in) per layer
        kw = dict(dtype=dtype, device=device)
        self.params = [torch.empty(c, o, i + 1, **kw) for o, i in self.shapes]
        self.x = torch.ones(c, n, model.p + 1, **kw)
        acts = [torch.ones(c, h + 1, n, **kw) for h in model.hidden]  # hidden outputs + a row of ones
        # the views every step uses, made once (a view costs a few µs of dispatch)
        self.ins = [self.x] + [a.transpose(1, 2) for a in acts]   # layer inputs [c, n, in + 1]
        self.ins_t = [self.x.transpose(1, 2)] + acts              # the same as [c, in + 1, n]
        self.relu_out = [a[:, :-1] for a in acts]                  # [c, h, n] next to the ones
        self.weights_t = [P[:, :, :-1].transpose(1, 2) for P in self.params]  # Wᵀ [c, in, out]
        self.dh = [torch.empty(c, h, n, **kw) for h in model.hidden]
        self.x_rows = self.x.view(c * n, model.p + 1)[:, :model.p]
        self.minus_one = torch.full((1, 1, 1), -1.0, **kw).expand(c, 1, n)

    # ---- parameters in and out ----------------------------------------------------------------

    def load(self, theta: torch.Tensor) -> None:
        """The parameters ← the rows of ``theta [c, d]``."""
        self._copy_in(theta, self.params)

    def blocks_of(self, theta: torch.Tensor) -> List[torch.Tensor]:
        """``theta`` [c, d] (or [d], one model for all: blocks [1, out, in + 1]) in the chunk's
        layout, as new blocks."""
        lead = self.c if theta.dim() == 2 else 1
        blocks = [theta.new_empty(lead, o, i + 1) for o, i in self.shapes]
        self._copy_in(theta, blocks)
        return blocks

    def _copy_in(self, theta: torch.Tensor, blocks: List[torch.Tensor]) -> None:
        for blk, (W, b), (o, i) in zip(blocks, _mlp_layers(self.model, theta), self.shapes):
            blk[..., :i].copy_(W)
            blk[..., i].copy_(b)

    def store(self, theta: torch.Tensor, blocks: Optional[List[torch.Tensor]] = None) -> None:
        """Writes ``blocks`` (default: the parameters) into the rows of ``theta [c, d]``."""
        for blk, (W, b), (o, i) in zip(blocks or self.params, _mlp_layers(self.model, theta), self.shapes):
            W.copy_(blk[:, :, :i])
            b.copy_(blk[:, :, i])

    # ---- one forward and backward pass ---------------------------------------------------------

    def gather(self, data: ClientData, idx: torch.Tensor) -> torch.Tensor:
        """Reads the rows ``idx`` (int64 [c, n]) into the input block; returns their labels [c, n]."""
        flat = idx.reshape(-1)
        torch.index_select(data.x, 0, flat, out=self.x_rows)
        return data.y.index_select(0, flat).view(self.c, self.n)

    def backward(self, y: torch.Tensor, w: Optional[torch.Tensor], visit) -> None:
        """Forward and backward of Σ_j w_j·ce_j on the gathered rows and labels ``y [c, n]`` (row
        weights ``w [c, n]``, or None: every row weighs 1 and the caller scales). For every layer,
        last first, calls ``visit(j, dz, a)``: the gradient of the loss in the layer's output
        ``dz [c, out, n]`` and its input with a ones column ``a [c, n, in + 1]``, so that the
        gradient of the layer's block is ``dz @ a``. ``visit`` may overwrite the layer's block:
        it has been read for the next dz."""
        last = len(self.params) - 1
        for j, P in enumerate(self.params):
            z = torch.bmm(P, self.ins_t[j])  # [c, out, n]
            if j < last:
                torch.clamp_min(z, 0, out=self.relu_out[j])  # ReLU
        dz = torch.softmax(z, 1)  # d ce / d z = softmax(z) − onehot(y)
        dz.scatter_add_(1, y.unsqueeze(1), self.minus_one)
        if w is not None:
            dz.mul_(w.unsqueeze(1))
        for j in range(last, -1, -1):
            if j > 0:  # with the block before visit() changes it
                dh = torch.bmm(self.weights_t[j], dz, out=self.dh[j - 1])
            visit(j, dz, self.ins[j])
            if j > 0:
                dz = _relu_backward_(dh, self.relu_out[j - 1])


def _gather(data: ClientData, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x [*idx.shape, p], y [*idx.shape]) of the rows ``idx`` (int64): ``index_select`` on the
    flat indices (4x faster than ``x[idx]`` with a 2-D index)."""
    flat = idx.reshape(-1)
    return (data.x.index_select(0, flat).view(*idx.shape, data.x.shape[1]),
            data.y.index_select(0, flat).view(idx.shape))


def _mlp_logits_t(layers, x: torch.Tensor) -> torch.Tensor:
    """Logits ``[c, C, n]`` (classes first) of the c models ``layers`` (views into theta, see
    ``_mlp_layers``) on rows ``x [c, n, p]``."""
    h = x
    for W, b in layers[:-1]:
        h = torch.baddbmm(b.unsqueeze(1), h, W.transpose(1, 2)).relu_()  # [c, n, out]
    W, b = layers[-1]
    return torch.baddbmm(b.unsqueeze(2), W, h.transpose(1, 2))


_FROZEN = "frozen"  # a layer whose lr_scale block is all zeros


def _block_kinds(ch, lr_scale: Optional[torch.Tensor]) -> Optional[list]:
    """Per layer of the chunk: None (step as usual), _FROZEN (no update) or the layer's block of
    ``lr_scale`` (a mixed block: the usual step, then scaled coordinate by coordinate)."""
    if lr_scale is None:
        return None
    kinds = []
    for blk in ch.blocks_of(lr_scale):
        if not bool(blk.any()):
            kinds.append(_FROZEN)
        elif bool((blk == 1).all()):
            kinds.append(None)
        else:
            kinds.append(blk)
    return kinds


def _mlp_local_steps(model: MLP, th: torch.Tensor, data: ClientData, batch_idx: Optional[torch.Tensor],
                     full: Optional[tuple], a: Optional[torch.Tensor], scale: Optional[torch.Tensor], steps: int,
                     lr: float, prox: float, lr_scale: Optional[torch.Tensor] = None) -> None:
    """The steps of one chunk ``th [c, d]`` (a view of theta's rows) on minibatches
    ``batch_idx`` (int64 [steps, c, B]) or on ``full = (idx [c, n], w [c, n])`` (every row of
    the clients, padded). θ ← θ(1 − lr(l2 + prox)) + lr·prox·a − lr·g, the shrink and the
    gradient in one GEMM: ``P.baddbmm_(dz, inputs, beta=1 − lr(l2 + prox), alpha=−lr)``; with an
    anchor and l2 = 0 the anchor term is one ``lerp_`` pass before it (θ + lr·prox·(a − θ))."""
    c = th.shape[0]
    n = batch_idx.shape[2] if batch_idx is not None else full[0].shape[1]
    ch = _MLPChunk(model, c, n, th.dtype, th.device)
    ch.load(th)
    # the anchor in the chunk's layout (one block per layer: lerp_ in one contiguous pass)
    anchor = ch.blocks_of(a) if prox and a is not None else None
    # lr_scale: a frozen layer (FedRep's body or head) is skipped, a mixed one scaled after its step
    kinds = _block_kinds(ch, lr_scale)
    lerp = anchor is not None and model.l2 == 0
    beta = 1.0 if lerp else 1.0 - lr * (model.l2 + prox)
    if full is not None:
        w = full[1] if scale is None else full[1] * scale[:, None]
    else:
        w = None if scale is None else (scale / n)[:, None].expand(c, n)
    alpha = -lr if w is not None else -lr / n  # minibatches: the 1/B of the mean in the GEMM's alpha

    def update(j, dz, inp):
        P = ch.params[j]
        kind = None if kinds is None else kinds[j]
        if kind is _FROZEN:
            return
        old = P.clone() if kind is not None else None
        if lerp:
            P.lerp_(anchor[j], lr * prox)
        P.baddbmm_(dz, inp, beta=beta, alpha=alpha)
        if anchor is not None and not lerp:
            P.add_(anchor[j], alpha=lr * prox)
        if old is not None:  # θ_old + s ⊙ (θ_new − θ_old): the step scaled per coordinate
            P.sub_(old).mul_(kind).add_(old)

    if full is not None:
        y = ch.gather(data, full[0])
        fresh = [False] * steps
    else:  # a step whose minibatch is the previous step's (pFedMe's inner steps) reuses its rows
        fresh = [True] + (batch_idx[1:] != batch_idx[:-1]).flatten(1).any(1).tolist()
    for s in range(steps):
        if fresh[s]:
            y = ch.gather(data, batch_idx[s])
        ch.backward(y, w, update)
    ch.store(th)


# ---- local_steps -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _native_mlp_module():
    """The native module when it has the MLP kernel, else None (resolved once)."""
    from pflcore import backend
    core = backend.loaded("native")
    return core if core is not None and hasattr(core, "mlp_local_steps") else None


def _native_mlp_steps(model: TorchNet, theta_t: torch.Tensor, data: ClientData, batches_t: Optional[torch.Tensor],
                      anchor_t: Optional[torch.Tensor], scale_t: Optional[torch.Tensor], steps: int, lr: float,
                      prox: float) -> bool:
    """Minibatch steps of a one-hidden-layer float32 MLP on the CPU in the native kernel
    (``csrc/cpu/mlp.cpp``: AVX-512, C <= 16, up to 128 hidden units); False where it does not
    serve the call, and the torch path runs. Its inputs have passed the same checks."""
    core = _native_mlp_module() if HAND_WRITTEN_MLP else None
    if (core is None or not isinstance(model, MLP) or len(model.hidden) != 1 or batches_t is None
            or theta_t.device.type != "cpu" or theta_t.dtype is not torch.float32
            or not core.mlp_local_steps_supported(model.hidden[0], model.C)):
        return False
    tensors = [theta_t, data.x, data.y, batches_t] + [t for t in (anchor_t, scale_t) if t is not None]
    if batches_t.dtype is not torch.int32 or not all(t.is_contiguous() for t in tensors):
        return False
    R = theta_t.shape[0]
    core.mlp_local_steps(theta_t.data_ptr(), R, model.p, model.hidden[0], model.C, model.l2, data.x.data_ptr(),
                         data.y.data_ptr(), batches_t.data_ptr(), steps, batches_t.shape[2],
                         0 if anchor_t is None else anchor_t.data_ptr(), anchor_t is not None and anchor_t.dim() == 1,
                         0 if scale_t is None else scale_t.data_ptr(), lr, prox)
    return True


def local_steps(model: TorchNet, theta_t: torch.Tensor, data: ClientData, rows_t: torch.Tensor,
                batches_t: Optional[torch.Tensor], anchor_t: Optional[torch.Tensor], scale_t: Optional[torch.Tensor],
                steps: int, lr: float, prox: float, lr_scale: Optional[torch.Tensor] = None) -> None:
    """``ops.local_steps`` for a torch net: in place on ``theta [R, d]``, for s = 0..steps-1
    θ_r ← θ_r − lr·s ⊙ ( grad_scale[r]·∇ℓ_i(θ_r; B_{r,s}) + l2·θ_r + prox·(θ_r − a_r) ), i = rows[r],
    s = ``lr_scale`` [d] (default 1)."""
    R = theta_t.shape[0]
    if steps == 0 or R == 0:
        return
    if lr_scale is None and _native_mlp_steps(model, theta_t, data, batches_t, anchor_t, scale_t, steps, lr, prox):
        return
    grad = _grad_fn(model)
    rows_per_model = batches_t.shape[2] if batches_t is not None else _max_rows(data, rows_t)
    shrink = 1.0 - lr * (model.l2 + prox)  # θ(1 − lr(l2 + prox)) + lr·prox·a − lr·g
    fast, fast_cnn = _fast_mlp(model), _fast_cnn(model)

    def work(c0: int, c1: int) -> None:
        th = theta_t[c0:c1]  # consecutive rows of a contiguous [R, d]: a contiguous view
        a = None if anchor_t is None else (anchor_t if anchor_t.dim() == 1 else anchor_t[c0:c1])
        if fast_cnn:
            scale = None if scale_t is None else scale_t[c0:c1]
            if batches_t is None:
                cnn_batched.local_steps_chunk(model, th, data, None, _full_batch(data, rows_t[c0:c1]), a, scale, steps,
                                              lr, prox, lr_scale)
            else:
                idx = batches_t[c0:c1].transpose(0, 1).to(torch.int64).contiguous()
                cnn_batched.local_steps_chunk(model, th, data, idx, None, a, scale, steps, lr, prox, lr_scale)
            return
        if fast:
            scale = None if scale_t is None else scale_t[c0:c1]
            if batches_t is None:
                _mlp_local_steps(model, th, data, None, _full_batch(data, rows_t[c0:c1]), a, scale, steps, lr, prox,
                                 lr_scale)
            else:  # the chunk's indices step-major and int64, once per call
                idx = batches_t[c0:c1].transpose(0, 1).to(torch.int64).contiguous()
                _mlp_local_steps(model, th, data, idx, None, a, scale, steps, lr, prox, lr_scale)
            return
        if batches_t is None:
            idx, w = _full_batch(data, rows_t[c0:c1])
            x, y = data.x[idx], data.y[idx]
        else:
            w = torch.full(batches_t[c0:c1, 0].shape, 1.0 / batches_t.shape[2], dtype=data.dtype,
                           device=data.device)
        if scale_t is not None:
            w = w * scale_t[c0:c1, None]
        for s in range(steps):
            if batches_t is not None:
                idx = batches_t[c0:c1, s].to(torch.int64)
                x, y = data.x[idx], data.y[idx]
            g = model.flatten(grad(model.split(th), x, y, w))
            cnn_batched.step_in_place(th, g, a, lr, prox, shrink, lr_scale)
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
        if _fast_cnn(model):
            x, y = _gather(data, idx)
            cnn_batched.gradient_into(model, th, x, y, w, out[c0:c1])
            if model.l2:
                out[c0:c1].add_(th, alpha=model.l2)
            return
        if _fast_mlp(model):
            ch = _MLPChunk(model, c1 - c0, idx.shape[1], th.dtype, th.device)
            ch.load(th)
            grads = [None] * len(ch.params)

            def keep(j, dz, inp):
                grads[j] = torch.bmm(dz, inp)
            ch.backward(ch.gather(data, idx), w, keep)
            ch.store(out[c0:c1], grads)
            if model.l2:
                out[c0:c1].add_(th, alpha=model.l2)
            return
        g = model.flatten(grad(model.split(th), data.x[idx], data.y[idx], w))
        out[c0:c1] = g if model.l2 == 0 else g.add_(th, alpha=model.l2)
    _for_chunks(list(_chunks(model, R, rows_per_model, data.dtype, data.device)), work, data.device)
    return out


# ---- evaluate ----------------------------------------------------------------------------------

def _row_blocks(data: ClientData, clients: torch.Tensor):
    """Every row of each client cut into blocks of L consecutive rows (the last one padded with
    the client's last row): ``(owner int64 [V], k int64 [V], idx int64 [V, L], real bool [V, L])``,
    block v holding rows of client ``clients[owner[v]]``, the k-th of its blocks. L is a quarter
    of the clients' mean size (at least 16, at most the largest client): padding every client to
    the largest one instead costs 1.6-3.7x the rows on lognormal client sizes."""
    lo, hi = data.offsets[clients], data.offsets[clients + 1]
    n = hi - lo
    L = int(min(int(n.max()), max(16, -(-int(n.sum()) // (4 * n.numel())))))
    nb = (n + L - 1) // L
    owner = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), nb)
    k = torch.arange(owner.numel(), device=n.device) - (torch.cumsum(nb, 0) - nb)[owner]
    j = torch.arange(L, device=n.device)
    start = (k * L)[:, None] + j  # offsets within the client
    idx = torch.minimum(lo[owner][:, None] + start, (hi - 1)[owner][:, None])
    return owner, k, idx, start < n[owner][:, None]


def evaluate(model: TorchNet, theta_t: torch.Tensor, data: ClientData, rows_t: torch.Tensor,
             batches: Optional[torch.Tensor] = None):
    """``(loss_sum [R], correct int64 [R], count int64 [R])``: cross-entropy summed over the
    client's rows (or the rows ``batches [R, B]``; no l2), rows whose first maximal logit is the
    label, rows. ``theta`` [R, d], or [d]: one model for every row (read in place).

    All rows of a client: the rows are cut into blocks (``_row_blocks``), each evaluated with its
    client's model; the blocks' sums are added per client afterwards, in block order."""
    R = rows_t.numel()
    dtype, device = theta_t.dtype, theta_t.device
    count = data.sizes[rows_t].clone() if batches is None else \
        torch.full((R,), batches.shape[1], dtype=torch.int64, device=device)
    if batches is None:
        owner, k, idx_all, real_all = _row_blocks(data, rows_t)
    else:
        owner, idx_all, real_all = None, batches.to(torch.int64), None
    V = idx_all.shape[0]
    loss_v = torch.empty(V, dtype=dtype, device=device)
    correct_v = torch.empty(V, dtype=torch.int64, device=device)
    logits = _logits_fn(model)

    def work(c0: int, c1: int) -> None:
        if theta_t.dim() == 1:
            th = theta_t.expand(c1 - c0, theta_t.shape[0])
        else:
            th = theta_t[c0:c1] if owner is None else theta_t.index_select(0, owner[c0:c1])
        x, y = _gather(data, idx_all[c0:c1])
        if _fast_mlp(model) or _fast_cnn(model):  # logits [c, C, n]: the class dimension first (see _MLPChunk)
            zt = _mlp_logits_t(_mlp_layers(model, th), x) if _fast_mlp(model) else cnn_batched.logits_t(model, th, x)
            ce = torch.logsumexp(zt, 1).sub_(zt.gather(1, y.unsqueeze(1)).squeeze(1))
            hit = zt.max(1).indices == y  # the first maximal logit, like argmax (7x faster over dim 1)
        else:
            z = logits(model.split(th), x)                                              # [c, n, C]
            ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none").view(y.shape)
            hit = z.max(-1).indices == y  # the first maximal logit, like argmax (faster)
        if real_all is None:
            loss_v[c0:c1], correct_v[c0:c1] = ce.sum(1), hit.sum(1)
        else:
            real = real_all[c0:c1]
            loss_v[c0:c1] = torch.where(real, ce, torch.zeros((), dtype=ce.dtype, device=ce.device)).sum(1)
            correct_v[c0:c1] = (hit & real).sum(1)
    _for_chunks(list(_chunks(model, V, idx_all.shape[1], data.dtype, data.device)), work, data.device)
    if owner is None:
        return loss_v, correct_v, count
    # per client, its blocks' sums in block order (one thread: the same bits at any thread count)
    width = int(k.max()) + 1
    loss = torch.zeros(R, width, dtype=dtype, device=device)
    correct = torch.zeros(R, width, dtype=torch.int64, device=device)
    loss[owner, k] = loss_v
    correct[owner, k] = correct_v
    return loss.sum(1), correct.sum(1), count


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

class NetsAdapter(Adapter):
    """The torch nets' implementation (chosen by the model's type, on CPU and CUDA tensors)."""

    name = "nets"
    takes_lr_scale = True
    devices = ("cpu", "cuda")

    def _load(self):
        return torch, f"torch.func over all clients (torch {torch.__version__})"

    @nets_math  # PFLCORE_NETS_TF32=0: full float32 (backends/_precision.py)
    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False,
                    lr_scale=None):
        if steps == 0:
            return
        _values.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
        local_steps(model, theta, data, all_rows(data, rows), batches, anchor, grad_scale, steps, lr, prox, lr_scale)

    @nets_math  # PFLCORE_NETS_TF32=0: full float32 (backends/_precision.py)
    def gradients(self, model, theta, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        theta = _values.one_per_row(theta, data, rows)
        return gradients(model, theta, data, all_rows(data, rows), batches)

    @nets_math  # PFLCORE_NETS_TF32=0: full float32 (backends/_precision.py)
    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        return evaluate(model, theta, data, all_rows(data, rows), batches)

    @nets_math  # PFLCORE_NETS_TF32=0: full float32 (backends/_precision.py)
    def hvp(self, model, theta, v, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        _values.finite_rows(v, "v")
        return hvp(model, theta, v, data, batches)
