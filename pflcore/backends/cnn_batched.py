"""The forward and backward pass of c ``CNN`` models (one chunk of model rows) on their clients'
rows at once (no autograd, no ``vmap``): what the nets adapter (``pflcore/backends/nets.py``) runs
for every ``CNN`` in ``local_steps``, ``gradients`` and ``evaluate``.

On the CPU with the native module built, the chunks run the direct convolutions of
``cnn_native.py`` (``csrc/cpu/cnn.cpp``; ``CPU_PATH``); this module's grouped oneDNN convolutions
are the CPU path without it, and ``cnn_im2col.py`` the path off the CPU. This module's
``CNNChunk``:

* The c models are the c groups of one grouped convolution per layer: activations are
  ``[n, c·C, H, W]`` in channels-last memory ``[n, H, W, c, C]`` (n rows per model), weights
  ``[c·Cout, Cin, k, k]`` (views of the ``theta`` rows), ``groups = c``. In that layout oneDNN
  runs the forward, the weight/bias gradient and the input gradient (``aten.convolution`` /
  ``convolution_backward``), and max-pooling is vectorized over the c·C channels. Measured at
  1 thread against the im2col + ``bmm`` path of ``cnn_im2col.py`` (per-client GEMMs of
  M = Cout rows, and k² strided copies for im2col and col2im; what other devices run): 1.3–1.5x faster on the MNIST and CIFAR nets of
  ``bench/algorithms.py`` part ``cnn``. (``vmap`` makes the same grouped convolutions but in
  NCHW, where oneDNN is several times slower.)
* A 3-channel (RGB) first layer gets a zero 4th input channel (see ``_PAD_CIN``); its weight
  gradient is sliced back.
* Max-pooling is applied before the ReLU (they commute: relu(max z) = max(relu z)), so the ReLU
  and its backward touch the pooled map only. Gradients agree with the module's: where the
  pooled value is > 0 both send it to the first maximal input of the window, elsewhere both
  give 0.
* The flattened features are copied to ``[c, C·H·W, n]`` (the module's flatten order, rows last)
  and the fully connected layers run feature-major with ``bmm`` like the hand-written MLP of
  ``nets.py``.
* The first conv layer needs no input gradient (the rows are data).
* Determinism: each chunk runs on one thread (``nets._for_chunks``), so oneDNN's reductions do
  not depend on the thread count. float64 (which oneDNN lacks) falls back to aten's own
  convolution: slower, same function.

Layer parameters are views into ``theta [c, d]`` rows (``model.split``); nothing is cached
between calls.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from pflcore.backends import cnn_im2col, cnn_native
from pflcore.models.nets import CNN

_aten = torch.ops.aten

# First-layer input channels padded with zero channels: oneDNN's grouped weight gradient with 3
# channels per group (RGB) ran ~2.5x slower than with 4 (1 thread, AVX2; 1, 2 and 4 are fine).
_PAD_CIN = {3: 4}
# Devices whose chunks take the grouped convolutions below; others take cnn_im2col's GEMMs.
GROUPED_DEVICES = {"cpu"}
# The CPU chunks: "native" (cnn_native.py's kernels, where the native module has them; else the
# grouped convolutions) or "grouped" (this module's oneDNN convolutions).
CPU_PATH = "native"


class CNNChunk(cnn_im2col.ChunkHead):
    """Forward/backward of the c models whose parameters are ``params`` (``model.split`` of
    ``theta [c, d]`` rows: ``{name: [c, *shape]}``)."""

    def __init__(self, model: CNN, params: Dict[str, torch.Tensor]):
        super().__init__(model, params)
        names = self.names
        self.conv = []  # (W [c·Cout, Cin, k, k], b [c·Cout]): group g of the grouped conv is model g
        for j in range(len(model.channels)):
            W, b = params[names[2 * j]], params[names[2 * j + 1]]
            W = W.reshape(-1, *W.shape[2:])
            if j == 0 and W.shape[1] in _PAD_CIN:  # a zero input channel (see _PAD_CIN)
                W = torch.cat([W, W.new_zeros(W.shape[0], _PAD_CIN[W.shape[1]] - W.shape[1], *W.shape[2:])], 1)
            self.conv.append((W, b.reshape(-1)))
        self.c = params[names[0]].shape[0]

    def _conv_args(self):
        pad = self.model.padding
        return [1, 1], [pad, pad], [1, 1], False, [0, 0], self.c

    # ---- forward ---------------------------------------------------------------------------

    def logits_t(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """Logits ``[c, C, n]`` (classes first) of every model on its rows ``x [c, n, p]``;
        ``keep``: save what ``gradient`` needs."""
        model = self.model
        c, n = x.shape[:2]
        cin, H, W = model.image_shape
        pool = model.pool
        # [n, c·Cin, H, W] in channels-last memory [n, H, W, c, Cin] (Cin padded with zero channels)
        cpad = self.conv[0][0].shape[1]
        a = x.new_empty(n, H, W, c, cpad)
        a[..., cin:].zero_()
        a[..., :cin].copy_(x.reshape(c, n, cin, H, W).permute(1, 3, 4, 0, 2))
        a = a.view(n, H, W, c * cpad).permute(0, 3, 1, 2)
        saved = []
        for Wk, b in self.conv:
            z = _aten.convolution(a, Wk, b, *self._conv_args())  # [n, c·Cout, Ho, Wo]
            pooled, idx = _aten.max_pool2d_with_indices(z, [pool, pool], [pool, pool])
            h = pooled.relu_()
            if keep:
                saved.append((a, z, idx, h))
            a = h
        cout, h2, w2 = a.shape[1] // c, a.shape[2], a.shape[3]
        # [c, C·H·W, n]: the module's flatten order, rows last (a small copy)
        h = a.reshape(n, c, cout, h2, w2).permute(1, 2, 3, 4, 0).reshape(c, cout * h2 * w2, n)
        return self._dense_forward(h, saved, keep)

    # ---- backward --------------------------------------------------------------------------

    def gradient(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, out: Dict[str, torch.Tensor]) -> None:
        """Writes the gradient of Σ_j w_j·ce_j (row weights ``w [c, n]``, labels ``y [c, n]``) of
        every model into ``out`` (``model.split`` of a ``[c, d]`` buffer)."""
        dz = self._dense_backward(x, y, w, out)
        c, n = y.shape
        nconv, names, pool = len(self.conv), self.names, self.model.pool
        _, cc, h2, w2 = self._saved[nconv - 1][3].shape
        # [c, C·H·W, n] back to [n, c·C, H, W] in channels-last memory
        da = dz.view(c, cc // c, h2, w2, n).permute(4, 2, 3, 0, 1).contiguous().view(n, h2, w2, cc).permute(0, 3, 1, 2)
        for j in range(nconv - 1, -1, -1):
            a, z, idx, h = self._saved[j]
            Wk = self.conv[j][0]
            dpool = _aten.threshold_backward(da, h, 0)  # the ReLU after the pool
            dz = _aten.max_pool2d_with_indices_backward(dpool, z, [pool, pool], [pool, pool], [0, 0], [1, 1],
                                                         False, idx)  # [n, c·Cout, Ho, Wo]
            da, gW, gb = _aten.convolution_backward(dz, a, Wk, [Wk.shape[0]], *self._conv_args(),
                                                    [j > 0, True, True])
            o = out[names[2 * j]]
            o.copy_(gW[:, :o.shape[2]].reshape(o.shape))
            out[names[2 * j + 1]].copy_(gb.view(c, -1))
        self._saved = []


def _native_ops(model: CNN, theta: torch.Tensor):
    """cnn_native's kernels where they serve ``theta`` (CPU, float32/float64, built) and ``model``
    (``cnn_native.supports``), else None."""
    if (CPU_PATH != "native" or theta.device.type != "cpu" or theta.dtype not in (torch.float32, torch.float64)
            or not cnn_native.supports(model)):
        return None
    return cnn_native.native_ops()


def _chunk(model: CNN, theta: torch.Tensor):
    """The chunk of the models ``theta [c, d]``: the native kernels on the CPU (``CPU_PATH``),
    else grouped convolutions on ``GROUPED_DEVICES``, else cnn_im2col's GEMMs."""
    ops = _native_ops(model, theta)
    if ops is not None:
        return cnn_native.CNNChunk(model, model.split(theta), ops)
    cls = CNNChunk if theta.device.type in GROUPED_DEVICES else cnn_im2col.CNNChunk
    return cls(model, model.split(theta))


def gradient_into(model: CNN, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                  out: torch.Tensor, rows_in_buffer: bool = False) -> None:
    """``out [c, d]`` ← the gradient of Σ_j w_j·ce_j of the models ``theta [c, d]`` on their rows
    ``x [c, n, p]`` (labels ``y``, weights ``w [c, n]``); no l2. ``rows_in_buffer``: x is a view of
    ``cnn_native.rows_buffer`` (the native first layer reads it in place without checking what
    follows it)."""
    chunk = _chunk(model, theta)
    chunk.rows_in_buffer = rows_in_buffer
    chunk.gradient(x, y, w, model.split(out))


def logits(model: CNN, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[c, n, C]`` logits of the models ``theta [c, d]`` on ``x [c, n, p]``."""
    return _chunk(model, theta).logits(x)


def logits_t(model: CNN, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[c, C, n]`` logits (classes first) of the models ``theta [c, d]`` on ``x [c, n, p]``."""
    return _chunk(model, theta).logits_t(x)


def step_in_place(th: torch.Tensor, g: torch.Tensor, a: Optional[torch.Tensor], lr: float, prox: float,
                  shrink: float, lr_scale: Optional[torch.Tensor]) -> None:
    """One step of the nets' update on ``th [c, d]`` from its gradient ``g`` (shared with the
    generic path of nets.py): θ ← θ·shrink + lr·prox·a − lr·g, then θ_old + s ⊙ (θ − θ_old)
    with ``lr_scale`` s."""
    old = th.clone() if lr_scale is not None else None
    if shrink != 1.0:
        th.mul_(shrink)
    if prox and a is not None:
        th.add_(a, alpha=lr * prox)
    th.add_(g, alpha=-lr)
    if old is not None:  # θ_old + s ⊙ (θ_new − θ_old)
        th.sub_(old).mul_(lr_scale).add_(old)


def local_steps_chunk(model: CNN, th: torch.Tensor, data, batch_idx: Optional[torch.Tensor], full: Optional[tuple],
                      a: Optional[torch.Tensor], scale: Optional[torch.Tensor], steps: int, lr: float, prox: float,
                      lr_scale: Optional[torch.Tensor]) -> None:
    """The steps of one chunk ``th [c, d]`` (a view of theta's rows, updated in place) on
    minibatches ``batch_idx`` (int64 [steps, c, B]) or on ``full = (idx [c, n], w [c, n])``
    (every row of the clients, padded): θ ← θ(1 − lr(l2 + prox)) + lr·prox·a − lr·g, then
    θ_old + s ⊙ (θ − θ_old) with ``lr_scale`` s — the generic path's arithmetic."""
    c, p = th.shape[0], data.x.shape[1]
    g = torch.empty_like(th)
    shrink = 1.0 - lr * (model.l2 + prox)

    native = _native_ops(model, th) is not None

    def gather(idx):
        flat = idx.reshape(-1)
        if native:  # rows followed by zeros: the native first layer reads them in place
            buf = cnn_native.rows_buffer(flat.numel(), p, data.x.dtype, data.x.device)
            x = torch.index_select(data.x, 0, flat, out=buf)
        else:
            x = data.x.index_select(0, flat)
        return x.view(c, -1, p), data.y.index_select(0, flat).view(c, -1)

    if full is not None:
        x, y = gather(full[0])
        w = full[1] if scale is None else full[1] * scale[:, None]
    else:
        B = batch_idx.shape[2]
        w = torch.full((c, B), 1.0 / B, dtype=th.dtype, device=th.device)
        if scale is not None:
            w = w * scale[:, None]
    for s in range(steps):
        if full is None and (s == 0 or not torch.equal(batch_idx[s], batch_idx[s - 1])):
            x, y = gather(batch_idx[s])
        gradient_into(model, th, x, y, w, g, rows_in_buffer=native)
        step_in_place(th, g, a, lr, prox, shrink, lr_scale)
