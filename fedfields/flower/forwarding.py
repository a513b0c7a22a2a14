"""A Grid that forwards every call to a wrapped Grid: the base of grids that change one call.

Flower 1.41's `Grid` is abstract in seven members; a wrapper that streams replies or shows
them to an observer overrides one or two and inherits the rest from here.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run


class ForwardingGrid(Grid):
    """`grid` itself, call for call; subclasses override what they change."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Run) -> None:
        """Set the run of the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message built by the wrapped grid."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's connected nodes."""
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        """The wrapped grid's connected nodes with their details."""
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the wrapped grid."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send and receive through the wrapped grid."""
        return self.grid.send_and_receive(messages, timeout=timeout)
