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

from flwr.app import Message
from flwr.serverapp import Grid

from fedfields.flower.forwarding import ForwardingGrid

DEFAULT_PULL_INTERVAL = 0.1
"""Seconds between pulls when the wrapped grid names none (Flower's in-memory grid: 0.1)."""


class StreamingGrid(ForwardingGrid):
    """`grid` with a lazy `send_and_receive`: messages are pushed at once, replies yielded
    as they are pulled until all arrived or `timeout` passed (Flower's semantics)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.pull_interval = float(getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL))

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
