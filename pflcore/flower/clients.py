"""A pflcore federation served as Flower clients: node ``partition-id`` i is client i.

``federation_client_app(federation, model, ...)`` returns a ``flwr.clientapp.ClientApp`` whose
nodes train with pflcore's ops on their client's rows of the federation. It is how the example
and the tests run Flower strategies on the papers' settings, and a template for a ClientApp
that honours the keys the strategies of ``pflcore.flower`` send:

- ``train``: ``steps`` gradient steps (``ops.local_steps``) from the received parameters; the
  ConfigRecord may set ``lr``, ``local-steps``, ``proximal-mu`` (Flower's FedProx: a prox term
  toward the received parameters) and ``grad-scale`` (PERM: the factor m·α_ij on the loss
  gradient). Reply: the trained parameters and ``num-examples``, ``train-loss``.
- ``evaluate``: the mean loss (and accuracy for classifiers) of the received parameters on the
  client's test rows. Reply metrics ``loss``, ``accuracy``, ``num-examples``.
- ``query.gradient``: the full-batch gradient of the client's training loss at the received
  parameters (``ops.gradients``), as an ArrayRecord of the received layout, and ``num-examples``.

The parameters travel as one array (a pflcore model is one vector ``[d]``) under the key the
server used. ``federation`` may be a zero-argument callable that builds it, e.g.
``functools.partial(pflcore.data.least_squares, 25, 5000, seed=0)``: the simulation engine then
builds it once in each worker process instead of shipping the data with every message.
"""
from __future__ import annotations

import pickle
from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflcore import ops
from pflcore.data.federation import Federation
from pflcore.flower.params import flatten, to_record

GRADIENT = "query.gradient"  # message type of PERM's gradient query


def _positive(value, name: str, integer: bool = False):
    ok = isinstance(value, (int, np.integer)) if integer else isinstance(value, (int, float, np.integer, np.floating))
    if isinstance(value, bool) or not ok or not value > 0:
        raise ValueError(f"{name}: expected a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


_BUILT: Dict[bytes, Federation] = {}  # federations built in this process, by their pickled recipe


def _build(recipe: Callable[[], Federation]) -> Federation:
    """``recipe()``, once per process for a recipe that pickles (a ``functools.partial`` of a
    module-level function): the simulation engine unpickles the ClientApp for every message, so
    the federation would otherwise be built again for each one."""
    try:
        key = pickle.dumps(recipe)
    except Exception:  # noqa: BLE001 - a lambda or a closure: built once per ClientApp object
        key = None
    if key is not None and key in _BUILT:
        return _BUILT[key]
    f = recipe()
    if not isinstance(f, Federation):
        raise ValueError(f"federation: the callable returned {type(f).__name__}, expected a Federation")
    if key is not None:
        _BUILT.clear()  # one federation per worker process: a new recipe replaces the old
        _BUILT[key] = f
    return f


class FederationClient:
    """The handlers of ``federation_client_app`` (a class, not closures: the simulation engine
    pickles the ClientApp into its workers, and the built federation stays out of the pickle)."""

    def __init__(self, federation: Union[Federation, Callable[[], Federation]], model, lr: float, local_steps: int,
                 batch_size: Optional[int], seed: int) -> None:
        if not (isinstance(federation, Federation) or callable(federation)):
            raise ValueError(f"federation: expected a pflcore Federation or a callable returning one, "
                             f"got {type(federation).__name__}")
        self.federation, self.model = federation, model
        self.lr, self.local_steps = _positive(lr, "lr"), _positive(local_steps, "local_steps", integer=True)
        self.batch_size = None if batch_size is None else _positive(batch_size, "batch_size", integer=True)
        self.seed = seed
        self._fed: Optional[Federation] = federation if isinstance(federation, Federation) else None

    def __getstate__(self):
        state = dict(self.__dict__)
        if not isinstance(self.federation, Federation):
            state["_fed"] = None  # built again in the worker, from the callable
        return state

    def fed(self) -> Federation:
        if self._fed is None:
            self._fed = _build(self.federation)
        return self._fed

    def client_of(self, context: Context) -> Tuple[Federation, torch.Tensor]:
        """(the federation, int64 [1] this node's client index)."""
        f = self.fed()
        i = context.node_config.get("partition-id")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < f.num_clients:
            raise ValueError(f"node_config['partition-id']: expected a client index in [0, {f.num_clients}), got {i!r}")
        return f, torch.tensor([int(i)], dtype=torch.int64)

    def received(self, msg: Message, f: Federation):
        """(key, record, layout, theta [1, d] a writable copy in the federation's dtype)."""
        records = msg.content.array_records
        if len(records) != 1:
            raise ValueError(f"message: expected one ArrayRecord (the parameters), got {len(records)}")
        key, record = next(iter(records.items()))
        vec, layout = flatten(record, name=f"message[{key!r}]")
        if layout.size != self.model.d:
            raise ValueError(f"message[{key!r}]: expected {self.model.d} parameters for {self.model!r}, "
                             f"got {layout.size}")
        return key, record, layout, torch.tensor(vec, dtype=f.train.dtype).reshape(1, -1)  # local_steps is in place

    @staticmethod
    def config(msg: Message):
        configs = msg.content.config_records
        return next(iter(configs.values())) if configs else {}

    def train(self, msg: Message, context: Context) -> Message:
        f, rows = self.client_of(context)
        key, record, layout, theta = self.received(msg, f)
        cfg = self.config(msg)
        steps = int(cfg.get("local-steps", self.local_steps))
        mu = float(cfg.get("proximal-mu", 0.0))
        batches = None
        if self.batch_size is not None:
            batches = ops.sample_batches(f.train, steps=steps, batch_size=self.batch_size, seed=self.seed,
                                             counter=int(cfg.get("server-round", 0)), clients=rows)
        anchor = theta[0].clone() if mu > 0 else None
        scale = torch.tensor([float(cfg.get("grad-scale", 1.0))], dtype=theta.dtype)
        ops.local_steps(self.model, theta, f.train, steps=steps, lr=float(cfg.get("lr", self.lr)), prox=mu,
                            anchor=anchor, rows=rows, batches=batches, grad_scale=scale)
        loss, _, count = ops.evaluate(self.model, theta, f.train, rows=rows)
        metrics = MetricRecord({"num-examples": int(count[0]), "train-loss": float(loss[0] / count[0])})
        arrays = to_record(theta[0].numpy(), layout, like=record)
        return Message(RecordDict({key: arrays, "metrics": metrics}), reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        f, rows = self.client_of(context)
        _, _, _, theta = self.received(msg, f)
        loss, correct, count = ops.evaluate(self.model, theta, f.test, rows=rows)
        n = int(count[0])
        metrics = {"num-examples": n, "loss": float(loss[0]) / n}
        if getattr(self.model, "is_classifier", False):
            metrics["accuracy"] = float(correct[0]) / n
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    def gradient(self, msg: Message, context: Context) -> Message:
        f, rows = self.client_of(context)
        key, record, layout, theta = self.received(msg, f)
        g = ops.gradients(self.model, theta, f.train, rows=rows)
        arrays = to_record(g[0].numpy(), layout, like=record)
        n = int(f.train.sizes[int(rows[0])])
        return Message(RecordDict({key: arrays, "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)


def federation_client_app(federation: Union[Federation, Callable[[], Federation]], model, *, lr: float = 0.1,
                          local_steps: int = 1, batch_size: Optional[int] = None, seed: int = 0) -> ClientApp:
    """A ClientApp serving ``federation`` with ``model`` (a pflcore GLM or net); ``lr`` and
    ``local_steps`` are the defaults the ConfigRecord may override; ``batch_size`` None means
    full-batch steps, else minibatches drawn by ``ops.sample_batches`` (seeded by ``seed`` and
    the server round)."""
    client = FederationClient(federation, model, lr, local_steps, batch_size, seed)
    app = ClientApp()
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    app.query("gradient")(client.gradient)
    return app
