"""The fast ops (DESIGN.md §4). Each takes torch tensors (CPU or CUDA) or numpy arrays and
returns the kind it got; each has a pure-torch reference ``<op>_ref``; ``pflcore.backend``
chooses the implementation."""
from pflcore.ops.anderson import Anderson, anderson_weights, anderson_weights_ref
from pflcore.ops.average import average, average_ref
from pflcore.ops.evaluate import evaluate, evaluate_ref
from pflcore.ops.gradients import gradients, gradients_ref
from pflcore.ops.kmeans import KMeans, kmeans, kmeans_assign, kmeans_assign_ref, kmeans_ref
from pflcore.ops.local_steps import local_steps, local_steps_ref
from pflcore.ops.sample_batches import sample_batches, sample_batches_ref

__all__ = [
    "Anderson", "anderson_weights", "anderson_weights_ref", "average", "average_ref", "evaluate",
    "evaluate_ref", "gradients", "gradients_ref", "KMeans", "kmeans", "kmeans_ref", "kmeans_assign",
    "kmeans_assign_ref", "local_steps", "local_steps_ref", "sample_batches", "sample_batches_ref",
]
