"""The fast ops (DESIGN.md §4, §8). Each is one public function: validate the metadata,
select the backend's adapter (``pflcore.backend.select``), call it. Each takes torch tensors
(CPU or CUDA), numpy arrays or DLPack arrays (JAX, CuPy) and returns the kind it got; each has
a pure-torch reference ``<op>_ref`` (the op run on the reference adapter)."""
from pflcore.ops.anderson import Anderson, anderson_weights, anderson_weights_ref
from pflcore.ops.average import average, average_ref
from pflcore.ops.dp import ClippedSum, clip_and_sum, clip_and_sum_ref
from pflcore.ops.evaluate import evaluate, evaluate_ref
from pflcore.ops.gradients import gradients, gradients_ref
from pflcore.ops.hvp import hvp, hvp_ref
from pflcore.ops.kmeans import KMeans, cluster_means, kmeans, kmeans_assign, kmeans_assign_ref, kmeans_ref
from pflcore.ops.local_steps import local_steps, local_steps_ref
from pflcore.ops.sample_batches import sample_batches, sample_batches_ref

__all__ = [
    "Anderson", "anderson_weights", "anderson_weights_ref", "average", "average_ref", "ClippedSum", "clip_and_sum", "clip_and_sum_ref", "cluster_means", "evaluate",
    "evaluate_ref", "gradients", "gradients_ref", "hvp", "hvp_ref", "KMeans", "kmeans", "kmeans_ref",
    "kmeans_assign", "kmeans_assign_ref", "local_steps", "local_steps_ref", "sample_batches", "sample_batches_ref",
]
