"""A Grid whose replies arrive as a stream, so a strategy can aggregate them one at a time.

Flower 1.41's `send_and_receive` returns a list only once every reply is in, so the server
holds all sampled clients' models at once. `StreamingGrid` pushes the same messages and
yields each reply as soon as it is pulled; a strategy that folds each reply into a running
sum (`fedfields.aggregate.RunningSum`) and drops it keeps O(model) memory, not
O(sampled x model). Everything else is forwarded to the wrapped grid.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

DEFAULT_PULL_INTERVAL = 0.1
"""Seconds between pulls when the wrapped grid names none (Flower's in-memory grid: 0.1)."""


class StreamingGrid(Grid):
    """`grid` with a lazy `send_and_receive`: messages are pushed at once, replies yielded
    as they are pulled until all arrived or `timeout` passed (Flower's semantics)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.pull_interval = float(getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL))

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
    ) -> Iterator[Message]:
        """Push `messages` now; the returned iterator yields each reply once pulled."""
        message_ids = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.time() + timeout
        return self._replies(message_ids, deadline)

    def _replies(self, message_ids: set[str], deadline: float | None) -> Iterator[Message]:
        """Pull until every message has its reply or the deadline passed."""
        while message_ids and (deadline is None or time.time() < deadline):
            pulled = list(self.grid.pull_messages(message_ids))
            message_ids.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            pulled.reverse()
            while pulled:  # hand over one at a time, keeping no reference to the rest handed
                yield pulled.pop()
            if message_ids:
                time.sleep(self.pull_interval)
