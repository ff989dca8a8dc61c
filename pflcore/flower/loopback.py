"""A Flower ``Grid`` that runs a ``ClientApp`` in this process, one message after another.

For tests and small experiments: ``strategy.start(grid=LoopbackGrid(client_app, 10), ...)``
runs a whole federation with Flower's own strategy loop, messages and records, without the
simulation engine (Ray) or a SuperLink. Each node has a ``Context`` that persists across rounds
(``context.state``) and the simulation engine's ``node_config`` keys ``partition-id`` and
``num-partitions``. Messages are delivered as objects (not serialized): a ClientApp must not
modify the content it receives (Flower's own ClientApps build new records for their replies).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid

_SUPERLINK_NODE_ID = 1  # the node id Flower gives the server side (flwr.common.constant.SUPERLINK_NODE_ID)
_ERROR_CLIENT_APP = 2  # Error.code of a ClientApp exception (Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION)


def ensure_task_identity(run_id: int = 1) -> None:
    """Flower >= 1.41 stamps every new instruction ``Message`` with the identity of the task that
    runs (``flwr.supercore.task_identity``), which a SuperLink or the simulation engine sets. Outside
    them (this grid, a test that builds Messages) nobody does: set a server identity when unset, as
    Flower's own legacy simulation API does. Older Flower versions have no such identity."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # pragma: no cover - Flower < 1.41
        return
    try:
        TaskIdentity.run_id
    except RuntimeError:
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = _SUPERLINK_NODE_ID


class LoopbackGrid(Grid):
    """``num_nodes`` nodes running ``client_app`` (a ``flwr.clientapp.ClientApp`` or any callable
    ``(message, context) -> message``). Node ids are random 63-bit integers drawn from ``seed``
    (as a SuperLink's are: strategies must not assume 0..n-1) unless ``node_ids`` gives them;
    ``node_ids[i]`` has partition i.

    ``raise_errors``: a ClientApp exception propagates (default) or, as on a real deployment,
    becomes an error reply for the strategy to handle."""

    def __init__(self, client_app: Callable[[Message, Context], Message], num_nodes: int, *, seed: int = 0,
                 node_ids: Optional[Sequence[int]] = None, run_config: Optional[dict] = None,
                 raise_errors: bool = True) -> None:
        if not callable(client_app):
            raise ValueError(f"client_app: expected a ClientApp or a callable (message, context) -> message, "
                             f"got {type(client_app).__name__}")
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
            raise ValueError(f"num_nodes: expected an integer >= 1, got {num_nodes!r}")
        self.client_app = client_app
        ensure_task_identity()
        if node_ids is None:
            node_ids = np.random.default_rng(seed).choice(2**62, size=int(num_nodes), replace=False) + 2
        elif (len(node_ids) != num_nodes or len(set(node_ids)) != num_nodes
              or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i > 1 for i in node_ids)):
            raise ValueError(f"node_ids: expected {num_nodes} distinct integers > 1 (1 is the server's), "
                             f"got {node_ids!r}")
        self.node_ids: List[int] = [int(i) for i in node_ids]
        self.contexts: Dict[int, Context] = {
            nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i, "num-partitions": int(num_nodes)},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(self.node_ids)}
        self.raise_errors = bool(raise_errors)
        self.delivered = 0  # messages delivered so far
        self._run = None
        self._replies: Dict[str, Message] = {}

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id,
                       ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def _deliver(self, message: Message) -> Message:
        node = message.metadata.dst_node_id
        if node not in self.contexts:
            raise ValueError(f"message: dst_node_id {node} is not a node of this grid")
        self.delivered += 1
        try:
            return self.client_app(message, self.contexts[node])
        except Exception as exc:  # noqa: BLE001 - becomes the error reply a deployment would send
            if self.raise_errors:
                raise
            return Message(Error(code=_ERROR_CLIENT_APP, reason=f"{type(exc).__name__}: {exc}"), reply_to=message)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            key = str(len(self._replies) + self.delivered)
            self._replies[key] = self._deliver(message)
            ids.append(key)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        return [self._deliver(m) for m in messages]
