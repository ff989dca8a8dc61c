"""Triton kernel of the GLM ops: ``local_steps``, ``gradients`` and ``evaluate`` (DESIGN.md §3, §4).

One program per model row r (client i = rows[r]) runs the row's whole loop in one launch:

    local_steps (MODE 0), for s = 0..steps-1:
        G = Σ_{t ∈ B_{r,s}} x_tᵀ ⊗ dℓ/dz(z_t, y_t),   z_t = x_t W (+ b)
        W ← W − lr·( grad_scale[r]·G/|B_{r,s}| + l2·W + prox·(W − a_r) )
    gradients (MODE 1):  out_r = G/|B_r| + l2·W   (B_r = all rows of client i, or batches[r])
    evaluate (MODE 2):   loss_r = Σ_t ℓ(z_t, y_t),  correct_r = Σ_t [pred(z_t) = y_t],  count_r = n_i

with the per-row math of csrc/include/pflcore/glm.h:
    least squares  ℓ = ½(z − y)²,                      dℓ/dz = z − y
    logistic       ℓ = max(s, 0) + log(1 + e^{−|s|}),  dℓ/dz = σ(z) − y,   s = z (y = 0), −z (y = 1)
    softmax        ℓ = logsumexp(z) − z_y,             dℓ/dz = softmax(z) − e_y

W [P, C] (P = p + intercept) stays in the row of ``theta`` (global memory, updated in place) and
the gradient accumulates in a scratch row, so any p and C fit: the rows are taken BLOCK_N at a
time, the features BLOCK_P at a time, the logits are [BLOCK_N, BLOCK_C] and every product is a
broadcast-multiply-sum (no tl.dot: its float32 inputs would be rounded to TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pflcore.triton._util import BLOCK_BUDGET, launch_device, next_pow2

_FAMILY = {"least_squares": 0, "logistic": 1, "softmax": 2}
_LOCAL_STEPS, _GRADIENTS, _EVALUATE = 0, 1, 2


@triton.jit
def _glm_kernel(
    theta_ptr,    # [R, d] parameters; MODE 0 updates them in place
    acc_ptr,      # [R, d] gradient sums: MODE 0 scratch, MODE 1 the output; unused in MODE 2
    x_ptr,        # [N, p] features
    y_ptr,        # [N] int64 labels, or targets in the dtype of x (least squares)
    offsets_ptr,  # [m + 1] int64 row offsets of the clients
    rows_ptr,     # [R] int64 client of each model row
    batches_ptr,  # [R, steps, B] int32 absolute row indices (HAS_BATCHES); MODE 1: [R, B]
    anchor_ptr,   # [R, d] (ANCHOR == 2) or [d] (ANCHOR == 1); unused when ANCHOR == 0
    scale_ptr,    # [R] grad_scale (HAS_SCALE)
    hyper_ptr,    # [3] lr, prox, l2 in the dtype of x (Python floats would arrive as float32)
    loss_ptr,     # [R] MODE 2: loss sums
    correct_ptr,  # [R] int64, MODE 2: correctly classified rows
    count_ptr,    # [R] int64, MODE 2: rows
    p, C, steps, B,
    FAMILY: tl.constexpr, INTERCEPT: tl.constexpr, MODE: tl.constexpr, HAS_BATCHES: tl.constexpr,
    ANCHOR: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    dt = theta_ptr.dtype.element_ty
    client = tl.load(rows_ptr + r)
    lo = tl.load(offsets_ptr + client)
    n = tl.load(offsets_ptr + client + 1) - lo
    if HAS_BATCHES:
        nb = n * 0 + B  # an int64 tensor either way (B itself may arrive as a Python int)
    else:
        nb = n
    P = p + INTERCEPT
    d = P * C
    lr = tl.load(hyper_ptr)
    prox = tl.load(hyper_ptr + 1)
    l2 = tl.load(hyper_ptr + 2)
    th = theta_ptr + r * d
    acc = acc_ptr + r * d
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    tn = tl.arange(0, BLOCK_N)
    kp = tl.arange(0, BLOCK_P)
    loss_sum = tl.zeros([BLOCK_N], dtype=dt)
    hits = tl.zeros([BLOCK_N], dtype=tl.int64)

    for s in range(steps):
        if MODE != 2:
            for k0 in range(0, P, BLOCK_P):
                k = k0 + kp
                pm = (k < P)[:, None] & cmask[None, :]
                tl.store(acc + k[:, None] * C + cc[None, :], tl.zeros([BLOCK_P, BLOCK_C], dtype=dt), mask=pm)
            tl.debug_barrier()
        for t0 in range(0, nb, BLOCK_N):
            t = t0 + tn
            tmask = t < nb
            if HAS_BATCHES:
                ridx = tl.load(batches_ptr + (r * steps + s) * B + t, mask=tmask, other=0).to(tl.int64)
                ridx = tl.where(tmask, ridx, lo)
            else:
                ridx = tl.where(tmask, lo + t, lo)
            # logits z [BLOCK_N, BLOCK_C] = x_t W (+ b); padded rows and classes give 0
            z = tl.zeros([BLOCK_N, BLOCK_C], dtype=dt)
            for k0 in range(0, P, BLOCK_P):
                k = k0 + kp
                xk = tl.load(x_ptr + ridx[:, None] * p + k[None, :], mask=tmask[:, None] & (k < p)[None, :],
                             other=0.0)
                if INTERCEPT:
                    xk = tl.where(tmask[:, None] & (k == p)[None, :], 1.0, xk)
                w = tl.load(th + k[:, None] * C + cc[None, :], mask=(k < P)[:, None] & cmask[None, :], other=0.0)
                z += tl.sum(xk[:, :, None] * w[None, :, :], axis=1)
            # per-row loss and dz = d loss / d z (0 on padding)
            if FAMILY == 0:
                yv = tl.load(y_ptr + ridx, mask=tmask, other=0.0)
                res = tl.sum(z, axis=1) - yv  # C = 1: the single logit
                row_loss = 0.5 * res * res
                dz = res[:, None] + tl.zeros([BLOCK_N, BLOCK_C], dtype=dt)
                row_hit = tl.zeros([BLOCK_N], dtype=tl.int64)
            elif FAMILY == 1:
                yv = tl.load(y_ptr + ridx, mask=tmask, other=0)
                z1 = tl.sum(z, axis=1)
                e = tl.exp(-tl.abs(z1))
                sig = tl.where(z1 >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
                sgn = tl.where(yv == 1, -z1, z1)
                # log(1 + e) accurate also where 1 + e rounds to 1 (Goldberg: log(u)·e/(u − 1),
                # u = fl(1 + e)); written inline: a nested jit call is slow in the interpreter
                u = 1.0 + e
                row_loss = tl.maximum(sgn, 0.0) + tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
                dz = (sig - yv.to(dt))[:, None] + tl.zeros([BLOCK_N, BLOCK_C], dtype=dt)
                row_hit = ((z1 > 0).to(tl.int64) == yv).to(tl.int64)
            else:
                yv = tl.load(y_ptr + ridx, mask=tmask, other=0)
                zm = tl.where(cmask[None, :], z, float("-inf"))
                zmax = tl.max(zm, axis=1)
                ez = tl.where(cmask[None, :], tl.exp(zm - zmax[:, None]), 0.0)
                total = tl.sum(ez, axis=1)
                onehot = cc[None, :] == yv[:, None]
                zy = tl.sum(tl.where(onehot, z, 0.0), axis=1)
                row_loss = tl.log(total) + zmax - zy
                dz = ez / total[:, None] - onehot.to(dt)
                row_hit = (tl.argmax(zm, axis=1, tie_break_left=True).to(tl.int64) == yv).to(tl.int64)
            if MODE == 2:
                loss_sum += tl.where(tmask, row_loss, 0.0)
                hits += tl.where(tmask, row_hit, 0)
            else:
                dz = tl.where(tmask[:, None] & cmask[None, :], dz, 0.0)
                # G[k, c] += Σ_t x_t[k]·dz_t[c]
                for k0 in range(0, P, BLOCK_P):
                    k = k0 + kp
                    xk = tl.load(x_ptr + ridx[:, None] * p + k[None, :], mask=tmask[:, None] & (k < p)[None, :],
                                 other=0.0)
                    if INTERCEPT:
                        xk = tl.where(tmask[:, None] & (k == p)[None, :], 1.0, xk)
                    g = tl.sum(xk[:, :, None] * dz[:, None, :], axis=0)
                    pm = (k < P)[:, None] & cmask[None, :]
                    offs = k[:, None] * C + cc[None, :]
                    tl.store(acc + offs, tl.load(acc + offs, mask=pm, other=0.0) + g, mask=pm)
                tl.debug_barrier()
        if MODE == 0:
            scale = 1.0 / nb.to(dt)
            if HAS_SCALE:
                scale = tl.load(scale_ptr + r) * scale
            for k0 in range(0, P, BLOCK_P):
                k = k0 + kp
                pm = (k < P)[:, None] & cmask[None, :]
                offs = k[:, None] * C + cc[None, :]
                w = tl.load(th + offs, mask=pm, other=0.0)
                g = tl.load(acc + offs, mask=pm, other=0.0)
                if ANCHOR == 1:
                    a = tl.load(anchor_ptr + offs, mask=pm, other=0.0)
                elif ANCHOR == 2:
                    a = tl.load(anchor_ptr + r * d + offs, mask=pm, other=0.0)
                else:
                    a = tl.zeros([BLOCK_P, BLOCK_C], dtype=dt)
                tl.store(th + offs, w - lr * (scale * g + l2 * w + prox * (w - a)), mask=pm)
            tl.debug_barrier()

    if MODE == 1:
        for k0 in range(0, P, BLOCK_P):
            k = k0 + kp
            pm = (k < P)[:, None] & cmask[None, :]
            offs = k[:, None] * C + cc[None, :]
            g = tl.load(acc + offs, mask=pm, other=0.0)
            w = tl.load(th + offs, mask=pm, other=0.0)
            tl.store(acc + offs, g / nb.to(dt) + l2 * w, mask=pm)
    if MODE == 2:
        tl.store(loss_ptr + r, tl.sum(loss_sum, axis=0))
        tl.store(correct_ptr + r, tl.sum(hits, axis=0))
        tl.store(count_ptr + r, n)


def _blocks(P: int, C: int):
    """(BLOCK_N, BLOCK_P, BLOCK_C): the [BLOCK_N, BLOCK_P, BLOCK_C] products hold at most
    BLOCK_BUDGET elements (more only when C alone needs it: a row's logits are one block)."""
    scale = max(1, BLOCK_BUDGET // 4096)
    block_c = next_pow2(C)
    block_p = max(1, min(next_pow2(P), (64 if block_c == 1 else 32) * scale, BLOCK_BUDGET // block_c))
    block_n = max(1, min(64 * scale, BLOCK_BUDGET // (block_p * block_c)))
    return block_n, block_p, block_c


def _launch(mode, model, theta, acc, data, rows, batches, anchor, grad_scale, steps, lr, prox, outs=None,
            blocks=None):
    R = theta.shape[0]
    if R == 0:
        return
    block_n, block_p, block_c = blocks or _blocks(model.P, model.C)
    hyper = torch.tensor([lr, prox, model.l2], dtype=theta.dtype, device=theta.device)
    dummy = theta  # stands for the pointers a configuration does not read
    anchor_mode = 0 if anchor is None else (1 if anchor.dim() == 1 else 2)
    loss, correct, count = outs if outs is not None else (dummy, rows, rows)
    with launch_device(theta):
        _glm_kernel[(R,)](
            theta, acc, data.x, data.y, data.offsets, rows,
            batches if batches is not None else rows, anchor if anchor is not None else dummy,
            grad_scale if grad_scale is not None else dummy, hyper, loss, correct, count,
            model.p, model.C, steps, 0 if batches is None else batches.shape[-1],
            FAMILY=_FAMILY[model.family], INTERCEPT=int(model.fit_intercept), MODE=mode,
            HAS_BATCHES=batches is not None, ANCHOR=anchor_mode, HAS_SCALE=grad_scale is not None,
            BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_C=block_c,
        )


def local_steps(model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, *, blocks=None):
    """``theta [R, d]`` ← ``steps`` fused gradient steps per row, in place (see the module doc).
    ``batches`` int32 [R, steps, B] or None, ``anchor`` [R, d], [d] or None, ``grad_scale`` [R] or
    None. ``blocks`` (BLOCK_N, BLOCK_P, BLOCK_C) overrides the block sizes (tests force many tiles)."""
    if steps == 0:
        return
    scratch = torch.empty_like(theta)
    _launch(_LOCAL_STEPS, model, theta, scratch, data, rows, batches, anchor, grad_scale, steps, lr, prox,
            blocks=blocks)


def gradients(model, theta, data, rows, batches, out):
    """``out [R, d]`` ← ∇f_i(θ_r) (full batch, or the mean over ``batches [R, B]`` int32) + l2·θ_r."""
    _launch(_GRADIENTS, model, theta, out, data, rows, batches, None, None, 1, 0.0, 0.0)


def evaluate(model, theta, data, rows, loss, correct, count):
    """``loss [R]`` ← Σ loss over client rows[r]'s rows, ``correct``/``count`` int64 [R]."""
    _launch(_EVALUATE, model, theta, theta, data, rows, None, None, None, 1, 0.0, 0.0, (loss, correct, count))
