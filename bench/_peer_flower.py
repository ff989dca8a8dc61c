"""The FedAvg workload of bench/peers.py as a Flower app, written the way Flower's PyTorch
quickstart is (``examples/quickstart-pytorch``: ``task.py`` + ``client_app.py`` +
``server_app.py`` in one module here): a ``ClientApp`` whose ``@app.train()`` loads the received
``ArrayRecord`` into a fresh ``nn.Module``, trains on its partition from a ``DataLoader`` with
``torch.optim.SGD`` and replies with its arrays and a ``MetricRecord`` holding ``num-examples``;
a ``ServerApp`` whose ``@app.main()`` runs ``FedAvg.start`` (the average weighted by
``num-examples``) with ``train_config`` carrying the learning rate and, when evaluating, an
``evaluate_fn`` on all clients' test rows (the quickstart's ``global_evaluate``). It runs on
Flower's simulation engine (``flwr.simulation.run_simulation``, ray), one virtual SuperNode
per client.

Where the quickstart differs from the workload, changed through the public API:
  - minibatches: ``DataLoader(..., sampler=RandomSampler(replacement=True,
    num_samples=steps·B))`` (20 minibatches of 20 drawn with replacement) instead of shuffled
    epochs; plain SGD (no momentum) at the workload's learning rate;
  - the model is the linear softmax classifier, initialised at zero;
  - 10 of the 100 nodes a round: ``fraction_train = cohort / clients``; no federated evaluation
    (``fraction_evaluate=0``: the evaluation is the centralized one, or none).
The clients read the federation from a file the driver wrote (the quickstart's clients load
their partition themselves, cached per process).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

_DATA = {}  # per process: the federation file's tensors (the quickstart caches its FederatedDataset)


def load(path: str):
    if path not in _DATA:
        _DATA.clear()
        _DATA[path] = torch.load(path)
    return _DATA[path]


def partition(path: str, i: int):
    d = load(path)
    lo, hi = int(d["offsets"][i]), int(d["offsets"][i + 1])
    return d["x"][lo:hi], d["y"][lo:hi]


def net(p: int, C: int) -> torch.nn.Module:
    model = torch.nn.Linear(p, C)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return model


def train_fn(model, loader, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
    return total / max(1, len(loader))


@torch.no_grad()
def test_fn(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).double().mean().item()


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context):
    cfg = msg.content["config"]
    x, y = partition(cfg["data"], context.node_config["partition-id"])
    model = net(x.shape[1], int(cfg["classes"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    steps, batch = int(cfg["local-steps"]), int(cfg["batch-size"])
    sampler = RandomSampler(range(len(y)), replacement=True, num_samples=steps * batch)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, sampler=sampler)
    train_loss = train_fn(model, loader, float(cfg["lr"]))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": train_loss, "num-examples": len(y)})})
    return Message(content=content, reply_to=msg)


def train_metrics(records, weighting_key: str) -> MetricRecord:
    """The train-loss average weighted by ``num-examples`` (a ``train_metrics_aggr_fn``, called
    once a round after the replies arrive: its clock readings give the time between rounds)."""
    _ROUND_CLOCK.append(time.perf_counter())
    total = weighted = 0.0
    for record in records:
        m = next(iter(record.metric_records.values()))
        total += float(m[weighting_key])
        weighted += float(m[weighting_key]) * float(m["train_loss"])
    return MetricRecord({"train_loss": weighted / max(total, 1e-30)})


_ROUND_CLOCK: list = []


def server_app(*, data: str, clients: int, cohort: int, rounds: int, lr: float, local_steps: int, batch_size: int,
               evaluate: bool, out: dict) -> ServerApp:
    """The ServerApp of one run; the final model goes to ``out["state_dict"]``, the centralized
    evaluations to ``out["evaluations"]``, the clock at the end of every round's training to
    ``out["round_clock"]``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        d = load(data)
        p, C = d["x"].shape[1], int(d["classes"])
        strategy = FedAvg(fraction_train=cohort / clients, fraction_evaluate=0.0, min_train_nodes=cohort,
                          min_available_nodes=clients, train_metrics_aggr_fn=train_metrics)
        _ROUND_CLOCK.clear()

        def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = net(p, C)
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = test_fn(model, d["x_test"], d["y_test"])
            out.setdefault("evaluations", []).append((server_round, acc))
            return MetricRecord({"accuracy": acc, "loss": loss})

        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(net(p, C).state_dict()), num_rounds=rounds,
            train_config=ConfigRecord({"lr": lr, "local-steps": local_steps, "batch-size": batch_size,
                                       "data": data, "classes": C}),
            evaluate_fn=global_evaluate if evaluate else None)
        out["state_dict"] = result.arrays.to_torch_state_dict()
        out["round_clock"] = list(_ROUND_CLOCK)

    return app


def save_federation(fed, path: str) -> None:
    torch.save({"x": fed.train.x, "y": fed.train.y, "offsets": fed.train.offsets, "x_test": fed.test.x,
                "y_test": fed.test.y, "classes": fed.num_classes}, path)


def run(data_path, *, clients, rounds, cohort, lr, local_steps, batch_size, evaluate):
    """One simulation; returns the final (weight [C, p], bias [C])."""
    from flwr.simulation import run_simulation

    out: dict = {}
    app = server_app(data=data_path, clients=clients, cohort=cohort, rounds=rounds, lr=lr, local_steps=local_steps,
                     batch_size=batch_size, evaluate=evaluate, out=out)
    run_simulation(server_app=app, client_app=client_app, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    if "state_dict" not in out:
        raise RuntimeError("the Flower simulation ended without a final model (see its log above)")
    LAST_RUN.clear()
    LAST_RUN.update(out)
    return out["state_dict"]["weight"], out["state_dict"]["bias"]


LAST_RUN: dict = {}  # the last run's ``out`` (round clock, evaluations)
