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
server used. ``federation`` may be a zero-argument callable that builds it: the simulation
engine then builds it once in each worker process instead of shipping the data to them.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
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


def federation_client_app(federation: Union[Federation, Callable[[], Federation]], model, *, lr: float = 0.1,
                          local_steps: int = 1, batch_size: Optional[int] = None, seed: int = 0) -> ClientApp:
    """A ClientApp serving ``federation`` with ``model`` (a pflcore GLM or net); ``lr`` and
    ``local_steps`` are the defaults the ConfigRecord may override; ``batch_size`` None means
    full-batch steps, else minibatches drawn by ``ops.sample_batches`` (seeded by ``seed`` and
    the server round)."""
    if not (isinstance(federation, Federation) or callable(federation)):
        raise ValueError(f"federation: expected a pflcore Federation or a callable returning one, "
                         f"got {type(federation).__name__}")
    lr, local_steps = _positive(lr, "lr"), _positive(local_steps, "local_steps", integer=True)
    batch_size = None if batch_size is None else _positive(batch_size, "batch_size", integer=True)
    built = {}

    def fed() -> Federation:
        if "fed" not in built:
            f = federation if isinstance(federation, Federation) else federation()
            if not isinstance(f, Federation):
                raise ValueError(f"federation: the callable returned {type(f).__name__}, expected a Federation")
            built["fed"] = f
        return built["fed"]

    def client_of(context: Context, f: Federation) -> int:
        i = context.node_config.get("partition-id")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < f.num_clients:
            raise ValueError(f"node_config['partition-id']: expected a client index in [0, {f.num_clients}), got {i!r}")
        return int(i)

    def received(msg: Message, f: Federation):
        records = msg.content.array_records
        if len(records) != 1:
            raise ValueError(f"message: expected one ArrayRecord (the parameters), got {len(records)}")
        key, record = next(iter(records.items()))
        vec, layout = flatten(record, name=f"message[{key!r}]")
        if layout.size != model.d:
            raise ValueError(f"message[{key!r}]: expected {model.d} parameters for {model!r}, got {layout.size}")
        theta = torch.tensor(vec, dtype=f.train.dtype).reshape(1, -1)  # a writable copy: local_steps is in place
        return key, record, layout, theta

    def config(msg: Message):
        configs = msg.content.config_records
        return next(iter(configs.values())) if configs else {}

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        f = fed()
        i = client_of(context, f)
        key, record, layout, theta = received(msg, f)
        cfg = config(msg)
        steps = int(cfg.get("local-steps", local_steps))
        mu = float(cfg.get("proximal-mu", 0.0))
        rows = torch.tensor([i], dtype=torch.int64)
        batches = None
        if batch_size is not None:
            batches = ops.sample_batches(f.train, steps=steps, batch_size=batch_size, seed=seed,
                                         counter=int(cfg.get("server-round", 0)), clients=rows)
        anchor = theta[0].clone() if mu > 0 else None
        ops.local_steps(model, theta, f.train, steps=steps, lr=float(cfg.get("lr", lr)), prox=mu, anchor=anchor,
                        rows=rows, batches=batches,
                        grad_scale=torch.tensor([float(cfg.get("grad-scale", 1.0))], dtype=theta.dtype))
        loss, _, count = ops.evaluate(model, theta, f.train, rows=rows)
        metrics = MetricRecord({"num-examples": int(count[0]), "train-loss": float(loss[0] / count[0])})
        arrays = to_record(theta[0].numpy(), layout, like=record)
        return Message(RecordDict({key: arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        f = fed()
        i = client_of(context, f)
        _, _, _, theta = received(msg, f)
        loss, correct, count = ops.evaluate(model, theta, f.test, rows=torch.tensor([i], dtype=torch.int64))
        n = int(count[0])
        metrics = {"num-examples": n, "loss": float(loss[0]) / n}
        if getattr(model, "is_classifier", False):
            metrics["accuracy"] = float(correct[0]) / n
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.query("gradient")
    def gradient(msg: Message, context: Context) -> Message:
        f = fed()
        i = client_of(context, f)
        key, record, layout, theta = received(msg, f)
        rows = torch.tensor([i], dtype=torch.int64)
        g = ops.gradients(model, theta, f.train, rows=rows)
        n = int(f.train.sizes[i])
        arrays = to_record(g[0].numpy(), layout, like=record)
        return Message(RecordDict({key: arrays, "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)

    return app
