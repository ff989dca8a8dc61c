"""The algorithms of the papers and their baselines (DESIGN.md §5)."""
from pflcore.algorithms.accelerated import Accelerated
from pflcore.algorithms.base import Algorithm, Context
from pflcore.algorithms.fedavg import FedAvg, LocalTrain
from pflcore.algorithms.fedprox import FedProx
from pflcore.algorithms.perfedavg import PerFedAvg
from pflcore.algorithms.pfedme import PFedMe
from pflcore.algorithms.splitting import FedPi, FedProxClassic, FedRP, FedSplit, GrandScheme

GlobalTrain = FedAvg

REGISTRY = {"localtrain": LocalTrain, "fedavg": FedAvg, "globaltrain": FedAvg, "fedprox": FedProx,
            "pfedme": PFedMe, "perfedavg": PerFedAvg, "grandscheme": GrandScheme, "fedproxclassic": FedProxClassic,
            "fedsplit": FedSplit, "fedpi": FedPi, "fedrp": FedRP}

__all__ = ["Accelerated", "Algorithm", "Context", "FedAvg", "FedPi", "FedProx", "FedProxClassic", "FedRP", "FedSplit",
           "GlobalTrain", "GrandScheme", "LocalTrain", "PFedMe", "PerFedAvg", "REGISTRY"]
