"""Triton kernel of the GLM ops: ``local_steps``, ``gradients`` and ``evaluate`` (DESIGN.md §3, §4).

A capped grid of programs takes the model rows grid-stride (program g: rows g, g + grid, ...),
each row's whole loop in one launch; for model row r, client i = rows[r]:

    local_steps (MODE 0), for s = 0..steps-1:
        G = Σ_{t ∈ B_{r,s}} x_tᵀ ⊗ dℓ/dz(z_t, y_t),   z_t = x_t W (+ b)
        W ← W − lr·( grad_scale[r]·G/|B_{r,s}| + l2·W + prox·(W − a_r) )
    gradients (MODE 1):  out_r = G/|B_r| + l2·W   (B_r = all rows of client i, or batches[r])
    evaluate (MODE 2):   loss_r = Σ_{t ∈ B_r} ℓ(z_t, y_t),  correct_r = Σ_{t ∈ B_r} [pred(z_t) = y_t],
                         count_r = |B_r|       (B_r = all n_i rows of client i, or batches[r])

with the per-row math of csrc/include/pflcore/glm.h:
    least squares  ℓ = ½(z − y)²,                      dℓ/dz = z − y
    logistic       ℓ = max(s, 0) + log(1 + e^{−|s|}),  dℓ/dz = σ(z) − y,   s = z (y = 0), −z (y = 1)
    softmax        ℓ = logsumexp(z) − z_y,             dℓ/dz = softmax(z) − e_y

W [P, C] (P = p + intercept). When the padded [P, C] fits registers (chosen by d in ``_blocks``),
``pflcore.triton.glm_rows`` runs it: blocks of model rows per program, W and G in registers.
Otherwise the kernel here: W stays in the row of ``theta`` (global memory) and G accumulates in
a scratch row per program ([grid, d]: bounded by the capped grid, not by R; gradients use
their output row), the features taken BLOCK_P at a time. Every product is a
broadcast-multiply-sum (no tl.dot: its float32 inputs would be rounded to TF32).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from pflcore.triton._util import BLOCK_BUDGET, launch_device, next_pow2

_FAMILY = {"least_squares": 0, "logistic": 1, "softmax": 2}
_LOCAL_STEPS, _GRADIENTS, _EVALUATE = 0, 1, 2

# Programs resident per SM that the grid is capped at (4 warps each; the kernels use up to
# ~128 registers a thread, so 4 programs of 128 threads fill an SM's 64K registers). More
# programs would only queue, and each one holds a scratch row.
RESIDENT_PER_SM = 4
# Under the interpreter programs run one after another: a small cap makes the tests walk
# the grid-stride loop whenever R > 64, at no cost.
INTERPRETER_GRID = 64
# Largest padded P·C kept in registers (W and G: 16 values each a thread at 128 threads in
# float32; float64 values take two registers each).
_REG_PARAMS = {4: 2048, 8: 1024}


def scalar_bits(v: float) -> int:
    """``-v`` as the int64 of its float64 bits, for the kernel's ``float_arg``. Triton types a
    Python float argument as float32, which would round float64 hyperparameters; an int64
    carries every bit. The sign flip makes every v >= 0 (+0.0 included) a negative int64 below
    −2**31, so Triton always types it i64 (one compiled variant), never i32."""
    return struct.unpack("<q", struct.pack("<d", -(float(v) + 0.0)))[0]


@triton.jit
def float_arg(bits, dt: tl.constexpr):
    """The hyperparameter encoded by ``scalar_bits``, in the kernel's dtype."""
    return (-(tl.cast(bits, tl.int64).to(tl.float64, bitcast=True))).to(dt)


# Flags and hyperparameters are runtime arguments, not constexprs, so that one compiled variant
# serves every algorithm (minibatch or not, any anchor, grad_scale or not): the variants are
# FAMILY x MODE x blocks x dtype (pflcore.triton.aot compiles them all). Triton would specialize
# an int argument equal to 1 as a constant (a variant per flag value): not for these.
@triton.jit(do_not_specialize=["icpt", "has_batches", "anchor_stride", "has_anchor", "has_scale", "lr_bits",
                               "prox_bits", "l2_bits"])
def _glm_kernel(
    theta_ptr,    # [R, d] parameters (row stride theta_stride: 0 = one model [d] for every row, MODE 1, 2)
    acc_ptr,      # MODE 0: [grid, d] scratch, a row per program; MODE 1: [R, d] the output; MODE 2: unused
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
    lr_bits, prox_bits, l2_bits,  # scalar_bits(lr), scalar_bits(prox), scalar_bits(l2)
    FAMILY: tl.constexpr, MODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """See the module doc: model rows r = program_id, program_id + grid, ... each run MODE's
    formula, G in ``acc`` (global), the parameters BLOCK_P x BLOCK_C at a time."""
    pid = tl.program_id(0)
    dt = theta_ptr.dtype.element_ty
    lr = float_arg(lr_bits, dt)  # once a program
    prox = float_arg(prox_bits, dt)
    l2 = float_arg(l2_bits, dt)
    P = p + icpt
    d = P * C
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    tn = tl.arange(0, BLOCK_N)
    kp = tl.arange(0, BLOCK_P)
    for r32 in range(pid, R, tl.num_programs(0)):
        r = tl.cast(r32, tl.int64)  # (the interpreter iterates Python ints)
        client = tl.load(rows_ptr + r)
        lo = tl.load(offsets_ptr + client)
        n = tl.load(offsets_ptr + client + 1) - lo
        nb = tl.where(has_batches != 0, n * 0 + B, n)  # int64 either way (B may arrive as a Python int)
        th = theta_ptr + r * theta_stride  # r is int64: no int32 overflow
        if MODE == 0:
            acc = acc_ptr + tl.cast(pid, tl.int64) * d
        else:
            acc = acc_ptr + r * d
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
                if has_batches != 0:
                    ridx = tl.load(batches_ptr + (r * steps + s) * B + t, mask=tmask, other=0).to(tl.int64)
                    ridx = tl.where(tmask, ridx, lo)
                else:
                    ridx = tl.where(tmask, lo + t, lo)
                # logits z [BLOCK_N, BLOCK_C] = x_t W (+ b); padded rows and classes give 0
                z = tl.zeros([BLOCK_N, BLOCK_C], dtype=dt)
                for k0 in range(0, P, BLOCK_P):
                    k = k0 + kp
                    xk = tl.load(x_ptr + ridx[:, None] * p + k[None, :],
                                 mask=tmask[:, None] & (k < p)[None, :], other=0.0)
                    xk = tl.where(tmask[:, None] & ((k >= p) & (k < P))[None, :], 1.0, xk)  # the intercept's 1
                    w = tl.load(th + k[:, None] * C + cc[None, :], mask=(k < P)[:, None] & cmask[None, :],
                                other=0.0)
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
                        xk = tl.load(x_ptr + ridx[:, None] * p + k[None, :],
                                     mask=tmask[:, None] & (k < p)[None, :], other=0.0)
                        xk = tl.where(tmask[:, None] & ((k >= p) & (k < P))[None, :], 1.0, xk)
                        g = tl.sum(xk[:, :, None] * dz[:, None, :], axis=0)
                        pm = (k < P)[:, None] & cmask[None, :]
                        offs = k[:, None] * C + cc[None, :]
                        tl.store(acc + offs, tl.load(acc + offs, mask=pm, other=0.0) + g, mask=pm)
                    tl.debug_barrier()
            if MODE == 0:
                scale = 1.0 / nb.to(dt)
                if has_scale != 0:
                    scale = tl.load(scale_ptr + r) * scale
                for k0 in range(0, P, BLOCK_P):
                    k = k0 + kp
                    pm = (k < P)[:, None] & cmask[None, :]
                    offs = k[:, None] * C + cc[None, :]
                    w = tl.load(th + offs, mask=pm, other=0.0)
                    g = tl.load(acc + offs, mask=pm, other=0.0)
                    # (the flag as a block: the interpreter cannot `&` a scalar)
                    a = tl.load(anchor_ptr + r * anchor_stride + offs, mask=pm & ((k * 0 + has_anchor) != 0)[:, None],
                                other=0.0)
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
            tl.store(count_ptr + r, nb)


def _blocks(P: int, C: int, itemsize: int = 4):
    """(BLOCK_N, BLOCK_P, BLOCK_C, BLOCK_R): the [BLOCK_R, BLOCK_N, BLOCK_P, BLOCK_C] products hold
    at most ``budget`` values (more only when C alone needs it: a row's logits are one block).
    BLOCK_R > 0: the padded [P, C] fits the register budget of its dtype, and the rows kernel
    (glm_rows) takes BLOCK_R model rows at a time; BLOCK_R = 0: the tiled kernel here."""
    scale = max(1, BLOCK_BUDGET // 4096)
    # Half the block budget in float32 and a quarter in float64 (two registers a value): with
    # the full budget, C = 1 took 168-255 registers and spilled (pflcore.triton.aot).
    budget = BLOCK_BUDGET * 2 // itemsize
    block_c = next_pow2(C)
    pc = next_pow2(P) * block_c
    regs = _REG_PARAMS[itemsize] * scale
    if pc <= regs:
        block_n = max(1, min(16, budget // pc))
        block_r = max(1, min(budget // (block_n * pc), regs // pc))
        return block_n, next_pow2(P), block_c, block_r
    block_p = max(1, min(next_pow2(P), (64 if block_c == 1 else 32) * scale, budget // block_c))
    block_n = max(1, min(64 * scale, budget // (block_p * block_c)))
    return block_n, block_p, block_c, 0


_SMS = {}


def grid_cap(t: torch.Tensor) -> int:
    """Programs resident at once on ``t``'s device (the interpreter: INTERPRETER_GRID)."""
    if t.device.type != "cuda":
        return INTERPRETER_GRID
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx] * RESIDENT_PER_SM


def plan(mode: int, model, dtype: torch.dtype, blocks=None):
    """(kernel, constexprs) of a launch: what ``_launch`` runs, and what pflcore.triton.aot
    compiles ahead of time (every flag of a call is a runtime argument). ``blocks``: (BLOCK_N,
    BLOCK_P, BLOCK_C) forces the tiled kernel, (..., BLOCK_R) the rows kernel."""
    from pflcore.triton.glm_rows import _glm_rows_kernel

    if blocks is not None and len(blocks) == 3:
        blocks = (*blocks, 0)
    block_n, block_p, block_c, block_r = blocks or _blocks(model.P, model.C,
                                                           torch.empty(0, dtype=dtype).element_size())
    const = dict(FAMILY=_FAMILY[model.family], MODE=mode, BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_C=block_c)
    if not block_r:
        return _glm_kernel, const
    if block_p < model.P or block_c < model.C:
        raise ValueError(f"blocks: the rows kernel needs BLOCK_P >= P = {model.P} and BLOCK_C >= C = {model.C}, "
                         f"got {block_p} and {block_c}")
    return _glm_rows_kernel, dict(const, BLOCK_R=block_r)


def _launch(mode, model, theta, acc, data, rows, batches, anchor, grad_scale, steps, lr, prox, outs=None,
            blocks=None, grid=None):
    R = rows.numel()
    if R == 0:
        return
    kernel, const = plan(mode, model, theta.dtype, blocks)
    per_program = const.get("BLOCK_R", 1)
    grid = min(triton.cdiv(R, per_program), grid or grid_cap(theta))
    if acc is None:  # MODE 0: a scratch row per program of the tiled kernel
        acc = theta if "BLOCK_R" in const else torch.empty(grid, model.d, dtype=theta.dtype, device=theta.device)
    # stand-ins for the pointers a call does not read, of the types the reads would have (a
    # pointer of another type would compile another variant)
    dummy = theta
    loss, correct, count = outs if outs is not None else (dummy, rows, rows)
    with launch_device(theta):
        kernel[(grid,)](
            theta, acc, data.x, data.y, data.offsets, rows,
            batches if batches is not None else data.offsets.view(torch.int32), anchor if anchor is not None else dummy,
            grad_scale if grad_scale is not None else dummy, loss, correct, count,
            R, 0 if theta.dim() == 1 else model.d, model.p, model.C, steps,
            0 if batches is None else batches.shape[-1],
            int(model.fit_intercept), int(batches is not None), 0 if anchor is None or anchor.dim() == 1 else model.d,
            int(anchor is not None), int(grad_scale is not None),
            scalar_bits(lr), scalar_bits(prox), scalar_bits(model.l2), **const,
        )


def local_steps(model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, *, blocks=None, grid=None):
    """``theta [R, d]`` ← ``steps`` fused gradient steps per row, in place (see the module doc).
    ``batches`` int32 [R, steps, B] or None, ``anchor`` [R, d], [d] or None, ``grad_scale`` [R] or
    None. ``blocks`` (see ``plan``) and ``grid`` override the block sizes and the grid cap (tests
    force many tiles, and programs that take several rows)."""
    if steps == 0:
        return
    _launch(_LOCAL_STEPS, model, theta, None, data, rows, batches, anchor, grad_scale, steps, lr, prox,
            blocks=blocks, grid=grid)


def gradients(model, theta, data, rows, batches, out, *, blocks=None, grid=None):
    """``out [R, d]`` ← ∇f_i(θ_r) (full batch, or the mean over ``batches [R, B]`` int32) + l2·θ_r;
    ``theta`` [R, d], or [d]: one model read by every row (row stride 0, no copy)."""
    _launch(_GRADIENTS, model, theta, out, data, rows, batches, None, None, 1, 0.0, 0.0, blocks=blocks, grid=grid)


def evaluate(model, theta, data, rows, batches, loss, correct, count, *, blocks=None, grid=None):
    """``loss [R]`` ← Σ loss over client rows[r]'s rows (or over ``batches [R, B]`` int32),
    ``correct``/``count`` int64 [R]; ``theta`` [R, d], or [d] read by every row."""
    _launch(_EVALUATE, model, theta, theta, data, rows, batches, None, None, 1, 0.0, 0.0, (loss, correct, count),
            blocks=blocks, grid=grid)
