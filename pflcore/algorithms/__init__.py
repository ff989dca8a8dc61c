"""The algorithms of the papers and their baselines (DESIGN.md §5)."""
from pflcore.algorithms.accelerated import Accelerated
from pflcore.algorithms.apfl import APFL
from pflcore.algorithms.base import Algorithm, Context
from pflcore.algorithms.cgpfl import CGPFL, CGPFLHeur
from pflcore.algorithms.ditto import Ditto
from pflcore.algorithms.fedavg import FedAvg, LocalizedFedAvg, LocalTrain
from pflcore.algorithms.fedprox import FedProx
from pflcore.algorithms.fedrep import FedPer, FedRep
from pflcore.algorithms.ifca import IFCA
from pflcore.algorithms.l2sgd import L2SGD
from pflcore.algorithms.perfedavg import PerFedAvg
from pflcore.algorithms.perm import PERM
from pflcore.algorithms.pfedme import PFedMe
from pflcore.algorithms.splitting import FedPi, FedProxClassic, FedRP, FedSplit, GrandScheme

GlobalTrain = FedAvg

REGISTRY = {"localtrain": LocalTrain, "fedavg": FedAvg, "globaltrain": FedAvg, "localizedfedavg": LocalizedFedAvg,
            "fedprox": FedProx, "pfedme": PFedMe, "perfedavg": PerFedAvg, "grandscheme": GrandScheme,
            "fedproxclassic": FedProxClassic, "fedsplit": FedSplit, "fedpi": FedPi, "fedrp": FedRP, "cgpfl": CGPFL,
            "cgpflheur": CGPFLHeur, "perm": PERM, "ditto": Ditto, "apfl": APFL, "ifca": IFCA, "l2sgd": L2SGD,
            "fedrep": FedRep, "fedper": FedPer}

__all__ = ["APFL", "Accelerated", "Algorithm", "CGPFL", "CGPFLHeur", "Context", "Ditto", "FedAvg", "FedPer", "FedPi", "FedProx",
           "FedProxClassic", "FedRP", "FedRep", "FedSplit", "GlobalTrain", "GrandScheme", "IFCA", "L2SGD", "LocalTrain",
           "LocalizedFedAvg", "PERM", "PFedMe", "PerFedAvg", "REGISTRY"]
