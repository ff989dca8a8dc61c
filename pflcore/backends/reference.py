"""The reference adapter: every op in plain torch, written for clarity, not speed (loops over
model rows). Each public ``ops.<op>_ref`` runs its op on this adapter, and the tests compare
every other backend with it. It serves CPU and CUDA tensors, GLMs and torch nets (for nets: a
``torch.nn`` module per row and ``torch.autograd``, independent of the vmapped nets adapter).

Values are checked first by the same torch pre-pass as the GPU backends (``_values.py``), so
the reference raises exactly the errors the native kernels raise.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from pflcore.backends import _values
from pflcore.backends._lloyd import lloyd_loop
from pflcore.backends.base import Adapter, all_rows
from pflcore.errors import NonFiniteError
from pflcore.models.glm import GLM
from pflcore.models.nets import TorchNet

_M32 = 0xFFFFFFFF


def _client_rows(data, i: int) -> Tuple[int, int]:
    return int(data.offsets[i]), int(data.offsets[i + 1])


# ---- the Gaussian mechanism (pflcore/ops/dp.py) ----------------------------------------------

_DP_NOISE_STREAM = 0x64702D6E6F697365  # counter word 2 of the mechanism's draws ("dp-noise")


def tree_sum(leaves: torch.Tensor) -> torch.Tensor:
    """``[d]``: the rows of ``leaves [R, d]`` summed along the binary tree over their positions
    (pairs (2i, 2i+1) at every level; a missing row adds an exact 0)."""
    x = leaves
    if x.shape[0] == 0:
        return torch.zeros(leaves.shape[1], dtype=leaves.dtype, device=leaves.device)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, torch.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def philox_normals(n: int, seed: int, counter: int) -> torch.Tensor:
    """``float64 [n]`` standard normals: Box–Muller on numpy's Philox4x64-10 (an implementation
    independent of pflcore's C++), block b from counter (b + 1, counter, stream, 0), key (seed, 0)."""
    import numpy as np
    blocks = (n + 3) // 4
    if blocks == 0:
        return torch.zeros(0, dtype=torch.float64)
    # numpy steps the counter before each block: starting from word 0 = 0 draws block 1 first
    gen = np.random.Philox(key=np.array([seed, 0], dtype=np.uint64),
                           counter=np.array([0, counter, _DP_NOISE_STREAM, 0], dtype=np.uint64))
    raw = torch.from_numpy((gen.random_raw(4 * blocks).reshape(blocks, 4) >> np.uint64(11)).astype(np.int64))
    u = raw.to(torch.float64) * 2.0 ** -53
    radius = torch.sqrt(-2.0 * torch.log1p(-u[:, 0::2]))       # [blocks, 2]
    angle = 6.283185307179586 * u[:, 1::2]
    return torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=2).reshape(-1)[:n]


# ---- GLM math (DESIGN.md §3) ------------------------------------------------------------------

def logits(model: GLM, W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """z [n, C] of rows X [n, p] under parameters W [P, C]."""
    z = X @ W[: model.p]
    if model.fit_intercept:
        z = z + W[model.p]
    return z


def loss_dz(model: GLM, z: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss [n], d loss / d z [n, C])."""
    if model.family == "least_squares":
        r = z[:, 0] - y
        return 0.5 * r * r, r[:, None]
    if model.family == "logistic":
        # log(1 + e^z) − y z = softplus(s), s = z (y = 0) or −z (y = 1), written out because
        # F.softplus switches to the identity above 20 (an absolute error of 2e-9).
        z0, yf = z[:, 0], y.to(z.dtype)
        s = torch.where(y == 1, -z0, z0)
        return s.clamp_min(0) + torch.log1p(torch.exp(-s.abs())), (torch.sigmoid(z0) - yf)[:, None]
    loss = torch.logsumexp(z, dim=1) - z.gather(1, y[:, None])[:, 0]
    dz = torch.softmax(z, dim=1)
    dz[torch.arange(z.shape[0], device=z.device), y] -= 1
    return loss, dz


def correct(model: GLM, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Number of correctly classified rows (0 for least squares)."""
    if model.family == "least_squares":
        return torch.zeros((), dtype=torch.int64)
    pred = (z[:, 0] > 0).to(torch.int64) if model.family == "logistic" else z.argmax(dim=1)
    return (pred == y).sum()


def grad_sum(model: GLM, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_rows ∇_W loss(row) as [P, C] (not divided by the row count, no l2)."""
    _, dz = loss_dz(model, logits(model, W, X), y)
    G = torch.empty_like(W)
    G[: model.p] = X.T @ dz
    if model.fit_intercept:
        G[model.p] = dz.sum(0)
    return G


def glm_hvp(model: GLM, theta: torch.Tensor, v: torch.Tensor, x: torch.Tensor, batches: torch.Tensor) -> torch.Tensor:
    """∇²(mean loss over B_r)(θ_r)·v_r + l2·v_r for every row, in closed form: with z = Xθ,
    ∇²(mean loss) v = Xᵀ J (X v) / B, J the Hessian of the loss in z (1 for least squares,
    σ(1−σ) for logistic, diag(s) − ssᵀ for softmax). Batched over rows with bmm."""
    R, B = batches.shape
    P, C = model.P, model.C
    X = x[batches.to(torch.int64)]                                    # [R, B, p]
    if model.fit_intercept:
        X = torch.cat([X, torch.ones(R, B, 1, dtype=X.dtype, device=X.device)], dim=2)  # [R, B, P]
    W, V = theta.view(R, P, C), v.view(R, P, C)
    z, zv = torch.bmm(X, W), torch.bmm(X, V)                         # [R, B, C]
    if model.family == "least_squares":
        jzv = zv
    elif model.family == "logistic":
        s = torch.sigmoid(z)
        jzv = s * (1 - s) * zv
    else:
        s = torch.softmax(z, dim=2)
        jzv = s * (zv - (s * zv).sum(dim=2, keepdim=True))
    return (torch.bmm(X.transpose(1, 2), jzv) / B).reshape(R, P * C) + model.l2 * v


# ---- nets: one torch.nn module, autograd, row by row --------------------------------------------

def _module(model: TorchNet, dtype, device):
    with torch.random.fork_rng(devices=[]):  # its own init is overwritten; keep the global RNG
        return model.module(dtype=dtype, device=device)


def _net_grad(model: TorchNet, module, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇ (mean cross-entropy over rows x [n, p]) at parameters ``row [d]``, by torch.autograd."""
    torch.nn.utils.vector_to_parameters(row, module.parameters())
    with torch.enable_grad():
        loss = F.cross_entropy(module(model.input_view(x)), y)
        grads = torch.autograd.grad(loss, list(module.parameters()))
    return torch.nn.utils.parameters_to_vector(grads)


def _net_hvp(model: TorchNet, theta, v, x, y, batches) -> torch.Tensor:
    module = _module(model, theta.dtype, theta.device)
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


# ---- counter-based sampling: the hash of csrc/include/pflcore/hash.h in torch ------------------

def _rotl(v: torch.Tensor, r: int) -> torch.Tensor:
    return ((v << r) | (v >> (32 - r))) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def murmur3_words(*words: torch.Tensor) -> torch.Tensor:
    """murmur3_32 (seed 0) of 32-bit words, in int64 tensors. Products of two 32-bit values
    wrap modulo 2**64 in int64, which leaves the low 32 bits exact."""
    h = torch.zeros_like(words[0])
    for k in words:
        k = (k * 0xCC9E2D51) & _M32
        k = _rotl(k, 15)
        k = (k * 0x1B873593) & _M32
        h = h ^ k
        h = _rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & _M32
    return _fmix32(h ^ (4 * len(words)))


# ---- PERM's water-filling -------------------------------------------------------------------------

def _level(c_sorted: torch.Tensor, w_sorted: torch.Tensor) -> torch.Tensor:
    """``[r]`` water level τ of rows whose costs are sorted ascending (weights alongside)."""
    level = (1.0 + torch.cumsum(c_sorted * w_sorted, dim=1)) / torch.cumsum(w_sorted, dim=1)
    # The prefix condition level_a > c_(a) holds for a = 1 (level_1 = c_(1) + 1/w_(1)) and, the
    # costs being sorted, exactly on a prefix: its length is the number of entries where it holds.
    active = (level > c_sorted).sum(dim=1, keepdim=True)
    return level.gather(1, active - 1)[:, 0]


def water_fill(costs: torch.Tensor, w: torch.Tensor, candidates: int = 256,
               w_own: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``alpha [r, k]`` float64: α_ij = w_j·max(0, τ_i − c_ij) with the level τ_i at which the row
    sums to 1 (the rule of csrc/cpu/water_fill.cpp; costs finite, w > 0, both float64), τ from
    ``water_levels``. ``w_own [r]``: row i's weight of the last column in place of w[k − 1]."""
    if w_own is not None:
        w = w.expand(costs.shape[0], w.shape[0]).clone()
        w[:, -1] = w_own
    tau = water_levels(costs, w, candidates)
    return torch.sub(tau[:, None], costs).clamp_(min=0.0).mul_(w if w.dim() == 2 else w[None, :])


def water_levels(costs: torch.Tensor, w: torch.Tensor, candidates: int = 256) -> torch.Tensor:
    """``[r]`` float64: the level τ_i at which Σ_j w_j·max(0, τ_i − c_ij) = 1 (costs finite, w > 0:
    ``[k]``, or ``[r, k]`` a weight per entry).

    Sorting a row's costs ascending, the active set is a prefix of length a, and
    τ = (1 + Σ_{j≤a} c_j w_j) / Σ_{j≤a} w_j; a is the longest prefix whose level exceeds its last
    cost. The level is first found among each row's ``candidates`` smallest costs (``torch.topk``,
    cheaper than sorting the row); it is exact for the row when τ ≤ the next smallest cost, since
    every other entry is then inactive. Rows that fail the check retry with 8× as many
    candidates, up to a full sort."""
    k = costs.shape[1]
    tau = torch.empty(costs.shape[0], dtype=torch.float64, device=costs.device)
    todo = torch.arange(costs.shape[0], device=costs.device)
    L = max(1, min(int(candidates), k))
    while todo.numel():
        rows = costs if todo.numel() == costs.shape[0] else costs[todo]  # no copy on the first pass
        if L >= k:
            vals, idx = torch.sort(rows, dim=1, stable=True)
            bound = torch.full((todo.numel(),), float("inf"), dtype=torch.float64, device=costs.device)
        else:
            vals, idx = torch.topk(rows, L + 1, dim=1, largest=False, sorted=True)
            bound, vals, idx = vals[:, L], vals[:, :L], idx[:, :L]
        level = _level(vals, w[idx] if w.dim() == 1 else torch.gather(w if rows is costs else w[todo], 1, idx))
        exact = level <= bound
        tau[todo[exact]] = level[exact]
        todo, L = todo[~exact], min(8 * L, k)
    return tau


def water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows, cols, fill: str = "block") -> torch.Tensor:
    """``water_fill`` of the costs ``max(0, sq_r[i] + sq_c[j] − 2·gram[i, j])`` (``c[i, own[i]] = 0``),
    written to ``out[out_rows[i], cols[j]]`` (the rule of csrc/cpu/water_fill.cpp's
    water_fill_gram); returns the rows' levels τ_i (α_{i,own} / w_own). ``fill``: "block" and
    "positive" (the block is 0 already: the native kernel then writes the positive weights only)
    write every entry of the block here; "row" clears each output row first."""
    costs = (sq_r[:, None] + sq_c[None, :]).add_(gram.to(torch.float64), alpha=-2.0)
    if not bool(torch.isfinite(costs).all()):  # before the clamp, which would turn −inf into 0
        bad = int(torch.nonzero(~torch.isfinite(costs).all(dim=1))[0])
        raise NonFiniteError(f"gram: row {bad} gives a NaN or infinite cost")
    costs.clamp_(min=0.0)
    at = torch.arange(costs.shape[0], device=costs.device)
    costs[at, own] = 0.0
    alpha = water_fill(costs, w)
    if fill == "row":
        out[out_rows] = 0.0
    out[out_rows[:, None], cols[None, :]] = alpha
    return alpha[at, own] / w[own]


# ---- Anderson's small solve ----------------------------------------------------------------------

def anderson_solve(G: torch.Tensor, reg: float) -> torch.Tensor:
    """π for a float64 Gram matrix G [k, k] (the same rule as csrc/cpu/anderson.cpp):
    a zero residual is taken as is; otherwise π = A⁻¹1 / 1ᵀA⁻¹1, A = G + reg·trace(G)·I,
    solved on the equilibrated Â = S A S, S = diag(A)^{-1/2}, with a jitter on Â's diagonal
    from 1e-14 upwards if rounding leaves it indefinite."""
    k = G.shape[0]
    diag = torch.diagonal(G)
    zero = torch.nonzero(diag == 0)
    if zero.numel():
        pi = torch.zeros(k, dtype=torch.float64)
        pi[int(zero[-1])] = 1.0
        return pi
    lam = reg * float(diag.sum())
    A = G + lam * torch.eye(k, dtype=torch.float64)
    scale = torch.diagonal(A).rsqrt()
    A_hat = A * scale[:, None] * scale[None, :]
    jitter = 0.0
    for _ in range(40):
        L, info = torch.linalg.cholesky_ex(A_hat + jitter * torch.eye(k, dtype=torch.float64))
        if int(info) == 0:
            x = torch.cholesky_solve(scale[:, None], L)[:, 0] * scale
            s = float(x.sum())
            if math.isfinite(s) and s != 0.0:
                return x / s
        jitter = 1e-14 if jitter == 0.0 else jitter * 10.0
    raise RuntimeError("anderson: the Gram matrix is not finite")


class ReferenceAdapter(Adapter):
    """Pure torch: every op, any device, GLMs and nets."""

    name = "reference"
    takes_lr_scale = True
    devices = ("cpu", "cuda")

    def _load(self):
        return torch, f"pure torch {torch.__version__}"

    # ---- model ops --------------------------------------------------------------------------

    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False,
                    lr_scale=None):
        if steps == 0:
            return
        _values.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
        rows = all_rows(data, rows)
        b = None if batches is None else batches.to(torch.int64)
        net = isinstance(model, TorchNet)
        module = _module(model, theta.dtype, theta.device) if net else None
        for r in range(theta.shape[0]):
            lo, hi = _client_rows(data, int(rows[r]))
            th = theta[r] if net else theta[r].view(model.P, model.C)
            a = 0.0 if anchor is None else (anchor if anchor.dim() == 1 else anchor[r])
            a = a if net or anchor is None else a.view(model.P, model.C)
            scale = 1.0 if grad_scale is None else grad_scale[r]
            step = lr if lr_scale is None else lr * (lr_scale if net else lr_scale.view(model.P, model.C))
            for s in range(steps):
                X, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r, s]], data.y[b[r, s]])
                if net:
                    g = _net_grad(model, module, th, X, y)
                else:
                    g = grad_sum(model, th, X, y) / X.shape[0]
                th -= step * (scale * g + model.l2 * th + prox * (th - a))

    def gradients(self, model, theta, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        theta = _values.one_per_row(theta, data, rows)
        rows = all_rows(data, rows)
        b = None if batches is None else batches.to(torch.int64)
        net = isinstance(model, TorchNet)
        module = _module(model, theta.dtype, theta.device) if net else None
        out = torch.empty_like(theta)
        for r in range(theta.shape[0]):
            lo, hi = _client_rows(data, int(rows[r]))
            X, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r]], data.y[b[r]])
            if net:
                out[r] = _net_grad(model, module, theta[r], X, y) + model.l2 * theta[r]
            else:
                W = theta[r].view(model.P, model.C)
                out[r] = (grad_sum(model, W, X, y) / X.shape[0] + model.l2 * W).reshape(-1)
        return out

    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        theta = _values.one_per_row(theta, data, rows)
        rows = all_rows(data, rows)
        b = None if batches is None else batches.to(torch.int64)
        R, dev = theta.shape[0], theta.device
        loss = torch.empty(R, dtype=theta.dtype, device=dev)
        hits = torch.empty(R, dtype=torch.int64, device=dev)
        count = torch.empty(R, dtype=torch.int64, device=dev)
        net = isinstance(model, TorchNet)
        module = _module(model, theta.dtype, dev) if net else None
        with torch.no_grad():
            for r in range(R):
                lo, hi = _client_rows(data, int(rows[r]))
                X, y = (data.x[lo:hi], data.y[lo:hi]) if b is None else (data.x[b[r]], data.y[b[r]])
                if net:
                    torch.nn.utils.vector_to_parameters(theta[r], module.parameters())
                    z = module(model.input_view(X))
                    loss[r] = F.cross_entropy(z, y, reduction="sum")
                    hits[r] = (z.argmax(1) == y).sum()
                else:
                    z = logits(model, theta[r].view(model.P, model.C), X)
                    loss[r] = loss_dz(model, z, y)[0].sum()
                    hits[r] = correct(model, z, y)
                count[r] = X.shape[0]
        return loss, hits, count

    def hvp(self, model, theta, v, data, rows, batches, trusted=False):
        _values.glm_fault(model, theta, data, rows, batches)
        _values.finite_rows(v, "v")
        if isinstance(model, TorchNet):
            return _net_hvp(model, theta, v, data.x, data.y, batches)
        return glm_hvp(model, theta, v, data.x, batches)

    # ---- sampling, clustering, mixing, averaging --------------------------------------------

    def sample_batches(self, data, clients, steps, batch_size, seed, counter, trusted=False):
        _values.sample_batches_fault(data, clients)
        dev = data.x.device
        clients = all_rows(data, clients)
        R = clients.numel()
        shape = (R, steps, batch_size)
        first = data.first_client  # global id of local client 0 (a shard of a federation)
        cid = (clients.to(torch.int64) + first).view(R, 1, 1).expand(shape)
        s = torch.arange(steps, dtype=torch.int64, device=dev).view(1, steps, 1).expand(shape)
        j = torch.arange(batch_size, dtype=torch.int64, device=dev).view(1, 1, batch_size).expand(shape)
        const = lambda v: torch.full(shape, v, dtype=torch.int64, device=dev)  # noqa: E731
        h = murmur3_words(const(seed), const(counter), cid & _M32, s, j)
        lo = data.offsets[clients].view(R, 1, 1)
        n = (data.offsets[clients + 1] - data.offsets[clients]).view(R, 1, 1)
        return (lo + ((h * n) >> 32)).to(torch.int32)

    def kmeans_assign(self, points, centroids, chunk: int = 4096):
        """Squared differences in chunks of points, then argmin (the first minimum: ties go to
        the lowest index)."""
        _values.kmeans_assign_fault(points, centroids)
        labels = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
        sqdist = torch.empty(points.shape[0], dtype=points.dtype, device=points.device)
        for s in range(0, points.shape[0], chunk):
            blk = points[s:s + chunk]
            dist = ((blk[:, None, :] - centroids[None, :, :]) ** 2).sum(-1)
            sqdist[s:s + chunk], labels[s:s + chunk] = dist.min(dim=1)
        return labels, sqdist

    def kmeans_update(self, points, labels, weights, centroids):
        """Float64 sums, empty clusters unchanged."""
        K = centroids.shape[0]
        _values.kmeans_update_fault(labels, weights, K)
        w = torch.ones(points.shape[0], dtype=torch.float64, device=points.device) if weights is None \
            else weights.to(torch.float64)
        wsum = torch.zeros(K, dtype=torch.float64, device=points.device).index_add_(0, labels, w)
        sums = torch.zeros(K, points.shape[1], dtype=torch.float64, device=points.device)
        sums.index_add_(0, labels, points.to(torch.float64) * w[:, None])
        keep = wsum > 0
        centroids[keep] = (sums[keep] / wsum[keep, None]).to(centroids.dtype)
        return wsum

    def kmeans_lloyd(self, points, centroids, weights, iters: int, tol: float):
        """The Lloyd loop of the reference's assignment and update (backends/_lloyd.py)."""
        return lloyd_loop(points, centroids, weights, iters, tol, self.kmeans_assign, self.kmeans_update)

    def anderson_push(self, u, tu, R_hist, TU_hist, slot: int, slots: List[int]):
        R_hist[slot] = tu - u
        TU_hist[slot] = tu
        idx = torch.tensor(slots, device=u.device)
        return (R_hist[idx].to(torch.float64) @ R_hist[slot].to(torch.float64)).cpu()

    def anderson_mix(self, TU_hist, slots: List[int], pi):
        idx = torch.tensor(slots, device=TU_hist.device)
        return (pi.to(TU_hist.device) @ TU_hist[idx].to(torch.float64)).to(TU_hist.dtype)

    def gram(self, vecs):
        v = vecs.to(torch.float64)
        return (v @ v.T).cpu()

    def anderson_solve(self, G, reg: float):
        return anderson_solve(G, reg)

    def water_fill(self, costs, w, candidates: int = 256, w_own=None):
        return water_fill(costs, w, candidates, w_own)

    def water_fill_gram(self, gram, sq_r, sq_c, own, w, out, out_rows, cols, fill: str = "block"):
        return water_fill_gram(gram, sq_r, sq_c, own, w, out, out_rows, cols, fill)

    def clip_and_sum(self, updates, weights, clip_norm: float, noise_std: float, seed: int, counter: int):
        _values.clip_and_sum_fault(updates, weights)
        u = updates.to(torch.float64)
        norms = torch.linalg.vector_norm(u, dim=1)
        scale = torch.where(norms > clip_norm, clip_norm / norms, torch.ones_like(norms))
        if weights is not None:
            scale = weights.to(torch.float64) * scale
        leaves = scale[:, None] * u + 0.0  # + 0.0: no -0.0, so that tree_sum's padding zeros add nothing
        total = tree_sum(leaves).cpu()
        if noise_std > 0:
            total = total + noise_std * self.dp_normals(u.shape[1], seed, counter)
        return total, int((norms > clip_norm).sum())

    def dp_normals(self, n: int, seed: int, counter: int):
        return philox_normals(n, seed, counter)

    def average(self, theta, weights, rows):
        _values.average_fault(theta, weights, rows)
        if rows is not None:
            theta, weights = theta[rows], weights[rows]
        w64 = weights.to(torch.float64)
        return ((w64 @ theta.to(torch.float64)) / w64.sum()).to(theta.dtype)
