"""Flower strategies built on pflcore's server ops (extra ``flower``: ``pip install "pflcore[flower]"``).

Which Flower API. Flower 1.2x–1.4x recommends the Message API: a ``ServerApp`` drives a
``flwr.serverapp.strategy.Strategy`` whose ``configure_train`` returns ``Message`` objects (one per
node, each with its own ``RecordDict``) and whose ``aggregate_train`` receives the reply Messages
and returns an ``ArrayRecord`` (the new parameters) and a ``MetricRecord``; ``ClientApp`` handlers
answer ``train``, ``evaluate`` and ``query.<action>`` messages. The older
``flwr.server.strategy.Strategy`` with ``Parameters``/``FitRes`` lives on under ``flwr.compat``
for old code. Everything here targets the Message API and works with its built-in strategies
(``FedAvg``, ``FedProx``, ``FedAdam``, ...); parameters are converted in one place,
``pflcore.flower.params`` (ArrayRecords or lists of numpy arrays to flat vectors and back, with
read-only views of the message bytes where the format allows).

- ``AndersonStrategy(strategy, memory, reg, safeguard)``: any strategy's aggregate T(u) of the
  clients' results from the parameters u it sent is the output of a fixed-point map; the server
  sends the Anderson mixture of the last pairs instead (``ops.Anderson``).
- ``ClusteredStrategy(num_contexts | "auto", ...)``: CGPFL's server (IFCA-style clustered
  federated learning): the uploaded models are clustered with ``ops.kmeans`` (k-means++ at the
  first round, then warm-started from the context models so context labels stay stable); each
  node is sent its context's model; K fixed or chosen at the first round by CGPFL-Heur's e(K).
- ``PERMStrategy(warmup_rounds, lam_alpha)``: PERM's mixing weights from client gradients, then
  its model shuffling.

PERM: decided to build it, because the Message API expresses it without bending Flower. PERM
needs (1) every client's gradient at the FedAvg model, (2) a different model for each client in
every round, with a per-client factor on its gradient, and (3) all the personalized models on the
server. (1) is a ``query.gradient`` message answered by a ``@app.query("gradient")`` handler (a
message type of its own, not a train round in disguise); (2) is what ``configure_train`` returns
anyway, one Message per node, the factor in that node's ConfigRecord (``grad-scale``, as
Flower's own FedProx sends ``proximal-mu``); (3) is server state. What it costs: clients must
implement the two keys (``pflcore.flower.clients.federation_client_app`` does; the contract is
in its docstring), every node takes part in every round of the shuffling phase (a node that
does not answer leaves its visiting model as it was for that round), and the server holds m
models. The older API could not send a query of another kind (only fit/evaluate instructions).

``LoopbackGrid`` runs a ClientApp in this process (tests, small runs without the simulation
engine); ``federation_client_app`` serves a pflcore federation as Flower clients.
"""
try:
    import flwr  # noqa: F401 - only to say what to install
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("pflcore.flower needs Flower: pip install 'pflcore[flower]' (flwr >= 1.41)") from exc

from pflcore.flower.anderson import AndersonStrategy
from pflcore.flower.clients import GRADIENT, federation_client_app
from pflcore.flower.clustered import ClusteredStrategy
from pflcore.flower.loopback import LoopbackGrid
from pflcore.flower.params import (Layout, array_view, flatten, flatten_as, layout_of, stack, to_array, to_ndarrays,
                                   to_record)
from pflcore.flower.perm import PERMStrategy

__all__ = ["AndersonStrategy", "ClusteredStrategy", "GRADIENT", "Layout", "LoopbackGrid", "PERMStrategy", "array_view",
           "federation_client_app", "flatten", "flatten_as", "layout_of", "stack", "to_array", "to_ndarrays",
           "to_record"]
