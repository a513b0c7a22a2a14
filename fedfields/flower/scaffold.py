"""Scaffold's client half on the fedfields protocol: the node's control variate c_i
(`ScaffoldClient`); the server half is `fedfields.methods.scaffold`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from flwr.app import Message, RecordDict
from torch import Tensor

from fedfields.flower.node import NodeState
from fedfields.flower.protocol import CONFIG, STRATEGY, arrays_to_state, state_to_arrays
from fedfields.methods.scaffold import CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL, Scaffold


@dataclass
class ScaffoldClient:
    """The client half of Scaffold: c from the train message, c_i from the node's private
    state (zeros at first); `correction` is c - c_i, `reply` keeps c_i+ and uploads delta c_i.
    """

    server_control: dict[str, Tensor]
    client_control: dict[str, Tensor]
    state: NodeState

    @classmethod
    def sent_by_scaffold(cls, msg: Message) -> bool:
        """Whether `msg` comes from a Scaffold server (its CONFIG names the strategy)."""
        return msg.content[CONFIG].get(STRATEGY) == Scaffold.name

    @classmethod
    def receive(cls, msg: Message, state: NodeState) -> ScaffoldClient:
        """c from `msg`'s SERVER_CONTROL record and this node's c_i."""
        if SERVER_CONTROL not in msg.content:
            raise ValueError(f"a Scaffold train message carries {SERVER_CONTROL!r}; this one not")
        server_control = arrays_to_state(msg.content[SERVER_CONTROL])
        client_control = state.tensors(CLIENT_CONTROL) or {
            key: torch.zeros_like(value) for key, value in server_control.items()
        }
        if client_control.keys() != server_control.keys():
            raise ValueError(
                "the node's Scaffold control c_i has other keys than the server's c: "
                "was its state directory used by another model?"
            )
        return cls(server_control, client_control, state)

    def correction(self) -> dict[str, Tensor]:
        """c - c_i, added to every local gradient (Algorithm 1, line 10)."""
        return {key: c - self.client_control[key] for key, c in self.server_control.items()}

    def reply(self, content: RecordDict, new_client_control: Mapping[str, Tensor]) -> None:
        """Keep c_i+ on the node and put delta c_i = c_i+ - c_i into the reply `content`."""
        delta = {key: value - self.client_control[key] for key, value in new_client_control.items()}
        self.state.put_tensors(CLIENT_CONTROL, new_client_control)
        content[CONTROL_DELTA] = state_to_arrays(delta)
