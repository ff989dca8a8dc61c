"""The im2col + batched-GEMM forward and backward of c ``CNN`` models (one chunk of model rows):
what ``cnn_batched.py`` runs off the CPU (on the CPU its grouped oneDNN convolutions are faster,
and on a GPU this path keeps cuBLAS's deterministic GEMMs instead of cuDNN's convolution
algorithms). Same interface as ``cnn_batched.CNNChunk``.

Why by hand: ``vmap`` over the models turns each convolution into a grouped convolution whose
backward (and NCHW max-pooling) ran no faster than a loop over clients' ``nn.Module`` s. Here:

* Activations are channel-major and row-minor, ``[c, C, H, W, n]`` (c models, n rows each).
  Seen as ``[c·C, n, H, W]`` that is channels-last memory with the rows as channels, where
  torch's max-pooling is vectorized (~20x its NCHW kernel on 24x24 maps).
* A conv layer is im2col + one batched GEMM per chunk: ``cols [c, Cin·k·k, Ho·Wo·n]`` (the
  module's tap order) is filled with one copy per tap (ki, kj), each a set of contiguous runs
  of Wo·n values; ``W [c, Cout, Cin·k·k] @ cols`` gives ``[c, Cout, Ho·Wo·n]``, already the
  next layer's layout (a GEMM with a long N dimension: the shape BLAS does well). Backward:
  ``dW = dz @ colsᵀ``, ``dcols = Wᵀ @ dz`` and col2im (k² shifted adds, contiguous runs too).
* Max-pooling is applied before the ReLU (they commute: relu(max z) = max(relu z)), so the ReLU
  and its backward touch the pooled map only. Gradients agree with the module's: where the
  pooled value is > 0 both send it to the first maximal input of the window, elsewhere both
  give 0.
* The flattened features are a free view ``[c, C·H·W, n]`` (the module's flatten order), and
  the fully connected layers run feature-major like the hand-written MLP of ``nets.py``.
* The first conv layer needs no input gradient (the rows are data).

Layer parameters are views into ``theta [c, d]`` rows (``model.split``); nothing is cached
between calls.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from pflcore.models.nets import CNN

_aten = torch.ops.aten


def _im2col(a: torch.Tensor, k: int, pad: int) -> Tuple[torch.Tensor, int, int]:
    """``a [c, Cin, H, W, n]`` → ``cols [c, Cin·k·k, Ho·Wo·n]`` (taps in the module's order
    Cin, ki, kj), Ho = H + 2·pad − k + 1 (likewise Wo)."""
    if pad:
        a = F.pad(a, (0, 0, pad, pad, pad, pad))
    c, cin, H, W, n = a.shape
    ho, wo = H - k + 1, W - k + 1
    cols = a.new_empty(c, cin, k, k, ho, wo, n)
    for i in range(k):
        for j in range(k):
            cols[:, :, i, j].copy_(a[:, :, i:i + ho, j:j + wo])
    return cols.view(c, cin * k * k, ho * wo * n), ho, wo


def _col2im(dcols: torch.Tensor, shape: Tuple[int, ...], k: int, pad: int) -> torch.Tensor:
    """The adjoint of ``_im2col``: ``dcols [c, Cin·k·k, Ho·Wo·n]`` → ``[c, Cin, H, W, n]``
    (``shape``), every window's taps added back onto the pixels they read."""
    c, cin, H, W, n = shape
    hp, wp = H + 2 * pad, W + 2 * pad
    ho, wo = hp - k + 1, wp - k + 1
    d = dcols.view(c, cin, k, k, ho, wo, n)
    out = dcols.new_zeros(c, cin, hp, wp, n)
    for i in range(k):
        for j in range(k):
            out[:, :, i:i + ho, j:j + wo].add_(d[:, :, i, j])
    return out[:, :, pad:pad + H, pad:pad + W] if pad else out


def _planes(t: torch.Tensor) -> torch.Tensor:
    """``[c, C, H, W, n]`` as ``[c·C, n, H, W]`` (a view: channels-last memory)."""
    c, C, H, W, n = t.shape
    return t.reshape(c * C, H, W, n).permute(0, 3, 1, 2)


class ChunkHead:
    """What both chunk layouts share (this one and ``cnn_batched.CNNChunk``): the parameters'
    names, the fully connected layers, feature-major ``[c, features, n]`` with ``bmm`` like the
    hand-written MLP of ``nets.py``, and the loss's gradient back through them. A subclass
    builds ``self.conv`` and writes ``logits_t`` (its conv layers, then ``_dense_forward``) and
    the conv part of ``gradient`` (after ``_dense_backward``)."""

    def __init__(self, model: CNN, params: Dict[str, torch.Tensor]):
        self.model = model
        self.names = [n for n, _ in model.param_shapes]
        nconv = len(model.channels)
        self.fc = [(params[self.names[2 * (nconv + j)]], params[self.names[2 * (nconv + j) + 1]])
                   for j in range(len(model.hidden) + 1)]
        self._saved: List[tuple] = []

    def _dense_forward(self, h: torch.Tensor, saved: List, keep: bool) -> torch.Tensor:
        """Logits ``[c, C, n]`` from the flattened features ``h [c, C·H·W, n]``; ``keep``: the
        conv layers' ``saved`` entries, then each dense layer's input, become ``self._saved``."""
        last = len(self.fc) - 1
        for j, (Wl, b) in enumerate(self.fc):
            z = torch.baddbmm(b.unsqueeze(2), Wl, h)  # [c, out, n]
            if keep:
                saved.append(h)
            h = z.relu_() if j < last else z
        if keep:
            self._saved = saved
        return h

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[c, n, C]``."""
        return self.logits_t(x).transpose(1, 2)

    def _dense_backward(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                        out: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The forward pass (saving), then the gradient of Σ_j w_j·ce_j through the dense layers
        into ``out``; returns the gradient at the flattened features, ``[c, C·H·W, n]``."""
        z = self.logits_t(x, keep=True)
        c, n = y.shape
        nconv = len(self.model.channels)
        dz = torch.softmax(z, 1)  # d ce / d z = softmax(z) − onehot(y)
        dz.scatter_add_(1, y.unsqueeze(1), torch.full((1, 1, 1), -1.0, dtype=dz.dtype, device=dz.device).expand(c, 1, n))
        dz.mul_(w.unsqueeze(1))
        names = self.names
        for j in range(len(self.fc) - 1, -1, -1):
            h = self._saved[nconv + j]
            Wl = self.fc[j][0]
            out[names[2 * (nconv + j)]].copy_(torch.bmm(dz, h.transpose(1, 2)))
            out[names[2 * (nconv + j) + 1]].copy_(dz.sum(2))
            dh = torch.bmm(Wl.transpose(1, 2), dz)  # [c, in, n]
            # the ReLU of the layer before (its saved output is this layer's input h)
            dz = _aten.threshold_backward(dh, h, 0) if j > 0 else dh
        return dz


class CNNChunk(ChunkHead):
    """Forward/backward of the c models whose parameters are ``params`` (``model.split`` of
    ``theta [c, d]`` rows: ``{name: [c, *shape]}``)."""

    def __init__(self, model: CNN, params: Dict[str, torch.Tensor]):
        super().__init__(model, params)
        self.conv = []  # (W [c, Cout, Cin·k·k], b [c, Cout])
        for j in range(len(model.channels)):
            W, b = params[self.names[2 * j]], params[self.names[2 * j + 1]]
            self.conv.append((W.reshape(W.shape[0], W.shape[1], -1), b))

    # ---- forward ---------------------------------------------------------------------------

    def logits_t(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """Logits ``[c, C, n]`` (classes first) of every model on its rows ``x [c, n, p]``;
        ``keep``: save what ``gradient`` needs."""
        model = self.model
        c, n = x.shape[:2]
        cin, H, W = model.image_shape
        k, pool, pad = model.kernel_size, model.pool, model.padding
        a = x.reshape(c, n, cin, H, W).permute(0, 2, 3, 4, 1).contiguous()  # [c, Cin, H, W, n]
        saved = []
        for Wk, b in self.conv:
            cout = Wk.shape[1]
            cols, ho, wo = _im2col(a, k, pad)
            z = torch.baddbmm(b.unsqueeze(2), Wk, cols).view(c, cout, ho, wo, n)
            zp = _planes(z)
            pooled, idx = _aten.max_pool2d_with_indices(zp, [pool, pool], [pool, pool])  # [c·Cout, n, H2, W2]
            h2, w2 = pooled.shape[2:]
            h = pooled.permute(0, 2, 3, 1).reshape(c, cout, h2, w2, n).relu_()  # a view when channels-last
            if keep:
                saved.append((a.shape, cols, zp, idx, h))
            a = h
        return self._dense_forward(a.reshape(c, -1, n), saved, keep)  # [c, C·H·W, n]: the module's flatten order

    # ---- backward --------------------------------------------------------------------------

    def gradient(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, out: Dict[str, torch.Tensor]) -> None:
        """Writes the gradient of Σ_j w_j·ce_j (row weights ``w [c, n]``, labels ``y [c, n]``) of
        every model into ``out`` (``model.split`` of a ``[c, d]`` buffer)."""
        model = self.model
        dz = self._dense_backward(x, y, w, out)
        c = y.shape[0]
        nconv, names = len(self.conv), self.names
        k, pool, pad = model.kernel_size, model.pool, model.padding
        da = dz.view(self._saved[nconv - 1][4].shape)  # [c, C, H2, W2, n]
        for j in range(nconv - 1, -1, -1):
            in_shape, cols, zp, idx, h = self._saved[j]
            Wk = self.conv[j][0]
            cout = Wk.shape[1]
            dpool = _planes(_aten.threshold_backward(da, h, 0))  # the ReLU after the pool
            dzp = _aten.max_pool2d_with_indices_backward(dpool, zp, [pool, pool], [pool, pool], [0, 0], [1, 1],
                                                         False, idx)  # [c·Cout, n, Ho, Wo]
            dzm = dzp.permute(0, 2, 3, 1).reshape(c, cout, -1)  # [c, Cout, Ho·Wo·n]
            out[names[2 * j]].copy_(torch.bmm(dzm, cols.transpose(1, 2)).view(out[names[2 * j]].shape))
            out[names[2 * j + 1]].copy_(dzm.sum(2))
            if j > 0:
                da = _col2im(torch.bmm(Wk.transpose(1, 2), dzm), in_shape, k, pad)  # [c, Cin, H, W, n]
        self._saved = []
