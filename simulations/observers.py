"""Simulation-only observers: the experimenter's audits that read ground truth.

A deployed ServerApp holds no user data; everything that needs it (clean views, personal masks,
a client's images, the split client's field) is an `Observer` that the simulation attaches:
the simulation launchers set run-config `simulation-audit`, and the observers read the
experimenter's data from run-config `data-dir` (the root the virtual nodes map their
partitions to). A deployment leaves both unset, so its server runs without observers and
opens no user's file.

An observer may wrap the job's Grid (`ReplyTap`) to see replies as they pass, is called after
every round with the new global arrays (`observe_round`) and once at the end (`finish`); what
it returns is merged into that round's line of metrics.jsonl and into summary.json.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, Protocol

from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedfields.flower.compressed_downloads import followed
from fedfields.flower.protocol import ARRAYS, CLIENT, CLIENT_INDEX, state_to_arrays
from fedfields.flower.strategy import ForwardingGrid
from fedfields.flower.upload_compression import uploaded_arrays


class Observer(Protocol):
    """A simulation-only audit of a run (see the module docstring)."""

    def wrap_grid(self, grid: Grid) -> Grid:
        """The grid the job should use (`grid` itself, or a `ReplyTap` around it)."""
        ...

    def observe_round(
        self, server_round: int, arrays: ArrayRecord, accepted: Collection[int] = ()
    ) -> dict[str, Any]:
        """Metrics of round `server_round`'s global `arrays` (merged into metrics.jsonl);
        `accepted` are the nodes whose replies the strategy's gate let into the round: only
        their replies may reach the audit."""
        ...

    def finish(self, arrays: ArrayRecord, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Final audit, files in the run directory; returns entries for summary.json."""
        ...


def train_replies(replies: Iterable[Message]) -> list[Message]:
    """The successful train replies, kept as they came until the gate has judged them."""
    return [
        r for r in replies if r.metadata.message_type == MessageType.TRAIN and not r.has_error()
    ]


def plaintext_uploads(
    replies: Iterable[Message], accepted: Collection[int], num_clients: int
) -> Iterator[tuple[int, ArrayRecord]]:
    """(client index, arrays) of each reply from an `accepted` node (the strategy's gate let it
    into the round) whose upload the server can read: one naming its client, an index in
    [0, `num_clients`), in the CLIENT record (under secure aggregation none does)."""
    accepted = set(accepted)
    for reply in replies:
        if reply.metadata.src_node_id not in accepted:
            continue
        if CLIENT not in reply.content or ARRAYS not in reply.content:
            continue
        index = reply.content[CLIENT].get(CLIENT_INDEX)
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < num_clients:
            yield index, reply.content[ARRAYS]


class ReplyTap(ForwardingGrid):
    """A Grid that forwards everything to `grid` and shows every reply to `on_replies`.

    The strategy gets the replies unchanged; the observer sees what the server received, a
    compressed upload as the state it stands for (the arrays sent plus the decompressed
    update; under compressed downloads the global the nodes rebuilt, which the tap follows
    from the messages it forwards, plus the update).
    """

    def __init__(self, grid: Grid, on_replies: Callable[[list[Message]], None]) -> None:
        super().__init__(grid)
        self.on_replies = on_replies
        self.sent: dict[str, Message] = {}
        """Train messages by id until their reply passes: uploads are read against them."""
        self.download: tuple[int, dict] | None = None
        """(version, reference) of the compressed downloads followed so far."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid, keeping the train messages for their replies."""
        messages = list(messages)
        message_ids = list(self.grid.push_messages(messages))
        self.remember(messages, message_ids)
        return message_ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the wrapped grid, showing the replies to the observer."""
        replies = list(self.grid.pull_messages(message_ids))
        self.on_replies([self.readable(reply) for reply in replies])
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send and receive through the wrapped grid, showing the replies to the observer."""
        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.remember(messages, [message.metadata.message_id for message in messages])
        self.on_replies([self.readable(reply) for reply in replies])
        return replies

    def remember(self, messages: list[Message], message_ids: list[str]) -> None:
        """Keep the train messages among `messages` (their ids set by the grid) in place of
        the last round's: a reply to an older round never enters this one."""
        train = {
            message_id: message
            for message, message_id in zip(messages, message_ids, strict=True)
            if message.metadata.message_type == MessageType.TRAIN
        }
        if train:
            self.sent = train
            self.download = followed(self.download, train.values())

    def readable(self, reply: Message) -> Message:
        """`reply`, its ARRAYS as the state the server reads (`uploaded_arrays`); a reply
        without arrays, an error or a malformed record (the gate drops it) as it came."""
        sent = self.sent.pop(reply.metadata.reply_to_message_id, None)
        if sent is None or reply.has_error() or ARRAYS not in reply.content:
            return reply
        received = None if self.download is None else state_to_arrays(self.download[1])
        try:
            arrays = uploaded_arrays(reply.content[ARRAYS], sent, received)
        except (TypeError, ValueError):
            return reply
        if arrays is reply.content[ARRAYS]:
            return reply
        return Message(RecordDict({**reply.content, ARRAYS: arrays}), reply_to=sent)
