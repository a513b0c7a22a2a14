"""A node's half of any method: the client hooks its train message's method declares, and
where what they leave goes.

`received_hooks(msg, state)` looks the message's "strategy" up in
`fedfields.methods.base.Method.registered` and builds that method's `client_hooks` from the
message's records and the node's kept state; the ClientApp passes them to the one local loop
(`fedfields.train.federated.local_train`, `fedfields.train.meta.local_meta_update`).
`keep_results` then writes what they leave: each kept state into the node's private state,
each record into the reply. The node never asks which method sent the message.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message, RecordDict

from fedfields.flower.node import NodeState
from fedfields.flower.protocol import CONFIG, STRATEGY, arrays_to_state, state_to_arrays
from fedfields.methods.base import ClientHook, HookResult, Method


def received_hooks(msg: Message, state: NodeState) -> list[ClientHook]:
    """The client hooks of the method `msg` names (none for a strategy that is not a
    registered `Method`), built from its array records and this node's kept state."""
    config = msg.content[CONFIG]
    method = Method.registered.get(str(config.get(STRATEGY, "")))
    if method is None:
        return []
    received = {name: arrays_to_state(record) for name, record in msg.content.array_records.items()}
    return method.client_hooks(config, received, state.tensors)


def keep_results(results: Iterable[HookResult], records: RecordDict, state: NodeState) -> None:
    """Each hook's kept state into the node's private state, its records into the reply."""
    for result in results:
        for name, kept in result.kept.items():
            state.put_tensors(name, kept)
        for name, record in result.records.items():
            records[name] = state_to_arrays(record)
