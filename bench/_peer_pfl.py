"""The FedAvg workload of bench/peers.py in Apple's pfl-research (PyPI ``pfl``), written the way
its own benchmarks are (``benchmarks/image_classification/pytorch/train.py`` and
``benchmarks/dataset/cifar10/numpy.py``): a ``FederatedDataset`` of per-user ``Dataset`` s of
torch tensors with a random user sampler, a ``PyTorchModel`` whose module has ``loss`` and
``metrics``, local ``torch.optim.SGD``, a central ``torch.optim.SGD`` with learning rate 1 (the
plain FedAvg update), ``WeightByDatapoints`` (the average weighted by sample counts),
``FederatedAveraging`` with ``NNAlgorithmParams`` and ``NNTrainHyperParams`` on a
``SimulatedBackend``; evaluation by a ``CentralEvaluationCallback`` on all clients' test rows.

Where pfl's defaults differ from the workload, changed through its public API:
  - ``local_num_steps`` stops after one pass over a user's data (a user of 188 rows has 10
    minibatches of 20, not 20) and its stock ``Dataset.iter`` reads minibatches in order: the user
    datasets are a ``Dataset`` subclass whose ``iter(batch_size)`` draws each minibatch with
    replacement (``len`` stays the user's sample count, so ``WeightByDatapoints`` weighs by it);
  - the linear model starts at zero (``torch.nn.init.zeros_``), as pflcore's FedAvg does;
  - no evaluation: ``evaluation_frequency`` beyond the last round (pfl evaluates iteration 0
    always) and no central evaluation; evaluating every round: ``evaluation_frequency=1`` (pfl
    then also evaluates each trained user before and after training) plus the central callback.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data import FederatedDataset
from pfl.data.dataset import Dataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Weighted
from pfl.model.pytorch import PyTorchModel


class SoftmaxRegression(torch.nn.Linear):
    """A linear softmax classifier with the ``loss`` and ``metrics`` pfl's PyTorchModel calls."""

    def loss(self, x, y, eval=False):  # noqa: A002 - pfl's keyword
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):  # noqa: A002
        self.eval() if eval else self.train()
        logits = self(x)
        return {"loss": Weighted(F.cross_entropy(logits, y, reduction="sum").item(), len(y)),
                "accuracy": Weighted((logits.argmax(1) == y).sum().item(), len(y))}


class MinibatchesWithReplacement(Dataset):
    """A user's dataset whose training minibatches are drawn with replacement (the workload's
    sampling), without end: ``local_num_steps`` stops local training. Evaluation asks for one
    batch of all rows (``batch_size`` None or the dataset's length) and gets it, as from the
    stock Dataset."""

    def iter(self, batch_size):  # noqa: A003 - pfl's name
        x, y = self.raw_data
        if batch_size is None or batch_size >= len(y):
            yield self.raw_data
            return
        while True:
            idx = torch.from_numpy(np.random.randint(0, len(y), size=batch_size))
            yield x[idx], y[idx]


def users(data):
    """Per-user (x, y) tensors of a pflcore ClientData."""
    return [data.client(i) for i in range(data.num_clients)]


def run(fed, *, rounds, cohort, lr, local_steps, batch_size, evaluate, seed, cache={}):
    """Trains for ``rounds`` and returns the final (weight [C, p], bias [C])."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    key = id(fed)
    if key not in cache:  # the slices, made once per federation as pfl's benchmarks do at start-up
        cache.clear()
        test = fed.test
        cache[key] = (users(fed.train), Dataset(raw_data=[test.x, test.y]))
    train_users, central_test = cache[key]
    federated_train = FederatedDataset(lambda uid: MinibatchesWithReplacement(train_users[uid], user_id=uid),
                                       get_user_sampler("random", list(range(len(train_users)))))
    p, C = fed.train.x.shape[1], fed.num_classes
    module = SoftmaxRegression(p, C)
    torch.nn.init.zeros_(module.weight)
    torch.nn.init.zeros_(module.bias)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), 1.0))
    backend = SimulatedBackend(training_data=federated_train, val_data=None, postprocessors=[WeightByDatapoints()])
    eval_params = NNEvalHyperParams(local_batch_size=None)
    callbacks = [CentralEvaluationCallback(central_test, model_eval_params=eval_params, frequency=1)] if evaluate else []
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=1 if evaluate else rounds + 1,
                                           train_cohort_size=cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=lr, local_num_epochs=None,
                                              local_num_steps=local_steps, local_batch_size=batch_size),
        model_eval_params=eval_params, callbacks=callbacks)
    return module.weight.detach().clone(), module.bias.detach().clone()
