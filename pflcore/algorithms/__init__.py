"""The algorithms of the papers and their baselines (DESIGN.md §5)."""
from pflcore.algorithms.base import Algorithm, Context
from pflcore.algorithms.fedavg import FedAvg, LocalTrain
from pflcore.algorithms.fedprox import FedProx
from pflcore.algorithms.perfedavg import PerFedAvg
from pflcore.algorithms.pfedme import PFedMe

GlobalTrain = FedAvg

REGISTRY = {"localtrain": LocalTrain, "fedavg": FedAvg, "globaltrain": FedAvg, "fedprox": FedProx,
            "pfedme": PFedMe, "perfedavg": PerFedAvg}

__all__ = ["Algorithm", "Context", "FedAvg", "FedProx", "GlobalTrain", "LocalTrain", "PFedMe", "PerFedAvg",
           "REGISTRY"]
