"""One message to this node, decoded once (`ClientCall`), and the client halves that answer it.

A client half (`ClientHalf`: scene, meta or split, registered in `clients.halves`) mirrors a
strategy's client side: it receives the decoded call and returns its reply's parts
(`fedfields.flower.protocol.ReplyParts`); `clients.client_app` sends the one reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Context, Message

from fedfields.config import FederatedConfig
from fedfields.flower.node import (
    NodeState,
    RunAttempt,
    client_index,
    node_device,
    pin_simulated_threads,
)
from fedfields.flower.protocol import CONFIG, SERVER_ROUND, ReplyParts
from strategies import parse_app_config


@dataclass(frozen=True)
class ClientCall:
    """A message to this node with what every half reads: the run-config parsed once, the
    node's private state (versioned by the message's round and the run's continuations) and
    device, and the server round (None in split mode's steps)."""

    msg: Message
    context: Context
    config: FederatedConfig
    state: NodeState
    device: torch.device
    server_round: int | None

    @classmethod
    def decode(cls, msg: Message, context: Context) -> ClientCall:
        """Decode `msg` for this node (a virtual node's torch threads pinned); a message without
        CONFIG is one ValueError."""
        if CONFIG not in msg.content:
            raise ValueError(f"node {context.node_id}: the message carries no {CONFIG!r} record")
        round_config = msg.content[CONFIG]
        pin_simulated_threads(context)
        server_round = int(round_config[SERVER_ROUND]) if SERVER_ROUND in round_config else None
        attempt = None if server_round is None else RunAttempt.of_config(server_round, round_config)
        return cls(
            msg=msg,
            context=context,
            config=parse_app_config(context.run_config),
            state=NodeState(context, attempt),
            device=node_device(context),
            server_round=server_round,
        )

    @property
    def round_config(self) -> ConfigRecord:
        """The message's CONFIG record (the server's settings for this call)."""
        return self.msg.content[CONFIG]

    def federated_round(self) -> int:
        """The server round of a federated round's message; one ValueError without it."""
        if self.server_round is None:
            raise ValueError(f"{self.node}: the message's {CONFIG!r} has no {SERVER_ROUND!r}")
        return self.server_round

    @property
    def client(self) -> int:
        """This node's client index (node-config `partition-id`)."""
        return client_index(self.context)

    @property
    def node(self) -> str:
        """How errors name this node: "node <id>"."""
        return f"node {self.context.node_id}"


@dataclass(frozen=True)
class ClientHalf:
    """One kind of client: the run-config mode and tasks it serves, its train handler, its
    gradient-query handler if it answers one, and whether its train reply closes a
    federated round (then the app adds the client's seconds and names the client)."""

    name: str
    mode: str
    tasks: tuple[str, ...]
    train: Callable[[ClientCall], ReplyParts]
    gradient: Callable[[ClientCall], ReplyParts] | None = None
    round_reply: bool = True
