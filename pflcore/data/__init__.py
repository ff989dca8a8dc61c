"""Client data (DESIGN.md §2) and, in the modules beside, generators, partitioners and readers of
real data sets (§6): MNIST's IDX files, scikit-learn's digits, LEAF's JSON, CIFAR-10's pickles."""
from pflcore.client_data import ClientData
from pflcore.data.federation import Federation
from pflcore.data.generators import contexts, least_squares, logistic_truth, synthetic, two_groups
from pflcore.data.partition import partition, partition_to_client_data
from pflcore.data.real import digits, mnist, read_idx, read_mnist
from pflcore.data.leaf_json import leaf, to_leaf
from pflcore.data.cifar import cifar10, read_cifar10, read_cifar10_batch

__all__ = [
    "ClientData", "Federation", "contexts", "least_squares", "logistic_truth", "partition", "partition_to_client_data",
    "synthetic", "two_groups", "digits", "mnist", "read_idx", "read_mnist", "leaf", "to_leaf", "cifar10",
    "read_cifar10", "read_cifar10_batch",
]
