"""Triton kernel of the GLM ops for models whose padded [P, C] fits registers: BLOCK_R model rows
at a time per program, W and G of every row in registers (DESIGN.md §3, §4).

The formulas are those of ``pflcore.triton.glm`` (its module doc); here a program takes the
model rows r0 .. r0 + BLOCK_R − 1 together (r0 = BLOCK_R·program_id, then grid-stride), so
the blocks gain a leading row axis: W, G [BLOCK_R, BLOCK_P, BLOCK_C], x [BLOCK_R, BLOCK_N,
BLOCK_P], logits [BLOCK_R, BLOCK_N, BLOCK_C]. Each row of x is loaded once per step, nothing
goes through global memory but x, y, the indices and the results, and a small model (d of a
few dozen) fills a program with many rows instead of one: 10^6 such clients are 10^6 / BLOCK_R
row blocks. Rows of a block with fewer data rows (or past R) are masked.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["icpt", "has_batches", "anchor_stride", "has_anchor", "has_scale", "lr_bits",
                               "prox_bits", "l2_bits"])
def _glm_rows_kernel(
    theta_ptr,    # [R, d] parameters (row stride theta_stride: 0 = one model [d] for every row, MODE 1, 2)
    out_ptr,      # MODE 1: [R, d] gradients; else unused
    x_ptr,        # [N, p] features
    y_ptr,        # [N] int64 labels, or targets in the dtype of x (least squares)
    offsets_ptr,  # [m + 1] int64 row offsets of the clients
    rows_ptr,     # [R] int64 client of each model row
    batches_ptr,  # [R, steps, B] int32 absolute row indices, read when has_batches; MODE 1, 2: [R, B]
    anchor_ptr,   # [R, d] (anchor_stride = d) or [d] (anchor_stride = 0); read when has_anchor
    scale_ptr,    # [R] grad_scale, read when has_scale
    loss_ptr,     # [R] MODE 2: loss sums
    correct_ptr,  # [R] int64, MODE 2: correctly classified rows
    count_ptr,    # [R] int64, MODE 2: rows
    R, theta_stride, p, C, steps, B,
    icpt, has_batches, anchor_stride, has_anchor, has_scale,  # 0/1 flags (icpt: P = p + 1), 0 or d
    lr_bits, prox_bits, l2_bits,  # glm.scalar_bits(lr), (prox), (l2)
    FAMILY: tl.constexpr, MODE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """pflcore.triton.glm's MODE formulas for rows r0 + [0, BLOCK_R), r0 = BLOCK_R·(program_id +
    k·grid): local steps W ← W − lr·(scale_r·G/|B| + l2·W + prox·(W − a_r)), gradients G/|B| + l2·W,
    evaluate Σ ℓ, Σ [pred = y], |B|; W, G [BLOCK_R, BLOCK_P >= P, BLOCK_C >= C] in registers."""
    pid = tl.program_id(0)
    dt = theta_ptr.dtype.element_ty
    # hyperparameters from their bits (glm.scalar_bits: −v as int64), inline: nested jit calls
    # are slow in the interpreter
    lr = (-(tl.cast(lr_bits, tl.int64).to(tl.float64, bitcast=True))).to(dt)
    prox = (-(tl.cast(prox_bits, tl.int64).to(tl.float64, bitcast=True))).to(dt)
    l2 = (-(tl.cast(l2_bits, tl.int64).to(tl.float64, bitcast=True))).to(dt)
    P = p + icpt
    d = P * C
    rr = tl.arange(0, BLOCK_R)
    tn = tl.arange(0, BLOCK_N)
    kp = tl.arange(0, BLOCK_P)
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    pc_mask = ((kp < P)[:, None] & cmask[None, :])[None, :, :]  # [1, P, C]
    pc_offs = (kp[:, None] * C + cc[None, :])[None, :, :]
    xcol = (kp < p)[None, None, :]
    icol = ((kp >= p) & (kp < P))[None, None, :]  # the intercept's column (none when icpt = 0)
    for r0 in range(pid * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        r = tl.cast(r0, tl.int64) + rr  # [BLOCK_R]
        rmask = r < R
        client = tl.load(rows_ptr + r, mask=rmask, other=0)
        lo = tl.load(offsets_ptr + client, mask=rmask, other=0)
        n = tl.load(offsets_ptr + client + 1, mask=rmask, other=0) - lo
        nb = tl.where(rmask, tl.where((rr * 0 + has_batches) != 0, n * 0 + B, n), 0)
        wmask = rmask[:, None, None] & pc_mask
        W = tl.load(theta_ptr + r[:, None, None] * theta_stride + pc_offs, mask=wmask, other=0.0)
        G = tl.zeros([BLOCK_R, BLOCK_P, BLOCK_C], dtype=dt)
        if MODE == 0:
            A = tl.load(anchor_ptr + r[:, None, None] * anchor_stride + pc_offs,
                        mask=wmask & ((rr * 0 + has_anchor) != 0)[:, None, None], other=0.0)
        loss_sum = tl.zeros([BLOCK_R, BLOCK_N], dtype=dt)
        hits = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.int64)
        nmax = tl.max(nb, axis=0)
        for s in range(steps):
            G = tl.zeros([BLOCK_R, BLOCK_P, BLOCK_C], dtype=dt)
            for t0 in range(0, nmax, BLOCK_N):
                t = t0 + tn
                tmask = t[None, :] < nb[:, None]  # [BLOCK_R, BLOCK_N]
                if has_batches != 0:
                    ridx = tl.load(batches_ptr + (r[:, None] * steps + s) * B + t[None, :], mask=tmask,
                                   other=0).to(tl.int64)
                    ridx = tl.where(tmask, ridx, lo[:, None])
                else:
                    ridx = tl.where(tmask, lo[:, None] + t[None, :], lo[:, None])
                x = tl.load(x_ptr + ridx[:, :, None] * p + kp[None, None, :], mask=tmask[:, :, None] & xcol,
                            other=0.0)
                x = tl.where(tmask[:, :, None] & icol, 1.0, x)
                # logits z [BLOCK_R, BLOCK_N, BLOCK_C] = x W (+ b); padded rows and classes give 0
                z = tl.sum(x[:, :, :, None] * W[:, None, :, :], axis=2)
                if FAMILY == 0:
                    yv = tl.load(y_ptr + ridx, mask=tmask, other=0.0)
                    res = tl.sum(z, axis=2) - yv  # C = 1: the single logit
                    row_loss = 0.5 * res * res
                    dz = res[:, :, None] + tl.zeros([BLOCK_R, BLOCK_N, BLOCK_C], dtype=dt)
                    row_hit = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.int64)
                elif FAMILY == 1:
                    yv = tl.load(y_ptr + ridx, mask=tmask, other=0)
                    z1 = tl.sum(z, axis=2)
                    e = tl.exp(-tl.abs(z1))
                    sig = tl.where(z1 >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
                    sgn = tl.where(yv == 1, -z1, z1)
                    u = 1.0 + e  # log(1 + e) accurate where 1 + e rounds to 1 (see glm.py)
                    row_loss = tl.maximum(sgn, 0.0) + tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
                    dz = (sig - yv.to(dt))[:, :, None] + tl.zeros([BLOCK_R, BLOCK_N, BLOCK_C], dtype=dt)
                    row_hit = ((z1 > 0).to(tl.int64) == yv).to(tl.int64)
                else:
                    yv = tl.load(y_ptr + ridx, mask=tmask, other=0)
                    zm = tl.where(cmask[None, None, :], z, float("-inf"))
                    zmax = tl.max(zm, axis=2)
                    ez = tl.where(cmask[None, None, :], tl.exp(zm - zmax[:, :, None]), 0.0)
                    total = tl.sum(ez, axis=2)
                    onehot = cc[None, None, :] == yv[:, :, None]
                    zy = tl.sum(tl.where(onehot, z, 0.0), axis=2)
                    row_loss = tl.log(total) + zmax - zy
                    dz = ez / total[:, :, None] - onehot.to(dt)
                    row_hit = (tl.argmax(zm, axis=2, tie_break_left=True).to(tl.int64) == yv).to(tl.int64)
                if MODE == 2:
                    loss_sum += tl.where(tmask, row_loss, 0.0)
                    hits += tl.where(tmask, row_hit, 0)
                else:
                    dz = tl.where(tmask[:, :, None] & cmask[None, None, :], dz, 0.0)
                    G += tl.sum(x[:, :, :, None] * dz[:, :, None, :], axis=1)  # G[r, k, c] += Σ_t x[r,t,k]·dz[r,t,c]
            if MODE == 0:
                scale = 1.0 / tl.where(rmask, nb, 1).to(dt)
                if has_scale != 0:
                    scale = tl.load(scale_ptr + r, mask=rmask, other=1.0) * scale
                W = W - lr * (scale[:, None, None] * G + l2 * W + prox * (W - A))
        if MODE == 0:
            tl.store(theta_ptr + r[:, None, None] * theta_stride + pc_offs, W, mask=wmask)
        if MODE == 1:
            nbf = tl.where(rmask, nb, 1).to(dt)
            tl.store(out_ptr + r[:, None, None] * d + pc_offs, G / nbf[:, None, None] + l2 * W, mask=wmask)
        if MODE == 2:
            tl.store(loss_ptr + r, tl.sum(loss_sum, axis=1), mask=rmask)
            tl.store(correct_ptr + r, tl.sum(hits, axis=1), mask=rmask)
            tl.store(count_ptr + r, nb, mask=rmask)
