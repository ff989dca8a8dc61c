"""The forward and backward pass of c ``CNN`` models (one chunk of model rows) on the CPU with the
direct convolutions of ``csrc/cpu/cnn.cpp``: what ``cnn_batched.py`` runs on the CPU when the
native module is built (otherwise its grouped oneDNN convolutions). Same interface as
``cnn_batched.CNNChunk``.

Why native: the per-model layers are thin (1→10, 10→20, 3→6, 6→16 channels), where oneDNN's
grouped convolution ran at 4–25 GFLOP/s at one thread (its input gradient worst) and was 70–78%
of a local step. The kernels (``csrc/cpu/cnn.cpp``) treat a convolution over "wide" planes as
a GEMM whose right-hand rows are shifted views of the input, and ran each op at 30–65 GFLOP/s.

Layout (N = c·n images, image i = g·n + r is row r of model g):

* A layer's input: ``[N, Cin, L]`` planes of the padded image (Hp rows of Wp values, zero
  borders) in a flat run of L = Hp·Wp rounded up to 16, then ``_SLACK`` zeros after the last
  image (a wide output row's last vector reads a few values past its plane). The first layer
  without padding reads the gathered data rows as they are (L = H·W: no copy; ``rows_buffer``).
* Its output ``z [N, Cout, Lz]``: Ho rows of Wp values (columns x >= Wo are garbage, never
  read), Lz = Ho·Wp rounded up to 16 (a whole number of vectors at any level's width).
* Max-pooling then ReLU (they commute: relu(max z) = max(relu z); the gradient goes to the
  first maximal input of the window where the pooled value is > 0, as the module's) writes the
  next layer's input planes in place (``conv_pool_relu``: the conv, then the pooling, image by
  image, so z is never a buffer of every image's planes), or, after the last conv layer, the
  flattened features ``[c, n, C·H·W]`` (the module's flatten order, a row per image) of the dense
  layers, which run in one call per chunk (``dense_grad`` / ``dense_logits``:
  ``csrc/cpu/cnn_dense.cpp`` on the avx2 and avx512 levels, torch's ``bmm`` elsewhere); the
  features ``[c, C·H·W, n]`` of ``cnn_im2col.ChunkHead``'s dense layers where a caller asks to keep
  the forward's state without the gradient (``logits_t(keep=True)``).
* Backward (``conv_backward``, one layer, model by model): from the pooled gradient alone
  (``cnn_pooled_backward``, kernels of at most 8 x 8): each channel's windows whose gradient is
  not 0 (the ReLU passes it and it is not 0; at 2 x 2 pooling a quarter of the positions, fewer
  after the ReLU) at their maxima; the weight gradient sums, per window and input channel, the
  k kernel rows of input the maximum read (8-lane vectors), and the input gradient (not for the
  first layer: the rows are data) scatters the window's gradient times those kernel rows back
  onto the same input positions, in the input's ``[N, Cin, L]`` layout, where the previous
  layer's pooling gradient reads it. No dz is written. Larger kernels take the dense sums over
  the pooling's gradient planes dz ``[n, Cout, Lz]``: the weight gradient ``shifted_corr(dz,
  input)``, the input gradient ``input_grad`` (per input channel the k² tap planes
  ``Σ_co W[co, ci, tap]·dz[co]``, a shifted GEMM over the Cout planes, summed back onto the
  pixels each tap read, col2im as a gather over the tap planes). Either way the weight and bias
  gradients go straight into the rows of the gradient.

``TorchOps`` is the same operations in torch (the reference the tests check the kernels
against; also a chunk that runs anywhere, slowly). Determinism: a chunk runs on one thread and the
kernels sum in a fixed order, so the bits do not depend on the thread count.
"""
from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Optional

import torch

from pflcore.backends import cnn_im2col
from pflcore.models.nets import CNN

# Values read past the last plane of a layer's input: a wide output row's last vector reaches up to
# k + 14 values beyond the padded image with 16-lane vectors (any kernel size up to _SLACK - 16).
_SLACK = 64


def _up16(v: int) -> int:
    """A whole number of vectors of positions at any level's width (8 or 16 floats)."""
    return -(-v // 16) * 16


class Layer(NamedTuple):
    """The geometry of conv layer j (and its pooling) in the wide layout."""
    cin: int
    cout: int
    pad: int
    wp: int      # padded input width: the row stride of every plane of this layer
    L: int       # input plane stride
    ho: int      # output rows
    lz: int      # output plane stride (and the positions computed)
    h2: int      # pooled rows and columns
    w2: int
    qv: int      # positions up to the last valid output, (ho − 1)·Wp + Wo: what col2im adds back
    off_f: torch.Tensor  # int64 [Cin·k·k] forward tap offsets (ci, i, j): ci·L + i·Wp + j


@functools.lru_cache(maxsize=64)
def layers(model: CNN) -> List[Layer]:
    """Every conv layer's geometry (cached per model configuration)."""
    k, pad, pool = model.kernel_size, model.padding, model.pool
    cin, H, W = model.image_shape
    out = []
    for j, cout in enumerate(model.channels):
        hp, wp = H + 2 * pad, W + 2 * pad
        L = hp * wp if (j == 0 and pad == 0) else _up16(hp * wp)  # raw data rows in the first layer
        ho, wo = hp - k + 1, wp - k + 1
        taps = torch.tensor([i * wp + jj for i in range(k) for jj in range(k)], dtype=torch.int64)
        off_f = (torch.arange(cin, dtype=torch.int64)[:, None] * L + taps).reshape(-1)
        out.append(Layer(cin, cout, pad, wp, L, ho, _up16(ho * wp), ho // pool, wo // pool, (ho - 1) * wp + wo, off_f))
        cin, H, W = cout, ho // pool, wo // pool
    return out


def rows_buffer(N: int, p: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[N, p]`` rows in a buffer with ``_SLACK`` zeros after them, for ``index_select(out=...)``:
    a first layer without padding then convolves the rows where they lie."""
    buf = torch.empty(N * p + _SLACK, dtype=dtype, device=device)
    buf[N * p:].zero_()
    return buf[:N * p].view(N, p)


def _has_slack(x: torch.Tensor) -> bool:
    """Whether ``_SLACK`` finite elements follow contiguous ``x`` in its storage (``rows_buffer``'s
    zeros, or further data rows). The kernels multiply what they read there by zero gradients
    (the wide rows' garbage columns), so a NaN or inf there would leak into the weight gradient."""
    end = (x.storage_offset() + x.numel() + _SLACK) * x.element_size()
    if not (x.is_contiguous() and x.untyped_storage().nbytes() >= end):
        return False
    after = x.new_empty(0).set_(x.untyped_storage(), x.storage_offset() + x.numel(), (_SLACK,), (1,))
    return bool(torch.isfinite(after).all())


def supports(model: CNN) -> bool:
    """Whether the wide layout serves ``model``: a wide output row's last vector reads up to
    ``kernel_size + 15`` values past its plane (16-lane vectors), which the ``_SLACK`` zeros must cover."""
    return model.kernel_size + 16 <= _SLACK


# ---- the five operations: native, and the torch reference ---------------------------------------
# Every buffer argument is a flat 1-D tensor whose first element is where the C++ pointer points.

class NativeOps:
    """``csrc/cpu/cnn.cpp`` through ``pflcore._core``."""

    def __init__(self, core):
        self.core = core

    def shifted_gemm(self, src, src_img, off, w, bias, G, n, R, P, out, out_img, out_row):
        self.core.cnn_shifted_gemm(src.dtype is torch.float64, src.data_ptr(), src_img, off.data_ptr(), off.numel(),
                                   w.data_ptr(), 0 if bias is None else bias.data_ptr(), G, n, R, P, out.data_ptr(),
                                   out_img, out_row)

    def input_grad(self, dz, dz_img, dz_row, wt, G, n, cout, cin, k, wp, P, qv, dx, dx_img, dx_row):
        self.core.cnn_input_grad(dz.dtype is torch.float64, dz.data_ptr(), dz_img, dz_row, wt.data_ptr(), G, n, cout,
                                 cin, k, wp, P, qv, dx.data_ptr(), dx_img, dx_row)

    def shifted_corr(self, a, a_img, a_row, src, src_img, off, G, n, R, P, dw, db):
        self.core.cnn_shifted_corr(a.dtype is torch.float64, a.data_ptr(), a_img, a_row, src.data_ptr(), src_img,
                                   off.data_ptr(), off.numel(), G, n, R, P, dw.data_ptr(), db.data_ptr())

    def pooled_backward(self, da, h, G, n, C, h2, w2, in_group, in_img, s_c, s_y, s_x, idx, src, src_img, L, wp, cin,
                        k, dw, db, wt=None, dx=None, dx_img=0, dx_row=0):
        """``dw [G, C, ...]`` and ``db [G, C]``: each model's block contiguous, the models any stride
        apart (the rows of a gradient buffer); the input gradient into ``dx`` where given."""
        self.core.cnn_pooled_backward(da.dtype is torch.float64, da.data_ptr(), h.data_ptr(), G, n, C, h2, w2,
                                      in_group, in_img, s_c, s_y, s_x, idx.data_ptr(), src.data_ptr(), src_img, L, wp,
                                      cin, k, dw.data_ptr(), dw.stride(0), db.data_ptr(), db.stride(0),
                                      0 if dx is None else wt.data_ptr(), 0 if dx is None else dx.data_ptr(), dx_img,
                                      dx_row)

    def pool_relu(self, z, N, C, z_row, wz, h2, w2, pool, n, out, out_group, out_img, s_c, s_y, s_x, idx):
        self.core.cnn_pool_relu(z.dtype is torch.float64, z.data_ptr(), N, C, z_row, wz, h2, w2, pool, n,
                                out.data_ptr(), out_group, out_img, s_c, s_y, s_x, idx.data_ptr())

    def conv_pool_relu(self, src, src_img, off, w, bias, G, n, R, P, wz, h2, w2, pool, out, out_group, out_img, s_c,
                       s_y, s_x, idx):
        self.core.cnn_conv_pool_relu(src.dtype is torch.float64, src.data_ptr(), src_img, off.data_ptr(), off.numel(),
                                     w.data_ptr(), 0 if bias is None else bias.data_ptr(), G, n, R, P, wz, h2, w2, pool,
                                     out.data_ptr(), out_group, out_img, s_c, s_y, s_x, idx.data_ptr())

    def conv_backward(self, da, h, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, P, src, src_img, off, G, dw,
                      db, wt, cin, k, wp, qv, dx, dx_img, dx_row):
        """``dw [G, C, ...]`` and ``db [G, C]``: each model's block contiguous, the models any stride
        apart (the rows of a gradient buffer)."""
        self.core.cnn_conv_backward(da.dtype is torch.float64, da.data_ptr(), h.data_ptr(), C, h2, w2, n, in_group,
                                    in_img, s_c, s_y, s_x, idx.data_ptr(), P, src.data_ptr(), src_img, off.data_ptr(),
                                    off.numel(), G, dw.data_ptr(), dw.stride(0), db.data_ptr(), db.stride(0),
                                    0 if wt is None else wt.data_ptr(), cin, k, wp, qv,
                                    0 if dx is None else dx.data_ptr(), dx_img, dx_row)

    def dense_grad(self, feats, y, w, layers, grads, dfeats):
        """The dense layers' forward and backward (``TorchOps.dense_grad``): ``layers`` and
        ``grads`` are ``[(W [c, out, in], b [c, out])]`` (each model's block contiguous, the
        models any one stride apart: rows of theta and of the gradient)."""
        c, n, _ = feats.shape
        dims = [layers[0][0].shape[2]] + [W.shape[1] for W, _ in layers]
        _check_dense_views(feats, layers, grads, dfeats)
        y = y.to(torch.int64).contiguous()  # (held here: the kernel reads them through pointers)
        w = w.to(feats.dtype).contiguous()
        self.core.cnn_dense_grad(feats.dtype is torch.float64, feats.data_ptr(), c, n, dims,
                                 [W.data_ptr() for W, _ in layers], [b.data_ptr() for _, b in layers],
                                 _model_strides(layers), y.data_ptr(), w.data_ptr(),
                                 [g.data_ptr() for g, _ in grads], [g.data_ptr() for _, g in grads], _model_strides(grads),
                                 dfeats.data_ptr())

    def dense_logits(self, feats, layers):
        """The dense layers' forward alone (``TorchOps.dense_logits``)."""
        c, n, _ = feats.shape
        dims = [layers[0][0].shape[2]] + [W.shape[1] for W, _ in layers]
        _check_dense_views(feats, layers, [], None)
        logits = feats.new_empty(c, n, dims[-1])
        self.core.cnn_dense_logits(feats.dtype is torch.float64, feats.data_ptr(), c, n, dims,
                                   [W.data_ptr() for W, _ in layers], [b.data_ptr() for _, b in layers],
                                   _model_strides(layers), logits.data_ptr())
        return logits

    def pool_relu_backward(self, da, h, N, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, dz, dz_row):
        self.core.cnn_pool_relu_backward(da.dtype is torch.float64, da.data_ptr(), h.data_ptr(), N, C, h2, w2, n,
                                         in_group, in_img, s_c, s_y, s_x, idx.data_ptr(), dz.data_ptr(), dz_row)


def _model_strides(pairs) -> List[int]:
    """Each tensor's model stride, W then b per layer (the kernels' theta_model / grad_model)."""
    return [s for W, b in pairs for s in (W.stride(0), b.stride(0))]


def _check_dense_views(feats, layers, grads, dfeats) -> None:
    """What the dense kernels assume of their buffers (they read and write through pointers):
    contiguous ``[c, n, F]`` features, each layer's ``[c, out, in]`` / ``[c, out]`` blocks
    contiguous within a model (the models any stride apart: rows of theta, of the gradient), the
    features' dtype."""
    if not feats.is_contiguous() or (dfeats is not None and (not dfeats.is_contiguous() or dfeats.shape != feats.shape)):
        raise ValueError("dense layers: expected contiguous [c, n, F] features and feature gradients")
    for W, b in list(layers) + list(grads):
        if W.stride()[1:] != (W.shape[2], 1) or b.stride(1) != 1 or W.dtype is not feats.dtype \
                or b.dtype is not feats.dtype:
            raise ValueError(f"dense layers: expected [c, out, in] blocks contiguous within a model and the features' "
                             f"dtype, got strides {W.stride()} / {b.stride()}, {W.dtype}")


class TorchOps:
    """The same operations in torch: the reference of the native kernels (tests)."""

    @staticmethod
    def _cols(src, src_img, off, N, P):  # [N, Tn, P]: src[i·src_img + off[t] + q]
        i = torch.arange(N, device=src.device)[:, None, None] * src_img
        return src[i + off.to(src.device)[None, :, None] + torch.arange(P, device=src.device)]

    def shifted_gemm(self, src, src_img, off, w, bias, G, n, R, P, out, out_img, out_row):
        cols = self._cols(src, src_img, off, G * n, P).view(G, n, -1, P)
        res = torch.einsum("grt,gntp->gnrp", w.view(G, R, -1), cols)
        if bias is not None:
            res = res + bias.view(G, 1, R, 1)
        out.as_strided((G * n, R, P), (out_img, out_row, 1)).copy_(res.reshape(G * n, R, P))

    def input_grad(self, dz, dz_img, dz_row, wt, G, n, cout, cin, k, wp, P, qv, dx, dx_img, dx_row):
        dzv = dz.as_strided((G, n, cout, P), (n * dz_img, dz_img, dz_row, 1))
        cols = torch.einsum("gtc,gncp->gntp", wt.view(G, cin * k * k, cout), dzv).reshape(G * n, cin, k * k, P)
        acc = cols.new_zeros(G * n, cin, dx_row)
        for t in range(k * k):  # col2im: each tap's values back onto the pixels it read
            o = (t // k) * wp + t % k
            acc[:, :, o:o + qv] += cols[:, :, t, :qv]
        dx.as_strided((G * n, cin, dx_row), (dx_img, dx_row, 1)).copy_(acc)

    def shifted_corr(self, a, a_img, a_row, src, src_img, off, G, n, R, P, dw, db):
        av = a.as_strided((G, n, R, P), (n * a_img, a_img, a_row, 1))
        cols = self._cols(src, src_img, off, G * n, P).view(G, n, -1, P)
        dw.view(G, R, -1).copy_(torch.einsum("gnrp,gntp->grt", av, cols))
        db.view(G, R).copy_(av.sum((1, 3)))

    def pool_relu(self, z, N, C, z_row, wz, h2, w2, pool, n, out, out_group, out_img, s_c, s_y, s_x, idx):
        win = z.as_strided((N, C, h2, w2, pool, pool), (C * z_row, z_row, pool * wz, pool, wz, 1))
        m, arg = win.reshape(N, C, h2, w2, pool * pool).max(4)  # the first maximal value (a NaN wins)
        y = torch.arange(h2, device=z.device)[:, None]
        x = torch.arange(w2, device=z.device)
        idx.view(N, C, h2, w2).copy_((y * pool + arg // pool) * wz + x * pool + arg % pool)
        out.as_strided((N // n, n, C, h2, w2), (out_group, out_img, s_c, s_y, s_x)).copy_(
            m.relu().view(N // n, n, C, h2, w2))

    def conv_pool_relu(self, src, src_img, off, w, bias, G, n, R, P, wz, h2, w2, pool, out, out_group, out_img, s_c,
                       s_y, s_x, idx):
        z = src.new_empty(G * n * R * P)
        self.shifted_gemm(src, src_img, off, w, bias, G, n, R, P, z, R * P, P)
        self.pool_relu(z, G * n, R, P, wz, h2, w2, pool, n, out, out_group, out_img, s_c, s_y, s_x, idx)

    def pooled_backward(self, da, h, G, n, C, h2, w2, in_group, in_img, s_c, s_y, s_x, idx, src, src_img, L, wp, cin,
                        k, dw, db, wt=None, dx=None, dx_img=0, dx_row=0):
        """The gradients from the pooled gradient (``cnn_pooled_backward``): the pooling's gradient into
        dz, then ``shifted_corr`` with the taps ci·L + ti·Wp + tj and, where ``dx`` is given,
        ``input_grad`` (dx's values outside the windows' reach: 0)."""
        reach = (k - 1) * (wp + 1)
        P = -(-(int(idx.max()) + 1) // 16) * 16 if idx.numel() else 16  # (dz holds every maximum)
        dz = da.new_empty(G * n * C * P)
        self.pool_relu_backward(da, h, G * n, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, dz, P)
        t = torch.arange(cin * k * k, device=da.device)
        off = (t // (k * k)) * L + ((t // k) % k) * wp + t % k
        grad_w = dw.new_empty(G, C, cin * k * k)
        grad_b = db.new_empty(G, C)
        self.shifted_corr(dz, C * P, P, src, src_img, off, G, n, C, P, grad_w, grad_b)
        dw.copy_(grad_w.view(dw.shape))
        db.copy_(grad_b.view(db.shape))
        if dx is not None:
            qv = min(P, dx_row - reach)  # (dz is 0 past the last maximum)
            self.input_grad(dz, C * P, P, wt, G, n, C, cin, k, wp, P, qv, dx, dx_img, dx_row)

    def conv_backward(self, da, h, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, P, src, src_img, off, G, dw,
                      db, wt, cin, k, wp, qv, dx, dx_img, dx_row):
        dz = da.new_empty(G * n * C * P)
        self.pool_relu_backward(da, h, G * n, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, dz, P)
        self.shifted_corr(dz, C * P, P, src, src_img, off, G, n, C, P, dw, db)
        if dx is not None:
            self.input_grad(dz, C * P, P, wt, G, n, C, cin, k, wp, P, qv, dx, dx_img, dx_row)

    @staticmethod
    def dense_logits(feats, layers):
        """The logits ``[c, n, C]`` of the dense layers below from the features ``feats [c, n, F]``."""
        h = feats
        for j, (W, b) in enumerate(layers):
            h = torch.baddbmm(b.unsqueeze(1), h, W.transpose(1, 2))
            h = h.relu() if j < len(layers) - 1 else h
        return h

    def dense_grad(self, feats, y, w, layers, grads, dfeats):
        """Dense layers ``h_l = relu(h_{l−1} W_lᵀ + b_l)`` (no ReLU after the last) from the
        features ``feats [c, n, F]``; the gradient of Σ_r w_r·ce_r (labels ``y [c, n]`` int64,
        weights ``w [c, n]``) written into ``grads`` ``[(gW [c, out, in], gb [c, out])]`` and, at
        the features, into ``dfeats [c, n, F]``."""
        hs = [feats]
        for j, (W, b) in enumerate(layers):
            z = torch.baddbmm(b.unsqueeze(1), hs[-1], W.transpose(1, 2))  # [c, n, out]
            hs.append(z.relu() if j < len(layers) - 1 else z)
        dz = torch.softmax(hs[-1], 2)
        dz.scatter_add_(2, y.unsqueeze(2), torch.full_like(dz[:, :, :1], -1.0))
        dz.mul_(w.unsqueeze(2))
        for j in range(len(layers) - 1, -1, -1):
            W, h = layers[j][0], hs[j]
            grads[j][0].copy_(torch.bmm(dz.transpose(1, 2), h))
            grads[j][1].copy_(dz.sum(1))
            dh = torch.bmm(dz, W)  # [c, n, in]
            dz = torch.where(h > 0, dh, torch.zeros_like(dh)) if j > 0 else dh
        dfeats.copy_(dz)

    def pool_relu_backward(self, da, h, N, C, h2, w2, n, in_group, in_img, s_c, s_y, s_x, idx, dz, dz_row):
        shape, strides = (N // n, n, C, h2, w2), (in_group, in_img, s_c, s_y, s_x)
        hv, dav = h.as_strided(shape, strides).reshape(N, C, -1), da.as_strided(shape, strides).reshape(N, C, -1)
        dz[:N * C * dz_row].zero_()
        dzv = dz[:N * C * dz_row].view(N, C, dz_row)
        at = idx.view(N, C, -1).long()
        dzv.scatter_(2, at, torch.where(hv > 0, dav, dzv.gather(2, at)))


_TORCH_DENSE = TorchOps()

# CPU capability levels whose dense-layer kernels (csrc/cpu/cnn_dense.cpp) beat torch's bmm: 256- and
# 512-bit vectors (CIFAR head, 7 models, 1 thread, AMD Zen 5: avx512 171 GFLOP/s, avx2 80, torch's
# bmm path 66-70; the baseline level's 128-bit vectors 40, slower than torch, as NEON would be)
_WIDE_LEVELS = ("avx2", "avx512")


def _dense_ops(ops):
    """Who runs a chunk's dense layers: ``ops`` where they are the native kernels on a level with
    wide vectors, else torch's ``bmm`` (``TorchOps``; the same layout and math)."""
    if isinstance(ops, NativeOps):
        from pflcore import backend
        level = backend.cpu_capability()
        if level in _WIDE_LEVELS or (level == "native" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
            return ops
        return _TORCH_DENSE
    return ops


@functools.lru_cache(maxsize=None)
def native_ops() -> Optional[NativeOps]:
    """The native operations when the native module has them, else None (resolved once)."""
    from pflcore import backend
    core = backend.loaded("native")
    return NativeOps(core) if core is not None and hasattr(core, "cnn_shifted_gemm") else None


# ---- the chunk ----------------------------------------------------------------------------------

class CNNChunk(cnn_im2col.ChunkHead):
    """Forward/backward of the c models whose parameters are ``params`` (``model.split`` of
    ``theta [c, d]`` rows: ``{name: [c, *shape]}``), float32 or float64, with ``ops``
    (``NativeOps`` or ``TorchOps``)."""

    def __init__(self, model: CNN, params: Dict[str, torch.Tensor], ops):
        super().__init__(model, params)
        self.ops = ops
        # set by a caller whose rows come from rows_buffer (its zeros after them): no check of them
        self.rows_in_buffer = False
        self.geo = layers(model)
        self.c = params[self.names[0]].shape[0]
        self.conv = []  # (W [c, Cout, Cin·k·k], b [c, Cout], Wt [c, Cin·k·k, Cout]): contiguous copies
        for j, g in enumerate(self.geo):
            W, b = params[self.names[2 * j]], params[self.names[2 * j + 1]]
            Wt = W.permute(0, 2, 3, 4, 1).reshape(self.c, -1, g.cout).contiguous() if j > 0 else None
            self.conv.append((W.reshape(self.c, g.cout, -1).contiguous(), b.contiguous(), Wt))

    def _first_input(self, x: torch.Tensor) -> torch.Tensor:
        """The first layer's input planes, flat (``[N, Cin, L]`` then ``_SLACK`` zeros)."""
        c, n, p = x.shape
        g = self.geo[0]
        if g.pad == 0:
            if not (self.rows_in_buffer and x.is_contiguous()) and not _has_slack(x):
                x = rows_buffer(c * n, p, x.dtype, x.device).copy_(x.reshape(c * n, p))
            return x.reshape(-1).as_strided((c * n * p + _SLACK,), (1,))
        cin, H, W = self.model.image_shape
        buf = x.new_zeros(c * n * cin * g.L + _SLACK)
        planes = buf[:c * n * cin * g.L].view(c * n, cin, g.L)[..., :(H + 2 * g.pad) * g.wp]
        planes.view(c * n, cin, H + 2 * g.pad, g.wp)[..., g.pad:g.pad + H, g.pad:g.pad + W].copy_(
            x.reshape(c * n, cin, H, W))
        return buf

    def _pool_target(self, j: int, n: int, like: torch.Tensor, rows_major: bool = False):
        """Where layer j's pooled output goes: (flat buffer, its view at the first pixel, strides
        (group, image, channel, row, column)); the next layer's padded input, or the features:
        ``[c, C·H·W, n]`` (the torch dense layers'), or ``[c, n, C·H·W]`` (``rows_major``: the
        native dense layers')."""
        g, c = self.geo[j], self.c
        if j + 1 < len(self.geo):
            nx = self.geo[j + 1]
            buf = like.new_zeros(c * n * nx.cin * nx.L + _SLACK)  # zero borders, gaps and slack
            first = nx.pad * nx.wp + nx.pad
            return buf, buf[first:], (n * nx.cin * nx.L, nx.cin * nx.L, nx.L, nx.wp, 1)
        F = g.cout * g.h2 * g.w2
        if rows_major:
            feats = like.new_empty(c, n, F)
            return feats, feats.view(-1), (n * F, F, g.h2 * g.w2, g.w2, 1)
        feats = like.new_empty(c, F, n)  # [c, C·H·W, n]
        return feats, feats.view(-1), (F * n, 1, g.h2 * g.w2 * n, g.w2 * n, n)

    # ---- forward ---------------------------------------------------------------------------

    def logits_t(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """Logits ``[c, C, n]`` (classes first) of every model on its rows ``x [c, n, p]``;
        ``keep``: save what ``gradient`` needs."""
        if keep:
            return self._dense_forward(*self._conv_forward(x, keep, rows_major=False), keep)
        feats, _ = self._conv_forward(x, False, rows_major=True)
        return _dense_ops(self.ops).dense_logits(feats, self.fc).transpose(1, 2)  # the dense layers in one call

    def _conv_forward(self, x: torch.Tensor, keep: bool, rows_major: bool):
        """The conv layers: (the features, the layers' saved state (``keep``: else empty)); the
        features ``[c, n, C·H·W]`` where ``rows_major``, else ``[c, C·H·W, n]``."""
        c, n = x.shape[:2]
        N, ops, pool = c * n, self.ops, self.model.pool
        a = self._first_input(x)
        saved = []
        for j, (g, (Wk, b, _)) in enumerate(zip(self.geo, self.conv)):
            idx = torch.empty(N * g.cout * g.h2 * g.w2, dtype=torch.int32, device=x.device)
            nxt, at, st = self._pool_target(j, n, x, rows_major)
            # the conv's output z [N, Cout, Lz] pooled image by image (conv_pool_relu: shifted_gemm
            # then pool_relu, without a buffer of every image's planes)
            ops.conv_pool_relu(a, g.cin * g.L, g.off_f, Wk, b, c, n, g.cout, g.lz, g.wp, g.h2, g.w2, pool, at, *st, idx)
            if keep:
                saved.append((a, idx, at, st))
            a = nxt
        return a, saved

    # ---- backward --------------------------------------------------------------------------

    def gradient(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, out: Dict[str, torch.Tensor]) -> None:
        """Writes the gradient of Σ_j w_j·ce_j (row weights ``w [c, n]``, labels ``y [c, n]``) of
        every model into ``out`` (``model.split`` of a ``[c, d]`` buffer)."""
        c, n = y.shape
        # the conv layers with the features [c, n, F] (each image's flattened features one row), then
        # the dense layers' forward and backward in one call (ops.dense_grad), the gradient at the
        # features in the features' layout
        feats, self._saved = self._conv_forward(x, True, rows_major=True)
        names, nconv = self.names, len(self.geo)
        grads = [(out[names[2 * (nconv + j)]], out[names[2 * (nconv + j) + 1]]) for j in range(len(self.fc))]
        dfeats = torch.empty_like(feats)
        _dense_ops(self.ops).dense_grad(feats, y.contiguous(), w.to(feats.dtype).contiguous(), self.fc, grads, dfeats)
        da = dfeats.view(-1)
        N, ops, names = c * n, self.ops, self.names
        nconv = len(self.geo)
        for j in range(nconv - 1, -1, -1):
            g = self.geo[j]
            a, idx, h, st = self._saved[j]
            dW, db = out[names[2 * j]], out[names[2 * j + 1]]  # [c, Cout, Cin, k, k], [c, Cout]: rows of the gradient
            # the pooling's gradient (dz [N, Cout, Lz]: zeros but at the maxima), the weight and bias
            # gradients, and (not for the first layer: the rows are data) the input gradient, in the
            # layout of this layer's input (= the pooled output of j − 1); model by model
            dnext = x.new_empty(N * g.cin * g.L) if j > 0 else None
            ops.conv_backward(da, h, g.cout, g.h2, g.w2, n, *st, idx, g.lz, a, g.cin * g.L, g.off_f, c, dW, db,
                              self.conv[j][2], g.cin, self.model.kernel_size, g.wp, g.qv, dnext, g.cin * g.L, g.L)
            if j > 0:
                da = dnext[g.pad * g.wp + g.pad:]
        self._saved = []
