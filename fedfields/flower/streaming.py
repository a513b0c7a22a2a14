"""A Grid whose replies arrive as a stream, so a strategy can aggregate them one at a time.

Flower 1.41's `send_and_receive` returns a list only once every reply is in, so the server
holds all sampled clients' models at once. `StreamingGrid` pushes the same messages and
yields each reply in the order its message was pushed, as soon as it and the replies before
it are in; a strategy that folds each reply into a running sum
(`fedfields.methods.RunningSum`) and drops it keeps O(model) memory while replies come in
order, and holds only those that overtake a slower one. Summing in push order (user-key
order, `fedfields.flower.user_keys`) makes a float sum independent of which client finished
first. Everything else is forwarded to the wrapped grid.
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
    in the order their messages were pushed, each as soon as it and those before it are in,
    until all arrived or `timeout` passed (Flower's semantics)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.pull_interval = float(getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterator[Message]:
        """Push `messages` now; the returned iterator yields each reply once pulled."""
        message_ids = list(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.time() + timeout
        return self._replies(message_ids, deadline)

    def _replies(self, message_ids: list[str], deadline: float | None) -> Iterator[Message]:
        """Pull until every message has its reply or the deadline passed, yielding replies in
        `message_ids`' order: a reply that comes early waits for those before it, so a sum
        folded over them never depends on arrival order (the strategies push in user-key
        order). At the deadline the replies still waiting are yielded in that order."""
        waiting = set(message_ids)
        early: dict[str, Message] = {}
        position = 0
        while waiting and (deadline is None or time.time() < deadline):
            pending = [message_id for message_id in message_ids if message_id in waiting]
            for reply in self.grid.pull_messages(pending):
                waiting.discard(reply.metadata.reply_to_message_id)
                early[reply.metadata.reply_to_message_id] = reply
            while position < len(message_ids) and message_ids[position] in early:
                yield early.pop(message_ids[position])  # keeps no reference once handed over
                position += 1
            if waiting:
                time.sleep(self.pull_interval)
        for message_id in message_ids[position:]:
            if message_id in early:
                yield early.pop(message_id)
