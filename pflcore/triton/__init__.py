"""Triton kernels of the ops (DESIGN.md §1, §4): the GLM local steps, gradients and
evaluation (``glm``), the k-means assignment and Lloyd update (``kmeans``), and Anderson
mixing's Gram column and mixing pass (``anderson``).

The functions here take validated torch tensors (``pflcore.ops`` checks the metadata, and the
adapter ``pflcore.backends.triton`` the values, before it calls them); they launch on the
tensors' device. On a machine
without a GPU, setting ``TRITON_INTERPRET=1`` before this package is first imported makes
every kernel run under Triton's CPU interpreter on CPU tensors (``INTERPRETED`` records
which mode the kernels were built in: Triton fixes it when a kernel is decorated).
"""
from __future__ import annotations

from pflcore.triton.anderson import anderson_mix, anderson_push, gram
from pflcore.triton.glm import evaluate, gradients, local_steps
from pflcore.triton.kmeans import kmeans_assign, kmeans_update
from pflcore.triton._util import interpreting

INTERPRETED: bool = interpreting()


__all__ = ["INTERPRETED", "local_steps", "gradients", "evaluate", "kmeans_assign",
           "kmeans_update", "anderson_push", "anderson_mix", "gram"]
