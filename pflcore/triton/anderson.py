"""Triton kernels of Anderson mixing (DESIGN.md §4): the incremental Gram update as a batched
dot product fused with storing the new pair, and the mixing pass. The small regularized solve
for π runs on the host (pflcore.ops.anderson): it is a k × k system, k ≤ memory + 1.

push:  r = tu − u;  R_hist[slot] ← r;  TU_hist[slot] ← tu;
       dots[j] = Σ_e R_hist[slots[j], e]·r_e   (float64)
mix:   out_e = Σ_j π_j·TU_hist[slots[j], e]     (float64 accumulation, stored in the state's dtype)
gram:  G[a, b] = Σ_e V[a, e]·V[b, e]            (float64), for anderson_weights

Each program reduces one block of BLOCK_D entries to one partial sum per j; the partials are
then summed over blocks in block order, so the dots do not depend on scheduling (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pflcore.triton._util import launch_device, row_offset

BLOCK_D = 1024  # entries of a program (pflcore.triton.aot compiles it)


@triton.jit
def _dots_kernel(
    u_ptr,        # [D] STORE: the point u; else the vector r to take the dots with
    tu_ptr,       # [D] STORE: its image T(u); else unused
    R_ptr,        # [H, D] residual history (STORE: row `slot` is written)
    TU_ptr,       # [H, D] image history (STORE: row `slot` is written)
    slots_ptr,    # [k] int64 rows of R_ptr to take the dots with
    partial_ptr,  # [num_blocks, k] float64 per-block partial dots
    D, slot, k,
    STORE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0)
    e = blk.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    emask = e < D
    if STORE:
        u = tl.load(u_ptr + e, mask=emask, other=0.0)
        tu = tl.load(tu_ptr + e, mask=emask, other=0.0)
        r = tu - u
        tl.store(R_ptr + row_offset(slot, D) + e, r, mask=emask)
        tl.store(TU_ptr + row_offset(slot, D) + e, tu, mask=emask)
    else:
        r = tl.load(u_ptr + e, mask=emask, other=0.0)
    r64 = r.to(tl.float64)
    for j in range(k):
        sj = tl.load(slots_ptr + j)
        v = tl.load(R_ptr + row_offset(sj, D) + e, mask=emask, other=0.0)
        if STORE:
            v = tl.where(sj == slot, r, v)  # the row just written, from registers
        tl.store(partial_ptr + row_offset(blk, k) + j, tl.sum(v.to(tl.float64) * r64, axis=0))


@triton.jit
def _mix_kernel(
    TU_ptr,     # [H, D] image history
    slots_ptr,  # [k] int64 rows to mix
    pi_ptr,     # [k] float64 weights
    out_ptr,    # [D] the mixed point
    D, k,
    BLOCK_D: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    emask = e < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float64)
    for j in range(k):
        sj = tl.load(slots_ptr + j)
        w = tl.load(pi_ptr + j)
        acc += w * tl.load(TU_ptr + row_offset(sj, D) + e, mask=emask, other=0.0).to(tl.float64)
    tl.store(out_ptr + e, acc.to(out_ptr.dtype.element_ty), mask=emask)


def _dots(u, tu, R_hist, TU_hist, slot, slots, store):
    D, k = R_hist.shape[1], slots.numel()
    nblk = triton.cdiv(D, BLOCK_D)
    partial = torch.empty(nblk, k, dtype=torch.float64, device=R_hist.device)
    with launch_device(R_hist):
        _dots_kernel[(nblk,)](u, tu, R_hist, TU_hist, slots, partial, D, slot, k, STORE=store, BLOCK_D=BLOCK_D)
    return partial.sum(0)  # a fixed reduction of a fixed-shape tensor: deterministic


def anderson_push(u, tu, R_hist, TU_hist, slot, slots, dots):
    """Store the pair (r = tu − u, tu) in row ``slot`` and ``dots [k]`` float64 ← ⟨R_hist[slots[j]], r⟩.
    ``slots`` int64 [k] on the device of the history; ``dots`` may be on any device."""
    dots.copy_(_dots(u, tu, R_hist, TU_hist, slot, slots, True))


def anderson_mix(TU_hist, slots, pi, out):
    """``out [D]`` ← Σ_j pi[j]·TU_hist[slots[j]]; ``slots`` int64 and ``pi`` float64 [k] on the device."""
    D, k = TU_hist.shape[1], slots.numel()
    with launch_device(TU_hist):
        _mix_kernel[(triton.cdiv(D, BLOCK_D),)](TU_hist, slots, pi, out, D, k, BLOCK_D=BLOCK_D)


def gram(vecs, G):
    """``G [k, k]`` float64 (any device) ← the Gram matrix of ``vecs [k, D]``, one batched dot per row."""
    k = vecs.shape[0]
    slots = torch.arange(k, dtype=torch.int64, device=vecs.device)
    for a in range(k):
        G[a].copy_(_dots(vecs[a], vecs[a], vecs, vecs, 0, slots, False))
